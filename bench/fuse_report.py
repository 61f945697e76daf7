"""The FUSE benchmark's report: the systems it compares, issue #10's bars, and the table and
chart built from a run's cells.  fuse.py runs, this module reports.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from common import bar_axes, import_pyplot  # noqa: E402
from harness import Results  # noqa: E402
from report import (  # noqa: E402
    fmt_cpu, fmt_disk, fmt_lat, fmt_ratio, fmt_value, geomean, is_below, markdown_table,
    table_footer,
)

# --------------------------------------------------------------------------------------------
# workloads and systems
# --------------------------------------------------------------------------------------------

WORKLOADS = list(harness.WORKLOADS)   # randread/randwrite 4k qd1, qd32, write/read 256k qd32

# "udm-fuse-dev" (a second daemon on /dev/fuse) joins when comparing the FUSE transports.
SYSTEMS = ["udm-fuse", "nbdfuse", "direct"]
LABELS = {"udm-fuse": "udm FUSE", "udm-fuse-dev": "udm FUSE (/dev/fuse)", "nbdfuse": "nbdfuse",
          "direct": "loop on file"}
COLORS = {"udm-fuse": "#1f77b4", "udm-fuse-dev": "#90caf9", "nbdfuse": "#ff7f0e",
          "direct": "#9e9e9e"}

# Issue #10's bars at 4 KiB random, depth 32 (besides udm FUSE >= nbdfuse on every row).
BAR_FILE_LOOP = 0.7   # loop on udm's FUSE file / loop on the file
BAR_URING = 1.3       # FUSE over io_uring / /dev/fuse


def beyond_the_limit(wl, med) -> str:
    """Why the io_uring bar cannot be met on this row, when /dev/fuse already comes so close
    to the loop straight on the file (the limit: no user space) that 1.3× of it lies beyond."""
    dev, direct = med(wl, "udm-fuse-dev"), med(wl, "direct")
    if not (dev and direct) or BAR_URING * dev <= direct:
        return ""
    return (f"; {BAR_URING}× /dev/fuse is {BAR_URING * dev / direct:.2f}× the loop straight on "
            f"the file, the limit: out of reach on this disk")


def variant_key(label: str) -> str:
    """The system key of a `--variant` daemon."""
    return f"udm-fuse-v-{label}"


def variants() -> list:
    return [k for k in SYSTEMS if k.startswith("udm-fuse-v-")]



# --------------------------------------------------------------------------------------------
# table and chart
# --------------------------------------------------------------------------------------------

def tabulate(results):
    """Per workload: the table's rows, the bars, the ratios and results.json's summary; what
    `build_table` prints."""
    r = Results(results)
    cell, med, ratio = r.cell, r.med, r.ratio

    compare = "udm-fuse-dev" in SYSTEMS
    header = ["workload"] + [LABELS[k] for k in SYSTEMS] + ["udm / nbdfuse", "udm / loop on file"]
    if compare:
        header.append("io_uring / /dev/fuse")
    header += [f"udm / {LABELS[k]}" for k in variants()]
    header += [f"{LABELS[k]} lat µs" for k in SYSTEMS]
    rows, below, r_peer_all, r_floor_all, summary, bars = [], [], [], [], {}, []
    cpu_rows = []
    missing_ratio = []
    for wl in WORKLOADS:
        r_peer = ratio(wl, "udm-fuse", "nbdfuse")
        r_floor = ratio(wl, "udm-fuse", "direct")
        r_uring = ratio(wl, "udm-fuse", "udm-fuse-dev") if compare else None
        label = wl.label + (" (IOPS)" if wl.metric == "iops" else " (MB/s)")
        if is_below(r_peer):
            below.append(f"{wl.label} {r_peer:.2f}×")
            label = "▼ " + label
        if r_peer is None:
            missing_ratio.append(wl.label)
        else:
            r_peer_all.append(r_peer)
        if r_floor is not None:
            r_floor_all.append(r_floor)
        row = [label] + [fmt_value(med(wl, k), wl.metric) for k in SYSTEMS]
        row += [fmt_ratio(r_peer), "—" if r_floor is None else f"{r_floor:.2f}×"]
        if compare:
            row.append("—" if r_uring is None else f"{r_uring:.2f}×")
        row += ["—" if (v := ratio(wl, "udm-fuse", k)) is None else f"{v:.2f}×"
                for k in variants()]
        rows.append(row + [fmt_lat(cell(wl, k)) for k in SYSTEMS])
        cpu_rows.append([wl.label] + [fmt_cpu(med(wl, k, "cpu_us_per_io"))
                                      for k in SYSTEMS if k != "direct"])
        if wl.bs == "4k" and wl.qd == 32 and wl.rw.startswith("rand"):
            bars.append((f"{wl.label}: loop on udm's FUSE file / loop on the file = "
                         + ("—" if r_floor is None else f"{r_floor:.2f}×")
                         + f" (≥ {BAR_FILE_LOOP}×)",
                         None if r_floor is None else round(r_floor, 2) >= BAR_FILE_LOOP))
            if compare:
                bars.append((f"{wl.label}: FUSE over io_uring / /dev/fuse = "
                             + ("—" if r_uring is None else f"{r_uring:.2f}×")
                             + f" (≥ {BAR_URING}×){beyond_the_limit(wl, med)}",
                             None if r_uring is None else round(r_uring, 2) >= BAR_URING))
        summary[wl.key] = {
            "metric": wl.metric,
            "systems": {
                k: None if cell(wl, k) is None else {"label": LABELS[k], **cell(wl, k).summary()}
                for k in SYSTEMS},
            "ratio_udm_vs_nbdfuse": r_peer,
            "ratio_udm_vs_direct": r_floor,
            "ratio_uring_vs_dev_fuse": r_uring,
            "ratio_udm_vs_variant": {LABELS[k]: ratio(wl, "udm-fuse", k) for k in variants()},
        }
    return SimpleNamespace(header=header, rows=rows, cpu_rows=cpu_rows, below=below,
                           r_peer_all=r_peer_all,
                           r_floor_all=r_floor_all, summary=summary, bars=bars,
                           missing_ratio=missing_ratio, compare=compare)


def build_table(results, meta) -> tuple[str, dict]:
    """The report: the table, its summary lines, the bars and the notes; and results.json's
    summary."""
    t = tabulate(results)
    header, rows, below, summary, bars = t.header, t.rows, t.below, t.summary, t.bars
    r_peer_all, r_floor_all, missing_ratio, compare = (t.r_peer_all, t.r_floor_all,
                                                       t.missing_ratio, t.compare)
    out = [f"## udm FUSE benchmark — {meta['timestamp']}", ""]
    out.append(f"Host: {meta['host']}, {meta['cpus']} CPUs, kernel {meta['kernel']}. "
               f"udm {meta['udm_commit']}. {meta['fio_version']} on /dev/loopN "
               f"(`losetup --direct-io=on`), io_uring, O_DIRECT, one job. {meta['nbdfuse_version']}"
               f" ({meta.get('nbdfuse_connections', '?')} connection(s) to udm's NBD socket). "
               f"Runtime {meta['runtime']} s per run, device size {meta['size_human']}, median of "
               f"{meta['repeat']} alternating run(s). FUSE transport: {meta['fuse_transport']}.")
    out.append("")
    out.append(markdown_table(header, rows))
    out.append("")
    out.append("CPU per I/O (µs of user + system time of the processes serving the loop device "
               "during the run, over fio's I/Os: the udm daemon; for nbdfuse, nbdfuse and the "
               "udm daemon serving it NBD; the kernel's own work, the loop worker's included, "
               "is in no column):")
    out.append("")
    out.append(markdown_table(["workload"] + [LABELS[k] for k in SYSTEMS if k != "direct"],
                              t.cpu_rows))
    out.append("")
    disk_rows = [[wl.label] + [fmt_disk(results.get((wl.key, k))) for k in SYSTEMS]
                 for wl in WORKLOADS]
    if any(cell != "—" for row in disk_rows for cell in row[1:]):
        out.append("At the disk (mean requests in flight, mean µs each; the kernel's counters "
                   "of the block device holding disk.img over each run, as in "
                   "bench/foundation.py):")
        out.append("")
        out.append(markdown_table(["workload"] + [LABELS[k] for k in SYSTEMS], disk_rows))
        out.append("")
    out.append(f"{LABELS['udm-fuse']}: loop on udm's own FUSE file (`udm attach`)"
               + (f"; {LABELS['udm-fuse-dev']}: the same from a second daemon with "
                  f"`--fuse-uring off`" if compare else "")
               + ". nbdfuse: loop on nbdfuse's file over the same udm device's NBD export. "
               "loop on file: loop straight on disk.img (the limit, no user space). udm = "
               f"{LABELS['udm-fuse']}. 4k rows in IOPS, 256k rows in MB/s (10^6 B/s). Ratios on "
               "IOPS or MB/s; **▼** marks udm / nbdfuse below 1.0×. Latency cells: completion "
               "latency mean / p99 in µs (fio clat).")
    for label, v in meta.get("variants", {}).items():
        out.append(f"- {label}: `{v['udm']} daemon … {' '.join(v['daemon_args'])}`")
    out.append("")
    if r_peer_all:
        g = geomean(r_peer_all)
        summary["_geomean_udm_vs_nbdfuse"] = g
        line = f"Summary: udm FUSE / nbdfuse geometric mean {g:.2f}× over {len(r_peer_all)} rows"
        if r_floor_all:
            gf = geomean(r_floor_all)
            summary["_geomean_udm_vs_direct"] = gf
            line += f"; udm FUSE / loop on file {gf:.2f}×"
        out.append(line + ".")
        out.append("")
    parts = []
    if below:
        parts.append("below 1.0× on " + "; ".join(below))
    if missing_ratio:
        parts.append("no ratio for " + ", ".join(missing_ratio))
    bars.insert(0, ("udm FUSE ≥ 1.0× nbdfuse on every row"
                    + (": " + "; ".join(parts) if parts else ""), not parts))
    if not compare:
        bars.append((f"FUSE over io_uring / /dev/fuse (≥ {BAR_URING}× at 4k random qd32): "
                     f"not measured ({meta.get('fuse_uring_not_compared')})", None))
    out.append("### Bars (issue #10)")
    out.append("")
    for text, ok in bars:
        out.append(f"- {'?' if ok is None else ('✔' if ok else '✘')} {text}")
    met = all(ok for _, ok in bars)
    summary["_bars"] = [{"text": t, "ok": ok} for t, ok in bars]
    summary["_bars_met"] = met
    out.append("")
    out.append("All bars: " + ("**met**." if met else "**not met** (✘ missed, ? not measured)."))
    failed = sorted({LABELS[k] for k in SYSTEMS for wl in WORKLOADS
                     if (wl.key, k) in results and results[(wl.key, k)].errors})
    table_footer(out, meta, failed)
    return "\n".join(out) + "\n", summary


def draw_chart(results, out_dir: Path, meta) -> list:
    plt = import_pyplot("chart")
    if plt is None:
        return []

    def med(wl, key, attr="value"):
        c = results.get((wl.key, key))
        return c.median(attr) if c else None

    caption = (f"{meta['timestamp']} · {meta['cpus']} CPUs · fio io_uring O_DIRECT on "
               f"/dev/loopN (losetup --direct-io=on) · {meta['runtime']} s × median of "
               f"{meta['repeat']} · {meta['size_human']}")
    groups = [("IOPS (4 KiB random)", [w for w in WORKLOADS if w.metric == "iops"], "value"),
              ("MB/s (256 KiB sequential)", [w for w in WORKLOADS if w.metric == "mbps"],
               "value"),
              ("mean latency at iodepth 1, µs (whisker: p99)",
               [w for w in WORKLOADS if w.qd == 1], "lat")]
    groups = [g for g in groups if g[1]]
    if not groups:
        return []
    widths = [max(len(g[1]), 1) for g in groups]
    fig, axes = plt.subplots(1, len(groups), figsize=(15, 5.4),
                             gridspec_kw={"width_ratios": widths})
    if len(groups) == 1:
        axes = [axes]
    n = len(SYSTEMS)
    width = 0.8 / n
    for ax, (ylabel, wls, kind) in zip(axes, groups):
        xs = list(range(len(wls)))
        for i, key in enumerate(SYSTEMS):
            pos = [x + (i - (n - 1) / 2) * width for x in xs]
            style = dict(color=COLORS.get(key, "#7e57c2"), hatch="//" if key == "direct" else None,
                         edgecolor="#555555" if key == "direct" else "white",
                         label=LABELS[key] + (" (limit)" if key == "direct" else ""))
            if kind == "lat":
                means = [med(w, key, "lat_mean_us") or 0 for w in wls]
                p99s = [med(w, key, "lat_p99_us") or 0 for w in wls]
                ax.bar(pos, means, width, yerr=[[0] * len(wls),
                                                [max(p - m, 0) for p, m in zip(p99s, means)]],
                       capsize=3, error_kw={"elinewidth": 1, "ecolor": "#333333"}, **style)
                continue
            bars = ax.bar(pos, [med(w, key) or 0 for w in wls], width, **style)
            if key == "udm-fuse":
                for w, b in zip(wls, bars):
                    va, vb = med(w, "udm-fuse"), med(w, "nbdfuse")
                    if va and vb:
                        r = va / vb
                        ax.annotate(f"{r:.2f}×", (b.get_x() + b.get_width() / 2, b.get_height()),
                                    ha="center", va="bottom", fontsize=8, fontweight="bold",
                                    color="#c62828" if is_below(r) else "#1b5e20")
        bar_axes(ax, xs, [w.label for w in wls], ylabel)
    axes[0].legend(fontsize=9, loc="upper left")
    fig.suptitle("Block device on a FUSE file: udm's FUSE export vs nbdfuse over udm's NBD "
                 "export  (ratio = udm / nbdfuse above the udm bar)")
    fig.text(0.5, 0.01, caption, ha="center", fontsize=8, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    path = out_dir / "fuse.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
