#!/usr/bin/env python3
"""Daemon memory per entry, and whether a pinned lookup stays flat as entries pile up.

Starts its own daemon, fills it with N tiny entries (4-byte int32 tensors under keys shaped like
an engine's, `prompt-00000001-block`, put_many in batches of 5,000), and reports the daemon's
RssAnon growth divided by N (the registry's records: entry, index, LRU, allocator; the pool's
own pages are shared memory, not RssAnon). Then it times `exists(key, pin_s=1)` of a present
key (vLLM's scheduler path) at 1k entries and at N entries, alternating rounds between two keys
put first and last, and quotes the median of per-round ratios N-entries / 1k-entries.

  python benchmarks/entry_memory.py [--entries 300000] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from bench_daemon import BenchDaemon, proc_memory_kib, write_results

BATCH = 5000


def pinned_lookup_us(client, key: str, n: int = 400) -> float:
    samples = []
    for _ in range(n):
        start = time.perf_counter_ns()
        client.exists(key, pin_s=1.0)
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    value = torch.ones(1, dtype=torch.int32)
    with tempfile.TemporaryDirectory() as workdir:
        daemon = BenchDaemon(workdir, pool="1GiB", extra=f"[limits]\nmax_batch = {BATCH}\n")
        client = daemon.connect()
        try:
            client.put_many({f"warm-{i}": value for i in range(1000)})  # the 1k-entry state
            time.sleep(0.5)
            small = [pinned_lookup_us(client, "warm-500") for _ in range(args.rounds)]
            before = proc_memory_kib(daemon.proc.pid)["RssAnon"]
            for start in range(0, args.entries, BATCH):
                client.put_many({f"prompt-{i:08d}-block": value
                                 for i in range(start, min(args.entries, start + BATCH))})
            time.sleep(0.5)
            after = proc_memory_kib(daemon.proc.pid)["RssAnon"]
            # paired: the same key's lookup at N entries, each round beside a 1k-entry figure
            large = [pinned_lookup_us(client, f"prompt-{args.entries // 2:08d}-block") for _ in range(args.rounds)]
            ratios = [big / little for big, little in zip(large, small)]
            res = {"entries": args.entries, "rssanon_kib_before": before, "rssanon_kib_after": after,
                   "bytes_per_entry": (after - before) * 1024 / args.entries,
                   "pinned_exists_p50_us_1k": statistics.median(small),
                   "pinned_exists_p50_us_n": statistics.median(large),
                   "flatness_ratio_median": statistics.median(ratios)}
        finally:
            client.close()
            daemon.proc.terminate()
            daemon.proc.wait(30)
    print(f"{res['entries']} entries: daemon RssAnon {before / 1024:.1f} -> {after / 1024:.1f} MiB, "
          f"{res['bytes_per_entry']:.0f} B per entry (goal <= 500)")
    print(f"exists(pin_s=1) p50: {res['pinned_exists_p50_us_1k']:.1f} us at 1k entries, "
          f"{res['pinned_exists_p50_us_n']:.1f} us at {args.entries}: ratio {res['flatness_ratio_median']:.2f} "
          "(goal <= 1.1)")
    if args.json:
        write_results(args.json, res)


if __name__ == "__main__":
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    main()
