//! The table lines of `thin-pool` and `thin`: parsed with the kernel's rules (dm-thin.c's
//! pool_ctr, parse_pool_features and thin_ctr), every token checked before any device is
//! opened, and printed back in the kernel's canonical form.

use crate::args::Args;
use crate::target::TargetError;

/// Data block size limits, in sectors: 64 KiB to 1 GiB, in multiples of 64 KiB.
pub const MIN_BLOCK_SECTORS: u64 = 128;
pub const MAX_BLOCK_SECTORS: u64 = 2_097_152;
/// Thin device ids have 24 bits.
pub const MAX_DEV_ID: u64 = (1 << 24) - 1;

/// The pool's features, with the kernel's defaults (zeroing, discards passed down, queue
/// when out of space, read-write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    pub zero_new_blocks: bool,
    pub discard_enabled: bool,
    pub discard_passdown: bool,
    pub read_only: bool,
    pub error_if_no_space: bool,
}

impl Default for Features {
    fn default() -> Self {
        Features {
            zero_new_blocks: true,
            discard_enabled: true,
            discard_passdown: true,
            read_only: false,
            error_if_no_space: false,
        }
    }
}

impl Features {
    /// The words that turn these features on, in the kernel's order (emit_flags).
    pub fn words(&self) -> Vec<&'static str> {
        let mut words = Vec::new();
        if !self.zero_new_blocks {
            words.push("skip_block_zeroing");
        }
        if !self.discard_enabled {
            words.push("ignore_discard");
        }
        if !self.discard_passdown {
            words.push("no_discard_passdown");
        }
        if self.read_only {
            words.push("read_only");
        }
        if self.error_if_no_space {
            words.push("error_if_no_space");
        }
        words
    }
}

/// `thin-pool <metadata dev> <data dev> <data block size> <low water mark> [<#features>
/// <feature>*]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolLine {
    pub metadata: String,
    pub data: String,
    pub block_sectors: u64,
    /// Free data blocks at or below which the pool raises an event (once per resume).
    pub low_water_blocks: u64,
    pub features: Features,
}

impl PoolLine {
    pub fn parse(args: &mut Args) -> Result<PoolLine, TargetError> {
        if args.remaining() < 4 {
            return Err(args.error(format!(
                "expected at least 4 arguments (<metadata dev> <data dev> <data block size> \
                 <low water mark> [<#features> <feature>*]), got {}",
                args.remaining()
            )));
        }
        let metadata = args.word("metadata dev")?.to_string();
        let data = args.word("data dev")?.to_string();
        if metadata == data {
            return Err(args.error(format!(
                "<metadata dev> and <data dev> are the same device '{data}'"
            )));
        }
        let block = args.word("data block size")?;
        let block_sectors = block
            .parse::<u64>()
            .ok()
            .filter(|s| {
                (MIN_BLOCK_SECTORS..=MAX_BLOCK_SECTORS).contains(s) && s % MIN_BLOCK_SECTORS == 0
            })
            .ok_or_else(|| {
                args.error(format!(
                    "invalid <data block size> '{block}': a multiple of {MIN_BLOCK_SECTORS} \
                     sectors (64 KiB) from {MIN_BLOCK_SECTORS} to {MAX_BLOCK_SECTORS} (1 GiB)"
                ))
            })?;
        let low_water_blocks = args.number("low water mark")?;
        let mut features = Features::default();
        if args.remaining() > 0 {
            let count: usize = args.number("#features")?;
            if count > args.remaining() {
                return Err(args.error(format!(
                    "<#features> is {count} but {} feature(s) follow",
                    args.remaining()
                )));
            }
            for _ in 0..count {
                let word = args.word("feature")?;
                match word.to_ascii_lowercase().as_str() {
                    "skip_block_zeroing" => features.zero_new_blocks = false,
                    "ignore_discard" => features.discard_enabled = false,
                    "no_discard_passdown" => features.discard_passdown = false,
                    "read_only" => features.read_only = true,
                    "error_if_no_space" => features.error_if_no_space = true,
                    _ => {
                        return Err(args.error(format!(
                            "unrecognised pool feature '{word}' (known: skip_block_zeroing, \
                             ignore_discard, no_discard_passdown, read_only, error_if_no_space)"
                        )))
                    }
                }
            }
        }
        Ok(PoolLine {
            metadata,
            data,
            block_sectors,
            low_water_blocks,
            features,
        })
    }

    /// The arguments as the kernel prints the table (without its trailing space).
    pub fn print(&self) -> String {
        let words = self.features.words();
        let mut line = format!(
            "{} {} {} {} {}",
            self.metadata,
            self.data,
            self.block_sectors,
            self.low_water_blocks,
            words.len()
        );
        for word in words {
            line.push(' ');
            line.push_str(word);
        }
        line
    }
}

/// `thin <pool dev> <dev id> [<external origin dev>]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinLine {
    pub pool: String,
    pub id: u32,
    pub origin: Option<String>,
}

impl ThinLine {
    pub fn parse(args: &mut Args) -> Result<ThinLine, TargetError> {
        if !(2..=3).contains(&args.remaining()) {
            return Err(args.error(format!(
                "expected 2 or 3 arguments (<pool dev> <dev id> [<external origin dev>]), got {}",
                args.remaining()
            )));
        }
        let pool = args.word("pool dev")?.to_string();
        let id = parse_dev_id(args.word("dev id")?).map_err(|e| args.error(e))?;
        let origin = match args.remaining() {
            0 => None,
            _ => Some(args.word("external origin dev")?.to_string()),
        };
        if origin.as_deref() == Some(pool.as_str()) {
            return Err(args.error(format!(
                "<external origin dev> '{pool}' is the pool device itself"
            )));
        }
        Ok(ThinLine { pool, id, origin })
    }

    pub fn print(&self) -> String {
        match &self.origin {
            Some(origin) => format!("{} {} {origin}", self.pool, self.id),
            None => format!("{} {}", self.pool, self.id),
        }
    }
}

/// A thin device id as tables and messages give it: decimal, 0 to 2^24 - 1.
pub fn parse_dev_id(word: &str) -> Result<u32, String> {
    word.parse::<u64>()
        .ok()
        .filter(|id| *id <= MAX_DEV_ID)
        .map(|id| id as u32)
        .ok_or_else(|| format!("invalid device id '{word}' (0 to {MAX_DEV_ID})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `line` read as the arguments of `target` by `parse`, every word used.
    fn parsed<T>(
        target: &str,
        line: &str,
        parse: fn(&mut Args) -> Result<T, TargetError>,
    ) -> Result<T, String> {
        let tokens: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        let mut args = Args::new(target, &tokens);
        let parsed = parse(&mut args).map_err(|e| e.to_string())?;
        args.finish().map_err(|e| e.to_string())?;
        Ok(parsed)
    }

    fn pool(line: &str) -> Result<PoolLine, String> {
        parsed("thin-pool", line, PoolLine::parse)
    }

    fn thin(line: &str) -> Result<ThinLine, String> {
        parsed("thin", line, ThinLine::parse)
    }

    #[test]
    fn pool_lines_print_as_the_kernel_prints_them() {
        let plain = pool("/m /d 128 32").unwrap();
        assert_eq!(plain.features, Features::default());
        assert_eq!(plain.print(), "/m /d 128 32 0");
        let all = pool(
            "/m /d 2097152 0 5 ERROR_IF_NO_SPACE read_only no_discard_passdown ignore_discard \
             skip_block_zeroing",
        )
        .unwrap();
        assert_eq!(
            all.print(),
            "/m /d 2097152 0 5 skip_block_zeroing ignore_discard no_discard_passdown read_only \
             error_if_no_space"
        );
        assert_eq!(pool(&all.print()).unwrap(), all);
        assert_eq!(pool("/m /d 256 1 0").unwrap().print(), "/m /d 256 1 0");
    }

    #[test]
    fn bad_pool_lines_name_the_token() {
        let cases = [
            ("/m /d 128", "expected at least 4 arguments"),
            ("/m /m 128 0", "the same device '/m'"),
            ("/m /d 64 0", "invalid <data block size> '64'"),
            ("/m /d 192 0", "invalid <data block size> '192'"),
            ("/m /d 4194304 0", "invalid <data block size> '4194304'"),
            ("/m /d x 0", "invalid <data block size> 'x'"),
            ("/m /d 128 -1", "invalid <low water mark> '-1'"),
            ("/m /d 128 0 x", "invalid <#features> 'x'"),
            (
                "/m /d 128 0 2 read_only",
                "<#features> is 2 but 1 feature(s) follow",
            ),
            (
                "/m /d 128 0 1 frobnicate",
                "unrecognised pool feature 'frobnicate'",
            ),
            ("/m /d 128 0 0 read_only", "unexpected argument 'read_only'"),
        ];
        for (line, expected) in cases {
            let err = pool(line).unwrap_err();
            assert!(err.starts_with("thin-pool: "), "{line}: {err}");
            assert!(err.contains(expected), "{line}: {err}");
        }
    }

    #[test]
    fn thin_lines() {
        assert_eq!(
            thin("pool 7").unwrap(),
            ThinLine {
                pool: "pool".into(),
                id: 7,
                origin: None
            }
        );
        let with_origin = thin("pool 16777215 /golden.img").unwrap();
        assert_eq!(with_origin.print(), "pool 16777215 /golden.img");
        let cases = [
            ("pool", "expected 2 or 3 arguments"),
            ("pool 1 /o extra", "expected 2 or 3 arguments"),
            ("pool 16777216", "invalid device id '16777216'"),
            ("pool -1", "invalid device id '-1'"),
            ("pool x", "invalid device id 'x'"),
            ("pool 1 pool", "is the pool device itself"),
        ];
        for (line, expected) in cases {
            let err = thin(line).unwrap_err();
            assert!(err.contains(expected), "{line}: {err}");
        }
    }
}
