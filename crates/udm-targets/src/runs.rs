//! A request cut into runs: the pieces of its byte range that each lie in one chunk, block or
//! region (or one stretch of regions in the same state), each with where it sits in the
//! request's buffer. The snapshot targets cut by chunk, thin by block, the clone by runs of
//! hydrated or unhydrated regions: one loop serves them all.

use std::ops::Range;

/// One run: what `next` said of it, its offset on the device, its length, and its bytes in the
/// request's buffer.
pub type Run<K> = (K, u64, u64, Range<usize>);

/// The runs of `offset..offset + len`. `next(pos)` says what the run starting at `pos` is
/// and where it ends (past `pos`; an end beyond the request is cut to it).
pub fn runs<K>(
    offset: u64,
    len: u64,
    mut next: impl FnMut(u64) -> (K, u64),
) -> impl Iterator<Item = Run<K>> {
    let end = offset + len;
    let mut pos = offset;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let (key, stop) = next(pos);
        debug_assert!(stop > pos, "a run must end past where it starts");
        let stop = stop.min(end);
        let run = (
            key,
            pos,
            stop - pos,
            (pos - offset) as usize..(stop - offset) as usize,
        );
        pos = stop;
        Some(run)
    })
}

/// The runs of `offset..offset + len` that each lie in one `size`-byte unit, named by its
/// index.
pub fn by_unit(offset: u64, len: u64, size: u64) -> impl Iterator<Item = Run<u64>> {
    runs(offset, len, move |pos| {
        let unit = pos / size;
        (unit, (unit + 1) * size)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_cut_at_their_boundaries_and_the_request_ends() {
        let cut: Vec<_> = by_unit(4096 + 512, 3 * 4096, 4096).collect();
        assert_eq!(
            cut,
            [
                (1, 4608, 3584, 0..3584),
                (2, 8192, 4096, 3584..7680),
                (3, 12288, 4096, 7680..11776),
                (4, 16384, 512, 11776..12288),
            ]
        );
        assert_eq!(by_unit(0, 0, 4096).count(), 0);
    }

    #[test]
    fn a_run_goes_as_far_as_next_says() {
        // Units of 10 in two states: 0-29 one way, 30 on the other.
        let state = |pos: u64| pos >= 30;
        let cut: Vec<_> = runs(5, 40, |pos| {
            let mut stop = (pos / 10 + 1) * 10;
            while stop < 45 && state(stop) == state(pos) {
                stop += 10;
            }
            (state(pos), stop)
        })
        .collect();
        assert_eq!(cut, [(false, 5, 25, 0..25), (true, 30, 15, 25..40)]);
    }
}
