//! A device for crash tests: what was flushed is durable, what was written since is volatile,
//! and the power can be cut at any write. After the cut, [`CrashDevice::after_power_cut`]
//! gives the image a restart would see: the durable data plus an arbitrary subset of the
//! volatile sectors (writes not yet flushed may be torn and reordered, as on real disks).
//!
//! Devices built on one [`PowerSwitch`] lose power together, at the n-th write to any of
//! them: what a crash does to a snapshot's origin and COW device at once.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use udm_block::{
    write_zeroes_by_writing, BlockDevice, BlockError, Capabilities, MemoryDevice, Result,
    WriteFlags, ZeroFlags, SECTOR_SIZE,
};

use crate::Rng;

/// The power supply of one or more [`CrashDevice`]s.
pub struct PowerSwitch {
    /// Writes left before the power goes; 0 = never.
    writes_left: AtomicU64,
    cut: AtomicBool,
}

impl PowerSwitch {
    /// Power that goes at write number `cut_at` to any device on it (1 = the first write;
    /// 0 = never).
    pub fn new(cut_at: u64) -> Arc<Self> {
        Arc::new(PowerSwitch {
            writes_left: AtomicU64::new(cut_at),
            cut: AtomicBool::new(false),
        })
    }

    pub fn is_cut(&self) -> bool {
        self.cut.load(Ordering::SeqCst)
    }

    /// Counts a write; true if the power goes during it.
    fn goes_now(&self) -> bool {
        self.writes_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                left.checked_sub(1)
            })
            .is_ok_and(|left| {
                if left == 1 {
                    self.cut.store(true, Ordering::SeqCst);
                }
                left == 1
            })
    }
}

pub struct CrashDevice {
    durable: MemoryDevice,
    /// Writes since the last flush, in order: (offset, data).
    volatile: Mutex<Vec<(u64, Vec<u8>)>>,
    power: Arc<PowerSwitch>,
    /// Seed for which volatile sectors survive.
    seed: u64,
}

impl CrashDevice {
    /// A device whose power is cut at write number `cut_at` (1 = the first write; 0 = never).
    pub fn new(size: u64, cut_at: u64, seed: u64) -> Self {
        Self::on_power(size, PowerSwitch::new(cut_at), seed)
    }

    /// A device on `power`, which it may share with others.
    pub fn on_power(size: u64, power: Arc<PowerSwitch>, seed: u64) -> Self {
        Self::from_image(MemoryDevice::new(size), power, seed)
    }

    fn from_image(durable: MemoryDevice, power: Arc<PowerSwitch>, seed: u64) -> Self {
        CrashDevice {
            durable,
            volatile: Mutex::new(Vec::new()),
            power,
            seed,
        }
    }

    pub fn is_cut(&self) -> bool {
        self.power.is_cut()
    }

    fn check_power(&self) -> Result<()> {
        if self.is_cut() {
            return Err(BlockError::Io("power cut".into()));
        }
        Ok(())
    }

    /// Writes `buf` over the parts of unflushed writes it covers: a disk never lets an older
    /// cached write land over a newer FUA one, so a cut must not bring their sectors back.
    fn supersede_volatile(&self, offset: u64, buf: &[u8]) {
        let end = offset + buf.len() as u64;
        for (at, data) in self.volatile.lock().iter_mut() {
            let (start, stop) = ((*at).max(offset), (*at + data.len() as u64).min(end));
            if start < stop {
                data[(start - *at) as usize..(stop - *at) as usize]
                    .copy_from_slice(&buf[(start - offset) as usize..(stop - offset) as usize]);
            }
        }
    }

    /// The image after the power cut (or now): durable data plus, sector by sector, a
    /// pseudo-random half of what was written and not flushed. The result has no cut pending.
    pub fn after_power_cut(&self) -> CrashDevice {
        let image = MemoryDevice::new(self.durable.size());
        let mut buf = vec![0u8; 1 << 20];
        let mut pos = 0;
        while pos < image.size() {
            let n = (image.size() - pos).min(buf.len() as u64) as usize;
            self.durable.read(pos, &mut buf[..n]).expect("memory read");
            if buf[..n].iter().any(|&b| b != 0) {
                image
                    .write(pos, &buf[..n], WriteFlags::default())
                    .expect("memory write");
            }
            pos += n as u64;
        }
        let mut survives = Rng::new(self.seed);
        for (offset, data) in self.volatile.lock().iter() {
            for (i, sector) in data.chunks(SECTOR_SIZE as usize).enumerate() {
                if survives.next() & 1 == 1 {
                    let at = offset + i as u64 * SECTOR_SIZE;
                    image
                        .write(at, sector, WriteFlags::default())
                        .expect("memory write");
                }
            }
        }
        CrashDevice::from_image(image, PowerSwitch::new(0), survives.next())
    }
}

impl BlockDevice for CrashDevice {
    fn size(&self) -> u64 {
        self.durable.size()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            native_fua: true,
            ..Capabilities::default()
        }
    }

    /// Reads see the newest data, durable or not, as a running system does.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_power()?;
        self.durable.read(offset, buf)?;
        let end = offset + buf.len() as u64;
        for (at, data) in self.volatile.lock().iter() {
            let (w_start, w_end) = (*at, at + data.len() as u64);
            let (start, stop) = (w_start.max(offset), w_end.min(end));
            if start < stop {
                buf[(start - offset) as usize..(stop - offset) as usize]
                    .copy_from_slice(&data[(start - w_start) as usize..(stop - w_start) as usize]);
            }
        }
        Ok(())
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        self.check_power()?;
        if self.power.goes_now() {
            // The write was in flight: part of it may have reached the media.
            self.volatile.lock().push((offset, buf.to_vec()));
            return Err(BlockError::Io("power cut".into()));
        }
        if flags.fua {
            self.durable.write(offset, buf, flags)?;
            self.supersede_volatile(offset, buf);
            Ok(())
        } else {
            self.volatile.lock().push((offset, buf.to_vec()));
            Ok(())
        }
    }

    fn flush(&self) -> Result<()> {
        self.check_power()?;
        for (offset, data) in self.volatile.lock().drain(..) {
            self.durable.write(offset, &data, WriteFlags::default())?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        write_zeroes_by_writing(
            self,
            offset,
            len,
            ZeroFlags {
                fast_only: false,
                ..flags
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unflushed_write_never_lands_over_a_newer_fua_one() {
        let dev = CrashDevice::new(1 << 20, 0, 7);
        dev.write(0, &[1u8; 8192], WriteFlags::default()).unwrap();
        dev.write(0, &[2u8; 4096], WriteFlags { fua: true })
            .unwrap();
        let mut buf = vec![0u8; 8192];
        dev.after_power_cut().read(0, &mut buf).unwrap();
        assert!(
            buf[..4096].iter().all(|&b| b == 2),
            "the FUA write was undone"
        );
    }

    #[test]
    fn flushed_data_survives_and_unflushed_data_may_not() {
        let dev = CrashDevice::new(1 << 20, 3, 42);
        dev.write(0, &[1u8; 4096], WriteFlags::default()).unwrap();
        dev.flush().unwrap();
        dev.write(4096, &[2u8; 65536], WriteFlags::default())
            .unwrap();
        let mut buf = vec![0u8; 4096];
        dev.read(4096, &mut buf).unwrap();
        assert!(
            buf.iter().all(|&b| b == 2),
            "a running system reads its own writes"
        );
        assert!(
            dev.write(1 << 19, &[3u8; 512], WriteFlags::default())
                .is_err(),
            "third write: power cut"
        );
        assert!(dev.read(0, &mut buf).is_err());
        let after = dev.after_power_cut();
        after.read(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 1));
        let mut big = vec![0u8; 65536];
        after.read(4096, &mut big).unwrap();
        let kept = big
            .chunks(512)
            .filter(|s| s.iter().all(|&b| b == 2))
            .count();
        let lost = big
            .chunks(512)
            .filter(|s| s.iter().all(|&b| b == 0))
            .count();
        assert_eq!(kept + lost, 128);
        assert!(
            kept > 0 && lost > 0,
            "a torn write keeps some sectors: kept {kept}"
        );
    }

    #[test]
    fn devices_on_one_switch_lose_power_together() {
        let power = PowerSwitch::new(3);
        let a = CrashDevice::on_power(1 << 20, power.clone(), 1);
        let b = CrashDevice::on_power(1 << 20, power.clone(), 2);
        a.write(0, &[1u8; 512], WriteFlags::default()).unwrap();
        b.write(0, &[1u8; 512], WriteFlags::default()).unwrap();
        assert!(a.write(512, &[1u8; 512], WriteFlags::default()).is_err());
        assert!(power.is_cut() && a.is_cut() && b.is_cut());
        assert!(b.flush().is_err());
        assert!(!b.after_power_cut().is_cut());
    }
}
