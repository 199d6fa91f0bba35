#!/usr/bin/env python3
"""GPU benchmark for ecd's CUDA data plane (needs a CUDA device; exits 2 with a message without one).

Starts its own daemon with `[pool.cuda]` on device 0 and measures, against references taken in
the same run on the same device (the repo's rule: each sample divided by a reference taken right
beside it, the median of those ratios quoted):
  floor. a bare pyzmq REQ/REP round trip over ipc (64-byte messages, an echo thread in this
     process), median: the least any design that does one synchronous control round trip per op
     pays on top of the copy. Per size, floor = copy_time / (copy_time + bare_rtt) is the best
     bandwidth ratio such a design could reach; put and get are also quoted as a fraction of it.
  a. D2D: put / get of 1, 16, 256 MiB CUDA tensors through the arena (device-to-device copies
     plus the control round trips) vs torch `dst.copy_(src)` of the same size. Each rep times
     the copy_ then the ecd op, back to back; put_ratio / get_ratio are the medians of the
     per-rep copy_time / ecd_time (>= 1: as fast as copy_; target >= 0.8), bandwidths are from
     the median times.
  b. host tier: put(tier="host") of a CUDA tensor (D2H into the CUDA-registered shm pool) and
     get(device="cuda:0") of a host entry (H2D from it) vs torch copies to/from pinned memory,
     paired the same way (target >= 0.8).
  c. cross-process on one GPU, per 16 MiB item, lock-step (one item in flight, the consumer acks
     the producer), the item's message going straight from producer to consumer over a pipe of
     their own in every variant (this process only collects results and free-memory readings):
     - ecd: the producer puts, the consumer reads it either with get(key, device="cuda:0") or
       with view(key) cloned on the device (zero-copy CUDA tensor over the arena), alternately;
     - the seed approach of vLLM's SHM connector: a fresh tensor per item, torch.multiprocessing.
       reductions.reduce_tensor, the handle pickled over the pipe, rebuilt in the consumer,
       cloned; "cached handle": as torch's caching allocator does it (the block, and so its IPC
       handle, may be reused); "fresh handle": after each item the consumer drops the tensor and
       calls ipc_collect() and empty_cache(), the producer drops its tensor and does the same, so
       every item is a new cudaMalloc with a new handle.
     p50/p99 latency per item after warm-up (from before the put / reduce_tensor to the
     consumer's copy being complete); seed p50 / ecd p50 for each pair (target >= 10x for the
     cached-handle seed against ecd get), and the device's free memory (torch.cuda.mem_get_info)
     after warm-up and after --items ecd items (target: no growth).
Each timed op ends with the work it queued completed (ecd's calls wait for their copies; the
torch references are followed by a synchronize). Each measurement is guarded: one that fails is
reported and the others still run. Exit code 0 when the measurements ran (targets missed or not),
1 when something broke, 2 without CUDA. --quick: fewer reps and items (well under 90 s on an H100).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback

from gpu_handoff import ITEM_MIB, MIB, bench_cross_process, guarded, summary_us

SIZES_MIB = (1, 16, 256)
REPS = {1: 200, 16: 100, 256: 20}
QUICK_REPS = {1: 100, 16: 50, 256: 10}
WARMUP = 5
TARGET_BW_RATIO = 0.8
TARGET_LATENCY_RATIO = 10.0
ITEMS, QUICK_ITEMS = 10_000, 300  # cross-process ecd items (default of --items)
SEED_ITEMS, QUICK_SEED_ITEMS = 300, 100  # each seed variant, timed after SEED_WARMUP
BARE_RTT_SAMPLES = 2000
GROWTH_TOLERANCE = 4 * MIB  # free-memory drift allowed over the ecd items (allocator noise)

now_ns = time.perf_counter_ns


def errors_in(res, where: str = "") -> list[str]:
    """Where the results say something broke: every "error" entry, by path."""
    out = []
    if isinstance(res, dict):
        for key, value in res.items():
            path = f"{where}.{key}" if where else str(key)
            if key == "error":
                out.append(f"{where or 'results'}: {value}")
            else:
                out += errors_in(value, path)
    return out


def median(values) -> float:
    return statistics.median(values)


def paired(ref, op, reps: int) -> tuple[list[int], list[int]]:
    """Nanoseconds of ref() and op() per rep, each rep timing ref then op back to back (both must
    leave no GPU work pending), after WARMUP untimed pairs."""
    for _ in range(WARMUP):
        ref()
        op()
    ref_ns, op_ns = [], []
    for _ in range(reps):
        t0 = now_ns()
        ref()
        t1 = now_ns()
        op()
        t2 = now_ns()
        ref_ns.append(t1 - t0)
        op_ns.append(t2 - t1)
    return ref_ns, op_ns


def ratio_of(ref_ns: list[int], op_ns: list[int]) -> float:
    """The median of per-rep ref_time / op_time (>= 1: the op is as fast as the reference)."""
    return median([r / o for r, o in zip(ref_ns, op_ns)])


def floor_of(copy_s: float, rtt_s: float | None) -> float | None:
    """The best bandwidth ratio to `copy` of a design that adds one synchronous round trip."""
    return None if rtt_s is None else copy_s / (copy_s + rtt_s)


# ---- the floor: a bare round trip -----------------------------------------------------------

def bench_bare_rtt(workdir: str, samples: int = BARE_RTT_SAMPLES) -> dict:
    """A bare pyzmq REQ/REP round trip over ipc, 64-byte messages, to an echo thread of this
    process: median (p99) after warm-up."""
    import zmq
    ctx = zmq.Context()
    endpoint = f"ipc://{workdir}/echo.sock"
    rep = ctx.socket(zmq.REP)
    rep.bind(endpoint)

    def serve() -> None:
        while True:
            msg = rep.recv()
            rep.send(msg)
            if msg == b"stop":
                return

    thread = threading.Thread(target=serve, name="bare-rtt-echo", daemon=True)
    thread.start()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.RCVTIMEO, 10_000)
    req.connect(endpoint)
    payload = b"x" * 64
    try:
        for _ in range(200):
            req.send(payload)
            req.recv()
        lat = []
        for _ in range(samples):
            t0 = now_ns()
            req.send(payload)
            req.recv()
            lat.append(now_ns() - t0)
        req.send(b"stop")
        req.recv()
    except BaseException:
        req.close(0)  # the echo thread may be stuck: left as it is (a daemon thread), ctx not termed
        raise
    thread.join(10)
    req.close(0)
    rep.close(0)
    ctx.term()
    return summary_us(lat, 0)


# ---- a, b: bandwidth beside torch's copies ---------------------------------------------------

def _d2d_size(c, torch, mib: int, reps: int, rtt_s: float | None) -> dict:
    n = mib * MIB
    key = f"d2d/{mib}"
    x = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(x)
    sync = torch.cuda.synchronize
    sync()

    def ref():
        dst.copy_(x)
        sync()

    try:
        ref_put, put_ns = paired(ref, lambda: c.put(key, x), reps)
        if not torch.equal(c.get(key), x):
            raise AssertionError("D2D round trip corrupted the bytes")
        ref_get, get_ns = paired(ref, lambda: c.get(key), reps)
    finally:
        try:
            c.delete(key)
        except Exception as exc:
            print(f"benchmarks/gpu.py: delete {key}: {exc!r}", file=sys.stderr)
    copy_s = median(ref_put + ref_get) / 1e9
    put_s, get_s = median(put_ns) / 1e9, median(get_ns) / 1e9
    out = {"reps": reps, "copy_us": copy_s * 1e6, "put_us": put_s * 1e6, "get_us": get_s * 1e6,
           "torch_copy_GBps": n / copy_s / 1e9, "put_GBps": n / put_s / 1e9, "get_GBps": n / get_s / 1e9,
           "put_ratio": ratio_of(ref_put, put_ns), "get_ratio": ratio_of(ref_get, get_ns)}
    floor = floor_of(copy_s, rtt_s)
    if floor is not None:
        out.update(floor_ratio=floor, put_of_floor=out["put_ratio"] / floor, get_of_floor=out["get_ratio"] / floor)
    return out


def bench_d2d(c, torch, reps: dict, rtt_s: float | None) -> dict:
    return {str(mib): guarded(f"D2D {mib} MiB", _d2d_size, c, torch, mib, reps[mib], rtt_s) for mib in SIZES_MIB}


def _host_size(c, torch, mib: int, reps: int, rtt_s: float | None) -> dict:
    n = mib * MIB
    key = f"host/{mib}"
    x = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    back = torch.empty_like(x)
    torch.cuda.synchronize()

    def d2h():
        pinned.copy_(x, non_blocking=True)
        torch.cuda.synchronize()

    def h2d():
        back.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    try:
        ref_d2h, put_ns = paired(d2h, lambda: c.put(key, x, tier="host"), reps)
        if not torch.equal(c.get(key, device="cuda:0"), x):
            raise AssertionError("host tier corrupted the bytes")
        ref_h2d, get_ns = paired(h2d, lambda: c.get(key, device="cuda:0"), reps)
    finally:
        try:
            c.delete(key)
        except Exception as exc:
            print(f"benchmarks/gpu.py: delete {key}: {exc!r}", file=sys.stderr)
    d2h_s, h2d_s = median(ref_d2h) / 1e9, median(ref_h2d) / 1e9
    put_s, get_s = median(put_ns) / 1e9, median(get_ns) / 1e9
    out = {"reps": reps, "pinned_d2h_us": d2h_s * 1e6, "pinned_h2d_us": h2d_s * 1e6, "put_us": put_s * 1e6,
           "get_us": get_s * 1e6, "pinned_d2h_GBps": n / d2h_s / 1e9, "pinned_h2d_GBps": n / h2d_s / 1e9,
           "put_d2h_GBps": n / put_s / 1e9, "get_h2d_GBps": n / get_s / 1e9,
           "put_ratio": ratio_of(ref_d2h, put_ns), "get_ratio": ratio_of(ref_h2d, get_ns)}
    floor_put, floor_get = floor_of(d2h_s, rtt_s), floor_of(h2d_s, rtt_s)
    if floor_put is not None and floor_get is not None:
        out.update(floor_put_ratio=floor_put, floor_get_ratio=floor_get,
                   put_of_floor=out["put_ratio"] / floor_put, get_of_floor=out["get_ratio"] / floor_get)
    return out


def bench_host(c, torch, reps: dict, rtt_s: float | None) -> dict:
    return {str(mib): guarded(f"host tier {mib} MiB", _host_size, c, torch, mib, reps[mib], rtt_s)
            for mib in SIZES_MIB}


# ---- c. cross-process ------------------------------------------------------------------------
# Each variant: a producer and a consumer joined by a duplex pipe of their own (the item's
# message one way, the ack the other), each with a control pipe to this process. The producer
# says "ready", waits for "go", and after `warm` items says "warm" (this process reads the free
# memory, says "go"); after its last item "done" (the same), then ends the consumer (None). The
# consumer says "ready", then sends its latencies [(item, ns)] back when it is ended.




# ---- report ---------------------------------------------------------------------------------

def _f(value, fmt: str) -> str:
    """A number in `fmt` (e.g. "9.2f"), or "-" in the same width when there is none."""
    return "-".rjust(int(fmt.split(".")[0])) if value is None else format(value, fmt)


def report(res: dict) -> list[tuple[str, str, str]]:
    """Print the tables; [(PASS | MISS | INFO, name, detail)], also printed at the end."""
    lines: list[tuple[str, str, str]] = []
    env = res.get("env", {})
    print(f"\necd GPU benchmark on {env.get('device')} (torch {env.get('torch')}, CUDA {env.get('cuda')})"
          f"{' --quick' if res.get('quick') else ''}\n")
    bare = res.get("bare_rtt", {})
    if "error" in bare:
        print(f"bare pyzmq REQ/REP round trip: FAILED ({bare['error']}): no floors")
    else:
        print(f"bare pyzmq REQ/REP round trip over ipc (64 B, echo thread in this process): "
              f"p50 {bare['p50_us']:.1f} us (p99 {bare['p99_us']:.1f})")
        print("floor = copy / (copy + bare round trip): the best ratio with one synchronous round trip per op")
    print("ratios: median over reps of copy_time / ecd_time, each rep timing torch's copy then ecd's op "
          "back to back (>= 1: as fast as the copy)\n")

    print(f"{'D2D':>8} | {'torch copy_':>12} | {'ecd put':>12} | {'ecd get':>12} | {'put ratio':>9} | "
          f"{'get ratio':>9} | {'floor':>5} | {'put/floor':>9} | {'get/floor':>9}")
    for mib, r in res.get("d2d", {}).items():
        if "error" in r:
            print(f"{mib + ' MiB':>8} | FAILED: {r['error']}")
            continue
        print(f"{mib + ' MiB':>8} | {r['torch_copy_GBps']:7.1f} GB/s | {r['put_GBps']:7.1f} GB/s | "
              f"{r['get_GBps']:7.1f} GB/s | {r['put_ratio']:9.2f} | {r['get_ratio']:9.2f} | "
              f"{_f(r.get('floor_ratio'), '5.2f')} | {_f(r.get('put_of_floor'), '9.2f')} | "
              f"{_f(r.get('get_of_floor'), '9.2f')}")
        ratio = min(r["put_ratio"], r["get_ratio"])
        lines.append(("PASS" if ratio >= TARGET_BW_RATIO else "MISS", f"D2D {mib} MiB >= {TARGET_BW_RATIO:.0%} of copy_",
                      f"put {r['put_ratio']:.2f}, get {r['get_ratio']:.2f}"))
        if r.get("floor_ratio") is not None:
            lines.append(("INFO", f"D2D {mib} MiB floor (copy_ + one bare round trip)",
                          f"{r['floor_ratio']:.2f}; put at {r['put_of_floor']:.2f} of it, "
                          f"get at {r['get_of_floor']:.2f}"))

    print(f"\n{'host':>8} | {'pinned D2H':>12} | {'ecd put host':>12} | {'pinned H2D':>12} | {'ecd get H2D':>12} | "
          f"{'put ratio':>9} | {'get ratio':>9} | {'floor D2H':>9} | {'floor H2D':>9} | {'put/floor':>9} | "
          f"{'get/floor':>9}")
    for mib, r in res.get("host", {}).items():
        if "error" in r:
            print(f"{mib + ' MiB':>8} | FAILED: {r['error']}")
            continue
        print(f"{mib + ' MiB':>8} | {r['pinned_d2h_GBps']:7.1f} GB/s | {r['put_d2h_GBps']:7.1f} GB/s | "
              f"{r['pinned_h2d_GBps']:7.1f} GB/s | {r['get_h2d_GBps']:7.1f} GB/s | {r['put_ratio']:9.2f} | "
              f"{r['get_ratio']:9.2f} | {_f(r.get('floor_put_ratio'), '9.2f')} | {_f(r.get('floor_get_ratio'), '9.2f')} | "
              f"{_f(r.get('put_of_floor'), '9.2f')} | {_f(r.get('get_of_floor'), '9.2f')}")
        ratio = min(r["put_ratio"], r["get_ratio"])
        lines.append(("PASS" if ratio >= TARGET_BW_RATIO else "MISS",
                      f"host tier {mib} MiB >= {TARGET_BW_RATIO:.0%} of pinned",
                      f"D2H {r['put_ratio']:.2f}, H2D {r['get_ratio']:.2f}"))
        if r.get("floor_put_ratio") is not None:
            lines.append(("INFO", f"host tier {mib} MiB floor (pinned copy + one bare round trip)",
                          f"D2H {r['floor_put_ratio']:.2f}, H2D {r['floor_get_ratio']:.2f}; put at "
                          f"{r['put_of_floor']:.2f} of it, get at {r['get_of_floor']:.2f}"))

    x = res.get("cross_process")
    if x is not None:
        print(f"\ncross-process, {ITEM_MIB} MiB item, lock-step, producer -> consumer over their own pipe; "
              "per item after warm-up:")
        for label, key in (('ecd put -> get(device="cuda:0")', "ecd"), ("ecd put -> view + clone", "ecd_view"),
                           ("seed reduce_tensor, cached handle", "seed_reduce_tensor"),
                           ("seed reduce_tensor, fresh handle", "seed_fresh_handle")):
            r = x.get(key)
            if r is None:
                continue
            if "error" in r:
                print(f"  {label:36} FAILED: {r['error']}")
                continue
            extra = f", {r['distinct_handles']} distinct handles" if r.get("distinct_handles") else ""
            print(f"  {label:36} p50 {r['p50_us']:8.0f} us  p99 {r['p99_us']:8.0f} us  ({r['items']} items{extra})")
        ratios = x.get("ratios", {})
        if ratios:
            print("  seed p50 / ecd p50: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        e = x.get("ecd", {})
        if "growth_bytes" in e:
            seeds = "; ".join(f"{name} {x[key]['growth_bytes'] / MIB:+.1f} MiB" for name, key in
                              (("seed cached", "seed_reduce_tensor"), ("seed fresh", "seed_fresh_handle"))
                              if "growth_bytes" in x.get(key, {}))
            print(f"GPU free memory over {e['ecd_items'] - e['warmup']} ecd items after warm-up: "
                  f"{e['growth_bytes'] / MIB:+.1f} MiB used" + (f"; {seeds}" if seeds else ""))
        if "latency_ratio" in x:
            lines.append(("PASS" if x["latency_ratio"] >= TARGET_LATENCY_RATIO else "MISS",
                          f"cross-process p50 >= {TARGET_LATENCY_RATIO:.0f}x lower than the seed "
                          "(cached handle; ecd get)", f"{x['latency_ratio']:.2f}x"))
        others = {k: v for k, v in ratios.items() if k != "seed_cached/ecd_get"}
        if others:
            lines.append(("INFO", "cross-process seed p50 / ecd p50, the other pairs",
                          ", ".join(f"{k} {v:.2f}x" for k, v in others.items())))
        if "growth_bytes" in e:
            lines.append(("PASS" if e["growth_bytes"] <= GROWTH_TOLERANCE else "MISS",
                          "no GPU memory growth over the ecd items", f"{e['growth_bytes'] / MIB:+.1f} MiB"))
    print()
    for kind, name, detail in lines:
        print(f"{kind:4}  {name}: {detail}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': stdout)")
    ap.add_argument("--quick", action="store_true",
                    help=f"fewer reps ({', '.join(f'{m} MiB {r}' for m, r in QUICK_REPS.items())}) and "
                         f"cross-process items ({QUICK_ITEMS} ecd, {QUICK_SEED_ITEMS} per seed variant)")
    ap.add_argument("--items", type=int, default=None,
                    help=f"cross-process ecd items, for the memory check too (default {ITEMS}; --quick {QUICK_ITEMS})")
    ap.add_argument("--arena", default="2GiB", help="[pool.cuda] size on device 0")
    args = ap.parse_args(argv)
    if args.items is None:
        args.items = QUICK_ITEMS if args.quick else ITEMS
    if args.items < 2:
        ap.error("--items must be at least 2 (one of each ecd consumer variant)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device (torch.cuda.is_available() is False): nothing to measure",
              file=sys.stderr)
        return 2
    reps = QUICK_REPS if args.quick else REPS
    seed_items = QUICK_SEED_ITEMS if args.quick else SEED_ITEMS
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_daemon import BenchDaemon, write_results
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="ecd-gpu-bench-")
    res: dict = {"env": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                         "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()},
                 "quick": args.quick, "reps": {str(m): r for m, r in reps.items()}}
    broke = False
    daemon = None
    try:
        daemon = BenchDaemon(workdir, node_prefix="gpubench", pool="2GiB",
                             extra=f'\n[pool.cuda]\ndevices = [0]\nsize = "{args.arena}"\n')
        c = daemon.connect(timeout=30)
        if not c.welcome.arenas:
            raise RuntimeError("the daemon exported no CUDA arena")
        res["bare_rtt"] = guarded("bare round trip", bench_bare_rtt, workdir)
        rtt_s = res["bare_rtt"]["p50_us"] / 1e6 if "p50_us" in res["bare_rtt"] else None
        res["d2d"] = bench_d2d(c, torch, reps, rtt_s)
        res["host"] = bench_host(c, torch, reps, rtt_s)
        res["cross_process"] = bench_cross_process(daemon.endpoint, args.items, seed_items, torch)
        try:
            c.close()
        except Exception as exc:
            print(f"benchmarks/gpu.py: closing the client: {exc!r}", file=sys.stderr)
    except Exception as exc:
        traceback.print_exc()
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if daemon is not None:
            try:
                rc = daemon.stop()
                print(f"daemon stopped with SIGTERM: exit code {rc}")
                if rc != 0:
                    print(daemon.log_tail())
                    res["daemon_exit_code"] = rc
                    broke = True
            except Exception:
                traceback.print_exc()
                broke = True
        shutil.rmtree(workdir, ignore_errors=True)
    try:
        lines = report(res)
        res["targets"] = [{"name": n, "pass": k == "PASS", "detail": d} for k, n, d in lines if k != "INFO"]
        res["info"] = [{"name": n, "detail": d} for k, n, d in lines if k == "INFO"]
    except Exception as exc:
        traceback.print_exc()
        res["report_error"] = f"{type(exc).__name__}: {exc}"
        broke = True
    errors = errors_in(res)
    if errors:
        broke = True
        print("\nsomething broke (exit code 1):")
        for line in errors:
            print(f"  {line}")
    res["wall_s"] = time.monotonic() - started
    print(f"\nbenchmark wall time {res['wall_s']:.1f} s")
    if args.json:
        try:
            write_results(args.json, res)
        except Exception as exc:
            print(f"benchmarks/gpu.py: writing {args.json}: {exc!r}", file=sys.stderr)
            broke = True
    return 1 if broke else 0


if __name__ == "__main__":
    sys.exit(main())
