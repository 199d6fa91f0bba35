"""Reads without a round trip (client/local_read.py), between real processes: what another
process put is located through the ring's entry index and read with no request to the daemon;
what cannot be checked that way (a missing key, a corrupt entry, local_reads=False) takes the
round trip, with the same answers as before."""
from __future__ import annotations

import time

import pytest
import torch

import ecd
from conftest import Actor
from actor import make_tensor
from ecd.client.local_read import REPORT_BATCH, REPORT_EVERY_S
from ecd.protocol import Acquire, Location, Release

NUMEL = 64 * 1024  # 256 KiB of float32: not inline
KEYS = [f"k{i}" for i in range(8)]


def ops(c: ecd.Client) -> dict[str, int]:
    return {op: n for op, n in c.stats()["ops"].items() if op != "stats"}


@pytest.fixture
def produced(daemon):
    """KEYS put by another process (this one never put or read them)."""
    producer = Actor(daemon.endpoint)
    try:
        for i, key in enumerate(KEYS):
            assert producer.ask(f"put {key} {i} {NUMEL}") == "ok"
        yield daemon
    finally:
        producer.proc.kill()
        producer.proc.wait()


def test_gets_and_read_many_of_another_process_s_entries_send_no_request(produced):
    with produced.client() as c:
        c.ping()
        before = ops(c)
        started = time.monotonic()
        for _ in range(50):
            for i, key in enumerate(KEYS):
                assert torch.equal(c.get(key), make_tensor(i, NUMEL))
            copies = c.read_many(KEYS, lambda views: [v.clone() for v in views])
            assert all(torch.equal(t, make_tensor(i, NUMEL)) for i, t in enumerate(copies))
        assert c.get_many(KEYS)[3].equal(make_tensor(3, NUMEL))
        c.ping()  # the reports of the local reads go before it
        after = ops(c)
        asked = {op: after.get(op, 0) - before.get(op, 0) for op in after}
        elapsed = time.monotonic() - started
        assert asked.get("acquire", 0) == 0, asked
        # the pings, and a report per REPORT_BATCH reads or per REPORT_EVERY_S while reads go on (a
        # loaded machine reads slower: more of the timed ones)
        reads = 50 * len(KEYS) * 2 + len(KEYS)
        assert asked.get("report", 0) <= reads // REPORT_BATCH + elapsed / REPORT_EVERY_S + 2, (asked, elapsed)
        assert sum(asked.values()) - asked.get("report", 0) <= 2, asked
        stats = c.stats()
        assert stats["hits"] >= 50 * len(KEYS) * 2 + len(KEYS)  # the daemon counted them


def test_what_cannot_be_read_locally_takes_the_round_trip(produced):
    with produced.client(local_reads=False) as asking, produced.client() as c:
        before = ops(c)
        assert torch.equal(asking.get("k1"), make_tensor(1, NUMEL))
        assert asking.read_many(["k2"], lambda views: views[0].clone()).equal(make_tensor(2, NUMEL))
        assert ops(c).get("acquire", 0) - before.get("acquire", 0) == 2
        # a key that is not there: the index cannot say "absent", the daemon does
        seen = []
        assert c.read_many(["k0", "nope"], lambda views: seen.append([v is None for v in views]) or len(seen),
                           missing_ok=True) == 1
        assert seen == [[False, True]]
        with pytest.raises(ecd.KeyNotFound):
            c.get("nope")


def test_a_corrupt_entry_is_never_consumed_and_raises(daemon):
    with daemon.client() as c:
        c.put("sum", make_tensor(5, NUMEL), checksum=True)
        (loc,) = c.request(Acquire(0, c.namespace, ["sum"], 0.0)).results
        assert isinstance(loc, Location)
        c.request(Release(0, [loc.generation]))
        c.mapping.rw_for(loc.pool, loc.offset, loc.nbytes)[loc.offset] ^= 0xFF  # a bit-flip in the pool
        consumed = []
        with pytest.raises(ecd.IntegrityError):
            c.read_many(["sum"], consumed.append, verify=True)
        assert consumed == []
        with pytest.raises(ecd.IntegrityError):
            c.get("sum", verify=True)
        assert c.get("sum").numel() == NUMEL  # unverified, it reads what is there

