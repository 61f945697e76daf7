//! Replication streams on a connection: `send` and `receive` on the control socket, and the
//! `--replication` TCP listener, which takes `receive` requests only (a remote daemon's
//! `udm send … --to tcp:HOST:PORT/POOL`). Both speak the control protocol's first line and
//! answers, with the stream's raw bytes in between.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use serde_json::json;

use super::acceptor;
use super::metrics::MetricsAddress;
use super::receive::{self, partial_of};
use super::registry::Registry;
use super::send::Send;
use crate::control::{Envelope, Request, Response, PROTOCOL_VERSION};

/// How long a refused receive still reads what the sender had in flight, so that its answer
/// is not lost to a reset connection.
const DRAIN: Duration = Duration::from_secs(2);
/// A replication connection silent this long is closed.
const IDLE: Duration = Duration::from_secs(60);
/// Replication connections served at once: each holds a thread, and the port may face the
/// network.
const MAX_CONNECTIONS: usize = 64;
/// Longest request line on the replication listener.
const MAX_REQUEST: u64 = 64 << 10;

fn answer(out: &mut dyn Write, response: &Response) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(response).expect("serialisable");
    bytes.push(b'\n');
    out.write_all(&bytes)?;
    out.flush()
}

/// `send`: the answer, then the stream. An error after the answer ends the stream early,
/// which the receiver sees as a cut.
pub fn send(registry: &Registry, request: Request, out: &mut dyn Write) {
    let Request::Send {
        pool,
        id,
        from,
        start_at,
    } = request
    else {
        unreachable!("only send requests come here");
    };
    // The pool device held as a client holds it, until the stream ends: the send's own table
    // on it is no device's, so a `remove` would not see it otherwise.
    let device = match registry.resolve(&pool) {
        Ok(device) => device,
        Err(e) => return drop(answer(out, &Response::error(e))),
    };
    let _open = device.open(false);
    let prepared = Send::prepare(registry, &device.name(), id, from)
        .and_then(|p| p.check_start(start_at).map(|()| p));
    let prepared = match prepared {
        Ok(p) => p,
        Err(e) => return drop(answer(out, &Response::error(e))),
    };
    let ok = Response {
        data: Some(prepared.summary(start_at)),
        ..Response::text("")
    };
    if answer(out, &ok).is_err() {
        return;
    }
    let mut out = std::io::BufWriter::with_capacity(1 << 20, out);
    if let Err(e) = prepared.write(start_at, &mut out) {
        warn!("send of thin device {id} of pool '{pool}' stopped: {e}");
    }
}

/// `receive`: the first answer, the stream, the second answer. `shutdown` ends the writing
/// side after a refusal, so that the sender sees the answer before the connection closes.
pub fn receive(
    registry: &Registry,
    request: Request,
    input: &mut dyn Read,
    out: &mut dyn Write,
    shutdown: &dyn Fn(),
) {
    let Request::Receive {
        pool,
        id,
        base,
        resume,
    } = request
    else {
        unreachable!("only receive requests come here");
    };
    // Held until the stream ends, as in `send`.
    let device = match registry.resolve(&pool) {
        Ok(device) => device,
        Err(e) => return drop(answer(out, &Response::error(e))),
    };
    let _open = device.open(false);
    let pool = device.name();
    let req = receive::Request {
        pool,
        id,
        base,
        resume,
    };
    let first = match partial_of(registry, &req) {
        Ok(partial) => Response {
            data: Some(json!({ "partial": partial })),
            ..Response::text("")
        },
        Err(e) => return drop(answer(out, &Response::error(e))),
    };
    if answer(out, &first).is_err() {
        return;
    }
    let outcome = receive::receive(registry, &req, input);
    let last = match &outcome {
        Ok(summary) => Response {
            data: Some(summary.clone()),
            ..Response::text("")
        },
        Err(e) => {
            warn!(
                "receive into thin device {id} of pool '{}' refused: {e}",
                req.pool
            );
            Response::error(e)
        }
    };
    let _ = answer(out, &last);
    if outcome.is_err() {
        shutdown();
        // A moment's worth of what the sender still had in flight, so that closing does not
        // reset the connection before the answer is read; not the rest of a long stream.
        let deadline = Instant::now() + DRAIN;
        let mut sink = [0u8; 64 << 10];
        while Instant::now() < deadline && matches!(input.read(&mut sink), Ok(n) if n > 0) {}
    }
}

/// Serves `receive` requests on `address` (`udm daemon --replication tcp:…`).
pub fn listen(address: &MetricsAddress, registry: Arc<Registry>) -> std::io::Result<()> {
    let listener = TcpListener::bind(address.0.as_str())?;
    info!(
        "replication: receiving streams on tcp:{}",
        listener.local_addr()?
    );
    acceptor::spawn(
        "replication",
        MAX_CONNECTIONS,
        move || listener.accept().map(|(s, _)| s),
        move |s| serve_tcp(s, &registry),
        |mut s| {
            let why = format!(
                "the receiving daemon is busy: {MAX_CONNECTIONS} replication connections are \
                 open; try again later"
            );
            let _ = answer(&mut s, &Response::error(why));
        },
    )
}

fn serve_tcp(stream: TcpStream, registry: &Registry) {
    let _ = stream.set_nodelay(true);
    // A peer that says nothing, or stops in the middle, is let go (its receive kept for
    // resuming if it asked for that).
    let _ = stream.set_read_timeout(Some(IDLE));
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::with_capacity(1 << 20, Read::take(stream, MAX_REQUEST));
    let mut line = Vec::new();
    if reader.read_until(b'\n', &mut line).is_err() || !line.ends_with(b"\n") {
        return debug!("replication: a connection without a request line");
    }
    let request = match serde_json::from_slice::<Envelope>(&line) {
        Ok(e) if e.version != PROTOCOL_VERSION => Err(format!(
            "control protocol version {} not supported",
            e.version
        )),
        Ok(Envelope {
            request: request @ Request::Receive { .. },
            ..
        }) => Ok(request),
        Ok(_) => Err("this listener takes receive requests only".to_string()),
        Err(e) => Err(format!("malformed request: {e}")),
    };
    let request = match request {
        Ok(r) => r,
        Err(e) => return drop(answer(&mut out, &Response::error(e))),
    };
    reader.get_mut().set_limit(u64::MAX);
    let _ = reader
        .get_ref()
        .get_ref()
        .set_read_timeout(Some(DRAIN * 30));
    let closer = out.try_clone();
    let shutdown = move || {
        if let Ok(s) = &closer {
            let _ = s.shutdown(Shutdown::Write);
            let _ = s.set_read_timeout(Some(DRAIN));
        }
    };
    receive(registry, request, &mut reader, &mut out, &shutdown);
}
