"""The foundation benchmark's report: its workloads, systems' pairs and issue #10's bars, the
tables and the charts built from a run's cells.  foundation.py runs, this module reports.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from common import bar_axes, import_pyplot  # noqa: E402
from harness import Results, Workload  # noqa: E402
from report import (  # noqa: E402
    fmt_cpu, fmt_disk, fmt_lat, fmt_ratio, fmt_value, geomean, is_below, judge,
    markdown_table, table_footer,
)

WORKLOADS = list(harness.WORKLOADS)




# --------------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------------


PAIRS = [("udm-zero", "nbdkit-null"), ("udm-linear", "qemu-nbd"), ("udm-linear", "nbdkit-file")]

# Issue #10's bars for udm linear over NBD, judged on the medians of one run.
BAR_FILE = {"randread-4k-qd32": 0.7, "randwrite-4k-qd32": 0.7,     # linear / fio on file
            "write-256k-qd32": 0.9, "read-256k-qd32": 0.9}
BAR_P99 = 2.0              # linear p99 / file p99 at depth 32, at most
BAR_PEER_4K_QD32 = 1.5     # linear / qemu-nbd and linear / nbdkit file at 4 KiB depth 32
BAR_PEER_OTHER = 1.0       # ... and on every other row
PEERS = ("qemu-nbd", "nbdkit-file")


def bar_lines(wl: Workload, ratio, p99_ratio, labels: dict) -> list:
    """(text, ok) for each of issue #10's bars on this workload's row; ok None = no data.
    The bars are set for one fio job: rows with more jobs are shown, not judged."""
    out = []
    if wl.jobs > 1:
        return out
    if wl.key in BAR_FILE:
        r, bar = ratio(wl, "udm-linear", "file"), BAR_FILE[wl.key]
        out.append((f"{wl.label}: udm linear / fio on file = "
                    + ("—" if r is None else f"{r:.2f}×") + f" (≥ {bar}×)",
                    None if r is None else judge(r, bar)))
    if wl.qd == 32:
        r = p99_ratio(wl)
        out.append((f"{wl.label}: p99 udm linear / fio on file = "
                    + ("—" if r is None else f"{r:.2f}×") + f" (≤ {BAR_P99}×)",
                    None if r is None else judge(r, BAR_P99, at_most=True)))
    bar = BAR_PEER_4K_QD32 if (wl.bs == "4k" and wl.qd == 32) else BAR_PEER_OTHER
    for peer in PEERS:
        r = ratio(wl, "udm-linear", peer)
        out.append((f"{wl.label}: udm linear / {labels[peer]} = "
                    + ("—" if r is None else f"{r:.2f}×") + f" (≥ {bar}×)",
                    None if r is None else judge(r, bar)))
    return out


def serial_bound_lines(results) -> list:
    """For each depth-32 row: what udm linear would reach if the transport (udm zero, same
    client) and the disk (fio on the file) took turns instead of overlapping, 1 / (1/zero +
    1/file), and how fast the transport would have to be for the file bar under that model.
    A client that processes a depth's worth of replies before it sends the next requests
    (fio's nbd engine, qemu's NBD client) meets a disk that completes a depth's worth together
    in waves, and the row lands on this bound (docs/architecture.md, "Where the time goes at
    depth 32")."""
    r = Results(results)
    out = []
    for wl in WORKLOADS:
        zero, file, linear = (r.med(wl, k) for k in ("udm-zero", "file", "udm-linear"))
        if wl.qd != 32 or wl.metric != "iops" or not (zero and file and linear):
            continue
        bound = 1 / (1 / zero + 1 / file)
        text = (f"{wl.label}: serial bound {bound / 1e3:.1f}k ({bound / file:.2f}× the file); "
                f"udm linear {linear / 1e3:.1f}k = {linear / bound:.2f}× the bound")
        bar = BAR_FILE.get(wl.key) if wl.jobs == 1 else None
        if bar:
            need = file * bar / (1 - bar)
            text += (f"; for {bar}× the file in series the transport would need "
                     f"{need / 1e3:.0f}k ({need / zero:.1f}× udm zero's)")
        out.append(text)
    return out


def tabulate(results, systems):
    """Per workload: the rows of the three tables, the bars, the ratios and results.json's
    summary; what `build_table` prints."""
    labels = {s.key: s.label for s in systems}
    keys = [s.key for s in systems]
    r = Results(results)
    cell, med, ratio = r.cell, r.med, r.ratio

    def p99_ratio(wl):
        return ratio(wl, "udm-linear", "file", "lat_p99_us")

    thr_rows, lat_rows, cpu_rows = [], [], []
    below = []
    bars = []
    ratios = {p: [] for p in PAIRS}
    summary = {}
    for wl in WORKLOADS:
        r_zero = ratio(wl, "udm-zero", "nbdkit-null")
        r_qemu = ratio(wl, "udm-linear", "qemu-nbd")
        r_nbdkit = ratio(wl, "udm-linear", "nbdkit-file")
        r_file = ratio(wl, "udm-linear", "file")
        label = wl.label + (" (IOPS)" if wl.metric == "iops" else " (MB/s)")
        flagged = [f"{a.removeprefix('udm-')} / {b}" for (a, b), r in
                   zip(PAIRS, (r_zero, r_qemu, r_nbdkit)) if is_below(r)]
        if flagged:
            below.append(f"{wl.label}: " + ", ".join(flagged))
            label = "▼ " + label
        for p, r in zip(PAIRS, (r_zero, r_qemu, r_nbdkit)):
            # The summary stays comparable with runs without --jobs.
            if r is not None and wl.jobs == 1:
                ratios[p].append(r)
        thr_rows.append([
            label,
            fmt_value(med(wl, "udm-zero"), wl.metric),
            fmt_value(med(wl, "nbdkit-null"), wl.metric),
            fmt_ratio(r_zero),
            fmt_value(med(wl, "udm-linear"), wl.metric),
            fmt_value(med(wl, "qemu-nbd"), wl.metric),
            fmt_value(med(wl, "nbdkit-file"), wl.metric),
            fmt_value(med(wl, "file"), wl.metric),
            "—" if r_file is None else f"{r_file:.2f}×",
            fmt_ratio(r_qemu),
            fmt_ratio(r_nbdkit),
        ])
        p99r = p99_ratio(wl)
        lat_rows.append([wl.label] + [fmt_lat(cell(wl, k)) for k in keys]
                        + ["—" if p99r is None else f"{p99r:.2f}×"])
        cpu_rows.append([wl.label] + [fmt_cpu(med(wl, k, "cpu_us_per_io")) for k in keys])
        row_bars = bar_lines(wl, ratio, p99_ratio, labels)
        bars += row_bars
        summary[wl.key] = {
            "metric": wl.metric,
            "systems": {s.key: None if cell(wl, s.key) is None else cell(wl, s.key).summary()
                        for s in systems},
            "ratio_zero_vs_nbdkit": r_zero,
            "ratio_linear_vs_qemu": r_qemu,
            "ratio_linear_vs_nbdkit_file": r_nbdkit,
            "ratio_linear_vs_file": r_file,
            "p99_ratio_linear_vs_file": p99r,
            "bars": [{"text": t, "ok": ok} for t, ok in row_bars],
        }
    return SimpleNamespace(thr_rows=thr_rows, lat_rows=lat_rows, cpu_rows=cpu_rows,
                           below=below, bars=bars, ratios=ratios, summary=summary,
                           cell=cell, med=med, ratio=ratio)


def build_table(results, systems, meta) -> tuple[str, dict]:
    """The report: the throughput, latency and CPU tables, the bars, the summary lines and the
    notes; and results.json's summary."""
    labels = {s.key: s.label for s in systems}
    keys = [s.key for s in systems]
    t = tabulate(results, systems)
    bars, summary, cell = t.bars, t.summary, t.cell
    out = []
    out.append(f"## udm foundation benchmark — {meta['timestamp']}")
    out.append("")
    out.append(f"Host: {meta['host']}, {meta['cpus']} CPUs, kernel {meta['kernel']}. "
               f"udm {meta['udm_commit']}. fio {meta['fio_version']}, nbd engine, one job "
               f"(rows marked 'N jobs × qdM': N jobs, one connection each), "
               f"unix socket. Runtime {meta['runtime']} s per run, export/file size "
               f"{meta['size_human']}, median of {meta['repeat']} alternating run(s).")
    out.append("")
    out.append("### Throughput")
    out.append("")
    out.append(markdown_table(
        ["workload", "udm zero", "nbdkit null", "zero / null", "udm linear", "qemu-nbd",
         "nbdkit file", "fio on file", "linear / file", "linear / qemu-nbd",
         "linear / nbdkit file"], t.thr_rows))
    out.append("")
    out.append("4k rows in IOPS, 256k rows in MB/s (10^6 B/s). Ratio = udm / peer on IOPS or MB/s "
               "(higher is better for udm); **▼** marks a ratio to a peer below 1.0×. nbdkit "
               f"file: `{meta.get('nbdkit_file_args', 'file DISK cache=none')}` (this nbdkit has "
               "no O_DIRECT option: cache=none evicts the pages it read or wrote).")
    out.append("")
    out.append("### Completion latency, mean / p99 µs (fio clat)")
    out.append("")
    out.append(markdown_table(["workload"] + [labels[k] for k in keys]
                              + ["linear p99 / file p99"], t.lat_rows))
    out.append("")
    out.append("### CPU per I/O, µs")
    out.append("")
    out.append(markdown_table(["workload"] + [labels[k] for k in keys], t.cpu_rows))
    out.append("")
    out.append("The server process's user + system time (/proc/PID/stat utime + stime, all its "
               "threads, not its children; the udm daemon for udm zero and linear) over the run, "
               "divided by the I/Os fio completed. fio on file: fio's own usr + sys CPU (no "
               "server). The fio client's CPU on the NBD rows is not included.")
    out.append("")
    disk_keys = [k for k in keys if k not in ("udm-zero", "nbdkit-null")]
    disk_rows = [[wl.label] + [fmt_disk(t.cell(wl, k)) for k in disk_keys] for wl in WORKLOADS]
    if any(cell != "—" for row in disk_rows for cell in row[1:]):
        out.append("### At the disk: mean requests in flight, mean µs each")
        out.append("")
        out.append(markdown_table(["workload"] + [labels[k] for k in disk_keys], disk_rows))
        out.append("")
        out.append("From the kernel's counters of the block device that holds the disk file "
                   "(/sys/dev/block/…/stat: completions and time_in_queue) over each fio run, "
                   "start-up included. Throughput at the disk is depth / time per request: a "
                   "server whose disk takes as long per request but sees a shallower queue "
                   "keeps it waiting for work (requests still on their way through the server "
                   "and the client).")
        out.append("")
    variants = [k for k in keys if k.startswith("v-")]
    if variants:
        out.append("### udm linear against the variants (A/B in the same run)")
        out.append("")
        rows = []
        for wl in WORKLOADS:
            rs = [t.ratio(wl, "udm-linear", k) for k in variants]
            p99 = [t.ratio(wl, "udm-linear", k, "lat_p99_us") for k in variants]
            rows.append([wl.label, fmt_value(t.med(wl, "udm-linear"), wl.metric)]
                        + [fmt_value(t.med(wl, k), wl.metric) for k in variants]
                        + ["—" if r is None else f"{r:.2f}×" for r in rs + p99])
        out.append(markdown_table(
            ["workload", "udm linear"] + [labels[k] for k in variants]
            + [f"udm / {labels[k]}" for k in variants]
            + [f"udm p99 / {labels[k]} p99" for k in variants], rows))
        for label, v in meta.get("variants", {}).items():
            out.append(f"- {label}: `{v['udm']} daemon … {' '.join(v['daemon_args'])}`")
        out.append("")
    serial = serial_bound_lines(results)
    if serial:
        out.append("### Transport and disk in series (4 KiB, depth 32)")
        out.append("")
        out += [f"- {line}" for line in serial]
        summary["_serial_bound"] = serial
        out.append("")
    out.append("### Bars (issue #10)")
    out.append("")
    for text, ok in bars:
        out.append(f"- {'?' if ok is None else ('✔' if ok else '✘')} {text}")
    met = bool(bars) and all(ok for _, ok in bars)
    summary["_bars"] = [{"text": t, "ok": ok} for t, ok in bars]
    summary["_bars_met"] = met
    out.append("")
    out.append("All bars: " + ("**met**." if met else "**not met** (✘ missed, ? not measured)."))
    gm = []
    for (a, b), rs in t.ratios.items():
        if rs:
            g = geomean(rs)
            gm.append(f"{a} / {b}: geometric mean {g:.2f}× over {len(rs)} workloads")
            summary.setdefault("_geomean", {})[f"{a}/{b}"] = g
    if gm:
        out.append("")
        out.append("Summary: " + "; ".join(gm) + ".")
    if t.below:
        out.append("")
        out.append("Below 1.0× (udm slower than its peer): " + "; ".join(t.below) + ".")
    missing = [f"{s.label} ({s.why_unavailable})" for s in systems if not s.available]
    failed = sorted({f"{s.label}" for s in systems for wl in WORKLOADS
                     if cell(wl, s.key) and cell(wl, s.key).errors})
    if missing:
        out.append("")
        out.append("Not measured: " + "; ".join(missing) + ".")
    table_footer(out, meta, failed)
    return "\n".join(out) + "\n", summary


# --------------------------------------------------------------------------------------------
# charts
# --------------------------------------------------------------------------------------------

def draw_charts(results, systems, out_dir: Path, meta) -> list:
    plt = import_pyplot("charts")
    if plt is None:
        return []

    by_key = {s.key: s for s in systems}
    colors = {"udm-zero": "#1f77b4", "nbdkit-null": "#ff7f0e", "udm-linear": "#1f77b4",
              "qemu-nbd": "#2ca02c", "nbdkit-file": "#ff7f0e", "file": "#9e9e9e"}
    caption = (f"{meta['timestamp']} · {meta['cpus']} CPUs · fio nbd engine, 1 job unless labelled, unix socket · "
               f"{meta['runtime']} s × median of {meta['repeat']} · {meta['size_human']}")
    files = []

    def med(wl, key, attr="value"):
        c = results.get((wl.key, key))
        return c.median(attr) if c else None

    charts = [
        ("foundation-zero-vs-nbdkit.png", "Transport ceiling: udm zero vs nbdkit null",
         ["udm-zero", "nbdkit-null", "file"], ("udm-zero", "nbdkit-null")),
        ("foundation-linear-vs-qemu.png",
         "Raw passthrough: udm linear vs qemu-nbd raw and nbdkit file",
         ["udm-linear", "qemu-nbd", "nbdkit-file", "file"], ("udm-linear", "qemu-nbd")),
    ]
    groups = [("iops", "IOPS (4 KiB random)", [w for w in WORKLOADS if w.metric == "iops"]),
              ("mbps", "MB/s (256 KiB sequential)", [w for w in WORKLOADS if w.metric == "mbps"])]

    for fname, title, keys, (ua, pb) in charts:
        fig, axes = plt.subplots(1, 2, figsize=(13, 5.2),
                                 gridspec_kw={"width_ratios": [2, 1]})
        for ax, (metric, ylabel, wls) in zip(axes, groups):
            n = len(keys)
            width = 0.8 / n
            xs = list(range(len(wls)))
            for i, key in enumerate(keys):
                vals = [med(w, key) or 0 for w in wls]
                label = by_key[key].label if key != "file" else "fio on file (floor)"
                bars = ax.bar([x + (i - (n - 1) / 2) * width for x in xs], vals, width,
                              label=label, color=colors.get(key, "#7e57c2"),
                              hatch="//" if key == "file" else None,
                              edgecolor="white" if key != "file" else "#555555")
                if key == ua:
                    for w, b in zip(wls, bars):
                        va, vb = med(w, ua), med(w, pb)
                        if va and vb:
                            r = va / vb
                            ax.annotate(f"{r:.2f}×", (b.get_x() + b.get_width() / 2,
                                                      b.get_height()),
                                        ha="center", va="bottom", fontsize=8,
                                        color="#c62828" if is_below(r) else "#1b5e20",
                                        fontweight="bold")
            bar_axes(ax, xs, [w.label for w in wls], ylabel)
        axes[0].legend(fontsize=9, loc="upper left")
        fig.suptitle(title + f"  (ratio = udm / {by_key[pb].label} above the udm bar)")
        fig.text(0.5, 0.01, caption, ha="center", fontsize=8, color="#555555")
        fig.tight_layout(rect=(0, 0.04, 1, 0.95))
        path = out_dir / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)

    files.append(draw_latency_chart(plt, by_key, med, caption, out_dir))
    return files

def draw_latency_chart(plt, by_key: dict, med, caption: str, out_dir: Path) -> Path:
    """Latency at queue depth 1: mean bars with the p99 as an error whisker."""
    wls = [w for w in WORKLOADS if w.qd == 1]
    keys = ["udm-zero", "nbdkit-null", "udm-linear", "qemu-nbd", "nbdkit-file", "file"]
    lat_colors = {"udm-zero": "#1f77b4", "nbdkit-null": "#ff7f0e", "udm-linear": "#0d47a1",
                  "qemu-nbd": "#2ca02c", "nbdkit-file": "#e65100", "file": "#9e9e9e"}
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        means = [med(w, key, "lat_mean_us") or 0 for w in wls]
        p99s = [med(w, key, "lat_p99_us") or 0 for w in wls]
        xs = [x + (i - (len(keys) - 1) / 2) * width for x in range(len(wls))]
        ax.bar(xs, means, width, label=by_key[key].label if key != "file" else "fio on file",
               color=lat_colors.get(key, "#7e57c2"), hatch="//" if key == "file" else None,
               yerr=[[0] * len(wls), [max(p - m, 0) for p, m in zip(p99s, means)]],
               capsize=3, error_kw={"elinewidth": 1, "ecolor": "#333333"})
    bar_axes(ax, range(len(wls)), [w.label for w in wls],
             "completion latency, µs (bar = mean, whisker = p99)", fontsize=10)
    ax.legend(fontsize=9)
    fig.suptitle("Latency at iodepth 1 (lower is better)")
    fig.text(0.5, 0.01, caption, ha="center", fontsize=8, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    path = out_dir / "foundation-latency-qd1.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
