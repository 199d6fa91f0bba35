#!/usr/bin/env python3
"""Core benchmark for ecd: bulk hand-off, control-plane latency and unbatched throughput.

Starts its own daemon (`python -m ecd serve`) on a private node name and runtime dir, measures
everything as ratios against references taken in the same run, prints a table and PASS/MISS per
target, and stops the daemon with SIGTERM (it must exit 0). `make bench` runs it with no
arguments; `--json PATH` also writes the results.

  1. 1/16/64 MiB float32: memcpy (np.copyto between two pre-faulted buffers, the reference),
     put+get(copy) in one process, and put in one process + view in another.
  2. exists() p50/p99 for a present key put by another process, unpinned (advisory: answered
     without a round trip where the client can) and pinned (exists(pin_s=1), vLLM's scheduler
     path: always a round trip), and for absent keys (answered from the event ring) vs. a bare
     pyzmq REQ/REP ipc round trip to a separate echo process.
  3. unbatched ops/s from 4 client processes (exists of a present key, unpinned / 4 KiB put / 4 KiB get).
  4. the cost of end-to-end integrity at 16 MiB: put(checksum=True) + view(verify=True) (and
     get(verify=True)) against the same calls without, interleaved rep by rep.

Every cross-process time uses time.perf_counter_ns, which on Linux is CLOCK_MONOTONIC: one clock
for the whole machine, so a stamp taken in the producer and one taken in the consumer subtract.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import xxhash

from ecd.client.client import Client
from ecd.client.tensors import write_bytes
from ecd.memory.host import ShmFile

from bench_daemon import BenchDaemon, pool_prefaulted, write_results

MIB = 1 << 20
SIZES_MIB = (1, 16, 64)
REPS = {1: 300, 16: 150, 64: 50}  # timed repetitions per method and size
WARMUP = {1: 30, 16: 10, 64: 4}
EXISTS_ROUNDS, EXISTS_BLOCK, EXISTS_WARMUP = 60, 100, 300  # interleaved blocks of each method
OPS_CLIENTS = 4
OPS_SMALL_ELEMS = 1024  # 4 KiB float32: rides inline (limits.inline_max_bytes = 64 KiB)
OPS_KEYS = 64

COLD_SPAN_MIB = 128  # > 2x this machine's 32 MiB L3
# The goals of issue 15 ("close to the physical limit"), each judged on a paired ratio: the median
# of per-sample (or per-round) ratios to a reference taken right beside it in the same run.
TARGET_HANDOFF_RATIO = 1.2  # 16 MiB put (process A) + view (process B) <= 1.2x one memcpy
TARGET_EXISTS_RATIO = 0.3  # unpinned exists of a present key <= 0.3x a bare REQ/REP round trip
TARGET_EXISTS_PINNED_RATIO = 1.3  # exists(pin_s>0) of a present key <= 1.3x the bare round trip
TARGET_OPS = 25_000  # aggregate unbatched ops/s from 4 client processes

now_ns = time.perf_counter_ns


def machine_busy_s() -> float:
    """CPU-seconds the whole machine spent not idle (from /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def pct(samples, q: float) -> float:
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q))


def summary_us(samples_ns) -> dict:
    a = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "mean_us": float(a.mean()), "min_us": float(a.min()), "n": int(a.size)}


def prefaulted(nbytes: int) -> np.ndarray:
    a = np.empty(nbytes // 4, np.float32)
    a.fill(1.0)  # touches every page now, so no timed copy pays first-touch faults
    return a


def recv(conn, timeout_s: float = 60.0):
    """A reply from a child process, or an error instead of hanging if the child died."""
    if not conn.poll(timeout_s):
        raise RuntimeError(f"no answer from a benchmark process within {timeout_s:g}s")
    return conn.recv()


def wait_until(t_ns: int) -> None:
    while True:
        left = t_ns - now_ns()
        if left <= 0:
            return
        time.sleep(min(left / 1e9, 0.01) if left > 2_000_000 else 0)


def bare_socket(socket_type: str, endpoint: str, *, bind: bool = False):
    """(context, socket) of pyzmq alone, one I/O thread like ecd's client: the references."""
    import zmq
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(getattr(zmq, socket_type))
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return ctx, sock


# ---- child processes (multiprocessing 'spawn': they import this file as __mp_main__) ----------

def child_starter(procs: list, conns: list | None = None):
    """start(target, *args) -> the parent's end of a pipe to a new 'spawn' child running
    target(*args, child_end); the child goes into `procs` (and the pipe into `conns`)."""
    spawn = mp.get_context("spawn")

    def start(target, *a):
        parent, child = spawn.Pipe()
        pr = spawn.Process(target=target, args=(*a, child), daemon=True)
        pr.start()
        procs.append(pr)
        if conns is not None:
            conns.append(parent)
        return parent
    return start


def _echo_server(endpoint: str, socket_type: str, conn) -> None:
    """A bare echo of every message: REP, the round-trip reference of exists and of the hand-off
    floor; ROUTER, the ops/s floor (what ecd's daemon is, minus all its work), served by the
    same worker processes as the ecd window beside it."""
    ctx, sock = bare_socket(socket_type, endpoint, bind=True)
    conn.send("ready")
    while True:
        frames = sock.recv_multipart()
        sock.send_multipart(frames)
        if frames[-1] == b"stop":
            break
    sock.close(0)
    ctx.term()


def _consumer(endpoint: str, conn) -> None:
    """Process B of the hand-off. Also puts the key that process A's exists() looks up."""
    c = pool_prefaulted(Client(endpoint, name="bench-consumer"))
    c.put("present/exists", torch.zeros(16))
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        if cmd[0] == "wait":  # park on each key in turn; stamp the moment the view is held
            for key, marker in cmd[1]:
                with c.view(key, timeout=30.0) as v:
                    t1 = now_ns()
                    ok = v[0].item() == marker and v[-1].item() == marker
                conn.send((t1, ok))
        elif cmd[0] == "view":  # the key is already published: time view() alone
            _, key, marker = cmd
            t0 = now_ns()
            with c.view(key) as v:
                t1 = now_ns()
                ok = v[0].item() == marker and v[-1].item() == marker
            conn.send((t1 - t0, ok))
    c.close()


def _bare_round_trips(endpoint: str, start_at: int, duration_s: float) -> tuple[int, int]:
    """A closed loop of bare DEALER round trips to a ROUTER _echo_server, the throughput floor:
    (round trips, ns the window took)."""
    ctx, sock = bare_socket("DEALER", endpoint)
    payload = b"x" * 64
    for _ in range(200):  # connected and warm before the window
        sock.send(payload)
        sock.recv()
    wait_until(start_at)
    deadline, n, t = start_at + int(duration_s * 1e9), 0, now_ns()
    while t < deadline:
        sock.send(payload)
        sock.recv()
        n += 1
        t = now_ns()
    sock.close(0)
    ctx.term()
    return n, t - start_at


def _ops_worker(endpoint: str, wid: int, conn) -> None:
    """One of the throughput clients: round-robin exists of a present key (unpinned) / small put / small get."""
    c = pool_prefaulted(Client(endpoint, name=f"bench-ops-{wid}"))
    small = torch.from_numpy(prefaulted(OPS_SMALL_ELEMS * 4))
    ex_keys = [f"ops/ex/{j}" for j in range(OPS_KEYS)]  # put by the main process, never by us
    get_keys = [f"ops/get/{j}" for j in range(OPS_KEYS)]
    put_keys = [f"ops/put/{wid}/{j}" for j in range(OPS_KEYS)]

    def mix(n: int | None, deadline: int | None) -> dict:
        counts, lat = [0, 0, 0], [0, 0, 0]
        i = 0
        t = now_ns()
        while (n is None or i < n) and (deadline is None or t < deadline):
            k, j = i % 3, (i // 3) % OPS_KEYS
            if k == 0:
                if not c.exists(ex_keys[j]):
                    raise AssertionError(f"{ex_keys[j]} should be present")
            elif k == 1:
                c.put(put_keys[j], small)
            else:
                c.get(get_keys[j])
            t2 = now_ns()
            counts[k] += 1
            lat[k] += t2 - t
            t = t2
            i += 1
        return {"counts": counts, "lat_ns": lat}

    mix(600, None)  # warm-up
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        if cmd[0] == "bare":
            conn.send(_bare_round_trips(*cmd[1:]))
            continue
        _, start_at, duration_s = cmd
        wait_until(start_at)
        cpu0 = time.process_time()
        res = mix(None, start_at + int(duration_s * 1e9))
        res["elapsed_ns"] = now_ns() - start_at
        res["cpu_s"] = time.process_time() - cpu0
        conn.send(res)
    c.close()


# ---- daemon ------------------------------------------------------------------------------

# ---- 1. bulk hand-off ----------------------------------------------------------------------

def handoff_floor(src_np: np.ndarray, shm_buf, echo_endpoint: str, warm: int, reps: int, ref_sample,
                  memcpy: list[int]) -> tuple[list[int], list[float]]:
    """The floor of any hand-off through a daemon on a control socket: the same copy into shared
    memory (the routine put uses) plus one bare REQ/REP round trip (the put's message to the
    daemon and the daemon's to the parked consumer are its two hops), each after the same
    reference memcpy as a hand-off sample. What the hand-off pays above it is ecd's own work.
    A loop of its own: interleaved with the hand-offs it would change them (the consumer would
    sit parked longer before each, and waking an idle vCPU of this VM costs more)."""
    ctx, req = bare_socket("REQ", echo_endpoint)
    src_bytes = src_np.view(np.uint8).reshape(-1)
    floor, paired = [], []
    try:
        for i in range(warm + reps):
            ref_sample()
            t0 = now_ns()
            write_bytes(shm_buf, 0, src_bytes)
            req.send(b"x" * 64)
            req.recv()
            t1 = now_ns()
            if i >= warm:
                floor.append(t1 - t0)
                paired.append((t1 - t0) / memcpy[-1])
    finally:
        req.close(0)
        ctx.term()
    return floor, paired


def bench_copies(c: Client, consumer, mib: int, shm_buf, echo_endpoint: str) -> dict:
    nbytes = mib * MIB
    ref_src, ref_dst = prefaulted(nbytes), prefaulted(nbytes)
    src_np = prefaulted(nbytes)
    src = torch.from_numpy(src_np)
    # A /dev/shm file mapped like the client maps the pool (MAP_SHARED|MAP_POPULATE), but our own:
    # copies into it show what the pool's memory itself costs, without any ecd code or round trip.
    shm_np = np.frombuffer(shm_buf, np.float32, count=nbytes // 4)
    warm, reps = WARMUP[mib], REPS[mib]
    memcpy, fresh, to_shm, from_shm, put1, get1, pg = [], [], [], [], [], [], []
    bad = 0

    # A put writes into a pool extent nobody touched lately: memory that is not in the CPU's
    # caches. The hot reference (same destination every time) flatters memcpy by the 32 MiB L3;
    # the cold one rotates through destinations totalling COLD_SPAN so each copy lands in memory
    # the cache has let go of. Both are reported; the hand-off is compared with both.
    cold_dsts = [prefaulted(nbytes) for _ in range(max(2, COLD_SPAN_MIB // mib))]
    cold: list[int] = []

    def ref_sample() -> None:
        t0 = now_ns()
        np.copyto(ref_dst, ref_src)
        t1 = now_ns()
        memcpy.append(t1 - t0)

    def cold_samples() -> None:
        # Its own loop: interleaved with the puts it would flush their sources from the cache too.
        for i in range(warm + reps):
            dst = cold_dsts[i % len(cold_dsts)]
            t0 = now_ns()
            np.copyto(dst, ref_src)
            cold.append(now_ns() - t0)

    # (a) put + get(copy) in one process. Reference samples are interleaved with the measured ones
    # so that the machine's drift (2 noisy vCPUs) hits both alike.
    for i in range(warm + reps):
        src_np[0] = src_np[-1] = i
        ref_sample()
        t0 = now_ns()
        c.put(f"pg/{mib}", src)
        t1 = now_ns()
        out = c.get(f"pg/{mib}")
        t2 = now_ns()
        bad += not (out[0].item() == i and out[-1].item() == i)
        del out
        c.delete(f"pg/{mib}")
        if i >= warm:
            put1.append(t1 - t0)
            get1.append(t2 - t1)
            pg.append(t2 - t0)
        # diagnostic: a memcpy into a buffer that was never touched (what get's fresh output pays)
        t0 = now_ns()
        dst = np.empty_like(ref_src)
        np.copyto(dst, ref_src)
        fresh.append(now_ns() - t0)
        del dst
        t0 = now_ns()
        np.copyto(shm_np, ref_src)
        t1 = now_ns()
        np.copyto(ref_dst, shm_np)
        t2 = now_ns()
        to_shm.append(t1 - t0)
        from_shm.append(t2 - t1)
    cold_samples()
    del memcpy[:warm], cold[:warm], fresh[:warm], to_shm[:warm], from_shm[:warm]

    # (b) hand-off, end to end: process B is already parked in view(key, timeout) (we poll the
    # daemon's waiter count until it is, before starting the clock); t0 is taken in A just before
    # put(), t1 in B the moment the view is held. Both are CLOCK_MONOTONIC, so t1 - t0 is the real
    # producer-start-to-consumer-holding latency, including B's wake-up.
    keys = [(f"xp/{mib}/{i}", float(i)) for i in range(warm + reps)]
    consumer.send(("wait", keys))
    e2e, put_parked, notify, paired = [], [], [], []
    for i, (key, marker) in enumerate(keys):
        src_np[0] = src_np[-1] = marker
        deadline = time.monotonic() + 10
        while c.stats()["waiters"] < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("consumer never parked on its key")
            time.sleep(0.0002)
        ref_sample()
        t0 = now_ns()
        c.put(key, src)
        tp = now_ns()
        t1, ok = recv(consumer)
        bad += not ok
        c.delete(key)
        if i >= warm:
            paired.append((t1 - t0) / memcpy[-1])
            e2e.append(t1 - t0)
            put_parked.append(tp - t0)
            notify.append(t1 - tp)  # may be < 0: the daemon answers parked B before acking A
    floor, floor_paired = handoff_floor(src_np, shm_buf, echo_endpoint, warm, reps, ref_sample, memcpy)

    # (c) cross-check, sequential: put latency in A, then view latency in B on the published key;
    # the sum of the p50s is the hand-off cost when nobody waits.
    put_seq, view_seq = [], []
    for i in range(warm + reps):
        key = f"seq/{mib}/{i}"
        src_np[0] = src_np[-1] = i
        ref_sample()
        t0 = now_ns()
        c.put(key, src)
        t1 = now_ns()
        consumer.send(("view", key, float(i)))
        dt, ok = recv(consumer)
        bad += not ok
        c.delete(key)
        if i >= warm:
            put_seq.append(t1 - t0)
            view_seq.append(dt)
    mc = pct(memcpy, 50)
    out = {
        "mib": mib, "bad_payloads": bad,
        "memcpy": summary_us(memcpy), "memcpy_cold_dst": summary_us(cold),
        "memcpy_fresh_dst": summary_us(fresh),
        "memcpy_to_shm": summary_us(to_shm), "memcpy_from_shm": summary_us(from_shm),
        "put_1proc": summary_us(put1), "get_1proc": summary_us(get1), "put_get_1proc": summary_us(pg),
        "handoff_e2e": summary_us(e2e), "put_with_parked_waiter": summary_us(put_parked),
        "handoff_floor": summary_us(floor),
        "consumer_notify_after_put": summary_us(notify),
        "put_seq": summary_us(put_seq), "view_seq": summary_us(view_seq),
    }
    out["handoff_seq_sum_p50_us"] = out["put_seq"]["p50_us"] + out["view_seq"]["p50_us"]
    out["ratio"] = {
        "put_get_1proc": pct(pg, 50) / mc,
        "handoff_e2e": pct(e2e, 50) / mc,
        "handoff_seq_sum": out["handoff_seq_sum_p50_us"] * 1e3 / mc,
        "handoff_e2e_paired_median": float(np.median(paired)),
        "handoff_floor_paired_median": float(np.median(floor_paired)),
        "handoff_e2e_vs_cold": pct(e2e, 50) / pct(cold, 50),
        "put_1proc_vs_cold": pct(put1, 50) / pct(cold, 50),
        "put_1proc": pct(put1, 50) / mc,
        "get_1proc": pct(get1, 50) / mc,
    }
    return out


# ---- 4. integrity cost ----------------------------------------------------------------------

INTEGRITY_MIB, INTEGRITY_REPS, INTEGRITY_WARMUP = 16, 120, 10


def bench_integrity(c: Client) -> dict:
    """put + view with checksum/verify vs without, one process, alternating rep by rep so drift
    hits both alike. Same-sized puts take the reserved-extent path in both arms."""
    nbytes = INTEGRITY_MIB * MIB
    src_np = prefaulted(nbytes)
    src = torch.from_numpy(src_np)
    ref_dst = prefaulted(nbytes)
    arms = {False: {"put": [], "view": [], "get": [], "put_view": []},
            True: {"put": [], "view": [], "get": [], "put_view": []}}
    memcpy, hash_only = [], []
    bad = 0
    for i in range(INTEGRITY_WARMUP + INTEGRITY_REPS):
        for checked in ((False, True) if i % 2 else (True, False)):
            src_np[0] = src_np[-1] = i
            key = f"ck/{int(checked)}/{i}"
            t0 = now_ns()
            c.put(key, src, checksum=checked)
            t1 = now_ns()
            with c.view(key, verify=checked) as v:
                t2 = now_ns()
                bad += not (v[0].item() == i and v[-1].item() == i)
            t3 = now_ns()
            out = c.get(key, verify=checked)
            t4 = now_ns()
            bad += not (out[0].item() == i and out[-1].item() == i)
            del out
            c.delete(key)
            if i >= INTEGRITY_WARMUP:
                arm = arms[checked]
                arm["put"].append(t1 - t0)
                arm["view"].append(t2 - t1)
                arm["put_view"].append(t2 - t0)
                arm["get"].append(t4 - t3)
        t0 = now_ns()
        np.copyto(ref_dst, src_np)
        t1 = now_ns()
        xxhash.xxh3_64_intdigest(ref_dst)
        t2 = now_ns()
        if i >= INTEGRITY_WARMUP:
            memcpy.append(t1 - t0)
            hash_only.append(t2 - t1)
    out = {"mib": INTEGRITY_MIB, "bad_payloads": bad, "memcpy": summary_us(memcpy),
           "xxh3_hot": summary_us(hash_only)}
    for checked, name in ((False, "plain"), (True, "checked")):
        out[name] = {k: summary_us(v) for k, v in arms[checked].items()}
    out["ratio"] = {k: out["checked"][k]["p50_us"] / out["plain"][k]["p50_us"] for k in ("put", "put_view", "get")}
    out["ratio"]["xxh3_vs_memcpy"] = out["xxh3_hot"]["p50_us"] / out["memcpy"]["p50_us"]
    out["extra_us"] = {k: out["checked"][k]["p50_us"] - out["plain"][k]["p50_us"]
                       for k in ("put", "view", "put_view", "get")}
    return out


# ---- 2. exists vs bare round trip ----------------------------------------------------------

def pin_process(pid: int, cpus: set[int]) -> None:
    """Pin every thread of `pid` (its zmq I/O threads too) to `cpus`."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass


def bench_exists(c: Client, echo_endpoint: str, servers: list[int]) -> dict:
    """Round trips, interleaved in small blocks, under three placements of the processes.

    On this 2-vCPU VM a round trip costs ~12 us when client and server threads share a CPU and
    ~25 us when every hop is a cross-CPU wake-up (an IPI, i.e. a VM exit), and the scheduler keeps
    whichever placement it happened to pick: unpinned results flip between runs. So besides the
    scheduler's choice we pin the client (this process) and both servers (echo process and daemon,
    all their threads) to one CPU, then client and servers to different CPUs; the bare reference
    and ecd always run under the same placement. The target is judged on the worse pinned ratio.
    """
    ctx, req = bare_socket("REQ", echo_endpoint)
    payload = b"x" * 32
    absent_i = [0]

    def zmq_rt():
        req.send(payload)
        req.recv()

    def ex_present():
        if not c.exists("present/exists"):
            raise AssertionError("present/exists should be present")

    def ex_pinned():
        if not c.exists("present/exists", pin_s=1.0):
            raise AssertionError("present/exists should be present")

    def ex_absent():
        absent_i[0] += 1
        if c.exists(f"absent/{absent_i[0]}"):
            raise AssertionError("absent key reported present")

    methods = {"bare_zmq_rtt": zmq_rt, "exists_present": ex_present, "exists_pinned": ex_pinned,
               "exists_absent": ex_absent, "ping": c.ping}
    paired_names = ("exists_present", "exists_pinned", "exists_absent", "ping")
    all_cpus = os.sched_getaffinity(0)
    placements = [("scheduler", None, None, EXISTS_ROUNDS)]
    if len(all_cpus) >= 2:
        a, b = sorted(all_cpus)[:2]
        placements += [("same_cpu", {a}, {a}, EXISTS_ROUNDS // 2),
                       ("cross_cpu", {a}, {b}, EXISTS_ROUNDS // 2)]
    out: dict = {}
    n_pinned = 0
    ops0 = c.stats()["ops"]
    try:
        for place, client_cpus, server_cpus, rounds in placements:
            pin_process(os.getpid(), client_cpus or all_cpus)
            for pid in servers:
                pin_process(pid, server_cpus or all_cpus)
            samples = {name: [] for name in methods}
            for fn in methods.values():
                for _ in range(EXISTS_WARMUP):
                    fn()
            n_pinned += EXISTS_WARMUP  # the pinned warm-up lookups are round trips too
            # per round: each method's p50 / the bare round trip's p50 of the same round
            paired: dict[str, list[float]] = {name: [] for name in paired_names}
            for _ in range(rounds):
                for name, fn in methods.items():
                    s = samples[name]
                    for _ in range(EXISTS_BLOCK):
                        t0 = now_ns()
                        fn()
                        s.append(now_ns() - t0)
                bare_p50 = pct(samples["bare_zmq_rtt"][-EXISTS_BLOCK:], 50)
                for name in paired_names:
                    paired[name].append(pct(samples[name][-EXISTS_BLOCK:], 50) / bare_p50)
            n_pinned += rounds * EXISTS_BLOCK
            r = {name: summary_us(s) for name, s in samples.items()}
            bare = r["bare_zmq_rtt"]["p50_us"]
            r["ratio"] = {k: r[k]["p50_us"] / bare for k in paired_names}
            for name in paired_names:
                r["ratio"][f"{name}_paired_median"] = float(np.median(paired[name]))
            out[place] = r
    finally:
        pin_process(os.getpid(), all_cpus)
        for pid in servers:
            pin_process(pid, all_cpus)
    ops1 = c.stats()["ops"]
    req.send(b"stop")
    req.recv()
    req.close(0)
    ctx.term()
    # What crossed the socket: pinned lookups are all round trips; unpinned present ones are
    # round trips unless the client answers them itself, absent ones are not (ring).
    out["daemon_exists_requests"] = ops1.get("exists", 0) - ops0.get("exists", 0)
    out["pinned_exists_requests"] = n_pinned
    # Judged on the worse of the two CPU placements (the scheduler's own choice flips between runs)
    placed = [p for p in ("same_cpu", "cross_cpu") if p in out] or ["scheduler"]
    for name in ("exists_present", "exists_pinned"):
        out[f"verdict_{name}"] = max(out[p]["ratio"][f"{name}_paired_median"] for p in placed)
    return out


# ---- 3. unbatched throughput ---------------------------------------------------------------

def run_ops(daemon: BenchDaemon, workers, duration_s: float) -> dict:
    start_at = now_ns() + 100_000_000
    cpu0, busy0, me0 = daemon.cpu_s(), machine_busy_s(), time.process_time()
    for conn in workers:
        conn.send(("run", start_at, duration_s))
    results = [recv(conn, duration_s + 60) for conn in workers]
    daemon_cpu = daemon.cpu_s() - cpu0
    busy = machine_busy_s() - busy0
    ours = daemon_cpu + sum(r["cpu_s"] for r in results) + time.process_time() - me0
    elapsed = max(r["elapsed_ns"] for r in results) / 1e9
    counts = np.sum([r["counts"] for r in results], axis=0)
    lat = np.sum([r["lat_ns"] for r in results], axis=0)
    total = int(counts.sum())
    names = ("exists", "put_4k", "get_4k")
    return {
        "clients": len(workers), "seconds": elapsed, "ops": total, "ops_per_s": total / elapsed,
        "per_op": {n: {"count": int(counts[k]), "ops_per_s": counts[k] / elapsed,
                       "mean_latency_us": lat[k] / max(1, counts[k]) / 1e3} for k, n in enumerate(names)},
        "per_client_ops_per_s": [sum(r["counts"]) / (r["elapsed_ns"] / 1e9) for r in results],
        "daemon_cpu_util": daemon_cpu / elapsed, "daemon_cpu_us_per_op": daemon_cpu / total * 1e6,
        "clients_cpu_us_per_op": sum(r["cpu_s"] for r in results) / total * 1e6,
        "machine_busy_cpus": busy / elapsed,
        # CPU that neither the daemon nor our clients used: other tenants of this small VM
        "other_processes_cpus": max(0.0, busy - ours) / elapsed,
    }


def run_bare(workers, echo_endpoint: str, duration_s: float) -> float:
    """Round trips/s of the same worker processes against a bare ROUTER echo (the floor)."""
    start_at = now_ns() + 200_000_000  # each worker connects and warms up first
    for conn in workers:
        conn.send(("bare", echo_endpoint, start_at, duration_s))
    results = [recv(conn, duration_s + 60) for conn in workers]
    return sum(n for n, _ in results) / (max(ns for _, ns in results) / 1e9)


def run_ops_paired(daemon: BenchDaemon, workers, echo_endpoint: str, duration_s: float) -> dict:
    """run_ops between two windows of the same clients against a bare ROUTER echo server: the
    ratio to the mean of the two is what this machine lets any pyzmq daemon do at that moment."""
    before = run_bare(workers, echo_endpoint, duration_s)
    res = run_ops(daemon, workers, duration_s)
    after = run_bare(workers, echo_endpoint, duration_s)
    res["bare_echo_ops_per_s"] = [before, after]
    res["ratio_to_bare_echo"] = res["ops_per_s"] / ((before + after) / 2)
    return res


# ---- report --------------------------------------------------------------------------------

def report(res: dict) -> list[tuple[str, bool, str]]:
    p = print
    p(f"\necd core benchmark  ({res['env']['cpus']} CPUs, python {res['env']['python']}, "
      f"torch {res['env']['torch']}, numpy {res['env']['numpy']})")
    p("\n1. bulk hand-off, float32, p50 in us (ratio = p50 / memcpy p50 of the same size)")
    rows = [("memcpy (np.copyto, pre-faulted)  [ref]", "memcpy", None),
            ("memcpy into cold memory  [ref]", "memcpy_cold_dst", None),
            ("memcpy into a fresh buffer  [diag]", "memcpy_fresh_dst", None),
            ("memcpy anon -> /dev/shm map  [diag]", "memcpy_to_shm", None),
            ("memcpy /dev/shm map -> anon  [diag]", "memcpy_from_shm", None),
            ("put, 1 process", "put_1proc", "put_1proc"),
            ("get (copy), 1 process", "get_1proc", "get_1proc"),
            ("put + get(copy), 1 process", "put_get_1proc", "put_get_1proc"),
            ("put A -> view B, end to end", "handoff_e2e", "handoff_e2e"),
            ("  floor: the copy + a bare round trip", "handoff_floor", None),
            ("  of which: A's put (B parked)", "put_with_parked_waiter", None),
            ("  of which: B wakes after A's put", "consumer_notify_after_put", None),
            ("view alone in B, key published", "view_seq", None),
            ("put A + view B, sequential sum", None, "handoff_seq_sum")]
    hdr = f"{'':42}" + "".join(f"{str(m) + ' MiB':>22}" for m in SIZES_MIB)
    p(hdr)
    for label, key, rkey in rows:
        line = f"{label:42}"
        for m in SIZES_MIB:
            r = res["copy"][str(m)]
            v = r[key]["p50_us"] if key else r["handoff_seq_sum_p50_us"]
            ratio = f" ({r['ratio'][rkey]:.2f}x)" if rkey else ""
            line += f"{v:>14.1f}{ratio:>8}" if rkey else f"{v:>14.1f}{'':>8}"
        p(line)
    p(f"{'  (p99 of end to end)':42}" + "".join(f"{res['copy'][str(m)]['handoff_e2e']['p99_us']:>14.1f}{'':>8}"
                                              for m in SIZES_MIB))
    p(f"{'  (median of per-rep e2e/memcpy ratios)':42}" + "".join(
        f"{'':>14}{res['copy'][str(m)]['ratio']['handoff_e2e_paired_median']:>7.2f}x" for m in SIZES_MIB))
    p(f"{'  (floor: median of per-rep ratios)':42}" + "".join(
        f"{'':>14}{res['copy'][str(m)]['ratio']['handoff_floor_paired_median']:>7.2f}x" for m in SIZES_MIB))
    p(f"{'  (end to end / cold memcpy)':42}" + "".join(
        f"{'':>14}{res['copy'][str(m)]['ratio']['handoff_e2e_vs_cold']:>7.2f}x" for m in SIZES_MIB))
    e = res["exists"]
    p("\n2. control-plane latency, us")
    places = [pl for pl in ("scheduler", "same_cpu", "cross_cpu") if pl in e]
    p(f"{'placement:':42}" + "".join(f"{pl:>26}" for pl in places))
    p(f"{'':42}" + f"{'p50':>9}{'p99':>8}{'ratio':>9}" * len(places))
    for label, key in (("bare pyzmq REQ/REP ipc  [ref]", "bare_zmq_rtt"),
                       ("exists, present key, unpinned", "exists_present"),
                       ("exists(pin_s=1), present key", "exists_pinned"),
                       ("exists, absent key (event ring)", "exists_absent"),
                       ("ping (round trip)  [diag]", "ping")):
        line = f"{label:42}"
        for pl in places:
            r = e[pl][key]
            ratio = f"{e[pl]['ratio'][key]:.2f}x" if key in e[pl]["ratio"] else ""
            line += f"{r['p50_us']:>9.1f}{r['p99_us']:>8.1f}{ratio:>9}"
        p(line)
    for label, key in (("  median of per-round unpinned/bare", "exists_present"),
                       ("  median of per-round pinned/bare", "exists_pinned")):
        p(f"{label:42}" + "".join(f"{'':>17}{e[pl]['ratio'][key + '_paired_median']:>8.2f}x" for pl in places))
    p(f"  Exists requests seen by the daemon: {e['daemon_exists_requests']} (pinned lookups made: "
      f"{e['pinned_exists_requests']}; the rest are unpinned present-key lookups the client did not "
      f"answer itself, and absent ones sharing a presence bucket with a live key)")
    p("\n3. unbatched ops/s (round-robin exists (unpinned, present) / put 4 KiB / get 4 KiB)")
    for o in res["ops"]:
        mixs = ", ".join(f"{n} {v['ops_per_s']:.0f}/s @{v['mean_latency_us']:.0f}us"
                         for n, v in o["per_op"].items())
        p(f"  {o['clients']} client(s), {o['seconds']:.1f}s: {o['ops_per_s']:>8.0f} ops/s  [{mixs}]")
        p(f"      a bare ROUTER echo server, same clients, windows before / after: "
          f"{o['bare_echo_ops_per_s'][0]:.0f} / {o['bare_echo_ops_per_s'][1]:.0f} round trips/s "
          f"(ecd = {o['ratio_to_bare_echo']:.2f}x of their mean)")
        p(f"      daemon CPU {o['daemon_cpu_util'] * 100:.0f}% ({o['daemon_cpu_us_per_op']:.1f} us/op), "
          f"clients CPU {o['clients_cpu_us_per_op']:.1f} us/op; machine busy {o['machine_busy_cpus']:.2f} "
          f"CPUs, of which other processes {o['other_processes_cpus']:.2f}")
    ig = res.get("integrity")
    if ig:
        p(f"\n4. integrity at {ig['mib']} MiB, p50 in us (checked: put(checksum=True), view/get(verify=True))")
        p(f"{'':34}{'without':>10}{'with':>10}{'extra':>10}{'ratio':>8}")
        for label, k in (("put", "put"), ("view (verify hashes the mapping)", "view"),
                         ("put + view", "put_view"), ("get (copy)", "get")):
            ratio = f"{ig['checked'][k]['p50_us'] / ig['plain'][k]['p50_us']:.2f}x"
            p(f"  {label:32}{ig['plain'][k]['p50_us']:>10.1f}{ig['checked'][k]['p50_us']:>10.1f}"
              f"{ig['extra_us'][k]:>10.1f}{ratio:>8}")
        p(f"  references: memcpy {ig['memcpy']['p50_us']:.1f} us, xxh3-64 of a cache-hot buffer "
          f"{ig['xxh3_hot']['p50_us']:.1f} us ({ig['ratio']['xxh3_vs_memcpy']:.2f}x memcpy)")
    c16 = res["copy"]["16"]
    agg = res["ops"][-1]
    handoff = c16["ratio"]["handoff_e2e_paired_median"]
    load = res["env"].get("loadavg_end", res["env"]["loadavg_start"])
    # (figure, reference, goal, measured, pass or None when measured elsewhere)
    goals = [
        ("put (process A) + view (process B) of 16 MiB, end to end", "one single-thread memcpy of 16 MiB",
         f"<= {TARGET_HANDOFF_RATIO}x", f"{handoff:.2f}x (floor, the copy + one bare round trip: "
         f"{c16['ratio']['handoff_floor_paired_median']:.2f}x; vs cold memcpy {c16['ratio']['handoff_e2e_vs_cold']:.2f}x)",
         handoff <= TARGET_HANDOFF_RATIO),
        ("exists of a present key, unpinned, p50", "bare pyzmq REQ/REP round trip over ipc",
         f"<= {TARGET_EXISTS_RATIO}x", f"{e['verdict_exists_present']:.2f}x",
         e["verdict_exists_present"] <= TARGET_EXISTS_RATIO),
        ("exists(pin_s>0) of a present key, p50", "the same bare round trip",
         f"<= {TARGET_EXISTS_PINNED_RATIO}x", f"{e['verdict_exists_pinned']:.2f}x",
         e["verdict_exists_pinned"] <= TARGET_EXISTS_PINNED_RATIO),
        (f"unbatched mixed ops/s, {OPS_CLIENTS} client processes", "-", f">= {TARGET_OPS // 1000}k",
         f"{agg['ops_per_s']:.0f} ({agg['ratio_to_bare_echo']:.2f}x of a bare ROUTER echo server with the same "
         f"clients, the floor: {sum(agg['bare_echo_ops_per_s']) / 2:.0f})", agg["ops_per_s"] >= TARGET_OPS),
        ("exists(pin_s>0) p50 at 300k entries vs at 1k", "itself", "flat (<= 1.1x)",
         "benchmarks/entry_memory.py", None),
        ("daemon memory per entry, 300k tiny entries", "-", "<= 500 B", "benchmarks/entry_memory.py", None),
        ("KV load / save of a 2048-token prompt", "memcpy of the same bytes", "<= 1.5x / <= 1.2x",
         "benchmarks/bench_vllm.py", None),
    ]
    p(f"\ngoals (issue 15): paired ratios, the median of per-sample (hand-off) or per-round (exists: "
      f"the worse of the two CPU placements, same CPU / different CPUs) ratios; load average "
      f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    p("| figure | reference | goal | measured | |\n|---|---|---|---|---|")
    for name, ref, goal, measured, ok in goals:
        p(f"| {name} | {ref} | {goal} | {measured} | {'-' if ok is None else 'PASS' if ok else 'MISS'} |")
    targets = [(f"{name} {goal}", bool(ok), measured) for name, _, goal, measured, ok in goals if ok is not None]
    return targets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--ops-seconds", type=float, default=4.0, help="length of the ops/s window")
    args = ap.parse_args()
    if time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
        print("warning: perf_counter is not CLOCK_MONOTONIC; cross-process stamps may not compare",
              file=sys.stderr)
    t_start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="ecd-bench-")
    daemon = BenchDaemon(workdir)
    procs: list = []
    conns: list = []
    ok_exit = False
    try:
        c = daemon.connect(timeout=0.5)

        start = child_starter(procs, conns)

        echo_endpoint = f"ipc://{daemon.runtime_dir}/echo.sock"
        start(_echo_server, echo_endpoint, "REP")
        router_endpoint = f"ipc://{daemon.runtime_dir}/router-echo.sock"
        start(_echo_server, router_endpoint, "ROUTER")
        router_proc = procs[-1]
        consumer = start(_consumer, daemon.endpoint)
        small = torch.from_numpy(prefaulted(OPS_SMALL_ELEMS * 4))
        for j in range(OPS_KEYS):
            c.put(f"ops/ex/{j}", small)
            c.put(f"ops/get/{j}", small)
        workers = [start(_ops_worker, daemon.endpoint, w) for w in range(OPS_CLIENTS)]
        for conn in conns:
            if recv(conn, 120) != "ready":
                raise RuntimeError("a benchmark process did not start")

        res = {"env": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "torch": torch.__version__, "numpy": np.__version__, "node": daemon.node,
                       "loadavg_start": os.getloadavg()}}
        diag_name = f"ecd-bench-diag.{os.getpid()}"
        created = ShmFile.create(diag_name, max(SIZES_MIB) * MIB)  # fallocated like a pool segment
        try:
            diag = ShmFile.attach(diag_name, max(SIZES_MIB) * MIB, writable=True, populate=True)
        finally:
            created.unlink()  # the mapping keeps the memory; the name goes now
        res["copy"] = {str(m): bench_copies(c, consumer, m, diag.buf, echo_endpoint) for m in SIZES_MIB}
        res["integrity"] = bench_integrity(c)
        res["exists"] = bench_exists(c, echo_endpoint, [daemon.proc.pid, procs[0].pid])
        res["ops"] = [run_ops_paired(daemon, workers[:1], router_endpoint, min(2.0, args.ops_seconds)),
                      run_ops_paired(daemon, workers, router_endpoint, args.ops_seconds)]
        res["env"]["loadavg_end"] = os.getloadavg()
        router_proc.terminate()  # a bare echo loop: nothing of it to keep
        for conn in workers + [consumer]:
            conn.send(("stop",))
        for pr in procs:
            pr.join(15)
        res["daemon_stats"] = c.stats()
        c.close()
        bad = sum(r["bad_payloads"] for r in res["copy"].values()) + res["integrity"]["bad_payloads"]
        targets = report(res)
        res["targets"] = [{"name": n, "pass": ok, "detail": d} for n, ok, d in targets]
        if bad:
            print(f"ERROR: {bad} hand-offs delivered the wrong payload")
        ok_exit = not bad
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.terminate()
        rc = daemon.stop()
        leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"ecd.{daemon.node}.")]
        print(f"\ndaemon stopped with SIGTERM: exit code {rc}; shm files left: {leftovers or 'none'}; "
              f"benchmark took {time.monotonic() - t_start:.0f}s")
        if rc != 0 or leftovers:
            print(daemon.log_tail())
            ok_exit = False
        shutil.rmtree(workdir, ignore_errors=True)
    if ok_exit and args.json:
        res["daemon_exit_code"] = rc
        write_results(args.json, res)
    return 0 if ok_exit else 1


if __name__ == "__main__":
    sys.exit(main())
