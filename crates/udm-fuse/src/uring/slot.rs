//! One ring entry's buffers, registered with the kernel: the header buffer
//! (`fuse_uring_req_header`) and the payload buffer, where a request arrives and its reply is
//! left for the kernel to take at the next COMMIT_AND_FETCH.
//!
//! While the kernel owns an entry (between a REGISTER or COMMIT_AND_FETCH and the completion
//! that brings the next request) nothing here touches its buffers; while udm owns it, exactly
//! one thread does (the queue thread, the engine's I/O, or one pool thread). The buffers are
//! therefore only reached through raw pointers ([`SlotBufs`]), handed from owner to owner.

use std::cell::{Cell, RefCell};

use log::error;
use udm_block::AlignedBuf;

use crate::abi::{self, ring, InHeader, OUT_HEADER_LEN};
use crate::dispatch::{self, Reply, Request};
use crate::fs::Errno;
use crate::session::Session;

pub(crate) struct Slot {
    /// Owners of the memory `bufs` points into.
    _header: AlignedBuf,
    _payload: AlignedBuf,
    /// REGISTER passes the kernel a pointer to these two iovecs (header, payload).
    iov: Box<[libc::iovec; 2]>,
    pub bufs: SlotBufs,
}

// SAFETY: the iovecs point into the slot's own buffers; see the module comment for who
// touches them when.
unsafe impl Send for Slot {}

impl Slot {
    /// A slot whose payload buffer takes `payload_len` bytes: at least the largest request
    /// the kernel sends (its max_write and max_pages). Mapped, so that pages never touched
    /// (most of a 1 MiB buffer serving 4 KiB requests) cost no memory.
    pub fn new(payload_len: usize) -> Slot {
        let mut header = AlignedBuf::mapped(ring::HEADER_LEN);
        let mut payload = AlignedBuf::mapped(payload_len);
        let bufs = SlotBufs {
            header: header.as_mut_ptr(),
            payload: payload.as_mut_ptr(),
            payload_len,
        };
        let iov = Box::new([
            libc::iovec {
                iov_base: bufs.header.cast(),
                iov_len: ring::HEADER_LEN,
            },
            libc::iovec {
                iov_base: bufs.payload.cast(),
                iov_len: payload_len,
            },
        ]);
        Slot {
            _header: header,
            _payload: payload,
            iov,
            bufs,
        }
    }

    /// The address REGISTER gives the kernel.
    pub fn iovecs(&self) -> u64 {
        self.iov.as_ptr() as u64
    }
}

/// Where a slot's buffers are, for whoever owns the slot right now.
#[derive(Clone, Copy)]
pub(crate) struct SlotBufs {
    header: *mut u8,
    pub payload: *mut u8,
    payload_len: usize,
}

// SAFETY: a slot is owned by one thread at a time (see the module comment).
unsafe impl Send for SlotBufs {}

fn read_u64(at: *const u8) -> u64 {
    // SAFETY (for callers): `at` lies within a slot's header buffer.
    u64::from_ne_bytes(unsafe { at.cast::<[u8; 8]>().read() })
}

impl SlotBufs {
    /// The request the kernel put in the slot.
    ///
    /// # Safety
    /// The caller owns the slot, and writes nothing to it while the request is borrowed.
    pub unsafe fn request(&self) -> Request<'_> {
        // SAFETY: within the buffers, which the caller owns.
        let (in_out, op_in, payload_sz) = unsafe {
            (
                std::slice::from_raw_parts(self.header.add(ring::IN_OUT), ring::OP_IN),
                std::slice::from_raw_parts(self.header.add(ring::OP_IN), ring::OP_IN_LEN),
                self.header
                    .add(ring::PAYLOAD_SZ)
                    .cast::<u32>()
                    .read_unaligned(),
            )
        };
        let len = (payload_sz as usize).min(self.payload_len);
        Request {
            header: InHeader::parse(in_out).expect("128 bytes hold a fuse_in_header"),
            args: op_in,
            // SAFETY: within the payload buffer.
            data: unsafe { std::slice::from_raw_parts(self.payload, len) },
        }
    }

    /// What COMMIT_AND_FETCH must name to hand the reply in: the kernel's id for the request.
    ///
    /// # Safety
    /// The caller owns the slot.
    pub unsafe fn commit_id(&self) -> u64 {
        // SAFETY: within the header buffer.
        read_u64(unsafe { self.header.add(ring::COMMIT_ID) })
    }

    /// Writes the reply header: the outcome of `unique`, with the first `len` bytes of the
    /// payload buffer as the reply's payload.
    ///
    /// # Safety
    /// The caller owns the slot, and nothing borrows its buffers.
    pub unsafe fn set_reply(&self, unique: u64, errno: Errno, len: usize) {
        let header = abi::out_header(OUT_HEADER_LEN + len, -errno, unique);
        // SAFETY: within the header buffer; the payload size field is a u32 at a 4-byte
        // aligned offset of a page-aligned buffer.
        unsafe {
            let at = self.header.add(ring::IN_OUT);
            std::ptr::copy_nonoverlapping(header.as_ptr(), at, header.len());
            self.header
                .add(ring::PAYLOAD_SZ)
                .cast::<u32>()
                .write(len as u32);
        }
    }

    /// Copies `payload` into the payload buffer and writes the reply header; a payload too
    /// large for the buffer (which the kernel sized for its largest request) fails with EIO.
    ///
    /// # Safety
    /// As [`SlotBufs::set_reply`]; `payload` is not in the slot's buffers.
    pub unsafe fn reply_with(&self, unique: u64, errno: Errno, payload: &[u8]) {
        if payload.len() > self.payload_len {
            error!(
                "fuse: a reply of {} bytes does not fit the ring entry's {} bytes",
                payload.len(),
                self.payload_len
            );
            // SAFETY: as the caller promised.
            return unsafe { self.set_reply(unique, libc::EIO, 0) };
        }
        // SAFETY: within the payload buffer, which does not overlap `payload`.
        unsafe {
            std::ptr::copy_nonoverlapping(payload.as_ptr(), self.payload, payload.len());
            self.set_reply(unique, errno, payload.len());
        }
    }
}

/// Serves requests from slots on the synchronous code ([`dispatch::serve`]), holding each
/// reply until the request's borrows of the slot have ended, then writing it into the slot.
/// Keeps its reply buffer across requests.
pub(crate) struct SlotServer {
    data: AlignedBuf,
    staged: Staged,
}

#[derive(Default)]
struct Staged {
    outcome: Cell<Option<(u64, Errno)>>,
    payload: RefCell<Vec<u8>>,
}

impl Reply for Staged {
    fn send(&self, unique: u64, errno: Errno, payload: &[u8]) {
        self.outcome.set(Some((unique, errno)));
        let mut staged = self.payload.borrow_mut();
        staged.clear();
        staged.extend_from_slice(payload);
    }
}

impl SlotServer {
    pub fn new(session: &Session) -> SlotServer {
        let max = session.limits.max_request as usize;
        SlotServer {
            data: AlignedBuf::zeroed(max + 2 * udm_block::SECTOR_SIZE as usize),
            staged: Staged::default(),
        }
    }

    /// Serves the request in `bufs` and leaves the reply there.
    ///
    /// # Safety
    /// The caller owns the slot.
    pub unsafe fn serve(&mut self, session: &Session, bufs: SlotBufs) {
        // SAFETY: the caller owns the slot; nothing writes to it until the request is served.
        let req = unsafe { bufs.request() };
        let (unique, opcode) = (req.header.unique, req.header.opcode);
        dispatch::serve(session, &mut self.data, &self.staged, &req);
        // Every request that comes through a ring entry waits for a reply (FORGET and
        // INTERRUPT come through /dev/fuse); without one, the entry would be lost.
        let (unique, errno) = self.staged.outcome.take().unwrap_or_else(|| {
            error!("fuse: request {opcode} through io_uring got no reply; answering EIO");
            self.staged.payload.borrow_mut().clear();
            (unique, libc::EIO)
        });
        // SAFETY: the request's borrows ended with `serve`; the staged payload is ours.
        unsafe { bufs.reply_with(unique, errno, &self.staged.payload.borrow()) };
    }
}
