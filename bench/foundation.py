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

import os
import shutil
import sys
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import harness  # noqa: E402
from common import (  # noqa: E402
    BenchError, copy_logs, fio_cell, remove_tmp, run, select_workloads,
    stop_daemon, tool_version, trap_signals,
)
# Also what multipath.py and snapshot.py import from here (from before harness.py held it).
from harness import (  # noqa: E402,F401
    REPO, Cell, Sample, Service, System, Udm, Workload, check_export, direct_io_note,
    fill_backing_file, find_udm, fio_cmd, parse_fio_json, read_reply_kind, resident_bytes,
    start_service, wait_for_socket,
)
from report import (  # noqa: E402
    exit_code, human_size, page_cache_note, write_results,
)
from foundation_report import WORKLOADS, build_table, draw_charts  # noqa: E402

# Which Debian package installs each external tool.
PACKAGES = harness.PACKAGES


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[foundation] {msg}", file=sys.stderr, flush=True)


# common's helpers (run, ...) log through its module-level `log`; make them speak with this
# script's prefix (clone.py and fuse.py point both at their own).
common.log = log


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


class Run:
    """One run of the matrix: the udm daemon with its two devices, the peers beside it, and
    what fio measured on each.  `cleanup` stops everything the run started."""

    # Per workload and repeat, udm next to its peers; every other repeat runs each group in
    # the reverse order, so that no system always goes first.
    GROUPS = [["udm-zero", "nbdkit-null"], ["udm-linear", "qemu-nbd", "nbdkit-file", "file"]]

    def __init__(self, args, udm_bin: Path, out_dir: Path, tmp: Path):
        self.args, self.udm_bin, self.out_dir, self.tmp = args, udm_bin, out_dir, tmp
        self.size = args.size
        self.sectors = self.size // 512
        self.disk = tmp / "disk.img"
        self.disk_stat = common.block_device_stat(tmp)
        self.ctl, self.nbd_sock = tmp / "ctl.sock", tmp / "udm.sock"
        self.uri_zero = f"nbd+unix:///nullz?socket={self.nbd_sock}"
        self.uri_lin = f"nbd+unix:///lin?socket={self.nbd_sock}"
        self.tables = {"nullz": f"0 {self.sectors} zero",
                       "lin": f"0 {self.sectors} linear {self.disk} 0"}
        self.services: list[Service] = []
        self.daemon: Service | None = None
        self.udm: Udm | None = None
        self.created: list[str] = []
        self.results: dict = {}
        self.notes: list = []
        self.sysmap: dict = {}
        self.groups = [list(g) for g in self.GROUPS]
        self.meta = {
            **common.base_meta(udm_bin),
            "nbdkit_version": tool_version(["nbdkit", "--version"])
            if shutil.which("nbdkit") else None,
            "qemu_nbd_version": tool_version(["qemu-nbd", "--version"])
            if shutil.which("qemu-nbd") else None,
            "runtime": args.runtime, "size": self.size, "size_human": human_size(self.size),
            "repeat": args.repeat, "tmpdir": str(tmp),
        }

    def note(self, text: str | None) -> None:
        """A caveat for the report (and the log); None is nothing."""
        if text:
            log(f"WARNING: {text}")
            self.notes.append(text)

    def start_udm(self) -> None:
        """The daemon with `nullz` (zero) and `lin` (linear over the disk), both checked."""
        fill_backing_file(self.disk, self.size, timeout=max(600, self.size / (20 << 20)))
        (self.tmp / "state").mkdir()
        self.daemon = start_service(
            "udm daemon",
            [str(self.udm_bin), "daemon", "--state-dir", str(self.tmp / "state"),
             "--control", str(self.ctl), "--nbd", f"unix:{self.nbd_sock}"],
            self.tmp / "udm-daemon.log", env=dict(os.environ, RUST_BACKTRACE="1"))
        self.services.append(self.daemon)
        wait_for_socket(self.ctl, self.daemon, timeout=30)
        self.udm = Udm(self.udm_bin, self.ctl)
        for name, table in self.tables.items():
            self.udm.client("create", name, "--table", table)
            self.created.append(name)
        wait_for_socket(self.nbd_sock, self.daemon, timeout=30)
        check_export(self.uri_zero, self.size, "udm nullz (zero)")
        check_export(self.uri_lin, self.size, "udm lin (linear)")
        note = direct_io_note("udm daemon", self.daemon.proc.pid, self.disk)
        self.meta["udm_o_direct"] = note is None
        self.note(note)
        systems = [
            System("udm-zero", "udm zero", ["--ioengine=nbd", f"--uri={self.uri_zero}"],
                   self.daemon),
            System("nbdkit-null", "nbdkit null", []),
            System("udm-linear", "udm linear", ["--ioengine=nbd", f"--uri={self.uri_lin}"],
                   self.daemon),
            System("qemu-nbd", "qemu-nbd", []),
            System("nbdkit-file", "nbdkit file", []),
            System("file", "fio on file",
                   ["--ioengine=io_uring", "--direct=1", f"--filename={self.disk}"]),
        ]
        for label, binary, extra in self.args.variants:
            systems.insert(3, self.start_variant(label, binary or self.udm_bin, extra))
        self.sysmap = {s.key: s for s in systems}

    def start_variant(self, label: str, binary: Path, extra: list) -> System:
        """A `--variant` daemon with its own state, sockets and `lin` over the same disk."""
        ctl, sock = self.tmp / f"ctl-v-{label}.sock", self.tmp / f"udm-v-{label}.sock"
        (self.tmp / f"state-v-{label}").mkdir()
        svc = start_service(
            f"udm daemon {label}",
            [str(binary), "daemon", "--state-dir", str(self.tmp / f"state-v-{label}"),
             "--control", str(ctl), "--nbd", f"unix:{sock}", *extra],
            self.tmp / f"udm-daemon-v-{label}.log", env=dict(os.environ, RUST_BACKTRACE="1"))
        self.services.append(svc)
        wait_for_socket(ctl, svc, timeout=30)
        Udm(binary, ctl).client("create", "lin", "--table", self.tables["lin"])
        wait_for_socket(sock, svc, timeout=30)
        uri = f"nbd+unix:///lin?socket={sock}"
        check_export(uri, self.size, f"udm lin ({label})")
        self.meta.setdefault("variants", {})[label] = {"udm": str(binary), "daemon_args": extra}
        self.groups[1].insert(1, f"v-{label}")
        return System(f"v-{label}", label, ["--ioengine=nbd", f"--uri={uri}"], svc)

    def start_peers(self) -> None:
        """nbdkit null, nbdkit file and qemu-nbd, each on its own unix socket for fio's nbd
        engine (a missing tool leaves its column empty), and how each zero device answers a
        read (a hole chunk moves no payload)."""
        # This nbdkit's file plugin has no O_DIRECT; cache=none is the closest: it evicts the
        # pages each read or write went through (fadvise DONTNEED, sync_file_range).
        nbdkit_file_args = ["file", str(self.disk), "cache=none"]
        self.meta["nbdkit_file_args"] = " ".join(nbdkit_file_args).replace(str(self.disk),
                                                                            "DISK")
        peers = [
            ("nbdkit-null", "nbdkit", "nbdkit.sock", "nbdkit.log",
             lambda sock: ["nbdkit", "-f", "-U", sock, "--exit-with-parent", "null",
                           str(self.size)]),
            ("nbdkit-file", "nbdkit", "nbdkit-file.sock", "nbdkit-file.log",
             lambda sock: ["nbdkit", "-f", "-U", sock, "--exit-with-parent",
                           *nbdkit_file_args]),
            ("qemu-nbd", "qemu-nbd", "qemu.sock", "qemu-nbd.log",
             lambda sock: ["qemu-nbd", "-t", "-e", "8", "-k", sock, "-f", "raw",
                           "--cache=none", "--aio=io_uring", str(self.disk)]),
        ]
        for key, tool, sockname, logname, command in peers:
            peer = self.sysmap[key]
            if not shutil.which(tool):
                peer.available = False
                peer.why_unavailable = f"{tool} missing: apt-get install {PACKAGES[tool]}"
                continue
            sock = self.tmp / sockname
            svc = start_service(peer.label, command(str(sock)), self.tmp / logname)
            self.services.append(svc)
            svc.socket = sock
            wait_for_socket(sock, svc)
            uri = f"nbd+unix:///?socket={sock}"
            check_export(uri, self.size, peer.label)
            peer.engine_args = ["--ioengine=nbd", f"--uri={uri}"]
            peer.service = svc
        if self.sysmap["qemu-nbd"].available:
            self.note(direct_io_note("qemu-nbd", self.sysmap["qemu-nbd"].service.proc.pid,
                                     self.disk))
        if self.sysmap["nbdkit-null"].available:
            k_udm = read_reply_kind(self.nbd_sock, "nullz")
            k_nbdkit = read_reply_kind(self.tmp / "nbdkit.sock", "")
            self.meta["zero_read_reply"] = {"udm zero": k_udm, "nbdkit null": k_nbdkit}
            if k_udm and k_nbdkit and k_udm != k_nbdkit:
                self.notes.append(f"udm zero answers a 256 KiB read with {k_udm} chunks, "
                                  f"nbdkit null with {k_nbdkit}: the zero pair's read rows do "
                                  f"not move the same payload")

    def restart_daemon(self) -> None:
        """Start the daemon again on the same state dir; its devices should come back."""
        self.daemon.socket = None
        for p in (self.ctl, self.nbd_sock):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        self.daemon.restart()
        wait_for_socket(self.ctl, self.daemon, timeout=30)
        for name, uri in (("nullz", self.uri_zero), ("lin", self.uri_lin)):
            try:
                wait_for_socket(self.nbd_sock, self.daemon, timeout=10)
                check_export(uri, self.size, f"udm {name} after restart")
            except BenchError:
                log(f"{name} did not come back from the state dir; creating it again")
                self.udm.client("create", name, "--table", self.tables[name])
                wait_for_socket(self.nbd_sock, self.daemon, timeout=30)

    def revive(self, svc: Service, when: str) -> str | None:
        """Before a cell: None when `svc` runs; else start it again where that is fair and
        return why it is still down (None if it is back)."""
        if svc.alive():
            return None
        msg = f"{svc.name} is not running (exit code {svc.proc.returncode})"
        daemon = self.daemon
        if svc is not daemon and svc.restarts < 3:
            # A peer is not what is measured here: note it and start it again.
            log(f"WARNING: {msg}; log tail:\n{svc.log_tail(5)}")
            self.notes.append(f"{msg} before {when}; restarted")
            try:
                svc.restart()
            except BenchError as e:
                log(f"restart failed: {e}")
        elif svc is daemon and daemon.restarts < 2 and daemon.proc.returncode == 0 and \
                "signal" in daemon.log_tail(3):
            # Stopped cleanly by a signal that was not ours (a shared machine: someone's
            # cleanup).  A crash is never restarted.
            log(f"WARNING: {msg} after a signal this script did not send; "
                f"log tail:\n{daemon.log_tail(5)}")
            self.notes.append(f"{msg} (stopped by an outside signal) before {when}; restarted")
            try:
                self.restart_daemon()
            except BenchError as e:
                log(f"daemon restart failed: {e}")
        return None if svc.alive() else msg

    def measure(self, wl: Workload, s: System, rep: int, tag: str) -> None:
        """One fio run of `wl` on system `s`, with the server's CPU time per I/O."""
        c = self.results.setdefault((wl.key, s.key), Cell())
        if s.service is not None:
            down = self.revive(s.service, f"{wl.key} {s.key} r{rep}")
            if down:
                c.errors.append(down)
                log(f"{tag}: SKIPPED, {down}")
                return
        stem = f"{wl.key}.{s.key}.r{rep}"
        cmd = fio_cmd(wl, s, self.args, self.out_dir / f"{stem}.json")
        server = s.service.proc.pid if s.service is not None else None
        cpu0 = common.proc_cpu_seconds(server) if server else None
        disk_watch = common.disk_watch(self.disk_stat)
        fio_timeout = self.args.runtime + 60
        smp = fio_cell(cmd, lambda cmd: run(cmd, timeout=fio_timeout, check=False, quiet=True,
                                            cwd=self.tmp),
                       parse_fio_json, wl, c, self.out_dir, stem, tag)
        if smp is None:
            return
        disk = disk_watch()
        if disk is not None and s.key not in ("udm-zero", "nbdkit-null"):
            smp.disk_depth, smp.disk_us = disk
        if server:
            smp.cpu_us_per_io = common.cpu_us_per_io(cpu0, common.proc_cpu_seconds(server),
                                                     smp.ios)
        elif smp.ios:
            smp.cpu_us_per_io = smp.fio_cpu_s / smp.ios * 1e6
        c.samples.append(smp)
        unit = "IOPS" if wl.metric == "iops" else "MB/s"
        cpu = "—" if smp.cpu_us_per_io is None else f"{smp.cpu_us_per_io:.1f}"
        at_disk = ("" if smp.disk_depth is None else
                   f"  disk depth {smp.disk_depth:.1f}, {smp.disk_us:.0f} µs/IO")
        log(f"{tag}: {smp.value:>10.0f} {unit}  clat mean {smp.lat_mean_us:.0f} µs "
            f"p99 {smp.lat_p99_us:.0f} µs  CPU {cpu} µs/IO{at_disk}")

    def run_matrix(self) -> None:
        """Every workload, repeat and available system, in the order GROUPS says."""
        runs = [k for g in self.groups for k in g if self.sysmap[k].available]
        total = len(WORKLOADS) * self.args.repeat * len(runs)
        est = total * (self.args.runtime + 1)
        log(f"{total} fio runs of {self.args.runtime} s (about {est // 60} min {est % 60} s)")
        n = 0
        for wl in WORKLOADS:
            for rep in range(1, self.args.repeat + 1):
                order = [k for g in self.groups for k in (g if rep % 2 else reversed(g))]
                for key in order:
                    if self.sysmap[key].available:
                        n += 1
                        self.measure(wl, self.sysmap[key], rep,
                                     f"[{n}/{total}] {wl.key:<18} {key:<11} r{rep}")

    def report(self, cached_before) -> int:
        """The table, results.json and the charts; the exit status the bars give."""
        cached_after = resident_bytes(self.disk)
        self.meta["page_cache_bytes"] = {"before": cached_before, "after": cached_after}
        self.note(page_cache_note(self.disk.name, self.size, cached_before, cached_after,
                                  "system is meant to bypass it (udm's buffered fallback, "
                                  "qemu-nbd not honouring --cache=none, or nbdkit file's "
                                  "cache=none evicting late)"))
        self.meta["notes"] = self.notes
        systems = list(self.sysmap.values())
        table, summary = build_table(self.results, systems, self.meta)
        write_results(self.out_dir, table, {"meta": self.meta, "workloads": summary})
        if self.args.no_charts:
            log("charts skipped (--no-charts)")
        else:
            for p in draw_charts(self.results, systems, self.out_dir, self.meta):
                log(f"chart: {p}")
        log(f"results in {self.out_dir}")
        return exit_code(self.results)

    def measure_all(self) -> int:
        """Everything started, the matrix, the report; the exit status."""
        self.start_udm()
        self.start_peers()
        # Every system here bypasses the page cache, so whatever of disk.img is cached after
        # the matrix was read or written by a buffered path.
        cached_before = resident_bytes(self.disk)
        self.run_matrix()
        return self.report(cached_before)

    def cleanup(self, rc: int) -> int:
        """Peers first, then the udm devices, then the daemon; logs kept, temp dir removed.
        Returns `rc`."""
        for svc in reversed(self.services):
            if svc is not self.daemon:
                svc.stop(grace=5)
        if self.daemon is not None and self.daemon.alive() and self.udm is not None:
            for name in reversed(self.created):
                try:
                    self.udm.client("remove", name, timeout=30, check=False)
                except BenchError as e:
                    log(f"udm remove {name}: {e}")
        if self.daemon is not None:
            stop_daemon(self.daemon, grace=15)
        copy_logs(self.services, self.out_dir)
        remove_tmp(self.tmp, self.args.keep)
        return rc


def parse_args(argv):
    ap = common.bench_parser(
        "udm foundation benchmark: udm zero vs nbdkit null, udm linear vs qemu-nbd raw and "
        "nbdkit file, and fio on the file, side by side.",
        runtime=10, size_help="export and backing file size (default 1G)", repeat=True,
        out="bench/results/foundation",
        out_help="output directory for fio JSON, table.md and charts "
                 "(default bench/results/foundation, relative to the current directory)")
    ap.add_argument("--workloads", default=None,
                    help="comma-separated subset of: " + ",".join(w.key for w in WORKLOADS))
    ap.add_argument("--jobs", default="",
                    help="comma-separated fio job counts (e.g. 2,4): each depth-32 row is "
                         "also run with N jobs at depth 32/N (the same total depth) and with N "
                         "jobs at depth 32 each, for every system alike; shows whether the "
                         "client (one fio thread) bounds a row. The bars judge the one-job "
                         "rows only.")
    common.add_variant_arg(ap, "its own `lin` over the same file")
    args = ap.parse_args(argv)
    common.resolve_variants(ap, args)
    jobs = parse_jobs(ap, args.jobs)
    common.resolve_sizing(args)
    if args.runtime < 1 or args.repeat < 1:
        ap.error("--runtime and --repeat must be at least 1")
    # In place: build_table and draw_charts read the same list.
    WORKLOADS[:] = with_jobs(select_workloads(ap, args.workloads, list(WORKLOADS)), jobs)
    return args


def parse_jobs(ap, text: str) -> list:
    """--jobs: fio job counts, each at least 2 and a divisor of 32 (the rows keep depth 32)."""
    try:
        jobs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--jobs {text!r} is not a list of numbers")
    if any(n < 2 or 32 % n for n in jobs):
        ap.error("--jobs counts must be at least 2 and divide 32")
    return jobs


def with_jobs(workloads: list, jobs: list) -> list:
    """`workloads`, each depth-32 one followed by its rows with more fio jobs: N × depth 32/N
    (the same requests in flight, more client threads) and N × depth 32."""
    out = []
    for wl in workloads:
        out.append(wl)
        if wl.qd != 32:
            continue
        for n in jobs:
            for qd in (32 // n, 32):
                out.append(Workload(f"{wl.key}-{n}x{qd}", f"{wl.label}, {n} jobs × qd{qd}",
                                    wl.rw, wl.bs, qd, jobs=n))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    trap_signals()
    if not common.have_fio_with_nbd():
        return 2
    for t in ("nbdkit", "qemu-nbd", "nbdinfo"):
        if not shutil.which(t):
            extra = " (only used for a sanity probe)" if t == "nbdinfo" else \
                    " — its column will be empty"
            log(f"WARNING: `{t}` not found; install the Debian package `{PACKAGES[t]}`{extra}")
    return common.run_bench(args, find_udm, "udm-foundation-", "nbdkit.sock",
                            lambda out_dir, udm_bin, tmp: Run(args, udm_bin, out_dir, tmp))


if __name__ == "__main__":
    common.maybe_reexec_for_matplotlib(__file__)
    sys.exit(main())

