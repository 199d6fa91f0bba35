"""Arena entries read without a round trip (no GPU: the fake driver's arenas are memfds, and
tests/fake_gpu_plane.py stands in for the client's CUDA plane, copying on a late "stream"). The
daemon indexes arena entries in the ring's entry index; a client on that device gets, views and
pins them with read slots: the daemon sees no Acquire and no Exists, `ecd keys` shows the slot
holds, and a pinned arena entry stays through an arena's worth of puts while an unpinned one goes."""
from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO
from ecd.client import cuda
from ecd.errors import KeyNotFound

sys.path.insert(0, str(REPO / "tests"))
from fake_gpu_plane import ArenaWriter, HostArenaPlane  # noqa: E402
from test_cuda_arenas import FakeCudaDaemon  # noqa: E402

CUDA = '[pool.cuda]\ndevices = [0]\nsize = "1MiB"\n'
BLOCK = 64 << 10


@pytest.fixture
def arena_daemon(monkeypatch):
    monkeypatch.setattr(cuda, "CudaPlane", HostArenaPlane)
    d = FakeCudaDaemon("16MiB", CUDA)
    d.start(env={"ECD_FAKE_CUDA_FD": "1"})
    yield d
    d.cleanup()


def block(n: int) -> torch.Tensor:
    return torch.full((BLOCK // 8,), n, dtype=torch.int64)


def held(c, key: str) -> tuple[int, int]:
    (entry,) = [e for e in c.keys()[1] if e["key"] == key]
    return entry["readers"], entry["pins"]


def test_arena_entries_are_got_viewed_and_pinned_with_read_slots(arena_daemon):
    producer = ArenaWriter(arena_daemon.endpoint)
    try:
        assert producer.put("a0", block(1)) and producer.put("a1", block(2))
        with arena_daemon.client() as c, arena_daemon.client() as admin:
            ops = dict(c.stats()["ops"])
            assert torch.equal(c.get("a0"), block(1))
            got = c.get_many(["a0", "a1"])
            assert len(got) == 2 and torch.equal(got[0], block(1)) and torch.equal(got[1], block(2))
            with c.view("a1") as view:
                assert torch.equal(view, block(2))
                assert held(admin, "a1") == (1, 0)  # the view's read slot
            assert held(admin, "a1") == (0, 0)
            assert c.exists("a0", pin_s=30) is True
            assert held(admin, "a0") == (0, 1)  # a pin slot
            after = c.stats()["ops"]
            assert after.get("acquire", 0) == ops.get("acquire", 0)
            assert after.get("exists", 0) == ops.get("exists", 0)
            for n in range(40):  # 2.5 arenas of puts: everything unpinned is evicted
                assert producer.put(f"fill{n}", block(100 + n))
            assert torch.equal(c.get("a0"), block(1))  # kept by the pin slot
            with pytest.raises(KeyNotFound):
                c.get("a1")
            assert c.unpin("a0") is True
            assert held(admin, "a0") == (0, 0)
    finally:
        producer.close()
