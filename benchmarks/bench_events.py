#!/usr/bin/env python3
"""[events] cost (issue 28): put throughput with KV events on against off, and how long an event
takes to reach a subscriber against a bare ZeroMQ PUB/SUB hop.

Three daemons side by side (64 MiB pools, ipc control sockets): `off` (no [events]), `reading`
([events] on, a subscriber process draining the stream) and `deaf` ([events] on, a subscriber
that connects and never reads: its ZMQ queue fills to the HWM and the daemon drops for it).
Per rep, the same put workload runs against each, in rotating order, and each `on` time is
divided by the `off` time of the same rep (a paired ratio: noise of a shared machine cancels).
The workload: --puts single puts of a 64-float tensor with a KVBlockMeta (each one BlockStored
and, as keys repeat, one BlockRemoved), then --batches put_many of --batch entries. Reported: the
median ratio per mode (1.0: no cost) and the per-put time of `off`, plus each daemon's RSS at
the end (the deaf subscriber must not grow it).

Latency: a subscriber in this process times put-return -> event-received for --latency puts, one
at a time: `quiet` (puts 25 ms apart: a change after a quiet batch_interval goes out at once) and
`stream` (back to back: each waits for the next batch, up to batch_interval), with the default
batch_interval (20 ms) and with 1 ms; against it a bare PUB -> SUB hop of one message over ipc in
this process, measured alternately (paired: latency / bare hop, medians).

    python benchmarks/bench_events.py [--reps 7] [--puts 2000] [--batches 20] [--batch 256] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

import msgspec  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402

from conftest import DaemonProcess  # noqa: E402
from ecd.protocol import KVBlockMeta  # noqa: E402

DRAIN = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.SUB); s.subscribe(b""); s.connect(sys.argv[1])
n = 0
while True:
    s.recv_multipart(); n += 1
"""
DEAF = """
import sys, time, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.SUB); s.rcvhwm = 10; s.subscribe(b""); s.connect(sys.argv[1])
time.sleep(3600)
"""


def rss(pid: int) -> int:
    return int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def workload(client, args, rep: int) -> float:
    t = torch.zeros(64)
    started = time.perf_counter()
    for i in range(args.puts):
        client.put(f"p{i % 500}", t, meta=KVBlockMeta(i, i - 1 if i else None, list(range(16)), 16))
    items = {f"b{i}": t for i in range(args.batch)}
    metas = {f"b{i}": KVBlockMeta(10_000_000 + i, None, list(range(16)), 16) for i in range(args.batch)}
    for _ in range(args.batches):
        client.put_many(items, meta=metas)
    return time.perf_counter() - started


def latency(args, evdir: str, interval: str, quiet: bool) -> list[tuple[float, float]]:
    """(event latency, bare hop) pairs, seconds; `quiet`: puts 25 ms apart, else back to back."""
    d = DaemonProcess("64MiB", extra=f'[events]\npublish = "ipc://{evdir}/lat-{interval}"\nbatch_interval = "{interval}"\n')
    d.start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.subscribe(b"")
    sub.connect(f"ipc://{evdir}/lat-{interval}")
    pub, bare = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    pub.bind(f"ipc://{evdir}/bare-{interval}")
    bare.subscribe(b"")
    bare.connect(f"ipc://{evdir}/bare-{interval}")
    pairs = []
    try:
        with d.client() as c:
            while not sub.poll(100):  # joined
                c.put("probe", torch.zeros(1))
            while sub.poll(200):
                sub.recv_multipart()
            while True:
                pub.send(b"x")
                if bare.poll(100):
                    bare.recv()
                    break
            t = torch.zeros(16)
            for i in range(args.latency):
                if quiet:
                    time.sleep(0.025)  # longer than batch_interval: the event goes at once
                c.put(f"l{i}", t, meta=KVBlockMeta(i))
                sent = time.perf_counter()
                sub.recv_multipart()
                event = time.perf_counter() - sent
                sent = time.perf_counter()
                pub.send_multipart([b"kv", b"\0" * 8, b"\x93" * 60])
                bare.recv_multipart()
                pairs.append((event, time.perf_counter() - sent))
    finally:
        for s in (sub, pub, bare):
            s.close(0)
        ctx.term()
        d.cleanup()
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--puts", type=int, default=2000)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--latency", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()
    evdir = tempfile.mkdtemp(prefix="ecd-bev-", dir="/tmp")
    daemons = {"off": DaemonProcess("64MiB"),
               "reading": DaemonProcess("64MiB", extra=f'[events]\npublish = "ipc://{evdir}/reading"\n'),
               "deaf": DaemonProcess("64MiB", extra=f'[events]\npublish = "ipc://{evdir}/deaf"\n')}
    subs = []
    try:
        for d in daemons.values():
            d.start()
        subs = [subprocess.Popen([sys.executable, "-c", DRAIN, f"ipc://{evdir}/reading"]),
                subprocess.Popen([sys.executable, "-c", DEAF, f"ipc://{evdir}/deaf"])]
        time.sleep(0.5)
        clients = {name: d.client() for name, d in daemons.items()}
        for c in clients.values():
            workload(c, args, -1)  # warm-up
        names = list(daemons)
        ratios: dict[str, list[float]] = {"reading": [], "deaf": []}
        off_times = []
        for rep in range(args.reps):
            order = names[rep % 3:] + names[:rep % 3]
            times = {name: workload(clients[name], args, rep) for name in order}
            off_times.append(times["off"])
            for mode in ratios:
                ratios[mode].append(times[mode] / times["off"])
        per_put = statistics.median(off_times) / (args.puts + args.batches * args.batch)
        stats = {name: c.stats()["events"] for name, c in clients.items()}
        for c in clients.values():
            c.close()
        result = {
            "ops_per_rep": args.puts + args.batches * args.batch,
            "off_per_op_us": per_put * 1e6,
            "ratio_reading_median": statistics.median(ratios["reading"]),
            "ratio_deaf_median": statistics.median(ratios["deaf"]),
            "ratios": ratios,
            "rss_mib": {name: rss(d.proc.pid) / 2**20 for name, d in daemons.items()},
            "events_published": {name: (s or {}).get("events", 0) for name, s in stats.items()},
            "events_dropped": {name: (s or {}).get("dropped", 0) for name, s in stats.items()},
        }
    finally:
        for p in subs:
            p.kill()
        for d in daemons.values():
            d.cleanup()
    for interval, quiet in (("20ms", True), ("20ms", False), ("1ms", False)):
        pairs = latency(args, evdir, interval, quiet)
        name = f"latency_{interval}_{'quiet' if quiet else 'stream'}"
        result[f"{name}_median_ms"] = statistics.median(p[0] for p in pairs) * 1e3
        result[f"{name}_bare_hop_median_ms"] = statistics.median(p[1] for p in pairs) * 1e3
        result[f"{name}_ratio_median"] = statistics.median(p[0] / p[1] for p in pairs)
    shutil.rmtree(evdir, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k != "ratios"}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    assert msgspec


if __name__ == "__main__":
    main()
