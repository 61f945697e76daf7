#!/usr/bin/env python3
"""Where a request's time goes at depth 32: udm linear over NBD, fio on the file, qemu-nbd.

Issue #10's 4 KiB random rows stop short of the file's IOPS. This script measures why,
without changing the daemon: while fio runs, the kernel's tracepoints (tracefs, an instance of
its own) record every io_uring submission and completion and every block request on the disk
holding the backing file (only those inside the file's extents). From their running counts it
derives how many requests sit in each stage on average, and by Little's law how long each
stage takes per request:

  udm:   client -> received by a loop (recvmsg completion) -> submitted to the engine ->
         queued at the block layer (block_bio_queue) -> issued to the device (block_rq_issue)
         -> completed by it -> engine completion -> reply sent (sendmsg completion) -> client
  file / qemu-nbd: the same without the socket stages (fio's or qemu-nbd's ring).

"rest" is what is left of depth/IOPS: the time a request spends in fio (and libnbd) and
the socket (for qemu-nbd also in its own work outside its ring). It also prints how requests
arrive and leave (requests per receive, replies per send) and how the disk completes them
(completions less than 20 µs apart), which shows whether the depth moves in waves. The
block stages' occupancy is kept by sector (exact); the others are differences of running
counts, offset so that each stage is empty at its emptiest.

Needs root (tracefs) and the same tools as foundation.py.

Usage:  python3 bench/foundation_waves.py [--runtime 3] [--rounds 2]
            [--workloads randwrite-4k-qd32,randread-4k-qd32] [--jobs 2]
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import BenchError, select_workloads, trap_signals  # noqa: E402
from foundation import Run, WORKLOADS, find_udm, parse_jobs, with_jobs  # noqa: E402
from harness import Workload, fio_cmd, parse_fio_json  # noqa: E402

TRACEFS = Path("/sys/kernel/tracing")
EVENTS = ["block/block_bio_queue", "block/block_rq_issue", "block/block_rq_complete",
          "io_uring/io_uring_submit_req", "io_uring/io_uring_complete"]
LINE = re.compile(r"^\s*(.+?)-(\d+)\s+\[\d+\]\s+\S+\s+([\d.]+): (\w+): (.*)$")
SECTOR = re.compile(r"(\d+) \+ (\d+)")
# The udm loop's own entries carry their kind in the low byte of user_data; the engine's
# have the top bit set (udm_uring::is_engine).
RECV, SEND, ENGINE_BIT = 1, 2, 1 << 63


def log(msg: str) -> None:
    print(f"[waves] {msg}", file=sys.stderr, flush=True)


common.log = log


def file_extents(path: Path) -> list:
    """(first sector, end sector) of each extent of `path` on its device."""
    out = subprocess.run(["filefrag", "-v", str(path)], capture_output=True, text=True,
                         check=True).stdout
    block = 4096
    m = re.search(r"blocksize of (\d+)", out)
    if m:
        block = int(m.group(1))
    extents = []
    for line in out.splitlines():
        m = re.match(r"\s*\d+:\s+\d+\.\.\s*\d+:\s+(\d+)\.\.\s*(\d+):", line)
        if m:
            extents.append((int(m.group(1)) * block // 512, (int(m.group(2)) + 1) * block // 512))
    return extents


def threads(pid: int) -> set:
    """The thread ids of process `pid`, as strings (empty once it has gone)."""
    try:
        return {p.name for p in Path(f"/proc/{pid}/task").iterdir()}
    except OSError:
        return set()


def device_of(path: Path) -> int:
    """The kernel's dev_t (major << 20 | minor, as tracepoints print it) of `path`'s disk."""
    st = os.stat(path)
    return os.major(st.st_dev) << 20 | os.minor(st.st_dev)


class Tracer:
    """A tracefs instance recording EVENTS for the disk holding `disk`."""

    def __init__(self, disk: Path):
        self.dir = TRACEFS / "instances" / f"udm-waves-{os.getpid()}"
        self.dir.mkdir(exist_ok=True)
        self.extents = file_extents(disk)
        dev = device_of(disk)
        self._w("buffer_size_kb", "65536")
        for e in EVENTS:
            if e.startswith("block/"):
                self._w(f"events/{e}/filter", f"dev == {dev}")

    def _w(self, name: str, value: str) -> None:
        (self.dir / name).write_text(value)

    def record(self, cmd: list, timeout: float) -> tuple[str, set]:
        """Runs `cmd` (fio, with --thread) traced; the trace and the thread ids fio ran on
        (other fio processes on a shared machine must not count)."""
        self._w("tracing_on", "0")
        self._w("trace", "")
        for e in EVENTS:
            self._w(f"events/{e}/enable", "1")
        self._w("tracing_on", "1")
        tids: set = set()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout
            while proc.poll() is None:
                tids |= threads(proc.pid)
                if time.monotonic() > deadline:
                    proc.kill()
                    raise BenchError(f"{cmd[0]} did not finish in {timeout:.0f} s")
                time.sleep(0.2)
            if proc.returncode:
                raise BenchError(f"{' '.join(cmd)} failed with status {proc.returncode}")
        finally:
            self._w("tracing_on", "0")
            for e in EVENTS:
                self._w(f"events/{e}/enable", "0")
        return (self.dir / "trace").read_text(errors="replace"), tids

    def close(self) -> None:
        try:
            self.dir.rmdir()
        except OSError as e:
            log(f"cannot remove {self.dir}: {e}")

    def mine(self, sector: int) -> bool:
        return any(a <= sector < b for a, b in self.extents)


def parse(text: str, tracer: Tracer, ring_owner) -> dict:
    """The trace as time-stamped stage events: `ring_owner(comm, tid)` says whether a ring
    whose submitter is that thread is the one measured ("server" or "fio") or neither."""
    rings, raw = {}, []
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        comm, tid, ts, event, rest = m.groups()
        ts = float(ts)
        if event.startswith("block_"):
            s = SECTOR.search(rest.split(")")[-1] if event != "block_bio_queue" else rest)
            if s and tracer.mine(int(s.group(1))):
                raw.append((ts, event, None, int(s.group(1)), int(s.group(2))))
            continue
        fields = dict(re.findall(r"(\w+) (\S+?),", rest + ","))
        ring = fields.get("ring")
        if event == "io_uring_submit_req":
            owner = ring_owner(comm, tid)
            if owner:
                rings[ring] = owner
            raw.append((ts, "sqe", ring, int(fields["user_data"], 16), 0))
        elif event == "io_uring_complete":
            raw.append((ts, "cqe", ring, int(fields["user_data"], 16), int(fields["result"])))
    return {"rings": rings, "events": sorted(raw, key=lambda e: e[0])}


def _running_counts(parsed: dict, server: bool) -> tuple:
    """The trace replayed: after each event, how many requests have passed each stage so far
    (`series`, with the final `counts`), and the bytes of each receive and send."""
    rings = parsed["rings"]
    counts = collections.Counter()
    recv_bytes, send_bytes = [], []
    series = []
    queued, device = set(), set()
    for ts, kind, ring, data, result in parsed["events"]:
        if kind in ("sqe", "cqe"):
            owner = rings.get(ring)
            if owner is None:
                continue
            if server:
                low = data & 0xff
                if data & ENGINE_BIT:
                    counts["submitted" if kind == "sqe" else "completed"] += 1
                elif kind == "cqe" and result > 0 and low == RECV:
                    counts["recv_bytes"] += result
                    recv_bytes.append(result)
                elif kind == "cqe" and result > 0 and low == SEND:
                    counts["send_bytes"] += result
                    send_bytes.append(result)
                else:
                    continue
            else:
                counts["submitted" if kind == "sqe" else "completed"] += 1
        else:
            counts[kind] += 1
            # Occupancy of the block stages by sector, exact where counts would drift (a
            # request the block layer merged from several bios is issued once).
            if kind == "block_bio_queue":
                queued.add(data)
            elif kind == "block_rq_issue":
                queued -= {q for q in queued if data <= q < data + max(result, 1)}
                device.add(data)
            else:
                device.discard(data)
            counts["queued"], counts["at_device"] = len(queued), len(device)
        series.append((ts, dict(counts)))
    return counts, series, recv_bytes, send_bytes


def _completion_clusters(events: list) -> list:
    """The sizes of the groups of device completions that came within 20 us of each other."""
    comps = [ts for ts, kind, *_ in events if kind == "block_rq_complete"]
    clusters, cur = [], 1
    for a, b in zip(comps, comps[1:]):
        if b - a < 20e-6:
            cur += 1
        else:
            clusters.append(cur)
            cur = 1
    clusters.append(cur)
    return clusters


def stages(parsed: dict, server: bool, depth: int, iops: float, rest: str) -> dict:
    """Mean requests in each stage and the time per request it makes (Little's law); `rest`
    names what is left of depth / IOPS."""
    counts, series, recv_bytes, send_bytes = _running_counts(parsed, server)
    if len(series) < 2 or not counts["submitted"]:
        return {}
    n = counts["submitted"]
    # Bytes per request on the socket, each way (headers and payloads).
    units = {"recv": counts["recv_bytes"] / n, "send": counts["send_bytes"] / n}
    order = ["submitted", "block_bio_queue", "block_rq_issue", "block_rq_complete",
             "completed"]
    names = ["submit → block layer", "block layer → device", "at the device",
             "device → completion"]
    if server:
        order = ["received"] + order + ["sent"]
        names = ["received → submitted"] + names + ["completed → reply sent"]
    pairs = list(zip(order, order[1:]))
    area = [0.0] * len(pairs)
    lowest = [0.0] * len(pairs)
    t0, prev = series[0][0], series[0][1]
    last = t0
    # Stages whose occupancy is known exactly (not a difference of two running counts).
    exact = {("block_bio_queue", "block_rq_issue"): "queued",
             ("block_rq_issue", "block_rq_complete"): "at_device"}
    for ts, c in series[1:]:
        got = dict(prev)
        if server:
            got["received"] = prev.get("recv_bytes", 0) / units["recv"] if units["recv"] else 0
            got["sent"] = prev.get("send_bytes", 0) / units["send"] if units["send"] else 0
        for i, (a, b) in enumerate(pairs):
            if (a, b) in exact:
                d = got.get(exact[a, b], 0)
            else:
                d = got.get(a, 0) - got.get(b, 0)
            area[i] += d * (ts - last)
            lowest[i] = min(lowest[i], d)
        last, prev = ts, c
    span = last - t0
    out = {}
    for i, name in enumerate(names):
        mean = area[i] / span - lowest[i]
        out[name] = (mean, mean / iops * 1e6)
    used = sum(m for m, _ in out.values())
    out[rest] = (depth - used, (depth - used) / iops * 1e6)
    out["_per_receive"] = _share([round(b / units["recv"]) for b in recv_bytes]) \
        if units["recv"] else ""
    out["_per_send"] = _share([round(b / units["send"]) for b in send_bytes]) \
        if units["send"] else ""
    out["_disk_clusters"] = _share(_completion_clusters(parsed["events"]))
    return out


def _share(sizes: list) -> str:
    """How many requests came in groups of each size range, as shares of all requests."""
    total = sum(sizes) or 1
    ranges = [(1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 1 << 30)]
    return "  ".join(f"{a}{'' if a == b else '-' + str(b) if b < 1 << 30 else '+'}: "
                     f"{100 * sum(s for s in sizes if a <= s <= b) / total:.0f}%"
                     for a, b in ranges)


def main(argv=None) -> int:
    ap = common.bench_parser(
        "Where a request's time goes: udm linear over NBD vs fio on the file vs qemu-nbd, "
        "from kernel tracepoints.", runtime=3, size_help="backing file size (default 1G)",
        repeat=False, out="bench/results/foundation-waves")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    ap.add_argument("--workloads", default="randwrite-4k-qd32,randread-4k-qd32")
    ap.add_argument("--jobs", default="",
                    help="comma-separated fio job counts: each depth-32 row also with N jobs "
                         "at depth 32/N and at depth 32 (as foundation.py --jobs)")
    args = ap.parse_args(argv)
    jobs = parse_jobs(ap, args.jobs)
    common.resolve_sizing(args)
    args.repeat = 1
    if not (TRACEFS / "instances").is_dir():
        log(f"{TRACEFS} is not mounted or not writable (root needed)")
        return 2
    workloads = with_jobs(select_workloads(ap, args.workloads, list(WORKLOADS)), jobs)
    trap_signals()

    def make_run(out_dir, udm_bin, tmp):
        return WavesRun(args, udm_bin, out_dir, tmp, workloads)

    return common.run_bench(args, find_udm, "udm-waves-", "nbdkit.sock", make_run)


class WavesRun(Run):
    def __init__(self, args, udm_bin, out_dir, tmp, workloads):
        super().__init__(args, udm_bin, out_dir, tmp)
        self.workloads = workloads

    def measure_all(self) -> int:
        self.start_udm()
        self.start_peers()
        tracer = Tracer(self.disk)
        daemon = threads(self.daemon.proc.pid)
        qemu = self.sysmap["qemu-nbd"]
        qemu = threads(qemu.service.proc.pid) if qemu.available else set()
        # Whose rings count: the udm loops', fio's own (its tids, known once it runs), qemu-nbd's.
        owners = {
            "udm-linear": lambda comm, tid, fio: tid in daemon and comm.startswith("nbd-loop"),
            "file": lambda comm, tid, fio: tid in fio,
            "qemu-nbd": lambda comm, tid, fio: tid in qemu,
        }
        try:
            for wl in self.workloads:
                for rnd in range(1, self.args.rounds + 1):
                    keys = list(owners) if rnd % 2 else list(reversed(owners))
                    for key in keys:
                        self.one(tracer, wl, key, owners[key], rnd)
        finally:
            tracer.close()
        return 0

    def one(self, tracer: Tracer, wl: Workload, key: str, owner, rnd: int) -> None:
        system = self.sysmap[key]
        if not system.available:
            return
        out = self.out_dir / f"{wl.key}.{key}.r{rnd}.json"
        text, fio = tracer.record(fio_cmd(wl, system, self.args, out) + ["--thread"],
                                  self.args.runtime + 60)
        smp = parse_fio_json(out, wl)
        load = Path("/proc/loadavg").read_text().split()[0]
        parsed = parse(text, tracer, lambda comm, tid: owner(comm, tid, fio))
        rest = {"udm-linear": "rest: client and socket", "file": "rest: fio",
                "qemu-nbd": "rest: client, socket, qemu-nbd"}[key]
        st = stages(parsed, key == "udm-linear", wl.qd * wl.jobs, smp.iops, rest)
        print(f"\n{wl.key} {key} r{rnd}: {smp.iops:.0f} IOPS, p99 {smp.lat_p99_us:.0f} µs, "
              f"load {load}, {len(text.splitlines())} trace lines")
        lost = sum(int(n) for n in re.findall(r"LOST (\d+) EVENTS", text))
        used = sum(v[0] for k, v in st.items() if not k.startswith(("_", "rest")))
        if lost or used > wl.qd * wl.jobs:
            # Counts that drift (a lost completion never leaves its stage) make stages hold
            # more than the depth.
            print(f"  WARNING: the trace lost {lost} events; stages hold {used:.0f} requests "
                  f"for a depth of {wl.qd * wl.jobs}: read the stage times as unreliable")
        for name, value in st.items():
            if name.startswith("_"):
                print(f"  {name[1:].replace('_', ' ')} (share of requests): {value}")
            else:
                print(f"  {name:<32} {value[0]:5.1f} requests  {value[1]:7.1f} µs each")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
