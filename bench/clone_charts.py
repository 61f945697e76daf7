"""The clone benchmark's charts: the matrix per workload and the hydration runs (`Charts`, a
part of `clone.Bench`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import human_size  # noqa: E402
from clone_report import (  # noqa: E402
    BAR_HYDRATION, BAR_INTERFERENCE, COLORS, LABELS, WORKLOADS, log, ratio, region_label,
)


class Charts:
    """The PNG charts of a run: mixed into `clone.Bench`, whose results they draw."""

    def draw_charts(self, meta: dict) -> list:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception as e:  # pragma: no cover
            log(f"NOTE: matplotlib is not available ({e}); charts skipped "
                f"(apt-get install python3-matplotlib)")
            return []
        regions = self.args.regions
        keys = ["clone"] + (["qcow2"] if self.qcow2_available else []) + \
            (["cow"] if self.cow_available else [])
        caption = (f"{meta['timestamp']} · {meta['cpus']} CPUs · fio nbd engine, 1 job · "
                   f"{self.args.runtime} s per run · {human_size(self.size)} · fresh unhydrated "
                   f"volume per bar · slow source = 1 ms per read · seed: dm-clone 4 KiB region "
                   f"randwrite 62,347 IOPS vs 64,490 raw SSD (97 %)")
        files = []
        wls = [wl for wl in WORKLOADS if any(k[0] == wl.key for k in self.results)]
        if wls:
            files.append(self.draw_matrix(plt, wls, keys, regions, caption))
        self.draw_hydration(plt, meta, files)
        return files

    def draw_matrix(self, plt, wls, keys, regions, caption) -> Path:
        cols = min(3, len(wls))
        rows = -(-len(wls) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.3 * cols, 4.5 * rows), squeeze=False)
        for ax in list(axes.flat)[len(wls):]:
            ax.set_visible(False)
        for ax, wl in zip(axes.flat, wls):
            n = len(keys)
            width = 0.8 / n
            xs = list(range(len(regions)))
            for i, key in enumerate(keys):
                vals = []
                for kib in regions:
                    r = self.results.get((wl.key, key, kib))
                    vals.append(r.value() if r and r.value() else 0)
                bars = ax.bar([x + (i - (n - 1) / 2) * width for x in xs], vals, width,
                              label=LABELS[key], color=COLORS[key])
                if key == "clone" and "qcow2" in keys:
                    for kib, b in zip(regions, bars):
                        r = ratio(self.results.get((wl.key, "clone", kib)),
                                  self.results.get((wl.key, "qcow2", kib)))
                        if r is not None and b.get_height() > 0:
                            ax.annotate(f"{r:.1f}×", (b.get_x() + b.get_width() / 2,
                                                      b.get_height()),
                                        ha="center", va="bottom", fontsize=7,
                                        color="#c62828" if r < 1 else "#1b5e20")
            for key, style in (("linear", "--"), ("source", ":")):
                r = self.results.get((wl.key, key, None))
                if r and r.value():
                    ax.axhline(r.value(), color=COLORS[key], linestyle=style, linewidth=1.2,
                               label=LABELS[key])
            ax.set_yscale("log")
            ax.set_xticks(xs)
            ax.set_xticklabels([region_label(k) for k in regions], fontsize=8)
            ax.set_xlabel("region / cluster / block size", fontsize=8)
            ax.set_ylabel("IOPS" if wl.metric == "iops" else "MB/s")
            ax.set_title(wl.label, fontsize=10)
            ax.grid(axis="y", alpha=0.3, which="both")
            ax.set_axisbelow(True)
            ax.legend(fontsize=7)
        fig.suptitle("udm clone vs qemu qcow2 overlay vs nbdkit cow over a slow (1 ms) source "
                     "(log scale; clone / qcow2 above the clone bar)")
        fig.text(0.5, 0.01, caption, ha="center", fontsize=7, color="#555555")
        fig.tight_layout(rect=(0, 0.03, 1, 0.96))
        path = self.out_dir / "clone-workloads.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def draw_hydration(self, plt, meta, files) -> None:
        """clone-hydration.png: hydration against the source (left) and user I/O while
        hydrating (right)."""
        hy = self.extras.get("hydration") or {}
        it = self.extras.get("interference") or {}
        if hy or it:
            fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
            self.draw_hydration_runs(a1, hy)
            if it:
                self.draw_interference(a2, it)
            else:
                a2.set_visible(False)
            hvol = next(iter(hy.values()))["volume_bytes"] if hy else None
            ivol = it.get("volume_bytes") if it else None
            vols = " / ".join(f"{what} {human_size(v)}" for what, v in
                              (("hydration", hvol), ("interference", ivol)) if v)
            fig.text(0.5, 0.01, f"{meta['timestamp']} · {meta['cpus']} CPUs · fio nbd engine, "
                     f"1 job · {self.args.runtime} s fio runs · volume {vols}, "
                     f"64 KiB regions, hydration_threshold 1024, hydration_batch_size 16",
                     ha="center", fontsize=7, color="#555555")
            fig.tight_layout(rect=(0, 0.04, 1, 1))
            path = self.out_dir / "clone-hydration.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            files.append(path)

    def draw_hydration_runs(self, a1, hy: dict) -> None:
        """Per source kind: its sequential read bandwidth beside the hydration's."""
        kinds = list(hy)
        xs = list(range(len(kinds)))
        a1.bar([x - 0.2 for x in xs], [hy[k].get("source_mbps") or 0 for k in kinds], 0.4,
               label="source seq read (1 MiB qd8)", color="#9e9e9e")
        b = a1.bar([x + 0.2 for x in xs], [hy[k].get("mbps") or 0 for k in kinds], 0.4,
                   label="background hydration", color=COLORS["clone"])
        for k, bb in zip(kinds, b):
            f = hy[k].get("fraction")
            if f is None:
                continue
            if hy[k].get("same_disk", k != "remote"):
                fc = hy[k].get("fraction_of_ceiling")
                text = f"{f:.2f}× src" + (f"\n{fc:.2f}× ceiling" if fc is not None else "")
                color = "#555555"
            else:
                text = f"{f:.2f}× (bar)"
                color = "#c62828" if f < BAR_HYDRATION else "#1b5e20"
            a1.annotate(text, (bb.get_x() + bb.get_width() / 2, bb.get_height()),
                        ha="center", va="bottom", fontsize=8, color=color)
        ceil = (self.extras.get("copy_ceiling") or {}).get("read_mbps")
        same_xs = [x for x, k in zip(xs, kinds) if hy[k].get("same_disk", k != "remote")]
        if ceil and same_xs:
            a1.hlines(ceil, min(same_xs) - 0.45, max(same_xs) + 0.45, color="#c62828",
                      linestyle=":", linewidth=1.2, label="same-disk copy ceiling (read side)")
        a1.set_xticks(xs)
        a1.set_xticklabels([{"remote": f"remote NBD\n(rate={self.REMOTE_RATE})",
                             "plain": "plain file\n(same disk)",
                             "delayed": "delayed 1 ms\n(same disk)"}.get(k, k)
                            for k in kinds], fontsize=8)
        a1.set_ylabel("MB/s")
        a1.set_title(f"Hydration, no user I/O (bar ≥ {BAR_HYDRATION}×, remote only)",
                     fontsize=10)
        top = max([hy[k].get(f) or 0 for k in kinds for f in ("source_mbps", "mbps")]
                  + [ceil or 0, 1])
        a1.set_ylim(0, top * 1.3)
        a1.legend(fontsize=7, loc="upper center", ncol=3)
        a1.grid(axis="y", alpha=0.3)

    def draw_interference(self, a2, it: dict) -> None:
        """Per pair and their medians: user IOPS on the idle clone beside while hydrating."""
        pairs = it.get("pairs", [])
        labels = [f"pair {n}" for n in range(1, len(pairs) + 1)] + ["median"]
        idle = [p.get("idle", {}).get("iops") or 0 for p in pairs] + \
            [it.get("median_idle_iops") or 0]
        hyd = [p.get("hydrating", {}).get("iops") or 0 for p in pairs] + \
            [it.get("median_hydrating_iops") or 0]
        xs2 = list(range(len(labels)))
        a2.bar([x - 0.2 for x in xs2], idle, 0.4, label="idle clone", color="#9e9e9e")
        bb = a2.bar([x + 0.2 for x in xs2], hyd, 0.4, label="while hydrating",
                    color=COLORS["clone"])
        fr = [p.get("fraction") for p in pairs] + [it.get("fraction")]
        for n, (f, bar) in enumerate(zip(fr, bb)):
            if f is None:
                continue
            last = n == len(fr) - 1
            a2.annotate(f"{f:.2f}×" + (" (bar)" if last else ""),
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8,
                        color=("#c62828" if f < BAR_INTERFERENCE else "#1b5e20")
                        if last else "#555555")
        a2.set_xticks(xs2)
        a2.set_xticklabels(labels)
        a2.set_ylabel("IOPS")
        a2.set_title(f"4 KiB randread qd32, median hydrating / median idle "
                     f"(bar ≥ {BAR_INTERFERENCE}×)", fontsize=10)
        a2.set_ylim(0, max(idle + hyd + [1]) * 1.25)
        a2.legend(fontsize=7, loc="upper center", ncol=2)
        a2.grid(axis="y", alpha=0.3)
