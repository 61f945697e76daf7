//! The transmission phase: requests in, replies out, many in flight.

use std::any::Any;
use std::io::{self, BufRead, BufReader, IoSlice, Read};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use udm_block::{merge_extents, BlockDevice, BlockError, Checked, Extent, WriteFlags, ZeroFlags};

use crate::budget::{BufferBudget, Payload};
use crate::handshake::{Negotiated, MAX_PAYLOAD};
use crate::protocol::*;
use crate::stream::Stream;
use crate::ServerConfig;

const READ_BUFFER: usize = 256 << 10;

struct Connection<'a> {
    name: String,
    /// Buffered: at queue depth 32 one read() brings in many requests (and small write
    /// payloads), instead of two system calls per request.
    reader: Mutex<BufReader<Stream>>,
    writer: Mutex<Stream>,
    device: Checked<Arc<dyn BlockDevice>>,
    structured: bool,
    base_allocation: bool,
    closing: AtomicBool,
    budget: &'a BufferBudget,
    idle_timeout: Option<Duration>,
    /// Requests read and not yet answered: a connection with any is never idle.
    in_flight: AtomicUsize,
    started: Instant,
    /// When a request last arrived or was answered, in milliseconds since `started`.
    last_active: AtomicU64,
}

/// Serves one negotiated connection until the client disconnects (or stays idle too long).
pub fn serve(
    stream: Stream,
    negotiated: Negotiated,
    config: &ServerConfig,
    budget: &BufferBudget,
) -> io::Result<()> {
    let Negotiated {
        name,
        export,
        structured,
        base_allocation,
    } = negotiated;
    // The idle timeout is the socket's: a read waiting for the next request wakes up then.
    stream.set_read_timeout(config.idle_timeout)?;
    let conn = Connection {
        name,
        writer: Mutex::new(stream.try_clone()?),
        reader: Mutex::new(BufReader::with_capacity(READ_BUFFER, stream)),
        device: Checked::new(export.device.clone(), export.read_only),
        structured,
        base_allocation,
        closing: AtomicBool::new(false),
        budget,
        idle_timeout: config.idle_timeout,
        in_flight: AtomicUsize::new(0),
        started: Instant::now(),
        last_active: AtomicU64::new(0),
    };
    std::thread::scope(|scope| {
        for i in 0..config.workers_per_connection.max(1) {
            let conn = &conn;
            std::thread::Builder::new()
                .name(format!("nbd-{}-{i}", conn.name))
                .spawn_scoped(scope, move || conn.worker())
                .expect("spawn NBD worker");
        }
    });
    // The export (and its open count) is released when the last worker is done.
    drop(export);
    Ok(())
}

/// A request read from the socket, with its payload buffer if it is a write.
struct Job<'c> {
    request: Request,
    payload: Option<Payload<'c>>,
    _in_flight: InFlight<'c>,
}

/// Counts a request in flight from when it is read until its reply is sent (or its worker
/// unwinds).
struct InFlight<'c>(&'c Connection<'c>);

impl<'c> InFlight<'c> {
    fn new(conn: &'c Connection<'c>) -> Self {
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        conn.touch();
        InFlight(conn)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

enum Next<'c> {
    Request(Job<'c>),
    /// NBD_CMD_DISC or end of stream: finish what is in flight and close.
    Disconnect,
    /// Nothing in flight and nothing arriving for the idle timeout.
    Idle,
}

impl<'c> Connection<'c> {
    fn worker(&'c self) {
        loop {
            let next = {
                let mut reader = self.reader.lock().unwrap();
                if self.closing.load(Ordering::Acquire) {
                    return;
                }
                self.read_request(&mut reader)
            };
            let job = match next {
                Ok(Next::Request(job)) => job,
                Ok(Next::Disconnect) => {
                    self.closing.store(true, Ordering::Release);
                    return;
                }
                Ok(Next::Idle) => {
                    info!(
                        "nbd export '{}': closing a connection idle for {:?}",
                        self.name,
                        self.idle_timeout.unwrap_or_default()
                    );
                    self.closing.store(true, Ordering::Release);
                    return self.writer.lock().unwrap().shutdown();
                }
                Err(e) => return self.abort(&format!("reading a request: {e}")),
            };
            if let Err(e) = self.handle(job) {
                return self.abort(&format!("sending a reply: {e}"));
            }
        }
    }

    /// Ends the connection after a protocol violation or a dead socket.
    fn abort(&self, why: &str) {
        if !self.closing.swap(true, Ordering::AcqRel) {
            warn!("nbd export '{}': closing connection: {why}", self.name);
        }
        self.writer.lock().unwrap().shutdown();
    }

    fn touch(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        self.last_active.fetch_max(now, Ordering::AcqRel);
    }

    fn quiet_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_active.load(Ordering::Acquire));
        self.started.elapsed().saturating_sub(last)
    }

    /// Waits for the first byte of the next request. Each time the socket's read timeout
    /// expires, the connection is idle if nothing is in flight and nothing happened for the
    /// idle timeout; otherwise the wait goes on for as long as could make it idle.
    fn wait_for_request(&self, reader: &mut BufReader<Stream>) -> io::Result<Option<Next<'c>>> {
        let mut shortened = false;
        let more = loop {
            match reader.fill_buf() {
                Ok(buffered) => break !buffered.is_empty(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    let Some(idle) = self.idle_timeout else {
                        return Err(e);
                    };
                    let wait = if self.in_flight.load(Ordering::Acquire) > 0 {
                        idle
                    } else {
                        match idle.checked_sub(self.quiet_for()) {
                            Some(left) if !left.is_zero() => left,
                            _ => return Ok(Some(Next::Idle)),
                        }
                    };
                    reader.get_ref().set_read_timeout(Some(wait))?;
                    shortened = true;
                }
                Err(e) => return Err(e),
            }
        };
        if shortened {
            // A request is arriving: its remaining bytes get the full timeout.
            reader.get_ref().set_read_timeout(self.idle_timeout)?;
        }
        Ok((!more).then_some(Next::Disconnect))
    }

    fn read_request(&'c self, reader: &mut BufReader<Stream>) -> io::Result<Next<'c>> {
        if let Some(next) = self.wait_for_request(reader)? {
            return Ok(next);
        }
        let mut header = [0u8; REQUEST_HEADER_LEN];
        match reader.read_exact(&mut header) {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(Next::Disconnect),
            other => other?,
        }
        let request = parse_request(&header)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        let in_flight = InFlight::new(self);
        let mut payload = None;
        if request.command == CMD_WRITE {
            // The payload must be consumed to stay in sync; one we won't buffer ends things.
            if request.length > MAX_PAYLOAD {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "write of {} bytes exceeds the {MAX_PAYLOAD}-byte limit",
                        request.length
                    ),
                ));
            }
            // Waits for room in the budget while holding the reader: this connection's
            // next request could not be buffered either.
            let buf = payload.insert(self.budget.take(request.length as usize));
            reader.read_exact(buf)?;
        }
        if request.command == CMD_DISC {
            return Ok(Next::Disconnect);
        }
        Ok(Next::Request(Job {
            request,
            payload,
            _in_flight: in_flight,
        }))
    }

    fn handle(&'c self, job: Job<'c>) -> io::Result<()> {
        let Job {
            request: r,
            mut payload,
            _in_flight,
        } = job;
        // A bug in a target fails its request, not the connection (nor the daemon).
        let result = catch_unwind(AssertUnwindSafe(|| self.execute(&r, &mut payload)))
            .unwrap_or_else(|panic| {
                let why = panic_message(&*panic);
                warn!(
                    "nbd export '{}': command {} panicked: {why}",
                    self.name, r.command
                );
                Err(BlockError::Io(format!("the request failed: {why}")))
            });
        match (result, r.command) {
            (Ok(Some(extents)), _) => self.reply_block_status(&r, &extents),
            (Ok(None), CMD_READ) => {
                self.reply_read(&r, payload.as_deref().expect("a read has its buffer"))
            }
            (Ok(None), _) => self
                .writer
                .lock()
                .unwrap()
                .write_all_vectored(&mut [IoSlice::new(&simple_reply(r.cookie, 0))]),
            (Err(e), _) => {
                debug!(
                    "nbd export '{}': command {} failed: {e}",
                    self.name, r.command
                );
                self.reply_error(&r, &e)
            }
        }
    }

    /// Refuses flags a command does not take, as nbdkit does. FUA is valid on every command
    /// (the protocol says so); DF only on reads with structured replies.
    fn check_flags(&self, r: &Request) -> Result<(), BlockError> {
        let allowed = CMD_FLAG_FUA
            | match r.command {
                CMD_READ if self.structured => CMD_FLAG_DF,
                CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
                _ => 0,
            };
        let bad = r.flags & !allowed;
        if bad == 0 {
            return Ok(());
        }
        let why = if bad == CMD_FLAG_DF && r.command == CMD_READ {
            " without structured replies".to_string()
        } else {
            format!(" on command {}", r.command)
        };
        Err(BlockError::InvalidArgument(format!(
            "flags {bad:#x} are not valid{why}"
        )))
    }

    /// Runs a request against the device; block status returns its extents. A read's
    /// buffer is taken from the budget here, once the request is known to be valid.
    fn execute(
        &'c self,
        r: &Request,
        payload: &mut Option<Payload<'c>>,
    ) -> Result<Option<Vec<Extent>>, BlockError> {
        self.check_flags(r)?;
        let fua = r.flags & CMD_FLAG_FUA != 0;
        let (offset, len) = (r.offset, u64::from(r.length));
        match r.command {
            CMD_READ => {
                if r.length > MAX_PAYLOAD {
                    return Err(BlockError::InvalidArgument(format!(
                        "read of {len} bytes exceeds the {MAX_PAYLOAD}-byte limit"
                    )));
                }
                let buf = payload.insert(self.budget.take(r.length as usize));
                self.device.read(offset, buf)?;
            }
            CMD_WRITE => self.device.write(
                offset,
                payload.as_deref().expect("a write's payload was read"),
                WriteFlags { fua },
            )?,
            CMD_FLUSH => {
                if offset != 0 || len != 0 {
                    return Err(BlockError::InvalidArgument(format!(
                        "flush with offset {offset} and length {len} (both must be 0)"
                    )));
                }
                self.device.flush()?
            }
            CMD_TRIM => {
                self.device.discard(offset, len)?;
                if fua {
                    self.device.flush()?;
                }
            }
            CMD_CACHE => self.device.cache(offset, len)?,
            CMD_WRITE_ZEROES => self.device.write_zeroes(
                offset,
                len,
                ZeroFlags {
                    fua,
                    may_unmap: r.flags & CMD_FLAG_NO_HOLE == 0,
                    fast_only: r.flags & CMD_FLAG_FAST_ZERO != 0,
                },
            )?,
            CMD_BLOCK_STATUS => {
                if !self.base_allocation {
                    return Err(BlockError::InvalidArgument(
                        "block status without a negotiated meta context".into(),
                    ));
                }
                // Checked keeps the total within the request, whose length is a u32, so every
                // merged extent fits the wire format.
                let mut extents = merge_extents(self.device.block_status(offset, len)?);
                if r.flags & CMD_FLAG_REQ_ONE != 0 {
                    extents.truncate(1);
                }
                return Ok(Some(extents));
            }
            other => {
                return Err(BlockError::InvalidArgument(format!(
                    "unknown command {other}"
                )));
            }
        }
        Ok(None)
    }

    fn reply_read(&self, r: &Request, data: &[u8]) -> io::Result<()> {
        let mut writer = self.writer.lock().unwrap();
        if !self.structured {
            let header = simple_reply(r.cookie, 0);
            return writer.write_all_vectored(&mut [IoSlice::new(&header), IoSlice::new(data)]);
        }
        let offset = r.offset.to_be_bytes();
        if is_zero(data) {
            // A hole chunk tells the client the range is zero without sending the zeroes.
            let header = chunk_header(CHUNK_FLAG_DONE, CHUNK_OFFSET_HOLE, r.cookie, 12);
            let size = (data.len() as u32).to_be_bytes();
            return writer.write_all_vectored(&mut [
                IoSlice::new(&header),
                IoSlice::new(&offset),
                IoSlice::new(&size),
            ]);
        }
        let header = chunk_header(
            CHUNK_FLAG_DONE,
            CHUNK_OFFSET_DATA,
            r.cookie,
            8 + data.len() as u32,
        );
        writer.write_all_vectored(&mut [
            IoSlice::new(&header),
            IoSlice::new(&offset),
            IoSlice::new(data),
        ])
    }

    fn reply_block_status(&self, r: &Request, extents: &[Extent]) -> io::Result<()> {
        let mut payload = BASE_ALLOCATION_ID.to_be_bytes().to_vec();
        for e in extents {
            payload.extend_from_slice(&(e.len as u32).to_be_bytes());
            payload.extend_from_slice(&e.flags.to_be_bytes());
        }
        let header = chunk_header(
            CHUNK_FLAG_DONE,
            CHUNK_BLOCK_STATUS,
            r.cookie,
            payload.len() as u32,
        );
        self.writer
            .lock()
            .unwrap()
            .write_all_vectored(&mut [IoSlice::new(&header), IoSlice::new(&payload)])
    }

    fn reply_error(&self, r: &Request, e: &BlockError) -> io::Result<()> {
        let error = nbd_error(e.errno());
        let mut writer = self.writer.lock().unwrap();
        if self.structured && matches!(r.command, CMD_READ | CMD_BLOCK_STATUS) {
            let mut message = e.to_string();
            if message.len() > 1024 {
                // Cut on a character boundary: the protocol wants valid UTF-8.
                let cut = (0..=1024)
                    .rev()
                    .find(|&i| message.is_char_boundary(i))
                    .unwrap_or(0);
                message.truncate(cut);
            }
            let message = message.as_bytes();
            let mut payload = error.to_be_bytes().to_vec();
            payload.extend_from_slice(&(message.len() as u16).to_be_bytes());
            payload.extend_from_slice(message);
            let header = chunk_header(CHUNK_FLAG_DONE, CHUNK_ERROR, r.cookie, payload.len() as u32);
            return writer.write_all_vectored(&mut [IoSlice::new(&header), IoSlice::new(&payload)]);
        }
        writer.write_all_vectored(&mut [IoSlice::new(&simple_reply(r.cookie, error))])
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic")
}

fn is_zero(data: &[u8]) -> bool {
    let (head, words, tail) = unsafe { data.align_to::<u128>() };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection_sees_a_single_set_byte_anywhere() {
        let mut data = vec![0u8; 4099];
        assert!(is_zero(&data));
        for at in [0, 1, 15, 16, 2048, 4098] {
            data[at] = 1;
            assert!(!is_zero(&data), "byte {at}");
            data[at] = 0;
        }
    }
}
