//! The FUSE wire format, as far as udm speaks it (see `<linux/fuse.h>`).
//!
//! Messages are native-endian C structs. They are decoded and encoded field by field at fixed
//! offsets rather than by casting buffers to `#[repr(C)]` structs: the request buffer holds
//! several structs back to back at offsets the kernel chooses, so casts would need alignment
//! proofs, and a short message must fail cleanly instead of being read past its end.

/// The protocol version implemented here. Newer kernels accept it and speak this version to us.
pub const KERNEL_VERSION: u32 = 7;
pub const KERNEL_MINOR_VERSION: u32 = 38;

pub const ROOT_ID: u64 = 1;

pub const IN_HEADER_LEN: usize = 40;
pub const OUT_HEADER_LEN: usize = 16;
pub const WRITE_IN_LEN: usize = 40;
const DIRENT_HEADER_LEN: usize = 24;

pub mod opcode {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const RENAME2: u32 = 45;
    pub const TMPFILE: u32 = 51;
}

/// INIT flags (`fuse_init_in.flags` / `fuse_init_out.flags`).
pub mod init {
    pub const ASYNC_READ: u32 = 1 << 0;
    pub const ATOMIC_O_TRUNC: u32 = 1 << 3;
    pub const BIG_WRITES: u32 = 1 << 5;
    pub const ASYNC_DIO: u32 = 1 << 15;
    pub const PARALLEL_DIROPS: u32 = 1 << 18;
    pub const MAX_PAGES: u32 = 1 << 22;
    /// `fuse_init_in` and `fuse_init_out` carry `flags2`, the flags from bit 32 on.
    pub const INIT_EXT: u32 = 1 << 30;
    /// In `flags2` (bit 41 of the 64-bit flags): requests can come through io_uring
    /// (kernel 6.14+, when the fuse module's `enable_uring` is set).
    pub const OVER_IO_URING: u32 = 1 << (41 - 32);
}

pub const FOPEN_DIRECT_IO: u32 = 1 << 0;
pub const FOPEN_PARALLEL_DIRECT_WRITES: u32 = 1 << 6;

pub const FATTR_SIZE: u32 = 1 << 3;
pub const FATTR_FH: u32 = 1 << 6;
pub const GETATTR_FH: u32 = 1 << 0;

/// `_IOR(229, 0, uint32_t)`: attach a new /dev/fuse descriptor to an existing connection.
pub const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

/// FUSE over io_uring (protocol 7.42, kernel 6.14+): every ring entry registers a header
/// buffer (`struct fuse_uring_req_header`) and a payload buffer with the kernel, which puts a
/// request's `fuse_in_header` and argument struct in the first and its data in the second;
/// the reply goes back in the same places.
pub mod ring {
    /// `fuse_in_header` on the way in, `fuse_out_header` on the way out.
    pub const IN_OUT: usize = 0;
    /// The opcode's argument struct (`fuse_read_in`, `fuse_write_in`, a LOOKUP's name…).
    pub const OP_IN: usize = 128;
    pub const OP_IN_LEN: usize = 128;
    /// `struct fuse_uring_ent_in_out`: flags, commit_id, payload_sz, padding, reserved.
    const ENT_IN_OUT: usize = 256;
    pub const COMMIT_ID: usize = ENT_IN_OUT + 8;
    /// Bytes of the payload buffer in use: the request's data, then the reply's.
    pub const PAYLOAD_SZ: usize = ENT_IN_OUT + 16;
    pub const HEADER_LEN: usize = ENT_IN_OUT + 32;

    /// Hands an entry's buffers to the kernel (`sqe->addr` = two iovecs, `sqe->len` = 2).
    pub const CMD_REGISTER: u32 = 1;
    /// Commits the reply in the entry's buffers and waits for the next request.
    pub const CMD_COMMIT_AND_FETCH: u32 = 2;

    /// `struct fuse_uring_cmd_req` in the 80-byte command area of a 128-byte SQE.
    pub fn cmd_req(qid: u16, commit_id: u64) -> [u8; 80] {
        let mut cmd = [0u8; 80];
        // flags (0) at 0, commit_id at 8, qid at 16, padding.
        cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
        cmd[16..18].copy_from_slice(&qid.to_ne_bytes());
        cmd
    }
}

/// The fixed part of every request.
#[derive(Debug, Clone, Copy)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
}

impl InHeader {
    pub fn parse(msg: &[u8]) -> Option<InHeader> {
        let mut a = Args::new(msg);
        let header = InHeader {
            len: a.u32()?,
            opcode: a.u32()?,
            unique: a.u64()?,
            nodeid: a.u64()?,
        };
        (msg.len() >= IN_HEADER_LEN).then_some(header)
    }
}

/// Reads the argument structs of a request in order.
pub struct Args<'a> {
    bytes: &'a [u8],
}

impl<'a> Args<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Args { bytes }
    }

    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.bytes.split_first_chunk::<N>()?;
        self.bytes = rest;
        Some(*head)
    }

    pub fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_ne_bytes)
    }

    pub fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_ne_bytes)
    }

    pub fn skip(&mut self, n: usize) -> Option<()> {
        self.bytes = self.bytes.get(n..)?;
        Some(())
    }

    /// A NUL-terminated name (LOOKUP).
    pub fn name(&mut self) -> Option<&'a [u8]> {
        let end = self.bytes.iter().position(|&b| b == 0)?;
        let name = &self.bytes[..end];
        self.bytes = &self.bytes[end + 1..];
        Some(name)
    }
}

/// `fuse_read_in`, as far as serving a read needs it.
#[derive(Debug, Clone, Copy)]
pub struct ReadIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
}

impl ReadIn {
    pub fn parse(args: &[u8]) -> Option<ReadIn> {
        let mut a = Args::new(args);
        Some(ReadIn {
            fh: a.u64()?,
            offset: a.u64()?,
            size: a.u32()?,
        })
    }
}

/// `fuse_write_in`, as far as serving a write needs it.
#[derive(Debug, Clone, Copy)]
pub struct WriteIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
    /// The flags the file was opened with.
    pub open_flags: u32,
}

impl WriteIn {
    pub fn parse(args: &[u8]) -> Option<WriteIn> {
        let mut a = Args::new(args);
        let fh = a.u64()?;
        let offset = a.u64()?;
        let size = a.u32()?;
        a.skip(12)?; // write_flags, lock_owner
        let open_flags = a.u32()?;
        Some(WriteIn {
            fh,
            offset,
            size,
            open_flags,
        })
    }

    /// A file opened O_DSYNC (or O_SYNC) wants each write durable when it returns.
    pub fn fua(&self) -> bool {
        self.open_flags as i32 & libc::O_DSYNC != 0
    }
}

/// `fuse_fallocate_in`.
#[derive(Debug, Clone, Copy)]
pub struct FallocateIn {
    pub fh: u64,
    pub offset: u64,
    pub length: u64,
    pub mode: i32,
}

/// What a FALLOCATE asks of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallocation {
    /// Nothing: every byte of a device is allocated already.
    Nothing,
    /// Make `[offset, end)` read zeroes; `may_unmap`: by deallocating it.
    Zero {
        offset: u64,
        end: u64,
        may_unmap: bool,
    },
}

impl FallocateIn {
    pub fn parse(args: &[u8]) -> Option<FallocateIn> {
        let mut a = Args::new(args);
        Some(FallocateIn {
            fh: a.u64()?,
            offset: a.u64()?,
            length: a.u64()?,
            mode: a.u32()? as i32,
        })
    }

    /// What the request means for a device of `size` bytes, which cannot grow; an errno for
    /// what it cannot do.
    pub fn meaning(&self, size: u64) -> Result<Fallocation, i32> {
        let end = self.offset.checked_add(self.length).ok_or(libc::EINVAL)?;
        let keep_size = self.mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        match self.mode & !libc::FALLOC_FL_KEEP_SIZE {
            0 if keep_size || end <= size => Ok(Fallocation::Nothing),
            // Punching a hole must leave zeroes: a loop device turns both discards and
            // write-zeroes requests into PUNCH_HOLE, and a filesystem relies on the zeroes of
            // the latter. So it is a write-zeroes that may deallocate, not a discard (whose
            // contents afterwards a device may leave as they were).
            libc::FALLOC_FL_PUNCH_HOLE if keep_size => Ok(Fallocation::Zero {
                offset: self.offset,
                end: end.min(size),
                may_unmap: true,
            }),
            libc::FALLOC_FL_ZERO_RANGE if keep_size || end <= size => Ok(Fallocation::Zero {
                offset: self.offset,
                end: end.min(size),
                may_unmap: false,
            }),
            _ => Err(libc::EOPNOTSUPP),
        }
    }
}

/// Builds a reply struct of a fixed size.
pub struct Enc<const N: usize> {
    buf: [u8; N],
    pos: usize,
}

impl<const N: usize> Enc<N> {
    pub fn new() -> Self {
        Enc {
            buf: [0; N],
            pos: 0,
        }
    }

    fn put(&mut self, bytes: &[u8]) -> &mut Self {
        self.buf[self.pos..self.pos + bytes.len()].copy_from_slice(bytes);
        self.pos += bytes.len();
        self
    }

    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.put(&v.to_ne_bytes())
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.put(&v.to_ne_bytes())
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.put(&v.to_ne_bytes())
    }

    /// Reserved and padding fields are zero: the buffer starts zeroed.
    pub fn zeros(&mut self, n: usize) -> &mut Self {
        self.pos += n;
        self
    }

    pub fn finish(&self) -> [u8; N] {
        debug_assert_eq!(self.pos, N, "reply struct not filled completely");
        self.buf
    }
}

pub fn out_header(len: usize, error: i32, unique: u64) -> [u8; OUT_HEADER_LEN] {
    Enc::<OUT_HEADER_LEN>::new()
        .u32(len as u32)
        .u32(error as u32)
        .u64(unique)
        .finish()
}

/// What udm tells the kernel about a file (`struct fuse_attr`).
#[derive(Debug, Clone, Copy)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub mode: u32,
    pub nlink: u32,
    /// One timestamp for atime, mtime and ctime: the devices keep none of their own.
    pub time: u64,
}

pub const ATTR_LEN: usize = 88;
pub const BLKSIZE: u32 = 4096;

fn put_attr<const N: usize>(e: &mut Enc<N>, a: &Attr) {
    e.u64(a.ino)
        .u64(a.size)
        .u64(a.size.div_ceil(512))
        .u64(a.time)
        .u64(a.time)
        .u64(a.time)
        .zeros(12) // nanoseconds of the three times
        .u32(a.mode)
        .u32(a.nlink)
        .u32(0) // uid: root, who mounted it
        .u32(0) // gid
        .u32(0) // rdev
        .u32(BLKSIZE)
        .u32(0); // flags
}

/// `fuse_entry_out` with zero timeouts: a name or size seen once may be gone or different
/// the next time, as devices come and go in the catalog.
pub fn entry_out(a: &Attr) -> [u8; 40 + ATTR_LEN] {
    let mut e = Enc::new();
    e.u64(a.ino).u64(0).u64(0).u64(0).u32(0).u32(0);
    put_attr(&mut e, a);
    e.finish()
}

pub fn attr_out(a: &Attr) -> [u8; 16 + ATTR_LEN] {
    let mut e = Enc::new();
    e.u64(0).u32(0).u32(0);
    put_attr(&mut e, a);
    e.finish()
}

pub fn open_out(fh: u64, open_flags: u32) -> [u8; 16] {
    Enc::new().u64(fh).u32(open_flags).u32(0).finish()
}

pub fn write_out(size: u32) -> [u8; 8] {
    Enc::new().u32(size).u32(0).finish()
}

pub fn statfs_out(files: u64) -> [u8; 80] {
    // No blocks, no free space: the export holds no data of its own besides the devices.
    Enc::new()
        .u64(0) // blocks
        .u64(0) // bfree
        .u64(0) // bavail
        .u64(files)
        .u64(0) // ffree
        .u32(BLKSIZE) // bsize
        .u32(255) // namelen
        .u32(BLKSIZE) // frsize
        .u32(0)
        .zeros(24)
        .finish()
}

pub struct InitOut {
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub max_pages: u16,
    pub flags2: u32,
}

pub fn init_out(o: &InitOut) -> [u8; 64] {
    Enc::new()
        .u32(KERNEL_VERSION)
        .u32(o.minor)
        .u32(o.max_readahead)
        .u32(o.flags)
        .u16(o.max_background)
        .u16(o.congestion_threshold)
        .u32(o.max_write)
        .u32(1) // time_gran: nanoseconds
        .u16(o.max_pages)
        .u16(0) // map_alignment
        .u32(o.flags2)
        .zeros(28)
        .finish()
}

/// Appends one `fuse_dirent` to `out` at `pos`; returns the new end, or `None` if it does not
/// fit (the kernel asked for at most `out.len()` bytes).
pub fn put_dirent(
    out: &mut [u8],
    pos: usize,
    ino: u64,
    next_offset: u64,
    dtype: u32,
    name: &[u8],
) -> Option<usize> {
    let len = (DIRENT_HEADER_LEN + name.len()).next_multiple_of(8);
    let slot = out.get_mut(pos..pos + len)?;
    let header = Enc::<DIRENT_HEADER_LEN>::new()
        .u64(ino)
        .u64(next_offset)
        .u32(name.len() as u32)
        .u32(dtype)
        .finish();
    slot[..DIRENT_HEADER_LEN].copy_from_slice(&header);
    slot[DIRENT_HEADER_LEN..DIRENT_HEADER_LEN + name.len()].copy_from_slice(name);
    slot[DIRENT_HEADER_LEN + name.len()..].fill(0);
    Some(pos + len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structs_have_the_sizes_of_the_kernel_header() {
        let a = Attr {
            ino: 2,
            size: 4096,
            mode: 0o100600,
            nlink: 1,
            time: 0,
        };
        // FUSE_COMPAT_ENTRY_OUT_SIZE and _ATTR_OUT_SIZE are the pre-7.9 sizes, 8 bytes less.
        assert_eq!(entry_out(&a).len(), 120 + 8);
        assert_eq!(attr_out(&a).len(), 96 + 8);
        let attr = attr_out(&a);
        assert_eq!(&attr[16..24], &2u64.to_ne_bytes());
        assert_eq!(&attr[32..40], &8u64.to_ne_bytes(), "blocks of 512 bytes");
        assert_eq!(&attr[16 + 60..16 + 64], &0o100600u32.to_ne_bytes(), "mode");
    }

    #[test]
    fn dirents_are_padded_to_eight_bytes_and_refuse_to_overflow() {
        let mut out = [0xffu8; 64];
        let end = put_dirent(&mut out, 0, 7, 1, 8, b"vol").unwrap();
        assert_eq!(end, 32);
        assert_eq!(&out[24..32], b"vol\0\0\0\0\0");
        assert_eq!(put_dirent(&mut out, end, 8, 2, 8, b"a-longer-name"), None);
    }

    #[test]
    fn args_stop_at_the_end_of_a_short_message() {
        let mut a = Args::new(&[1, 0, 0, 0, 2, 0]);
        assert_eq!(a.u32(), Some(1));
        assert_eq!(a.u32(), None);
        let mut n = Args::new(b"vol\0rest");
        assert_eq!(n.name(), Some(&b"vol"[..]));
        assert_eq!(n.u32(), Some(u32::from_ne_bytes(*b"rest")));
    }
}
