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

The script is in five files, one per job: this one (the run's state, its helpers and
main), clone_matrix.py, clone_hydration.py, clone_report.py and clone_charts.py; the generic
helpers (processes, fio JSON, udm verbs) come from harness.py, sizes and tables from
report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import (  # noqa: E402
    BenchError, copy_logs, remove_tmp, run, select_workloads, stop_daemon, tool_version,
    trap_signals,
)
from harness import (  # noqa: E402
    Service, Udm, Workload, check_export, fill_backing_file, find_udm, parse_fio_json,
    start_service, wait_for_socket,
)
from report import parse_size, write_results  # noqa: E402
from clone_charts import Charts  # noqa: E402
from clone_hydration import Hydration  # noqa: E402
from clone_matrix import Matrix  # noqa: E402
from clone_report import (  # noqa: E402
    LABELS, Res, SECTOR, WORKLOADS, log, metadata_bytes,
    region_label,
)
from clone_report import Report  # noqa: E402


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------

class Bench(Matrix, Hydration, Report, Charts):
    def __init__(self, args, udm_bin: Path, tmp: Path, out_dir: Path):
        self.args = args
        self.udm_bin = udm_bin
        self.tmp = tmp
        self.out_dir = out_dir
        # results.json's `meta`: set by main before the run, completed by it.
        self.run_meta: dict = {}
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



    def measure_all(self) -> int:
        """The sources, the matrix, the hydrated clone and the extras as asked, then the report;
        3 when a cell failed."""
        args = self.args
        fill_backing_file(self.src, args.size, timeout=max(600, args.size / (20 << 20)))
        self.start_daemon()
        s = args.size // SECTOR
        self.udm_create("slowsrc", f"0 {s} delay {self.src} 0 1 {self.src} 0 0")
        self.udm_create("linsrc", f"0 {s} linear {self.src} 0")
        wait_for_socket(self.nbd_sock, self.daemon, timeout=30)
        check_export(self.uri("slowsrc"), args.size, "udm slowsrc")
        self.probe_peers()
        self.notes.append("a udm NBD connection serves at most --nbd-threads requests at once "
                       f"({args.nbd_threads or 'the daemon default, 32'}), and a delayed read "
                       "holds its thread for the 1 ms, so the slow source (and anything read "
                       "through it at iodepth 32) tops out near threads / 1 ms; nbdkit (16 "
                       "threads) and qemu's nbd client are bound alike")
        if not args.skip_matrix:
            self.run_matrix()
            if args.bar_repeats > 1:
                self.repeat_bar_cells()
        if not args.skip_hydrated:
            self.ensure_daemon()
            self.hydrated_vs_linear()
        if not args.skip_extras:
            self.ensure_daemon()
            hsrc = self.make_hsrc(args.hydration_size)
            self.hydration_throughput(hsrc, args.hydration_size)
            self.hydration_interference(hsrc, args.hydration_size)
        self.run_meta["notes"] = self.notes
        table, bars = self.build_report(self.run_meta)
        write_results(self.out_dir, table, {
            "meta": self.run_meta,
            "matrix": [{"workload": wl, "system": sk, "region_kib": kib,
                        "iops": r.sample.iops if r.sample else None,
                        "mbps": r.sample.mbps if r.sample else None,
                        "lat_mean_us": r.sample.lat_mean_us if r.sample else None,
                        "lat_p99_us": r.sample.lat_p99_us if r.sample else None,
                        "json": r.sample.json_path.name if r.sample else None,
                        "error": r.error, **r.extra}
                       for (wl, sk, kib), r in self.results.items()],
            "metadata_used_blocks": {str(k): v for k, v in self.meta_used.items()},
            "extras": self.extras,
            "bars": [{"text": t, "ok": ok} for t, ok in bars],
        })
        if not args.no_charts:
            for p in self.draw_charts(self.run_meta):
                log(f"chart: {p}")
        log(f"results in {self.out_dir}")
        return 3 if any(r.sample is None for r in self.results.values()) else 0


    def cleanup(self, rc: int) -> int:
        """Peers first, then the udm devices (newest first), then the daemon; logs kept,
        temp dir removed unless --keep.  Returns `rc`."""
        for svc in list(reversed(self.services)):
            if svc is not self.daemon:
                svc.stop(grace=5)
        if self.daemon is not None and self.daemon.alive() and self.udm is not None:
            for name in list(reversed(self.created)):
                self.udm_remove(name)
        if self.daemon is not None:
            stop_daemon(self.daemon, grace=15, report_exit=False)
        copy_logs(self.services, self.out_dir)
        remove_tmp(self.tmp, self.args.keep)
        return rc

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


def parse_args(argv):
    ap = common.bench_parser(
        "udm clone benchmark: the dm-clone seed's table (udm clone vs udm linear, qemu qcow2 "
        "overlay and nbdkit cow over a slow source), plus hydration throughput, interference "
        "and metadata size.",
        runtime=5, size_help="volume size for the matrix (default 1G)", repeat=False,
        quick={"runtime": 2}, out="bench/results/clone")
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
    # In place: the matrix and the report read this same list.
    WORKLOADS[:] = select_workloads(ap, args.workloads, list(WORKLOADS))
    return args


def tools_ready() -> bool:
    """fio with its nbd engine and qemu-img (an ERROR line for each missing); nbdkit and
    qemu-nbd only leave their columns empty."""
    if not common.have_fio_with_nbd():
        return False
    if not shutil.which("qemu-img"):
        log("ERROR: `qemu-img` not found (used to probe every export); apt-get install qemu-utils")
        return False
    for t, pkg in (("nbdkit", "nbdkit"), ("qemu-nbd", "qemu-utils")):
        if not shutil.which(t):
            log(f"WARNING: `{t}` not found; install the Debian package `{pkg}` — its column "
                f"will be empty")
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    trap_signals()
    if not tools_ready():
        return 2
    def start(out_dir: Path, udm_bin: Path, tmp: Path) -> Bench:
        b = Bench(args, udm_bin, tmp, out_dir)
        b.run_meta = {
            **common.base_meta(udm_bin),
            "nbdkit_version": tool_version(["nbdkit", "--version"])
            if shutil.which("nbdkit") else None,
            "qemu_version": tool_version(["qemu-img", "--version"]),
            "runtime": args.runtime, "size": args.size, "regions_kib": args.regions,
            "hydration_size": args.hydration_size, "tmpdir": str(tmp),
        }
        return b

    return common.run_bench(args, find_udm, "udm-clone-", "nbdkit-delay.sock", start)

if __name__ == "__main__":
    common.maybe_reexec_for_matplotlib(__file__)
    sys.exit(main())

