"""A Client's pool mappings are prefaulted in the background (ecd.memory.prefault), not in mmap.

Seen by the kernel: /proc/self/smaps gives, for each mapping, how much of it this process's page
tables map (Rss). With `populate` (the default) a thread fills the read-write and read-only
mappings while the Client is already usable; without it nothing is mapped ahead. Both backings
(sealed memfds, named /dev/shm files) take the same route.
"""
from __future__ import annotations

import pytest
import torch

from ecd import Client
from ecd.memory import prefault

pytestmark = pytest.mark.skipif(not prefault.supported(), reason="the kernel lacks MADV_POPULATE_* (Linux 5.14)")


def resident_kib(buf) -> int:
    """Rss of the mapping that starts at buf's address, from /proc/self/smaps."""
    start = f"{prefault.address_of(buf):x}-"
    with open("/proc/self/smaps") as f:
        lines = iter(f.read().splitlines())
    for line in lines:
        if line.startswith(start):
            for field in lines:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping at {start} in /proc/self/smaps")


@pytest.mark.parametrize("backing", ["memfd", "named"])
def test_pool_mappings_are_prefaulted_in_the_background(daemon_factory, backing):
    daemon = daemon_factory(size="64MiB", backing=backing)
    with Client(daemon.endpoint) as c:
        thread = c.mapping.prefaulting
        assert thread is not None
        c.put("x", torch.arange(1 << 20, dtype=torch.float32))  # usable while it runs
        thread.join(30)
        assert not thread.is_alive()
        for buf in c.mapping.rw + c.mapping.ro:
            assert resident_kib(buf) * 1024 == len(buf), backing  # every page mapped
        assert torch.equal(c.get("x"), torch.arange(1 << 20, dtype=torch.float32))


def test_without_populate_nothing_is_mapped_ahead(daemon):
    with Client(daemon.endpoint, populate=False) as c:
        assert c.mapping.prefaulting is None
        assert all(resident_kib(buf) * 1024 < len(buf) // 2 for buf in c.mapping.rw + c.mapping.ro)


def test_a_mapping_let_go_of_stops_the_thread(monkeypatch):
    """The thread holds a mapping only while it populates a chunk: one its owner let go of is
    left alone (unmapped), and the thread ends without touching it."""
    import mmap
    monkeypatch.setattr(prefault, "CHUNK", 1 << 20)
    held = mmap.mmap(-1, 8 << 20)
    thread = prefault.start([held], [])
    thread.join(60)
    assert not thread.is_alive() and resident_kib(held) * 1024 == len(held)
    dropped = mmap.mmap(-1, 8 << 20)
    thread = prefault.start([dropped], [])
    del dropped  # unmapped now, or after the chunk in progress
    thread.join(60)
    assert not thread.is_alive()
