//! A connection that breaks: reconnect and resend, fail fast, time out, redial a server
//! that stops answering, a disconnected start, a server shutting down, closing.

use super::*;
use udm_block::BlockError;

/// Reads 64 KiB at `offset` on a thread of its own: a request the test can catch waiting.
fn read_in_background(
    client: &Arc<NbdClient>,
    offset: u64,
) -> JoinHandle<udm_block::Result<AlignedBuf>> {
    let client = client.clone();
    std::thread::spawn(move || {
        let mut buf = AlignedBuf::zeroed(65536);
        client.read(offset, &mut buf).map(|()| buf)
    })
}

#[test]
fn reconnects_and_resends_after_the_server_restarts() {
    let dir = scratch("reconnect");
    let (data, file_arg) = patterned_image(&dir, 11);
    // Reads take 300 ms, so one can be caught in flight when the server dies.
    let args = ["--filter=delay", "file", &file_arg, "delay-read=300ms"];
    let server = nbdkit(&dir, &args);
    let client = Arc::new(connect(&uri(&dir), options(Duration::from_secs(10))));
    assert!(read(&*client, 0, 4096)[..] == data[..4096]);

    let in_flight = read_in_background(&client, MIB);
    std::thread::sleep(Duration::from_millis(100));
    kill_server(server, &client);
    let while_down = read_in_background(&client, 2 * MIB + 8192);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!in_flight.is_finished() && !while_down.is_finished());

    let _server = nbdkit(&dir, &args);
    let got = in_flight
        .join()
        .unwrap()
        .expect("the read in flight is resent");
    assert!(got[..] == data[MIB as usize..][..65536]);
    let got = while_down
        .join()
        .unwrap()
        .expect("the read made while down is sent");
    assert!(got[..] == data[2 * MIB as usize + 8192..][..65536]);
    assert!(client.is_connected());
    client
        .write(0, &pattern(4096, 12), WriteFlags { fua: true })
        .unwrap();
    assert!(read(&*client, 0, 4096)[..] == pattern(4096, 12)[..]);
}

#[test]
fn a_fail_fast_client_fails_requests_when_the_connection_breaks_and_serves_once_back() {
    let dir = scratch("fail-fast");
    let (data, file_arg) = patterned_image(&dir, 13);
    // Reads take 2 s, so one is in flight when the server dies.
    let args = ["--filter=delay", "file", &file_arg, "delay-read=2"];
    let server = nbdkit(&dir, &args);
    let client = Arc::new(connect(&uri(&dir), fail_fast(Duration::from_secs(30))));
    let in_flight = {
        let client = client.clone();
        std::thread::spawn(move || {
            let mut buf = AlignedBuf::zeroed(4096);
            let started = Instant::now();
            (client.read(0, &mut buf), started.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    drop(server);
    // Not resent, not waited for: the io_timeout (30 s) plays no part.
    let (result, took) = in_flight.join().unwrap();
    let err = result.unwrap_err();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(err.to_string().contains("connection broke"), "{err}");
    assert!(took < Duration::from_secs(2), "failed after {took:?}");
    // While there is no connection, a request fails at once.
    let started = Instant::now();
    let mut buf = AlignedBuf::zeroed(4096);
    let err = client.read(0, &mut buf).unwrap_err();
    assert!(err.to_string().contains("not connected"), "{err}");
    assert!(started.elapsed() < Duration::from_millis(100));
    // The client redials by itself; requests succeed again once it has.
    let _server = nbdkit(&dir, &["file", &file_arg]);
    wait_until("the client is back", Duration::from_secs(10), || {
        client.is_connected()
    });
    assert!(read(&*client, MIB, 4096)[..] == data[MIB as usize..][..4096]);
}

#[test]
fn a_server_that_stays_away_fails_requests_after_io_timeout() {
    let dir = scratch("away");
    let server = nbdkit(&dir, &["memory", "64M"]);
    // nbdkit serves any export name; this one names the client's thread "nbd-client-away".
    let client = connect(&uri_for(&dir, "away"), options(Duration::from_secs(1)));
    // The thread names itself once it runs.
    wait_until("the client's thread runs", Duration::from_secs(2), || {
        thread_named("nbd-client-away")
    });
    drop(server);
    let start = Instant::now();
    let mut buf = AlignedBuf::zeroed(4096);
    let err = client.read(0, &mut buf).unwrap_err();
    let took = start.elapsed();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(err.to_string().contains("unreachable"), "{err}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_millis(2500),
        "failed after {took:?}"
    );
    // Dropping it stops the reconnect loop at once, and its thread is gone.
    let start = Instant::now();
    drop(client);
    assert!(start.elapsed() < Duration::from_secs(1));
    assert!(!thread_named("nbd-client-away"));
}

#[test]
fn a_server_that_stops_answering_is_dropped_and_redialled() {
    // Reads hang for 20 s; writes are immediate.
    let dir = scratch("stalled");
    let _server = nbdkit(&dir, &["--filter=delay", "memory", "64M", "delay-read=20"]);
    let client = connect(&uri(&dir), options(Duration::from_secs(1)));
    let start = Instant::now();
    let mut buf = AlignedBuf::zeroed(4096);
    let err = client.read(0, &mut buf).unwrap_err();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(start.elapsed() < Duration::from_millis(2500));
    // The silent connection was abandoned; a fresh one serves what the server still does.
    client
        .write(0, &pattern(4096, 1), WriteFlags::default())
        .unwrap();
    assert!(client.is_connected());
}

#[test]
fn an_export_that_comes_back_with_another_size_fails_the_device() {
    let dir = scratch("resized");
    let server = nbdkit(&dir, &["memory", "64M"]);
    let client = connect(&uri(&dir), options(Duration::from_secs(5)));
    kill_server(server, &client);
    let _server = nbdkit(&dir, &["memory", "32M"]);
    let start = Instant::now();
    let mut buf = AlignedBuf::zeroed(4096);
    let err = client.read(0, &mut buf).unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    assert!(err.to_string().contains("changed size"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(4));
    assert!(!client.is_connected());
    let err = client.write(0, &buf, WriteFlags::default()).unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
}

#[test]
fn a_client_made_disconnected_connects_once_the_server_is_there() {
    let dir = scratch("later");
    let (data, file_arg) = patterned_image(&dir, 21);
    let client = Arc::new(
        NbdClient::disconnected(&uri(&dir), options(Duration::from_secs(10)), 4 * MIB).unwrap(),
    );
    assert_eq!(client.size(), 4 * MIB);
    assert!(!client.is_connected());
    let waiting = read_in_background(&client, MIB);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiting.is_finished());
    let _server = nbdkit(&dir, &["file", &file_arg]);
    let got = waiting
        .join()
        .unwrap()
        .expect("the read waits for the server");
    assert!(got[..] == data[MIB as usize..][..65536]);
    assert!(client.is_connected());

    // The size it was made with is checked against the server's.
    let wrong =
        NbdClient::disconnected(&uri(&dir), options(Duration::from_secs(5)), 8 * MIB).unwrap();
    let mut buf = AlignedBuf::zeroed(4096);
    let err = wrong.read(0, &mut buf).unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    assert!(err.to_string().contains("changed size"), "{err}");
}

#[test]
fn a_server_shutting_down_is_let_go_and_its_successor_serves_the_request() {
    for structured in [true, false] {
        let dir = scratch("eshutdown");
        let (data, file_arg) = patterned_image(&dir, 22);
        // Reads take 5 s, so one is in flight when the server is told to stop; nbdkit then
        // answers it (and anything after it) with ESHUTDOWN and waits for us to hang up.
        let mut args = vec!["--filter=delay", "file", &file_arg, "rdelay=5"];
        if !structured {
            args.insert(0, "--no-sr");
        }
        let mut server = nbdkit(&dir, &args);
        let client = Arc::new(connect(&uri(&dir), options(Duration::from_secs(20))));
        let in_flight = read_in_background(&client, MIB);
        std::thread::sleep(Duration::from_millis(300));
        unsafe { libc::kill(server.0.id() as i32, libc::SIGTERM) };
        wait_until(
            "nbdkit exits (the client hangs up)",
            Duration::from_secs(4),
            || matches!(server.0.try_wait(), Ok(Some(_))),
        );
        assert!(
            !in_flight.is_finished(),
            "the request failed instead of waiting"
        );
        let _server = nbdkit(&dir, &["file", &file_arg]);
        let got = in_flight
            .join()
            .unwrap()
            .expect("the request is resent to the new server");
        assert!(got[..] == data[MIB as usize..][..65536]);
    }
}

#[test]
fn closing_fails_waiting_requests_at_once() {
    let dir = scratch("close");
    let server = nbdkit(&dir, &["memory", "64M"]);
    let client = Arc::new(connect(&uri(&dir), options(Duration::from_secs(30))));
    drop(server);
    let waiting = {
        let client = client.clone();
        std::thread::spawn(move || {
            let mut buf = AlignedBuf::zeroed(4096);
            client.read(0, &mut buf)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiting.is_finished());
    let start = Instant::now();
    client.close();
    let err = waiting.join().unwrap().unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(err.errno(), libc::ESHUTDOWN, "{err}");
}

#[test]
fn a_read_only_client_does_not_wait_for_a_dead_server_to_flush() {
    let dir = scratch("ro-flush");
    let server = nbdkit(&dir, &["memory", "64M"]);
    let options = ClientOptions {
        read_only: true,
        ..options(Duration::from_secs(30))
    };
    let client = connect(&uri(&dir), options);
    drop(server);
    let start = Instant::now();
    client.flush().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
}

/// A write the server acknowledged but did not make durable dies with the server: nbdkit's
/// cache filter keeps writes in memory until a flush, and nbdkit is killed and restarted
/// between a write and the flush after it. That flush went to the new server, succeeded,
/// and told the caller the write was durable while the image did not have it (found by
/// hand). It fails now, once; the next flush covers what was written since.
#[test]
fn a_flush_after_the_server_lost_acknowledged_writes_fails() {
    let mut cached = WritebackCache::start("lost-writes", 13, options(Duration::from_secs(10)));
    let client = &cached.client;
    client
        .write(0, &pattern(4096, 14), WriteFlags::default())
        .unwrap();
    client.flush().unwrap();
    client
        .write(MIB, &pattern(4096, 15), WriteFlags::default())
        .unwrap();
    cached.crash_and_restart();
    let (client, data) = (&cached.client, &cached.data);
    let err = client
        .flush()
        .expect_err("a flush vouched for a write the server lost");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    // The flushed write survived the crash; the other did not, as the failed flush said.
    assert!(read(client, 0, 4096)[..] == pattern(4096, 14)[..]);
    assert!(read(client, MIB, 4096)[..] == data[MIB as usize..][..4096]);
    client
        .write(MIB, &pattern(4096, 15), WriteFlags::default())
        .unwrap();
    client.flush().unwrap();
}

/// A server that closes quiet connections (udm's own, after `--nbd-idle-timeout`) ended the
/// connection of a client whose last writes no flush had covered, and the client took that
/// for a crash: the next flush failed with EIO though nothing was lost (found by hand: a
/// `linear` over another daemon's export, a write, a quiet spell, a flush). A quiet client
/// flushes such writes itself now, before an idle timeout can come.
#[test]
fn a_server_closing_a_quiet_connection_fails_no_flush() {
    let dir = scratch("idle-close");
    let config = ServerConfig {
        idle_timeout: Some(Duration::from_secs(5)),
        ..ServerConfig::default()
    };
    let (uri, catalog) = udm_server_with(&dir, Arc::new(MemoryDevice::new(4 * MIB)), config);
    let client = connect(&uri, options(Duration::from_secs(10)));
    let connected = catalog.opened();
    client
        .write(0, &pattern(4096, 18), WriteFlags::default())
        .unwrap();
    // Quiet for longer than the server's idle timeout: the server closes the connection, and
    // the client connects again.
    std::thread::sleep(Duration::from_secs(11));
    assert!(
        catalog.opened() > connected,
        "the server closed no connection"
    );
    client.flush().unwrap();
    assert!(read(&client, 0, 4096)[..] == pattern(4096, 18)[..]);
}

/// The flush a quiet client sends itself makes its writes durable: a server with a writeback
/// cache killed after the quiet spell has them (before, they were lost, and the next flush
/// said so).
#[test]
fn a_quiet_client_has_its_writes_flushed() {
    let mut cached = WritebackCache::start("quiet-flush", 19, options(Duration::from_secs(10)));
    cached
        .client
        .write(MIB, &pattern(4096, 20), WriteFlags::default())
        .unwrap();
    std::thread::sleep(Duration::from_secs(6));
    cached.crash_and_restart();
    cached.client.flush().unwrap();
    assert!(read(&cached.client, MIB, 4096)[..] == pattern(4096, 20)[..]);
}

/// A fail-fast client (a multipath's path) reports the lost writes to a flush that finds no
/// connection too, as a kind of error of its own: a multipath would take "not connected" for
/// a path failure and cover the flush down another path, which never had these writes.
#[test]
fn a_fail_fast_flush_without_a_connection_reports_lost_writes() {
    let mut cached = WritebackCache::start(
        "lost-writes-fail-fast",
        16,
        fail_fast(Duration::from_secs(10)),
    );
    let client = &cached.client;
    client
        .write(0, &pattern(4096, 17), WriteFlags::default())
        .unwrap();
    cached.crash();
    let client = &cached.client;
    let err = client.flush().expect_err("no connection");
    assert!(matches!(err, BlockError::WritesLost(_)), "{err}");
    assert_eq!(err.errno(), libc::EIO);
    // Said once: the next flush fails for want of a connection alone.
    let err = client.flush().expect_err("no connection");
    assert!(matches!(err, BlockError::Io(_)), "{err}");
}

/// nbdkit serving a patterned image behind a writeback cache, and a client of it: a write
/// lives in nbdkit's memory until a flush, so killing nbdkit loses the writes since the last
/// one, as a server's crash would.
struct WritebackCache {
    client: NbdClient,
    server: Option<Server>,
    /// The image as it was written before the client's first write.
    data: AlignedBuf,
    file_arg: String,
    dir: TempDir,
}

impl WritebackCache {
    fn start(name: &str, seed: u64, options: ClientOptions) -> Self {
        let dir = scratch(name);
        let (data, file_arg) = patterned_image(&dir, seed);
        let server = nbdkit(&dir, &Self::args(&file_arg));
        let client = connect(&uri(&dir), options);
        Self {
            client,
            server: Some(server),
            data,
            file_arg,
            dir,
        }
    }

    fn args(file_arg: &str) -> [&str; 4] {
        ["--filter=cache", "file", file_arg, "cache=writeback"]
    }

    /// Kills nbdkit and waits until the client has seen it go.
    fn crash(&mut self) {
        kill_server(self.server.take().expect("a server"), &self.client);
    }

    /// Kills nbdkit and starts it again on the image as the crash left it.
    fn crash_and_restart(&mut self) {
        self.crash();
        self.server = Some(nbdkit(&self.dir, &Self::args(&self.file_arg)));
    }
}

/// Kills the server and waits until `client` has seen it go.
fn kill_server(server: Server, client: &NbdClient) {
    drop(server);
    wait_until(
        "the client sees the server gone",
        Duration::from_secs(2),
        || !client.is_connected(),
    );
}

/// A server that lost acknowledged writes may come back read-only, or without FLUSH (a
/// write-through server, by the protocol): the flush after had nothing to send, succeeded,
/// and the loss was never told, on the synchronous way and as a mapped flush alike (found by
/// reading `flush`). Both report it now, once.
#[test]
fn lost_writes_are_reported_by_a_server_back_read_only_or_without_flush() {
    for successor in ["read-only", "no-flush"] {
        let name = format!("lost-writes-{successor}");
        let mut cached = WritebackCache::start(&name, 21, options(Duration::from_secs(10)));
        cached
            .client
            .write(MIB, &pattern(4096, 22), WriteFlags::default())
            .unwrap();
        cached.crash();
        let args = match successor {
            "read-only" => vec!["-r".into(), "file".into(), cached.file_arg.clone()],
            _ => without_flush(&cached.dir.path("disk.img")),
        };
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let _server = nbdkit(&cached.dir, &args);
        let (client, data) = (&cached.client, &cached.data);
        wait_until("the client is back", Duration::from_secs(10), || {
            client.is_connected()
        });
        // A mapped flush must not be done at once: the executor would answer it as a success.
        let mapped = client.map(udm_block::MapOp::Flush, 0, 0);
        assert!(
            mapped.is_none_or(|m| !m.is_ready()),
            "{successor}: a mapped flush vouched for a write the server lost"
        );
        let err = client
            .flush()
            .expect_err("a flush vouched for a write the server lost");
        assert!(
            matches!(err, BlockError::WritesLost(_)),
            "{successor}: {err}"
        );
        assert!(read(client, MIB, 4096)[..] == data[MIB as usize..][..4096]);
        // Said once.
        client.flush().unwrap();
    }
}

/// nbdkit's arguments for a writable export of `image` that does not advertise FLUSH.
fn without_flush(image: &std::path::Path) -> Vec<String> {
    let image = image.display();
    vec![
        "eval".into(),
        format!("get_size=stat -c %s {image}"),
        format!("pread=dd if={image} iflag=skip_bytes,count_bytes skip=$4 count=$3 status=none"),
        format!("pwrite=dd of={image} oflag=seek_bytes conv=notrunc seek=$4 status=none"),
    ]
}
