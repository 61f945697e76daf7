//! `log-writes <dev> <log dev>`: passes I/O to `dev` and records every write, discard,
//! zeroing, FLUSH and FUA in order, with its data, on `log dev`, so that `udm replay-log` can
//! rebuild the device as it was at any flush point (the kernel's dm-log-writes). Message:
//! `mark <text>`. Each construction starts a new log.

use std::sync::{Arc, Mutex, RwLock};

use udm_block::{
    BlockDevice, BlockError, Capabilities, Extent, OpenMode, Result, WriteFlags, ZeroFlags,
    SECTOR_SIZE,
};
use udm_metadata::log::{EntryKind, LogWriter};
use udm_metadata::MetadataError;

use crate::args::Args;
use crate::target::{Target, TargetContext, TargetError};

pub struct LogWrites {
    dev_ref: String,
    log_ref: String,
    dev: Arc<dyn BlockDevice>,
    len: u64,
    log: Mutex<LogWriter>,
    /// Writes hold it shared while they complete and are logged; a flush holds it alone, so
    /// every write logged before a FLUSH entry completed before the flush began.
    order: RwLock<()>,
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let (dev_ref, dev) = args.device(ctx, "dev", OpenMode::ReadWrite)?;
    let (log_ref, log_dev) = args.device(ctx, "log dev", OpenMode::Exclusive)?;
    ctx.require(&dev_ref, &*dev, 0, ctx.len)
        .map_err(|e| args.error(e))?;
    let log = LogWriter::create(log_dev)
        .map_err(|e| args.error(format!("log device '{log_ref}': {e}")))?;
    Ok(Arc::new(LogWrites {
        dev_ref,
        log_ref,
        dev,
        len: ctx.len,
        log: Mutex::new(log),
        order: RwLock::new(()),
    }))
}

fn logged(e: MetadataError) -> BlockError {
    match e {
        MetadataError::Io(e) => e,
        other => BlockError::Io(format!("log-writes: {other}")),
    }
}

impl LogWrites {
    fn append(
        &self,
        kind: EntryKind,
        fua: bool,
        offset: u64,
        len: u64,
        data: Option<&[u8]>,
        mark: &str,
    ) -> Result<()> {
        self.log
            .lock()
            .unwrap()
            .append(kind, fua, offset, len, data, mark)
            .map_err(logged)
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
        let _shared = self.order.read().unwrap();
        self.dev.write(offset, buf, flags)?;
        self.append(
            EntryKind::Write,
            flags.fua,
            offset,
            buf.len() as u64,
            Some(buf),
            "",
        )
    }
    fn flush(&self) -> Result<()> {
        let _alone = self.order.write().unwrap();
        self.dev.flush()?;
        self.append(EntryKind::Flush, false, 0, 0, None, "")
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let _shared = self.order.read().unwrap();
        self.dev.discard(offset, len)?;
        self.append(EntryKind::Discard, false, offset, len, None, "")
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        let _shared = self.order.read().unwrap();
        self.dev.write_zeroes(offset, len, flags)?;
        self.append(EntryKind::WriteZeroes, flags.fua, offset, len, None, "")
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
        // As the kernel: entries logged, and the last log sector used.
        let log = self.log.lock().unwrap();
        format!(
            "{} {}",
            log.entries(),
            log.blocks_used() * (4096 / SECTOR_SIZE) - 1
        )
    }
    fn message(&self, words: &[&str]) -> Result<String, TargetError> {
        match words {
            [mark, text] if mark.eq_ignore_ascii_case("mark") => {
                let _alone = self.order.write().unwrap();
                self.append(EntryKind::Mark, false, 0, 0, None, text)
                    .map_err(|e| TargetError::new(format!("log-writes: {e}")))?;
                Ok(String::new())
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
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use udm_block::{conformance, BlockDevice, WriteFlags};
    use udm_metadata::log::{EntryKind, LogReader};

    use crate::testing::{build, memory_resolver};

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
}
