#!/usr/bin/env python3
"""A fleet of ecd daemons on one machine, one Redis directory, churn: what the fleet costs.

One command, one run (`make bench-fleet`; `--daemons 32` by default, small pools):
  1. a redis-server of our own on loopback (a free port, no persistence);
  2. the fleet grows to n = 4, 8, 16, N daemons (each with a peer plane on loopback and
     `[cluster] directory` pointing at it, no static peers); at each size:
     - discovery: the time until every daemon knows every other;
     - the new daemons' producers put encoder-cache entries (EncoderMeta: registered in the
       directory), bytes derived from the key so any copy anywhere can be checked; Redis's own
       command counter gives the directory's commands per put;
     - fetch latency: a consumer on node A fetches a key only node B holds, with no peer named
       (one directory lookup, then the transfer), paired with a fetch of a sibling key naming B
       (no lookup) taken right beside it: the median of the per-sample ratios, and the medians;
     - the idle load: directory commands per daemon per second over an idle window;
  3. churn: a tenth of the daemons SIGKILLed while consumers keep fetching, restarted later (they
     adopt their pools and register again): the time until each killed node leaves the live set
     (the directory's TTL), fetch outcomes during the churn, and every fetched byte checked.
Zero wrong bytes is asserted; everything else is reported (`--json PATH` writes it).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import redis
import torch

from bench_daemon import BenchDaemon, write_results
from ecd.client.client import Client
from ecd.daemon.peer import directory_store
from ecd.protocol import EncoderMeta

ITEM_BYTES = 64 << 10
PREFIX = "ecdbench"


_TAKEN: set[int] = set()  # ports handed to a node already (each keeps its own across restarts)


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _TAKEN:
            _TAKEN.add(port)
            return port


def item_bytes(key: str) -> torch.Tensor:
    """The bytes every copy of `key` must have: a BLAKE2b stream of the key."""
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return torch.frombuffer(bytearray(seed * (ITEM_BYTES // len(seed))), dtype=torch.uint8)


def start_redis(workdir: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", workdir, "--protected-mode", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis(port=port)
    for _ in range(200):
        try:
            r.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


class FleetNode:
    """One daemon of the fleet: its config, its process (restartable on the same name and port)."""

    def __init__(self, index: int, root: str, redis_port: int, ttl: float, pool: str) -> None:
        self.index = index
        self.workdir = os.path.join(root, f"n{index:02d}")
        os.makedirs(self.workdir, exist_ok=True)
        self.listen = f"tcp://127.0.0.1:{free_port()}"
        self.extra = (f'\n[cluster]\nlisten = "{self.listen}"\ndata_listen = "tcp://127.0.0.1:{free_port()}"\n'
                      f'insecure = true\n'
                      f'directory = "redis://127.0.0.1:{redis_port}/0"\ndirectory_prefix = "{PREFIX}"\n'
                      f'directory_ttl = "{ttl}s"\n')
        self.pool = pool
        self.daemon: BenchDaemon | None = None
        self.client: Client | None = None
        self.keys: list[str] = []

    @property
    def node(self) -> str:
        assert self.daemon is not None
        return self.daemon.node

    def start(self) -> None:
        self.daemon = BenchDaemon(self.workdir, node_prefix=f"fleet{self.index:02d}-", pool=self.pool,
                                  metrics="", extra=self.extra)

    def connect(self) -> Client:
        assert self.daemon is not None
        self.client = self.daemon.connect(namespace="mm", name=f"fleet-{self.index}", wait_s=120)
        return self.client

    def kill(self) -> None:
        assert self.daemon is not None
        if self.client is not None:
            self.client.close()
            self.client = None
        self.daemon.proc.kill()
        self.daemon.proc.wait()

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.daemon is not None:
            self.daemon.stop()

    def peers_up(self) -> int:
        assert self.client is not None
        return sum(1 for p in self.client.stats()["peers"] if p["state"] == "up")


def live_nodes(r: redis.Redis) -> set[str]:
    """The directory's live set, as a router would read it (members whose expiry, on Redis's
    clock, is ahead)."""
    return {n.decode() if isinstance(n, bytes) else n for n in directory_store.live_nodes(r, PREFIX)}


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start


def commands(r: redis.Redis) -> int:
    return int(r.info("stats")["total_commands_processed"])


def fetch_checked(consumer: FleetNode, key: str, peer: str | None, wrong: list[str]) -> tuple[bool, float]:
    """One fetch into `consumer` (timed), then its bytes read back and compared; the key is
    deleted there afterwards so that the next sample fetches again."""
    c = consumer.client
    assert c is not None
    t0 = time.perf_counter()
    ok = c.fetch(key, peer=peer, timeout=10.0)
    elapsed = time.perf_counter() - t0
    if ok:
        got = c.get(key)
        if got is None or not torch.equal(got.view(torch.uint8).flatten(), item_bytes(key)):
            wrong.append(key)
        c.delete(key)
    return bool(ok), elapsed


def fill(nodes: list[FleetNode], per_node: int) -> None:
    for n in nodes:
        assert n.client is not None
        n.keys = [f"img-{n.index}-{j}" for j in range(per_node)]
        items = {k: item_bytes(k) for k in n.keys}
        n.client.put_many(items, meta={k: EncoderMeta(num_tokens=ITEM_BYTES) for k in items})


def measure_fetches(nodes: list[FleetNode], samples: int, wrong: list[str], rng: random.Random) -> dict:
    """Fetch by lookup vs fetch naming the owner, alternating, each sample paired with its
    reference taken right beside it."""
    ratios, lookup_s, named_s, failures = [], [], [], 0
    for i in range(samples):
        owner, consumer = rng.sample(nodes, 2)
        key, sibling = rng.sample(owner.keys, 2)
        order = [("lookup", key, None), ("named", sibling, owner.listen)]
        if i % 2:
            order.reverse()
        timed = {}
        for what, k, peer in order:
            ok, elapsed = fetch_checked(consumer, k, peer, wrong)
            failures += not ok
            timed[what] = elapsed
        lookup_s.append(timed["lookup"])
        named_s.append(timed["named"])
        ratios.append(timed["lookup"] / timed["named"])
    return {"samples": samples, "lookup_ms_p50": 1e3 * statistics.median(lookup_s),
            "named_ms_p50": 1e3 * statistics.median(named_s), "lookup_over_named_p50": statistics.median(ratios),
            "failures": failures}


def churn(nodes: list[FleetNode], r: redis.Redis, rounds: int, wrong: list[str], rng: random.Random,
          ttl: float) -> dict:
    """Kill a tenth of the fleet, keep fetching from the survivors' view, watch the dead drop out
    of the directory, restart them (adopting their pools), and see them found again."""
    victims = rng.sample(nodes, max(1, len(nodes) // 10))
    survivors = [n for n in nodes if n not in victims]
    killed_at = {}
    for v in victims:
        v.kill()
        killed_at[v.node] = time.monotonic()
    outcomes = {"ok": 0, "failed": 0}
    dropped_after: dict[str, float] = {}
    deadline = time.monotonic() + 4 * ttl + 10
    while len(dropped_after) < len(victims) and time.monotonic() < deadline:
        live = live_nodes(r)
        for v in victims:
            if v.node not in live and v.node not in dropped_after:
                dropped_after[v.node] = time.monotonic() - killed_at[v.node]
        owner, consumer = rng.sample(nodes, 1)[0], rng.choice(survivors)
        if owner is not consumer and owner.keys:
            ok, _ = fetch_checked(consumer, rng.choice(owner.keys), None, wrong)
            outcomes["ok" if ok else "failed"] += 1
    for v in victims:
        v.start()
    for v in victims:
        v.connect()
    try:
        rejoin = wait_until(lambda: all(v.node in live_nodes(r) for v in victims), 60, "the restarted nodes")
    except RuntimeError:
        for v in victims:
            assert v.daemon is not None
            print(f"{v.node} (live: {v.node in live_nodes(r)}):\n{v.daemon.log_tail()}", file=sys.stderr)
        raise
    after = measure_fetches(nodes, rounds, wrong, rng)
    return {"killed": len(victims), "drop_out_s": sorted(dropped_after.values()),
            "drop_out_s_max": max(dropped_after.values(), default=float("nan")),
            "not_dropped": len(victims) - len(dropped_after), "fetches_during_churn": outcomes,
            "rejoin_s": rejoin, "fetches_after_rejoin": after}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--daemons", type=int, default=32)
    ap.add_argument("--sizes", default="4,8,16,32", help="fleet sizes to measure fetch latency at")
    ap.add_argument("--per-node", type=int, default=32, help="encoder entries each node puts")
    ap.add_argument("--samples", type=int, default=40, help="paired fetch samples per fleet size")
    ap.add_argument("--ttl", type=float, default=3.0, help="[cluster] directory_ttl")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of the idle load window")
    ap.add_argument("--pool", default="16MiB")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        print("redis-server is not installed (Debian: apt-get install redis-server)", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    sizes = sorted({min(int(s), args.daemons) for s in args.sizes.split(",")})
    root = tempfile.mkdtemp(prefix="ecd-fleet-")
    rproc, rport = start_redis(root)
    r = redis.Redis(port=rport)
    nodes = [FleetNode(i, root, rport, args.ttl, args.pool) for i in range(args.daemons)]
    wrong: list[str] = []
    results: dict = {"daemons": args.daemons, "ttl_s": args.ttl, "item_bytes": ITEM_BYTES,
                     "by_size": {}, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}
    try:
        running = 0
        for size in sizes:  # the fleet grows: the first `size` nodes are up at each step
            for n in nodes[running:size]:
                n.start()
            for n in nodes[running:size]:
                n.connect()
            fleet = nodes[:size]
            t0 = time.monotonic()
            wait_until(lambda f=fleet: all(n.peers_up() >= len(f) - 1 for n in f), 120, "discovery", 0.2)
            step: dict = {"discovery_s": time.monotonic() - t0}
            before = commands(r)
            fill(nodes[running:size], args.per_node)
            step["commands_per_put"] = (commands(r) - before) / ((size - running) * args.per_node)
            running = size
            step.update(measure_fetches(fleet, args.samples, wrong, rng))
            before = commands(r)
            time.sleep(args.idle)
            step["idle_commands_per_daemon_s"] = (commands(r) - before) / args.idle / size
            results["by_size"][size] = step
            print(f"n={size:3d}  discovery {step['discovery_s']:.2f} s  fetch by lookup p50 "
                  f"{step['lookup_ms_p50']:.2f} ms, naming the owner {step['named_ms_p50']:.2f} ms, "
                  f"ratio {step['lookup_over_named_p50']:.2f}  directory: "
                  f"{step['idle_commands_per_daemon_s']:.2f} cmd/s per idle daemon, "
                  f"{step['commands_per_put']:.2f} cmd per put", flush=True)
        results["churn"] = churn(nodes, r, args.samples, wrong, rng, args.ttl)
        results["wrong_bytes_keys"] = wrong
        results["loadavg_end"] = os.getloadavg()[0]
    finally:
        for n in nodes:
            n.stop()
        rproc.terminate()
        rproc.wait()
        shutil.rmtree(root, ignore_errors=True)
    c = results["churn"]
    print(f"churn: {c['killed']} killed; dropped out of the directory after {c['drop_out_s']} s "
          f"(ttl {args.ttl} s); fetches during churn {c['fetches_during_churn']}; rejoined in {c['rejoin_s']:.2f} s")
    print(f"wrong bytes: {len(wrong)} keys")
    if args.json:
        write_results(args.json, results)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
