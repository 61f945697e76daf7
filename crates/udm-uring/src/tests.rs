//! The engine against real files through a real ring.

use std::fs::{File, OpenOptions};
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use io_uring::IoUring;
use smallvec::smallvec;
use udm_block::{AlignedBuf, Piece};

use super::*;

struct TempFile {
    path: PathBuf,
}

impl TempFile {
    fn new(tag: &str, len: u64) -> Self {
        Self::new_in(&std::env::temp_dir(), tag, len)
    }

    fn new_in(dir: &std::path::Path, tag: &str, len: u64) -> Self {
        let path = dir.join(format!("udm-uring-{tag}-{}", std::process::id()));
        File::create(&path).unwrap().set_len(len).unwrap();
        TempFile { path }
    }

    /// `len` bytes of 0xaa from 0, then the file's data read back.
    fn filled(&self, len: usize) {
        File::options()
            .write(true)
            .open(&self.path)
            .unwrap()
            .write_all_at(&vec![0xaa; len], 0)
            .unwrap();
    }

    fn contents(&self) -> Vec<u8> {
        std::fs::read(&self.path).unwrap()
    }

    /// Where the first data at or after `offset` is (SEEK_DATA).
    fn next_data(&self, offset: u64) -> i64 {
        let file = File::open(&self.path).unwrap();
        // SAFETY: lseek on a descriptor we own.
        unsafe {
            libc::lseek(
                std::os::fd::AsRawFd::as_raw_fd(&file),
                offset as i64,
                libc::SEEK_DATA,
            )
        }
    }

    fn mapped(&self) -> Arc<MappedFile> {
        let open = || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(&self.path)
                .unwrap()
        };
        Arc::new(MappedFile::new(self.path.clone(), None, open()))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Runs one request to completion on a ring of its own; its mapping asks for no retry.
fn run(op: MapOp, mapping: Mapping, buf: &mut [u8]) -> Result<(), BlockError> {
    match run_to_outcome(op, mapping, buf) {
        Outcome::Done(result) => result,
        Outcome::Retry => panic!("a retry no mapping asked for"),
    }
}

fn run_to_outcome(op: MapOp, mapping: Mapping, buf: &mut [u8]) -> Outcome {
    let mut ring = IoUring::new(64).unwrap();
    let mut engine = Engine::new();
    let mut queued = Vec::new();
    let mut push = |e: squeue::Entry| queued.push(e);
    // SAFETY: buf outlives the request, which completes before this function returns.
    if let Some(done) = unsafe { engine.start(op, mapping, buf.as_mut_ptr(), 7, &mut push) } {
        return Outcome::Done(done);
    }
    loop {
        for e in queued.drain(..) {
            // SAFETY: the entries' buffers are `buf`, alive until the end.
            unsafe { ring.submission().push(&e).unwrap() };
        }
        ring.submit_and_wait(1).unwrap();
        let completions: Vec<_> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (user_data, result) in completions {
            assert!(is_engine(user_data));
            let mut push = |e: squeue::Entry| queued.push(e);
            if let Some((owner, outcome)) = engine.complete(user_data, result, &mut push) {
                assert_eq!(owner, 7);
                assert_eq!(engine.in_flight(), 0);
                return outcome;
            }
        }
    }
}

fn on(file: &Arc<MappedFile>, at: u64, len: u64, offset: u64) -> Piece {
    Piece {
        at,
        len,
        place: Place::File {
            file: file.clone(),
            offset,
        },
    }
}

#[test]
fn pieces_on_two_files_and_a_zero_run_read_and_write_as_one_request() {
    let (a, b) = (TempFile::new("a", 1 << 20), TempFile::new("b", 1 << 20));
    let (fa, fb) = (a.mapped(), b.mapped());
    let mapping = || Mapping {
        pieces: smallvec![
            on(&fa, 0, 4096, 8192),
            Piece {
                at: 4096,
                len: 4096,
                place: Place::Zero,
            },
            on(&fb, 8192, 8192, 0),
        ],
        ..Mapping::default()
    };
    let mut data = AlignedBuf::zeroed(16384);
    data.iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i % 251) as u8 + 1);
    run(MapOp::Write { fua: true }, mapping(), &mut data).unwrap();
    let mut check = vec![0u8; 8192];
    File::open(&a.path)
        .unwrap()
        .read_exact_at(&mut check[..4096], 8192)
        .unwrap();
    assert_eq!(&check[..4096], &data[..4096]);
    File::open(&b.path)
        .unwrap()
        .read_exact_at(&mut check, 0)
        .unwrap();
    assert_eq!(&check[..], &data[8192..]);

    let mut back = AlignedBuf::zeroed(16384);
    back.fill(0xee);
    run(MapOp::Read, mapping(), &mut back).unwrap();
    assert_eq!(&back[..4096], &data[..4096]);
    assert!(
        back[4096..8192].iter().all(|&b| b == 0),
        "the zero run reads as zeroes"
    );
    assert_eq!(&back[8192..], &data[8192..]);
}

#[test]
fn a_write_o_direct_refuses_goes_through_the_buffered_descriptor() {
    let file = TempFile::new("einval", 1 << 20);
    // An eventfd takes only 8-byte writes: it answers EINVAL as O_DIRECT does to an
    // alignment it cannot do.
    // SAFETY: eventfd returns a new descriptor we own.
    let refusing = unsafe { File::from_raw_fd(libc::eventfd(0, 0)) };
    let buffered = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file.path)
        .unwrap();
    let mapped = Arc::new(MappedFile::new(file.path.clone(), Some(refusing), buffered));
    let mut data = AlignedBuf::zeroed(4096);
    data.fill(0x5a);
    let mapping = Mapping {
        pieces: smallvec![on(&mapped, 0, 4096, 4096)],
        ..Mapping::default()
    };
    run(MapOp::Write { fua: false }, mapping, &mut data).unwrap();
    let mut check = vec![0u8; 4096];
    File::open(&file.path)
        .unwrap()
        .read_exact_at(&mut check, 4096)
        .unwrap();
    assert!(check.iter().all(|&b| b == 0x5a));
}

/// A file truncated under its device: the table was checked against the old size, so the
/// read fails naming the file, rather than handing out zeroes nobody wrote.
#[test]
fn a_read_past_the_end_of_a_shrunk_file_fails_naming_the_file() {
    let file = TempFile::new("shrunk", 8192);
    std::fs::write(&file.path, vec![3u8; 4096]).unwrap();
    let mapped = file.mapped();
    let mut buf = AlignedBuf::zeroed(8192);
    let mapping = Mapping {
        pieces: smallvec![on(&mapped, 0, 8192, 0)],
        ..Mapping::default()
    };
    let err = run(MapOp::Read, mapping, &mut buf).unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    let text = err.to_string();
    assert!(text.contains(&*file.path.to_string_lossy()), "{text}");
    assert!(text.contains("shrank"), "{text}");

    // Inside what is left, reads go on working.
    let mapping = Mapping {
        pieces: smallvec![on(&mapped, 0, 4096, 0)],
        ..Mapping::default()
    };
    run(MapOp::Read, mapping, &mut buf[..4096]).unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 3));
}

#[test]
fn a_failed_piece_fails_the_request_with_the_file_named() {
    let file = TempFile::new("ro", 1 << 20);
    let read_only = File::open(&file.path).unwrap();
    let mapped = Arc::new(MappedFile::new(file.path.clone(), None, read_only));
    let mut data = AlignedBuf::zeroed(4096);
    let mapping = Mapping {
        pieces: smallvec![on(&mapped, 0, 4096, 0)],
        ..Mapping::default()
    };
    let err = run(MapOp::Write { fua: false }, mapping, &mut data).unwrap_err();
    assert_eq!(err.errno(), libc::EBADF);
    assert!(
        err.to_string().contains(&*file.path.to_string_lossy()),
        "{err}"
    );
}

#[test]
fn a_flush_syncs_each_file_once_and_releases_its_holds_at_completion() {
    let (a, b) = (TempFile::new("fa", 4096), TempFile::new("fb", 4096));
    let (fa, fb) = (a.mapped(), b.mapped());
    let held = Arc::new(());
    let flush = |file: &Arc<MappedFile>| on(file, 0, 0, 0);
    let mapping = Mapping {
        pieces: smallvec![flush(&fa), flush(&fb), flush(&fa)],
        holds: smallvec![Box::new(held.clone()) as Box<dyn std::any::Any + Send>],
        ..Mapping::default()
    };
    let mut ring = IoUring::new(8).unwrap();
    let mut engine = Engine::new();
    let mut queued = Vec::new();
    // SAFETY: a flush touches no buffer.
    let started = unsafe {
        engine.start(MapOp::Flush, mapping, std::ptr::null_mut(), 1, &mut |e| {
            queued.push(e)
        })
    };
    assert!(started.is_none());
    assert_eq!(queued.len(), 2, "one fdatasync per file");
    assert_eq!(Arc::strong_count(&held), 2, "held while in flight");
    for e in &queued {
        // SAFETY: fdatasync entries reference no memory.
        unsafe { ring.submission().push(e).unwrap() };
    }
    ring.submit_and_wait(2).unwrap();
    let completions: Vec<_> = ring
        .completion()
        .map(|c| (c.user_data(), c.result()))
        .collect();
    let mut outcome = None;
    for (user_data, result) in completions {
        outcome = outcome.or(engine.complete(user_data, result, &mut |_| panic!("no resubmit")));
    }
    assert!(matches!(outcome, Some((1, Outcome::Done(Ok(()))))));
    assert_eq!(Arc::strong_count(&held), 1, "released at completion");
}

#[test]
fn a_request_of_zero_pieces_only_completes_at_once() {
    let mut buf = vec![9u8; 1024];
    let mapping = Mapping::single(1024, Place::Zero);
    let mut engine = Engine::new();
    // SAFETY: buf is valid for the mapping's length.
    let done = unsafe {
        engine.start(MapOp::Read, mapping, buf.as_mut_ptr(), 1, &mut |_| {
            panic!("no I/O")
        })
    };
    assert!(matches!(done, Some(Ok(()))));
    assert!(buf.iter().all(|&b| b == 0));
}

#[test]
fn the_completion_callbacks_hear_how_the_request_went() {
    let a = TempFile::new("told", 8192);
    let told = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let record = || {
        let told = told.clone();
        move |done: Completed| {
            told.lock().push(match done {
                Completed::Ok => "ok",
                Completed::Failed(_) => "failed",
                Completed::Retried(_) => "retried",
            })
        }
    };
    let good = Mapping::single(4096, Place::Zero).when_complete(record());
    run(MapOp::Read, good, &mut AlignedBuf::zeroed(4096)).unwrap();
    let mapping = Mapping {
        pieces: smallvec![on(&a.mapped(), 0, 4096, 0)],
        ..Mapping::default()
    };
    run(
        MapOp::Read,
        mapping.when_complete(record()),
        &mut AlignedBuf::zeroed(4096),
    )
    .unwrap();
    // A descriptor opened for writing only: the read fails with EBADF.
    let write_only = OpenOptions::new().write(true).open(&a.path).unwrap();
    let file = Arc::new(MappedFile::new(a.path.clone(), None, write_only));
    let bad = || Mapping {
        pieces: smallvec![on(&file, 0, 4096, 0)],
        ..Mapping::default()
    };
    run(
        MapOp::Read,
        bad().when_complete(record()),
        &mut AlignedBuf::zeroed(4096),
    )
    .unwrap_err();
    // Asked to, the engine hands the failed request back for a retry, its holds released.
    let held = Arc::new(());
    let retried = bad()
        .when_complete(record())
        .hold(held.clone())
        .retried_on_error();
    let outcome = run_to_outcome(MapOp::Read, retried, &mut AlignedBuf::zeroed(4096));
    assert!(matches!(outcome, Outcome::Retry), "{outcome:?}");
    assert_eq!(Arc::strong_count(&held), 1);
    // A request that succeeds is not retried, whatever its mapping asked.
    let fine = Mapping::single(512, Place::Zero).retried_on_error();
    let outcome = run_to_outcome(MapOp::Read, fine, &mut AlignedBuf::zeroed(512));
    assert!(matches!(outcome, Outcome::Done(Ok(()))));
    assert_eq!(*told.lock(), ["ok", "ok", "failed", "retried"]);
}

#[test]
fn discard_punches_a_hole_and_write_zeroes_zeroes_each_way_it_is_asked() {
    let file = TempFile::new("fill", 64 << 10);
    file.filled(64 << 10);
    let f = file.mapped();
    let one = |offset| Mapping {
        pieces: smallvec![on(&f, 0, 4096, offset)],
        ..Mapping::default()
    };
    run(MapOp::Discard { fua: false }, one(8192), &mut []).unwrap();
    let unmap = MapOp::WriteZeroes {
        may_unmap: true,
        fast_only: false,
        fua: false,
    };
    run(unmap, one(20480), &mut []).unwrap();
    let in_place = MapOp::WriteZeroes {
        may_unmap: false,
        fast_only: true,
        fua: true,
    };
    run(in_place, one(32768), &mut []).unwrap();
    let data = file.contents();
    for (at, byte) in data.iter().enumerate() {
        let zeroed = [8192, 20480, 32768]
            .iter()
            .any(|&z| (z..z + 4096).contains(&at));
        assert_eq!(*byte, if zeroed { 0 } else { 0xaa }, "byte {at}");
    }
    // Discard and may-unmap punched holes: the file has no data there any more.
    assert_eq!(file.next_data(8192), 12288);
    assert_eq!(file.next_data(20480), 24576);
}

#[test]
fn write_zeroes_where_the_file_cannot_zero_a_range_writes_zeroes_unless_only_fast_will_do() {
    // tmpfs punches holes but has no ZERO_RANGE.
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("skipped: no /dev/shm");
        return;
    }
    let file = TempFile::new_in(shm, "fill-slow", 3 << 20);
    file.filled(3 << 20);
    let f = file.mapped();
    // Longer than the shared zero buffer: written in several pieces.
    let range = || Mapping {
        pieces: smallvec![on(&f, 0, (2 << 20) + 4096, 4096)],
        ..Mapping::default()
    };
    let fast = MapOp::WriteZeroes {
        may_unmap: false,
        fast_only: true,
        fua: false,
    };
    let err = run(fast, range(), &mut []).unwrap_err();
    assert!(matches!(err, BlockError::NotSupported(_)), "{err}");
    assert!(
        file.contents().iter().all(|&b| b == 0xaa),
        "a failed fast zero changed data"
    );
    let slow = MapOp::WriteZeroes {
        may_unmap: false,
        fast_only: false,
        fua: true,
    };
    run(slow, range(), &mut []).unwrap();
    let data = file.contents();
    let zeroed = 4096..(2 << 20) + 8192;
    for (at, byte) in data.iter().enumerate() {
        assert_eq!(
            *byte,
            if zeroed.contains(&at) { 0 } else { 0xaa },
            "byte {at}"
        );
    }
}

#[test]
fn push_some_fills_the_submission_queue_and_says_how_many_went_in() {
    let mut ring = IoUring::new(4).unwrap();
    let nops: Vec<_> = (0..6)
        .map(|i| opcode::Nop::new().build().user_data(i))
        .collect();
    // SAFETY: a no-op has no buffers.
    assert_eq!(unsafe { push_some(&mut ring, &nops) }, 4);
    assert_eq!(unsafe { push_some(&mut ring, &nops[4..]) }, 0);
    ring.submit_and_wait(4).unwrap();
    let mut seen: Vec<_> = ring.completion().map(|c| c.user_data()).collect();
    assert_eq!(unsafe { push_some(&mut ring, &nops[4..]) }, 2);
    ring.submit_and_wait(2).unwrap();
    seen.extend(ring.completion().map(|c| c.user_data()));
    assert_eq!(seen, (0..6).collect::<Vec<_>>());
    assert_eq!(unsafe { push_some(&mut ring, &[]) }, 0);
}
