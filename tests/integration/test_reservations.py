"""Same-sized puts reuse a reserved extent: copy first, one Publish round trip, same bytes."""
from __future__ import annotations

import time

import pytest
import torch

from conftest import entry_bytes, metric, metric_by_label, scrape_metrics, wait_for

N = 300_032  # 1.2 MB of float32: above the inline limit, a whole number of 256-byte units


@pytest.fixture
def daemon(daemon_factory):
    """The round-trip route these tests follow (Alloc, Commit, Publish, reservations): a daemon
    without submission pages (`[leases] submit_records = 0`; tests/integration/test_submissions.py
    covers puts without a message)."""
    return daemon_factory(extra="[leases]\nsubmit_records = 0\n")


def test_repeated_same_size_puts_take_one_round_trip_each(daemon, actors):
    consumer = actors(daemon.endpoint)
    with daemon.client() as c:
        for i in range(5):
            g = torch.Generator().manual_seed(100 + i)
            c.put(f"emb-{i}", (torch.randn(N, generator=g) * 100))
        ops = c.stats()["ops"]
        assert ops["alloc"] == 1 and ops["commit"] == 1 and ops["publish"] == 4
        for i in range(5):  # published from a reservation, read by another process: identical
            assert consumer.ask(f"get emb-{i} {100 + i} {N}") == "ok"
        stats = c.stats()
        assert stats["reservations"] == 1 and stats["reserved_bytes"] >= N * 4
        assert entry_bytes(stats) == 5 * N * 4
        body = scrape_metrics(daemon.metrics_port)
        assert metric(body, "ecd_reserved_bytes") == stats["reserved_bytes"]
        outcomes = metric_by_label(body, "ecd_reservations_total", "outcome")
        assert outcomes == {"granted": 5, "refused": 0, "published": 4, "aborted": 0, "expired": 0,
                            "reclaimed": 0}


def test_a_different_size_falls_back_to_alloc_and_drops_the_old_reservation(daemon):
    with daemon.client() as c:
        c.put("a", torch.ones(N))
        c.put("b", torch.ones(2 * N))  # does not fit the reservation: Abort it, Alloc instead
        assert torch.equal(c.get("b"), torch.ones(2 * N))
        stats = c.stats()
        assert stats["ops"]["alloc"] == 2 and stats["ops"]["abort"] == 1
        assert stats["reservations"] == 1 and stats["reserved_bytes"] == 2 * N * 4  # for b's size


def test_an_old_reservation_is_not_used(daemon_factory):
    d = daemon_factory(extra='[leases]\nwrite_ttl = "1s"\n')
    with d.client() as c:
        c.put("x", torch.ones(N))
        time.sleep(0.7)  # past half the write TTL: the client must not trust it any more
        c.put("y", torch.full((N,), 2.0))
        assert torch.equal(c.get("y"), torch.full((N,), 2.0))
        assert torch.equal(c.get("x"), torch.ones(N))
        assert c.stats()["ops"].get("publish", 0) == 0


def test_closing_the_client_frees_its_reservation(daemon):
    with daemon.client() as observer:
        with daemon.client() as c:
            c.put("r", torch.ones(N))
            assert observer.stats()["reservations"] == 1
        # Bye travels on c's own connection: the observer's next request may overtake it.
        stats = wait_for(lambda: (st := observer.stats())["reservations"] == 0 and st)
        assert stats and stats["used_bytes"] == entry_bytes(stats) == N * 4
