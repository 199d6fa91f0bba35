#!/usr/bin/env python3
"""Tenants' sizes (issue 44, item 4): what tenant A at its size costs tenant B, and what being a
tenant costs at all. Run as root: A and B are client processes of other uids (they drop root
after their imports), each its daemon's tenant by uid.

  1. fairness: tenant B times its 64 KiB put (wait=True) and get, window by window, while tenant
     A is idle and while A puts 1 MiB entries at three times its size (every put evicts A's own
     oldest), at full speed and held to --rate puts/s; each busy window's p50 is divided by the
     idle window's beside it (the order swapped every round), medians of those ratios. B's
     entries are checked intact after, A's bytes held at most its size.
  2. the tenant path: B's same put + get against a twin daemon without [tenants] (B admitted by
     allowed_uids), windows interleaved: p50 with tenants / p50 without.

On a 2-vCPU machine A at full speed takes a CPU and a share of the daemon's loop: that is the
CPU's cost, not the pool's; the rate-held run shows what is left of it.

  python benchmarks/bench_tenants.py [--rounds 12] [--window 300] [--rate 100] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from bench_copy import cpu_name
from bench_core import child_starter
from bench_daemon import BenchDaemon, write_results

A_UID, B_UID = 4242, 4343
MIB = 1 << 20
SMALL = 16 << 10  # float32 elements: B's 64 KiB entries
SIZE_MIB = 64  # each tenant's size in a 256 MiB pool
B_KEYS = 32


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _tenant_b(endpoint: str, conn) -> None:
    """B: on ("window", n), n rounds of a put of a 64 KiB entry (wait=True) and a get of it, over
    B_KEYS keys; answers the p50 of each (ns). On ("check",): whether every key holds its bytes."""
    from ecd.client.client import Client
    _drop_to(B_UID)
    with Client(endpoint, "kv", timeout=30, name="tenant-b") as c:
        values = [torch.full((SMALL,), float(i)) for i in range(B_KEYS)]
        conn.send(c.welcome.tenant)
        while (ask := conn.recv()) is not None:
            if ask[0] == "check":
                conn.send(all(torch.equal(c.get(f"b{i}"), values[i]) for i in range(B_KEYS)))
                continue
            puts, gets = [], []
            for i in range(ask[1]):
                key, value = f"b{i % B_KEYS}", values[i % B_KEYS]
                t0 = time.perf_counter_ns()
                c.put(key, value)
                t1 = time.perf_counter_ns()
                c.get(key)
                gets.append(time.perf_counter_ns() - t1)
                puts.append(t1 - t0)
            conn.send((statistics.median(puts), statistics.median(gets)))


def _tenant_a(endpoint: str, rate: float, conn) -> None:
    """A: on "go", 1 MiB puts (wait=False, a flush every 16) over 3 x its size in keys, at most
    `rate` a second (0: as fast as it can), until the next message; answers how many it made
    and how many of its entries the daemon holds."""
    from ecd.client.client import Client
    _drop_to(A_UID)
    with Client(endpoint, "kv", timeout=30, name="tenant-a") as c:
        value = torch.ones(MIB // 4)
        conn.send(c.welcome.tenant)
        made = 0
        while conn.recv() == "go":
            start, n = time.monotonic(), 0
            while not conn.poll():
                c.put(f"a{made % (3 * SIZE_MIB)}", value, wait=False)
                made, n = made + 1, n + 1
                if made % 16 == 0:
                    c.flush()
                if rate:
                    time.sleep(max(0.0, start + n / rate - time.monotonic()))
            conn.recv()  # "stop"
            c.flush()
            conn.send((made, c.keys("kv")[0]))


def _daemon(workdir: str, tenants: bool) -> BenchDaemon:
    """A daemon of A and B, as tenants with a size each, or admitted by allowed_uids only."""
    os.makedirs(workdir)
    os.chmod(workdir, 0o755)  # the tenants' uids reach the runtime dir below (its ACL entries)
    extra = (f'\n[tenants.team-a]\nuids = [{A_UID}]\nsize = "{SIZE_MIB}MiB"\n'
             f'[tenants.team-b]\nuids = [{B_UID}]\nsize = "{SIZE_MIB}MiB"\n') if tenants else ""
    return BenchDaemon(workdir, "bt" if tenants else "bn", pool=f"{4 * SIZE_MIB}MiB", extra=extra,
                       control=f"allowed_uids = [{A_UID}, {B_UID}]")


def _p50s(b, window: int) -> tuple[float, float]:
    b.send(("window", window))
    return b.recv()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--window", type=int, default=300, help="B's put+get pairs per window")
    parser.add_argument("--rate", type=float, default=100.0, help="A's held rate, 1 MiB puts/s")
    parser.add_argument("--json", default="", help="write the results here ('-': stdout)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: tenants A and B are processes of other uids")
    procs: list = []
    start = child_starter(procs)
    res: dict = {"cpu": cpu_name(), "rounds": args.rounds, "window": args.window, "rate": args.rate}
    with tempfile.TemporaryDirectory(prefix="ecd-bt-") as work:
        os.chmod(work, 0o755)
        daemons = [_daemon(f"{work}/t", True), _daemon(f"{work}/n", False)]
        try:
            for d in daemons:
                d.connect().close()
            tenants, plain = daemons
            b, b_plain = start(_tenant_b, tenants.endpoint), start(_tenant_b, plain.endpoint)
            a_full, a_held = start(_tenant_a, tenants.endpoint, 0.0), start(_tenant_a, tenants.endpoint, args.rate)
            said = (b.recv(), b_plain.recv(), a_full.recv(), a_held.recv())
            assert said == ("team-b", "", "team-a", "team-a"), said
            _p50s(b, args.window), _p50s(b_plain, args.window)  # warm: B's entries stored, located
            ratios: dict[str, list[float]] = {k: [] for k in ("full_put", "full_get", "held_put", "held_get",
                                                              "tenant_put", "tenant_get")}
            made: dict[str, tuple[int, int]] = {}
            for r in range(args.rounds):
                for name, a in (("full", a_full), ("held", a_held)):
                    windows = {}
                    for busy in ((False, True) if r % 2 else (True, False)):
                        if busy:
                            a.send("go")
                            time.sleep(0.2)  # A at its size before B's window starts
                        windows[busy] = _p50s(b, args.window)
                        if busy:
                            a.send("stop")
                            made[name] = a.recv()
                    ratios[f"{name}_put"].append(windows[True][0] / windows[False][0])
                    ratios[f"{name}_get"].append(windows[True][1] / windows[False][1])
                pair = {tenant: _p50s(client, args.window)
                        for tenant, client in ((True, b), (False, b_plain))[::1 if r % 2 else -1]}
                ratios["tenant_put"].append(pair[True][0] / pair[False][0])
                ratios["tenant_get"].append(pair[True][1] / pair[False][1])
                res["b_put_p50_us"], res["b_get_p50_us"] = pair[True][0] / 1e3, pair[True][1] / 1e3
            b.send(("check",))
            res["b_intact"] = b.recv()
            res["a_puts"] = {name: n for name, (n, _) in made.items()}
            res["a_entries_held"] = max(held for _, held in made.values())
            for conn in (b, b_plain, a_full, a_held):
                conn.send(None)
        finally:
            for d in daemons:
                d.stop()
            for p in procs:
                p.join(10)
    res.update({k: statistics.median(v) for k, v in ratios.items()})
    print(f"CPU: {res['cpu']}; {args.rounds} rounds of {args.window} put+get pairs (64 KiB) by tenant B")
    print(f"  B's put / get p50 with tenants: {res['b_put_p50_us']:.0f} / {res['b_get_p50_us']:.0f} us")
    for name, what in (("full", "A at 3x its size, full speed"), ("held", f"A at 3x its size, {args.rate:g} puts/s")):
        print(f"  {what}: B's put p50 x{res[name + '_put']:.2f}, get p50 x{res[name + '_get']:.2f} "
              f"(busy / idle, median of paired windows)")
    print(f"  tenants vs none: B's put p50 x{res['tenant_put']:.2f}, get p50 x{res['tenant_get']:.2f}")
    print(f"  B's entries intact: {res['b_intact']}; A's entries held: {res['a_entries_held']} "
          f"(size {SIZE_MIB} x 1 MiB); A's puts: {res['a_puts']}")
    if args.json:
        write_results(args.json, res)


if __name__ == "__main__":
    main()
