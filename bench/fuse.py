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

The report is in fuse_report.py, loop devices and mounts in loops.py; the generic helpers
(processes, fio JSON, udm verbs) come from harness.py, sizes and tables from report.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import harness  # noqa: E402
from common import (  # noqa: E402
    BenchError, copy_logs, fio_cell, locate_udm, prepare_out_dir, proc_cpu_seconds, run,
    select_workloads, tmp_base, tool_version, trap_signals,
)
from fuse_report import (  # noqa: E402
    LABELS, SYSTEMS, WORKLOADS, build_table, draw_chart, variant_key,
)
from harness import (  # noqa: E402
    Cell, Service, Udm, Workload, check_export, direct_io_note, fill_backing_file, find_udm,
    parse_fio_json, resident_bytes, start_service, wait_for_socket,
)
from loops import (  # noqa: E402
    LoopDev, UdmFuse, cleanup, device_size, is_mounted, loop_dio, loops_under, losetup_attach,
    run_group, same_bytes, wait_for_file,
)
from report import exit_code, human_size, page_cache_note, write_results  # noqa: E402

REPO = harness.REPO


def log(msg: str) -> None:
    print(f"[fuse] {msg}", file=sys.stderr, flush=True)


# common's and harness's helpers (run, Service, fill_backing_file ...) log through common's
# module-level `log`; make them speak with this script's prefix.
common.log = log

PACKAGES = dict(harness.PACKAGES, nbdfuse="libnbd-bin",
                fusermount3="fuse3", losetup="mount", blockdev="util-linux")


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
    ap = common.bench_parser(
        "udm FUSE benchmark: fio on a loop device over udm's FUSE file, over nbdfuse on udm's "
        "NBD export, and straight on the file, side by side.",
        runtime=10, size_help="device and backing file size (default 1G)", repeat=True,
        out="bench/results/fuse",
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
    common.add_variant_arg(ap, "its own FUSE mount of the same `vol` and loop device")
    args = ap.parse_args(argv)
    common.resolve_sizing(args)
    common.resolve_variants(ap, args)
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
        self.disk_stat = common.block_device_stat(tmp)
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
        for label, binary, extra in args.variants:
            # In place: the report reads the same lists.
            SYSTEMS.insert(SYSTEMS.index("nbdfuse"), variant_key(label))
            LABELS[variant_key(label)] = label
            self.meta.setdefault("variants", {})[label] = {
                "udm": str(binary or udm_bin), "daemon_args": extra}

    def choose_transport(self) -> list:
        """The FUSE transport: with --fuse-uring in the daemon, compare FUSE over io_uring
        with /dev/fuse (two daemons on the same file, alternating), or run one in the mode
        asked.  Returns the main daemon's options."""
        if not fuse_uring_flag(self.udm_bin):
            self.meta["fuse_transport"] = "the daemon's default"
            self.meta["fuse_uring_not_compared"] = "this udm daemon has no --fuse-uring"
            return []
        mode = self.args.fuse_uring
        if mode == "compare":
            # In place: the report reads the same list.
            SYSTEMS[:] = ["udm-fuse", "udm-fuse-dev", "nbdfuse", "direct"]
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
        for label, binary, extra in self.args.variants:
            start_udm_fuse(self.udms, variant_key(label), binary or self.udm_bin, self.tmp,
                           f"-v-{label}", self.disk, self.size, extra)
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

    def servers(self, key: str) -> list:
        """The processes serving `key`'s loop device, whose CPU per I/O the report gives: the
        udm daemon; for nbdfuse, nbdfuse and the udm daemon serving it NBD; none for the
        loop on the file (the kernel's own work is nobody's)."""
        lp = next(lp for lp in self.loops if lp.system == key)
        if lp.owner:
            return [lp.owner.daemon.proc.pid]
        if key == "nbdfuse":
            return [self.nbdfuse.proc.pid, self.daemon.proc.pid]
        return []

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
                    servers = self.servers(key)
                    cpu0 = [proc_cpu_seconds(pid) for pid in servers]
                    disk_watch = common.disk_watch(self.disk_stat)
                    smp = fio_cell(cmd,
                                   lambda cmd: run_group(cmd, timeout=fio_timeout, cwd=self.tmp),
                                   parse_fio_json, wl, c, self.out_dir, stem, tag)
                    if smp is None:
                        continue
                    cpu1 = [proc_cpu_seconds(pid) for pid in servers]
                    disk = disk_watch()
                    if disk is not None:
                        smp.disk_depth, smp.disk_us = disk
                    if servers and smp.ios and None not in cpu0 + cpu1:
                        smp.cpu_us_per_io = (sum(cpu1) - sum(cpu0)) / smp.ios * 1e6
                    c.samples.append(smp)
                    unit = "IOPS" if wl.metric == "iops" else "MB/s"
                    cpu = "" if smp.cpu_us_per_io is None else \
                        f"  server CPU {smp.cpu_us_per_io:.1f} µs/IO"
                    log(f"{tag}: {smp.value:>10.0f} {unit}  clat mean {smp.lat_mean_us:.0f} µs "
                        f"p99 {smp.lat_p99_us:.0f} µs{cpu}")

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

    def cleanup(self, rc: int) -> int:
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
    return common.guarded(r.measure_all, r.cleanup)


if __name__ == "__main__":
    common.maybe_reexec_for_matplotlib(__file__)
    sys.exit(main())
