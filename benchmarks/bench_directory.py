"""The fleet directory's load and reaction times, on this machine ([cluster] directory).

Starts a real redis-server (tests/redis_server.py: loopback, a free port) and real daemons, and
measures:
- commands per second per daemon at idle (registration renewals only), from the store's own
  count (INFO commandstats) and the daemons' (Stats.directory.counts.commands);
- commands per put of an encoder-cache entry (PutInline with EncoderMeta);
- the time until a SIGKILLed daemon drops out of the live set (polled every 10 ms);
- a lookup's round trip (DirectoryStore.lookup: one EVALSHA) against a bare PING, paired:
  each lookup divided by the PING taken right beside it, alternating, the median of the ratios.

  PYTHONPATH=$PWD python benchmarks/bench_directory.py [--daemons 3] [--ttl 3] [--idle 15]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "cluster"))

import torch  # noqa: E402

from conftest import DaemonProcess  # noqa: E402
from ecd.daemon.peer.directory_store import DirectoryStore, live_nodes  # noqa: E402
from ecd.protocol import EncoderMeta, PutInline  # noqa: E402
from peerutil import cluster_toml, free_port  # noqa: E402
from redis_server import RedisServer  # noqa: E402


def store_commands(client) -> int:
    info = client.info("stats")
    return int(info["total_commands_processed"])


def daemon_commands(d) -> int:
    with d.client() as c:
        return c.stats()["directory"]["counts"]["commands"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--daemons", type=int, default=3)
    ap.add_argument("--ttl", type=float, default=3.0)
    ap.add_argument("--idle", type=float, default=15.0, help="seconds of idle measured")
    ap.add_argument("--puts", type=int, default=500)
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    server = RedisServer()
    server.start()
    daemons: list[DaemonProcess] = []
    try:
        for _ in range(args.daemons):
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            extra = cluster_toml(endpoint, [], f'directory = "{server.url}"\ndirectory_ttl = "{args.ttl}s"\n')
            d = DaemonProcess("32MiB", extra)
            d.start()
            daemons.append(d)
        client = server.client()
        while len(live_nodes(client)) < args.daemons:
            time.sleep(0.05)
        time.sleep(args.ttl)  # every node has read every other's record

        # 1. idle: renewals only (INFO itself counts one command per call: subtracted)
        s0, d0, t0 = store_commands(client), [daemon_commands(d) for d in daemons], time.monotonic()
        time.sleep(args.idle)
        s1, d1, t1 = store_commands(client), [daemon_commands(d) for d in daemons], time.monotonic()
        idle_store = (s1 - s0 - 1) / (t1 - t0) / args.daemons
        idle_daemon = statistics.mean((b - a) / (t1 - t0) for a, b in zip(d0, d1))
        print(f"idle, ttl {args.ttl:g}s: {idle_store:.3f} commands/s per daemon (store's count), "
              f"{idle_daemon:.3f} (daemons' count); renewal every {args.ttl / 3:.2f}s")

        # 2. per put of an encoder-cache entry
        d = daemons[0]
        payload = torch.ones(64).numpy().tobytes()
        before_s, before_d = store_commands(client), daemon_commands(d)
        with d.client() as c:
            for i in range(args.puts):
                c.request(PutInline(0, "default", f"img-{i}", "float32", [64], payload, meta=EncoderMeta("", 4)))
        store = DirectoryStore(client, "ecd")
        deadline = time.monotonic() + 30
        while store.lookup("default", [f"img-{args.puts - 1}"]) != [[d.node]] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        after_s, after_d = store_commands(client), daemon_commands(d)
        print(f"per encoder put: {(after_d - before_d) / args.puts:.2f} commands (daemon's count), "
              f"{(after_s - before_s) / args.puts:.2f} (store's count, renewals and the polling lookups included)")

        # 3. lookup vs PING, paired
        keys = ["img-0"]
        ratios, lookups, pings = [], [], []
        for i in range(args.reps):
            first_ping = i % 2 == 0
            if first_ping:
                a = time.perf_counter(); client.ping(); b = time.perf_counter()  # noqa: E702
                store.lookup("default", keys); c2 = time.perf_counter()  # noqa: E702
                ping, look = b - a, c2 - b
            else:
                a = time.perf_counter(); store.lookup("default", keys); b = time.perf_counter()  # noqa: E702
                client.ping(); c2 = time.perf_counter()  # noqa: E702
                look, ping = b - a, c2 - b
            ratios.append(look / ping)
            lookups.append(look)
            pings.append(ping)
        print(f"lookup of 1 key: median {statistics.median(lookups) * 1e6:.0f} us, PING {statistics.median(pings) * 1e6:.0f} us, "
              f"paired ratio median {statistics.median(ratios):.2f} ({args.reps} reps)")
        keys32 = [f"img-{i}" for i in range(32)]
        ratios32 = []
        for _ in range(args.reps // 4):
            a = time.perf_counter(); client.ping(); b = time.perf_counter()  # noqa: E702
            store.lookup("default", keys32); c2 = time.perf_counter()  # noqa: E702
            ratios32.append((c2 - b) / (b - a))
        print(f"lookup of 32 keys: paired ratio to PING median {statistics.median(ratios32):.2f}")

        # 4. a killed daemon drops out
        victim = daemons[-1]
        times = []
        victim.stop(signal.SIGKILL)
        killed = time.monotonic()
        while victim.node in live_nodes(client):
            time.sleep(0.01)
        times.append(time.monotonic() - killed)
        print(f"killed daemon dropped out of the live set after {times[0]:.2f}s (ttl {args.ttl:g}s: "
              f"between 2/3 ttl and ttl after the kill, by when it last renewed)")
    finally:
        for d in daemons:
            d.cleanup()
        server.stop()


if __name__ == "__main__":
    main()
