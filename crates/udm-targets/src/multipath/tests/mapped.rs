//! Requests remapped onto the chosen path, and what a mapped request's failure does.

use super::*;
use udm_block::{MapOp, Mapping, Ready, Transfer};

#[test]
fn requests_map_onto_the_chosen_file_and_count_until_they_complete() {
    use udm_block::Place;
    let dir = udm_testkit::TempDir::new("mp-map");
    let (table, [a, b]) = file_paths(&dir, "queue-length");
    let file_of = |mapping: &udm_block::Mapping| match &mapping.pieces[0].place {
        Place::File { file, offset } => {
            assert_eq!(*offset, 8192);
            file.path().to_path_buf()
        }
        Place::Zero => panic!("mapped to zeroes"),
    };
    // The first mapping is held (in flight): queue-length sends the next one to b.
    let first = table.map(MapOp::Read, 8192, 4096).unwrap();
    assert_eq!(file_of(&first), a);
    assert!(target(&table).status().ends_with("a A 0 1 b A 0 0"));
    let second = table.map(MapOp::Write { fua: false }, 8192, 4096).unwrap();
    assert_eq!(file_of(&second), b);
    drop((first, second));
    assert!(target(&table).status().ends_with("a A 0 0 b A 0 0"));
    // A flush with several usable paths goes the synchronous way (one down each path at
    // once, each failure failing its own path); with one, it maps onto it.
    assert!(table.map(MapOp::Flush, 0, 0).is_none());
    message(&table, "fail_path a").unwrap();
    for _ in 0..3 {
        assert_eq!(file_of(&table.map(MapOp::Read, 8192, 4096).unwrap()), b);
    }
    assert_eq!(table.map(MapOp::Flush, 0, 0).unwrap().pieces.len(), 1);
    // With no usable path a request may have to wait: it goes the synchronous way.
    message(&table, "fail_path b").unwrap();
    assert!(table.map(MapOp::Read, 0, 4096).is_none());
    assert!(table.map(MapOp::Flush, 0, 0).is_none());
    // Paths that do not map (these memory routes) are never mapped onto.
    let rig = Rig::new();
    let (table, _) = rig.build(TWO_PATHS);
    assert!(table.map(MapOp::Read, 0, 4096).is_none());
}

#[test]
fn a_mapped_request_that_fails_fails_its_path_and_is_retried_the_synchronous_way() {
    use udm_block::Completed;
    let dir = udm_testkit::TempDir::new("mp-retry");
    let (table, _) = file_paths(&dir, "round-robin");
    let eio = BlockError::Os {
        context: "read".into(),
        errno: libc::EIO,
    };
    // Round-robin: the first request goes down a.
    let mapping = table.map(MapOp::Read, 0, 4096).unwrap();
    assert!(mapping.retry_on_error, "a failure would reach the client");
    for told in mapping.on_complete {
        told(Completed::Retried(&eio));
    }
    assert!(target(&table).status().ends_with("a F 1 b A 0"));
    // The retry (the synchronous read) goes down b.
    read(&table, 0).unwrap();
    // An error any path would give (no space) does not fail the path; the retry returns it.
    let enospc = BlockError::Os {
        context: "write".into(),
        errno: libc::ENOSPC,
    };
    let mapping = table.map(MapOp::Write { fua: false }, 0, 4096).unwrap();
    for told in mapping.on_complete {
        told(Completed::Retried(&enospc));
    }
    assert!(target(&table).status().ends_with("a F 1 b A 0"));
}

/// A route whose reads, writes and flushes map to transfers, as a remote export's client's
/// do: done on a thread of their own, or, while `broken`, failed asking for a retry (a
/// connection that broke). Once `lost` is set, its next flush reports writes lost, as a
/// client whose server died with writes in its cache does.
struct Remote {
    route: Arc<Switchable>,
    broken: std::sync::atomic::AtomicBool,
    lost: Arc<std::sync::atomic::AtomicBool>,
}

fn flush_route(route: &Switchable, lost: &std::sync::atomic::AtomicBool) -> Result<()> {
    if lost.swap(false, Ordering::SeqCst) {
        return Err(BlockError::WritesLost("the server died".into()));
    }
    route.flush()
}

impl BlockDevice for Remote {
    fn size(&self) -> u64 {
        self.route.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.route.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        self.route.write(offset, buf, flags)
    }
    fn flush(&self) -> Result<()> {
        flush_route(&self.route, &self.lost)
    }
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        if op.is_fill() {
            return None;
        }
        let (route, broken) = (self.route.clone(), self.broken.load(Ordering::SeqCst));
        let lost = self.lost.clone();
        let len = if op == MapOp::Flush { 0 } else { len };
        Some(
            Mapping::new().taking(Transfer::new(0, len, move |buf, done| {
                std::thread::spawn(move || {
                    if broken {
                        return done.retry(BlockError::Io("the connection broke".into()));
                    }
                    // SAFETY: the executor lends us the buffer until `done`.
                    let data =
                        unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr(), buf.len()) };
                    done.finish(match op {
                        MapOp::Read => route.read(offset, data),
                        MapOp::Write { .. } => route.write(offset, data, WriteFlags::default()),
                        _ => flush_route(&route, &lost),
                    })
                });
            })),
        )
    }
}

/// Maps a request of `table` and runs it as the NBD event loop does; what it ended as.
fn execute(table: &Table, op: MapOp, offset: u64, buf: &mut [u8]) -> &'static str {
    let mapping = table.map(op, offset, buf.len() as u64).expect("mapped");
    let (tx, rx) = std::sync::mpsc::channel();
    // SAFETY: `buf` is untouched until the mapping is done (the wait below).
    unsafe {
        mapping.when_ready_with(buf.as_mut_ptr(), move |ready| {
            tx.send(match ready {
                Ready::Go(m) if m.pieces.is_empty() => "done",
                Ready::Go(_) => "pieces left",
                Ready::Failed(_) => "failed",
                Ready::Retry => "retry",
            })
            .unwrap()
        })
    };
    rx.recv_timeout(Duration::from_secs(10)).unwrap()
}

/// A multipath of [`TWO_PATHS`] over [`Remote`]s on `rig`'s routes a and b; its paths.
fn remote_paths(rig: &Rig) -> (Table, Vec<Arc<Remote>>) {
    let remotes = Devices::default();
    let paths: Vec<Arc<Remote>> = ["a", "b"]
        .iter()
        .zip(&rig.routes)
        .map(|(name, route)| {
            let remote = Arc::new(Remote {
                route: route.clone(),
                broken: Default::default(),
                lost: Default::default(),
            });
            remotes.add(name, remote.clone(), false);
            remote
        })
        .collect();
    let table = build(&remotes, &format!("0 {SECTORS} multipath {TWO_PATHS}")).unwrap();
    (table, paths)
}

#[test]
fn requests_down_paths_that_transfer_them_are_retried_on_another_path_when_one_breaks() {
    let rig = Rig::new();
    let (table, paths) = remote_paths(&rig);
    // Round-robin: the write goes down a, the read down b, each transferred by its path.
    let mut data = pattern(4096, 7).to_vec();
    assert_eq!(
        execute(&table, MapOp::Write { fua: false }, 0, &mut data),
        "done"
    );
    let mut back = vec![0u8; 4096];
    assert_eq!(execute(&table, MapOp::Read, 0, &mut back), "done");
    assert!(back == data);
    // a's connection breaks: the next request (down a) asks for a retry, a is failed, and
    // the retry (the synchronous read) goes down b.
    paths[0].broken.store(true, Ordering::SeqCst);
    assert_eq!(execute(&table, MapOp::Read, 0, &mut back), "retry");
    assert!(target(&table).status().ends_with("a F 1 b A 0"));
    assert!(read(&table, 0).unwrap() == data);
    // With one usable path a flush maps onto it, and is transferred too; but not while a
    // failed path is owed one (a took the write): that flush goes the synchronous way, which
    // sends it to a too, whose device may report writes lost.
    assert!(table.map(MapOp::Flush, 0, 0).is_none());
    table.flush().unwrap();
    assert_eq!(execute(&table, MapOp::Flush, 0, &mut []), "done");
}

/// A path whose device reports writes it acknowledged and lost (a remote server that died
/// with them in its cache) fails the flush that reaches it, failed or not: no flush down
/// another path covers writes that never reached the storage, nor is the flush retried
/// there, and the path is not failed for it.
#[test]
fn a_flush_fails_when_a_path_reports_writes_lost() {
    let rig = Rig::new();
    let (table, paths) = remote_paths(&rig);
    // Round-robin: the write goes down a; a is failed before the flush.
    table
        .write(0, &pattern(4096, 8), WriteFlags::default())
        .unwrap();
    message(&table, "fail_path a").unwrap();
    paths[0].lost.store(true, Ordering::SeqCst);
    let err = table.flush().unwrap_err();
    assert!(matches!(err, BlockError::WritesLost(_)), "{err}");
    assert_eq!(err.errno(), libc::EIO);
    // Said once: the next flush goes to a again (it stayed owed), and succeeds.
    table.flush().unwrap();
    // A usable path's mapped flush that reports writes lost fails, and is not retried.
    message(&table, "reinstate_path a").unwrap();
    message(&table, "fail_path b").unwrap();
    paths[0].lost.store(true, Ordering::SeqCst);
    assert_eq!(execute(&table, MapOp::Flush, 0, &mut []), "failed");
    assert!(target(&table).status().ends_with("a A 1 b F 1"));
}
