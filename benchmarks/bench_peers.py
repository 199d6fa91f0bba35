#!/usr/bin/env python3
"""ecd against what engines use today to hand a tensor to another process, in one run.

One command, one run: a producer (this process) hands a float32 tensor of 1 MiB and of 16 MiB to
a consumer process, by
  - ecd: put, then view (zero-copy, under a read lease) or get (a copy) in the consumer;
  - vLLM's example connectors' disk path: `safetensors.torch.save_file` of one file per item
    (`<dir>/<hash>/encoder_cache.safetensors`, as ECExampleConnector writes under /tmp), then
    `safetensors.torch.load_file` in the consumer;
  - raw pyzmq over ipc (PUSH -> PULL): send with copy, or zero-copy (copy=False both ways);
  - Redis over a unix socket: SET, then GET in the consumer (a redis-server of our own, started
    here, bound to no TCP port, persistence off) when `redis-server` and the `redis` package are
    installed.
Each sample is timed from the producer's first call to the moment the consumer holds the tensor
(both stamps CLOCK_MONOTONIC), and divided by a single-thread memcpy of the same bytes
(np.copyto between two pre-faulted buffers) taken right before it: the table quotes the median of
those per-sample ratios. Every way includes the same notification of the consumer over a
multiprocessing pipe, shown alone as its own row. Methods rotate order sample by sample, so the
machine's drift hits all alike.

The extra packages (safetensors, redis) are never dependencies of ecd: each is imported here, and
a row is skipped with the reason when it is missing. `--json PATH` also writes the results.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from bench_daemon import BenchDaemon, write_results

MIB = 1 << 20
SIZES_MIB = (1, 16)
REPS = {1: 60, 16: 24}
WARMUP = 3
now_ns = time.perf_counter_ns


def prefaulted(nbytes: int) -> np.ndarray:
    a = np.empty(nbytes // 4, np.float32)
    a.fill(1.0)
    return a


def _consumer(endpoint: str, zmq_endpoint: str, redis_socket: str | None, conn) -> None:
    """The other process: on each command, fetch the tensor the way named, stamp, check."""
    import zmq
    from ecd.client.client import Client
    c = Client(endpoint, name="peers-consumer")
    ctx = zmq.Context(io_threads=1)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(zmq_endpoint)
    rds = None
    if redis_socket is not None:
        import redis
        rds = redis.Redis(unix_socket_path=redis_socket)
    st_load = None
    try:
        from safetensors.torch import load_file as st_load
    except ImportError:
        pass
    conn.send("ready")
    while True:
        cmd = conn.recv()
        what = cmd[0]
        if what == "stop":
            break
        marker = cmd[2]
        if what == "notify":
            t1 = now_ns()
            ok = True
        elif what == "ecd_view":
            with c.view(cmd[1]) as v:
                t1 = now_ns()
                ok = v[0].item() == marker and v[-1].item() == marker
        elif what == "ecd_get":
            t = c.get(cmd[1])
            t1 = now_ns()
            ok = t[0].item() == marker and t[-1].item() == marker
        elif what == "safetensors":
            t = st_load(cmd[1])["ec_cache"]
            t1 = now_ns()
            ok = t[0].item() == marker and t[-1].item() == marker
        elif what in ("zmq_copy", "zmq_zerocopy"):
            if what == "zmq_copy":
                a = np.frombuffer(pull.recv(), np.float32)
            else:
                a = np.frombuffer(pull.recv(copy=False).buffer, np.float32)
            t = torch.from_numpy(a)
            t1 = now_ns()
            ok = t[0].item() == marker and t[-1].item() == marker
        elif what == "redis":
            a = np.frombuffer(rds.get(cmd[1]), np.float32)
            t = torch.from_numpy(a)
            t1 = now_ns()
            ok = t[0].item() == marker and t[-1].item() == marker
        else:
            raise ValueError(what)
        conn.send((t1, ok))
    pull.close(0)
    ctx.term()
    c.close()


def start_redis(workdir: str) -> tuple[subprocess.Popen | None, str | None, str]:
    """A private redis-server on a unix socket (no TCP port, no persistence), or why not."""
    exe = shutil.which("redis-server")
    if exe is None:
        return None, None, "redis-server not installed (apt-get install redis-server)"
    try:
        import redis
    except ImportError:
        return None, None, "the redis package is not installed (pip install redis)"
    path = os.path.join(workdir, "redis.sock")
    proc = subprocess.Popen([exe, "--port", "0", "--unixsocket", path, "--unixsocketperm", "700",
                             "--save", "", "--appendonly", "no", "--dir", workdir, "--maxmemory", "0",
                             "--proto-max-bulk-len", "1gb"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis(unix_socket_path=path)
    deadline = time.monotonic() + 10
    while True:
        try:
            r.ping()
            return proc, path, ""
        except (redis.exceptions.ConnectionError, FileNotFoundError, socket.error):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                return None, None, "redis-server did not start"
            time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--storage", default=None,
                    help="directory for the safetensors files (default: a new directory under /tmp, "
                         "as vLLM's example connectors use /tmp)")
    args = ap.parse_args()
    import zmq
    workdir = tempfile.mkdtemp(prefix="ecd-peers-")
    storage = args.storage or tempfile.mkdtemp(prefix="ecd-peers-st-", dir="/tmp")
    daemon = BenchDaemon(workdir, node_prefix="peers", pool="256MiB")  # two 16 MiB entries live at most
    redis_proc, redis_socket, redis_why = start_redis(workdir)
    skipped: dict[str, str] = {}
    if redis_proc is None:
        skipped["redis"] = redis_why
    try:
        from safetensors.torch import save_file as st_save
    except ImportError:
        st_save = None
        skipped["safetensors"] = "the safetensors package is not installed (pip install safetensors)"
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    zmq_endpoint = f"ipc://{workdir}/push.sock"
    consumer = spawn.Process(target=_consumer, args=(daemon.endpoint, zmq_endpoint, redis_socket, child), daemon=True)
    ctx = zmq.Context(io_threads=1)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    rc = 1
    try:
        c = daemon.connect(timeout=10)
        consumer.start()
        if not parent.poll(120) or parent.recv() != "ready":
            raise RuntimeError("consumer did not start")
        push.connect(zmq_endpoint)
        rds = None
        if redis_socket is not None:
            import redis
            rds = redis.Redis(unix_socket_path=redis_socket)
        methods = ["notify", "ecd_view", "ecd_get", "zmq_copy", "zmq_zerocopy"]
        if st_save is not None:
            methods.append("safetensors")
        if rds is not None:
            methods.append("redis")
        results: dict = {"env": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                                 "python": sys.version.split()[0], "torch": torch.__version__,
                                 "storage": storage}, "skipped": skipped, "sizes": {}}
        bad = 0
        for mib in SIZES_MIB:
            nbytes = mib * MIB
            src_np, ref_dst = prefaulted(nbytes), prefaulted(nbytes)
            src = torch.from_numpy(src_np)
            samples: dict[str, list[int]] = {m: [] for m in methods}
            producer: dict[str, list[int]] = {m: [] for m in methods}  # the producer's call alone
            ratios: dict[str, list[float]] = {m: [] for m in methods}
            memcpy: list[int] = []
            for i in range(WARMUP + REPS[mib]):
                order = methods[i % len(methods):] + methods[:i % len(methods)]
                for m in order:
                    marker = float(i * 16 + methods.index(m))
                    src_np[0] = src_np[-1] = marker
                    t0 = now_ns()
                    np.copyto(ref_dst, src_np)
                    ref = now_ns() - t0
                    key = f"peers/{mib}/{m}/{i}"
                    t0 = now_ns()
                    if m in ("ecd_view", "ecd_get"):
                        c.put(key, src)
                        tw = now_ns()
                        parent.send((m, key, marker))
                    elif m == "safetensors":
                        folder = os.path.join(storage, key.replace("/", "_"))
                        os.makedirs(folder, exist_ok=True)
                        path = os.path.join(folder, "encoder_cache.safetensors")
                        st_save({"ec_cache": src}, path)
                        tw = now_ns()
                        parent.send((m, path, marker))
                    elif m == "zmq_copy":
                        push.send(src_np, copy=True)
                        tw = now_ns()
                        parent.send((m, key, marker))
                    elif m == "zmq_zerocopy":
                        push.send(src_np, copy=False)
                        tw = now_ns()
                        parent.send((m, key, marker))
                    elif m == "redis":
                        rds.set(key, memoryview(src_np).cast("B"))
                        tw = now_ns()
                        parent.send((m, key, marker))
                    else:  # notify: the pipe alone, part of every other row
                        parent.send((m, key, marker))
                        tw = now_ns()
                    if not parent.poll(60):
                        raise RuntimeError(f"no answer from the consumer ({m})")
                    t1, ok = parent.recv()
                    bad += not ok
                    if i >= WARMUP:
                        samples[m].append(t1 - t0)
                        producer[m].append(tw - t0)
                        ratios[m].append((t1 - t0) / ref)
                        if m == methods[0]:
                            memcpy.append(ref)
                    # clean up outside the timed span
                    if m in ("ecd_view", "ecd_get"):
                        c.delete(key)
                    elif m == "safetensors":
                        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
                    elif m == "redis":
                        rds.delete(key)
            results["sizes"][str(mib)] = {
                "memcpy_p50_us": float(np.median(memcpy)) / 1e3,
                "methods": {m: {"p50_us": float(np.median(samples[m])) / 1e3,
                                "producer_p50_us": float(np.median(producer[m])) / 1e3,
                                "ratio_median": float(np.median(ratios[m])),
                                "n": len(samples[m])} for m in methods}}
        results["env"]["loadavg_end"] = os.getloadavg()
        report(results, methods)
        if bad:
            print(f"ERROR: {bad} hand-offs delivered the wrong payload")
        rc = 0 if not bad else 1
        parent.send(("stop",))
        consumer.join(15)
        c.close()
        if args.json:
            write_results(args.json, results)
    finally:
        push.close(0)
        ctx.term()
        if consumer.is_alive():
            consumer.terminate()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
        if daemon.stop() != 0:
            print(daemon.log_tail())
            rc = 1
        shutil.rmtree(workdir, ignore_errors=True)
        if args.storage is None:
            shutil.rmtree(storage, ignore_errors=True)
    return rc


LABELS = {
    "ecd_view": "ecd: put, then view in the consumer (zero-copy)",
    "ecd_get": "ecd: put, then get in the consumer (a copy)",
    "safetensors": "safetensors file per item (vLLM's example connectors)",
    "zmq_copy": "raw pyzmq PUSH/PULL over ipc, copying",
    "zmq_zerocopy": "raw pyzmq PUSH/PULL over ipc, zero-copy",
    "redis": "Redis SET + GET over a unix socket",
    "notify": "the consumer's notification alone (in every row)",
}


def report(res: dict, methods: list[str]) -> None:
    env = res["env"]
    la, lb = env["loadavg_start"], env["loadavg_end"]
    sizes = list(res["sizes"])
    print(f"\nhanding a float32 tensor to another process, end to end ({env['cpus']} CPUs; load average "
          f"{la[0]:.2f} at start, {lb[0]:.2f} at end): p50 and the median of per-sample ratios to a "
          f"single-thread memcpy of the same bytes taken just before each sample\n")
    head = "| way | " + " | ".join(f"{m} MiB p50 (producer's part) | ×memcpy" for m in sizes) + " |"
    print(head)
    print("|---|" + "---:|---:|" * len(sizes))
    print("| memcpy of the same bytes (reference) | " + " | ".join(
        f"{res['sizes'][m]['memcpy_p50_us'] / 1e3:.2f} ms | 1.00" for m in sizes) + " |")
    for meth in methods[1:] + methods[:1]:
        cells = []
        for m in sizes:
            r = res["sizes"][m]["methods"][meth]
            cells.append(f"{r['p50_us'] / 1e3:.2f} ms ({r['producer_p50_us'] / 1e3:.2f}) | **{r['ratio_median']:.1f}**")
        print(f"| {LABELS[meth]} | " + " | ".join(cells) + " |")
    for name, why in res["skipped"].items():
        print(f"| {name}: skipped | {why} |")


if __name__ == "__main__":
    sys.exit(main())
