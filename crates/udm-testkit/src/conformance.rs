//! The conformance suite: the behaviour every backend and target must show, in functions any
//! crate's tests can call on its own device.
//!
//! Devices that store data run [`run_all`]; targets that by design do not (zero, error) run
//! the checks for their behaviour ([`reads_zero_and_drops_writes`], [`fails_every_request`]).

use udm_block::{AlignedBuf, BlockDevice, WriteFlags, ZeroFlags, EXTENT_ZERO};

use crate::pattern;

fn read_back(dev: &dyn BlockDevice, offset: u64, len: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(len);
    dev.read(offset, &mut buf).expect("read back");
    buf
}

/// Runs every check for a device that stores what is written. Needs at least 4 MiB.
pub fn run_all(dev: &dyn BlockDevice) {
    assert!(
        dev.size() >= 4 << 20,
        "the conformance suite needs a device of at least 4 MiB"
    );
    writes_read_back(dev);
    fua_and_flush_succeed(dev);
    write_zeroes_reads_zero(dev);
    discard_keeps_neighbours(dev);
    block_status_covers_and_tells_truth(dev);
    concurrent_writers_do_not_mix(dev);
    edges_of_the_device_work(dev);
}

pub fn writes_read_back(dev: &dyn BlockDevice) {
    for (i, (offset, len)) in [(0u64, 512usize), (4096, 4096), (65536 + 512, 131072 - 1024)]
        .into_iter()
        .enumerate()
    {
        let data = pattern(len, i as u64 + 1);
        dev.write(offset, &data, WriteFlags::default()).unwrap();
        assert!(
            read_back(dev, offset, len)[..] == data[..],
            "data at {offset}+{len}"
        );
    }
}

pub fn fua_and_flush_succeed(dev: &dyn BlockDevice) {
    let data = pattern(8192, 42);
    dev.write(1 << 20, &data, WriteFlags { fua: true }).unwrap();
    dev.flush().unwrap();
    assert!(read_back(dev, 1 << 20, 8192)[..] == data[..]);
}

pub fn write_zeroes_reads_zero(dev: &dyn BlockDevice) {
    let base = 2 << 20;
    dev.write(base, &pattern(65536, 7), WriteFlags::default())
        .unwrap();
    for (i, may_unmap) in [false, true].into_iter().enumerate() {
        let at = base + i as u64 * 32768;
        dev.write_zeroes(
            at,
            16384,
            ZeroFlags {
                may_unmap,
                ..ZeroFlags::default()
            },
        )
        .unwrap();
        assert!(
            read_back(dev, at, 16384).iter().all(|&b| b == 0),
            "zeroes at {at}"
        );
    }
    // Bytes around the zeroed ranges are untouched.
    let after = read_back(dev, base, 65536);
    let expected = pattern(65536, 7);
    assert!(after[16384..32768] == expected[16384..32768]);
    assert!(after[49152..] == expected[49152..]);
}

pub fn discard_keeps_neighbours(dev: &dyn BlockDevice) {
    let base = 3 << 20;
    let data = pattern(3 * 4096, 9);
    dev.write(base, &data, WriteFlags::default()).unwrap();
    dev.discard(base + 4096, 4096).unwrap();
    let after = read_back(dev, base, 3 * 4096);
    assert!(after[..4096] == data[..4096] && after[8192..] == data[8192..]);
}

pub fn block_status_covers_and_tells_truth(dev: &dyn BlockDevice) {
    let len = 1 << 20;
    let extents = dev.block_status(0, len).unwrap();
    assert!(!extents.is_empty());
    let mut pos = 0;
    for e in &extents {
        assert!(e.len > 0 && e.len % 512 == 0, "extent {e:?}");
        if e.flags & EXTENT_ZERO != 0 {
            let data = read_back(dev, pos, e.len.min(1 << 20) as usize);
            assert!(
                data.iter().all(|&b| b == 0),
                "extent at {pos} claims zero: {e:?}"
            );
        }
        pos += e.len;
    }
    assert!(pos <= len && pos > 0);
}

pub fn concurrent_writers_do_not_mix(dev: &dyn BlockDevice) {
    let base = 3 << 20 | 1 << 19;
    std::thread::scope(|s| {
        for t in 0..4u64 {
            s.spawn(move || {
                for round in 0..16u64 {
                    let data = pattern(4096, t * 100 + round);
                    dev.write(base + t * 4096, &data, WriteFlags::default())
                        .unwrap();
                }
            });
        }
    });
    for t in 0..4u64 {
        assert!(read_back(dev, base + t * 4096, 4096)[..] == pattern(4096, t * 100 + 15)[..]);
    }
}

pub fn edges_of_the_device_work(dev: &dyn BlockDevice) {
    let last = dev.size() - 4096;
    let data = pattern(4096, 99);
    dev.write(last, &data, WriteFlags::default()).unwrap();
    assert!(read_back(dev, last, 4096)[..] == data[..]);
}

/// For the `zero` target: reads return zeroes, writes succeed and vanish.
pub fn reads_zero_and_drops_writes(dev: &dyn BlockDevice) {
    dev.write(0, &pattern(8192, 1), WriteFlags { fua: true })
        .unwrap();
    dev.flush().unwrap();
    dev.discard(0, 4096).unwrap();
    dev.write_zeroes(0, 4096, ZeroFlags::default()).unwrap();
    assert!(read_back(dev, 0, 8192).iter().all(|&b| b == 0));
    let extents = dev.block_status(0, 8192).unwrap();
    assert!(extents.iter().all(|e| e.flags & EXTENT_ZERO != 0));
}

/// For the `error` target: every request fails with EIO, but a flush, which has nothing to
/// make durable.
pub fn fails_every_request(dev: &dyn BlockDevice) {
    let mut buf = AlignedBuf::zeroed(4096);
    let eio = |r: udm_block::Result<()>| assert_eq!(r.unwrap_err().errno(), libc::EIO);
    eio(dev.read(0, &mut buf));
    eio(dev.write(0, &buf, WriteFlags::default()));
    dev.flush().unwrap();
    eio(dev.discard(0, 4096));
    eio(dev.write_zeroes(0, 4096, ZeroFlags::default()));
}
