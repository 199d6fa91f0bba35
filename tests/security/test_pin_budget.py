"""Pins cannot starve other namespaces (issue 40, attack 5). A client that keeps re-pinning every key
of every namespace made another namespace's new 1 MiB puts fail 16 of 20 times, and a namespace
with `guaranteed = "8MiB"` that held nothing got 0 of 10 (PoolFull): its own 4 MiB quota limited
nothing. Now pinned entries may hold at most `[limits] pinned_share` of the pool, less what the
guaranteed shares still lack; a pin past it is not taken and that key answers "not found". The
attacker is a real process that lists every key (an operator's `keys`) and pins them in a loop.
"""
from __future__ import annotations

import subprocess
import sys

import torch

from conftest import REPO
from secutil import metric

MiB = 1 << 20
NAMESPACES = """
[namespaces.mean]
quota = "4MiB"
[namespaces.reserved]
guaranteed = "8MiB"
"""

PINNER = r"""
import sys, time
from ecd import ControlClient
endpoint = sys.argv[1]
clients = {}
rounds = 0
while True:
    _, entries = ControlClient(endpoint, timeout=10).keys(limit=100000)
    by_ns = {}
    for e in entries:
        by_ns.setdefault(e["ns"], []).append(e["key"])
    for ns, keys in by_ns.items():
        c = clients.get(ns) or clients.setdefault(ns, ControlClient(endpoint, namespace=ns, timeout=10))
        c.exists(keys, pin_s=600)
    rounds += 1
    if rounds == 2:
        print("pinning", flush=True)
    time.sleep(0.05)
"""


def test_a_pinner_of_every_key_leaves_room_for_puts_and_guaranteed_shares(daemon_factory):
    d = daemon_factory(size="64MiB", extra=NAMESPACES)
    block = torch.ones(MiB, dtype=torch.uint8)
    with d.client(namespace="victim") as victim:
        for i in range(60):  # the pool, full of another namespace's entries
            victim.put(f"old-{i}", block)
        pinner = subprocess.Popen([sys.executable, "-c", PINNER, d.endpoint], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            assert pinner.stdout.readline().strip() == "pinning", pinner.stderr.read()
            failures = []
            for i in range(20):  # while every key it sees is being pinned again and again
                try:
                    victim.put(f"new-{i}", block)
                except Exception as exc:  # noqa: BLE001 - counted, and the first reasons shown
                    failures.append(repr(exc))
            assert failures == [], f"{len(failures)} of 20 puts failed: {failures[:3]}"
            with d.client(namespace="reserved") as reserved:
                for i in range(8):  # its whole guaranteed share, though it held nothing
                    reserved.put(f"r-{i}", block)
                assert reserved.exists([f"r-{i}" for i in range(8)]) == [True] * 8
            assert pinner.poll() is None, pinner.stderr.read()
            pinned = metric(d, "ecd_pinned_bytes", pool="host", of="held")
            budget = metric(d, "ecd_pinned_bytes", pool="host", of="budget")
            assert 0 < pinned <= budget <= 32 * MiB, (pinned, budget)
            assert metric(d, "ecd_pins_refused_total") > 0
        finally:
            pinner.kill()
            pinner.wait(10)
        # a refused pin says so: the key is there, but a pinned lookup cannot promise it
        with d.client(namespace="victim") as again:
            assert again.exists("new-19") is True
