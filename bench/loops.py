"""Loop devices and FUSE mounts for the FUSE benchmark: commands bounded in time (a process
stuck on a dead mount must not hang the script), loop devices attached, checked and
detached, mounts found and unmounted, and the cleanup that leaves none behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import BenchError, _pdeathsig, run, stop_daemon  # noqa: E402
from fuse_report import LABELS  # noqa: E402
from harness import Service, Udm  # noqa: E402


def log(msg: str) -> None:
    """Through common's `log`, which fuse.py points at its own (its prefix)."""
    common.log(msg)

@dataclass
class UdmFuse:
    """A udm daemon serving `vol` (linear over disk.img) as a file in its FUSE mount."""
    key: str                      # the system it serves: "udm-fuse" or "udm-fuse-dev"
    daemon: Service
    udm: Udm
    fuse_dir: Path
    created: list



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
