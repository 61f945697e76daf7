//! systemd's readiness protocol (sd_notify) without libsystemd: one datagram per state change
//! to the Unix socket named by `$NOTIFY_SOCKET`, a path or (leading `@`) an abstract name.
//! Without the variable (not started by systemd as `Type=notify`) nothing is sent.
//! `udm daemon --fork` listens the same way for READY=1 alone, and is gone after it: it sets
//! [`READY_ONLY`] so that nothing else is sent to it.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

use log::warn;

/// Set by `udm daemon --fork` for the daemon it starts: only READY=1 is wanted.
pub const READY_ONLY: &str = "UDM_NOTIFY_READY_ONLY";

/// Sends `state` (`READY=1`, `STOPPING=1`, `STATUS=…`, lines joined by `\n`) to systemd, if
/// systemd asked for it. A failure is logged: the daemon serves either way, and systemd will
/// say it never heard from it.
pub fn notify(state: &str) {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if std::env::var_os(READY_ONLY).is_some() && !state.starts_with("READY=1") {
        return;
    }
    let socket = socket.to_string_lossy().into_owned();
    if let Err(e) = send(&socket, state) {
        warn!("telling systemd {state:?} through NOTIFY_SOCKET={socket}: {e}");
    }
    if std::env::var_os(READY_ONLY).is_some() {
        let_go_of_a_piped_stderr();
    }
}

/// A daemon started by `udm daemon --fork` with its stderr on a pipe (`out=$(… 2>&1)`,
/// `… | tee`) would hold that pipe for its whole life and the caller's shell would wait for
/// it. Errors before readiness reach the caller that way; once ready, the log goes.
fn let_go_of_a_piped_stderr() {
    // SAFETY: fstat on descriptor 2 into a zeroed stat of our own.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    let piped =
        unsafe { libc::fstat(2, &mut stat) } == 0 && stat.st_mode & libc::S_IFMT == libc::S_IFIFO;
    if !piped {
        return;
    }
    warn!("stderr is a pipe, which a daemon would keep open: the log ends here; give 2>FILE");
    if let Ok(null) = std::fs::File::options().write(true).open("/dev/null") {
        // SAFETY: dup2 onto descriptor 2 from a descriptor we own; nothing else owns fd 2.
        unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 2) };
    }
}

fn send(socket: &str, state: &str) -> std::io::Result<()> {
    let address = match socket.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name)?,
        None => SocketAddr::from_pathname(socket)?,
    };
    UnixDatagram::unbound()?.send_to_addr(state.as_bytes(), &address)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_reach_a_path_socket_and_an_abstract_one() {
        let path = std::env::temp_dir().join(format!("udm-notify-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixDatagram::bind(&path).unwrap();
        send(path.to_str().unwrap(), "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
        std::fs::remove_file(&path).unwrap();

        let name = format!("udm-notify-test-{}", std::process::id());
        let address = SocketAddr::from_abstract_name(&name).unwrap();
        let listener = UnixDatagram::bind_addr(&address).unwrap();
        send(&format!("@{name}"), "STOPPING=1").unwrap();
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }
}
