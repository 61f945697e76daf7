//! Requests against every kind of server: the conformance suite on nbdkit, qemu-nbd and
//! udm's own, TCP and IPv6, block status, many requests in flight, requests split to the
//! server's maximum.

use super::*;

#[test]
fn conformance_against_nbdkit_memory() {
    let dir = scratch("memory");
    let _server = nbdkit(&dir, &["memory", "64M"]);
    let client = connect(&uri(&dir), ClientOptions::default());
    assert_eq!(client.size(), 64 * MIB);
    let caps = client.capabilities();
    assert!(caps.native_fua && caps.discard && caps.fast_zero && !caps.read_only);
    assert!(client.is_connected());
    conformance::run_all(&client);
    client.cache(0, 2 * MIB).unwrap();
}

#[test]
fn conformance_against_nbdkit_without_structured_replies() {
    // Simple replies only: read data follows the reply header, and there is no block status.
    let dir = scratch("no-sr");
    let _server = nbdkit(&dir, &["--no-sr", "memory", "64M"]);
    let client = connect(&uri(&dir), ClientOptions::default());
    conformance::run_all(&client);
    assert_eq!(
        client.block_status(0, 8 * MIB).unwrap(),
        vec![Extent::data(8 * MIB)]
    );
}

#[test]
fn conformance_against_qemu_nbd() {
    let dir = scratch("qemu");
    let image = dir.sparse("disk.img", 64 * MIB);
    let _server = qemu_nbd(&dir, &image, &["-e", "4", "--discard=unmap"]);
    let client = connect(&uri(&dir), ClientOptions::default());
    assert_eq!(client.size(), 64 * MIB);
    conformance::run_all(&client);
}

#[test]
fn conformance_against_udm_server() {
    let dir = scratch("udm");
    let uri = udm_server(&dir, Arc::new(MemoryDevice::new(64 * MIB)));
    let client = connect(&uri, ClientOptions::default());
    assert_eq!(client.size(), 64 * MIB);
    conformance::run_all(&client);
}

#[test]
fn tcp_and_ipv6_addresses_reach_the_server() {
    let _dir = scratch("tcp");
    let server = NbdServer::new(
        Arc::new(Devices::memory(&[("vol", 8 * MIB)])),
        ServerConfig::default(),
    )
    .unwrap();
    let v4 = server.listen_tcp("127.0.0.1:0").unwrap();
    let client = connect(
        &format!("nbd://127.0.0.1:{}/vol", v4.port()),
        ClientOptions::default(),
    );
    conformance::writes_read_back(&client);
    // IPv6 loopback may be missing in a container; test it where it exists.
    if let Ok(v6) = server.listen_tcp("[::1]:0") {
        let client = connect(
            &format!("nbd://[::1]:{}/vol", v6.port()),
            ClientOptions::default(),
        );
        assert!(read(&client, 0, 512)[..] == pattern(512, 1)[..]);
    }
}

#[test]
fn block_status_tells_holes_from_data() {
    let hole = |len| Extent {
        len,
        flags: EXTENT_HOLE | EXTENT_ZERO,
    };

    // qemu-nbd over a sparse file answers from SEEK_DATA/SEEK_HOLE.
    let dir = scratch("map");
    let image = dir.path("sparse.img");
    let mut file = std::fs::File::create(&image).unwrap();
    file.set_len(4 * MIB).unwrap();
    let data = pattern(65536, 5);
    std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(MIB)).unwrap();
    file.write_all(&data).unwrap();
    drop(file);
    let _server = qemu_nbd(&dir, &image, &["-r"]);
    let client = connect(&uri(&dir), ClientOptions::default());
    assert!(client.capabilities().read_only);
    assert_eq!(
        map(&client, 0, 4 * MIB),
        vec![hole(MIB), Extent::data(65536), hole(3 * MIB - 65536)]
    );
    assert!(read(&client, MIB, 65536)[..] == data[..]);
    assert!(read(&client, 0, 65536).iter().all(|&b| b == 0));

    // udm's server over a memory device: unwritten pages are holes.
    let dir = scratch("map-udm");
    let uri = udm_server(&dir, Arc::new(MemoryDevice::new(4 * MIB)));
    let client = connect(&uri, ClientOptions::default());
    client
        .write(8192, &pattern(4096, 1), WriteFlags::default())
        .unwrap();
    assert_eq!(
        map(&client, 0, MIB),
        vec![hole(8192), Extent::data(4096), hole(MIB - 12288)]
    );
    // A read of a hole comes back as a hole chunk, which must zero the caller's buffer.
    let mut buf = AlignedBuf::zeroed(8192);
    buf.fill(0xff);
    client.read(0, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
}

#[test]
fn many_requests_in_flight_from_many_threads() {
    const THREADS: u64 = 8;
    const WRITES: usize = 200;
    const REGION: u64 = 8 * MIB;
    let dir = scratch("threads");
    let _server = nbdkit(&dir, &["memory", "64M"]);
    let client = connect(&uri(&dir), ClientOptions::default());
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let client = &client;
            s.spawn(move || {
                let base = t * REGION;
                let mut rng = Rng::new(t);
                let mut written = std::collections::HashMap::new();
                for i in 0..WRITES {
                    let block = rng.below(REGION / 4096);
                    let seed = t << 32 | i as u64;
                    client
                        .write(
                            base + block * 4096,
                            &pattern(4096, seed),
                            WriteFlags::default(),
                        )
                        .unwrap();
                    written.insert(block, seed);
                }
                for (block, seed) in written {
                    assert!(
                        read(client, base + block * 4096, 4096)[..] == pattern(4096, seed)[..],
                        "thread {t} block {block}"
                    );
                }
            });
        }
    });
}

#[test]
fn requests_beyond_the_servers_maximum_are_split() {
    let dir = scratch("split");
    let _server = nbdkit(
        &dir,
        &[
            "--filter=blocksize-policy",
            "memory",
            "64M",
            "blocksize-maximum=64K",
            "blocksize-error-policy=error",
        ],
    );
    let client = connect(&uri(&dir), ClientOptions::default());
    let data = pattern(MIB as usize + 4096, 3);
    client.write(4096, &data, WriteFlags { fua: true }).unwrap();
    assert!(read(&client, 4096, data.len())[..] == data[..]);
    client
        .write_zeroes(4096, MIB, ZeroFlags::default())
        .unwrap();
    let after = read(&client, 4096, data.len());
    assert!(after[..MIB as usize].iter().all(|&b| b == 0));
    assert!(after[MIB as usize..] == data[MIB as usize..]);
    client.cache(0, 4 * MIB).unwrap();
    client.discard(0, 16 * MIB).unwrap();
}

#[test]
fn one_thread_reads_the_replies_of_every_client_and_theirs_sleep() {
    let dir = scratch("one-reader");
    let _server = nbdkit(&dir, &["memory", "64M"]);
    // nbdkit serves any export name; these name the clients' threads.
    let clients = [
        connect(&uri_for(&dir, "ra"), ClientOptions::default()),
        connect(&uri_for(&dir, "rb"), ClientOptions::default()),
    ];
    wait_until("the clients' threads run", Duration::from_secs(2), || {
        thread_named("nbd-client-ra") && thread_named("nbd-client-rb")
    });
    let before = thread_switches("nbd-client-ra") + thread_switches("nbd-client-rb");
    for i in 0..200 {
        for client in &clients {
            read(client, i * 4096, 4096);
        }
    }
    // 400 replies came in: had the clients' own threads read them, they would have been
    // woken for most of them. The process's one reply reader did.
    let after = thread_switches("nbd-client-ra") + thread_switches("nbd-client-rb");
    assert!(
        after - before < 20,
        "the clients' threads were switched {} times",
        after - before
    );
    assert_eq!(threads_named("nbd-replies"), 1);
}
