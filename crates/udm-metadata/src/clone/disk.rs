//! The clone metadata on disk: superblocks and bitmap blocks encoded, written by a commit,
//! formatted, read back by `load`, and the fallback to the older slot when the newer one is
//! damaged.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

use udm_block::{AlignedBuf, BlockDevice, BlockError, WriteFlags};

use super::*;
use crate::block::{read_u64, seal, verify, write_u64, BlockType};

pub(super) fn read_blocks(
    dev: &dyn BlockDevice,
    first: u64,
    count: u64,
) -> Result<AlignedBuf, MetadataError> {
    let mut buf = AlignedBuf::zeroed((count as usize) * BLOCK_SIZE);
    dev.read(first * BLOCK_SIZE as u64, &mut buf)?;
    Ok(buf)
}

pub(super) fn parse_superblock(number: u64, block: &[u8]) -> Result<Superblock, MetadataError> {
    verify(BlockType::CloneSuperblock, number, block)?;
    if &block[16..24] != MAGIC {
        return Err(MetadataError::Corrupt {
            block: number,
            what: "bad magic".into(),
        });
    }
    let version = u32::from_le_bytes(block[24..28].try_into().unwrap());
    if version != VERSION {
        return Err(MetadataError::Corrupt {
            block: number,
            what: format!("format version {version}, this udm reads {VERSION}"),
        });
    }
    Ok(Superblock {
        transaction: read_u64(block, 32),
        geometry: CloneGeometry {
            region_sectors: read_u64(block, 40),
            target_sectors: read_u64(block, 48),
        },
    })
}

impl CloneMetadata {
    pub(super) fn write_commit(
        &self,
        blocks: &BTreeSet<u64>,
        transaction: u64,
        slot: u64,
        flush_data: &dyn Fn() -> Result<(), BlockError>,
    ) -> Result<(), MetadataError> {
        let area = self.geometry.area_start(slot);
        // Encode first, then flush the data: every bit encoded was set after its data was
        // written, so the flush below makes that data durable before the bit is.
        let encoded: Vec<(u64, AlignedBuf)> = blocks
            .iter()
            .map(|&b| (b, self.encode_bitmap_block(area + b, b)))
            .collect();
        let hydrated = self.hydrated_count();
        flush_data()?;
        for run in contiguous_runs(&encoded) {
            let mut buf = AlignedBuf::zeroed(run.len() * BLOCK_SIZE);
            for (i, (_, block)) in run.iter().enumerate() {
                buf[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE].copy_from_slice(block);
            }
            self.dev.write(
                (area + run[0].0) * BLOCK_SIZE as u64,
                &buf,
                WriteFlags::default(),
            )?;
        }
        self.dev.flush()?;
        let sb = self.encode_superblock(slot, transaction, hydrated);
        self.dev
            .write(slot * BLOCK_SIZE as u64, &sb, WriteFlags::default())?;
        self.dev.flush()?;
        Ok(())
    }

    fn encode_bitmap_block(&self, number: u64, index: u64) -> AlignedBuf {
        let mut block = AlignedBuf::zeroed(BLOCK_SIZE);
        let first = index * WORDS_PER_BLOCK;
        for i in 0..WORDS_PER_BLOCK {
            let Some(word) = self.bits.get((first + i) as usize) else {
                break;
            };
            write_u64(
                &mut block,
                HEADER_SIZE + i as usize * 8,
                word.load(Ordering::Acquire),
            );
        }
        seal(BlockType::CloneBitmap, number, &mut block);
        block
    }

    fn encode_superblock(&self, slot: u64, transaction: u64, hydrated: u64) -> AlignedBuf {
        let g = self.geometry;
        let mut block = AlignedBuf::zeroed(BLOCK_SIZE);
        block[16..24].copy_from_slice(MAGIC);
        block[24..28].copy_from_slice(&VERSION.to_le_bytes());
        write_u64(&mut block, 32, transaction);
        write_u64(&mut block, 40, g.region_sectors);
        write_u64(&mut block, 48, g.target_sectors);
        write_u64(&mut block, 56, g.regions());
        write_u64(&mut block, 64, g.bitmap_blocks());
        write_u64(&mut block, 72, g.area_start(slot));
        write_u64(&mut block, 80, hydrated);
        seal(BlockType::CloneSuperblock, slot, &mut block);
        block
    }

    /// Writes an empty bitmap to area A and superblock A (transaction 1).
    pub(super) fn format(&self) -> Result<(), MetadataError> {
        let blocks = self.geometry.bitmap_blocks();
        let mut area = AlignedBuf::zeroed(blocks as usize * BLOCK_SIZE);
        for b in 0..blocks {
            let block = self.encode_bitmap_block(self.geometry.area_start(0) + b, b);
            area[(b as usize) * BLOCK_SIZE..(b as usize + 1) * BLOCK_SIZE].copy_from_slice(&block);
        }
        self.dev.write(
            self.geometry.area_start(0) * BLOCK_SIZE as u64,
            &area,
            WriteFlags::default(),
        )?;
        self.dev.flush()?;
        let sb = self.encode_superblock(0, 1, 0);
        self.dev.write(0, &sb, WriteFlags::default())?;
        self.dev.flush()?;
        let mut st = self.state.lock();
        st.transaction = 1;
        st.slot = 0;
        // Area B has never been written: the first commit must write all of it.
        st.previous = (0..blocks).collect();
        st.dirty.clear();
        Ok(())
    }

    /// Reads the last durable commit into memory (at open, and to abort after a failed
    /// commit). Changes since that commit are dropped.
    pub fn load(&self) -> Result<(), MetadataError> {
        let reported = self.fallback.lock().take();
        let supers = read_blocks(&*self.dev, 0, SUPERBLOCKS)?;
        let parsed: Vec<_> = (0..SUPERBLOCKS)
            .map(|slot| {
                parse_superblock(
                    slot,
                    &supers[slot as usize * BLOCK_SIZE..(slot as usize + 1) * BLOCK_SIZE],
                )
            })
            .collect();
        let (slot, current) = match (&parsed[0], &parsed[1]) {
            (Ok(a), Ok(b)) if b.transaction > a.transaction => (1, b),
            (Ok(a), Ok(_)) => (0, a),
            (Ok(a), Err(e)) => (0, self.fall_back(0, a, 1, e, &supers)),
            (Err(e), Ok(b)) => (1, self.fall_back(1, b, 0, e, &supers)),
            (Err(a), Err(b)) => {
                return Err(MetadataError::Corrupt {
                    block: 0,
                    what: format!(
                        "no valid clone superblock (slot 0: {a}; slot 1: {b}) on a device \
                         that has been committed to; refusing to use or reformat it"
                    ),
                })
            }
        };
        if current.geometry != self.geometry {
            return Err(MetadataError::Mismatch(format!(
                "metadata was made for region size {} and length {} sectors, but the table \
                 says region size {} and length {}",
                current.geometry.region_sectors,
                current.geometry.target_sectors,
                self.geometry.region_sectors,
                self.geometry.target_sectors
            )));
        }
        // Said once, not at every load of the same disk: a table's first resume rereads
        // what its open has just read (and warned about).
        if let Some(fallback) = self.fallback.lock().as_ref() {
            if reported.as_ref() != Some(fallback) {
                log::warn!("clone metadata: {fallback}");
            }
        }
        let other_valid = parsed[(1 - slot) as usize].is_ok();
        let (words, previous) = self.read_area(slot, other_valid)?;
        // The bits and their count change together, under the lock `set_hydrated` takes.
        let mut st = self.state.lock();
        for (word, value) in self.bits.iter().zip(&words) {
            word.store(*value, Ordering::Release);
        }
        let hydrated = words.iter().map(|w| w.count_ones() as u64).sum();
        self.hydrated.store(hydrated, Ordering::Release);
        st.transaction = current.transaction;
        st.slot = slot;
        st.previous = previous;
        st.dirty.clear();
        Ok(())
    }

    /// The bitmap words of the area `slot` names, and the blocks the other area lacks (all of
    /// them when the other slot is not valid): the next commit writes the other area.
    fn read_area(
        &self,
        slot: u64,
        other_valid: bool,
    ) -> Result<(Vec<u64>, BTreeSet<u64>), MetadataError> {
        let blocks = self.geometry.bitmap_blocks();
        let area = read_blocks(&*self.dev, self.geometry.area_start(slot), blocks)?;
        let other = read_blocks(&*self.dev, self.geometry.area_start(1 - slot), blocks)?;
        let mut previous = BTreeSet::new();
        let mut words = Vec::with_capacity(self.bits.len());
        let regions = self.regions();
        for b in 0..blocks {
            let range = (b as usize) * BLOCK_SIZE..(b as usize + 1) * BLOCK_SIZE;
            let block = &area[range.clone()];
            verify(
                BlockType::CloneBitmap,
                self.geometry.area_start(slot) + b,
                block,
            )?;
            if !other_valid || other[range.start + HEADER_SIZE..range.end] != block[HEADER_SIZE..] {
                previous.insert(b);
            }
            for i in 0..WORDS_PER_BLOCK {
                let index = b * WORDS_PER_BLOCK + i;
                if index as usize >= self.bits.len() {
                    break;
                }
                let mut value = read_u64(block, HEADER_SIZE + i as usize * 8);
                // Bits past the last region carry no meaning; keep them clear.
                let first_region = index * 64;
                if first_region + 64 > regions {
                    value &= (1u64 << (regions - first_region)) - 1;
                }
                words.push(value);
            }
        }
        Ok((words, previous))
    }
}

impl CloneMetadata {
    /// Uses the valid slot when the other is not valid, and says so unless the other was
    /// simply never written (slot 1 before the first commit). A torn superblock from a crash
    /// mid-commit lands here too, and then nothing acknowledged was lost; a newer slot
    /// damaged after its commit completed means the changes of that commit are gone. Which
    /// of the two it was cannot be told from the disk, so the fallback is always reported.
    fn fall_back<'s>(
        &self,
        used: u64,
        current: &'s Superblock,
        bad: u64,
        why: &MetadataError,
        supers: &[u8],
    ) -> &'s Superblock {
        let block = &supers[bad as usize * BLOCK_SIZE..(bad as usize + 1) * BLOCK_SIZE];
        if block.iter().all(|&x| x == 0) {
            return current;
        }
        // Unverified, but the best hint of how much was lost.
        let claimed = (&block[16..24] == MAGIC).then(|| read_u64(block, 32));
        let fallback = SuperblockFallback {
            used_slot: used,
            used_transaction: current.transaction,
            bad_slot: bad,
            bad_slot_claims_transaction: claimed,
            reason: why.to_string(),
        };
        *self.fallback.lock() = Some(fallback);
        current
    }

    /// Set when the last open or reload had to use the older superblock slot.
    pub fn fallback(&self) -> Option<SuperblockFallback> {
        self.fallback.lock().clone()
    }
}

/// What `udm status --json` and the log say when the newest superblock was unusable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuperblockFallback {
    pub used_slot: u64,
    pub used_transaction: u64,
    pub bad_slot: u64,
    /// The transaction id the bad slot's (unverified) bytes carry, if it still has our magic.
    pub bad_slot_claims_transaction: Option<u64>,
    pub reason: String,
}

impl std::fmt::Display for SuperblockFallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "superblock slot {} is invalid ({}",
            self.bad_slot, self.reason
        )?;
        if let Some(t) = self.bad_slot_claims_transaction {
            write!(f, "; it claims transaction {t}")?;
        }
        write!(
            f,
            "); using slot {} at transaction {}: a commit after it, if one completed, is lost",
            self.used_slot, self.used_transaction
        )
    }
}

fn contiguous_runs(blocks: &[(u64, AlignedBuf)]) -> Vec<&[(u64, AlignedBuf)]> {
    let mut runs = Vec::new();
    let mut start = 0;
    for i in 1..=blocks.len() {
        if i == blocks.len() || blocks[i].0 != blocks[i - 1].0 + 1 {
            runs.push(&blocks[start..i]);
            start = i;
        }
    }
    runs
}
