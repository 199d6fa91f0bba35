"""Peers that die or stop: a failed fetch leaves nothing half visible and no lease, write or
token behind, on either side, and never stalls the puller's other clients."""
from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
from peerutil import cluster  # noqa: F401 - the fixture

from conftest import wait_for
from ecd.errors import KeyNotFound

KEYS = [f"blk-{i}" for i in range(8)]


def _put_big(client):
    data = {}
    for i, key in enumerate(KEYS):
        t = torch.full((16 << 20,), i, dtype=torch.float32)  # 64 MiB each
        client.put(key, t, checksum=True)
        data[key] = t
    return data


def _fetch_in_thread(d, peer, timeout):
    out: dict = {}

    def run():
        started = time.monotonic()
        with d.client(timeout=10) as c:
            try:
                out["result"] = c.fetch(KEYS, peer=peer, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                out["error"] = exc
        out["elapsed"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)  # a client of a killed daemon may linger
    thread.start()
    return thread, out


def test_owner_killed_mid_fetch(cluster):
    a, b = cluster(2, size="1GiB")
    with a.client() as ca:
        _put_big(ca)
    with b.client() as watcher:
        thread, out = _fetch_in_thread(b, a.peer_endpoint, timeout=20)
        assert wait_for(lambda: watcher.stats()["entries_writing"] > 0, timeout=30, interval=0.005), \
            "the transfer never started"
        a.stop(signal.SIGKILL)
        thread.join(40)
        assert not thread.is_alive(), "the fetch hung"
        assert out["elapsed"] < 20 + 10
        assert out["result"] == [False] * len(KEYS), out
        for key in KEYS:  # nothing half visible
            with pytest.raises(KeyNotFound):
                watcher.get(key)
        s = watcher.stats()
        assert s["entries_writing"] == 0 and s["read_leases"] == 0 and s["fetches_in_flight"] == 0, s
        assert s["entries_ready"] == 0 and s["used_bytes"] - s["reserved_bytes"] == 0, s
        assert sum(s["fetch_failures"].values()) >= 1
        # the node keeps serving
        watcher.put("after", torch.ones(4))
        assert torch.equal(watcher.get("after"), torch.ones(4))


def test_puller_killed_mid_fetch_gives_the_owners_leases_back(cluster):
    a, b = cluster(2, size="1GiB")
    with a.client() as ca:
        _put_big(ca)
        thread, out = _fetch_in_thread(b, a.peer_endpoint, timeout=20)
        assert wait_for(lambda: ca.stats()["transfer_leases"] > 0, timeout=30, interval=0.005)
        b.stop(signal.SIGKILL)  # its client thread gets DaemonUnavailable later: not waited for
        # the data connection breaks (or the session goes silent: peer_ttl = 3 s)
        assert wait_for(lambda: ca.stats()["transfer_leases"] == 0 and ca.stats()["read_leases"] == 0,
                        timeout=20), ca.stats()
        # evictable again: a delete frees the bytes at once (no reader left)
        assert ca.delete(KEYS) == [True] * len(KEYS)
        s = ca.stats()
        assert s["used_bytes"] - s["reserved_bytes"] == 0 and s["entries_retired"] == 0, s


def test_stopped_peer_does_not_stall_other_clients(cluster):
    a, b = cluster(2)
    with a.client() as ca:
        ca.put("k", torch.ones(1000))
    a.proc.send_signal(signal.SIGSTOP)
    try:
        with b.client() as cb:
            thread, out = _fetch_in_thread(b, a.peer_endpoint, timeout=5)
            worst = 0.0
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                started = time.monotonic()
                cb.ping()
                worst = max(worst, time.monotonic() - started)
                time.sleep(0.05)
            thread.join(20)
            assert not thread.is_alive()
            assert worst < 1.0, f"a ping took {worst:.2f}s while a peer was stopped"
            assert out["result"] == [False] * len(KEYS)
            assert out["elapsed"] < 5 + 5
            peers = {p["endpoint"]: p for p in cb.stats()["peers"]}
            assert peers[a.peer_endpoint]["state"] == "down"
    finally:
        a.proc.send_signal(signal.SIGCONT)
    with b.client() as cb:  # and once it is back, fetches work again
        assert wait_for(lambda: cb.fetch("k", peer=a.peer_endpoint, timeout=5), timeout=20)
