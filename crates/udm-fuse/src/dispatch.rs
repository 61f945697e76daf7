//! Serving one request, whichever way it arrived (/dev/fuse or an io_uring entry): decode
//! it, run it against the filesystem and its devices, and hand the reply to the transport.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use log::{debug, error, info, warn};
use udm_block::{AlignedBuf, BlockDevice, BlockError, Checked, WriteFlags, ZeroFlags, SECTOR_SIZE};

use crate::abi::{
    self, opcode, Args, FallocateIn, Fallocation, InHeader, ReadIn, WriteIn, IN_HEADER_LEN,
    WRITE_IN_LEN,
};
use crate::fs::Errno;
use crate::session::Session;

type Device = Checked<Arc<dyn BlockDevice>>;

const SECTOR: u64 = SECTOR_SIZE;

/// Where replies go: written to /dev/fuse, or put in a ring entry's buffers.
pub(crate) trait Reply {
    /// Sends the one reply to request `unique`: `errno` 0 and `payload`, or an error.
    fn send(&self, unique: u64, errno: Errno, payload: &[u8]);
}

/// A request as the transport received it: the header, the opcode's argument struct, and
/// what follows it (a WRITE's bytes, a LOOKUP's name). Over io_uring the two arrive in
/// different buffers, which is why the kernel sends a LOOKUP with an empty argument struct.
pub(crate) struct Request<'a> {
    pub header: InHeader,
    pub args: &'a [u8],
    pub data: &'a [u8],
}

impl<'a> Request<'a> {
    /// Splits a message read from /dev/fuse, where arguments and data follow the header in
    /// one buffer.
    pub fn from_message(msg: &'a [u8]) -> Option<Request<'a>> {
        let header = InHeader::parse(msg)?;
        let body = &msg[IN_HEADER_LEN..(header.len as usize).clamp(IN_HEADER_LEN, msg.len())];
        let args_len = match header.opcode {
            opcode::LOOKUP => 0,
            opcode::WRITE => WRITE_IN_LEN,
            _ => body.len(),
        };
        let (args, data) = body.split_at(args_len.min(body.len()));
        Some(Request { header, args, data })
    }
}

/// Counts the replies sent, so that a request that panics after its reply is not answered
/// twice.
struct Counted<'a> {
    inner: &'a dyn Reply,
    sent: Cell<u32>,
}

impl Reply for Counted<'_> {
    fn send(&self, unique: u64, errno: Errno, payload: &[u8]) {
        self.sent.set(self.sent.get() + 1);
        self.inner.send(unique, errno, payload);
    }
}

/// Serves `req` and sends its reply (if its opcode has one) through `reply`. `data` is the
/// serving thread's buffer for read data, listings and read-modify-write spans: a
/// request's data plus the two partial sectors around it.
///
/// A bug in a target must not cost a thread (and leave the caller hanging forever on a
/// request nobody answers): a panic is answered with EIO.
pub(crate) fn serve(session: &Session, data: &mut AlignedBuf, reply: &dyn Reply, req: &Request) {
    let counted = Counted {
        inner: reply,
        sent: Cell::new(0),
    };
    let mut ctx = Ctx {
        session,
        data,
        reply: &counted,
    };
    let panicked = catch_unwind(AssertUnwindSafe(|| ctx.dispatch(req))).is_err();
    if panicked && counted.sent.get() == 0 && has_reply(req.header.opcode) {
        error!(
            "fuse: request {} panicked; answering EIO",
            req.header.opcode
        );
        reply.send(req.header.unique, libc::EIO, &[]);
    }
}

/// Opcodes the kernel expects no reply to.
fn has_reply(opcode: u32) -> bool {
    !matches!(
        opcode,
        opcode::FORGET | opcode::BATCH_FORGET | opcode::INTERRUPT
    )
}

/// One request being served: the shared state and the serving thread's buffer.
struct Ctx<'a> {
    session: &'a Session,
    data: &'a mut AlignedBuf,
    reply: &'a dyn Reply,
}

fn errno(op: &str, e: BlockError) -> Errno {
    debug!("fuse: {op} failed: {e}");
    e.errno()
}

impl Ctx<'_> {
    fn dispatch(&mut self, req: &Request) {
        let h = req.header;
        let a = Args::new(req.args);
        let result = match h.opcode {
            // No reply: the kernel does not wait for one. Inode numbers live as long as the
            // export, and requests are not interruptible, so there is nothing to do either.
            opcode::FORGET | opcode::BATCH_FORGET | opcode::INTERRUPT => return,
            opcode::INIT => self.init(&h, a),
            opcode::DESTROY | opcode::FLUSH => {
                self.send(h.unique, 0, &[]);
                Ok(())
            }
            opcode::LOOKUP => self.lookup(&h, Args::new(req.data)),
            opcode::GETATTR => self.getattr(&h, a),
            opcode::SETATTR => self.setattr(&h, a),
            opcode::ACCESS => self.access(&h, a),
            opcode::STATFS => {
                let out = abi::statfs_out(self.fs().device_count());
                self.send(h.unique, 0, &out);
                Ok(())
            }
            opcode::OPEN => self.open(&h, a),
            opcode::READ => self.read(&h, req.args),
            opcode::WRITE => self.write(&h, req.args, req.data),
            opcode::FSYNC => self.fsync(&h, a),
            opcode::FALLOCATE => self.fallocate(&h, req.args),
            opcode::RELEASE => self.release(&h, a, false),
            opcode::OPENDIR => self.opendir(&h),
            opcode::READDIR => self.readdir(&h, a),
            opcode::RELEASEDIR => self.release(&h, a, true),
            // The names are the catalog's devices: made, renamed and removed with `udm`, not
            // here. "Function not implemented" read as a bug in udm; EPERM says "not allowed
            // here", as rm and mv in a directory one may not change. (Other opcodes keep
            // ENOSYS, which the kernel remembers and answers itself from then on: xattrs get
            // EOPNOTSUPP, lseek and copy_file_range its generic code.)
            opcode::SYMLINK
            | opcode::MKNOD
            | opcode::MKDIR
            | opcode::UNLINK
            | opcode::RMDIR
            | opcode::RENAME
            | opcode::RENAME2
            | opcode::LINK
            | opcode::CREATE
            | opcode::TMPFILE => Err(libc::EPERM),
            _ => Err(libc::ENOSYS),
        };
        if let Err(errno) = result {
            self.send(h.unique, errno, &[]);
        }
    }

    fn fs(&self) -> &crate::fs::Fs {
        &self.session.fs
    }

    fn send(&self, unique: u64, errno: Errno, payload: &[u8]) {
        self.reply.send(unique, errno, payload);
    }

    fn init(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let major = a.u32().ok_or(libc::EINVAL)?;
        let minor = a.u32().ok_or(libc::EINVAL)?;
        let max_readahead = a.u32().ok_or(libc::EINVAL)?;
        let flags = a.u32().ok_or(libc::EINVAL)?;
        // Only meaningful with INIT_EXT (protocol 7.36+).
        let flags2 = a.u32().unwrap_or(0);
        // Before 7.9 several structs were shorter; nothing that old runs today.
        if major < abi::KERNEL_VERSION || (major == abi::KERNEL_VERSION && minor < 9) {
            error!("fuse: kernel protocol {major}.{minor} is too old");
            self.session.handshake_done(false);
            return Err(libc::EPROTO);
        }
        use abi::init::*;
        // ASYNC_READ and ASYNC_DIO let the kernel send many reads and direct I/Os of one file
        // at once (a loop device keeps a queue of them); MAX_PAGES lifts the 128 KiB request
        // limit to max_request; ATOMIC_O_TRUNC lets an O_TRUNC open be ignored like on a block
        // device instead of arriving as a truncate to 0 that must fail.
        let wanted =
            ASYNC_READ | ATOMIC_O_TRUNC | BIG_WRITES | ASYNC_DIO | PARALLEL_DIROPS | MAX_PAGES;
        let offered = flags & INIT_EXT != 0 && flags2 & OVER_IO_URING != 0;
        let uring = self.session.offer_uring && offered;
        if self.session.offer_uring && !offered {
            warn!(
                "fuse: the kernel does not offer FUSE over io_uring at INIT (enable_uring was \
                 off when the mount was made?)"
            );
        }
        let limits = self.session.limits;
        let max_background = limits.max_background;
        let out = abi::InitOut {
            minor: abi::KERNEL_MINOR_VERSION,
            max_readahead,
            flags: flags & wanted | if uring { INIT_EXT } else { 0 },
            max_background,
            congestion_threshold: max_background / 4 * 3,
            max_write: limits.max_request,
            max_pages: (limits.max_request / 4096).min(u16::MAX.into()) as u16,
            flags2: if uring { OVER_IO_URING } else { 0 },
        };
        info!(
            "fuse: kernel protocol {major}.{minor}, speaking 7.{}, flags {:#x}{}",
            abi::KERNEL_MINOR_VERSION,
            out.flags,
            if uring {
                ", requests over io_uring"
            } else {
                ""
            }
        );
        self.send(h.unique, 0, &abi::init_out(&out));
        // The kernel has taken the reply when the send returns: ring entries may register.
        self.session.handshake_done(uring);
        Ok(())
    }

    fn lookup(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let name = a.name().ok_or(libc::EINVAL)?;
        let attr = self.fs().lookup(h.nodeid, name)?;
        self.send(h.unique, 0, &abi::entry_out(&attr));
        Ok(())
    }

    fn getattr(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let flags = a.u32().ok_or(libc::EINVAL)?;
        a.skip(4).ok_or(libc::EINVAL)?;
        let fh = a.u64().ok_or(libc::EINVAL)?;
        let fh = (flags & abi::GETATTR_FH != 0).then_some(fh);
        let attr = self.fs().getattr(h.nodeid, fh)?;
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
        let attr = self.fs().getattr(h.nodeid, fh)?;
        if valid & abi::FATTR_SIZE != 0 && size != attr.size {
            return Err(libc::EINVAL);
        }
        self.send(h.unique, 0, &abi::attr_out(&attr));
        Ok(())
    }

    fn access(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let mask = a.u32().ok_or(libc::EINVAL)?;
        let attr = self.fs().getattr(h.nodeid, None)?;
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
        let fh = self.fs().open(h.nodeid, writable)?;
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
            self.fs().releasedir(fh);
        } else {
            self.fs().release(fh);
        }
        self.send(h.unique, 0, &[]);
        Ok(())
    }

    fn opendir(&mut self, h: &InHeader) -> Result<(), Errno> {
        let fh = self.fs().opendir(h.nodeid)?;
        self.send(h.unique, 0, &abi::open_out(fh, 0));
        Ok(())
    }

    fn readdir(&mut self, h: &InHeader, mut a: Args) -> Result<(), Errno> {
        let fh = a.u64().ok_or(libc::EINVAL)?;
        let offset = a.u64().ok_or(libc::EINVAL)?;
        let size = a.u32().ok_or(libc::EINVAL)? as usize;
        let listing = self.fs().listing(fh).ok_or(libc::EBADF)?;
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
        let open = self.fs().file(fh).ok_or(libc::EBADF)?;
        open.device.flush().map_err(|e| errno("flush", e))?;
        self.send(h.unique, 0, &[]);
        Ok(())
    }

    /// Reads like a regular file: up to the end of the device (a read there returns nothing,
    /// which is how `cat` knows it is done), at any byte offset and length.
    fn read(&mut self, h: &InHeader, args: &[u8]) -> Result<(), Errno> {
        let ReadIn { fh, offset, size } = ReadIn::parse(args).ok_or(libc::EINVAL)?;
        let open = self.fs().file(fh).ok_or(libc::EBADF)?;
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

    fn write(&mut self, h: &InHeader, args: &[u8], data: &[u8]) -> Result<(), Errno> {
        let w = WriteIn::parse(args).ok_or(libc::EINVAL)?;
        let payload = data.get(..w.size as usize).ok_or(libc::EINVAL)?;
        let open = self.fs().file(w.fh).ok_or(libc::EBADF)?;
        let flags = WriteFlags { fua: w.fua() };
        let written = self.write_at(&open.device, w.offset, payload, flags)?;
        self.send(h.unique, 0, &abi::write_out(written as u32));
        Ok(())
    }

    /// Writes like a regular file of fixed size: a write crossing the end is cut short there,
    /// one starting at or past it fails with ENOSPC, as on a block device.
    ///
    /// Bytes that only partly cover a sector are merged by read-modify-write of that sector in
    /// the serving thread's buffer. That is not atomic: a concurrent write to another part of the
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

    fn fallocate(&mut self, h: &InHeader, args: &[u8]) -> Result<(), Errno> {
        let f = FallocateIn::parse(args).ok_or(libc::EINVAL)?;
        let open = self.fs().file(f.fh).ok_or(libc::EBADF)?;
        let device = &open.device;
        match f.meaning(device.size())? {
            Fallocation::Nothing => {}
            Fallocation::Zero {
                offset,
                end,
                may_unmap,
            } => self.zero(device, offset, end, may_unmap)?,
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
