//! The transmission phase: requests in, replies out, many in flight.

use parking_lot::Mutex;
use std::io::{self, BufRead, BufReader, IoSlice, Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{info, warn};

use crate::budget::{BufferBudget, Payload};
use crate::commands::Session;
use crate::handshake::{Negotiated, MAX_PAYLOAD};
use crate::protocol::*;
use crate::stall;
use crate::stream::Stream;
use crate::ServerConfig;

const READ_BUFFER: usize = 256 << 10;

struct Connection<'a> {
    /// Buffered: at queue depth 32 one read() brings in many requests (and small write
    /// payloads), instead of two system calls per request.
    reader: Mutex<BufReader<Stream>>,
    writer: Mutex<Stream>,
    session: Session,
    closing: AtomicBool,
    budget: &'a Arc<BufferBudget>,
    idle_timeout: Option<Duration>,
    /// How long a client may send none of a write's data, or read none of a reply, while
    /// nobody waits for buffer room (see [`stall`]).
    write_timeout: Duration,
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
    budget: &Arc<BufferBudget>,
) -> io::Result<()> {
    let (session, open_guard) = Session::start(negotiated);
    // The idle timeout is the socket's: a read waiting for the next request wakes up then.
    stream.set_read_timeout(config.idle_timeout)?;
    // A reply's send looks this often whether its client has stalled (see `send`).
    stream.set_write_timeout(Some(stall::LOOK_EVERY))?;
    let conn = Connection {
        writer: Mutex::new(stream.try_clone()?),
        reader: Mutex::new(BufReader::with_capacity(READ_BUFFER, stream)),
        session,
        closing: AtomicBool::new(false),
        budget,
        idle_timeout: config.idle_timeout,
        write_timeout: config.handshake_timeout,
        in_flight: AtomicUsize::new(0),
        started: Instant::now(),
        last_active: AtomicU64::new(0),
    };
    std::thread::scope(|scope| {
        for i in 0..config.workers_per_connection.max(1) {
            let conn = &conn;
            std::thread::Builder::new()
                .name(format!("nbd-{}-{i}", conn.session.name))
                .spawn_scoped(scope, move || conn.worker())
                .expect("spawn NBD worker");
        }
    });
    // The export (and its open count) is released when the last worker is done.
    drop(open_guard);
    Ok(())
}

/// A request read from the socket, with its payload buffer if it is a write.
struct Job<'c> {
    request: Request,
    payload: Option<Payload>,
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
                let mut reader = self.reader.lock();
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
                        self.session.name,
                        self.idle_timeout.unwrap_or_default()
                    );
                    self.closing.store(true, Ordering::Release);
                    return self.writer.lock().shutdown();
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
            warn!(
                "nbd export '{}': closing connection: {why}",
                self.session.name
            );
        }
        self.writer.lock().shutdown();
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
                Err(e) if stall::timed_out(&e) => {
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
            // Part of a header and no more of it for the idle timeout is no request.
            Err(e) if stall::timed_out(&e) && self.in_flight.load(Ordering::Acquire) == 0 => {
                return Ok(Next::Idle)
            }
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
            self.read_payload(reader, buf)?;
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
        let result = self.session.validate(&r).and_then(|()| {
            if r.command == CMD_READ {
                payload = Some(self.budget.take(r.length as usize));
            }
            self.session.execute(&r, payload.as_deref_mut())
        });
        let reply = self.session.reply(&r, result, payload);
        self.send(reply.slices().collect())
    }

    /// Receives a write's data, ending the connection if its client stalls (see [`stall`]).
    fn read_payload(&self, reader: &mut BufReader<Stream>, buf: &mut [u8]) -> io::Result<()> {
        if reader.buffer().len() >= buf.len() {
            return reader.read_exact(buf);
        }
        // Blocked reads look every so often whether the client has stalled.
        reader.get_ref().set_read_timeout(Some(stall::LOOK_EVERY))?;
        let what = "sent none of the rest of a write's data";
        let mut got = 0;
        let received = stall::move_all(self.budget, self.write_timeout, what, buf.len(), || {
            let n = reader.read(&mut buf[got..])?;
            got += n;
            Ok(n)
        });
        reader.get_ref().set_read_timeout(self.idle_timeout)?;
        received
    }

    /// Sends a reply, ending the connection if its client stalls (see [`stall`]); the
    /// socket's write timeout is [`stall::LOOK_EVERY`].
    fn send(&self, mut slices: Vec<IoSlice<'_>>) -> io::Result<()> {
        let mut writer = self.writer.lock();
        let mut slices = &mut slices[..];
        let len = slices.iter().map(|s| s.len()).sum();
        let what = "read none of its replies";
        stall::move_all(self.budget, self.write_timeout, what, len, || {
            let n = writer.write_vectored(slices)?;
            IoSlice::advance_slices(&mut slices, n);
            Ok(n)
        })
    }
}
