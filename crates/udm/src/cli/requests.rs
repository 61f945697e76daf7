//! The verbs that are one control request: which request each sends, and how its answer is
//! printed. The verbs that run in the client (the daemon, send and receive, loop devices,
//! progress bars…) are answered in main.rs.

use anyhow::bail;
use udm::control::Request;

use super::{ColumnsArgs, Command, Control, ThinCommand};

/// How a verb's answer is printed.
pub enum Print {
    /// The daemon's text.
    Text,
    /// The daemon's data as JSON.
    Json,
    /// `info -c`: columns drawn from the data.
    Columns(ColumnsArgs),
    /// Nothing: only whether the request succeeded (`mknodes`).
    Nothing,
}

impl Print {
    fn json_or_text(json: bool) -> Print {
        if json {
            Print::Json
        } else {
            Print::Text
        }
    }

    fn info(json: bool, columns: ColumnsArgs) -> Print {
        match (json, columns.wanted()) {
            (true, _) => Print::Json,
            (false, true) => Print::Columns(columns),
            (false, false) => Print::Text,
        }
    }
}

/// The one device named, or none for every device (per_device took lists of several).
fn only(names: Vec<String>) -> Option<String> {
    names.into_iter().next()
}

/// A verb read from the command line.
pub enum Verb {
    /// Control requests to the daemon at `control`, sent in turn: one, or one per device named
    /// (`remove a b c`).
    Requests(Control, Vec<Request>, Print),
    /// A listing of several devices named (`status a b`): one request per device, the answers
    /// printed as one listing, each text line marked with its device's name.
    Listing(Control, Vec<(String, Request)>, Print),
    /// A verb that runs in the client.
    Local(Command),
}

/// What `command` asks of the daemon. One arm per verb, each only the verb's arguments moved
/// into its request: a flat table, long because there are many verbs (reason for its length).
pub fn verb(command: Command) -> anyhow::Result<Verb> {
    let command = match per_device(command) {
        Verb::Local(command) => command,
        verb => return Ok(verb),
    };
    let (control, request, print) = match command {
        Command::Thin {
            command:
                ThinCommand::Delta {
                    pool,
                    from,
                    to,
                    json,
                    control,
                },
        } => (
            control,
            Request::ThinDelta {
                pool,
                from: Some(from),
                to,
            },
            Print::json_or_text(json),
        ),
        Command::Create { notable: true, .. } => bail!(
            "create --notable: a udm device is made with its table (give it with --table, a \
             file or standard input)"
        ),
        Command::Create {
            name,
            table,
            readonly,
            uuid,
            notable: false,
            control,
        } => (
            control,
            Request::Create {
                name,
                table: table.text()?,
                read_only: readonly,
                uuid,
            },
            Print::Text,
        ),
        Command::Load {
            name,
            table,
            readonly,
            force,
            control,
        } => (
            control,
            Request::Load {
                name,
                table: table.text()?,
                force,
                read_only: readonly,
            },
            Print::Text,
        ),
        Command::Clear { name, control } => (control, Request::Clear { name }, Print::Text),
        Command::Message {
            name,
            sector,
            words,
            control,
        } => (
            control,
            Request::Message {
                name,
                sector,
                words,
            },
            Print::Text,
        ),
        Command::Ls {
            tree,
            target,
            json,
            control,
        } => (
            control,
            Request::Ls { tree, target },
            Print::json_or_text(json),
        ),
        Command::Wait {
            name,
            event_nr,
            progress: false,
            noflush: _,
            control,
        } => (control, Request::Wait { name, event_nr }, Print::Text),
        Command::Rename {
            name,
            new,
            setuuid,
            control,
        } => {
            let (new_name, uuid) = match setuuid {
                true => (None, Some(new)),
                false => (Some(new), None),
            };
            (
                control,
                Request::Rename {
                    name,
                    new_name,
                    uuid,
                },
                Print::Text,
            )
        }
        Command::RemoveAll { force, control } => {
            (control, Request::RemoveAll { force }, Print::Text)
        }
        Command::Finalize { name, control } => (control, Request::Finalize { name }, Print::Text),
        Command::Targets { control } => (control, Request::Targets, Print::Text),
        // Without names: only whether the daemon answers (per_device took those with names).
        Command::Mknodes { names: _, control } => {
            (control, Request::Info { name: None }, Print::Nothing)
        }
        local => return Ok(Verb::Local(local)),
    };
    Ok(Verb::Requests(control, vec![request], print))
}

/// The verbs dmsetup takes a list of devices for (`dmsetup remove a b c`): one request per
/// device, or the command back as `Local` if it is none of them.
fn per_device(command: Command) -> Verb {
    let command = match listing(command) {
        Verb::Local(command) => command,
        verb => return verb,
    };
    type Each = Box<dyn Fn(String) -> Request>;
    let (control, names, each, print): (_, _, Each, _) = match command {
        Command::Suspend {
            names,
            noflush,
            nolockfs: _,
            control,
        } => (
            control,
            names,
            Box::new(move |name| Request::Suspend { name, noflush }),
            Print::Text,
        ),
        Command::Resume {
            names,
            noflush,
            control,
        } => (
            control,
            names,
            Box::new(move |name| Request::Resume { name, noflush }),
            Print::Text,
        ),
        Command::Remove {
            names,
            force,
            retry,
            deferred,
            control,
        } => (
            control,
            names,
            Box::new(move |name| Request::Remove {
                name,
                force,
                retry,
                deferred,
            }),
            Print::Text,
        ),
        // Only whether each device exists: there are no nodes to make.
        Command::Mknodes { names, control } if !names.is_empty() => (
            control,
            names,
            Box::new(|name| Request::Info { name: Some(name) }),
            Print::Nothing,
        ),
        other => return Verb::Local(other),
    };
    let requests = names.into_iter().map(each).collect();
    Verb::Requests(control, requests, print)
}

/// `info`, `status`, `table` and `deps`: one request for one device or none (every device),
/// a listing of several; or the command back as `Local`.
fn listing(command: Command) -> Verb {
    type Each = Box<dyn Fn(Option<String>) -> Request>;
    let (control, names, each, print): (_, _, Each, _) = match command {
        Command::Status {
            names,
            target,
            noflush: _,
            json,
            control,
        } => (
            control,
            names,
            Box::new(move |name| Request::Status {
                name,
                target: target.clone(),
            }),
            Print::json_or_text(json),
        ),
        Command::Table {
            names,
            target,
            inactive,
            showkeys: _,
            control,
        } => (
            control,
            names,
            Box::new(move |name| Request::Table {
                name,
                target: target.clone(),
                inactive,
            }),
            Print::Text,
        ),
        Command::Info {
            names,
            columns,
            json,
            control,
        } => (
            control,
            names,
            Box::new(|name| Request::Info { name }),
            Print::info(json, columns),
        ),
        Command::Deps {
            names,
            options: _,
            json,
            control,
        } => (
            control,
            names,
            Box::new(|name| Request::Deps { name }),
            Print::json_or_text(json),
        ),
        other => return Verb::Local(other),
    };
    if names.len() <= 1 {
        return Verb::Requests(control, vec![each(only(names))], print);
    }
    let requests = names
        .into_iter()
        .map(|name| (name.clone(), each(Some(name))))
        .collect();
    Verb::Listing(control, requests, print)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::Cli;

    fn verb_of(line: &str) -> Verb {
        let cli = Cli::try_parse_from(line.split_whitespace()).unwrap();
        verb(cli.command).unwrap()
    }

    #[test]
    fn verbs_that_are_more_than_one_request_run_here() {
        for line in [
            "udm wait vol --progress",
            "udm thin ls pool",
            "udm version",
            "udm stop",
            "udm receive pool 3",
        ] {
            assert!(matches!(verb_of(line), Verb::Local(_)), "{line}");
        }
    }

    #[test]
    fn the_others_are_one_request_each() {
        for (line, expected) in [
            ("udm wait vol 3", "Wait"),
            ("udm thin delta pool 2 3", "ThinDelta"),
            ("udm info vol -c", "Info"),
            ("udm rename vol --setuuid u-1", "Rename"),
        ] {
            let Verb::Requests(_, requests, _) = verb_of(line) else {
                panic!("{line} ran here");
            };
            let sent = format!("{requests:?}");
            assert!(sent.contains(expected), "{line}: {sent}");
        }
    }
}
