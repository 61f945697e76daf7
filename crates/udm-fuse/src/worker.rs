//! The worker threads: each reads a request from /dev/fuse, serves it and writes the reply,
//! with buffers of its own allocated once.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use log::{debug, error, info, warn};
use udm_block::{AlignedBuf, BlockDevice, BlockError, Checked, WriteFlags, ZeroFlags, SECTOR_SIZE};

use crate::abi::{self, opcode, Args, InHeader, IN_HEADER_LEN, OUT_HEADER_LEN, WRITE_IN_LEN};
use crate::fs::{Errno, Fs};

type Device = Checked<Arc<dyn BlockDevice>>;

/// The request buffer starts this far before the point where a WRITE's payload lands, so that
/// the payload (after the 80 bytes of fuse_in_header and fuse_write_in) is page-aligned and
/// goes to O_DIRECT backends without a bounce copy.
const HEADER_ROOM: usize = 4096;
const WRITE_HEADERS: usize = IN_HEADER_LEN + WRITE_IN_LEN;

const SECTOR: u64 = SECTOR_SIZE;

/// What every worker needs to know of the configuration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_request: u32,
    pub max_background: u16,
}

pub(crate) struct Worker {
    fs: Arc<Fs>,
    fd: Arc<OwnedFd>,
    limits: Limits,
}

impl Worker {
    pub fn new(fs: Arc<Fs>, fd: Arc<OwnedFd>, limits: Limits) -> Worker {
        Worker { fs, fd, limits }
    }

    /// Serves requests until the connection ends (unmount or abort).
    pub fn run(self) {
        let max = self.limits.max_request as usize;
        // The kernel refuses reads into less than fuse_in_header + fuse_write_in + max_write;
        // every other request is smaller than a WRITE.
        let mut request = AlignedBuf::zeroed(HEADER_ROOM + max);
        // Read data, listings and read-modify-write spans: a request's data plus the two
        // partial sectors around it.
        let mut data = AlignedBuf::zeroed(max + 2 * SECTOR as usize);
        let fd = self.fd.as_raw_fd();
        let start = HEADER_ROOM - WRITE_HEADERS;
        loop {
            let room = &mut request[start..];
            // SAFETY: reads into the tail of our buffer, within its length.
            let n = unsafe { libc::read(fd, room.as_mut_ptr().cast(), room.len()) };
            if n < 0 {
                let err = std::io::Error::last_os_error();
                match err.raw_os_error() {
                    // ENOENT: the request was interrupted before we got it.
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                    // Unmounted or aborted: the connection is over.
                    Some(libc::ENODEV) | Some(libc::ECONNABORTED) => return,
                    _ => return error!("fuse: reading /dev/fuse failed, worker stops: {err}"),
                }
            }
            let msg = &request[start..start + n as usize];
            let mut ctx = Ctx {
                fs: &self.fs,
                fd,
                limits: self.limits,
                data: &mut data,
            };
            // A bug in a target must not cost a worker (and leave the caller hanging forever
            // on a request nobody answers): the request fails with EIO instead.
            if catch_unwind(AssertUnwindSafe(|| ctx.dispatch(msg))).is_err() {
                if let Some(h) = InHeader::parse(msg) {
                    error!("fuse: request {} panicked; answering EIO", h.opcode);
                    ctx.send(h.unique, libc::EIO, &[]);
                }
            }
        }
    }
}

/// One request being served: the shared state and this worker's buffers.
struct Ctx<'a> {
    fs: &'a Fs,
    fd: RawFd,
    limits: Limits,
    data: &'a mut AlignedBuf,
}

fn errno(op: &str, e: BlockError) -> Errno {
    debug!("fuse: {op} failed: {e}");
    e.errno()
}

impl Ctx<'_> {
    fn dispatch(&mut self, msg: &[u8]) {
        let Some(h) = InHeader::parse(msg) else {
            return warn!("fuse: a request of {} bytes is too short", msg.len());
        };
        let body = &msg[IN_HEADER_LEN..(h.len as usize).clamp(IN_HEADER_LEN, msg.len())];
        let a = Args::new(body);
        let result = match h.opcode {
            // No reply: the kernel does not wait for one. Inode numbers live as long as the
            // export, and requests are not interruptible, so there is nothing to do either.
            opcode::FORGET | opcode::BATCH_FORGET | opcode::INTERRUPT => return,
            opcode::INIT => self.init(&h, a),
            opcode::DESTROY | opcode::FLUSH => {
                self.send(h.unique, 0, &[]);
                Ok(())
            }
            opcode::LOOKUP => self.lookup(&h, a),
            opcode::GETATTR => self.getattr(&h, a),
            opcode::SETATTR => self.setattr(&h, a),
            opcode::ACCESS => self.access(&h, a),
            opcode::STATFS => {
                let out = abi::statfs_out(self.fs.device_count());
                self.send(h.unique, 0, &out);
                Ok(())
            }
            opcode::OPEN => self.open(&h, a),
            opcode::READ => self.read(&h, a),
            opcode::WRITE => self.write(&h, a),
            opcode::FSYNC => self.fsync(&h, a),
            opcode::FALLOCATE => self.fallocate(&h, a),
            opcode::RELEASE => self.release(&h, a, false),
            opcode::OPENDIR => self.opendir(&h),
            opcode::READDIR => self.readdir(&h, a),
            opcode::RELEASEDIR => self.release(&h, a, true),
            _ => Err(libc::ENOSYS),
        };
        if let Err(errno) = result {
            self.send(h.unique, errno, &[]);
        }
    }

    /// Writes one reply, header and payload in one writev (the kernel takes a reply only
    /// whole).
    fn send(&self, unique: u64, errno: Errno, payload: &[u8]) {
        let header = abi::out_header(OUT_HEADER_LEN + payload.len(), -errno, unique);
        let iov = [IoSlice::new(&header), IoSlice::new(payload)];
        let count = if payload.is_empty() { 1 } else { 2 };
        // SAFETY: IoSlice is ABI-compatible with iovec; `count` slices are initialised.
        let n = unsafe { libc::writev(self.fd, iov.as_ptr().cast(), count) };
        if n < 0 {
            // ENOENT: the request was aborted meanwhile (unmount); nobody waits for the reply.
            debug!(
                "fuse: reply to request {unique} not delivered: {}",
                std::io::Error::last_os_error()
            );
        }
    }

    fn init(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let major = a.u32().ok_or(libc::EINVAL)?;
        let minor = a.u32().ok_or(libc::EINVAL)?;
        let max_readahead = a.u32().ok_or(libc::EINVAL)?;
        let flags = a.u32().ok_or(libc::EINVAL)?;
        // Before 7.9 several structs were shorter; nothing that old runs today.
        if major < abi::KERNEL_VERSION || (major == abi::KERNEL_VERSION && minor < 9) {
            error!("fuse: kernel protocol {major}.{minor} is too old");
            return Err(libc::EPROTO);
        }
        use abi::init::*;
        // ASYNC_READ and ASYNC_DIO let the kernel send many reads and direct I/Os of one file
        // at once (a loop device keeps a queue of them); MAX_PAGES lifts the 128 KiB request
        // limit to max_request; ATOMIC_O_TRUNC lets an O_TRUNC open be ignored like on a block
        // device instead of arriving as a truncate to 0 that must fail.
        let wanted =
            ASYNC_READ | ATOMIC_O_TRUNC | BIG_WRITES | ASYNC_DIO | PARALLEL_DIROPS | MAX_PAGES;
        let max_background = self.limits.max_background;
        let out = abi::InitOut {
            minor: abi::KERNEL_MINOR_VERSION,
            max_readahead,
            flags: flags & wanted,
            max_background,
            congestion_threshold: max_background / 4 * 3,
            max_write: self.limits.max_request,
            max_pages: (self.limits.max_request / 4096).min(u16::MAX.into()) as u16,
        };
        info!(
            "fuse: kernel protocol {major}.{minor}, speaking 7.{}, flags {:#x}",
            abi::KERNEL_MINOR_VERSION,
            out.flags
        );
        self.send(h.unique, 0, &abi::init_out(&out));
        Ok(())
    }

    fn lookup(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let name = a.name().ok_or(libc::EINVAL)?;
        let attr = self.fs.lookup(h.nodeid, name)?;
        self.send(h.unique, 0, &abi::entry_out(&attr));
        Ok(())
    }

    fn getattr(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let flags = a.u32().ok_or(libc::EINVAL)?;
        a.skip(4).ok_or(libc::EINVAL)?;
        let fh = a.u64().ok_or(libc::EINVAL)?;
        let fh = (flags & abi::GETATTR_FH != 0).then_some(fh);
        let attr = self.fs.getattr(h.nodeid, fh)?;
        self.send(h.unique, 0, &abi::attr_out(&attr));
        Ok(())
    }

    /// A device cannot change its size through its file; every other change (mode, owner,
    /// times) is accepted and forgotten, as tools like cp and touch expect them to work.
    fn setattr(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let valid = a.u32().ok_or(libc::EINVAL)?;
        a.skip(4).ok_or(libc::EINVAL)?;
        let fh = a.u64().ok_or(libc::EINVAL)?;
        let size = a.u64().ok_or(libc::EINVAL)?;
        let fh = (valid & abi::FATTR_FH != 0).then_some(fh);
        let attr = self.fs.getattr(h.nodeid, fh)?;
        if valid & abi::FATTR_SIZE != 0 && size != attr.size {
            return Err(libc::EINVAL);
        }
        self.send(h.unique, 0, &abi::attr_out(&attr));
        Ok(())
    }

    fn access(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let mask = a.u32().ok_or(libc::EINVAL)?;
        let attr = self.fs.getattr(h.nodeid, None)?;
        // Root may write anything by permission bits; a read-only device still refuses.
        if mask & libc::W_OK as u32 != 0 && attr.mode & 0o200 == 0 {
            return Err(libc::EROFS);
        }
        self.send(h.unique, 0, &[]);
        Ok(())
    }

    fn open(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let flags = a.u32().ok_or(libc::EINVAL)?;
        let writable = flags as i32 & libc::O_ACCMODE != libc::O_RDONLY;
        let fh = self.fs.open(h.nodeid, writable)?;
        // DIRECT_IO: no page cache, every read and write comes here (the device is the cache
        // owner; a loop device on top has its own). PARALLEL_DIRECT_WRITES: the kernel does not
        // serialise writes to the file on its inode lock.
        let flags = abi::FOPEN_DIRECT_IO | abi::FOPEN_PARALLEL_DIRECT_WRITES;
        self.send(h.unique, 0, &abi::open_out(fh, flags));
        Ok(())
    }

    fn release(&mut self, h: &InHeader, mut a: Args, dir: bool) -> Result<(), Errno> {
        let fh = a.u64().ok_or(libc::EINVAL)?;
        if dir {
            self.fs.releasedir(fh);
        } else {
            self.fs.release(fh);
        }
        self.send(h.unique, 0, &[]);
        Ok(())
    }

    fn opendir(&mut self, h: &InHeader) -> Result<(), Errno> {
        let fh = self.fs.opendir(h.nodeid)?;
        self.send(h.unique, 0, &abi::open_out(fh, 0));
        Ok(())
    }

    fn readdir(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let fh = a.u64().ok_or(libc::EINVAL)?;
        let offset = a.u64().ok_or(libc::EINVAL)?;
        let size = a.u32().ok_or(libc::EINVAL)? as usize;
        let listing = self.fs.listing(fh).ok_or(libc::EBADF)?;
        let limit = size.min(self.data.len());
        let out = &mut self.data[..limit];
        let mut end = 0;
        let skip = usize::try_from(offset).unwrap_or(usize::MAX);
        for (i, entry) in listing.iter().enumerate().skip(skip) {
            let dtype = if entry.is_dir {
                libc::DT_DIR
            } else {
                libc::DT_REG
            };
            let next = i as u64 + 1;
            let name = entry.name.as_bytes();
            match abi::put_dirent(out, end, entry.ino, next, dtype.into(), name) {
                Some(e) => end = e,
                None => break,
            }
        }
        self.send(h.unique, 0, &self.data[..end]);
        Ok(())
    }

    fn fsync(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let fh = a.u64().ok_or(libc::EINVAL)?;
        let open = self.fs.file(fh).ok_or(libc::EBADF)?;
        open.device.flush().map_err(|e| errno("flush", e))?;
        self.send(h.unique, 0, &[]);
        Ok(())
    }

    /// Reads like a regular file: up to the end of the device (a read there returns nothing,
    /// which is how `cat` knows it is done), at any byte offset and length.
    fn read(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let fh = a.u64().ok_or(libc::EINVAL)?;
        let offset = a.u64().ok_or(libc::EINVAL)?;
        let size = a.u32().ok_or(libc::EINVAL)?;
        let open = self.fs.file(fh).ok_or(libc::EBADF)?;
        let device = &open.device;
        let end_of_device = device.size();
        if offset >= end_of_device || size == 0 {
            self.send(h.unique, 0, &[]);
            return Ok(());
        }
        let len = u64::from(size).min(end_of_device - offset);
        // Unaligned requests read the whole sectors around them; the device size is a
        // multiple of the sector, so the rounded-up end stays within it.
        let start = offset - offset % SECTOR;
        let span = ((offset + len).next_multiple_of(SECTOR) - start) as usize;
        let buf = self.data.get_mut(..span).ok_or(libc::EINVAL)?;
        device.read(start, buf).map_err(|e| errno("read", e))?;
        let at = (offset - start) as usize;
        self.send(h.unique, 0, &self.data[at..at + len as usize]);
        Ok(())
    }

    fn write(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let fh = a.u64().ok_or(libc::EINVAL)?;
        let offset = a.u64().ok_or(libc::EINVAL)?;
        let size = a.u32().ok_or(libc::EINVAL)? as usize;
        a.skip(12).ok_or(libc::EINVAL)?; // write_flags, lock_owner
        let open_flags = a.u32().ok_or(libc::EINVAL)?;
        a.skip(4).ok_or(libc::EINVAL)?;
        let payload = a.rest().get(..size).ok_or(libc::EINVAL)?;
        let open = self.fs.file(fh).ok_or(libc::EBADF)?;
        // A file opened O_DSYNC (or O_SYNC) wants each write durable when it returns.
        let fua = open_flags as i32 & libc::O_DSYNC != 0;
        let written = self.write_at(&open.device, offset, payload, WriteFlags { fua })?;
        self.send(h.unique, 0, &abi::write_out(written as u32));
        Ok(())
    }

    /// Writes like a regular file of fixed size: a write crossing the end is cut short there,
    /// one starting at or past it fails with ENOSPC, as on a block device.
    ///
    /// Bytes that only partly cover a sector are merged by read-modify-write of that sector in
    /// this worker's buffer. That is not atomic: a concurrent write to another part of the
    /// same sector can be lost. Aligned writes (a loop device, O_DIRECT users) never take this
    /// path; byte-granular tools (`dd bs=1`, editors) are the ones that do.
    fn write_at(
        &mut self,
        device: &Device,
        offset: u64,
        payload: &[u8],
        flags: WriteFlags,
    ) -> Result<usize, Errno> {
        if payload.is_empty() {
            return Ok(0);
        }
        let end_of_device = device.size();
        if offset >= end_of_device {
            return Err(libc::ENOSPC);
        }
        let len = (payload.len() as u64).min(end_of_device - offset) as usize;
        let payload = &payload[..len];
        let end = offset + len as u64;
        if offset.is_multiple_of(SECTOR) && end.is_multiple_of(SECTOR) {
            device
                .write(offset, payload, flags)
                .map_err(|e| errno("write", e))?;
            return Ok(len);
        }
        let start = offset - offset % SECTOR;
        let span = (end.next_multiple_of(SECTOR) - start) as usize;
        let buf = self.data.get_mut(..span).ok_or(libc::EINVAL)?;
        let sector = SECTOR as usize;
        let head_partial = offset != start;
        if head_partial {
            device
                .read(start, &mut buf[..sector])
                .map_err(|e| errno("read for a partial write", e))?;
        }
        // The last sector, unless it is the first one and was read already.
        let tail_partial = !end.is_multiple_of(SECTOR);
        let tail_read_already = head_partial && span == sector;
        if tail_partial && !tail_read_already {
            device
                .read(start + (span - sector) as u64, &mut buf[span - sector..])
                .map_err(|e| errno("read for a partial write", e))?;
        }
        let at = (offset - start) as usize;
        buf[at..at + len].copy_from_slice(payload);
        device
            .write(start, buf, flags)
            .map_err(|e| errno("write", e))?;
        Ok(len)
    }

    fn fallocate(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let fh = a.u64().ok_or(libc::EINVAL)?;
        let offset = a.u64().ok_or(libc::EINVAL)?;
        let length = a.u64().ok_or(libc::EINVAL)?;
        let mode = a.u32().ok_or(libc::EINVAL)? as i32;
        let open = self.fs.file(fh).ok_or(libc::EBADF)?;
        let device = &open.device;
        let end = offset.checked_add(length).ok_or(libc::EINVAL)?;
        let size = device.size();
        let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        match mode & !libc::FALLOC_FL_KEEP_SIZE {
            // Every byte of a device is allocated already; it cannot grow.
            0 if keep_size || end <= size => {}
            // Punching a hole must leave zeroes: a loop device turns both discards and
            // write-zeroes requests into PUNCH_HOLE, and a filesystem relies on the zeroes of
            // the latter. So it is a write_zeroes that may deallocate, not a discard (whose
            // contents afterwards a device may leave as they were).
            libc::FALLOC_FL_PUNCH_HOLE if keep_size => {
                self.zero(device, offset, end.min(size), true)?
            }
            libc::FALLOC_FL_ZERO_RANGE if keep_size || end <= size => {
                self.zero(device, offset, end.min(size), false)?
            }
            _ => return Err(libc::EOPNOTSUPP),
        }
        self.send(h.unique, 0, &[]);
        Ok(())
    }

    /// Zeroes `[offset, end)`: whole sectors through the device, partial ones at either end by
    /// read-modify-write (with the same caveat as unaligned writes).
    fn zero(
        &mut self,
        device: &Device,
        offset: u64,
        end: u64,
        may_unmap: bool,
    ) -> Result<(), Errno> {
        if offset >= end {
            return Ok(());
        }
        let first = offset.next_multiple_of(SECTOR);
        let last = end - end % SECTOR;
        if first > last {
            return self.zero_within_sector(device, offset, end);
        }
        if offset < first {
            self.zero_within_sector(device, offset, first)?;
        }
        if first < last {
            let flags = ZeroFlags {
                may_unmap,
                ..ZeroFlags::default()
            };
            device
                .write_zeroes(first, last - first, flags)
                .map_err(|e| errno("write_zeroes", e))?;
        }
        if last < end {
            self.zero_within_sector(device, last, end)?;
        }
        Ok(())
    }

    fn zero_within_sector(&mut self, device: &Device, from: u64, to: u64) -> Result<(), Errno> {
        let sector = from - from % SECTOR;
        let buf = &mut self.data[..SECTOR as usize];
        device
            .read(sector, buf)
            .map_err(|e| errno("read for a partial zeroing", e))?;
        buf[(from - sector) as usize..(to - sector) as usize].fill(0);
        device
            .write(sector, buf, WriteFlags::default())
            .map_err(|e| errno("partial zeroing", e))
    }
}
