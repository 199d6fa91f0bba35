#!/usr/bin/env python3
"""CPU per operation, thread by thread, for one client in a closed loop (benchmarks/PROFILE.md).

    python benchmarks/thread_cpu.py [--seconds 4] [OP ...]
    OP: bare ping exists_pin put4k get4k put64k put64k_reserved

put64k rides inline (limits.inline_max_bytes); put64k_reserved is 64 KiB + 64 bytes, so it goes
into the client's reservation (copy, then Publish): the route a write lease generalises. Both put
a new key each time into a pool that evicts (the daemon's whole commit: place, evict, index,
journal, ring).

`bare` is the reference: a pyzmq REQ socket against a REP echo process over ipc. Every other OP
runs against a daemon of its own (BenchDaemon). For each, the wall time per operation and the CPU
per operation of every thread of the server (the daemon or the echo process) and of this client,
read from /proc/PID/task/*/stat before and after the loop (clock ticks: run a few seconds).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time

OPS = ("bare", "ping", "exists_pin", "put4k", "get4k", "put64k", "put64k_reserved")


def task_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of every thread of `pid`, by "name:tid"."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                s = f.read()
        except FileNotFoundError:
            continue
        name = s[s.index("(") + 1:s.rindex(")")]
        fields = s.rsplit(")", 1)[1].split()
        out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _echo(endpoint: str) -> None:
    import zmq
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.REP)
    sock.bind(endpoint)
    while True:
        sock.send(sock.recv())


def measure(step, server_pid: int, seconds: float) -> dict:
    for _ in range(2000):
        step()
    s0, c0, t0, n = task_cpu(server_pid), task_cpu(os.getpid()), time.perf_counter(), 0
    while time.perf_counter() < t0 + seconds:
        for _ in range(200):
            step()
        n += 200
    wall = time.perf_counter() - t0
    s1, c1 = task_cpu(server_pid), task_cpu(os.getpid())
    res: dict = {"ops": n, "wall_us": wall / n * 1e6}
    for who, a, b in (("server", s0, s1), ("client", c0, c1)):
        per = {k: (v - a.get(k, 0.0)) / n * 1e6 for k, v in b.items()}
        res[who] = {k: v for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 0.05}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ops", nargs="*", default=list(OPS), choices=OPS, metavar="OP")
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    for op in args.ops:
        workdir = tempfile.mkdtemp(prefix="ecd-threadcpu-")
        if op == "bare":
            import zmq
            endpoint = f"ipc://{workdir}/echo.sock"
            echo = mp.get_context("spawn").Process(target=_echo, args=(endpoint,), daemon=True)
            echo.start()
            ctx = zmq.Context(io_threads=1)
            req = ctx.socket(zmq.REQ)
            req.setsockopt(zmq.LINGER, 0)
            req.connect(endpoint)
            payload = b"x" * 32

            def bare() -> None:
                req.send(payload)
                req.recv()
            res = measure(bare, echo.pid, args.seconds)
            echo.terminate()
            req.close(0)
            ctx.term()
        else:
            import torch

            from bench_daemon import BenchDaemon
            daemon = BenchDaemon(workdir, node_prefix="threadcpu", pool="64MiB")
            c = daemon.connect()
            small = torch.ones(1024)
            c.put("k", small)
            inline, reserved = torch.ones(64 << 10, dtype=torch.uint8), torch.ones((64 << 10) + 64, dtype=torch.uint8)
            keys = iter(range(1 << 62))
            steps = {"ping": c.ping, "exists_pin": lambda: c.exists("k", pin_s=1.0),
                     "put4k": lambda: c.put("p", small), "get4k": lambda: c.get("k"),
                     "put64k": lambda: c.put(f"n{next(keys)}", inline),
                     "put64k_reserved": lambda: c.put(f"n{next(keys)}", reserved)}
            try:
                res = measure(steps[op], daemon.proc.pid, args.seconds)
            finally:
                c.close()
                daemon.stop()
        print(f"{op}: {res['ops']} ops, wall {res['wall_us']:.1f} us/op; load {os.getloadavg()[0]:.2f}")
        for who in ("server", "client"):
            threads = res[who]
            print(f"  {who} CPU us/op: total {sum(threads.values()):.1f} = "
                  + ", ".join(f"{k.split(':')[0]} {v:.1f}" for k, v in threads.items()))


if __name__ == "__main__":
    main()
