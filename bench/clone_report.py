"""The clone benchmark's vocabulary and its report: the workloads and systems it compares, the
bars they must meet, a result and how a table prints it (module level), and the report built
from a run (`Report`, a part of `clone.Bench`; the charts are in clone_charts.py).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import harness  # noqa: E402
from harness import Workload  # noqa: E402
from report import human_size, markdown_table  # noqa: E402

REPO = harness.REPO
SECTOR = 512
META_BLOCK = 4096
TIB = 1 << 40


def log(msg: str) -> None:
    print(f"[clone] {msg}", file=sys.stderr, flush=True)


# common's and harness's helpers (run, Service, fill_backing_file ...) log through common's
# module-level `log`; make them speak with this script's prefix.
common.log = log

# --------------------------------------------------------------------------------------------
# workloads, systems, results
# --------------------------------------------------------------------------------------------

# The seed's order: latency (qd1), IOPS (qd32), bandwidth (256 KiB qd32); writes then reads.
WORKLOADS = sorted(harness.WORKLOADS,
                   key=lambda w: (w.bs != "4k", w.qd, w.direction == "read"))

# Per-region systems, in the order they run for each (workload, region).
REGION_SYSTEMS = ["clone", "qcow2", "cow"]
LABELS = {
    "clone": "udm clone",
    "linear": "udm linear (dest)",
    "source": "slow source",
    "qcow2": "qemu qcow2",
    "cow": "nbdkit cow",
    "hydrated": "udm clone (hydrated)",
    "hydlinear": "udm linear (its dest)",
}
COLORS = {"clone": "#1f77b4", "qcow2": "#2ca02c", "cow": "#ff7f0e", "linear": "#555555",
          "source": "#c62828"}

BAR_LINEAR_4K = 0.95      # 4 KiB regions: clone randwrite >= 0.95x linear
BAR_HYDRATED = 0.95       # a fully hydrated clone >= 0.95x linear on its destination
BAR_QCOW2_4K = 3.0        # 4 KiB regions: clone randwrite >= 3x qcow2
BAR_QCOW2_ALL = 1.0       # every region size: clone >= qcow2
BAR_HYDRATION = 0.9       # background hydration >= 0.9x the source's sequential read bandwidth
BAR_INTERFERENCE = 0.8    # user randread while hydrating >= 0.8x idle


@dataclass
class Res:
    sample: harness.Sample | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def value(self):
        return self.sample.value if self.sample else None


def fmt_value(v, metric: str) -> str:
    if v is None:
        return "—"
    if metric == "iops":
        if v >= 10000:
            return f"{v / 1000:.1f}k"
        return f"{v:.0f}"
    return f"{v:.0f} MB/s"


def fmt_cell(res: Res | None, wl: Workload) -> str:
    if res is None:
        return "—"
    if res.sample is None:
        return "error"
    s = fmt_value(res.sample.value, wl.metric)
    if wl.qd == 1:
        s += f" ({fmt_lat(res.sample.lat_mean_us)})"
    return s


def fmt_lat(us: float) -> str:
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "?"
    if us >= 1000:
        return f"{us / 1000:.1f} ms"
    return f"{us:.0f} µs"


def ratio(a: Res | None, b: Res | None):
    va = a.value() if a else None
    vb = b.value() if b else None
    if va is None or vb is None or vb == 0:
        return None
    return va / vb


def fmt_ratio(r, bar: float | None = None) -> str:
    if r is None:
        return "—"
    text = f"{r:.2f}×" if r < 100 else f"{r:.0f}×"
    if bar is not None and round(r, 2) < bar:
        return f"**{text} ✘**"
    return text


def region_label(kib: int) -> str:
    return f"{kib} KiB"


def metadata_bytes(volume_bytes: int, region_bytes: int) -> tuple[int, int, int]:
    """docs/clone-metadata.md: R regions, B bitmap blocks per area, (2 + 2B) blocks of 4 KiB."""
    r = -(-volume_bytes // region_bytes)
    w = -(-r // 64)
    b = max(1, -(-w // 510))
    return r, b, (2 + 2 * b) * META_BLOCK




class Report:
    """The report and charts of a run: mixed into `clone.Bench`, whose state they read."""

    # ---- report --------------------------------------------------------------------------

    def report_hydrated(self, hyd: dict, out: list, bars: list) -> None:
        """The fully hydrated clone against linear on its destination: a table, every run."""
        kib = hyd["region_kib"]
        out.append(f"### Fully hydrated clone vs linear on its destination ({kib} KiB regions)")
        out.append("")
        out.append(f"A clone of the plain source file, {kib} KiB regions, hydrated in the "
                   f"background to completion"
                   + (f" ({hyd['hydration_seconds']:.1f} s)" if "hydration_seconds" in hyd
                      else "")
                   + ", then measured against `linear` over the clone's own destination file, "
                   "each device created for its run (the clone again on its metadata) and "
                   "removed after, alternating, "
                   f"{max(1, self.args.bar_repeats)} run(s) each; the table shows the medians "
                   "and every run.")
        out.append("")
        rows = []
        for wl in WORKLOADS:
            runs = hyd["runs"].get(wl.key)
            if not runs:
                continue
            r = runs.get("ratio")
            rows.append([wl.label, fmt_value(runs.get("median_clone"), wl.metric),
                         fmt_value(runs.get("median_linear"), wl.metric),
                         fmt_ratio(r, BAR_HYDRATED),
                         ", ".join(fmt_value(v, wl.metric) for v in runs["hydrated"]),
                         ", ".join(fmt_value(v, wl.metric) for v in runs["hydlinear"])])
            bars.append((f"{wl.label}: fully hydrated clone / linear on its destination = "
                         + ("—" if r is None else f"{r:.2f}×") + f" (bar ≥ {BAR_HYDRATED}×)",
                         r is not None and round(r, 2) >= BAR_HYDRATED))
        if rows:
            out.append(markdown_table(["workload", "clone (hydrated)", "linear (its dest)",
                                       "clone / linear", "clone, every run",
                                       "linear, every run"], rows))
            out.append("")
        if "error" in hyd:
            out.append(f"Failed: {hyd['error']}")
            out.append("")
            bars.append(("fully hydrated clone vs linear: not measured", False))
        if hyd.get("incomplete_on_reload"):
            out.append(f"**The clone, created again on its metadata, did not report itself "
                       f"complete {hyd['incomplete_on_reload']} time(s)**: those runs may include "
                       f"hydration.")
            out.append("")

    def build_report(self, meta: dict) -> tuple[str, list]:
        """The report's markdown, section by section, and its bars: (text, ok) with ok True,
        False, or None for a figure reported but not judged."""
        out: list = []
        bars: list = []
        self.report_intro(meta, out)
        qcow2_cells = self.report_workloads(out, bars)
        self.report_repeats(out)
        hyd = self.extras.get("hydrated")
        if hyd:
            self.report_hydrated(hyd, out, bars)
        self.report_qcow2_summary(qcow2_cells, bars)
        self.report_hydration(out, bars)
        self.report_interference(out, bars)
        self.report_metadata(out)
        self.report_bars(out, bars)
        return "\n".join(out) + "\n", bars

    def report_intro(self, meta: dict, out: list) -> None:
        """The header: host, versions, and what each column runs."""
        out += [f"## udm clone benchmark — {meta['timestamp']}", ""]
        out.append(
            f"Host: {meta['host']}, {meta['cpus']} CPUs, kernel {meta['kernel']}. udm "
            f"{meta['udm_commit']}. fio {meta['fio_version']}, nbd engine, one job, unix socket, "
            f"{self.args.runtime} s per run, volume {human_size(self.size)}; a fresh unhydrated "
            f"volume for every cell (clone created with `no_hydration`: no background copy).")
        out.append("")
        out.append("Slow source (the seed's spinning disk): udm `slowsrc` = `delay SRC 0 1 SRC 0 0` "
                   "(1 ms per read, writes undelayed; fully written random data). Columns:")
        out.append("")
        out.append("- **udm clone**: `clone META DEST slowsrc <region> 1 no_hydration 4 "
                   "hydration_threshold 256 hydration_batch_size 64`, source = udm `slowsrc`.")
        out.append("- **udm linear (dest)**: the seed's raw-SSD row, once per workload: writes to a "
                   "fresh sparse file (as the clone's destination), reads from the fully written "
                   "source file without delay.")
        out.append("- **slow source**: fio on udm `slowsrc` itself (reads only; the seed's HDD row).")
        if self.qcow2_available:
            out.append(f"- **qemu qcow2**: `qemu-img create -f qcow2 -F raw -b <slow> -o "
                       f"cluster_size=<region>`, `qemu-nbd -t -e 8 -f qcow2 --cache=none "
                       f"--aio=io_uring`; {self.qcow2_source_note}.")
        if self.cow_available:
            out.append("- **nbdkit cow**: `nbdkit --filter=cow --filter=delay file SRC rdelay=1ms"
                       + (" cow-block-size=<region>`" if self.cow_block_size_ok else
                          "` (cow-block-size refused: default block)")
                       + "; slow source = nbdkit's delay filter (1 ms per read).")
        out.append("")

    def report_workloads(self, out: list, bars: list) -> list:
        """A table per workload (every region size, every system, the ratios); returns the
        (label, clone / qcow2) cells for the summary bar."""
        qcow2_cells: list = []   # (label, ratio) for "clone >= qcow2 at every region size"
        for wl in WORKLOADS:
            if not any(k[0] == wl.key for k in self.results):
                continue
            unit = ("IOPS (mean latency)" if wl.qd == 1 else "IOPS") if wl.metric == "iops" \
                else "MB/s"
            out.append(f"### {wl.label} — {unit}")
            out.append("")
            lin = self.results.get((wl.key, "linear", None))
            srcr = self.results.get((wl.key, "source", None))
            # The comparisons this workload has: (present, column, ratio column).
            others = [
                (wl.direction == "read", "slow source", "clone / source"),
                (self.qcow2_available, "qemu qcow2", "clone / qcow2"),
                (self.cow_available, "nbdkit cow", "clone / cow"),
            ]
            header = ["region", "udm clone", "udm linear (dest)"]
            header += [column for present, column, _ in others if present]
            header += ["clone / linear"]
            header += [ratio for present, _, ratio in others if present]
            if wl.direction == "write":
                header.append("clone hydrated at end")
            rows = []
            for kib in self.args.regions:
                c = self.results.get((wl.key, "clone", kib))
                q = self.results.get((wl.key, "qcow2", kib))
                k = self.results.get((wl.key, "cow", kib))
                r_lin, r_q, r_k = ratio(c, lin), ratio(c, q), ratio(c, k)
                is_4k_rw = kib == 4 and wl.rw == "randwrite"
                row = [region_label(kib), fmt_cell(c, wl), fmt_cell(lin, wl)]
                if wl.direction == "read":
                    row.append(fmt_cell(srcr, wl))
                if self.qcow2_available:
                    row.append(fmt_cell(q, wl))
                if self.cow_available:
                    row.append(fmt_cell(k, wl))
                row.append(fmt_ratio(r_lin, BAR_LINEAR_4K if is_4k_rw else None))
                if wl.direction == "read":
                    row.append(fmt_ratio(ratio(c, srcr)))
                if self.qcow2_available:
                    q_bar = BAR_QCOW2_4K if is_4k_rw else BAR_QCOW2_ALL
                    row.append(fmt_ratio(r_q, q_bar))
                    if r_q is not None:
                        if is_4k_rw:
                            bars.append((f"{wl.label}, 4 KiB regions: clone / qcow2 = {r_q:.2f}× "
                                         f"(bar ≥ {BAR_QCOW2_4K:.0f}×)",
                                         round(r_q, 2) >= BAR_QCOW2_4K))
                        qcow2_cells.append((f"{wl.label} {kib} KiB", r_q))
                if self.cow_available:
                    row.append(fmt_ratio(r_k))
                if wl.direction == "write":
                    hb = c.extra.get("hydrated_bytes_after") if c else None
                    row.append("—" if hb is None else f"{hb / self.size * 100:.0f} %")
                if is_4k_rw and r_lin is not None:
                    bars.append((f"{wl.label}, 4 KiB regions: clone / linear = {r_lin:.2f}× "
                                 f"(bar ≥ {BAR_LINEAR_4K}×)", round(r_lin, 2) >= BAR_LINEAR_4K))
                rows.append(row)
            out.append(markdown_table(header, rows))
            out.append("")
        if any(k[0] in {w.key for w in WORKLOADS if w.direction == "write"}
               for k in self.results):
            out.append("\"clone hydrated at end\": the share of the volume the clone had marked "
                       "hydrated when its run ended (a write that covers a whole region skips the "
                       "copy, a smaller one copies the region first). A run that hydrates most of "
                       "the volume spends its later part on hydrated regions: the seed's runs "
                       "were 90 s on 300 GB; use a larger --size to stay further from that.")
            out.append("")
        return qcow2_cells

    def report_repeats(self, out: list) -> None:
        """Every run of the cells judged on the median of several."""
        reps = self.extras.get("bar_repeats")
        if reps:
            parts = []
            for key, vals in reps.items():
                wl_key, system, _ = key.split("|")
                parts.append(f"{wl_key} {LABELS[system]}: {', '.join(str(v) for v in vals)}")
            out.append(f"The 4 KiB-region random-write cells (the tightest bars) are the median of "
                       f"{self.args.bar_repeats} runs each, run alternately (linear, clone, qcow2, "
                       f"then again); all runs, IOPS: " + "; ".join(parts) + ".")
            out.append("")

    def report_qcow2_summary(self, qcow2_cells: list, bars: list) -> None:
        """One bar: the clone at least matches qcow2 in every cell."""
        if qcow2_cells:
            below = [f"{lab} ({r:.2f}×)" for lab, r in qcow2_cells if round(r, 2) < BAR_QCOW2_ALL]
            bars.append((f"clone ≥ qcow2 at every region size and workload: "
                         f"{len(qcow2_cells) - len(below)} of {len(qcow2_cells)} cells"
                         + (f"; below: {', '.join(below)}" if below else ""), not below))

    def report_hydration(self, out: list, bars: list) -> None:
        """Background hydration with no user I/O, against the source's bandwidth."""
        out.append("### Background hydration, no user I/O")
        out.append("")
        hy = self.extras.get("hydration", {})
        if hy:
            vol = next(iter(hy.values()))["volume_bytes"]
            ceil = self.extras.get("copy_ceiling") or {}
            ceil_rd = ceil.get("read_mbps")
            copy_ref = self.extras.get("copy_reference_mbps")
            out.append(f"Clone of a fully written {human_size(vol)} source, region 64 KiB, "
                       f"`hydration_threshold 1024 hydration_batch_size 16`, created with "
                       f"`no_hydration`, then `enable_hydration`; `udm status --json` polled every "
                       f"100 ms until `complete`.")
            out.append("")
            out.append(f"**The bar (≥ {BAR_HYDRATION}× the source's sequential read bandwidth) is "
                       f"judged on the remote row only.** The clone's use case is a source slower "
                       f"than the destination (remote storage), where hydration should run at the "
                       f"source's speed. The remote source is `nbdkit -U SOCK --filter=rate file "
                       f"SRC rate={self.REMOTE_RATE}` (nbdkit's rate filter, in bits per second: "
                       f"2·2^30 bit/s ≈ 268 MB/s, like a 2 Gbit/s link), given to the clone as "
                       f"`nbd+unix:///?socket=SOCK`. The rate filter lets an initial burst of "
                       f"several hundred MB through, so a short time-based read overstates the "
                       f"link; its source bandwidth is therefore fio reading the whole volume once "
                       f"(1 MiB, iodepth 8, not time based) from a fresh nbdkit, and the hydration "
                       f"runs against another fresh nbdkit: both see the same burst and the same "
                       f"bytes.")
            out.append("")
            out.append("The plain and delayed rows read the source from the same virtual disk the "
                       "destination is on, so hydration there reads and writes that disk at once "
                       "and is capped by the disk's combined read+write capacity, not by udm: "
                       "their fraction of the source's read bandwidth is reported, not a bar, and "
                       "\"vs same-disk copy ceiling\" compares them with what a copy can reach on "
                       "this disk. Their source bandwidth = fio 1 MiB sequential reads at iodepth "
                       f"8 for {self.args.runtime} s on the source's udm export (`linear` over the "
                       "file, or the `delay` device), mean of a run before and a run after.")
            out.append("")
            rows = self.hydration_rows(hy, copy_ref, bars)
            out.append(markdown_table(["source", "time to hydrate", "hydration MB/s",
                                       "udm's copy_rate (last)", "max regions in flight",
                                       "source seq read",
                                       "fraction of source (bar: remote only)",
                                       "vs same-disk copy ceiling", "vs local copy"], rows))
            out.append("")
            out.append("Same-disk copy ceiling (reference, not a bar): one fio run with two jobs at "
                       "once, job 1 reading the source file, job 2 writing a freshly fallocate'd "
                       f"file of {human_size(vol)} in the same directory (1 MiB, iodepth 8, "
                       "O_DIRECT, io_uring, the whole size each): "
                       + (f"read **{ceil_rd:.0f} MB/s** while writing "
                          f"{ceil.get('write_mbps') or 0:.0f} MB/s" if ceil_rd else "failed")
                       + "; \"vs same-disk copy ceiling\" = hydration MB/s / that read MB/s. "
                       "\"vs local copy\" compares with copying the source file to a new file "
                       "with `qemu-img convert -t none -T none` "
                       + (f"({copy_ref:.0f} MB/s)" if copy_ref else "(failed)")
                       + ". udm's copy_rate is sampled once a second, so it stays empty for a "
                       "hydration shorter than about 2 s.")
        else:
            out.append("Not measured.")
        out.append("")

    def hydration_rows(self, hy: dict, copy_ref, bars: list) -> list:
        """The hydration table's rows, one per source kind; each kind's bar (or reported
        line) into `bars`."""
        rows = []
        labels = {"remote": f"remote NBD (nbdkit rate={self.REMOTE_RATE}) — bar",
                  "plain": "plain file (same disk)",
                  "delayed": "delayed 1 ms/read (same disk)"}
        for kind, e in hy.items():
            frac = e.get("fraction")
            same = e.get("same_disk", kind != "remote")
            fceil = e.get("fraction_of_ceiling")
            if not same:
                bars.append((f"hydration of the remote source (nbdkit rate="
                             f"{self.REMOTE_RATE}): "
                             + (f"{frac:.2f}× its sequential read bandwidth"
                                if frac is not None else "not measured")
                             + f" (bar ≥ {BAR_HYDRATION}×)",
                             frac is not None and round(frac, 2) >= BAR_HYDRATION))
            elif frac is not None:
                bars.append((f"hydration of the {kind} source on the destination's disk: "
                             f"{frac:.2f}× its sequential read bandwidth"
                             + (f", {fceil:.2f}× the same-disk copy ceiling"
                                if fceil is not None else "")
                             + " (reported, no bar: a same-disk copy is capped by the disk)",
                             None))
            if same:
                src_cell = ((f"{e['source_mbps']:.0f} MB/s ({e['bw_before_mbps'] or 0:.0f} / "
                             f"{e['bw_after_mbps'] or 0:.0f})") if e.get("source_mbps")
                            else "—")
            else:
                src_cell = (f"{e['source_mbps']:.0f} MB/s (whole volume, fresh nbdkit)"
                            if e.get("source_mbps") else "—")
            rows.append([
                labels.get(kind, kind),
                "error" if "error" in e else
                (f"{e['seconds']:.2f} s" + ("" if e.get("complete") else " (incomplete)")),
                f"{e['mbps']:.0f} MB/s" if e.get("mbps") else "—",
                f"{e['udm_reported_rate_mbps']:.0f} MB/s"
                if e.get("udm_reported_rate_mbps") else "—",
                str(e.get("max_hydrating_regions", "—")),
                src_cell,
                fmt_ratio(frac, None if same else BAR_HYDRATION),
                fmt_ratio(fceil) if same else "— (not same disk)",
                fmt_ratio(e["mbps"] / copy_ref) if same and e.get("mbps") and copy_ref
                else "—",
            ])
        return rows

    def report_interference(self, out: list, bars: list) -> None:
        """User random reads while the clone hydrates, against an idle clone."""
        out.append("### User random reads while hydrating")
        out.append("")
        it = self.extras.get("interference")
        if it:
            pairs = it.get("pairs", [])
            out.append(f"4 KiB random reads at iodepth 32 for {self.args.runtime} s on a clone "
                       f"(64 KiB regions, plain-file source, no delay) of a fully written "
                       f"{human_size(it['volume_bytes'])} source: idle clone created with "
                       f"`no_hydration` vs a fresh clone hydrating from the moment fio starts "
                       f"(`hydration_threshold 1024 hydration_batch_size 16`, no rate limit). "
                       f"Run-to-run noise on a VM is large, so {len(pairs)} alternating pairs "
                       f"(idle, hydrating, idle, hydrating, ...), each run on a fresh clone; the "
                       f"fraction is the median hydrating IOPS over the median idle IOPS.")
            out.append("")
            rows = []
            for n, pr in enumerate(pairs, 1):
                i, h = pr.get("idle", {}), pr.get("hydrating", {})
                fin = h.get("finished_at_s")
                rows.append([str(n), "idle (no_hydration)",
                             "error" if "error" in i else fmt_value(i.get("iops"), "iops"),
                             fmt_lat(i.get("lat_mean_us")), fmt_lat(i.get("lat_p99_us")),
                             "—", "—", ""])
                rows.append([str(n), "hydrating",
                             "error" if "error" in h else fmt_value(h.get("iops"), "iops"),
                             fmt_lat(h.get("lat_mean_us")), fmt_lat(h.get("lat_p99_us")),
                             f"{(h.get('hydrated_bytes_at_end') or 0) / 1e6:.0f} MB "
                             f"({(h.get('hydration_mbps_under_load') or 0):.0f} MB/s)",
                             f"at {fin:.1f} s" if fin is not None else "no",
                             fmt_ratio(pr.get("fraction"))])
            rows.append(["median", "idle", fmt_value(it.get("median_idle_iops"), "iops"),
                         "", "", "", "", ""])
            rows.append(["median", "hydrating", fmt_value(it.get("median_hydrating_iops"), "iops"),
                         "", "", "", "", fmt_ratio(it.get("fraction"), BAR_INTERFERENCE)])
            out.append(markdown_table(["pair", "clone", "IOPS", "mean lat", "p99 lat",
                                       "hydrated during fio", "hydration finished",
                                       "hydrating / idle"], rows))
            out.append("")
            frac = it.get("fraction")
            out.append(f"Fraction median hydrating / median idle: "
                       f"{fmt_ratio(frac, BAR_INTERFERENCE)} (bar ≥ {BAR_INTERFERENCE}×); the "
                       f"per-pair fractions are shown for the spread, not judged.")
            if frac is not None:
                bars.append((f"randread qd32 while hydrating: median {frac:.2f}× idle over "
                             f"{len(pairs)} pairs (bar ≥ {BAR_INTERFERENCE}×)",
                             round(frac, 2) >= BAR_INTERFERENCE))
        else:
            out.append("Not measured.")
        out.append("")

    def report_metadata(self, out: list) -> None:
        """Metadata size per TiB, from the format, against what udm reported."""
        out.append("### Metadata size per TiB of volume")
        out.append("")
        out.append("From docs/clone-metadata.md: R = ceil(volume / region), B = max(1, "
                   "ceil(ceil(R/64) / 510)), (2 + 2·B) blocks of 4096 bytes. The last column is "
                   f"what `udm status` reported as used metadata blocks for the "
                   f"{human_size(self.size)} volume of this run, against the formula.")
        out.append("")
        rows = []
        for kib in self.args.regions:
            r, b, nbytes = metadata_bytes(TIB, kib << 10)
            _, _, at_size = metadata_bytes(self.size, kib << 10)
            got = self.meta_used.get(kib)
            want_blocks = at_size // META_BLOCK
            rows.append([region_label(kib), f"{r:,}", f"{b:,}", f"{nbytes:,}",
                         f"{nbytes / (1 << 20):.1f} MiB", f"{nbytes / TIB * 100:.4f} %",
                         (f"{got[0]} (formula {want_blocks})" +
                          ("" if got[0] == want_blocks else " ✘")) if got else "—"])
        out.append(markdown_table(["region", "regions / TiB", "B", "bytes / TiB", "MiB / TiB",
                                   "of volume", f"used blocks at {human_size(self.size)}"], rows))
        out.append("")

    def report_bars(self, out: list, bars: list) -> None:
        """Every bar, then the runs that failed and the notes."""
        out.append("### Bars")
        out.append("")
        if bars:
            for text, ok in bars:
                mark = "· (reported)" if ok is None else ("✔" if ok else "✘ **FAILED**")
                out.append(f"- {mark} {text}")
        else:
            out.append("- nothing measured")
        failed = sorted({f"{LABELS[s]} {wl} {'' if k is None else region_label(k)}"
                         for (wl, s, k), r in self.results.items() if r.sample is None})
        if failed:
            out.append("")
            out.append("Runs with errors (see the *.err files): " + "; ".join(failed) + ".")
        if self.notes:
            out.append("")
            out.append("Notes:")
            out.append("")
            for n in self.notes:
                out.append(f"- {n}")
