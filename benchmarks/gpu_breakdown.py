#!/usr/bin/env python3
"""Where a CUDA put or get spends its time, on a GPU (the figures under README's GPU arenas).

One process, 1 MiB: medians of each part beside the whole (a bare pyzmq REQ/REP round trip over
ipc, torch copy_ + synchronize, an event record + synchronize, the arena view through
__cuda_array_interface__, ecd's pinned exists, put and get in the arena and the host pool, view),
then cProfile of 300 arena puts and 300 gets. Across processes, 16 MiB: a producer's put, the
pipe hop to the consumer and the consumer's get, medians, beside the same put and get in one
process. `python benchmarks/gpu_breakdown.py` (exits 2 without CUDA).
"""
from __future__ import annotations

import cProfile
import io
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIB = 1 << 20
HANDOFF_ITEMS = 300
HANDOFF_WARM = 50

now_ns = time.perf_counter_ns


def median_us(fn, reps: int = 300, warm: int = 20) -> float:
    for _ in range(warm):
        fn()
    samples = []
    for _ in range(reps):
        t0 = now_ns()
        fn()
        samples.append(now_ns() - t0)
    return round(statistics.median(samples) / 1e3, 1)


def profile(fn, calls: int = 300, top: int = 28) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def one_process(c, torch) -> None:
    x = torch.randint(0, 255, (MIB,), dtype=torch.uint8, device="cuda:0")
    on_host, dst = x.cpu(), torch.empty_like(x)
    c.put("p", x)
    c.put("h", on_host)
    event = torch.cuda.Event()
    plane = c.cuda_plane()
    arena = next(iter(plane.by_pool))

    def view() -> None:
        with c.view("p"):
            pass

    parts = [
        ("copy_ + synchronize, 1 MiB D2D", lambda: (dst.copy_(x), torch.cuda.synchronize())),
        ("event record + synchronize", lambda: (event.record(), event.synchronize())),
        ("arena view (__cuda_array_interface__)", lambda: plane.arena_bytes(arena, 4096, MIB)),
        ("exists with a pin", lambda: c.exists("p", pin_s=1.0)),
        ("put CPU tensor -> host pool", lambda: c.put("h", on_host)),
        ("get host pool -> CPU", lambda: c.get("h")),
        ("put CUDA tensor -> arena", lambda: c.put("p", x)),
        ("get arena -> CUDA", lambda: c.get("p")),
        ("put CUDA tensor -> host pool (tier='host')", lambda: c.put("ph", x, tier="host")),
        ("view of an arena entry", view),
    ]
    for name, fn in parts:
        print(f"  {name:45s} {median_us(fn):8.1f} us", flush=True)
    print("==== cProfile: 300 puts into the arena")
    print(profile(lambda: c.put("p", x)))
    print("==== cProfile: 300 gets out of the arena")
    print(profile(lambda: c.get("p")))


def _producer(endpoint: str, peer) -> None:
    import torch
    from ecd import Client
    c = Client(endpoint, timeout=30)
    x = torch.randint(0, 255, (16 * MIB,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    peer.recv()  # the consumer is ready
    puts = []
    for i in range(HANDOFF_ITEMS):
        t0 = now_ns()
        c.put(f"k{i % 8}", x)
        t1 = now_ns()
        puts.append(t1 - t0)
        peer.send((f"k{i % 8}", t0, t1))
        peer.recv()  # lock-step: the consumer has its copy
    peer.send(puts)
    peer.recv()
    c.close()


def _consumer(endpoint: str, peer) -> None:
    import torch
    from ecd import Client
    c = Client(endpoint, timeout=30)
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    peer.send("ready")
    hops, gets, totals = [], [], []
    for _ in range(HANDOFF_ITEMS):
        key, t0, t1 = peer.recv()
        t2 = now_ns()
        y = c.get(key, device="cuda:0")
        t3 = now_ns()
        hops.append(t2 - t1)
        gets.append(t3 - t2)
        totals.append(t3 - t0)
        del y
        peer.send(True)
    puts = peer.recv()
    peer.send(True)
    c.close()

    def p50(values) -> int:
        return round(statistics.median(values[HANDOFF_WARM:]) / 1e3)

    print(f"  across processes, 16 MiB: put {p50(puts)} us, pipe hop {p50(hops)} us, get {p50(gets)} us, "
          f"total {p50(totals)} us", flush=True)


def handoff(c, endpoint: str, torch) -> None:
    x = torch.randint(0, 255, (16 * MIB,), dtype=torch.uint8, device="cuda:0")
    puts, gets = [], []
    for i in range(200):
        t0 = now_ns()
        c.put(f"s{i % 8}", x)
        t1 = now_ns()
        c.get(f"s{i % 8}")
        puts.append(t1 - t0)
        gets.append(now_ns() - t1)
    print(f"  one process, 16 MiB: put {round(statistics.median(puts[20:]) / 1e3)} us, "
          f"get {round(statistics.median(gets[20:]) / 1e3)} us", flush=True)
    spawn = mp.get_context("spawn")
    producer_end, consumer_end = spawn.Pipe()
    consumer = spawn.Process(target=_consumer, args=(endpoint, consumer_end))
    producer = spawn.Process(target=_producer, args=(endpoint, producer_end))
    consumer.start()
    producer.start()
    producer.join(120)
    consumer.join(120)


def main() -> int:
    import torch
    if not torch.cuda.is_available():
        print("benchmarks/gpu_breakdown.py: no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    from bench_daemon import BenchDaemon
    from gpu import bench_bare_rtt
    bare = bench_bare_rtt(tempfile.mkdtemp())
    print(f"bare pyzmq REQ/REP round trip over ipc: {bare['p50_us']:.1f} us", flush=True)
    daemon = BenchDaemon(tempfile.mkdtemp(), node_prefix="breakdown", pool="1GiB",
                         extra='\n[pool.cuda]\ndevices = [0]\nsize = "1GiB"\n')
    try:
        c = daemon.connect(timeout=30)
        one_process(c, torch)
        handoff(c, daemon.endpoint, torch)
        c.close()
    finally:
        print(f"daemon stopped: exit code {daemon.stop()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
