"""The seed's matrix: the daemon and the peers (qemu-nbd, nbdkit) set up and probed, every
(workload, region size, system) cell measured on a fresh volume, the bar cells repeated, and
a hydrated clone against linear (`Matrix`, a part of `clone.Bench`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BenchError, run  # noqa: E402
from harness import Udm, check_export, start_service, wait_for_socket  # noqa: E402
from clone_report import Res, WORKLOADS, log  # noqa: E402


class Matrix:
    """Setup, probes and the matrix: mixed into `clone.Bench`, whose helpers they use."""

    # ---- setup and probes ----------------------------------------------------------------

    def start_daemon(self) -> None:
        ctl = self.tmp / "ctl.sock"
        (self.tmp / "state").mkdir()
        cmd = [str(self.udm_bin), "daemon", "--state-dir", str(self.tmp / "state"),
               "--control", str(ctl), "--nbd", f"unix:{self.nbd_sock}"]
        if self.args.nbd_threads:
            cmd += ["--nbd-threads", str(self.args.nbd_threads)]
        self.daemon = start_service("udm daemon", cmd, self.tmp / "udm-daemon.log",
                                    env=dict(os.environ, RUST_BACKTRACE="1"))
        self.services.append(self.daemon)
        wait_for_socket(ctl, self.daemon, timeout=30)
        self.udm = Udm(self.udm_bin, ctl)

    def read_back(self, what: str, cmd_src: list, length: int = 1 << 20) -> float:
        """Copy the first `length` bytes of an image with `qemu-img dd` in 4 KiB reads, compare
        with the source file; return the seconds it took (a slow source shows ~1 ms a read)."""
        out = self.tmp / "probe.raw"
        try:
            out.unlink()
        except FileNotFoundError:
            pass
        t0 = time.monotonic()
        run(["qemu-img", "dd", *cmd_src, "-O", "raw", f"of={out}", "bs=4096",
             f"count={length // 4096}"], timeout=120)
        dt = time.monotonic() - t0
        with open(out, "rb") as a, open(self.src, "rb") as b:
            if a.read(length) != b.read(length):
                raise BenchError(f"{what}: the first {length} bytes differ from the source")
        out.unlink()
        return dt

    def probe_peers(self) -> None:
        """Every system reads back what it should before anything is measured."""
        self.probe_clone()
        self.probe_qcow2_backing()
        self.probe_cow()

    def probe_clone(self) -> None:
        """The clone itself answers with the source's data; the slow source's pace."""
        with self.clone(4096, "slowsrc", self.size) as name:
            dt = self.read_back("udm clone", ["-f", "raw", f"if={self.uri(name)}"])
            log(f"probe: udm clone reads back the source (256 reads of 4 KiB in {dt:.2f} s)")
            self.extras["probe_clone_s"] = dt
        dt = self.read_back("udm slowsrc", ["-f", "raw", f"if={self.uri('slowsrc')}"])
        log(f"probe: udm slowsrc: 256 reads of 4 KiB in {dt:.2f} s")
        self.extras["probe_slowsrc_s"] = dt

    def probe_qcow2_backing(self) -> None:
        """qemu: its nbd driver over udm's slow export as the qcow2 backing file, else over
        nbdkit's delay filter; a note saying which."""
        if not (shutil.which("qemu-img") and shutil.which("qemu-nbd")):
            self.qcow2_available = False
            self.notes.append("qemu qcow2 not measured: qemu-img/qemu-nbd missing "
                              "(apt-get install qemu-utils)")
        else:
            backing = json.dumps({"driver": "raw", "file": {
                "driver": "nbd", "server": {"type": "unix", "path": str(self.nbd_sock)},
                "export": "slowsrc"}}, separators=(",", ":"))
            self.qcow2_backing = "json:" + backing
            ok, err = self.probe_qcow2()
            if ok:
                self.qcow2_source_note = ("qcow2 backing = qemu's nbd driver over udm's `slowsrc` "
                                          "export (the same 1 ms delay device as the clone's)")
            else:
                log(f"qemu's nbd driver over udm's slowsrc did not work ({err}); falling back to "
                    f"nbdkit's delay filter")
                sock = self.tmp / "nbdkit-delay.sock"
                self.start("nbdkit delay (qcow2 backing)",
                           ["nbdkit", "-f", "-U", str(sock), "--exit-with-parent",
                            "--filter=delay", "file", str(self.src), "rdelay=1ms"],
                           "nbdkit-delay.log", sock)
                backing = json.dumps({"driver": "raw", "file": {
                    "driver": "nbd", "server": {"type": "unix", "path": str(sock)}}},
                    separators=(",", ":"))
                self.qcow2_backing = "json:" + backing
                ok, err2 = self.probe_qcow2()
                if ok:
                    self.qcow2_source_note = (
                        f"qcow2 backing = qemu's nbd driver over `nbdkit --filter=delay file "
                        f"rdelay=1ms` (udm's slowsrc export did not work as a backing file: "
                        f"{err[:200]})")
                else:
                    self.qcow2_available = False
                    self.qcow2_source_note = (f"qcow2 not measured: no slow backing worked "
                                              f"(udm: {err[:200]}; nbdkit: {err2[:200]})")
            self.notes.append(self.qcow2_source_note)

    def probe_cow(self) -> None:
        """nbdkit cow over its delay filter, with cow-block-size when this nbdkit takes it."""
        if not shutil.which("nbdkit"):
            self.cow_available = False
            self.notes.append("nbdkit cow not measured: nbdkit missing (apt-get install nbdkit)")
            return
        sock = self.tmp / "cow.sock"
        for block in (65536, None):
            svc = None
            try:
                svc = self.start("nbdkit cow (probe)", self.cow_cmd(sock, block),
                                 "nbdkit-cow-probe.log", sock,
                                 env=dict(os.environ, TMPDIR=str(self.tmp)))
                uri = f"nbd+unix:///?socket={sock}"
                check_export(uri, self.size, "nbdkit cow")
                dt = self.read_back("nbdkit cow", ["-f", "raw", f"if={uri}"])
                log(f"probe: nbdkit cow+delay{' cow-block-size' if block else ''}: 256 reads of "
                    f"4 KiB in {dt:.2f} s")
                self.extras["probe_cow_s"] = dt
                if block is None:
                    self.cow_block_size_ok = False
                    self.notes.append("nbdkit cow: cow-block-size was refused by this nbdkit, so "
                                      "its column uses the filter's default block size "
                                      "whatever the region size")
                break
            except BenchError as e:
                log(f"probe: nbdkit cow {'with' if block else 'without'} cow-block-size: {e}")
                if block is None:
                    self.cow_available = False
                    self.notes.append(f"nbdkit cow not measured: {str(e)[:300]}")
            finally:
                if svc is not None:
                    self.stop_service(svc)
                    self.keep_log(svc, "nbdkit-cow.log")
        if self.cow_available:
            self.notes.append("nbdkit cow: `nbdkit --filter=cow --filter=delay file SRC rdelay=1ms"
                              + (" cow-block-size=<region>" if self.cow_block_size_ok else "")
                              + "`; the delay filter sits under the cow filter, so only reads of "
                                "the source are delayed (1 ms); the overlay is a deleted "
                                "temporary file in the page cache, lost at exit")

    def probe_qcow2(self) -> tuple[bool, str]:
        ov = self.tmp / "probe.qcow2"
        try:
            run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", self.qcow2_backing,
                 "-o", "cluster_size=65536", str(ov), str(self.size)], timeout=60)
            dt = self.read_back("qcow2 overlay", ["-f", "qcow2", f"if={ov}"])
            log(f"probe: qcow2 over its slow backing: 256 reads of 4 KiB in {dt:.2f} s")
            self.extras["probe_qcow2_s"] = dt
            return True, ""
        except BenchError as e:
            return False, str(e)
        finally:
            try:
                ov.unlink()
            except FileNotFoundError:
                pass

    # ---- the matrix ----------------------------------------------------------------------

    def run_matrix(self) -> None:
        regions = self.args.regions
        per_wl = 1 + len(regions) * (1 + self.qcow2_available + self.cow_available)
        total = len(WORKLOADS) * per_wl + sum(1 for w in WORKLOADS if w.direction == "read")
        log(f"matrix: {total} fio runs of {self.args.runtime} s "
            f"(about {total * (self.args.runtime + 1.5) / 60:.0f} min)")
        n = 0
        for wl in WORKLOADS:
            self.ensure_daemon()
            # The seed's raw SSD row: udm linear over a destination. Writes go to a fresh sparse
            # file (as the clone's destination is); reads to the fully written source file, so
            # they hit allocated blocks as on a real disk.
            n += 1
            if wl.direction == "write":
                with self.linear_fresh() as name:
                    self.measure(wl, "linear", None, self.uri(name), f"[{n}/{total}]")
            else:
                self.measure(wl, "linear", None, self.uri("linsrc"), f"[{n}/{total}]")
                n += 1
                self.measure(wl, "source", None, self.uri("slowsrc"), f"[{n}/{total}]")
            for kib in regions:
                rb = kib << 10
                self.ensure_daemon()
                n += 1
                try:
                    with self.clone(rb, "slowsrc", self.size) as name:
                        if kib not in self.meta_used:
                            st = self.status_json(name)["targets"][0]["status"].split()
                            used, tot = st[1].split("/")
                            self.meta_used[kib] = (int(used), int(tot))
                        res = self.measure(wl, "clone", kib, self.uri(name), f"[{n}/{total}]")
                        try:
                            d = self.clone_details(name)
                            res.extra = {"hydrated_bytes_after": d.get("hydrated_bytes"),
                                         "mode": d.get("mode")}
                            if d.get("mode") != "write":
                                self.notes.append(f"clone {wl.key} {kib} KiB: metadata mode "
                                                  f"{d.get('mode')} after the run")
                        except (BenchError, json.JSONDecodeError, KeyError, IndexError) as e:
                            log(f"status after run: {e}")
                except BenchError as e:
                    self.results[(wl.key, "clone", kib)] = Res(error=str(e))
                    log(f"[{n}/{total}] clone {kib} KiB setup FAILED: {e}")
                for key, peer, available in (("qcow2", self.qcow2, self.qcow2_available),
                                             ("cow", self.cow, self.cow_available)):
                    if not available:
                        continue
                    n += 1
                    try:
                        with peer(rb) as uri:
                            self.measure(wl, key, kib, uri, f"[{n}/{total}]")
                    except BenchError as e:
                        self.results[(wl.key, key, kib)] = Res(error=str(e))
                        log(f"[{n}/{total}] {key} {kib} KiB setup FAILED: {e}")

    def repeat_bar_cells(self) -> None:
        """The 4 KiB-region random-write cells carry the tightest bars and single 5 s runs swing
        by ±30 % here: run linear, clone and qcow2 there again, alternating, and keep for each
        the run with the median value."""
        runs = {}
        bar_wls = [w for w in WORKLOADS if w.key.startswith("randwrite-4k")]
        for wl in bar_wls:
            for system, kib in (("linear", None), ("clone", 4), ("qcow2", 4)):
                first = self.results.get((wl.key, system, kib))
                if first is not None and first.sample is not None:
                    runs[(wl.key, system, kib)] = [first]
        for rep in range(2, self.args.bar_repeats + 1):
            for wl in bar_wls:
                for system, kib in (("linear", None), ("clone", 4), ("qcow2", 4)):
                    if (wl.key, system, kib) not in runs:
                        continue
                    self.ensure_daemon()
                    tag, suffix = f"[repeat {rep}/{self.args.bar_repeats}]", f".rep{rep}"
                    try:
                        if system == "linear":
                            with self.linear_fresh() as name:
                                res = self.measure(wl, system, kib, self.uri(name), tag, suffix)
                        elif system == "clone":
                            with self.clone(kib << 10, "slowsrc", self.size) as name:
                                res = self.measure(wl, system, kib, self.uri(name), tag, suffix)
                                d = self.clone_details(name)
                                res.extra = {"hydrated_bytes_after": d.get("hydrated_bytes"),
                                             "mode": d.get("mode")}
                        else:
                            with self.qcow2(kib << 10) as uri:
                                res = self.measure(wl, system, kib, uri, tag, suffix)
                    except (BenchError, json.JSONDecodeError, KeyError, IndexError) as e:
                        log(f"{tag} {wl.key} {system}: FAILED: {e}")
                        continue
                    if res.sample is not None:
                        runs[(wl.key, system, kib)].append(res)
        repeats = {}
        for key, results in runs.items():
            ordered = sorted(results, key=lambda r: r.value())
            median = ordered[(len(ordered) - 1) // 2]
            self.results[key] = median
            repeats["|".join(str(k) for k in key)] = [round(r.value()) for r in results]
        self.extras["bar_repeats"] = repeats

    def hydrated_vs_linear(self) -> None:
        """A clone whose every region is hydrated against `linear` over its own destination
        file: the clone then serves every request from the destination (remapped through its
        bitmap) and should be as fast as linear. The clone (--hydrated-region, the plain source
        file, no delay) is hydrated in the background to completion first. The destination is
        the clone's own while it exists, so each run creates its device (the clone again on
        the same metadata, which must come back complete, or linear on the destination) and
        removes it after; per workload --bar-repeats alternating runs (clone, linear; linear,
        clone; ...), every run kept, the medians compared."""
        kib = self.args.hydrated_region
        rb = kib << 10
        entry: dict = {"region_kib": kib, "runs": {}, "incomplete_on_reload": 0}
        self.extras["hydrated"] = entry
        reps = max(1, self.args.bar_repeats)
        try:
            with self.clone_files(rb, self.size) as (n, meta, dest):
                table = self.clone_table(meta, dest, str(self.src), rb, self.size,
                                         core=("hydration_threshold", "1024",
                                               "hydration_batch_size", "64"))
                tables = {"hydrated": table, "hydlinear": f"0 {self.sectors} linear {dest} 0"}
                name = f"cl{n}"
                self.udm_create(name, table)
                t0 = time.monotonic()
                self.udm.client("message", name, "0", "enable_hydration", timeout=30)
                t = self.wait_hydrated(name, t0, self.args.hydration_timeout, [])
                self.udm_remove(name)
                if t is None:
                    raise BenchError(f"the {kib} KiB-region clone did not finish hydrating in "
                                     f"{self.args.hydration_timeout:.0f} s")
                entry["hydration_seconds"] = round(t, 2)
                log(f"hydrated clone ({kib} KiB regions): hydrated in {t:.1f} s")
                # Before any write: the destination must now hold the source's bytes.
                differ = differing_chunks(self.src, dest, self.size)
                if differ:
                    raise BenchError(f"after hydration the destination differs from the source "
                                     f"at {differ}")
                i, total = 0, len(WORKLOADS) * reps * 2
                for wl in WORKLOADS:
                    runs = entry["runs"].setdefault(wl.key, {"hydrated": [], "hydlinear": []})
                    for rep in range(1, reps + 1):
                        order = ("hydrated", "hydlinear") if rep % 2 else \
                                ("hydlinear", "hydrated")
                        for system in order:
                            self.ensure_daemon()
                            i += 1
                            dev = f"hyd{self.next_id()}"
                            self.udm_create(dev, tables[system])
                            try:
                                if system == "hydrated" and \
                                        not self.clone_details(dev).get("complete"):
                                    entry["incomplete_on_reload"] += 1
                                res = self.measure(wl, system, kib, self.uri(dev),
                                                   f"[hydrated {i}/{total}]", f".rep{rep}",
                                                   store=False)
                            finally:
                                self.udm_remove(dev)
                            if res.sample is not None:
                                runs[system].append(res.value())
        except (BenchError, json.JSONDecodeError, KeyError, IndexError) as e:
            entry["error"] = str(e)
            log(f"hydrated clone vs linear FAILED: {e}")
        for runs in entry["runs"].values():
            mc = statistics.median(runs["hydrated"]) if runs["hydrated"] else None
            ml = statistics.median(runs["hydlinear"]) if runs["hydlinear"] else None
            runs["median_clone"], runs["median_linear"] = mc, ml
            runs["ratio"] = mc / ml if mc and ml else None


def differing_chunks(a: Path, b: Path, size: int, chunk: int = 1 << 20) -> list:
    """Offsets among eight spread 1 MiB chunks (first, last and between) where two files
    differ, read with O_DIRECT so that no page cache is left behind."""
    offsets = sorted({(size - chunk) * i // 7 // 4096 * 4096 for i in range(8)})
    buf = mmap.mmap(-1, chunk)       # page-aligned, as O_DIRECT wants
    digests = {}
    for path in (a, b):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for off in offsets:
                got = os.preadv(fd, [buf], off)
                digests.setdefault(off, []).append(hashlib.sha256(buf[:got]).digest())
        finally:
            os.close(fd)
    return [off for off, (da, db) in digests.items() if da != db]
