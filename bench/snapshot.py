#!/usr/bin/env python3
"""Classic snapshot benchmark for udm (issue #12): seed 002's table, first writes, merges.

Every comparison is measured in the same run, alternating, median of --repeat runs:

1. Seed 002's table: 4 KiB random writes to the origin at depth 32 with 1, 2, 4 and 8 fio
   jobs, one snapshot, origin and COW device each behind a udm `delay` of 1 ms, against udm
   `linear` over the same delayed origin. Bar: 8 jobs >= 6x one job.
2. First writes: 4 KiB random writes at depth 32 (4 KiB chunks, a fresh snapshot for every
   run, so nearly every write is the first to its chunk) against udm `linear` on the same
   kind of file, with 1 and with 4 snapshots (the cost per snapshot), and a qcow2 external
   overlay (cluster 4 KiB) served by qemu-nbd. Bar: 1 snapshot >= 0.3x linear.
3. Merge: the chunks a snapshot saved copied back by `snapshot-merge`, against a plain copy of
   the same chunks by fio (their COW chunks read, their origin chunks written, fsync at the
   end) on the same disk; then 4 KiB random reads on the merging device against the same
   reads once it is merged. Bars: merge >= 0.9x the copy, reads during >= 0.8x after.

The daemon runs with --nbd-pool-threads 128 (--pool-threads): before deferred completion a
write that saved its chunk waited for its commit on a pool thread, and `delay` slept on one, so
the pool size capped how many were in flight. Now both wait as steps of their mappings on no
thread; --pool-threads 16 (the daemon's default) shows the pool no longer matters.

Usage:  python3 bench/snapshot.py [--runtime 5] [--repeat 3] [--size 1G] [--merge-size 256M]
                                  [--quick] [--out bench/results/snapshot] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import foundation as fnd  # noqa: E402
from common import (  # noqa: E402
    BenchError, base_meta, copy_logs, locate_udm, make_tmpdir, prepare_out_dir, remove_tmp,
    run, stop_daemon, tmp_base, trap_signals,
)
from foundation import (  # noqa: E402
    Udm, Workload, fill_backing_file, find_udm, parse_fio_json, start_service,
    wait_for_socket,
)
from report import human_size, markdown_table, parse_size, write_results  # noqa: E402

SECTOR = 512
POOL_THREADS = 128
JOBS = [1, 2, 4, 8]
# A copy-out's stages as `udm status --json` reports them (mean microseconds each).
STAGES = ["chunk_locks", "origin_read", "cow_write", "commit"]
RANDWRITE = Workload("randwrite-4k-qd32", "randwrite 4k qd32", "randwrite", "4k", 32)
RANDREAD = Workload("randread-4k-qd32", "randread 4k qd32", "randread", "4k", 32)
BAR_SCALING = 6.0
BAR_FIRST_WRITE = 0.3
BAR_MERGE = 0.9
BAR_USER_IO = 0.8


def log(msg: str) -> None:
    print(f"[snapshot] {msg}", file=sys.stderr, flush=True)


common.log = fnd.log = log


class Bench:
    def __init__(self, args, udm_bin: Path, tmp: Path, out: Path):
        self.args, self.tmp, self.out = args, tmp, out
        self.sock = tmp / "nbd.sock"
        self.udm = Udm(udm_bin, tmp / "control.sock")
        self.daemon = start_service(
            "udm", [str(udm_bin), "daemon", "--state-dir", str(tmp / "state"), "--control",
                    str(tmp / "control.sock"), "--nbd", f"unix:{self.sock}",
                    "--nbd-pool-threads", str(args.pool_threads)],
            tmp / "udm.log", env=dict(os.environ, UDM_LOG="info"))
        wait_for_socket(tmp / "control.sock", self.daemon)
        self.qemu = None
        self.runs = 0

    def uri(self, name: str) -> str:
        return f"nbd+unix:///{name}?socket={self.sock}"

    def create(self, name: str, table: str) -> None:
        self.udm.client("create", name, "--table", table)

    def remove(self, name: str) -> None:
        self.udm.client("remove", name)

    def status(self, name: str) -> dict:
        return json.loads(self.udm.client("status", name, "--json").stdout)

    def fio(self, wl: Workload, uri: str, tag: str, jobs: int = 1, extra=()) -> dict:
        """One fio run over NBD; IOPS (all jobs) and mean latency."""
        self.runs += 1
        out_json = self.out / f"{self.runs:03d}-{tag}.json"
        cmd = ["fio", f"--name={tag}", "--ioengine=nbd", f"--uri={uri}", f"--rw={wl.rw}",
               f"--bs={wl.bs}", f"--iodepth={wl.qd}", f"--numjobs={jobs}", "--time_based",
               f"--runtime={self.args.runtime}", f"--size={self.args.size}",
               "--norandommap", "--randrepeat=0", "--group_reporting",
               "--output-format=json", f"--output={out_json}", *extra]
        run(cmd, timeout=self.args.runtime * 10 + 120)
        sample = parse_fio_json(out_json, wl)
        return {"iops": sample.iops, "lat_us": sample.lat_mean_us, "json": out_json.name}

    def daemon_cpu(self) -> float:
        """CPU seconds the daemon has used so far (user and system)."""
        fields = Path(f"/proc/{self.daemon.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def fresh_file(self, name: str, size: int) -> Path:
        """A file of `size` whose every block is written (no unwritten extents to convert on
        the first writes, as on a real logical volume)."""
        path = self.tmp / name
        if not path.exists():
            fill_backing_file(path, size, timeout=600)
        return path

    def blank_cow(self, path: Path) -> None:
        """Makes a COW file blank for a fresh snapshot: zero header (magic 0) and area 0."""
        with open(path, "r+b") as f:
            f.write(bytes(2 * 4096))
            os.fsync(f.fileno())

    # ---------------------------------------------------------------------------- 1. seed

    def seed_table(self) -> dict:
        size = self.args.size
        sectors = size // SECTOR
        origin = self.fresh_file("origin.img", size)
        cow = self.fresh_file("cow0.img", size)
        self.create("odelay", f"0 {sectors} delay {origin} 0 1")
        self.create("cdelay", f"0 {sectors} delay {cow} 0 1")
        self.create("sbase", f"0 {sectors} snapshot-origin odelay")
        self.create("slin", f"0 {sectors} linear odelay 0")
        jobs_list = self.args.jobs
        cells = {(sys_, j): [] for sys_ in ("snapshot", "linear") for j in jobs_list}
        evidence = {j: [] for j in jobs_list}
        for rep in range(self.args.repeat):
            for jobs in jobs_list:
                order = ["snapshot", "linear"] if rep % 2 == 0 else ["linear", "snapshot"]
                for system in order:
                    cpu = self.daemon_cpu()
                    if system == "snapshot":
                        self.blank_cow(cow)
                        self.create("ssnap", f"0 {sectors} snapshot odelay cdelay P 8")
                        r = self.fio(RANDWRITE, self.uri("sbase"), f"seed-snap-j{jobs}", jobs)
                        d = self.status("ssnap")["targets"][0]["details"]
                        self.remove("ssnap")
                    else:
                        r = self.fio(RANDWRITE, self.uri("slin"), f"seed-linear-j{jobs}", jobs)
                    # Where the time goes: the daemon's CPU (of 2 cores: is it CPU-bound?) and,
                    # for the snapshot, how many commits and how many exceptions in each.
                    cpu = (self.daemon_cpu() - cpu) / self.args.runtime
                    seen = f"daemon CPU {cpu:.2f} cores, load {os.getloadavg()[0]:.1f}"
                    if system == "snapshot":
                        commits = d["commits"] / self.args.runtime
                        per = d["exceptions_committed"] / max(d["commits"], 1)
                        seen += f", {commits:.0f} commits/s of {per:.1f} exceptions"
                        # (Older binaries do not time the stages.)
                        st = d.get("copy_out_stages", {})
                        if st:
                            stages = "/".join(f"{st[k + '_us'] / 1000:.1f}" for k in STAGES)
                            seen += f", copy-out ms {'/'.join(STAGES)} {stages}"

                        evidence[jobs].append({"cpu": cpu, "commits_per_s": commits,
                                               "exceptions_per_commit": per, "stages_us": st})
                    log(f"seed: {system} jobs {jobs}: {r['iops']:.0f} IOPS ({seen})")
                    cells[(system, jobs)].append(r["iops"])
        for name in ("sbase", "slin", "cdelay", "odelay"):
            self.remove(name)
        med = {f"{s}-{j}": statistics.median(v) for (s, j), v in cells.items()}
        runs = {f"{s}-{j}": v for (s, j), v in cells.items()}
        return {"median_iops": med, "runs": runs, "snapshot_evidence": evidence}

    # ---------------------------------------------------------------------- 2. first write

    def first_writes(self) -> dict:
        size = self.args.size
        sectors = size // SECTOR
        origin = self.fresh_file("origin.img", size)
        linear = self.fresh_file("linear.img", size)
        cows = [self.fresh_file(f"cow{i}.img", size) for i in range(4)]
        self.create("lin", f"0 {sectors} linear {linear} 0")
        self.create("base", f"0 {sectors} snapshot-origin {origin}")
        overlay = self.tmp / "overlay.qcow2"
        qsock = self.tmp / "qemu.sock"
        systems = ["linear", "snap1", "snap4", "qcow2"]
        cells = {s: [] for s in systems}
        batching = []
        for rep in range(self.args.repeat):
            order = systems if rep % 2 == 0 else systems[::-1]
            for system in order:
                if system == "linear":
                    r = self.fio(RANDWRITE, self.uri("lin"), "fw-linear")
                elif system.startswith("snap"):
                    count = int(system[4:])
                    for i in range(count):
                        self.blank_cow(cows[i])
                        self.create(f"s{i}", f"0 {sectors} snapshot {origin} {cows[i]} P 8")
                    r = self.fio(RANDWRITE, self.uri("base"), f"fw-{system}")
                    d = self.status("s0")["targets"][0]["details"]
                    batching.append(d["exceptions_committed"] / max(d["commits"], 1))
                    for i in range(count):
                        self.remove(f"s{i}")
                else:
                    if overlay.exists():
                        overlay.unlink()
                    run(["qemu-img", "create", "-q", "-f", "qcow2", "-o",
                         f"cluster_size=4096,backing_file={origin},backing_fmt=raw",
                         str(overlay)], timeout=60)
                    q = start_service("qemu-nbd", [
                        "qemu-nbd", "-t", "-e", "8", "-k", str(qsock), "-f", "qcow2",
                        "--cache=none", "--aio=io_uring", str(overlay)],
                        self.tmp / "qemu-nbd.log")
                    try:
                        wait_for_socket(qsock, q)
                        r = self.fio(RANDWRITE, f"nbd+unix:///?socket={qsock}", "fw-qcow2")
                    finally:
                        q.stop()
                log(f"first writes: {system}: {r['iops']:.0f} IOPS")
                cells[system].append(r["iops"])
        self.remove("base")
        self.remove("lin")
        med = {s: statistics.median(v) for s, v in cells.items()}
        return {"median_iops": med, "runs": cells,
                "exceptions_per_commit": statistics.median(batching) if batching else None}

    # ---------------------------------------------------------------------------- 3. merge

    def make_changes(self, origin: Path, cow: Path) -> int:
        """A snapshot of `origin` on a blank `cow`, then every 4 KiB block of the first
        --merge-size of the origin written once in random order: that many chunks saved."""
        sectors = self.args.size // SECTOR
        self.blank_cow(cow)
        self.create("mbase", f"0 {sectors} snapshot-origin {origin}")
        self.create("msnap", f"0 {sectors} snapshot {origin} {cow} P 8")
        run(["fio", "--name=changes", "--ioengine=nbd", f"--uri={self.uri('mbase')}",
             "--rw=randwrite", "--bs=4k", "--iodepth=32", f"--size={self.args.merge_size}",
             "--randrepeat=0", "--output-format=terse"], timeout=900)
        chunks = self.status("msnap")["targets"][0]["details"]["exceptions"]
        self.udm.client("suspend", "mbase")
        self.remove("msnap")
        self.udm.client("load", "mbase", "--table",
                        f"0 {sectors} snapshot-merge {origin} {cow} P 8")
        return chunks

    def merged(self) -> bool:
        progress = self.status("mbase")["targets"][0]["details"]["progress"]
        if progress.get("stopped"):
            raise BenchError(f"merge stopped: {progress['stopped']}")
        return progress["complete"]

    def wait_merged(self) -> float:
        start = time.monotonic()
        while not self.merged():
            time.sleep(0.02)
            if time.monotonic() - start > 900:
                raise BenchError("merge did not finish in 15 minutes")
        return time.monotonic() - start

    def plain_copy(self, origin: Path, cow: Path) -> float:
        """fio copying the same amount the same way: the COW chunks read in order, the origin
        chunks written at random, at once, durable at the end."""
        size = self.args.merge_size
        start = time.monotonic()
        run(["fio", "--ioengine=io_uring", "--direct=1", "--bs=4k", "--iodepth=16",
             f"--size={size}", "--output-format=terse", "--randrepeat=0",
             "--name=read-cow", f"--filename={cow}", "--rw=read", "--offset=8192",
             "--name=write-origin", f"--filename={origin}", "--rw=randwrite",
             "--end_fsync=1"], timeout=900)
        return time.monotonic() - start

    def merges(self) -> dict:
        origin = self.fresh_file("origin.img", self.args.size)
        cow = self.fresh_file("cow0.img", self.args.size)
        merge_s, copy_s, chunks_merged = [], [], []
        for rep in range(self.args.repeat):
            chunks = self.make_changes(origin, cow)
            order = ["merge", "copy"] if rep % 2 == 0 else ["copy", "merge"]
            for what in order:
                if what == "merge":
                    self.udm.client("resume", "mbase")
                    took = self.wait_merged()
                    merge_s.append(took)
                    chunks_merged.append(chunks)
                    log(f"merge: {chunks} chunks in {took:.2f} s")
                else:
                    took = self.plain_copy(origin, cow)
                    copy_s.append(took)
                    log(f"plain copy: {took:.2f} s")
            self.remove("mbase")
        # User reads while merging, against the same reads once merged.
        chunks = self.make_changes(origin, cow)
        self.udm.client("resume", "mbase")
        during = self.fio(RANDREAD, self.uri("mbase"), "merge-reads-during")
        still = not self.merged()
        self.wait_merged()
        after = self.fio(RANDREAD, self.uri("mbase"), "merge-reads-after")
        self.remove("mbase")
        bytes_ = self.args.merge_size
        return {
            "chunks": statistics.median(chunks_merged),
            "merge_seconds": merge_s, "copy_seconds": copy_s,
            "merge_mb_s": bytes_ / statistics.median(merge_s) / 1e6,
            "copy_mb_s": bytes_ / statistics.median(copy_s) / 1e6,
            "reads_during_iops": during["iops"], "reads_after_iops": after["iops"],
            "merge_ran_through_the_reads": still, "chunks_for_reads": chunks,
        }


def ratio(a, b):
    return a / b if a and b else None


def verdict(value, bar) -> str:
    if value is None:
        return "?"
    return "✔" if value >= bar else "✘"


def report(seed, first, merge, meta) -> tuple[str, dict]:
    out = [f"## Classic snapshots (`python3 bench/snapshot.py`, {meta['timestamp']})", ""]
    bars = []
    if seed:
        m = seed["median_iops"]
        rows = [[f"{j}", f"{m[f'snapshot-{j}']:.0f}", f"{m[f'linear-{j}']:.0f}",
                 f"{ratio(m[f'snapshot-{j}'], m[f'linear-{j}']):.2f}x",
                 f"{ratio(m[f'snapshot-{j}'], m.get('snapshot-1')):.2f}x"]
                for j in JOBS if f"snapshot-{j}" in m]
        out += ["### Seed 002's table: origin 4 KiB random writes, depth 32, one snapshot, "
                "origin and COW behind a 1 ms delay", "",
                markdown_table(["fio jobs", "snapshot-origin IOPS", "linear IOPS",
                                "snapshot / linear", "vs 1 job"], rows), ""]
        scaling = ratio(m.get("snapshot-8"), m.get("snapshot-1"))
        bars.append((f"8 jobs >= {BAR_SCALING:g}x one job (seed 002)", scaling, BAR_SCALING))
    if first:
        m = first["median_iops"]
        lin = m["linear"]
        per_snapshot = None
        if m.get("snap4") and lin:
            per_snapshot = (1e6 / m["snap4"] - 1e6 / lin) / 4
        rows = [[label, f"{m[k]:.0f}", f"{ratio(m[k], lin):.2f}x"] for k, label in
                [("linear", "udm linear"), ("snap1", "snapshot-origin, 1 snapshot"),
                 ("snap4", "snapshot-origin, 4 snapshots"),
                 ("qcow2", "qcow2 overlay (qemu-nbd), first writes")]]
        out += ["### First writes: 4 KiB random writes, depth 32, 4 KiB chunks, fresh "
                "snapshots", "", markdown_table(["system", "IOPS", "vs linear"], rows), "",
                f"Exceptions per metadata commit (1 snapshot, median): "
                f"{first['exceptions_per_commit']:.1f}. "
                + (f"Each of 4 snapshots adds {per_snapshot:.0f} µs per write "
                   f"((1/IOPS₄ − 1/IOPS_linear) / 4)." if per_snapshot else ""), ""]
        bars.append((f"first write, 1 snapshot >= {BAR_FIRST_WRITE:g}x linear",
                     ratio(m["snap1"], lin), BAR_FIRST_WRITE))
    if merge:
        rows = [["snapshot-merge", f"{merge['merge_mb_s']:.0f} MB/s",
                 ", ".join(f"{s:.2f}" for s in merge["merge_seconds"])],
                ["plain copy (fio)", f"{merge['copy_mb_s']:.0f} MB/s",
                 ", ".join(f"{s:.2f}" for s in merge["copy_seconds"])]]
        out += [f"### Merge: {merge['chunks']:.0f} chunks of 4 KiB back into the origin", "",
                markdown_table(["copy", "throughput", "every run (s)"], rows), "",
                f"4 KiB random reads at depth 32 on the merging device: "
                f"{merge['reads_during_iops']:.0f} IOPS during the merge "
                f"(merge still running at the end: {merge['merge_ran_through_the_reads']}), "
                f"{merge['reads_after_iops']:.0f} once merged.", ""]
        bars.append((f"merge >= {BAR_MERGE:g}x a plain copy",
                     ratio(merge["merge_mb_s"], merge["copy_mb_s"]), BAR_MERGE))
        bars.append((f"user I/O during the merge >= {BAR_USER_IO:g}x without",
                     ratio(merge["reads_during_iops"], merge["reads_after_iops"]),
                     BAR_USER_IO))
    out.append("Bars:")
    out.append("")
    for name, value, bar in bars:
        shown = f"{value:.2f}x" if value is not None else "not measured"
        out.append(f"- {verdict(value, bar)} {name}: {shown}")
    out += ["", f"Medians of {meta['repeat']} alternating runs of {meta['runtime']} s on "
            f"{meta['size']} files (every block written beforehand); udm daemon with "
            f"--nbd-pool-threads {meta['pool_threads']}; {meta['host']}, {meta['cpus']} CPUs."]
    return "\n".join(out) + "\n", {"bars": [{"name": n, "value": v, "bar": b,
                                             "met": v is not None and v >= b}
                                            for n, v, b in bars]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_sizing_args(ap, runtime=5, size_help="size of each origin and COW file",
                           repeat=True)
    ap.add_argument("--merge-size", type=parse_size, default=None,
                    help="origin bytes changed (4 KiB chunks) before each merge (default "
                         "256M; 32M with --quick)")
    ap.add_argument("--pool-threads", type=int, default=POOL_THREADS,
                    help=f"the daemon's --nbd-pool-threads (default {POOL_THREADS})")
    ap.add_argument("--jobs", type=lambda v: [int(j) for j in v.split(",")], default=JOBS,
                    help="fio job counts of the seed table (default 1,2,4,8)")
    ap.add_argument("--sections", default="seed,first,merge",
                    help="comma-separated subset of seed, first, merge")
    common.add_run_args(ap, out="bench/results/snapshot", out_help="results directory",
                        tmpdir_help="where the files go (default $TMPDIR or /tmp)",
                        keep_help="keep the temporary directory", udm_help="udm binary",
                        charts_help="(no charts: accepted for symmetry)")
    args = ap.parse_args(argv)
    common.resolve_sizing(args)
    if args.merge_size is None:
        args.merge_size = parse_size("32M" if args.quick else "256M")
    if not {1, 8} <= set(args.jobs):
        ap.error("--jobs must include 1 and 8 (the bar is their ratio)")
    sections = {s.strip() for s in args.sections.split(",")}
    if "merge" in sections and args.merge_size * 9 > args.size * 8:
        # Every changed chunk and its metadata go to a COW device as large as the origin.
        ap.error("--merge-size must leave room in the COW device (as large as --size) for "
                 "its metadata: at most 8/9 of --size")
    trap_signals()
    udm_bin = locate_udm(args, find_udm)
    if udm_bin is None:
        return 1
    out = prepare_out_dir(args.out)
    tmp = make_tmpdir(tmp_base(args), "udm-snapshot-", "control.sock")
    if tmp is None:
        return 1
    meta = dict(base_meta(udm_bin), runtime=args.runtime, repeat=args.repeat,
                size=human_size(args.size), merge_size=human_size(args.merge_size),
                pool_threads=args.pool_threads)
    bench = None
    try:
        bench = Bench(args, udm_bin, tmp, out)
        seed = bench.seed_table() if "seed" in sections else None
        first = bench.first_writes() if "first" in sections else None
        merge = bench.merges() if "merge" in sections else None
        table, verdicts = report(seed, first, merge, meta)
        write_results(out, table, {"meta": meta, "seed": seed, "first_writes": first,
                                   "merge": merge, **verdicts})
        return 0
    except (BenchError, subprocess.SubprocessError, OSError) as e:
        log(f"ERROR: {e}")
        return 1
    finally:
        if bench is not None:
            stop_daemon(bench.daemon, grace=30)
            copy_logs([bench.daemon], out)
        remove_tmp(tmp, args.keep)


if __name__ == "__main__":
    sys.exit(main())
