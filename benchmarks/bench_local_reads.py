#!/usr/bin/env python3
"""Reads without a round trip (issue 42, client/local_read.py): what a warm get and view cost now.

Starts its own daemon and a bare pyzmq REQ/REP echo process, and measures, interleaved round by
round so that each ratio compares samples taken side by side:
  1. a warm get of a 64 KiB entry (its location known: no request) against one bare round trip,
     and against the same get forced through the daemon (the location forgotten before each);
  2. the same at 16 MiB against a memcpy of 16 MiB into a new tensor (torch.empty + copy_);
  1b. a warm view of it (open and close: read slots, no request), and the same through the daemon;
  1c. a pinned exists of it (a pin slot, client/pins.py), and a pin then unpin, against the
      same through the daemon;
  3. how many requests the daemon handles while another process makes 1000 gets of one key, then
     1000 views, then 1000 pinned exists each followed by an unpin (its stats' per-operation
     counters; the target is <= 1 % of the reads);
  3b. a 16 MiB put here until another process's view of it is open, against a memcpy of 16 MiB;
  4. a 64 KiB hand-off to a consumer already waiting in get(key, timeout=...) in another process,
     from the producer's put start to the consumer's return, after both paused 20 ms (every
     thread on the path must be woken), against a bare round trip; and the producer's put alone
     after the same pause (the floor of that hand-off).
Prints medians of the per-round ratios and PASS/MISS per target; `--json PATH` writes them.
`make bench-local-reads` runs it.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import sys
import tempfile
import time

import torch

from bench_core import _echo_server, bare_socket, child_starter
from bench_daemon import BenchDaemon, write_results
from ecd.client.client import Client

KIB = 1 << 10
ROUNDS, BLOCK = 40, 100
TARGET_WARM_GET_RATIO = 0.5  # warm 64 KiB get <= 0.5 bare round trips
TARGET_REQUESTS_PER_READ = 0.01
TARGET_PINNED_EXISTS_RATIO = 0.2  # pinned exists <= 0.2 bare round trips
TARGET_HANDOFF_RATIO = 1.5  # producer's put start -> waiting consumer's return <= 1.5 round trips
HANDOFF_ROUNDS = 40
TARGET_PUT_VIEW_RATIO = 1.15  # 16 MiB put (process A) + view (process B) <= 1.15 memcpy
READS = 1000


def per_op_ns(fn, n: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - start) / n


def _reader(endpoint: str, key: str, how: str, conn) -> None:
    """Another process: READS gets (or views) of `key` (the first asks the daemon where it is)."""
    with Client(endpoint, timeout=10) as c:
        conn.recv()
        for _ in range(READS):
            if how == "get":
                c.get(key)
            elif how == "pin":
                c.exists(key, pin_s=30)
                c.unpin(key)
            else:
                with c.view(key):
                    pass
        c.ping()  # its batched report of the reads goes before this; then the counters are read
        conn.send("done")
        conn.recv()


def _waiting_consumer(endpoint: str, conn) -> None:
    """Another process: for each key it is sent, says "waiting", waits for it, sends when it
    returned (perf_counter_ns: CLOCK_MONOTONIC, one clock for every process)."""
    with Client(endpoint, timeout=10) as c:
        while True:
            key = conn.recv()
            if key is None:
                return
            conn.send("waiting")
            c.get(key, timeout=10)
            conn.send(time.perf_counter_ns())


def _viewer(endpoint: str, conn) -> None:
    """Another process: views each key it is sent (an entry put just before) and sends the time
    the view was open (perf_counter_ns) and its first element."""
    with Client(endpoint, timeout=10) as c:
        while True:
            key = conn.recv()
            if key is None:
                return
            with c.view(key) as view:
                opened = time.perf_counter_ns()
                conn.send((opened, float(view[0])))


def put_then_view(c: Client, viewer, rounds: int) -> float:
    """Median per-round ratio of (this process's 16 MiB put start -> the viewer's view open) to a
    memcpy of 16 MiB into a new tensor beside it."""
    value = torch.rand(4 * KIB * KIB)
    ratios = []
    for r in range(rounds):
        m = per_op_ns(lambda: torch.empty_like(value).copy_(value), 3)
        value[0] = r
        start = time.perf_counter_ns()
        c.put(f"pv{r % 4}", value)
        viewer.send(f"pv{r % 4}")
        opened, first = viewer.recv()
        assert first == r
        ratios.append((opened - start) / m)
    return round(statistics.median(ratios), 3)


def handoffs(c: Client, consumers: dict, bare, rounds: int) -> dict[str, float]:
    """Median per-round ratio of each consumer's hand-off to a bare round trip beside it."""
    value = torch.arange(16 * KIB, dtype=torch.float32)
    ratios: dict[str, list[float]] = {name: [] for name in [*consumers, "put alone"]}
    for r in range(rounds):
        time.sleep(0.02)  # the floor: the producer's put alone, after the same pause
        start = time.perf_counter_ns()
        c.put(f"p{r}", value)
        ratios["put alone"].append((time.perf_counter_ns() - start) / per_op_ns(bare, 20))
        for name, conn in consumers.items():
            key = f"h{r}-{name}"
            conn.send(key)
            assert conn.recv() == "waiting"
            time.sleep(0.02)  # the consumer is asleep in its get; everyone else idles too
            start = time.perf_counter_ns()
            c.put(key, value)
            took = conn.recv() - start
            ratios[name].append(took / (per_op_ns(bare, 20)))
    return {name: round(statistics.median(values), 3) for name, values in ratios.items()}


def requests_handled(c: Client) -> int:
    return sum(n for op, n in c.stats()["ops"].items() if op != "stats")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    res: dict = {"cpu": platform.processor() or platform.machine()}
    with open("/proc/cpuinfo") as f:
        res["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), res["cpu"])
    procs: list = []
    start = child_starter(procs)
    with tempfile.TemporaryDirectory(prefix="ecd-bench-") as workdir:
        daemon = BenchDaemon(workdir, "benchlr", pool="256MiB")
        try:
            echo_endpoint = f"ipc://{workdir}/echo.sock"
            echo = start(_echo_server, echo_endpoint, "REP")
            assert echo.recv() == "ready"
            ctx, req = bare_socket("REQ", echo_endpoint)
            c = daemon.connect()
            small, large = torch.arange(16 * KIB, dtype=torch.float32), torch.rand(4 * KIB * KIB)
            c.put("k64", small)
            c.put("k16m", large)
            asking = Client(daemon.endpoint, timeout=5, local_reads=False)  # the old route: Acquire, copy, Release

            def bare() -> None:
                req.send(b"x")
                req.recv()

            def through_daemon() -> None:
                asking.get("k64")

            def memcpy_16m() -> None:
                torch.empty_like(large).copy_(large)

            def view_64k(client: Client) -> None:
                with client.view("k64"):
                    pass

            def pin_unpin(client: Client) -> None:
                client.exists("k64", pin_s=30)
                client.unpin("k64")

            for fn in (bare, through_daemon, lambda: c.get("k64"), lambda: view_64k(c), lambda: view_64k(asking),
                       lambda: pin_unpin(c)):
                per_op_ns(fn, 200)  # warm
            warm, asked, copy_ratio, viewed, viewed_asking = [], [], [], [], []
            pinned, pinned_asking, pin_pairs, pin_pairs_asking = [], [], [], []
            for _ in range(ROUNDS):
                b = per_op_ns(bare, BLOCK)
                pinned.append(per_op_ns(lambda: c.exists("k64", pin_s=30), BLOCK) / b)
                pinned_asking.append(per_op_ns(lambda: asking.exists("k64", pin_s=30), BLOCK) / b)
                pin_pairs.append(per_op_ns(lambda: pin_unpin(c), BLOCK) / b)
                pin_pairs_asking.append(per_op_ns(lambda: pin_unpin(asking), BLOCK) / b)
                warm.append(per_op_ns(lambda: c.get("k64"), BLOCK) / b)
                asked.append(per_op_ns(through_daemon, BLOCK) / b)
                viewed.append(per_op_ns(lambda: view_64k(c), BLOCK) / b)
                viewed_asking.append(per_op_ns(lambda: view_64k(asking), BLOCK) / b)
                m = per_op_ns(memcpy_16m, 5)
                copy_ratio.append(per_op_ns(lambda: c.get("k16m"), 5) / m)
            bare_us = per_op_ns(bare, 1000) / 1e3
            res["bare_round_trip_us"] = round(bare_us, 1)
            res["warm_get_64k_vs_round_trip"] = round(statistics.median(warm), 3)
            res["asked_get_64k_vs_round_trip"] = round(statistics.median(asked), 3)
            res["warm_view_64k_vs_round_trip"] = round(statistics.median(viewed), 3)
            res["asked_view_64k_vs_round_trip"] = round(statistics.median(viewed_asking), 3)
            res["warm_get_16m_vs_memcpy"] = round(statistics.median(copy_ratio), 3)
            res["pinned_exists_vs_round_trip"] = round(statistics.median(pinned), 3)
            res["asked_pinned_exists_vs_round_trip"] = round(statistics.median(pinned_asking), 3)
            res["pin_unpin_vs_round_trip"] = round(statistics.median(pin_pairs), 3)
            res["asked_pin_unpin_vs_round_trip"] = round(statistics.median(pin_pairs_asking), 3)
            c.unpin("k64")
            asking.unpin("k64")

            for how in ("get", "view", "pin"):
                reader = start(_reader, daemon.endpoint, "k64", how)
                time.sleep(0.5)  # its session is open (Hello counted before the window)
                before = requests_handled(c)
                reader.send("go")
                assert reader.recv() == "done"
                handled = requests_handled(c) - before - 1  # less the ping that closes the window
                reader.send("bye")
                res[f"requests_per_{how}"] = round(handled / READS, 4)
                res[f"requests_in_{how}_window"] = handled

            viewer = start(_viewer, daemon.endpoint)
            res["put_16m_then_view_vs_memcpy"] = put_then_view(c, viewer, 20)
            viewer.send(None)

            consumers = {"waiting": start(_waiting_consumer, daemon.endpoint)}
            got = handoffs(c, consumers, bare, HANDOFF_ROUNDS)
            for conn in consumers.values():
                conn.send(None)
            res["handoff_64k_vs_round_trip"] = got["waiting"]
            res["put_64k_after_pause_vs_round_trip"] = got["put alone"]
            asking.close()
            c.close()
            req.send(b"stop")
            req.recv()
            req.close(0)
            ctx.term()
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
            rc = daemon.stop()
    res["daemon_exit"] = rc
    print(f"CPU: {res['cpu']}")
    print(f"bare REQ/REP round trip: {res['bare_round_trip_us']} us")
    rows = [("warm 64 KiB get / bare round trip", res["warm_get_64k_vs_round_trip"], TARGET_WARM_GET_RATIO),
            ("64 KiB get through the daemon / bare round trip", res["asked_get_64k_vs_round_trip"], None),
            ("warm 16 MiB get / memcpy into a new tensor", res["warm_get_16m_vs_memcpy"], None),
            ("warm 64 KiB view (open and close) / bare round trip", res["warm_view_64k_vs_round_trip"],
             TARGET_WARM_GET_RATIO),
            ("64 KiB view through the daemon (leases) / bare round trip", res["asked_view_64k_vs_round_trip"], None),
            (f"daemon requests per read ({READS} gets from another process)", res["requests_per_get"],
             TARGET_REQUESTS_PER_READ),
            (f"daemon requests per view ({READS} views from another process)", res["requests_per_view"],
             TARGET_REQUESTS_PER_READ),
            ("pinned 64 KiB exists (a pin slot) / bare round trip", res["pinned_exists_vs_round_trip"],
             TARGET_PINNED_EXISTS_RATIO),
            ("pinned exists through the daemon / bare round trip", res["asked_pinned_exists_vs_round_trip"], None),
            ("pinned exists + unpin (pin slots) / bare round trip", res["pin_unpin_vs_round_trip"], None),
            ("pinned exists + unpin through the daemon / bare round trip", res["asked_pin_unpin_vs_round_trip"], None),
            (f"daemon requests per pin ({READS} pins + unpins from another process)", res["requests_per_pin"],
             TARGET_REQUESTS_PER_READ),
            ("16 MiB put (this process) until another's view is open / memcpy", res["put_16m_then_view_vs_memcpy"],
             TARGET_PUT_VIEW_RATIO),
            ("64 KiB hand-off to a consumer waiting in get(key, timeout) / bare round trip",
             res["handoff_64k_vs_round_trip"], TARGET_HANDOFF_RATIO),
            ("the producer's 64 KiB put alone, after the same pause / bare round trip",
             res["put_64k_after_pause_vs_round_trip"], None)]
    for name, value, target in rows:
        verdict = "" if target is None else ("PASS" if value <= target else "MISS") + f" (target <= {target})"
        print(f"{name:<66} {value:>8}  {verdict}")
    if args.json:
        write_results(args.json, res)
    sys.exit(0 if rc == 0 else 1)


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    main()
