//! Power cuts under composed stacks: `linear` over `striped` over two `linear` devices, each
//! over a [`CrashDevice`] on one power supply. A top-level FLUSH must reach every stripe that
//! took writes, and a FUA write split across stripes must be durable on each, so whatever
//! the client had acknowledged as durable is on the disks after a cut at any write.

use std::collections::HashMap;
use std::sync::Arc;

use udm_block::{BlockDevice, WriteFlags};
use udm_testkit::{pattern, CrashDevice, PowerSwitch, Rng};

use crate::table::Table;
use crate::testing::{build, Devices};

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 64;
/// Each disk holds half of the striped device.
const DISK: u64 = BLOCKS * BLOCK / 2;

fn block_data(block: u64, version: u64) -> Vec<u8> {
    pattern(BLOCK as usize, block << 32 | version).to_vec()
}

/// The stack over `disks`: 4 KiB chunks, so writes of several blocks span both stripes, and
/// the lower `linear`s put a device between the stripes and the disks.
fn stack(disks: [Arc<CrashDevice>; 2]) -> Table {
    let resolver = Devices::default();
    let sectors = DISK / 512;
    for (name, disk) in ["a", "b"].into_iter().zip(disks) {
        resolver.add(name, disk, false);
        let lower = build(&resolver, &format!("0 {sectors} linear {name} 0")).unwrap();
        resolver.add(&format!("low-{name}"), Arc::new(lower), false);
    }
    let striped = build(
        &resolver,
        &format!("0 {} striped 2 8 low-a 0 low-b 0", 2 * sectors),
    )
    .unwrap();
    resolver.add("striped", Arc::new(striped), false);
    build(&resolver, &format!("0 {} linear striped 0", 2 * sectors)).unwrap()
}

/// For every block, the versions a read may return after a cut (0: never written, zeroes).
struct Model(HashMap<u64, Vec<u64>>);

impl Model {
    fn durable(&mut self, block: u64, version: u64) {
        self.0.get_mut(&block).unwrap().retain(|&v| v >= version);
    }
}

/// Writes runs of 1–4 blocks (one in five FUA), with a FLUSH after every six, until the
/// power goes; returns the model of what must survive and the durable writes it holds.
fn workload(top: &Table, random: &mut Rng) -> (Model, u64) {
    let mut model = Model((0..BLOCKS).map(|b| (b, vec![0])).collect());
    let (mut version, mut durable) = (0, 0);
    let mut unflushed = Vec::new();
    loop {
        for _ in 0..6 {
            let first = random.below(BLOCKS - 3);
            let count = 1 + random.below(4);
            let fua = random.below(5) == 0;
            version += 1;
            let mut data = Vec::new();
            for block in first..first + count {
                model.0.get_mut(&block).unwrap().push(version);
                data.extend(block_data(block, version));
            }
            if top.write(first * BLOCK, &data, WriteFlags { fua }).is_err() {
                return (model, durable);
            }
            for block in first..first + count {
                if fua {
                    model.durable(block, version);
                    durable += 1;
                } else {
                    unflushed.push((block, version));
                }
            }
        }
        if top.flush().is_err() {
            return (model, durable);
        }
        durable += unflushed.len() as u64;
        for (block, version) in unflushed.drain(..) {
            model.durable(block, version);
        }
    }
}

#[test]
fn acknowledged_writes_survive_a_power_cut_at_every_write_under_a_striped_stack() {
    let mut checked = 0;
    for cut_at in 1..=300 {
        let power = PowerSwitch::new(cut_at);
        let disks = [1, 2].map(|seed| {
            Arc::new(CrashDevice::on_power(
                DISK,
                power.clone(),
                cut_at * 2 + seed,
            ))
        });
        let (model, durable) = workload(&stack(disks.clone()), &mut Rng::new(cut_at));
        checked += durable;
        let after = stack(disks.map(|d| Arc::new(d.after_power_cut())));
        for (block, allowed) in &model.0 {
            let mut got = vec![0u8; BLOCK as usize];
            after.read(block * BLOCK, &mut got).unwrap();
            // Writes not yet durable may be torn: each sector on its own holds an allowed
            // version.
            for (i, sector) in got.chunks(512).enumerate() {
                let holds = |&v: &u64| {
                    let expected = if v == 0 {
                        vec![0u8; BLOCK as usize]
                    } else {
                        block_data(*block, v)
                    };
                    sector == &expected[i * 512..(i + 1) * 512]
                };
                assert!(
                    allowed.iter().any(holds),
                    "cut at write {cut_at}: sector {i} of block {block} holds none of the \
                     versions {allowed:?}"
                );
            }
        }
    }
    assert!(checked > 1000, "too few durable writes: {checked}");
    eprintln!("300 power cuts, {checked} durable block writes checked");
}
