//! Tables: parsing and printing lines, and the device made of their segments.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use udm_block::{
    merge_extents, BlockDevice, BlockError, Capabilities, Extent, MapOp, Mapping, OpenMode, Result,
    WriteFlags, ZeroFlags, SECTOR_SIZE,
};

use crate::args::Args;
use crate::reference::Reference;
use crate::registry::construct;
use crate::target::{EventSink, Resolver, Target, TargetContext, TargetError};

/// One line of a table, as text: `START LEN TYPE ARGS…` (sectors).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableLine {
    pub start: u64,
    pub len: u64,
    pub type_name: String,
    pub args: Vec<String>,
}

impl TableLine {
    /// Parses every non-empty line of `text` (`#` starts a comment line), each with its line
    /// number for error messages.
    pub fn parse_all(text: &str) -> Result<Vec<(usize, TableLine)>, TargetError> {
        let lines: Vec<_> = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
            .map(|(i, l)| {
                TableLine::parse(l)
                    .map(|line| (i + 1, line))
                    .map_err(|e| TargetError::new(format!("line {}: {e}", i + 1)))
            })
            .collect::<Result<_, _>>()?;
        if lines.is_empty() {
            return Err(TargetError::new("the table is empty"));
        }
        Ok(lines)
    }

    pub fn parse(line: &str) -> Result<TableLine, TargetError> {
        let tokens: Vec<&str> = line.split_whitespace().collect();
        let mut args = Args::new("", &tokens);
        let start = args.number("start")?;
        let len = args.number("length")?;
        if len == 0 {
            return Err(TargetError::new("<length> must not be zero"));
        }
        let type_name = args.word("target type")?.to_string();
        let args = args.rest().iter().map(|t| t.to_string()).collect();
        Ok(TableLine {
            start,
            len,
            type_name,
            args,
        })
    }
}

impl std::fmt::Display for TableLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {}", self.start, self.len, self.type_name)?;
        for arg in &self.args {
            write!(f, " {arg}")?;
        }
        Ok(())
    }
}

pub struct Segment {
    /// Byte offset of the segment in the table.
    pub start: u64,
    pub len: u64,
    pub target: Arc<dyn Target>,
    /// (reference, bytes from its start) for every lower device the target reaches into.
    needs: Vec<(String, u64)>,
}

/// A constructed table: contiguous segments from 0, each served by its target.
pub struct Table {
    segments: Vec<Segment>,
    /// The segments a flush goes to (see [`flushed_segments`]).
    flushed: Vec<usize>,
    size: u64,
    capabilities: Capabilities,
    /// The remote exports the targets opened: each open is a connection of this table's own,
    /// which [`Table::close_remotes`] may hang up.
    remotes: Vec<Arc<dyn BlockDevice>>,
}

/// The resolver a table is built with, keeping what it opens of remote exports.
struct RemembersRemotes<'a> {
    resolver: &'a dyn Resolver,
    remotes: Mutex<Vec<Arc<dyn BlockDevice>>>,
}

impl RemembersRemotes<'_> {
    fn remember(
        &self,
        reference: &str,
        opened: Result<Arc<dyn BlockDevice>, TargetError>,
    ) -> Result<Arc<dyn BlockDevice>, TargetError> {
        if let (Reference::Remote(_), Ok(device)) = (Reference::parse(reference), &opened) {
            self.remotes.lock().push(device.clone());
        }
        opened
    }
}

impl Resolver for RemembersRemotes<'_> {
    fn open(&self, reference: &str, mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.remember(reference, self.resolver.open(reference, mode))
    }

    fn open_path(
        &self,
        reference: &str,
        mode: OpenMode,
        timeout: Duration,
    ) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.remember(reference, self.resolver.open_path(reference, mode, timeout))
    }

    fn restoring(&self) -> bool {
        self.resolver.restoring()
    }

    fn read_only(&self) -> bool {
        self.resolver.read_only()
    }
}

/// The segments a flush must go to: every one, but of the segments whose flush is only
/// their lower device's ([`Target::flush_key`]), one per lower device.
fn flushed_segments(segments: &[Segment]) -> Vec<usize> {
    let mut seen = HashSet::new();
    (0..segments.len())
        .filter(|&i| {
            segments[i]
                .target
                .flush_key()
                .is_none_or(|key| seen.insert(key))
        })
        .collect()
}

/// The largest device: NBD clients and Linux address bytes with signed 64-bit offsets, so
/// a larger one would be served as a negative size, and past 2^64 bytes its size would wrap.
const MAX_SECTORS: u64 = i64::MAX as u64 / SECTOR_SIZE;

impl Table {
    /// Builds every target of `text`, the table of device `owner`; the first bad line fails the
    /// whole table.
    pub fn build(
        owner: &str,
        text: &str,
        resolver: &dyn Resolver,
        raise_event: EventSink,
    ) -> Result<Table, TargetError> {
        let remembering = RemembersRemotes {
            resolver,
            remotes: Mutex::default(),
        };
        let resolver = &remembering;
        let lines = TableLine::parse_all(text)?;
        let mut segments = Vec::with_capacity(lines.len());
        let mut next = 0u64;
        for (number, line) in &lines {
            let at = |e: TargetError| TargetError::new(format!("line {number}: {e}"));
            if line.start != next {
                return Err(at(TargetError::new(format!(
                    "segment starts at sector {} but the previous one ends at {next}: \
                     segments must be contiguous from 0",
                    line.start
                ))));
            }
            let end = u128::from(next) + u128::from(line.len);
            if end > u128::from(MAX_SECTORS) {
                return Err(at(TargetError::new(format!(
                    "the device would end at sector {end}, past the {MAX_SECTORS} sectors \
                     clients can address"
                ))));
            }
            let len = line.len * SECTOR_SIZE;
            let ctx = TargetContext {
                resolver,
                owner,
                len,
                raise_event: raise_event.clone(),
                restoring: resolver.restoring(),
                read_only: resolver.read_only(),
                needs: Default::default(),
            };
            let target = construct(&line.type_name, &line.args, &ctx).map_err(at)?;
            segments.push(Segment {
                start: next * SECTOR_SIZE,
                len,
                target,
                needs: ctx.needs.into_inner(),
            });
            next += line.len;
        }
        let capabilities = Capabilities::weakest(segments.iter().map(|s| s.target.capabilities()));
        Ok(Table {
            flushed: flushed_segments(&segments),
            segments,
            size: next * SECTOR_SIZE,
            capabilities,
            remotes: remembering.remotes.into_inner(),
        })
    }

    /// The table is going away with requests in flight (a removal by force): those waiting
    /// on a remote export that may never answer (a server that stopped) fail now, and so do
    /// later ones, instead of holding the removal's drain for the whole remote timeout.
    /// Only for a table that is never resumed again.
    pub fn close_remotes(&self) {
        self.remotes.iter().for_each(|remote| remote.close());
    }

    /// The targets a flush goes to.
    fn flushed(&self) -> impl Iterator<Item = &Arc<dyn Target>> {
        self.flushed.iter().map(|&i| &self.segments[i].target)
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The table as `udm table` prints it; [`Table::build`] accepts it back unchanged.
    pub fn lines(&self) -> Vec<String> {
        self.segments
            .iter()
            .map(|s| self.line(s, &s.target.args()))
            .collect()
    }

    /// One status line per segment.
    pub fn status_lines(&self) -> Vec<String> {
        self.segments
            .iter()
            .map(|s| self.line(s, &s.target.status()))
            .collect()
    }

    fn line(&self, s: &Segment, rest: &str) -> String {
        let head = format!(
            "{} {} {}",
            s.start / SECTOR_SIZE,
            s.len / SECTOR_SIZE,
            s.target.type_name()
        );
        if rest.is_empty() {
            head
        } else {
            format!("{head} {rest}")
        }
    }

    /// Every device reference of every segment, without repeats.
    pub fn references(&self) -> Vec<String> {
        let mut refs: Vec<String> = Vec::new();
        for s in &self.segments {
            for r in s.target.references() {
                if !refs.contains(&r) {
                    refs.push(r);
                }
            }
        }
        refs
    }

    /// How many bytes of the device `reference` this table's targets reach into (0 if it
    /// does not use it): a table that shrinks `reference` below this would strand them.
    pub fn needs_of(&self, reference: &str) -> u64 {
        self.segments
            .iter()
            .flat_map(|s| &s.needs)
            .filter(|(r, _)| r == reference)
            .map(|(_, end)| *end)
            .max()
            .unwrap_or(0)
    }

    /// The target that `udm message NAME SECTOR …` addresses.
    pub fn target_at(&self, sector: u64) -> Option<&Arc<dyn Target>> {
        let offset = sector.checked_mul(SECTOR_SIZE)?;
        self.segment_index(offset).map(|i| &self.segments[i].target)
    }

    pub fn presuspend(&self, noflush: bool) {
        self.segments
            .iter()
            .for_each(|s| s.target.presuspend(noflush));
    }

    /// [`Target::renamed`] of every target.
    pub fn renamed(&self, new: &str) {
        self.segments.iter().for_each(|s| s.target.renamed(new));
    }

    /// [`Target::preresume`] of every target: the first refusal.
    pub fn preresume(&self) -> Result<(), TargetError> {
        self.segments.iter().try_for_each(|s| s.target.preresume())
    }

    pub fn suspend(&self) {
        self.segments.iter().for_each(|s| s.target.suspend());
    }

    pub fn resume(&self) {
        self.segments.iter().for_each(|s| s.target.resume());
    }

    fn segment_index(&self, offset: u64) -> Option<usize> {
        if offset >= self.size {
            return None;
        }
        Some(self.segments.partition_point(|s| s.start + s.len <= offset))
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(BlockError::Io(format!(
                "offset {offset} length {len} is beyond the end of the table ({} bytes)",
                self.size
            )));
        }
        Ok(())
    }

    /// Calls `f(target, offset in target, range of the request)` for each segment the request
    /// touches, stopping at the first error.
    ///
    /// The range is checked against this table, the one serving the request: a request
    /// checked against an older, larger table (it waited at a suspended device while a smaller
    /// table was loaded) fails whole with EIO, as the kernel fails bytes no target maps,
    /// instead of doing the part that fits.
    fn each_piece(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&dyn Target, u64, std::ops::Range<usize>) -> Result<()>,
    ) -> Result<()> {
        self.check_range(offset, len)?;
        let mut index = self.segment_index(offset).unwrap_or(self.segments.len());
        let mut done = 0u64;
        while done < len && index < self.segments.len() {
            let segment = &self.segments[index];
            let pos = offset + done;
            let n = (segment.start + segment.len - pos).min(len - done);
            f(
                &*segment.target,
                pos - segment.start,
                done as usize..(done + n) as usize,
            )?;
            done += n;
            index += 1;
        }
        Ok(())
    }
}

impl BlockDevice for Table {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.each_piece(offset, buf.len() as u64, |t, at, range| {
            t.read(at, &mut buf[range])
        })
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        self.each_piece(offset, buf.len() as u64, |t, at, range| {
            t.write(at, &buf[range], flags)
        })
    }

    fn flush(&self) -> Result<()> {
        udm_block::flush_every(self.flushed().map(|t| &**t))
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.each_piece(offset, len, |t, at, range| {
            t.discard(at, range.len() as u64)
        })
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.each_piece(offset, len, |t, at, range| {
            t.write_zeroes(at, range.len() as u64, flags)
        })
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        // Answer for the first segment only: the caller asks again for the rest, and a short
        // answer keeps one slow segment from holding up the reply. The range is cut to that
        // segment before walking it, so that a client mapping a table of many segments
        // asks as many questions as there are segments, each of one segment's cost (walking
        // the whole rest each time made `nbdinfo --map` quadratic: 81 s at 200,000 lines).
        self.check_range(offset, len)?;
        let first_len = match self.segment_index(offset) {
            Some(index) => {
                let segment = &self.segments[index];
                len.min(segment.start + segment.len - offset)
            }
            None => len,
        };
        let mut extents = Vec::new();
        self.each_piece(offset, first_len, |t, at, range| {
            extents = merge_extents(t.block_status(at, range.len() as u64)?);
            Ok(())
        })?;
        Ok(extents)
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.each_piece(offset, len, |t, at, range| t.cache(at, range.len() as u64))
    }

    /// The segments' mappings joined; one segment that must handle its piece itself sends
    /// the whole request the synchronous way, and so do too many pieces (see
    /// [`udm_block::MAX_MAPPED_PIECES`]).
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        let mut mapping = Mapping::new();
        if op == MapOp::Flush {
            for target in self.flushed() {
                mapping.append(0, target.map(op, 0, 0)?);
            }
            return Some(mapping);
        }
        self.each_piece(offset, len, |t, at, range| {
            let piece = t
                .map(op, at, range.len() as u64)
                .ok_or(BlockError::NotSupported("not mapped".into()))?;
            mapping.append(range.start as u64, piece);
            if mapping.is_too_large() {
                return Err(BlockError::NotSupported("too many pieces to map".into()));
            }
            Ok(())
        })
        .ok()?;
        Some(mapping)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{build, memory_resolver, Devices, Switchable};
    use std::sync::atomic::Ordering;
    use udm_testkit::conformance;

    #[test]
    fn lines_print_back_exactly() {
        let resolver = memory_resolver(&[("a", 8 << 20), ("b", 8 << 20)]);
        let text = "0 2048 linear a 0\n2048 4096 striped 2 8 a 4096 b 0\n6144 2048 zero\n\
                    8192 8 error\n8200 8 delay a 100 0\n8208 8 flakey a 0 1 0\n\
                    8216 8 dust b 8 512";
        let table = build(&resolver, text).unwrap();
        assert_eq!(table.lines().join("\n"), text);
        let again = build(&resolver, &table.lines().join("\n")).unwrap();
        assert_eq!(again.lines(), table.lines());
    }

    #[test]
    fn requests_spanning_segments_land_in_each() {
        let resolver = memory_resolver(&[("a", 4 << 20), ("b", 4 << 20)]);
        let table = build(&resolver, "0 4096 linear a 4096\n4096 8192 linear b 0").unwrap();
        assert_eq!(table.size(), 6 << 20);
        conformance::run_all(&table);
    }

    #[test]
    fn bad_tables_say_which_line_and_why() {
        let resolver = memory_resolver(&[("a", 4 << 20)]);
        let cases = [
            ("", "the table is empty"),
            ("0 8 zero\n16 8 zero", "line 2: segment starts at sector 16"),
            ("8 8 zero", "line 1: segment starts at sector 8"),
            ("0 0 zero", "line 1: <length> must not be zero"),
            ("0 x zero", "line 1: invalid <length> 'x'"),
            ("0 8", "line 1: missing argument <target type>"),
            ("0 8 frobnicate", "line 1: unknown target type 'frobnicate'"),
            (
                "0 8 zero\n\n# c\n8 8 zero extra",
                "line 4: zero: unexpected argument 'extra'",
            ),
            // Sizes no client can address (NBD and Linux offsets are signed 64-bit): one
            // was served as an export of -512 bytes, and a table past 2^64 bytes wrapped
            // to a device of 1 sector.
            (
                "0 36028797018963967 zero",
                "line 1: the device would end at sector 36028797018963967",
            ),
            (
                "0 18014398509481984 zero",
                "line 1: the device would end at sector 18014398509481984",
            ),
            (
                "0 36028797018963967 zero\n36028797018963967 36028797018963967 zero\n\
                 72057594037927934 3 zero",
                "line 1: the device would end at sector 36028797018963967",
            ),
        ];
        for (text, expected) in cases {
            let err = build(&resolver, text)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.starts_with(expected), "table {text:?}: got {err:?}");
        }
    }

    #[test]
    fn a_request_past_the_table_fails_whole_and_touches_nothing() {
        let resolver = memory_resolver(&[("a", 4 << 20)]);
        let table = build(&resolver, "0 4096 linear a 0").unwrap();
        let across = vec![7u8; 4096];
        let err = table
            .write((2 << 20) - 2048, &across, WriteFlags::default())
            .unwrap_err();
        assert!(matches!(err, BlockError::Io(_)), "{err:?}");
        let mut buf = vec![9u8; 2048];
        resolver.get("a").read((2 << 20) - 2048, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "the part that fit was written");
        let mut read = vec![9u8; 512];
        assert!(table.read(3 << 20, &mut read).is_err());
        assert!(table.discard(2 << 20, 512).is_err());
    }

    #[test]
    fn needs_record_how_far_each_lower_device_is_used() {
        let resolver = memory_resolver(&[("a", 8 << 20), ("b", 8 << 20)]);
        let table = build(
            &resolver,
            "0 2048 linear a 4096\n2048 4096 striped 2 8 a 0 b 2048",
        )
        .unwrap();
        assert_eq!(table.needs_of("a"), 3 << 20);
        assert_eq!(table.needs_of("b"), 2 << 20);
        assert_eq!(table.needs_of("c"), 0);
    }

    /// A client maps a table of many segments by asking again from where each answer ends
    /// (nbdinfo --map, qemu-img map). Each answer must cost one segment, not the rest of the
    /// table: walking the rest each time took minutes here (it is quadratic); now it is a
    /// fraction of a second, so the bound below has a wide margin for a loaded machine.
    #[test]
    fn mapping_a_table_of_many_segments_costs_each_answer_one_segment() {
        let resolver = memory_resolver(&[]);
        let segments = 100_000u64;
        let text: String = (0..segments)
            .map(|i| format!("{} 8 zero\n", i * 8))
            .collect();
        let table = build(&resolver, &text).unwrap();
        let started = std::time::Instant::now();
        let (mut offset, mut answers) = (0, 0);
        while offset < table.size() {
            let extents = table.block_status(offset, table.size() - offset).unwrap();
            offset += extents.iter().map(|e| e.len).sum::<u64>();
            answers += 1;
        }
        assert_eq!(answers, segments);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{segments} answers took {:?}",
            started.elapsed()
        );
        assert!(table.block_status(table.size() - 512, 1024).is_err());
    }

    /// An `error` segment masks a bad region of a disk, as in dm ("useful for bringing up
    /// LVs that have holes in them"): it has nothing to make durable, so a flush of the table
    /// succeeds and reaches the other segments.
    #[test]
    fn a_flush_of_a_table_with_an_error_segment_syncs_the_rest() {
        let resolver = Devices::default();
        let disk = Arc::new(Switchable::new(4 << 20));
        resolver.add("disk", disk.clone(), false);
        let table = build(&resolver, "0 2048 error\n2048 2048 linear disk 2048").unwrap();
        table.flush().unwrap();
        assert_eq!(disk.flushes.load(Ordering::SeqCst), 1);
    }

    /// A device stacked over a fragmented one has a segment per fragment, each a `linear`
    /// onto it: its flush reached the lower device once per segment, and each of those
    /// flushed every lower segment again (segments × segments syncs: 2,000 over 2,000 made a
    /// FLUSH take 424 ms on the io_uring engine). A lower device is flushed once per flush.
    #[test]
    fn a_flush_reaches_a_lower_device_once_however_many_segments_lead_to_it() {
        let resolver = Devices::default();
        let disk = Arc::new(Switchable::new(1 << 20));
        resolver.add("disk", disk.clone(), false);
        let fragments = (0..50).map(|i| format!("{} 8 linear disk {}", i * 8, (49 - i) * 8));
        let lower = build(&resolver, &fragments.collect::<Vec<_>>().join("\n")).unwrap();
        resolver.add("frag", Arc::new(lower), false);
        let segments = (0..50).map(|i| format!("{} 8 linear frag {}", i * 8, (49 - i) * 8));
        let top = build(&resolver, &segments.collect::<Vec<_>>().join("\n")).unwrap();
        top.flush().unwrap();
        assert_eq!(disk.flushes.load(Ordering::SeqCst), 1);
    }

    /// Opens every reference as a new handle of its own, as the daemon opens an `nbd://`
    /// reference: one connection per segment, each with writes only its own flush covers.
    #[derive(Default)]
    struct Connections(parking_lot::Mutex<Vec<Arc<Switchable>>>);

    impl Resolver for Connections {
        fn open(
            &self,
            _: &str,
            _: udm_block::OpenMode,
        ) -> std::result::Result<Arc<dyn BlockDevice>, TargetError> {
            let connection = Arc::new(Switchable::new(1 << 20));
            self.0.lock().push(connection.clone());
            Ok(connection)
        }
    }

    /// Two segments on one remote export are two connections, and a server that does not
    /// advertise multi-conn makes a flush durable only for its own connection's writes: a
    /// flush goes to each handle that knows no identity, however it was named.
    #[test]
    fn a_flush_reaches_every_connection_to_one_remote() {
        let resolver = Connections::default();
        let uri = "nbd://server/disk";
        let table = build(
            &resolver,
            &format!("0 8 linear {uri} 0\n8 8 linear {uri} 8"),
        )
        .unwrap();
        table.flush().unwrap();
        let flushes: Vec<u64> = resolver
            .0
            .lock()
            .iter()
            .map(|c| c.flushes.load(Ordering::SeqCst))
            .collect();
        assert_eq!(flushes, [1, 1], "a connection's writes were never flushed");
    }

    /// One segment whose flush fails fails the flush, but the other segments' writes are
    /// still made durable: dm sends the flush to every target.
    #[test]
    fn a_failing_segment_does_not_keep_the_flush_from_the_others() {
        let resolver = Devices::default();
        let (a, b) = (
            Arc::new(Switchable::new(1 << 20)),
            Arc::new(Switchable::new(1 << 20)),
        );
        resolver.add("a", a.clone(), false);
        resolver.add("b", b.clone(), false);
        let table = build(&resolver, "0 2048 linear a 0\n2048 2048 linear b 0").unwrap();
        a.fail_writes.store(true, Ordering::SeqCst);
        assert_eq!(table.flush().unwrap_err().errno(), libc::EIO);
        assert_eq!(b.flushes.load(Ordering::SeqCst), 1, "b was never synced");
    }

    #[test]
    fn message_goes_to_the_segment_at_the_sector() {
        let resolver = memory_resolver(&[("a", 4 << 20)]);
        let table = build(&resolver, "0 8 zero\n8 8 dust a 0 512").unwrap();
        assert_eq!(table.target_at(8).unwrap().type_name(), "dust");
        assert_eq!(table.target_at(7).unwrap().type_name(), "zero");
        assert!(table.target_at(16).is_none());
    }
}

#[cfg(test)]
mod map_tests {
    use std::sync::Arc;

    use udm_block::{BlockDevice, FileDevice, MapOp, OpenMode, Place, MAX_MAPPED_PIECES};

    use crate::testing::{build, Devices};

    fn file(dir: &udm_testkit::TempDir, name: &str) -> (std::path::PathBuf, Arc<dyn BlockDevice>) {
        let path = dir.sparse(name, 1 << 20);
        let dev = Arc::new(FileDevice::open(&path, OpenMode::ReadWrite).unwrap());
        (path, dev)
    }

    /// Mapped, the same stack's flush names the file once, not once per pair of segments.
    #[test]
    fn a_flush_of_a_stack_over_a_fragmented_device_maps_each_file_once() {
        let dir = udm_testkit::TempDir::new("table-map-flush-fragments");
        let (_, a) = file(&dir, "a.img");
        let files = Devices::default();
        files.add("a", a, false);
        let fragments = (0..50).map(|i| format!("{} 8 linear a {}", i * 8, (49 - i) * 8));
        let lower = build(&files, &fragments.collect::<Vec<_>>().join("\n")).unwrap();
        files.add("frag", Arc::new(lower), false);
        let segments = (0..50).map(|i| format!("{} 8 linear frag {}", i * 8, (49 - i) * 8));
        let top = build(&files, &segments.collect::<Vec<_>>().join("\n")).unwrap();
        let flush = top.map(MapOp::Flush, 0, 0).unwrap();
        assert_eq!(flush.pieces.len(), 1);
    }

    /// On the io_uring way too: the error segment adds nothing to sync, the file is synced.
    #[test]
    fn a_flush_of_a_table_with_an_error_segment_stays_mapped() {
        let dir = udm_testkit::TempDir::new("table-map-error");
        let (a_path, a) = file(&dir, "a.img");
        let files = Devices::default();
        files.add("a", a, false);
        let table = build(&files, "0 8 error\n8 8 linear a 0").unwrap();
        let flush = table
            .map(MapOp::Flush, 0, 0)
            .expect("the flush went the slow way");
        let synced: Vec<_> = flush
            .pieces
            .iter()
            .map(|p| match &p.place {
                Place::File { file, .. } => Some(file.path().to_path_buf()),
                Place::Zero => None,
            })
            .collect();
        assert_eq!(synced, [Some(a_path)]);
    }

    /// A discard has no payload to bound it (up to 4 GiB): over stacked fragmented tables
    /// each level multiplies the pieces. 64 segments over a device of 2048 one-sector
    /// segments made 131,072 pieces for one request; 8,389 such segments, 8.6 million (a
    /// gigabyte of pieces, past the 2^20 the engine can address, whose completions then went
    /// to other requests). Past the bound the request goes the synchronous way.
    #[test]
    fn a_fill_over_stacked_fragmented_tables_maps_a_bounded_number_of_pieces() {
        let dir = udm_testkit::TempDir::new("table-map-fragments");
        let (_, a) = file(&dir, "a.img");
        let files = Devices::default();
        files.add("a", a, false);
        let fragments: Vec<_> = (0..2048).map(|s| format!("{s} 1 linear a {s}")).collect();
        let lower = build(&files, &fragments.join("\n")).unwrap();
        let stacked = Devices::default();
        stacked.add("lower", Arc::new(lower), false);
        let segments: Vec<_> = (0..64)
            .map(|i| format!("{} 2048 linear lower 0", i * 2048))
            .collect();
        let top = build(&stacked, &segments.join("\n")).unwrap();
        let discard = MapOp::Discard { fua: false };
        let mapped = top.map(discard, 0, top.size()).map(|m| m.pieces.len());
        assert!(
            mapped.is_none_or(|pieces| pieces <= MAX_MAPPED_PIECES),
            "{mapped:?} pieces"
        );
        // What a largest read or write can need is still mapped.
        let most = top.map(MapOp::Read, 0, 32 << 20).map(|m| m.pieces.len());
        assert_eq!(most, Some(65536));
    }

    #[test]
    fn linear_over_striped_over_two_files_maps_to_file_extents() {
        let dir = udm_testkit::TempDir::new("table-map");
        let (a_path, a) = file(&dir, "a.img");
        let (b_path, b) = file(&dir, "b.img");
        let files = Devices::default();
        files.add("a", a, false);
        files.add("b", b, false);
        // 8 KiB chunks, alternating a and b; then a linear 4 KiB into it, and a zero tail.
        let striped = build(&files, "0 2048 striped 2 16 a 0 b 0").unwrap();
        let stacked = Devices::default();
        stacked.add("s", Arc::new(striped), false);
        let top = build(&stacked, "0 24 linear s 8\n24 64 zero").unwrap();
        // The linear part is striped bytes 4096..16384: a 4096..8192, then b 0..8192.
        let mapping = top.map(MapOp::Read, 0, 16384).unwrap();
        let pieces: Vec<_> = mapping
            .pieces
            .iter()
            .map(|p| match &p.place {
                Place::File { file, offset } => {
                    (p.at, p.len, Some((file.path().to_path_buf(), *offset)))
                }
                Place::Zero => (p.at, p.len, None),
            })
            .collect();
        assert_eq!(
            pieces,
            vec![
                (0, 4096, Some((a_path.clone(), 4096))),
                (4096, 8192, Some((b_path.clone(), 0))),
                (12288, 4096, None),
            ]
        );
        // A flush syncs every file below.
        let flush = top.map(MapOp::Flush, 0, 0).unwrap();
        assert_eq!(flush.pieces.len(), 2);
        // A target that handles its own I/O keeps the whole request.
        let flakey = build(&files, "0 8 linear a 0\n8 8 flakey b 0 1000 0").unwrap();
        assert!(flakey.map(MapOp::Read, 0, 4096).is_some());
        assert!(flakey.map(MapOp::Read, 0, 8192).is_none());
        // One whose piece waits (a delay's timer) makes the whole request wait.
        let delayed = build(&files, "0 8 linear a 0\n8 8 delay b 0 10").unwrap();
        assert!(delayed.map(MapOp::Read, 0, 4096).unwrap().is_ready());
        let both = delayed.map(MapOp::Read, 0, 8192).unwrap();
        assert_eq!((both.pieces.len(), both.is_ready()), (2, false));
    }
}
