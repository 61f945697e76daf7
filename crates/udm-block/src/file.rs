//! Files and block devices as backends, with O_DIRECT where the filesystem allows it.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::device::{BlockDevice, Capabilities, Extent, WriteFlags, ZeroFlags};
use crate::error::{BlockError, Result};
use crate::map::{MapOp, MappedFile, Mapping, Place};
use crate::SECTOR_SIZE;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    ReadOnly,
    ReadWrite,
    /// Read-write, for a user that keeps state on the device (a clone's metadata and
    /// destination, a log-writes log): nobody else may write it meanwhile. Whoever resolves
    /// references enforces that; the file itself opens as read-write.
    Exclusive,
    /// Exclusive towards everyone but other devices opening it `Handover` too: targets that
    /// share its state within the process and hand it over between them (a snapshot's COW
    /// device, taken over by the `snapshot-merge` of another device: the kernel's exception
    /// handover). Those targets decide who may use it when.
    Handover,
}

impl OpenMode {
    /// The user keeps its state there.
    pub fn is_exclusive(self) -> bool {
        matches!(self, OpenMode::Exclusive | OpenMode::Handover)
    }
}

/// A regular file or a block device.
///
/// It is opened twice: once with O_DIRECT (when the filesystem accepts it) for the data path,
/// bypassing the page cache as the benchmarks' peers do, and once buffered for the rare request
/// whose alignment O_DIRECT refuses. The kernel keeps the two coherent: direct I/O writes back
/// and invalidates cached pages of the range first.
pub struct FileDevice {
    path: PathBuf,
    /// Shared with the mappings handed to the hot path.
    files: Arc<MappedFile>,
    size: u64,
    is_block_device: bool,
    read_only: bool,
    /// See [`BlockDevice::identity`].
    identity: String,
}

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

impl FileDevice {
    pub fn open(path: &Path, mode: OpenMode) -> Result<Self> {
        let read_only = mode == OpenMode::ReadOnly;
        let context = |what: &str| format!("{what} {}", path.display());
        let mut options = OpenOptions::new();
        options.read(true).write(!read_only);
        let buffered = options
            .open(path)
            .map_err(|e| BlockError::from_io(context("open"), e))?;
        let direct = options.custom_flags(libc::O_DIRECT).open(path).ok();
        let meta = buffered
            .metadata()
            .map_err(|e| BlockError::from_io(context("stat"), e))?;
        let is_block_device = meta.file_type().is_block_device();
        let size = if is_block_device {
            let mut bytes: u64 = 0;
            // SAFETY: BLKGETSIZE64 writes one u64 through the pointer.
            if unsafe { libc::ioctl(buffered.as_raw_fd(), BLKGETSIZE64, &mut bytes) } != 0 {
                return Err(BlockError::last_os(context("BLKGETSIZE64")));
            }
            bytes
        } else if meta.is_file() {
            meta.len()
        } else {
            return Err(BlockError::InvalidArgument(format!(
                "{} is neither a regular file nor a block device",
                path.display()
            )));
        };
        // Two device nodes of one block device share its number; a file is its inode.
        let identity = if is_block_device {
            format!("blockdev:{}", meta.rdev())
        } else {
            format!("file:{}:{}", meta.dev(), meta.ino())
        };
        Ok(FileDevice {
            path: path.to_path_buf(),
            files: Arc::new(MappedFile::new(path.to_path_buf(), direct, buffered)),
            size: size - size % SECTOR_SIZE,
            is_block_device,
            read_only,
            identity,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn is_direct(&self) -> bool {
        self.files.is_direct()
    }

    fn context(&self, op: &str, offset: u64, len: usize) -> String {
        format!("{op} {} at {offset}+{len}", self.path.display())
    }

    /// Runs `op` on the direct descriptor, and again on the buffered one if O_DIRECT refused
    /// the request's alignment.
    fn with_fd(&self, mut op: impl FnMut(i32) -> std::io::Result<()>) -> std::io::Result<()> {
        if self.files.is_direct() {
            match op(self.files.data_fd()) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                other => return other,
            }
        }
        op(self.files.buffered_fd())
    }

    fn fallocate(&self, mode: i32, offset: u64, len: u64) -> std::io::Result<()> {
        // SAFETY: plain syscall on an fd we own.
        let rc =
            unsafe { libc::fallocate(self.files.buffered_fd(), mode, offset as i64, len as i64) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    fn seek(&self, offset: u64, whence: i32) -> std::io::Result<Option<u64>> {
        // SAFETY: lseek on an fd we own.
        let pos = unsafe { libc::lseek(self.files.buffered_fd(), offset as i64, whence) };
        if pos >= 0 {
            return Ok(Some(pos as u64));
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(err)
        }
    }
}

/// Reads all of `buf`, or up to the end of the file: returns how much it read.
fn pread_full(fd: i32, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of buf.
        let n = unsafe {
            libc::pread(
                fd,
                buf[done..].as_mut_ptr().cast(),
                buf.len() - done,
                (offset + done as u64) as i64,
            )
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => return Ok(done),
            _ => {
                let err = std::io::Error::last_os_error();
                if err.kind() != std::io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
    Ok(done)
}

fn pwrite_full(fd: i32, buf: &[u8], offset: u64, fua: bool) -> std::io::Result<()> {
    let flags = if fua { libc::RWF_DSYNC } else { 0 };
    let mut done = 0;
    while done < buf.len() {
        let iov = libc::iovec {
            iov_base: buf[done..].as_ptr() as *mut _,
            iov_len: buf.len() - done,
        };
        // SAFETY: one iovec describing the unwritten tail of buf.
        let n = unsafe { libc::pwritev2(fd, &iov, 1, (offset + done as u64) as i64, flags) };
        if n >= 0 {
            done += n as usize;
        } else {
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
    }
    Ok(())
}

fn is_unsupported(err: &std::io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL)
    )
}

impl BlockDevice for FileDevice {
    fn identity(&self) -> Option<String> {
        Some(self.identity.clone())
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: self.read_only,
            native_fua: true,
            discard: true,
            fast_zero: true,
            ..Capabilities::default()
        }
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let len = buf.len();
        let mut read = 0;
        self.with_fd(|fd| pread_full(fd, buf, offset).map(|n| read = n))
            .map_err(|e| BlockError::from_io(self.context("read", offset, len), e))?;
        if read < len {
            // See BlockError::past_end_of_file: zeroes here would be data nobody wrote.
            return Err(BlockError::past_end_of_file(&self.path, offset, len as u64));
        }
        Ok(())
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        self.with_fd(|fd| pwrite_full(fd, buf, offset, flags.fua))
            .map_err(|e| BlockError::from_io(self.context("write", offset, buf.len()), e))
    }

    fn flush(&self) -> Result<()> {
        // SAFETY: fdatasync on an fd we own; it covers writes through either descriptor.
        if unsafe { libc::fdatasync(self.files.buffered_fd()) } != 0 {
            return Err(BlockError::last_os(format!(
                "fdatasync {}",
                self.path.display()
            )));
        }
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        match self.fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        ) {
            Ok(()) => Ok(()),
            // A discard is a hint: a filesystem that cannot punch holes just keeps the data.
            Err(e) if is_unsupported(&e) => Ok(()),
            Err(e) => Err(BlockError::from_io(
                self.context("discard", offset, len as usize),
                e,
            )),
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        let mut modes = vec![libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE];
        if flags.may_unmap {
            modes.insert(0, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE);
        }
        for mode in modes {
            match self.fallocate(mode, offset, len) {
                Ok(()) => return if flags.fua { self.flush() } else { Ok(()) },
                Err(e) if is_unsupported(&e) => continue,
                Err(e) => {
                    return Err(BlockError::from_io(
                        self.context("write_zeroes", offset, len as usize),
                        e,
                    ))
                }
            }
        }
        crate::write_zeroes_by_writing(self, offset, len, flags)
    }

    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        if self.read_only && op.is_write() {
            return None;
        }
        let file = self.files.clone();
        Some(Mapping::single(len, Place::File { file, offset }))
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        if self.is_block_device {
            return Ok(vec![Extent::data(len)]);
        }
        const MAX_EXTENTS: usize = 1024;
        let end = offset + len;
        let mut extents = Vec::new();
        let mut pos = offset;
        let err = |e| BlockError::from_io(self.context("seek", offset, len as usize), e);
        // What lies past the file's end now (it shrank under the device) is not a hole: it
        // is reported as data, so that whoever skips holes (a clone's hydration) reads it and
        // gets the error instead of taking it for zeroes.
        let file_end = self.files.current_len().map_err(err)? / SECTOR_SIZE * SECTOR_SIZE;
        // Where the next data (or hole) from `pos` starts, within the request; `none` when
        // the file has none.
        let next = |pos, whence, none: u64| -> Result<u64> {
            Ok(self
                .seek(pos, whence)
                .map_err(err)?
                .unwrap_or(none)
                .min(end))
        };
        while pos < end && extents.len() < MAX_EXTENTS {
            if pos >= file_end {
                extents.push(Extent::data(end - pos));
                break;
            }
            let data = next(pos, libc::SEEK_DATA, file_end)?;
            if data > pos {
                extents.push(Extent::hole(data - pos));
                pos = data;
                continue;
            }
            let hole = next(pos, libc::SEEK_HOLE, end)?;
            // Holes are reported at filesystem-block granularity; keep extents sector-aligned.
            let hole = hole
                .next_multiple_of(SECTOR_SIZE)
                .min(end)
                .max(pos + SECTOR_SIZE);
            extents.push(Extent::data(hole - pos));
            pos = hole;
        }
        Ok(extents)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;

    fn temp_file(len: u64) -> (PathBuf, File) {
        let path = std::env::temp_dir().join(format!(
            "udm-file-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let file = File::create(&path).unwrap();
        file.set_len(len).unwrap();
        (path, file)
    }

    #[test]
    fn sparse_file_reports_holes_and_data() {
        let (path, _file) = temp_file(4 << 20);
        let dev = FileDevice::open(&path, OpenMode::ReadWrite).unwrap();
        let data = crate::AlignedBuf::zeroed(65536);
        dev.write(1 << 20, &data, WriteFlags::default()).unwrap();
        let extents = dev.block_status(0, 4 << 20).unwrap();
        assert_eq!(extents.iter().map(|e| e.len).sum::<u64>(), 4 << 20);
        assert_eq!(extents[0], Extent::hole(1 << 20));
        assert_eq!(extents[1].flags, 0);
        std::fs::remove_file(&path).unwrap();
    }

    /// Someone truncates the file under a device: reads past the new end fail naming the
    /// file, and block status calls that part data, so nothing takes it for zeroes.
    #[test]
    fn a_file_truncated_under_the_device_fails_reads_past_its_end() {
        let (path, file) = temp_file(4 << 20);
        let dev = FileDevice::open(&path, OpenMode::ReadWrite).unwrap();
        let mut data = crate::AlignedBuf::zeroed(8192);
        data.fill(7);
        dev.write(0, &data, WriteFlags::default()).unwrap();
        file.set_len(4096).unwrap();

        let mut buf = crate::AlignedBuf::zeroed(8192);
        let err = dev.read(0, &mut buf).unwrap_err();
        assert_eq!(err.errno(), libc::EIO);
        let text = err.to_string();
        assert!(
            text.contains(&*path.to_string_lossy()) && text.contains("shrank"),
            "{text}"
        );
        dev.read(0, &mut buf[..4096]).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 7));

        let extents = dev.block_status(0, 4 << 20).unwrap();
        assert_eq!(extents.iter().map(|e| e.len).sum::<u64>(), 4 << 20);
        let last = extents.last().unwrap();
        assert_eq!((last.len, last.flags), ((4 << 20) - 4096, 0), "{extents:?}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn read_only_open_refuses_writes_from_the_os() {
        let (path, _file) = temp_file(1 << 20);
        let dev = FileDevice::open(&path, OpenMode::ReadOnly).unwrap();
        assert!(dev.capabilities().read_only);
        let err = dev
            .write(0, &[0u8; 512], WriteFlags::default())
            .unwrap_err();
        assert_eq!(err.errno(), libc::EBADF);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn missing_file_error_names_the_path() {
        let err = FileDevice::open(Path::new("/nonexistent/udm"), OpenMode::ReadOnly)
            .err()
            .unwrap();
        assert!(err.to_string().contains("/nonexistent/udm"), "{err}");
    }
}
