//! The thin pool's metadata under damage. Random bytes never pass dm's checksums, so the
//! input is a list of edits to a valid pool (several devices, a snapshot of a snapshot, a
//! held metadata snapshot, counts of 3 and more), each damaged block resealed unless the edit
//! says not to: the damage reaches the structure checks, as a writer's bug would.

use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

use udm_block::{BlockDevice, MemoryDevice, WriteFlags};
use udm_metadata::thin::checksum::{raw_crc32c, seal, Kind};
use udm_metadata::{ThinError, ThinMetadata, BLOCK_SIZE};

const KINDS: [Kind; 4] = [Kind::Superblock, Kind::Node, Kind::Bitmap, Kind::Index];

/// The kind whose salt block `block` carries, if any.
fn kind_of(block: &[u8]) -> Option<Kind> {
    let stored = u32::from_le_bytes(block[0..4].try_into().unwrap());
    let salt = stored ^ raw_crc32c(&block[4..]);
    KINDS.into_iter().find(|k| k.salt() == salt)
}

/// The valid pool every input edits, and its blocks in use.
fn base() -> &'static (Vec<u8>, Vec<usize>) {
    static BASE: OnceLock<(Vec<u8>, Vec<usize>)> = OnceLock::new();
    BASE.get_or_init(|| {
        let dev = Arc::new(MemoryDevice::new(1 << 20));
        let mut meta = ThinMetadata::open(dev.clone(), 128, 40_000).expect("format");
        meta.create_thin(1).unwrap();
        for vb in 0..700 {
            let b = meta.alloc_data_block().unwrap().unwrap();
            meta.insert(1, vb * 3, b).unwrap();
        }
        meta.create_snap(2, 1).unwrap();
        meta.create_snap(3, 2).unwrap();
        for vb in 0..30 {
            let b = meta.alloc_data_block().unwrap().unwrap();
            meta.insert(3, vb * 7, b).unwrap();
        }
        meta.commit().unwrap();
        meta.reserve_metadata_snap().unwrap();
        meta.delete(1).unwrap();
        meta.commit().unwrap();
        let mut image = vec![0u8; 1 << 20];
        dev.read(0, &mut image).unwrap();
        let used = (0..image.len() / BLOCK_SIZE)
            .filter(|&b| kind_of(&image[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE]).is_some())
            .collect();
        (image, used)
    })
}

/// Applies the edits in `data` (4 bytes each: block, offset, xor) to the base pool.
pub fn damaged(data: &[u8]) -> Vec<u8> {
    let (image, used) = base();
    let mut image = image.clone();
    let mut reseal = BTreeSet::new();
    for edit in data.chunks_exact(4) {
        let b = used[edit[0] as usize % used.len()];
        let at = b * BLOCK_SIZE + u16::from_le_bytes([edit[1], edit[2]]) as usize % BLOCK_SIZE;
        image[at] ^= edit[3];
        // The top bit of the block byte leaves the checksum broken.
        if edit[0] & 0x80 == 0 {
            reseal.insert(b);
        }
    }
    for b in reseal {
        let block = &mut image[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE];
        if let Some(kind) = KINDS.into_iter().find(|k| {
            let (base, _) = base();
            kind_of(&base[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE]) == Some(*k)
        }) {
            seal(kind, b as u64, block);
        }
    }
    image
}

/// Everything a pool does, so a damaged block is met wherever it is.
fn exercise(meta: &mut ThinMetadata) -> Result<(), ThinError> {
    for info in meta.devices() {
        meta.lookup_range(info.id, 0, u64::MAX)?;
        meta.highest_mapped(info.id)?;
        meta.lookup(info.id, 21)?;
    }
    for b in [0, 1, 700, 39_999] {
        meta.data_ref_count(b)?;
    }
    let ids: Vec<u32> = meta.devices().iter().map(|d| d.id).collect();
    if let Some(&first) = ids.first() {
        meta.create_snap(9, first)?;
        for vb in 0..40 {
            let b = meta.alloc_data_block()?.unwrap_or(0);
            meta.insert(first, vb * 5, b)?;
            meta.remove(9, vb * 3)?;
        }
    }
    if let Some(&last) = ids.last() {
        meta.delete(last)?;
    }
    if meta.held_root().is_some() {
        meta.release_metadata_snap()?;
    }
    meta.commit()
}

/// A damaged pool opens and works, or fails with an error; never a panic. What a damaged
/// pool committed opens again or fails with an error.
pub fn thin_metadata(data: &[u8]) {
    let image = damaged(data);
    let dev = Arc::new(MemoryDevice::new(image.len() as u64));
    dev.write(0, &image, WriteFlags::default())
        .expect("memory write");
    let Ok(mut meta) = ThinMetadata::open(dev.clone(), 128, 40_000) else {
        return;
    };
    if exercise(&mut meta).is_err() {
        let _ = meta.abort();
        return;
    }
    if let Ok(mut again) = ThinMetadata::open(dev, 128, 40_000) {
        let _ = exercise(&mut again);
    }
}
