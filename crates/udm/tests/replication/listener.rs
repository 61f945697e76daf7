//! The replication listener facing a crowd: idle connections hold a bounded number of threads,
//! the rest are answered "busy", and the port serves again once they go.

use std::time::Duration;

use super::*;

#[test]
fn idle_connections_to_the_replication_port_hold_a_bounded_number_of_threads() {
    let daemon = Daemon::start_with("hostile-replication", &["--replication", "tcp:127.0.0.1:0"]);
    let log = daemon.log();
    let port: u16 = log
        .lines()
        .find_map(|line| line.split_once("replication: receiving streams on tcp:"))
        .and_then(|(_, addr)| addr.rsplit_once(':')?.1.parse().ok())
        .unwrap_or_else(|| panic!("no replication listener in the log:\n{log}"));
    let connect = || std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let first_line = |stream: std::net::TcpStream| {
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(stream), &mut line);
        line
    };
    let (before, _) = daemon.threads();
    // Before, each of these held a thread of its own for a minute: a peer of the port could
    // make the daemon spawn threads until none could be made for its devices' work.
    let idle: Vec<_> = (0..200).map(|_| connect()).collect();
    let refused = first_line(connect());
    assert!(
        refused.contains("64 replication connections are open"),
        "{refused}"
    );
    let (during, _) = daemon.threads();
    assert!(
        during <= before + 64,
        "{before} threads before, {during} with 200 idle connections"
    );
    daemon.udm(&["ls"]);
    drop(idle);
    wait_for(
        || {
            let mut stream = connect();
            stream.write_all(b"{}\n").unwrap();
            first_line(stream).contains("malformed request")
        },
        "the replication port to serve again",
    );
}
