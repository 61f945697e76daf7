#!/usr/bin/env python3
"""udm multipath benchmark (issue #13): a multipath over NBD exports of other udm daemons,
against itself and against linear, fio's nbd engine on the multipath host's export.

Three parts, one run, systems alternating, medians of --repeat:

1. Round-robin over two paths / linear over one, both on a `zero` export and on a file
   export of a storage daemon (two Unix listeners: two paths): IOPS or MB/s ratio (bar ≥ 0.98×,
   seed 004; goal ≥ 1.0×) and the multipath host's CPU per I/O. Beside them, a multipath
   over one of the two paths: seed 004's own comparison ("the multipath runs are only with a
   single path"), which prices the target apart from a second connection's.
2. Two paths with 1 ms and 5 ms added latency (the storage daemon's `delay` devices):
   queue-length, service-time and historical-service-time / round-robin IOPS at depth 32
   (bar ≥ 1.5×).
3. The failover gap: fio's longest completion latency when one path's server is killed
   (kill -9) mid-run, the default checker, against the same run without a kill (bar ≤ 2 s).
   Two storage daemons share one file here, so one can die while the other serves.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import foundation as fnd  # noqa: E402
from common import (  # noqa: E402
    BenchError, copy_logs, cpu_us_per_io, fio_cell, locate_udm, make_tmpdir, per_io,
    prepare_out_dir, proc_context_switches, proc_cpu_seconds, remove_tmp, run, stop_daemon,
    tmp_base, trap_signals,
)
from foundation import (  # noqa: E402
    Cell, Service, System, Udm, Workload, fill_backing_file, find_udm, fio_cmd, parse_fio_json,
    start_service, wait_for_socket,
)
from report import (  # noqa: E402
    exit_code, fmt_cpu, fmt_ratio, fmt_value, human_size, judge, markdown_table, table_footer,
    write_results,
)


def log(msg: str) -> None:
    print(f"[multipath] {msg}", file=sys.stderr, flush=True)


common.log = fnd.log = log

# Part 1.
WORKLOADS = [
    Workload("randread-4k-qd32", "randread 4k qd32", "randread", "4k", 32),
    Workload("randwrite-4k-qd32", "randwrite 4k qd32", "randwrite", "4k", 32),
    Workload("read-256k-qd32", "read 256k qd32", "read", "256k", 32),
]
BACKENDS = [("zero", "zero export"), ("file", "file export")]
BAR_RR = 0.98
# Part 2.
SLOW = Workload("randread-4k-qd32", "randread 4k qd32", "randread", "4k", 32)
SELECTORS = [("round-robin", "1"), ("queue-length", "1"), ("service-time", "1 1"),
             ("historical-service-time", "0")]
SLOW_SERVERS = [("udm", "udm delay"), ("nbdkit", "nbdkit delay")]
BAR_SELECTOR = 1.5
# Part 3.
GAP = Workload("randwrite-4k-qd16", "randwrite 4k qd16", "randwrite", "4k", 16)
BAR_GAP_MS = 2000.0
# Requests down remote paths take no pool thread (the NBD client completes them) and the
# storage's `delay` over `zero` waits on a timer; the pool serves what is left (a flush down
# both paths, a retry after a path broke), generously, so that depth 32 never waits for one.
POOL = "64"


class Daemon:
    """A udm daemon of ours: its process, control client and NBD sockets."""

    def __init__(self, udm_bin: Path, tmp: Path, name: str, sockets: list[str],
                 extra: list[str] | None = None):
        self.name, self.tmp = name, tmp
        self.ctl = tmp / f"{name}.ctl"
        self.sockets = [tmp / s for s in sockets]
        state = tmp / f"{name}-state"
        state.mkdir()
        cmd = [str(udm_bin), "daemon", "--state-dir", str(state), "--control", str(self.ctl),
               "--nbd-pool-threads", POOL]
        for s in self.sockets:
            cmd += ["--nbd", f"unix:{s}"]
        cmd += extra or []
        self.service: Service = start_service(f"udm {name}", cmd, tmp / f"{name}.log")
        wait_for_socket(self.ctl, self.service, timeout=30)
        self.udm = Udm(udm_bin, self.ctl)

    def create(self, dev: str, table: str) -> None:
        self.udm.client("create", dev, "--table", table)

    def uri(self, dev: str, socket: int = 0) -> str:
        return f"nbd+unix:///{dev}?socket={self.sockets[socket]}"

    def restart(self) -> None:
        for p in [self.ctl, *self.sockets]:
            p.unlink(missing_ok=True)
        self.service.restart()
        wait_for_socket(self.ctl, self.service, timeout=30)


def multipath_table(sectors: int, selector: str, path_args: str, uris: list[str],
                    features: str = "0") -> str:
    nargs = len(path_args.split())
    paths = " ".join(f"{u} {path_args}" for u in uris)
    return (f"0 {sectors} multipath {features} 0 1 1 {selector} 0 {len(uris)} {nargs} "
            f"{paths}")


def measure(wl: Workload, system: System, host: Daemon, args, out_dir: Path, stem: str,
            cells: dict, key, tag: str, storage: Daemon | None = None):
    """One fio run; the sample (with the host daemon's CPU and context switches per I/O, and
    the storage daemon's when given) joins cells[key]. Context switches say how many
    wake-ups the I/Os took, which CPU time on a busy machine blurs."""
    cell = cells.setdefault(key, Cell())
    cmd = fio_cmd(wl, system, args, out_dir / f"{stem}.json")
    daemons = {"": host, "storage_": storage} if storage else {"": host}

    def counters():
        return {prefix: (proc_cpu_seconds(d.service.proc.pid),
                         proc_context_switches(d.service.proc.pid))
                for prefix, d in daemons.items()}
    before = counters()
    smp = fio_cell(cmd, lambda c: run(c, timeout=args.runtime + 120, check=False, quiet=True),
                   parse_fio_json, wl, cell, out_dir, stem, tag)
    if smp is None:
        return None
    after = counters()
    for prefix in daemons:
        (cpu0, switches0), (cpu1, switches1) = before[prefix], after[prefix]
        setattr(smp, f"{prefix}cpu_us_per_io", cpu_us_per_io(cpu0, cpu1, smp.ios))
        setattr(smp, f"{prefix}switches_per_io", per_io(switches0, switches1, smp.ios))
    if not storage:
        smp.storage_cpu_us_per_io = smp.storage_switches_per_io = None
    cell.samples.append(smp)
    storage_note = (f", storage CPU {fmt_cpu(smp.storage_cpu_us_per_io)} µs/IO "
                    f"{fmt_switches(smp.storage_switches_per_io)} switches/IO") if storage else ""
    log(f"{tag}: {fmt_value(smp.value, wl.metric)}, host CPU "
        f"{fmt_cpu(smp.cpu_us_per_io)} µs/IO {fmt_switches(smp.switches_per_io)} "
        f"switches/IO{storage_note}")
    return smp


def fmt_switches(v) -> str:
    return "–" if v is None else f"{v:.2f}"


def nbd(host: Daemon, dev: str) -> list:
    return ["--ioengine=nbd", f"--uri={host.uri(dev)}"]


def part_rr_vs_linear(hosts, storage, sectors, args, out_dir, cells) -> None:
    """Round-robin over storage's two listeners vs linear over one, per backend, on each host
    daemon: (suffix of its systems' keys, daemon), this run's first, then each --variant's."""
    systems = []
    for suffix, host in hosts:
        for backend, _ in BACKENDS:
            paths = [storage.uri(backend, 0), storage.uri(backend, 1)]
            host.create(f"mp-{backend}", multipath_table(sectors, "round-robin", "1", paths))
            host.create(f"mp1-{backend}",
                        multipath_table(sectors, "round-robin", "1", paths[:1]))
            host.create(f"lin-{backend}", f"0 {sectors} linear {paths[0]} 0")
            systems += [(host, System(f"mp-{backend}{suffix}", f"round-robin ×2 ({backend})",
                                      nbd(host, f"mp-{backend}"))),
                        (host, System(f"mp1-{backend}{suffix}", f"multipath ×1 ({backend})",
                                      nbd(host, f"mp1-{backend}"))),
                        (host, System(f"lin-{backend}{suffix}", f"linear ×1 ({backend})",
                                      nbd(host, f"lin-{backend}")))]
    for wl in args.workloads:
        for rep in range(1, args.repeat + 1):
            for backend, _ in BACKENDS:
                for suffix, _ in hosts:
                    group = [f"{sys}-{backend}{suffix}" for sys in ("mp", "mp1", "lin")]
                    for key in group if rep % 2 else reversed(group):
                        host, system = next((h, s) for h, s in systems if s.key == key)
                        measure(wl, system, host, args, out_dir, f"{wl.key}.{key}.r{rep}",
                                cells, (wl.key, key), f"{wl.key} {key} r{rep}", storage=storage)


def start_delay_peers(tmp: Path, size: int) -> list[Service]:
    """nbdkit null exports behind its delay filter, 1 ms and 5 ms per request."""
    peers = []
    for ms in (1, 5):
        sock = tmp / f"nbdkit-d{ms}.sock"
        peer = start_service(
            f"nbdkit delay {ms} ms",
            ["nbdkit", "-f", "-U", str(sock), "--exit-with-parent", "--filter=delay", "null",
             str(size), f"rdelay={ms}ms", f"wdelay={ms}ms"],
            tmp / f"nbdkit-d{ms}.log")
        peer.socket = sock
        wait_for_socket(sock, peer)
        peers.append(peer)
    return peers


def part_selectors(host, storage, peers, sectors, args, out_dir, cells) -> None:
    """Each selector over a 1 ms and a 5 ms path: the storage daemon's delay devices, and
    nbdkit's delay filter when there is nbdkit."""
    servers = [("udm", [storage.uri("d1", 0), storage.uri("d5", 1)])]
    if peers:
        servers.append(("nbdkit", [f"nbd+unix:///?socket={p.socket}" for p in peers]))
    for server, paths in servers:
        for selector, path_args in SELECTORS:
            host.create(f"slow-{server}-{selector}",
                        multipath_table(sectors, selector, path_args, paths))
    for rep in range(1, args.repeat + 1):
        order = SELECTORS if rep % 2 else list(reversed(SELECTORS))
        for server, _ in servers:
            for selector, _ in order:
                dev = f"slow-{server}-{selector}"
                measure(SLOW, System(dev, selector, nbd(host, dev)), host, args, out_dir,
                        f"slow.{server}.{selector}.r{rep}", cells, ("slow", server, selector),
                        f"1 ms + 5 ms paths ({server}), {selector} r{rep}")


def part_failover_gap(host, servers, sectors, args, out_dir, cells) -> dict:
    """fio on a multipath over servers B and C (one file), without and with B killed mid-run."""
    uris = [s.uri("file") for s in servers]
    host.create("gap", multipath_table(sectors, "round-robin", "1", uris))
    system = System("gap", "gap", nbd(host, "gap"))
    runtime = max(args.runtime, 6)
    gap_args = argparse.Namespace(**{**vars(args), "runtime": runtime})
    out = {}
    for kill in (False, True):
        killer = None
        if kill:
            def kill_b():
                time.sleep(runtime / 2)
                log("killing B's server (kill -9)")
                servers[0].service.proc.send_signal(signal.SIGKILL)
            killer = threading.Thread(target=kill_b, daemon=True)
            killer.start()
        name = "kill" if kill else "steady"
        smp = measure(GAP, system, host, gap_args, out_dir, f"gap.{name}", cells,
                      ("gap", name), f"failover gap, {name}")
        if killer is not None:
            killer.join()
        if smp is not None:
            text = smp.json_path.read_text()
            job = json.loads(text[text.find("{"):])["jobs"][0]
            out[name] = {"clat_max_ms": job["write"]["clat_ns"]["max"] / 1e6,
                         "iops": smp.iops, "errors": job.get("error", 0)}
    status = host.udm.client("status", "gap", check=False)
    out["status_after"] = status.stdout.strip() if status else None
    return out


def build_report(cells, gap, meta) -> tuple[str, list]:
    bars = []
    lines = [f"## Multipath (`python3 bench/multipath.py`, {meta['timestamp']})", ""]

    def med(key, attr="value"):
        c = cells.get(key)
        return c.median(attr) if c else None

    def ratio(a, b):
        return a / b if a and b else None

    parts = {k[0] for k in cells}
    measured = [w for w in WORKLOADS if w.key in parts]
    if measured:
        lines += rr_section(med, ratio, bars, measured,
                            [""] + [f"@{v}" for v in meta.get("variants", {})])
    if "slow" in parts:
        lines += selector_section(med, ratio, bars)
    if gap:
        lines += gap_section(gap, bars)
    lines += ["", "#### Bars", ""]
    lines += [f"- {'✔' if ok else '✘ **FAILED**'} {text}" for text, ok in bars]
    return "\n".join(lines), bars


def rr_section(med, ratio, bars, workloads, suffixes) -> list:
    """One row per workload measured and host daemon (`suffixes`: "" for this run's, "@LABEL"
    for a --variant's)."""
    lines = ["### Round-robin over two paths / linear over one (NBD from a udm daemon)"]
    lines.append("")
    header = ["workload"]
    for backend, label in BACKENDS:
        header += [f"rr ×2, {label}", f"linear, {label}", "rr / linear",
                   "host CPU µs/IO rr / linear", "storage CPU µs/IO rr / linear",
                   "switches/IO host rr / linear; storage rr / linear"]
    rows = []
    for wl, suffix in ((wl, suffix) for wl in workloads for suffix in suffixes):
        row = [wl.label + (" (IOPS)" if wl.metric == "iops" else " (MB/s)") + suffix]
        for backend, label in BACKENDS:
            mp, lin = (med((wl.key, f"{sys}-{backend}{suffix}")) for sys in ("mp", "lin"))
            r = ratio(mp, lin)
            cpu = [" / ".join(fmt_cpu(med((wl.key, f"{sys}-{backend}{suffix}"), attr))
                              for sys in ("mp", "lin"))
                   for attr in ("cpu_us_per_io", "storage_cpu_us_per_io")]
            switches = "; ".join(" / ".join(fmt_switches(med((wl.key, f"{sys}-{backend}{suffix}"),
                                                             attr))
                                            for sys in ("mp", "lin"))
                                 for attr in ("switches_per_io", "storage_switches_per_io"))
            row += [fmt_value(mp, wl.metric), fmt_value(lin, wl.metric), fmt_ratio(r), *cpu,
                    switches]
            if r is not None:
                bars.append((f"{wl.label}{suffix}, {label}: round-robin ×2 / linear = {r:.2f}× "
                             f"(≥ {BAR_RR}×)", judge(r, BAR_RR)))
        rows.append(row)
    lines.append(markdown_table(header, rows))
    lines += ["", "CPU: the multipath host daemon's (and the storage daemon's) utime + stime "
              "over the run / I/Os fio completed; switches: their threads' voluntary and "
              "involuntary context switches / I/Os (a wake-up each, mostly), which load on the "
              "machine blurs less than CPU time. Round-robin's two paths are two connections "
              "to the storage daemon, each carrying half of every batch of requests (served on "
              "one event loop of the storage daemon: one client, one export)."]
    lines += ["", "Multipath over one path / linear over it (seed 004's comparison: the "
              "target's own cost, no second connection; not a bar):", ""]
    rows = []
    for wl, suffix in ((wl, suffix) for wl in workloads for suffix in suffixes):
        row = [wl.label + suffix]
        for backend, _ in BACKENDS:
            mp1, lin = (med((wl.key, f"{sys}-{backend}{suffix}")) for sys in ("mp1", "lin"))
            row += [fmt_value(mp1, wl.metric), fmt_ratio(ratio(mp1, lin))]
        rows.append(row)
    header = ["workload"]
    for _, label in BACKENDS:
        header += [f"multipath ×1, {label}", "/ linear"]
    lines.append(markdown_table(header, rows))
    return lines


def selector_section(med, ratio, bars) -> list:
    lines = ["", "### Selectors over a 1 ms and a 5 ms path (randread 4k qd32, IOPS)", ""]
    rows = []
    for selector, _ in SELECTORS:
        row = [selector]
        for server, label in SLOW_SERVERS:
            v = med(("slow", server, selector))
            r = ratio(v, med(("slow", server, "round-robin")))
            row += [fmt_value(v, "iops"), fmt_ratio(r)]
            if selector != "round-robin" and r is not None:
                bars.append((f"{selector} / round-robin over 1 ms + 5 ms paths ({label}) = "
                             f"{r:.2f}× (≥ {BAR_SELECTOR}×)", judge(r, BAR_SELECTOR)))
        rows.append(row)
    header = ["selector"]
    for _, label in SLOW_SERVERS:
        header += [label, "/ round-robin"]
    lines.append(markdown_table(header, rows))
    lines += ["", "udm delay: the storage daemon's `delay` devices over `zero` (each request "
              "waits on the daemon's timer, no cap); nbdkit delay: `nbdkit --filter=delay null` "
              "(16 threads per connection, so at most 16 requests in flight per path)."]
    return lines


def gap_section(gap, bars) -> list:
    lines = ["", "### Failover gap: one path's server killed mid-run (randwrite 4k qd16)", ""]
    rows = []
    for name, label in (("steady", "no kill"), ("kill", "B killed (kill -9) mid-run")):
        g = gap.get(name)
        if g:
            rows.append([label, f"{g['iops']:.0f}", f"{g['clat_max_ms']:.1f} ms",
                         str(g["errors"])])
    lines.append(markdown_table(["run", "IOPS", "longest completion", "fio errors"], rows))
    if "kill" in gap:
        g = gap["kill"]["clat_max_ms"]
        bars.append((f"failover gap with the default checker: {g:.1f} ms (≤ {BAR_GAP_MS:.0f} "
                     f"ms)", g <= BAR_GAP_MS and gap["kill"]["errors"] == 0))
    lines += ["", "Killed server: its connections are reset, the requests in flight on it "
              "fail at once and go down the other path; the checker (every 5 s) is not "
              "involved. A server that stops answering without a reset (a cut link) is "
              "failed after `path_timeout` (default 5 s). multipathd's defaults for "
              "comparison: `polling_interval` 5 s, `checker_timeout` the SCSI command "
              "timeout (30 s); a dead path there is found by an I/O error, whose delay is "
              "the transport's (`fast_io_fail_tmo` 5 s on FC, `replacement_timeout` 120 s "
              "for iSCSI)."]
    return lines


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_sizing_args(ap, runtime=2, size_help="export size (default 1G)", repeat=True,
                           quick={"runtime": 2, "size": "256M", "repeat": 1})
    ap.add_argument("--parts", default="rr,selectors,gap",
                    help="comma-separated parts to run: rr (round-robin vs linear), selectors, "
                         "gap (failover); default all")
    common.add_run_args(
        ap, out="bench/results/multipath",
        out_help="output directory (default bench/results/multipath)",
        tmpdir_help="where to create the temp dir (default $TMPDIR or /tmp)",
        keep_help="keep the temp dir (image, logs)",
        udm_help="path of the udm binary (default target/release/udm, built if missing)",
        charts_help="(no charts here; accepted for symmetry)")
    ap.add_argument("--workloads", default=None,
                    help="comma-separated subset of the rr part's workloads: "
                         + ",".join(w.key for w in WORKLOADS))
    common.add_variant_arg(ap, "round-robin and linear devices of its own over the same "
                               "storage daemon (rr part only; its rows are WORKLOAD@LABEL)")
    args = ap.parse_args(argv)
    common.resolve_sizing(args)
    common.resolve_variants(ap, args)
    args.workloads = common.select_workloads(ap, args.workloads, WORKLOADS)
    args.parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not args.parts or args.parts - {"rr", "selectors", "gap"}:
        ap.error(f"--parts: unknown parts {sorted(args.parts - {'rr', 'selectors', 'gap'})}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    parts = args.parts
    trap_signals()
    if not shutil.which("fio"):
        log("ERROR: fio not found (apt-get install fio)")
        return 2
    out_dir = prepare_out_dir(args.out)
    udm_bin = locate_udm(args, find_udm)
    if udm_bin is None:
        return 2
    tmp = make_tmpdir(tmp_base(args), "udm-multipath-", "storage-2.sock")
    if tmp is None:
        return 2
    sectors = args.size // 512
    daemons: list[Daemon] = []
    services: list[Service] = []
    cells: dict = {}
    meta = {**common.base_meta(udm_bin), "runtime": args.runtime, "size": args.size,
            "size_human": human_size(args.size), "repeat": args.repeat}
    rc = 1
    try:
        disk = tmp / "disk.img"
        fill_backing_file(disk, args.size, timeout=max(600, args.size / (20 << 20)))
        storage = Daemon(udm_bin, tmp, "storage", ["storage-1.sock", "storage-2.sock"])
        daemons.append(storage)
        storage.create("zero", f"0 {sectors} zero")
        storage.create("file", f"0 {sectors} linear {disk} 0")
        for ms in (1, 5):
            storage.create(f"d{ms}", f"0 {sectors} delay zero 0 {ms}")
        servers = []
        for name in ("b", "c"):
            server = Daemon(udm_bin, tmp, name, [f"{name}.sock"])
            server.create("file", f"0 {sectors} linear {disk} 0")
            daemons.append(server)
            servers.append(server)
        host = Daemon(udm_bin, tmp, "host", ["host.sock"])
        daemons.append(host)
        hosts = [("", host)]
        for label, binary, extra in args.variants if "rr" in parts else []:
            variant = Daemon(binary or udm_bin, tmp, f"host-{label}", [f"host-{label}.sock"],
                             extra)
            daemons.append(variant)
            hosts.append((f"@{label}", variant))
            meta.setdefault("variants", {})[label] = {
                "udm": str(binary or udm_bin), "args": extra}

        if "rr" in parts:
            part_rr_vs_linear(hosts, storage, sectors, args, out_dir, cells)
        if "selectors" in parts:
            if shutil.which("nbdkit"):
                peers = start_delay_peers(tmp, args.size)
            else:
                log("WARNING: nbdkit not found (apt-get install nbdkit): udm delay paths only")
                peers = []
            services += peers
            part_selectors(host, storage, peers, sectors, args, out_dir, cells)
        gap = part_failover_gap(host, servers, sectors, args, out_dir, cells) \
            if "gap" in parts else {}
        table, bars = build_report(cells, gap, meta)
        failed = [f"{k}" for k, c in cells.items() if c.errors]
        out = table.splitlines()
        table_footer(out, meta, failed)
        write_results(out_dir, "\n".join(out), {
            "meta": meta, "gap": gap,
            "bars": [{"bar": t, "ok": ok} for t, ok in bars],
            "cells": {"/".join(map(str, k)): {"samples": [vars(s) for s in c.samples],
                                    "errors": c.errors} for k, c in cells.items()},
        })
        rc = exit_code(cells)
    except (BenchError, KeyboardInterrupt) as e:
        log(f"ERROR: {e}")
        rc = 2
    finally:
        for d in reversed(daemons):
            stop_daemon(d.service, grace=15, report_exit=d.name not in ("b",))
        # nbdkit waits for its clients to hang up: after the host daemon.
        for peer in services:
            peer.stop(grace=5)
        copy_logs([d.service for d in daemons] + services, out_dir)
        remove_tmp(tmp, args.keep)
    return rc


if __name__ == "__main__":
    sys.exit(main())
