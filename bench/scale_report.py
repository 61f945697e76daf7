"""The scale benchmark's report: the connection runs' table, the flood, and issue #10's bars.
scale.py runs, this module reports.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import markdown_table, table_footer  # noqa: E402

# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------

def med(runs: list, attr: str):
    vals = [getattr(r, attr) for r in runs if getattr(r, attr) is not None]
    return statistics.median(vals) if vals else None


def mib(n) -> str:
    return "—" if not n else f"{n / (1 << 20):.0f} MiB"


def fmt_iops(v) -> str:
    return "—" if v is None else f"{v / 1000:.1f}k"


def mark(ok) -> str:
    return "?" if ok is None else ("✔" if ok else "✘")


def build_report(meta: dict, runs: dict, fl: dict | None, args) -> tuple[str, dict]:
    """The report: the connection runs' table, the flood, the bars; and results.json's
    summary."""
    n_conn = args.connections
    cpus = meta["cpus"]
    out = [f"## udm scale benchmark — {meta['timestamp']}", ""]
    out.append(f"Host: {meta['host']}, {cpus} CPUs, kernel {meta['kernel']}. udm "
               f"{meta['udm_commit']}, daemon flags: `{' '.join(meta['daemon_flags']) or '—'}`. "
               f"{meta['fio_version']}, nbd engine, unix socket, one `linear` device over a "
               f"fully written {meta['size_human']} file. {args.runtime} s per run, median of "
               f"{args.repeat} alternating run(s).")
    out.append("")
    out.append(f"### {n_conn} connections vs 1 — 4 KiB random reads, iodepth 32 per connection")
    out.append("")
    summary = connections_table(out, runs, n_conn)
    bars = connection_bars(summary, runs, args, cpus)
    flood_section(out, bars, fl, summary, args)
    out.append("")
    out.append("### Bars (issue #10)")
    out.append("")
    for text, ok in bars:
        out.append(f"- {'·' if ok == 'reported' else mark(ok)} {text}")
    judged = [ok for _, ok in bars if ok != "reported"]
    met = bool(judged) and all(ok is True for ok in judged)
    out.append("")
    out.append("All bars: " + ("**met**." if met else "**not met** (✘ missed, ? not measured)")
               + " (· reported, not judged)")
    summary["_bars"] = [{"text": t, "ok": ok} for t, ok in bars]
    summary["_bars_met"] = met
    table_footer(out, meta, [])
    return "\n".join(out) + "\n", summary


def connections_table(out: list, runs: dict, n_conn: int) -> dict:
    """The table of the 1- and the many-connection runs, into `out`; their summary."""
    rows, summary = [], {}
    for jobs in (1, n_conn):
        rs = runs.get(jobs, [])
        ok = [r for r in rs if r.error is None]
        worst = {k: max((r.daemon.get(k) or 0 for r in rs), default=0)
                 for k in ("threads_max", "rss_max", "vm_hwm", "connections_max")}
        errors = [r.error for r in rs if r.error]
        summary[str(jobs)] = {"median_iops": med(ok, "iops"),
                              "median_lat_p99_us": med(ok, "lat_p99_us"),
                              "median_cpu_us_per_io": med(ok, "cpu_us_per_io"),
                              **worst, "errors": errors, "runs": [r.__dict__ for r in rs]}
        p99 = med(ok, "lat_p99_us")
        cpu = med(ok, "cpu_us_per_io")
        rows.append([str(jobs), fmt_iops(med(ok, "iops")),
                     ", ".join(fmt_iops(r.iops) for r in rs),
                     "—" if p99 is None else f"{p99:.0f}",
                     "—" if cpu is None else f"{cpu:.1f}",
                     str(worst["threads_max"]), mib(worst["rss_max"]), mib(worst["vm_hwm"]),
                     str(worst["connections_max"]),
                     "none" if not errors else f"**{len(errors)} run(s)**"])
    out.append(markdown_table(["connections", "total IOPS", "every run", "p99 µs",
                               "daemon CPU µs/IO", "daemon threads (max)", "daemon RSS (max)",
                               "daemon VmHWM", "connections held (max)", "fio errors"], rows))
    out.append("")
    out.append("Threads: entries of /proc/PID/task, RSS: VmRSS of /proc/PID/status, both the "
               "most seen in samples every 100 ms over every run of the row; VmHWM: the "
               "daemon's peak RSS since it started (so the 64-connection row's includes "
               "everything before). Connections: the server ends of connected sockets on the "
               "listener's path in /proc/net/unix. CPU: the daemon's utime + stime over the run "
               "/ I/Os.")
    return summary


def connection_bars(summary: dict, runs: dict, args, cpus: int) -> list:
    """The bars the connection runs are judged on: (text, ok, or "reported")."""
    n_conn = args.connections
    bars = []
    one, many = summary["1"]["median_iops"], summary[str(n_conn)]["median_iops"]
    r = many / one if one and many else None
    summary["ratio_many_vs_one"] = r
    bars.append((f"{n_conn} connections' total IOPS / 1 connection's = "
                 + ("—" if r is None else f"{r:.2f}×") + " (≥ 1.0×)",
                 None if r is None else round(r, 2) >= 1.0))
    errs = summary[str(n_conn)]["errors"] + summary["1"]["errors"]
    bars.append((f"fio errors in the connection runs: {len(errs)} (must be 0)"
                 + (f": {errs[0][:200]}" if errs else ""),
                 None if not runs else not errs))
    threads = summary[str(n_conn)]["threads_max"]
    if args.pool_threads is not None:
        limit = 2 * cpus + args.pool_threads
        bars.append((f"daemon threads with {n_conn} connections: {threads} (≤ 2 × {cpus} cores "
                     f"+ {args.pool_threads} pool = {limit})", threads <= limit))
    else:
        bars.append((f"daemon threads with {n_conn} connections: {threads} (bar: ≤ 2 × {cpus} "
                     f"cores + the worker pool; give the pool size with --pool-threads to judge)",
                     "reported"))
    bars.append((f"daemon RSS with {n_conn} connections: "
                 f"{mib(summary[str(n_conn)]['rss_max'])} (reported)", "reported"))

    return bars


def flood_section(out: list, bars: list, fl: dict | None, summary: dict, args) -> None:
    """What the flood did, into `out`, and its bars into `bars`."""
    out.append("")
    out.append(f"### Flood — {args.flood} raw connections from one uid while fio runs")
    out.append("")
    if fl:
        fio = fl["fio"]
        oc = fl["outcome"]
        refused = {k.removeprefix("refused: "): v for k, v in oc.items()
                   if k.startswith("refused: ")}
        one_iops = summary["1"]["median_iops"]
        out.append(f"- fio (1 job, 4 KiB random reads, iodepth 32, {fl['fio_seconds']} s): "
                   + ((f"completed, {fmt_iops(fio['iops'])} IOPS"
                       + (f" ({fio['iops'] / one_iops:.2f}× the 1-connection median)"
                          if one_iops and fio["iops"] else "")
                       + ", no error") if fio["error"] is None
                      else f"**failed**: {fio['error']}")
                   + ".")
        out.append(f"- {args.flood} connections opened one after another in "
                   f"{fl.get('open_seconds', '?')} s (fio still running when all were open: "
                   f"{'yes' if fl.get('fio_running_when_open') else '**no**'}): "
                   f"{oc.get('served', 0)} served and held idle; "
                   + (", ".join(f"{v} refused with \"{k}\"" for k, v in refused.items())
                      or "none refused")
                   + f"; {oc.get('closed without a word', 0)} closed without a word"
                   + "".join(f"; {v} {k}" for k, v in oc.items() if k.startswith("error: "))
                   + ".")
        out.append(f"- Connections the daemon held once the flood was open: "
                   f"{fl.get('connections_held')} (fio's one included); daemon threads (max) "
                   f"{fio['daemon'].get('threads_max')}, RSS (max) "
                   f"{mib(fio['daemon'].get('rss_max'))}.")
        out.append(f"- Which limit bit: {fl['limit_bit']}.")
        out.append(f"- After the clients left: {fl['connections_left']} connection(s) left, a "
                   f"new client {'served' if fl.get('served_after') else '**not served**'}; "
                   f"daemon {'alive' if fl['daemon_alive'] else '**dead**'}.")
        bars.append(("flood: fio completed with no error", fio["error"] is None))
        bars.append(("flood: every slot given back (no connection left, a new client served)",
                     fl["connections_left"] == 0 and bool(fl.get("served_after"))))
    else:
        out.append("Not run.")

def limit_bit(refused: dict, flags: dict) -> str:
    """Which of the daemon's connection limits the flood's refusals name."""
    texts = " ".join(refused)
    per_client = "per client" in texts
    server = "server's limit" in texts
    if not refused:
        return "none (no connection was refused)"
    parts = []
    if server:
        parts.append("the server-wide limit (--nbd-max-connections"
                     + (f" {flags['--nbd-max-connections']}" if "--nbd-max-connections" in flags
                        else ", not settable in this build: 256") + ")")
    if per_client:
        parts.append("the per-client limit (--nbd-max-connections-per-client"
                     + (f" {flags['--nbd-max-connections-per-client']}"
                        if "--nbd-max-connections-per-client" in flags else ", default 64")
                     + "): the flood and fio share one uid")
    return " and ".join(parts) or f"unrecognised refusal message(s): {texts[:200]}"
