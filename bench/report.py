"""What every udm benchmark report is made of: sizes, numbers and ratios as the tables print
them, markdown tables and their footers, and the results files.  Shared by foundation.py,
clone.py, fuse.py and scale.py; it imports none of them.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = 1
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if t and t[-1] in units:
        mult = units[t[-1]]
        t = t[:-1]
    try:
        value = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 256M, 1G)")
    size = int(value * mult)
    if size <= 0 or size % (1 << 20):
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 1 MiB")
    return size


def geomean(ratios) -> float:
    """The geometric mean of positive ratios: how a run of them is summed up."""
    ratios = list(ratios)
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def human_size(n: int) -> str:
    for unit, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def fmt_value(v, metric: str) -> str:
    if v is None:
        return "—"
    if metric == "iops":
        return f"{v / 1000:.1f}k" if v >= 1000 else f"{v:.0f}"
    return f"{v:.0f} MB/s"


def is_below(r) -> bool:
    """Below 1.0x as printed (0.996 prints as 1.00x and is not flagged)."""
    return r is not None and round(r, 2) < 1.0


def fmt_ratio(r) -> str:
    if r is None:
        return "—"
    if is_below(r):
        return f"**{r:.2f}× ▼**"
    return f"{r:.2f}×"


def fmt_disk(cell) -> str:
    """Mean requests in flight at the disk, and mean µs each, of a cell (harness.Cell)."""
    if cell is None:
        return "—"
    depth, us = cell.median("disk_depth"), cell.median("disk_us")
    return "—" if depth is None or us is None else f"{depth:.1f}, {us:.0f} µs"


def fmt_lat(cell) -> str:
    """Mean / p99 latency of a cell (harness.Cell), in µs."""
    if cell is None:
        return "—"
    m, p = cell.median("lat_mean_us"), cell.median("lat_p99_us")
    if m is None:
        return "—"
    return f"{m:.0f} / {p:.0f}" if p is not None else f"{m:.0f} / ?"


def fmt_cpu(v) -> str:
    if v is None:
        return "—"
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def judge(r, bar: float, at_most: bool = False) -> bool:
    """A bar on a ratio as printed (two decimals): r ≥ bar, or r ≤ bar with `at_most`."""
    return round(r, 2) <= bar if at_most else round(r, 2) >= bar


def markdown_table(header, rows) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def table_footer(out: list, meta: dict, failed) -> None:
    """Append the notes and the systems with failed runs to a table's lines."""
    if meta.get("notes"):
        out.append("")
        out.append("Notes: " + "; ".join(meta["notes"]) + ".")
    if failed:
        out.append("")
        out.append("Runs with errors (see results.json and the *.err files): "
                   + ", ".join(failed) + ".")


def page_cache_note(name: str, size: int, before, after, why: str):
    """A note when more than 1% (at least 1 MiB) of a file entered the page cache."""
    if before is not None and after is not None and \
            after - before > max(size // 100, 1 << 20):
        return (f"{(after - before) >> 20} MiB of {name} entered the page "
                f"cache during the runs although every {why}")
    return None


def write_results(out_dir: Path, table: str, payload: dict) -> None:
    """Print the table and write table.md and results.json."""
    print()
    print(table)
    (out_dir / "table.md").write_text(table)
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")


def exit_code(results: dict) -> int:
    """0 when every cell has samples and no errors, 3 when some failed, 1 when none ran."""
    any_ok = any(c.samples for c in results.values())
    any_err = any(c.errors for c in results.values())
    return 0 if any_ok and not any_err else (3 if any_ok else 1)
