#!/usr/bin/env python3
"""Does a long-lived client's memory stay flat? (issue 12)

One process puts and then gets N distinct keys (128 KiB float32 tensors by default) through one
Client against a daemon it starts for itself, with a pool far smaller than N entries (the daemon
evicts LRU entries all along), and reads its own RssAnon (/proc/self/status) every `--every`
keys. It prints the table and the growth after the warm-up (`--warmup` keys): a client whose
memory is bounded grows by (almost) nothing after it; one that keeps state per key grows in
proportion to the keys. The client's location cache size is printed too.

  python benchmarks/client_memory.py                       # 100k keys, warm-up 10k
  python benchmarks/client_memory.py --keys 30000 --every 5000
Exit status 1 when the growth after warm-up is --limit-mib (4) or more.
"""
from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time

import torch

from bench_daemon import BenchDaemon, proc_memory_kib, write_results


def cache_len(client) -> int:
    return len(client.location_cache)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=10_000, help="keys before the baseline is taken")
    ap.add_argument("--every", type=int, default=10_000, help="print a row every this many keys")
    ap.add_argument("--kib", type=int, default=128, help="tensor size (KiB)")
    ap.add_argument("--pool", default="256MiB", help="daemon host pool (much smaller than keys x size)")
    ap.add_argument("--limit-mib", type=float, default=4.0)
    ap.add_argument("--json", default="", help="also write the results here ('-': stdout)")
    args = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="ecd-mem-")
    daemon = BenchDaemon(workdir, "mem", pool=args.pool)
    rows = []
    try:
        client = daemon.connect(name="client-memory")
        t = torch.arange(args.kib * 256, dtype=torch.float32)  # kib KiB
        base = None
        start = time.monotonic()
        print(f"{'keys':>8} {'RssAnon MiB':>12} {'since warm-up':>14} {'cache entries':>14} {'s':>7}")
        for i in range(1, args.keys + 1):
            key = f"k{i:08d}"
            t[0] = i
            client.put(key, t)
            got = client.get(key)
            if got[0].item() != i:
                raise AssertionError(f"{key}: read back {got[0].item()}")
            del got
            if i == args.warmup:
                gc.collect()
                base = proc_memory_kib()["RssAnon"]
            if i % args.every == 0 or i == args.keys:
                gc.collect()
                rss = proc_memory_kib()["RssAnon"]
                grown = (rss - base) / 1024 if base is not None else float("nan")
                rows.append({"keys": i, "rss_anon_kib": rss, "growth_mib": grown, "cache": cache_len(client),
                             "elapsed_s": time.monotonic() - start})
                print(f"{i:>8} {rss / 1024:>12.1f} {grown:>14.2f} {cache_len(client):>14} "
                      f"{time.monotonic() - start:>7.1f}", flush=True)
        client.close()
    finally:
        rc = daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    growth = (rows[-1]["rss_anon_kib"] - base) / 1024 if base is not None else float("nan")
    per_100k = growth / max(1, args.keys - args.warmup) * 100_000
    ok = growth < args.limit_mib
    print(f"RssAnon growth after {args.warmup} warm-up keys: {growth:.2f} MiB over "
          f"{args.keys - args.warmup} more keys ({per_100k:.1f} MiB per 100k keys): "
          f"{'PASS' if ok else 'MISS'} (< {args.limit_mib} MiB); daemon exit {rc}")
    if args.json:
        write_results(args.json, {"kib": args.kib, "keys": args.keys, "warmup": args.warmup, "rows": rows,
                                  "growth_mib": growth, "pass": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
