#!/usr/bin/env python3
"""Replication benchmark for udm (issue #14): `udm send | udm receive` between two daemons,
against reading the same data with fio, `nbdcopy`, `qemu-img convert`, and (where installed)
rsync of an image file. Runs alternate within a row; medians of --repeat.

Rows (every run is kept in results.json):

* incremental: a --size volume (default 4 GiB) written whole with random data, a full send,
  then 1 %, 10 % and 50 % of its 64 KiB blocks rewritten, each followed by a snapshot and an
  incremental send into the other daemon's pool (send | receive). Bar: time ∝ changed data,
  1 % ≤ 1.5 × (1 % of the full send) + 1 s.
* empty delta: a 100 GiB sparse volume with 1 GiB mapped (random 64 KiB blocks), two
  snapshots with nothing between them: `udm send --from` of the empty delta (bar < 1 s), and
  `udm thin delta`.
* full send: the full volume's snapshot sent to /dev/null (the sender alone) and into the
  other daemon, against fio reading the same mapped data from a read-only thin device over
  NBD (1 MiB sequential reads, depth 8; bar ≥ 0.9×); nbdcopy and qemu-img convert of the same
  device, and rsync of a raw image of it, as reported peers.

* capped link (root only): the full snapshot sent with `udm send --to` to a third daemon in a
  network namespace behind a veth link shaped with `tc … tbf rate 1gbit` (bar ≥ 0.9× the
  link's 125 MB/s); skipped, and said so, where namespaces cannot be made.

Usage:  python3 bench/replication.py [--size 4G] [--repeat 3] [--out bench/results/replication]
                                     [--udm PATH] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import foundation as fnd  # noqa: E402
from common import BenchError, run  # noqa: E402
from foundation import Udm, find_udm, start_service, wait_for_socket  # noqa: E402
from report import markdown_table, parse_size, write_results  # noqa: E402
from thin import BLOCK, GIB, MIB, Rig, median, ratio  # noqa: E402


def log(msg: str) -> None:
    print(f"[replication] {msg}", file=sys.stderr, flush=True)


common.log = fnd.log = log


class Pair:
    """A sending and a receiving daemon, each with a pool "pool" big enough for the runs."""

    def __init__(self, tmp: Path, udm_bin: Path, out: Path, data_bytes: int):
        self.udm_bin = udm_bin
        self.src, self.dst = (self._rig(tmp, out, side, data_bytes) for side in ("src", "dst"))

    def _rig(self, tmp: Path, out: Path, side: str, data_bytes: int) -> Rig:
        (tmp / side).mkdir()
        (out / side).mkdir(exist_ok=True)
        rig = Rig(tmp / side, self.udm_bin, out / side)
        data = rig.file("pool.data", data_bytes)
        rig.pool("pool", str(data), data_bytes // BLOCK, meta_size=256 * MIB)
        return rig

    def udm(self, rig: Rig, *args) -> str:
        return f"{self.udm_bin} --control {rig.udm.control} " + " ".join(map(str, args))

    def timed(self, shell: str) -> float:
        t = time.monotonic()
        cp = run(["bash", "-o", "pipefail", "-c", shell], timeout=3600, check=False,
                 quiet=True)
        took = time.monotonic() - t
        if cp.returncode != 0:
            raise BenchError(f"`{shell}` failed: {cp.stderr[-1500:]}")
        return took

    def send_receive(self, dev_id: int, frm: int | None) -> float:
        """Sends source device `dev_id` into the receiver as the same id; seconds."""
        base = f"--from {frm}" if frm is not None else ""
        return self.timed(f"{self.udm(self.src, 'send pool', dev_id, base)} | "
                          f"{self.udm(self.dst, 'receive pool', dev_id)} >/dev/null")

    def send_null(self, dev_id: int, frm: int | None = None) -> float:
        base = f"--from {frm}" if frm is not None else ""
        return self.timed(f"{self.udm(self.src, 'send pool', dev_id, base)} >/dev/null")

    def forget(self, dev_id: int):
        """Deletes a received device, so that it can be received again."""
        self.dst.v("message", "pool", "0", "delete", str(dev_id))


def incremental(pair: Pair, args) -> tuple[list, dict]:
    size = args.size
    src = pair.src
    src.thin("vol", "pool", 1, size)
    log(f"filling {size // MIB} MiB with random data")
    src.fio("vol", "write", "1M", 8, 0, size)
    src.snapshot("pool", "vol", 10, 1)
    full = pair.send_receive(10, None)
    log(f"full send of {size // MIB} MiB: {full:.1f} s")
    rows, prev = [], 10
    blocks = size // BLOCK
    for i, pct in enumerate((1, 10, 50)):
        changed = blocks * pct // 100
        # Each block at most once: fio's random map; 64 KiB writes, one per block.
        src.fio("vol", "randwrite", "64k", 16, 0, size, extra=[f"--io_size={changed * BLOCK}"])
        snap = 11 + i
        src.snapshot("pool", "vol", snap, 1)
        took = pair.send_receive(snap, prev)
        bar = 1.5 * pct / 100 * full + 1.0
        log(f"{pct} % changed ({changed} blocks): {took:.2f} s (bar {bar:.2f} s)")
        rows.append({"row": f"incremental, {pct} % changed", "seconds": took,
                     "bar_seconds": bar, "met": took <= bar,
                     "per_changed_gib": took / (changed * BLOCK / GIB)})
        prev = snap
    return rows, {"full_send_seconds": full, "volume_bytes": size}


def empty_delta(pair: Pair, args) -> list:
    src = pair.src
    big = 100 * GIB
    src.thin("sparse", "pool", 2, big)
    src.fio("sparse", "randwrite", "64k", 16, 0, big, extra=[f"--io_size={GIB}"])
    src.snapshot("pool", "sparse", 20, 2)
    src.snapshot("pool", "sparse", 21, 2)
    sends = [pair.send_null(21, 20) for _ in range(args.repeat)]
    t = time.monotonic()
    src.v("thin", "delta", "pool", "20", "21")
    delta = time.monotonic() - t
    took = median(sends)
    log(f"empty delta of 100 GiB with 1 GiB mapped: send {took:.3f} s, thin delta {delta:.3f} s")
    src.remove("sparse")
    return [{"row": "empty delta, 100 GiB volume, 1 GiB mapped", "seconds": took,
             "bar_seconds": 1.0, "met": took < 1.0, "thin_delta_seconds": delta,
             "runs": sends}]


def full_send(pair: Pair, args, full_bytes: int) -> list:
    src = pair.src
    table = f"0 {args.size // 512} thin pool 10"
    src.v("create", "snap10", "--readonly", "--table", table)
    uri = src.uri("snap10")
    image = src.tmp / "snap10.raw"
    runs = {"send": [], "send_receive": [], "fio": [], "nbdcopy": [], "qemu-img": []}
    for rep in range(args.repeat):
        steps = [
            ("send", lambda: full_bytes / pair.send_null(10)),
            ("fio", lambda: src.fio("snap10", "read", "1M", 8, 0, args.size)["iops"] * MIB),
        ]
        for key, step in steps if rep % 2 == 0 else steps[::-1]:
            runs[key].append(step())
        pair.forget(10)
        runs["send_receive"].append(full_bytes / pair.send_receive(10, None))
        runs["nbdcopy"].append(full_bytes / pair.timed(f"nbdcopy '{uri}' null:"))
        runs["qemu-img"].append(full_bytes / pair.timed(
            f"qemu-img convert -f raw -O raw '{uri}' {image}"))
    rsync = None
    if shutil.which("rsync"):
        copy = src.tmp / "rsync-copy.raw"
        rsync = full_bytes / pair.timed(f"rsync --inplace {image} {copy}")
        copy.unlink()
    image.unlink(missing_ok=True)
    src.remove("snap10")
    mb = {k: median(v) / 1e6 for k, v in runs.items()}
    log("full send MB/s: " + ", ".join(f"{k} {v:.0f}" for k, v in mb.items()))
    r = ratio(mb["send"], mb["fio"])
    return [{"row": "full send to /dev/null vs fio reading the snapshot", "mb_s": mb["send"],
             "peer_mb_s": mb["fio"], "ratio": r, "bar": 0.9, "met": r >= 0.9,
             "send_receive_mb_s": mb["send_receive"], "nbdcopy_mb_s": mb["nbdcopy"],
             "qemu_img_convert_mb_s": mb["qemu-img"],
             "rsync_mb_s": rsync / 1e6 if rsync else None, "runs": runs}]


LINK_RATE = 125_000_000  # 1 Gbit/s in bytes per second


def capped_link(pair: Pair, args, full_bytes: int) -> list:
    """The full snapshot over a 1 Gbit/s veth link to a daemon in a namespace of its own."""
    ns = f"udm-bench-repl-{os.getpid()}"
    tmp = pair.src.tmp.parent / "far"
    tmp.mkdir()
    if run(["ip", "netns", "add", ns], timeout=20, check=False, quiet=True).returncode != 0:
        log("capped link: cannot make a network namespace here (root?): skipped")
        return []
    far = None
    try:
        for cmd in (["ip", "link", "add", "urb0", "type", "veth", "peer", "name", "urb1",
                     "netns", ns],
                    ["ip", "addr", "add", "10.79.0.1/24", "dev", "urb0"],
                    ["ip", "link", "set", "urb0", "up"],
                    ["ip", "-n", ns, "addr", "add", "10.79.0.2/24", "dev", "urb1"],
                    ["ip", "-n", ns, "link", "set", "urb1", "up"],
                    ["ip", "-n", ns, "link", "set", "lo", "up"],
                    ["tc", "qdisc", "add", "dev", "urb0", "root", "tbf", "rate", "1gbit",
                     "burst", "256kb", "latency", "50ms"]):
            run(cmd, timeout=20)
        control = tmp / "control.sock"
        far = start_service("udm far", ["ip", "netns", "exec", ns, str(pair.udm_bin), "daemon",
                                        "--state-dir", str(tmp / "state"), "--control",
                                        str(control), "--replication", "tcp:10.79.0.2:10900"],
                            pair.src.out / "udm-far.log")
        wait_for_socket(control, far)
        udm = Udm(pair.udm_bin, control)
        data, meta = tmp / "pool.data", tmp / "pool.meta"
        for path, size in ((data, 2 * full_bytes), (meta, 256 * MIB)):
            with open(path, "wb") as f:
                f.truncate(size)
        udm.client("create", "pool", "--table", f"0 {2 * full_bytes // 512} thin-pool {meta} "
                   f"{data} 128 0")
        took = pair.timed(f"{pair.udm(pair.src, 'send pool 10 --to tcp:10.79.0.2:10900/pool')}"
                          " >/dev/null")
    finally:
        if far:
            far.stop()
        run(["ip", "link", "del", "urb0"], timeout=20, check=False, quiet=True)
        run(["ip", "netns", "del", ns], timeout=20, check=False, quiet=True)
    r = full_bytes / took / LINK_RATE
    log(f"capped link: {full_bytes / took / 1e6:.0f} MB/s over 1 Gbit/s ({r:.2f}×)")
    return [{"row": "full send over a 1 Gbit/s link (tc tbf)", "mb_s": full_bytes / took / 1e6,
             "peer_mb_s": LINK_RATE / 1e6, "ratio": r, "bar": 0.9, "met": r >= 0.9}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="4G")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="bench/results/replication")
    ap.add_argument("--udm")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    args.size = parse_size(args.size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    udm_bin = find_udm(args)
    tmp = Path(tempfile.mkdtemp(prefix="udm-repl-", dir=os.environ.get("TMPDIR", "/tmp")))
    load = os.getloadavg()[0]
    pair = Pair(tmp, udm_bin, out, 4 * args.size + 2 * GIB)
    try:
        rows, meta = incremental(pair, args)
        rows += empty_delta(pair, args)
        rows += capped_link(pair, args, args.size)
        rows += full_send(pair, args, args.size)
    finally:
        pair.src.stop()
        pair.dst.stop()
        if not args.keep:
            subprocess.run(["rm", "-rf", str(tmp)])
    table_rows = []
    for r in rows:
        if "seconds" in r:
            value, bar = f"{r['seconds']:.2f} s", f"≤ {r['bar_seconds']:.2f} s"
        else:
            value = f"{r['mb_s']:.0f} MB/s vs {r['peer_mb_s']:.0f} MB/s ({r['ratio']:.2f}×)"
            bar = f"≥ {r['bar']}×"
        table_rows.append([r["row"], value, bar, "✔" if r["met"] else "✘"])
    table = markdown_table(["row", "udm", "bar", ""], table_rows)
    full = next(r for r in rows if "send_receive_mb_s" in r)
    table += (f"\n\nFull send of {args.size // MIB} MiB: {meta['full_send_seconds']:.1f} s into "
              f"the other daemon; end to end (send | receive) {full['send_receive_mb_s']:.0f} "
              f"MB/s, nbdcopy to null: {full['nbdcopy_mb_s']:.0f} MB/s, qemu-img convert to a "
              f"file: {full['qemu_img_convert_mb_s']:.0f} MB/s, rsync of the image: "
              + (f"{full['rsync_mb_s']:.0f} MB/s" if full["rsync_mb_s"] else "not installed")
              + f". Load average at the start: {load:.1f}.")
    write_results(out, table, {"rows": rows, "meta": {**meta, "load_average": load}})
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        log(str(e))
        sys.exit(2)
