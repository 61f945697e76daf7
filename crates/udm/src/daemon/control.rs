//! The daemon side of the control socket: decode a request, run the verb, answer.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use log::{debug, warn};
use serde_json::json;
use udm_block::{BlockDevice, MapOp, SECTOR_SIZE};
use udm_targets::TARGET_TYPES;

use super::device::Device;
use super::registry::Registry;
use crate::control::{Envelope, Request, Response, PROTOCOL_VERSION};

/// Longest request line accepted; a table of thousands of lines still fits.
const MAX_REQUEST: u64 = 4 << 20;
/// How often a `wait` looks whether its client is still there.
const WAIT_SLICE: Duration = Duration::from_millis(200);

/// Where devices are also served as files, and how the FUSE requests come.
pub struct FuseFiles {
    pub dir: PathBuf,
    pub transport: String,
}

/// How the daemon exports devices, for `udm info`.
#[derive(Default)]
pub struct Exports {
    pub fuse: Option<FuseFiles>,
    /// The engine serving NBD connections, when the daemon listens for them.
    pub nbd_engine: Option<String>,
}

pub fn listen(path: &Path, registry: Arc<Registry>, exports: Exports) -> std::io::Result<()> {
    let exports = Arc::new(exports);
    udm_nbd::remove_stale_socket(path)?;
    let listener = UnixListener::bind(path)?;
    std::thread::Builder::new()
        .name("control-accept".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(s) => {
                        let registry = registry.clone();
                        let exports = exports.clone();
                        let _ = std::thread::Builder::new()
                            .name("control".into())
                            .spawn(move || serve(s, &registry, &exports));
                    }
                    Err(e) => warn!("control: accept failed: {e}"),
                }
            }
        })?;
    Ok(())
}

fn serve(stream: UnixStream, registry: &Registry, exports: &Exports) {
    let Ok(writer) = stream.try_clone() else {
        return;
    };
    let mut writer = writer;
    let mut reader = BufReader::new(std::io::Read::take(stream, MAX_REQUEST));
    // Bytes, not a String: a line of invalid UTF-8 is a malformed request to answer, not a
    // read error that would end the connection.
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) if !line.ends_with(b"\n") => {
                let _ = reply(
                    &mut writer,
                    &Response::error("request too long or not terminated"),
                );
                return;
            }
            Ok(_) => {}
            Err(e) => return debug!("control: read failed: {e}"),
        }
        let response = match serde_json::from_slice::<Envelope>(&line) {
            Ok(envelope) if envelope.version != PROTOCOL_VERSION => Response::error(format!(
                "control protocol version {} not supported (this daemon speaks {PROTOCOL_VERSION})",
                envelope.version
            )),
            Ok(envelope) => execute(registry, envelope.request, exports, &writer),
            Err(e) => Response::error(format!("malformed request: {e}")),
        };
        if reply(&mut writer, &response).is_err() {
            return;
        }
        reader.get_mut().set_limit(MAX_REQUEST);
    }
}

fn reply(writer: &mut UnixStream, response: &Response) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(response).expect("serialisable");
    bytes.push(b'\n');
    writer.write_all(&bytes)
}

/// Whether the client has closed its end of the connection (a `udm wait` that was killed or
/// interrupted). Only a hang-up counts: a client may well send its next request early.
fn hung_up(client: &UnixStream) -> bool {
    let mut fd = libc::pollfd {
        fd: client.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one pollfd that we own, and a zero timeout: this never blocks.
    let ready = unsafe { libc::poll(&mut fd, 1, 0) };
    ready > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// `client` is the requester's connection, watched by requests that block.
fn execute(
    registry: &Registry,
    request: Request,
    exports: &Exports,
    client: &UnixStream,
) -> Response {
    let result: Result<Response, Box<dyn std::error::Error>> = (|| {
        Ok(match request {
            Request::Create {
                name,
                table,
                read_only,
            } => {
                registry.create(&name, &table, read_only)?;
                Response::text("")
            }
            Request::Load { name, table, force } => {
                registry.load(&name, &table, force)?;
                Response::text("")
            }
            Request::Clear { name } => {
                registry.clear(&name)?;
                Response::text("")
            }
            Request::Suspend { name } => {
                registry.suspend(&name)?;
                Response::text("")
            }
            Request::Resume { name } => {
                registry.resume(&name)?;
                Response::text("")
            }
            Request::Message {
                name,
                sector,
                words,
            } => {
                let words: Vec<&str> = words.iter().map(String::as_str).collect();
                Response::text(registry.message(&name, sector, &words)?)
            }
            Request::Status { name } => status(registry, &name)?,
            Request::Table { name } => {
                Response::text(registry.get(&name)?.live().lines().join("\n"))
            }
            Request::Info { name } => info(registry, &name, exports)?,
            Request::Ls { tree } => ls(registry, tree),
            Request::Wait { name, event_nr } => {
                let device = registry.get(&name)?;
                let after = event_nr.unwrap_or_else(|| device.events().current());
                // In slices, so that the wait ends (and its thread with it) when the device
                // goes away or nobody waits for the answer any more.
                loop {
                    let now = device.events().wait(after, WAIT_SLICE);
                    if now > after {
                        break Response::text(now.to_string());
                    }
                    registry.get(&name)?;
                    if hung_up(client) {
                        return Err("the client went away".into());
                    }
                }
            }
            Request::Remove { name, force } => {
                registry.remove(&name, force)?;
                Response::text("")
            }
            Request::Finalize { name } => Response::text(registry.finalize(&name)?),
            Request::Targets => Response::text(
                TARGET_TYPES
                    .iter()
                    .map(|(name, _)| format!("{name:<16}v1.0.0"))
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
        })
    })();
    result.unwrap_or_else(Response::error)
}

fn status(registry: &Registry, name: &str) -> Result<Response, Box<dyn std::error::Error>> {
    let device = registry.get(name)?;
    let table = device.live();
    let lines = table.status_lines();
    let targets: Vec<_> = table
        .segments()
        .iter()
        .map(|s| {
            json!({
                "start": s.start / SECTOR_SIZE,
                "length": s.len / SECTOR_SIZE,
                "type": s.target.type_name(),
                "status": s.target.status(),
                "details": s.target.status_details(),
            })
        })
        .collect();
    Ok(Response {
        data: Some(json!({ "name": name, "targets": targets })),
        ..Response::text(lines.join("\n"))
    })
}

fn info(
    registry: &Registry,
    name: &str,
    exports: &Exports,
) -> Result<Response, Box<dyn std::error::Error>> {
    let device = registry.get(name)?;
    let state = if device.is_suspended() {
        "SUSPENDED"
    } else {
        "ACTIVE"
    };
    let tables = if device.inactive().is_some() {
        "LIVE & INACTIVE"
    } else {
        "LIVE"
    };
    let opens = device.open_count() + registry.holders(name).len();
    let access = if device.read_only() {
        " (READ-ONLY)"
    } else {
        ""
    };
    let fuse_files = exports.fuse.as_ref();
    let fuse_file = fuse_files.map(|f| f.dir.join(name));
    let mut text = format!(
        "Name:              {name}\nState:             {state}{access}\n\
         Tables present:    {tables}\nOpen count:        {opens}\n\
         Event number:      {}\nSize:              {} sectors",
        device.events().current(),
        device.size() / SECTOR_SIZE
    );
    if let (Some(file), Some(files)) = (&fuse_file, fuse_files) {
        text += &format!("\nFUSE file:         {}", file.display());
        text += &format!("\nFUSE transport:    {}", files.transport);
    }
    let data_path = data_path(&device);
    if let Some(engine) = &exports.nbd_engine {
        text += &format!("\nNBD engine:        {engine}");
    }
    text += &format!("\nData path:         {data_path}");
    Ok(Response {
        data: Some(json!({
            "name": name, "state": state, "read_only": device.read_only(),
            "inactive_table": device.inactive().is_some(), "open_count": opens,
            "event_nr": device.events().current(), "sectors": device.size() / SECTOR_SIZE,
            "fuse_file": fuse_file, "fuse_transport": fuse_files.map(|f| &f.transport),
            "nbd_engine": exports.nbd_engine, "data_path": data_path,
        })),
        ..Response::text(text)
    })
}

/// Whether the io_uring engines (NBD's event loops, FUSE over io_uring) can send this
/// device's I/O straight to files, or its targets take requests themselves on worker threads.
fn data_path(device: &Device) -> &'static str {
    let probe = device.size().min(4096);
    if probe == 0 {
        return "empty";
    }
    let reads = device.map(MapOp::Read, 0, probe).is_some();
    let writes = device.read_only() || device.map(MapOp::Write { fua: false }, 0, probe).is_some();
    match (reads, writes) {
        (true, true) => "remapped onto files (io_uring)",
        (true, false) => "reads remapped onto files (io_uring), writes through the targets",
        (false, _) => "through the targets (worker threads)",
    }
}

fn ls(registry: &Registry, tree: bool) -> Response {
    let devices = registry.all();
    if devices.is_empty() {
        return Response::text("No devices found");
    }
    if !tree {
        let lines: Vec<_> = devices
            .iter()
            .map(|d| format!("{}\t({} sectors)", d.name(), d.size() / SECTOR_SIZE))
            .collect();
        return Response::text(lines.join("\n"));
    }
    // Like `dmsetup ls --tree`: each device not used by another is a root, with what it is
    // built on below it, devices and backing files alike.
    let mut out = Vec::new();
    for device in devices
        .iter()
        .filter(|d| registry.holders(d.name()).is_empty())
    {
        out.push(device.name().to_string());
        tree_below(registry, device.name(), "", &mut out);
    }
    Response::text(out.join("\n"))
}

fn tree_below(registry: &Registry, name: &str, indent: &str, out: &mut Vec<String>) {
    let Ok(device) = registry.get(name) else {
        return;
    };
    let refs = device.live().references();
    for (i, r) in refs.iter().enumerate() {
        let last = i + 1 == refs.len();
        out.push(format!("{indent}{}{r}", if last { " └─" } else { " ├─" }));
        let deeper = format!("{indent}{}", if last { "   " } else { " │ " });
        tree_below(registry, r, &deeper, out);
    }
}
