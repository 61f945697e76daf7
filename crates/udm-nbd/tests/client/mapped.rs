//! Mapped requests: the client's transfers, started as the NBD event loop starts them, sent
//! from the starting thread and completed by the client's reader, with no thread waiting.

use super::*;
use std::sync::mpsc;
use udm_block::{MapOp, Ready};

/// How a mapped request ended.
#[derive(Debug)]
enum Ended {
    Done,
    Failed(udm_block::BlockError),
    Retry,
}

/// Asserts that a mapped request failed for want of a reply, after a time in `within`.
fn assert_no_reply(ended: Ended, took: Duration, within: std::ops::Range<Duration>) {
    let Ended::Failed(e) = ended else {
        panic!("{ended:?}")
    };
    assert!(e.to_string().contains("no reply within"), "{e}");
    assert!(within.contains(&took), "failed after {took:?}");
}

/// Maps `op` and runs the mapping as an executor does, with `buf` as the request's buffer;
/// returns how it ended and how long it took. Panics if the client does not map it.
fn run(dev: &dyn BlockDevice, op: MapOp, offset: u64, buf: &mut [u8]) -> (Ended, Duration) {
    let mapping = dev.map(op, offset, buf.len() as u64).expect("mapped");
    assert!(!mapping.is_ready(), "a remote request is a transfer");
    let started = Instant::now();
    let (tx, rx) = mpsc::channel();
    // SAFETY: `buf` is not touched until the transfer has ended (the wait below).
    unsafe {
        mapping.when_ready_with(buf.as_mut_ptr(), move |ready| {
            let ended = match ready {
                Ready::Go(mapping) => {
                    assert!(mapping.pieces.is_empty());
                    Ended::Done
                }
                Ready::Failed(e) => Ended::Failed(e),
                Ready::Retry => Ended::Retry,
            };
            tx.send(ended).unwrap()
        })
    };
    let ended = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the transfer ends");
    (ended, started.elapsed())
}

#[test]
fn mapped_reads_writes_and_flushes_complete_without_a_waiting_thread() {
    let dir = scratch("mapped");
    let (data, file_arg) = patterned_image(&dir, 3);
    let _server = nbdkit(&dir, &["file", &file_arg]);
    let client = connect(&uri(&dir), options(Duration::from_secs(30)));
    let mut buf = AlignedBuf::zeroed(65536);
    let (ended, _) = run(&client, MapOp::Read, MIB, &mut buf);
    assert!(matches!(ended, Ended::Done), "{ended:?}");
    assert!(buf[..] == data[MIB as usize..][..65536]);
    let mut written = pattern(8192, 4);
    for op in [MapOp::Write { fua: false }, MapOp::Write { fua: true }] {
        let (ended, _) = run(&client, op, 2 * MIB, &mut written);
        assert!(matches!(ended, Ended::Done), "{ended:?}");
    }
    let (ended, _) = run(&client, MapOp::Flush, 0, &mut []);
    assert!(matches!(ended, Ended::Done), "{ended:?}");
    assert!(read(&client, 2 * MIB, 8192)[..] == written[..]);
    // Discards and write-zeroes are not transfers: they go the synchronous way.
    for op in [
        MapOp::Discard { fua: false },
        MapOp::WriteZeroes {
            may_unmap: true,
            fast_only: false,
            fua: false,
        },
    ] {
        assert!(client.map(op, 0, 4096).is_none());
    }
}

#[test]
fn many_mapped_requests_in_flight_land_in_their_own_buffers() {
    let dir = scratch("mapped-many");
    let (data, file_arg) = patterned_image(&dir, 5);
    let _server = nbdkit(&dir, &["--threads=8", "file", &file_arg]);
    let client = connect(&uri(&dir), options(Duration::from_secs(30)));
    let (tx, rx) = mpsc::channel();
    let mut bufs: Vec<AlignedBuf> = (0..64).map(|_| AlignedBuf::zeroed(4096)).collect();
    for (i, buf) in bufs.iter_mut().enumerate() {
        let mapping = client.map(MapOp::Read, i as u64 * 8192, 4096).unwrap();
        let tx = tx.clone();
        // SAFETY: every buffer outlives the waits below and is untouched until then.
        unsafe {
            mapping.when_ready_with(buf.as_mut_ptr(), move |ready| {
                tx.send((i, matches!(ready, Ready::Go(_)))).unwrap()
            })
        };
    }
    for _ in 0..64 {
        let (i, ok) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(ok, "request {i} failed");
    }
    for (i, buf) in bufs.iter().enumerate() {
        assert!(buf[..] == data[i * 8192..][..4096], "request {i}");
    }
}

#[test]
fn a_mapped_request_whose_connection_breaks_asks_for_a_retry() {
    // Reads hang for 20 s: the request is in flight when the server dies.
    let dir = scratch("mapped-lost");
    let server = nbdkit(&dir, &["--filter=delay", "memory", "64M", "delay-read=20"]);
    let client = Arc::new(connect(&uri(&dir), options(Duration::from_secs(30))));
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(server)
    });
    let mut buf = AlignedBuf::zeroed(4096);
    let (ended, took) = run(&*client, MapOp::Read, 0, &mut buf);
    killer.join().unwrap();
    // The synchronous way resends it once the connection is back (or fails it fast).
    assert!(matches!(ended, Ended::Retry), "{ended:?}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    // With no connection, a request asks for a retry at once: the synchronous way waits.
    wait_until("the client sees the break", Duration::from_secs(5), || {
        !client.is_connected()
    });
    let (ended, took) = run(&*client, MapOp::Read, 0, &mut buf);
    assert!(matches!(ended, Ended::Retry), "{ended:?}");
    assert!(took < Duration::from_millis(100), "took {took:?}");
}

#[test]
fn a_mapped_request_to_a_server_that_stops_answering_fails_after_io_timeout() {
    let dir = scratch("mapped-stalled");
    let _server = nbdkit(&dir, &["--filter=delay", "memory", "64M", "delay-read=20"]);
    let client = connect(&uri(&dir), options(Duration::from_secs(1)));
    let mut buf = AlignedBuf::zeroed(4096);
    let (ended, took) = run(&client, MapOp::Read, 0, &mut buf);
    assert_no_reply(
        ended,
        took,
        Duration::from_millis(900)..Duration::from_millis(2500),
    );
    // The silent connection was abandoned; a fresh one serves what the server still does.
    let mut data = pattern(4096, 1);
    wait_until("the client is back", Duration::from_secs(10), || {
        client.is_connected()
    });
    let (ended, _) = run(&client, MapOp::Write { fua: false }, 0, &mut data);
    assert!(matches!(ended, Ended::Done), "{ended:?}");
}

#[test]
fn a_mapped_request_the_server_alone_leaves_unanswered_fails_and_the_connection_stays() {
    let dir = scratch("mapped-slow-one");
    // Reads at offset 0 hang for 20 s; the others answer at once.
    let _server = nbdkit(
        &dir,
        &[
            "eval",
            "thread_model=echo parallel",
            "get_size=echo 64M",
            "pread=if [ \"$4\" = 0 ]; then sleep 20; fi; head -c $3 /dev/zero",
        ],
    );
    // A shell per read is slow on a loaded machine: a timeout that leaves it time.
    let client = Arc::new(connect(&uri(&dir), options(Duration::from_secs(3))));
    let stalled = {
        let client = client.clone();
        std::thread::spawn(move || {
            let mut buf = AlignedBuf::zeroed(4096);
            run(&*client, MapOp::Read, 0, &mut buf)
        })
    };
    // Other requests keep being answered meanwhile, on the same connection.
    while !stalled.is_finished() {
        assert!(client.is_connected());
        read(&*client, MIB, 4096);
        std::thread::sleep(Duration::from_millis(50));
    }
    let (ended, took) = stalled.join().unwrap();
    assert_no_reply(
        ended,
        took,
        Duration::from_millis(2900)..Duration::from_millis(4500),
    );
    assert!(client.is_connected());
    // Later requests are answered in step on the same connection (the late reply, when it
    // comes, is dropped).
    assert!(read(&*client, 2 * MIB, 4096).iter().all(|&b| b == 0));
    assert!(client.is_connected());
}

#[test]
fn a_client_whose_last_owner_is_a_mapped_requests_completion_is_let_go() {
    let dir = scratch("mapped-last-owner");
    let _server = nbdkit(&dir, &["memory", "64M"]);
    let client = connect(
        &uri_for(&dir, "last-owner"),
        options(Duration::from_secs(30)),
    );
    let mapping = client.map(MapOp::Read, 0, 4096).unwrap();
    let mut buf = AlignedBuf::zeroed(4096);
    let (tx, rx) = mpsc::channel();
    // SAFETY: `buf` is untouched until the transfer has ended (the wait below).
    unsafe {
        mapping.when_ready_with(buf.as_mut_ptr(), move |ready| {
            // The completion runs on the client's own thread, and drops the client there.
            drop(client);
            tx.send(matches!(ready, Ready::Go(_))).unwrap()
        })
    };
    assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap());
    wait_until("the client's thread ends", Duration::from_secs(5), || {
        !thread_named("nbd-client-last")
    });
}

/// Starts `op` on each buffer (at its index × its length) as an executor does; each sends
/// its index and how it ended on the channel it returns.
fn start_each(
    dev: &dyn BlockDevice,
    op: MapOp,
    bufs: &mut [AlignedBuf],
) -> mpsc::Receiver<(usize, Ended)> {
    let (tx, rx) = mpsc::channel();
    for (i, buf) in bufs.iter_mut().enumerate() {
        let len = buf.len() as u64;
        let mapping = dev.map(op, i as u64 * len, len).expect("mapped");
        let tx = tx.clone();
        // SAFETY: the callers keep every buffer untouched until its request has ended.
        unsafe {
            mapping.when_ready_with(buf.as_mut_ptr(), move |ready| {
                let ended = match ready {
                    Ready::Go(_) => Ended::Done,
                    Ready::Failed(e) => Ended::Failed(e),
                    Ready::Retry => Ended::Retry,
                };
                tx.send((i, ended)).unwrap()
            })
        };
    }
    rx
}

#[test]
fn requests_started_in_one_batch_go_out_together_when_it_ends() {
    let dir = scratch("mapped-batch");
    let _server = nbdkit(&dir, &["memory", "64M"]);
    let client = connect(&uri(&dir), options(Duration::from_secs(30)));
    let mut bufs: Vec<AlignedBuf> = (0..32).map(|i| pattern(4096, 100 + i)).collect();
    let batch = udm_block::Batch::open();
    let ended = start_each(&client, MapOp::Write { fua: false }, &mut bufs);
    // Nothing went out yet, so nothing came back.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        ended.try_recv().is_err(),
        "a request was sent before the batch ended"
    );
    drop(batch);
    for _ in 0..32 {
        let (i, how) = ended.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(matches!(how, Ended::Done), "request {i}: {how:?}");
    }
    for (i, buf) in bufs.iter().enumerate() {
        assert!(
            read(&client, i as u64 * 4096, 4096)[..] == buf[..],
            "request {i}"
        );
    }
}

#[test]
fn a_batch_whose_server_dies_while_it_is_written_has_every_request_retried() {
    // Writes wait 20 s in the server: its threads stop reading, the socket fills, and the
    // batch's write blocks until the server is killed.
    let dir = scratch("mapped-batch-killed");
    let server = nbdkit(&dir, &["--filter=delay", "memory", "64M", "delay-write=20"]);
    let client = connect(&uri(&dir), options(Duration::from_secs(30)));
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        drop(server)
    });
    let mut bufs: Vec<AlignedBuf> = (0..48).map(|i| pattern(256 << 10, i)).collect();
    let started = Instant::now();
    let batch = udm_block::Batch::open();
    let ended = start_each(&client, MapOp::Write { fua: false }, &mut bufs);
    drop(batch);
    killer.join().unwrap();
    for _ in 0..48 {
        let (i, how) = ended.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(matches!(how, Ended::Retry), "request {i}: {how:?}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// A mapped request is started on the executor's thread (an NBD event loop serving many
/// connections), which must never wait. Its send waited for the socket: to a server that
/// stopped reading (a hung process, a full TCP window), a 4 MiB write held the starting
/// thread until the socket's send timeout, `io_timeout`, and with it every other connection
/// of that event loop (found by reading `send_outbox`). What the socket cannot take at once
/// is now left to a thread of its own.
#[test]
fn starting_a_mapped_write_to_a_server_that_stopped_reading_does_not_wait() {
    let dir = scratch("mapped-stopped-reading");
    let server = nbdkit(&dir, &["memory", "64M"]);
    let client = connect(&uri(&dir), options(Duration::from_secs(5)));
    let pid = server.0.id() as libc::pid_t;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let mut data = pattern(4 << 20, 23);
    let mapping = client
        .map(MapOp::Write { fua: false }, MIB, data.len() as u64)
        .expect("mapped");
    let (tx, rx) = mpsc::channel();
    let started = Instant::now();
    // SAFETY: `data` is not touched until the transfer has ended (the wait below).
    unsafe {
        mapping.when_ready_with(data.as_mut_ptr(), move |ready| {
            tx.send(matches!(ready, Ready::Go(_))).unwrap()
        })
    };
    let took = started.elapsed();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(
        took < Duration::from_millis(500),
        "starting the write took {took:?}"
    );
    let done = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the write ends");
    assert!(done, "the write failed once the server read again");
    assert!(read(&client, MIB, data.len())[..] == data[..]);
}
