//! Running the daemon in the background from a shell: `udm daemon --fork` returns once the
//! daemon is ready (as qemu-nbd's `--fork` does), and `udm stop` returns once it has stopped.
//! So a script can run `udm daemon … --fork`, use the devices, `udm stop`, and start the
//! daemon again on the same state dir without racing either end.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use anyhow::Context;

use crate::client;
use udm::control::Request;

/// Starts this same command line without `--fork` as a new session, tells it to report
/// readiness to a socket of ours (the daemon's sd_notify), and returns once it has: the
/// devices are restored and the sockets listen. If the daemon exits first, its own error is
/// on stderr already; its exit status is ours.
pub fn fork() -> anyhow::Result<ExitCode> {
    let notify = std::env::temp_dir().join(format!("udm-fork-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&notify);
    let ready = UnixDatagram::bind(&notify)
        .with_context(|| format!("readiness socket {}", notify.display()))?;
    ready.set_read_timeout(Some(Duration::from_millis(200)))?;
    let args = std::env::args_os().skip(1).filter(|a| a != "--fork");
    let mut command = Command::new(std::env::current_exe().context("finding udm itself")?);
    command
        .args(args)
        .env("NOTIFY_SOCKET", &notify)
        .env(udm::daemon::notify::READY_ONLY, "1")
        .stdin(Stdio::null())
        // It never writes there, and `out=$(udm daemon --fork)` would wait for it to exit.
        .stdout(Stdio::null());
    // SAFETY: setsid is async-signal-safe; it detaches the daemon from the terminal's session
    // so that closing the terminal does not stop it.
    unsafe {
        command.pre_exec(|| {
            libc::setsid();
            Ok(())
        })
    };
    let mut daemon = command.spawn().context("starting the daemon")?;
    let result = loop {
        let mut buf = [0u8; 256];
        if let Ok(n) = ready.recv(&mut buf) {
            if buf[..n].split(|&b| b == b'\n').any(|l| l == b"READY=1") {
                break Ok(ExitCode::SUCCESS);
            }
        }
        if let Some(status) = daemon.try_wait()? {
            let code = status.code().unwrap_or(1).clamp(1, 255) as u8;
            break Ok(ExitCode::from(code));
        }
    };
    let _ = std::fs::remove_file(&notify);
    result
}

/// `udm stop`: asks the daemon to stop as SIGTERM does (flushing every device) and waits
/// until it has let go of its state dir, i.e. exited.
pub fn stop(control: &Path) -> anyhow::Result<()> {
    let response = client::call(control, Request::Stop)?;
    let data = response.data.unwrap_or_default();
    let state_dir = data["state_dir"]
        .as_str()
        .context("the daemon did not say where its state dir is")?;
    let lock = std::fs::File::open(Path::new(state_dir).join("lock"))
        .with_context(|| format!("state dir {state_dir}"))?;
    let mut said = false;
    let started = std::time::Instant::now();
    // The daemon holds an exclusive flock on it until it exits.
    // SAFETY: flock on a descriptor we own.
    while unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } != 0 {
        if !said && started.elapsed() > Duration::from_secs(3) {
            eprintln!(
                "udm: waiting for the daemon (pid {}) to stop; its log says what it waits for",
                data["pid"]
            );
            said = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}
