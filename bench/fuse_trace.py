#!/usr/bin/env python3
"""Where a 4 KiB request through a loop device on udm's FUSE file waits: a per-request
timeline from the kernel's tracepoints (root, tracefs), for one transport at a time.

One daemon (`--fuse-uring on` or `off`) with `vol` = `linear disk.img 0`, `udm attach vol`,
fio (io_uring, O_DIRECT, depth 32) on the loop device; for `--window` seconds in the middle of
the run the fuse, io_uring, block and sched tracepoints are on. The report:

* per request over io_uring, matched by ring entry (the COMMIT_AND_FETCH that answers a
  request is followed by its fuse_request_end): the kernel queues it (fuse_request_send) ->
  the entry's command completes in udm's ring (the request has reached the queue thread) ->
  udm submits the disk I/O (the engine's piece) -> the disk I/O completes in the ring ->
  udm submits COMMIT_AND_FETCH -> the kernel ends the request (the payload copied back);
* for both transports: fuse_request_send -> fuse_request_end, the block layer's issue ->
  complete on each device (the loop device and the disk under disk.img), which tasks queued
  and ended the FUSE requests and on which CPU, and each CPU's time by task (sched_switch).

Usage:  python3 bench/fuse_trace.py [--fuse-uring on|off] [--rw randread|randwrite]
                                    [--runtime 4] [--window 0.5] [--size 1G] [--keep-trace]

Figures taken on a loaded machine mostly show the load (who else runs on the queue's CPU);
compare the phases, not the totals, and say the load average.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from fuse import start_udm_fuse  # noqa: E402
from harness import fill_backing_file, find_udm  # noqa: E402
from report import parse_size  # noqa: E402
from loops import detach_loop, unmount_fuse  # noqa: E402

TRACEFS = Path("/sys/kernel/tracing")
EVENTS = ["fuse/fuse_request_send", "fuse/fuse_request_end", "io_uring/io_uring_complete",
          "io_uring/io_uring_submit_req", "io_uring/io_uring_queue_async_work",
          "block/block_rq_issue", "block/block_rq_complete", "sched/sched_switch"]
LINE = re.compile(r"^\s*(.+?)-(\d+)\s+\[(\d+)\]\s+\S+\s+([\d.]+): (\w+): (.*)$")
# udm's engine marks its pieces' user_data with bit 63 (udm_uring::ENGINE_TAG) and puts the
# request's tag (the ring entry) above its PIECE_BITS; a ring entry's commands carry the
# entry's index, which is small.
ENGINE_BIT = 1 << 63
PIECE_BITS = 20
DISK_OPS = {"READ", "WRITE", "READV", "WRITEV", "READ_FIXED", "WRITE_FIXED"}
PHASES = ["queued -> in udm's ring", "in ring -> disk I/O submitted",
          "submitted -> at the disk (block issue)", "at the disk (block issue -> complete)",
          "disk done -> completion in udm's ring", "completed -> committed",
          "committed -> request ended", "total"]


def log(msg: str) -> None:
    print(f"[fuse_trace] {msg}", file=sys.stderr, flush=True)


common.log = log


def tracing(on: bool) -> None:
    for event in EVENTS:
        (TRACEFS / "events" / event / "enable").write_text("1" if on else "0")


def capture(args, udm_bin: Path, tmp: Path, out: Path) -> str:
    """Runs the setup and fio, tracing the window; returns fio's terse line."""
    disk = tmp / "disk.img"
    fill_backing_file(disk, args.size, timeout=600)
    udms: list = []
    loop = None
    try:
        inst = start_udm_fuse(udms, "udm", udm_bin, tmp, "", disk, args.size,
                              ["--fuse-uring", args.fuse_uring])
        loop = inst.udm.client("attach", "vol", timeout=60).stdout.strip()
        fio = subprocess.Popen(
            ["fio", "--name=trace", "--ioengine=io_uring", "--direct=1", f"--filename={loop}",
             f"--rw={args.rw}", "--bs=4k", "--iodepth=32", "--time_based",
             f"--runtime={args.runtime}", "--randrepeat=1", "--output-format=terse",
             "--terse-version=3"], stdout=subprocess.PIPE, text=True)
        time.sleep(max(0.0, (args.runtime - args.window) / 2))
        (TRACEFS / "trace").write_text("")
        (TRACEFS / "buffer_size_kb").write_text("65536")
        tracing(True)
        try:
            time.sleep(args.window)
        finally:
            tracing(False)
        shutil.copyfile(TRACEFS / "trace", out)
        return fio.communicate(timeout=args.runtime + 60)[0]
    finally:
        if loop:
            detach_loop(loop)
        for inst in udms:
            unmount_fuse(inst.fuse_dir)
            inst.daemon.stop()


def dist(values: list) -> str:
    if not values:
        return "none"
    v = sorted(values)
    n = len(v)
    return (f"n={n:6d}  p50 {v[n // 2] * 1e6:6.0f}  p90 {v[n * 9 // 10] * 1e6:6.0f}  "
            f"mean {statistics.mean(v) * 1e6:6.0f} µs")


class Timeline:
    """The trace, read once."""

    def __init__(self):
        self.sent = {}                     # unique -> time queued
        self.latency = []                  # fuse_request_send -> fuse_request_end
        self.block_issued = {}             # (device, sector) -> time
        self.block = collections.defaultdict(list)
        self.queued_by = collections.Counter()
        self.ended_by = collections.Counter()
        self.cpu_time = collections.defaultdict(collections.Counter)
        self.last_switch = {}
        self.punted = 0
        # io_uring path: (ring, entry) -> time its command completed (a request came in);
        # (ring, user_data) of engine pieces -> submitted / completed; entry of each piece.
        self.arrived = {}
        self.piece_sub, self.piece_done, self.piece_entry = {}, {}, {}
        # The block request a piece became: the queue thread issues its pieces to the disk in
        # the same enter that submits them, in order (one plug); then its completion time.
        self.submitting = collections.defaultdict(collections.deque)  # pid -> pieces
        self.piece_of_block = {}           # (device, sector) -> piece
        self.piece_issue, self.piece_disk = {}, {}
        self.committing = None             # (ring, entry, time) until its request ends
        self.phases = {p: [] for p in PHASES}

    def feed(self, line: str) -> None:
        m = LINE.match(line)
        if not m:
            return
        comm, pid, cpu, ts, event, rest = m.groups()
        ts = float(ts)
        task = re.sub(r"[\d.:/-]+$", "", comm.strip())
        if event == "fuse_request_send":
            self.sent[unique(rest)] = ts
            self.queued_by[f"{task} on CPU {int(cpu)}"] += 1
        elif event == "fuse_request_end":
            self.ended(unique(rest), ts, task, cpu)
        elif event in ("io_uring_complete", "io_uring_submit_req"):
            self.ring_event(event, rest, ts, pid)
        elif event == "io_uring_queue_async_work":
            self.punted += 1
        elif event in ("block_rq_issue", "block_rq_complete"):
            device = rest.split()[0]
            sector = rest.split(") ")[1].split()[0] if ") " in rest else ""
            if event == "block_rq_issue":
                self.block_issued[(device, sector)] = ts
                pieces = self.submitting.get(pid)
                if pieces:
                    piece = pieces.popleft()
                    self.piece_of_block[(device, sector)] = piece
                    self.piece_issue[piece] = ts
            elif (device, sector) in self.block_issued:
                self.block[device].append(ts - self.block_issued.pop((device, sector)))
                piece = self.piece_of_block.pop((device, sector), None)
                if piece:
                    self.piece_disk[piece] = ts
        elif event == "sched_switch":
            prev = re.sub(r"[\d.:/-]+$", "", rest.split("prev_comm=")[1].split(" prev_pid")[0])
            if cpu in self.last_switch:
                self.cpu_time[int(cpu)][prev] += ts - self.last_switch[cpu]
            self.last_switch[cpu] = ts

    def ring_event(self, event: str, rest: str, ts: float, pid: str) -> None:
        ring = rest.split(",")[0].split()[-1]
        data = int(re.search(r"user_data (0x[0-9a-f]+)", rest).group(1), 16)
        engine = bool(data & ENGINE_BIT)
        if not engine and data > 1 << 16:
            return                         # fio's own ring
        if event == "io_uring_complete":
            if engine:
                self.piece_done[(ring, data)] = ts
            else:
                self.arrived[(ring, data)] = ts
            return
        op = re.search(r"opcode (\w+)", rest).group(1)
        if engine and op in DISK_OPS:
            self.piece_sub[(ring, data)] = ts
            self.submitting[pid].append((ring, data))
            self.piece_entry[(ring, data)] = (ring, (data & ~ENGINE_BIT) >> PIECE_BITS)
        elif not engine and op == "URING_CMD":
            self.committing = (ring, data, ts)

    def ended(self, uid: str, ts: float, task: str, cpu: str) -> None:
        self.ended_by[f"{task} on CPU {int(cpu)}"] += 1
        if uid in self.sent:
            self.latency.append(ts - self.sent[uid])
        if not self.committing:
            return
        ring, entry, committed = self.committing
        self.committing = None
        pieces = [k for k, e in self.piece_entry.items() if e == (ring, entry)]
        for k in pieces:
            del self.piece_entry[k]
        if len(pieces) != 1 or uid not in self.sent or (ring, entry) not in self.arrived:
            return
        piece = pieces[0]
        if any(piece not in d for d in (self.piece_sub, self.piece_issue, self.piece_disk,
                                          self.piece_done)):
            return
        marks = [self.sent[uid], self.arrived[(ring, entry)], self.piece_sub[piece],
                 self.piece_issue.pop(piece), self.piece_disk.pop(piece),
                 self.piece_done[piece], committed, ts]
        if any(b < a for a, b in zip(marks, marks[1:])):
            return
        for phase, a, b in zip(PHASES, marks, marks[1:]):
            self.phases[phase].append(b - a)
        self.phases["total"].append(ts - marks[0])


def unique(rest: str) -> str:
    return re.search(r"req (\d+)", rest).group(1)


def report(t: Timeline) -> None:
    print(f"FUSE request queued -> ended   {dist(t.latency)}")
    if t.phases["total"]:
        print(f"over io_uring, per request ({len(t.phases['total'])} of {len(t.latency)} matched "
              f"to their ring entry and disk request):")
        for phase in PHASES:
            print(f"  {phase:40s} {dist(t.phases[phase])}")
    for device, values in sorted(t.block.items()):
        print(f"block {device:8s} issue -> complete {dist(values)}")
    print("requests queued by:", ", ".join(f"{k} {v}" for k, v in t.queued_by.most_common(4)))
    print("requests ended by: ", ", ".join(f"{k} {v}" for k, v in t.ended_by.most_common(4)))
    print(f"io_uring requests punted to io-wq workers: {t.punted}")
    for cpu, tasks in sorted(t.cpu_time.items()):
        total = sum(tasks.values()) or 1
        share = ", ".join(f"{k} {v / total:.0%}" for k, v in tasks.most_common(6))
        print(f"CPU {cpu}: {share}")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fuse-uring", choices=("on", "off"), default="on")
    ap.add_argument("--rw", choices=("randread", "randwrite"), default="randread")
    ap.add_argument("--runtime", type=float, default=4)
    ap.add_argument("--window", type=float, default=0.5, help="seconds traced (default 0.5)")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"),
                    help="size of disk.img and the device (default 1G)")
    ap.add_argument("--udm", default=None, help="the udm binary (default target/release/udm)")
    ap.add_argument("--no-build", action="store_true", help="never run cargo build")
    ap.add_argument("--tmpdir", default=None)
    ap.add_argument("--keep-trace", default=None, help="copy the raw trace to this file")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not (TRACEFS / "events" / "fuse").is_dir():
        log(f"ERROR: no fuse tracepoints under {TRACEFS} (root and tracefs needed)")
        return 2
    udm_bin = find_udm(args)
    tmp = Path(tempfile.mkdtemp(prefix="udm-fuse-trace.", dir=common.tmp_base(args)))
    out = tmp / "trace.txt"
    try:
        terse = capture(args, udm_bin, tmp, out).split(";")
        iops = int(terse[7]) + int(terse[48])
        load = Path("/proc/loadavg").read_text().split()[:3]
        print(f"--fuse-uring {args.fuse_uring}, {args.rw} 4k depth 32: {iops} IOPS "
              f"(traced {args.window} s of {args.runtime} s), load average {' '.join(load)}")
        timeline = Timeline()
        with open(out, errors="replace") as f:
            for line in f:
                timeline.feed(line)
        report(timeline)
        if args.keep_trace:
            shutil.copyfile(out, args.keep_trace)
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
