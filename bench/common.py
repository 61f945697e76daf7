"""Helpers shared by every udm benchmark script.

Processes (bounded runs, parent-death signal), the matplotlib re-exec, the argument and
output-directory plumbing every script's main() does the same way, the fio run of one cell,
and the tail of a table.  Messages go through the module-level `log`, which each script
points at its own (so they carry that script's prefix).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from report import (  # noqa: E402
    parse_size,
)

REPO = Path(__file__).resolve().parent.parent


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# matplotlib: optional, and possibly only in the system interpreter
# --------------------------------------------------------------------------------------------

def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except Exception:
        return False


def maybe_reexec_for_matplotlib(script: str) -> None:
    """Re-run `script` under /usr/bin/python3 when this interpreter (e.g. a pyenv one) lacks
    matplotlib."""
    if have_matplotlib() or os.environ.get("UDM_BENCH_NO_REEXEC"):
        return
    if "--no-charts" in sys.argv or "-h" in sys.argv or "--help" in sys.argv:
        return
    cand = "/usr/bin/python3"
    try:
        if not os.access(cand, os.X_OK) or \
                os.path.realpath(cand) == os.path.realpath(sys.executable):
            return
        probe = subprocess.run(
            [cand, "-c", "import sys, matplotlib; assert sys.version_info >= (3, 9)"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return
    if probe.returncode == 0:
        os.environ["UDM_BENCH_NO_REEXEC"] = "1"
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(cand, [cand, os.path.abspath(script)] + sys.argv[1:])


def import_pyplot(what: str):
    """matplotlib.pyplot with the Agg backend, or None (logged) when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover - depends on the machine
        log(f"NOTE: matplotlib is not available ({e}); {what} skipped. "
            f"Install it with `apt-get install python3-matplotlib`.")
        return None
    return plt


# --------------------------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------------------------

_libc = None


def _pdeathsig() -> None:
    """preexec_fn: the child gets SIGTERM if this script dies, even by SIGKILL."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def run(cmd, *, timeout: float, env=None, cwd=None, check=True, quiet=False):
    """Run a command to completion with a timeout; return CompletedProcess (text)."""
    try:
        cp = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            timeout=timeout, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            preexec_fn=_pdeathsig)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"timed out after {timeout:.0f}s: {' '.join(map(str, cmd))}") from e
    if check and cp.returncode != 0:
        raise BenchError(
            f"command failed (exit {cp.returncode}): {' '.join(map(str, cmd))}\n"
            f"  stdout: {cp.stdout.strip()[-2000:]}\n  stderr: {cp.stderr.strip()[-2000:]}")
    if not quiet and cp.returncode != 0:
        log(f"exit {cp.returncode}: {' '.join(map(str, cmd))}: {cp.stderr.strip()[-500:]}")
    return cp


def tool_version(cmd) -> str:
    try:
        cp = run(cmd, timeout=20, check=False, quiet=True)
        return (cp.stdout or cp.stderr).strip().splitlines()[0]
    except Exception:
        return "?"


def git_describe() -> str:
    try:
        cp = run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], timeout=20,
                 check=False, quiet=True)
        return cp.stdout.strip() or "?"
    except Exception:
        return "?"


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used (all its threads, living and ended;
    not its children), from /proc/PID/stat; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces: split after it.
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK   # utime, stime (fields 14, 15)


def proc_context_switches(pid: int) -> int | None:
    """Voluntary + involuntary context switches of process `pid`'s living threads, from
    /proc/PID/task/*/status; None when it is gone. A thread that ended takes its count with
    it, so compare processes whose busy threads live on (event loops, client readers)."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            status = (task / "status").read_text()
        except OSError:
            continue    # ended meanwhile
        for line in status.splitlines():
            if "ctxt_switches:" in line:
                total += int(line.split()[-1])
    return total


def block_device_stat(path: Path) -> Path | None:
    """The kernel's I/O counters (/sys/dev/block/MAJ:MIN/stat) of the block device, or the
    partition, that holds `path`; None when it has none (tmpfs, overlay)."""
    st = os.stat(path)
    stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    return stat if stat.exists() else None


def disk_counters(stat: Path | None) -> tuple[int, int] | None:
    """(requests completed, milliseconds they spent in flight, summed) from a block device's
    stat file: fields 1 + 5 (reads, writes) and 11 (time_in_queue, which the kernel sums
    from each request's own nanoseconds, so it holds for gaps far shorter than a tick)."""
    if stat is None:
        return None
    fields = stat.read_text().split()
    return int(fields[0]) + int(fields[4]), int(fields[10])


def disk_use(before: tuple[int, int] | None, after: tuple[int, int] | None,
             seconds: float) -> tuple[float, float] | None:
    """The disk over a run: (mean requests in flight, mean µs each spent there). A server
    whose disk waits for work shows a shallower queue at the same time per request."""
    if before is None or after is None or seconds <= 0:
        return None
    ios, queue_ms = after[0] - before[0], after[1] - before[1]
    return queue_ms / 1e3 / seconds, (queue_ms * 1e3 / ios if ios else 0.0)


def disk_watch(stat: Path | None):
    """Starts counting the disk's work (see `disk_use`); call what it returns at the end."""
    before, start = disk_counters(stat), time.monotonic()
    return lambda: disk_use(before, disk_counters(stat), time.monotonic() - start)


def per_io(before: float | None, after: float | None, ios: int) -> float | None:
    """How much of a counter (system calls, context switches) each I/O took between two
    samples."""
    if before is None or after is None or not ios:
        return None
    return (after - before) / ios


def cpu_us_per_io(before: float | None, after: float | None, ios: int) -> float | None:
    """Microseconds of CPU per I/O between two proc_cpu_seconds samples."""
    seconds = per_io(before, after, ios)
    return None if seconds is None else seconds * 1e6


def trap_signals() -> None:
    """SIGTERM/SIGHUP become KeyboardInterrupt so that the cleanup in `finally` runs."""
    def _on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)


def stop_daemon(daemon, grace: float, report_exit: bool = True) -> None:
    """Stop the udm daemon (saying so first when it had already died)."""
    if not daemon.alive():
        log(f"udm daemon had exited with code {daemon.proc.returncode}; log tail:\n"
            f"{daemon.log_tail()}")
    daemon.stop(grace=grace)
    if report_exit and daemon.proc.returncode not in (0, -signal.SIGTERM, None):
        log(f"udm daemon exit code after SIGTERM: {daemon.proc.returncode}")


def copy_logs(services, out_dir: Path) -> None:
    for svc in services:
        if svc is None:
            continue
        try:
            if svc.logfile.exists():
                shutil.copy(svc.logfile, out_dir / svc.logfile.name)
        except OSError:
            pass


def remove_tmp(tmp: Path, keep: bool) -> None:
    if keep:
        log(f"kept temp dir {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# main() plumbing: workloads, output and temp directories, metadata
# --------------------------------------------------------------------------------------------

def select_workloads(ap, text, workloads: list) -> list:
    """The --workloads subset (comma-separated keys) of `workloads`; ap.error on unknown ones."""
    if not text:
        return workloads
    wanted = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [w for w in wanted if w not in {x.key for x in workloads}]
    if unknown:
        ap.error(f"unknown workloads {unknown}")
    return [w for w in workloads if w.key in wanted]


def prepare_out_dir(out: str) -> Path:
    """Create the output directory and leave nothing from an earlier run that this run could
    be mistaken for."""
    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for pattern in ("*.json", "*.err", "*.png", "*.log", "table.md"):
        for old in out_dir.glob(pattern):
            old.unlink()
    return out_dir


def locate_udm(args, find_udm):
    """find_udm(args), logged; None (after an ERROR line) when there is no binary."""
    try:
        udm_bin = find_udm(args)
    except BenchError as e:
        log(f"ERROR: {e}")
        return None
    log(f"udm binary: {udm_bin}")
    return udm_bin


def tmp_base(args) -> str:
    return args.tmpdir or os.environ.get("TMPDIR") or "/tmp"


def make_tmpdir(base: str, prefix: str, longest_socket: str, resolve: bool = False):
    """A fresh temp dir under `base`; None (after an ERROR line) when a unix socket path in it
    would be too long (they are limited to 107 bytes)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    if resolve:
        tmp = tmp.resolve()
    if len(str(tmp / longest_socket)) > 100:
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"ERROR: temp dir path {tmp} too long for unix sockets; use --tmpdir /tmp")
        return None
    return tmp


def base_meta(udm_bin) -> dict:
    """The first entries of every results.json `meta`: when, where, which udm and fio."""
    return {
        "timestamp": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
        "udm_commit": git_describe(), "udm_binary": str(udm_bin),
        "fio_version": tool_version(["fio", "--version"]),
    }


# --------------------------------------------------------------------------------------------
# fio and results
# --------------------------------------------------------------------------------------------

def fio_cell(cmd, runner, parse, wl, cell, out_dir: Path, stem: str, tag: str):
    """Run one fio command (`runner(cmd)` -> CompletedProcess) and parse its JSON with
    `parse(path, wl)`; on failure record the error in `cell.errors`, write `stem.err` and
    return None.  `tag` prefixes the FAILED line."""
    out_json = out_dir / f"{stem}.json"
    try:
        cp = runner(cmd)
        if cp.returncode != 0:
            raise BenchError(f"fio exit {cp.returncode}: "
                             f"{(cp.stderr or cp.stdout).strip()[-1500:]}")
        return parse(out_json, wl)
    except (BenchError, json.JSONDecodeError, KeyError, OSError) as e:
        err = f"{e}"
        cell.errors.append(err)
        (out_dir / f"{stem}.err").write_text(" ".join(cmd) + "\n\n" + err + "\n")
        log(f"{tag}: FAILED: {err[:400]}")
        return None


def bench_parser(description: str, *, runtime: int, size_help: str, repeat: bool,
                 out: str, quick: dict | None = None, **run_helps) -> argparse.ArgumentParser:
    """The parser every script starts from: its description, the sizing options
    (add_sizing_args) and the run options (add_run_args, `run_helps` as it takes them)."""
    ap = argparse.ArgumentParser(description=description)
    add_sizing_args(ap, runtime=runtime, size_help=size_help, repeat=repeat, quick=quick)
    add_run_args(ap, out=out, **run_helps)
    return ap


def add_sizing_args(ap, *, runtime: int, size_help: str, repeat: bool,
                    quick: dict | None = None) -> None:
    """--runtime, --size (default 1G), with `repeat` --repeat (default 3), and --quick: the
    values in `quick` (keys runtime, size, repeat) for the options not given, to prove a run
    works end to end in a few minutes.  Call resolve_sizing(args) after parse_args."""
    quick = dict({"runtime": 3, "size": "256M", "repeat": 1}, **(quick or {}))
    ap.add_argument("--runtime", type=int, default=None,
                    help=f"seconds per fio run (default {runtime}; {quick['runtime']} with "
                         f"--quick)")
    ap.add_argument("--size", type=parse_size, default=None,
                    help=f"{size_help}; {quick['size']} with --quick")
    normal = {"runtime": runtime, "size": parse_size("1G")}
    if repeat:
        ap.add_argument("--repeat", type=int, default=None,
                        help=f"alternating runs per system and workload; the median is kept "
                             f"(default 3; {quick['repeat']} with --quick)")
        normal["repeat"] = 3
    ap.add_argument("--quick", action="store_true",
                    help="short runs on a small image, to check the script works (not for "
                         "figures): " + ", ".join(f"--{k} {v}" for k, v in quick.items()
                                                 if k in normal) + " unless given")
    quick["size"] = parse_size(str(quick["size"]))
    ap.set_defaults(_sizing={"normal": normal, "quick": quick})


def resolve_sizing(args) -> None:
    """Fill --runtime, --size and --repeat left out from the normal or the --quick defaults."""
    chosen = args._sizing["quick" if args.quick else "normal"]
    for key in args._sizing["normal"]:
        if getattr(args, key) is None:
            setattr(args, key, chosen[key])


def add_run_args(ap, *, out: str, out_help: str | None = None, tmpdir_help: str | None = None,
                 keep_help: str = "keep the temp dir (disk image, logs)",
                 udm_help: str = "path of the udm binary (default target/release/udm, built "
                                 "if missing)",
                 charts_help: str = "skip the PNG charts") -> None:
    """--out, --tmpdir, --keep, --udm, --no-build and --no-charts; the help texts say what
    most scripts mean unless a script says otherwise."""
    ap.add_argument("--out", default=out, help=out_help or f"output directory (default {out}, "
                                                          f"relative to the current directory)")
    ap.add_argument("--tmpdir", default=None,
                    help=tmpdir_help or "where to create the temp dir (must support O_DIRECT; "
                                        "default $TMPDIR or /tmp)")
    ap.add_argument("--keep", action="store_true", help=keep_help)
    ap.add_argument("--udm", default=None, help=udm_help)
    ap.add_argument("--no-build", action="store_true", help="never run cargo build")
    ap.add_argument("--no-charts", action="store_true", help=charts_help)


def add_variant_arg(ap, what: str) -> None:
    """--variant: another udm daemon measured beside this run's, for an A/B in one run."""
    ap.add_argument("--variant", action="append", default=[], metavar="'LABEL UDM [ARG...]'",
                    help=f"another udm daemon (UDM: a binary, `-` for this run's) with these "
                         f"daemon options and {what}, measured in the same run, alternating, "
                         f"as column LABEL with udm / LABEL beside it: an A/B of two binaries "
                         f"or two settings; repeatable")


def resolve_variants(ap, args) -> None:
    """args.variants: (label, binary or None for this run's, [daemon args]) per --variant."""
    args.variants = []
    for text in args.variant:
        words = shlex.split(text)
        if len(words) < 2 or not words[0].replace("-", "").replace("_", "").isalnum():
            ap.error(f"--variant {text!r}: expected 'LABEL UDM [DAEMON-ARG...]' with a LABEL "
                     f"of letters, digits, - and _")
        binary = None if words[1] == "-" else Path(words[1]).resolve()
        if binary is not None and not os.access(binary, os.X_OK):
            ap.error(f"--variant {text!r}: {binary} is not an executable")
        args.variants.append((words[0], binary, words[2:]))


def have_fio_with_nbd() -> bool:
    """Whether fio is installed with its nbd engine; logs an ERROR line saying what is missing
    when not."""
    if not shutil.which("fio"):
        log("ERROR: `fio` not found; install the Debian package `fio`")
        return False
    if run(["fio", "--enghelp=nbd"], timeout=20, check=False, quiet=True).returncode != 0:
        log("ERROR: this fio has no nbd engine (Debian's fio package has it; it needs libnbd0)")
        return False
    return True


def run_dirs(args, find_udm, prefix: str, longest_socket: str, resolve: bool = False):
    """The output directory (emptied), the udm binary and a fresh temp dir for a run, or None
    (after an ERROR line) when there is no binary or the temp dir's sockets would not fit."""
    out_dir = prepare_out_dir(args.out)
    udm_bin = locate_udm(args, find_udm)
    if udm_bin is None:
        return None
    tmp = make_tmpdir(tmp_base(args), prefix, longest_socket, resolve=resolve)
    if tmp is None:
        return None
    return out_dir, udm_bin, tmp


def guarded(body, cleanup) -> int:
    """Runs a benchmark: `body()` returns the exit status; Ctrl-C makes it 130 and a
    BenchError 1 (logged).  `cleanup(rc)` always runs after and returns the final status."""
    rc = 1
    try:
        rc = body()
    except KeyboardInterrupt as e:
        log(f"interrupted ({e or 'Ctrl-C'}); cleaning up")
        rc = 130
    except BenchError as e:
        log(f"ERROR: {e}")
        rc = 1
    finally:
        rc = cleanup(rc)
    return rc


def run_bench(args, find_udm, prefix: str, longest_socket: str, make_run) -> int:
    """The rest of a main once the tools are there: the run's directories (run_dirs), then
    `make_run(out_dir, udm_bin, tmp)`'s `measure_all`, guarded, and its `cleanup`."""
    dirs = run_dirs(args, find_udm, prefix, longest_socket)
    if dirs is None:
        return 2
    run = make_run(*dirs)
    return guarded(run.measure_all, run.cleanup)


def bar_axes(ax, xs, labels: list, ylabel: str, fontsize: int = 9) -> None:
    """A bar chart's x labels, y label and grid, as every chart here has them."""
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=fontsize)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
