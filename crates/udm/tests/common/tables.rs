//! Table lines the tests write again and again.

use std::path::Path;

/// `linear` over the first `size` bytes of `path`.
pub fn linear_table(path: &Path, size: u64) -> String {
    format!("0 {} linear {} 0", size / 512, path.display())
}

/// A `thin-pool` of 64 KiB blocks over `data_size` bytes of `data`, with its metadata on
/// `meta`; `rest` is the low-water mark and the features (`0`, `4 1 skip_block_zeroing`).
pub fn thin_pool_table(meta: &Path, data: &Path, data_size: u64, rest: &str) -> String {
    format!(
        "0 {} thin-pool {} {} 128 {rest}",
        data_size / 512,
        meta.display(),
        data.display()
    )
}
