//! The clone target against in-memory devices that count and fail on command: the rig here,
//! the tests by job beside it.

mod args;
mod commit;
mod hydration;
mod io;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_block::{AlignedBuf, BlockDevice, WriteFlags, ZeroFlags};

use udm_testkit::{conformance, pattern};

use crate::table::Table;
use crate::testing::{build_counting_events, Devices, Switchable};

const MIB: u64 = 1 << 20;

struct Rig {
    table: Table,
    meta: Arc<Switchable>,
    dest: Arc<Switchable>,
    source: Arc<Switchable>,
    events: Arc<AtomicU64>,
}

impl Rig {
    fn clone_target(&self) -> &Arc<dyn crate::Target> {
        self.table.target_at(0).unwrap()
    }
    fn status(&self) -> String {
        self.clone_target().status()
    }
    fn message(&self, words: &str) {
        let words: Vec<&str> = words.split_whitespace().collect();
        self.clone_target().message(&words).unwrap();
    }
    fn transaction(&self) -> u64 {
        self.clone_target().status_details().unwrap()["metadata_transaction"]
            .as_u64()
            .unwrap()
    }
    fn wait_complete(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.events.load(Ordering::SeqCst) == 0 {
            assert!(
                Instant::now() < deadline,
                "hydration did not finish: {}",
                self.status()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A clone of `size` bytes whose source holds a pattern in its first half and a hole after.
fn rig_with(size: u64, table_args: &str, setup_devices: impl FnOnce(&Rig)) -> Rig {
    let meta = Arc::new(Switchable::new(MIB));
    let dest = Arc::new(Switchable::new(size));
    let source = Arc::new(Switchable::new(size));
    source
        .inner
        .write(0, &pattern((size / 2) as usize, 1), WriteFlags::default())
        .unwrap();
    let devices = named(&[
        ("meta", meta.clone()),
        ("dest", dest.clone()),
        ("source", source.clone()),
    ]);
    let pre = Rig {
        table: Table::build("test", "0 8 zero", &Devices::default(), Arc::new(|| {})).unwrap(),
        meta: meta.clone(),
        dest: dest.clone(),
        source: source.clone(),
        events: Arc::new(AtomicU64::new(0)),
    };
    setup_devices(&pre);
    let text = format!("0 {} clone meta dest source {table_args}", size / 512);
    let (table, events) = build_counting_events(&devices, &text).unwrap();
    Rig {
        table,
        meta,
        dest,
        source,
        events,
    }
}

/// Devices by name, the way a test holds on to them.
fn named(devices: &[(&str, Arc<Switchable>)]) -> Devices {
    let all = Devices::default();
    for (name, device) in devices {
        all.add(name, device.clone(), false);
    }
    all
}

/// `Switchable`s of the given sizes, by name.
fn switchables(devices: &[(&str, u64)]) -> Devices {
    let all = Devices::default();
    for (name, size) in devices {
        all.add(name, Arc::new(Switchable::new(*size)), false);
    }
    all
}

fn rig(size: u64, table_args: &str) -> Rig {
    rig_with(size, table_args, |_| {})
}

fn read(dev: &dyn BlockDevice, offset: u64, len: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(len);
    dev.read(offset, &mut buf).unwrap();
    buf
}
