//! Devices as files: sizes and modes, aligned and unaligned I/O, fallocate, the end of a
//! device, read-only devices, a changing catalog, large requests, ext4 and fio on loop devices.

use super::*;

#[test]
fn devices_are_files_with_their_size_and_mode() {
    each_transport(|mode| {
        let (dir, catalog, export) = mounted("attrs", mode, |_, catalog| {
            catalog.add_memory("vol", 8 * MIB);
            catalog.add("ro", Arc::new(MemoryDevice::new(MIB)), true);
        });
        let mnt = export.mountpoint().to_path_buf();
        assert_eq!(listing(&mnt), ["ro", "vol"]);
        let vol = std::fs::metadata(mnt.join("vol")).unwrap();
        assert!(vol.is_file());
        assert_eq!(vol.len(), 8 * MIB);
        assert_eq!(vol.permissions().mode() & 0o7777, 0o600);
        let ro = std::fs::metadata(mnt.join("ro")).unwrap();
        assert_eq!(ro.len(), MIB);
        assert_eq!(ro.permissions().mode() & 0o7777, 0o400);
        // Inode numbers stay put while the export lives.
        assert_eq!(vol.ino(), std::fs::metadata(mnt.join("vol")).unwrap().ino());
        assert_ne!(vol.ino(), ro.ino());
        assert_eq!(errno_of(std::fs::metadata(mnt.join("nope"))), libc::ENOENT);
        let root = std::fs::metadata(&mnt).unwrap();
        assert!(root.is_dir());
        // Files come only from the catalog.
        assert!(File::create(mnt.join("new")).is_err());
        assert!(std::fs::create_dir(mnt.join("dir")).is_err());
        assert!(std::fs::remove_file(mnt.join("vol")).is_err());
        assert_eq!(listing(&mnt), ["ro", "vol"]);
        // Changes other than the size are accepted (and have no effect).
        std::fs::set_permissions(mnt.join("vol"), std::fs::Permissions::from_mode(0o644)).unwrap();
        // A whole read ends at the device size.
        assert_eq!(
            std::fs::read(mnt.join("ro")).unwrap(),
            vec![0u8; MIB as usize]
        );
        export.unmount();
        catalog.wait_closed();
        assert!(!dir.path("mnt").join("vol").exists(), "still mounted");
    });
}

#[test]
fn aligned_and_unaligned_reads_and_writes() {
    each_transport(|mode| {
        let device = Recording::new(4 * MIB);
        let (_dir, catalog, export) = mounted("rw", mode, |_, catalog| {
            catalog.add("vol", device.clone(), false)
        });
        let path = export.mountpoint().join("vol");
        let mut model = vec![0u8; 4 * MIB as usize];
        let file = open_rw(&path).unwrap();

        let mut write = |file: &File, offset: usize, data: &[u8]| {
            file.write_all_at(data, offset as u64).unwrap();
            model[offset..offset + data.len()].copy_from_slice(data);
        };
        write(&file, 0, &pattern(64 * 1024, 1));
        write(&file, MIB as usize, &pattern(MIB as usize, 2));
        // Unaligned: within one sector, across a boundary, long with both ends partial.
        write(&file, 1000, b"abc");
        write(&file, 510, b"across");
        write(&file, 3 * MIB as usize + 77, &pattern(100_000, 3));
        // Byte by byte, like dd bs=1.
        for (i, b) in b"one byte at a time".iter().enumerate() {
            write(&file, 2 * MIB as usize + 511 + i, &[*b]);
        }
        file.sync_all().unwrap();
        assert!(
            device.flushes.load(Ordering::SeqCst) >= 1,
            "fsync reached the device"
        );

        let check = |offset: usize, len: usize| {
            let mut buf = vec![0u8; len];
            file.read_exact_at(&mut buf, offset as u64).unwrap();
            assert!(buf == model[offset..offset + len], "{offset}+{len} differs");
        };
        check(0, 64 * 1024);
        check(1, 1);
        check(999, 5);
        check(500, 20);
        check(MIB as usize - 3, 700);
        check(2 * MIB as usize + 500, 40);
        check(3 * MIB as usize, MIB as usize);
        // Reads at and across the end are short, like a regular file's.
        let mut tail = vec![0u8; 100];
        assert_eq!(file.read_at(&mut tail, 4 * MIB - 10).unwrap(), 10);
        assert_eq!(file.read_at(&mut tail, 4 * MIB).unwrap(), 0);
        // cat: the whole file, in whatever pieces the reader chooses.
        assert!(std::fs::read(&path).unwrap() == model);
        // What the device holds is what was written.
        let mut direct = vec![0u8; model.len()];
        device.inner.read(0, &mut direct).unwrap();
        assert!(direct == model);
        drop(file);
        catalog.wait_closed();
        export.unmount();
    });
}

#[test]
fn fallocate_punches_and_zeroes() {
    each_transport(|mode| {
        let (_dir, _catalog, export) = mounted("falloc", mode, |_, catalog| {
            catalog.add_memory("vol", MIB);
        });
        let file = open_rw(&export.mountpoint().join("vol")).unwrap();
        let ones = vec![0xffu8; MIB as usize];
        file.write_all_at(&ones, 0).unwrap();
        let keep = libc::FALLOC_FL_KEEP_SIZE;
        fallocate(&file, libc::FALLOC_FL_PUNCH_HOLE | keep, 4096, 8192).unwrap();
        fallocate(&file, libc::FALLOC_FL_ZERO_RANGE, 65536, 4096).unwrap();
        // Unaligned ends are zeroed too, and nothing beside them.
        fallocate(&file, libc::FALLOC_FL_PUNCH_HOLE | keep, 100_001, 2000).unwrap();
        fallocate(&file, libc::FALLOC_FL_ZERO_RANGE | keep, 200_100, 100).unwrap();
        // Beyond the end with KEEP_SIZE: only the part within the device.
        fallocate(&file, libc::FALLOC_FL_PUNCH_HOLE | keep, MIB - 512, 4096).unwrap();
        let mut expected = ones.clone();
        for (offset, len) in [
            (4096, 8192),
            (65536, 4096),
            (100_001, 2000),
            (200_100, 100),
            (MIB as usize - 512, 512),
        ] {
            expected[offset..offset + len].fill(0);
        }
        let mut got = vec![0u8; MIB as usize];
        file.read_exact_at(&mut got, 0).unwrap();
        let first_difference = got.iter().zip(&expected).position(|(a, b)| a != b);
        assert_eq!(first_difference, None);
        // Plain allocation is a no-op within the device; growing it is not possible.
        fallocate(&file, 0, 0, MIB).unwrap();
        assert_eq!(errno_of(fallocate(&file, 0, 0, 2 * MIB)), libc::EOPNOTSUPP);
        assert_eq!(
            errno_of(fallocate(&file, libc::FALLOC_FL_COLLAPSE_RANGE, 0, 4096)),
            libc::EOPNOTSUPP
        );
        drop(file);
        export.unmount();
    });
}

#[test]
fn writes_stop_at_the_end_and_the_size_cannot_change() {
    each_transport(|mode| {
        let (_dir, _catalog, export) = mounted("end", mode, |_, catalog| {
            catalog.add_memory("vol", MIB);
        });
        let path = export.mountpoint().join("vol");
        let file = open_rw(&path).unwrap();
        assert_eq!(file.write_at(&[7u8; 4096], MIB - 1024).unwrap(), 1024);
        assert_eq!(errno_of(file.write_at(&[7u8; 10], MIB)), libc::ENOSPC);
        assert_eq!(errno_of(file.set_len(2 * MIB)), libc::EINVAL);
        assert_eq!(errno_of(file.set_len(0)), libc::EINVAL);
        file.set_len(MIB).unwrap();
        // O_TRUNC is ignored, as on a block device: the data stays.
        let truncating = OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        drop(truncating);
        let mut tail = [0u8; 4];
        file.read_exact_at(&mut tail, MIB - 4).unwrap();
        assert_eq!(tail, [7; 4]);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), MIB);
        drop(file);
        export.unmount();
    });
}

#[test]
fn read_only_devices_refuse_writes() {
    each_transport(|mode| {
        let device = Arc::new(MemoryDevice::new(MIB));
        device.write(0, &[5u8; 512], WriteFlags::default()).unwrap();
        let (_dir, catalog, export) =
            mounted("ro", mode, |_, catalog| catalog.add("ro", device, true));
        let path = export.mountpoint().join("ro");
        assert_eq!(errno_of(open_rw(&path)), libc::EROFS);
        assert_eq!(
            errno_of(OpenOptions::new().write(true).open(&path)),
            libc::EROFS
        );
        let data = std::fs::read(&path).unwrap();
        assert_eq!(&data[..512], &[5u8; 512][..]);
        export.unmount();
        catalog.wait_closed();
    });
}

#[test]
fn devices_come_and_go_with_the_catalog() {
    each_transport(|mode| {
        let (_dir, catalog, export) = mounted("catalog", mode, |_, catalog| {
            catalog.add_memory("a", MIB);
        });
        let mnt = export.mountpoint().to_path_buf();
        assert_eq!(listing(&mnt), ["a"]);
        let ino = std::fs::metadata(mnt.join("a")).unwrap().ino();

        catalog.add_memory("b", 2 * MIB);
        assert_eq!(listing(&mnt), ["a", "b"]);
        assert_eq!(std::fs::metadata(mnt.join("b")).unwrap().len(), 2 * MIB);

        // An open file keeps its device even after the catalog drops it.
        let held = open_rw(&mnt.join("a")).unwrap();
        held.write_all_at(b"still here", 0).unwrap();
        catalog.remove("a");
        assert_eq!(listing(&mnt), ["b"]);
        assert_eq!(errno_of(std::fs::metadata(mnt.join("a"))), libc::ENOENT);
        assert_eq!(errno_of(File::open(mnt.join("a"))), libc::ENOENT);
        let mut buf = [0u8; 10];
        held.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"still here");
        drop(held);
        catalog.wait_closed();

        // Back under the same name: the same inode number, the new size.
        catalog.add_memory("a", 3 * MIB);
        let again = std::fs::metadata(mnt.join("a")).unwrap();
        assert_eq!(again.len(), 3 * MIB);
        assert_eq!(again.ino(), ino);
        // Names that cannot be files are not shown.
        catalog.add_memory("x/y", MIB);
        catalog.add_memory("..", MIB);
        assert_eq!(listing(&mnt), ["a", "b"]);
        export.unmount();
    });
}

#[test]
fn large_requests_arrive_whole() {
    each_transport(|mode| {
        let device = Recording::new(8 * MIB);
        let (_dir, _catalog, export) = mounted("large", mode, |_, catalog| {
            catalog.add("vol", device.clone(), false)
        });
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(export.mountpoint().join("vol"))
            .unwrap();
        // Page-aligned user memory: 256 pages, one request.
        let mut buf = AlignedBuf::zeroed(MIB as usize);
        buf.copy_from_slice(&pattern(MIB as usize, 9));
        file.write_all_at(&buf, MIB).unwrap();
        file.read_exact_at(&mut buf, MIB).unwrap();
        assert_eq!(device.largest_write.load(Ordering::SeqCst), MIB);
        assert_eq!(device.largest_read.load(Ordering::SeqCst), MIB);
        drop(file);
        export.unmount();
    });
}

#[test]
fn ext4_on_a_loop_device() {
    each_transport(|mode| {
        let (dir, catalog, export) = mounted("ext4", mode, |dir, catalog| {
            let device = file_device(dir, "backing.img", 128 * MIB);
            catalog.add("vol", Arc::new(device), false);
        });
        let lo = LoopDevice::attach(&export.mountpoint().join("vol"));
        assert!(lo.direct_io(), "{} without direct I/O", lo.0);
        run_ok(Command::new("mkfs.ext4").args(["-q", "-F", &lo.0]));
        let files: Vec<(String, Vec<u8>)> = (0..20)
            .map(|i| {
                (
                    format!("file{i}"),
                    pattern(1000 + i as usize * 37_777, 100 + i).to_vec(),
                )
            })
            .collect();
        let fs = Mounted::new(&lo.0, &dir.path("ext4"));
        for (name, data) in &files {
            std::fs::write(fs.path().join(name), data).unwrap();
        }
        run_ok(&mut Command::new("sync"));
        for (name, data) in &files {
            assert!(std::fs::read(fs.path().join(name)).unwrap() == *data);
        }
        fs.unmount();
        run_ok(Command::new("e2fsck").args(["-fn", &lo.0]));
        // Mounted again, the files are there (read back through the device, not a cache).
        run_ok(Command::new("blockdev").args(["--flushbufs", &lo.0]));
        let fs = Mounted::new(&lo.0, &dir.path("ext4"));
        for (name, data) in &files {
            assert!(
                std::fs::read(fs.path().join(name)).unwrap() == *data,
                "{name}"
            );
        }
        fs.unmount();
        drop(lo);
        catalog.wait_closed();
        export.unmount();
    });
}

#[test]
fn fio_verify_on_a_loop_device() {
    each_transport(|mode| {
        let (dir, catalog, export) = mounted("fio", mode, |_, catalog| {
            catalog.add_memory("vol", 64 * MIB);
        });
        let lo = LoopDevice::attach(&export.mountpoint().join("vol"));
        let out = run_ok(Command::new("fio").current_dir(&dir.0).args([
            "--name=verify",
            &format!("--filename={}", lo.0),
            "--direct=1",
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=16",
            "--ioengine=io_uring",
            "--size=32M",
            "--verify=crc32c",
            "--verify_state_save=0",
        ]));
        eprintln!("{out}");
        assert!(out.contains("err= 0"), "{out}");
        drop(lo);
        catalog.wait_closed();
        export.unmount();
    });
}
