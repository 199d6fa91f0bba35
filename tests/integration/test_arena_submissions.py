"""Arena puts without a message (issue 43, item 4), on a machine without a GPU: the fake driver's
arenas are memfds and tests/fake_gpu_plane.py stands in for the client's CUDA plane, copying on a
late "stream". A put into an arena is placed in a put lease of that arena, copied on the device,
waited for, and posted as a record: the daemon sees no Alloc and no Commit, another client reads
the bytes the copy wrote, and a record that names a meta in an arena lease is refused."""
from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

from conftest import REPO, metric_by_label, scrape_metrics
from ecd.client import cuda
from ecd.client.testing import intercept_round_trips, place_on_page, put_into_arena, submission_page
from ecd.errors import EcdError
from ecd.protocol import Acquire, Release

sys.path.insert(0, str(REPO / "tests"))
import fake_gpu_plane  # noqa: E402
from fake_gpu_plane import HostArenaPlane  # noqa: E402
from test_cuda_arenas import FakeCudaDaemon  # noqa: E402

CUDA = '[pool.cuda]\ndevices = [0]\nsize = "8MiB"\n'  # its slab: 64 KiB (1/128 of it)
BLOCK = 4 << 10


@pytest.fixture
def arena_daemon(monkeypatch):
    monkeypatch.setattr(cuda, "CudaPlane", HostArenaPlane)
    d = FakeCudaDaemon("16MiB", CUDA)
    d.start(env={"ECD_FAKE_CUDA_FD": "1"})
    yield d
    d.cleanup()


def block(n: int) -> torch.Tensor:
    return torch.full((BLOCK // 8,), n, dtype=torch.int64)


def test_arena_puts_are_posted_records_in_arena_leases(arena_daemon):
    sent: list[tuple[str, int]] = []
    with arena_daemon.client() as c:
        arena = c.welcome.arenas[0].index
        spy = lambda request, send: (sent.append((type(request).__name__, getattr(request, "arena", None))),  # noqa: E731
                                     send(request))[1]
        with intercept_round_trips(c, spy):
            for i in range(64):
                put_into_arena(c, {f"a{i}": block(i)}, arena, wait=False)
            c.flush()
            put_into_arena(c, {"waited": block(99)}, arena)  # visible on return
        assert {name for name, _ in sent} == {"LeaseSpace"}, sent  # no Alloc, no Commit
        assert all(tier == arena for _, tier in sent), sent
        assert len(sent) <= 64 * BLOCK // (64 << 10) + 4, sent  # a lease per 64 KiB slab at most
        with arena_daemon.client() as other:
            for i in (0, 31, 63):
                assert torch.equal(other.get(f"a{i}"), block(i))
            assert torch.equal(other.get("waited"), block(99))
            capacity, used = other.stats()["pools"][arena]
        assert used >= 65 * BLOCK  # in the arena (its pool's bytes), not the host pool
        records = metric_by_label(scrape_metrics(arena_daemon.metrics_port), "ecd_submission_records_total", "outcome")
        assert records["committed"] == 65


def test_host_and_arena_leases_are_filled_side_by_side(arena_daemon):
    """A session fills one lease per tier: puts alternating between the host pool and an arena
    keep both leases (a record in one does not retire the other)."""
    with arena_daemon.client() as c:
        arena = c.welcome.arenas[0].index
        asked: list[str] = []
        with intercept_round_trips(c, lambda request, send: (asked.append(type(request).__name__), send(request))[1]):
            for i in range(40):
                c.put(f"h{i}", block(i), wait=False)
                put_into_arena(c, {f"a{i}": block(i)}, arena, wait=False)
            c.flush()
        # 40 x 4 KiB per tier: the first lease of each (64 KiB) holds 16 of them; were the other
        # tier's lease retired by each record, every put would ask again (80 requests)
        assert asked.count("LeaseSpace") <= 8, asked
        with arena_daemon.client() as other:
            assert all(torch.equal(other.get(k), block(i)) for i in range(40) for k in (f"h{i}", f"a{i}"))


def test_a_lease_in_no_arena_is_refused_and_an_arena_record_with_a_meta_too(arena_daemon):
    with arena_daemon.client() as c:
        with pytest.raises(EcdError, match="not a CUDA arena"):
            put_into_arena(c, {"x": block(1)}, 99)
        arena = c.welcome.arenas[0].index
        put_into_arena(c, {"first": block(1)}, arena)  # holds an arena lease now
        page = submission_page(c)
        placed = place_on_page(c, {"hostile": block(2)}, [BLOCK], ["int64"], tier=arena)
        placed[0].meta = b"\x80"  # a meta in device memory the daemon cannot read: refused with a reason
        with pytest.raises(EcdError, match="meta in a CUDA arena"):
            page.post(placed, [0], False, True, 5.0)
        assert not c.exists("hostile")
        put_into_arena(c, {"after": block(3)}, arena)
        with arena_daemon.client() as other:
            assert torch.equal(other.get("after"), block(3))


def arena_now(client, key: str) -> torch.Tensor:
    """The bytes of `key` in its arena as they are now, read from the arena's memory itself (not
    through the fake stream, which would run after every copy queued before it)."""
    from ecd import fd_passing
    (loc,) = client.request(Acquire(0, "default", [key])).results
    try:
        path = os.path.join(os.path.dirname(client.endpoint[len("ipc://"):]), client.welcome.fd_socket)
        _, items = fd_passing.receive(path, 5.0)
        try:
            fd = next(fd for item, fd in items if item.kind == "arena" and item.index == loc.pool)
            with mmap.mmap(fd, loc.offset + loc.nbytes) as memory:
                return torch.frombuffer(bytearray(memory[loc.offset:loc.offset + loc.nbytes]), dtype=torch.int64)
        finally:
            for _, fd in items:
                os.close(fd)
    finally:
        client.request(Release(0, [loc.generation]))


def test_an_arena_put_not_waited_for_returns_before_its_copy_and_posts_after_it(arena_daemon, monkeypatch):
    """put(wait=False) into an arena queues the copy on the device and returns: its record is
    posted only once the copy completed (the fake stream here runs each copy up to 20 ms late),
    at the client's next use of its page; flush posts and commits them all, and the arena holds
    exactly the bytes copied. A record posted before its copy ended would make an entry of bytes
    not yet there: reading the arena at once after flush sees them."""
    monkeypatch.setattr(fake_gpu_plane, "COPY_DELAY_S", 0.02)
    with arena_daemon.client() as c, arena_daemon.client() as other:
        arena = c.welcome.arenas[0].index
        for i in range(24):
            put_into_arena(c, {f"a{i}": block(i)}, arena, wait=False)
        assert submission_page(c).pending()
        assert not other.exists("a23")  # its copy may be done, its record is not posted yet
        c.flush()
        for i in reversed(range(24)):  # the last copies first: the latest to finish
            assert torch.equal(arena_now(other, f"a{i}"), block(i)), i
        put_into_arena(c, {"read-own": block(7)}, arena, wait=False)
        assert torch.equal(c.get("read-own"), block(7))  # a client reads its own writes


def test_a_client_closed_with_arena_puts_in_flight_posts_them_first(arena_daemon):
    with arena_daemon.client() as c:
        arena = c.welcome.arenas[0].index
        for i in range(16):
            put_into_arena(c, {f"a{i}": block(i)}, arena, wait=False)
    with arena_daemon.client() as other:
        for i in range(16):
            assert torch.equal(other.get(f"a{i}"), block(i)), i
