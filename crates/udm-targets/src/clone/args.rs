//! The clone's table line: devices, region size, feature arguments and core arguments, checked
//! as the kernel's constructor checks them.

use std::sync::Arc;

use udm_block::{BlockDevice, OpenMode, SECTOR_SIZE};
use udm_metadata::{CloneGeometry, CloneMetadata};

use super::hydration::Settings;
use crate::args::Args;
use crate::target::{TargetContext, TargetError};

const MIN_REGION_SECTORS: u64 = 8;
const MAX_REGION_SECTORS: u64 = 2_097_152;

/// Everything a table line says, with its devices opened and its metadata read.
pub(super) struct CloneArgs {
    /// The line's arguments as given, printed back by `udm table`.
    pub line: Vec<String>,
    /// Metadata, destination and source, as the line names them.
    pub references: Vec<String>,
    pub meta: CloneMetadata,
    pub dest: Arc<dyn BlockDevice>,
    pub source: Arc<dyn BlockDevice>,
    /// Region size in bytes.
    pub region: u64,
    pub discard_passdown: bool,
    pub hydrate_on_read: bool,
    pub settings: Settings,
}

pub(super) fn parse(args: &mut Args, ctx: &TargetContext) -> Result<CloneArgs, TargetError> {
    let line: Vec<String> = args.tokens().iter().map(|t| t.to_string()).collect();
    if args.remaining() < 4 {
        return Err(args.error(format!(
            "expected at least 4 arguments (<metadata dev> <destination dev> <source dev> \
             <region size>), got {}",
            args.remaining()
        )));
    }
    let (meta_ref, meta_dev) = args.device(ctx, "metadata dev", OpenMode::Exclusive)?;
    let (dest_ref, dest) = args.device(ctx, "destination dev", OpenMode::Exclusive)?;
    let (source_ref, source) = args.device(ctx, "source dev", OpenMode::ReadOnly)?;
    let region_sectors: u64 = args.number("region size")?;
    if !region_sectors.is_power_of_two()
        || !(MIN_REGION_SECTORS..=MAX_REGION_SECTORS).contains(&region_sectors)
    {
        return Err(args.error(format!(
            "invalid region size {region_sectors}: must be a power of two from \
             {MIN_REGION_SECTORS} to {MAX_REGION_SECTORS} sectors"
        )));
    }
    for (reference, dev) in [(&dest_ref, &dest), (&source_ref, &source)] {
        ctx.require(reference, &**dev, 0, ctx.len)
            .map_err(|e| args.error(e))?;
    }
    let mut settings = Settings::default();
    let (discard_passdown, hydrate_on_read) = features(args, &mut settings)?;
    core_args(args, &mut settings)?;
    let geometry = CloneGeometry {
        region_sectors,
        target_sectors: ctx.len / SECTOR_SIZE,
    };
    let meta = CloneMetadata::open(meta_dev.clone(), geometry)
        .map_err(|e| args.error(format!("metadata device '{meta_ref}': {e}")))?;
    let meta_bytes = geometry.required_blocks() * udm_metadata::BLOCK_SIZE as u64;
    ctx.require(&meta_ref, &*meta_dev, 0, meta_bytes)
        .map_err(|e| args.error(e))?;
    Ok(CloneArgs {
        line,
        references: vec![meta_ref, dest_ref, source_ref],
        meta,
        dest,
        source,
        region: region_sectors * SECTOR_SIZE,
        discard_passdown,
        hydrate_on_read,
        settings,
    })
}

/// `[<#features> [no_hydration] [no_discard_passdown] [hydrate_on_read]]`; returns
/// (discard passdown, hydrate on read).
fn features(args: &mut Args, settings: &mut Settings) -> Result<(bool, bool), TargetError> {
    let (mut discard_passdown, mut hydrate_on_read) = (true, false);
    if args.remaining() == 0 {
        return Ok((discard_passdown, hydrate_on_read));
    }
    let count: usize = args.number("#features")?;
    if count > 3 || count > args.remaining() {
        return Err(args.error(format!("invalid number of feature arguments {count}")));
    }
    for _ in 0..count {
        match args.word("feature")?.to_ascii_lowercase().as_str() {
            "no_hydration" => settings.hydration_enabled = false,
            "no_discard_passdown" => discard_passdown = false,
            "hydrate_on_read" => hydrate_on_read = true,
            other => return Err(args.error(format!("unsupported feature argument '{other}'"))),
        }
    }
    Ok((discard_passdown, hydrate_on_read))
}

/// `[<#core args> [hydration_threshold <n>] [hydration_batch_size <n>]
/// [max_hydration_rate <KiB/s>]]`.
fn core_args(args: &mut Args, settings: &mut Settings) -> Result<(), TargetError> {
    if args.remaining() == 0 {
        return Ok(());
    }
    let count: usize = args.number("#core args")?;
    if !count.is_multiple_of(2) || count > 6 || count != args.remaining() {
        return Err(args.error(format!(
            "invalid number of core arguments {count} ({} follow): it counts the words of \
             up to 3 key/value pairs, e.g. 4 for 'hydration_threshold 64 hydration_batch_size 4'",
            args.remaining()
        )));
    }
    for _ in 0..count / 2 {
        let key = args.word("core arg")?.to_ascii_lowercase();
        match key.as_str() {
            "hydration_threshold" => settings.threshold = args.number(&key)?,
            "hydration_batch_size" => settings.batch_size = args.number_at_least(&key, 1)?,
            "max_hydration_rate" => settings.max_rate_kib = args.number(&key)?,
            other => return Err(args.error(format!("invalid core argument '{other}'"))),
        }
    }
    Ok(())
}
