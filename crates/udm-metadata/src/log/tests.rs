//! The write log, written and read back: order, the exact end, damage, torn entries, restarts
//! and a full log.

use super::*;
use udm_block::MemoryDevice;

#[test]
fn entries_read_back_in_order_and_the_end_is_exact() {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(1 << 20));
    // An older log's leftovers must not be read as part of the new one.
    let mut old = LogWriter::create(dev.clone()).unwrap();
    for _ in 0..5 {
        old.append(Op::Write {
            offset: 0,
            data: &[1u8; 4096],
            fua: false,
        })
        .unwrap();
    }
    let mut log = LogWriter::create(dev.clone()).unwrap();
    log.append(Op::Write {
        offset: 8192,
        data: &[7u8; 5000],
        fua: false,
    })
    .unwrap();
    log.append(Op::Mark("before-flush")).unwrap();
    log.append(Op::Flush).unwrap();
    log.append(Op::Write {
        offset: 0,
        data: &[9u8; 512],
        fua: true,
    })
    .unwrap();
    log.append(Op::Discard {
        offset: 4096,
        len: 4096,
    })
    .unwrap();
    let mut reader = LogReader::open(dev).unwrap();
    let mut kinds = Vec::new();
    while let Some((entry, data)) = reader.next_entry().unwrap() {
        if entry.kind == EntryKind::Write && entry.seq == 0 {
            assert_eq!(data.len(), 5000);
            assert!(data.iter().all(|&b| b == 7));
        }
        if entry.kind == EntryKind::Mark {
            assert_eq!(entry.mark, "before-flush");
        }
        kinds.push((entry.kind, entry.fua));
    }
    assert_eq!(
        kinds,
        vec![
            (EntryKind::Write, false),
            (EntryKind::Mark, false),
            (EntryKind::Flush, false),
            (EntryKind::Write, true),
            (EntryKind::Discard, false)
        ]
    );
}

/// A log of two writes, a FLUSH and a third write, as a test's device would leave it.
fn flushed_log() -> Arc<dyn BlockDevice> {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(1 << 20));
    let mut log = LogWriter::create(dev.clone()).unwrap();
    for i in 0..2u8 {
        let data = [i; 4096];
        let write = Op::Write {
            offset: 0,
            data: &data,
            fua: false,
        };
        log.append(write).unwrap();
    }
    log.append(Op::Flush).unwrap();
    let data = [9u8; 4096];
    log.append(Op::Write {
        offset: 0,
        data: &data,
        fua: false,
    })
    .unwrap();
    dev
}

fn entries_read(dev: Arc<dyn BlockDevice>) -> Result<u64, MetadataError> {
    let mut reader = LogReader::open(dev)?;
    let mut read = 0;
    while reader.next_entry()?.is_some() {
        read += 1;
    }
    Ok(read)
}

fn flip_byte(dev: &Arc<dyn BlockDevice>, offset: u64) {
    let mut block = AlignedBuf::zeroed(BLOCK_SIZE);
    let start = offset / BLOCK_SIZE as u64 * BLOCK_SIZE as u64;
    dev.read(start, &mut block).unwrap();
    block[(offset - start) as usize] ^= 0x5a;
    dev.write(start, &block, WriteFlags::default()).unwrap();
}

#[test]
fn damage_before_the_last_flush_is_an_error_not_a_shorter_log() {
    // Entry 1 is the second write: header at block 3, data at block 4.
    for (what, offset) in [("header", 3 * 4096 + 40), ("data", 4 * 4096 + 7)] {
        let dev = flushed_log();
        assert_eq!(entries_read(dev.clone()).unwrap(), 4);
        flip_byte(&dev, offset);
        let err = entries_read(dev).expect_err(what).to_string();
        assert!(
            err.contains("entry 1") && err.contains("records 3 entries as flushed"),
            "{what}: {err}"
        );
    }
}

#[test]
fn a_torn_entry_after_the_last_flush_ends_the_log() {
    // The write after the FLUSH (entry 3, header at block 6, data at block 7) was never
    // flushed: a power cut may tear it, and the log ends before it.
    for offset in [6 * 4096 + 40, 7 * 4096 + 7] {
        let dev = flushed_log();
        flip_byte(&dev, offset);
        assert_eq!(entries_read(dev).unwrap(), 3);
    }
}

#[test]
fn a_resumed_log_keeps_what_was_logged_and_ignores_older_leftovers_past_its_end() {
    let dev = flushed_log();
    // After a first restart entry (block 8), two discards never flushed: a crash tore the
    // first (block 9) and kept the second (block 10), whose sequence number follows the
    // second restart entry's, in its place.
    let mut writer = LogWriter::resume(dev.clone()).unwrap();
    writer
        .append(Op::Discard {
            offset: 0,
            len: 4096,
        })
        .unwrap();
    writer
        .append(Op::Discard {
            offset: 0,
            len: 4096,
        })
        .unwrap();
    drop(writer);
    flip_byte(&dev, 9 * 4096 + 40);
    let mut writer = LogWriter::resume(dev.clone()).unwrap();
    let kinds = |dev: &Arc<dyn BlockDevice>| {
        let mut reader = LogReader::open(dev.clone()).unwrap();
        let mut kinds = Vec::new();
        while let Some((entry, _)) = reader.next_entry().unwrap() {
            kinds.push(entry.kind);
        }
        kinds
    };
    use EntryKind::*;
    assert_eq!(kinds(&dev), [Write, Write, Flush, Write, Restart, Restart]);
    // And what comes after the restart is read back.
    writer.append(Op::Flush).unwrap();
    assert_eq!(
        kinds(&dev),
        [Write, Write, Flush, Write, Restart, Restart, Flush]
    );
}

#[test]
fn a_full_log_is_cut_off_for_good_and_says_so() {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(4 * 4096));
    let mut log = LogWriter::create(dev.clone()).unwrap();
    let write = |log: &mut LogWriter| {
        log.append(Op::Write {
            offset: 0,
            data: &[1u8; 4096],
            fua: false,
        })
        .unwrap()
    };
    assert_eq!(write(&mut log), Appended::Logged);
    assert!(!LogReader::open(dev.clone()).unwrap().is_cut_off());
    assert_eq!(write(&mut log), Appended::CutOff);
    // A FLUSH entry would fit in the last block, but the log has a gap now: no more.
    let flush = log.append(Op::Flush).unwrap();
    assert_eq!(flush, Appended::CutOff);
    assert!(log.is_cut_off());
    let mut reader = LogReader::open(dev).unwrap();
    assert!(reader.is_cut_off());
    assert_eq!(
        reader.next_entry().unwrap().unwrap().0.kind,
        EntryKind::Write
    );
    assert!(reader.next_entry().unwrap().is_none());
}
