//! `flakey <dev> <offset> <up secs> <down secs> [<#feature args> <feature args>…]`: passes
//! I/O for `up` seconds, then misbehaves for `down` seconds, over and over.
//!
//! While down, and with no features, every read and write fails with EIO. Features narrow or
//! change that: `drop_writes` (writes succeed but are thrown away), `error_writes`,
//! `error_reads`, `corrupt_bio_byte <Nth> <r|w> <value> <flags>` (sets byte N of each matching
//! request), `random_read_corrupt <p>` and `random_write_corrupt <p>` (corrupt one random byte
//! with probability p / 1e9).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use udm_block::{AlignedBuf, BlockError, OpenMode, Result};

use crate::args::Args;
use crate::filter::{Filter, Filtered, Lower, OpKind};
use crate::target::{Target, TargetContext, TargetError};

#[derive(Default)]
struct Features {
    drop_writes: bool,
    error_writes: bool,
    error_reads: bool,
    /// (byte number from 1, applies to writes, value)
    corrupt_byte: Option<(usize, bool, u8)>,
    random_read_corrupt: u64,
    random_write_corrupt: u64,
}

pub struct Flakey {
    lower: Lower,
    up: u64,
    down: u64,
    feature_words: Vec<String>,
    features: Features,
    started: Instant,
    random: AtomicU64,
}

const PROBABILITY_SCALE: u64 = 1_000_000_000;

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let lower = Lower::parse(args, ctx, OpenMode::ReadWrite)?;
    let up: u32 = args.number("up interval")?;
    let down: u32 = args.number("down interval")?;
    if up == 0 && down == 0 {
        return Err(args.error("total (up + down) interval is zero"));
    }
    let mut feature_words = Vec::new();
    let mut features = Features::default();
    if args.remaining() > 0 {
        let count: usize = args.number("#feature args")?;
        if count != args.remaining() {
            return Err(args.error(format!(
                "<#feature args> is {count} but {} follow",
                args.remaining()
            )));
        }
        let words = args.rest().to_vec();
        feature_words = words.iter().map(|w| w.to_string()).collect();
        features = parse_features(&mut Args::new("flakey", &words))?;
    }
    if !features.drop_writes
        && !features.error_writes
        && !features.error_reads
        && features.corrupt_byte.is_none()
        && features.random_read_corrupt == 0
        && features.random_write_corrupt == 0
    {
        features.error_reads = true;
        features.error_writes = true;
    }
    Ok(Arc::new(Filtered(Flakey {
        lower,
        up: up.into(),
        down: down.into(),
        feature_words,
        features,
        started: Instant::now(),
        random: AtomicU64::new(0x2545_F491_4F6C_DD1D),
    })))
}

fn parse_features(args: &mut Args) -> Result<Features, TargetError> {
    let mut f = Features::default();
    while args.remaining() > 0 {
        match args.word("feature")?.to_ascii_lowercase().as_str() {
            "drop_writes" if !f.drop_writes => f.drop_writes = true,
            "error_writes" if !f.error_writes => f.error_writes = true,
            "error_reads" if !f.error_reads => f.error_reads = true,
            "corrupt_bio_byte" if f.corrupt_byte.is_none() => {
                let nth = args.number_at_least("corrupt byte", 1)?;
                let writes = match args.word("direction")? {
                    "r" => false,
                    "w" => true,
                    other => {
                        return Err(args.error(format!(
                            "corrupt_bio_byte: direction must be r or w, got '{other}'"
                        )))
                    }
                };
                let value: u8 = args.number("corrupt value")?;
                args.number::<u64>("bio flags")?;
                f.corrupt_byte = Some((nth, writes, value));
            }
            which @ ("random_read_corrupt" | "random_write_corrupt") => {
                let p: u64 = args.number("probability")?;
                if p > PROBABILITY_SCALE {
                    return Err(args.error(format!("probability {p} exceeds {PROBABILITY_SCALE}")));
                }
                if which == "random_read_corrupt" {
                    f.random_read_corrupt = p;
                } else {
                    f.random_write_corrupt = p;
                }
            }
            word => return Err(args.error(format!("unknown or repeated feature '{word}'"))),
        }
    }
    if f.drop_writes && f.error_writes {
        return Err(args.error("drop_writes and error_writes are mutually exclusive"));
    }
    Ok(f)
}

impl Flakey {
    fn is_down(&self) -> bool {
        self.started.elapsed().as_secs() % (self.up + self.down) >= self.up
    }

    fn next_random(&self) -> u64 {
        let mut x = self.random.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.random.store(x, Ordering::Relaxed);
        x
    }

    fn corrupt(&self, buf: &mut [u8], writes: bool) -> bool {
        let mut changed = false;
        if let Some((nth, on_writes, value)) = self.features.corrupt_byte {
            if on_writes == writes && nth <= buf.len() {
                buf[nth - 1] = value;
                changed = true;
            }
        }
        let p = if writes {
            self.features.random_write_corrupt
        } else {
            self.features.random_read_corrupt
        };
        if p > 0 && !buf.is_empty() && self.next_random() % PROBABILITY_SCALE < p {
            let at = (self.next_random() % buf.len() as u64) as usize;
            buf[at] = buf[at].wrapping_add(1);
            changed = true;
        }
        changed
    }
}

impl Filter for Flakey {
    fn lower(&self) -> &Lower {
        &self.lower
    }

    fn admit(&self, kind: OpKind, _offset: u64, _len: u64) -> Result<bool> {
        if !self.is_down() {
            return Ok(true);
        }
        let f = &self.features;
        match kind {
            OpKind::Read if f.error_reads => Err(BlockError::Io("flakey: device is down".into())),
            OpKind::Write if f.error_writes => Err(BlockError::Io("flakey: device is down".into())),
            OpKind::Write if f.drop_writes => Ok(false),
            _ => Ok(true),
        }
    }

    fn after_read(&self, _offset: u64, buf: &mut [u8]) {
        if self.is_down() {
            self.corrupt(buf, false);
        }
    }

    fn replace_write(&self, _offset: u64, buf: &[u8]) -> Option<AlignedBuf> {
        if !self.is_down() {
            return None;
        }
        let mut copy = AlignedBuf::zeroed(buf.len());
        copy.copy_from_slice(buf);
        self.corrupt(&mut copy, true).then_some(copy)
    }
}

impl Target for Filtered<Flakey> {
    fn type_name(&self) -> &'static str {
        "flakey"
    }
    fn args(&self) -> String {
        let f = &self.0;
        let mut out = format!("{} {} {}", f.lower.args(), f.up, f.down);
        if !f.feature_words.is_empty() {
            out += &format!(" {} {}", f.feature_words.len(), f.feature_words.join(" "));
        }
        out
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
    fn up_passes_the_conformance_suite() {
        let resolver = memory_resolver(&[("a", 8 << 20)]);
        conformance::run_all(&build(&resolver, "0 16384 flakey a 0 3600 1").unwrap());
    }

    #[test]
    fn down_without_features_fails_reads_and_writes() {
        let resolver = memory_resolver(&[("a", 1 << 20)]);
        let table = build(&resolver, "0 2048 flakey a 0 0 5").unwrap();
        let mut buf = vec![0u8; 512];
        assert_eq!(table.read(0, &mut buf).unwrap_err().errno(), libc::EIO);
        assert_eq!(
            table
                .write(0, &buf, WriteFlags::default())
                .unwrap_err()
                .errno(),
            libc::EIO
        );
        table.flush().unwrap();
    }

    #[test]
    fn drop_writes_loses_data_silently_and_reads_pass() {
        let resolver = memory_resolver(&[("a", 1 << 20)]);
        let table = build(&resolver, "0 2048 flakey a 0 0 5 1 drop_writes").unwrap();
        table.write(0, &[9u8; 512], WriteFlags::default()).unwrap();
        let mut buf = vec![1u8; 512];
        table.read(0, &mut buf).unwrap();
        assert_eq!(buf, vec![0u8; 512]);
        assert_eq!(table.lines()[0], "0 2048 flakey a 0 0 5 1 drop_writes");
    }

    #[test]
    fn corrupt_bio_byte_changes_the_nth_byte_of_reads() {
        let resolver = memory_resolver(&[("a", 1 << 20)]);
        resolver
            .get("a")
            .write(0, &[7u8; 512], WriteFlags::default())
            .unwrap();
        let table = build(
            &resolver,
            "0 2048 flakey a 0 0 5 5 corrupt_bio_byte 32 r 1 0",
        )
        .unwrap();
        let mut buf = vec![0u8; 512];
        table.read(0, &mut buf).unwrap();
        assert_eq!(buf[31], 1);
        assert_eq!(buf[30], 7);
    }

    #[test]
    fn refuses_bad_features() {
        let resolver = memory_resolver(&[("a", 1 << 20)]);
        assert_refused(
            &resolver,
            &[
                ("0 8 flakey a 0 0 0", "total (up + down) interval is zero"),
                (
                    "0 8 flakey a 0 1 1 2 drop_writes",
                    "<#feature args> is 2 but 1 follow",
                ),
                (
                    "0 8 flakey a 0 1 1 1 bogus",
                    "unknown or repeated feature 'bogus'",
                ),
                (
                    "0 8 flakey a 0 1 1 2 drop_writes error_writes",
                    "mutually exclusive",
                ),
                (
                    "0 8 flakey a 0 1 1 5 corrupt_bio_byte 1 x 0 0",
                    "direction must be r or w",
                ),
            ],
        );
    }
}
