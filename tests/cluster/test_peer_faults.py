"""Peers that die or stop: a failed fetch leaves nothing half visible and no lease, write or
token behind, on either side, and never stalls the puller's other clients."""
from __future__ import annotations

import signal
import time

import pytest
import torch
from peerutil import BIG_KEYS as KEYS
from peerutil import cluster  # noqa: F401 - the fixture
from peerutil import fetch_in_thread, leases_back, put_big

from conftest import OPEN_POOL, REPO, pool_target, wait_for
from ecd.errors import DaemonUnavailable, KeyNotFound

def test_owner_killed_mid_fetch(cluster):
    a, b = cluster(2, size="1GiB")
    with a.client() as ca:
        put_big(ca)
    with b.client() as watcher:
        thread, out = fetch_in_thread(b, a.peer_endpoint, timeout=20)
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
        put_big(ca)
        thread, out = fetch_in_thread(b, a.peer_endpoint, timeout=8, client_timeout=3)
        assert wait_for(lambda: ca.stats()["transfer_leases"] > 0, timeout=30, interval=0.005)
        b.stop(signal.SIGKILL)
        # the data connection breaks (or the session goes silent: peer_ttl = 3 s)
        assert leases_back(ca, timeout=20), ca.stats()
        # evictable again: a delete frees the bytes at once (no reader left)
        assert ca.delete(KEYS) == [True] * len(KEYS)
        s = ca.stats()
        assert s["used_bytes"] - s["reserved_bytes"] == 0 and s["entries_retired"] == 0, s
    # The killed daemon's client gives up within its own timeout, never hangs; and no client
    # thread may outlive the test (pyzmq torn down under it at exit aborts the process).
    thread.join(60)
    assert not thread.is_alive(), "the client of the killed puller hung"
    assert isinstance(out.get("error"), DaemonUnavailable), out


@pytest.mark.timing
def test_stopped_peer_does_not_stall_other_clients(cluster):
    a, b = cluster(2)
    with a.client() as ca:
        ca.put("k", torch.ones(1000))
    a.proc.send_signal(signal.SIGSTOP)
    try:
        with b.client() as cb:
            thread, out = fetch_in_thread(b, a.peer_endpoint, timeout=5)
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


VANDAL = OPEN_POOL + """
import os, sys
fd = open_pool(sys.argv[1])
at = int(sys.argv[2])
os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, 4, at)), at)
os.close(fd)
"""


def test_bytes_that_do_not_match_the_owners_checksum_are_never_committed(cluster):
    """The owner's bytes changed behind its back (a bit flip in its pool, as a bad link would
    change them in transit): the puller checks what arrived against the owner's xxh3, drops it,
    counts it; nothing is visible on the puller and the owner's leases come back."""
    import subprocess
    import sys

    from conftest import metric_by_label, scrape_metrics
    from ecd.protocol import Acquire, Location, Release
    a, b = cluster(2)
    t = torch.randn(1 << 16)
    with a.client() as ca, b.client() as cb:
        ca.put("flipped", t, checksum=True)
        ca.put("intact", t + 1, checksum=True)
        (loc,) = ca.request(Acquire(0, ca.namespace, ["flipped"], 0.0)).results
        assert isinstance(loc, Location) and loc.checksum
        ca.request(Release(0, [loc.generation]))
        subprocess.run([sys.executable, "-c", VANDAL, pool_target(ca, loc.pool), str(loc.offset + 4096)],
                       check=True, timeout=60, cwd=REPO)

        outcomes = cb.fetch_detailed(["flipped", "intact"], peer=a.peer_endpoint, timeout=20)
        assert [(bool(o), o.reason) for o in outcomes] == [(False, "checksum"), (True, "")], outcomes
        assert cb.exists("flipped") is False
        with pytest.raises(KeyNotFound):
            cb.get("flipped", timeout=0)
        assert torch.equal(cb.get("intact"), t + 1)
        failures = metric_by_label(scrape_metrics(b.metrics_port), "ecd_transfer_failures_total", "reason")
        assert failures.get("checksum") == 1, failures
        sb = cb.stats()
        assert sb["entries_writing"] == 0 and sb["entries_ready"] == 1 and sb["fetches_in_flight"] == 0
        assert wait_for(lambda: ca.stats()["transfer_leases"] == 0, timeout=10), ca.stats()
        assert "bytes do not match the owner's checksum" in b.log()


def test_fetch_through_a_tcp_control_endpoint(cluster):
    """A client on the puller's node that talks to its daemon over tcp (not ipc) fetches the
    same way: Fetch is a control request, the bytes land in the daemon's pool."""
    from peerutil import free_port
    a, b = cluster(2, peers=True)
    b.stop()
    tcp = f"tcp://127.0.0.1:{free_port()}"
    b.config.write_text(b.config.read_text().replace(f'endpoint = "{b.endpoint}"', f'endpoint = "{tcp}"'))
    b.endpoint = tcp
    b.start()
    t = torch.arange(1 << 18, dtype=torch.int32)
    with a.client() as ca, b.client() as cb:
        ca.put("k", t)
        assert cb.fetch(["k", "nope"], peer=a.peer_endpoint, timeout=20) == [True, False]
        assert torch.equal(cb.get("k"), t)
        assert cb.stats()["entries_ready"] == 1
