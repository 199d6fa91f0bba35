"""Fetch between real daemons: bit-identical bytes from a named peer and from configured peers,
absent keys, pull-once under concurrency."""
from __future__ import annotations


import pytest
import torch
from peerutil import cluster  # noqa: F401 - the fixture
from peerutil import fetch_concurrently, leases_back

from conftest import wait_for
from ecd.errors import InvalidRequest


def test_fetch_from_named_peer_is_bit_identical(cluster):
    a, b = cluster(2)
    tensors = {
        "f32": torch.randn(1000, 37),
        "bf16": torch.randn(4096, 17).to(torch.bfloat16),
        "i64": torch.randint(-2**62, 2**62, (333,), dtype=torch.int64),
        "u8": torch.randint(0, 256, (5 << 20,), dtype=torch.uint8),
        "empty": torch.empty(0, 4),
    }
    with a.client() as ca, b.client() as cb:
        for key, t in tensors.items():
            ca.put(key, t)
        keys = list(tensors) + ["absent"]
        assert cb.fetch(keys, peer=a.peer_endpoint, timeout=20) == [True] * len(tensors) + [False]
        for key, t in tensors.items():
            got = cb.get(key)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8) if got.numel() else got, t.view(torch.uint8) if t.numel() else t)
        # already local counts; by node name too
        node = cb.stats()["peers"][0]["node"]
        assert node == a.node
        assert cb.fetch(["f32", "absent"], peer=a.node, timeout=10) == [True, False]
        assert leases_back(ca), ca.stats()
        sb = cb.stats()
        # a names b once its own link to b has shaken hands (b may have started after a)
        served = wait_for(lambda: {p["node"]: p for p in ca.stats()["peers"]}.get(b.node), timeout=15)
    assert sb["entries_writing"] == 0 and sb["fetches_in_flight"] == 0
    assert served["served_entries"] == len(tensors)


def test_fetch_from_configured_peers_first_holder_wins(cluster):
    a, b, c = cluster(3)
    with a.client() as ca, b.client() as cb, c.client() as cc:
        ca.put("only-a", torch.arange(100, dtype=torch.float64))
        cb.put("only-b", torch.arange(50, dtype=torch.int32))
        ca.put("both", torch.ones(10))
        cb.put("both", torch.ones(10))
        assert cc.fetch(["only-a", "only-b", "both", "nowhere"], timeout=20) == [True, True, True, False]
        assert torch.equal(cc.get("only-a"), torch.arange(100, dtype=torch.float64))
        assert torch.equal(cc.get("only-b"), torch.arange(50, dtype=torch.int32))
        # the loser's lease on "both" was given back
        for client in (ca, cb):
            assert leases_back(client), client.stats()


def test_large_entry_over_64mib(cluster):
    a, b = cluster(2, size="320MiB")
    big = torch.randint(0, 256, (80 << 20,), dtype=torch.uint8)  # 80 MiB
    with a.client() as ca, b.client() as cb:
        ca.put("big", big, checksum=True)  # the puller verifies it, and keeps it for its readers
        assert cb.fetch("big", peer=a.peer_endpoint, timeout=60) is True
        assert torch.equal(cb.get("big", verify=True), big)


def test_concurrent_fetches_of_one_key_pull_once(cluster):
    a, b = cluster(2)
    with a.client() as ca:
        ca.put("hot", torch.randn(4 << 20))  # 16 MiB
    results = fetch_concurrently(b, "hot", a.peer_endpoint)
    assert results == [True] * 6
    with a.client() as ca:
        assert leases_back(ca), ca.stats()  # the owner counts a send when it ends, after the fetch returned
        # a names b once its own link to b has shaken hands (b may have started after a: a's first
        # hello to it then went unanswered, and a tries again a moment later)
        served = wait_for(lambda: {p["node"]: p for p in ca.stats()["peers"]}.get(b.node), timeout=15)
        assert served and served["served_entries"] == 1, ca.stats()["peers"]


def test_fetch_errors(cluster, daemon):
    a, b = cluster(2)
    with b.client() as cb:
        with pytest.raises(InvalidRequest, match="no known peer is node"):
            cb.fetch("x", peer="no-such-node")
        with pytest.raises(InvalidRequest, match="tcp://HOST:PORT"):
            cb.fetch("x", peer="tcp://nonsense")
    with daemon.client() as c:  # no [cluster]
        with pytest.raises(InvalidRequest, match="no peer plane"):
            c.fetch("x")


def test_a_key_on_the_pullers_own_disk_tier_is_local(cluster, tmp_path):
    """After a restart its persisted entries are on disk only: a fetch counts them as local (a
    read brings them back) and asks no peer for them."""
    disk = tmp_path / "disk"
    disk.mkdir()
    # a cold restart ([restart] adopt = false): the host pool forgets, the disk tier does not
    a, b = cluster(2, other=["", f'[pool.disk]\npath = "{disk}"\nsize = "256MiB"\n[restart]\nadopt = false\n'])
    t = torch.arange(1 << 16, dtype=torch.float32)
    with b.client() as cb:
        cb.put("kept", t, persist=True)
    b.stop()
    b.start()
    with a.client() as ca, b.client() as cb:
        assert cb.stats()["entries_ready"] == 0  # on disk only
        assert cb.fetch(["kept", "nowhere"], peer=a.peer_endpoint, timeout=10) == [True, False]
        assert torch.equal(cb.get("kept"), t)  # promoted from the disk, not pulled
        assert all(p["fetched_entries"] == 0 for p in cb.stats()["peers"]), cb.stats()["peers"]
        assert ca.stats()["transfer_leases"] == 0
