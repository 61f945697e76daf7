//! `linear <dev> <offset>`: the range maps onto `dev` from `offset` on.

use std::sync::Arc;

use udm_block::OpenMode;

use crate::args::Args;
use crate::filter::{Filter, Filtered, Lower};
use crate::target::{Target, TargetContext, TargetError};

/// The filter that changes nothing.
pub struct Linear(Lower);

impl Filter for Linear {
    fn lower(&self) -> &Lower {
        &self.0
    }
    fn remaps(&self) -> bool {
        true
    }
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    Ok(Arc::new(Filtered(Linear(Lower::parse(
        args,
        ctx,
        OpenMode::ReadWrite,
    )?))))
}

impl Target for Filtered<Linear> {
    fn type_name(&self) -> &'static str {
        "linear"
    }
    fn args(&self) -> String {
        self.0 .0.args()
    }
    fn references(&self) -> Vec<String> {
        vec![self.0 .0.reference.clone()]
    }
    fn flush_key(&self) -> Option<String> {
        // By identity only: two handles that know none may be two NBD connections to one
        // export, and a server without multi-conn syncs on a flush only its connection's
        // writes. A name is no key either: each handle is flushed on its own.
        let dev = &self.0 .0.dev;
        Some(
            dev.identity()
                .unwrap_or_else(|| format!("handle:{:p}", Arc::as_ptr(dev))),
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::{assert_refused, build, memory_resolver};
    use udm_block::BlockDevice;

    use udm_testkit::{conformance, pattern};

    #[test]
    fn passes_the_conformance_suite_at_an_offset() {
        let resolver = memory_resolver(&[("a", 16 << 20)]);
        let table = build(&resolver, "0 16384 linear a 8192").unwrap();
        conformance::run_all(&table);
        // The data landed 4 MiB into the lower device.
        let lower = resolver.get("a");
        let mut buf = vec![0u8; 512];
        lower.read(4 << 20, &mut buf).unwrap();
        assert_eq!(&buf[..], &pattern(512, 1)[..]);
    }

    #[test]
    fn refuses_what_does_not_fit_and_names_the_token() {
        let resolver = memory_resolver(&[("a", 1 << 20)]);
        assert_refused(
            &resolver,
            &[
                ("0 2048 linear a 1", "has 2048 sectors"),
                ("0 8 linear a x1", "invalid <offset> 'x1'"),
                ("0 8 linear a", "missing argument <offset>"),
                ("0 8 linear a 0 extra", "unexpected argument 'extra'"),
                ("0 8 linear nosuch 0", "'nosuch'"),
            ],
        );
    }
}
