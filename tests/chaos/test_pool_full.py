"""A pool full of leased entries: PoolFull with a clear message, no deadlock, normal service once
the leases return."""
from __future__ import annotations

import re
import time

import pytest

import ecd
from chaos_worker import payload
from conftest import wait_for
from invariants import assert_healthy, serving_worker

A, B, C = "a#1000000", "b#1000000", "c#500000"  # 4 + 4 MB in an 8 MiB pool; C needs 2 MB more


@pytest.fixture
def small(daemon_factory):
    return daemon_factory(size="8MiB")


def test_pool_full_when_every_entry_is_leased(small):
    with small.client() as c, small.client() as other:
        c.put(A, payload(A))
        c.put(B, payload(B))
        with c.view(A), c.view(B):
            with pytest.raises(ecd.PoolFull, match="leased"):
                other.put(C, payload(C))
            assert other.exists([A, B, C]) == [True, True, False]
        c.ping()  # releases are fire-and-forget: anything after them on c's connection follows them
        other.put(C, payload(C))  # leases returned: eviction makes room again
        assert other.exists(C) is True
        assert other.get(C).equal(payload(C))
    assert_healthy(small)


def test_leased_full_pool_with_a_parked_waiter_does_not_deadlock(small):
    with small.client() as c:
        c.put(A, payload(A))
        c.put(B, payload(B))
    holders = [serving_worker(small.endpoint) for _ in range(2)]  # other processes hold views
    assert holders[0].ask(f"view-hold {A}") == "ok"
    assert holders[1].ask(f"view-hold {B}") == "ok"
    waiter = serving_worker(small.endpoint)
    waiter.send(f"get {C} 60")  # parked until someone manages to put C
    with small.client() as other:
        assert wait_for(lambda: other.stats()["waiters"] == 1, timeout=10.0)
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(ecd.PoolFull) as info:
                other.put(C, payload(C))
            assert time.monotonic() - started < 5.0  # refused, not queued behind the leases
        message = str(info.value)
        assert re.search(r"no room for 2000000 bytes: \d+ of 8388608 bytes in use", message), message
        assert re.search(r"\(\d+ bytes held: 2 entries leased or pinned", message), message
        # The daemon still answers everything else.
        assert other.ping() > 0
        stats = other.stats()
        assert stats["read_leases"] == 2 and stats["waiters"] == 1 and stats["entries_writing"] == 0
        assert other.exists([A, B]) == [True, True]
        assert other.get(A).equal(payload(A))  # a third reader is fine
        # Leases come back: the next put evicts and the parked waiter gets exactly C.
        for h in holders:
            assert h.ask("drop") == "ok"
        other.put(C, payload(C))
        assert waiter.read() == "ok"
    for w in holders + [waiter]:
        w.send("quit")
        w.proc.wait(30)
    assert_healthy(small)
