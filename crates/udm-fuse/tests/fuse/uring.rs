//! Over io_uring: mapped requests go to the engine, a slow device does not hold up a fast
//! one, and an unmount with requests in flight ends in bounded time.

use super::*;

/// A device whose data lives in a file the engine can reach (`map()`), and whose own
/// synchronous methods fail: what succeeds through the mount was served by the engine.
struct MapOnly(FileDevice);

impl BlockDevice for MapOnly {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read(&self, _: u64, _: &mut [u8]) -> udm_block::Result<()> {
        Err(udm_block::BlockError::NotSupported(
            "synchronous read".into(),
        ))
    }
    fn write(&self, _: u64, _: &[u8], _: WriteFlags) -> udm_block::Result<()> {
        Err(udm_block::BlockError::NotSupported(
            "synchronous write".into(),
        ))
    }
    fn flush(&self) -> udm_block::Result<()> {
        Err(udm_block::BlockError::NotSupported(
            "synchronous flush".into(),
        ))
    }
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        self.0.map(op, offset, len)
    }
}

fn open_direct(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap()
}

#[test]
fn over_io_uring_mapped_requests_go_to_the_engine() {
    if !can_run() {
        return;
    }
    // Three threads per queue, dealt 11, 11 and 10 of its entries.
    let config = FuseConfig {
        io_uring: UringMode::On,
        threads_per_queue: 3,
        ..FuseConfig::default()
    };
    let (dir, catalog, export) = mounted_with("engine", config, |dir, catalog| {
        let file = file_device(dir, "backing.img", 8 * MIB);
        catalog.add("vol", Arc::new(MapOnly(file)), false);
    });
    let backing = dir.path("backing.img");
    assert!(matches!(
        export.transport(),
        Transport::IoUring {
            threads_per_queue: 3,
            depth: 32,
            ..
        }
    ));
    let vol = open_direct(&export.mountpoint().join("vol"));
    let mut buf = AlignedBuf::zeroed(MIB as usize);
    buf.copy_from_slice(&pattern(MIB as usize, 21));
    vol.write_all_at(&buf[..4096], 4096).unwrap();
    vol.write_all_at(&buf, 2 * MIB).unwrap();
    vol.sync_all().unwrap();
    let mut back = AlignedBuf::zeroed(MIB as usize);
    vol.read_exact_at(&mut back, 2 * MIB).unwrap();
    assert!(back[..] == buf[..]);
    vol.read_exact_at(&mut back[..4096], 4096).unwrap();
    assert!(back[..4096] == buf[..4096]);
    // In the backing file, where the mapping said.
    let on_disk = std::fs::read(&backing).unwrap();
    assert!(on_disk[2 * MIB as usize..3 * MIB as usize] == buf[..]);
    // A loop device's discards and write-zeroes (fallocate on whole sectors) too.
    let keep = libc::FALLOC_FL_KEEP_SIZE;
    fallocate(
        &vol,
        libc::FALLOC_FL_PUNCH_HOLE | keep,
        2 * MIB + 4096,
        8192,
    )
    .unwrap();
    fallocate(&vol, libc::FALLOC_FL_ZERO_RANGE, 2 * MIB + 65536, 4096).unwrap();
    let mut expected = buf.to_vec();
    expected[4096..12288].fill(0);
    expected[65536..69632].fill(0);
    let on_disk = std::fs::read(&backing).unwrap();
    assert!(on_disk[2 * MIB as usize..3 * MIB as usize] == expected[..]);
    // A partial sector needs read-modify-write, which only the synchronous code does.
    let plain = open_rw(&export.mountpoint().join("vol")).unwrap();
    assert_eq!(errno_of(plain.write_at(b"x", 3)), libc::EOPNOTSUPP);
    drop((vol, plain));
    catalog.wait_closed();
    export.unmount();
}

/// With a bound of one read at the disk per queue, reads beyond it wait their turn and every
/// one of them still comes back with its own bytes, also when they wait for steps first and
/// writes run beside them (writes are not bounded).
#[test]
fn over_io_uring_reads_beyond_the_bound_wait_their_turn() {
    if !can_run() {
        return;
    }
    let dir = TempDir::new("read-bound");
    let backing = dir.path("backing.img");
    let data = pattern(8 * MIB as usize, 33);
    std::fs::write(&backing, &data[..]).unwrap();
    let catalog = Arc::new(Devices::default());
    let file = || FileDevice::open(&backing, OpenMode::ReadWrite).unwrap();
    catalog.add("vol", Arc::new(MapOnly(file())), false);
    let stepped = Stepped {
        inner: MapOnly(file()),
        delay: Duration::from_millis(5),
        fail: false,
    };
    catalog.add("slow", Arc::new(stepped), false);
    let config = FuseConfig {
        io_uring: UringMode::On,
        queue_reads: 1,
        ..FuseConfig::default()
    };
    let export = mount_with(&dir, &catalog, config);
    assert!(matches!(
        export.transport(),
        Transport::IoUring { reads: 1, .. }
    ));
    let data = Arc::new(data);
    let readers: Vec<_> = (0..8u64)
        .map(|t| {
            let name = if t % 2 == 0 { "vol" } else { "slow" };
            let (path, data) = (export.mountpoint().join(name), data.clone());
            std::thread::spawn(move || {
                let f = open_direct(&path);
                let mut back = AlignedBuf::zeroed(64 << 10);
                for i in 0..16u64 {
                    // The first 4 MiB: the writers below keep to the rest.
                    let at = ((t * 16 + i) * 37 % 64) * (64 << 10);
                    f.read_exact_at(&mut back, at).unwrap();
                    let at = at as usize;
                    assert!(back[..] == data[at..at + back.len()], "read at {at}");
                }
            })
        })
        .collect();
    let writer = {
        let path = export.mountpoint().join("vol");
        std::thread::spawn(move || {
            let f = open_direct(&path);
            let buf = pattern(64 << 10, 34);
            for i in 0..32u64 {
                f.write_all_at(&buf, 4 * MIB + i * (64 << 10)).unwrap();
            }
        })
    };
    readers.into_iter().for_each(|r| r.join().unwrap());
    writer.join().unwrap();
    catalog.wait_closed();
    export.unmount();
}

/// A device whose mappings wait for a step (as a `delay`'s timer or a snapshot copy-out) that
/// a thread of its own finishes after `delay`, failing it if `fail`; its synchronous methods
/// fail, so what succeeds through the mount waited for its step on the engine's path.
struct Stepped {
    inner: MapOnly,
    delay: Duration,
    fail: bool,
}

impl BlockDevice for Stepped {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        self.inner.write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        self.inner.flush()
    }
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        let (delay, fail) = (self.delay, self.fail);
        let step = Pending::new(move |done| {
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                done.finish(match fail {
                    true => Err(udm_block::BlockError::Io("the step failed".into())),
                    false => Ok(()),
                })
            });
        });
        Some(self.inner.map(op, offset, len)?.after(step))
    }
}

#[test]
fn over_io_uring_mappings_that_wait_for_steps_hold_no_thread() {
    if !can_run() {
        return;
    }
    let dir = TempDir::new("steps");
    let backing = dir.path("backing.img");
    std::fs::write(&backing, &pattern(MIB as usize, 5)[..]).unwrap();
    let stepped = |fail| {
        let file = FileDevice::open(&backing, OpenMode::ReadWrite).unwrap();
        Arc::new(Stepped {
            inner: MapOnly(file),
            delay: Duration::from_millis(500),
            fail,
        })
    };
    let catalog = Arc::new(Devices::default());
    catalog.add("vol", stepped(false), false);
    catalog.add("failing", stepped(true), false);
    // One pool thread: requests that took it would wait for each other.
    let config = FuseConfig {
        workers: 1,
        io_uring: UringMode::On,
        ..FuseConfig::default()
    };
    let export = mount_with(&dir, &catalog, config);
    let mnt = export.mountpoint().to_path_buf();
    let started = Instant::now();
    let readers = read_in_background(&mnt.join("vol"), 8);
    for reader in readers {
        reader.join().unwrap().unwrap();
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "8 reads waiting 500 ms each took {took:?}: they waited in turn"
    );
    let vol = open_direct(&mnt.join("vol"));
    let mut back = AlignedBuf::zeroed(8192);
    vol.read_exact_at(&mut back, 8192).unwrap();
    assert!(back[..] == pattern(MIB as usize, 5)[8192..16384]);
    back.fill(7);
    vol.write_all_at(&back, 4096).unwrap();
    vol.sync_all().unwrap();
    assert!(std::fs::read(&backing).unwrap()[4096..12288] == back[..]);
    // A step that fails fails its request.
    let failing = open_direct(&mnt.join("failing"));
    assert_eq!(errno_of(failing.read_exact_at(&mut back, 0)), libc::EIO);
    drop((vol, failing));
    catalog.wait_closed();
    export.unmount();
}

/// A device that takes `delay` to read and cannot be mapped, counting reads in progress.
struct Slow {
    inner: MemoryDevice,
    delay: Duration,
    reading: AtomicUsize,
}

impl Slow {
    fn new(size: u64, delay: Duration) -> Arc<Slow> {
        Arc::new(Slow {
            inner: MemoryDevice::new(size),
            delay,
            reading: AtomicUsize::new(0),
        })
    }

    fn wait_reading(&self, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.reading.load(Ordering::SeqCst) < count {
            assert!(Instant::now() < deadline, "the slow reads never started");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl BlockDevice for Slow {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        self.reading.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        self.reading.fetch_sub(1, Ordering::SeqCst);
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        self.inner.write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        Ok(())
    }
}

/// Fills a catalog with `slow` and `fast`, a file device of 4 MiB.
fn slow_and_fast(slow: &Arc<Slow>) -> impl FnOnce(&TempDir, &Devices) + '_ {
    move |dir, catalog| {
        catalog.add("slow", slow.clone(), false);
        let fast = file_device(dir, "fast.img", 4 * MIB);
        catalog.add("fast", Arc::new(fast), false);
    }
}

/// Starts `count` threads each reading 4 KiB of `path` with O_DIRECT (one request each).
fn read_in_background(
    path: &Path,
    count: usize,
) -> Vec<std::thread::JoinHandle<std::io::Result<()>>> {
    (0..count)
        .map(|i| {
            let path = path.to_path_buf();
            std::thread::spawn(move || {
                let mut buf = AlignedBuf::zeroed(4096);
                OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&path)?
                    .read_exact_at(&mut buf, i as u64 * 4096)
            })
        })
        .collect()
}

#[test]
fn over_io_uring_a_slow_device_does_not_hold_up_a_fast_one() {
    if !can_run() {
        return;
    }
    let slow = Slow::new(MIB, Duration::from_secs(3));
    // Two threads for synchronous requests, both kept busy by the slow device.
    let config = FuseConfig {
        workers: 2,
        io_uring: UringMode::On,
        ..FuseConfig::default()
    };
    let (_dir, catalog, export) = mounted_with("slow", config, slow_and_fast(&slow));
    let mnt = export.mountpoint().to_path_buf();
    let readers = read_in_background(&mnt.join("slow"), 4);
    slow.wait_reading(2);
    let started = Instant::now();
    let fast = open_direct(&mnt.join("fast"));
    let mut buf = AlignedBuf::zeroed(64 * 1024);
    for i in 0..32 {
        fast.read_exact_at(&mut buf, i * 64 * 1024).unwrap();
    }
    fast.write_all_at(&buf, 0).unwrap();
    assert_eq!(std::fs::metadata(mnt.join("fast")).unwrap().len(), 4 * MIB);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "the fast device waited {took:?} behind the slow one"
    );
    assert_eq!(
        slow.reading.load(Ordering::SeqCst),
        2,
        "the pool is bounded"
    );
    drop(fast);
    for reader in readers {
        reader.join().unwrap().unwrap();
    }
    catalog.wait_closed();
    export.unmount();
}

#[test]
fn unmount_with_requests_in_flight_ends_in_bounded_time() {
    each_transport(|mode| {
        // Longer than the grace a busy mount is served after it is detached.
        let slow = Slow::new(MIB, Duration::from_secs(5));
        let (_dir, catalog, export) = mounted("inflight", mode, slow_and_fast(&slow));
        let mnt = export.mountpoint().to_path_buf();
        let readers = read_in_background(&mnt.join("slow"), 3);
        // And the fast device busy with a stream of requests.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // The streamer must have its file open before the unmount, or the open itself fails
        // (it did, on a loaded machine, when the thread started late).
        let (opened, is_open) = std::sync::mpsc::channel();
        let streamer = {
            let (path, stop) = (mnt.join("fast"), stop.clone());
            std::thread::spawn(move || {
                let file = open_direct(&path);
                opened.send(()).unwrap();
                let mut buf = AlignedBuf::zeroed(4096);
                let mut served = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    match file.read_exact_at(&mut buf, (served % 1024) * 4096) {
                        Ok(()) => served += 1,
                        Err(e) => return (served, Some(e)),
                    }
                }
                (served, None)
            })
        };
        is_open.recv().unwrap();
        slow.wait_reading(3);
        let started = Instant::now();
        export.unmount();
        let took = started.elapsed();
        assert!(took < Duration::from_secs(15), "unmount took {took:?}");
        // Nothing reaches a device once unmount has returned.
        assert_eq!(slow.reading.load(Ordering::SeqCst), 0);
        stop.store(true, Ordering::SeqCst);
        let (served, error) = streamer.join().unwrap();
        assert!(served > 0);
        eprintln!("{served} reads, then {error:?}");
        for reader in readers {
            // Answered before the abort, or failed by it: never left hanging.
            if let Err(e) = reader.join().unwrap() {
                let errno = e.raw_os_error().unwrap();
                assert!(
                    errno == libc::ENOTCONN || errno == libc::ECONNABORTED,
                    "{e}"
                );
            }
        }
        assert!(started.elapsed() < Duration::from_secs(15));
        catalog.wait_closed();
    });
}
