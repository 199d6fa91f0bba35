"""benchmarks/gpu.py, part c: producer -> consumer per 16 MiB item across processes on one GPU,
ecd (put, then get or view) against the seed approach (a torch reduce_tensor handle per item,
its cached and fresh-handle variants), lock-step, and the device's free memory over the ecd items.
Run through benchmarks/gpu.py; its children are spawned with this module's functions."""
from __future__ import annotations

import multiprocessing as mp
import sys
import time
import traceback

MIB = 1 << 20
ITEM_MIB = 16
SEED_WARMUP = 20
PHASE_TIMEOUT_S = 120.0  # longest wait for a cross-process child's next word
ECD_MODES = ("get", "view")  # the ecd consumer's two ways of reading an item, alternately

now_ns = time.perf_counter_ns


def guarded(name: str, fn, *args) -> dict:
    """fn(*args), or {"error": ...} with the traceback printed: one failed measurement must not
    take the others with it."""
    try:
        return fn(*args)
    except Exception as exc:
        traceback.print_exc()
        print(f"benchmarks/gpu.py: {name} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"}


def summary_us(lat_ns: list[int], warm: int) -> dict:
    timed_part = sorted(lat_ns[warm:])
    if not timed_part:
        raise RuntimeError("no timed samples")
    return {"p50_us": timed_part[len(timed_part) // 2] / 1e3,
            "p99_us": timed_part[min(len(timed_part) - 1, int(len(timed_part) * 0.99))] / 1e3,
            "items": len(timed_part)}


def _phased(ctl, items: int, warm: int):
    """A producer's item numbers, with the parent told "ready" before the first and "warm" before
    item `warm` (each answered before going on): it reads device memory at those points."""
    ctl.send("ready")
    ctl.recv()
    for i in range(items):
        if i == warm:
            ctl.send("warm")
            ctl.recv()
        yield i


def _ecd_producer(endpoint: str, items: int, warm: int, peer, ctl) -> None:
    import torch
    from ecd import Client
    c = Client(endpoint, timeout=30, name="gpu-bench-producer")
    x = torch.randint(0, 255, (ITEM_MIB * MIB,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    for i in _phased(ctl, items, warm):
        key = f"xp/{i % 8}"
        t0 = now_ns()
        c.put(key, x)
        peer.send((i, key, t0, ECD_MODES[i % len(ECD_MODES)]))
        peer.recv()  # the consumer has its copy: lock-step, one item in flight
    ctl.send("done")
    ctl.recv()
    peer.send(None)
    c.close()


def _ecd_consumer(endpoint: str, peer, ctl) -> None:
    import torch
    from ecd import Client
    c = Client(endpoint, timeout=30, name="gpu-bench-consumer")
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    ctl.send("ready")
    lat: dict[str, list[tuple[int, int]]] = {mode: [] for mode in ECD_MODES}
    while True:
        msg = peer.recv()
        if msg is None:
            break
        i, key, t0, mode = msg
        if mode == "get":
            y = c.get(key, device="cuda:0")  # complete when it returns
        else:
            with c.view(key) as v:  # zero-copy CUDA tensor over the arena, cloned on the device
                y = v.clone()
                torch.cuda.synchronize()
        lat[mode].append((i, now_ns() - t0))
        del y
        peer.send(True)
    ctl.send(lat)
    c.close()


def _seed_producer(items: int, warm: int, fresh: bool, peer, ctl) -> None:
    """vLLM SHM connector's seed: a fresh tensor per item, reduce_tensor, the handle pickled."""
    import pickle
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    base = torch.randint(0, 255, (ITEM_MIB * MIB,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    for i in _phased(ctl, items, warm):
        t = base.clone()  # a fresh output per item, as an encoder produces
        torch.cuda.synchronize()
        t0 = now_ns()
        rebuild, args = reduce_tensor(t)
        peer.send_bytes(pickle.dumps((i, rebuild, args, t0)))
        peer.recv_bytes()  # the consumer is done with it (torch's IPC ref counting held the block too)
        del t, rebuild, args
        if fresh:  # give the block back to the driver: the next item is a new cudaMalloc, a new handle
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
    ctl.send("done")
    ctl.recv()
    peer.send_bytes(pickle.dumps(None))


def _seed_consumer(fresh: bool, peer, ctl) -> None:
    import pickle
    import torch
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    ctl.send("ready")
    lat: list[tuple[int, int]] = []
    handles: set = set()
    while True:
        msg = pickle.loads(peer.recv_bytes())
        if msg is None:
            break
        i, rebuild, args, t0 = msg
        shared = rebuild(*args)
        y = shared.clone()
        torch.cuda.synchronize()
        lat.append((i, now_ns() - t0))
        try:  # rebuild_cuda_tensor's storage_handle and storage_offset_bytes: which allocation it was
            handles.add((bytes(args[7]), int(args[9])))
        except Exception:
            pass
        del shared, y, rebuild, args, msg
        if fresh:
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
        peer.send_bytes(b"1")
    ctl.send({"lat": lat, "distinct_handles": len(handles) or None})  # None: not readable in this torch


def _recv(conn, who: str, timeout: float = PHASE_TIMEOUT_S):
    if not conn.poll(timeout):
        raise TimeoutError(f"the {who} said nothing for {timeout:.0f}s")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"the {who} process ended early (a child's traceback is above)") from None


def _run_pair(torch, producer, producer_args: tuple, consumer, consumer_args: tuple) -> tuple[object, dict]:
    """Run one producer/consumer variant; (the consumer's results, free device memory readings)."""
    spawn = mp.get_context("spawn")
    peer_p, peer_c = spawn.Pipe()
    ctl_p, ctl_p_child = spawn.Pipe()
    ctl_c, ctl_c_child = spawn.Pipe()
    procs = [spawn.Process(target=producer, args=(*producer_args, peer_p, ctl_p_child), daemon=True),
             spawn.Process(target=consumer, args=(*consumer_args, peer_c, ctl_c_child), daemon=True)]
    try:
        for p in procs:
            p.start()
        for conn in (peer_p, peer_c, ctl_p_child, ctl_c_child):
            conn.close()  # the children have theirs: a child that dies is an EOFError here, not a hang
        if _recv(ctl_p, "producer") != "ready" or _recv(ctl_c, "consumer") != "ready":
            raise RuntimeError("a child did not start")
        torch.cuda.synchronize()

        def free() -> int:
            return torch.cuda.mem_get_info(0)[0]

        mem = {"free_before": free()}
        ctl_p.send("go")
        while True:
            msg = _recv(ctl_p, "producer")
            if msg == "warm":
                mem["free_after_warmup"] = free()
                ctl_p.send("go")
            elif msg == "done":
                mem["free_after"] = free()  # both children alive, holding what they hold
                ctl_p.send("go")
                break
            else:
                raise RuntimeError(f"the producer said {msg!r}")
        result = _recv(ctl_c, "consumer")
        for p in procs:
            p.join(30)
        mem.setdefault("free_after_warmup", mem["free_before"])
        mem["growth_bytes"] = mem["free_after_warmup"] - mem["free_after"]
        return result, mem
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(10)
        for conn in (ctl_p, ctl_c):
            conn.close()


def _xp_ecd(torch, endpoint: str, items: int) -> dict:
    warm = min(100, items // 10)
    lat, mem = _run_pair(torch, _ecd_producer, (endpoint, items, warm), _ecd_consumer, (endpoint,))
    out = {}
    for mode in ECD_MODES:
        out[mode] = summary_us([ns for i, ns in lat[mode] if i >= warm], 0)
    out["memory"] = dict(mem, ecd_items=items, warmup=warm)
    return out


def _xp_seed(torch, items: int, fresh: bool) -> dict:
    res, mem = _run_pair(torch, _seed_producer, (items + SEED_WARMUP, SEED_WARMUP, fresh), _seed_consumer, (fresh,))
    out = summary_us([ns for i, ns in res["lat"] if i >= SEED_WARMUP], 0)
    out.update(distinct_handles=res["distinct_handles"], growth_bytes=mem["growth_bytes"])
    return out


def bench_cross_process(endpoint: str, items: int, seed_items: int, torch) -> dict:
    ecd = guarded("cross-process ecd", _xp_ecd, torch, endpoint, items)
    x: dict = {}
    if "error" in ecd:
        x["ecd"] = ecd
    else:
        x["ecd"] = dict(ecd["get"], **ecd["memory"])  # get(device="cuda:0"), and the memory readings
        x["ecd_view"] = ecd["view"]
    x["seed_reduce_tensor"] = guarded("cross-process seed (cached handle)", _xp_seed, torch, seed_items, False)
    x["seed_fresh_handle"] = guarded("cross-process seed (fresh handle)", _xp_seed, torch, seed_items, True)
    ratios = {}
    for s_name, s_key in (("cached", "seed_reduce_tensor"), ("fresh", "seed_fresh_handle")):
        for e_name, e_key in (("get", "ecd"), ("view", "ecd_view")):
            s, e = x.get(s_key, {}), x.get(e_key, {})
            if "p50_us" in s and "p50_us" in e:
                ratios[f"seed_{s_name}/ecd_{e_name}"] = s["p50_us"] / e["p50_us"]
    x["ratios"] = ratios
    if "seed_cached/ecd_get" in ratios:
        x["latency_ratio"] = ratios["seed_cached/ecd_get"]
    return x
