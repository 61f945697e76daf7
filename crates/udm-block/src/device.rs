//! The trait every layer implements, and the shared vocabulary of its requests.

use std::sync::OnceLock;

use crate::error::Result;
use crate::map::{MapOp, Mapping};

/// Extent flag: the range is not allocated (reads as zero unless `EXTENT_ZERO` is clear).
pub const EXTENT_HOLE: u32 = 1;
/// Extent flag: the range reads as zeroes.
pub const EXTENT_ZERO: u32 = 2;

/// One run of a block-status answer. The flags use NBD's `base:allocation` bits, which are also
/// what SEEK_HOLE/SEEK_DATA and a clone's bitmap can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub len: u64,
    pub flags: u32,
}

impl Extent {
    pub fn data(len: u64) -> Self {
        Extent { len, flags: 0 }
    }
    pub fn hole(len: u64) -> Self {
        Extent {
            len,
            flags: EXTENT_HOLE | EXTENT_ZERO,
        }
    }
    pub fn zero(len: u64) -> Self {
        Extent {
            len,
            flags: EXTENT_ZERO,
        }
    }
}

/// Appends `extent` to an answer, joining it to the last run when the flags are the same, so
/// that layers which ask below piece by piece still answer with whole runs.
pub fn push_extent(extents: &mut Vec<Extent>, extent: Extent) {
    match extents.last_mut() {
        Some(last) if last.flags == extent.flags => last.len += extent.len,
        _ => extents.push(extent),
    }
}

/// Cuts an answer for `[offset, offset + len)` to `len` bytes, dropping what lies beyond
/// (it may be left empty).
pub fn clip_extents(extents: &mut Vec<Extent>, len: u64) {
    let mut left = len;
    extents.retain_mut(|e| {
        e.len = e.len.min(left);
        left -= e.len;
        e.len > 0
    });
}

/// The same answer in runs of whole `granule`s (a sector), for an answer that may describe
/// single bytes (an NBD server's may). A granule made of several runs has only the flags they
/// all have: it is a hole or zero only if every byte of it is, since callers act on whole
/// sectors and zeroing a sector with a byte of data in it loses that byte. A granule the
/// answer ends inside of is left out; the caller asks again from there.
pub fn align_extents(extents: &[Extent], granule: u64) -> Vec<Extent> {
    let mut out = Vec::new();
    let mut pos = 0;
    // The flags common to the runs seen so far of the granule `pos` is inside of.
    let mut shared = 0;
    for e in extents {
        let mut len = e.len;
        if pos % granule != 0 {
            let take = len.min(granule - pos % granule);
            shared &= e.flags;
            pos += take;
            len -= take;
            if pos % granule == 0 {
                push_extent(
                    &mut out,
                    Extent {
                        len: granule,
                        flags: shared,
                    },
                );
            }
        }
        let whole = len / granule * granule;
        if whole > 0 {
            push_extent(
                &mut out,
                Extent {
                    len: whole,
                    flags: e.flags,
                },
            );
        }
        if len % granule != 0 {
            shared = e.flags;
        }
        pos += len;
    }
    out
}

/// Keeps an answer honest for `[offset, offset + len)`: within `len`, never empty (one data
/// extent when nothing is left), so a client always learns about at least one byte.
pub fn clamp_extents(extents: &mut Vec<Extent>, len: u64) {
    clip_extents(extents, len);
    if extents.is_empty() {
        extents.push(Extent::data(len));
    }
}

/// The same answer with neighbours of equal flags joined.
pub fn merge_extents(extents: Vec<Extent>) -> Vec<Extent> {
    let mut out = Vec::with_capacity(extents.len());
    for e in extents {
        push_extent(&mut out, e);
    }
    out
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteFlags {
    /// Force unit access: the data is durable when the write completes.
    pub fua: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    pub fua: bool,
    /// The range may be deallocated as long as it reads back as zeroes.
    pub may_unmap: bool,
    /// Fail with `NotSupported` instead of falling back to writing zero buffers.
    pub fast_only: bool,
}

/// What a device can do natively. Everything it cannot do is emulated by [`crate::Checked`]
/// or by the target above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    pub read_only: bool,
    /// Writes with FUA are durable without a separate flush.
    pub native_fua: bool,
    /// Discards release space (a hint; a device that can't still accepts them).
    pub discard: bool,
    /// write_zeroes is cheap (no zero buffers are written).
    pub fast_zero: bool,
    pub rotational: bool,
    /// A FLUSH through any handle makes every completed write durable, whoever issued it.
    /// True for everything udm serves from one process; a target that breaks it says so.
    pub flush_covers_all: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            read_only: false,
            native_fua: false,
            discard: false,
            fast_zero: false,
            rotational: false,
            flush_covers_all: true,
        }
    }
}

impl Capabilities {
    /// A device that keeps its data in memory, or none: FUA costs nothing, discard and
    /// zeroing are instant.
    pub fn in_memory() -> Capabilities {
        Capabilities {
            native_fua: true,
            discard: true,
            fast_zero: true,
            ..Capabilities::default()
        }
    }

    /// What a device built on `children` can promise: the weakest of them.
    pub fn weakest(children: impl IntoIterator<Item = Capabilities>) -> Capabilities {
        // Each child can only take promises away.
        let mut caps = Capabilities::in_memory();
        for child in children {
            caps.read_only |= child.read_only;
            caps.native_fua &= child.native_fua;
            caps.discard &= child.discard;
            caps.fast_zero &= child.fast_zero;
            caps.rotational |= child.rotational;
            caps.flush_covers_all &= child.flush_covers_all;
        }
        caps
    }
}

/// A virtual or real block device. Offsets and lengths are in bytes; callers above
/// [`crate::Checked`] have already made them sector-aligned and in range, so implementations
/// only map and forward.
///
/// All methods take `&self`: requests arrive concurrently from many threads, and an
/// implementation keeps whatever state it needs behind short locks.
pub trait BlockDevice: Send + Sync {
    /// Size in bytes, a multiple of 512.
    fn size(&self) -> u64;

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()>;

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()>;

    /// Makes every completed write durable.
    fn flush(&self) -> Result<()>;

    /// A hint that the range is no longer needed. Contents afterwards are unspecified.
    fn discard(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        write_zeroes_by_writing(self, offset, len, flags)
    }

    /// Describes the allocation of `[offset, offset + len)`. The answer may stop short of `len`
    /// but must describe at least one byte.
    fn block_status(&self, _offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(vec![Extent::data(len)])
    }

    /// A hint that the range will be read soon (NBD_CMD_CACHE).
    fn cache(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    /// The owner of this handle is going away and will not wait for it: requests still
    /// waiting on something that may never come (a remote's reconnection) fail now, and
    /// later ones fail at once. Only for handles no one else uses; shared devices ignore it.
    fn close(&self) {}

    /// Where `[offset, offset + len)` lives, for the hot path to submit itself; `None` when
    /// this device must handle the request (see [`crate::map`]). A flush's offset and length
    /// are 0. Called with requests [`crate::Checked`] has already checked; must not block.
    fn map(&self, _op: MapOp, _offset: u64, _len: u64) -> Option<Mapping> {
        None
    }

    /// True while the device holds new I/O (dm's suspend): a caller that must not wait (an
    /// event loop) holds its requests itself instead of sending them where they would block.
    fn suspended(&self) -> bool {
        false
    }

    /// What this handle reaches, the same for every handle to the same storage however it
    /// was named (dm's dev_t): a file by inode, a block device by its number, a udm device by
    /// a serial that survives renames. `None` where nothing better than the name is known.
    fn identity(&self) -> Option<String> {
        None
    }
}

const ZERO_CHUNK: usize = 1 << 20;

/// A page-aligned buffer of zeroes (1 MiB) to write from, shared by everyone.
pub fn zero_chunk() -> &'static [u8] {
    static ZEROES: OnceLock<crate::AlignedBuf> = OnceLock::new();
    ZEROES.get_or_init(|| crate::AlignedBuf::zeroed(ZERO_CHUNK))
}

/// Flushes every one of several lower devices, even after one fails, and returns the first
/// error: a flush that stopped at a failing device left the others' acknowledged writes
/// unsynced, as dm sends a flush to every target and device of a table.
pub fn flush_every<'a, D: BlockDevice + ?Sized + 'a>(
    devices: impl IntoIterator<Item = &'a D>,
) -> Result<()> {
    devices
        .into_iter()
        .map(|device| device.flush())
        .fold(Ok(()), Result::and)
}

/// Zeroes a range by writing zero buffers: the fallback for devices with no cheap way.
pub fn write_zeroes_by_writing<D: BlockDevice + ?Sized>(
    dev: &D,
    offset: u64,
    len: u64,
    flags: ZeroFlags,
) -> Result<()> {
    if flags.fast_only {
        return Err(crate::BlockError::NotSupported(
            "this device cannot zero quickly".into(),
        ));
    }
    let zeroes = zero_chunk();
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(ZERO_CHUNK as u64) as usize;
        dev.write(offset + done, &zeroes[..n], WriteFlags { fua: flags.fua })?;
        done += n as u64;
    }
    Ok(())
}

impl<T: BlockDevice + ?Sized> BlockDevice for std::sync::Arc<T> {
    fn size(&self) -> u64 {
        (**self).size()
    }
    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        (**self).read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        (**self).write(offset, buf, flags)
    }
    fn flush(&self) -> Result<()> {
        (**self).flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        (**self).discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        (**self).write_zeroes(offset, len, flags)
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        (**self).block_status(offset, len)
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        (**self).cache(offset, len)
    }
    fn close(&self) {
        (**self).close()
    }
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        (**self).map(op, offset, len)
    }
    fn suspended(&self) -> bool {
        (**self).suspended()
    }
    fn identity(&self) -> Option<String> {
        (**self).identity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_joins_equal_neighbours() {
        let merged = merge_extents(vec![
            Extent::data(512),
            Extent::data(512),
            Extent::hole(1024),
        ]);
        assert_eq!(merged, vec![Extent::data(1024), Extent::hole(1024)]);
    }

    #[test]
    fn aligned_runs_keep_only_the_flags_every_byte_has() {
        let zero = |len| Extent::zero(len);
        // A one-byte zero run, then data: the first sector is data.
        let aligned = align_extents(&[Extent::hole(1), Extent::data(1023)], 512);
        assert_eq!(aligned, vec![Extent::data(1024)]);
        // Zero runs that make up a sector between them stay zero; a hole and a zero run
        // make a zero sector that is not a hole.
        let aligned = align_extents(&[zero(100), Extent::hole(412), Extent::data(512)], 512);
        assert_eq!(aligned, vec![zero(512), Extent::data(512)]);
        // A run spanning granules keeps its whole ones; what ends inside a granule is left.
        let aligned = align_extents(&[Extent::data(700), Extent::hole(1348), zero(10)], 512);
        assert_eq!(aligned, vec![Extent::data(1024), Extent::hole(1024)]);
        assert!(align_extents(&[Extent::hole(511)], 512).is_empty());
        assert_eq!(
            align_extents(&[Extent::hole(4096)], 512),
            vec![Extent::hole(4096)]
        );
    }
}
