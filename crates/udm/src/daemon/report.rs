//! What `status`, `table`, `info`, `deps` and `ls` print, for one device or for all of them,
//! in dmsetup's formats (docs/control-protocol.md says where udm differs).

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{json, Value};
use udm_block::{BlockDevice, MapOp, Mapping, Place, SECTOR_SIZE};
use udm_targets::Table;

use super::device::Device;
use super::registry::{Registry, RegistryError};
use crate::control::Response;

type Result<T, E = RegistryError> = std::result::Result<T, E>;

const NO_DEVICES: &str = "No devices found";

/// Where devices are also served as files, and how the FUSE requests come.
pub struct FuseFiles {
    pub dir: PathBuf,
    pub transport: String,
    pub on_io_uring: bool,
}

/// How the daemon exports devices, for `udm info`.
#[derive(Default)]
pub struct Exports {
    pub fuse: Option<FuseFiles>,
    /// The engine serving NBD connections, when the daemon listens for them.
    pub nbd_engine: Option<String>,
    pub nbd_on_io_uring: bool,
}

impl Exports {
    /// Whether some export runs an io_uring engine, which is what executes remapped I/O.
    fn on_io_uring(&self) -> bool {
        self.nbd_on_io_uring || self.fuse.as_ref().is_some_and(|f| f.on_io_uring)
    }
}

/// The devices a listing covers: the one named, or every device in name order.
fn devices(registry: &Registry, name: Option<&str>) -> Result<Vec<Arc<Device>>> {
    match name {
        Some(name) => Ok(vec![registry.resolve(name)?]),
        None => Ok(registry.all()),
    }
}

/// Lines of one device for a listing of all: dmsetup prefixes each with `NAME: `.
fn prefixed(name: &str, lines: Vec<String>, all: bool) -> Vec<String> {
    if !all {
        return lines;
    }
    lines.into_iter().map(|l| format!("{name}: {l}")).collect()
}

/// The lines of `table` (as `line` renders each segment) whose target is of type `target`,
/// or all of them.
fn segment_lines(table: &Table, lines: Vec<String>, target: Option<&str>) -> Vec<String> {
    table
        .segments()
        .iter()
        .zip(lines)
        .filter(|(s, _)| target.is_none_or(|t| s.target.type_name() == t))
        .map(|(_, line)| line)
        .collect()
}

pub fn status(registry: &Registry, name: Option<&str>, target: Option<&str>) -> Result<Response> {
    let devices = devices(registry, name)?;
    let mut out = Vec::new();
    let mut data = Vec::new();
    for device in &devices {
        let table = device.live();
        let lines = segment_lines(&table, table.status_lines(), target);
        let targets: Vec<Value> = table
            .segments()
            .iter()
            .filter(|s| target.is_none_or(|t| s.target.type_name() == t))
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
        out.extend(prefixed(&device.name(), lines, name.is_none()));
        data.push(json!({ "name": device.name(), "targets": targets }));
    }
    Ok(listing(name, &devices, out, data))
}

pub fn table(
    registry: &Registry,
    name: Option<&str>,
    target: Option<&str>,
    inactive: bool,
) -> Result<Response> {
    let devices = devices(registry, name)?;
    let mut out = Vec::new();
    for device in &devices {
        let table = if inactive {
            device.inactive()
        } else {
            Some(device.live())
        };
        let Some(table) = table else { continue };
        let lines = segment_lines(&table, table.lines(), target);
        out.extend(prefixed(&device.name(), lines, name.is_none()));
    }
    Ok(listing(name, &devices, out, Vec::new()))
}

/// One device's or every device's lines (`devices` were listed); `data` is the one device's
/// object, or the list.
fn listing(
    name: Option<&str>,
    devices: &[Arc<Device>],
    out: Vec<String>,
    mut data: Vec<Value>,
) -> Response {
    if devices.is_empty() {
        return Response {
            data: Some(json!([])),
            ..Response::text(NO_DEVICES)
        };
    }
    let data = match (name, data.len()) {
        (_, 0) => None,
        (Some(_), _) => data.pop(),
        (None, _) => Some(Value::Array(data)),
    };
    Response {
        data,
        ..Response::text(out.join("\n"))
    }
}

pub fn info(registry: &Registry, name: Option<&str>, exports: &Exports) -> Result<Response> {
    let devices = devices(registry, name)?;
    if devices.is_empty() {
        return Ok(Response {
            data: Some(json!([])),
            ..Response::text(NO_DEVICES)
        });
    }
    let (texts, data): (Vec<String>, Vec<Value>) = devices
        .iter()
        .map(|device| device_info(registry, device, exports))
        .unzip();
    Ok(Response {
        data: Some(match name {
            Some(_) => data.into_iter().next().expect("one device"),
            None => Value::Array(data),
        }),
        // dmsetup separates devices with a blank line.
        ..Response::text(texts.join("\n\n"))
    })
}

fn device_info(registry: &Registry, device: &Device, exports: &Exports) -> (String, Value) {
    let name = device.name();
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
    let opens = device.open_count() + registry.holders(&name).len();
    let mut flags = String::new();
    if device.read_only() {
        flags += " (READ-ONLY)";
    }
    if device.deferred_remove() {
        flags += " (DEFERRED REMOVE)";
    }
    let segments = device.live().segments().len();
    let mut text = format!(
        "Name:              {name}\nState:             {state}{flags}\n\
         Tables present:    {tables}\nOpen count:        {opens}\n\
         Event number:      {}\nNumber of targets: {segments}\nSize:              {} sectors",
        device.events().current(),
        device.size() / SECTOR_SIZE
    );
    if let Some(uuid) = device.uuid() {
        text += &format!("\nUUID: {uuid}");
    }
    let fuse_file = exports.fuse.as_ref().map(|f| f.dir.join(&name));
    if let (Some(file), Some(files)) = (&fuse_file, &exports.fuse) {
        text += &format!("\nFUSE file:         {}", file.display());
        text += &format!("\nFUSE transport:    {}", files.transport);
    }
    if let Some(engine) = &exports.nbd_engine {
        text += &format!("\nNBD engine:        {engine}");
    }
    let data_path = data_path(device, exports.on_io_uring());
    text += &format!("\nData path:         {data_path}");
    let data = json!({
        "name": name, "uuid": device.uuid(), "state": state, "read_only": device.read_only(),
        "inactive_table": device.inactive().is_some(), "open_count": opens,
        "event_nr": device.events().current(), "sectors": device.size() / SECTOR_SIZE,
        "segments": segments, "deferred_remove": device.deferred_remove(),
        "fuse_file": fuse_file, "fuse_transport": exports.fuse.as_ref().map(|f| &f.transport),
        "nbd_engine": exports.nbd_engine, "data_path": data_path,
    });
    (text, data)
}

/// Whether the io_uring engines (NBD's event loops, FUSE over io_uring) can send this
/// device's I/O straight to where it lives (files, remote exports), or its targets take
/// requests themselves on worker threads; without such an engine (io_uring disabled) every
/// request takes the second way, and the line says so rather than promise what does not run.
/// (The probe's mappings are dropped unused, so they count in no statistics.)
fn data_path(device: &Device, engine: bool) -> String {
    let probe = device.size().min(4096);
    if probe == 0 {
        return "empty".into();
    }
    let reads = device.map(MapOp::Read, 0, probe);
    let writes = device.read_only() || device.map(MapOp::Write { fua: false }, 0, probe).is_some();
    let Some(reads) = reads else {
        return "through the targets (worker threads)".into();
    };
    if !engine {
        return "through the targets (worker threads): no export runs on io_uring to remap onto"
            .into();
    }
    let onto = destinations(&reads).map_or(String::new(), |d| format!(" onto {d}"));
    if writes {
        format!("remapped{onto} (io_uring)")
    } else {
        format!("reads remapped{onto} (io_uring), writes through the targets")
    }
}

/// What the probe's mapping reaches, in words: a `linear` over a remote export is sent by
/// the NBD client from the event loop, not through files. None where it reaches neither
/// (`zero`, or a thin device's unprovisioned first block): that says nothing of the rest.
fn destinations(mapping: &Mapping) -> Option<&'static str> {
    let files = (mapping.pieces.iter()).any(|p| matches!(p.place, Place::File { .. }));
    match (files, !mapping.transfers.is_empty()) {
        (true, false) => Some("files"),
        (false, true) => Some("remote exports"),
        (true, true) => Some("files and remote exports"),
        (false, false) => None,
    }
}

/// dmsetup's `deps`: `N dependencies\t: (a) (b)`, naming what the live table uses — files,
/// remote exports and other devices — where dmsetup prints device numbers.
pub fn deps(registry: &Registry, name: Option<&str>) -> Result<Response> {
    let devices = devices(registry, name)?;
    let mut out = Vec::new();
    let mut data = Vec::new();
    for device in &devices {
        let refs = device.live().references();
        let list: String = refs.iter().map(|r| format!(" ({r})")).collect();
        let line = format!("{} dependencies\t:{list}", refs.len());
        out.extend(prefixed(&device.name(), vec![line], name.is_none()));
        data.push(json!({ "name": device.name(), "dependencies": refs }));
    }
    Ok(listing(name, &devices, out, data))
}

/// `target`: only devices whose live table has a target of that type (dmsetup ls --target).
pub fn ls(registry: &Registry, tree: bool, target: Option<&str>) -> Response {
    let mut devices = registry.all();
    if let Some(target) = target {
        devices.retain(|d| {
            let table = d.live();
            let mut segments = table.segments().iter();
            segments.any(|s| s.target.type_name() == target)
        });
    }
    if devices.is_empty() {
        return Response {
            data: Some(json!([])),
            ..Response::text(NO_DEVICES)
        };
    }
    let data: Vec<Value> = devices
        .iter()
        .map(|d| {
            json!({
                "name": d.name(), "uuid": d.uuid(), "sectors": d.size() / SECTOR_SIZE,
                "suspended": d.is_suspended(), "read_only": d.read_only(),
                "open_count": d.open_count() + registry.holders(&d.name()).len(),
                "dependencies": registry.dependencies(d),
            })
        })
        .collect();
    let text = if tree {
        tree_text(registry, &devices)
    } else {
        devices
            .iter()
            .map(|d| {
                let uuid = d.uuid().map(|u| format!("\t{u}")).unwrap_or_default();
                format!("{}\t({} sectors){uuid}", d.name(), d.size() / SECTOR_SIZE)
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    Response {
        data: Some(Value::Array(data)),
        ..Response::text(text)
    }
}

/// Like `dmsetup ls --tree`: each device not used by another is a root, with what it is
/// built on below it, devices and backing files alike.
fn tree_text(registry: &Registry, devices: &[Arc<Device>]) -> String {
    let mut out = Vec::new();
    for device in devices
        .iter()
        .filter(|d| registry.holders(&d.name()).is_empty())
    {
        out.push(device.name());
        tree_below(registry, &device.name(), "", &mut out);
    }
    out.join("\n")
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
