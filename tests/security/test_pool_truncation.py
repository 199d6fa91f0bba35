"""A member of the daemon's group truncates a pool file (/dev/shm/ecd.<node>.<n> is 0660): the
daemon must not die of it (issue 23, attack 4), nothing the cut took may be served, and what it
did not take must still be.

Before the fix the next inline put (the daemon copies it into the pool itself) killed the daemon
with SIGBUS. Now every request that writes or leases pool bytes, and a timer, compare the files'
sizes with what the daemon created; a shrunk file is restored (its size and pages) and every
entry whose extent reached past the cut is dropped (an EVICTED ring event), a write in progress
there refused with CORRUPT and a reason; the daemon's own copies go through the kernel, so a
truncation racing them is a short count, not a signal.

Real parts: the daemon (`ecd serve`), the attacker (a process that ftruncates the file, as root
here: a group member can do the same), honest clients in processes of their own
(pool_client.py: they map the pool, and a fault there must not take the test runner with it).
The test process itself only sends requests that never touch pool bytes.

All of it is about `[pool.host] backing = "named"` (pinned here): the default, sealed memfds,
cannot be truncated at all (test_memfd_pool.py).
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DaemonProcess, wait_for
from ecd.config import LeasesSection
from ecd.memory.entry_index import slot_area_bytes
from ecd.errors import Code
from ecd.protocol import Acquire, Alloc, AllocItem, Commit, Release

sys.path.insert(0, str(Path(__file__).parent))
from secutil import metric  # noqa: E402

# segment 0 holds the read slots after its share of the pool (memory/entry_index.py)
SLOT_AREA = slot_area_bytes(LeasesSection().slot_sessions, LeasesSection().read_slots)
HELPER = str(Path(__file__).with_name("pool_client.py"))
BIG = 1 << 20  # float32 elements: a 4 MiB put, copied by the client into its extent
SMALL = 1024  # 4 KiB: rides inline, the daemon copies it
REPLY_S = 30.0
ATTACK_S = 2.0


class HonestClient:
    def __init__(self, endpoint: str) -> None:
        self.proc = subprocess.Popen([sys.executable, HELPER, endpoint], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_S)
        assert ready, f"the honest client did not answer {line!r} within {REPLY_S:g}s"
        answer = self.proc.stdout.readline().strip()
        assert answer, f"the honest client died on {line!r} (exit status {self.proc.wait()})"
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def truncate(path: str, size: int) -> None:
    """The attack, from a process of its own."""
    subprocess.run([sys.executable, "-c", f"import os; os.truncate({path!r}, {size})"], check=True, timeout=30)


def locate(admin, key: str):
    """The entry's Location (pool, offset, nbytes), learnt with a lease given back at once."""
    loc, = admin.request(Acquire(0, "default", [key], 0.0)).results
    admin.request(Release(0, [loc.generation]))
    return loc


@pytest.fixture
def node():
    d = DaemonProcess(size="32MiB", backing="named")
    d.start()
    clients: list[HonestClient] = []

    def honest() -> HonestClient:
        clients.append(HonestClient(d.endpoint))
        return clients[-1]
    try:
        yield d, honest
    finally:
        for c in clients:
            c.close()
        d.cleanup()


def _pool_path(d: DaemonProcess) -> str:
    return f"/dev/shm/ecd.{d.node}.0"


def test_inline_put_into_a_truncated_pool_keeps_the_daemon_serving(node):
    d, honest = node
    client = honest()
    for key, seed in (("low", 1), ("high", 2), ("top", 3)):
        assert client.ask(f"put {key} {seed} {BIG}") == "ok"
    admin = d.client()
    low, high, top = (locate(admin, k) for k in ("low", "high", "top"))
    assert low.offset + low.nbytes <= high.offset < top.offset, "placed in put order"
    path, full = _pool_path(d), os.stat(_pool_path(d)).st_size
    cut = high.offset + 4096  # inside "high": "low" below the cut keeps its bytes

    truncate(path, cut)
    # the attack of issue 23: before the fix the daemon died of SIGBUS copying this put
    assert client.ask(f"put tiny 7 {SMALL}") == "ok"
    assert d.alive(), f"the daemon died after the pool was truncated:\n{d.log()[-3000:]}"
    assert os.stat(path).st_size == full, "the daemon gives the pool file its size back"

    assert client.ask(f"get tiny 7 {SMALL}") == "ok"
    assert client.ask(f"get low 1 {BIG}") == "ok", "an entry below the cut is served intact"
    for key, seed in (("high", 2), ("top", 3)):  # cut: gone, never served as zeros
        assert client.ask(f"get {key} {seed} {BIG}") == "missing"
    assert client.ask(f"put big 9 {BIG}") == "ok"  # the client's own copy into the restored pool
    assert client.ask(f"get big 9 {BIG}") == "ok"
    assert client.ask(f"put high 12 {BIG}") == "ok", "a cut key can be put again"
    assert client.ask(f"get high 12 {BIG}") == "ok"

    assert d.alive()
    assert metric(d, "ecd_pool_truncations_total") >= 1
    assert metric(d, "ecd_evictions_total", reason="truncated") >= 2
    assert "was truncated" in d.log()
    admin.close()


def _a_below_b(node):
    """Entries "a" (seed 1) and "b" (seed 2) put by an honest client: (daemon, that client, an
    admin Client, b's location)."""
    d, honest = node
    client = honest()
    assert client.ask(f"put a 1 {BIG}") == "ok"
    assert client.ask(f"put b 2 {BIG}") == "ok"
    admin = d.client()
    return d, client, admin, locate(admin, "b")


def test_a_truncation_with_no_request_is_repaired_by_the_timer(node):
    d, client, admin, b = _a_below_b(node)
    path, full = _pool_path(d), os.stat(_pool_path(d)).st_size
    truncate(path, b.offset)  # exactly at "b": "a" is whole

    assert wait_for(lambda: os.stat(path).st_size == full, timeout=10.0), "restored without any request"
    assert wait_for(lambda: admin.exists(["b"]) == [False], timeout=10.0), "the cut entry is gone from the ring"
    assert admin.exists(["a"]) == [True]
    assert client.ask(f"get a 1 {BIG}") == "ok"
    assert client.ask(f"get b 2 {BIG}") == "missing"
    assert d.alive()
    admin.close()


def test_a_truncation_undone_by_the_attacker_is_found_by_the_pages_it_took(node):
    """Cut and grown back to its size before the daemon looks: the size is right, but the cut
    pages are gone (zeros). The daemon sees pages missing (st_blocks) and, since nothing cheap
    says which, drops every entry of the segment: never serves zeros as "b" (before, it saw a
    whole file and served them)."""
    d, client, admin, b = _a_below_b(node)
    path = _pool_path(d)
    full = os.stat(path).st_size
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, b.offset)  # "b" and everything above it go ...
        os.ftruncate(fd, full)  # ... and the size comes back at once, before the 0.25 s check
    finally:
        os.close(fd)
    assert wait_for(lambda: admin.exists(["b"]) == [False], timeout=10.0), "the cut entry is dropped"
    assert client.ask(f"get b 2 {BIG}") == "missing"
    # Below the cut, but nothing says so: dropped too. Unless the 0.25 s check fell between the
    # two ftruncates and saw a plain cut at "b": then "a" is whole and served (the client checks
    # its bytes). Never anything else.
    a = client.ask(f"get a 1 {BIG}")
    assert a == ("missing" if "grown again" in d.log() else "ok"), d.log()[-2000:]
    assert os.stat(path).st_blocks * 512 >= full, "its pages are allocated again"
    assert client.ask(f"put c 3 {BIG}") == "ok" and client.ask(f"get c 3 {BIG}") == "ok"
    assert d.alive()
    admin.close()


def test_a_write_in_progress_that_the_cut_took_is_refused(node):
    d, honest = node
    admin = d.client()
    extents = admin.request(Alloc(0, "default", [AllocItem("w1", "uint8", [BIG], BIG),
                                                 AllocItem("w2", "uint8", [BIG], BIG)])).results
    w1, w2 = sorted(extents, key=lambda e: e.offset)
    truncate(_pool_path(d), w2.offset + 100)  # w1 below, w2 cut
    reply = admin.request(Commit(0, [w1.generation, w2.generation]))
    by_generation = dict(zip([w1.generation, w2.generation], reply.results))
    assert by_generation[w1.generation] is None
    failure = by_generation[w2.generation]
    assert failure is not None and failure.code == Code.CORRUPT and "truncated" in failure.message
    assert d.alive()
    assert metric(d, "ecd_pool_truncated_writes_refused_total") >= 1
    admin.close()


def test_a_persisted_entry_cut_in_memory_comes_back_from_disk(tmp_path):
    """The disk tier keeps a whole copy: the cut drops the memory copy only, a get promotes it."""
    d = DaemonProcess(size="32MiB", extra=f'[pool.disk]\npath = "{tmp_path}"\nsize = "64MiB"\n', backing="named")
    d.start()
    client = HonestClient(d.endpoint)
    admin = None
    try:
        assert client.ask(f"put kept 4 {BIG} persist") == "ok"
        assert client.ask(f"put lost 5 {BIG}") == "ok"
        admin = d.client()
        kept = locate(admin, "kept")
        truncate(_pool_path(d), kept.offset)  # both cut
        assert client.ask(f"get kept 4 {BIG}") == "ok", "read back from its disk record, intact"
        assert client.ask(f"get lost 5 {BIG}") == "missing"
        assert d.alive()
    finally:
        if admin is not None:
            admin.close()
        client.close()
        d.cleanup()


def test_inline_puts_while_an_attacker_truncates_in_a_loop(node):
    """The daemon's copy racing the attacker's truncations: a short copy, never SIGBUS. Each put
    is stored or refused with a reason; afterwards each stored key is served intact or missing
    (a later cut took it), never with other bytes."""
    d, honest = node
    client = honest()
    path = _pool_path(d)
    assert client.ask(f"put warm 1 {SMALL}") == "ok"
    attacker = subprocess.Popen([sys.executable, "-c", f"""
import os, time
end = time.monotonic() + {ATTACK_S}
while time.monotonic() < end:
    for size in (0, 4096, 1 << 20):
        os.truncate({path!r}, size)
"""])
    stored, refused = [], []
    try:
        i = 0
        while attacker.poll() is None:
            answer = client.ask(f"put k{i} {100 + i} {SMALL}")
            assert answer == "ok" or ("truncated" in answer and answer.startswith("error")), answer
            if answer == "ok":
                stored.append(i)
            else:
                refused.append(answer)
            i += 1
    finally:
        attacker.wait()
    assert d.alive(), f"the daemon died under the truncation loop:\n{d.log()[-3000:]}"
    assert stored, "puts went on being stored under the attack"
    assert wait_for(lambda: os.stat(path).st_size == (32 << 20) + SLOT_AREA, timeout=10.0)
    served = 0
    for i in stored:
        answer = client.ask(f"get k{i} {100 + i} {SMALL}")
        # A get without a round trip may copy an entry whose bytes a late cut took before the
        # daemon's check drops it: its checksum refuses them (IntegrityError), never served.
        assert answer in ("ok", "missing") or answer.startswith("error IntegrityError"), f"k{i}: {answer}"
        served += answer == "ok"
    assert client.ask(f"put after 3 {BIG}") == "ok"
    assert client.ask(f"get after 3 {BIG}") == "ok"
    print(f"{len(stored)} puts stored, {len(refused)} refused, {served} served intact afterwards, "
          f"{metric(d, 'ecd_pool_truncations_total'):.0f} truncations seen")


def test_a_client_sees_a_truncated_pool_file_before_it_copies(tmp_path):
    """The client side (ecd/client/mapping.py): one fstat before each copy in or out of the pool,
    so a truncated file is an IntegrityError in the honest engine instead of SIGBUS."""
    import mmap

    from ecd.client.mapping import _reaching
    from ecd.errors import IntegrityError

    with open(tmp_path / "pool", "w+b") as f:
        f.truncate(1 << 20)
        buf = mmap.mmap(f.fileno(), 1 << 20)
        assert _reaching(buf, 0, 1 << 20) is buf
        os.truncate(tmp_path / "pool", 8192)
        assert _reaching(buf, 0, 8192) is buf  # below the cut: still readable
        with pytest.raises(IntegrityError, match="truncated to 8192 bytes"):
            _reaching(buf, 0, 8193)
        buf.close()
