#!/usr/bin/env python3
"""put + view of 16 MiB across containers against the same on the host, paired.

Across containers: the daemon in its container (the image `make image` builds), a producer and a
consumer in two others, each with its own pid, IPC, mount and network namespaces and a uid other
than the daemon's; only the socket directory is shared (tests/containers/containers_util.py).
On the host: the same daemon code (`python -m ecd serve`, this tree) and the same two client
processes (tests/containers/container_actor.py) as plain host processes.
One sample = the producer's put of a fresh 16 MiB entry + the consumer's zero-copy view of it
(taken and released), each timed inside the client around the call alone. Samples alternate
host/container (the order flips every pair) so the machine's drift hits both alike; the table
quotes the median of the per-pair ratios container/host. Needs root, podman and the image; the
cross-IPC-namespace view needs the pool passed as memfds ([pool.host] backing = "memfd").
`--json PATH` also writes the results.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "containers"))
from bench_daemon import BenchDaemon, write_results  # noqa: E402
from containers_util import ACTOR_CODE, Actor, ContainerNode, probe_features, unavailable_reason  # noqa: E402

MiB = 1 << 20


def host_actor(endpoint: str, label: str) -> Actor:
    # this tree's ecd, as the host daemon runs it
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    actor = Actor([sys.executable, "-c", ACTOR_CODE, endpoint], label, env={"PYTHONPATH": path})
    assert actor.read(timeout=120).get("ready")
    actor.ok("connect 5")
    return actor


def sample(producer: Actor, consumer: Actor, key: str, nbytes: int) -> float:
    put = producer.ok(f"timed-put {key} {nbytes} 7")["seconds"]
    view = consumer.ok(f"timed-view {key}")["seconds"]
    producer.ok(f"delete {key}")
    return put + view


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--size-mib", type=int, default=16)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    reason = unavailable_reason()
    features = probe_features() if reason is None else {}
    if reason is None and features["memfd"] is not None:
        reason = f"a view across IPC namespaces needs the memfd pool: {features['memfd']}"
    if reason is not None:
        print(f"bench_containers: skipped: {reason}")
        return 0
    nbytes = args.size_mib * MiB
    node = ContainerNode(pool="256MiB")
    workdir = tempfile.mkdtemp(prefix="ecd-bench-ctr-", dir="/tmp")
    host = BenchDaemon(workdir, pool="256MiB")
    try:
        node.start_daemon()
        host.connect().close()
        pairs = {"container": (node.client("producer"), node.client("consumer")),
                 "host": (host_actor(host.endpoint, "host-producer"), host_actor(host.endpoint, "host-consumer"))}
        for where, (p, c) in pairs.items():  # warm up: first touches of the pools and the copy paths
            for i in range(3):
                sample(p, c, f"warm-{where}-{i}", nbytes)
        times: dict[str, list[float]] = {"container": [], "host": []}
        ratios = []
        for i in range(args.samples):
            order = ["host", "container"] if i % 2 == 0 else ["container", "host"]
            got = {where: sample(*pairs[where], f"s{i}", nbytes) for where in order}
            for where, seconds in got.items():
                times[where].append(seconds)
            ratios.append(got["container"] / got["host"])
    finally:
        node.close()
        host.stop()
    ratios.sort()
    res = {"size_bytes": nbytes, "samples": args.samples,
           "host_median_ms": statistics.median(times["host"]) * 1e3,
           "container_median_ms": statistics.median(times["container"]) * 1e3,
           "ratio_median": statistics.median(ratios),
           "ratio_p10": ratios[len(ratios) // 10], "ratio_p90": ratios[(len(ratios) * 9) // 10]}
    print(f"put + view of {args.size_mib} MiB, {args.samples} paired samples")
    print(f"  host:       median {res['host_median_ms']:.2f} ms")
    print(f"  containers: median {res['container_median_ms']:.2f} ms")
    print(f"  container/host, per pair: median {res['ratio_median']:.2f} "
          f"(p10 {res['ratio_p10']:.2f}, p90 {res['ratio_p90']:.2f})")
    if args.json:
        write_results(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
