//! The /dev/fuse transport: worker threads that each read a request from /dev/fuse, serve it
//! and write the reply, with buffers of their own allocated once.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use log::{debug, error, warn};
use udm_block::{AlignedBuf, SECTOR_SIZE};

use crate::abi::{self, IN_HEADER_LEN, OUT_HEADER_LEN, WRITE_IN_LEN};
use crate::dispatch::{self, Reply, Request};
use crate::fs::Errno;
use crate::session::Session;

/// The request buffer starts this far before the point where a WRITE's payload lands, so that
/// the payload (after the 80 bytes of fuse_in_header and fuse_write_in) is page-aligned and
/// goes to O_DIRECT backends without a bounce copy.
const HEADER_ROOM: usize = 4096;
const WRITE_HEADERS: usize = IN_HEADER_LEN + WRITE_IN_LEN;

pub(crate) struct Worker {
    session: Arc<Session>,
    fd: Arc<OwnedFd>,
}

/// Replies written to /dev/fuse.
struct DevReply(RawFd);

impl Reply for DevReply {
    /// Writes header and payload in one writev (the kernel takes a reply only whole).
    fn send(&self, unique: u64, errno: Errno, payload: &[u8]) {
        let header = abi::out_header(OUT_HEADER_LEN + payload.len(), -errno, unique);
        let iov = [IoSlice::new(&header), IoSlice::new(payload)];
        let count = if payload.is_empty() { 1 } else { 2 };
        // SAFETY: IoSlice is ABI-compatible with iovec; `count` slices are initialised.
        let n = unsafe { libc::writev(self.0, iov.as_ptr().cast(), count) };
        if n < 0 {
            // ENOENT: the request was aborted meanwhile (unmount); nobody waits for the reply.
            debug!(
                "fuse: reply to request {unique} not delivered: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

impl Worker {
    pub fn new(session: Arc<Session>, fd: Arc<OwnedFd>) -> Worker {
        Worker { session, fd }
    }

    /// Serves requests until the connection ends (unmount or abort).
    pub fn run(self) {
        let max = self.session.limits.max_request as usize;
        // The kernel refuses reads into less than fuse_in_header + fuse_write_in + max_write;
        // every other request is smaller than a WRITE.
        let mut request = AlignedBuf::zeroed(HEADER_ROOM + max);
        let mut data = AlignedBuf::zeroed(max + 2 * SECTOR_SIZE as usize);
        let fd = self.fd.as_raw_fd();
        let reply = DevReply(fd);
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
            match Request::from_message(msg) {
                Some(req) => dispatch::serve(&self.session, &mut data, &reply, &req),
                None => warn!("fuse: a request of {} bytes is too short", msg.len()),
            }
        }
    }
}
