//! The NBD client: a remote export as a udm [`BlockDevice`], so a clone can hydrate from
//! `nbd://backup-host/vol`.
//!
//! One connection carries every request. Callers write their request under a writer lock with
//! a fresh cookie and sleep on a slot of their own; one thread for the whole process (the
//! reply reader, `poller`) waits on every client's socket at once, reads the replies, copies
//! read data into the caller's buffer, and wakes the slot: a burst of replies over several
//! connections (a multipath's paths) wakes one thread once. Each client's own thread
//! redials: while connected it only wakes to flush writes left owing on a quiet connection
//! (which a server's idle timeout would otherwise turn into a failed flush), and when the
//! connection breaks it redials with backoff.
//! Requests in flight then are not failed: their callers resend them once the connection is
//! back (reads, writes, flushes and the rest are all idempotent), and only a request older
//! than `io_timeout` fails, so nothing waits forever on a server that stays away. With
//! `fail_fast` (a multipath's path) they fail at once instead, for the multipath to send
//! elsewhere. A server that answers ESHUTDOWN is going away cleanly: that counts as a broken
//! connection too, and closing ours lets it exit.
//!
//! A client can also start without a connection ([`NbdClient::disconnected`]), for a device
//! that must come back while its remote is down: the size it was last seen with stands in
//! until the first connection confirms it.
//!
//! The files, by job: `dial` connects and negotiates (Unix or TCP, the handshake, the
//! options); `connection` is one established connection and the slots its requests wait in;
//! `poller` is the process's reply reader, its epoll and each connection's buffer; `reply`
//! tells how long a reply is and matches it to its slot; `request` is the caller's side,
//! sending a request and waiting for it across reconnections; `mapped` the executor's side,
//! requests nobody waits for; `reconnect` is the state callers share with the client's
//! thread and the reader, and the client's thread's loop. This file holds the public
//! surface and the [`BlockDevice`] implementation.

mod connection;
mod dial;
mod mapped;
mod poller;
mod reconnect;
mod reply;
mod request;

use parking_lot::{Condvar, Mutex};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use log::info;
use thiserror::Error;
use udm_block::{
    write_zeroes_by_writing, BlockDevice, BlockError, Capabilities, Extent, MapOp, Mapping,
    WriteFlags, ZeroFlags,
};

use crate::protocol::*;
use crate::stream::Stream;
use crate::uri::UriError;
use connection::{disconnect, Conn};
use dial::{ExportInfo, Target};
use reconnect::{Shared, State};
use request::Payload;

/// Requests are split to this size at most, whatever the server allows: the protocol's
/// portable maximum, which no server treats as a denial of service.
const MAX_REQUEST: u32 = 32 << 20;
/// TRIM and BLOCK_STATUS carry no payload and may exceed the maximum block size; they are
/// still bounded by the 32-bit length field. 2 GiB stays aligned to any minimum block size.
const MAX_NO_PAYLOAD: u64 = 1 << 31;
const SECTOR: u32 = 512;

#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Refuse writes locally even if the export is writable.
    pub read_only: bool,
    /// A request not completed within this time (because the server is unreachable or does
    /// not answer) fails with EIO.
    pub io_timeout: Duration,
    /// Bounds each connection attempt: dialling and the handshake.
    pub connect_timeout: Duration,
    /// A request fails as soon as its connection breaks, or at once when there is none,
    /// instead of waiting up to `io_timeout` to be resent on the next one: for a multipath's
    /// path, whose requests have another path to go to. The client still redials in the
    /// background, and requests made once it is back succeed.
    pub fail_fast: bool,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            read_only: false,
            io_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            fail_fast: false,
        }
    }
}

/// Why [`NbdClient::connect`] failed.
#[derive(Debug, Error)]
pub enum ClientError {
    #[error(transparent)]
    Uri(#[from] UriError),
    #[error("cannot connect to nbd server {address}: {source}")]
    Connect {
        address: String,
        #[source]
        source: io::Error,
    },
    #[error("nbd server {address}: handshake failed: {source}")]
    Handshake {
        address: String,
        #[source]
        source: io::Error,
    },
    #[error("nbd server {address}: {what}")]
    Protocol { address: String, what: String },
    #[error("nbd server {address} refused export '{export}': {message}")]
    Refused {
        address: String,
        export: String,
        message: String,
    },
}

/// A remote NBD export as a block device. See the module documentation for the design.
pub struct NbdClient {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl NbdClient {
    /// Connects to `uri` (`nbd://HOST[:PORT]/EXPORT` or `nbd+unix:///EXPORT?socket=PATH`).
    /// The first connection must succeed; later breaks are repaired in the background.
    pub fn connect(uri: &str, options: ClientOptions) -> Result<NbdClient, ClientError> {
        let target = Target::parse(uri, options)?;
        let (stream, info) = target.dial()?;
        let (conn, reader) = Conn::new(stream, info).map_err(|e| target.handshake_io(e))?;
        info!(
            "nbd: connected to {} export '{}' ({} bytes)",
            target.address, target.export, info.size
        );
        target.warn_about(&info);
        Self::start(target, info, Some((conn, reader)))
    }

    /// A client for `uri` that does not connect now: its export was last seen with `size`
    /// bytes and is expected back. Requests wait for the connection the background thread
    /// keeps trying to make (up to `io_timeout`); an export that comes back with another size
    /// fails the device, as on any reconnection.
    pub fn disconnected(
        uri: &str,
        options: ClientOptions,
        size: u64,
    ) -> Result<NbdClient, ClientError> {
        let target = Target::parse(uri, options)?;
        // Until the server tells, assume the least: no optional commands, no block status.
        // Skipping FLUSH meanwhile loses nothing, since nothing was written through us yet.
        let info = ExportInfo {
            size,
            flags: 0,
            min_block: 1,
            max_request: MAX_REQUEST,
            structured: false,
            base_allocation: None,
        };
        Self::start(target, info, None)
    }

    fn start(
        target: Target,
        info: ExportInfo,
        conn: Option<(Arc<Conn>, Stream)>,
    ) -> Result<NbdClient, ClientError> {
        let name = format!("nbd-client-{}", target.export);
        let shared = Arc::new(Shared {
            size: info.size,
            target,
            state: Mutex::new(State {
                connected_before: conn.is_some(),
                conn: conn.as_ref().map(|(conn, _)| conn.clone()),
                info,
                failed: None,
                closing: false,
            }),
            changed: Condvar::new(),
            next_cookie: AtomicU64::new(1),
            writes_lost: AtomicBool::new(false),
        });
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn({
                let shared = shared.clone();
                move || shared.run(conn)
            })
            .map_err(|e| shared.target.handshake_io(e))?;
        Ok(NbdClient {
            shared,
            thread: Some(thread),
        })
    }

    /// Whether the connection is up. Background work (hydration) can pause while it is not;
    /// requests made meanwhile wait for it, up to `io_timeout`.
    pub fn is_connected(&self) -> bool {
        self.shared.state.lock().conn.is_some()
    }

    fn info(&self) -> ExportInfo {
        self.shared.state.lock().info
    }

    fn read_only(&self, info: &ExportInfo) -> bool {
        self.shared.target.options.read_only || info.has(TF_READ_ONLY)
    }

    /// A server without FLUSH writes through, and a read-only client writes nothing: either
    /// way a flush has nothing to make durable, and no reason to wait for a server that is
    /// down.
    fn flush_sends_nothing(&self, info: &ExportInfo) -> bool {
        !info.has(TF_SEND_FLUSH) || self.read_only(info)
    }

    fn check_writable(&self, info: &ExportInfo) -> udm_block::Result<()> {
        if self.read_only(info) {
            return Err(BlockError::ReadOnly(format!(
                "nbd export '{}' is read-only",
                self.shared.target.export
            )));
        }
        Ok(())
    }

    /// Sends `[offset, offset + len)` as requests of at most `max` bytes, one after another.
    fn in_pieces(
        &self,
        command: u16,
        flags: u16,
        offset: u64,
        len: u64,
        max: u64,
    ) -> udm_block::Result<()> {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(max);
            self.call(command, flags, offset + done, n as u32, Payload::None)?;
            done += n;
        }
        Ok(())
    }
}

/// The part of an export of `size` bytes that whole sectors cover.
fn usable(size: u64) -> u64 {
    size / u64::from(SECTOR) * u64::from(SECTOR)
}

impl BlockDevice for NbdClient {
    fn size(&self) -> u64 {
        usable(self.shared.size)
    }

    fn capabilities(&self) -> Capabilities {
        let info = self.info();
        Capabilities {
            read_only: self.read_only(&info),
            native_fua: info.has(TF_SEND_FUA),
            discard: info.has(TF_SEND_TRIM),
            fast_zero: info.has(TF_SEND_FAST_ZERO),
            rotational: info.has(TF_ROTATIONAL),
            // Every request goes over one connection, so a flush covers every write we made.
            flush_covers_all: true,
        }
    }

    /// Reads, writes and flushes go as transfers while connected (see `mapped`).
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        self.mapping(op, offset, len)
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        let max = self.info().max_request as usize;
        for (i, piece) in buf.chunks_mut(max).enumerate() {
            let len = piece.len() as u32;
            self.call(
                CMD_READ,
                0,
                offset + (i * max) as u64,
                len,
                Payload::Read(piece),
            )?;
        }
        Ok(())
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        let info = self.info();
        self.check_writable(&info)?;
        let native_fua = flags.fua && info.has(TF_SEND_FUA);
        let max = info.max_request as usize;
        for (i, piece) in buf.chunks(max).enumerate() {
            self.call(
                CMD_WRITE,
                if native_fua { CMD_FLAG_FUA } else { 0 },
                offset + (i * max) as u64,
                piece.len() as u32,
                Payload::Write(piece),
            )?;
        }
        if flags.fua && !native_fua {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&self) -> udm_block::Result<()> {
        let info = self.info();
        if self.flush_sends_nothing(&info) {
            // Writes an earlier connection's server acknowledged and may have lost are still
            // reported: that server may have come back read-only, or without FLUSH.
            return reconnect::take_writes_lost(&self.shared.writes_lost).map_or(Ok(()), Err);
        }
        // A flush that fails (no connection, with `fail_fast`) reports lost writes all the
        // same: its caller may be a multipath that would take a connection error for its
        // path's and cover the flush down another path, which never had these writes.
        self.call(CMD_FLUSH, 0, 0, 0, Payload::None)
            .map(drop)
            .map_err(|e| reconnect::take_writes_lost(&self.shared.writes_lost).unwrap_or(e))
    }

    fn discard(&self, offset: u64, len: u64) -> udm_block::Result<()> {
        let info = self.info();
        self.check_writable(&info)?;
        if !info.has(TF_SEND_TRIM) {
            return Ok(());
        }
        self.in_pieces(CMD_TRIM, 0, offset, len, MAX_NO_PAYLOAD)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> udm_block::Result<()> {
        let info = self.info();
        self.check_writable(&info)?;
        if !info.has(TF_SEND_WRITE_ZEROES) {
            return write_zeroes_by_writing(self, offset, len, flags);
        }
        if flags.fast_only && !info.has(TF_SEND_FAST_ZERO) {
            return Err(BlockError::NotSupported(
                "the nbd server cannot promise fast zeroing".into(),
            ));
        }
        let native_fua = flags.fua && info.has(TF_SEND_FUA);
        let mut command_flags = 0;
        if !flags.may_unmap {
            command_flags |= CMD_FLAG_NO_HOLE;
        }
        if flags.fast_only {
            command_flags |= CMD_FLAG_FAST_ZERO;
        }
        if native_fua {
            command_flags |= CMD_FLAG_FUA;
        }
        self.in_pieces(
            CMD_WRITE_ZEROES,
            command_flags,
            offset,
            len,
            info.max_request.into(),
        )?;
        if flags.fua && !native_fua {
            self.flush()?;
        }
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> udm_block::Result<Vec<Extent>> {
        let info = self.info();
        if info.base_allocation.is_none() {
            return Ok(vec![Extent::data(len)]);
        }
        let len = len.min(MAX_NO_PAYLOAD);
        let extents = self.call(CMD_BLOCK_STATUS, 0, offset, len as u32, Payload::None)?;
        // The server may describe single bytes, and callers act on whole sectors: a clone
        // zeroed the whole first sector of a source that said only its first byte was zero.
        let mut extents = udm_block::align_extents(&extents, SECTOR.into());
        // The server's answer may run past the request; keep it within.
        udm_block::clamp_extents(&mut extents, len);
        Ok(extents)
    }

    fn cache(&self, offset: u64, len: u64) -> udm_block::Result<()> {
        let info = self.info();
        if !info.has(TF_SEND_CACHE) {
            return Ok(());
        }
        self.in_pieces(CMD_CACHE, 0, offset, len, info.max_request.into())
    }

    /// Hangs up: requests waiting for a connection or a reply fail with ESHUTDOWN, and the
    /// background thread stops redialling.
    fn close(&self) {
        let conn = {
            let mut state = self.shared.state.lock();
            state.closing = true;
            state.conn.take()
        };
        self.shared.changed.notify_all();
        if let Some(conn) = conn {
            // A writer stuck on a server that stopped reading must not hold us up: the goodbye
            // is skipped then, and when a request is part-written (it would end inside it).
            if let Some(mut writer) = conn.writer.try_lock().filter(|w| w.idle()) {
                disconnect(&mut writer.stream);
            }
            // The reply reader sees the socket end and marks the connection lost; the
            // requests it had in flight are then resent, find the client closing and fail.
            conn.control.shutdown();
        }
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        self.close();
        if let Some(thread) = self.thread.take() {
            // The reconnect loop sees `closing` and ends (the reply reader lets go of the
            // connection by itself). The last owner may be a mapped request's completion,
            // running on the reply reader, which must not wait for a redial in progress (it
            // serves every other client), or on this very thread: the thread then ends by
            // itself.
            let here = std::thread::current().id();
            if thread.thread().id() != here && !poller::is_reader() {
                let _ = thread.join();
            }
        }
    }
}
