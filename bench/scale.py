#!/usr/bin/env python3
"""Scale benchmark for udm's NBD server: many connections against one daemon, and a flood.

1. **Many connections.** One udm daemon, one ``linear`` device over a fully written file.
   fio's nbd engine, 4 KiB random reads at iodepth 32 per connection: ``--connections`` jobs
   (default 64, ``numjobs``; each fio job opens its own NBD connection) against one job,
   alternating, ``--repeat`` times.  Reported: total IOPS both ways (median) and their ratio,
   p99 latency, the daemon's thread count (``/proc/PID/task``, the most seen while sampling
   every 100 ms), its RSS (the most ``VmRSS`` seen, and ``VmHWM``), its CPU time per I/O, the
   connections it held (``/proc/net/unix``) and fio's errors (must be none).
2. **Flood.** While one fio job runs 4 KiB random reads at iodepth 32, open ``--flood``
   (default 400) raw connections from this process (one uid), each doing the NBD
   fixed-newstyle handshake to the export (NBD_OPT_GO) and then sitting idle.  Reported: that
   the fio job completed with no error (and its IOPS against the one-connection runs), how many
   connections were served, how many were refused and with which message (so which of the
   daemon's limits bit: the server-wide one or the per-client one), how many were closed
   without a word, the daemon's threads and RSS, and that every slot came back afterwards (no
   connection left, a new one served).

Usage:  python3 bench/scale.py [--runtime 10] [--size 1G] [--repeat 3] [--quick]
                               [--connections 64] [--flood 400] [--out bench/results/scale]

The generic helpers (processes, fio JSON, sizes, udm verbs, the NBD handshake) come from
harness.py and common.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import (  # noqa: E402
    BenchError, _pdeathsig, copy_logs, remove_tmp, run, stop_daemon, trap_signals,
)
from harness import (  # noqa: E402
    NbdRefused, Service, Udm, Workload, check_export, fill_backing_file, find_udm, nbd_handshake,
    parse_fio_json, start_service, wait_for_socket,
)
from report import human_size, write_results  # noqa: E402
from scale_report import build_report, limit_bit, mib  # noqa: E402


def log(msg: str) -> None:
    print(f"[scale] {msg}", file=sys.stderr, flush=True)


# common's and harness's helpers log through common's module-level `log`; make them speak
# with this script's prefix.
common.log = log

WORKLOAD = Workload("randread-4k-qd32", "randread 4k qd32", "randread", "4k", 32)
EXPORT = "lin"


# --------------------------------------------------------------------------------------------
# watching the daemon
# --------------------------------------------------------------------------------------------

def unix_connections(sock_path: Path) -> int:
    """Connected sockets bound to `sock_path` (/proc/net/unix): the server's end of every
    connection accepted on that listener carries the listener's path; the listener itself is
    not connected (state 01)."""
    n = 0
    try:
        with open("/proc/net/unix") as f:
            next(f)
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[7] == str(sock_path) and fields[5] == "03":
                    n += 1
    except OSError:
        pass
    return n


def proc_status(pid: int) -> dict:
    """VmRSS and VmHWM in bytes and the thread count of process `pid` ({} when it is gone)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
        out["threads"] = len(os.listdir(f"/proc/{pid}/task"))
    except (OSError, ValueError, IndexError):
        pass
    return out


class Watcher:
    """Samples the daemon every `interval` seconds on a thread of its own while in a `with`
    block: the most threads, RSS and connections seen, and the last VmHWM."""

    def __init__(self, pid: int, sock: Path, interval: float = 0.1):
        self.pid, self.sock, self.interval = pid, sock, interval
        self.threads_max = self.rss_max = self.conns_max = 0
        self.hwm = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        st = proc_status(self.pid)
        if not st:
            return
        self.samples += 1
        self.threads_max = max(self.threads_max, st.get("threads", 0))
        self.rss_max = max(self.rss_max, st.get("VmRSS", 0))
        self.hwm = st.get("VmHWM", self.hwm)
        self.conns_max = max(self.conns_max, unix_connections(self.sock))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self):
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *_exc):
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()

    def as_dict(self) -> dict:
        return {"threads_max": self.threads_max, "rss_max": self.rss_max, "vm_hwm": self.hwm,
                "connections_max": self.conns_max, "samples": self.samples}


# --------------------------------------------------------------------------------------------
# fio
# --------------------------------------------------------------------------------------------

@dataclass
class Run:
    """One fio run against the daemon."""
    jobs: int
    iops: float | None = None
    lat_p99_us: float | None = None
    ios: int = 0
    cpu_us_per_io: float | None = None
    error: str | None = None           # fio's exit status / job error, None when clean
    daemon: dict = field(default_factory=dict)
    json: str = ""


def fio_cmd(uri: str, jobs: int, runtime: int, size: int, out_json: Path) -> list:
    # Each fio job has its own libnbd handle, so numjobs=N opens N connections.
    return ["fio", f"--name={WORKLOAD.key}", "--ioengine=nbd", f"--uri={uri}",
            f"--rw={WORKLOAD.rw}", f"--bs={WORKLOAD.bs}", f"--iodepth={WORKLOAD.qd}",
            f"--numjobs={jobs}", "--time_based", f"--runtime={runtime}", f"--size={size}",
            "--randrepeat=1", "--group_reporting", "--output-format=json",
            f"--output={out_json}"]


def fio_outcome(cp, out_json: Path, r: Run) -> None:
    """Fill `r` from fio's exit status and JSON: the numbers, or the error (fio's job error
    with group_reporting is the first error of any job)."""
    errors = []
    if cp.returncode != 0:
        errors.append(f"fio exit {cp.returncode}: {(cp.stderr or cp.stdout).strip()[-600:]}")
    try:
        text = out_json.read_text(errors="replace")
        job = json.loads(text[text.index("{"):])["jobs"][0]
        if job.get("error", 0):
            errors.append(f"fio job error {job['error']}")
        else:
            smp = parse_fio_json(out_json, WORKLOAD)
            r.iops, r.lat_p99_us, r.ios = smp.iops, smp.lat_p99_us, smp.ios
    except (OSError, ValueError, KeyError, IndexError, BenchError) as e:
        errors.append(f"fio JSON: {e}")
    r.error = "; ".join(errors) or None


def fio_run(uri: str, jobs: int, args, out_json: Path, daemon: Service, sock: Path) -> Run:
    r = Run(jobs=jobs, json=out_json.name)
    cmd = fio_cmd(uri, jobs, args.runtime, args.size, out_json)
    r.daemon["connections_before"] = drain(sock, f"a {jobs}-connection run")
    pid = daemon.proc.pid
    cpu0 = common.proc_cpu_seconds(pid)
    with Watcher(pid, sock) as w:
        cp = run(cmd, timeout=args.runtime + 120, check=False, quiet=True)
    cpu1 = common.proc_cpu_seconds(pid)
    fio_outcome(cp, out_json, r)
    r.cpu_us_per_io = common.cpu_us_per_io(cpu0, cpu1, r.ios)
    r.daemon.update(w.as_dict())
    return r


# --------------------------------------------------------------------------------------------
# the flood
# --------------------------------------------------------------------------------------------

def open_flood(sock: Path, n: int, keep: list) -> Counter:
    """Open `n` connections one after another, each handshaking to EXPORT; the served ones go
    into `keep` (left open, idle).  Returns how each ended: "served", "refused: MESSAGE",
    "closed without a word" or "error: ...".  One at a time, so that every refused client is
    answered (the server answers only a few refusals at once and drops the rest silently)."""
    outcome = Counter()
    for _ in range(n):
        sk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sk.settimeout(10)
        try:
            sk.connect(str(sock))
            nbd_handshake(sk, EXPORT)
        except NbdRefused as e:
            outcome[f"refused: {e}"] += 1
            sk.close()
            continue
        except (ConnectionError, EOFError) as e:
            outcome["closed without a word"] += 1
            log(f"flood: closed without a word ({e})")
            sk.close()
            continue
        except OSError as e:
            outcome[f"error: {e.__class__.__name__}: {e}"] += 1
            sk.close()
            continue
        outcome["served"] += 1
        keep.append(sk)
    return outcome


def close_flood(socks: list) -> None:
    for sk in socks:
        try:
            # NBD_CMD_DISC, then close: a polite client leaving.
            sk.sendall(b"\x25\x60\x95\x13" + bytes(2) + (2).to_bytes(2, "big") + bytes(20))
        except OSError:
            pass
        sk.close()
    socks.clear()


def wait_connections(sock: Path, at_most: int, timeout: float) -> int:
    """Wait until the daemon holds at most `at_most` connections; return how many it holds."""
    deadline = time.monotonic() + timeout
    n = unix_connections(sock)
    while n > at_most and time.monotonic() < deadline:
        time.sleep(0.1)
        n = unix_connections(sock)
    return n


def drain(sock: Path, before: str) -> int:
    """Wait (up to 30 s) for the connections of an earlier run to be gone; the server closes
    its ends after the clients left, and a run must not start while the last one winds down.
    Returns how many are left (0 unless the server is slow to let go, which is logged)."""
    left = wait_connections(sock, 0, timeout=30)
    if left:
        log(f"WARNING: {left} connection(s) still open on the server 30 s after their clients "
            f"left, before {before}")
    return left


def flood(args, uri: str, daemon: Service, sock: Path, out_dir: Path) -> dict:
    """fio (one job) runs while `args.flood` idle connections are opened; see the module doc."""
    # Long enough to outlast opening the flood and holding it a moment.
    runtime = max(args.runtime, 5)
    res: dict = {"connections": args.flood, "fio_seconds": runtime}
    out_json = out_dir / "flood.fio.json"
    cmd = fio_cmd(uri, 1, runtime, args.size, out_json)
    r = Run(jobs=1, json=out_json.name)
    socks: list = []
    pid = daemon.proc.pid
    base = drain(sock, "the flood")
    cpu0 = common.proc_cpu_seconds(pid)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, preexec_fn=_pdeathsig)
    try:
        with Watcher(pid, sock) as w:
            # The flood starts once fio holds its connection, so fio is not the one refused.
            # fio's nbd engine connects twice (a short probe for the size, then the job's
            # connection): wait until one has been up for a second.
            deadline = time.monotonic() + 20
            up_since = None
            while proc.poll() is None and time.monotonic() < deadline:
                if unix_connections(sock) <= base:
                    up_since = None
                elif up_since is None:
                    up_since = time.monotonic()
                elif time.monotonic() - up_since >= 1.0:
                    break
                time.sleep(0.05)
            t0 = time.monotonic()
            outcome = open_flood(sock, args.flood, socks)
            res["open_seconds"] = round(time.monotonic() - t0, 2)
            res["fio_running_when_open"] = proc.poll() is None
            res["connections_held"] = unix_connections(sock)
            try:
                out, err = proc.communicate(timeout=runtime + 120)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                err = f"fio timed out after {runtime + 120} s; {err}"
        cpu1 = common.proc_cpu_seconds(pid)
        cp = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        close_flood(socks)
    fio_outcome(cp, out_json, r)
    r.cpu_us_per_io = common.cpu_us_per_io(cpu0, cpu1, r.ios)
    r.daemon = w.as_dict()
    res["fio"] = r.__dict__
    res["outcome"] = dict(outcome)
    res["daemon_alive"] = daemon.alive()
    # Every slot must come back: no connection left once the clients are gone, and a new
    # client served.
    res["connections_left"] = wait_connections(sock, 0, timeout=15)
    after: list = []
    try:
        res["served_after"] = open_flood(sock, 1, after).get("served", 0) == 1
    finally:
        close_flood(after)
    return res


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def daemon_flags(udm_bin: Path, args) -> dict:
    """The connection-limit flags to pass, among those `udm daemon --help` lists."""
    cp = run([str(udm_bin), "daemon", "--help"], timeout=30, check=False, quiet=True)
    text = cp.stdout + cp.stderr
    flags = {}
    for flag, value in (("--nbd-max-connections", args.max_connections),
                        ("--nbd-max-connections-per-client", args.per_client_limit)):
        if value is None:
            continue
        if re.search(re.escape(flag) + r"(?![\w-])", text):
            flags[flag] = str(value)
        else:
            log(f"NOTE: this udm daemon has no {flag}; the daemon's default applies")
    return flags


def parse_args(argv):
    ap = common.bench_parser(
        "udm scale benchmark: many NBD connections against one daemon (total IOPS, threads, "
        "RSS, errors) and a connection flood.",
        runtime=10, size_help="device and backing file size (default 1G)", repeat=True,
        out="bench/results/scale", charts_help="(no charts here; accepted for symmetry)")
    ap.add_argument("--connections", type=int, default=64,
                    help="fio jobs, one NBD connection each, in the many-connection runs "
                         "(default 64)")
    ap.add_argument("--flood", type=int, default=400,
                    help="raw connections opened while fio runs (default 400; 0 skips)")
    ap.add_argument("--per-client-limit", type=int, default=1024,
                    help="daemon --nbd-max-connections-per-client (default 1024, so that the "
                         "many-connection runs and the flood, all from this uid, meet the "
                         "server-wide limit rather than the per-client one; 0 leaves the "
                         "daemon's default)")
    ap.add_argument("--max-connections", type=int, default=None,
                    help="daemon --nbd-max-connections, when the build has it (default: the "
                         "daemon's default)")
    ap.add_argument("--pool-threads", type=int, default=None,
                    help="the daemon's worker pool size, to judge the thread bar (threads ≤ "
                         "2 × cores + pool); without it the thread count is only reported")
    args = ap.parse_args(argv)
    common.resolve_sizing(args)
    if args.per_client_limit == 0:
        args.per_client_limit = None
    if args.runtime < 1 or args.repeat < 1 or args.connections < 1 or args.flood < 0:
        ap.error("--runtime, --repeat and --connections must be at least 1, --flood at least 0")
    return args


class Scale:
    """One run: the daemon serving one linear device, fio over 1 and over many connections
    (alternating), the flood, and the report.  `cleanup` removes the device and stops the
    daemon."""

    def __init__(self, args, udm_bin: Path, out_dir: Path, tmp: Path):
        self.args, self.udm_bin, self.out_dir, self.tmp = args, udm_bin, out_dir, tmp
        self.size = args.size
        self.disk = tmp / "disk.img"
        self.ctl, self.sock = tmp / "ctl.sock", tmp / "udm.sock"
        self.uri = f"nbd+unix:///{EXPORT}?socket={self.sock}"
        self.daemon: Service | None = None
        self.udm: Udm | None = None
        self.runs: dict = {}
        self.fl = None
        self.notes: list = []
        self.flags = daemon_flags(udm_bin, args)
        self.meta = {**common.base_meta(udm_bin), "runtime": args.runtime, "size": self.size,
                     "size_human": human_size(self.size), "repeat": args.repeat,
                     "connections": args.connections, "flood": args.flood,
                     "daemon_flags": [x for kv in self.flags.items() for x in kv],
                     "tmpdir": str(tmp), "notes": self.notes}

    def start(self) -> None:
        """The daemon and the device, checked; the daemon's idle threads and memory."""
        fill_backing_file(self.disk, self.size, timeout=max(600, self.size / (20 << 20)))
        (self.tmp / "state").mkdir()
        self.daemon = start_service(
            "udm daemon",
            [str(self.udm_bin), "daemon", "--state-dir", str(self.tmp / "state"),
             "--control", str(self.ctl), "--nbd", f"unix:{self.sock}",
             *self.meta["daemon_flags"]],
            self.tmp / "udm-daemon.log", env=dict(os.environ, RUST_BACKTRACE="1"))
        wait_for_socket(self.ctl, self.daemon, timeout=30)
        self.udm = Udm(self.udm_bin, self.ctl)
        self.udm.client("create", EXPORT, "--table", f"0 {self.size // 512} linear {self.disk} 0")
        wait_for_socket(self.sock, self.daemon, timeout=30)
        check_export(self.uri, self.size, "udm lin (linear)")
        st = proc_status(self.daemon.proc.pid)
        self.meta["daemon_idle"] = {"threads": st.get("threads"), "rss": st.get("VmRSS")}

    def connection_runs(self) -> None:
        """1 connection against many, alternating, `--repeat` times each."""
        args, daemon = self.args, self.daemon
        total = 2 * args.repeat
        log(f"{total} fio runs of {args.runtime} s, then the flood")
        n = 0
        for rep in range(1, args.repeat + 1):
            for jobs in ((1, args.connections) if rep % 2 else (args.connections, 1)):
                n += 1
                if not daemon.alive():
                    raise BenchError(f"udm daemon exited (code {daemon.proc.returncode}); log "
                                     f"tail:\n{daemon.log_tail()}")
                r = fio_run(self.uri, jobs, args, self.out_dir / f"conn{jobs}.r{rep}.json",
                            daemon, self.sock)
                self.runs.setdefault(jobs, []).append(r)
                cpu = "—" if r.cpu_us_per_io is None else f"{r.cpu_us_per_io:.1f}"
                log(f"[{n}/{total}] {jobs:>3} connection(s) r{rep}: "
                    + (f"{r.iops:>9.0f} IOPS, p99 {r.lat_p99_us:.0f} µs" if r.iops else "no IOPS")
                    + f", CPU {cpu} µs/IO, threads {r.daemon['threads_max']}, RSS "
                    f"{mib(r.daemon['rss_max'])}" + (f", ERROR {r.error[:300]}" if r.error else ""))

    def flood(self) -> None:
        """`--flood` raw connections while fio runs, and which limit refused them."""
        if not self.daemon.alive():
            raise BenchError(f"udm daemon exited (code {self.daemon.proc.returncode})")
        log(f"flood: {self.args.flood} connections while fio runs")
        self.fl = flood(self.args, self.uri, self.daemon, self.sock, self.out_dir)
        refused = {k.removeprefix("refused: ") for k in self.fl["outcome"]
                   if k.startswith("refused: ")}
        self.fl["limit_bit"] = limit_bit(refused, self.flags)
        log(f"flood: {self.fl['outcome']}; fio error: {self.fl['fio']['error']}")

    def measure_all(self) -> int:
        """Everything, then the report; 3 when a run failed."""
        self.start()
        self.connection_runs()
        if self.args.flood:
            self.flood()
        if not self.daemon.alive():
            self.notes.append(f"the udm daemon exited (code {self.daemon.proc.returncode}) "
                              f"during the run")
        table, summary = build_report(self.meta, self.runs, self.fl, self.args)
        write_results(self.out_dir, table,
                      {"meta": self.meta, "connections": summary, "flood": self.fl})
        log(f"results in {self.out_dir}")
        any_err = any(r.error for rs in self.runs.values() for r in rs) or \
            (self.fl is not None and self.fl["fio"]["error"] is not None)
        return 3 if any_err else 0

    def cleanup(self, rc: int) -> int:
        """The device removed once its connections are gone, the daemon stopped, its log
        kept, the temp dir removed unless --keep.  Returns `rc`."""
        if self.daemon is not None and self.daemon.alive() and self.udm is not None:
            drain(self.sock, "removing the device")
            self.udm.client("remove", EXPORT, timeout=30, check=False)
        if self.daemon is not None:
            stop_daemon(self.daemon, grace=15)
        copy_logs([self.daemon], self.out_dir)
        remove_tmp(self.tmp, self.args.keep)
        return rc


def main(argv=None) -> int:
    args = parse_args(argv)
    trap_signals()
    if not common.have_fio_with_nbd():
        return 2
    return common.run_bench(args, find_udm, "udm-scale-", "udm.sock",
                            lambda out_dir, udm_bin, tmp: Scale(args, udm_bin, out_dir, tmp))

if __name__ == "__main__":
    sys.exit(main())
