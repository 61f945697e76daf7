//! The daemon side of the control socket: decode a request, run the verb, answer.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::debug;
use serde_json::json;
use udm_metadata::thin::Side;
use udm_targets::TARGET_TYPES;

use super::acceptor;
use super::registry::Registry;
use super::removal::{CLOSING_GRACE, RETRY_WAIT};
use super::report::{self, Exports};
use super::transfer;
use crate::control::{Envelope, Request, Response, PROTOCOL_VERSION};

/// dmsetup's message that takes back a deferred removal.
const CANCEL_DEFERRED_REMOVE: &str = "@cancel_deferred_remove";

/// Longest request line accepted; a table of thousands of lines still fits.
const MAX_REQUEST: u64 = 4 << 20;
/// Control connections served at once (a `udm wait` holds one for as long as it waits).
const MAX_CONNECTIONS: usize = 256;
/// How long a connection has to send a complete request, from its start or from its last
/// answer. Without a bound, `MAX_CONNECTIONS` clients that connect and say nothing held every
/// slot for ever and locked the operator out. A request is one write of a local client, so
/// this is generous; a request that is being answered (a long `wait`) is not bound by it.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a `wait` looks whether its client is still there.
const WAIT_SLICE: Duration = Duration::from_millis(200);

pub fn listen(path: &Path, registry: Arc<Registry>, exports: Exports) -> std::io::Result<()> {
    udm_nbd::remove_stale_socket(path)?;
    let listener = UnixListener::bind(path)?;
    acceptor::spawn(
        "control",
        MAX_CONNECTIONS,
        move || listener.accept().map(|(s, _)| s),
        move |s| serve(s, &registry, &exports),
        |mut s| {
            let why = format!(
                "the daemon is busy: {MAX_CONNECTIONS} control connections are open (each \
                 `udm wait` holds one); try again when some have closed"
            );
            let _ = reply(&mut s, &Response::error(why));
        },
    )
}

fn serve(stream: UnixStream, registry: &Arc<Registry>, exports: &Exports) {
    let Ok(writer) = stream.try_clone() else {
        return;
    };
    let mut writer = writer;
    let stream = Deadline {
        stream,
        until: None,
    };
    let mut reader = BufReader::new(stream.take(MAX_REQUEST));
    // Bytes, not a String: a line of invalid UTF-8 is a malformed request to answer, not a
    // read error that would end the connection.
    let mut line = Vec::new();
    loop {
        line.clear();
        reader.get_mut().get_mut().until = Some(Instant::now() + REQUEST_TIMEOUT);
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => return,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                let why = format!(
                    "no complete request within {} s: closing the connection",
                    REQUEST_TIMEOUT.as_secs()
                );
                return drop(reply(&mut writer, &Response::error(why)));
            }
            Ok(_) if !line.ends_with(b"\n") => {
                let _ = reply(
                    &mut writer,
                    &Response::error(format!(
                        "request too long (over {} MiB) or not terminated",
                        MAX_REQUEST >> 20
                    )),
                );
                return;
            }
            Ok(_) => {}
            Err(e) => return debug!("control: read failed: {e}"),
        }
        let response = match serde_json::from_slice::<Envelope>(&line) {
            Ok(envelope) if envelope.version != PROTOCOL_VERSION => Response::error(format!(
                "control protocol version {} not supported (this daemon speaks {PROTOCOL_VERSION})",
                envelope.version
            )),
            Ok(envelope) if matches!(envelope.request, Request::Send { .. }) => {
                return transfer::send(registry, envelope.request, &mut writer);
            }
            Ok(envelope) if matches!(envelope.request, Request::Receive { .. }) => {
                // The stream's own pace is the sender's (a pipe, ssh): no deadline for it.
                reader.get_mut().get_mut().until = None;
                let _ = reader.get_ref().get_ref().stream.set_read_timeout(None);
                reader.get_mut().set_limit(u64::MAX);
                let closer = writer.try_clone();
                let shutdown = move || {
                    if let Ok(s) = &closer {
                        let _ = s.shutdown(std::net::Shutdown::Write);
                    }
                };
                return transfer::receive(
                    registry,
                    envelope.request,
                    &mut reader,
                    &mut writer,
                    &shutdown,
                );
            }
            Ok(envelope) => {
                let stop = matches!(envelope.request, Request::Stop);
                let response = execute(registry, envelope.request, exports, &writer);
                if stop {
                    let _ = reply(&mut writer, &response);
                    // The main thread collects it and stops in order, as for `kill`.
                    // SAFETY: sends a signal to this process.
                    unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
                    return;
                }
                response
            }
            Err(e) => Response::error(format!("malformed request: {e}")),
        };
        if reply(&mut writer, &response).is_err() {
            return;
        }
        reader.get_mut().set_limit(MAX_REQUEST);
    }
}

/// The connection's reading side, which fails with `TimedOut` once `until` has passed: the
/// bound is on a whole request, however its bytes are spread over writes.
struct Deadline {
    stream: UnixStream,
    until: Option<Instant>,
}

impl Read for Deadline {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(until) = self.until {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            self.stream.set_read_timeout(Some(left))?;
        }
        match self.stream.read(buf) {
            // What a socket's read timeout looks like.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                Err(std::io::ErrorKind::TimedOut.into())
            }
            other => other,
        }
    }
}

fn reply(writer: &mut UnixStream, response: &Response) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(response).expect("serialisable");
    bytes.push(b'\n');
    writer.write_all(&bytes)
}

/// Whether the client has closed its end of the connection (a `udm wait` that was killed or
/// interrupted). Only a hang-up counts: a client may well send its next request early.
fn hung_up(client: &UnixStream) -> bool {
    let mut fd = libc::pollfd {
        fd: client.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one pollfd that we own, and a zero timeout: this never blocks.
    let ready = unsafe { libc::poll(&mut fd, 1, 0) };
    ready > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// One arm per verb, each one call (a dispatch table: long only because the verbs are many).
/// `client` is the requester's connection, watched by requests that block. Devices are named
/// by name or UUID; the registry is asked under the device's name.
fn execute(
    registry: &Arc<Registry>,
    request: Request,
    exports: &Exports,
    client: &UnixStream,
) -> Response {
    let named = |name: &str| registry.resolve(name).map(|d| d.name());
    let result: Answer = (|| {
        Ok(match request {
            Request::Create {
                name,
                table,
                read_only,
                uuid,
            } => registry
                .create(&name, &table, read_only, uuid.as_deref())
                .map(done)?,
            Request::Load {
                name,
                table,
                force,
                read_only,
            } => registry
                .load(&named(&name)?, &table, force, read_only)
                .map(done)?,
            Request::Clear { name } => registry.clear(&named(&name)?).map(done)?,
            Request::Suspend { name, noflush } => {
                registry.suspend(&named(&name)?, noflush).map(done)?
            }
            Request::Resume { name, noflush } => {
                registry.resume(&named(&name)?, noflush).map(done)?
            }
            Request::Message {
                name,
                sector,
                words,
            } => {
                // dmsetup joins its arguments with spaces and the kernel splits the message at
                // whitespace, so `message pool 0 "create_thin 0"` (as the kernel's
                // documentation writes it) is two words, as `message pool 0 create_thin 0` is.
                let line = words.join(" ");
                let words: Vec<&str> = line.split_whitespace().collect();
                if words == [CANCEL_DEFERRED_REMOVE] {
                    registry.cancel_deferred_remove(&named(&name)?).map(done)?
                } else {
                    Response::text(registry.message(&named(&name)?, sector, &words)?)
                }
            }
            Request::Status { name, target } => {
                report::status(registry, name.as_deref(), target.as_deref())?
            }
            Request::Table {
                name,
                target,
                inactive,
            } => report::table(registry, name.as_deref(), target.as_deref(), inactive)?,
            Request::Info { name } => report::info(registry, name.as_deref(), exports)?,
            Request::Deps { name } => report::deps(registry, name.as_deref())?,
            Request::Ls { tree, target } => report::ls(registry, tree, target.as_deref()),
            Request::Wait { name, event_nr } => wait(registry, &name, event_nr, client)?,
            Request::Rename {
                name,
                new_name,
                uuid,
            } => rename(registry, &named(&name)?, new_name, uuid)?,
            Request::Remove {
                name,
                force,
                retry,
                deferred,
            } => remove(registry, &named(&name)?, force, retry, deferred)?,
            Request::RemoveAll { force } => registry.remove_all(force).map(done)?,
            Request::Finalize { name } => finalize(registry, &named(&name)?)?,
            Request::Targets => targets(),
            Request::ThinDelta { pool, from, to } => thin_delta(&named(&pool)?, from, to)?,
            Request::Send { .. } | Request::Receive { .. } => {
                unreachable!("streams are served by transfer.rs")
            }
            Request::Stop => stopping(registry),
            Request::Version => version(),
        })
    })();
    result.unwrap_or_else(Response::error)
}

type Answer = Result<Response, Box<dyn std::error::Error>>;

/// The answer of a verb that only changes something.
fn done<T>(_: T) -> Response {
    Response::text("")
}

/// `wait`: until the device's event counter passes `event_nr` (default: its value now).
/// In slices, so that the wait ends (and its thread with it) when the device goes away or
/// nobody waits for the answer any more.
fn wait(registry: &Registry, name: &str, event_nr: Option<u64>, client: &UnixStream) -> Answer {
    let device = registry.resolve(name)?;
    let after = event_nr.unwrap_or_else(|| device.events().current());
    loop {
        let now = device.events().wait(after, WAIT_SLICE);
        if now > after {
            return Ok(Response::text(now.to_string()));
        }
        registry.get(&device.name())?;
        if hung_up(client) {
            return Err("the client went away".into());
        }
    }
}

/// `rename`: a new name, or with `--setuuid` a new UUID.
fn rename(
    registry: &Registry,
    name: &str,
    new_name: Option<String>,
    uuid: Option<String>,
) -> Answer {
    match (new_name, uuid) {
        (Some(new_name), None) => registry.rename(name, &new_name)?,
        (None, Some(uuid)) => registry.set_uuid(name, &uuid)?,
        _ => return Err("rename takes either a new name or a UUID".into()),
    }
    Ok(Response::text(""))
}

/// `remove`: now (waiting for closing clients, longer with `--retry`), or once unused.
fn remove(
    registry: &Arc<Registry>,
    name: &str,
    force: bool,
    retry: bool,
    deferred: bool,
) -> Answer {
    if deferred {
        return Ok(match registry.remove_deferred(name)? {
            true => Response::text(""),
            false => Response::text(format!(
                "device '{name}' is in use: it will be removed once unused"
            )),
        });
    }
    let wait = if retry { RETRY_WAIT } else { CLOSING_GRACE };
    registry.remove(name, force, wait)?;
    Ok(Response::text(""))
}

/// `finalize`: a finished clone's device gets its end-state table.
fn finalize(registry: &Registry, name: &str) -> Answer {
    Ok(match registry.finalize(name)? {
        Some(table) => Response::text(table),
        None => Response::text(format!(
            "device '{name}' has no target with an end state (a clone): nothing to finalize"
        )),
    })
}

/// `targets`: every target type, as dmsetup lists them.
fn targets() -> Response {
    Response::text(
        TARGET_TYPES
            .iter()
            .map(|(name, _)| format!("{name:<16}v1.0.0"))
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

/// `stop`'s answer: who is stopping (the caller then signals this process).
fn stopping(registry: &Registry) -> Response {
    log::info!("stop requested over the control socket");
    Response {
        data: Some(json!({
            "pid": std::process::id(), "state_dir": registry.state_dir,
        })),
        ..Response::text("")
    }
}

fn version() -> Response {
    Response {
        data: Some(json!({
            "version": env!("CARGO_PKG_VERSION"), "protocol": PROTOCOL_VERSION,
        })),
        ..Response::text(format!(
            "udm daemon {} (control protocol {PROTOCOL_VERSION})",
            env!("CARGO_PKG_VERSION")
        ))
    }
}

/// `thin delta`: runs of blocks that differ, named as thin_delta names them.
fn thin_delta(pool: &str, from: Option<u32>, to: u32) -> Result<Response, String> {
    let handle = udm_targets::replica::pool(pool).map_err(|e| e.to_string())?;
    let runs = handle.delta(from, to).map_err(|e| e.to_string())?;
    let kind = |side: Side| match side {
        Side::LeftOnly => "left_only",
        Side::RightOnly => "right_only",
        Side::Different => "different",
    };
    let text: Vec<String> = runs
        .iter()
        .map(|r| format!("{} {} {}", r.begin, r.len, kind(r.side)))
        .collect();
    let data: Vec<serde_json::Value> = runs
        .iter()
        .map(|r| json!({"begin": r.begin, "length": r.len, "kind": kind(r.side)}))
        .collect();
    Ok(Response {
        data: Some(json!({ "block_bytes": handle.block_bytes(), "runs": data })),
        ..Response::text(text.join("\n"))
    })
}
