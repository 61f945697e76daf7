//! FUSE over io_uring (Linux 6.14+): requests reach the export through ring entries registered
//! on /dev/fuse instead of read()/write() on it, one queue per CPU, and the READs and WRITEs
//! that the devices can map go to the io_uring engine on the queue's own ring.
//!
//! The protocol, in the kernel's terms (fs/fuse/dev_uring.c): after INIT has agreed on
//! FUSE_OVER_IO_URING, every queue (one per possible CPU) sends FUSE_IO_URING_CMD_REGISTER for
//! each of its entries (an IORING_OP_URING_CMD on /dev/fuse, 128-byte SQE, two iovecs: a
//! header buffer and a payload buffer). Requests wait in the kernel until every queue has
//! an entry; from then on the command of an entry completes when a request is in its
//! buffers, and FUSE_IO_URING_CMD_COMMIT_AND_FETCH hands the reply back and waits for the next.
//! FORGET and INTERRUPT still come through /dev/fuse, so one /dev/fuse worker stays.
//! A refused REGISTER turns io_uring off for the connection: requests then come through
//! /dev/fuse, and the export starts its usual workers.

mod plan;
mod pool;
mod queue;
mod slot;

use log::info;

pub(crate) use pool::{jobs, run as run_pool};
pub(crate) use queue::Queue;

/// The fuse module's switch: the kernel offers FUSE_OVER_IO_URING at INIT only while it is Y.
const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";
const POSSIBLE_CPUS: &str = "/sys/devices/system/cpu/possible";

/// Makes sure the next mount's INIT will offer FUSE over io_uring: io_uring works in this
/// process, the fuse module has the switch, and the switch is on — turned on here if it is
/// off and we may (root). Err: one line saying why not.
pub fn enable_kernel_support() -> Result<(), String> {
    udm_uring::probe()?;
    let value = match std::fs::read_to_string(ENABLE_URING) {
        Ok(value) => value,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!(
                "the kernel's fuse module cannot serve over io_uring ({ENABLE_URING} is \
                 missing: it needs Linux 6.14+ built with CONFIG_FUSE_IO_URING)"
            ))
        }
        Err(e) => return Err(format!("reading {ENABLE_URING}: {e}")),
    };
    if value.trim() == "Y" {
        return Ok(());
    }
    // SAFETY: plain getter.
    if unsafe { libc::geteuid() } != 0 {
        return Err(format!(
            "FUSE over io_uring is off ({ENABLE_URING} is {}) and only root can turn it on",
            value.trim()
        ));
    }
    std::fs::write(ENABLE_URING, "Y").map_err(|e| {
        format!(
            "FUSE over io_uring is off and turning it on failed (writing Y to {ENABLE_URING}: {e})"
        )
    })?;
    info!("fuse: turned FUSE over io_uring on (wrote Y to {ENABLE_URING})");
    Ok(())
}

/// The queues for a mount: one per possible CPU, as many as the kernel makes, each with
/// `depth` entries of `payload_len` bytes shared by `threads` threads (a [`Queue`] each, in
/// order of qid), and at most `reads` reads at the disk (0: no bound), dealt out like the
/// entries (at least one to each thread). Made before the mount, so that nothing but the kernel's own answer to
/// REGISTER can fail once INIT has agreed on io_uring (the kernel holds every request until
/// all queues have registered).
pub(crate) fn prepare(
    depth: u16,
    threads: u16,
    reads: u16,
    payload_len: usize,
) -> Result<Vec<Queue>, String> {
    enable_kernel_support()?;
    let count = possible_cpus()?;
    let queues = u16::try_from(count)
        .map_err(|_| format!("{count} possible CPUs are more queues than FUSE takes"))?;
    let mut rings = Vec::new();
    for qid in 0..queues {
        // Every thread may read: a share of 0 would mean no bound.
        let reads = shares(reads, threads).map(|share| share.max(u16::from(reads > 0)));
        for (thread, (entries, reads)) in shares(depth, threads).zip(reads).enumerate() {
            rings.push(Queue::new(qid, thread as u16, entries, reads, payload_len)?);
        }
    }
    Ok(rings)
}

/// `depth` entries dealt out to `threads` threads as evenly as they go.
fn shares(depth: u16, threads: u16) -> impl Iterator<Item = u16> {
    (0..threads).map(move |t| depth / threads + u16::from(t < depth % threads))
}

/// The number of possible CPUs (the kernel's num_possible_cpus(), which may exceed the
/// online ones): "0-3", "0,2-5".
fn possible_cpus() -> Result<usize, String> {
    let text = std::fs::read_to_string(POSSIBLE_CPUS)
        .map_err(|e| format!("reading {POSSIBLE_CPUS}: {e}"))?;
    count_cpus(&text).ok_or_else(|| format!("{POSSIBLE_CPUS} reads {:?}", text.trim()))
}

fn count_cpus(list: &str) -> Option<usize> {
    list.trim().split(',').try_fold(0, |count, range| {
        let (first, last) = match range.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => {
                let cpu = range.parse().ok()?;
                (cpu, cpu)
            }
        };
        Some(count + last.checked_sub(first)? + 1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_dealt_out_evenly() {
        assert_eq!(shares(32, 2).collect::<Vec<_>>(), [16, 16]);
        assert_eq!(shares(5, 2).collect::<Vec<_>>(), [3, 2]);
        assert_eq!(shares(7, 1).collect::<Vec<_>>(), [7]);
    }

    #[test]
    fn cpu_lists_are_counted() {
        assert_eq!(count_cpus("0-1\n"), Some(2));
        assert_eq!(count_cpus("0"), Some(1));
        assert_eq!(count_cpus("0,2-5"), Some(5));
        assert_eq!(count_cpus("3-1"), None);
        assert_eq!(count_cpus(""), None);
    }
}
