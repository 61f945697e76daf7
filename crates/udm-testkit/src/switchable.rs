//! A device for failure tests.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use udm_block::{BlockDevice, BlockError, Extent, MemoryDevice, Result, WriteFlags, ZeroFlags};

/// Runs at every read (or flush) of a [`Switchable`], before it.
pub type Hook = Box<dyn Fn() + Send + Sync>;

/// A memory device that can be told to fail reads or writes (flushes fail with writes), counts
/// what reaches it, and can call a test back at every read and every flush. Several can share one memory
/// device ([`Switchable::over`]): routes to one disk that fail apart, a multipath's paths.
pub struct Switchable {
    pub inner: Arc<MemoryDevice>,
    pub fail_reads: AtomicBool,
    pub fail_writes: AtomicBool,
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
    pub on_read: Mutex<Option<Hook>>,
    pub on_flush: Mutex<Option<Hook>>,
}

impl Switchable {
    pub fn new(size: u64) -> Self {
        Self::over(Arc::new(MemoryDevice::new(size)))
    }

    /// A switchable route to `inner`.
    pub fn over(inner: Arc<MemoryDevice>) -> Self {
        Switchable {
            inner,
            fail_reads: AtomicBool::new(false),
            fail_writes: AtomicBool::new(false),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            on_read: Mutex::default(),
            on_flush: Mutex::default(),
        }
    }

    fn check(&self, fail: &AtomicBool, count: Option<&AtomicU64>) -> Result<()> {
        if let Some(count) = count {
            count.fetch_add(1, Ordering::SeqCst);
        }
        if fail.load(Ordering::SeqCst) {
            return Err(BlockError::Io("switched off".into()));
        }
        Ok(())
    }
}

impl BlockDevice for Switchable {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        if let Some(hook) = &*self.on_read.lock() {
            hook();
        }
        self.check(&self.fail_reads, Some(&self.reads))?;
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        self.check(&self.fail_writes, Some(&self.writes))?;
        self.inner.write(offset, buf, flags)
    }
    fn flush(&self) -> Result<()> {
        if let Some(hook) = &*self.on_flush.lock() {
            hook();
        }
        self.check(&self.fail_writes, Some(&self.flushes))
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.check(&self.fail_writes, Some(&self.writes))?;
        self.inner.write_zeroes(offset, len, flags)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len)
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.inner.block_status(offset, len)
    }
}
