//! What a READ, WRITE, FSYNC or FALLOCATE arriving on a ring entry asks of the io_uring
//! engine: the device's mapping of it and the reply it will get.

use udm_block::{BlockDevice, MapOp, Mapping, SECTOR_SIZE};

use crate::abi::{opcode as op, Args, FallocateIn, Fallocation, ReadIn, WriteIn};
use crate::dispatch::Request;
use crate::fs::Fs;

/// A request the engine executes, and what its reply will be.
pub(super) struct Mapped {
    pub unique: u64,
    pub answer: Answer,
    /// A read counted in the queue thread's bound on reads until it completes.
    pub admitted: bool,
}

pub(super) enum Answer {
    /// A read: the data is in the payload buffer.
    Data(usize),
    /// A write of this many bytes.
    Written(u32),
    /// An fsync or fallocate.
    Empty,
}

/// What the engine must do for a READ, WRITE, FSYNC or FALLOCATE, if its device maps it; None
/// sends the request to the synchronous path (which also answers everything a mapping cannot
/// express: ranges at or past the end, zero lengths, a fallocate of part of a sector, errors).
/// A read or write of part of a sector is mapped like any other: the engine writes those
/// bytes through the file's buffered descriptor when O_DIRECT refuses their alignment.
pub(super) fn plan(fs: &Fs, req: &Request) -> Option<(MapOp, Mapping, Mapped)> {
    let unique = req.header.unique;
    let (map_op, device, offset, len, answer) = match req.header.opcode {
        op::READ => {
            let r = ReadIn::parse(req.args)?;
            let open = fs.file(r.fh)?;
            let len = within(open.device.size(), r.offset, r.size)?;
            (MapOp::Read, open, r.offset, len, Answer::Data(len as usize))
        }
        op::WRITE => {
            let w = WriteIn::parse(req.args)?;
            if req.data.len() < w.size as usize {
                return None;
            }
            let open = fs.file(w.fh)?;
            let len = within(open.device.size(), w.offset, w.size)?;
            let map_op = MapOp::Write { fua: w.fua() };
            (map_op, open, w.offset, len, Answer::Written(len as u32))
        }
        op::FSYNC => {
            let open = fs.file(Args::new(req.args).u64()?)?;
            (MapOp::Flush, open, 0, 0, Answer::Empty)
        }
        op::FALLOCATE => {
            let f = FallocateIn::parse(req.args)?;
            let open = fs.file(f.fh)?;
            let Ok(Fallocation::Zero {
                offset,
                end,
                may_unmap,
            }) = f.meaning(open.device.size())
            else {
                return None;
            };
            // Partial sectors at either end are read-modify-written, synchronously.
            if offset >= end || offset % SECTOR_SIZE != 0 || end % SECTOR_SIZE != 0 {
                return None;
            }
            // As the synchronous path's write_zeroes: zero buffers where the file cannot
            // punch or zero a range, and no sync (fallocate promises no durability).
            let map_op = MapOp::WriteZeroes {
                may_unmap,
                fast_only: false,
                fua: false,
            };
            (map_op, open, offset, end - offset, Answer::Empty)
        }
        _ => return None,
    };
    let mapping = device.device.map(map_op, offset, len)?;
    let mapped = Mapped {
        unique,
        answer,
        admitted: false,
    };
    Some((map_op, mapping, mapped))
}

/// How much of `size` bytes at `offset` lies within a device of `end` bytes: a read or write
/// crossing the end is cut short there, like the synchronous path's. None if nothing does.
fn within(end: u64, offset: u64, size: u32) -> Option<u64> {
    (offset < end && size > 0).then(|| u64::from(size).min(end - offset))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_cut_at_the_end_of_the_device() {
        assert_eq!(within(8192, 0, 4096), Some(4096));
        assert_eq!(within(8192, 4096, 8192), Some(4096));
        assert_eq!(within(8192, 8192, 512), None);
        assert_eq!(within(8192, 0, 0), None);
    }
}
