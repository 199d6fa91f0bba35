"""Failure is a miss, never garbage: an entry evicted, deleted or corrupted (a checksum mismatch)
between batch_exists and the load, a daemon restarted or gone. The load says False for those pages,
the host pool's page keeps the bytes it had, nothing raises into SGLang's threads, and later calls
work again by themselves."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import torch
from sglang_env import fill, make_backend, mha_host_pool, pages, slots

from conftest import OPEN_POOL, REPO, pool_target
from ecd import Client
from ecd.protocol import Acquire, Location, Release

# A third process that flips 4 bytes of an entry in the daemon's pool behind its back.
VANDAL = OPEN_POOL + """
import os, sys
target, offset = sys.argv[1], int(sys.argv[2])
fd = open_pool(target)
old = os.pread(fd, 4, offset)
os.pwrite(fd, bytes(b ^ 0xFF for b in old), offset)
os.close(fd)
"""


def corrupt(endpoint: str, namespace: str, key: str) -> None:
    with Client(endpoint, namespace) as c:
        (loc,) = c.request(Acquire(0, namespace, [key], 0.0)).results
        assert isinstance(loc, Location), loc
        c.request(Release(0, [loc.generation]))
        subprocess.run([sys.executable, "-c", VANDAL, pool_target(c, loc.pool), str(loc.offset + 16)], check=True,
                       timeout=60, cwd=REPO)


def stored(daemon, seed: int, keys: list[str], **config):
    """A backend with `keys` stored from host slots 0.., and copies of those pages."""
    host = mha_host_pool()
    backend = make_backend(daemon.endpoint, host, **config)
    fill(host, seed)
    assert backend.batch_set_v1(keys, slots(0, len(keys))) == [True] * len(keys)
    return backend, host, pages(host, 0, len(keys))


def untouched(host, first: int, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, pages(host, first, len(before))))


def eventually(fn, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_evicted_between_exists_and_get_is_a_miss(daemon):
    keys = ["e0", "e1", "e2"]
    backend, host, want = stored(daemon, 1, keys)
    assert backend.batch_exists(keys) == 3  # pins them for the load
    with Client(daemon.endpoint, backend.namespace) as c:  # an operator evicts one anyway
        assert c.evict(["e1"], force=True)["evicted"] == 1
    before = pages(host, 64, 3)
    assert backend.batch_get_v1(keys, slots(64, 3)) == [True, False, True]
    assert torch.equal(pages(host, 64, 1)[0], want[0]) and torch.equal(pages(host, 72, 1)[0], want[2])
    assert untouched(host, 68, before[1:2])
    assert backend.counters["missed_pages"] == 1
    backend.close()


def test_pages_batch_exists_found_survive_memory_pressure_until_loaded(daemon_factory):
    daemon = daemon_factory(size="8MiB")
    keys = [f"p{i}" for i in range(4)]
    backend, host, want = stored(daemon, 2, keys + ["q"])
    assert backend.batch_exists(keys) == 4  # pinned for pin_seconds (q is not asked for: not pinned)
    with Client(daemon.endpoint, "filler") as c:  # 3x the pool in other entries: the pressure is real
        for i in range(24):
            c.put(f"f{i}", torch.ones(1 << 18))
        assert c.stats()["evictions"] >= 16  # (q, unpinned, may go or stay: the plans evict what makes room)
    assert backend.batch_get_v1(keys, slots(64, 4)) == [True] * 4
    assert all(torch.equal(a, b) for a, b in zip(want, pages(host, 64, 4)))
    backend.close()


def test_deleted_between_exists_and_get_is_a_miss(daemon):
    keys = ["d0", "d1"]
    backend, host, want = stored(daemon, 3, keys)
    assert backend.batch_exists(keys) == 2
    with Client(daemon.endpoint, backend.namespace) as c:
        assert c.delete("d0") is True
    before = pages(host, 64, 2)
    assert backend.batch_get_v1(keys, slots(64, 2)) == [False, True]
    assert untouched(host, 64, before[:1]) and torch.equal(pages(host, 68, 1)[0], want[1])
    targets = [host.get_dummy_flat_data_page() for _ in keys]
    assert backend.batch_get(keys, targets)[0] is None and not targets[0].any()
    backend.close()


def test_corrupted_page_fails_verification_and_is_a_miss(daemon):
    keys = ["c0", "c1", "c2"]
    backend, host, want = stored(daemon, 4, keys, extra={"verify": True})
    corrupt(daemon.endpoint, backend.namespace, "c1")
    assert backend.batch_exists(keys) == 3  # present: only a read can tell
    before = pages(host, 64, 3)
    assert backend.batch_get_v1(keys, slots(64, 3)) == [True, False, True]
    assert untouched(host, 68, before[1:2])
    assert torch.equal(pages(host, 64, 1)[0], want[0]) and torch.equal(pages(host, 72, 1)[0], want[2])
    assert backend.counters["integrity_failures"] == 1
    target = host.get_dummy_flat_data_page()
    assert backend.batch_get(["c1"], [target]) == [None] and not target.any()  # the generic path too
    # later calls work: the page stored again (a new entry) loads
    with Client(daemon.endpoint, backend.namespace) as c:
        c.delete("c1")
    assert backend.batch_set_v1(["c1"], slots(4, 1)) == [True]
    assert backend.batch_get_v1(["c1"], slots(100, 1)) == [True]
    assert torch.equal(pages(host, 100, 1)[0], want[1])
    backend.close()


def test_corruption_without_verify_is_not_detected(daemon):
    """What verify buys: without it, a page corrupted in shared memory behind the daemon's back
    loads as it is (the daemon's memory is trusted)."""
    backend, host, want = stored(daemon, 5, ["u0"])
    corrupt(daemon.endpoint, backend.namespace, "u0")
    assert backend.batch_get_v1(["u0"], slots(64, 1)) == [True]
    assert not torch.equal(pages(host, 64, 1)[0], want[0])
    backend.close()


def test_daemon_restart_with_a_fresh_pool_between_exists_and_get(daemon):
    keys = ["r0", "r1"]
    backend, host, want = stored(daemon, 6, keys)
    assert backend.batch_exists(keys) == 2
    daemon.stop(signal.SIGKILL)
    daemon.release_pool()  # nothing adopted: the restarted daemon starts empty
    daemon.start()
    before = pages(host, 64, 2)
    assert backend.batch_get_v1(keys, slots(64, 2)) == [False, False]
    assert untouched(host, 64, before)
    # later calls work by themselves (the client reconnects after its back-off)
    assert eventually(lambda: backend.batch_set_v1(keys, slots(0, 2)) == [True, True])
    assert backend.batch_get_v1(keys, slots(64, 2)) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(want, pages(host, 64, 2)))
    backend.close()


def test_daemon_restart_that_adopts_the_pool_keeps_the_pages(daemon):
    keys = ["a0", "a1"]
    backend, host, want = stored(daemon, 7, keys)
    assert backend.batch_exists(keys) == 2
    daemon.stop()
    daemon.start()  # the holder kept the pool: the entries are adopted
    result = eventually(lambda: backend.batch_get_v1(keys, slots(64, 2)) == [True, True])
    assert result
    assert all(torch.equal(a, b) for a, b in zip(want, pages(host, 64, 2)))
    backend.close()


def test_daemon_gone_is_a_miss_and_comes_back(daemon):
    keys = ["g0"]
    backend, host, want = stored(daemon, 8, keys)
    daemon.stop()
    daemon.release_pool()
    before = pages(host, 64, 1)
    started = time.monotonic()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, slots(64, 1)) == [False]
    assert backend.batch_set_v1(keys, slots(0, 1)) == [False]
    assert time.monotonic() - started < 5  # no timeouts waited out: the socket is gone
    assert untouched(host, 64, before)
    daemon.start()
    assert eventually(lambda: backend.batch_set_v1(keys, slots(0, 1)) == [True])
    assert backend.batch_get_v1(keys, slots(64, 1)) == [True]
    assert torch.equal(pages(host, 64, 1)[0], want[0])
    backend.close()
