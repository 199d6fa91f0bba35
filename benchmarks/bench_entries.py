#!/usr/bin/env python3
"""Per-entry cost of ecd (issue 26, item 3): many small entries in one request each way.

Starts its own daemon (`python -m ecd serve`, benchmarks/bench_daemon.py) and, for each shape
N x S (N entries of S bytes; defaults 252 x 32 KiB, a KV block of every layer for a batch, and
64 x 8 KiB, embeddings), measures in alternating reps:

  put_many          Client.put_many({key: tensor}) of all N new keys in one call (rows of one
                    contiguous tensor; deleted again after each rep, outside the timing)
  put_many_replace  the same keys again: each commit also retires the entry it replaces
  get_many          Client.get_many(keys): copies out of the pool into new tensors
  view_many         Client.view_many(keys) and one copy of each view into a preallocated buffer
  kv_save           what EcdKVConnector's worker saves: PagedKV.gather (strided views of a paged
                    cache whose layers share one allocation, vLLM's own) + put_many, new keys
  kv_load           what it loads on a CPU engine: view_many + PagedKV.scatter_found into it

each paired with its reference taken right beside it: one memcpy (np.copyto) of the same N x S
bytes between two pre-faulted buffers. Reported: the per-entry overhead (op - memcpy) / N in us
and op / memcpy, medians over the reps; the target is <= 10 us per 32 KiB entry. Beside wall time,
CPU per entry: the client process's (all threads) + the daemon's (all threads, from
/proc/PID/task/*/schedstat) CPU for the op, minus the memcpy, split into client and daemon. On a
small machine shared with other work, wall medians move 2-3x between runs; CPU per entry does not
count what the other processes ran, so before/after comparisons read it first.

Also put + get of ONE 64 KiB entry against a bare pyzmq REQ/REP round trip over ipc to an echo
process (as bench_core's), alternating: target put+get <= 2 bare round trips.

Nothing is asserted: targets print as met/missed. `--json PATH` ('-': stdout) writes the results.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import shutil
import tempfile
import time

import numpy as np
import torch

from ecd.client.client import Client
from ecd.integrations.vllm.paged_kv import PagedKV

from bench_daemon import BenchDaemon, write_results

TARGET_ENTRY_US = 10.0  # per 32 KiB entry above the memcpy
TARGET_SMALL_RTT = 2.0  # put+get of 64 KiB <= 2 bare ZeroMQ round trips
SMALL_BYTES = 64 << 10
now_ns = time.perf_counter_ns


def prefaulted(nbytes: int) -> np.ndarray:
    a = np.empty(max(nbytes, 1), np.uint8)
    a.fill(1)
    return a[:nbytes]


def _echo_server(endpoint: str, conn) -> None:
    """A bare REP echo over ipc: the round-trip reference (pyzmq alone, one I/O thread)."""
    import zmq
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    conn.send("ready")
    while True:
        msg = sock.recv()
        sock.send(msg)
        if msg == b"stop":
            break
    sock.close(0)
    ctx.term()


class PagedCache:
    """A paged KV cache as vLLM allocates it on a CPU engine: per-layer views [blocks, *block] of
    one allocation at a constant distance, so PagedKV sees one strided [blocks, layers, *block]."""

    def __init__(self, entry_bytes: int, blocks: int, layers: int = 4) -> None:
        if entry_bytes % (layers * 2):
            layers = 1
        per_layer = entry_bytes // (layers * 2)  # fp16 elements of one block of one layer
        buf = torch.from_numpy(prefaulted(layers * blocks * per_layer * 2)).view(torch.float16)
        whole = buf.view(layers, blocks, per_layer)
        self.paged = PagedKV({f"layer.{i}": whole[i] for i in range(layers)}, blocks)


def daemon_cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` so far (/proc/PID/task/*/schedstat: ns, not ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def _ratios(op_ns: list[int], ref_ns: list[int], n: int, cpu_ns: list[int], daemon_ns: list[int]) -> dict:
    op, ref = np.array(op_ns, float), np.array(ref_ns, float)
    per_entry = (op - ref) / n / 1e3
    # CPU (client process, all its threads, + daemon, all its threads) per entry above the
    # memcpy's: what other processes do on a loaded machine does not count in it, unlike wall time
    cpu = (np.array(cpu_ns, float) - ref) / n / 1e3
    daemon = np.array(daemon_ns, float) / n / 1e3
    return {"cpu_per_entry_over_memcpy_us_p50": float(np.median(cpu)),
            "daemon_cpu_per_entry_us_p50": float(np.median(daemon)),  # the rest of it is the client's
            "client_cpu_per_entry_over_memcpy_us_p50": float(np.median(cpu - daemon)),
            "cpu_per_entry_over_memcpy_us_p10": float(np.percentile(cpu, 10)),
            "op_us_p50": float(np.median(op) / 1e3), "memcpy_us_p50": float(np.median(ref) / 1e3),
            "per_entry_overhead_us_p50": float(np.median(per_entry)),
            "per_entry_overhead_us_p10": float(np.percentile(per_entry, 10)),
            "per_entry_overhead_us_p90": float(np.percentile(per_entry, 90)),
            "ratio_to_memcpy_p50": float(np.median(op / ref)), "reps": len(op_ns)}


def bench_shape(c: Client, daemon_pid: int, n: int, size: int, reps: int, warmup: int, tag: str) -> dict:
    total = n * size
    src = torch.from_numpy(prefaulted(total)).view(n, size)
    ref_src, ref_dst = prefaulted(total), prefaulted(total)
    sink = prefaulted(total).reshape(n, size) if size else prefaulted(0)
    keys = [f"{tag}/{i}" for i in range(n)]  # put once: what get_many and view_many read
    new_keys = [f"{tag}/new/{i}" for i in range(n)]  # put and deleted again each rep
    kv_keys = [f"{tag}/kv/{i}" for i in range(n)]  # the paged cache's layout, for kv_load
    kv_new = [f"{tag}/kvnew/{i}" for i in range(n)]
    items = {k: src[i] for i, k in enumerate(keys)}
    new_items = {k: src[i] for i, k in enumerate(new_keys)}
    cache = PagedCache(size, blocks=n) if size else None
    block_ids = list(range(n))

    def memcpy() -> None:
        np.copyto(ref_dst, ref_src)

    def put_many() -> None:
        c.put_many(new_items)

    def put_many_replace() -> None:
        c.put_many(items)

    def get_many() -> None:
        c.get_many(keys)

    def view_many() -> None:
        with c.view_many(keys) as views:
            for row, v in zip(sink, views):
                np.copyto(row, v.numpy().view(np.uint8).reshape(-1))

    def kv_save(keys=kv_new) -> None:
        paged = cache.paged
        c.put_many(dict(zip(keys, paged.gather(block_ids))))

    def kv_load() -> None:
        with c.view_many(kv_keys, missing_ok=True) as views:
            missing, failed, error = cache.paged.scatter_found(block_ids, views)
        if missing or failed or error:
            raise RuntimeError(f"kv_load: {missing} missing, {failed[:3]} failed, {error!r}")

    ops = {"put_many": put_many, "put_many_replace": put_many_replace, "get_many": get_many,
           "view_many": view_many}
    if cache is not None:
        ops.update(kv_save=kv_save, kv_load=kv_load)
    after = {"put_many": lambda: c.delete(new_keys), "kv_save": lambda: c.delete(kv_new)}  # untimed
    samples: dict[str, tuple[list[int], list[int], list[int], list[int]]] = {name: ([], [], [], []) for name in ops}
    put_many_replace()
    if cache is not None:
        kv_save(kv_keys)
    for i in range(warmup + reps):
        for name, fn in (ops.items() if i % 2 else reversed(list(ops.items()))):
            first_ref = (i // 2) % 2 == 0  # the reference before, then after, the op
            if first_ref:
                t0 = now_ns()
                memcpy()
                t1 = now_ns()
            c2, d2 = time.process_time_ns(), daemon_cpu_ns(daemon_pid)
            t2 = now_ns()
            fn()
            t3 = now_ns()
            c3, d3 = time.process_time_ns(), daemon_cpu_ns(daemon_pid)
            if not first_ref:
                t0 = now_ns()
                memcpy()
                t1 = now_ns()
            if i >= warmup:
                samples[name][0].append(t3 - t2)
                samples[name][1].append(t1 - t0)
                samples[name][2].append(c3 - c2 + d3 - d2)
                samples[name][3].append(d3 - d2)
            if name in after:
                after[name]()
    c.delete(keys + kv_keys)
    return {name: _ratios(op, ref, n, cpu, daemon) for name, (op, ref, cpu, daemon) in samples.items()}


def bench_small(c: Client, echo_endpoint: str, reps: int, warmup: int) -> dict:
    """put + get of one 64 KiB entry against one bare REQ/REP round trip, alternating."""
    import zmq
    ctx = zmq.Context(io_threads=1)
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(echo_endpoint)
    t = torch.from_numpy(prefaulted(SMALL_BYTES))
    payload = b"x" * 32
    pg, rt = [], []
    try:
        for i in range(warmup + reps):
            t0 = now_ns()
            c.put("small/64k", t)
            c.get("small/64k")
            t1 = now_ns()
            req.send(payload)
            req.recv()
            t2 = now_ns()
            if i >= warmup:
                pg.append(t1 - t0)
                rt.append(t2 - t1)
        req.send(b"stop")
        req.recv()
    finally:
        req.close(0)
        ctx.term()
    op, ref = np.array(pg, float), np.array(rt, float)
    return {"put_get_us_p50": float(np.median(op) / 1e3), "bare_rtt_us_p50": float(np.median(ref) / 1e3),
            "ratio_to_rtt_p50": float(np.median(op / ref)), "reps": reps}


def report(res: dict) -> None:
    print(f"\nload average {res['env']['loadavg_start']} -> {res['env']['loadavg_end']}; "
          f"{res['env']['cpus']} CPUs")
    print("\n| shape | op | op p50 us | memcpy p50 us | per-entry over memcpy us (p10-p90) | op/memcpy "
          "| CPU per entry over memcpy us (p10) | of it: client + daemon |")
    print("|---|---|---:|---:|---|---:|---:|---|")
    for shape, ops in res["shapes"].items():
        for name, r in ops.items():
            print(f"| {shape} | {name} | {r['op_us_p50']:.0f} | {r['memcpy_us_p50']:.0f} | "
                  f"{r['per_entry_overhead_us_p50']:.1f} ({r['per_entry_overhead_us_p10']:.1f}-"
                  f"{r['per_entry_overhead_us_p90']:.1f}) | {r['ratio_to_memcpy_p50']:.2f} | "
                  f"{r['cpu_per_entry_over_memcpy_us_p50']:.1f} ({r['cpu_per_entry_over_memcpy_us_p10']:.1f}) | "
                  f"{r['client_cpu_per_entry_over_memcpy_us_p50']:.1f} + {r['daemon_cpu_per_entry_us_p50']:.1f} |")
    s = res["small"]
    print(f"\nput+get of one 64 KiB entry: {s['put_get_us_p50']:.0f} us, bare ZeroMQ round trip "
          f"{s['bare_rtt_us_p50']:.0f} us: {s['ratio_to_rtt_p50']:.2f} round trips (paired median)")
    print("\ntargets (issue 26):")
    for t in res["targets"]:
        print(f"  {'met   ' if t['met'] else 'MISSED'} {t['name']}: {t['detail']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", metavar="NxBYTES",
                    help="N entries of BYTES each (repeatable; default 252x32768 and 64x8192)")
    ap.add_argument("--reps", type=int, default=60, help="timed reps per op and shape")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--small-reps", type=int, default=400)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': stdout)")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in (args.shape or ["252x32768", "64x8192"])]
    workdir = tempfile.mkdtemp(prefix="ecd-bench-entries-")
    daemon = BenchDaemon(workdir, node_prefix="bentries")
    spawn = mp.get_context("spawn")
    echo = None
    try:
        c = daemon.connect()
        echo_endpoint = f"ipc://{daemon.runtime_dir}/echo.sock"
        parent, child = spawn.Pipe()
        echo = spawn.Process(target=_echo_server, args=(echo_endpoint, child), daemon=True)
        echo.start()
        if not parent.poll(60) or parent.recv() != "ready":
            raise RuntimeError("the echo process did not start")
        res: dict = {"env": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                             "numpy": np.__version__, "loadavg_start": os.getloadavg()}, "shapes": {}}
        for n, size in shapes:
            res["shapes"][f"{n}x{size}"] = bench_shape(c, daemon.proc.pid, n, size, args.reps, args.warmup, f"b{n}x{size}")
        res["small"] = bench_small(c, echo_endpoint, args.small_reps, max(20, args.small_reps // 10))
        res["env"]["loadavg_end"] = os.getloadavg()
        c.close()
        targets = []
        for shape, ops in res["shapes"].items():
            if shape.endswith("x32768"):
                for name, r in ops.items():
                    v = r["per_entry_overhead_us_p50"]
                    targets.append({"name": f"{shape} {name} <= {TARGET_ENTRY_US:g} us/entry above memcpy",
                                    "met": v <= TARGET_ENTRY_US, "detail": f"{v:.1f} us/entry"})
        v = res["small"]["ratio_to_rtt_p50"]
        targets.append({"name": f"put+get 64 KiB <= {TARGET_SMALL_RTT:g} bare ZeroMQ round trips",
                        "met": v <= TARGET_SMALL_RTT, "detail": f"{v:.2f} round trips"})
        res["targets"] = targets
        report(res)
    finally:
        if echo is not None and echo.is_alive():
            echo.terminate()
        rc = daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"daemon stopped: exit code {rc}")
    if args.json:
        write_results(args.json, res)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
