"""Human (rich) and machine (JSON) output of the operator commands: `ecd status|keys|evict|bench`.

Nothing here talks to the daemon: each function turns a plain dict into text, so the formatting
can be read (and changed) apart from the request logic in cli.py and bench.py.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def stdout_console() -> Console:
    # Piped into grep or a file: do not wrap rows at 80 columns (a terminal keeps its own width).
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, width=200 if wide else None)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def shown(name: str) -> str:
    """A key or namespace (chosen by any tenant) as inert text: characters that are not printable
    (ESC and other controls, CR/LF, bidi overrides, zero-width ones) spelled as Python escapes, so
    nothing a tenant names can move the cursor, retitle the operator's terminal or hide its name."""
    if name.isprintable():
        return name
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in name)


def shown_list(names: Sequence[str]) -> str:
    """Names joined for a console.print with markup: escaped for rich as well."""
    return escape(", ".join(shown(n) for n in names))


def print_json(doc: Any) -> None:
    """One JSON document on stdout (and nothing else goes there with --json)."""
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False, allow_nan=False) + "\n")
    sys.stdout.flush()


def human_size(n: float) -> str:
    """1536 -> '1.5 KiB', 1572864 -> '1.5 MiB', 512 -> '512 B', 64 << 20 -> '64 MiB'."""
    n = float(n)
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.1f} {unit}" if abs(n) < 100 and n != int(n) else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """0.25 -> '250ms', 42 -> '42.0s', 3700 -> '1h01m', 200000 -> '2d07h'."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def percent(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0


# ---- status ------------------------------------------------------------------------------

def render_status(doc: dict, console: Console) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("daemon", f"ecd {doc['version']} on node {doc['node']} (epoch {doc['epoch']})")
    grid.add_row("endpoint", doc["endpoint"])
    grid.add_row("uptime", human_duration(doc["uptime_s"]))
    entries = doc["entries"]
    grid.add_row("entries", f"{entries['ready']} ready, {entries['writing']} writing, "
                            f"{entries['retired']} retired (draining readers), "
                            f"{entries['reservations']} reservations ({human_size(entries['reserved_bytes'])})")
    grid.add_row("clients", f"{doc['clients']} connected (not counting this command)")
    grid.add_row("holds", f"{doc['read_leases']} read leases, {doc['pins']} pins, {doc['waiters']} waiters")
    lookups = doc["hits"] + doc["misses"]
    hit = "n/a (no lookups yet)" if doc["hit_rate"] is None else f"{doc['hit_rate'] * 100:.1f}%"
    grid.add_row("hit rate", f"{hit}  ({doc['hits']} hits / {lookups} lookups)")
    ops = "n/a (--interval 0)" if doc["ops_per_s"] is None else \
        f"{doc['ops_per_s']:.1f} ops/s (over {doc['interval_s']:.1f}s, not counting this command)"
    grid.add_row("requests", ops)
    grid.add_row("evictions", f"{doc['evictions']} (LRU), {doc['reclaimed_sessions']} sessions reclaimed, "
                              f"{doc['expired_writes']} writes expired")
    if doc.get("restart"):
        grid.add_row("start", restart_line(doc["restart"]))
    if doc.get("events"):
        ev = doc["events"]
        grid.add_row("kv events", f"{' + '.join(ev['endpoints'])}: {ev['events']} events in {ev['batches']} batches, "
                                  f"{ev['waiting']} waiting, {ev['dropped']} dropped, {ev['resyncs']} resyncs, "
                                  f"{ev['replays']} replays ({ev['bad_replay_requests']} bad requests ignored)")
    if doc["errors"]:
        grid.add_row("errors", ", ".join(f"{k}={v}" for k, v in sorted(doc["errors"].items())))
    console.print(grid)

    pools = Table(title="pools", title_justify="left", show_edge=False)
    pools.add_column("segment")
    for name in ("used", "capacity", "used %"):
        pools.add_column(name, justify="right")
    for i, p in enumerate(doc["pools"]):
        pools.add_row(str(i), human_size(p["used_bytes"]), human_size(p["capacity_bytes"]), f"{p['used_pct']:.1f}%")
    pools.add_row("total", human_size(doc["used_bytes"]), human_size(doc["capacity_bytes"]),
                  f"{doc['used_pct']:.1f}%", style="bold")
    console.print(pools)
    render_sessions(doc.get("sessions") or [], console)
    render_disk(doc.get("disk"), console)
    render_peers(doc.get("cluster") or {}, console)


SESSIONS_SHOWN = 50  # rows of the sessions table; --json lists them all


def render_sessions(sessions: list[dict], console: Console) -> None:
    """Each client session: who the kernel says it is and how the daemon learns it is gone."""
    if not sessions:
        return
    table = Table(title="sessions", title_justify="left", show_edge=False)
    tenants = any(s.get("tenant") for s in sessions)  # [tenants.NAME] configured: whose each one is
    for name in ("id", "name", "pid", "pid namespace", "uid", "gid", "watched by") + (("tenant",) if tenants else ()):
        table.add_column(name, justify="right" if name in ("id", "pid", "uid", "gid") else "left")
    for s in sessions[:SESSIONS_SHOWN]:
        remote = s["uid"] < 0
        pid = "-" if remote else str(s["pid"]) if s["pid"] else "0 (another pid namespace)"
        ns = "-" if remote or not s["pid_ns"] else f"{s['pid_ns']}{' (its claim)' if s['pid_ns_claimed'] else ''}"
        watch = "pidfd" if s["watch"] == "pidfd" else "heartbeat (leases.session_ttl)"
        table.add_row(str(s["id"]), escape(shown(s["name"])) or "-", pid, ns, "-" if remote else str(s["uid"]),
                      "-" if remote else str(s["gid"]), watch, *((s.get("tenant") or "default",) if tenants else ()))
    if len(sessions) > SESSIONS_SHOWN:
        table.add_row("...", f"{len(sessions) - SESSIONS_SHOWN} more (ecd status --json lists all)",
                      *[""] * (len(table.columns) - 2))
    console.print(table)


def restart_line(restart: dict) -> str:
    """How the daemon's start went ([restart]): the pool adopted, and how long that took, or cold."""
    keeper = "not kept across restarts" if restart["keeper"] == "none" else f"kept by {restart['keeper']}"
    if restart["adopted"]:
        how = (f"adopted {restart['entries']} entries ({human_size(restart['bytes'])}) in {restart['seconds']:.3f}s, "
               f"{restart['quarantined']} unfinished writes quarantined, {restart['skipped_records']} records skipped")
    else:
        how = "cold" + (f" (not adopted: {restart['refused']})" if restart["refused"] else "")
    full = f", {restart['journal_full']} entries not journaled (journal full)" if restart["journal_full"] else ""
    return f"{how}; pool {keeper}, {restart['journal_records']} journal records{full}"


def render_disk(disk: dict | None, console: Console) -> None:
    """The disk tier's part of `ecd status` (nothing without [pool.disk])."""
    if not disk:
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    io = "O_DIRECT" if disk["direct_io"] else "buffered I/O"
    grid.add_row("disk tier", f"{shown(disk['path'])} ({io}): {human_size(disk['used_bytes'])} of "
                              f"{human_size(disk['capacity_bytes'])} "
                              f"({percent(disk['used_bytes'], disk['capacity_bytes']):.1f}%), {disk['entries']} "
                              f"records ({disk['persisted_entries']} persisted)")
    grid.add_row("disk traffic", f"{disk['spills']} spills, {disk['promotions']} promotions, "
                                 f"{disk['writes_in_flight']} writes in flight "
                                 f"({human_size(disk['spill_buffer_bytes'])} in the spill buffer); "
                                 f"{disk['loaded']} records re-indexed at start in {disk['load_s']:.2f}s")
    problems = [f"{disk['integrity_failures']} corrupt records removed"] if disk["integrity_failures"] else []
    problems += [f"{k}={v}" for k, v in sorted(disk["errors"].items())]
    problems += [f"not spilled ({k})={v}" for k, v in sorted(disk["dropped"].items())]
    grid.add_row("disk problems", ", ".join(problems) or "none")
    if disk.get("degraded"):  # the filesystem refuses writes: records served, writes fail until it takes one
        grid.add_row("disk DEGRADED", f"{disk['degraded']} (for {disk.get('degraded_s', 0.0):.0f}s; "
                                      "records served; writes that do not fit fail; probed every second until one succeeds)")
    console.print(grid)


def render_peers(cluster: dict, console: Console) -> None:
    """The peer plane's part of `ecd status` (nothing without [cluster])."""
    if not cluster.get("listen"):
        return
    failures = ", ".join(f"{k}={v}" for k, v in sorted(cluster["fetch_failures"].items())) or "none"
    console.print(f"peer plane on {cluster['listen']}: {cluster['transfer_leases']} transfer leases, "
                  f"{cluster['fetches_in_flight']} keys being fetched, failures: {failures}")
    peers = Table(title="peers", title_justify="left", show_edge=False)
    for name in ("endpoint", "node", "state"):
        peers.add_column(name)
    for name in ("fetched", "served", "failures"):
        peers.add_column(name, justify="right")
    for p in cluster["peers"]:
        peers.add_row(p["endpoint"] + ("" if p["configured"] else " (named)"), p["node"] or "?", p["state"],
                      f"{p['fetched_entries']} ({human_size(p['fetched_bytes'])})",
                      f"{p['served_entries']} ({human_size(p['served_bytes'])})", str(p["failures"]))
    console.print(peers)
    d = cluster.get("directory")
    if d:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(d["counts"].items()))
        console.print(f"directory {d['url']}: {'up' if d['up'] else 'DOWN'}, {len(d['nodes'])} live node(s) "
                      f"({', '.join(d['nodes'])}); {counts}")


# ---- keys --------------------------------------------------------------------------------

def render_keys(total: int, entries: Sequence[dict], console: Console) -> None:
    table = Table(show_edge=False)
    table.add_column("namespace")
    table.add_column("key", overflow="fold", min_width=10)  # on a narrow terminal the key stays whole
    for name in ("size", "dtype", "shape", "age", "idle", "readers", "pins", "tier"):
        table.add_column(name, justify="left" if name in ("dtype", "shape", "tier") else "right")
    for e in entries:
        # Text: a key like "[/bold]" is a name, not rich markup (which would fail or restyle it).
        table.add_row(Text(shown(e["ns"])), Text(shown(e["key"])), human_size(e["nbytes"]), e["dtype"],
                      "[" + ", ".join(map(str, e["shape"])) + "]", human_duration(e["age_s"]),
                      human_duration(e["idle_s"]), str(e["readers"]), str(e["pins"]), e.get("tier", "memory"))
    if entries:
        console.print(table)
    console.print(f"showing {len(entries)} of {total}")


# ---- evict -------------------------------------------------------------------------------

def render_evict(doc: dict, console: Console) -> None:
    console.print(f"evicted {doc['evicted']} entr{'y' if doc['evicted'] == 1 else 'ies'}")
    if doc["refused"]:
        console.print(f"[bold red]refused[/] {len(doc['refused'])} (leased or pinned; --force evicts them): "
                      + shown_list(doc["refused"]))
    if doc["missing"]:
        console.print(f"missing {len(doc['missing'])}: " + shown_list(doc["missing"]))
    if doc["draining"]:
        if doc["drained"]:
            console.print(f"{len(doc['draining'])} forced entr{'y' if len(doc['draining']) == 1 else 'ies'}: "
                          f"readers let go after {doc['drain_wait_s']:.2f}s, memory freed")
        else:
            console.print(f"[bold red]drain timed out[/]: {doc['still_held']} of {len(doc['draining'])} "
                          f"forced entries still held by readers after {doc['drain_wait_s']:.1f}s "
                          "(their memory is freed when the readers release)")


# ---- bench -------------------------------------------------------------------------------

def render_bench(doc: dict, console: Console) -> None:
    console.print(f"{doc['clients']} client(s), {doc['elapsed_s']:.2f}s, op={doc['op']}, "
                  f"endpoint {doc['endpoint']}")
    table = Table(show_edge=False)
    table.add_column("op", justify="left")
    for name in ("size", "ops", "ops/s", "GB/s", "p50", "p90", "p99", "errors"):
        table.add_column(name, justify="right")
    for r in doc["results"]:
        table.add_row(r["op"], human_size(r["size"]), str(r["ops"]), f"{r['ops_per_s']:.1f}",
                      f"{r['gb_per_s']:.3f}", _ms(r["p50_ms"]), _ms(r["p90_ms"]), _ms(r["p99_ms"]),
                      str(r["errors"]))
    t = doc["total"]
    table.add_row("total", "", str(t["ops"]), f"{t['ops_per_s']:.1f}", f"{t['gb_per_s']:.3f}", "", "", "",
                  str(t["errors"]), style="bold")
    console.print(table)
    console.print(f"latencies are per call, as a client sees them; cleanup evicted {doc['cleanup']['evicted']} "
                  f"bench entr{'y' if doc['cleanup']['evicted'] == 1 else 'ies'}")


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}µs" if value < 1 else f"{value:.2f}ms"
