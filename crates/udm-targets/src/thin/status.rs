//! Status lines, byte for byte as dm-thin's pool_status and thin_status print them (including
//! the pool line's trailing space, which `dmsetup status` shows too).

/// The pool's mode, as the kernel's pool modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Mode {
    Write = 0,
    /// Allocation failed: writes that need a new block queue (or fail with
    /// error_if_no_space) until the data device grows or blocks are freed.
    OutOfDataSpace = 1,
    /// No metadata changes: `read_only`, a metadata failure, or metadata space exhausted.
    ReadOnly = 2,
    /// The metadata cannot even be read: every I/O fails.
    Fail = 3,
}

impl Mode {
    pub fn from_u8(v: u8) -> Mode {
        match v {
            0 => Mode::Write,
            1 => Mode::OutOfDataSpace,
            2 => Mode::ReadOnly,
            _ => Mode::Fail,
        }
    }

    /// The word the status line uses.
    pub fn word(self) -> &'static str {
        match self {
            Mode::Write => "rw",
            Mode::OutOfDataSpace => "out_of_data_space",
            Mode::ReadOnly => "ro",
            Mode::Fail => "Fail",
        }
    }
}

/// Everything the pool's status line says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStatus {
    pub mode: Mode,
    pub transaction_id: u64,
    pub metadata_used: u64,
    pub metadata_total: u64,
    pub data_used: u64,
    pub data_total: u64,
    pub held_root: Option<u64>,
    pub discard_enabled: bool,
    pub discard_passdown: bool,
    pub error_if_no_space: bool,
    pub needs_check: bool,
    pub metadata_low_water: u64,
}

impl std::fmt::Display for PoolStatus {
    /// `<transaction id> <used>/<total metadata blocks> <used>/<total data blocks> <held root>
    /// ro|rw|out_of_data_space [no_]discard_passdown|ignore_discard
    /// error_if_no_space|queue_if_no_space needs_check|- <metadata low water mark> `
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.mode == Mode::Fail {
            return f.write_str("Fail");
        }
        write!(
            f,
            "{} {}/{} {}/{} ",
            self.transaction_id,
            self.metadata_used,
            self.metadata_total,
            self.data_used,
            self.data_total
        )?;
        match self.held_root {
            Some(root) => write!(f, "{root} ")?,
            None => f.write_str("- ")?,
        }
        write!(f, "{} ", self.mode.word())?;
        f.write_str(match (self.discard_enabled, self.discard_passdown) {
            (false, _) => "ignore_discard ",
            (true, true) => "discard_passdown ",
            (true, false) => "no_discard_passdown ",
        })?;
        f.write_str(if self.error_if_no_space {
            "error_if_no_space "
        } else {
            "queue_if_no_space "
        })?;
        f.write_str(if self.needs_check {
            "needs_check "
        } else {
            "- "
        })?;
        write!(f, "{} ", self.metadata_low_water)
    }
}

/// The metadata low water mark the kernel reports and raises an event at: a quarter of the
/// metadata device's blocks, at most 1024 (4 MiB).
pub fn metadata_low_water(metadata_blocks: u64) -> u64 {
    (metadata_blocks / 4).min(1024)
}

/// A thin device's status: `<mapped sectors> <highest mapped sector>|-`, or `Fail`.
pub fn thin_status(
    pool_failed: bool,
    mapped_blocks: u64,
    highest_block: Option<u64>,
    block_sectors: u64,
) -> String {
    if pool_failed {
        return "Fail".into();
    }
    match highest_block {
        Some(highest) => format!(
            "{} {}",
            mapped_blocks * block_sectors,
            (highest + 1) * block_sectors - 1
        ),
        None => format!("{} -", mapped_blocks * block_sectors),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status() -> PoolStatus {
        PoolStatus {
            mode: Mode::Write,
            transaction_id: 0,
            metadata_used: 280,
            metadata_total: 4096,
            data_used: 0,
            data_total: 16384,
            held_root: None,
            discard_enabled: true,
            discard_passdown: true,
            error_if_no_space: false,
            needs_check: false,
            metadata_low_water: metadata_low_water(4096),
        }
    }

    #[test]
    fn pool_lines_byte_for_byte() {
        assert_eq!(
            status().to_string(),
            "0 280/4096 0/16384 - rw discard_passdown queue_if_no_space - 1024 "
        );
        let other = PoolStatus {
            mode: Mode::OutOfDataSpace,
            transaction_id: 7,
            held_root: Some(123),
            discard_passdown: false,
            error_if_no_space: true,
            needs_check: true,
            metadata_low_water: metadata_low_water(1000),
            ..status()
        };
        assert_eq!(
            other.to_string(),
            "7 280/4096 0/16384 123 out_of_data_space no_discard_passdown error_if_no_space \
             needs_check 250 "
        );
        let ro = PoolStatus {
            mode: Mode::ReadOnly,
            discard_enabled: false,
            ..status()
        };
        assert!(ro.to_string().contains(" ro ignore_discard "), "{ro}");
        let failed = PoolStatus {
            mode: Mode::Fail,
            ..status()
        };
        assert_eq!(failed.to_string(), "Fail");
    }

    #[test]
    fn thin_lines() {
        assert_eq!(thin_status(false, 0, None, 128), "0 -");
        assert_eq!(thin_status(false, 3, Some(9), 128), "384 1279");
        assert_eq!(thin_status(true, 3, Some(9), 128), "Fail");
    }
}
