//! `dust <dev> <offset> <block size>`: reads of listed bad blocks fail, as on a disk with
//! unreadable sectors. Messages `addbadblock <n> [<write failures>]`, `removebadblock <n>`,
//! `queryblock <n>`, `countbadblocks`, `clearbadblocks`, `listbadblocks`, `enable`,
//! `disable`, `quiet`. A write to a bad block repairs it (after failing `write failures`
//! times), as a disk remaps a sector on write.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use udm_block::{BlockError, OpenMode, Result};

use crate::args::Args;
use crate::filter::{Filter, Filtered, Lower, OpKind};
use crate::target::{Target, TargetContext, TargetError};

pub struct Dust {
    lower: Lower,
    block_size: u64,
    /// Bad block number → writes that still fail before the block is repaired.
    bad_blocks: Mutex<BTreeMap<u64, u32>>,
    enabled: AtomicBool,
    quiet: AtomicBool,
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let lower = Lower::parse(args, ctx, OpenMode::ReadWrite)?;
    let block_size: u64 = args.number("block size")?;
    if block_size < 512 || !block_size.is_power_of_two() {
        return Err(args.error(format!(
            "invalid <block size> {block_size}: must be a power of two of at least 512 bytes"
        )));
    }
    Ok(Arc::new(Filtered(Dust {
        lower,
        block_size,
        bad_blocks: Mutex::new(BTreeMap::new()),
        enabled: AtomicBool::new(false),
        quiet: AtomicBool::new(false),
    })))
}

impl Dust {
    fn blocks(&self, offset: u64, len: u64) -> std::ops::RangeInclusive<u64> {
        offset / self.block_size..=(offset + len.max(1) - 1) / self.block_size
    }

    /// The block number a message names, in range.
    fn block(&self, args: &mut Args) -> Result<u64, TargetError> {
        let block: u64 = args.number("block")?;
        let blocks = self.lower.len / self.block_size;
        if block >= blocks {
            return Err(TargetError::new(format!(
                "dust: block {block} out of range (device has {blocks} blocks)"
            )));
        }
        Ok(block)
    }
}

impl Filter for Dust {
    fn lower(&self) -> &Lower {
        &self.lower
    }

    fn admit(&self, kind: OpKind, offset: u64, len: u64) -> Result<bool> {
        if !self.enabled.load(Ordering::Relaxed) || kind == OpKind::Flush {
            return Ok(true);
        }
        let mut bad = self.bad_blocks.lock();
        let hit: Vec<u64> = bad
            .range(self.blocks(offset, len))
            .map(|(b, _)| *b)
            .collect();
        if hit.is_empty() {
            return Ok(true);
        }
        if kind == OpKind::Read {
            return Err(BlockError::Io(format!("dust: bad block {}", hit[0])));
        }
        for block in hit {
            let failures = bad.get_mut(&block).expect("present");
            if *failures > 0 {
                *failures -= 1;
                return Err(BlockError::Io(format!(
                    "dust: write to bad block {block} failed"
                )));
            }
            bad.remove(&block);
        }
        Ok(true)
    }
}

impl Target for Filtered<Dust> {
    fn type_name(&self) -> &'static str {
        "dust"
    }

    fn args(&self) -> String {
        format!("{} {}", self.0.lower.args(), self.0.block_size)
    }

    fn status(&self) -> String {
        let d = &self.0;
        let mode = if d.enabled.load(Ordering::Relaxed) {
            "fail_read_on_bad_block"
        } else {
            "bypass"
        };
        let verbosity = if d.quiet.load(Ordering::Relaxed) {
            "quiet"
        } else {
            "verbose"
        };
        format!("{} {mode} {verbosity}", d.lower.reference)
    }

    fn settings_messages(&self) -> Vec<String> {
        let d = &self.0;
        let mut messages = vec![if d.enabled.load(Ordering::Relaxed) {
            "enable"
        } else {
            "disable"
        }
        .to_string()];
        if d.quiet.load(Ordering::Relaxed) {
            messages.push("quiet".into());
        }
        for (block, failures) in d.bad_blocks.lock().iter() {
            messages.push(format!("addbadblock {block} {failures}"));
        }
        messages
    }

    fn message(&self, words: &[&str]) -> Result<String, TargetError> {
        let d = &self.0;
        let mut bad = d.bad_blocks.lock();
        let lowered: Vec<String> = words.iter().map(|w| w.to_ascii_lowercase()).collect();
        let lowered: Vec<&str> = lowered.iter().map(String::as_str).collect();
        match lowered.as_slice() {
            ["enable"] => {
                d.enabled.store(true, Ordering::Relaxed);
                Ok("enabling read failures on bad sectors".into())
            }
            ["disable"] => {
                d.enabled.store(false, Ordering::Relaxed);
                Ok("disabling read failures on bad sectors".into())
            }
            ["quiet"] => {
                let was = d.quiet.fetch_xor(true, Ordering::Relaxed);
                Ok(if was { "verbose mode" } else { "quiet mode" }.into())
            }
            ["countbadblocks"] => Ok(format!("countbadblocks: {} badblock(s) found", bad.len())),
            ["clearbadblocks"] => {
                let had = !bad.is_empty();
                bad.clear();
                Ok(if had {
                    "dust_clear_badblocks: badblocks cleared"
                } else {
                    "dust_clear_badblocks: no badblocks found"
                }
                .into())
            }
            ["listbadblocks"] => Ok(bad
                .keys()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join("\n")),
            ["addbadblock", _] | ["addbadblock", _, _] => {
                let mut args = Args::new("dust", &words[1..]);
                let block = d.block(&mut args)?;
                let failures = args.optional_number("write failures")?.unwrap_or(0);
                if bad.insert(block, failures).is_some() {
                    return Err(TargetError::new(format!(
                        "dust_add_block: block {block} already in badblocklist"
                    )));
                }
                Ok(format!("dust_add_block: badblock added at block {block}"))
            }
            ["removebadblock", _] => {
                let block = d.block(&mut Args::new("dust", &words[1..]))?;
                match bad.remove(&block) {
                    Some(_) => Ok(format!(
                        "dust_remove_block: badblock removed at block {block}"
                    )),
                    None => Err(TargetError::new(format!(
                        "dust_remove_block: block {block} not found in badblocklist"
                    ))),
                }
            }
            ["queryblock", _] => {
                let block = d.block(&mut Args::new("dust", &words[1..]))?;
                let found = if bad.contains_key(&block) {
                    "found"
                } else {
                    "not found"
                };
                Ok(format!(
                    "dust_query_block: block {block} {found} in badblocklist"
                ))
            }
            _ => Err(TargetError::new(format!(
                "dust: unknown message or wrong argument count: '{}'",
                words.join(" ")
            ))),
        }
    }

    fn references(&self) -> Vec<String> {
        vec![self.0.lower.reference.clone()]
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::{assert_refused, build, memory_resolver};
    use udm_block::{BlockDevice, WriteFlags};

    use udm_testkit::conformance;

    #[test]
    fn passes_the_conformance_suite_when_enabled_without_bad_blocks() {
        let resolver = memory_resolver(&[("a", 8 << 20)]);
        let table = build(&resolver, "0 16384 dust a 0 4096").unwrap();
        table.target_at(0).unwrap().message(&["enable"]).unwrap();
        conformance::run_all(&table);
    }

    #[test]
    fn bad_blocks_fail_reads_until_written() {
        let resolver = memory_resolver(&[("a", 1 << 20)]);
        let table = build(&resolver, "0 2048 dust a 0 4096").unwrap();
        let dust = table.target_at(0).unwrap().clone();
        assert_eq!(
            dust.message(&["addbadblock", "2"]).unwrap(),
            "dust_add_block: badblock added at block 2"
        );
        assert!(dust.message(&["addbadblock", "2"]).is_err());
        assert!(dust
            .message(&["addbadblock", "256"])
            .unwrap_err()
            .to_string()
            .contains("out of range"));
        let mut buf = vec![0u8; 4096];
        // Bypass mode until enabled.
        table.read(8192, &mut buf).unwrap();
        dust.message(&["enable"]).unwrap();
        assert_eq!(dust.status(), "a fail_read_on_bad_block verbose");
        assert_eq!(table.read(8192, &mut buf).unwrap_err().errno(), libc::EIO);
        table.read(4096, &mut buf).unwrap();
        assert_eq!(
            dust.message(&["countbadblocks"]).unwrap(),
            "countbadblocks: 1 badblock(s) found"
        );
        table.write(8192, &buf, WriteFlags::default()).unwrap();
        table.read(8192, &mut buf).unwrap();
        assert_eq!(
            dust.message(&["queryblock", "2"]).unwrap(),
            "dust_query_block: block 2 not found in badblocklist"
        );
        assert!(dust.message(&["frob"]).is_err());
    }

    #[test]
    fn refuses_bad_block_sizes() {
        let resolver = memory_resolver(&[("a", 1 << 20)]);
        assert_refused(
            &resolver,
            &[("0 8 dust a 0 1000", "invalid <block size> 1000")],
        );
    }
}
