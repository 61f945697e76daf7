//! A sparse in-memory device, for tests and scratch space.

use parking_lot::Mutex;
use std::collections::HashMap;

use crate::device::{push_extent, BlockDevice, Capabilities, Extent, WriteFlags, ZeroFlags};
use crate::error::Result;

const PAGE: u64 = 4096;

/// Pages that were never written (or were discarded) take no memory and read as zeroes.
pub struct MemoryDevice {
    size: u64,
    pages: Mutex<HashMap<u64, Box<[u8]>>>,
}

impl MemoryDevice {
    pub fn new(size: u64) -> Self {
        MemoryDevice {
            size,
            pages: Mutex::new(HashMap::new()),
        }
    }

    /// Bytes of memory the written pages take.
    pub fn allocated(&self) -> u64 {
        self.pages.lock().len() as u64 * PAGE
    }

    /// Calls `f(page, offset_in_page, range_in_buffer)` for each page piece of a request.
    fn for_each_piece(
        offset: u64,
        len: usize,
        mut f: impl FnMut(u64, usize, std::ops::Range<usize>),
    ) {
        let mut done = 0usize;
        while done < len {
            let pos = offset + done as u64;
            let in_page = (pos % PAGE) as usize;
            let n = (PAGE as usize - in_page).min(len - done);
            f(pos / PAGE, in_page, done..done + n);
            done += n;
        }
    }

    fn drop_range(&self, offset: u64, len: u64) {
        let mut pages = self.pages.lock();
        Self::for_each_piece(offset, len as usize, |page, at, range| {
            if range.len() == PAGE as usize {
                pages.remove(&page);
            } else if let Some(p) = pages.get_mut(&page) {
                p[at..at + range.len()].fill(0);
            }
        });
    }
}

impl BlockDevice for MemoryDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::in_memory()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let pages = self.pages.lock();
        Self::for_each_piece(offset, buf.len(), |page, at, range| {
            match pages.get(&page) {
                Some(p) => buf[range.clone()].copy_from_slice(&p[at..at + range.len()]),
                None => buf[range].fill(0),
            }
        });
        Ok(())
    }

    fn write(&self, offset: u64, buf: &[u8], _flags: WriteFlags) -> Result<()> {
        let mut pages = self.pages.lock();
        Self::for_each_piece(offset, buf.len(), |page, at, range| {
            let p = pages
                .entry(page)
                .or_insert_with(|| vec![0u8; PAGE as usize].into());
            p[at..at + range.len()].copy_from_slice(&buf[range]);
        });
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.drop_range(offset, len);
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        self.drop_range(offset, len);
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let pages = self.pages.lock();
        let mut extents: Vec<Extent> = Vec::new();
        Self::for_each_piece(offset, len as usize, |page, _, range| {
            let extent = if pages.contains_key(&page) {
                Extent::data(range.len() as u64)
            } else {
                Extent::hole(range.len() as u64)
            };
            push_extent(&mut extents, extent);
        });
        Ok(extents)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discard_frees_memory() {
        let dev = MemoryDevice::new(1 << 20);
        dev.write(0, &[7u8; 8192], WriteFlags::default()).unwrap();
        assert_eq!(dev.allocated(), 8192);
        dev.discard(0, 8192).unwrap();
        assert_eq!(dev.allocated(), 0);
    }
}
