#!/usr/bin/env python3
"""Writes without a round trip (issue 43, ecd/writes): what a put costs now.

Starts two daemons of the same build (one with submission pages, one with `[leases]
submit_records = 0`: every put a round trip, the route before issue 43) and a bare pyzmq REQ/REP
echo process, and measures, interleaved round by round so each ratio compares samples taken side
by side:
  1. a stream of 64 KiB puts with wait=False (one flush per block) against the same puts through
     the round-trip route, and against a memcpy of 64 KiB (torch copy_ into a preallocated tensor);
  2. a 64 KiB put with wait=True (visible on return) against one bare round trip;
  3. a 64 KiB put (wait=True) here plus a get of it in another process (its location read from
     the entry index: no request), against one bare round trip;
  4. how many requests the daemon handles while another process makes 1000 puts of 64 KiB with
     wait=False and one flush (its stats' per-operation counters: the target is <= 1 % beyond
     the LeaseSpace requests that start or refill leases);
  5. the same once the pool is full of 64 KiB entries (a cache's steady state: every lease
     evicts), with the LeaseSpace requests a put.
Prints medians of the per-round ratios and PASS/MISS per target; `--json PATH` writes them.
`make bench-writes` runs it.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time

import torch

from bench_copy import cpu_name
from bench_core import _echo_server, bare_socket, child_starter
from bench_daemon import BenchDaemon, write_results
from bench_local_reads import per_op_ns
from ecd.client.client import Client

KIB = 1 << 10
N = 16 * KIB  # float32 elements: 64 KiB
ROUNDS, BLOCK = 30, 100
PUTS = 1000
TARGET_PUT_GET_RATIO = 1.0  # 64 KiB put + get across two processes <= 1 bare round trip
TARGET_REQUESTS_PER_PUT = 0.01


def _streamer(endpoint: str, conn) -> None:
    """Another process: on each count it is sent, that many puts of 64 KiB with wait=False and
    one flush."""
    with Client(endpoint, timeout=10, name="bench-streamer") as c:
        value = torch.ones(N)
        first = 0
        while (count := conn.recv()) is not None:
            for i in range(first, first + count):
                c.put(f"s{i}", value, wait=False)
            c.flush()
            first += count
            conn.send("done")


def _getter(endpoint: str, conn) -> None:
    """Another process: on each key named, a get of it; answers the time it took."""
    with Client(endpoint, timeout=10, name="bench-getter") as c:
        while True:
            key = conn.recv()
            if key is None:
                return
            t0 = time.perf_counter_ns()
            c.get(key)
            conn.send(time.perf_counter_ns() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="", help="write the results here ('-': stdout)")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    procs: list = []
    start = child_starter(procs)
    with tempfile.TemporaryDirectory(prefix="ecd-bw-") as ring_dir, \
            tempfile.TemporaryDirectory(prefix="ecd-bw-") as trip_dir:
        ringed = BenchDaemon(ring_dir, "bwr", pool="1GiB")
        tripped = BenchDaemon(trip_dir, "bwt", pool="1GiB", extra="[leases]\nsubmit_records = 0\n")
        try:
            res = run(ringed, tripped, start, args.rounds)
        finally:
            for p in procs:
                p.kill()
            ringed.stop()
            tripped.stop()
    res["cpu"] = cpu_name()
    report(res)
    if args.json:
        write_results(args.json, res)


def run(ringed: BenchDaemon, tripped: BenchDaemon, start, rounds: int) -> dict:
    echo = f"ipc://{ringed.runtime_dir}/echo.sock"
    echo_server = start(_echo_server, echo, "REP")
    assert echo_server.recv() == "ready"
    ctx, req = bare_socket("REQ", echo)
    fast, slow = ringed.connect(), tripped.connect()
    getter = start(_getter, ringed.endpoint)
    value, dst = torch.ones(N), torch.empty(N)
    ratios: dict[str, list[float]] = {k: [] for k in ("stream_vs_round_trip_route", "stream_vs_memcpy",
                                                      "waited_put_vs_rtt", "put_get_vs_rtt")}
    raw: dict[str, list[float]] = {k: [] for k in ("stream_ns", "round_trip_route_ns", "memcpy_ns", "waited_ns",
                                                   "rtt_ns", "put_get_ns")}
    counter = iter(range(10**9))

    def rtt() -> None:
        req.send(b"x")
        req.recv()

    def stream(c: Client) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(BLOCK):
            c.put(f"k{next(counter)}", value, wait=False)
        c.flush()
        return (time.perf_counter_ns() - t0) / BLOCK

    for _ in range(3):  # warm: leases granted, pages mapped
        stream(fast), stream(slow), per_op_ns(rtt, BLOCK)
    for _ in range(rounds):
        s, t = stream(fast), stream(slow)
        m = per_op_ns(lambda: dst.copy_(value), BLOCK)
        w = per_op_ns(lambda: fast.put(f"w{next(counter)}", value), BLOCK)
        r = per_op_ns(rtt, BLOCK)
        handoffs = []
        for _ in range(10):
            key = f"h{next(counter)}"
            t0 = time.perf_counter_ns()
            fast.put(key, value)
            put_ns = time.perf_counter_ns() - t0
            getter.send(key)
            handoffs.append(put_ns + getter.recv())
        h = statistics.median(handoffs)
        for name, v in (("stream_ns", s), ("round_trip_route_ns", t), ("memcpy_ns", m), ("waited_ns", w),
                        ("rtt_ns", r), ("put_get_ns", h)):
            raw[name].append(v)
        ratios["stream_vs_round_trip_route"].append(s / t)
        ratios["stream_vs_memcpy"].append(s / m)
        ratios["waited_put_vs_rtt"].append(w / r)
        ratios["put_get_vs_rtt"].append(h / r)
    getter.send(None)
    # 4. requests per put of a streaming producer in another process; 5. into a full pool
    streamer = start(_streamer, ringed.endpoint)
    requests = stream_requests(fast, streamer, PUTS)
    leases = requests.get("lease_space", 0)
    others = sum(n for op, n in requests.items() if op not in ("lease_space", "hello", "bye"))
    streamer.send(ringed_pool_entries(fast) * 5 // 4)  # the pool full of 64 KiB entries, evicting
    assert streamer.recv() == "done"
    full = stream_requests(fast, streamer, PUTS)
    streamer.send(None)
    req.close(0)
    ctx.term()
    fast.close()
    slow.close()
    return {"ratios_median": {k: statistics.median(v) for k, v in ratios.items()},
            "medians_us": {k: statistics.median(v) / 1e3 for k, v in raw.items()},
            "stream_requests": requests, "stream_requests_per_put": others / PUTS, "stream_lease_requests": leases,
            "full_pool_requests": full, "full_pool_lease_requests_per_put": full.get("lease_space", 0) / PUTS,
            "rounds": rounds, "block": BLOCK}


def ringed_pool_entries(c: Client) -> int:
    """How many 64 KiB entries the daemon's host pool holds."""
    return sum(capacity for capacity, _ in c.stats()["pools"]) // (N * 4)


def stream_requests(c: Client, streamer, puts: int) -> dict[str, int]:
    """The daemon's requests by operation while `streamer` makes `puts` puts (and a flush)."""
    ops0 = c.stats()["ops"]
    streamer.send(puts)
    assert streamer.recv() == "done"
    ops1 = c.stats()["ops"]
    requests = {op: ops1.get(op, 0) - ops0.get(op, 0) for op in ops1 if ops1.get(op, 0) != ops0.get(op, 0)}
    requests["stats"] = requests.get("stats", 0) - 1  # our own
    return requests


def report(res: dict) -> None:
    r, m = res["ratios_median"], res["medians_us"]
    print(f"writes without a round trip, 64 KiB, on {res['cpu']} (median of {res['rounds']} paired rounds)")
    print(f"  stream put (wait=False, flush per {res['block']}): {m['stream_ns']:.1f} us = "
          f"{r['stream_vs_round_trip_route']:.2f}x the round-trip route ({m['round_trip_route_ns']:.1f} us), "
          f"{r['stream_vs_memcpy']:.1f}x a memcpy ({m['memcpy_ns']:.1f} us)")
    print(f"  put (wait=True): {m['waited_ns']:.1f} us = {r['waited_put_vs_rtt']:.2f}x a bare round trip "
          f"({m['rtt_ns']:.1f} us)")
    ok = r["put_get_vs_rtt"] <= TARGET_PUT_GET_RATIO
    print(f"  put here + get in another process: {m['put_get_ns']:.1f} us = {r['put_get_vs_rtt']:.2f}x a bare "
          f"round trip  [{'PASS' if ok else 'MISS'}: <= {TARGET_PUT_GET_RATIO}]")
    ok = res["stream_requests_per_put"] <= TARGET_REQUESTS_PER_PUT
    print(f"  a producer's {PUTS} puts: {res['stream_lease_requests']} lease requests, "
          f"{res['stream_requests_per_put']:.3f} other requests per put {res['stream_requests']}  "
          f"[{'PASS' if ok else 'MISS'}: <= {TARGET_REQUESTS_PER_PUT} beyond leases]")
    print(f"  the same into a full pool (every lease evicts): {res['full_pool_lease_requests_per_put']:.3f} lease "
          f"requests per put {res['full_pool_requests']}")


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    sys.exit(main())
