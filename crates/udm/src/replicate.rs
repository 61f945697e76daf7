//! `udm send` and `udm receive`: carry a replication stream between the local daemon and
//! stdout, stdin or a remote daemon's `--replication` listener. The daemons read and apply it;
//! this side checks it on the way (so a stream that ends early is reported here too) and
//! draws the progress bar.

use std::io::{BufRead, BufReader, BufWriter, IsTerminal, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use udm::control::{Envelope, Request, Response, PROTOCOL_VERSION};
use udm::replication::stream::{Event, Header, Kind, Layout, Reader, StreamError};

use crate::cli::SendArgs;
use crate::progress::Meter;

fn request_line(request: Request) -> Vec<u8> {
    let mut line = serde_json::to_vec(&Envelope {
        version: PROTOCOL_VERSION,
        request,
    })
    .expect("serialisable");
    line.push(b'\n');
    line
}

/// The next answer line: its data, or its error.
fn answer(from: &mut dyn BufRead, who: &str) -> anyhow::Result<Value> {
    let mut line = String::new();
    from.read_line(&mut line)
        .with_context(|| format!("reading the answer of {who}"))?;
    if line.is_empty() {
        bail!("{who} closed the connection without answering");
    }
    let response: Response = serde_json::from_str(&line).context("malformed answer")?;
    match response {
        Response { ok: true, data, .. } => Ok(data.unwrap_or_default()),
        Response {
            error: Some(error), ..
        } => bail!("{error}"),
        _ => bail!("{who} refused"),
    }
}

fn connect_local(control: &Path) -> anyhow::Result<UnixStream> {
    UnixStream::connect(control).with_context(|| {
        format!(
            "cannot reach the udm daemon at {} (is `udm daemon` running?)",
            control.display()
        )
    })
}

/// Passes on exactly the bytes read through it; remembers why writing failed (the receiver
/// stopped taking the stream).
struct Tee<R, W> {
    input: R,
    out: W,
    failed: Option<std::io::Error>,
}

impl<R: Read, W: Write> Read for Tee<R, W> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.input.read(buf)?;
        if let Err(e) = self.out.write_all(&buf[..n]) {
            let said = std::io::Error::new(e.kind(), "the receiver stopped taking the stream");
            self.failed = Some(e);
            return Err(said);
        }
        Ok(n)
    }
}

/// Why a stream was not passed on whole.
enum Broken {
    /// What came in is not a whole, valid stream.
    Input(StreamError),
    /// The receiver stopped taking it.
    Output,
}

/// Passes a whole stream from `input` to `out`, checking it (`first` and `layout`: what the
/// receiver has, for a resumed stream); the header.
fn forward(
    input: impl Read,
    out: impl Write,
    first: u64,
    layout: Layout,
    asked_progress: bool,
) -> Result<(Header, Meter), Broken> {
    let mut tee = Tee {
        input: BufReader::with_capacity(1 << 20, input),
        out: BufWriter::with_capacity(1 << 20, out),
        failed: None,
    };
    let broken = |tee: &Tee<_, _>, e: StreamError| match tee.failed {
        Some(_) => Broken::Output,
        None => Broken::Input(e),
    };
    let header = match Header::read(&mut tee) {
        Ok(h) => h,
        Err(e) => return Err(broken(&tee, e)),
    };
    let mut meter = Meter::new(header.changed_bytes, asked_progress);
    let mut reader = Reader::new(&mut tee, header.clone(), first, layout);
    loop {
        match reader.next_event() {
            Ok(Event::Record { kind, place, .. }) => {
                if kind != Kind::Unmapped {
                    meter.add(place.len as u64);
                }
            }
            Ok(Event::End) => break,
            Err(e) => {
                drop(reader);
                return Err(broken(&tee, e));
            }
        }
    }
    drop(reader);
    tee.out.flush().map_err(|_| Broken::Output)?;
    Ok((header, meter))
}

/// `tcp:HOST:PORT/POOL[/ID]`
struct Destination {
    address: String,
    pool: String,
    id: Option<u32>,
}

impl Destination {
    fn parse(text: &str) -> anyhow::Result<Destination> {
        let bad = || anyhow::anyhow!("--to '{text}': expected tcp:HOST:PORT/POOL[/ID]");
        let rest = text.strip_prefix("tcp:").ok_or_else(bad)?;
        let (address, path) = rest.split_once('/').ok_or_else(bad)?;
        let (pool, id) = match path.split_once('/') {
            Some((pool, id)) => (pool, Some(id.parse().map_err(|_| bad())?)),
            None => (path, None),
        };
        if pool.is_empty() || !address.contains(':') {
            return Err(bad());
        }
        Ok(Destination {
            address: address.to_string(),
            pool: pool.to_string(),
            id,
        })
    }
}

pub fn send(control: &Path, args: SendArgs) -> anyhow::Result<()> {
    let destination = args.to.as_deref().map(Destination::parse).transpose()?;
    if destination.is_none() && std::io::stdout().is_terminal() {
        bail!(
            "the stream is binary: send it somewhere (> FILE, | udm receive POOL ID, | ssh HOST \
             udm receive POOL ID) or use --to tcp:HOST:PORT/POOL"
        );
    }
    let mut start_at = args.resume_at.unwrap_or(0);
    // The receiver first: it says where a receive it kept stopped.
    let remote = match &destination {
        Some(d) => Some(connect_receiver(d, &args, &mut start_at)?),
        None => None,
    };
    let local = connect_local(control)?;
    (&local).write_all(&request_line(Request::Send {
        pool: args.pool.clone(),
        id: args.id,
        from: args.from,
        start_at,
    }))?;
    let mut input = BufReader::with_capacity(1 << 20, local);
    let sent = answer(&mut input, "the udm daemon")?;
    let layout = Layout(sent["layout_before"].as_u64().unwrap_or(0) as u32);
    let forwarded = match &remote {
        Some((stream, _)) => forward(&mut input, stream, start_at, layout, args.progress),
        None => forward(
            &mut input,
            std::io::stdout().lock(),
            start_at,
            layout,
            args.progress,
        ),
    };
    let received = match remote {
        Some((stream, last)) => {
            let _ = stream.shutdown(Shutdown::Write);
            Some(last.join().expect("the answer's reader does not panic"))
        }
        None => None,
    };
    let meter = match forwarded {
        Ok((_, meter)) => meter,
        Err(Broken::Input(e)) => {
            bail!("the stream from the local daemon is broken: {e} (see its log)")
        }
        Err(Broken::Output) => match received {
            Some(Err(e)) => return Err(e.context("the receiver refused the stream")),
            _ => bail!("the receiver stopped taking the stream"),
        },
    };
    let received = received
        .transpose()
        .context("the receiver refused the stream")?;
    let summary = Summary {
        sent,
        start_at,
        meter,
        received,
    };
    summary.print(&args, destination.is_some())
}

/// A receiver's answer still to come, read by its own thread.
type LastAnswer = std::thread::JoinHandle<anyhow::Result<Value>>;

/// Asks the listener at `d` to receive; when it kept a stopped receive of this very stream
/// and `--resume` leaves it the choice, `start_at` becomes the record it stopped at.
fn connect_receiver(
    d: &Destination,
    args: &SendArgs,
    start_at: &mut u64,
) -> anyhow::Result<(TcpStream, LastAnswer)> {
    let stream = TcpStream::connect(&d.address)
        .with_context(|| format!("cannot reach the replication listener at {}", d.address))?;
    let _ = stream.set_nodelay(true);
    let mut answers = BufReader::new(stream.try_clone()?);
    (&stream).write_all(&request_line(Request::Receive {
        pool: d.pool.clone(),
        id: d.id.unwrap_or(args.id),
        base: None,
        resume: args.resume,
    }))?;
    let first = answer(&mut answers, &d.address)?;
    let kept = &first["partial"];
    if args.resume
        && args.resume_at.is_none()
        && kept["to"] == args.id
        && kept["from"] == json!(args.from)
    {
        *start_at = kept["next_record"].as_u64().unwrap_or(0);
    }
    // The last answer is read as soon as it comes: a receiver that refuses the stream half
    // way answers and closes, and the answer must not be lost to the reset that the bytes
    // still in flight then cause.
    let last = std::thread::spawn(move || answer(&mut answers, "the receiver"));
    Ok((stream, last))
}

/// What a finished send reports.
struct Summary {
    /// The local daemon's answer.
    sent: Value,
    start_at: u64,
    meter: Meter,
    /// The receiver's last answer, when sending to a listener.
    received: Option<Value>,
}

impl Summary {
    /// Prints the summary (JSON with `--json`) on stdout, or on stderr when stdout is the
    /// stream.
    fn print(self, args: &SendArgs, to_listener: bool) -> anyhow::Result<()> {
        let Summary {
            sent,
            start_at,
            meter,
            received,
        } = self;
        let seconds = meter.seconds();
        let rate = meter.rate();
        meter.finish();
        let line = if args.json {
            serde_json::to_string_pretty(&json!({
                "sent": sent, "started_at_record": start_at, "seconds": seconds,
                "rate_bytes_per_second": rate, "received": received,
            }))?
        } else {
            format!(
                "sent thin device {} of pool '{}'{}: {} records, {} changed bytes in \
                 {seconds:.1} s",
                args.id,
                args.pool,
                args.from.map_or(String::new(), |f| format!(" from {f}")),
                sent["records"],
                sent["changed_bytes"],
            )
        };
        match to_listener {
            true => outln!("{line}"),
            false => eprintln!("{line}"),
        }
        Ok(())
    }
}

pub struct ReceiveOptions {
    pub base: Option<u32>,
    pub resume: bool,
    pub json: bool,
    pub progress: bool,
}

pub fn receive(control: &Path, pool: &str, id: u32, options: ReceiveOptions) -> anyhow::Result<()> {
    if std::io::stdin().is_terminal() {
        bail!("the stream comes on stdin: udm send … | udm receive {pool} {id} (or < FILE)");
    }
    let local = connect_local(control)?;
    (&local).write_all(&request_line(Request::Receive {
        pool: pool.to_string(),
        id,
        base: options.base,
        resume: options.resume,
    }))?;
    let mut answers = BufReader::new(local.try_clone()?);
    let first = answer(&mut answers, "the udm daemon")?;
    let kept = &first["partial"];
    let (have, layout) = match options.resume && !kept.is_null() {
        true => (
            kept["next_record"].as_u64().unwrap_or(0),
            Layout(kept["layout"].as_u64().unwrap_or(0) as u32),
        ),
        false => (0, Layout::default()),
    };
    let forwarded = forward(
        std::io::stdin().lock(),
        &local,
        have,
        layout,
        options.progress,
    );
    let _ = local.shutdown(Shutdown::Write);
    let last = answer(&mut answers, "the udm daemon");
    match (forwarded, last) {
        (Ok((_, meter)), Ok(mut done)) => {
            let rate = meter.rate();
            meter.finish();
            if options.json {
                done["rate_bytes_per_second"] = json!(rate);
                outln!("{}", serde_json::to_string_pretty(&done)?);
            } else {
                outln!(
                    "received thin device {id} of pool '{pool}': {} records, {} bytes of data \
                     in {:.1} s",
                    done["records"],
                    done["data_bytes"],
                    done["seconds"].as_f64().unwrap_or(0.0)
                );
            }
            Ok(())
        }
        // The daemon read the same bytes: its answer says what it did about them.
        (_, Err(refused)) => Err(refused),
        (Err(Broken::Input(e)), Ok(_)) => bail!("the stream is refused: {e}"),
        (Err(Broken::Output), Ok(_)) => bail!("the udm daemon stopped taking the stream"),
    }
}
