//! The transient exception store (`N`): chunks are handed out from the start of the COW
//! device and the table lives only in memory, as in the kernel. Nothing is written but data.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use udm_block::SECTOR_SIZE;

use super::layout::check_chunk_sectors;
use super::{ExceptionStore, StoreError, Usage};

pub struct TransientStore {
    chunk_sectors: u64,
    chunks: u64,
    device_sectors: u64,
    next_free: AtomicU64,
    valid: AtomicBool,
}

impl TransientStore {
    /// A store of `chunk_sectors` chunks on a device of `device_bytes`.
    pub fn new(chunk_sectors: u64, device_bytes: u64) -> Result<Self, StoreError> {
        check_chunk_sectors(chunk_sectors).map_err(StoreError::Corrupt)?;
        let chunks = device_bytes / (chunk_sectors * SECTOR_SIZE);
        if chunks == 0 {
            return Err(StoreError::TooSmall(format!(
                "{} sectors do not hold one chunk of {chunk_sectors}",
                device_bytes / SECTOR_SIZE
            )));
        }
        Ok(TransientStore {
            chunk_sectors,
            chunks,
            device_sectors: device_bytes / SECTOR_SIZE,
            next_free: AtomicU64::new(0),
            valid: AtomicBool::new(true),
        })
    }
}

impl ExceptionStore for TransientStore {
    fn chunk_sectors(&self) -> u64 {
        self.chunk_sectors
    }

    fn allocate(&self) -> Result<u64, StoreError> {
        if !self.valid.load(Ordering::Acquire) {
            return Err(StoreError::Invalid);
        }
        self.next_free
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |next| {
                (next < self.chunks).then_some(next + 1)
            })
            .map_err(|_| StoreError::Full)
    }

    fn submit(&self, _records: &[super::Record]) -> Result<u64, StoreError> {
        if !self.valid.load(Ordering::Acquire) {
            return Err(StoreError::Invalid);
        }
        Ok(0)
    }

    fn wait(&self, _ticket: u64) -> Result<(), StoreError> {
        Ok(())
    }

    fn invalidate(&self) -> Result<(), StoreError> {
        self.valid.store(false, Ordering::Release);
        Ok(())
    }

    fn usage(&self) -> Usage {
        Usage {
            allocated: self.next_free.load(Ordering::Acquire) * self.chunk_sectors,
            total: self.device_sectors,
            metadata: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_every_chunk_once_then_is_full() {
        let store = TransientStore::new(8, 3 * 4096 + 512).unwrap();
        assert_eq!(
            (0..3)
                .map(|_| store.allocate().unwrap())
                .collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(store.allocate(), Err(StoreError::Full));
        assert_eq!(
            store.usage(),
            Usage {
                allocated: 24,
                total: 25,
                metadata: 0
            }
        );
        store.invalidate().unwrap();
        assert_eq!(store.submit(&[]), Err(StoreError::Invalid));
    }
}
