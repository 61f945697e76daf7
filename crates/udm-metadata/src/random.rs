//! Random ids for the formats that name themselves: a log's id, a pool's uuid.

use std::time::{SystemTime, UNIX_EPOCH};

/// `N` bytes from the kernel's random source; if it has none to give, the current time in
/// nanoseconds (ids need to differ, not to be secret).
pub(crate) fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    // SAFETY: getrandom fills the buffer we own, of N bytes.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), N, 0) };
    if usize::try_from(n) != Ok(N) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos());
        for (byte, from_time) in bytes.iter_mut().zip(now.to_le_bytes().iter().cycle()) {
            *byte = *from_time;
        }
    }
    bytes
}
