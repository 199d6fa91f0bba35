"""The put route's choices as the daemon sees them (ecd.client.put), and the test-support hooks
of ecd.client.testing that tests use instead of a client's private attributes."""
from __future__ import annotations

import pytest
import torch

from conftest import wait_for
from ecd import Client
from ecd.client.location_cache import LocationCache
from ecd.client.testing import acquire, intercept_round_trips, replace_location_cache
from ecd.errors import Code
from ecd.protocol import Failure, Location

N = 300_032  # 1.2 MB of float32: above the inline limit


@pytest.fixture
def daemon(daemon_factory):
    """The round-trip route these tests follow (Alloc, Commit, Publish, reservations): a daemon
    without submission pages (`[leases] submit_records = 0`; tests/integration/test_submissions.py
    covers puts without a message)."""
    return daemon_factory(extra="[leases]\nsubmit_records = 0\n")


def test_each_put_is_placed_once_then_copied_and_committed(daemon):
    """Inline for a small tensor; Alloc + Commit without a reservation; a lone Publish into the
    reservation the previous commit brought; Alloc + Commit for a batch (the reservation stays)."""
    seen: list[str] = []

    def spy(request, send):
        seen.append(type(request).__name__)
        return send(request)

    with daemon.client() as c:
        with intercept_round_trips(c, spy):
            c.put("small", torch.ones(4))
            c.put("a", torch.ones(N))
            c.put("b", torch.full((N,), 2.0))
            c.put_many({"x": torch.ones(N), "y": torch.zeros(N)})
            c.put("c", torch.full((N,), 3.0))  # the reservation is still there: one round trip
        assert seen == ["PutInline", "Alloc", "Commit", "Publish", "Alloc", "Commit", "Publish"]
        c.put("d", torch.ones(N))  # the interception ended with its block
        assert len(seen) == 7
        for key, value in [("small", 1.0), ("a", 1.0), ("b", 2.0), ("x", 1.0), ("y", 0.0), ("c", 3.0)]:
            assert bool((c.get(key) == value).all())


def test_intercepting_a_class_sees_every_client_of_it_and_can_be_nested(daemon):
    outer: list[str] = []
    inner: list[str] = []

    def record(into):
        def interceptor(request, send):
            into.append(type(request).__name__)
            return send(request)
        return interceptor

    with daemon.client() as a, daemon.client() as b:
        with intercept_round_trips(Client, record(outer)):
            a.ping()
            with intercept_round_trips(b, record(inner)):
                b.ping()
            b.ping()
        a.ping()
    assert outer == ["Ping", "Ping", "Ping"] and inner == ["Ping"]


def test_acquire_holds_read_leases_until_released(daemon):
    with daemon.client() as c:
        c.put("here", torch.ones(N))
        (found, missing), release = acquire(c, ["here", "absent"])
        assert isinstance(found, Location) and found.nbytes == N * 4
        assert isinstance(missing, Failure) and missing.code == Code.KEY_NOT_FOUND
        assert c.stats()["read_leases"] == 1
        release()
        assert wait_for(lambda: c.stats()["read_leases"] == 0)


def test_the_public_read_only_surface(daemon):
    with daemon.client() as c:
        assert c.welcome.epoch == c.epoch and c.session_id == c.welcome.session
        assert c.mapping.local and c.mapping.epoch == c.epoch
        assert not c.heartbeating  # a local ipc client: the daemon watches its pid
        replace_location_cache(c, LocationCache(8))
        c.put("k", torch.ones(N))
        assert len(c.location_cache) == 1
