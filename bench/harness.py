"""What the udm benchmarks run on: processes started and stopped (`Service`), udm's verbs
(`Udm`, `find_udm`), fio workloads, commands and results (`Workload`, `System`, `Sample`,
`Cell`), backing files, and raw NBD probes of an export. Shared by every bench script; it
imports none of them.
"""

from __future__ import annotations

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
from common import REPO, BenchError, _pdeathsig, run  # noqa: E402
from report import human_size  # noqa: E402

PACKAGES = {
    "fio": "fio",
    "nbdkit": "nbdkit",
    "qemu-nbd": "qemu-utils",
    "nbdinfo": "libnbd-bin",
    "cargo": "cargo (or rustup)",
}



def log(msg: str) -> None:
    """Through common's `log`, which each script points at its own (its prefix)."""
    common.log(msg)


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
    qd: int        # per job
    # fio jobs, each with its own connection (or ring, on the file) at depth `qd`: more than
    # one shows whether a single-threaded client (fio's nbd engine is libnbd on one thread)
    # is what bounds a row.
    jobs: int = 1

    @property
    def direction(self) -> str:
        return "read" if "read" in self.rw else "write"

    @property
    def metric(self) -> str:
        return "iops" if self.bs == "4k" else "mbps"



# The six workloads of the seeds: latency (4 KiB, depth 1), IOPS (4 KiB, depth 32) and
# bandwidth (256 KiB sequential, depth 32); each script orders or narrows them.
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
    disk_depth: float | None = None     # mean requests in flight at the disk over the run
    disk_us: float | None = None        # mean µs a request spent at the disk


@dataclass
class Cell:
    samples: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    def median(self, attr: str):
        vals = [getattr(s, attr) for s in self.samples if getattr(s, attr) is not None]
        vals = [v for v in vals if not (isinstance(v, float) and math.isnan(v))]
        return statistics.median(vals) if vals else None

    def summary(self) -> dict:
        """The cell as results.json holds it: the medians, every sample and the errors."""
        attrs = ("value", "iops", "mbps", "lat_mean_us", "lat_p99_us", "cpu_us_per_io",
                 "disk_depth", "disk_us")
        return {
            **{f"median_{a}": self.median(a) for a in attrs},
            "samples": [{"value": x.value, "iops": x.iops, "mbps": x.mbps,
                         "lat_mean_us": x.lat_mean_us, "lat_p99_us": x.lat_p99_us,
                         "ios": x.ios, "cpu_us_per_io": x.cpu_us_per_io,
                         "fio_cpu_s": x.fio_cpu_s, "json": x.json_path.name}
                        for x in self.samples],
            "errors": self.errors,
        }


class Results:
    """A run's cells by (workload key, system key): their medians and the ratios between
    systems, as every table reads them."""

    def __init__(self, cells: dict):
        self.cells = cells

    def cell(self, wl: Workload, key: str) -> Cell | None:
        return self.cells.get((wl.key, key))

    def med(self, wl: Workload, key: str, attr: str = "value"):
        c = self.cell(wl, key)
        return c.median(attr) if c else None

    def ratio(self, wl: Workload, a: str, b: str, attr: str = "value"):
        """System `a`'s median over `b`'s; None when either is missing (or `b`'s is 0)."""
        va, vb = self.med(wl, a, attr), self.med(wl, b, attr)
        if va is None or vb is None or vb == 0:
            return None
        return va / vb


def fio_cmd(wl: Workload, system: System, args, out_json: Path) -> list:
    return [
        "fio", f"--name={wl.key}", *system.engine_args,
        f"--rw={wl.rw}", f"--bs={wl.bs}", f"--iodepth={wl.qd}", f"--numjobs={wl.jobs}",
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


