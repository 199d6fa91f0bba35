#!/usr/bin/env python3
"""Restart without a cold cache (issue 27): how long a restarted daemon takes to serve N entries
again when it adopts its pool, against a cold restart that refills from the disk tier, and the
new daemon's memory.

Two pool sizes with the same entry count (--entries, default 100,000): a small pool (--small-pool,
default 1 GiB: ~10 KiB entries) and a big one (--pool-size, default 16 GiB: ~160 KiB entries), so
that what grows with the pool, and not with the entries, shows. Per pool size, --reps pairs, the
order inside a pair alternating:

- adopt: a daemon (`[restart] adopt = true`, the default; keeper "auto": the holder process) is
  filled with N entries (put_many, batches of --batch), stopped with SIGTERM and started again.
- cold: a daemon of the same pool size with `[restart] adopt = false` and a disk tier
  (`[pool.disk]` under --dir, filled once with the same N entries by put(persist=True)) is stopped
  with SIGTERM and started again: its pool starts empty; the disk tier re-indexes its records and
  every entry is promoted back into the pool by a read.

Per restart, from the new process's spawn: `serving_s` until its log says "serving node",
`answer_s` until a client's stats() answers (what `ecd status` asks), `ready_s` until every entry
has been read back (view_many of all N keys in batches: for cold, that is the promotion from disk;
the headline figure), and the daemon's own accounts: `adopt_s` (the log line "restart: adopted N
entries ... in S s", = stats()["restart"]["seconds"]) or `reindex_s` (the disk tier's re-index).
The new daemon's VmRSS, VmHWM, RssAnon and RssShmem (/proc/PID/status) are read once it answers
and again after the reads. Spot checks: --checks entries, chosen at random, read with get and
compared bit for bit with what was put. The result per pool size is the median of the per-pair
ratios adopt / cold (below 1: adoption is faster). Goal (issue 27): adoption <= 1 s for 100,000
entries and for a 16 GiB pool, and the adopting daemon's RSS does not grow with the pool size.

Memory: the big pool is filled twice per pair (once per daemon; the adopted one is released to
the machine before the cold daemon starts), so it needs the pool size free plus a margin; the
benchmark refuses a size that /proc/meminfo's MemAvailable does not cover (--pool-size 8GiB then).
--profile PATH: one more adopting restart of the small pool under cProfile (the daemon's whole
run; the adoption's functions are printed).

    python benchmarks/bench_adopt.py [--entries 100000] [--pool-size 16GiB] [--reps 3] [--json PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import pstats
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_daemon import _die_with_parent, write_results  # noqa: E402

from ecd.client.client import Client  # noqa: E402
from ecd.config_types import format_size, parse_size  # noqa: E402
from ecd.daemon.restart.holder_client import HolderKeeper  # noqa: E402
from ecd.errors import EcdError  # noqa: E402

GOAL_S = 1.0
ADOPTED = re.compile(r"restart: adopted (\d+) entries \((\d+) bytes\) .* in ([0-9.]+)s")
MEMORY_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssShmem")


def memory_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in MEMORY_FIELDS:
                out[name] = int(value.split()[0])
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (load-independent, unlike wall time)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class Node:
    """One daemon configuration (node name, runtime dir, config) started and stopped many times."""

    def __init__(self, work: str, name: str, pool: int, extra: str, profile: str = "") -> None:
        self.name = f"{name}{os.getpid()}"
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir)
        self.runtime_dir = os.path.join(self.dir, "run")
        self.endpoint = f"ipc://{self.runtime_dir}/ecd.sock"
        self.config = os.path.join(self.dir, "node.toml")
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.profile = profile
        with open(self.config, "w") as f:
            f.write(f'[node]\nname = "{self.name}"\nruntime_dir = "{self.runtime_dir}"\nlog_level = "info"\n\n'
                    f'[control]\nendpoint = "{self.endpoint}"\n\n[pool.host]\nsize = {pool}\n\n'
                    f'[metrics]\nlisten = "127.0.0.1:0"\n{extra}')
        self.proc: subprocess.Popen | None = None

    def start(self) -> tuple[float, int]:
        """Spawn the daemon; returns (monotonic spawn time, the log's offset where this run starts)."""
        offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        log = open(self.log_path, "ab")
        prefix = ["-m", "cProfile", "-o", self.profile] if self.profile else []
        spawned = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, *prefix, "-m", "ecd", "serve", "--config", self.config],
                                     stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        log.close()
        return spawned, offset

    def log(self, offset: int = 0) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def wait_serving(self, offset: int, timeout: float = 300.0) -> float:
        deadline = time.monotonic() + timeout
        while "serving node" not in self.log(offset):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: not serving after {timeout}s:\n{self.log(offset)[-3000:]}")
            time.sleep(0.002)
        return time.monotonic()

    def connect(self, timeout: float = 300.0) -> Client:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                # populate=False: this client must not prefault the pool beside the measurement
                return Client(self.endpoint, timeout=60.0, name="bench-adopt", populate=False)
            except EcdError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.002)

    def check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name}: daemon exited with {self.proc.returncode}:\n{self.log()[-3000:]}")

    def stop(self) -> float:
        """SIGTERM; the seconds until the process is gone."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        began = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.monotonic() - began

    def release(self) -> None:
        """Let the holder give the pool back to the machine (a final stop's second half)."""
        with contextlib.suppress(Exception):
            HolderKeeper(self.name, self.runtime_dir, spawn=False).release()


class Entries:
    """N entries of `nbytes` each: a random base whose first 8 bytes carry the entry's index, so
    every entry is distinct and can be rebuilt for a bit-for-bit check."""

    def __init__(self, count: int, nbytes: int, seed: int) -> None:
        self.count, self.nbytes = count, nbytes
        self.base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))

    @staticmethod
    def key(i: int) -> str:
        return f"adopt/{i:07d}"

    def value(self, i: int) -> torch.Tensor:
        t = self.base.clone()
        t[:8] = torch.tensor([i], dtype=torch.int64).view(torch.uint8)
        return t

    def put_all(self, client: Client, batch: int, persist: bool = False) -> float:
        began = time.monotonic()
        for start in range(0, self.count, batch):
            idx = range(start, min(start + batch, self.count))
            client.put_many({self.key(i): self.value(i) for i in idx}, persist=persist)
        return time.monotonic() - began

    def read_all(self, client: Client, batch: int) -> None:
        """Every entry readable (a view of each, in batches: promotes what is on disk)."""
        for start in range(0, self.count, batch):
            keys = [self.key(i) for i in range(start, min(start + batch, self.count))]
            with client.view_many(keys, timeout=120.0) as views:
                assert all(v is not None and v.numel() == self.nbytes for v in views), keys[0]

    def spot_check(self, client: Client, checks: int, rng: random.Random) -> int:
        picks = sorted(rng.sample(range(self.count), min(checks, self.count)))
        for i, got in zip(picks, client.get_many([self.key(i) for i in picks], timeout=60.0)):
            if not torch.equal(got, self.value(i)):
                raise AssertionError(f"{self.key(i)} differs after the restart")
        return len(picks)


def restart(node: Node, entries: Entries, args, rng: random.Random, kind: str) -> dict:
    """Stop `node` (SIGTERM), start it again, measure until every entry reads back."""
    stop_s = node.stop()
    gc.collect()  # no client of an earlier daemon keeps its pool mapped
    available = mem_available()
    spawned, offset = node.start()
    serving = node.wait_serving(offset) - spawned
    client = node.connect()
    stats = client.stats()
    answer = time.monotonic() - spawned
    assert node.proc is not None
    mem_answer = memory_kib(node.proc.pid)
    cpu_answer = cpu_s(node.proc.pid)
    entries.read_all(client, args.batch)
    ready = time.monotonic() - spawned
    mem_ready = memory_kib(node.proc.pid)
    checked = entries.spot_check(client, args.checks, rng)
    stats_after = client.stats()
    client.close()
    del client
    gc.collect()
    row = {"kind": kind, "mem_available_gib_before": available / 2**30, "stop_s": stop_s,
           "cpu_s_answer": cpu_answer, "serving_s": serving, "answer_s": answer, "ready_s": ready,
           "memory_kib_answer": mem_answer, "memory_kib_ready": mem_ready, "spot_checked": checked,
           "entries_ready": stats_after["entries_ready"]}
    restart_stats = stats["restart"]
    if kind == "adopt":
        match = ADOPTED.search(node.log(offset))
        assert match is not None, f"no adoption log line:\n{node.log(offset)[-2000:]}"
        assert int(match.group(1)) == entries.count == restart_stats["entries"], (match.group(0), restart_stats)
        assert restart_stats["adopted"] and restart_stats["journal_full"] == 0, restart_stats
        row.update(adopt_s=restart_stats["seconds"], adopt_log_s=float(match.group(3)),
                   adopted_bytes=restart_stats["bytes"])
    else:
        assert not restart_stats["adopted"], restart_stats
        disk = stats_after["disk"]
        assert disk["loaded"] == entries.count, disk
        row.update(reindex_s=disk["load_s"])
    assert stats_after["entries_ready"] == entries.count, stats_after["entries_ready"]
    return row


def entry_bytes(pool: int, count: int) -> int:
    """The biggest entry (a multiple of 4 KiB) of which `count` fill ~94% of the pool."""
    return max(4096, int(pool * 0.94) // count // 4096 * 4096)


def run_pool(args, work: str, pool: int, label: str) -> dict:
    count = args.entries
    nbytes = entry_bytes(pool, count)
    entries = Entries(count, nbytes, seed=pool & 0xFFFF)
    rng = random.Random(7)
    disk_dir = tempfile.mkdtemp(prefix="ecd-bench-adopt-tier-", dir=args.dir)
    disk_size = count * (nbytes + 8192) + (256 << 20)
    hold = '\n[restart]\nhold = "600s"\n'
    adopt = Node(work, f"ad{label}", pool, hold)
    cold = Node(work, f"cd{label}", pool, f'\n[restart]\nadopt = false\n\n[pool.disk]\npath = "{disk_dir}"\n'
                f'size = {disk_size}\nmin_spill_size = 0\nio_threads = {args.io_threads}\n')
    print(f"[{label}] pool {format_size(pool)}: {count} entries of {nbytes} bytes "
          f"({count * nbytes / 2**30:.2f} GiB)", flush=True)
    rows: list[dict] = []
    try:
        cold.start()
        c = cold.connect()
        persist_s = entries.put_all(c, args.persist_batch, persist=True)
        c.close()
        del c
        cold.stop()  # its pool goes back to the machine (adopt = false); each cold restart starts it again
        print(f"[{label}] disk tier filled by put(persist=True) in {persist_s:.1f}s", flush=True)
        fill_s = []
        for rep in range(args.reps):
            order = ("adopt", "cold") if rep % 2 == 0 else ("cold", "adopt")
            pair = {}
            for kind in order:
                if kind == "adopt":
                    adopt.start()
                    c = adopt.connect()
                    fill_s.append(entries.put_all(c, args.batch))
                    c.close()
                    del c
                    pair[kind] = restart(adopt, entries, args, rng, "adopt")
                    adopt.stop()
                    adopt.release()
                else:
                    pair[kind] = restart(cold, entries, args, rng, "cold")
                    cold.stop()  # adopt = false: its pool goes back to the machine; the disk tier stays
            a, k = pair["adopt"], pair["cold"]
            print(f"[{label}] pair {rep}: adopt {a['adopt_s']:.3f}s (log), answers {a['answer_s']:.2f}s, all read "
                  f"{a['ready_s']:.2f}s, CPU to answer {a['cpu_s_answer']:.2f}s, "
                  f"RSS {a['memory_kib_answer']['VmRSS'] / 1024:.0f} MiB, HWM "
                  f"{a['memory_kib_ready']['VmHWM'] / 1024:.0f} MiB | cold: re-index {k['reindex_s']:.2f}s, answers "
                  f"{k['answer_s']:.2f}s, all read {k['ready_s']:.2f}s, CPU to answer {k['cpu_s_answer']:.2f}s, RSS "
                  f"{k['memory_kib_ready']['VmRSS'] / 1024:.0f} MiB | ready adopt/cold "
                  f"{a['ready_s'] / k['ready_s']:.3f}", flush=True)
            rows.append(pair)
    finally:
        for node in (adopt, cold):
            node.stop()
            node.release()
        shutil.rmtree(disk_dir, ignore_errors=True)
    return summarize(label, pool, entries, rows, persist_s, fill_s)


def summarize(label: str, pool: int, entries: Entries, rows: list[dict], persist_s: float, fill_s: list[float]) -> dict:
    med = statistics.median

    def ratios(field: str) -> list[float]:
        return [p["adopt"][field] / p["cold"][field] for p in rows]

    def mem(kind: str, when: str, field: str) -> float:
        return med(p[kind][f"memory_kib_{when}"][field] for p in rows) / 1024
    summary = {
        "label": label, "pool_bytes": pool, "entries": entries.count, "entry_bytes": entries.nbytes,
        "disk_fill_s": persist_s, "adopt_fill_s": med(fill_s),
        "adopt_s": med(p["adopt"]["adopt_s"] for p in rows),
        "reindex_s": med(p["cold"]["reindex_s"] for p in rows),
        "ratio_ready": med(ratios("ready_s")), "ratio_answer": med(ratios("answer_s")),
        "ratio_serving": med(ratios("serving_s")),
        "ratios_ready": ratios("ready_s"),
        **{f"{kind}_{field}": med(p[kind][field] for p in rows) for kind in ("adopt", "cold")
           for field in ("serving_s", "answer_s", "ready_s", "stop_s", "cpu_s_answer")},
        **{f"{kind}_{field.lower()}_mib_{when}": mem(kind, when, field) for kind in ("adopt", "cold")
           for when in ("answer", "ready") for field in MEMORY_FIELDS},
        "pairs": rows,
    }
    return summary


def profile_adoption(args, work: str, pool: int) -> dict:
    """One adopting restart of `pool` under cProfile: where the adoption's time goes."""
    entries = Entries(args.entries, entry_bytes(pool, args.entries), seed=3)
    node = Node(work, "prof", pool, '\n[restart]\nhold = "600s"\n', profile=args.profile)
    try:
        node.profile = ""
        node.start()
        c = node.connect()
        entries.put_all(c, args.batch)
        c.close()
        node.profile = args.profile
        node.stop()
        spawned, offset = node.start()
        node.wait_serving(offset)
        adopt_s = node.connect().stats()["restart"]["seconds"]
        node.stop()  # cProfile writes the profile at exit
    finally:
        node.stop()
        node.release()
    stats = pstats.Stats(args.profile)
    print(f"profile ({args.profile}): adoption {adopt_s:.3f}s in the daemon's account (without cProfile's "
          "overhead: less); under cProfile, what open_kept (mapping, Journal.open) and adopt_entries call:")
    stats.sort_stats("cumulative").print_callees(r"adopt\.py:\d+\((open_kept|adopt_entries|_insert)\)")
    stats.print_callees(r"journal\.py:\d+\((open|_scan)\)")
    return {"profile": args.profile, "adopt_s_profiled": adopt_s}


def table(results: list[dict]) -> None:
    print("\n| pool | entries | adopt: adoption (log) | adopt: start -> answers | adopt: start -> all read | "
          "cold: disk re-index | cold: start -> answers | cold: start -> all read | all read, adopt / cold "
          "(median of pairs) | adopt RSS / HWM / RssAnon / RssShmem after reads (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {format_size(r['pool_bytes'])} | {r['entries']:,} x {r['entry_bytes'] // 1024} KiB | "
              f"{r['adopt_s']:.3f} s | {r['adopt_answer_s']:.2f} s | {r['adopt_ready_s']:.2f} s | "
              f"{r['reindex_s']:.2f} s | {r['cold_answer_s']:.2f} s | {r['cold_ready_s']:.2f} s | "
              f"{r['ratio_ready']:.3f} ({', '.join(f'{x:.3f}' for x in r['ratios_ready'])}) | "
              f"{r['adopt_vmrss_mib_ready']:.0f} / {r['adopt_vmhwm_mib_ready']:.0f} / "
              f"{r['adopt_rssanon_mib_ready']:.0f} / {r['adopt_rssshmem_mib_ready']:.0f} |")
    print("\nThe new daemon once it answers (before any read), adopt vs cold: VmRSS / RssAnon (MiB), and its CPU "
          "seconds since spawn (user + system: what the load does not stretch):")
    for r in results:
        print(f"  {format_size(r['pool_bytes'])}: adopt {r['adopt_vmrss_mib_answer']:.0f} / "
              f"{r['adopt_rssanon_mib_answer']:.0f} MiB, {r['adopt_cpu_s_answer']:.2f} CPU s; cold "
              f"{r['cold_vmrss_mib_answer']:.0f} / {r['cold_rssanon_mib_answer']:.0f} MiB, "
              f"{r['cold_cpu_s_answer']:.2f} CPU s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--small-pool", default="1GiB", help="the pool of the 'same entries, small pool' run (0: skip it)")
    parser.add_argument("--pool-size", default="16GiB", help="the big pool (0: skip it)")
    parser.add_argument("--reps", type=int, default=3, help="adopt/cold pairs per pool size")
    parser.add_argument("--batch", type=int, default=1000, help="entries per put_many / view_many")
    parser.add_argument("--persist-batch", type=int, default=256, help="entries per put_many(persist=True)")
    parser.add_argument("--io-threads", type=int, default=4, help="the cold daemon's [pool.disk] io_threads")
    parser.add_argument("--checks", type=int, default=64, help="entries compared bit for bit per restart")
    parser.add_argument("--dir", default="/var/tmp", help="where the disk tier goes (a local disk)")
    parser.add_argument("--profile", default="", help="also profile one adoption of the small pool (cProfile)")
    parser.add_argument("--margin", default="2GiB", help="memory left free beyond the pool")
    parser.add_argument("--json", default="", help="also write the results here ('-': stdout)")
    args = parser.parse_args()
    pools = [(label, size) for label, size in (("small", int(parse_size(args.small_pool))),
                                               ("big", int(parse_size(args.pool_size)))) if size]
    work = tempfile.mkdtemp(prefix="ecd-bench-adopt-", dir="/tmp")
    results: list[dict] = []
    load = os.getloadavg()
    try:
        for label, pool in pools:
            available = mem_available()
            if pool + int(parse_size(args.margin)) > available:
                print(f"[{label}] skipped: a {format_size(pool)} pool needs {format_size(pool)} + {args.margin} free, "
                      f"MemAvailable is {available / 2**30:.1f} GiB (try --pool-size with less)", flush=True)
                continue
            results.append(run_pool(args, work, pool, label))
        profile = profile_adoption(args, work, pools[0][1]) if args.profile and pools else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table(results)
    print(f"\nload average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, at end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs; goal: adoption <= {GOAL_S} s")
    if args.json:
        write_results(args.json, {"goal_s": GOAL_S, "load_start": load, "load_end": os.getloadavg(),
                                  "results": results, "profile": profile})
    return 0


if __name__ == "__main__":
    sys.exit(main())
