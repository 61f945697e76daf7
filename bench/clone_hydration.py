"""Background hydration measured: throughput from local and remote sources against what
the source and the disk can give, and user I/O while hydrating (`Hydration`, a part of
`clone.Bench`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BenchError, run  # noqa: E402
from harness import Workload, fill_backing_file, parse_fio_json  # noqa: E402
from report import human_size  # noqa: E402
from clone_report import SECTOR, log  # noqa: E402


class Hydration:
    """Hydration runs: mixed into `clone.Bench`, whose helpers they use."""

    # ---- extra measurements --------------------------------------------------------------

    def read_bandwidth(self, tag: str, uri: str, fio_args: list,
                       timeout: float | None = None) -> float | None:
        """fio 1 MiB sequential reads at iodepth 8 from `uri`: MB/s (None, and a note, if the
        run fails)."""
        out_json = self.out_dir / f"srcbw.{tag}.json"
        wl = Workload("srcbw", "seq read 1M qd8", "read", "1m", 8)
        try:
            self.fio("srcbw", ["--ioengine=nbd", f"--uri={uri}", "--rw=read", "--bs=1m",
                               "--iodepth=8", *fio_args], out_json, timeout=timeout)
            mbps = parse_fio_json(out_json, wl).mbps
            log(f"source bandwidth {tag}: {mbps:.0f} MB/s")
            return mbps
        except (BenchError, json.JSONDecodeError, KeyError, OSError) as e:
            log(f"source bandwidth {tag}: FAILED: {e}")
            self.notes.append(f"source bandwidth {tag} failed: {str(e)[:300]}")
            return None

    def source_bandwidth(self, device: str, tag: str, size: int) -> float | None:
        """Sequential reads for --runtime seconds on a udm export: MB/s."""
        return self.read_bandwidth(tag, self.uri(device),
                                   ["--time_based", f"--runtime={self.args.runtime}",
                                    f"--size={size}"])

    def wait_hydrated(self, name: str, t0: float, limit: float, samples: list,
                      stop: threading.Event | None = None) -> float | None:
        """Poll status every 100 ms until complete; return seconds since t0 (None: not done)."""
        deadline = t0 + limit
        while time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                return None
            try:
                d = self.clone_details(name)
            except (BenchError, json.JSONDecodeError, KeyError, IndexError) as e:
                log(f"status {name}: {e}")
                time.sleep(0.1)
                continue
            now = time.monotonic() - t0
            samples.append({"t": round(now, 3), "hydrated_bytes": d.get("hydrated_bytes"),
                            "hydrating_regions": d.get("hydrating_regions"),
                            "rate": d.get("copy_rate_bytes_per_second"), "mode": d.get("mode")})
            if d.get("complete"):
                return now
            if d.get("mode") not in (None, "write"):
                raise BenchError(f"clone {name} went to mode {d.get('mode')} while hydrating")
            time.sleep(0.1)
        return None

    def local_copy(self, hsrc: Path, hsize: int) -> float | None:
        """Reference: copy the source file to a new file with `qemu-img convert -t none -T none`
        (O_DIRECT both sides, the same disk) — what a copy can reach here; MB/s."""
        dst = self.tmp / "copy-ref.img"
        try:
            t0 = time.monotonic()
            run(["qemu-img", "convert", "-t", "none", "-T", "none", "-f", "raw", "-O", "raw",
                 str(hsrc), str(dst)], timeout=max(600, hsize / (10 << 20)))
            dt = time.monotonic() - t0
            mbps = hsize / dt / 1e6
            log(f"reference copy (qemu-img convert -t none -T none): {dt:.2f} s, {mbps:.0f} MB/s")
            return mbps
        except BenchError as e:
            log(f"reference copy failed: {e}")
            return None
        finally:
            dst.unlink(missing_ok=True)

    REMOTE_RATE = "2G"     # nbdkit rate filter: bits per second (2·2^30 bit/s ≈ 268 MB/s)

    def remote_uri(self, sock: Path) -> str:
        return f"nbd+unix:///?socket={sock}"

    @contextlib.contextmanager
    def remote_source(self, hsrc: Path, what: str):
        """A FRESH `nbdkit --filter=rate file HSRC rate=2G` (the remote source); yields its URI.
        Each measurement gets its own process, so each starts with the same full token bucket
        (the rate filter lets an initial burst of about 2 s worth through)."""
        n = self.next_id()
        sock = self.tmp / "remote.sock"
        svc = None
        try:
            svc = self.start(f"nbdkit rate ({what})",
                             ["nbdkit", "-f", "-U", str(sock), "--exit-with-parent",
                              "--filter=rate", "file", str(hsrc), f"rate={self.REMOTE_RATE}"],
                             f"nbdkit-rate-{n}.log", sock)
            yield self.remote_uri(sock)
        finally:
            if svc is not None:
                self.stop_service(svc)
                self.keep_log(svc, "nbdkit-rate.log")

    def remote_bandwidth(self, hsrc: Path, hsize: int) -> float | None:
        """The remote source's bandwidth: fio reads the WHOLE volume once (1 MiB, iodepth 8, not
        time based) from a fresh nbdkit — the same bytes and the same initial burst that the
        hydration gets; MB/s."""
        try:
            with self.remote_source(hsrc, "source bandwidth") as uri:
                return self.read_bandwidth("remote", uri, [f"--size={hsize}"],
                                           timeout=max(self.fio_timeout, hsize / (20 << 20) + 60))
        except BenchError as e:
            log(f"source bandwidth remote: FAILED: {e}")
            self.notes.append(f"source bandwidth remote failed: {str(e)[:300]}")
            return None

    def copy_ceiling(self, hsrc: Path, hsize: int) -> dict | None:
        """The disk's copy ceiling: ONE fio invocation, two jobs at once — job 1 reads the hsrc
        file, job 2 writes a freshly fallocate'd file of the same size in the same tmp dir (1 MiB,
        iodepth 8, O_DIRECT, io_uring, the whole size each). A same-disk hydration has to do both
        at once, so the read job's MB/s is what it can reach here."""
        dst = self.tmp / "ceiling-dst.img"
        out_json = self.out_dir / "copy-ceiling.json"
        try:
            with open(dst, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, hsize)
            common_opts = ["--bs=1M", "--iodepth=8", "--direct=1", "--ioengine=io_uring",
                           f"--size={hsize}"]
            cmd = ["fio", "--output-format=json", f"--output={out_json}",
                   "--name=read", f"--filename={hsrc}", "--rw=read", *common_opts,
                   "--name=write", f"--filename={dst}", "--rw=write", *common_opts]
            cp = run(cmd, timeout=max(600, hsize / (5 << 20)), check=False, quiet=True,
                     cwd=self.tmp)
            if cp.returncode != 0:
                raise BenchError(f"fio exit {cp.returncode}: "
                                 f"{(cp.stderr or cp.stdout).strip()[-1500:]}")
            text = out_json.read_text(errors="replace")
            data = json.loads(text[text.find("{"):])
            jobs = {j["jobname"]: j for j in data["jobs"]}
            rd = jobs["read"]["read"]["bw_bytes"] / 1e6
            wr = jobs["write"]["write"]["bw_bytes"] / 1e6
            log(f"same-disk copy ceiling (fio read + write at once): read {rd:.0f} MB/s, "
                f"write {wr:.0f} MB/s")
            return {"read_mbps": rd, "write_mbps": wr, "json": out_json.name}
        except (BenchError, json.JSONDecodeError, KeyError, OSError) as e:
            log(f"copy ceiling failed: {e}")
            self.notes.append(f"same-disk copy ceiling failed: {str(e)[:300]}")
            return None
        finally:
            dst.unlink(missing_ok=True)

    def hydrate_once(self, kind: str, source: str, hsize: int, entry: dict) -> None:
        """One background hydration (no user I/O) of a fresh clone of `source`; fills `entry`."""
        samples: list = []
        entry["samples"] = samples
        try:
            with self.clone(64 << 10, source, hsize,
                            core=("hydration_threshold", "1024",
                                  "hydration_batch_size", "16")) as name:
                t0 = time.monotonic()
                self.udm.client("message", name, "0", "enable_hydration", timeout=30)
                t = self.wait_hydrated(name, t0, self.args.hydration_timeout, samples)
                last = samples[-1] if samples else {}
                if t is None:
                    elapsed = time.monotonic() - t0
                    got = last.get("hydrated_bytes") or 0
                    entry.update(complete=False, seconds=elapsed, bytes=got,
                                 mbps=got / elapsed / 1e6)
                    self.notes.append(f"hydration of the {kind} source did not complete in "
                                      f"{self.args.hydration_timeout:.0f} s "
                                      f"({got >> 20} of {hsize >> 20} MiB)")
                else:
                    entry.update(complete=True, seconds=t, bytes=hsize, mbps=hsize / t / 1e6)
                rates = [s["rate"] for s in samples if s.get("rate")]
                entry["udm_reported_rate_mbps"] = (rates[-1] / 1e6) if rates else None
                inflight = [s["hydrating_regions"] for s in samples
                            if s.get("hydrating_regions") is not None]
                entry["max_hydrating_regions"] = max(inflight) if inflight else None
                log(f"hydration ({kind} source): {entry['seconds']:.2f} s, "
                    f"{entry['mbps']:.0f} MB/s, complete={entry['complete']}")
        except BenchError as e:
            entry["error"] = str(e)
            log(f"hydration ({kind}) FAILED: {e}")

    def hydration_throughput(self, hsrc: Path, hsize: int) -> None:
        """(i) background hydration, no user I/O. First (the bar) from a remote, rate-limited
        NBD source — the clone's use case, a source slower than the destination; then from the
        plain file and the delayed source, both on the destination's disk (reported against the
        disk's copy ceiling, no bar: they measure the disk's read+write capacity)."""
        res = {}
        # -- remote: fresh nbdkit for the source bandwidth, another fresh one for the hydration
        if shutil.which("nbdkit"):
            self.ensure_daemon()
            bw = self.remote_bandwidth(hsrc, hsize)
            entry = {"volume_bytes": hsize, "same_disk": False, "bw_before_mbps": bw,
                     "bw_after_mbps": None, "rate": self.REMOTE_RATE}
            try:
                with self.remote_source(hsrc, "hydration") as uri:
                    entry["source"] = uri
                    self.hydrate_once("remote", uri, hsize, entry)
            except BenchError as e:
                entry["error"] = str(e)
                log(f"hydration (remote) FAILED: {e}")
            entry["source_mbps"] = bw
            entry["fraction"] = (entry["mbps"] / bw) if entry.get("mbps") and bw else None
            res["remote"] = entry
            if hsize < (2 << 30):
                self.notes.append(f"remote source: much of the {human_size(hsize)} volume fits in "
                                  f"the rate filter's initial burst (several hundred MB), so both "
                                  f"its source read and its hydration run faster than the "
                                  f"{self.REMOTE_RATE} bit/s link; use --hydration-size 2G or "
                                  f"more to measure the link itself")
        else:
            self.notes.append("remote hydration not measured: nbdkit missing "
                              "(apt-get install nbdkit)")

        # -- same-disk references
        self.extras["copy_reference_mbps"] = self.local_copy(hsrc, hsize)
        self.extras["copy_ceiling"] = self.copy_ceiling(hsrc, hsize)
        ceiling = (self.extras["copy_ceiling"] or {}).get("read_mbps")
        for kind, source, dev in (("plain", str(hsrc), "hlin"), ("delayed", "hslow", "hslow")):
            self.ensure_daemon()
            bw_before = self.source_bandwidth(dev, f"{kind}-before", hsize)
            entry = {"source": source, "volume_bytes": hsize, "same_disk": True,
                     "bw_before_mbps": bw_before}
            self.hydrate_once(kind, source, hsize, entry)
            bw_after = self.source_bandwidth(dev, f"{kind}-after", hsize)
            entry["bw_after_mbps"] = bw_after
            bws = [b for b in (bw_before, bw_after) if b]
            entry["source_mbps"] = sum(bws) / len(bws) if bws else None
            entry["fraction"] = (entry["mbps"] / entry["source_mbps"]
                                 if entry.get("mbps") and entry["source_mbps"] else None)
            entry["fraction_of_ceiling"] = (entry["mbps"] / ceiling
                                            if entry.get("mbps") and ceiling else None)
            res[kind] = entry
        self.extras["hydration"] = res

    INTERFERENCE_PAIRS = 3

    def interference_run(self, kind: str, hsrc: Path, hsize: int, pair: int) -> dict:
        """One 4 KiB randread qd32 fio run on a fresh clone, idle (`no_hydration`) or hydrating
        from the moment fio starts; returns the run's entry."""
        wl = Workload("randread-4k-qd32", "randread 4k qd32", "randread", "4k", 32)
        self.ensure_daemon()
        out_json = self.out_dir / f"interference.{kind}.{human_size(hsize)}.p{pair}.json"
        samples: list = []
        stop = threading.Event()
        with self.clone(64 << 10, str(hsrc), hsize,
                        core=("hydration_threshold", "1024",
                              "hydration_batch_size", "16")) as name:
            done = {}
            t0 = time.monotonic()
            if kind == "hydrating":
                self.udm.client("message", name, "0", "enable_hydration", timeout=30)

            # Poll status every 100 ms in both runs, so both pay for it alike.
            def poll():
                done["t"] = self.wait_hydrated(name, t0, 3600, samples, stop)
            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            try:
                self.fio(wl.key, ["--ioengine=nbd", f"--uri={self.uri(name)}",
                                  "--rw=randread", "--bs=4k", "--iodepth=32",
                                  "--time_based", f"--runtime={self.args.runtime}",
                                  f"--size={hsize}"], out_json)
                smp = parse_fio_json(out_json, wl)
                fio_end = time.monotonic() - t0
                entry = {"iops": smp.iops, "lat_mean_us": smp.lat_mean_us,
                         "lat_p99_us": smp.lat_p99_us, "json": out_json.name}
                log(f"interference pair {pair} {kind}: {smp.iops:.0f} IOPS")
            except (BenchError, json.JSONDecodeError, KeyError, OSError) as e:
                entry = {"error": str(e)}
                log(f"interference pair {pair} {kind}: FAILED: {e}")
                fio_end = time.monotonic() - t0
            finally:
                stop.set()
                poller.join(timeout=30)
            if kind == "hydrating":
                d = {}
                try:
                    d = self.clone_details(name)
                except (BenchError, json.JSONDecodeError, KeyError, IndexError):
                    pass
                hb = d.get("hydrated_bytes")
                entry.update(hydrated_bytes_at_end=hb,
                             hydration_mbps_under_load=(hb / fio_end / 1e6) if hb else None,
                             finished_at_s=done.get("t"), fio_seconds=fio_end, samples=samples)
        return entry

    def hydration_interference(self, hsrc: Path, hsize: int) -> None:
        """(ii) user 4 KiB randread qd32 while hydrating vs on an idle no_hydration clone; plain
        file source so that what is measured is the hydration's interference. Three alternating
        pairs (idle, hydrating, idle, hydrating, ...), each run on a fresh clone; the fraction is
        median hydrating / median idle. If a hydration finishes before its fio run ends, the
        volume is doubled (up to --hydration-max) and the pairs start over."""
        pairs: list = []
        early: list = []     # (pair, finished_at_s) of hydrations that ended before fio did
        p = 0
        while p < self.INTERFERENCE_PAIRS:
            pair = {kind: self.interference_run(kind, hsrc, hsize, p + 1)
                    for kind in ("idle", "hydrating")}
            i, h = pair["idle"], pair["hydrating"]
            pair["fraction"] = (h["iops"] / i["iops"]) if i.get("iops") and h.get("iops") \
                else None
            fin = h.get("finished_at_s")
            if fin is not None and fin < h.get("fio_seconds", 0) - 0.5:
                if hsize * 2 <= self.args.hydration_max:
                    note = (f"hydration of the {human_size(hsize)} volume finished {fin:.1f} s "
                            f"into the {self.args.runtime} s fio run")
                    hsize *= 2
                    log(f"{note}; the pairs again with a {human_size(hsize)} volume")
                    self.notes.append(note + f"; the pairs were repeated with {human_size(hsize)}")
                    hsrc = self.make_hsrc(hsize)
                    pairs, early, p = [], [], 0
                    continue
                early.append((p + 1, fin))
            pairs.append(pair)
            p += 1
        for n, fin in early:
            self.notes.append(f"interference pair {n}: hydration of the {human_size(hsize)} "
                              f"volume finished {fin:.1f} s into the {self.args.runtime} s fio "
                              f"run (its IOPS mix hydrating and hydrated time)")
        idle = [pr["idle"]["iops"] for pr in pairs if pr["idle"].get("iops")]
        hyd = [pr["hydrating"]["iops"] for pr in pairs if pr["hydrating"].get("iops")]
        mi = statistics.median(idle) if idle else None
        mh = statistics.median(hyd) if hyd else None
        self.extras["interference"] = {
            "volume_bytes": hsize, "source": str(hsrc), "pairs": pairs,
            "median_idle_iops": mi, "median_hydrating_iops": mh,
            "fraction": (mh / mi) if mi and mh else None,
        }

    def make_hsrc(self, hsize: int) -> Path:
        """A fully written source of `hsize` for the hydration measurements."""
        old = getattr(self, "_hsrc", None)
        if old is not None and old[1] >= hsize:
            return old[0]
        for name in ("hlin", "hslow"):
            if name in self.created:
                self.udm_remove(name)
        if old is not None:
            old[0].unlink()
        path = self.tmp / f"hsrc-{human_size(hsize)}.img"
        fill_backing_file(path, hsize, timeout=max(600, hsize / (20 << 20)))
        s = hsize // SECTOR
        self.udm_create("hlin", f"0 {s} linear {path} 0")
        self.udm_create("hslow", f"0 {s} delay {path} 0 1 {path} 0 0")
        self._hsrc = (path, hsize)
        return path

