#!/usr/bin/env python3
"""GPU benchmark for ecd's CUDA data plane (needs a CUDA device; exits 2 with a message without one).

Starts its own daemon with `[pool.cuda]` on device 0 and measures, against references taken in
the same run on the same device:
  a. put / get of 1, 16, 256 MiB CUDA tensors through the arena (device-to-device copies plus
     the control round trips) vs torch `dst.copy_(src)` of the same size: bandwidth ratio
     (target >= 0.8);
  b. host tier: put(tier="host") of a CUDA tensor (D2H into the CUDA-registered shm pool) and
     get(device="cuda:0") of a host entry (H2D from it) vs torch copies to/from pinned memory
     (target >= 0.8);
  c. cross-process on one GPU, per 16 MiB item: producer process -> daemon -> consumer process
     (put; the consumer gets a copy on its device), lock-step, vs the seed approach of vLLM's
     SHM connector in the same run (a fresh tensor per item, torch.multiprocessing.reductions.
     reduce_tensor, the handle pickled over a socket, rebuilt in the consumer, copied out):
     p50 latency per item after warm-up (target >= 10x lower), and the device's free memory
     (torch.cuda.mem_get_info) before and after --items ecd items (target: no growth).
Each timed op ends with the work it queued completed (ecd's calls wait for their copies; the
torch references are followed by a synchronize).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

MIB = 1 << 20
SIZES_MIB = (1, 16, 256)
REPS = {1: 200, 16: 100, 256: 20}
WARMUP = 5
TARGET_BW_RATIO = 0.8
TARGET_LATENCY_RATIO = 10.0
ITEM_MIB = 16
SEED_ITEMS = 300  # the seed approach, timed after warm-up
GROWTH_TOLERANCE = 4 * MIB  # free-memory drift allowed over the ecd items (allocator noise)

now_ns = time.perf_counter_ns


def timed(fn, reps: int) -> float:
    """Median seconds of fn() (which must leave no GPU work pending) after warm-up."""
    for _ in range(WARMUP):
        fn()
    samples = []
    for _ in range(reps):
        t0 = now_ns()
        fn()
        samples.append(now_ns() - t0)
    return statistics.median(samples) / 1e9


def bench_d2d(c, torch) -> dict:
    out = {}
    for mib in SIZES_MIB:
        n = mib * MIB
        x = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
        dst = torch.empty_like(x)
        sync = torch.cuda.synchronize

        def ref():
            dst.copy_(x)
            sync()

        c.put(f"d2d/{mib}", x)
        t_ref = timed(ref, REPS[mib])
        t_put = timed(lambda: c.put(f"d2d/{mib}", x), REPS[mib])
        t_get = timed(lambda: c.get(f"d2d/{mib}"), REPS[mib])
        assert torch.equal(c.get(f"d2d/{mib}"), x), "D2D round trip corrupted the bytes"
        c.delete(f"d2d/{mib}")
        out[str(mib)] = {"torch_copy_GBps": n / t_ref / 1e9, "put_GBps": n / t_put / 1e9,
                         "get_GBps": n / t_get / 1e9, "put_ratio": t_ref / t_put, "get_ratio": t_ref / t_get}
    return out


def bench_host(c, torch) -> dict:
    out = {}
    for mib in SIZES_MIB:
        n = mib * MIB
        x = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        back = torch.empty_like(x)

        def d2h():
            pinned.copy_(x, non_blocking=True)
            torch.cuda.synchronize()

        def h2d():
            back.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

        c.put(f"host/{mib}", x, tier="host")
        t_d2h, t_h2d = timed(d2h, REPS[mib]), timed(h2d, REPS[mib])
        t_put = timed(lambda: c.put(f"host/{mib}", x, tier="host"), REPS[mib])
        t_get = timed(lambda: c.get(f"host/{mib}", device="cuda:0"), REPS[mib])
        assert torch.equal(c.get(f"host/{mib}", device="cuda:0"), x), "host tier corrupted the bytes"
        c.delete(f"host/{mib}")
        out[str(mib)] = {"pinned_d2h_GBps": n / t_d2h / 1e9, "pinned_h2d_GBps": n / t_h2d / 1e9,
                         "put_d2h_GBps": n / t_put / 1e9, "get_h2d_GBps": n / t_get / 1e9,
                         "put_ratio": t_d2h / t_put, "get_ratio": t_h2d / t_get}
    return out


# ---- cross-process --------------------------------------------------------------------------

def _ecd_producer(endpoint: str, items: int, conn) -> None:
    import torch
    from ecd import Client
    c = Client(endpoint, timeout=30, name="gpu-bench-producer")
    x = torch.randint(0, 255, (ITEM_MIB * MIB,), dtype=torch.uint8, device="cuda:0")
    conn.send("ready")
    for i in range(items):
        key = f"xp/{i % 8}"
        t0 = now_ns()
        c.put(key, x)
        conn.send((key, t0))
        conn.recv()  # the consumer has its copy: lock-step, one item in flight
    conn.send(None)
    c.close()


def _ecd_consumer(endpoint: str, conn) -> None:
    import torch
    from ecd import Client
    c = Client(endpoint, timeout=30, name="gpu-bench-consumer")
    torch.zeros(1, device="cuda:0")
    conn.send("ready")
    lat = []
    while True:
        msg = conn.recv()
        if msg is None:
            break
        key, t0 = msg
        y = c.get(key, device="cuda:0")
        lat.append(now_ns() - t0)
        del y
        conn.send(True)
    conn.send(lat)
    c.close()


def _seed_producer(items: int, sock_conn, ack_conn) -> None:
    """vLLM SHM connector's seed: reduce_tensor per item, the handle sent over a socket."""
    import pickle
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    base = torch.randint(0, 255, (ITEM_MIB * MIB,), dtype=torch.uint8, device="cuda:0")
    ack_conn.send("ready")
    for _ in range(items):
        t = base.clone()  # a fresh output per item, as an encoder produces
        torch.cuda.synchronize()
        t0 = now_ns()
        rebuild, args = reduce_tensor(t)
        sock_conn.send_bytes(pickle.dumps((rebuild, args, t0)))
        ack_conn.recv()
        del t  # kept alive until the consumer is done (torch's IPC ref counting holds the block too)
    sock_conn.send_bytes(pickle.dumps(None))


def _seed_consumer(sock_conn, ack_conn) -> None:
    import pickle
    import torch
    torch.zeros(1, device="cuda:0")
    ack_conn.send("ready")
    lat = []
    while True:
        msg = pickle.loads(sock_conn.recv_bytes())
        if msg is None:
            break
        rebuild, args, t0 = msg
        shared = rebuild(*args)
        y = shared.clone()
        torch.cuda.synchronize()
        lat.append(now_ns() - t0)
        del shared, y
        ack_conn.send(True)
    ack_conn.send(lat)


def _p50_after_warmup(lat: list[int], warm: int) -> dict:
    timed_part = sorted(lat[warm:])
    return {"p50_us": timed_part[len(timed_part) // 2] / 1e3,
            "p99_us": timed_part[min(len(timed_part) - 1, int(len(timed_part) * 0.99))] / 1e3,
            "items": len(timed_part)}


def bench_cross_process(endpoint: str, items: int, torch) -> dict:
    spawn = mp.get_context("spawn")
    # ecd
    p_parent, p_child = spawn.Pipe()
    c_parent, c_child = spawn.Pipe()
    prod = spawn.Process(target=_ecd_producer, args=(endpoint, items, p_child), daemon=True)
    cons = spawn.Process(target=_ecd_consumer, args=(endpoint, c_child), daemon=True)
    prod.start()
    cons.start()
    assert p_parent.recv() == "ready" and c_parent.recv() == "ready"
    torch.cuda.synchronize()
    free_before = free_after_warm = torch.cuda.mem_get_info(0)[0]
    warm = min(100, items // 10)
    n = 0
    while True:
        msg = p_parent.recv()
        c_parent.send(msg)
        if msg is None:
            break
        p_parent.send(c_parent.recv())
        n += 1
        if n == warm:
            free_after_warm = torch.cuda.mem_get_info(0)[0]
    lat = c_parent.recv()
    free_after = torch.cuda.mem_get_info(0)[0]
    prod.join(30)
    cons.join(30)
    ecd = _p50_after_warmup(lat, warm)
    ecd.update(free_before=free_before, free_after_warmup=free_after_warm, free_after=free_after,
               growth_bytes=free_after_warm - free_after)
    # the seed approach
    s_parent, s_child = spawn.Pipe()  # the "socket" the handles travel on
    a_parent, a_child = spawn.Pipe()
    b_parent, b_child = spawn.Pipe()
    prod = spawn.Process(target=_seed_producer, args=(SEED_ITEMS + 20, s_child, a_child), daemon=True)
    cons = spawn.Process(target=_seed_consumer, args=(s_parent, b_child), daemon=True)
    prod.start()
    cons.start()
    assert a_parent.recv() == "ready" and b_parent.recv() == "ready"
    seed_free_before = torch.cuda.mem_get_info(0)[0]
    for _ in range(SEED_ITEMS + 20):
        a_parent.send(b_parent.recv())
    seed_lat = b_parent.recv()
    seed_free_after = torch.cuda.mem_get_info(0)[0]
    prod.join(30)
    cons.join(30)
    seed = _p50_after_warmup(seed_lat, 20)
    seed.update(growth_bytes=seed_free_before - seed_free_after)
    return {"ecd": ecd, "seed_reduce_tensor": seed, "latency_ratio": seed["p50_us"] / ecd["p50_us"]}


# ---- report ---------------------------------------------------------------------------------

def report(res: dict) -> list[tuple[str, bool, str]]:
    print(f"\necd GPU benchmark on {res['env']['device']} (torch {res['env']['torch']})\n")
    print(f"{'size':>8} | {'torch copy_':>12} | {'ecd put':>10} | {'ecd get':>10} | {'put ratio':>9} | {'get ratio':>9}")
    targets = []
    for mib, r in res["d2d"].items():
        print(f"{mib + ' MiB':>8} | {r['torch_copy_GBps']:9.1f} GB/s | {r['put_GBps']:7.1f} GB/s | "
              f"{r['get_GBps']:7.1f} GB/s | {r['put_ratio']:9.2f} | {r['get_ratio']:9.2f}")
        ratio = min(r["put_ratio"], r["get_ratio"])
        targets.append((f"D2D {mib} MiB >= {TARGET_BW_RATIO:.0%} of copy_", ratio >= TARGET_BW_RATIO, f"{ratio:.2f}"))
    print(f"\n{'size':>8} | {'pinned D2H':>11} | {'ecd put host':>12} | {'pinned H2D':>11} | {'ecd get H2D':>11}")
    for mib, r in res["host"].items():
        print(f"{mib + ' MiB':>8} | {r['pinned_d2h_GBps']:6.1f} GB/s | {r['put_d2h_GBps']:7.1f} GB/s | "
              f"{r['pinned_h2d_GBps']:6.1f} GB/s | {r['get_h2d_GBps']:6.1f} GB/s")
        ratio = min(r["put_ratio"], r["get_ratio"])
        targets.append((f"host tier {mib} MiB >= {TARGET_BW_RATIO:.0%} of pinned", ratio >= TARGET_BW_RATIO,
                        f"D2H {r['put_ratio']:.2f}, H2D {r['get_ratio']:.2f}"))
    x = res["cross_process"]
    e, s = x["ecd"], x["seed_reduce_tensor"]
    print(f"\ncross-process {ITEM_MIB} MiB item, p50 (p99): ecd {e['p50_us']:.0f} us ({e['p99_us']:.0f}), "
          f"reduce_tensor seed {s['p50_us']:.0f} us ({s['p99_us']:.0f}); ratio {x['latency_ratio']:.1f}x")
    print(f"GPU free memory over {e['items']} ecd items after warm-up: {e['growth_bytes'] / MIB:+.1f} MiB used; "
          f"seed over {s['items']} items: {s['growth_bytes'] / MIB:+.1f} MiB")
    targets.append((f"cross-process latency >= {TARGET_LATENCY_RATIO:.0f}x lower than the seed",
                    x["latency_ratio"] >= TARGET_LATENCY_RATIO, f"{x['latency_ratio']:.1f}x"))
    targets.append(("no GPU memory growth over the ecd items", e["growth_bytes"] <= GROWTH_TOLERANCE,
                    f"{e['growth_bytes'] / MIB:+.1f} MiB"))
    print()
    for name, ok, detail in targets:
        print(f"{'PASS' if ok else 'MISS'}  {name}: {detail}")
    return targets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--items", type=int, default=10_000, help="cross-process ecd items (memory check)")
    ap.add_argument("--arena", default="2GiB", help="[pool.cuda] size on device 0")
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device (torch.cuda.is_available() is False): nothing to measure",
              file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_daemon import BenchDaemon, write_results
    workdir = tempfile.mkdtemp(prefix="ecd-gpu-bench-")
    daemon = BenchDaemon(workdir, node_prefix="gpubench", pool="2GiB",
                         extra=f'\n[pool.cuda]\ndevices = [0]\nsize = "{args.arena}"\n')
    ok = False
    try:
        c = daemon.connect(timeout=30)
        if not c.welcome.arenas:
            raise RuntimeError("the daemon exported no CUDA arena")
        res = {"env": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()}}
        res["d2d"] = bench_d2d(c, torch)
        res["host"] = bench_host(c, torch)
        res["cross_process"] = bench_cross_process(daemon.endpoint, args.items, torch)
        c.close()
        res["targets"] = [{"name": n, "pass": p, "detail": d} for n, p, d in report(res)]
        ok = True
    finally:
        rc = daemon.stop()
        print(f"daemon stopped with SIGTERM: exit code {rc}")
        if rc != 0:
            print(daemon.log_tail())
            ok = False
        shutil.rmtree(workdir, ignore_errors=True)
    if ok and args.json:
        write_results(args.json, res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
