//! What goes wrong reaches the caller: server errors with their errno, read-only exports,
//! failed connects, and a minimal server's quirks.

use super::*;

#[test]
fn server_errors_reach_the_caller_with_their_errno() {
    for structured in [true, false] {
        let dir = scratch("errors");
        let mut args = vec![
            "--filter=error",
            "memory",
            "64M",
            "error-pread=EIO",
            "error-pread-rate=100%",
            "error-pwrite=ENOSPC",
            "error-pwrite-rate=100%",
            "error-zero=EINVAL",
            "error-zero-rate=100%",
            "error-trim=EPERM",
            "error-trim-rate=100%",
        ];
        if !structured {
            args.insert(0, "--no-sr");
        }
        let _server = nbdkit(&dir, &args);
        let client = connect(&uri(&dir), ClientOptions::default());
        let mut buf = AlignedBuf::zeroed(4096);
        let errno = |r: udm_block::Result<()>| r.unwrap_err().errno();
        assert_eq!(errno(client.read(0, &mut buf)), libc::EIO);
        assert_eq!(
            errno(client.write(0, &buf, WriteFlags::default())),
            libc::ENOSPC
        );
        assert_eq!(
            errno(client.write_zeroes(0, 4096, ZeroFlags::default())),
            libc::EINVAL
        );
        assert_eq!(errno(client.discard(0, 4096)), libc::EPERM);
        // Errors are answers, not broken connections.
        assert!(client.is_connected());
        client.flush().unwrap();
    }
}

#[test]
fn read_only_exports_and_clients_refuse_writes() {
    let dir = scratch("ro");
    let _server = nbdkit(&dir, &["-r", "memory", "64M"]);
    let client = connect(&uri(&dir), ClientOptions::default());
    assert!(client.capabilities().read_only);
    let buf = AlignedBuf::zeroed(4096);
    let err = client.write(0, &buf, WriteFlags::default()).unwrap_err();
    assert_eq!(err.errno(), libc::EPERM);

    let dir = scratch("ro-option");
    let _server = nbdkit(&dir, &["memory", "64M"]);
    let client = connect(
        &uri(&dir),
        ClientOptions {
            read_only: true,
            ..ClientOptions::default()
        },
    );
    assert!(client.capabilities().read_only);
    assert_eq!(client.discard(0, 4096).unwrap_err().errno(), libc::EPERM);
    assert_eq!(
        client
            .write_zeroes(0, 4096, ZeroFlags::default())
            .unwrap_err()
            .errno(),
        libc::EPERM
    );
    read(&client, 0, 4096);
}

#[test]
fn connect_reports_what_went_wrong() {
    let dir = scratch("connect");
    let missing = NbdClient::connect(&uri(&dir), ClientOptions::default());
    assert!(matches!(missing, Err(ClientError::Connect { .. })));

    let bad = NbdClient::connect("nbd://host:99999/x", ClientOptions::default());
    assert!(matches!(bad, Err(ClientError::Uri(_))));

    let unknown =
        udm_server(&dir, Arc::new(MemoryDevice::new(4 * MIB))).replace("///vol", "///nope");
    match NbdClient::connect(&unknown, ClientOptions::default()) {
        Err(ClientError::Refused {
            export, message, ..
        }) => {
            assert_eq!(export, "nope");
            assert!(message.contains("nope"), "{message}");
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }

    let dir = scratch("oldstyle");
    let _server = nbdkit(&dir, &["-o", "memory", "4M"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let err = loop {
        match NbdClient::connect(&uri(&dir), ClientOptions::default()) {
            Err(ClientError::Connect { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => break e,
            Ok(_) => panic!("an oldstyle server was accepted"),
        }
    };
    assert!(err.to_string().contains("oldstyle"), "{err}");
}

/// The least a fixed-newstyle server can be: every option but NBD_OPT_EXPORT_NAME is refused
/// as unsupported, replies are simple, and the 124 zero bytes are always sent. It serves one
/// connection after another until a client says goodbye with NBD_CMD_DISC.
struct MinimalServer {
    disk: Mutex<Vec<u8>>,
    /// How the first request of the first connection is answered.
    first: First,
    connections: AtomicUsize,
    saw_disc: AtomicBool,
}

/// How a [`MinimalServer`] answers the first request it is sent.
#[derive(Clone, Copy, PartialEq, Eq)]
enum First {
    Right,
    /// With bytes that are no reply.
    Garbage,
    /// With a reply under a cookie the client never sent.
    BogusCookie,
    /// With structured replies negotiated (on that connection only), with two data chunks
    /// that both carry the first half of the read and add up to its length.
    OverlappingChunks,
    /// With a reply header and half the read's data, and then nothing.
    HalfReply,
    /// With structured replies and `base:allocation` negotiated (on that connection only),
    /// with two block status chunks for the context: data for the first half of the range,
    /// then a hole for the second half.
    TwoStatusChunks,
}

impl MinimalServer {
    fn start(dir: &TempDir, first: First) -> (Arc<MinimalServer>, JoinHandle<()>) {
        let listener = UnixListener::bind(socket(dir)).unwrap();
        let server = Arc::new(MinimalServer {
            disk: Mutex::new(vec![0u8; 4 * MIB as usize]),
            first,
            connections: AtomicUsize::new(0),
            saw_disc: AtomicBool::new(false),
        });
        let thread = std::thread::spawn({
            let server = server.clone();
            move || {
                for stream in listener.incoming() {
                    let first = match server.connections.fetch_add(1, Ordering::AcqRel) {
                        0 => server.first,
                        _ => First::Right,
                    };
                    if server.serve(stream.unwrap(), first) {
                        return;
                    }
                }
            }
        });
        (server, thread)
    }

    /// Serves one connection; true when it ended with NBD_CMD_DISC.
    fn serve(&self, mut s: UnixStream, first: First) -> bool {
        assert_eq!(greet(&mut s), CLIENT_FIXED_NEWSTYLE);
        loop {
            let mut header = [0u8; 16];
            s.read_exact(&mut header).unwrap();
            let option = u32::from_be_bytes(header[8..12].try_into().unwrap());
            let len = u32::from_be_bytes(header[12..16].try_into().unwrap());
            let mut data = vec![0u8; len as usize];
            s.read_exact(&mut data).unwrap();
            let structured = matches!(first, First::OverlappingChunks | First::TwoStatusChunks);
            if option == OPT_STRUCTURED_REPLY && structured {
                s.write_all(&option_reply(option, REP_ACK, &[])).unwrap();
                continue;
            }
            if option == OPT_SET_META_CONTEXT && first == First::TwoStatusChunks {
                let mut context = BASE_ALLOCATION_ID.to_be_bytes().to_vec();
                context.extend_from_slice(BASE_ALLOCATION.as_bytes());
                s.write_all(&option_reply(option, REP_META_CONTEXT, &context))
                    .unwrap();
                s.write_all(&option_reply(option, REP_ACK, &[])).unwrap();
                continue;
            }
            if option == OPT_EXPORT_NAME {
                let size = self.disk.lock().len() as u64;
                let mut reply = size.to_be_bytes().to_vec();
                reply.extend_from_slice(&(TF_HAS_FLAGS | TF_SEND_FLUSH).to_be_bytes());
                reply.extend_from_slice(&[0u8; 124]);
                s.write_all(&reply).unwrap();
                break;
            }
            s.write_all(&option_reply(option, REP_ERR_UNSUP, &[]))
                .unwrap();
        }
        loop {
            let mut header = [0u8; REQUEST_HEADER_LEN];
            if s.read_exact(&mut header).is_err() {
                return false;
            }
            let r = parse_request(&header).unwrap();
            let wrong = match first {
                First::Right => None,
                First::Garbage => Some([0xde; 16].to_vec()),
                First::BogusCookie => Some(simple_reply(r.cookie ^ 0x5a5a_0000, 0).to_vec()),
                First::OverlappingChunks => {
                    let half = r.length / 2;
                    let data = self.disk.lock()[r.offset as usize..][..half as usize].to_vec();
                    let mut chunks = Vec::new();
                    for flags in [0, CHUNK_FLAG_DONE] {
                        chunks.extend(chunk_header(flags, CHUNK_OFFSET_DATA, r.cookie, half + 8));
                        chunks.extend(r.offset.to_be_bytes());
                        chunks.extend(&data);
                    }
                    Some(chunks)
                }
                First::TwoStatusChunks => {
                    let half = r.length / 2;
                    let mut chunks = Vec::new();
                    for (flags, extent) in [(0, 0), (CHUNK_FLAG_DONE, EXTENT_HOLE | EXTENT_ZERO)] {
                        chunks.extend(chunk_header(flags, CHUNK_BLOCK_STATUS, r.cookie, 12));
                        chunks.extend(BASE_ALLOCATION_ID.to_be_bytes());
                        chunks.extend(half.to_be_bytes());
                        chunks.extend(extent.to_be_bytes());
                    }
                    Some(chunks)
                }
                First::HalfReply => {
                    let mut reply = simple_reply(r.cookie, 0).to_vec();
                    reply.resize(reply.len() + r.length as usize / 2, 0);
                    Some(reply)
                }
            };
            if let Some(wrong) = wrong {
                // Then wait for the client to hang up, as it must.
                s.write_all(&wrong).unwrap();
                let _ = s.read_to_end(&mut Vec::new());
                return false;
            }
            let range = r.offset as usize..(r.offset + u64::from(r.length)) as usize;
            match r.command {
                CMD_READ => {
                    let mut reply = simple_reply(r.cookie, 0).to_vec();
                    reply.extend_from_slice(&self.disk.lock()[range]);
                    s.write_all(&reply).unwrap();
                }
                CMD_WRITE => {
                    s.read_exact(&mut self.disk.lock()[range]).unwrap();
                    s.write_all(&simple_reply(r.cookie, 0)).unwrap();
                }
                CMD_FLUSH => s.write_all(&simple_reply(r.cookie, 0)).unwrap(),
                CMD_DISC => {
                    self.saw_disc.store(true, Ordering::Release);
                    return true;
                }
                _ => s.write_all(&simple_reply(r.cookie, NBD_EINVAL)).unwrap(),
            }
        }
    }
}

#[test]
fn a_server_without_options_is_reached_through_export_name() {
    let dir = scratch("minimal");
    let (server, thread) = MinimalServer::start(&dir, First::Right);
    let client = NbdClient::connect(&uri(&dir), ClientOptions::default()).unwrap();
    let caps = client.capabilities();
    assert!(!caps.native_fua && !caps.discard && !caps.fast_zero);
    let data = pattern(65536, 8);
    client.write(8192, &data, WriteFlags { fua: true }).unwrap();
    assert!(read(&client, 8192, 65536)[..] == data[..]);
    assert!(server.disk.lock()[8192..8192 + 65536] == data[..]);
    // No WRITE_ZEROES, TRIM, CACHE or block status: emulated or answered locally.
    client
        .write_zeroes(8192, 4096, ZeroFlags::default())
        .unwrap();
    assert!(read(&client, 8192, 4096).iter().all(|&b| b == 0));
    client.discard(0, 4096).unwrap();
    client.cache(0, 4096).unwrap();
    assert_eq!(
        client.block_status(0, MIB).unwrap(),
        vec![Extent::data(MIB)]
    );
    drop(client);
    thread.join().unwrap();
    assert!(
        server.saw_disc.load(Ordering::Acquire),
        "no NBD_CMD_DISC on drop"
    );
}

/// A read whose first answer is `first`'s breach of the protocol: the client hangs up and
/// reads again, right, on a second connection.
fn read_again_after(tag: &str, first: First, seed: u64) {
    let dir = scratch(tag);
    let (server, thread) = MinimalServer::start(&dir, first);
    server.disk.lock()[..4096].copy_from_slice(&pattern(4096, seed));
    let client = NbdClient::connect(&uri(&dir), options(Duration::from_secs(5))).unwrap();
    assert!(read(&client, 0, 4096)[..] == pattern(4096, seed)[..]);
    assert_eq!(server.connections.load(Ordering::Acquire), 2);
    drop(client);
    thread.join().unwrap();
}

#[test]
fn a_protocol_error_from_the_server_means_reconnect_and_resend() {
    read_again_after("garbage", First::Garbage, 4);
}

#[test]
fn a_reply_under_a_cookie_never_sent_means_reconnect_and_resend() {
    let dir = scratch("bogus-cookie");
    let (server, thread) = MinimalServer::start(&dir, First::BogusCookie);
    server.disk.lock()[..4096].copy_from_slice(&pattern(4096, 6));
    let client = NbdClient::connect(&uri(&dir), options(Duration::from_secs(5))).unwrap();
    // A mapped read: the first connection dies under it, and it asks for the synchronous
    // way, which reads on the second.
    let mut buf = AlignedBuf::zeroed(4096);
    let mapping = client.map(udm_block::MapOp::Read, 0, 4096).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    // SAFETY: `buf` is untouched until the transfer has ended (the wait below).
    unsafe {
        mapping.when_ready_with(buf.as_mut_ptr(), move |ready| {
            tx.send(matches!(ready, udm_block::Ready::Retry)).unwrap()
        })
    };
    assert!(
        rx.recv_timeout(Duration::from_secs(10)).unwrap(),
        "not retried"
    );
    assert!(read(&client, 0, 4096)[..] == pattern(4096, 6)[..]);
    assert_eq!(server.connections.load(Ordering::Acquire), 2);
    drop(client);
    thread.join().unwrap();
}

/// Overlapping chunks that add up to the read's length used to pass for a whole reply: the
/// half of the buffer no chunk covered kept what it held before (zeroes here, stale data in
/// a reused buffer). Found by reading the reply code; the server must not overlap chunks, so
/// the client takes it for a protocol error and reads again on a new connection.
#[test]
fn overlapping_read_chunks_are_a_protocol_error() {
    read_again_after("overlap", First::OverlappingChunks, 9);
}

/// One block status chunk per context, says the protocol. A second one for `base:allocation`
/// was taken for the runs after the first's: a server that sent data for the first half and
/// then a hole for the same first half had the second half, data, described as a hole, and a
/// copy by the map (nbdcopy through udm's export, a clone probing for zeroes) would have
/// written zeroes over it (found by reading the reply code). It is a protocol error now: the
/// client hangs up and asks again on a new connection.
#[test]
fn a_second_block_status_chunk_for_a_context_is_a_protocol_error() {
    let dir = scratch("two-status-chunks");
    let (server, thread) = MinimalServer::start(&dir, First::TwoStatusChunks);
    let client = NbdClient::connect(&uri(&dir), options(Duration::from_secs(5))).unwrap();
    // The second connection has no block status: all data.
    assert_eq!(
        client.block_status(0, MIB).unwrap(),
        vec![Extent::data(MIB)]
    );
    assert_eq!(server.connections.load(Ordering::Acquire), 2);
    drop(client);
    thread.join().unwrap();
}

/// One thread reads every client's replies, and it waits on no single server: one that
/// sends half a reply and stalls holds up no other client's reads. Its own read fails after
/// `io_timeout`, the connection dropped as a stalled one: the next read goes on a new one.
#[test]
fn a_server_stalled_in_the_middle_of_a_reply_holds_up_no_other_client() {
    let dir = scratch("half-reply");
    let (server, thread) = MinimalServer::start(&dir, First::HalfReply);
    let stalled = NbdClient::connect(&uri(&dir), options(Duration::from_secs(2))).unwrap();
    let other_dir = scratch("half-reply-other");
    let _other_server = nbdkit(&other_dir, &["memory", "64M"]);
    let other = connect(&uri(&other_dir), ClientOptions::default());
    let start = Instant::now();
    let waiting = std::thread::spawn(move || {
        let result = stalled.read(0, &mut AlignedBuf::zeroed(4096));
        (result, start.elapsed(), stalled)
    });
    let (mut reads, mut slowest) = (0, Duration::ZERO);
    while !waiting.is_finished() {
        let read_start = Instant::now();
        read(&other, reads * 4096, 4096);
        slowest = slowest.max(read_start.elapsed());
        reads += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    let (result, took, stalled) = waiting.join().unwrap();
    let err = result.unwrap_err();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(took >= Duration::from_millis(1900), "failed after {took:?}");
    assert!(reads >= 20, "{reads} reads meanwhile");
    assert!(slowest < Duration::from_secs(1), "a read took {slowest:?}");
    assert!(read(&stalled, 0, 4096).iter().all(|&b| b == 0));
    assert_eq!(server.connections.load(Ordering::Acquire), 2);
    drop(stalled);
    thread.join().unwrap();
}

/// qemu-nbd serves one client at a time unless told otherwise: a second one gets no greeting.
/// That said "handshake failed: Resource temporarily unavailable (os error 11)" after the
/// connect timeout (found by hand, creating a device over a qemu-nbd a clone already used).
#[test]
fn a_server_that_never_greets_is_reported_as_such() {
    let dir = scratch("busy");
    let image = dir.sparse("disk.img", 4 * MIB);
    let _server = qemu_nbd(&dir, &image, &[]);
    let _first = connect(&uri(&dir), ClientOptions::default());
    let options = ClientOptions {
        connect_timeout: Duration::from_millis(500),
        ..ClientOptions::default()
    };
    let err = NbdClient::connect(&uri(&dir), options)
        .err()
        .expect("a second client was served");
    let text = err.to_string();
    assert!(text.contains("no greeting within 500ms"), "{text}");
}

/// The connect timeout bounded each read of the handshake, not the handshake: a server that
/// answered NBD_OPT_GO with information without end (or trickled its replies a byte at a
/// time) held the dial for ever, and `udm create` with it the daemon's verbs (found by
/// reading `dial`). The whole handshake has the connect timeout now.
#[test]
fn a_server_that_never_ends_its_handshake_is_given_up_at_the_connect_timeout() {
    let dir = scratch("endless-handshake");
    go_server(&dir, |s| {
        let mut name = INFO_NAME.to_be_bytes().to_vec();
        name.extend_from_slice(b"more to come");
        while s.write_all(&option_reply(OPT_GO, REP_INFO, &name)).is_ok() {
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let options = ClientOptions {
        connect_timeout: Duration::from_secs(1),
        ..ClientOptions::default()
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let uri = uri(&dir);
    std::thread::spawn(move || {
        let started = Instant::now();
        let result = NbdClient::connect(&uri, options).map(drop);
        let _ = tx.send((result, started.elapsed()));
    });
    let (result, took) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the dial was still going after 20 s");
    let err = result.expect_err("an endless handshake was accepted");
    assert!(matches!(err, ClientError::Handshake { .. }), "{err}");
    assert!(took < Duration::from_secs(5), "given up after {took:?}");
}

/// A fixed-newstyle server's greeting; returns the client's flags.
fn greet(s: &mut UnixStream) -> u32 {
    let mut greeting = NBDMAGIC.to_be_bytes().to_vec();
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&FLAG_FIXED_NEWSTYLE.to_be_bytes());
    s.write_all(&greeting).unwrap();
    let mut word = [0u8; 4];
    s.read_exact(&mut word).unwrap();
    u32::from_be_bytes(word)
}

/// A server for one connection on the directory's socket that refuses every option until
/// NBD_OPT_GO, then has `answer` reply to it.
fn go_server(dir: &TempDir, answer: impl FnOnce(&mut UnixStream) + Send + 'static) {
    let listener = UnixListener::bind(socket(dir)).unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        greet(&mut s);
        loop {
            let mut header = [0u8; 16];
            s.read_exact(&mut header).unwrap();
            let option = u32::from_be_bytes(header[8..12].try_into().unwrap());
            let len = u32::from_be_bytes(header[12..16].try_into().unwrap());
            s.read_exact(&mut vec![0u8; len as usize]).unwrap();
            if option == OPT_GO {
                return answer(&mut s);
            }
            s.write_all(&option_reply(option, REP_ERR_UNSUP, &[]))
                .unwrap();
        }
    });
}
