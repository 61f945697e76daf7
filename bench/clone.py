#!/usr/bin/env python3
"""Clone benchmark for udm: the dm-clone seed's table, reproduced side by side on this machine.

For each region size (4 KiB ... 128 KiB) and each workload (4 KiB random writes and reads at
iodepth 1 and 32, 256 KiB sequential writes and reads at iodepth 32), on a FRESH unhydrated
volume every time (new metadata and destination files, clone created with ``no_hydration`` so
no background copying mixes in), measure:

* udm ``clone`` over a slow source (udm ``delay`` device adding 1 ms to every read);
* udm ``linear`` over the destination (the seed's "raw SSD" row; once per workload);
* the slow source itself (read workloads only; the seed's "HDD" row);
* qemu-nbd serving a qcow2 overlay (cluster size = region size) whose backing file is the
  same slow source (qemu's nbd driver over udm's ``slowsrc`` export);
* nbdkit's cow filter (cow-block-size = region size) over nbdkit's delay filter (rdelay=1ms).

Then, separately: background hydration throughput against the source's sequential read
bandwidth — from a remote, rate-limited NBD source (nbdkit's rate filter, 2 Gbit/s; the bar),
and from the plain file and the delayed source on the destination's own disk (reported against
the disk's same-disk copy ceiling) —, user random-read IOPS while hydrating against an idle
clone (three alternating pairs, medians), and the metadata size per TiB from
docs/clone-metadata.md.

Also: a clone whose regions are all hydrated (4 KiB regions by default) against ``linear``
over its own destination file, alternating, every run shown.

Usage:  python3 bench/clone.py [--runtime 5] [--size 1G] [--regions 4,8,16,32,64,128] [--quick]
                               [--out bench/results/clone] [--hydration-size 4G] [--keep]

The generic helpers (processes, fio JSON, sizes, udm verbs) come from foundation.py.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import foundation as fnd  # noqa: E402
from common import (  # noqa: E402
    BenchError, copy_logs, locate_udm, make_tmpdir, prepare_out_dir, remove_tmp, run,
    select_workloads, stop_daemon, tmp_base, tool_version, trap_signals,
)
from foundation import (  # noqa: E402
    Service, Udm, Workload, check_export, fill_backing_file, find_udm, parse_fio_json,
    start_service, wait_for_socket,
)
from report import (  # noqa: E402
    human_size, markdown_table, parse_size, write_results,
)

REPO = fnd.REPO
SECTOR = 512
META_BLOCK = 4096
TIB = 1 << 40


def log(msg: str) -> None:
    print(f"[clone] {msg}", file=sys.stderr, flush=True)


# common's and foundation's helpers (run, Service, fill_backing_file ...) log through their
# module-level `log`; make them speak with this script's prefix.
common.log = fnd.log = log


def _maybe_reexec_for_matplotlib() -> None:
    """Re-run under /usr/bin/python3 when this interpreter (e.g. a pyenv one) lacks matplotlib."""
    common.maybe_reexec_for_matplotlib(__file__)


# --------------------------------------------------------------------------------------------
# workloads, systems, results
# --------------------------------------------------------------------------------------------

# The seed's order: latency (qd1), IOPS (qd32), bandwidth (256 KiB qd32); writes then reads.
WORKLOADS = [
    Workload("randwrite-4k-qd1", "randwrite 4k qd1", "randwrite", "4k", 1),
    Workload("randread-4k-qd1", "randread 4k qd1", "randread", "4k", 1),
    Workload("randwrite-4k-qd32", "randwrite 4k qd32", "randwrite", "4k", 32),
    Workload("randread-4k-qd32", "randread 4k qd32", "randread", "4k", 32),
    Workload("write-256k-qd32", "write 256k qd32", "write", "256k", 32),
    Workload("read-256k-qd32", "read 256k qd32", "read", "256k", 32),
]

# Per-region systems, in the order they run for each (workload, region).
REGION_SYSTEMS = ["clone", "qcow2", "cow"]
LABELS = {
    "clone": "udm clone",
    "linear": "udm linear (dest)",
    "source": "slow source",
    "qcow2": "qemu qcow2",
    "cow": "nbdkit cow",
    "hydrated": "udm clone (hydrated)",
    "hydlinear": "udm linear (its dest)",
}
COLORS = {"clone": "#1f77b4", "qcow2": "#2ca02c", "cow": "#ff7f0e", "linear": "#555555",
          "source": "#c62828"}

BAR_LINEAR_4K = 0.95      # 4 KiB regions: clone randwrite >= 0.95x linear
BAR_HYDRATED = 0.95       # a fully hydrated clone >= 0.95x linear on its destination
BAR_QCOW2_4K = 3.0        # 4 KiB regions: clone randwrite >= 3x qcow2
BAR_QCOW2_ALL = 1.0       # every region size: clone >= qcow2
BAR_HYDRATION = 0.9       # background hydration >= 0.9x the source's sequential read bandwidth
BAR_INTERFERENCE = 0.8    # user randread while hydrating >= 0.8x idle


@dataclass
class Res:
    sample: fnd.Sample | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def value(self):
        return self.sample.value if self.sample else None


def fmt_value(v, metric: str) -> str:
    if v is None:
        return "—"
    if metric == "iops":
        if v >= 10000:
            return f"{v / 1000:.1f}k"
        return f"{v:.0f}"
    return f"{v:.0f} MB/s"


def fmt_cell(res: Res | None, wl: Workload) -> str:
    if res is None:
        return "—"
    if res.sample is None:
        return "error"
    s = fmt_value(res.sample.value, wl.metric)
    if wl.qd == 1:
        s += f" ({fmt_lat(res.sample.lat_mean_us)})"
    return s


def fmt_lat(us: float) -> str:
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "?"
    if us >= 1000:
        return f"{us / 1000:.1f} ms"
    return f"{us:.0f} µs"


def ratio(a: Res | None, b: Res | None):
    va = a.value() if a else None
    vb = b.value() if b else None
    if va is None or vb is None or vb == 0:
        return None
    return va / vb


def fmt_ratio(r, bar: float | None = None) -> str:
    if r is None:
        return "—"
    text = f"{r:.2f}×" if r < 100 else f"{r:.0f}×"
    if bar is not None and round(r, 2) < bar:
        return f"**{text} ✘**"
    return text


def region_label(kib: int) -> str:
    return f"{kib} KiB"


def metadata_bytes(volume_bytes: int, region_bytes: int) -> tuple[int, int, int]:
    """docs/clone-metadata.md: R regions, B bitmap blocks per area, (2 + 2B) blocks of 4 KiB."""
    r = -(-volume_bytes // region_bytes)
    w = -(-r // 64)
    b = max(1, -(-w // 510))
    return r, b, (2 + 2 * b) * META_BLOCK


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args, udm_bin: Path, tmp: Path, out_dir: Path):
        self.args = args
        self.udm_bin = udm_bin
        self.tmp = tmp
        self.out_dir = out_dir
        self.size = args.size
        self.sectors = args.size // SECTOR
        self.services: list[Service] = []
        self.daemon: Service | None = None
        self.udm: Udm | None = None
        self.created: list[str] = []
        self.notes: list[str] = []
        self.results: dict = {}          # (wl.key, system, region_kib or None) -> Res
        self.extras: dict = {}
        self.meta_used: dict = {}        # region_kib -> (used, total) metadata blocks (status)
        self.counter = 0
        self.fio_timeout = args.runtime + 90
        self.src = tmp / "src.img"
        self.nbd_sock = tmp / "udm.sock"
        self.qcow2_backing: str | None = None
        self.qcow2_source_note = ""
        self.cow_block_size_ok = True
        self.cow_available = True
        self.qcow2_available = True

    # ---- helpers -------------------------------------------------------------------------

    def uri(self, name: str) -> str:
        return f"nbd+unix:///{name}?socket={self.nbd_sock}"

    def next_id(self) -> int:
        self.counter += 1
        return self.counter

    def udm_create(self, name: str, table: str) -> None:
        self.udm.client("create", name, "--table", table, timeout=60)
        self.created.append(name)

    def udm_remove(self, name: str) -> None:
        """Remove a device; if a client still holds it (e.g. a fio just killed), force it."""
        if name in self.created:
            self.created.remove(name)
        if self.udm.client("remove", name, timeout=120, check=False) is None:
            time.sleep(0.5)
            if self.udm.client("remove", name, timeout=120, check=False) is None:
                log(f"removing {name} with --force")
                self.udm.client("remove", "--force", name, timeout=120, check=False)

    def status_json(self, name: str) -> dict:
        cp = self.udm.client("status", name, "--json", timeout=30)
        return json.loads(cp.stdout)

    def clone_details(self, name: str) -> dict:
        return self.status_json(name)["targets"][0]["details"]

    def ensure_daemon(self) -> None:
        if not self.daemon.alive():
            raise BenchError(f"udm daemon exited (code {self.daemon.proc.returncode}); log tail:"
                             f"\n{self.daemon.log_tail()}")

    def stop_service(self, svc: Service) -> None:
        svc.stop(grace=10)
        if svc in self.services:
            self.services.remove(svc)

    def start(self, name: str, cmd: list, logname: str, sock: Path, env=None) -> Service:
        try:
            sock.unlink()
        except FileNotFoundError:
            pass
        logfile = self.tmp / logname
        svc = start_service(name, cmd, logfile, env=env, cwd=self.tmp)
        # Append each run's log to one file per peer kind, kept in --out.
        self.services.append(svc)
        svc.socket = sock
        wait_for_socket(sock, svc, timeout=30)
        return svc

    def fio(self, name: str, wl_args: list, out_json: Path, timeout: float | None = None):
        cmd = ["fio", f"--name={name}", *wl_args, "--numjobs=1", "--randrepeat=1",
               "--group_reporting", "--output-format=json", f"--output={out_json}"]
        cp = run(cmd, timeout=timeout or self.fio_timeout, check=False, quiet=True, cwd=self.tmp)
        if cp.returncode != 0:
            raise BenchError(f"fio exit {cp.returncode}: "
                             f"{(cp.stderr or cp.stdout).strip()[-1500:]}\n  command: "
                             f"{' '.join(cmd)}")
        return cmd

    def measure(self, wl: Workload, system: str, region_kib, uri: str, tag: str,
                suffix: str = "", store: bool = True) -> Res:
        """One fio run of `wl` against `uri`; returns the result, kept in the matrix's results
        with `store`."""
        rkey = "" if region_kib is None else f".r{region_kib}k"
        out_json = self.out_dir / f"{wl.key}.{system}{rkey}{suffix}.json"
        args = ["--ioengine=nbd", f"--uri={uri}", f"--rw={wl.rw}", f"--bs={wl.bs}",
                f"--iodepth={wl.qd}", "--time_based", f"--runtime={self.args.runtime}",
                f"--size={self.size}"]
        res = Res()
        try:
            self.fio(wl.key, args, out_json)
            res.sample = parse_fio_json(out_json, wl)
        except (BenchError, json.JSONDecodeError, KeyError, OSError) as e:
            res.error = str(e)
            (self.out_dir / f"{wl.key}.{system}{rkey}.err").write_text(str(e) + "\n")
            log(f"{tag} {wl.key} {system} {region_kib or ''}: FAILED: {str(e)[:500]}")
        else:
            unit = "IOPS" if wl.metric == "iops" else "MB/s"
            log(f"{tag} {wl.key:<18} {LABELS[system]:<18} "
                f"{'' if region_kib is None else region_label(region_kib):>8}: "
                f"{res.sample.value:>9.0f} {unit}  clat mean {res.sample.lat_mean_us:.0f} µs")
        if store:
            self.results[(wl.key, system, region_kib)] = res
        return res

    def meta_file(self, path: Path, volume: int, region_bytes: int) -> None:
        need = metadata_bytes(volume, region_bytes)[2]
        size = max(8 << 20, -(-need // (1 << 20)) * (1 << 20))
        with open(path, "wb") as f:
            f.truncate(size)

    def dest_file(self, path: Path, volume: int) -> None:
        """A fresh destination file: preallocated (the seed's destination is a whole logical
        volume on the SSD) or sparse, per --dest."""
        with open(path, "wb") as f:
            if self.args.dest == "falloc":
                os.posix_fallocate(f.fileno(), 0, volume)
            else:
                f.truncate(volume)

    @contextlib.contextmanager
    def clone_files(self, region_bytes: int, volume: int):
        """A fresh clone's files, (id, all-zero metadata, destination), deleted afterwards."""
        n = self.next_id()
        meta = self.tmp / f"meta{n}.img"
        dest = self.tmp / f"dest{n}.img"
        self.meta_file(meta, volume, region_bytes)
        self.dest_file(dest, volume)
        try:
            yield n, meta, dest
        finally:
            for p in (meta, dest):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass

    @staticmethod
    def clone_table(meta: Path, dest: Path, source: str, region_bytes: int, volume: int,
                    features=("no_hydration",),
                    core=("hydration_threshold", "256", "hydration_batch_size", "64")) -> str:
        feat = f"{len(features)} {' '.join(features)}".strip() if features else "0"
        return (f"0 {volume // SECTOR} clone {meta} {dest} {source} {region_bytes // SECTOR} "
                f"{feat} {len(core)} {' '.join(core)}")

    @contextlib.contextmanager
    def clone(self, region_bytes: int, source: str, volume: int, **table_args):
        """A fresh clone device (new all-zero metadata, new destination file); `table_args`
        (features, core) as clone_table's."""
        with self.clone_files(region_bytes, volume) as (n, meta, dest):
            name = f"cl{n}"
            try:
                self.udm_create(name, self.clone_table(meta, dest, source, region_bytes, volume,
                                                       **table_args))
                yield name
            finally:
                if name in self.created and self.daemon.alive():
                    self.udm_remove(name)

    @contextlib.contextmanager
    def linear_fresh(self):
        """udm linear over a fresh destination-like file (for the write workloads)."""
        n = self.next_id()
        name = f"lin{n}"
        dest = self.tmp / f"lin{n}.img"
        self.dest_file(dest, self.size)
        try:
            self.udm_create(name, f"0 {self.sectors} linear {dest} 0")
            yield name
        finally:
            if name in self.created and self.daemon.alive():
                self.udm_remove(name)
            try:
                dest.unlink()
            except FileNotFoundError:
                pass

    @contextlib.contextmanager
    def qcow2(self, region_bytes: int):
        """qemu-nbd serving a fresh qcow2 overlay (cluster = region) over the slow backing."""
        n = self.next_id()
        ov = self.tmp / f"ov{n}.qcow2"
        sock = self.tmp / "qemu.sock"
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", self.qcow2_backing,
             "-o", f"cluster_size={region_bytes}", str(ov), str(self.size)], timeout=60)
        svc = None
        try:
            svc = self.start("qemu-nbd qcow2",
                             ["qemu-nbd", "-t", "-e", "8", "-k", str(sock), "-f", "qcow2",
                              "--cache=none", "--aio=io_uring", str(ov)],
                             f"qemu-nbd-{n}.log", sock)
            yield f"nbd+unix:///?socket={sock}"
        finally:
            if svc is not None:
                self.stop_service(svc)
                self.keep_log(svc, "qemu-nbd.log")
            try:
                ov.unlink()
            except FileNotFoundError:
                pass

    def cow_cmd(self, sock: Path, region_bytes: int | None) -> list:
        cmd = ["nbdkit", "-f", "-U", str(sock), "--exit-with-parent", "--filter=cow",
               "--filter=delay", "file", str(self.src), "rdelay=1ms"]
        if region_bytes is not None:
            cmd.append(f"cow-block-size={region_bytes}")
        return cmd

    @contextlib.contextmanager
    def cow(self, region_bytes: int):
        """nbdkit cow filter (block = region) over the delay filter over the source file."""
        n = self.next_id()
        sock = self.tmp / "cow.sock"
        svc = None
        try:
            svc = self.start("nbdkit cow",
                             self.cow_cmd(sock, region_bytes if self.cow_block_size_ok else None),
                             f"nbdkit-cow-{n}.log", sock,
                             env=dict(os.environ, TMPDIR=str(self.tmp)))
            yield f"nbd+unix:///?socket={sock}"
        finally:
            if svc is not None:
                self.stop_service(svc)
                self.keep_log(svc, "nbdkit-cow.log")

    def keep_log(self, svc: Service, name: str) -> None:
        """Append a per-run peer log to one log file in --out (only if it said something)."""
        try:
            # Drop the noise of wait_for_socket's probe connection (connect, then close).
            text = "\n".join(ln for ln in svc.logfile.read_text(errors="replace").splitlines()
                             if "handshake: Broken pipe" not in ln)
            if text.strip():
                with open(self.out_dir / name, "a") as f:
                    f.write(f"==== {' '.join(map(str, svc.cmd))}\n{text}\n")
            svc.logfile.unlink()
        except OSError:
            pass

    # ---- setup and probes ----------------------------------------------------------------

    def start_daemon(self) -> None:
        ctl = self.tmp / "ctl.sock"
        (self.tmp / "state").mkdir()
        cmd = [str(self.udm_bin), "daemon", "--state-dir", str(self.tmp / "state"),
               "--control", str(ctl), "--nbd", f"unix:{self.nbd_sock}"]
        if self.args.nbd_threads:
            cmd += ["--nbd-threads", str(self.args.nbd_threads)]
        self.daemon = start_service("udm daemon", cmd, self.tmp / "udm-daemon.log",
                                    env=dict(os.environ, RUST_BACKTRACE="1"))
        self.services.append(self.daemon)
        wait_for_socket(ctl, self.daemon, timeout=30)
        self.udm = Udm(self.udm_bin, ctl)

    def read_back(self, what: str, cmd_src: list, length: int = 1 << 20) -> float:
        """Copy the first `length` bytes of an image with `qemu-img dd` in 4 KiB reads, compare
        with the source file; return the seconds it took (a slow source shows ~1 ms a read)."""
        out = self.tmp / "probe.raw"
        try:
            out.unlink()
        except FileNotFoundError:
            pass
        t0 = time.monotonic()
        run(["qemu-img", "dd", *cmd_src, "-O", "raw", f"of={out}", "bs=4096",
             f"count={length // 4096}"], timeout=120)
        dt = time.monotonic() - t0
        with open(out, "rb") as a, open(self.src, "rb") as b:
            if a.read(length) != b.read(length):
                raise BenchError(f"{what}: the first {length} bytes differ from the source")
        out.unlink()
        return dt

    def probe_peers(self) -> None:
        # -- the clone itself answers with the source's data
        with self.clone(4096, "slowsrc", self.size) as name:
            dt = self.read_back("udm clone", ["-f", "raw", f"if={self.uri(name)}"])
            log(f"probe: udm clone reads back the source (256 reads of 4 KiB in {dt:.2f} s)")
            self.extras["probe_clone_s"] = dt
        dt = self.read_back("udm slowsrc", ["-f", "raw", f"if={self.uri('slowsrc')}"])
        log(f"probe: udm slowsrc: 256 reads of 4 KiB in {dt:.2f} s")
        self.extras["probe_slowsrc_s"] = dt

        # -- qemu: nbd driver over udm's slow export as the qcow2 backing file
        if not (shutil.which("qemu-img") and shutil.which("qemu-nbd")):
            self.qcow2_available = False
            self.notes.append("qemu qcow2 not measured: qemu-img/qemu-nbd missing "
                              "(apt-get install qemu-utils)")
        else:
            backing = json.dumps({"driver": "raw", "file": {
                "driver": "nbd", "server": {"type": "unix", "path": str(self.nbd_sock)},
                "export": "slowsrc"}}, separators=(",", ":"))
            self.qcow2_backing = "json:" + backing
            ok, err = self.probe_qcow2()
            if ok:
                self.qcow2_source_note = ("qcow2 backing = qemu's nbd driver over udm's `slowsrc` "
                                          "export (the same 1 ms delay device as the clone's)")
            else:
                log(f"qemu's nbd driver over udm's slowsrc did not work ({err}); falling back to "
                    f"nbdkit's delay filter")
                sock = self.tmp / "nbdkit-delay.sock"
                self.start("nbdkit delay (qcow2 backing)",
                           ["nbdkit", "-f", "-U", str(sock), "--exit-with-parent",
                            "--filter=delay", "file", str(self.src), "rdelay=1ms"],
                           "nbdkit-delay.log", sock)
                backing = json.dumps({"driver": "raw", "file": {
                    "driver": "nbd", "server": {"type": "unix", "path": str(sock)}}},
                    separators=(",", ":"))
                self.qcow2_backing = "json:" + backing
                ok, err2 = self.probe_qcow2()
                if ok:
                    self.qcow2_source_note = (
                        f"qcow2 backing = qemu's nbd driver over `nbdkit --filter=delay file "
                        f"rdelay=1ms` (udm's slowsrc export did not work as a backing file: "
                        f"{err[:200]})")
                else:
                    self.qcow2_available = False
                    self.qcow2_source_note = (f"qcow2 not measured: no slow backing worked "
                                              f"(udm: {err[:200]}; nbdkit: {err2[:200]})")
            self.notes.append(self.qcow2_source_note)

        # -- nbdkit cow + delay, with cow-block-size
        if not shutil.which("nbdkit"):
            self.cow_available = False
            self.notes.append("nbdkit cow not measured: nbdkit missing (apt-get install nbdkit)")
            return
        sock = self.tmp / "cow.sock"
        for block in (65536, None):
            svc = None
            try:
                svc = self.start("nbdkit cow (probe)", self.cow_cmd(sock, block),
                                 "nbdkit-cow-probe.log", sock,
                                 env=dict(os.environ, TMPDIR=str(self.tmp)))
                uri = f"nbd+unix:///?socket={sock}"
                check_export(uri, self.size, "nbdkit cow")
                dt = self.read_back("nbdkit cow", ["-f", "raw", f"if={uri}"])
                log(f"probe: nbdkit cow+delay{' cow-block-size' if block else ''}: 256 reads of "
                    f"4 KiB in {dt:.2f} s")
                self.extras["probe_cow_s"] = dt
                if block is None:
                    self.cow_block_size_ok = False
                    self.notes.append("nbdkit cow: cow-block-size was refused by this nbdkit, so "
                                      "its column uses the filter's default block size "
                                      "whatever the region size")
                break
            except BenchError as e:
                log(f"probe: nbdkit cow {'with' if block else 'without'} cow-block-size: {e}")
                if block is None:
                    self.cow_available = False
                    self.notes.append(f"nbdkit cow not measured: {str(e)[:300]}")
            finally:
                if svc is not None:
                    self.stop_service(svc)
                    self.keep_log(svc, "nbdkit-cow.log")
        if self.cow_available:
            self.notes.append("nbdkit cow: `nbdkit --filter=cow --filter=delay file SRC rdelay=1ms"
                              + (" cow-block-size=<region>" if self.cow_block_size_ok else "")
                              + "`; the delay filter sits under the cow filter, so only reads of "
                                "the source are delayed (1 ms); the overlay is a deleted "
                                "temporary file in the page cache, lost at exit")

    def probe_qcow2(self) -> tuple[bool, str]:
        ov = self.tmp / "probe.qcow2"
        try:
            run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", self.qcow2_backing,
                 "-o", "cluster_size=65536", str(ov), str(self.size)], timeout=60)
            dt = self.read_back("qcow2 overlay", ["-f", "qcow2", f"if={ov}"])
            log(f"probe: qcow2 over its slow backing: 256 reads of 4 KiB in {dt:.2f} s")
            self.extras["probe_qcow2_s"] = dt
            return True, ""
        except BenchError as e:
            return False, str(e)
        finally:
            try:
                ov.unlink()
            except FileNotFoundError:
                pass

    # ---- the matrix ----------------------------------------------------------------------

    def run_matrix(self) -> None:
        regions = self.args.regions
        per_wl = 1 + len(regions) * (1 + self.qcow2_available + self.cow_available)
        total = len(WORKLOADS) * per_wl + sum(1 for w in WORKLOADS if w.direction == "read")
        log(f"matrix: {total} fio runs of {self.args.runtime} s "
            f"(about {total * (self.args.runtime + 1.5) / 60:.0f} min)")
        n = 0
        for wl in WORKLOADS:
            self.ensure_daemon()
            # The seed's raw SSD row: udm linear over a destination. Writes go to a fresh sparse
            # file (as the clone's destination is); reads to the fully written source file, so
            # they hit allocated blocks as on a real disk.
            n += 1
            if wl.direction == "write":
                with self.linear_fresh() as name:
                    self.measure(wl, "linear", None, self.uri(name), f"[{n}/{total}]")
            else:
                self.measure(wl, "linear", None, self.uri("linsrc"), f"[{n}/{total}]")
                n += 1
                self.measure(wl, "source", None, self.uri("slowsrc"), f"[{n}/{total}]")
            for kib in regions:
                rb = kib << 10
                self.ensure_daemon()
                n += 1
                try:
                    with self.clone(rb, "slowsrc", self.size) as name:
                        if kib not in self.meta_used:
                            st = self.status_json(name)["targets"][0]["status"].split()
                            used, tot = st[1].split("/")
                            self.meta_used[kib] = (int(used), int(tot))
                        res = self.measure(wl, "clone", kib, self.uri(name), f"[{n}/{total}]")
                        try:
                            d = self.clone_details(name)
                            res.extra = {"hydrated_bytes_after": d.get("hydrated_bytes"),
                                         "mode": d.get("mode")}
                            if d.get("mode") != "write":
                                self.notes.append(f"clone {wl.key} {kib} KiB: metadata mode "
                                                  f"{d.get('mode')} after the run")
                        except (BenchError, json.JSONDecodeError, KeyError, IndexError) as e:
                            log(f"status after run: {e}")
                except BenchError as e:
                    self.results[(wl.key, "clone", kib)] = Res(error=str(e))
                    log(f"[{n}/{total}] clone {kib} KiB setup FAILED: {e}")
                for key, peer, available in (("qcow2", self.qcow2, self.qcow2_available),
                                             ("cow", self.cow, self.cow_available)):
                    if not available:
                        continue
                    n += 1
                    try:
                        with peer(rb) as uri:
                            self.measure(wl, key, kib, uri, f"[{n}/{total}]")
                    except BenchError as e:
                        self.results[(wl.key, key, kib)] = Res(error=str(e))
                        log(f"[{n}/{total}] {key} {kib} KiB setup FAILED: {e}")

    def repeat_bar_cells(self) -> None:
        """The 4 KiB-region random-write cells carry the tightest bars and single 5 s runs swing
        by ±30 % here: run linear, clone and qcow2 there again, alternating, and keep for each
        the run with the median value."""
        runs = {}
        bar_wls = [w for w in WORKLOADS if w.key.startswith("randwrite-4k")]
        for wl in bar_wls:
            for system, kib in (("linear", None), ("clone", 4), ("qcow2", 4)):
                first = self.results.get((wl.key, system, kib))
                if first is not None and first.sample is not None:
                    runs[(wl.key, system, kib)] = [first]
        for rep in range(2, self.args.bar_repeats + 1):
            for wl in bar_wls:
                for system, kib in (("linear", None), ("clone", 4), ("qcow2", 4)):
                    if (wl.key, system, kib) not in runs:
                        continue
                    self.ensure_daemon()
                    tag, suffix = f"[repeat {rep}/{self.args.bar_repeats}]", f".rep{rep}"
                    try:
                        if system == "linear":
                            with self.linear_fresh() as name:
                                res = self.measure(wl, system, kib, self.uri(name), tag, suffix)
                        elif system == "clone":
                            with self.clone(kib << 10, "slowsrc", self.size) as name:
                                res = self.measure(wl, system, kib, self.uri(name), tag, suffix)
                                d = self.clone_details(name)
                                res.extra = {"hydrated_bytes_after": d.get("hydrated_bytes"),
                                             "mode": d.get("mode")}
                        else:
                            with self.qcow2(kib << 10) as uri:
                                res = self.measure(wl, system, kib, uri, tag, suffix)
                    except (BenchError, json.JSONDecodeError, KeyError, IndexError) as e:
                        log(f"{tag} {wl.key} {system}: FAILED: {e}")
                        continue
                    if res.sample is not None:
                        runs[(wl.key, system, kib)].append(res)
        repeats = {}
        for key, results in runs.items():
            ordered = sorted(results, key=lambda r: r.value())
            median = ordered[(len(ordered) - 1) // 2]
            self.results[key] = median
            repeats["|".join(str(k) for k in key)] = [round(r.value()) for r in results]
        self.extras["bar_repeats"] = repeats

    def hydrated_vs_linear(self) -> None:
        """A clone whose every region is hydrated against `linear` over its own destination
        file: the clone then serves every request from the destination (remapped through its
        bitmap) and should be as fast as linear. The clone (--hydrated-region, the plain source
        file, no delay) is hydrated in the background to completion first. The destination is
        the clone's own while it exists, so each run creates its device (the clone again on
        the same metadata, which must come back complete, or linear on the destination) and
        removes it after; per workload --bar-repeats alternating runs (clone, linear; linear,
        clone; ...), every run kept, the medians compared."""
        kib = self.args.hydrated_region
        rb = kib << 10
        entry: dict = {"region_kib": kib, "runs": {}, "incomplete_on_reload": 0}
        self.extras["hydrated"] = entry
        reps = max(1, self.args.bar_repeats)
        try:
            with self.clone_files(rb, self.size) as (n, meta, dest):
                table = self.clone_table(meta, dest, str(self.src), rb, self.size,
                                         core=("hydration_threshold", "1024",
                                               "hydration_batch_size", "64"))
                tables = {"hydrated": table, "hydlinear": f"0 {self.sectors} linear {dest} 0"}
                name = f"cl{n}"
                self.udm_create(name, table)
                t0 = time.monotonic()
                self.udm.client("message", name, "0", "enable_hydration", timeout=30)
                t = self.wait_hydrated(name, t0, self.args.hydration_timeout, [])
                self.udm_remove(name)
                if t is None:
                    raise BenchError(f"the {kib} KiB-region clone did not finish hydrating in "
                                     f"{self.args.hydration_timeout:.0f} s")
                entry["hydration_seconds"] = round(t, 2)
                log(f"hydrated clone ({kib} KiB regions): hydrated in {t:.1f} s")
                # Before any write: the destination must now hold the source's bytes.
                differ = differing_chunks(self.src, dest, self.size)
                if differ:
                    raise BenchError(f"after hydration the destination differs from the source "
                                     f"at {differ}")
                i, total = 0, len(WORKLOADS) * reps * 2
                for wl in WORKLOADS:
                    runs = entry["runs"].setdefault(wl.key, {"hydrated": [], "hydlinear": []})
                    for rep in range(1, reps + 1):
                        order = ("hydrated", "hydlinear") if rep % 2 else \
                                ("hydlinear", "hydrated")
                        for system in order:
                            self.ensure_daemon()
                            i += 1
                            dev = f"hyd{self.next_id()}"
                            self.udm_create(dev, tables[system])
                            try:
                                if system == "hydrated" and \
                                        not self.clone_details(dev).get("complete"):
                                    entry["incomplete_on_reload"] += 1
                                res = self.measure(wl, system, kib, self.uri(dev),
                                                   f"[hydrated {i}/{total}]", f".rep{rep}",
                                                   store=False)
                            finally:
                                self.udm_remove(dev)
                            if res.sample is not None:
                                runs[system].append(res.value())
        except (BenchError, json.JSONDecodeError, KeyError, IndexError) as e:
            entry["error"] = str(e)
            log(f"hydrated clone vs linear FAILED: {e}")
        for runs in entry["runs"].values():
            mc = statistics.median(runs["hydrated"]) if runs["hydrated"] else None
            ml = statistics.median(runs["hydlinear"]) if runs["hydlinear"] else None
            runs["median_clone"], runs["median_linear"] = mc, ml
            runs["ratio"] = mc / ml if mc and ml else None

    # ---- extra measurements --------------------------------------------------------------

    def read_bandwidth(self, tag: str, uri: str, fio_args: list,
                       timeout: float | None = None) -> float | None:
        """fio 1 MiB sequential reads at iodepth 8 from `uri`: MB/s (None, and a note, if the
        run fails)."""
        out_json = self.out_dir / f"srcbw.{tag}.json"
        wl = Workload("srcbw", "seq read 1M qd8", "read", "1m", 8)
        try:
            self.fio("srcbw", ["--ioengine=nbd", f"--uri={uri}", "--rw=read", "--bs=1m",
                               "--iodepth=8", *fio_args], out_json, timeout=timeout)
            mbps = parse_fio_json(out_json, wl).mbps
            log(f"source bandwidth {tag}: {mbps:.0f} MB/s")
            return mbps
        except (BenchError, json.JSONDecodeError, KeyError, OSError) as e:
            log(f"source bandwidth {tag}: FAILED: {e}")
            self.notes.append(f"source bandwidth {tag} failed: {str(e)[:300]}")
            return None

    def source_bandwidth(self, device: str, tag: str, size: int) -> float | None:
        """Sequential reads for --runtime seconds on a udm export: MB/s."""
        return self.read_bandwidth(tag, self.uri(device),
                                   ["--time_based", f"--runtime={self.args.runtime}",
                                    f"--size={size}"])

    def wait_hydrated(self, name: str, t0: float, limit: float, samples: list,
                      stop: threading.Event | None = None) -> float | None:
        """Poll status every 100 ms until complete; return seconds since t0 (None: not done)."""
        deadline = t0 + limit
        while time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                return None
            try:
                d = self.clone_details(name)
            except (BenchError, json.JSONDecodeError, KeyError, IndexError) as e:
                log(f"status {name}: {e}")
                time.sleep(0.1)
                continue
            now = time.monotonic() - t0
            samples.append({"t": round(now, 3), "hydrated_bytes": d.get("hydrated_bytes"),
                            "hydrating_regions": d.get("hydrating_regions"),
                            "rate": d.get("copy_rate_bytes_per_second"), "mode": d.get("mode")})
            if d.get("complete"):
                return now
            if d.get("mode") not in (None, "write"):
                raise BenchError(f"clone {name} went to mode {d.get('mode')} while hydrating")
            time.sleep(0.1)
        return None

    def local_copy(self, hsrc: Path, hsize: int) -> float | None:
        """Reference: copy the source file to a new file with `qemu-img convert -t none -T none`
        (O_DIRECT both sides, the same disk) — what a copy can reach here; MB/s."""
        dst = self.tmp / "copy-ref.img"
        try:
            t0 = time.monotonic()
            run(["qemu-img", "convert", "-t", "none", "-T", "none", "-f", "raw", "-O", "raw",
                 str(hsrc), str(dst)], timeout=max(600, hsize / (10 << 20)))
            dt = time.monotonic() - t0
            mbps = hsize / dt / 1e6
            log(f"reference copy (qemu-img convert -t none -T none): {dt:.2f} s, {mbps:.0f} MB/s")
            return mbps
        except BenchError as e:
            log(f"reference copy failed: {e}")
            return None
        finally:
            dst.unlink(missing_ok=True)

    REMOTE_RATE = "2G"     # nbdkit rate filter: bits per second (2·2^30 bit/s ≈ 268 MB/s)

    def remote_uri(self, sock: Path) -> str:
        return f"nbd+unix:///?socket={sock}"

    @contextlib.contextmanager
    def remote_source(self, hsrc: Path, what: str):
        """A FRESH `nbdkit --filter=rate file HSRC rate=2G` (the remote source); yields its URI.
        Each measurement gets its own process, so each starts with the same full token bucket
        (the rate filter lets an initial burst of about 2 s worth through)."""
        n = self.next_id()
        sock = self.tmp / "remote.sock"
        svc = None
        try:
            svc = self.start(f"nbdkit rate ({what})",
                             ["nbdkit", "-f", "-U", str(sock), "--exit-with-parent",
                              "--filter=rate", "file", str(hsrc), f"rate={self.REMOTE_RATE}"],
                             f"nbdkit-rate-{n}.log", sock)
            yield self.remote_uri(sock)
        finally:
            if svc is not None:
                self.stop_service(svc)
                self.keep_log(svc, "nbdkit-rate.log")

    def remote_bandwidth(self, hsrc: Path, hsize: int) -> float | None:
        """The remote source's bandwidth: fio reads the WHOLE volume once (1 MiB, iodepth 8, not
        time based) from a fresh nbdkit — the same bytes and the same initial burst that the
        hydration gets; MB/s."""
        try:
            with self.remote_source(hsrc, "source bandwidth") as uri:
                return self.read_bandwidth("remote", uri, [f"--size={hsize}"],
                                           timeout=max(self.fio_timeout, hsize / (20 << 20) + 60))
        except BenchError as e:
            log(f"source bandwidth remote: FAILED: {e}")
            self.notes.append(f"source bandwidth remote failed: {str(e)[:300]}")
            return None

    def copy_ceiling(self, hsrc: Path, hsize: int) -> dict | None:
        """The disk's copy ceiling: ONE fio invocation, two jobs at once — job 1 reads the hsrc
        file, job 2 writes a freshly fallocate'd file of the same size in the same tmp dir (1 MiB,
        iodepth 8, O_DIRECT, io_uring, the whole size each). A same-disk hydration has to do both
        at once, so the read job's MB/s is what it can reach here."""
        dst = self.tmp / "ceiling-dst.img"
        out_json = self.out_dir / "copy-ceiling.json"
        try:
            with open(dst, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, hsize)
            common_opts = ["--bs=1M", "--iodepth=8", "--direct=1", "--ioengine=io_uring",
                           f"--size={hsize}"]
            cmd = ["fio", "--output-format=json", f"--output={out_json}",
                   "--name=read", f"--filename={hsrc}", "--rw=read", *common_opts,
                   "--name=write", f"--filename={dst}", "--rw=write", *common_opts]
            cp = run(cmd, timeout=max(600, hsize / (5 << 20)), check=False, quiet=True,
                     cwd=self.tmp)
            if cp.returncode != 0:
                raise BenchError(f"fio exit {cp.returncode}: "
                                 f"{(cp.stderr or cp.stdout).strip()[-1500:]}")
            text = out_json.read_text(errors="replace")
            data = json.loads(text[text.find("{"):])
            jobs = {j["jobname"]: j for j in data["jobs"]}
            rd = jobs["read"]["read"]["bw_bytes"] / 1e6
            wr = jobs["write"]["write"]["bw_bytes"] / 1e6
            log(f"same-disk copy ceiling (fio read + write at once): read {rd:.0f} MB/s, "
                f"write {wr:.0f} MB/s")
            return {"read_mbps": rd, "write_mbps": wr, "json": out_json.name}
        except (BenchError, json.JSONDecodeError, KeyError, OSError) as e:
            log(f"copy ceiling failed: {e}")
            self.notes.append(f"same-disk copy ceiling failed: {str(e)[:300]}")
            return None
        finally:
            dst.unlink(missing_ok=True)

    def hydrate_once(self, kind: str, source: str, hsize: int, entry: dict) -> None:
        """One background hydration (no user I/O) of a fresh clone of `source`; fills `entry`."""
        samples: list = []
        entry["samples"] = samples
        try:
            with self.clone(64 << 10, source, hsize,
                            core=("hydration_threshold", "1024",
                                  "hydration_batch_size", "16")) as name:
                t0 = time.monotonic()
                self.udm.client("message", name, "0", "enable_hydration", timeout=30)
                t = self.wait_hydrated(name, t0, self.args.hydration_timeout, samples)
                last = samples[-1] if samples else {}
                if t is None:
                    elapsed = time.monotonic() - t0
                    got = last.get("hydrated_bytes") or 0
                    entry.update(complete=False, seconds=elapsed, bytes=got,
                                 mbps=got / elapsed / 1e6)
                    self.notes.append(f"hydration of the {kind} source did not complete in "
                                      f"{self.args.hydration_timeout:.0f} s "
                                      f"({got >> 20} of {hsize >> 20} MiB)")
                else:
                    entry.update(complete=True, seconds=t, bytes=hsize, mbps=hsize / t / 1e6)
                rates = [s["rate"] for s in samples if s.get("rate")]
                entry["udm_reported_rate_mbps"] = (rates[-1] / 1e6) if rates else None
                inflight = [s["hydrating_regions"] for s in samples
                            if s.get("hydrating_regions") is not None]
                entry["max_hydrating_regions"] = max(inflight) if inflight else None
                log(f"hydration ({kind} source): {entry['seconds']:.2f} s, "
                    f"{entry['mbps']:.0f} MB/s, complete={entry['complete']}")
        except BenchError as e:
            entry["error"] = str(e)
            log(f"hydration ({kind}) FAILED: {e}")

    def hydration_throughput(self, hsrc: Path, hsize: int) -> None:
        """(i) background hydration, no user I/O. First (the bar) from a remote, rate-limited
        NBD source — the clone's use case, a source slower than the destination; then from the
        plain file and the delayed source, both on the destination's disk (reported against the
        disk's copy ceiling, no bar: they measure the disk's read+write capacity)."""
        res = {}
        # -- remote: fresh nbdkit for the source bandwidth, another fresh one for the hydration
        if shutil.which("nbdkit"):
            self.ensure_daemon()
            bw = self.remote_bandwidth(hsrc, hsize)
            entry = {"volume_bytes": hsize, "same_disk": False, "bw_before_mbps": bw,
                     "bw_after_mbps": None, "rate": self.REMOTE_RATE}
            try:
                with self.remote_source(hsrc, "hydration") as uri:
                    entry["source"] = uri
                    self.hydrate_once("remote", uri, hsize, entry)
            except BenchError as e:
                entry["error"] = str(e)
                log(f"hydration (remote) FAILED: {e}")
            entry["source_mbps"] = bw
            entry["fraction"] = (entry["mbps"] / bw) if entry.get("mbps") and bw else None
            res["remote"] = entry
            if hsize < (2 << 30):
                self.notes.append(f"remote source: much of the {human_size(hsize)} volume fits in "
                                  f"the rate filter's initial burst (several hundred MB), so both "
                                  f"its source read and its hydration run faster than the "
                                  f"{self.REMOTE_RATE} bit/s link; use --hydration-size 2G or "
                                  f"more to measure the link itself")
        else:
            self.notes.append("remote hydration not measured: nbdkit missing "
                              "(apt-get install nbdkit)")

        # -- same-disk references
        self.extras["copy_reference_mbps"] = self.local_copy(hsrc, hsize)
        self.extras["copy_ceiling"] = self.copy_ceiling(hsrc, hsize)
        ceiling = (self.extras["copy_ceiling"] or {}).get("read_mbps")
        for kind, source, dev in (("plain", str(hsrc), "hlin"), ("delayed", "hslow", "hslow")):
            self.ensure_daemon()
            bw_before = self.source_bandwidth(dev, f"{kind}-before", hsize)
            entry = {"source": source, "volume_bytes": hsize, "same_disk": True,
                     "bw_before_mbps": bw_before}
            self.hydrate_once(kind, source, hsize, entry)
            bw_after = self.source_bandwidth(dev, f"{kind}-after", hsize)
            entry["bw_after_mbps"] = bw_after
            bws = [b for b in (bw_before, bw_after) if b]
            entry["source_mbps"] = sum(bws) / len(bws) if bws else None
            entry["fraction"] = (entry["mbps"] / entry["source_mbps"]
                                 if entry.get("mbps") and entry["source_mbps"] else None)
            entry["fraction_of_ceiling"] = (entry["mbps"] / ceiling
                                            if entry.get("mbps") and ceiling else None)
            res[kind] = entry
        self.extras["hydration"] = res

    INTERFERENCE_PAIRS = 3

    def interference_run(self, kind: str, hsrc: Path, hsize: int, pair: int) -> dict:
        """One 4 KiB randread qd32 fio run on a fresh clone, idle (`no_hydration`) or hydrating
        from the moment fio starts; returns the run's entry."""
        wl = Workload("randread-4k-qd32", "randread 4k qd32", "randread", "4k", 32)
        self.ensure_daemon()
        out_json = self.out_dir / f"interference.{kind}.{human_size(hsize)}.p{pair}.json"
        samples: list = []
        stop = threading.Event()
        with self.clone(64 << 10, str(hsrc), hsize,
                        core=("hydration_threshold", "1024",
                              "hydration_batch_size", "16")) as name:
            done = {}
            t0 = time.monotonic()
            if kind == "hydrating":
                self.udm.client("message", name, "0", "enable_hydration", timeout=30)

            # Poll status every 100 ms in both runs, so both pay for it alike.
            def poll():
                done["t"] = self.wait_hydrated(name, t0, 3600, samples, stop)
            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            try:
                self.fio(wl.key, ["--ioengine=nbd", f"--uri={self.uri(name)}",
                                  "--rw=randread", "--bs=4k", "--iodepth=32",
                                  "--time_based", f"--runtime={self.args.runtime}",
                                  f"--size={hsize}"], out_json)
                smp = parse_fio_json(out_json, wl)
                fio_end = time.monotonic() - t0
                entry = {"iops": smp.iops, "lat_mean_us": smp.lat_mean_us,
                         "lat_p99_us": smp.lat_p99_us, "json": out_json.name}
                log(f"interference pair {pair} {kind}: {smp.iops:.0f} IOPS")
            except (BenchError, json.JSONDecodeError, KeyError, OSError) as e:
                entry = {"error": str(e)}
                log(f"interference pair {pair} {kind}: FAILED: {e}")
                fio_end = time.monotonic() - t0
            finally:
                stop.set()
                poller.join(timeout=30)
            if kind == "hydrating":
                d = {}
                try:
                    d = self.clone_details(name)
                except (BenchError, json.JSONDecodeError, KeyError, IndexError):
                    pass
                hb = d.get("hydrated_bytes")
                entry.update(hydrated_bytes_at_end=hb,
                             hydration_mbps_under_load=(hb / fio_end / 1e6) if hb else None,
                             finished_at_s=done.get("t"), fio_seconds=fio_end, samples=samples)
        return entry

    def hydration_interference(self, hsrc: Path, hsize: int) -> None:
        """(ii) user 4 KiB randread qd32 while hydrating vs on an idle no_hydration clone; plain
        file source so that what is measured is the hydration's interference. Three alternating
        pairs (idle, hydrating, idle, hydrating, ...), each run on a fresh clone; the fraction is
        median hydrating / median idle. If a hydration finishes before its fio run ends, the
        volume is doubled (up to --hydration-max) and the pairs start over."""
        pairs: list = []
        early: list = []     # (pair, finished_at_s) of hydrations that ended before fio did
        p = 0
        while p < self.INTERFERENCE_PAIRS:
            pair = {kind: self.interference_run(kind, hsrc, hsize, p + 1)
                    for kind in ("idle", "hydrating")}
            i, h = pair["idle"], pair["hydrating"]
            pair["fraction"] = (h["iops"] / i["iops"]) if i.get("iops") and h.get("iops") \
                else None
            fin = h.get("finished_at_s")
            if fin is not None and fin < h.get("fio_seconds", 0) - 0.5:
                if hsize * 2 <= self.args.hydration_max:
                    note = (f"hydration of the {human_size(hsize)} volume finished {fin:.1f} s "
                            f"into the {self.args.runtime} s fio run")
                    hsize *= 2
                    log(f"{note}; the pairs again with a {human_size(hsize)} volume")
                    self.notes.append(note + f"; the pairs were repeated with {human_size(hsize)}")
                    hsrc = self.make_hsrc(hsize)
                    pairs, early, p = [], [], 0
                    continue
                early.append((p + 1, fin))
            pairs.append(pair)
            p += 1
        for n, fin in early:
            self.notes.append(f"interference pair {n}: hydration of the {human_size(hsize)} "
                              f"volume finished {fin:.1f} s into the {self.args.runtime} s fio "
                              f"run (its IOPS mix hydrating and hydrated time)")
        idle = [pr["idle"]["iops"] for pr in pairs if pr["idle"].get("iops")]
        hyd = [pr["hydrating"]["iops"] for pr in pairs if pr["hydrating"].get("iops")]
        mi = statistics.median(idle) if idle else None
        mh = statistics.median(hyd) if hyd else None
        self.extras["interference"] = {
            "volume_bytes": hsize, "source": str(hsrc), "pairs": pairs,
            "median_idle_iops": mi, "median_hydrating_iops": mh,
            "fraction": (mh / mi) if mi and mh else None,
        }

    def make_hsrc(self, hsize: int) -> Path:
        """A fully written source of `hsize` for the hydration measurements."""
        old = getattr(self, "_hsrc", None)
        if old is not None and old[1] >= hsize:
            return old[0]
        for name in ("hlin", "hslow"):
            if name in self.created:
                self.udm_remove(name)
        if old is not None:
            old[0].unlink()
        path = self.tmp / f"hsrc-{human_size(hsize)}.img"
        fill_backing_file(path, hsize, timeout=max(600, hsize / (20 << 20)))
        s = hsize // SECTOR
        self.udm_create("hlin", f"0 {s} linear {path} 0")
        self.udm_create("hslow", f"0 {s} delay {path} 0 1 {path} 0 0")
        self._hsrc = (path, hsize)
        return path

    # ---- report --------------------------------------------------------------------------

    def report_hydrated(self, hyd: dict, out: list, bars: list) -> None:
        """The fully hydrated clone against linear on its destination: a table, every run."""
        kib = hyd["region_kib"]
        out.append(f"### Fully hydrated clone vs linear on its destination ({kib} KiB regions)")
        out.append("")
        out.append(f"A clone of the plain source file, {kib} KiB regions, hydrated in the "
                   f"background to completion"
                   + (f" ({hyd['hydration_seconds']:.1f} s)" if "hydration_seconds" in hyd
                      else "")
                   + ", then measured against `linear` over the clone's own destination file, "
                   "each device created for its run (the clone again on its metadata) and "
                   "removed after, alternating, "
                   f"{max(1, self.args.bar_repeats)} run(s) each; the table shows the medians "
                   "and every run.")
        out.append("")
        rows = []
        for wl in WORKLOADS:
            runs = hyd["runs"].get(wl.key)
            if not runs:
                continue
            r = runs.get("ratio")
            rows.append([wl.label, fmt_value(runs.get("median_clone"), wl.metric),
                         fmt_value(runs.get("median_linear"), wl.metric),
                         fmt_ratio(r, BAR_HYDRATED),
                         ", ".join(fmt_value(v, wl.metric) for v in runs["hydrated"]),
                         ", ".join(fmt_value(v, wl.metric) for v in runs["hydlinear"])])
            bars.append((f"{wl.label}: fully hydrated clone / linear on its destination = "
                         + ("—" if r is None else f"{r:.2f}×") + f" (bar ≥ {BAR_HYDRATED}×)",
                         r is not None and round(r, 2) >= BAR_HYDRATED))
        if rows:
            out.append(markdown_table(["workload", "clone (hydrated)", "linear (its dest)",
                                       "clone / linear", "clone, every run",
                                       "linear, every run"], rows))
            out.append("")
        if "error" in hyd:
            out.append(f"Failed: {hyd['error']}")
            out.append("")
            bars.append(("fully hydrated clone vs linear: not measured", False))
        if hyd.get("incomplete_on_reload"):
            out.append(f"**The clone, created again on its metadata, did not report itself "
                       f"complete {hyd['incomplete_on_reload']} time(s)**: those runs may include "
                       f"hydration.")
            out.append("")

    def build_report(self, meta: dict) -> tuple[str, list]:
        """The report's markdown, section by section, and its bars: (text, ok) with ok True,
        False, or None for a figure reported but not judged."""
        out: list = []
        bars: list = []
        self.report_intro(meta, out)
        qcow2_cells = self.report_workloads(out, bars)
        self.report_repeats(out)
        hyd = self.extras.get("hydrated")
        if hyd:
            self.report_hydrated(hyd, out, bars)
        self.report_qcow2_summary(qcow2_cells, bars)
        self.report_hydration(out, bars)
        self.report_interference(out, bars)
        self.report_metadata(out)
        self.report_bars(out, bars)
        return "\n".join(out) + "\n", bars

    def report_intro(self, meta: dict, out: list) -> None:
        """The header: host, versions, and what each column runs."""
        out += [f"## udm clone benchmark — {meta['timestamp']}", ""]
        out.append(
            f"Host: {meta['host']}, {meta['cpus']} CPUs, kernel {meta['kernel']}. udm "
            f"{meta['udm_commit']}. fio {meta['fio_version']}, nbd engine, one job, unix socket, "
            f"{self.args.runtime} s per run, volume {human_size(self.size)}; a fresh unhydrated "
            f"volume for every cell (clone created with `no_hydration`: no background copy).")
        out.append("")
        out.append("Slow source (the seed's spinning disk): udm `slowsrc` = `delay SRC 0 1 SRC 0 0` "
                   "(1 ms per read, writes undelayed; fully written random data). Columns:")
        out.append("")
        out.append("- **udm clone**: `clone META DEST slowsrc <region> 1 no_hydration 4 "
                   "hydration_threshold 256 hydration_batch_size 64`, source = udm `slowsrc`.")
        out.append("- **udm linear (dest)**: the seed's raw-SSD row, once per workload: writes to a "
                   "fresh sparse file (as the clone's destination), reads from the fully written "
                   "source file without delay.")
        out.append("- **slow source**: fio on udm `slowsrc` itself (reads only; the seed's HDD row).")
        if self.qcow2_available:
            out.append(f"- **qemu qcow2**: `qemu-img create -f qcow2 -F raw -b <slow> -o "
                       f"cluster_size=<region>`, `qemu-nbd -t -e 8 -f qcow2 --cache=none "
                       f"--aio=io_uring`; {self.qcow2_source_note}.")
        if self.cow_available:
            out.append("- **nbdkit cow**: `nbdkit --filter=cow --filter=delay file SRC rdelay=1ms"
                       + (" cow-block-size=<region>`" if self.cow_block_size_ok else
                          "` (cow-block-size refused: default block)")
                       + "; slow source = nbdkit's delay filter (1 ms per read).")
        out.append("")

    def report_workloads(self, out: list, bars: list) -> list:
        """A table per workload (every region size, every system, the ratios); returns the
        (label, clone / qcow2) cells for the summary bar."""
        qcow2_cells: list = []   # (label, ratio) for "clone >= qcow2 at every region size"
        for wl in WORKLOADS:
            if not any(k[0] == wl.key for k in self.results):
                continue
            unit = ("IOPS (mean latency)" if wl.qd == 1 else "IOPS") if wl.metric == "iops" \
                else "MB/s"
            out.append(f"### {wl.label} — {unit}")
            out.append("")
            lin = self.results.get((wl.key, "linear", None))
            srcr = self.results.get((wl.key, "source", None))
            header = ["region", "udm clone", "udm linear (dest)"]
            if wl.direction == "read":
                header.append("slow source")
            if self.qcow2_available:
                header.append("qemu qcow2")
            if self.cow_available:
                header.append("nbdkit cow")
            header += ["clone / linear"]
            if wl.direction == "read":
                header.append("clone / source")
            if self.qcow2_available:
                header.append("clone / qcow2")
            if self.cow_available:
                header.append("clone / cow")
            if wl.direction == "write":
                header.append("clone hydrated at end")
            rows = []
            for kib in self.args.regions:
                c = self.results.get((wl.key, "clone", kib))
                q = self.results.get((wl.key, "qcow2", kib))
                k = self.results.get((wl.key, "cow", kib))
                r_lin, r_q, r_k = ratio(c, lin), ratio(c, q), ratio(c, k)
                is_4k_rw = kib == 4 and wl.rw == "randwrite"
                row = [region_label(kib), fmt_cell(c, wl), fmt_cell(lin, wl)]
                if wl.direction == "read":
                    row.append(fmt_cell(srcr, wl))
                if self.qcow2_available:
                    row.append(fmt_cell(q, wl))
                if self.cow_available:
                    row.append(fmt_cell(k, wl))
                row.append(fmt_ratio(r_lin, BAR_LINEAR_4K if is_4k_rw else None))
                if wl.direction == "read":
                    row.append(fmt_ratio(ratio(c, srcr)))
                if self.qcow2_available:
                    q_bar = BAR_QCOW2_4K if is_4k_rw else BAR_QCOW2_ALL
                    row.append(fmt_ratio(r_q, q_bar))
                    if r_q is not None:
                        if is_4k_rw:
                            bars.append((f"{wl.label}, 4 KiB regions: clone / qcow2 = {r_q:.2f}× "
                                         f"(bar ≥ {BAR_QCOW2_4K:.0f}×)",
                                         round(r_q, 2) >= BAR_QCOW2_4K))
                        qcow2_cells.append((f"{wl.label} {kib} KiB", r_q))
                if self.cow_available:
                    row.append(fmt_ratio(r_k))
                if wl.direction == "write":
                    hb = c.extra.get("hydrated_bytes_after") if c else None
                    row.append("—" if hb is None else f"{hb / self.size * 100:.0f} %")
                if is_4k_rw and r_lin is not None:
                    bars.append((f"{wl.label}, 4 KiB regions: clone / linear = {r_lin:.2f}× "
                                 f"(bar ≥ {BAR_LINEAR_4K}×)", round(r_lin, 2) >= BAR_LINEAR_4K))
                rows.append(row)
            out.append(markdown_table(header, rows))
            out.append("")
        if any(k[0] in {w.key for w in WORKLOADS if w.direction == "write"}
               for k in self.results):
            out.append("\"clone hydrated at end\": the share of the volume the clone had marked "
                       "hydrated when its run ended (a write that covers a whole region skips the "
                       "copy, a smaller one copies the region first). A run that hydrates most of "
                       "the volume spends its later part on hydrated regions: the seed's runs "
                       "were 90 s on 300 GB; use a larger --size to stay further from that.")
            out.append("")
        return qcow2_cells

    def report_repeats(self, out: list) -> None:
        """Every run of the cells judged on the median of several."""
        reps = self.extras.get("bar_repeats")
        if reps:
            parts = []
            for key, vals in reps.items():
                wl_key, system, _ = key.split("|")
                parts.append(f"{wl_key} {LABELS[system]}: {', '.join(str(v) for v in vals)}")
            out.append(f"The 4 KiB-region random-write cells (the tightest bars) are the median of "
                       f"{self.args.bar_repeats} runs each, run alternately (linear, clone, qcow2, "
                       f"then again); all runs, IOPS: " + "; ".join(parts) + ".")
            out.append("")

    def report_qcow2_summary(self, qcow2_cells: list, bars: list) -> None:
        """One bar: the clone at least matches qcow2 in every cell."""
        if qcow2_cells:
            below = [f"{lab} ({r:.2f}×)" for lab, r in qcow2_cells if round(r, 2) < BAR_QCOW2_ALL]
            bars.append((f"clone ≥ qcow2 at every region size and workload: "
                         f"{len(qcow2_cells) - len(below)} of {len(qcow2_cells)} cells"
                         + (f"; below: {', '.join(below)}" if below else ""), not below))

    def report_hydration(self, out: list, bars: list) -> None:
        """Background hydration with no user I/O, against the source's bandwidth."""
        out.append("### Background hydration, no user I/O")
        out.append("")
        hy = self.extras.get("hydration", {})
        if hy:
            vol = next(iter(hy.values()))["volume_bytes"]
            ceil = self.extras.get("copy_ceiling") or {}
            ceil_rd = ceil.get("read_mbps")
            copy_ref = self.extras.get("copy_reference_mbps")
            out.append(f"Clone of a fully written {human_size(vol)} source, region 64 KiB, "
                       f"`hydration_threshold 1024 hydration_batch_size 16`, created with "
                       f"`no_hydration`, then `enable_hydration`; `udm status --json` polled every "
                       f"100 ms until `complete`.")
            out.append("")
            out.append(f"**The bar (≥ {BAR_HYDRATION}× the source's sequential read bandwidth) is "
                       f"judged on the remote row only.** The clone's use case is a source slower "
                       f"than the destination (remote storage), where hydration should run at the "
                       f"source's speed. The remote source is `nbdkit -U SOCK --filter=rate file "
                       f"SRC rate={self.REMOTE_RATE}` (nbdkit's rate filter, in bits per second: "
                       f"2·2^30 bit/s ≈ 268 MB/s, like a 2 Gbit/s link), given to the clone as "
                       f"`nbd+unix:///?socket=SOCK`. The rate filter lets an initial burst of "
                       f"several hundred MB through, so a short time-based read overstates the "
                       f"link; its source bandwidth is therefore fio reading the whole volume once "
                       f"(1 MiB, iodepth 8, not time based) from a fresh nbdkit, and the hydration "
                       f"runs against another fresh nbdkit: both see the same burst and the same "
                       f"bytes.")
            out.append("")
            out.append("The plain and delayed rows read the source from the same virtual disk the "
                       "destination is on, so hydration there reads and writes that disk at once "
                       "and is capped by the disk's combined read+write capacity, not by udm: "
                       "their fraction of the source's read bandwidth is reported, not a bar, and "
                       "\"vs same-disk copy ceiling\" compares them with what a copy can reach on "
                       "this disk. Their source bandwidth = fio 1 MiB sequential reads at iodepth "
                       f"8 for {self.args.runtime} s on the source's udm export (`linear` over the "
                       "file, or the `delay` device), mean of a run before and a run after.")
            out.append("")
            rows = []
            labels = {"remote": f"remote NBD (nbdkit rate={self.REMOTE_RATE}) — bar",
                      "plain": "plain file (same disk)",
                      "delayed": "delayed 1 ms/read (same disk)"}
            for kind, e in hy.items():
                frac = e.get("fraction")
                same = e.get("same_disk", kind != "remote")
                fceil = e.get("fraction_of_ceiling")
                if not same:
                    bars.append((f"hydration of the remote source (nbdkit rate="
                                 f"{self.REMOTE_RATE}): "
                                 + (f"{frac:.2f}× its sequential read bandwidth"
                                    if frac is not None else "not measured")
                                 + f" (bar ≥ {BAR_HYDRATION}×)",
                                 frac is not None and round(frac, 2) >= BAR_HYDRATION))
                elif frac is not None:
                    bars.append((f"hydration of the {kind} source on the destination's disk: "
                                 f"{frac:.2f}× its sequential read bandwidth"
                                 + (f", {fceil:.2f}× the same-disk copy ceiling"
                                    if fceil is not None else "")
                                 + " (reported, no bar: a same-disk copy is capped by the disk)",
                                 None))
                if same:
                    src_cell = ((f"{e['source_mbps']:.0f} MB/s ({e['bw_before_mbps'] or 0:.0f} / "
                                 f"{e['bw_after_mbps'] or 0:.0f})") if e.get("source_mbps")
                                else "—")
                else:
                    src_cell = (f"{e['source_mbps']:.0f} MB/s (whole volume, fresh nbdkit)"
                                if e.get("source_mbps") else "—")
                rows.append([
                    labels.get(kind, kind),
                    "error" if "error" in e else
                    (f"{e['seconds']:.2f} s" + ("" if e.get("complete") else " (incomplete)")),
                    f"{e['mbps']:.0f} MB/s" if e.get("mbps") else "—",
                    f"{e['udm_reported_rate_mbps']:.0f} MB/s"
                    if e.get("udm_reported_rate_mbps") else "—",
                    str(e.get("max_hydrating_regions", "—")),
                    src_cell,
                    fmt_ratio(frac, None if same else BAR_HYDRATION),
                    fmt_ratio(fceil) if same else "— (not same disk)",
                    fmt_ratio(e["mbps"] / copy_ref) if same and e.get("mbps") and copy_ref
                    else "—",
                ])
            out.append(markdown_table(["source", "time to hydrate", "hydration MB/s",
                                       "udm's copy_rate (last)", "max regions in flight",
                                       "source seq read",
                                       "fraction of source (bar: remote only)",
                                       "vs same-disk copy ceiling", "vs local copy"], rows))
            out.append("")
            out.append("Same-disk copy ceiling (reference, not a bar): one fio run with two jobs at "
                       "once, job 1 reading the source file, job 2 writing a freshly fallocate'd "
                       f"file of {human_size(vol)} in the same directory (1 MiB, iodepth 8, "
                       "O_DIRECT, io_uring, the whole size each): "
                       + (f"read **{ceil_rd:.0f} MB/s** while writing "
                          f"{ceil.get('write_mbps') or 0:.0f} MB/s" if ceil_rd else "failed")
                       + "; \"vs same-disk copy ceiling\" = hydration MB/s / that read MB/s. "
                       "\"vs local copy\" compares with copying the source file to a new file "
                       "with `qemu-img convert -t none -T none` "
                       + (f"({copy_ref:.0f} MB/s)" if copy_ref else "(failed)")
                       + ". udm's copy_rate is sampled once a second, so it stays empty for a "
                       "hydration shorter than about 2 s.")
        else:
            out.append("Not measured.")
        out.append("")

    def report_interference(self, out: list, bars: list) -> None:
        """User random reads while the clone hydrates, against an idle clone."""
        out.append("### User random reads while hydrating")
        out.append("")
        it = self.extras.get("interference")
        if it:
            pairs = it.get("pairs", [])
            out.append(f"4 KiB random reads at iodepth 32 for {self.args.runtime} s on a clone "
                       f"(64 KiB regions, plain-file source, no delay) of a fully written "
                       f"{human_size(it['volume_bytes'])} source: idle clone created with "
                       f"`no_hydration` vs a fresh clone hydrating from the moment fio starts "
                       f"(`hydration_threshold 1024 hydration_batch_size 16`, no rate limit). "
                       f"Run-to-run noise on a VM is large, so {len(pairs)} alternating pairs "
                       f"(idle, hydrating, idle, hydrating, ...), each run on a fresh clone; the "
                       f"fraction is the median hydrating IOPS over the median idle IOPS.")
            out.append("")
            rows = []
            for n, pr in enumerate(pairs, 1):
                i, h = pr.get("idle", {}), pr.get("hydrating", {})
                fin = h.get("finished_at_s")
                rows.append([str(n), "idle (no_hydration)",
                             "error" if "error" in i else fmt_value(i.get("iops"), "iops"),
                             fmt_lat(i.get("lat_mean_us")), fmt_lat(i.get("lat_p99_us")),
                             "—", "—", ""])
                rows.append([str(n), "hydrating",
                             "error" if "error" in h else fmt_value(h.get("iops"), "iops"),
                             fmt_lat(h.get("lat_mean_us")), fmt_lat(h.get("lat_p99_us")),
                             f"{(h.get('hydrated_bytes_at_end') or 0) / 1e6:.0f} MB "
                             f"({(h.get('hydration_mbps_under_load') or 0):.0f} MB/s)",
                             f"at {fin:.1f} s" if fin is not None else "no",
                             fmt_ratio(pr.get("fraction"))])
            rows.append(["median", "idle", fmt_value(it.get("median_idle_iops"), "iops"),
                         "", "", "", "", ""])
            rows.append(["median", "hydrating", fmt_value(it.get("median_hydrating_iops"), "iops"),
                         "", "", "", "", fmt_ratio(it.get("fraction"), BAR_INTERFERENCE)])
            out.append(markdown_table(["pair", "clone", "IOPS", "mean lat", "p99 lat",
                                       "hydrated during fio", "hydration finished",
                                       "hydrating / idle"], rows))
            out.append("")
            frac = it.get("fraction")
            out.append(f"Fraction median hydrating / median idle: "
                       f"{fmt_ratio(frac, BAR_INTERFERENCE)} (bar ≥ {BAR_INTERFERENCE}×); the "
                       f"per-pair fractions are shown for the spread, not judged.")
            if frac is not None:
                bars.append((f"randread qd32 while hydrating: median {frac:.2f}× idle over "
                             f"{len(pairs)} pairs (bar ≥ {BAR_INTERFERENCE}×)",
                             round(frac, 2) >= BAR_INTERFERENCE))
        else:
            out.append("Not measured.")
        out.append("")

    def report_metadata(self, out: list) -> None:
        """Metadata size per TiB, from the format, against what udm reported."""
        out.append("### Metadata size per TiB of volume")
        out.append("")
        out.append("From docs/clone-metadata.md: R = ceil(volume / region), B = max(1, "
                   "ceil(ceil(R/64) / 510)), (2 + 2·B) blocks of 4096 bytes. The last column is "
                   f"what `udm status` reported as used metadata blocks for the "
                   f"{human_size(self.size)} volume of this run, against the formula.")
        out.append("")
        rows = []
        for kib in self.args.regions:
            r, b, nbytes = metadata_bytes(TIB, kib << 10)
            _, _, at_size = metadata_bytes(self.size, kib << 10)
            got = self.meta_used.get(kib)
            want_blocks = at_size // META_BLOCK
            rows.append([region_label(kib), f"{r:,}", f"{b:,}", f"{nbytes:,}",
                         f"{nbytes / (1 << 20):.1f} MiB", f"{nbytes / TIB * 100:.4f} %",
                         (f"{got[0]} (formula {want_blocks})" +
                          ("" if got[0] == want_blocks else " ✘")) if got else "—"])
        out.append(markdown_table(["region", "regions / TiB", "B", "bytes / TiB", "MiB / TiB",
                                   "of volume", f"used blocks at {human_size(self.size)}"], rows))
        out.append("")

    def report_bars(self, out: list, bars: list) -> None:
        """Every bar, then the runs that failed and the notes."""
        out.append("### Bars")
        out.append("")
        if bars:
            for text, ok in bars:
                mark = "· (reported)" if ok is None else ("✔" if ok else "✘ **FAILED**")
                out.append(f"- {mark} {text}")
        else:
            out.append("- nothing measured")
        failed = sorted({f"{LABELS[s]} {wl} {'' if k is None else region_label(k)}"
                         for (wl, s, k), r in self.results.items() if r.sample is None})
        if failed:
            out.append("")
            out.append("Runs with errors (see the *.err files): " + "; ".join(failed) + ".")
        if self.notes:
            out.append("")
            out.append("Notes:")
            out.append("")
            for n in self.notes:
                out.append(f"- {n}")

    def draw_charts(self, meta: dict) -> list:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception as e:  # pragma: no cover
            log(f"NOTE: matplotlib is not available ({e}); charts skipped "
                f"(apt-get install python3-matplotlib)")
            return []
        regions = self.args.regions
        keys = ["clone"] + (["qcow2"] if self.qcow2_available else []) + \
            (["cow"] if self.cow_available else [])
        caption = (f"{meta['timestamp']} · {meta['cpus']} CPUs · fio nbd engine, 1 job · "
                   f"{self.args.runtime} s per run · {human_size(self.size)} · fresh unhydrated "
                   f"volume per bar · slow source = 1 ms per read · seed: dm-clone 4 KiB region "
                   f"randwrite 62,347 IOPS vs 64,490 raw SSD (97 %)")
        files = []
        wls = [wl for wl in WORKLOADS if any(k[0] == wl.key for k in self.results)]
        if wls:
            files.append(self.draw_matrix(plt, wls, keys, regions, caption))
        self.draw_hydration(plt, meta, files)
        return files

    def draw_matrix(self, plt, wls, keys, regions, caption) -> Path:
        cols = min(3, len(wls))
        rows = -(-len(wls) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.3 * cols, 4.5 * rows), squeeze=False)
        for ax in list(axes.flat)[len(wls):]:
            ax.set_visible(False)
        for ax, wl in zip(axes.flat, wls):
            n = len(keys)
            width = 0.8 / n
            xs = list(range(len(regions)))
            for i, key in enumerate(keys):
                vals = []
                for kib in regions:
                    r = self.results.get((wl.key, key, kib))
                    vals.append(r.value() if r and r.value() else 0)
                bars = ax.bar([x + (i - (n - 1) / 2) * width for x in xs], vals, width,
                              label=LABELS[key], color=COLORS[key])
                if key == "clone" and "qcow2" in keys:
                    for kib, b in zip(regions, bars):
                        r = ratio(self.results.get((wl.key, "clone", kib)),
                                  self.results.get((wl.key, "qcow2", kib)))
                        if r is not None and b.get_height() > 0:
                            ax.annotate(f"{r:.1f}×", (b.get_x() + b.get_width() / 2,
                                                      b.get_height()),
                                        ha="center", va="bottom", fontsize=7,
                                        color="#c62828" if r < 1 else "#1b5e20")
            for key, style in (("linear", "--"), ("source", ":")):
                r = self.results.get((wl.key, key, None))
                if r and r.value():
                    ax.axhline(r.value(), color=COLORS[key], linestyle=style, linewidth=1.2,
                               label=LABELS[key])
            ax.set_yscale("log")
            ax.set_xticks(xs)
            ax.set_xticklabels([region_label(k) for k in regions], fontsize=8)
            ax.set_xlabel("region / cluster / block size", fontsize=8)
            ax.set_ylabel("IOPS" if wl.metric == "iops" else "MB/s")
            ax.set_title(wl.label, fontsize=10)
            ax.grid(axis="y", alpha=0.3, which="both")
            ax.set_axisbelow(True)
            ax.legend(fontsize=7)
        fig.suptitle("udm clone vs qemu qcow2 overlay vs nbdkit cow over a slow (1 ms) source "
                     "(log scale; clone / qcow2 above the clone bar)")
        fig.text(0.5, 0.01, caption, ha="center", fontsize=7, color="#555555")
        fig.tight_layout(rect=(0, 0.03, 1, 0.96))
        path = self.out_dir / "clone-workloads.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def draw_hydration(self, plt, meta, files) -> None:
        hy = self.extras.get("hydration") or {}
        it = self.extras.get("interference") or {}
        if hy or it:
            fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
            kinds = list(hy)
            xs = list(range(len(kinds)))
            a1.bar([x - 0.2 for x in xs], [hy[k].get("source_mbps") or 0 for k in kinds], 0.4,
                   label="source seq read (1 MiB qd8)", color="#9e9e9e")
            b = a1.bar([x + 0.2 for x in xs], [hy[k].get("mbps") or 0 for k in kinds], 0.4,
                       label="background hydration", color=COLORS["clone"])
            for k, bb in zip(kinds, b):
                f = hy[k].get("fraction")
                if f is None:
                    continue
                if hy[k].get("same_disk", k != "remote"):
                    fc = hy[k].get("fraction_of_ceiling")
                    text = f"{f:.2f}× src" + (f"\n{fc:.2f}× ceiling" if fc is not None else "")
                    color = "#555555"
                else:
                    text = f"{f:.2f}× (bar)"
                    color = "#c62828" if f < BAR_HYDRATION else "#1b5e20"
                a1.annotate(text, (bb.get_x() + bb.get_width() / 2, bb.get_height()),
                            ha="center", va="bottom", fontsize=8, color=color)
            ceil = (self.extras.get("copy_ceiling") or {}).get("read_mbps")
            same_xs = [x for x, k in zip(xs, kinds) if hy[k].get("same_disk", k != "remote")]
            if ceil and same_xs:
                a1.hlines(ceil, min(same_xs) - 0.45, max(same_xs) + 0.45, color="#c62828",
                          linestyle=":", linewidth=1.2, label="same-disk copy ceiling (read side)")
            a1.set_xticks(xs)
            a1.set_xticklabels([{"remote": f"remote NBD\n(rate={self.REMOTE_RATE})",
                                 "plain": "plain file\n(same disk)",
                                 "delayed": "delayed 1 ms\n(same disk)"}.get(k, k)
                                for k in kinds], fontsize=8)
            a1.set_ylabel("MB/s")
            a1.set_title(f"Hydration, no user I/O (bar ≥ {BAR_HYDRATION}×, remote only)",
                         fontsize=10)
            top = max([hy[k].get(f) or 0 for k in kinds for f in ("source_mbps", "mbps")]
                      + [ceil or 0, 1])
            a1.set_ylim(0, top * 1.3)
            a1.legend(fontsize=7, loc="upper center", ncol=3)
            a1.grid(axis="y", alpha=0.3)
            if it:
                pairs = it.get("pairs", [])
                labels = [f"pair {n}" for n in range(1, len(pairs) + 1)] + ["median"]
                idle = [p.get("idle", {}).get("iops") or 0 for p in pairs] + \
                    [it.get("median_idle_iops") or 0]
                hyd = [p.get("hydrating", {}).get("iops") or 0 for p in pairs] + \
                    [it.get("median_hydrating_iops") or 0]
                xs2 = list(range(len(labels)))
                a2.bar([x - 0.2 for x in xs2], idle, 0.4, label="idle clone", color="#9e9e9e")
                bb = a2.bar([x + 0.2 for x in xs2], hyd, 0.4, label="while hydrating",
                            color=COLORS["clone"])
                fr = [p.get("fraction") for p in pairs] + [it.get("fraction")]
                for n, (f, bar) in enumerate(zip(fr, bb)):
                    if f is None:
                        continue
                    last = n == len(fr) - 1
                    a2.annotate(f"{f:.2f}×" + (" (bar)" if last else ""),
                                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=8,
                                color=("#c62828" if f < BAR_INTERFERENCE else "#1b5e20")
                                if last else "#555555")
                a2.set_xticks(xs2)
                a2.set_xticklabels(labels)
                a2.set_ylabel("IOPS")
                a2.set_title(f"4 KiB randread qd32, median hydrating / median idle "
                             f"(bar ≥ {BAR_INTERFERENCE}×)", fontsize=10)
                a2.set_ylim(0, max(idle + hyd + [1]) * 1.25)
                a2.legend(fontsize=7, loc="upper center", ncol=2)
                a2.grid(axis="y", alpha=0.3)
            else:
                a2.set_visible(False)
            hvol = next(iter(hy.values()))["volume_bytes"] if hy else None
            ivol = it.get("volume_bytes") if it else None
            vols = " / ".join(f"{what} {human_size(v)}" for what, v in
                              (("hydration", hvol), ("interference", ivol)) if v)
            fig.text(0.5, 0.01, f"{meta['timestamp']} · {meta['cpus']} CPUs · fio nbd engine, "
                     f"1 job · {self.args.runtime} s fio runs · volume {vols}, "
                     f"64 KiB regions, hydration_threshold 1024, hydration_batch_size 16",
                     ha="center", fontsize=7, color="#555555")
            fig.tight_layout(rect=(0, 0.04, 1, 1))
            path = self.out_dir / "clone-hydration.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            files.append(path)


def differing_chunks(a: Path, b: Path, size: int, chunk: int = 1 << 20) -> list:
    """Offsets among eight spread 1 MiB chunks (first, last and between) where two files
    differ, read with O_DIRECT so that no page cache is left behind."""
    offsets = sorted({(size - chunk) * i // 7 // 4096 * 4096 for i in range(8)})
    buf = mmap.mmap(-1, chunk)       # page-aligned, as O_DIRECT wants
    digests = {}
    for path in (a, b):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for off in offsets:
                got = os.preadv(fd, [buf], off)
                digests.setdefault(off, []).append(hashlib.sha256(buf[:got]).digest())
        finally:
            os.close(fd)
    return [off for off, (da, db) in digests.items() if da != db]


def parse_regions(text: str) -> list:
    out = []
    for tok in text.split(","):
        tok = tok.strip().upper().removesuffix("K").removesuffix("KIB")
        if not tok:
            continue
        try:
            kib = int(tok)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad region size {tok!r} (KiB, e.g. 4,8,64)")
        if kib < 4 or kib > (1 << 20) or kib & (kib - 1):
            raise argparse.ArgumentTypeError(f"region {kib} KiB: must be a power of two from 4 KiB "
                                             f"to 1 GiB")
        out.append(kib)
    if not out:
        raise argparse.ArgumentTypeError("no region sizes")
    return out


def main(argv=None) -> int:
    global WORKLOADS
    ap = argparse.ArgumentParser(
        description="udm clone benchmark: the dm-clone seed's table (udm clone vs udm linear, "
                    "qemu qcow2 overlay and nbdkit cow over a slow source), plus hydration "
                    "throughput, interference and metadata size.")
    common.add_sizing_args(ap, runtime=5, size_help="volume size for the matrix (default 1G)",
                           repeat=False, quick={"runtime": 2})
    ap.add_argument("--regions", type=parse_regions, default=None,
                    help="region sizes in KiB (default 4,8,16,32,64,128; 4,64 with --quick)")
    ap.add_argument("--hydration-size", type=parse_size, default=None,
                    help="volume size for the hydration measurements (default 4G, 1G with "
                         "--quick; doubled, up "
                         "to --hydration-max, when hydration finishes before the fio run ends)")
    ap.add_argument("--hydration-max", type=parse_size, default=parse_size("16G"),
                    help="largest hydration volume to grow to (default 16G)")
    ap.add_argument("--hydration-timeout", type=float, default=300,
                    help="seconds to wait for a background hydration to complete (default 300)")
    common.add_run_args(
        ap, out="bench/results/clone", out_help="output directory (default bench/results/clone)",
        tmpdir_help="where to create the temp dir (must support O_DIRECT; default $TMPDIR "
                    "or /tmp)",
        keep_help="keep the temp dir",
        udm_help="udm binary (default target/release/udm, built if missing)",
        charts_help="skip the PNG charts")
    ap.add_argument("--nbd-threads", type=int, default=None,
                    help="pass --nbd-threads to the udm daemon (default: the daemon's default)")
    ap.add_argument("--workloads", default=None,
                    help="comma-separated subset of: " + ",".join(w.key for w in WORKLOADS))
    ap.add_argument("--dest", choices=("falloc", "sparse"), default="falloc",
                    help="destination files of clone and linear: preallocated with fallocate, "
                         "standing in for the seed's destination logical volume (default), or "
                         "sparse")
    ap.add_argument("--bar-repeats", type=int, default=3,
                    help="runs of linear, clone and qcow2 in the 4 KiB-region random-write cells "
                         "(the tightest bars), alternating; the median is reported (default 3)")
    ap.add_argument("--hydrated-region", type=int, default=4,
                    help="region size in KiB of the fully hydrated clone measured against "
                         "linear on its destination (default 4: the most regions to look up)")
    ap.add_argument("--skip-hydrated", action="store_true",
                    help="skip the fully hydrated clone vs linear measurement")
    ap.add_argument("--skip-matrix", action="store_true", help="only the extra measurements")
    ap.add_argument("--skip-extras", action="store_true", help="only the matrix")
    args = ap.parse_args(argv)
    common.resolve_sizing(args)
    if args.regions is None:
        args.regions = parse_regions("4,64" if args.quick else "4,8,16,32,64,128")
    if args.hydration_size is None:
        args.hydration_size = parse_size("1G" if args.quick else "4G")
    try:
        parse_regions(str(args.hydrated_region))
    except argparse.ArgumentTypeError as e:
        ap.error(f"--hydrated-region: {e}")
    if args.runtime < 1:
        ap.error("--runtime must be at least 1")
    WORKLOADS = select_workloads(ap, args.workloads, WORKLOADS)
    trap_signals()

    if not shutil.which("fio"):
        log("ERROR: `fio` not found; install the Debian package `fio`")
        return 2
    if run(["fio", "--enghelp=nbd"], timeout=20, check=False, quiet=True).returncode != 0:
        log("ERROR: this fio has no nbd engine (Debian's fio package has it; it needs libnbd0)")
        return 2
    if not shutil.which("qemu-img"):
        log("ERROR: `qemu-img` not found (used to probe every export); apt-get install qemu-utils")
        return 2
    for t, pkg in (("nbdkit", "nbdkit"), ("qemu-nbd", "qemu-utils")):
        if not shutil.which(t):
            log(f"WARNING: `{t}` not found; install the Debian package `{pkg}` — its column "
                f"will be empty")

    out_dir = prepare_out_dir(args.out)
    udm_bin = locate_udm(args, find_udm)
    if udm_bin is None:
        return 2
    tmp = make_tmpdir(tmp_base(args), "udm-clone-", "nbdkit-delay.sock")
    if tmp is None:
        return 2

    b = Bench(args, udm_bin, tmp, out_dir)
    meta = {
        **common.base_meta(udm_bin),
        "nbdkit_version": tool_version(["nbdkit", "--version"]) if shutil.which("nbdkit") else None,
        "qemu_version": tool_version(["qemu-img", "--version"]),
        "runtime": args.runtime, "size": args.size, "regions_kib": args.regions,
        "hydration_size": args.hydration_size, "tmpdir": str(tmp),
    }
    rc = 1
    try:
        fill_backing_file(b.src, args.size, timeout=max(600, args.size / (20 << 20)))
        b.start_daemon()
        s = args.size // SECTOR
        b.udm_create("slowsrc", f"0 {s} delay {b.src} 0 1 {b.src} 0 0")
        b.udm_create("linsrc", f"0 {s} linear {b.src} 0")
        wait_for_socket(b.nbd_sock, b.daemon, timeout=30)
        check_export(b.uri("slowsrc"), args.size, "udm slowsrc")
        b.probe_peers()
        b.notes.append("a udm NBD connection serves at most --nbd-threads requests at once "
                       f"({args.nbd_threads or 'the daemon default, 32'}), and a delayed read "
                       "holds its thread for the 1 ms, so the slow source (and anything read "
                       "through it at iodepth 32) tops out near threads / 1 ms; nbdkit (16 "
                       "threads) and qemu's nbd client are bound alike")

        if not args.skip_matrix:
            b.run_matrix()
            if args.bar_repeats > 1:
                b.repeat_bar_cells()
        if not args.skip_hydrated:
            b.ensure_daemon()
            b.hydrated_vs_linear()
        if not args.skip_extras:
            b.ensure_daemon()
            hsrc = b.make_hsrc(args.hydration_size)
            b.hydration_throughput(hsrc, args.hydration_size)
            b.hydration_interference(hsrc, args.hydration_size)

        meta["notes"] = b.notes
        table, bars = b.build_report(meta)
        write_results(out_dir, table, {
            "meta": meta,
            "matrix": [{"workload": wl, "system": sk, "region_kib": kib,
                        "iops": r.sample.iops if r.sample else None,
                        "mbps": r.sample.mbps if r.sample else None,
                        "lat_mean_us": r.sample.lat_mean_us if r.sample else None,
                        "lat_p99_us": r.sample.lat_p99_us if r.sample else None,
                        "json": r.sample.json_path.name if r.sample else None,
                        "error": r.error, **r.extra}
                       for (wl, sk, kib), r in b.results.items()],
            "metadata_used_blocks": {str(k): v for k, v in b.meta_used.items()},
            "extras": b.extras,
            "bars": [{"text": t, "ok": ok} for t, ok in bars],
        })
        if not args.no_charts:
            for p in b.draw_charts(meta):
                log(f"chart: {p}")
        log(f"results in {out_dir}")
        any_err = any(r.sample is None for r in b.results.values())
        rc = 3 if any_err else 0
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}); cleaning up")
        rc = 130
    except BenchError as e:
        log(f"ERROR: {e}")
        rc = 1
    finally:
        # peers first, then the udm devices (newest first), then the daemon
        for svc in list(reversed(b.services)):
            if svc is not b.daemon:
                svc.stop(grace=5)
        if b.daemon is not None and b.daemon.alive() and b.udm is not None:
            for name in list(reversed(b.created)):
                b.udm_remove(name)
        if b.daemon is not None:
            stop_daemon(b.daemon, grace=15, report_exit=False)
        copy_logs(b.services, out_dir)
        remove_tmp(tmp, args.keep)
    return rc


if __name__ == "__main__":
    _maybe_reexec_for_matplotlib()
    sys.exit(main())
