#!/usr/bin/env python3
"""Thin provisioning benchmark for udm (issue #11): udm's thin-pool/thin against udm linear and
qcow2 served by qemu-nbd, side by side in one run, alternating, medians of --repeat.

Rows (each a ratio with its bar; every run is kept in results.json):

* provisioned: 4 KiB random write and read at depth 32 on a thin volume whose blocks are all
  allocated and unshared, against udm linear on a preallocated file (bar ≥ 0.9×);
* break sharing: the first 4 KiB write into each 64 KiB block after a snapshot (one write per
  block: fio --rw=write:60k, 4 KiB written then 60 KiB skipped), depth 1, against qemu-nbd serving a qcow2 overlay with 64 KiB
  clusters on a raw base (bar ≥ 1.5×); mean and p99 latency;
* many snapshots (seed 003): 4 KiB random writes at depth 32 into a volume with 100 snapshots
  taken (each after a round of writes) against one with 1, both on blocks already broken
  (bar ≥ 0.95×);
* snapshot chain: 4 KiB random reads at depth 32 from the 10th snapshot of a chain of
  snapshots-of-snapshots against a volume with none (bar ≥ 0.95×); qemu-nbd reading through
  a qcow2 backing chain of 10 is the comparison row;
* writers (seed 002): the data device behind a udm `delay` of 1 ms, 4 KiB writes at depth 1
  (one per 64 KiB block, each job in its own part of the volume) from 1, 2, 4 and 8 jobs, to fresh blocks and to shared blocks (bar: 8 jobs ≥ 6× one);
* metadata per TiB at 64 KiB and 512 KiB blocks (udm's pool after mapping blocks, scaled),
  beside `thin_metadata_size`'s figure;
* snapshot creation time with 1 GiB and 100 GiB mapped (pools made with thin_restore).

Usage:  python3 bench/thin.py [--runtime 5] [--size 512M] [--repeat 3] [--quick]
                              [--out bench/results/thin] [--udm PATH] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import BenchError, run  # noqa: E402
from harness import Udm, find_udm, start_service, wait_for_socket  # noqa: E402
from report import markdown_table, parse_size  # noqa: E402

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
BLOCK = 64 * KIB


def log(msg: str) -> None:
    print(f"[thin] {msg}", file=sys.stderr, flush=True)


common.log = log


def fio(uri: str, out: Path, rw: str, bs: str, depth: int, runtime: float, size: int,
        jobs: int = 1, extra=()) -> dict:
    """One fio run over NBD; returns iops and clat mean/p99 in µs (all jobs together)."""
    cmd = ["fio", "--name=t", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={depth}", f"--size={size}", f"--numjobs={jobs}", "--group_reporting",
           "--output-format=json", f"--output={out}", *extra]
    if runtime:
        cmd += [f"--runtime={runtime}", "--time_based"]
    cp = run(cmd, timeout=max(120, runtime * 4), check=False, quiet=True)
    if cp.returncode != 0:
        raise BenchError(f"fio failed: {' '.join(cmd)}\n{cp.stderr[-1500:]}")
    text = out.read_text()
    # fio may print warnings into its output file before the JSON.
    job = json.loads(text[text.index("{"):])["jobs"][0]
    side = job["write"] if job["write"]["total_ios"] else job["read"]
    clat = side["clat_ns"]
    return {"iops": side["iops"], "ios": side["total_ios"],
            "mean_us": clat["mean"] / 1000,
            "p99_us": clat.get("percentile", {}).get("99.000000", 0) / 1000}


class Rig:
    """One udm daemon in a scratch directory, and what the rows build on it."""

    def __init__(self, tmp: Path, udm_bin: Path, out: Path):
        self.tmp, self.out = tmp, out
        self.sock = tmp / "nbd.sock"
        control = tmp / "control.sock"
        self.daemon = start_service(
            "udm", [str(udm_bin), "daemon", "--state-dir", str(tmp / "state"),
                    "--control", str(control), "--nbd", f"unix:{self.sock}"],
            out / "udm.log")
        wait_for_socket(control, self.daemon)
        self.udm = Udm(udm_bin, control)
        self.runs = 0

    def uri(self, name: str) -> str:
        return f"nbd+unix:///{name}?socket={self.sock}"

    def v(self, *args, timeout: float = 120):
        return self.udm.client(*args, timeout=timeout).stdout.strip()

    def fio(self, target: str, *args, **kw) -> dict:
        self.runs += 1
        uri = target if "://" in target else self.uri(target)
        return fio(uri, self.out / f"fio-{self.runs}.json", *args, **kw)

    def file(self, name: str, size: int, prealloc: bool = False) -> Path:
        path = self.tmp / name
        path.unlink(missing_ok=True)
        if prealloc:
            run(["fallocate", "-l", str(size), str(path)], timeout=120)
        else:
            with open(path, "wb") as f:
                f.truncate(size)
        return path

    def pool(self, name: str, data: str, blocks: int, block_sectors: int = 128,
             meta_size: int = 64 * MIB, features: str = "0") -> Path:
        meta = self.file(f"{name}.meta", meta_size)
        self.v("create", name, "--table",
               f"0 {blocks * block_sectors} thin-pool {meta} {data} {block_sectors} 0 "
               f"{features}")
        return meta

    def thin(self, name: str, pool: str, dev_id: int, size: int, create: bool = True):
        if create:
            self.v("message", pool, "0", "create_thin", str(dev_id))
        self.v("create", name, "--table", f"0 {size // 512} thin {pool} {dev_id}")

    def snapshot(self, pool: str, volume: str | None, dev_id: int, origin: int) -> float:
        """Takes snapshot `dev_id` of `origin` (suspending `volume` meanwhile); the seconds
        the create_snap message took."""
        if volume:
            self.v("suspend", volume)
        t = time.monotonic()
        self.v("message", pool, "0", "create_snap", str(dev_id), str(origin))
        took = time.monotonic() - t
        if volume:
            self.v("resume", volume)
        return took

    def remove(self, *names):
        for name in names:
            self.v("remove", name)

    def fill(self, name: str, size: int):
        self.fio(name, "write", "1M", 8, 0, size)

    def stop(self):
        self.daemon.stop()


def qemu_nbd(rig: Rig, tag: str, image: Path) -> tuple:
    sock = rig.tmp / f"qemu-{tag}.sock"
    svc = start_service(f"qemu-nbd {tag}",
                        ["qemu-nbd", "-t", "-e", "8", "-k", str(sock), "-f", "qcow2",
                         "--cache=none", "--aio=io_uring", str(image)],
                        rig.out / f"qemu-nbd-{tag}.log")
    wait_for_socket(sock, svc)
    return svc, f"nbd+unix:///?socket={sock}"


def qcow2(path: Path, backing: Path, backing_fmt: str, cluster: int = BLOCK):
    path.unlink(missing_ok=True)
    run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", f"cluster_size={cluster}",
         "-b", str(backing), "-F", backing_fmt, str(path)], timeout=60)


def median(values):
    return statistics.median(values) if values else None


def ratio(a, b):
    return a / b if a and b else None


# --------------------------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------------------------

def provisioned(rig: Rig, args) -> list:
    size = args.size
    lin = rig.file("linear.img", size, prealloc=True)
    rig.v("create", "lin", "--table", f"0 {size // 512} linear {lin} 0")
    data = rig.file("prov.data", size, prealloc=True)
    rig.pool("ppool", str(data), size // BLOCK)
    rig.thin("pvol", "ppool", 1, size)
    rig.fill("lin", size)
    rig.fill("pvol", size)
    rows = []
    for rw in ("randwrite", "randread"):
        runs = {"thin": [], "linear": []}
        for rep in range(args.repeat):
            order = [("thin", "pvol"), ("linear", "lin")]
            for key, dev in order if rep % 2 == 0 else order[::-1]:
                runs[key].append(rig.fio(dev, rw, "4k", 32, args.runtime, size)["iops"])
        t, l = median(runs["thin"]), median(runs["linear"])
        rows.append({"row": f"provisioned {rw} 4k qd32", "thin": t, "peer": l,
                     "peer_name": "udm linear", "ratio": ratio(t, l), "bar": 0.9,
                     "runs": runs})
    rig.remove("pvol", "ppool", "lin")
    return rows


def break_sharing(rig: Rig, args) -> list:
    size = args.size
    ios = min(size // BLOCK, 2048)
    extra = [f"--number_ios={ios}"]
    strided = f"write:{BLOCK - 4096}"
    base = rig.file("base.raw", size, prealloc=True)
    rig.v("create", "base", "--table", f"0 {size // 512} linear {base} 0")
    rig.fill("base", size)
    rig.remove("base")
    # The volume, and a block for every first write of every repeat.
    blocks = size // BLOCK + args.repeat * ios + 1024
    data = rig.file("bs.data", blocks * BLOCK, prealloc=True)
    rig.pool("bpool", str(data), blocks)
    rig.thin("bvol", "bpool", 1, size)
    rig.fill("bvol", size)
    runs = {"thin": [], "qcow2": []}
    for rep in range(args.repeat):
        for key in (("thin", "qcow2") if rep % 2 == 0 else ("qcow2", "thin")):
            if key == "thin":
                snap_id = 100 + rep
                rig.snapshot("bpool", "bvol", snap_id, 1)
                runs["thin"].append(rig.fio("bvol", strided, "4k", 1, 0, size, extra=extra))
                # Undo: the volume's broken blocks stay; the next repeat snapshots again,
                # so its first writes break sharing anew.
            else:
                overlay = rig.tmp / "overlay.qcow2"
                qcow2(overlay, base, "raw")
                svc, uri = qemu_nbd(rig, f"bs{rep}", overlay)
                try:
                    runs["qcow2"].append(rig.fio(uri, strided, "4k", 1, 0, size, extra=extra))
                finally:
                    svc.stop()
    t = median([r["iops"] for r in runs["thin"]])
    q = median([r["iops"] for r in runs["qcow2"]])
    lat = {k: (median([r["mean_us"] for r in v]), median([r["p99_us"] for r in v]))
           for k, v in runs.items()}
    rig.remove("bvol", "bpool")
    return [{"row": "first write after a snapshot, 4k qd1, 64k blocks", "thin": t, "peer": q,
             "peer_name": "qcow2 overlay (64k clusters)", "ratio": ratio(t, q), "bar": 1.5,
             "latency_us": lat, "runs": runs}]


def many_snapshots(rig: Rig, args) -> list:
    size = args.size
    results = {}
    round_ios = 256
    for count in (1, args.snapshots):
        # The volume twice over, and a block for every write of every round.
        blocks = 2 * size // BLOCK + count * round_ios + 1024
        data = rig.file(f"ms{count}.data", blocks * BLOCK, prealloc=True)
        rig.pool(f"mpool{count}", str(data), blocks)
        vol = f"mvol{count}"
        rig.thin(vol, f"mpool{count}", 1, size)
        rig.fill(vol, size)
        for n in range(count):
            rig.fio(vol, "randwrite", "4k", 32, 0, size, extra=[f"--number_ios={round_ios}"])
            rig.snapshot(f"mpool{count}", vol, 2 + n, 1)
        # Break every block once (whole-block writes copy nothing), then measure.
        rig.fill(vol, size)
        results[count] = vol
    runs = {1: [], args.snapshots: []}
    for rep in range(args.repeat):
        for count in ((1, args.snapshots) if rep % 2 == 0 else (args.snapshots, 1)):
            runs[count].append(rig.fio(results[count], "randwrite", "4k", 32, args.runtime,
                                       size)["iops"])
    for count, vol in results.items():
        rig.remove(vol, f"mpool{count}")
    many, one = median(runs[args.snapshots]), median(runs[1])
    return [{"row": f"randwrite 4k qd32, {args.snapshots} snapshots vs 1 (broken blocks)",
             "thin": many, "peer": one, "peer_name": "thin with 1 snapshot",
             "ratio": ratio(many, one), "bar": 0.95, "runs": runs}]


def snapshot_chain(rig: Rig, args) -> list:
    size = args.size
    data = rig.file("chain.data", 2 * size, prealloc=True)
    rig.pool("cpool", str(data), 2 * size // BLOCK)
    rig.thin("plain", "cpool", 1, size)
    rig.fill("plain", size)
    rig.thin("corigin", "cpool", 2, size)
    rig.fill("corigin", size)
    rig.remove("corigin")
    for n in range(10):
        rig.snapshot("cpool", None, 3 + n, 2 + n)
    rig.thin("top", "cpool", 12, size, create=False)
    # qcow2: a raw base and 10 overlays, each backed by the one below.
    base = rig.file("chain-base.raw", size, prealloc=True)
    rig.v("create", "cbase", "--table", f"0 {size // 512} linear {base} 0")
    rig.fill("cbase", size)
    rig.remove("cbase")
    below, fmt = base, "raw"
    for n in range(10):
        overlay = rig.tmp / f"chain-{n}.qcow2"
        qcow2(overlay, below, fmt)
        below, fmt = overlay, "qcow2"
    svc, uri = qemu_nbd(rig, "chain", below)
    runs = {"chain": [], "plain": [], "qcow2": []}
    try:
        for rep in range(args.repeat):
            order = [("chain", "top"), ("plain", "plain"), ("qcow2", uri)]
            for key, dev in order if rep % 2 == 0 else order[::-1]:
                runs[key].append(rig.fio(dev, "randread", "4k", 32, args.runtime,
                                         size)["iops"])
    finally:
        svc.stop()
    rig.remove("top", "plain", "cpool")
    c, p, q = (median(runs[k]) for k in ("chain", "plain", "qcow2"))
    return [{"row": "randread 4k qd32 from the 10th snapshot of a chain", "thin": c,
             "peer": p, "peer_name": "thin without snapshots", "ratio": ratio(c, p),
             "bar": 0.95, "runs": runs,
             "qcow2_chain_of_10": q, "thin_vs_qcow2_chain": ratio(c, q)}]


def writers(rig: Rig, args) -> list:
    """Each job writes its own part of the volume, one 4 KiB write per 64 KiB block, so every
    write needs a new block (fresh) or a copy of a shared one: what scales is provisioning
    and breaking sharing, not rewriting blocks already there."""
    size = args.size
    writes = min(size // BLOCK, args.writer_ios)
    blocks = 2 * size // BLOCK + writes + 1024
    data = rig.file("w.data", blocks * BLOCK, prealloc=True)
    rig.v("create", "slowdata", "--table", f"0 {blocks * 128} delay {data} 0 1")
    rig.pool("wpool", "slowdata", blocks)
    rows = []
    dev_id = 1
    for shared in (False, True):
        iops = {}
        for jobs in (1, 2, 4, 8):
            rig.thin("wvol", "wpool", dev_id, size)
            if shared:
                rig.fill("wvol", size)
                rig.snapshot("wpool", "wvol", dev_id + 1, dev_id)
            iops[jobs] = rig.fio("wvol", f"write:{BLOCK - 4096}", "4k", 1, 0, size // jobs,
                                 jobs=jobs,
                                 extra=[f"--offset_increment={size // jobs}",
                                        f"--number_ios={writes // jobs}"])["iops"]
            rig.remove("wvol")
            for gone in (dev_id, dev_id + 1) if shared else (dev_id,):
                rig.v("message", "wpool", "0", "delete", str(gone))
            dev_id += 2
        rows.append({"row": f"writers, delay 1 ms, 4k qd1, {'shared' if shared else 'fresh'} "
                            "blocks: 8 jobs vs 1", "thin": iops[8], "peer": iops[1],
                     "peer_name": "1 job", "ratio": ratio(iops[8], iops[1]), "bar": 6.0,
                     "by_jobs": iops})
    rig.remove("wpool", "slowdata")
    return rows


def metadata_per_tib(rig: Rig, args) -> list:
    rows = []
    for block_sectors in (128, 1024):
        block = block_sectors * 512
        mapped = args.metadata_blocks
        data = rig.file(f"md{block_sectors}.data", mapped * block)
        name = f"mdpool{block_sectors}"
        rig.pool(name, str(data), mapped, block_sectors, meta_size=256 * MIB,
                 features="1 skip_block_zeroing")
        before = pool_usage(rig, name)["metadata_blocks"]["used"]
        rig.thin("mdvol", name, 1, mapped * block)
        # One 4 KiB write per block maps every block.
        rig.fio("mdvol", f"write:{block - 4096}", "4k", 16, 0, mapped * block,
                extra=[f"--number_ios={mapped}"])
        after = pool_usage(rig, name)["metadata_blocks"]["used"]
        per_tib = (after - before) * 4096 * (TIB // block) / mapped
        tool = subprocess.run(["thin_metadata_size", "-b", f"{block // KIB}k", "-s", "1t",
                               "-m", "1", "-u", "m", "-n"], capture_output=True, text=True)
        theirs = float(tool.stdout.split()[0]) * MIB if tool.returncode == 0 else None
        rig.remove("mdvol", name)
        rows.append({"row": f"metadata per TiB, {block // KIB} KiB blocks", "thin": per_tib,
                     "peer": theirs, "peer_name": "thin_metadata_size",
                     "ratio": ratio(per_tib, theirs), "bar": None,
                     "mapped_blocks": mapped, "metadata_blocks_used": after - before})
    return rows


def pool_usage(rig: Rig, pool: str) -> dict:
    return json.loads(rig.v("status", pool, "--json"))["targets"][0]["details"]


def snapshot_time(rig: Rig, args) -> list:
    times = {}
    for gib in (1, args.snapshot_gib):
        blocks = gib * GIB // BLOCK
        meta = rig.file(f"st{gib}.meta", 256 * MIB)
        data = rig.file(f"st{gib}.data", blocks * BLOCK)
        xml = rig.tmp / f"st{gib}.xml"
        xml.write_text(
            f'<superblock uuid="" time="0" transaction="1" flags="0" version="2" '
            f'data_block_size="128" nr_data_blocks="{blocks}">\n'
            f'  <device dev_id="1" mapped_blocks="{blocks}" transaction="0" '
            f'creation_time="0" snap_time="0">\n'
            f'    <range_mapping origin_begin="0" data_begin="0" length="{blocks}" '
            f'time="0"/>\n  </device>\n</superblock>\n')
        run(["thin_restore", "-i", str(xml), "-o", str(meta)], timeout=600)
        name = f"stpool{gib}"
        rig.v("create", name, "--table",
              f"0 {blocks * 128} thin-pool {meta} {data} 128 0")
        times[gib] = [rig.snapshot(name, None, 2 + n, 1) for n in range(args.repeat)]
        rig.remove(name)
    one, big = median(times[1]), median(times[args.snapshot_gib])
    return [{"row": f"create_snap, {args.snapshot_gib} GiB mapped vs 1 GiB (seconds)",
             "thin": big, "peer": one, "peer_name": "1 GiB mapped",
             "ratio": ratio(big, one), "bar": None, "runs": times}]


ROWS = {
    "provisioned": provisioned,
    "break": break_sharing,
    "snapshots": many_snapshots,
    "chain": snapshot_chain,
    "writers": writers,
    "metadata": metadata_per_tib,
    "snaptime": snapshot_time,
}


def fmt(v, row: str) -> str:
    if v is None:
        return "—"
    if "metadata per TiB" in row:
        return f"{v / MIB:.0f} MiB"
    if "seconds" in row:
        return f"{v * 1000:.1f} ms"
    return f"{v / 1000:.1f}k" if v >= 1000 else f"{v:.0f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runtime", type=float, default=5)
    ap.add_argument("--size", default="512M")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--snapshots", type=int, default=100)
    ap.add_argument("--snapshot-gib", type=int, default=100)
    ap.add_argument("--metadata-blocks", type=int, default=32768)
    ap.add_argument("--writer-ios", type=int, default=4096)
    ap.add_argument("--rows", default=",".join(ROWS), help="which rows: " + ",".join(ROWS))
    ap.add_argument("--quick", action="store_true",
                    help="2 s runs, 256 MiB, 1 repeat, 20 snapshots, 10 GiB: checks it works")
    ap.add_argument("--out", default="bench/results/thin")
    ap.add_argument("--udm")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.runtime, args.size, args.repeat = 2, "256M", 1
        args.snapshots, args.snapshot_gib, args.metadata_blocks = 20, 10, 4096
        args.writer_ios = 1024
    args.size = parse_size(args.size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    udm_bin = find_udm(args)
    tmp = Path(tempfile.mkdtemp(prefix="udm-thin-", dir=os.environ.get("TMPDIR", "/tmp")))
    rig = Rig(tmp, udm_bin, out)
    rows, failed = [], []
    try:
        for name in args.rows.split(","):
            log(f"row {name}")
            try:
                rows += ROWS[name](rig, args)
            except BenchError as e:
                log(f"row {name} failed: {e}")
                failed.append({"row": name, "error": str(e)})
    finally:
        rig.stop()
        if not args.keep:
            subprocess.run(["rm", "-rf", str(tmp)])
    table_rows = []
    for r in rows:
        bar = r["bar"]
        met = "·" if bar is None or r["ratio"] is None else ("✔" if r["ratio"] >= bar else "✘")
        table_rows.append([r["row"], fmt(r["thin"], r["row"]), r["peer_name"],
                           fmt(r["peer"], r["row"]),
                           f"{r['ratio']:.2f}×" if r["ratio"] else "—",
                           f"≥ {bar}×" if bar else "—", met])
    header = ["row", "udm thin", "against", "value", "ratio", "bar", ""]
    table = markdown_table(header, table_rows) if table_rows else "(no row completed)"
    extra = [r for r in rows if "latency_us" in r or "qcow2_chain_of_10" in r]
    for r in extra:
        if "latency_us" in r:
            (tm, tp), (qm, qp) = r["latency_us"]["thin"], r["latency_us"]["qcow2"]
            table += (f"\n\nFirst write after a snapshot, mean / p99 µs: thin {tm:.0f} / "
                      f"{tp:.0f}, qcow2 {qm:.0f} / {qp:.0f}.")
        if "qcow2_chain_of_10" in r:
            table += (f"\n\nReads through a qcow2 backing chain of 10: "
                      f"{fmt(r['qcow2_chain_of_10'], '')} IOPS (thin's 10th snapshot: "
                      f"{r['thin_vs_qcow2_chain']:.2f}× that).")
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"rows": rows, "failed": failed,
                                                  "args": vars(args)}, indent=2,
                                                 default=str) + "\n")
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
