#!/usr/bin/env python3
"""Foundation benchmark for udm: the NBD transport and raw passthrough, side by side.

Pairs (see docs/benchmarks.md in the shared docs):

* udm ``zero`` target   vs  ``nbdkit null``            (the transport's ceiling)
* udm ``linear`` target vs  ``qemu-nbd -f raw``        (raw passthrough over the same file)
                        and ``nbdkit file``
* fio straight on the file (io_uring, O_DIRECT)        (the physical floor, the limit column)

Every figure that matters is a ratio measured in this run: the systems alternate per workload
(udm next to its peers, the order reversed every other repeat), each workload is repeated
``--repeat`` times and the median is reported, with the latency (mean, p99) and the server's
CPU time per I/O of each system, and issue #10's bars judged under the table.

Usage:  python3 bench/foundation.py [--runtime SECONDS] [--size 1G] [--repeat 3] [--quick]
                                    [--out bench/results/foundation] [--keep]

Only the Python standard library is needed; matplotlib (Debian: python3-matplotlib) draws the
charts.  If the running interpreter lacks matplotlib but /usr/bin/python3 has it, the script
re-executes itself there; if no interpreter has it, the table is still printed and the charts
are skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import (  # noqa: E402
    REPO, BenchError, _pdeathsig, copy_logs, fio_cell, import_pyplot, locate_udm, make_tmpdir,
    prepare_out_dir, remove_tmp, run, select_workloads, stop_daemon, tmp_base, tool_version,
    trap_signals,
)
from report import (  # noqa: E402
    exit_code, fmt_cpu, fmt_lat, fmt_ratio, fmt_value, human_size, is_below, judge, markdown_table,
    page_cache_note, table_footer, write_results,
)

# Which Debian package installs each external tool.
PACKAGES = {
    "fio": "fio",
    "nbdkit": "nbdkit",
    "qemu-nbd": "qemu-utils",
    "nbdinfo": "libnbd-bin",
    "cargo": "cargo (or rustup)",
}


# --------------------------------------------------------------------------------------------
# matplotlib: optional, and possibly only in the system interpreter
# --------------------------------------------------------------------------------------------

def _maybe_reexec_for_matplotlib() -> None:
    """Re-run under /usr/bin/python3 when this interpreter (e.g. a pyenv one) lacks matplotlib."""
    common.maybe_reexec_for_matplotlib(__file__)


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[foundation] {msg}", file=sys.stderr, flush=True)


# common's helpers (run, ...) log through its module-level `log`; make them speak with this
# script's prefix (clone.py and fuse.py point both at their own).
common.log = log


@dataclass
class Service:
    """A long-running process we started (daemon or peer)."""
    name: str
    proc: subprocess.Popen
    logfile: Path
    _fh: object = None
    cmd: list = field(default_factory=list)
    env: dict | None = None
    cwd: Path | None = None
    socket: Path | None = None
    restarts: int = 0

    def restart(self) -> None:
        """Start the same command again (used for peers that went away between runs)."""
        self.stop(grace=5)
        if self.socket is not None:
            try:
                self.socket.unlink()
            except FileNotFoundError:
                pass
        self._fh = open(self.logfile, "ab")
        log(f"restarting {self.name}: {' '.join(map(str, self.cmd))}")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self._fh,
                                     stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                     start_new_session=True, preexec_fn=_pdeathsig)
        self.restarts += 1
        if self.socket is not None:
            wait_for_socket(self.socket, self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                log(f"{self.name} did not exit on SIGTERM within {grace:.0f}s; SIGKILL")
                try:
                    self.proc.kill()
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    log(f"{self.name} (pid {self.proc.pid}) still alive after SIGKILL")
        if self._fh:
            try:
                self._fh.close()
            except Exception:
                pass
            self._fh = None

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.logfile.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def start_service(name: str, cmd, logfile: Path, env=None, cwd=None) -> Service:
    fh = open(logfile, "wb")
    log(f"starting {name}: {' '.join(map(str, cmd))}")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                            env=env, cwd=cwd, start_new_session=True, preexec_fn=_pdeathsig)
    return Service(name=name, proc=proc, logfile=logfile, _fh=fh, cmd=list(cmd), env=env,
                   cwd=cwd)


def wait_for_socket(path: Path, svc: Service, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    last_err = None
    while time.monotonic() < deadline:
        if not svc.alive():
            raise BenchError(f"{svc.name} exited (code {svc.proc.returncode}) before creating "
                             f"{path}; log tail:\n{svc.log_tail()}")
        if path.exists():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(2)
            try:
                s.connect(str(path))
                return
            except OSError as e:
                last_err = e
            finally:
                s.close()
        time.sleep(0.05)
    raise BenchError(f"{svc.name}: socket {path} not ready after {timeout:.0f}s ({last_err}); "
                     f"log tail:\n{svc.log_tail()}")


# --------------------------------------------------------------------------------------------
# workloads and systems
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    key: str       # file-name friendly
    label: str     # table label
    rw: str
    bs: str
    qd: int

    @property
    def direction(self) -> str:
        return "read" if "read" in self.rw else "write"

    @property
    def metric(self) -> str:
        return "iops" if self.bs == "4k" else "mbps"


WORKLOADS = [
    Workload("randread-4k-qd1", "randread 4k qd1", "randread", "4k", 1),
    Workload("randwrite-4k-qd1", "randwrite 4k qd1", "randwrite", "4k", 1),
    Workload("randread-4k-qd32", "randread 4k qd32", "randread", "4k", 32),
    Workload("randwrite-4k-qd32", "randwrite 4k qd32", "randwrite", "4k", 32),
    Workload("write-256k-qd32", "write 256k qd32", "write", "256k", 32),
    Workload("read-256k-qd32", "read 256k qd32", "read", "256k", 32),
]


@dataclass
class System:
    key: str            # e.g. "udm-zero"
    label: str          # e.g. "udm zero"
    engine_args: list   # fio arguments selecting the target
    service: Service | None = None   # process that must be alive for the run
    available: bool = True
    why_unavailable: str = ""


@dataclass
class Sample:
    value: float        # IOPS or MB/s depending on workload.metric
    iops: float
    mbps: float
    lat_mean_us: float
    lat_p99_us: float
    json_path: Path
    ios: int = 0                        # I/Os fio completed (every direction)
    fio_cpu_s: float | None = None      # fio's own usr+sys CPU seconds
    cpu_us_per_io: float | None = None  # the server's (or, on the file, fio's) CPU per I/O


@dataclass
class Cell:
    samples: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    def median(self, attr: str):
        vals = [getattr(s, attr) for s in self.samples if getattr(s, attr) is not None]
        vals = [v for v in vals if not (isinstance(v, float) and math.isnan(v))]
        return statistics.median(vals) if vals else None


def fio_cmd(wl: Workload, system: System, args, out_json: Path) -> list:
    return [
        "fio", f"--name={wl.key}", *system.engine_args,
        f"--rw={wl.rw}", f"--bs={wl.bs}", f"--iodepth={wl.qd}", "--numjobs=1",
        "--time_based", f"--runtime={args.runtime}", f"--size={args.size}",
        "--randrepeat=1", "--group_reporting", "--output-format=json",
        f"--output={out_json}",
    ]


def parse_fio_json(path: Path, wl: Workload) -> Sample:
    text = path.read_text(errors="replace")
    start = text.find("{")
    if start < 0:
        raise BenchError(f"no JSON in {path}")
    data = json.loads(text[start:])
    job = data["jobs"][0]
    if job.get("error", 0):
        raise BenchError(f"fio job error {job['error']} in {path}")
    side = job[wl.direction]
    if not side.get("total_ios", side.get("io_bytes", 0)):
        raise BenchError(f"fio did no {wl.direction} I/O in {path}")
    clat = side.get("clat_ns", {})
    pct = clat.get("percentile", {}) or {}
    p99 = pct.get("99.000000")
    iops = float(side["iops"])
    mbps = float(side["bw_bytes"]) / 1e6
    ios = sum(int(job.get(d, {}).get("total_ios", 0)) for d in ("read", "write", "trim"))
    # usr_cpu / sys_cpu are percentages of the job's run time.
    fio_cpu_s = (float(job.get("usr_cpu", 0)) + float(job.get("sys_cpu", 0))) / 100.0 \
        * float(job.get("job_runtime", 0)) / 1000.0
    return Sample(
        value=iops if wl.metric == "iops" else mbps,
        iops=iops, mbps=mbps,
        lat_mean_us=float(clat.get("mean", float("nan"))) / 1000.0,
        lat_p99_us=(float(p99) / 1000.0) if p99 is not None else float("nan"),
        json_path=path, ios=ios, fio_cpu_s=fio_cpu_s,
    )


# --------------------------------------------------------------------------------------------
# udm client verbs
# --------------------------------------------------------------------------------------------

class Udm:
    """The udm client verbs, talking to our daemon's control socket."""

    def __init__(self, binary: Path, control: Path):
        self.binary = binary
        self.control = control
        self.env = dict(os.environ, UDM_CONTROL=str(control))

    def client(self, *verb_args, timeout: float = 30.0, check: bool = True):
        cmd = [str(self.binary), "--control", str(self.control), *verb_args]
        cp = run(cmd, timeout=timeout, env=self.env, check=False, quiet=True)
        if cp.returncode == 0:
            return cp
        msg = (f"`{' '.join(cmd)}` failed with exit {cp.returncode}\n"
               f"  stdout: {cp.stdout.strip()[-1500:]}\n  stderr: {cp.stderr.strip()[-1500:]}")
        if check:
            raise BenchError(msg)
        log(msg)
        return None


def find_udm(args) -> Path:
    if args.udm:
        p = Path(args.udm).resolve()
        if not os.access(p, os.X_OK):
            raise BenchError(f"--udm {p} is not an executable file")
        return p
    target_dir = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    if not target_dir.is_absolute():
        target_dir = REPO / target_dir
    binary = target_dir / "release" / "udm"
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    if args.no_build:
        raise BenchError(f"{binary} does not exist and --no-build was given")
    if not shutil.which("cargo"):
        raise BenchError(f"{binary} does not exist and cargo is not installed "
                         f"(install {PACKAGES['cargo']})")
    log(f"{binary} missing: running `cargo build --release -p udm` (this can take minutes)")
    run(["cargo", "build", "--release", "-p", "udm"], cwd=REPO, timeout=3600)
    if not binary.is_file():
        raise BenchError(f"cargo build succeeded but {binary} does not exist")
    return binary


# --------------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------------


PAIRS = [("udm-zero", "nbdkit-null"), ("udm-linear", "qemu-nbd"), ("udm-linear", "nbdkit-file")]

# Issue #10's bars for udm linear over NBD, judged on the medians of one run.
BAR_FILE = {"randread-4k-qd32": 0.7, "randwrite-4k-qd32": 0.7,     # linear / fio on file
            "write-256k-qd32": 0.9, "read-256k-qd32": 0.9}
BAR_P99 = 2.0              # linear p99 / file p99 at depth 32, at most
BAR_PEER_4K_QD32 = 1.5     # linear / qemu-nbd and linear / nbdkit file at 4 KiB depth 32
BAR_PEER_OTHER = 1.0       # ... and on every other row
PEERS = ("qemu-nbd", "nbdkit-file")


def bar_lines(wl: Workload, ratio, p99_ratio, labels: dict) -> list:
    """(text, ok) for each of issue #10's bars on this workload's row; ok None = no data."""
    out = []
    if wl.key in BAR_FILE:
        r, bar = ratio(wl, "udm-linear", "file"), BAR_FILE[wl.key]
        out.append((f"{wl.label}: udm linear / fio on file = "
                    + ("—" if r is None else f"{r:.2f}×") + f" (≥ {bar}×)",
                    None if r is None else judge(r, bar)))
    if wl.qd == 32:
        r = p99_ratio(wl)
        out.append((f"{wl.label}: p99 udm linear / fio on file = "
                    + ("—" if r is None else f"{r:.2f}×") + f" (≤ {BAR_P99}×)",
                    None if r is None else judge(r, BAR_P99, at_most=True)))
    bar = BAR_PEER_4K_QD32 if (wl.bs == "4k" and wl.qd == 32) else BAR_PEER_OTHER
    for peer in PEERS:
        r = ratio(wl, "udm-linear", peer)
        out.append((f"{wl.label}: udm linear / {labels[peer]} = "
                    + ("—" if r is None else f"{r:.2f}×") + f" (≥ {bar}×)",
                    None if r is None else judge(r, bar)))
    return out


def build_table(results, systems, meta) -> tuple[str, dict]:
    labels = {s.key: s.label for s in systems}
    keys = [s.key for s in systems]

    def cell(wl, key):
        return results.get((wl.key, key))

    def med(wl, key, attr="value"):
        c = cell(wl, key)
        return c.median(attr) if c else None

    def ratio(wl, a, b, attr="value"):
        va, vb = med(wl, a, attr), med(wl, b, attr)
        if va is None or vb is None or vb == 0:
            return None
        return va / vb

    def p99_ratio(wl):
        return ratio(wl, "udm-linear", "file", "lat_p99_us")

    thr_rows, lat_rows, cpu_rows = [], [], []
    below = []
    bars = []
    ratios = {p: [] for p in PAIRS}
    summary = {}
    for wl in WORKLOADS:
        r_zero = ratio(wl, "udm-zero", "nbdkit-null")
        r_qemu = ratio(wl, "udm-linear", "qemu-nbd")
        r_nbdkit = ratio(wl, "udm-linear", "nbdkit-file")
        r_file = ratio(wl, "udm-linear", "file")
        label = wl.label + (" (IOPS)" if wl.metric == "iops" else " (MB/s)")
        flagged = [f"{a.removeprefix('udm-')} / {b}" for (a, b), r in
                   zip(PAIRS, (r_zero, r_qemu, r_nbdkit)) if is_below(r)]
        if flagged:
            below.append(f"{wl.label}: " + ", ".join(flagged))
            label = "▼ " + label
        for p, r in zip(PAIRS, (r_zero, r_qemu, r_nbdkit)):
            if r is not None:
                ratios[p].append(r)
        thr_rows.append([
            label,
            fmt_value(med(wl, "udm-zero"), wl.metric),
            fmt_value(med(wl, "nbdkit-null"), wl.metric),
            fmt_ratio(r_zero),
            fmt_value(med(wl, "udm-linear"), wl.metric),
            fmt_value(med(wl, "qemu-nbd"), wl.metric),
            fmt_value(med(wl, "nbdkit-file"), wl.metric),
            fmt_value(med(wl, "file"), wl.metric),
            "—" if r_file is None else f"{r_file:.2f}×",
            fmt_ratio(r_qemu),
            fmt_ratio(r_nbdkit),
        ])
        p99r = p99_ratio(wl)
        lat_rows.append([wl.label] + [fmt_lat(cell(wl, k)) for k in keys]
                        + ["—" if p99r is None else f"{p99r:.2f}×"])
        cpu_rows.append([wl.label] + [fmt_cpu(med(wl, k, "cpu_us_per_io")) for k in keys])
        row_bars = bar_lines(wl, ratio, p99_ratio, labels)
        bars += row_bars
        summary[wl.key] = {
            "metric": wl.metric,
            "systems": {
                s.key: None if cell(wl, s.key) is None else {
                    "median_value": med(wl, s.key),
                    "median_iops": med(wl, s.key, "iops"),
                    "median_mbps": med(wl, s.key, "mbps"),
                    "median_lat_mean_us": med(wl, s.key, "lat_mean_us"),
                    "median_lat_p99_us": med(wl, s.key, "lat_p99_us"),
                    "median_cpu_us_per_io": med(wl, s.key, "cpu_us_per_io"),
                    "samples": [{"value": x.value, "iops": x.iops, "mbps": x.mbps,
                                 "lat_mean_us": x.lat_mean_us, "lat_p99_us": x.lat_p99_us,
                                 "ios": x.ios, "cpu_us_per_io": x.cpu_us_per_io,
                                 "fio_cpu_s": x.fio_cpu_s,
                                 "json": x.json_path.name} for x in cell(wl, s.key).samples],
                    "errors": cell(wl, s.key).errors,
                } for s in systems},
            "ratio_zero_vs_nbdkit": r_zero,
            "ratio_linear_vs_qemu": r_qemu,
            "ratio_linear_vs_nbdkit_file": r_nbdkit,
            "ratio_linear_vs_file": r_file,
            "p99_ratio_linear_vs_file": p99r,
            "bars": [{"text": t, "ok": ok} for t, ok in row_bars],
        }

    out = []
    out.append(f"## udm foundation benchmark — {meta['timestamp']}")
    out.append("")
    out.append(f"Host: {meta['host']}, {meta['cpus']} CPUs, kernel {meta['kernel']}. "
               f"udm {meta['udm_commit']}. fio {meta['fio_version']}, nbd engine, one job, "
               f"unix socket. Runtime {meta['runtime']} s per run, export/file size "
               f"{meta['size_human']}, median of {meta['repeat']} alternating run(s).")
    out.append("")
    out.append("### Throughput")
    out.append("")
    out.append(markdown_table(
        ["workload", "udm zero", "nbdkit null", "zero / null", "udm linear", "qemu-nbd",
         "nbdkit file", "fio on file", "linear / file", "linear / qemu-nbd",
         "linear / nbdkit file"], thr_rows))
    out.append("")
    out.append("4k rows in IOPS, 256k rows in MB/s (10^6 B/s). Ratio = udm / peer on IOPS or MB/s "
               "(higher is better for udm); **▼** marks a ratio to a peer below 1.0×. nbdkit "
               f"file: `{meta.get('nbdkit_file_args', 'file DISK cache=none')}` (this nbdkit has "
               "no O_DIRECT option: cache=none evicts the pages it read or wrote).")
    out.append("")
    out.append("### Completion latency, mean / p99 µs (fio clat)")
    out.append("")
    out.append(markdown_table(["workload"] + [labels[k] for k in keys]
                              + ["linear p99 / file p99"], lat_rows))
    out.append("")
    out.append("### CPU per I/O, µs")
    out.append("")
    out.append(markdown_table(["workload"] + [labels[k] for k in keys], cpu_rows))
    out.append("")
    out.append("The server process's user + system time (/proc/PID/stat utime + stime, all its "
               "threads, not its children; the udm daemon for udm zero and linear) over the run, "
               "divided by the I/Os fio completed. fio on file: fio's own usr + sys CPU (no "
               "server). The fio client's CPU on the NBD rows is not included.")
    out.append("")
    out.append("### Bars (issue #10)")
    out.append("")
    for text, ok in bars:
        out.append(f"- {'?' if ok is None else ('✔' if ok else '✘')} {text}")
    met = bool(bars) and all(ok for _, ok in bars)
    summary["_bars"] = [{"text": t, "ok": ok} for t, ok in bars]
    summary["_bars_met"] = met
    out.append("")
    out.append("All bars: " + ("**met**." if met else "**not met** (✘ missed, ? not measured)."))
    gm = []
    for (a, b), rs in ratios.items():
        if rs:
            g = math.exp(sum(math.log(r) for r in rs) / len(rs))
            gm.append(f"{a} / {b}: geometric mean {g:.2f}× over {len(rs)} workloads")
            summary.setdefault("_geomean", {})[f"{a}/{b}"] = g
    if gm:
        out.append("")
        out.append("Summary: " + "; ".join(gm) + ".")
    if below:
        out.append("")
        out.append("Below 1.0× (udm slower than its peer): " + "; ".join(below) + ".")
    missing = [f"{s.label} ({s.why_unavailable})" for s in systems if not s.available]
    failed = sorted({f"{s.label}" for s in systems for wl in WORKLOADS
                     if cell(wl, s.key) and cell(wl, s.key).errors})
    if missing:
        out.append("")
        out.append("Not measured: " + "; ".join(missing) + ".")
    table_footer(out, meta, failed)
    return "\n".join(out) + "\n", summary


# --------------------------------------------------------------------------------------------
# charts
# --------------------------------------------------------------------------------------------

def draw_charts(results, systems, out_dir: Path, meta) -> list:
    plt = import_pyplot("charts")
    if plt is None:
        return []

    by_key = {s.key: s for s in systems}
    colors = {"udm-zero": "#1f77b4", "nbdkit-null": "#ff7f0e", "udm-linear": "#1f77b4",
              "qemu-nbd": "#2ca02c", "nbdkit-file": "#ff7f0e", "file": "#9e9e9e"}
    caption = (f"{meta['timestamp']} · {meta['cpus']} CPUs · fio nbd engine, 1 job, unix socket · "
               f"{meta['runtime']} s × median of {meta['repeat']} · {meta['size_human']}")
    files = []

    def med(wl, key, attr="value"):
        c = results.get((wl.key, key))
        return c.median(attr) if c else None

    charts = [
        ("foundation-zero-vs-nbdkit.png", "Transport ceiling: udm zero vs nbdkit null",
         ["udm-zero", "nbdkit-null", "file"], ("udm-zero", "nbdkit-null")),
        ("foundation-linear-vs-qemu.png",
         "Raw passthrough: udm linear vs qemu-nbd raw and nbdkit file",
         ["udm-linear", "qemu-nbd", "nbdkit-file", "file"], ("udm-linear", "qemu-nbd")),
    ]
    groups = [("iops", "IOPS (4 KiB random)", [w for w in WORKLOADS if w.metric == "iops"]),
              ("mbps", "MB/s (256 KiB sequential)", [w for w in WORKLOADS if w.metric == "mbps"])]

    for fname, title, keys, (ua, pb) in charts:
        fig, axes = plt.subplots(1, 2, figsize=(13, 5.2),
                                 gridspec_kw={"width_ratios": [2, 1]})
        for ax, (metric, ylabel, wls) in zip(axes, groups):
            n = len(keys)
            width = 0.8 / n
            xs = list(range(len(wls)))
            for i, key in enumerate(keys):
                vals = [med(w, key) or 0 for w in wls]
                label = by_key[key].label if key != "file" else "fio on file (floor)"
                bars = ax.bar([x + (i - (n - 1) / 2) * width for x in xs], vals, width,
                              label=label, color=colors[key],
                              hatch="//" if key == "file" else None,
                              edgecolor="white" if key != "file" else "#555555")
                if key == ua:
                    for w, b in zip(wls, bars):
                        va, vb = med(w, ua), med(w, pb)
                        if va and vb:
                            r = va / vb
                            ax.annotate(f"{r:.2f}×", (b.get_x() + b.get_width() / 2,
                                                      b.get_height()),
                                        ha="center", va="bottom", fontsize=8,
                                        color="#c62828" if is_below(r) else "#1b5e20",
                                        fontweight="bold")
            ax.set_xticks(xs)
            ax.set_xticklabels([w.label for w in wls], fontsize=9)
            ax.set_ylabel(ylabel)
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
        axes[0].legend(fontsize=9, loc="upper left")
        fig.suptitle(title + f"  (ratio = udm / {by_key[pb].label} above the udm bar)")
        fig.text(0.5, 0.01, caption, ha="center", fontsize=8, color="#555555")
        fig.tight_layout(rect=(0, 0.04, 1, 0.95))
        path = out_dir / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)

    # Latency at queue depth 1: mean bars with the p99 as an error whisker.
    wls = [w for w in WORKLOADS if w.qd == 1]
    keys = ["udm-zero", "nbdkit-null", "udm-linear", "qemu-nbd", "nbdkit-file", "file"]
    lat_colors = {"udm-zero": "#1f77b4", "nbdkit-null": "#ff7f0e", "udm-linear": "#0d47a1",
                  "qemu-nbd": "#2ca02c", "nbdkit-file": "#e65100", "file": "#9e9e9e"}
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        means = [med(w, key, "lat_mean_us") or 0 for w in wls]
        p99s = [med(w, key, "lat_p99_us") or 0 for w in wls]
        xs = [x + (i - (len(keys) - 1) / 2) * width for x in range(len(wls))]
        ax.bar(xs, means, width, label=by_key[key].label if key != "file" else "fio on file",
               color=lat_colors[key], hatch="//" if key == "file" else None,
               yerr=[[0] * len(wls), [max(p - m, 0) for p, m in zip(p99s, means)]],
               capsize=3, error_kw={"elinewidth": 1, "ecolor": "#333333"})
    ax.set_xticks(range(len(wls)))
    ax.set_xticklabels([w.label for w in wls])
    ax.set_ylabel("completion latency, µs (bar = mean, whisker = p99)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(fontsize=9)
    fig.suptitle("Latency at iodepth 1 (lower is better)")
    fig.text(0.5, 0.01, caption, ha="center", fontsize=8, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    path = out_dir / "foundation-latency-qd1.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    files.append(path)
    return files


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------

def fill_backing_file(path: Path, size: int, timeout: float) -> None:
    """Write every byte of the file (random data, O_DIRECT) so reads hit allocated blocks."""
    log(f"writing {human_size(size)} of data to {path}")
    run(["fio", "--name=fill", "--ioengine=io_uring", "--direct=1", "--rw=write", "--bs=1M",
         "--iodepth=16", f"--size={size}", f"--filename={path}", "--refill_buffers",
         "--randrepeat=1", "--end_fsync=1", "--output-format=terse"], timeout=timeout)
    st = path.stat()
    if st.st_size != size:
        raise BenchError(f"{path} is {st.st_size} bytes, expected {size}")
    if st.st_blocks * 512 < size:
        raise BenchError(f"{path} is sparse ({st.st_blocks * 512} of {size} bytes allocated)")


def open_flags(pid: int, path: Path) -> list:
    """The open(2) flags of every descriptor process `pid` holds on `path` (Linux /proc)."""
    flags = []
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return flags
    for fd in fds:
        try:
            if os.readlink(fd) != str(path):
                continue
            for line in Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text().splitlines():
                if line.startswith("flags:"):
                    flags.append(int(line.split()[1], 8))
        except (OSError, ValueError):
            continue
    return flags


def direct_io_note(name: str, pid: int, path: Path) -> str | None:
    """A note when `name` reads `path` through the page cache (the comparison assumes O_DIRECT)."""
    o_direct = getattr(os, "O_DIRECT", 0o40000)
    flags = open_flags(pid, path)
    if not flags:
        return f"could not see {name} holding {path.name} open (no O_DIRECT check)"
    if not any(f & o_direct for f in flags):
        return (f"{name} has {path.name} open without O_DIRECT "
                f"(flags {', '.join(oct(f) for f in flags)}): its figures include the page cache")
    return None


def resident_bytes(path: Path):
    """Bytes of `path` in the page cache (fincore, util-linux), or None if unknown."""
    if not shutil.which("fincore"):
        return None
    try:
        cp = run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
                 timeout=30, check=False, quiet=True)
        return int(cp.stdout.split()[0]) if cp.returncode == 0 else None
    except (BenchError, ValueError, IndexError):
        return None


class NbdRefused(Exception):
    """The server answered the handshake's GO with an error; str() is its message."""


def recv_exact(sk: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sk.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("server closed the connection")
        buf += chunk
    return buf


NBD_IHAVEOPT = 0x49484156454F5054
NBD_OPT_GO, NBD_OPT_STRUCTURED_REPLY = 7, 8
NBD_REP_ACK = 1


def nbd_handshake(sk: socket.socket, export: str, structured: bool = False) -> bool:
    """Fixed-newstyle handshake on a connected socket up to the transmission phase: the
    greeting, optionally NBD_OPT_STRUCTURED_REPLY, then NBD_OPT_GO for `export`.  Returns
    whether structured replies are on; raises NbdRefused with the server's message when GO is
    answered with an error, ConnectionError when the server closes the connection."""
    def option(opt: int, data: bytes) -> tuple[int, bytes]:
        sk.sendall(struct.pack(">QII", NBD_IHAVEOPT, opt, len(data)) + data)
        while True:
            _m, _o, rtype, rlen = struct.unpack(">QIII", recv_exact(sk, 20))
            payload = recv_exact(sk, rlen)
            if rtype == NBD_REP_ACK or rtype & 0x80000000:
                return rtype, payload

    recv_exact(sk, 18)                                  # NBDMAGIC, IHAVEOPT, flags
    sk.sendall((3).to_bytes(4, "big"))                  # FIXED_NEWSTYLE | NO_ZEROES
    on = structured and option(NBD_OPT_STRUCTURED_REPLY, b"")[0] == NBD_REP_ACK
    name = export.encode()
    rtype, payload = option(NBD_OPT_GO, struct.pack(">I", len(name)) + name + bytes(2))
    if rtype != NBD_REP_ACK:
        # An error reply's payload is a human-readable message.
        raise NbdRefused(payload.decode(errors="replace") or f"error reply {rtype:#x}")
    return on


def read_reply_kind(sock_path: Path, export: str, length: int = 256 << 10) -> str | None:
    """How a server answers one READ with structured replies on: "hole" (OFFSET_HOLE chunks,
    no payload), "data" (OFFSET_DATA) or "mixed"; None if the probe failed.  A server that
    answers zero reads with holes moves no payload, which matters when comparing read rows."""
    kinds = set()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sk:
            sk.settimeout(10)
            sk.connect(str(sock_path))
            if not nbd_handshake(sk, export, structured=True):
                return "data"
            sk.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, 1, 0, length))
            while True:
                _m, flags, ctype, _c, clen = struct.unpack(">IHHQI", recv_exact(sk, 20))
                recv_exact(sk, clen)
                kinds.add({1: "data", 2: "hole"}.get(ctype, "other"))
                if flags & 1:
                    break
            sk.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 2, 2, 0, 0))  # NBD_CMD_DISC
    except (OSError, ConnectionError, struct.error, NbdRefused):
        return None
    kinds.discard("other")
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else None)


def check_export(uri: str, size: int, what: str) -> None:
    """Sanity probe with nbdinfo (if installed): the export answers and has the right size."""
    if not shutil.which("nbdinfo"):
        return
    cp = run(["nbdinfo", "--size", uri], timeout=30, check=False, quiet=True)
    if cp.returncode != 0:
        raise BenchError(f"nbdinfo --size {uri} ({what}) failed: exit {cp.returncode}: "
                         f"{cp.stderr.strip()[-1000:]}")
    try:
        got = int(cp.stdout.strip())
    except ValueError:
        raise BenchError(f"nbdinfo --size {uri} printed {cp.stdout!r}")
    if got != size:
        raise BenchError(f"{what}: export size {got}, expected {size}")


def main(argv=None) -> int:
    global WORKLOADS
    ap = argparse.ArgumentParser(
        description="udm foundation benchmark: udm zero vs nbdkit null, udm linear vs "
                    "qemu-nbd raw and nbdkit file, and fio on the file, side by side.")
    common.add_sizing_args(ap, runtime=10, size_help="export and backing file size (default 1G)",
                           repeat=True)
    common.add_run_args(
        ap, out="bench/results/foundation",
        out_help="output directory for fio JSON, table.md and charts "
                 "(default bench/results/foundation, relative to the current directory)",
        tmpdir_help="where to create the temp dir (must support O_DIRECT; default $TMPDIR "
                    "or /tmp)",
        keep_help="keep the temp dir (disk image, logs)",
        udm_help="path of the udm binary (default target/release/udm, built if missing)",
        charts_help="skip the PNG charts")
    ap.add_argument("--workloads", default=None,
                    help="comma-separated subset of: " + ",".join(w.key for w in WORKLOADS))
    args = ap.parse_args(argv)
    common.resolve_sizing(args)
    if args.runtime < 1 or args.repeat < 1:
        ap.error("--runtime and --repeat must be at least 1")

    WORKLOADS = select_workloads(ap, args.workloads, WORKLOADS)
    trap_signals()

    missing_required = [t for t in ("fio",) if not shutil.which(t)]
    if missing_required:
        for t in missing_required:
            log(f"ERROR: `{t}` not found; install the Debian package `{PACKAGES[t]}`")
        return 2
    eng = run(["fio", "--enghelp=nbd"], timeout=20, check=False, quiet=True)
    if eng.returncode != 0:
        log("ERROR: this fio has no nbd engine (Debian's fio package has it; it needs libnbd0)")
        return 2
    for t in ("nbdkit", "qemu-nbd", "nbdinfo"):
        if not shutil.which(t):
            extra = " (only used for a sanity probe)" if t == "nbdinfo" else \
                    " — its column will be empty"
            log(f"WARNING: `{t}` not found; install the Debian package `{PACKAGES[t]}`{extra}")

    out_dir = prepare_out_dir(args.out)
    udm_bin = locate_udm(args, find_udm)
    if udm_bin is None:
        return 2
    tmp = make_tmpdir(tmp_base(args), "udm-foundation-", "nbdkit.sock")
    if tmp is None:
        return 2

    size = args.size
    sectors = size // 512
    disk = tmp / "disk.img"
    services: list[Service] = []
    daemon: Service | None = None
    udm: Udm | None = None
    created: list[str] = []
    results: dict = {}
    notes: list = []
    rc = 1
    meta = {
        **common.base_meta(udm_bin),
        "nbdkit_version": tool_version(["nbdkit", "--version"]) if shutil.which("nbdkit") else None,
        "qemu_nbd_version": tool_version(["qemu-nbd", "--version"])
        if shutil.which("qemu-nbd") else None,
        "runtime": args.runtime, "size": size, "size_human": human_size(size),
        "repeat": args.repeat, "tmpdir": str(tmp),
    }
    try:
        fill_backing_file(disk, size, timeout=max(600, size / (20 << 20)))

        # ---- udm daemon and its devices
        ctl = tmp / "ctl.sock"
        nbd_sock = tmp / "udm.sock"
        (tmp / "state").mkdir()
        daemon = start_service(
            "udm daemon",
            [str(udm_bin), "daemon", "--state-dir", str(tmp / "state"), "--control", str(ctl),
             "--nbd", f"unix:{nbd_sock}"],
            tmp / "udm-daemon.log", env=dict(os.environ, RUST_BACKTRACE="1"))
        services.append(daemon)
        wait_for_socket(ctl, daemon, timeout=30)
        udm = Udm(udm_bin, ctl)
        udm.client("create", "nullz", "--table", f"0 {sectors} zero")
        created.append("nullz")
        udm.client("create", "lin", "--table", f"0 {sectors} linear {disk} 0")
        created.append("lin")
        wait_for_socket(nbd_sock, daemon, timeout=30)
        uri_zero = f"nbd+unix:///nullz?socket={nbd_sock}"
        uri_lin = f"nbd+unix:///lin?socket={nbd_sock}"
        check_export(uri_zero, size, "udm nullz (zero)")
        check_export(uri_lin, size, "udm lin (linear)")
        note = direct_io_note("udm daemon", daemon.proc.pid, disk)
        meta["udm_o_direct"] = note is None
        if note:
            log(f"WARNING: {note}")
            notes.append(note)
        # Every system here bypasses the page cache, so whatever of disk.img is cached after the
        # matrix was read or written by a buffered path.
        cached_before = resident_bytes(disk)

        systems = [
            System("udm-zero", "udm zero", ["--ioengine=nbd", f"--uri={uri_zero}"], daemon),
            System("nbdkit-null", "nbdkit null", []),
            System("udm-linear", "udm linear", ["--ioengine=nbd", f"--uri={uri_lin}"], daemon),
            System("qemu-nbd", "qemu-nbd", []),
            System("nbdkit-file", "nbdkit file", []),
            System("file", "fio on file",
                   ["--ioengine=io_uring", "--direct=1", f"--filename={disk}"]),
        ]
        sysmap = {s.key: s for s in systems}

        # ---- peers: each on its own unix socket, served to fio's nbd engine
        # This nbdkit's file plugin has no O_DIRECT; cache=none is the closest: it evicts the
        # pages each read or write went through (fadvise DONTNEED, sync_file_range).
        nbdkit_file_args = ["file", str(disk), "cache=none"]
        meta["nbdkit_file_args"] = " ".join(nbdkit_file_args).replace(str(disk), "DISK")
        peers = [
            ("nbdkit-null", "nbdkit", "nbdkit.sock", "nbdkit.log",
             lambda sock: ["nbdkit", "-f", "-U", sock, "--exit-with-parent", "null", str(size)]),
            ("nbdkit-file", "nbdkit", "nbdkit-file.sock", "nbdkit-file.log",
             lambda sock: ["nbdkit", "-f", "-U", sock, "--exit-with-parent",
                           *nbdkit_file_args]),
            ("qemu-nbd", "qemu-nbd", "qemu.sock", "qemu-nbd.log",
             lambda sock: ["qemu-nbd", "-t", "-e", "8", "-k", sock, "-f", "raw",
                           "--cache=none", "--aio=io_uring", str(disk)]),
        ]
        for key, tool, sockname, logname, command in peers:
            peer = sysmap[key]
            if not shutil.which(tool):
                peer.available = False
                peer.why_unavailable = f"{tool} missing: apt-get install {PACKAGES[tool]}"
                continue
            sock = tmp / sockname
            svc = start_service(peer.label, command(str(sock)), tmp / logname)
            services.append(svc)
            svc.socket = sock
            wait_for_socket(sock, svc)
            uri = f"nbd+unix:///?socket={sock}"
            check_export(uri, size, peer.label)
            peer.engine_args = ["--ioengine=nbd", f"--uri={uri}"]
            peer.service = svc
        if sysmap["qemu-nbd"].available:
            note = direct_io_note("qemu-nbd", sysmap["qemu-nbd"].service.proc.pid, disk)
            if note:
                log(f"WARNING: {note}")
                notes.append(note)

        # ---- how zero reads are answered (a hole chunk moves no payload)
        if sysmap["nbdkit-null"].available:
            k_udm = read_reply_kind(nbd_sock, "nullz")
            k_nbdkit = read_reply_kind(tmp / "nbdkit.sock", "")
            meta["zero_read_reply"] = {"udm zero": k_udm, "nbdkit null": k_nbdkit}
            if k_udm and k_nbdkit and k_udm != k_nbdkit:
                notes.append(f"udm zero answers a 256 KiB read with {k_udm} chunks, nbdkit null "
                             f"with {k_nbdkit}: the zero pair's read rows do not move the same "
                             f"payload")

        def restart_daemon():
            """Start the daemon again on the same state dir; its devices should come back."""
            daemon.socket = None
            for p in (ctl, nbd_sock):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
            daemon.restart()
            wait_for_socket(ctl, daemon, timeout=30)
            for name, table, uri in (("nullz", f"0 {sectors} zero", uri_zero),
                                     ("lin", f"0 {sectors} linear {disk} 0", uri_lin)):
                try:
                    wait_for_socket(nbd_sock, daemon, timeout=10)
                    check_export(uri, size, f"udm {name} after restart")
                except BenchError:
                    log(f"{name} did not come back from the state dir; creating it again")
                    udm.client("create", name, "--table", table)
                    wait_for_socket(nbd_sock, daemon, timeout=30)

        # ---- the matrix: per workload and repeat, udm next to its peers, side by side; every
        # other repeat runs each group in the reverse order, so no system always goes first.
        groups = [["udm-zero", "nbdkit-null"], ["udm-linear", "qemu-nbd", "nbdkit-file", "file"]]
        total = len(WORKLOADS) * args.repeat * sum(1 for g in groups for k in g
                                                   if sysmap[k].available)
        est = total * (args.runtime + 1)
        log(f"{total} fio runs of {args.runtime} s (about {est // 60} min {est % 60} s)")
        n = 0
        fio_timeout = args.runtime + 60
        for wl in WORKLOADS:
            for rep in range(1, args.repeat + 1):
                order = [k for g in groups for k in (g if rep % 2 else reversed(g))]
                for key in order:
                    s = sysmap[key]
                    if not s.available:
                        continue
                    n += 1
                    c = results.setdefault((wl.key, key), Cell())
                    if s.service is not None and not s.service.alive():
                        msg = (f"{s.service.name} is not running (exit code "
                               f"{s.service.proc.returncode})")
                        if s.service is not daemon and s.service.restarts < 3:
                            # A peer is not what is measured here: note it and start it again.
                            log(f"WARNING: {msg}; log tail:\n{s.service.log_tail(5)}")
                            notes.append(f"{msg} before {wl.key} {key} r{rep}; restarted")
                            try:
                                s.service.restart()
                            except BenchError as e:
                                log(f"restart failed: {e}")
                        elif s.service is daemon and daemon.restarts < 2 and \
                                daemon.proc.returncode == 0 and \
                                "signal" in daemon.log_tail(3):
                            # Stopped cleanly by a signal that was not ours (a shared machine:
                            # someone's cleanup).  A crash is never restarted.
                            log(f"WARNING: {msg} after a signal this script did not send; "
                                f"log tail:\n{daemon.log_tail(5)}")
                            notes.append(f"{msg} (stopped by an outside signal) before "
                                         f"{wl.key} {key} r{rep}; restarted")
                            try:
                                restart_daemon()
                            except BenchError as e:
                                log(f"daemon restart failed: {e}")
                        if not s.service.alive():
                            c.errors.append(msg)
                            log(f"[{n}/{total}] {wl.key} {key} r{rep}: SKIPPED, {msg}")
                            continue
                    stem = f"{wl.key}.{key}.r{rep}"
                    cmd = fio_cmd(wl, s, args, out_dir / f"{stem}.json")
                    server = s.service.proc.pid if s.service is not None else None
                    cpu0 = common.proc_cpu_seconds(server) if server else None
                    smp = fio_cell(cmd, lambda cmd: run(cmd, timeout=fio_timeout, check=False,
                                                        quiet=True, cwd=tmp),
                                   parse_fio_json, wl, c, out_dir, stem,
                                   f"[{n}/{total}] {wl.key} {key} r{rep}")
                    if smp is None:
                        continue
                    if server:
                        smp.cpu_us_per_io = common.cpu_us_per_io(
                            cpu0, common.proc_cpu_seconds(server), smp.ios)
                    elif smp.ios:
                        smp.cpu_us_per_io = smp.fio_cpu_s / smp.ios * 1e6
                    c.samples.append(smp)
                    unit = "IOPS" if wl.metric == "iops" else "MB/s"
                    cpu = "—" if smp.cpu_us_per_io is None else f"{smp.cpu_us_per_io:.1f}"
                    log(f"[{n}/{total}] {wl.key:<18} {key:<11} r{rep}: "
                        f"{smp.value:>10.0f} {unit}  clat mean {smp.lat_mean_us:.0f} µs "
                        f"p99 {smp.lat_p99_us:.0f} µs  CPU {cpu} µs/IO")

        cached_after = resident_bytes(disk)
        meta["page_cache_bytes"] = {"before": cached_before, "after": cached_after}
        note = page_cache_note(disk.name, size, cached_before, cached_after,
                               "system is meant to bypass it (udm's buffered fallback, "
                               "qemu-nbd not honouring --cache=none, or nbdkit file's "
                               "cache=none evicting late)")
        if note:
            log(f"WARNING: {note}")
            notes.append(note)
        meta["notes"] = notes
        table, summary = build_table(results, systems, meta)
        write_results(out_dir, table, {"meta": meta, "workloads": summary})
        if args.no_charts:
            log("charts skipped (--no-charts)")
        else:
            for p in draw_charts(results, systems, out_dir, meta):
                log(f"chart: {p}")
        log(f"results in {out_dir}")
        rc = exit_code(results)
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}); cleaning up")
        rc = 130
    except BenchError as e:
        log(f"ERROR: {e}")
        rc = 1
    finally:
        # peers first, then the udm devices, then the daemon
        for svc in reversed(services):
            if svc is not daemon:
                svc.stop(grace=5)
        if daemon is not None and daemon.alive() and udm is not None:
            for name in reversed(created):
                try:
                    udm.client("remove", name, timeout=30, check=False)
                except BenchError as e:
                    log(f"udm remove {name}: {e}")
        if daemon is not None:
            stop_daemon(daemon, grace=15)
        copy_logs(services, out_dir)
        remove_tmp(tmp, args.keep)
    return rc


if __name__ == "__main__":
    _maybe_reexec_for_matplotlib()
    sys.exit(main())
