//! Power cuts at every write: the snapshot reads exactly what the origin held.

use super::*;

/// The origin (of `size` bytes) and COW devices as a power cut left them, in a fresh rig:
/// asserts that the snapshot loads and still reads what the origin held when it was taken
/// (`cut` says which cut, for the messages).
fn reopened(
    size: u64,
    origin: Arc<dyn BlockDevice>,
    cow: Arc<dyn BlockDevice>,
    cut: &str,
) -> (Rig, Table) {
    let after = Rig::new(size);
    after.set_origin(origin);
    let cow = after.add("cow", cow);
    let snap = after
        .try_table("snap-dev", &format!("snapshot {} {cow} P 8", after.origin))
        .unwrap_or_else(|e| panic!("{cut}: the snapshot does not load: {e}"));
    assert!(
        read(&snap, 0, size as usize)[..] == original(size)[..],
        "{cut}: the snapshot changed"
    );
    (after, snap)
}

/// A power cut at every write, cutting the origin and the COW device at once: after it,
/// the snapshot reads exactly what the origin held when it was taken, and every origin write
/// that was flushed is there.
#[test]
fn a_power_cut_at_any_write_keeps_the_snapshot_exact() {
    const SIZE: u64 = 512 * 1024;
    let mut cuts = 0;
    let mut cut_at = 1;
    loop {
        // The first write (the origin's contents) is not one to cut at.
        let power = PowerSwitch::new(cut_at + 1);
        let seed = cut_at;
        let origin_dev = Arc::new(CrashDevice::on_power(SIZE, power.clone(), seed));
        origin_dev
            .write(0, &original(SIZE), WriteFlags { fua: true })
            .unwrap();
        let cow_dev = Arc::new(CrashDevice::on_power(
            4 * MIB,
            power.clone(),
            seed + 1_000_000,
        ));
        let rig = Rig::new(SIZE);
        rig.set_origin(origin_dev.clone());
        let cow = rig.add("cow", cow_dev.clone());
        let mut flushed: HashMap<u64, u64> = HashMap::new();
        let mut unflushed: Vec<(u64, u64)> = Vec::new();
        let mut x = cut_at | 1;
        let mut run = || -> Result<(), String> {
            let origin = rig.try_table("origin-dev", &format!("snapshot-origin {}", rig.origin))?;
            let _snap = rig.try_table("snap-dev", &format!("snapshot {} {cow} P 8", rig.origin))?;
            for i in 0..40u64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let block = x % (SIZE / 4096);
                // A write in flight at the cut may land, in part.
                unflushed.push((block, 100 + i));
                origin
                    .write(block * 4096, &pattern(4096, 100 + i), WriteFlags::default())
                    .map_err(|e| e.to_string())?;
                if i % 5 == 4 {
                    origin.flush().map_err(|e| e.to_string())?;
                    flushed.extend(unflushed.drain(..));
                }
            }
            Ok(())
        };
        let outcome = run();
        if !power.is_cut() {
            outcome.unwrap();
            break;
        }
        cuts += 1;
        let (after, _snap) = reopened(
            SIZE,
            Arc::new(origin_dev.after_power_cut()),
            Arc::new(cow_dev.after_power_cut()),
            &format!("cut at write {cut_at}"),
        );
        let origin = read(&*after.device(&after.origin), 0, SIZE as usize);
        for (block, seed) in &flushed {
            let at = (*block * 4096) as usize;
            let newer = unflushed.iter().any(|(b, _)| b == block);
            assert!(
                newer || origin[at..at + 4096] == pattern(4096, *seed)[..],
                "cut at write {cut_at}: flushed origin block {block} lost"
            );
        }
        cut_at += 1;
    }
    assert!(cuts >= 100, "only {cuts} cut points");
    eprintln!("snapshot targets: {cuts} power-cut points checked");
}

/// A COW device on a file whose power is cut at its `cut_at`-th metadata write once armed
/// (the header and area 0, below chunk 2): that write and every later one fail, and it maps
/// nothing more. Data writes map onto the file, so the copier writes them on its ring.
struct CutAtCommit {
    file: Arc<dyn BlockDevice>,
    metadata_writes: AtomicU64,
    cut_at: AtomicU64,
    cut: AtomicBool,
    data_writes_mapped: AtomicU64,
}

impl CutAtCommit {
    fn new(file: Arc<dyn BlockDevice>) -> Arc<CutAtCommit> {
        Arc::new(CutAtCommit {
            file,
            metadata_writes: AtomicU64::new(0),
            cut_at: AtomicU64::new(u64::MAX),
            cut: AtomicBool::new(false),
            data_writes_mapped: AtomicU64::new(0),
        })
    }

    /// Cuts the power at the `cut_at`-th metadata write from now on.
    fn arm(&self, cut_at: u64) {
        self.metadata_writes.store(0, Ordering::SeqCst);
        self.cut_at.store(cut_at, Ordering::SeqCst);
    }

    fn is_cut(&self) -> bool {
        self.cut.load(Ordering::SeqCst)
    }

    fn power_cut() -> udm_block::BlockError {
        udm_block::BlockError::Io("power cut".into())
    }
}

impl BlockDevice for CutAtCommit {
    fn size(&self) -> u64 {
        self.file.size()
    }
    fn capabilities(&self) -> udm_block::Capabilities {
        self.file.capabilities()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        self.file.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        if offset < 8192 {
            let n = self.metadata_writes.fetch_add(1, Ordering::SeqCst) + 1;
            if n >= self.cut_at.load(Ordering::SeqCst) {
                self.cut.store(true, Ordering::SeqCst);
            }
        }
        if self.is_cut() {
            return Err(Self::power_cut());
        }
        self.file.write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        match self.is_cut() {
            true => Err(Self::power_cut()),
            false => self.file.flush(),
        }
    }
    fn map(&self, op: udm_block::MapOp, offset: u64, len: u64) -> Option<udm_block::Mapping> {
        if self.is_cut() {
            return None;
        }
        if op.is_write() {
            self.data_writes_mapped.fetch_add(1, Ordering::SeqCst);
        }
        self.file.map(op, offset, len)
    }
}

/// The copier's crash test: mapped first writes on files, their chunks copied on the ring,
/// and the power cut at the first, second or third commit. Whatever was copied and not
/// committed is not the snapshot's, the origin writes waiting for that commit never land, and
/// those whose commit was durable did; after the restart the snapshot reads the origin
/// exactly as it was.
#[test]
fn a_power_cut_between_the_copier_s_copy_and_its_commit_keeps_the_snapshot_exact() {
    use udm_block::MapOp;
    const SIZE: u64 = MIB;
    for cut_at in 1..=3 {
        let dir = udm_testkit::TempDir::new("snapshot-copier-cut");
        let rig = Rig::new(SIZE);
        rig.file_origin(&dir, SIZE);
        rig.device(&rig.origin)
            .write(0, &original(SIZE), WriteFlags { fua: true })
            .unwrap();
        let cow_dev = CutAtCommit::new(file_device(&dir.path("cow.img"), 4 * MIB));
        let cow = rig.add("cow", cow_dev.clone());
        let origin = rig.origin_table();
        let snap = rig.snapshot(&cow, "P 8");
        cow_dev.arm(cut_at);
        let landed = Arc::new(AtomicU64::new(0));
        for wave in 0..4u64 {
            let (tx, rx) = std::sync::mpsc::channel();
            for i in 0..16 {
                let (tx, cow_dev, landed) = (tx.clone(), cow_dev.clone(), landed.clone());
                let at = (wave * 16 + i) * 3 * 4096;
                let mapping = origin.map(MapOp::Write { fua: false }, at, 4096).unwrap();
                // A write is submitted as soon as it is ready (on the thread that finished
                // its commit, before the next commit starts), unless the machine is off.
                mapping.when_ready(move |ready| {
                    if !cow_dev.is_cut() {
                        let mapping = ready.expect("the copy-out succeeds while the power is on");
                        execute(MapOp::Write { fua: false }, mapping, &mut pattern(4096, at));
                        landed.fetch_add(1, Ordering::SeqCst);
                    }
                    tx.send(()).unwrap()
                });
            }
            for _ in 0..16 {
                rx.recv_timeout(Duration::from_secs(10)).unwrap();
            }
        }
        let landed = landed.load(Ordering::SeqCst);
        assert!(cow_dev.is_cut(), "cut at {cut_at}: the power was never cut");
        assert!(
            cow_dev.data_writes_mapped.load(Ordering::SeqCst) > 0,
            "cut at {cut_at}: the copier never wrote on the ring"
        );
        drop((snap, origin));
        let (_after, snap) = reopened(
            SIZE,
            file_device(&dir.path("origin.img"), SIZE),
            file_device(&dir.path("cow.img"), 4 * MIB),
            &format!("cut at {cut_at} ({landed} origin writes landed)"),
        );
        let exceptions = target(&snap).status_details().unwrap()["exceptions"].clone();
        assert!(
            cut_at == 1 || landed > 0,
            "cut at {cut_at}: no commit went through before the cut ({exceptions} exceptions)"
        );
    }
}
