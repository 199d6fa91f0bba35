#!/usr/bin/env python3
"""Soak test: K client processes hammer one real daemon with a random mix of operations.

  python benchmarks/soak.py --minutes 10 --clients 8 [--json PATH|-]

Starts its own daemon (benchmarks/bench_daemon.py), then K worker processes each loop until the
deadline over a shared key space: put (sometimes put_many), get, get_many, view, exists (sometimes
pinning), delete, and waiting gets on a key another worker is about to publish. Sizes run from
16 bytes (inline puts) to --max-size, dtypes vary. Every payload verifies itself without ecd's
help: its first 16 bytes are (seed, crc32 of the key, length) and the rest is a pattern derived
from the seed, so any reader can recompute it and compare every byte (half the puts also store
an ecd checksum and half the reads verify it; an IntegrityError counts as a corrupt read too).

Reports ops/s (total and per op, with latency p50/p99), errors by type (PoolFull and KeyNotFound
are expected under pressure: counted, not failures), corrupt reads (must be 0), daemon RSS at
start and end, leases and pool bytes left once the workers have gone (0 leases; 0 bytes after
evicting everything), and /dev/shm files left after the daemon stops (must be 0). Exits 1 on any
corrupt read, unexpected error, crashed worker or daemon, leaked lease or extent, or leftover.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import random
import shutil
import struct
import sys
import tempfile
import time
import traceback
import zlib

import numpy as np

from bench_daemon import BenchDaemon, write_results

HEADER = struct.Struct("<QII")  # seed, crc32(key), length
MIN_SIZE = HEADER.size
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
OPS = {  # op -> weight
    "put": 24, "put_many": 4, "get": 18, "get_many": 5, "view": 14, "exists": 12, "delete": 5,
    "wait_get": 8, "handoff_put": 10,
}
EXPECTED_ERRORS = {"KeyNotFound", "PoolFull", "WaitTimeout"}
LATENCY_SAMPLES = 20_000  # reservoir per op and worker
CLIENT_TIMEOUT_S = 15.0


# ---- self-verifying payloads -------------------------------------------------------------------

def key_tag(key: str) -> int:
    return zlib.crc32(key.encode())


def pattern(seed: int, n: int) -> np.ndarray:
    """n bytes that depend on the seed and on the position of every 8-byte word."""
    words = np.arange((n + 7) // 8, dtype=np.uint64)
    words *= GOLDEN
    words += np.uint64(seed)
    words ^= words >> np.uint64(29)
    return words.view(np.uint8)[:n]


def make_payload(key: str, seed: int, n: int) -> np.ndarray:
    data = pattern(seed, n).copy()
    HEADER.pack_into(data, 0, seed, key_tag(key), n)
    return data


def check_payload(key: str, data: np.ndarray) -> str | None:
    """None if `data` is exactly what some put of `key` wrote, else what is wrong."""
    n = data.size
    if n < MIN_SIZE:
        return f"{n} bytes: shorter than the header"
    seed, tag, length = HEADER.unpack_from(data[:MIN_SIZE].tobytes())
    if tag != key_tag(key):
        return f"header names another key (crc {tag:#x}, want {key_tag(key):#x})"
    if length != n:
        return f"header says {length} bytes, read {n}"
    want = pattern(seed, n)
    if not np.array_equal(data[MIN_SIZE:], want[MIN_SIZE:]):
        bad = int(np.flatnonzero(data[MIN_SIZE:] != want[MIN_SIZE:])[0]) + MIN_SIZE
        return f"seed {seed:#x}, {n} bytes: first wrong byte at {bad}"
    return None


def random_size(rng: random.Random, max_size: int) -> int:
    """Mostly small (inline) and medium, some large: log-uniform within tiers."""
    r = rng.random()
    lo, hi = ((MIN_SIZE, 1 << 10) if r < 0.35 else (1 << 10, 64 << 10) if r < 0.60
              else (64 << 10, 1 << 20) if r < 0.90 else (1 << 20, max_size))
    hi = max(min(hi, max_size), lo)
    return int(round(2 ** rng.uniform(np.log2(lo), np.log2(hi))))


def as_tensor(torch, data: np.ndarray, rng: random.Random):
    """The payload as a tensor of a random dtype (the bytes are what count)."""
    t = torch.from_numpy(data)
    n = data.size
    r = rng.random()
    if r < 0.2 and n % 4 == 0:
        t = t.view(torch.float32)
    elif r < 0.35 and n % 2 == 0:
        t = t.view(torch.bfloat16)
    elif r < 0.45 and n % 16 == 0:
        t = t.view(torch.int64).reshape(2, -1)
    return t


def tensor_bytes(torch, t) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


# ---- worker --------------------------------------------------------------------------------------

class Reservoir:
    def __init__(self, rng: random.Random) -> None:
        self.rng, self.seen, self.samples = rng, 0, []

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.samples) < LATENCY_SAMPLES:
            self.samples.append(value)
        else:
            j = self.rng.randrange(self.seen)
            if j < LATENCY_SAMPLES:
                self.samples[j] = value


def worker(endpoint: str, wid: int, nworkers: int, nkeys: int, max_size: int, start_at: float,
           deadline: float, seed: int, progress, conn) -> None:
    import torch

    from ecd import Client
    from ecd.errors import EcdError, IntegrityError, KeyNotFound

    torch.set_num_threads(1)
    rng = random.Random(seed * 7919 + wid)
    c = Client(endpoint, name=f"soak-{wid}", timeout=CLIENT_TIMEOUT_S)
    keys = [f"k{j}" for j in range(nkeys)]
    ops, weights = list(OPS), list(OPS.values())
    if wid == 0:
        # Waits only go to lower-numbered workers, and worker 0 never waits, so no two workers
        # can end up parked on each other's next key: every wait is answered by a worker that
        # keeps publishing.
        weights[ops.index("wait_get")] = 0
    counts: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    corrupt: list[str] = []
    checksum_failures = 0
    unexpected: list[str] = []
    lat = {op: Reservoir(rng) for op in ops}
    bytes_written = bytes_read = 0

    def verify_read(key: str, t) -> None:
        nonlocal bytes_read
        data = tensor_bytes(torch, t)
        bytes_read += data.size
        problem = check_payload(key, data)
        if problem is not None:
            corrupt.append(f"worker {wid} read {key!r}: {problem}")

    def put_one(key: str) -> None:
        nonlocal bytes_written
        n = random_size(rng, max_size)
        data = make_payload(key, rng.getrandbits(63), n)
        c.put(key, as_tensor(torch, data, rng), checksum=rng.random() < 0.5)
        bytes_written += n

    while time.time() < start_at:
        time.sleep(0.005)
    while True:
        now = time.time()
        if now >= deadline:
            break
        op = rng.choices(ops, weights)[0]
        verify = rng.random() < 0.5
        t0 = time.perf_counter()
        try:
            if op == "put":
                put_one(rng.choice(keys))
            elif op == "put_many":
                batch = {}
                for key in rng.sample(keys, rng.randint(2, 4)):
                    n = random_size(rng, max_size // 2)
                    batch[key] = as_tensor(torch, make_payload(key, rng.getrandbits(63), n), rng)
                    bytes_written += n
                c.put_many(batch, checksum=rng.random() < 0.5)
            elif op == "get":
                key = rng.choice(keys)
                verify_read(key, c.get(key, verify=verify))
            elif op == "get_many":
                names = rng.sample(keys, rng.randint(2, 6))
                for key, t in zip(names, c.get_many(names, missing_ok=True, verify=verify)):
                    if t is not None:
                        verify_read(key, t)
            elif op == "view":
                key = rng.choice(keys)
                with c.view(key, verify=verify) as t:
                    verify_read(key, t)
                    if rng.random() < 0.1:
                        time.sleep(0.002)  # hold the lease while others replace or delete the key
                        verify_read(key, t)
            elif op == "exists":
                c.exists(rng.sample(keys, rng.randint(1, 8)), pin_s=0.5 if rng.random() < 0.2 else 0.0)
            elif op == "delete":
                c.delete(rng.choice(keys))
            elif op == "handoff_put":
                key = f"h{wid}/{progress[wid] + 1}"
                put_one(key)
                progress[wid] += 1  # only this worker writes its slot
            elif op == "wait_get":
                other = rng.randrange(wid)
                key = f"h{other}/{progress[other] + 1}"  # the next one that worker will publish
                wait = max(1.0, min(10.0, deadline - time.time() + 2.0))
                try:
                    verify_read(key, c.get(key, timeout=wait, verify=verify))
                except KeyNotFound:
                    errors["WaitTimeout"] += 1
                    continue
            counts[op] += 1
            lat[op].add(time.perf_counter() - t0)
        except IntegrityError as exc:
            checksum_failures += 1
            corrupt.append(f"worker {wid} {op}: {exc}")
        except EcdError as exc:
            name = type(exc).__name__
            errors[name] += 1
            if name not in EXPECTED_ERRORS and len(unexpected) < 10:
                unexpected.append(f"worker {wid} {op}: {name}: {exc}")
        except Exception as exc:  # a bug in the client: report it, keep going
            errors[type(exc).__name__] += 1
            if len(unexpected) < 10:
                unexpected.append(f"worker {wid} {op}: {traceback.format_exc(limit=5)}")
    elapsed = time.time() - start_at
    c.close()
    conn.send({
        "wid": wid, "elapsed_s": elapsed, "counts": dict(counts), "errors": dict(errors),
        "corrupt": len(corrupt), "corrupt_examples": corrupt[:10], "checksum_failures": checksum_failures,
        "unexpected_examples": unexpected, "bytes_written": bytes_written, "bytes_read": bytes_read,
        "latency": {op: r.samples for op, r in lat.items()},
    })
    conn.close()


# ---- main ----------------------------------------------------------------------------------------

def rss(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssShmem in bytes (anon is what a leak grows; shmem is pool pages the
    daemon touched, e.g. by copying inline puts)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssShmem"):
                out[name] = int(value.split()[0]) * 1024
    return out


def percentile_us(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q) * 1e6) if samples else 0.0


def run(args) -> dict:
    workdir = tempfile.mkdtemp(prefix="ecd-soak-")
    daemon = BenchDaemon(workdir, node_prefix="soak", pool=args.pool)
    res: dict = {"config": {"minutes": args.minutes, "clients": args.clients, "keys": args.keys,
                            "pool": args.pool, "max_size": args.max_size, "seed": args.seed},
                 "failures": []}
    fail = res["failures"].append
    spawn = mp.get_context("spawn")
    procs, conns = [], []
    try:
        c = daemon.connect(timeout=CLIENT_TIMEOUT_S, name="soak-main")
        res["daemon_rss_start"] = rss(daemon.proc.pid)
        progress = spawn.Array("q", args.clients, lock=False)
        duration = args.minutes * 60
        start_at = time.time() + 3.0 + 0.5 * args.clients  # workers import torch first
        deadline = start_at + duration
        for wid in range(args.clients):
            parent, child = spawn.Pipe(duplex=False)
            p = spawn.Process(target=worker, args=(daemon.endpoint, wid, args.clients, args.keys,
                                                   args.max_size, start_at, deadline, args.seed,
                                                   progress, child), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        rss_peak = dict(res["daemon_rss_start"])
        next_note = start_at + 30
        timeline = res["daemon_rss_anon_timeline"] = []  # (seconds into the run, RssAnon bytes)
        next_sample = start_at
        results = []
        pending = dict(enumerate(conns))
        while pending:
            if daemon.proc.poll() is not None:
                fail(f"daemon exited with {daemon.proc.returncode} during the run")
                break
            for wid, conn in list(pending.items()):
                if conn.poll(0):
                    try:
                        results.append(conn.recv())
                    except EOFError:
                        fail(f"worker {wid} died (exit code {procs[wid].exitcode})")
                    del pending[wid]
                elif not procs[wid].is_alive() and not conn.poll(0.1):
                    fail(f"worker {wid} died (exit code {procs[wid].exitcode})")
                    del pending[wid]
            if time.time() > deadline + 120:
                fail(f"workers {sorted(pending)} did not finish within 2 minutes of the deadline")
                break
            sample = rss(daemon.proc.pid)
            rss_peak = {k: max(v, rss_peak.get(k, 0)) for k, v in sample.items()}
            if time.time() >= next_sample and time.time() < deadline:
                timeline.append((round(time.time() - start_at), sample["RssAnon"]))
                next_sample += max(5.0, duration / 20)
            if not args.quiet and time.time() >= next_note and time.time() < deadline:
                s = c.stats()
                print(f"  {time.time() - start_at:5.0f}s: {s['entries_ready']} entries, "
                      f"{s['used_bytes'] >> 20} MiB used, {s['evictions']} evictions, "
                      f"daemon RSS {sample['VmRSS'] >> 20} MiB", file=sys.stderr, flush=True)
                next_note += 30
            time.sleep(0.2)
        for p in procs:
            p.join(10)
            if p.exitcode not in (0, None) and not any(f"worker {procs.index(p)} " in x for x in res["failures"]):
                fail(f"worker {procs.index(p)} exited with {p.exitcode}")
        res["daemon_rss_peak"] = rss_peak
        alive = daemon.proc.poll() is None
        if alive:
            res["daemon_rss_end"] = rss(daemon.proc.pid)
            # Every worker has said Bye (or exited): nothing they held may remain.
            # Their last fire-and-forget releases and Byes travel on their own connections: wait
            # (up to 10 s) for the sessions to end rather than guess how long that takes.
            settle_until = time.monotonic() + 10
            s = c.stats()
            while s["clients"] != 1 and time.monotonic() < settle_until:
                time.sleep(0.05)
                s = c.stats()
            res["after_workers"] = {k: s[k] for k in ("clients", "read_leases", "pins", "waiters",
                                                      "entries_writing", "reservations", "reserved_bytes",
                                                      "entries_ready", "entries_retired", "used_bytes",
                                                      "evictions", "hits", "misses", "integrity_failures")}
            res["daemon_errors"] = s["errors"]
            a = res["after_workers"]
            for k in ("read_leases", "pins", "waiters", "entries_writing", "reservations", "entries_retired"):
                if a[k]:
                    fail(f"{a[k]} {k} left after every worker stopped")
            if a["clients"] != 1:
                fail(f"{a['clients']} client sessions after the workers stopped (want 1: this one)")
            c.evict(everything=True)
            res["used_bytes_after_evicting_everything"] = used = c.stats()["used_bytes"]
            if used:
                fail(f"{used} pool bytes still allocated after evicting everything")
        c.close()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        rc = daemon.stop()
        res["daemon_exit_code"] = rc
        res["shm_files_left"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"ecd.{daemon.node}."))
        if rc != 0:
            fail(f"daemon exited with {rc} on SIGTERM")
            res["daemon_log_tail"] = daemon.log_tail()
        if res["shm_files_left"]:
            fail(f"/dev/shm files left after the daemon stopped: {res['shm_files_left']}")
        shutil.rmtree(workdir, ignore_errors=True)

    # ---- aggregate
    elapsed = max((r["elapsed_s"] for r in results), default=0.0) or 1e-9
    counts: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    samples: dict[str, list[float]] = collections.defaultdict(list)
    for r in results:
        counts.update(r["counts"])
        errors.update(r["errors"])
        for op, s in r["latency"].items():
            samples[op].extend(s)
    total = sum(counts.values())
    res["seconds"] = elapsed
    res["ops"] = total
    res["ops_per_s"] = total / elapsed
    res["per_op"] = {op: {"count": counts.get(op, 0), "ops_per_s": counts.get(op, 0) / elapsed,
                          "p50_us": percentile_us(samples[op], 50), "p99_us": percentile_us(samples[op], 99)}
                     for op in OPS}
    res["errors"] = dict(sorted(errors.items()))
    res["unexpected_errors"] = {k: v for k, v in res["errors"].items() if k not in EXPECTED_ERRORS}
    res["corrupt_reads"] = sum(r["corrupt"] for r in results)
    res["checksum_failures"] = sum(r["checksum_failures"] for r in results)
    res["corrupt_examples"] = [x for r in results for x in r["corrupt_examples"]][:10]
    res["unexpected_examples"] = [x for r in results for x in r["unexpected_examples"]][:10]
    res["bytes_written"] = sum(r["bytes_written"] for r in results)
    res["bytes_read"] = sum(r["bytes_read"] for r in results)
    res["workers_reported"] = len(results)
    if res["corrupt_reads"]:
        fail(f"{res['corrupt_reads']} corrupt reads")
    if res["unexpected_errors"]:
        fail(f"unexpected errors: {res['unexpected_errors']}")
    if total == 0:
        fail("no operation completed")
    res["ok"] = not res["failures"]
    return res


def report(res: dict) -> None:
    p = print
    cfg = res["config"]
    p(f"\necd soak: {cfg['clients']} clients, {res['seconds']:.0f}s, {cfg['keys']} shared keys, "
      f"sizes {MIN_SIZE} B..{cfg['max_size'] >> 20} MiB, pool {cfg['pool']}")
    p(f"\n{'op':14}{'count':>10}{'ops/s':>10}{'p50 us':>10}{'p99 us':>10}")
    for op, v in res["per_op"].items():
        p(f"{op:14}{v['count']:>10}{v['ops_per_s']:>10.0f}{v['p50_us']:>10.0f}{v['p99_us']:>10.0f}")
    p(f"{'total':14}{res['ops']:>10}{res['ops_per_s']:>10.0f}")
    p(f"\nbytes written {res['bytes_written'] / 2**30:.2f} GiB, read and checked {res['bytes_read'] / 2**30:.2f} GiB")
    expected = {k: v for k, v in res["errors"].items() if k in EXPECTED_ERRORS}
    p(f"errors, expected under pressure: {expected or 'none'}")
    p(f"errors, unexpected: {res['unexpected_errors'] or 'none'}")
    for line in res["unexpected_examples"]:
        p("    " + " | ".join(line.strip().splitlines()[-2:]))
    p(f"corrupt reads: {res['corrupt_reads']} (of which caught by ecd checksums: {res['checksum_failures']})")
    for line in res["corrupt_examples"]:
        p(f"    {line}")
    mib = lambda d, k: f"{d[k] / 2**20:.1f}" if d and k in d else "?"  # noqa: E731
    s, e, pk = res.get("daemon_rss_start"), res.get("daemon_rss_end"), res.get("daemon_rss_peak")
    p(f"daemon RSS MiB (total / anon / shm pages): start {mib(s, 'VmRSS')} / {mib(s, 'RssAnon')} / "
      f"{mib(s, 'RssShmem')}, end {mib(e, 'VmRSS')} / {mib(e, 'RssAnon')} / {mib(e, 'RssShmem')}, "
      f"peak {mib(pk, 'VmRSS')}")
    tl = res.get("daemon_rss_anon_timeline")
    if tl:
        p("daemon RssAnon over the run (s: MiB): " + ", ".join(f"{t}: {v / 2**20:.0f}" for t, v in tl))
    a = res.get("after_workers")
    if a:
        p(f"after the workers stopped: {a['read_leases']} read leases, {a['pins']} pins, {a['waiters']} "
          f"waiters, {a['entries_writing']} writes, {a['reservations']} reservations, {a['clients']} "
          f"client(s); {a['entries_ready']} entries holding {a['used_bytes'] / 2**20:.1f} MiB; "
          f"{a['evictions']} evictions in the run")
        p(f"pool bytes after evicting everything: {res['used_bytes_after_evicting_everything']}")
    if res.get("daemon_errors"):
        p(f"daemon error counters: {res['daemon_errors']}")
    p(f"daemon exit code on SIGTERM: {res['daemon_exit_code']}; /dev/shm files left: "
      f"{res['shm_files_left'] or 'none'}")
    p("\nRESULT: " + ("PASS" if res["ok"] else "FAIL: " + "; ".join(res["failures"])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--keys", type=int, default=256, help="size of the shared key space")
    ap.add_argument("--pool", default="256MiB", help="daemon host pool size")
    ap.add_argument("--max-size", type=int, default=4 << 20, help="largest payload in bytes")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': stdout)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args()
    if args.clients < 1 or args.minutes <= 0 or args.max_size < MIN_SIZE or args.keys < 8:
        ap.error("need --clients >= 1, --minutes > 0, --max-size >= 16, --keys >= 8")
    res = run(args)
    report(res)
    if args.json:
        write_results(args.json, res)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
