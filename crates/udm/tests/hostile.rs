//! Hostile and broken NBD clients: each gets an error or a closed connection, and a
//! well-behaved client connected all along keeps working.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::*;

fn daemon_with_volume(tag: &str) -> Daemon {
    let daemon = Daemon::start(tag);
    let disk = daemon.create_linear("vol", "disk.img", 8 << 20);
    daemon.create("slow", &format!("0 16384 delay {} 0 200", disk.display()));
    daemon
}

/// The bystander: writes, then reads back, on its own connection.
fn check_bystander(client: &mut RawClient, round: u64) {
    let data = vec![round as u8; 4096];
    client.send(0, NBD_CMD_WRITE, round, round * 4096, 4096, &data);
    assert_eq!(client.reply().unwrap(), (0, round));
    client.send(0, NBD_CMD_READ, round + 1000, round * 4096, 4096, &[]);
    assert_eq!(client.reply().unwrap(), (0, round + 1000));
    let mut back = vec![0u8; 4096];
    client.stream.read_exact(&mut back).unwrap();
    assert_eq!(back, data);
}

fn connect_raw(daemon: &Daemon) -> UnixStream {
    let mut s = UnixStream::connect(daemon.nbd_socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    s
}

/// True when the server closes the connection (within the read timeout).
fn closed(s: &mut UnixStream) -> bool {
    let mut sink = Vec::new();
    match s.read_to_end(&mut sink) {
        Ok(_) => true,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

fn option(code: u32, data: &[u8]) -> Vec<u8> {
    let mut o = b"IHAVEOPT".to_vec();
    o.extend_from_slice(&code.to_be_bytes());
    o.extend_from_slice(&(data.len() as u32).to_be_bytes());
    o.extend_from_slice(data);
    o
}

/// Reads one option reply: (option, reply type, data).
fn option_reply(s: &mut UnixStream) -> (u32, u32, Vec<u8>) {
    let mut head = [0u8; 20];
    s.read_exact(&mut head).unwrap();
    let len = u32::from_be_bytes(head[16..20].try_into().unwrap());
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data).unwrap();
    (
        u32::from_be_bytes(head[8..12].try_into().unwrap()),
        u32::from_be_bytes(head[12..16].try_into().unwrap()),
        data,
    )
}

#[test]
fn broken_handshakes_are_closed_and_others_carry_on() {
    let daemon = daemon_with_volume("hostile-handshake");
    let mut bystander = RawClient::connect(&daemon.nbd_socket(), "vol");
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "http request instead of flags",
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        ),
        (
            "unknown client flags",
            0xffff_ffffu32.to_be_bytes().to_vec(),
        ),
        (
            "bad option magic",
            [
                3u32.to_be_bytes().to_vec(),
                b"IHAVEOPX".to_vec(),
                vec![0; 8],
            ]
            .concat(),
        ),
        (
            "truncated option header",
            [3u32.to_be_bytes().to_vec(), b"IHAVE".to_vec()].concat(),
        ),
        (
            "garbage after a malformed GO",
            [
                3u32.to_be_bytes().to_vec(),
                option(7, &[0; 4])[..16].to_vec(),
                100u32.to_be_bytes().to_vec(),
                vec![1; 10],
            ]
            .concat(),
        ),
        (
            "export name of an unknown export",
            [3u32.to_be_bytes().to_vec(), option(1, b"ghost")].concat(),
        ),
    ];
    for (round, (what, bytes)) in cases.into_iter().enumerate() {
        let mut s = connect_raw(&daemon);
        s.write_all(&bytes).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(closed(&mut s), "{what}");
        check_bystander(&mut bystander, round as u64);
    }
}

#[test]
fn malformed_options_get_error_replies_and_negotiation_continues() {
    let daemon = daemon_with_volume("hostile-options");
    let mut s = connect_raw(&daemon);
    s.write_all(&3u32.to_be_bytes()).unwrap();
    let err_unsup = (1 << 31) + 1;
    let err_invalid = (1 << 31) + 3;
    let err_unknown = (1 << 31) + 6;
    // Extended headers (recent libnbd asks) and an invented option: unsupported.
    for code in [11u32, 4242] {
        s.write_all(&option(code, &[])).unwrap();
        assert_eq!(option_reply(&mut s).1, err_unsup, "option {code}");
    }
    // INFO with a name length past the data.
    s.write_all(&option(6, &[0, 0, 1, 0, b'v'])).unwrap();
    assert_eq!(option_reply(&mut s).1, err_invalid);
    // LIST with data, structured reply with data.
    s.write_all(&option(3, b"x")).unwrap();
    assert_eq!(option_reply(&mut s).1, err_invalid);
    s.write_all(&option(8, b"x")).unwrap();
    assert_eq!(option_reply(&mut s).1, err_invalid);
    // SET_META_CONTEXT before structured replies.
    let mut meta = 3u32.to_be_bytes().to_vec();
    meta.extend_from_slice(b"vol");
    meta.extend_from_slice(&1u32.to_be_bytes());
    meta.extend_from_slice(&15u32.to_be_bytes());
    meta.extend_from_slice(b"base:allocation");
    s.write_all(&option(10, &meta)).unwrap();
    assert_eq!(option_reply(&mut s).1, err_invalid);
    // GO for an export that does not exist.
    let mut go = 5u32.to_be_bytes().to_vec();
    go.extend_from_slice(b"ghost");
    go.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&option(7, &go)).unwrap();
    let (_, reply, message) = option_reply(&mut s);
    assert_eq!(reply, err_unknown);
    assert!(String::from_utf8_lossy(&message).contains("ghost"));
    // After all that, GO for the real export works on the same connection.
    let mut go = 3u32.to_be_bytes().to_vec();
    go.extend_from_slice(b"vol");
    go.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&option(7, &go)).unwrap();
    loop {
        let (_, reply, _) = option_reply(&mut s);
        if reply == 1 {
            break;
        }
        assert_eq!(reply, 3, "expected INFO replies before ACK");
    }
}

#[test]
fn bad_requests_get_errors_and_the_connection_survives() {
    let daemon = daemon_with_volume("hostile-requests");
    let mut c = RawClient::connect(&daemon.nbd_socket(), "vol");
    let size = c.size;
    let einval = 22;
    let cases: &[(&str, u16, u16, u64, u32)] = &[
        ("read past the end", 0, NBD_CMD_READ, size - 512, 1024),
        (
            "read at a huge offset",
            0,
            NBD_CMD_READ,
            u64::MAX - 511,
            512,
        ),
        ("read larger than the maximum", 0, NBD_CMD_READ, 0, 64 << 20),
        ("misaligned read", 0, NBD_CMD_READ, 100, 512),
        ("unknown command", 0, 99, 0, 512),
        ("unknown flags", 1 << 12, NBD_CMD_READ, 0, 512),
        ("block status without a meta context", 0, 7, 0, 512),
        ("trim past the end", 0, 4, size, 512),
    ];
    for (i, (what, flags, command, offset, len)) in cases.iter().enumerate() {
        c.send(*flags, *command, i as u64, *offset, *len, &[]);
        assert_eq!(c.reply().unwrap(), (einval, i as u64), "{what}");
    }
    // A write past the end: its payload is consumed, the error comes back, the stream stays in sync.
    c.send(0, NBD_CMD_WRITE, 77, size, 4096, &[0u8; 4096]);
    assert_eq!(c.reply().unwrap().1, 77);
    check_bystander(&mut c, 3);
}

#[test]
fn protocol_breaking_requests_close_only_their_connection() {
    let daemon = daemon_with_volume("hostile-close");
    let mut bystander = RawClient::connect(&daemon.nbd_socket(), "vol");
    // Bad request magic.
    let mut c = RawClient::connect(&daemon.nbd_socket(), "vol");
    c.stream.write_all(&[0xde; 28]).unwrap();
    assert!(c.is_closed());
    check_bystander(&mut bystander, 1);
    // A write whose payload exceeds what the server accepts.
    let mut c = RawClient::connect(&daemon.nbd_socket(), "vol");
    c.send(0, NBD_CMD_WRITE, 1, 0, 1 << 30, &[]);
    assert!(c.is_closed());
    check_bystander(&mut bystander, 2);
    // Truncated request header, then gone.
    let mut c = RawClient::connect(&daemon.nbd_socket(), "vol");
    c.stream.write_all(&[0x25, 0x60, 0x95, 0x13, 0, 0]).unwrap();
    drop(c);
    check_bystander(&mut bystander, 3);
    // Vanishes in the middle of a write's payload.
    let mut c = RawClient::connect(&daemon.nbd_socket(), "vol");
    c.send(0, NBD_CMD_WRITE, 1, 0, 1 << 20, &vec![9u8; 100_000]);
    drop(c);
    check_bystander(&mut bystander, 4);
    // Vanishes while its requests are still being served (the reply has nowhere to go).
    let mut c = RawClient::connect(&daemon.nbd_socket(), "slow");
    for cookie in 0..8 {
        c.send(0, NBD_CMD_READ, cookie, cookie * 4096, 4096, &[]);
    }
    drop(c);
    std::thread::sleep(Duration::from_millis(300));
    check_bystander(&mut bystander, 5);
    // Sends DISC with requests in flight: they are answered, then the connection closes.
    let mut c = RawClient::connect(&daemon.nbd_socket(), "slow");
    c.send(0, NBD_CMD_READ, 1, 0, 512, &[]);
    c.send(0, NBD_CMD_DISC, 2, 0, 0, &[]);
    assert_eq!(c.reply().unwrap(), (0, 1));
    let mut data = [0u8; 512];
    c.stream.read_exact(&mut data).unwrap();
    assert!(c.is_closed());
    check_bystander(&mut bystander, 6);
}

#[test]
fn a_flood_of_connections_does_not_take_the_daemon_down() {
    let mut daemon = daemon_with_volume("hostile-flood");
    let mut bystander = RawClient::connect(&daemon.nbd_socket(), "vol");
    let mut flood = Vec::new();
    for _ in 0..400 {
        if let Ok(s) = UnixStream::connect(daemon.nbd_socket()) {
            flood.push(s);
        }
    }
    check_bystander(&mut bystander, 1);
    drop(flood);
    std::thread::sleep(Duration::from_millis(300));
    // Capacity comes back once the flood is gone.
    let mut fresh = RawClient::connect(&daemon.nbd_socket(), "vol");
    check_bystander(&mut fresh, 2);
    check_bystander(&mut bystander, 3);
    assert!(daemon.is_running());
}

#[test]
fn invalid_flags_and_writes_past_the_end_get_nbdkits_errors() {
    let daemon = daemon_with_volume("hostile-strict");
    let mut c = RawClient::connect(&daemon.nbd_socket(), "vol");
    let size = c.size;
    let (einval, enospc) = (22, 28);
    let (fua, no_hole, df, req_one, fast_zero) = (1, 2, 4, 8, 16);
    let (trim, write_zeroes) = (4, 6);
    let block = [7u8; 4096];
    // What, flags, command, offset, length, payload, the error expected.
    type Case<'a> = (&'a str, u16, u16, u64, u32, &'a [u8], u32);
    // One case a line: a table reads better than rustfmt's one field a line.
    #[rustfmt::skip]
    let cases: &[Case] = &[
        ("write past the end", 0, NBD_CMD_WRITE, size, 4096, &block, enospc),
        ("write straddling the end", 0, NBD_CMD_WRITE, size - 512, 4096, &block, enospc),
        ("write-zeroes past the end", 0, write_zeroes, size, 4096, &[], enospc),
        ("read past the end", 0, NBD_CMD_READ, size, 512, &[], einval),
        ("trim past the end", 0, trim, size, 512, &[], einval),
        ("REQ_ONE on a read", req_one, NBD_CMD_READ, 0, 512, &[], einval),
        ("NO_HOLE on a write", no_hole, NBD_CMD_WRITE, 0, 4096, &block, einval),
        ("DF on a write", df, NBD_CMD_WRITE, 0, 4096, &block, einval),
        ("FAST_ZERO on a trim", fast_zero, trim, 0, 512, &[], einval),
        ("DF without structured replies", df, NBD_CMD_READ, 0, 512, &[], einval),
        ("flush with an offset", 0, NBD_CMD_FLUSH, 4096, 0, &[], einval),
        ("flush with a length", 0, NBD_CMD_FLUSH, 0, 512, &[], einval),
        // What stays valid: FUA on any command, zero flags on write-zeroes, plain flush.
        ("FUA on a flush", fua, NBD_CMD_FLUSH, 0, 0, &[], 0),
        ("NO_HOLE on write-zeroes", no_hole | fua, write_zeroes, 0, 4096, &[], 0),
        ("flush", 0, NBD_CMD_FLUSH, 0, 0, &[], 0),
    ];
    for (i, (what, flags, command, offset, len, data, errno)) in cases.iter().enumerate() {
        c.send(*flags, *command, i as u64, *offset, *len, data);
        assert_eq!(c.reply().unwrap(), (*errno, i as u64), "{what}");
    }
    check_bystander(&mut c, 1);
    // The rejected writes wrote nothing.
    c.send(0, NBD_CMD_READ, 99, 0, 4096, &[]);
    assert_eq!(c.reply().unwrap(), (0, 99));
    let mut data = vec![1u8; 4096];
    c.stream.read_exact(&mut data).unwrap();
    assert_eq!(data, vec![0u8; 4096]);

    // With structured replies (libnbd, strict mode off so it sends what it is told): DF on
    // a read is fine, REQ_ONE on a read is not.
    let (ok, out) = nbdsh(&format!(
        r#"
h = nbd.NBD()
h.set_strict_mode(0)
h.connect_uri("{uri}")
assert h.pread(4096, 0, nbd.CMD_FLAG_DF) == bytes(4096)
try:
    h.pread(4096, 0, nbd.CMD_FLAG_REQ_ONE)
    raise SystemExit("REQ_ONE on a read was accepted")
except nbd.Error as e:
    assert "(EINVAL)" in str(e), e
    print("refused:", e)
"#,
        uri = daemon.uri("vol")
    ));
    assert!(ok, "{out}");
}

#[test]
fn one_client_at_its_connection_cap_is_refused_with_an_error_and_others_are_served() {
    let daemon = Daemon::start_with("hostile-cap", &["--nbd-max-connections-per-client", "3"]);
    daemon.create_linear("vol", "disk.img", 8 << 20);
    // Another user may use the socket (this test runs as root, uid 0).
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(daemon.nbd_socket(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let nbdinfo = |as_nobody: bool| {
        let mut cmd = std::process::Command::new(if as_nobody { "setpriv" } else { "nbdinfo" });
        if as_nobody {
            cmd.args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "nbdinfo",
            ]);
        }
        let out = cmd
            .arg(daemon.uri("vol"))
            .env("LIBNBD_DEBUG", "1")
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let mut mine: Vec<RawClient> = (0..3)
        .map(|_| RawClient::connect(&daemon.nbd_socket(), "vol"))
        .collect();
    let (ok, err) = nbdinfo(false);
    assert!(!ok, "a fourth connection from uid 0 was served");
    // An NBD error reply, with the reason (libnbd shows the server's message when debugging).
    assert!(err.contains("server replied with error to opt_go"), "{err}");
    assert!(
        err.contains("too many connections from uid 0: the limit is 3 per client"),
        "{err}"
    );
    // Another client is served meanwhile, and the capped one still works.
    let (ok, err) = nbdinfo(true);
    assert!(ok, "uid 65534 was refused: {err}");
    check_bystander(&mut mine[0], 1);
    // A closed connection gives its place back.
    drop(mine.pop());
    wait_for(|| nbdinfo(false).0, "uid 0 to be served again");
}

/// Refused clients were told why by a thread each, at most 16 at once for up to 5 s each:
/// past 16 refused clients that did not read their answer (a flood, or slow clients), the
/// next refused client got a bare close and never learned why. One thread now answers every
/// refusal, each a few hundred bytes of state.
#[test]
fn every_refused_client_is_told_why_however_many_wait() {
    let daemon = Daemon::start_with(
        "hostile-refusals",
        &["--nbd-max-connections-per-client", "1"],
    );
    daemon.create_linear("vol", "disk.img", 8 << 20);
    let mut mine = RawClient::connect(&daemon.nbd_socket(), "vol");
    // Refused clients that never answer the greeting: each keeps its refusal pending.
    let silent: Vec<UnixStream> = (0..40)
        .map(|_| UnixStream::connect(daemon.nbd_socket()).unwrap())
        .collect();
    wait_for(
        || daemon.log().matches("nbd: refusing a connection").count() >= silent.len(),
        "the silent clients' refusals",
    );
    let out = std::process::Command::new("nbdinfo")
        .arg(daemon.uri("vol"))
        .env("LIBNBD_DEBUG", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a second connection from uid 0 was served"
    );
    assert!(
        err.contains("too many connections from uid 0: the limit is 1 per client"),
        "{err}"
    );
    let refusing = daemon.threads_named("nbd-refuse");
    assert!(refusing <= 1, "{refusing} threads refuse clients");
    check_bystander(&mut mine, 1);
}

#[test]
fn idle_connections_are_closed_and_busy_ones_are_not() {
    let daemon = Daemon::start_with("hostile-idle", &["--nbd-idle-timeout", "1s"]);
    let disk = daemon.sparse("disk.img", 8 << 20);
    // Reads take 2.5 s; writes and flushes none.
    let disk = disk.display();
    daemon.create("slow", &format!("0 16384 delay {disk} 0 2500 {disk} 0 0"));
    // Idle: closed after about a second.
    let started = std::time::Instant::now();
    let mut idle = RawClient::connect(&daemon.nbd_socket(), "slow");
    assert!(idle.is_closed(), "the idle connection stayed open");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "closed after {took:?}; the daemon's log:\n{}",
        daemon.log()
    );
    // Part of a request's header, and then nothing, is as idle: on io_uring such a connection
    // stayed open for good.
    let mut partial = RawClient::connect(&daemon.nbd_socket(), "slow");
    let header = request_header(0, NBD_CMD_READ, 1, 0, 512);
    partial.stream.write_all(&header[..20]).unwrap();
    assert!(
        partial.is_closed(),
        "a connection with part of a header stayed open"
    );
    // A request in flight for 2.5 s is not idleness: its reply arrives.
    let mut busy = RawClient::connect(&daemon.nbd_socket(), "slow");
    busy.send(0, NBD_CMD_READ, 1, 0, 512, &[]);
    assert_eq!(busy.reply().unwrap(), (0, 1));
    let mut data = [0u8; 512];
    busy.stream.read_exact(&mut data).unwrap();
    // Requests every half second keep a connection open well past the timeout.
    for cookie in 2..8 {
        std::thread::sleep(Duration::from_millis(500));
        busy.send(0, NBD_CMD_FLUSH, cookie, 0, 0, &[]);
        assert_eq!(busy.reply().unwrap(), (0, cookie));
    }
    assert!(busy.is_closed(), "closed once quiet");
    assert!(daemon.log().contains("closing a connection idle for 1s"));
}

/// Asserts that the daemon's resident memory has not grown more than 64 MiB past `rss`.
fn assert_rss_near(daemon: &Daemon, rss: u64) {
    let (_, now) = memory_of(daemon.pid());
    assert!(
        now <= rss + (64 << 20),
        "RSS grew from {} MiB to {} MiB",
        rss >> 20,
        now >> 20
    );
}

/// VmHWM (peak) and VmRSS of a process, in bytes.
fn memory_of(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib << 10
    };
    (field("VmHWM:"), field("VmRSS:"))
}

#[test]
fn a_flood_of_big_requests_stays_within_the_buffer_budget() {
    // The default budget (256 MiB) against 4 connections with 16 requests of 32 MiB each in
    // flight: 2 GiB of payloads asked for at once.
    let daemon = Daemon::start("hostile-memory");
    daemon.create_linear("vol", "disk.img", 256 << 20);
    let (before, _) = memory_of(daemon.pid());
    let (ok, out) = nbdsh(&format!(
        r#"
import threading
MIB = 1 << 20
def flood(i):
    h = nbd.NBD()
    h.connect_uri("{uri}")
    buf = nbd.Buffer(32 * MIB)
    cookies = []
    for j in range(16):
        offset = (j % 8) * 32 * MIB
        if i % 2:
            cookies.append(h.aio_pwrite(buf, offset))
        else:
            cookies.append(h.aio_pread(buf, offset))
    while h.aio_in_flight() > 0:
        h.poll(-1)
    for c in cookies:
        assert h.aio_command_completed(c)
    h.shutdown()
threads = [threading.Thread(target=flood, args=(i,)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print("flood done")
"#,
        uri = daemon.uri("vol")
    ));
    assert!(ok && out.contains("flood done"), "{out}");
    let (peak, now) = memory_of(daemon.pid());
    let (budget, slack) = (256u64 << 20, 64u64 << 20);
    eprintln!(
        "daemon memory: {} MiB before, peak {} MiB, {} MiB after the flood",
        before >> 20,
        peak >> 20,
        now >> 20
    );
    assert!(
        peak <= before + budget + slack,
        "peak RSS {} MiB exceeds {} MiB at start + the 256 MiB budget + 64 MiB",
        peak >> 20,
        before >> 20
    );
    // The 32 MiB buffers went back after their replies.
    assert!(now <= before + slack, "{} MiB still resident", now >> 20);
}

#[test]
fn clients_that_vanish_with_a_full_queue_give_back_their_slots_and_buffers() {
    // Four places for this uid: a slot kept by any of the 40 clients below would lock it out.
    let daemon = Daemon::start_with("hostile-vanish", &["--nbd-max-connections-per-client", "4"]);
    daemon.create_linear("vol", "disk.img", 8 << 20);
    let mut bystander = RawClient::connect(&daemon.nbd_socket(), "vol");
    check_bystander(&mut bystander, 1);
    let (fds, (_, rss)) = (open_descriptors(daemon.pid()), memory_of(daemon.pid()));
    let data = vec![7u8; 4096];
    for round in 0..40u64 {
        // At most 3 of them at once (with the bystander, the cap): wait for a place, which a
        // leaked slot would never give back.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let mut client = loop {
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: no connection slot came back"
            );
            let mut s = connect_raw(&daemon);
            s.write_all(&0u32.to_be_bytes()).unwrap();
            s.write_all(&option(
                7,
                &[&3u32.to_be_bytes()[..], b"vol", &[0, 0]].concat(),
            ))
            .unwrap();
            let (_, kind, _) = option_reply(&mut s);
            if kind == 3 {
                while option_reply(&mut s).1 != 1 {}
                break s;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        // 32 writes and 32 reads in flight, then gone without reading a reply (every other
        // one mid-request).
        let mut burst = Vec::new();
        for i in 0..64u64 {
            let command = if i < 32 { NBD_CMD_WRITE } else { NBD_CMD_READ };
            // Away from the bystander's blocks (the first few).
            let offset = (1 << 20) + (i % 1024) * 4096;
            burst.extend_from_slice(&request_header(0, command, i, offset, 4096));
            if command == NBD_CMD_WRITE {
                burst.extend_from_slice(&data);
            }
        }
        if round % 2 == 1 {
            burst.truncate(burst.len() - 2000);
        }
        client.write_all(&burst).unwrap();
        drop(client);
    }
    check_bystander(&mut bystander, 2);
    // Every vanished client's place comes back: three new ones connect beside the bystander.
    wait_for(
        || open_descriptors(daemon.pid()) <= fds,
        "the daemon's descriptors to come back",
    );
    let others: Vec<RawClient> = (0..3)
        .map(|_| RawClient::connect(&daemon.nbd_socket(), "vol"))
        .collect();
    drop(others);
    assert_rss_near(&daemon, rss);
}

/// Twelve clients that each `stall` (given its connection and a cookie) in the middle of a
/// 32 MiB request, 384 MiB of the 256 MiB budget wanted, on either engine: a bystander is served
/// within its 10 s read timeout, and at least `ended` of the stalled connections are ended, the
/// log saying `why`.
fn stalled_clients_hold_nobody_up(
    tag: &str,
    stall: impl Fn(&mut RawClient, u64),
    ended: usize,
    why: &str,
) {
    for engine in ["uring", "threads"] {
        let tag = format!("{tag}-{engine}");
        let daemon = Daemon::start_with(&tag, &["--nbd-engine", engine]);
        daemon.create_linear("vol", "disk.img", 64 << 20);
        let mut stalled: Vec<RawClient> = (0..12u64)
            .map(|cookie| {
                let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
                stall(&mut client, cookie);
                client
            })
            .collect();
        // Its requests wait for room a moment, and then go through (the 10 s read timeout
        // fails the test if they do not).
        let mut bystander = RawClient::connect(&daemon.nbd_socket(), "vol");
        check_bystander(&mut bystander, 1);
        let closed = (stalled.iter_mut())
            .map(|c| {
                let short = Some(Duration::from_millis(200));
                c.stream.set_read_timeout(short).unwrap();
                closed(&mut c.stream)
            })
            .filter(|&ended| ended)
            .count();
        assert!(
            closed >= ended,
            "{engine}: {closed} stalled connections ended"
        );
        let log = daemon.log();
        assert!(log.contains(why), "{engine}: {log}");
    }
}

/// Clients stopped in the middle of large writes (a paused VM, a hostile peer) held the
/// buffer budget for good: a dozen connections, each sending the header of a 32 MiB write
/// and 4 KiB of its data, took the whole 256 MiB, and every other client of the daemon
/// waited behind them (found by hand: a qemu-io read of 4 KiB hung; on the threaded engine
/// too, until the idle timeout). Such a connection is ended once a second passes without its
/// data while others wait for room.
#[test]
fn clients_stalled_in_the_middle_of_large_writes_hold_nobody_up() {
    let stall = |client: &mut RawClient, cookie| {
        let header = request_header(0, NBD_CMD_WRITE, cookie, 0, 32 << 20);
        client.stream.write_all(&header).unwrap();
        client.stream.write_all(&[7u8; 4096]).unwrap();
    };
    let why = "the client sent none of the rest of a write's data for 1s, while other requests";
    // 8 of them hold buffers, and 4 wait for room ahead of the bystander: 5 are ended before
    // it is served. Then nobody waits, and the others may be left to the 30 s rule.
    stalled_clients_hold_nobody_up("hostile-stalled-writes", stall, 5, why);
}

/// The same with clients that send a byte of the rest every 300 ms: each byte counted as
/// progress, and they held the budget as surely (found by hand: a 4 KiB write waited 35 s).
#[test]
fn clients_trickling_large_writes_hold_nobody_up() {
    let stall = |client: &mut RawClient, cookie| {
        let header = request_header(0, NBD_CMD_WRITE, cookie, 0, 32 << 20);
        client.stream.write_all(&header).unwrap();
        let mut stream = client.stream.try_clone().unwrap();
        // Until the connection ends (the daemon's, at the latest).
        std::thread::spawn(move || {
            while stream.write_all(&[7u8]).is_ok() {
                std::thread::sleep(Duration::from_millis(300));
            }
        });
    };
    let why = "the client sent none of the rest of a write's data for 1s, while other requests";
    stalled_clients_hold_nobody_up("hostile-trickled-writes", stall, 5, why);
}

/// The same with reads whose replies the client never reads: each held its 32 MiB until the
/// write timeout (30 s), and every other client waited as long (found by hand: a 4 KiB read
/// took 29.6 s on io_uring; on threads it waited over a minute).
#[test]
fn clients_that_read_none_of_large_read_replies_hold_nobody_up() {
    let stall = |client: &mut RawClient, cookie| {
        client.send(0, NBD_CMD_READ, cookie, 0, 32 << 20, &[]);
    };
    let why = "the client read none of its replies for 1s, while other requests";
    // Those whose reply was stalled when a tick looked: some reads may still be at the disk.
    stalled_clients_hold_nobody_up("hostile-unread-reads", stall, 1, why);
}

#[test]
fn a_client_that_never_reads_its_replies_is_held_back_and_others_are_served() {
    let daemon = daemon_with_volume("hostile-unread");
    let mut bystander = RawClient::connect(&daemon.nbd_socket(), "vol");
    let (_, rss) = memory_of(daemon.pid());
    let mut flood = RawClient::connect(&daemon.nbd_socket(), "vol");
    flood.stream.set_nonblocking(true).unwrap();
    // 10,000 writes of 4 KiB (40 MiB), sent as fast as the server takes them.
    let data = vec![3u8; 4096];
    let mut burst = Vec::new();
    for i in 0..10_000u64 {
        let offset = (1 << 20) + (i % 1024) * 4096;
        burst.extend_from_slice(&request_header(0, NBD_CMD_WRITE, i, offset, 4096));
        burst.extend_from_slice(&data);
    }
    // Sends until the server has taken nothing for a second (10 s at most).
    let (mut sent, start) = (0, std::time::Instant::now());
    let mut progress = start;
    while sent < burst.len()
        && progress.elapsed() < Duration::from_secs(1)
        && start.elapsed() < Duration::from_secs(10)
    {
        match flood.stream.write(&burst[sent..]) {
            Ok(n) => {
                sent += n;
                progress = std::time::Instant::now();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("{e}"),
        }
    }
    // The server stops reading once its replies are not taken (about half of the flood fits
    // in the sockets' buffers, as replies and requests): the rest waits in the client.
    assert!(
        sent < burst.len() && progress.elapsed() >= Duration::from_secs(1),
        "the server took {sent} bytes of {} and was still taking more",
        burst.len()
    );
    check_bystander(&mut bystander, 3);
    assert_rss_near(&daemon, rss);
}
