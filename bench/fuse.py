#!/usr/bin/env python3
"""FUSE benchmark for udm: a kernel block device (loop) on udm's FUSE file, side by side.

Ways to get a /dev/loopN for the same bytes (a fully written ``disk.img``), all with
``losetup --direct-io=on``, measured with fio (io_uring, O_DIRECT) alternating in one run:

* ``udm FUSE``    -- ``udm attach vol``: a loop device on ``FUSEDIR/vol``, the file udm's own
                     FUSE export serves for a ``linear`` device over disk.img;
* ``udm FUSE (/dev/fuse)`` -- when the daemon has ``--fuse-uring``: the same from a second
                     daemon with ``--fuse-uring off``, the first one running ``--fuse-uring on``
                     (FUSE over io_uring against the /dev/fuse read/write path);
* ``nbdfuse``     -- the peer: ``nbdfuse MOUNTDIR nbd+unix:///vol?socket=NBDSOCK`` (libnbd's
                     FUSE file over the SAME udm device, through udm's NBD export), then
                     ``losetup --direct-io=on -f --show MOUNTDIR/nbd``;
* ``loop on file`` -- the limit: ``losetup --direct-io=on -f --show disk.img``.

Bars (issue #10): udm FUSE >= 1.0x nbdfuse on every row; udm FUSE / loop on file >= 0.7x at
4 KiB random depth 32; FUSE over io_uring >= 1.3x /dev/fuse on the same rows.

Usage:  python3 bench/fuse.py [--runtime 10] [--size 1G] [--repeat 3] [--quick]
                              [--fuse-uring compare|on|off|auto] [--out bench/results/fuse]

The generic helpers (processes, fio JSON, udm verbs) come from harness.py, sizes and
tables from report.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import harness  # noqa: E402
from common import (  # noqa: E402
    BenchError, _pdeathsig, copy_logs, fio_cell, import_pyplot, locate_udm, prepare_out_dir, run,
    select_workloads, stop_daemon, tmp_base, tool_version, trap_signals,
)
from harness import (  # noqa: E402
    Cell, Results, Service, Udm, Workload, check_export, direct_io_note, fill_backing_file, find_udm,
    parse_fio_json, resident_bytes, start_service, wait_for_socket,
)
from report import (  # noqa: E402
    exit_code, fmt_lat, fmt_ratio, fmt_value, geomean, human_size, is_below, markdown_table,
    page_cache_note, table_footer, write_results,
)

REPO = harness.REPO


def log(msg: str) -> None:
    print(f"[fuse] {msg}", file=sys.stderr, flush=True)


# common's and harness's helpers (run, Service, fill_backing_file ...) log through common's
# module-level `log`; make them speak with this script's prefix.
common.log = log

PACKAGES = dict(harness.PACKAGES, nbdfuse="libnbd-bin",
                fusermount3="fuse3", losetup="mount", blockdev="util-linux")


def _maybe_reexec_for_matplotlib() -> None:
    """Re-run under /usr/bin/python3 when this interpreter (e.g. a pyenv one) lacks matplotlib."""
    common.maybe_reexec_for_matplotlib(__file__)


# --------------------------------------------------------------------------------------------
# workloads and systems
# --------------------------------------------------------------------------------------------

WORKLOADS = list(harness.WORKLOADS)   # randread/randwrite 4k qd1, qd32, write/read 256k qd32

# "udm-fuse-dev" (a second daemon on /dev/fuse) joins when comparing the FUSE transports.
SYSTEMS = ["udm-fuse", "nbdfuse", "direct"]
LABELS = {"udm-fuse": "udm FUSE", "udm-fuse-dev": "udm FUSE (/dev/fuse)", "nbdfuse": "nbdfuse",
          "direct": "loop on file"}
COLORS = {"udm-fuse": "#1f77b4", "udm-fuse-dev": "#90caf9", "nbdfuse": "#ff7f0e",
          "direct": "#9e9e9e"}

# Issue #10's bars at 4 KiB random, depth 32 (besides udm FUSE >= nbdfuse on every row).
BAR_FILE_LOOP = 0.7   # loop on udm's FUSE file / loop on the file
BAR_URING = 1.3       # FUSE over io_uring / /dev/fuse


@dataclass
class LoopDev:
    system: str
    device: str          # /dev/loopN
    backing: Path        # the file it was made on
    owner: "UdmFuse | None" = None   # the udm daemon that attached it (`udm detach` it)


# --------------------------------------------------------------------------------------------
# bounded subprocesses (a process stuck on a dead FUSE mount must not hang the script)
# --------------------------------------------------------------------------------------------

def run_group(cmd, *, timeout: float, cwd=None, env=None, text: bool = True):
    """Run `cmd` in its own process group with a hard time limit.

    fio forks its job processes, and a process blocked on a FUSE file may not die at once:
    on timeout (or Ctrl-C) the whole group gets SIGTERM, then SIGKILL, and we wait at most a
    few seconds more before giving up on it (it is reported, never waited for forever)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text,
                            stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                            start_new_session=True, preexec_fn=_pdeathsig)

    def kill_group():
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.communicate(timeout=wait)
                return True
            except subprocess.TimeoutExpired:
                continue
        log(f"WARNING: process group {proc.pid} ({cmd[0]}) did not exit after SIGKILL "
            f"(stuck in the kernel?); leaving it")
        return False

    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group()
        raise BenchError(f"timed out after {timeout:.0f}s: {' '.join(map(str, cmd))}")
    except BaseException:
        kill_group()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# --------------------------------------------------------------------------------------------
# loop devices and mounts
# --------------------------------------------------------------------------------------------

def loops_under(prefix: Path) -> list:
    """Loop devices whose backing file lies under `prefix` (ours: everything is in the temp dir),
    as (device, back-file) pairs."""
    cp = run(["losetup", "--list", "--json", "--output", "NAME,BACK-FILE"], timeout=30,
             check=False, quiet=True)
    if cp.returncode != 0 or not cp.stdout.strip():
        return []
    try:
        rows = json.loads(cp.stdout).get("loopdevices", [])
    except json.JSONDecodeError:
        return []
    want = str(prefix).rstrip("/") + "/"
    return [(r["name"], r.get("back-file") or "") for r in rows
            if (r.get("back-file") or "").startswith(want)]


def mounts_under(prefix: Path) -> list:
    """Mount points at or under `prefix`, deepest first (from /proc/self/mountinfo)."""
    want = str(prefix).rstrip("/")
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        mp = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n") \
                      .replace("\\134", "\\")
        if mp == want or mp.startswith(want + "/"):
            found.append(mp)
    return sorted(set(found), key=len, reverse=True)


def is_mounted(path: Path) -> bool:
    return str(path) in mounts_under(path)


def loop_dio(device: str) -> bool | None:
    """Whether the loop driver really does direct I/O on its backing file (/sys .../loop/dio):
    `losetup --direct-io=on` only warns when the kernel refuses it."""
    try:
        return Path(f"/sys/block/{Path(device).name}/loop/dio").read_text().strip() == "1"
    except OSError:
        return None


def losetup_attach(backing: Path) -> str:
    cp = run(["losetup", "--direct-io=on", "-f", "--show", str(backing)], timeout=60,
             check=False, quiet=True)
    dev = cp.stdout.strip()
    if cp.returncode != 0 or not dev.startswith("/dev/"):
        raise BenchError(f"losetup --direct-io=on -f --show {backing} failed "
                         f"(exit {cp.returncode}): {cp.stderr.strip()[-800:]}")
    if cp.stderr.strip():
        log(f"losetup {backing.name}: {cp.stderr.strip()}")
    return dev


def detach_loop(device: str, *, udm: Udm | None = None) -> bool:
    """Detach one loop device (with `udm detach` when given the udm client), retrying briefly:
    the device may still be held for a moment by the process that used it."""
    for attempt in range(20):
        if udm is not None and attempt == 0:
            cp = run([str(udm.binary), "--control", str(udm.control), "detach", device],
                     timeout=30, env=udm.env, check=False, quiet=True)
        else:
            cp = run(["losetup", "-d", device], timeout=30, check=False, quiet=True)
        if cp.returncode == 0:
            return True
        if "No such device" in cp.stderr or "not a loop" in cp.stderr.lower():
            return True
        time.sleep(0.25)
    log(f"WARNING: could not detach {device}: {cp.stderr.strip()[-300:]}")
    return False


def unmount_fuse(mountpoint: Path, *, lazy_fallback: bool = True) -> bool:
    """`fusermount3 -u`, retried while busy (a loop device lets go of its file asynchronously),
    then a lazy unmount as the last resort."""
    if not is_mounted(mountpoint):
        return True
    err = ""
    for _ in range(40):
        cp = run(["fusermount3", "-u", str(mountpoint)], timeout=30, check=False, quiet=True)
        if cp.returncode == 0 or not is_mounted(mountpoint):
            return True
        err = cp.stderr.strip()
        time.sleep(0.25)
    if lazy_fallback:
        log(f"WARNING: fusermount3 -u {mountpoint} kept failing ({err[-200:]}); lazy unmount")
        cp = run(["fusermount3", "-u", "-z", str(mountpoint)], timeout=30, check=False,
                 quiet=True)
        if cp.returncode != 0 and is_mounted(mountpoint):
            run(["umount", "-l", str(mountpoint)], timeout=30, check=False, quiet=True)
    return not is_mounted(mountpoint)


def wait_for_file(path: Path, svc: Service | None, timeout: float, size: int | None = None):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if svc is not None and not svc.alive():
            raise BenchError(f"{svc.name} exited (code {svc.proc.returncode}) before {path} "
                             f"appeared; log tail:\n{svc.log_tail()}")
        try:
            st = path.stat()
            if size is None or st.st_size == size:
                return
            last = f"size {st.st_size}, expected {size}"
        except OSError as e:
            last = str(e)
        time.sleep(0.1)
    raise BenchError(f"{path} not ready after {timeout:.0f}s ({last})")


def device_size(device: str) -> int:
    cp = run(["blockdev", "--getsize64", device], timeout=30)
    return int(cp.stdout.strip())


def read_digest(path: str, offset: int, length: int = 1 << 20) -> str:
    """SHA-256 of `length` bytes at `offset`, read with O_DIRECT (dd iflag=direct)."""
    # dd's output is binary: read it without text decoding (common's run() is text).
    proc = run_group(["dd", f"if={path}", "bs=1M", f"count={length >> 20}",
                      f"skip={offset >> 20}", "iflag=direct", "status=none"],
                     timeout=60, text=False)
    if proc.returncode != 0 or len(proc.stdout) != length:
        raise BenchError(f"dd of {path} at {offset}: exit {proc.returncode}, "
                         f"{len(proc.stdout)} bytes: {proc.stderr.decode(errors='replace')[-300:]}")
    return hashlib.sha256(proc.stdout).hexdigest()


def same_bytes(loops: list, disk: Path, size: int) -> str | None:
    """Read the same 1 MiB at a few offsets through every loop device (and disk.img): all
    must agree.  None when they do, else a note."""
    offsets = sorted({0, (size // 3) & ~((1 << 20) - 1), size - (1 << 20)})
    bad = []
    for off in offsets:
        digests = {"disk.img": read_digest(str(disk), off)}
        for lp in loops:
            digests[LABELS[lp.system]] = read_digest(lp.device, off)
        if len(set(digests.values())) != 1:
            bad.append(f"offset {off}: " + ", ".join(f"{k} {v[:12]}" for k, v in
                                                      digests.items()))
    return None if not bad else "the loop devices disagree about the data: " + "; ".join(bad)


# --------------------------------------------------------------------------------------------
# table and chart
# --------------------------------------------------------------------------------------------

def tabulate(results):
    """Per workload: the table's rows, the bars, the ratios and results.json's summary; what
    `build_table` prints."""
    r = Results(results)
    cell, med, ratio = r.cell, r.med, r.ratio

    compare = "udm-fuse-dev" in SYSTEMS
    header = ["workload"] + [LABELS[k] for k in SYSTEMS] + ["udm / nbdfuse", "udm / loop on file"]
    if compare:
        header.append("io_uring / /dev/fuse")
    header += [f"{LABELS[k]} lat µs" for k in SYSTEMS]
    rows, below, r_peer_all, r_floor_all, summary, bars = [], [], [], [], {}, []
    missing_ratio = []
    for wl in WORKLOADS:
        r_peer = ratio(wl, "udm-fuse", "nbdfuse")
        r_floor = ratio(wl, "udm-fuse", "direct")
        r_uring = ratio(wl, "udm-fuse", "udm-fuse-dev") if compare else None
        label = wl.label + (" (IOPS)" if wl.metric == "iops" else " (MB/s)")
        if is_below(r_peer):
            below.append(f"{wl.label} {r_peer:.2f}×")
            label = "▼ " + label
        if r_peer is None:
            missing_ratio.append(wl.label)
        else:
            r_peer_all.append(r_peer)
        if r_floor is not None:
            r_floor_all.append(r_floor)
        row = [label] + [fmt_value(med(wl, k), wl.metric) for k in SYSTEMS]
        row += [fmt_ratio(r_peer), "—" if r_floor is None else f"{r_floor:.2f}×"]
        if compare:
            row.append("—" if r_uring is None else f"{r_uring:.2f}×")
        rows.append(row + [fmt_lat(cell(wl, k)) for k in SYSTEMS])
        if wl.bs == "4k" and wl.qd == 32 and wl.rw.startswith("rand"):
            bars.append((f"{wl.label}: loop on udm's FUSE file / loop on the file = "
                         + ("—" if r_floor is None else f"{r_floor:.2f}×")
                         + f" (≥ {BAR_FILE_LOOP}×)",
                         None if r_floor is None else round(r_floor, 2) >= BAR_FILE_LOOP))
            if compare:
                bars.append((f"{wl.label}: FUSE over io_uring / /dev/fuse = "
                             + ("—" if r_uring is None else f"{r_uring:.2f}×")
                             + f" (≥ {BAR_URING}×)",
                             None if r_uring is None else round(r_uring, 2) >= BAR_URING))
        summary[wl.key] = {
            "metric": wl.metric,
            "systems": {
                k: None if cell(wl, k) is None else {"label": LABELS[k], **cell(wl, k).summary()}
                for k in SYSTEMS},
            "ratio_udm_vs_nbdfuse": r_peer,
            "ratio_udm_vs_direct": r_floor,
            "ratio_uring_vs_dev_fuse": r_uring,
        }
    return SimpleNamespace(header=header, rows=rows, below=below, r_peer_all=r_peer_all,
                           r_floor_all=r_floor_all, summary=summary, bars=bars,
                           missing_ratio=missing_ratio, compare=compare)


def build_table(results, meta) -> tuple[str, dict]:
    """The report: the table, its summary lines, the bars and the notes; and results.json's
    summary."""
    t = tabulate(results)
    header, rows, below, summary, bars = t.header, t.rows, t.below, t.summary, t.bars
    r_peer_all, r_floor_all, missing_ratio, compare = (t.r_peer_all, t.r_floor_all,
                                                       t.missing_ratio, t.compare)
    out = [f"## udm FUSE benchmark — {meta['timestamp']}", ""]
    out.append(f"Host: {meta['host']}, {meta['cpus']} CPUs, kernel {meta['kernel']}. "
               f"udm {meta['udm_commit']}. {meta['fio_version']} on /dev/loopN "
               f"(`losetup --direct-io=on`), io_uring, O_DIRECT, one job. {meta['nbdfuse_version']}"
               f" ({meta.get('nbdfuse_connections', '?')} connection(s) to udm's NBD socket). "
               f"Runtime {meta['runtime']} s per run, device size {meta['size_human']}, median of "
               f"{meta['repeat']} alternating run(s). FUSE transport: {meta['fuse_transport']}.")
    out.append("")
    out.append(markdown_table(header, rows))
    out.append("")
    out.append(f"{LABELS['udm-fuse']}: loop on udm's own FUSE file (`udm attach`)"
               + (f"; {LABELS['udm-fuse-dev']}: the same from a second daemon with "
                  f"`--fuse-uring off`" if compare else "")
               + ". nbdfuse: loop on nbdfuse's file over the same udm device's NBD export. "
               "loop on file: loop straight on disk.img (the limit, no user space). udm = "
               f"{LABELS['udm-fuse']}. 4k rows in IOPS, 256k rows in MB/s (10^6 B/s). Ratios on "
               "IOPS or MB/s; **▼** marks udm / nbdfuse below 1.0×. Latency cells: completion "
               "latency mean / p99 in µs (fio clat).")
    out.append("")
    if r_peer_all:
        g = geomean(r_peer_all)
        summary["_geomean_udm_vs_nbdfuse"] = g
        line = f"Summary: udm FUSE / nbdfuse geometric mean {g:.2f}× over {len(r_peer_all)} rows"
        if r_floor_all:
            gf = geomean(r_floor_all)
            summary["_geomean_udm_vs_direct"] = gf
            line += f"; udm FUSE / loop on file {gf:.2f}×"
        out.append(line + ".")
        out.append("")
    parts = []
    if below:
        parts.append("below 1.0× on " + "; ".join(below))
    if missing_ratio:
        parts.append("no ratio for " + ", ".join(missing_ratio))
    bars.insert(0, ("udm FUSE ≥ 1.0× nbdfuse on every row"
                    + (": " + "; ".join(parts) if parts else ""), not parts))
    if not compare:
        bars.append((f"FUSE over io_uring / /dev/fuse (≥ {BAR_URING}× at 4k random qd32): "
                     f"not measured ({meta.get('fuse_uring_not_compared')})", None))
    out.append("### Bars (issue #10)")
    out.append("")
    for text, ok in bars:
        out.append(f"- {'?' if ok is None else ('✔' if ok else '✘')} {text}")
    met = all(ok for _, ok in bars)
    summary["_bars"] = [{"text": t, "ok": ok} for t, ok in bars]
    summary["_bars_met"] = met
    out.append("")
    out.append("All bars: " + ("**met**." if met else "**not met** (✘ missed, ? not measured)."))
    failed = sorted({LABELS[k] for k in SYSTEMS for wl in WORKLOADS
                     if (wl.key, k) in results and results[(wl.key, k)].errors})
    table_footer(out, meta, failed)
    return "\n".join(out) + "\n", summary


def draw_chart(results, out_dir: Path, meta) -> list:
    plt = import_pyplot("chart")
    if plt is None:
        return []

    def med(wl, key, attr="value"):
        c = results.get((wl.key, key))
        return c.median(attr) if c else None

    caption = (f"{meta['timestamp']} · {meta['cpus']} CPUs · fio io_uring O_DIRECT on "
               f"/dev/loopN (losetup --direct-io=on) · {meta['runtime']} s × median of "
               f"{meta['repeat']} · {meta['size_human']}")
    groups = [("IOPS (4 KiB random)", [w for w in WORKLOADS if w.metric == "iops"], "value"),
              ("MB/s (256 KiB sequential)", [w for w in WORKLOADS if w.metric == "mbps"],
               "value"),
              ("mean latency at iodepth 1, µs (whisker: p99)",
               [w for w in WORKLOADS if w.qd == 1], "lat")]
    groups = [g for g in groups if g[1]]
    if not groups:
        return []
    widths = [max(len(g[1]), 1) for g in groups]
    fig, axes = plt.subplots(1, len(groups), figsize=(15, 5.4),
                             gridspec_kw={"width_ratios": widths})
    if len(groups) == 1:
        axes = [axes]
    n = len(SYSTEMS)
    width = 0.8 / n
    for ax, (ylabel, wls, kind) in zip(axes, groups):
        xs = list(range(len(wls)))
        for i, key in enumerate(SYSTEMS):
            pos = [x + (i - (n - 1) / 2) * width for x in xs]
            style = dict(color=COLORS[key], hatch="//" if key == "direct" else None,
                         edgecolor="#555555" if key == "direct" else "white",
                         label=LABELS[key] + (" (limit)" if key == "direct" else ""))
            if kind == "lat":
                means = [med(w, key, "lat_mean_us") or 0 for w in wls]
                p99s = [med(w, key, "lat_p99_us") or 0 for w in wls]
                ax.bar(pos, means, width, yerr=[[0] * len(wls),
                                                [max(p - m, 0) for p, m in zip(p99s, means)]],
                       capsize=3, error_kw={"elinewidth": 1, "ecolor": "#333333"}, **style)
                continue
            bars = ax.bar(pos, [med(w, key) or 0 for w in wls], width, **style)
            if key == "udm-fuse":
                for w, b in zip(wls, bars):
                    va, vb = med(w, "udm-fuse"), med(w, "nbdfuse")
                    if va and vb:
                        r = va / vb
                        ax.annotate(f"{r:.2f}×", (b.get_x() + b.get_width() / 2, b.get_height()),
                                    ha="center", va="bottom", fontsize=8, fontweight="bold",
                                    color="#c62828" if is_below(r) else "#1b5e20")
        ax.set_xticks(xs)
        ax.set_xticklabels([w.label for w in wls], fontsize=9)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].legend(fontsize=9, loc="upper left")
    fig.suptitle("Block device on a FUSE file: udm's FUSE export vs nbdfuse over udm's NBD "
                 "export  (ratio = udm / nbdfuse above the udm bar)")
    fig.text(0.5, 0.01, caption, ha="center", fontsize=8, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    path = out_dir / "fuse.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------

def fio_cmd(wl: Workload, device: str, args, out_json: Path) -> list:
    return [
        "fio", f"--name={wl.key}", "--ioengine=io_uring", "--direct=1", f"--filename={device}",
        f"--rw={wl.rw}", f"--bs={wl.bs}", f"--iodepth={wl.qd}", "--numjobs=1",
        "--time_based", f"--runtime={args.runtime}", f"--size={args.size}",
        "--randrepeat=1", "--group_reporting", "--output-format=json",
        f"--output={out_json}",
    ]


@dataclass
class UdmFuse:
    """A udm daemon serving `vol` (linear over disk.img) as a file in its FUSE mount."""
    key: str                      # the system it serves: "udm-fuse" or "udm-fuse-dev"
    daemon: Service
    udm: Udm
    fuse_dir: Path
    created: list


def start_udm_fuse(udms: list, key: str, udm_bin: Path, tmp: Path, suffix: str, disk: Path,
                   size: int, extra: list) -> UdmFuse:
    """Start a daemon with its FUSE mount in tmp/udmfuseSUFFIX (its state, control socket and
    log suffixed alike) and create `vol` on it; check the mount and the file's size.  The
    daemon joins `udms` as soon as it runs, so that the cleanup stops it whatever fails next."""
    fuse_dir = tmp / f"udmfuse{suffix}"
    state = tmp / f"state{suffix}"
    ctl = tmp / f"ctl{suffix}.sock"
    state.mkdir()
    fuse_dir.mkdir()
    daemon = start_service(
        f"udm daemon{suffix}",
        [str(udm_bin), "daemon", "--state-dir", str(state), "--control", str(ctl),
         "--fuse", str(fuse_dir), *extra],
        tmp / f"udm-daemon{suffix}.log", env=dict(os.environ, RUST_BACKTRACE="1"))
    wait_for_socket(ctl, daemon, timeout=30)
    inst = UdmFuse(key, daemon, Udm(udm_bin, ctl), fuse_dir, [])
    udms.append(inst)
    inst.udm.client("create", "vol", "--table", f"0 {size // 512} linear {disk} 0")
    inst.created.append("vol")
    if not is_mounted(fuse_dir):
        raise BenchError(f"udm's FUSE mount {fuse_dir} is not in /proc/self/mountinfo; "
                         f"log tail:\n{daemon.log_tail()}")
    wait_for_file(fuse_dir / "vol", daemon, timeout=30, size=size)
    return inst


def fuse_uring_flag(udm_bin: Path) -> bool:
    """Whether this udm daemon has --fuse-uring (FUSE over io_uring or /dev/fuse)."""
    cp = run([str(udm_bin), "daemon", "--help"], timeout=30, check=False, quiet=True)
    return "--fuse-uring" in cp.stdout + cp.stderr


def transport_lines(inst: UdmFuse) -> list:
    """What the daemon's log says about its FUSE transport (lines naming io_uring)."""
    try:
        text = inst.daemon.logfile.read_text(errors="replace")
    except OSError:
        return []
    return [ln.strip()[:300] for ln in text.splitlines() if "uring" in ln.lower()][:5]


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description="udm FUSE benchmark: fio on a loop device over udm's FUSE file, over "
                    "nbdfuse on udm's NBD export, and straight on the file, side by side.")
    common.add_sizing_args(ap, runtime=10, size_help="device and backing file size (default 1G)",
                           repeat=True)
    common.add_run_args(
        ap, out="bench/results/fuse",
        tmpdir_help="where to create the temp dir (must support O_DIRECT, not tmpfs; "
                    "default $TMPDIR or /tmp)",
        keep_help="keep the temp dir (disk image, logs); mounts and loops still go")
    ap.add_argument("--connections", type=int, default=None,
                    help="nbdfuse -C N (default: nbdfuse's own default, multi-conn when the "
                         "server offers it)")
    ap.add_argument("--workloads", default=None,
                    help="comma-separated subset of: " + ",".join(w.key for w in WORKLOADS))
    ap.add_argument("--fuse-uring", choices=("compare", "on", "off", "auto"), default="compare",
                    help="the FUSE transport, when the daemon has --fuse-uring: compare (default: "
                         "a second daemon with --fuse-uring off beside one with on, both measured) "
                         "or one daemon with on, off or auto")
    args = ap.parse_args(argv)
    common.resolve_sizing(args)
    if args.runtime < 1 or args.repeat < 1:
        ap.error("--runtime and --repeat must be at least 1")
    # In place: build_table and draw_chart read the same list.
    WORKLOADS[:] = select_workloads(ap, args.workloads, list(WORKLOADS))
    return args


def host_ready() -> bool:
    """Root, the tools and /dev/fuse; an ERROR line for each that is missing."""
    if os.geteuid() != 0:
        log("ERROR: loop devices need root (losetup)")
        return False
    missing = [t for t in ("fio", "nbdfuse", "fusermount3", "losetup", "blockdev", "dd")
               if not shutil.which(t)]
    for t in missing:
        log(f"ERROR: `{t}` not found; install the Debian package "
            f"`{PACKAGES.get(t, 'coreutils')}`")
    if missing:
        return False
    if not Path("/dev/fuse").exists():
        log("ERROR: /dev/fuse is missing (modprobe fuse)")
        return False
    return True


def fresh_tmpdir(args):
    """A temp dir for this run (None after an ERROR line); loop devices an earlier, killed
    run left on files under the same base are reported, not removed (they may belong to a
    run in progress)."""
    base = tmp_base(args)
    stale = [(d, b) for d, b in loops_under(Path(base).resolve())
             if Path(b.split(" (deleted)")[0]).relative_to(Path(base).resolve())
             .parts[0].startswith("udm-fusebench-")]
    if stale:
        log("WARNING: loop devices on files of an earlier (killed?) fuse.py run: "
            + ", ".join(f"{d} ({b})" for d, b in stale)
            + "; if no other run is in progress: losetup -d DEV, then fusermount3 -u -z on its "
              "mount")
    return common.make_tmpdir(base, "udm-fusebench-", "ctl-dev.sock", resolve=True)


class Run:
    """One run: the udm daemon(s) serving `vol` over FUSE and NBD, nbdfuse on the NBD
    export, a loop device on each path and on the file, and what fio measured on each.
    `finish` detaches, unmounts and stops everything the run started."""

    def __init__(self, args, udm_bin: Path, out_dir: Path, tmp: Path):
        self.args, self.udm_bin, self.out_dir, self.tmp = args, udm_bin, out_dir, tmp
        self.size = args.size
        self.disk = tmp / "disk.img"
        self.nbd_mnt = tmp / "nbdfuse"           # nbdfuse's mount: nbd_mnt/nbd
        self.nbd_sock = tmp / "udm.sock"
        self.uri = f"nbd+unix:///vol?socket={self.nbd_sock}"
        self.daemon: Service | None = None
        self.nbdfuse: Service | None = None
        self.udms: list = []                     # UdmFuse: the main daemon, then /dev/fuse's
        self.loops: list = []
        self.results: dict = {}
        self.notes: list = []
        uring = Path("/sys/module/fuse/parameters/enable_uring")
        self.meta = {
            **common.base_meta(udm_bin),
            "nbdfuse_version": tool_version(["nbdfuse", "--version"]),
            "losetup_version": tool_version(["losetup", "--version"]),
            "fuse_enable_uring": uring.read_text().strip() if uring.exists() else None,
            "runtime": args.runtime, "size": self.size, "size_human": human_size(self.size),
            "repeat": args.repeat, "tmpdir": str(tmp), "workloads": [w.key for w in WORKLOADS],
        }
        self.uring_args = self.choose_transport()

    def choose_transport(self) -> list:
        """The FUSE transport: with --fuse-uring in the daemon, compare FUSE over io_uring
        with /dev/fuse (two daemons on the same file, alternating), or run one in the mode
        asked.  Returns the main daemon's options."""
        global SYSTEMS
        if not fuse_uring_flag(self.udm_bin):
            self.meta["fuse_transport"] = "the daemon's default"
            self.meta["fuse_uring_not_compared"] = "this udm daemon has no --fuse-uring"
            return []
        mode = self.args.fuse_uring
        if mode == "compare":
            SYSTEMS = ["udm-fuse", "udm-fuse-dev", "nbdfuse", "direct"]
            LABELS["udm-fuse"] = "udm FUSE (io_uring)"
            self.meta["fuse_transport"] = ("`--fuse-uring on` (udm FUSE) against a second "
                                           "daemon with `--fuse-uring off` (/dev/fuse)")
            return ["--fuse-uring", "on"]
        self.meta["fuse_transport"] = f"`--fuse-uring {mode}`"
        self.meta["fuse_uring_not_compared"] = f"--fuse-uring {mode} was asked for"
        return ["--fuse-uring", mode]

    def note(self, text: str | None) -> None:
        """A caveat for the report (and the log); None is nothing."""
        if text:
            log(f"WARNING: {text}")
            self.notes.append(text)

    def start_daemons(self) -> None:
        """The daemon (NBD + FUSE) with `vol`, linear over disk.img; the /dev/fuse one."""
        meta = self.meta
        fill_backing_file(self.disk, self.size, timeout=max(600, self.size / (20 << 20)))
        self.nbd_mnt.mkdir()
        self.daemon = start_udm_fuse(self.udms, "udm-fuse", self.udm_bin, self.tmp, "",
                                     self.disk, self.size,
                                     ["--nbd", f"unix:{self.nbd_sock}", *self.uring_args]).daemon
        wait_for_socket(self.nbd_sock, self.daemon, timeout=30)
        check_export(self.uri, self.size, "udm vol (linear)")
        if "udm-fuse-dev" in SYSTEMS:
            start_udm_fuse(self.udms, "udm-fuse-dev", self.udm_bin, self.tmp, "-dev",
                           self.disk, self.size, ["--fuse-uring", "off"])
        for inst in self.udms:
            note = direct_io_note(inst.daemon.name, inst.daemon.proc.pid, self.disk)
            meta.setdefault("udm_o_direct", {})[inst.key] = note is None
            self.note(note)
            meta.setdefault("fuse_transport_log", {})[inst.key] = transport_lines(inst)
        if "udm-fuse-dev" in SYSTEMS and not meta["fuse_transport_log"]["udm-fuse"]:
            self.notes.append("the `--fuse-uring on` daemon's log does not mention io_uring: "
                              "check in udm-daemon.log that it really serves FUSE over io_uring")
        meta["fuse_enable_uring_after_start"] = meta["fuse_enable_uring"] and \
            Path("/sys/module/fuse/parameters/enable_uring").read_text().strip()
        cp = run(["nbdinfo", "--json", self.uri], timeout=30, check=False, quiet=True) \
            if shutil.which("nbdinfo") else None
        if cp is not None and cp.returncode == 0:
            try:
                info = json.loads(cp.stdout)
                exp = (info.get("exports") or [{}])[0]
                meta["udm_export_can_multi_conn"] = exp.get("can_multi_conn")
            except (json.JSONDecodeError, IndexError, AttributeError):
                pass

    def start_nbdfuse(self) -> None:
        """nbdfuse over the same export, and how many connections it opened."""
        nbd_cmd = ["nbdfuse", "-P", str(self.tmp / "nbdfuse.pid")]
        if self.args.connections:
            nbd_cmd += ["-C", str(self.args.connections)]
        nbd_cmd += [str(self.nbd_mnt), self.uri]
        self.nbdfuse = start_service("nbdfuse", nbd_cmd, self.tmp / "nbdfuse.log")
        wait_for_file(self.tmp / "nbdfuse.pid", self.nbdfuse, timeout=30)
        wait_for_file(self.nbd_mnt / "nbd", self.nbdfuse, timeout=30, size=self.size)
        self.meta["nbdfuse_connections"] = self.args.connections or \
            (4 if self.meta.get("udm_export_can_multi_conn") else 1)
        try:
            self.meta["nbdfuse_sockets"] = sum(
                1 for fd in Path(f"/proc/{self.nbdfuse.proc.pid}/fd").iterdir()
                if os.readlink(fd).startswith("socket:"))
        except OSError:
            pass

    def attach_loops(self) -> None:
        """One loop device per udm daemon (`udm attach`), nbdfuse's and the file's, each
        checked for its size and direct I/O."""
        for inst in self.udms:
            cp = inst.udm.client("attach", "vol", timeout=60)
            dev = cp.stdout.strip()
            if not dev.startswith("/dev/loop"):
                raise BenchError(f"udm attach vol printed {cp.stdout!r}")
            self.loops.append(LoopDev(inst.key, dev, inst.fuse_dir / "vol", inst))
        for system, backing in (("nbdfuse", self.nbd_mnt / "nbd"), ("direct", self.disk)):
            self.loops.append(LoopDev(system, losetup_attach(backing), backing))
        for lp in self.loops:
            system, dev, backing = lp.system, lp.device, lp.backing
            got = device_size(dev)
            if got != self.size:
                raise BenchError(f"{dev} ({LABELS[system]}) is {got} bytes, expected {self.size}")
            dio = loop_dio(dev)
            self.meta.setdefault("loop_devices", {})[system] = {
                "device": dev, "backing": str(backing), "dio": dio}
            log(f"{LABELS[system]}: {dev} on {backing} (direct I/O: {dio})")
            if dio is False:
                self.note(f"{LABELS[system]}'s loop device {dev} runs WITHOUT direct I/O (the "
                          f"kernel refused it on {backing.name}): its figures include the page "
                          f"cache")

    def down(self, key: str) -> str | None:
        """Why the server behind `key`'s loop device is not running, or None."""
        lp = next(lp for lp in self.loops if lp.system == key)
        server = lp.owner.daemon if lp.owner else self.daemon
        if key != "direct" and not server.alive():
            return f"{server.name} is not running (exit code {server.proc.returncode})"
        if key == "nbdfuse" and not self.nbdfuse.alive():
            return f"nbdfuse is not running (exit code {self.nbdfuse.proc.returncode})"
        return None

    def run_matrix(self) -> None:
        """Per workload and repeat, every system back to back, the order reversed every
        other repeat."""
        args = self.args
        bymap = {lp.system: lp for lp in self.loops}
        total = len(WORKLOADS) * args.repeat * len(SYSTEMS)
        est = total * (args.runtime + 1)
        log(f"{total} fio runs of {args.runtime} s (about {est // 60} min {est % 60} s)")
        n = 0
        fio_timeout = args.runtime + 90
        for wl in WORKLOADS:
            for rep in range(1, args.repeat + 1):
                for key in (SYSTEMS if rep % 2 else SYSTEMS[::-1]):
                    n += 1
                    tag = f"[{n}/{total}] {wl.key:<18} {key:<9} r{rep}"
                    c = self.results.setdefault((wl.key, key), Cell())
                    dead = self.down(key)
                    if dead:
                        c.errors.append(dead)
                        if dead not in self.notes:
                            self.notes.append(dead + f" from {wl.key} r{rep} on")
                        log(f"{tag}: SKIPPED, {dead}")
                        continue
                    stem = f"{wl.key}.{key}.r{rep}"
                    cmd = fio_cmd(wl, bymap[key].device, args, self.out_dir / f"{stem}.json")
                    smp = fio_cell(cmd,
                                   lambda cmd: run_group(cmd, timeout=fio_timeout, cwd=self.tmp),
                                   parse_fio_json, wl, c, self.out_dir, stem, tag)
                    if smp is None:
                        continue
                    c.samples.append(smp)
                    unit = "IOPS" if wl.metric == "iops" else "MB/s"
                    log(f"{tag}: {smp.value:>10.0f} {unit}  clat mean {smp.lat_mean_us:.0f} µs "
                        f"p99 {smp.lat_p99_us:.0f} µs")

    def check_after(self, cached_before) -> None:
        """What the runs may have changed: the page cache, the bytes every path reads, the
        loop devices' direct I/O."""
        cached_after = resident_bytes(self.disk)
        self.meta["page_cache_bytes"] = {"before": cached_before, "after": cached_after}
        self.note(page_cache_note(self.disk.name, self.size, cached_before, cached_after,
                                  "path is meant to bypass it"))
        if all(u.daemon.alive() for u in self.udms) and self.nbdfuse.alive():
            try:
                note = same_bytes(self.loops, self.disk, self.size)
            except BenchError as e:
                note = f"reading back after the runs failed: {e}"
            if note:
                log(f"WARNING: {note} (after the runs)")
                self.notes.append(note + " (after the runs: a stale cache on some path)")
        for lp in self.loops:
            dio = loop_dio(lp.device)
            if dio is not None and dio != self.meta["loop_devices"][lp.system]["dio"]:
                self.notes.append(f"{LABELS[lp.system]}'s loop device changed direct I/O to "
                                  f"{dio} during the run")

    def report(self) -> int:
        """The table, results.json and the chart; the exit status the bars give."""
        self.meta["notes"] = self.notes
        table, summary = build_table(self.results, self.meta)
        write_results(self.out_dir, table, {"meta": self.meta, "workloads": summary})
        if self.args.no_charts:
            log("chart skipped (--no-charts)")
        else:
            for p in draw_chart(self.results, self.out_dir, self.meta):
                log(f"chart: {p}")
        log(f"results in {self.out_dir}")
        return exit_code(self.results)

    def measure_all(self) -> int:
        """Everything started and checked, the matrix, the checks after it, the report; the
        exit status."""
        self.start_daemons()
        self.start_nbdfuse()
        self.attach_loops()
        note = same_bytes(self.loops, self.disk, self.size)
        if note:
            raise BenchError(note + " (before any run)")
        cached_before = resident_bytes(self.disk)
        self.run_matrix()
        self.check_after(cached_before)
        return self.report()

    def finish(self, rc: int) -> int:
        """Cleanup, which must finish: a second Ctrl-C or SIGTERM is ignored (every step has
        a timeout).  Returns `rc`, or 3 when a run that passed left something behind."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        clean = cleanup(self.tmp, self.loops, self.udms, self.nbdfuse, self.nbd_mnt)
        copy_logs([u.daemon for u in self.udms] + [self.nbdfuse], self.out_dir)
        if not clean:
            log(f"WARNING: cleanup incomplete; {self.tmp} left in place (see messages above)")
        elif self.args.keep:
            log(f"cleaned up (loops detached, mounts gone); kept temp dir {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
            log("cleaned up (loops detached, mounts gone, temp dir removed)")
        return 3 if not clean and rc == 0 else rc


def main(argv=None) -> int:
    args = parse_args(argv)
    trap_signals()
    if not host_ready():
        return 2
    out_dir = prepare_out_dir(args.out)
    udm_bin = locate_udm(args, find_udm)
    if udm_bin is None:
        return 2
    tmp = fresh_tmpdir(args)
    if tmp is None:
        return 2
    r = Run(args, udm_bin, out_dir, tmp)
    return common.guarded(r.measure_all, r.finish)

def cleanup(tmp: Path, loops: list, udms: list, nbdfuse: Service | None,
            nbd_mnt: Path) -> bool:
    """Loops first (ours, and any other loop on a file in our temp dir), then nbdfuse, then the
    udm devices and daemons (each unmounts its FUSE dir), then whatever is still mounted under
    the temp dir.  True when nothing of ours is left."""
    ok = True
    try:
        for lp in reversed(loops):
            owner = lp.owner if lp.owner is not None and lp.owner.daemon.alive() else None
            detach_loop(lp.device, udm=owner.udm if owner else None)
        # A loop whose losetup was interrupted before we read its name.
        for dev, back in loops_under(tmp):
            log(f"detaching leftover {dev} ({back})")
            detach_loop(dev)
    except BenchError as e:
        log(f"loop cleanup: {e}")
    if nbdfuse is not None:
        try:
            if not unmount_fuse(nbd_mnt):
                ok = False
        except BenchError as e:
            log(f"unmounting nbdfuse: {e}")
        try:
            nbdfuse.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        nbdfuse.stop(grace=5)
    for inst in reversed(udms):
        if inst.daemon.alive():
            for name in reversed(inst.created):
                try:
                    inst.udm.client("remove", name, timeout=30, check=False)
                except BenchError as e:
                    log(f"udm remove {name}: {e}")
        stop_daemon(inst.daemon, grace=20)
    try:
        for mp in mounts_under(tmp):
            log(f"{mp} still mounted after its server stopped; unmounting")
            unmount_fuse(Path(mp))
        left_loops = loops_under(tmp)
        left_mounts = mounts_under(tmp)
    except BenchError as e:
        log(f"final check: {e}")
        return False
    if left_loops:
        log(f"WARNING: loop devices still on files in {tmp}: {left_loops}")
        ok = False
    if left_mounts:
        log(f"WARNING: still mounted under {tmp}: {left_mounts}")
        ok = False
    return ok


if __name__ == "__main__":
    _maybe_reexec_for_matplotlib()
    sys.exit(main())
