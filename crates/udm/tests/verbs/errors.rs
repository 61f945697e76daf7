//! Bad input of every kind gets a one-line error naming the problem, and the daemon keeps
//! serving.

use super::*;

#[test]
fn bad_input_gets_one_line_errors_that_name_the_problem() {
    let daemon = Daemon::start("errors");
    let cases: &[(&[&str], &str)] = &[
        (
            &["create", "a", "--table", "0 8 linear"],
            "line 1: linear: missing argument <dev>",
        ),
        (
            &["create", "a", "--table", "0 8 nosuch"],
            "unknown target type 'nosuch'",
        ),
        (
            &["create", "a", "--table", "0 8 zero\n9 8 zero"],
            "line 2: segment starts at sector 9",
        ),
        (
            &["create", "a", "--table", "0 8 linear /nonexistent/x 0"],
            "/nonexistent/x",
        ),
        (
            &["create", "a", "--table", "0 8 linear ghost 0"],
            "no device named 'ghost'",
        ),
        (
            &[
                "create",
                "a",
                "--table",
                "0 8 linear nbd+unix:///x?socket=/nonexistent/nbd.sock 0",
            ],
            "cannot connect to nbd server",
        ),
        (
            &["create", "a/b", "--table", "0 8 zero"],
            "invalid device name 'a/b'",
        ),
        (&["status", "ghost"], "device 'ghost' does not exist"),
        (&["remove", "ghost"], "device 'ghost' does not exist"),
    ];
    for (args, expected) in cases {
        let err = daemon.udm_err(args);
        assert!(err.contains(expected), "udm {args:?}: {err}");
    }
    daemon.create("a", "0 8 zero");
    assert!(daemon
        .udm_err(&["create", "a", "--table", "0 8 zero"])
        .contains("already exists"));
    // A device cannot come to depend on itself.
    daemon.create("b", "0 8 linear a 0");
    let err = daemon.udm_err(&["load", "a", "--table", "0 8 linear b 0"]);
    assert!(err.contains("would make 'a' depend on itself"), "{err}");
    assert!(daemon.udm_err(&["remove", "a"]).contains("used by b"));
    // Nothing was lost: both devices are still there and the daemon still answers.
    assert_eq!(daemon.udm(&["ls"]), "a\t(8 sectors)\nb\t(8 sectors)");

    // The daemon is not reachable: a clear error, no hang.
    let out = std::process::Command::new(UDM)
        .args(["ls", "--control", "/nonexistent/control.sock"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach the udm daemon"));
}

#[test]
fn malformed_control_requests_leave_the_daemon_serving() {
    use std::io::{BufRead, BufReader, Write};
    let daemon = Daemon::start("control");
    for junk in [
        "not json\n",
        "{\"version\":1,\"command\":\"explode\"}\n",
        "{\"version\":9,\"command\":\"targets\"}\n",
        "{}\n",
    ] {
        let mut s = std::os::unix::net::UnixStream::connect(daemon.control()).unwrap();
        s.write_all(junk.as_bytes()).unwrap();
        let mut answer = String::new();
        BufReader::new(s).read_line(&mut answer).unwrap();
        let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(answer["ok"], false, "{junk}");
        assert!(answer["error"].as_str().unwrap().len() > 5);
    }
    daemon.udm(&["ls"]);
}

#[test]
fn invalid_utf8_in_a_control_request_gets_an_error_and_the_connection_stays_usable() {
    use std::io::{BufRead, BufReader, Write};
    let daemon = Daemon::start("control-utf8");
    let s = std::os::unix::net::UnixStream::connect(daemon.control()).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut writer = s.try_clone().unwrap();
    let mut reader = BufReader::new(s);
    let mut answer = |request: &[u8]| -> serde_json::Value {
        writer.write_all(request).unwrap();
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    };
    for junk in [
        &b"{\"version\":1,\"command\":\"table\",\"name\":\"\xff\xfe\"}\n"[..],
        b"\xc3\x28\n",
    ] {
        let bad = answer(junk);
        assert_eq!(bad["ok"], false, "{bad}");
        assert!(
            bad["error"]
                .as_str()
                .unwrap()
                .starts_with("malformed request"),
            "{bad}"
        );
    }
    let good = answer(b"{\"version\":1,\"command\":\"ls\",\"tree\":false}\n");
    assert_eq!(good["ok"], true, "{good}");
}

/// A bad command line is one line on stderr with exit status 1, like every other error, and
/// says where to read more.
#[test]
fn bad_command_lines_are_one_line_errors_with_status_1() {
    let daemon = Daemon::start("command-lines");
    for args in [
        &["create"][..],
        &["create", "x", "--bogus"],
        &["frobnicate"],
        &["message", "x"],
        &["info", "-c", "-o"],
    ] {
        // With $UDM_CONTROL set, as run_udm does: clap's usage line used to show --control
        // as required then.
        let out = daemon.run_udm(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "udm {args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "udm {args:?}: {err}");
        assert!(err.starts_with("udm: ") && err.contains("--help`"), "{err}");
        assert!(!err.contains("--control"), "{err}");
    }
    let help = daemon.udm(&["replay-log", "--help"]);
    assert!(!help.contains("--control"), "{help}");
    assert!(daemon
        .udm(&["--help"])
        .contains("NAME is a device's name or its UUID"));

    // finalize on a device with nothing to finalize (a second finalize) is not an error.
    daemon.create("vol", "0 8 zero");
    let said = daemon.udm(&["finalize", "vol"]);
    assert!(said.contains("nothing to finalize"), "{said}");
}

/// Errors of a daemon that cannot start: one line, each cause once, limits in plain words.
#[test]
fn a_daemon_that_cannot_start_says_why_in_one_line() {
    let dir = TempDir::new("start-errors");
    let file = dir.path("a-file");
    std::fs::write(&file, b"").unwrap();
    let control = dir.path("c.sock");
    let long = dir.path(&"d".repeat(100)).join("control.sock");
    let under_a_file = format!("{}/mnt", file.display());
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "--control",
                control.to_str().unwrap(),
                "--fuse",
                &under_a_file,
            ],
            "Not a directory (os error 20)",
        ),
        (&["--control", long.to_str().unwrap()], "holds at most 107"),
    ];
    for (args, expected) in cases {
        let mut command = std::process::Command::new(UDM);
        command
            .args(["daemon", "--state-dir"])
            .arg(dir.path("state"))
            .args(*args);
        let out = command.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.trim_end().lines().last().unwrap_or("");
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(last.starts_with("udm: "), "{err}");
        assert_eq!(last.matches(expected).count(), 1, "{last}");
        assert!(!last.contains("SUN_LEN"), "{last}");
    }
}

/// `udm info vol | head -1`: a reader that goes away before udm has written everything
/// used to make udm panic with a backtrace ("failed printing to stdout: Broken pipe"). Like
/// dmsetup (and cat), it now ends quietly by SIGPIPE.
#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    let daemon = Daemon::start("closed-pipe");
    daemon.create("vol", "0 8 zero");
    for verb in [
        &["info", "vol"][..],
        &["status"],
        &["ls", "--json"],
        &["version"],
    ] {
        let mut child = std::process::Command::new(UDM)
            .args(verb)
            .env("UDM_CONTROL", daemon.control())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.is_empty(), "udm {verb:?} into a closed pipe: {err}");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGPIPE),
            "udm {verb:?}: {err}"
        );
    }
}
