//! The sending side of replication: the stream of what differs from one snapshot of a live
//! pool to another (everything mapped, for a full stream), its data read through a private
//! read-only `thin` table on the snapshot. The plan of records follows from the delta alone,
//! so a resumed stream (`start_at`) has the same records as the first one had.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use log::info;
use serde_json::json;
use udm_block::{AlignedBuf, BlockDevice};
use udm_metadata::thin::Side;
use udm_targets::replica::{self, PoolHandle, SentHold};
use udm_targets::Table;

use super::device::Events;
use super::received::stamp_of;
use super::registry::Registry;
use crate::replication::stream::{
    Header, Kind, Layout, Place, Stamp, Writer, MAX_DATA, MAX_EMPTY, NO_BASE,
};

/// One record to send: data (read from the snapshot; zeroes become a zero record) or a range
/// the snapshot does not map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    pub place: Place,
    pub changed: bool,
}

/// Splits the delta's runs into records.
pub fn plan(runs: &[udm_metadata::thin::DeltaRun], block_bytes: u64) -> Vec<Planned> {
    let mut out = Vec::new();
    for run in runs {
        let changed = run.side != Side::LeftOnly;
        let most = if changed { MAX_DATA } else { MAX_EMPTY } as u64;
        let (mut at, end) = (run.begin * block_bytes, (run.begin + run.len) * block_bytes);
        while at < end {
            let len = (end - at).min(most);
            out.push(Planned {
                place: Place {
                    seq: out.len() as u64,
                    offset: at,
                    len: len as u32,
                },
                changed,
            });
            at += len;
        }
    }
    out
}

/// Records read at once.
const READ_AHEAD: usize = 8;

/// How the private tables of sends are named (they only read).
pub const SENDING_PREFIX: &str = ".send-";
/// Names the private tables of concurrent sends apart.
static SENDS: AtomicU64 = AtomicU64::new(0);

/// The source pool's name in streams: this host's, and the pool device's.
pub fn source_name(pool: &str) -> String {
    let mut host = [0u8; 256];
    // SAFETY: gethostname writes at most host.len() bytes into our buffer.
    let ok = unsafe { libc::gethostname(host.as_mut_ptr().cast(), host.len()) } == 0;
    let end = host.iter().position(|&b| b == 0).unwrap_or(host.len());
    let host = if ok {
        String::from_utf8_lossy(&host[..end]).into_owned()
    } else {
        "localhost".into()
    };
    format!("{host}/{pool}")
}

/// A prepared send: the header and the records, checked against the pool.
pub struct Send {
    pool_name: String,
    pub header: Header,
    plan: Vec<Planned>,
    /// The snapshot, read through a table of its own (none for an empty volume), opened as
    /// the send is prepared: one that cannot be opened is refused before the stream starts,
    /// and the table holds the device against a delete from then on.
    table: Option<Table>,
    /// The snapshot and the base, kept from writable tables until the send ends: the stream
    /// is of one point, and its base what the receiver holds.
    _still: Vec<SentHold>,
}

/// Holds thin device `id` for a send (through tables of device `by`), if it exists and no
/// writable table uses it (see [`PoolHandle::hold_sent`]).
fn hold_still(pool: &PoolHandle, pool_name: &str, id: u32, by: &str) -> Result<SentHold, String> {
    if pool.device(id).is_none() {
        return Err(format!(
            "thin device {id} does not exist in pool '{pool_name}'"
        ));
    }
    pool.hold_sent(id, by).map_err(|e| e.to_string())
}

/// The stamp of thin device `id` (held for the send), which is sealed first if it is not: a
/// later write to a block it holds as its own (written since its last snapshot) would be made
/// in place and leave its stamp as it was, so that an increment from it would pass at the
/// receiver and leave that write out. The seal does not change the stamp. A device that
/// cannot be sealed (the pool read-only) is not sent.
fn sealed_stamp(pool: &PoolHandle, pool_name: &str, id: u32) -> Result<Stamp, String> {
    let stamp = stamp_of(pool, id)?;
    if pool
        .device(id)
        .is_some_and(|d| !d.is_sealed(stamp.newest_mapping))
    {
        pool.seal(id).map_err(|e| {
            format!(
                "cannot send thin device {id} of pool '{pool_name}': it was written since it \
                 was last snapshotted, and sealing it (so that a later write to it is seen) \
                 needs a metadata commit, which failed ({e}); send it once the pool is \
                 writable"
            )
        })?;
    }
    Ok(stamp)
}

impl Send {
    pub fn prepare(
        registry: &Registry,
        pool_name: &str,
        id: u32,
        from: Option<u32>,
    ) -> Result<Send, String> {
        let pool = replica::pool(pool_name).map_err(|e| e.to_string())?;
        if from == Some(id) {
            return Err(format!("--from {id} is the snapshot sent"));
        }
        let owner = format!(
            "{SENDING_PREFIX}{pool_name}-{id}-{}",
            SENDS.fetch_add(1, Ordering::Relaxed)
        );
        let mut still = vec![hold_still(&pool, pool_name, id, &owner)?];
        if let Some(from) = from {
            still.push(hold_still(&pool, pool_name, from, &owner)?);
        }
        // Read before the delta and checked again once the table holds the device: a
        // snapshot deleted and made again meanwhile has another creation time, and the
        // stream would name the one and carry the other.
        let time = |id: u32| pool.device(id).map_or(0, |d| d.creation_time);
        let times = (time(id), from.map_or(0, time));
        // Taken while the holds keep both from writes: what the receiver records of the
        // snapshot, and what it checks its copy of the base against.
        let to_stamp = sealed_stamp(&pool, pool_name, id)?;
        let from_stamp = from
            .map(|f| sealed_stamp(&pool, pool_name, f))
            .transpose()?;
        let block = pool.block_bytes();
        let runs = pool.delta(from, id).map_err(|e| e.to_string())?;
        let plan = plan(&runs, block);
        let mapped_end = pool
            .highest_mapped(id)
            .map_err(|e| e.to_string())?
            .map_or(0, |b| (b + 1) * block);
        let plan_end = plan
            .last()
            .map_or(0, |p| p.place.offset + p.place.len as u64);
        let used_as: u64 = pool
            .users_of(id)
            .iter()
            .filter_map(|u| registry.get(u).ok())
            .map(|d| d.live().size())
            .max()
            .unwrap_or(0);
        let header = Header {
            block_bytes: block as u32,
            to_id: id,
            to_time: times.0,
            to_stamp,
            from_id: from.unwrap_or(NO_BASE),
            from_time: times.1,
            from_stamp: from_stamp.unwrap_or_default(),
            volume_bytes: mapped_end.max(plan_end).max(used_as),
            records: plan.len() as u64,
            changed_bytes: plan
                .iter()
                .filter(|p| p.changed)
                .map(|p| p.place.len as u64)
                .sum(),
            source: source_name(pool_name),
        };
        let table = open_volume(registry, &owner, pool_name, &header)?;
        if (time(id), from.map_or(0, time)) != times {
            return Err(format!(
                "thin device {id}{} of pool '{pool_name}' was deleted or made again while the \
                 send was prepared: send again",
                from.map_or(String::new(), |f| format!(" or {f}"))
            ));
        }
        Ok(Send {
            pool_name: pool_name.to_string(),
            header,
            plan,
            table,
            _still: still,
        })
    }

    /// Refuses a stream from record `start_at` past the end of this one (the trailer is
    /// "record" `records`, the last place a stream may start).
    pub fn check_start(&self, start_at: u64) -> Result<(), String> {
        let records = self.header.records;
        if start_at > records {
            return Err(format!(
                "cannot start the stream of thin device {} at record {start_at}: it has \
                 {records} records (resume at record {records} or before)",
                self.header.to_id
            ));
        }
        Ok(())
    }

    /// The layout checksum of the records before `start_at`.
    fn layout_before(&self, start_at: u64) -> Layout {
        let mut layout = Layout::default();
        for p in self.plan.iter().take(start_at as usize) {
            layout.add(p.place);
        }
        layout
    }

    /// What the client hears before a stream from record `start_at`.
    pub fn summary(&self, start_at: u64) -> serde_json::Value {
        let h = &self.header;
        json!({
            "source": h.source, "to": h.to_id, "from": (!h.is_full()).then_some(h.from_id),
            "records": h.records, "changed_bytes": h.changed_bytes,
            "volume_bytes": h.volume_bytes, "block_bytes": h.block_bytes,
            "layout_before": self.layout_before(start_at).0,
        })
    }

    /// Reads record `p`'s data into `buf`; its kind: unmapped (not changed), zero or data.
    fn read_record(
        &self,
        table: Option<&Table>,
        p: &Planned,
        buf: &mut AlignedBuf,
    ) -> Result<Kind, String> {
        if !p.changed {
            return Ok(Kind::Unmapped);
        }
        let data = &mut buf[..p.place.len as usize];
        let table = table.expect("data lies inside the volume");
        table.read(p.place.offset, data).map_err(|e| {
            format!(
                "reading thin device {} at byte {}: {e}",
                self.header.to_id, p.place.offset
            )
        })?;
        Ok(match data.iter().all(|&b| b == 0) {
            true => Kind::Zero,
            false => Kind::Data,
        })
    }

    /// Writes the stream from record `start_at` on (the header always).
    pub fn write(&self, start_at: u64, out: &mut dyn Write) -> Result<(), String> {
        let h = &self.header;
        let table = self.table.as_ref();
        let io = |e: std::io::Error| format!("writing the stream: {e}");
        out.write_all(&h.encode()).map_err(io)?;
        let start = (start_at as usize).min(self.plan.len());
        let mut w = Writer::new(out, self.layout_before(start_at));
        // Records are read READ_AHEAD at a time in parallel, while the batch before is
        // written: one synchronous 1 MiB read at a time leaves the data device idle between.
        let read = |p: &Planned, buf: &mut AlignedBuf| self.read_record(table, p, buf);
        let mut bufs: Vec<AlignedBuf> = (0..2 * READ_AHEAD)
            .map(|_| AlignedBuf::zeroed(MAX_DATA as usize))
            .collect();
        let (mut front, mut back) = bufs.split_at_mut(READ_AHEAD);
        let mut ready: Vec<(Planned, Kind)> = Vec::new();
        let batches = self.plan[start..].chunks(READ_AHEAD).chain([&[][..]]);
        for batch in batches {
            let read_now = std::thread::scope(|s| {
                let readers: Vec<_> = batch
                    .iter()
                    .zip(back.iter_mut())
                    .map(|(p, buf)| s.spawn(|| read(p, buf)))
                    .collect();
                let written = ready
                    .iter()
                    .zip(front.iter())
                    .try_for_each(|((p, kind), buf)| {
                        let payload = if *kind == Kind::Data {
                            &buf[..p.place.len as usize]
                        } else {
                            &[]
                        };
                        w.record(*kind, p.place, payload).map_err(io)
                    });
                let kinds: Result<Vec<Kind>, String> = readers
                    .into_iter()
                    .map(|r| r.join().expect("a reader does not panic"))
                    .collect();
                written.and(kinds)
            })?;
            ready = batch.iter().copied().zip(read_now).collect();
            std::mem::swap(&mut front, &mut back);
        }
        w.finish(h.records).map_err(io)?;
        info!(
            "sent thin device {} of pool '{}'{} from record {start_at}: {} records",
            h.to_id,
            self.pool_name,
            if h.is_full() {
                String::new()
            } else {
                format!(" (from {})", h.from_id)
            },
            h.records
        );
        Ok(())
    }
}

/// The thin device being sent, as a read-only table of device `owner` (none for an empty
/// volume).
fn open_volume(
    registry: &Registry,
    owner: &str,
    pool_name: &str,
    h: &Header,
) -> Result<Option<Table>, String> {
    if h.volume_bytes == 0 {
        return Ok(None);
    }
    let line = format!("0 {} thin {} {}", h.volume_bytes / 512, pool_name, h.to_id);
    registry
        .build(owner, &line, true, &Arc::new(Events::default()))
        .map(Some)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use udm_metadata::thin::DeltaRun;

    #[test]
    fn runs_become_records_of_bounded_size_in_order() {
        let runs = [
            DeltaRun {
                begin: 0,
                len: 20,
                side: Side::RightOnly,
            },
            DeltaRun {
                begin: 20,
                len: 1,
                side: Side::Different,
            },
            DeltaRun {
                begin: 30,
                len: 40_000,
                side: Side::LeftOnly,
            },
        ];
        let p = plan(&runs, 65536);
        let sizes: Vec<(u64, u32, bool)> = p
            .iter()
            .map(|p| (p.place.offset, p.place.len, p.changed))
            .collect();
        assert_eq!(
            sizes,
            [
                (0, 1 << 20, true),
                (1 << 20, 4 << 16, true),
                (20 << 16, 1 << 16, true),
                (30 << 16, 1 << 30, false),
                ((30 << 16) + (1 << 30), 1 << 30, false),
                ((30 << 16) + (2 << 30), (40_000 << 16) - (2 << 30), false),
            ]
        );
        assert!(p.iter().enumerate().all(|(i, p)| p.place.seq == i as u64));
    }
}
