//! The client side of the control socket, used by every verb but `daemon`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use anyhow::{bail, Context};

use udm::control::{Envelope, Request, Response, PROTOCOL_VERSION};
use udm_targets::Reference;

pub fn call(socket: &Path, request: Request) -> anyhow::Result<Response> {
    let reached = udm_nbd::socket_path_fits(socket).and_then(|()| UnixStream::connect(socket));
    let mut stream = reached.with_context(|| {
        format!(
            "cannot reach the udm daemon at {} (is `udm daemon` running?)",
            socket.display()
        )
    })?;
    let mut line = serde_json::to_vec(&Envelope {
        version: PROTOCOL_VERSION,
        request,
    })?;
    line.push(b'\n');
    // A daemon that refuses a request part-way (one too long) answers and closes: the write
    // then fails with EPIPE, and the answer, which says why, is still there to read.
    let sent = stream.write_all(&line);
    let mut answer = String::new();
    let read = BufReader::new(stream).read_line(&mut answer);
    if answer.is_empty() {
        sent.context("sending the request to the daemon")?;
        read.context("reading the daemon's answer")?;
        bail!("the daemon closed the connection without answering");
    }
    let response: Response = serde_json::from_str(&answer).context("malformed answer")?;
    match (&response.ok, &response.error) {
        (true, _) => Ok(response),
        (false, Some(error)) => bail!("{error}"),
        (false, None) => bail!("the daemon refused the request"),
    }
}

/// The `status --json` data of device `name`: its targets' status and details.
pub fn status(socket: &Path, name: &str) -> anyhow::Result<serde_json::Value> {
    let request = Request::Status {
        name: Some(name.to_string()),
        target: None,
    };
    Ok(call(socket, request)?.data.unwrap_or_default())
}

/// Rewrites relative paths (`./x`, `../x`) in table lines to absolute ones, so that the
/// daemon, whose working directory is not the caller's, opens the file the caller meant.
pub fn absolutize_table(text: &str) -> anyhow::Result<String> {
    let cwd = std::env::current_dir().context("current directory")?;
    Ok(Reference::absolute_paths(text, &cwd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_become_absolute_against_the_current_directory() {
        let cwd = std::env::current_dir().unwrap();
        let text = absolutize_table("0 8 linear ./a.img 0\n8 8 linear vol 0").unwrap();
        assert_eq!(
            text,
            format!(
                "0 8 linear {} 0\n8 8 linear vol 0",
                cwd.join("a.img").display()
            )
        );
    }
}
