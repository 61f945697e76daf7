//! `log-writes <dev> <log dev>`: passes I/O to `dev` and records every write, discard,
//! zeroing, FLUSH and FUA in order, with its data, on `log dev`, so that `udm replay-log` can
//! rebuild the device as it was at any flush point (the kernel's dm-log-writes). Message:
//! `mark <text>`. Each table starts a new log when it first goes live (not when it is loaded:
//! an inactive table must not write under the live one's log). A table that brings the device
//! back after a daemon restart goes on with the log instead, after a restart entry: a restart
//! is not a new table, and the record of what came before it is what the user is testing.
//!
//! When the log device fills up, logging stops for good and I/O goes on to `dev` unlogged, as
//! in the kernel: a full log must not fail the writes of the filesystem above. A warning is
//! logged, an event raised, the status line says `log full` and the log itself records that it
//! was cut off, so `udm replay-log` says so.

use parking_lot::{Mutex, RwLock};
use std::sync::Arc;

use log::warn;

use udm_block::{
    BlockDevice, BlockError, Capabilities, Extent, OpenMode, Result, WriteFlags, ZeroFlags,
    SECTOR_SIZE,
};
use udm_metadata::log::{Appended, LogReader, LogWriter, Op, MIN_LOG_SIZE};
use udm_metadata::MetadataError;

use crate::args::Args;
use crate::target::{EventSink, Target, TargetContext, TargetError};

pub struct LogWrites {
    dev_ref: String,
    log_ref: String,
    dev: Arc<dyn BlockDevice>,
    len: u64,
    log_dev: Arc<dyn BlockDevice>,
    /// This table brings the device back after a daemon restart: it goes on with the log.
    continues_log: bool,
    log: Mutex<Log>,
    /// Writes hold it shared while they complete and are logged; a flush holds it alone, so
    /// every write logged before a FLUSH entry completed before the flush began.
    order: RwLock<()>,
    raise_event: EventSink,
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let (dev_ref, dev) = args.device(ctx, "dev", OpenMode::ReadWrite)?;
    let (log_ref, log_dev) = args.device(ctx, "log dev", OpenMode::Exclusive)?;
    ctx.require(&dev_ref, &*dev, 0, ctx.len)
        .map_err(|e| args.error(e))?;
    let unusable = |e: MetadataError| args.error(format!("log device '{log_ref}': {e}"));
    if ctx.restoring {
        // Refuse now what could not be continued (a damaged log), naming why.
        LogReader::open(log_dev.clone())
            .and_then(|mut log| log.read_to_end())
            .map_err(unusable)?;
    } else if log_dev.size() < MIN_LOG_SIZE {
        return Err(unusable(MetadataError::Mismatch(format!(
            "{} bytes; a log needs at least {MIN_LOG_SIZE}",
            log_dev.size()
        ))));
    }
    Ok(Arc::new(LogWrites {
        dev_ref,
        log_ref,
        dev,
        len: ctx.len,
        log_dev,
        continues_log: ctx.restoring,
        log: Mutex::new(Log::NotStarted),
        order: RwLock::new(()),
        raise_event: ctx.raise_event.clone(),
    }))
}

fn logged(e: MetadataError) -> BlockError {
    match e {
        MetadataError::Io(e) => e,
        other => BlockError::Io(format!("log-writes: {other}")),
    }
}

/// The log of a table, from the moment it first goes live.
enum Log {
    NotStarted,
    Started(LogWriter),
    /// Starting it failed (an I/O error on the log device): I/O fails, naming why, rather than
    /// going on unlogged from the first write.
    Failed(String),
}

impl LogWrites {
    /// Starts the log if this is the first time: a new one, or the one on the device when
    /// this table brings the device back after a restart.
    fn started(&self) -> Result<parking_lot::MappedMutexGuard<'_, LogWriter>> {
        let mut log = self.log.lock();
        if let Log::NotStarted = *log {
            let started = if self.continues_log {
                LogWriter::resume(self.log_dev.clone())
            } else {
                LogWriter::create(self.log_dev.clone())
            };
            *log = match started {
                Ok(writer) => Log::Started(writer),
                Err(e) => {
                    let why = format!("log-writes: log device '{}': {e}", self.log_ref);
                    warn!("{why}");
                    Log::Failed(why)
                }
            };
        }
        parking_lot::MutexGuard::try_map(log, |log| match log {
            Log::Started(writer) => Some(writer),
            _ => None,
        })
        .map_err(|log| match &*log {
            Log::Failed(why) => BlockError::Io(why.clone()),
            _ => unreachable!("the log was started above"),
        })
    }

    /// Logs an operation that completed on `dev`. Once the log is full the operations go
    /// unlogged, and still succeed (`Appended::CutOff`): the device did what was asked.
    fn append(&self, op: Op) -> Result<Appended> {
        let mut log = self.started()?;
        let was_cut_off = log.is_cut_off();
        let appended = log.append(op).map_err(logged)?;
        if !was_cut_off && log.is_cut_off() {
            warn!(
                "log-writes: ran out of space on the log device '{}' after {} entries: \
                 logging stopped, I/O goes on to '{}' unlogged",
                self.log_ref,
                log.entries(),
                self.dev_ref
            );
            (self.raise_event)();
        }
        Ok(appended)
    }

    fn log_io(&self, op: Op) -> Result<()> {
        self.append(op).map(|_| ())
    }
}

impl BlockDevice for LogWrites {
    fn size(&self) -> u64 {
        self.len
    }
    fn capabilities(&self) -> Capabilities {
        self.dev.capabilities()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.dev.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        let _shared = self.order.read();
        self.dev.write(offset, buf, flags)?;
        self.log_io(Op::Write {
            offset,
            data: buf,
            fua: flags.fua,
        })
    }
    fn flush(&self) -> Result<()> {
        let _alone = self.order.write();
        self.dev.flush()?;
        self.log_io(Op::Flush)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let _shared = self.order.read();
        self.dev.discard(offset, len)?;
        self.log_io(Op::Discard { offset, len })
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        let _shared = self.order.read();
        self.dev.write_zeroes(offset, len, flags)?;
        self.log_io(Op::WriteZeroes {
            offset,
            len,
            fua: flags.fua,
        })
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.dev.block_status(offset, len)
    }
}

impl Target for LogWrites {
    fn type_name(&self) -> &'static str {
        "log-writes"
    }
    fn args(&self) -> String {
        format!("{} {}", self.dev_ref, self.log_ref)
    }
    fn status(&self) -> String {
        // As the kernel: entries logged, and the last log sector used; then whether the log
        // filled up.
        match self.started() {
            Ok(log) => format!(
                "{} {}{}",
                log.entries(),
                log.blocks_used() * (4096 / SECTOR_SIZE) - 1,
                if log.is_cut_off() { " log full" } else { "" }
            ),
            Err(_) => "0 0 log failed".into(),
        }
    }
    fn message(&self, words: &[&str]) -> Result<String, TargetError> {
        match words {
            [mark, text] if mark.eq_ignore_ascii_case("mark") => {
                let _alone = self.order.write();
                match self.append(Op::Mark(text)) {
                    Ok(Appended::Logged) => Ok(String::new()),
                    Ok(Appended::CutOff) => Err(TargetError::new(format!(
                        "log-writes: mark '{text}' not logged: the log device '{}' is full",
                        self.log_ref
                    ))),
                    Err(e) => Err(TargetError::new(format!("log-writes: {e}"))),
                }
            }
            _ => Err(TargetError::new(format!(
                "log-writes: unknown message '{}' (expected: mark <text>)",
                words.join(" ")
            ))),
        }
    }
    fn references(&self) -> Vec<String> {
        vec![self.dev_ref.clone(), self.log_ref.clone()]
    }
    fn resume(&self) {
        // Errors are kept and reported by the I/O that needs the log.
        let _ = self.started();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use udm_block::{BlockDevice, WriteFlags};

    use udm_metadata::log::{EntryKind, LogReader};
    use udm_testkit::conformance;

    use crate::testing::{build, build_counting_events, memory_resolver};

    #[test]
    fn passes_the_conformance_suite_and_logs_in_order() {
        let resolver = memory_resolver(&[("dev", 8 << 20), ("log", 64 << 20)]);
        let table = build(&resolver, "0 16384 log-writes dev log").unwrap();
        conformance::run_all(&table);
        table
            .write(0, &[5u8; 4096], WriteFlags { fua: true })
            .unwrap();
        table
            .target_at(0)
            .unwrap()
            .message(&["mark", "done"])
            .unwrap();
        let mut reader = LogReader::open(resolver.get("log") as Arc<dyn BlockDevice>).unwrap();
        let mut last = None;
        let mut writes = 0;
        while let Some((entry, _)) = reader.next_entry().unwrap() {
            writes += (entry.kind == EntryKind::Write) as u32;
            last = Some(entry);
        }
        let last = last.unwrap();
        assert_eq!((last.kind, last.mark.as_str()), (EntryKind::Mark, "done"));
        assert!(writes > 10);
        assert!(table.target_at(0).unwrap().message(&["bogus"]).is_err());
    }

    #[test]
    fn a_full_log_stops_logging_and_writes_go_on() {
        // 16 blocks: the superblock and seven 4 KiB writes (header + data) fill the log.
        let resolver = memory_resolver(&[("dev", 8 << 20), ("log", 16 * 4096)]);
        let (table, events) =
            build_counting_events(&resolver, "0 16384 log-writes dev log").unwrap();
        for i in 0..20u8 {
            table
                .write(u64::from(i) * 4096, &[i + 1; 4096], WriteFlags::default())
                .unwrap();
        }
        table.flush().unwrap();
        table.discard(1 << 20, 4096).unwrap();
        let mut data = vec![0u8; 20 * 4096];
        resolver.get("dev").read(0, &mut data).unwrap();
        assert!(data
            .chunks(4096)
            .enumerate()
            .all(|(i, block)| block.iter().all(|&b| b == i as u8 + 1)));
        assert_eq!(table.status_lines()[0], "0 16384 log-writes 7 119 log full");
        assert_eq!(events.load(std::sync::atomic::Ordering::SeqCst), 1);
        let err = table
            .target_at(0)
            .unwrap()
            .message(&["mark", "late"])
            .unwrap_err();
        assert!(
            err.to_string().contains("the log device 'log' is full"),
            "{err}"
        );
        // The log holds the seven writes (the FLUSH after them would have fit, but logging
        // stopped for good) and says it was cut off.
        let mut reader = LogReader::open(resolver.get("log") as Arc<dyn BlockDevice>).unwrap();
        assert!(reader.is_cut_off());
        let mut entries = 0;
        while let Some((entry, data)) = reader.next_entry().unwrap() {
            assert_eq!(
                (entry.kind, entry.offset),
                (EntryKind::Write, entries * 4096)
            );
            assert!(data.iter().all(|&b| b == entries as u8 + 1));
            entries += 1;
        }
        assert_eq!(entries, 7);
    }
}
