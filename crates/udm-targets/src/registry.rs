//! The target types udm knows, and building one from a table line. Each target's file has its
//! constructor; this list is the only place that names them all.

use std::sync::Arc;

use crate::args::Args;
use crate::target::{Target, TargetContext, TargetError};

type Constructor = fn(&mut Args, &TargetContext) -> Result<Arc<dyn Target>, TargetError>;

/// Every target type udm knows, as `dmsetup targets` lists them.
pub const TARGET_TYPES: &[(&str, Constructor)] = &[
    ("linear", crate::linear::construct),
    ("striped", crate::striped::construct),
    ("zero", crate::zero::construct),
    ("error", crate::error_target::construct),
    ("delay", crate::delay::construct),
    ("flakey", crate::flakey::construct),
    ("dust", crate::dust::construct),
    ("clone", crate::clone::construct),
    ("log-writes", crate::log_writes::construct),
    ("snapshot-origin", crate::snapshot::construct_origin),
    ("snapshot", crate::snapshot::construct_snapshot),
    ("snapshot-merge", crate::snapshot::construct_merge),
    ("thin-pool", crate::thin::construct_pool),
    ("thin", crate::thin::construct_thin),
    ("multipath", crate::multipath::construct),
];

/// Builds the target of one table line.
pub fn construct(
    type_name: &str,
    args: &[String],
    ctx: &TargetContext,
) -> Result<Arc<dyn Target>, TargetError> {
    let (_, constructor) = TARGET_TYPES
        .iter()
        .find(|(name, _)| *name == type_name)
        .ok_or_else(|| {
            let known: Vec<_> = TARGET_TYPES.iter().map(|(name, _)| *name).collect();
            TargetError::new(format!(
                "unknown target type '{type_name}' (known: {})",
                known.join(", ")
            ))
        })?;
    let mut args = Args::new(type_name, args);
    let target = constructor(&mut args, ctx)?;
    args.finish()?;
    Ok(target)
}
