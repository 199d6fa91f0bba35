"""Issue 27 against the real daemon: a restart (SIGTERM or SIGKILL, while writer processes put)
adopts the host pool: every put that had returned is there, bit-identical, nothing half-written
is visible, connected clients carry on. A pool of another layout or a journal of another format
is refused with one log line and the daemon starts cold. A final stop leaves nothing behind. A
write cut by the restart never lands on an adopted or a newer entry. Restarts in a row keep exactly
what the pool held. (Views held across a restart: test_restart_views.py.)

The writers are tests/restart_writer.py processes; they log every operation as it begins and as
it returns, so the test knows, for each key, what a read may return."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, entry_bytes, shm_files, wait_for

sys.path.insert(0, str(REPO / "tests"))
from pool_holders import held_by, holder_pids, mapped, memfds, open_anywhere  # noqa: E402
from restart_writer import digest, payload  # noqa: E402

WRITER = REPO / "tests" / "restart_writer.py"
NAMESPACES = ["alpha", "beta", "gamma"]
WRITERS = 4
ENTRIES = 10_000  # new keys, over all writers (replaces and deletes come on top)


def edit_config(d, old: str, new: str) -> None:
    text = d.config.read_text()
    assert old in text, (old, text)
    d.config.write_text(text.replace(old, new, 1))


def not_adopted_lines(d) -> list[str]:
    return [line for line in d.log().splitlines() if "not adopted:" in line]


# ---- 1. 10,000 entries from several writers, the daemon killed while they put ---------------

class Writers:
    def __init__(self, endpoint: str, workdir: Path, entries: int) -> None:
        self.logs = [workdir / f"w{i}.jsonl" for i in range(WRITERS)]
        self.procs = [subprocess.Popen([sys.executable, str(WRITER), "write", endpoint, str(i), str(1000 + i),
                                        str(entries // WRITERS), str(self.logs[i]), ",".join(NAMESPACES)],
                                       stderr=open(workdir / f"w{i}.err", "w"))
                      for i in range(WRITERS)]

    def done(self) -> int:
        return sum(p.read_bytes().count(b'"done"') for p in self.logs if p.exists())

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def records(self, i: int) -> list[dict]:
        text = self.logs[i].read_text()
        return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()


def model(records: list[dict]) -> tuple[dict[tuple[str, str], str | None], dict | None]:
    """What the writer's returned operations left ({(ns, key): digest, or None: deleted}), and its
    operation that began but had not returned (None: none)."""
    begun = {r["i"]: r for r in records if "op" in r}
    done = {r["i"] for r in records if "done" in r}
    state: dict[tuple[str, str], str | None] = {}
    for i in sorted(done):
        op = begun[i]
        state[(op["ns"], op["key"])] = op.get("digest")
    open_ops = [begun[i] for i in begun if i not in done]
    assert len(open_ops) <= 1, f"a writer has {len(open_ops)} operations open at once"
    return state, (open_ops[0] if open_ops else None)


def read_all(clients: dict, keys: list[tuple[str, str]]) -> dict[tuple[str, str], str | None]:
    """{(ns, key): digest of what a get returns, None: missing}; entries stored with a checksum
    are verified against it."""
    got: dict[tuple[str, str], str | None] = {}
    for ns in NAMESPACES:
        names = [k for n, k in keys if n == ns]
        for start in range(0, len(names), 256):
            chunk = names[start:start + 256]
            for key, tensor in zip(chunk, clients[ns].get_many(chunk, missing_ok=True, verify=True)):
                got[(ns, key)] = None if tensor is None else digest(tensor)
    return got


def listed(client) -> set[tuple[str, str]]:
    total, entries = client.keys(None, limit=1_000_000)
    assert total == len(entries)
    return {(e["ns"], e["key"]) for e in entries}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
@pytest.mark.parametrize("backing", ["memfd", "named"])
def test_entries_of_several_writers_survive_a_restart(daemon_factory, tmp_path, backing, sig):
    d = daemon_factory(size="768MiB", backing=backing, start=False)  # ~300 MB written: nothing is evicted
    edit_config(d, 'log_level = "debug"', 'log_level = "info"\nshutdown_grace = "5s"')
    d.start()
    clients = {ns: d.client(namespace=ns) for ns in NAMESPACES}  # made before the kill, used after it
    writers = Writers(d.endpoint, tmp_path, ENTRIES)
    try:
        # Kill while the writers are well into their puts.
        assert wait_for(lambda: writers.done() >= ENTRIES * 6 // 10 or any(p.poll() is not None for p in writers.procs),
                        timeout=150, interval=0.05), "the writers did not get going"
        assert all(p.poll() is None for p in writers.procs), "a writer ended before the kill"
        before = clients["alpha"].stats()
        assert before["evictions"] == 0
        d.stop(sig, timeout=30)
        writers.signal(signal.SIGSTOP)  # frozen while the test looks: nothing changes under it
        time.sleep(0.2)
        state: dict[tuple[str, str], str | None] = {}
        allowed: dict[tuple[str, str], set[str | None]] = {}
        open_puts = open_deletes = 0
        for i in range(WRITERS):
            mine, open_op = model(writers.records(i))
            state.update(mine)
            if open_op is not None:
                k = (open_op["ns"], open_op["key"])
                allowed[k] = {state.get(k), open_op.get("digest")}  # before it, or all of it
                open_puts += open_op["op"] == "put"
                open_deletes += open_op["op"] == "delete" and state.get(k) is not None  # may have taken effect
        live = sum(v is not None for v in state.values())
        assert live > ENTRIES // 2

        d.start()
        restarted = time.monotonic()
        stats = clients["alpha"].stats()  # a client of the old run carries on by itself
        restart = stats["restart"]
        assert restart["adopted"] and restart["refused"] == "", restart
        assert live - open_deletes <= restart["entries"] <= live + open_puts, (live, open_puts, open_deletes, restart)
        assert f"restart: adopted {restart['entries']} entries" in d.log()
        assert stats["evictions"] == 0 and stats["entries_ready"] == restart["entries"]

        # Every returned put is there, bit-identical; deleted keys stay deleted; the open
        # operations show all of their bytes or none (the value before them).
        keys = sorted(set(state) | set(allowed))
        got = read_all(clients, keys)
        wrong = [(k, got[k], state.get(k)) for k in keys
                 if got[k] not in allowed.get(k, {state.get(k)})]
        assert not wrong, f"{len(wrong)} keys read other than what was returned: {wrong[:5]}"
        print(f"killed with {live} returned puts live, {len(allowed)} operation(s) open "
              f"({sum(got[k] != state.get(k) for k in allowed)} of them took effect); adopted {restart['entries']} "
              f"entries ({restart['bytes']} bytes) in {restart['seconds']:.3f}s, {restart['quarantined']} quarantined")
        assert listed(clients["beta"]) == {k for k in keys if got[k] is not None}, "entries nobody wrote"

        # The writers (their clients made before the kill) carry on and finish.
        writers.signal(signal.SIGCONT)
        for i, p in enumerate(writers.procs):
            assert p.wait(150) == 0, (tmp_path / f"w{i}.err").read_text()[-3000:]
        final: dict[tuple[str, str], str | None] = {}
        for i in range(WRITERS):
            records = writers.records(i)
            mine, open_op = model(records)
            assert open_op is None and "end" in records[-1]
            assert len(records[-1]["epochs"]) == 1 and records[-1]["epochs"][0] == clients["alpha"].epoch
            assert any(r.get("done", 0) > restarted for r in records), f"writer {i} did nothing after the restart"
            final.update(mine)
        got = read_all(clients, sorted(final))
        assert {k: v for k, v in got.items() if v != final[k]} == {}
        assert listed(clients["gamma"]) == {k for k, v in final.items() if v is not None}
        after = clients["alpha"].stats()
        assert after["evictions"] == 0 and after["entries_writing"] == 0
        assert "Traceback" not in d.log()
    finally:
        writers.kill()
        for c in clients.values():
            c.close()


# ---- 2. refusals: another layout, another node, another journal format -> cold ---------------

def _old_pool(d) -> dict[tuple[int, int], int]:
    pids = holder_pids(d.node)
    assert len(pids) == 1, pids
    held = held_by(pids[0], d.node)
    assert held, "the holder holds nothing"
    return held


def _assert_cold_and_serving(d, reason: str, old: dict[tuple[int, int], int]) -> None:
    lines = not_adopted_lines(d)
    assert len(lines) == 1 and reason in lines[0], d.log()[-4000:]
    with d.client() as c:
        restart = c.stats()["restart"]
        assert not restart["adopted"] and reason in restart["refused"] and restart["entries"] == 0, restart
        assert c.exists("kept#1") is False  # cold
        c.put("new#1", payload("new#1", 0, 300_000))
        assert digest(c.get("new#1")) == digest(payload("new#1", 0, 300_000))
    # The old pool went back to the machine: no process holds or maps it; the holder holds the new one.
    gone = wait_for(lambda: not (set(memfds(d.node)) & set(old)) and not open_anywhere(old), timeout=10)
    assert gone, f"the old pool is still held: {memfds(d.node)}"
    pids = holder_pids(d.node)
    assert len(pids) == 1
    assert not set(held_by(pids[0], d.node)) & set(old)


def _put_kept(d) -> None:
    with d.client() as c:
        c.put("kept#1", payload("kept#1", 0, 300_000))


@pytest.mark.parametrize("change", ["size", "segment_size"])
def test_another_pool_layout_starts_cold_with_one_log_line(daemon_factory, change):
    d = daemon_factory(size="64MiB")
    _put_kept(d)
    old = _old_pool(d)
    d.stop()
    if change == "size":
        edit_config(d, 'size = "64MiB"', 'size = "32MiB"')
        reason = "segments"
    else:
        edit_config(d, 'size = "64MiB"', 'size = "64MiB"\nsegment_size = "16MiB"')
        reason = "segment"
    d.start()
    _assert_cold_and_serving(d, reason, old)


def test_a_pool_of_another_node_is_refused(daemon_factory):
    """The holder is found by node name, so another node's pool reaches a daemon only when it is
    handed over (systemd's store is per unit): move node A's pool into node B's holder."""
    d = daemon_factory(size="64MiB")
    _put_kept(d)
    old = _old_pool(d)
    d.stop()
    node_a, node_b = d.node, d.node + "b"
    move = f"""
from ecd.daemon.restart.holder_client import HolderKeeper
fds = HolderKeeper({node_a!r}, {d.runtime_dir!r}, spawn=False).take()
HolderKeeper({node_b!r}, {d.runtime_dir!r}, hold=120.0).keep(fds)
print(len(fds))  # one segment, the journal, its key, the ring
"""
    # stderr to a file: the holder it spawns inherits it and outlives it
    with open(Path(d.runtime_dir) / "move.err", "w") as err:
        out = subprocess.run([sys.executable, "-c", move], cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout.strip() == "4", (Path(d.runtime_dir) / "move.err").read_text()
    d.release_pool()  # node A's holder lets its copy go
    assert wait_for(lambda: holder_pids(node_a) == [], timeout=10)
    edit_config(d, f'name = "{node_a}"', f'name = "{node_b}"')
    d.node = node_b
    d.start()
    _assert_cold_and_serving(d, f"node = {node_a!r}", old)


CORRUPT_JOURNAL = """
import mmap, struct, sys
from ecd.daemon.restart.holder_client import HolderKeeper
fds = HolderKeeper(sys.argv[1], sys.argv[2], spawn=False).take()
journal = mmap.mmap(fds["journal"], 4096)
journal[8:12] = struct.pack("<I", 99)  # the header's format
journal.close()
print("ok")
"""


@pytest.mark.parametrize("backing", ["memfd", "named"])
def test_a_journal_of_another_format_starts_cold(daemon_factory, backing):
    d = daemon_factory(size="64MiB", backing=backing)
    _put_kept(d)
    old = _old_pool(d)
    d.stop()
    if backing == "named":  # the journal is a file: write into it
        with open(f"/dev/shm/ecd.{d.node}.journal", "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<I", 99))
    else:  # a memfd only the holder holds: take it from the holder while no daemon runs
        out = subprocess.run([sys.executable, "-c", CORRUPT_JOURNAL, d.node, d.runtime_dir], cwd=REPO,
                             capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    d.start()
    _assert_cold_and_serving(d, "format 99", old)
    if backing == "named":
        assert os.path.exists(f"/dev/shm/ecd.{d.node}.journal")  # a new one, for the next restart


FORGE_JOURNAL = """
import json, mmap, os, struct, sys
from ecd.daemon.restart.holder_client import HolderKeeper
from ecd.integrity import checksum
from ecd.memory.journal import Journal, Layout, new_key
from ecd.memory.ring import key_hash
fds = HolderKeeper(sys.argv[1], sys.argv[2], spawn=False).take()
size = os.fstat(fds["journal"]).st_size
journal = mmap.mmap(fds["journal"], size)
fields = json.loads(bytes(journal[64:64 + struct.unpack_from("<I", journal, 12)[0]]))
layout = Layout(fields["node"], fields["backing"], tuple(fields["segments"]))
forged = b"forged by someone without the daemon's key " * 64
pool = mmap.mmap(fds["pool.0"], layout.segments[0])
pool[:len(forged)] = forged
journal[:] = bytes(size)  # a journal of its own, consistent in itself, under a key it chose
Journal.create(journal, size, layout, new_key()).entry(
    1 << 40, 0, 0, len(forged), "uint8", (len(forged),), "default", "kept#1", checksum=checksum(forged),
    keyhash=key_hash("default", "kept#1"), committed=True)
print("ok")
"""


def test_a_journal_forged_without_the_daemons_key_is_never_adopted(daemon_factory):
    """Issue 40, attack 1: whoever can write the kept journal but does not hold the daemon's key
    (it is a sealed memfd beside the journal, never in it) cannot make the next daemon adopt an
    entry: the forged journal (with matching checksums) is refused as a whole and its bytes are
    never served, even to get(..., verify=True). Before the key left the header, the forged entry
    was adopted and served."""
    d = daemon_factory(size="64MiB")
    _put_kept(d)
    old = _old_pool(d)
    d.stop()
    out = subprocess.run([sys.executable, "-c", FORGE_JOURNAL, d.node, d.runtime_dir], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    d.start()
    _assert_cold_and_serving(d, "not written with the key kept beside it", old)


# ---- 3. a final stop leaves nothing ----------------------------------------------------------

@pytest.mark.parametrize("ending", ["release", "hold expires"])
@pytest.mark.parametrize("backing", ["memfd", "named"])
def test_nothing_is_left_after_a_final_stop(daemon_factory, backing, ending):
    d = daemon_factory(size="64MiB", backing=backing, extra='[restart]\nhold = "2s"' if ending != "release" else "")
    _put_kept(d)
    assert holder_pids(d.node) and (memfds(d.node) or backing == "named")
    d.stop()
    assert holder_pids(d.node), "the holder should keep the pool after the daemon's stop"
    if backing == "named":
        assert f"ecd.{d.node}.0" in shm_files(d.node)
    if ending == "release":
        d.release_pool()

    def nothing_left():
        return not holder_pids(d.node) and not shm_files(d.node) and not memfds(d.node) and not mapped(d.node)

    assert wait_for(nothing_left, timeout=15, interval=0.1), (
        f"left behind: holders {holder_pids(d.node)}, /dev/shm {shm_files(d.node)}, memfds {memfds(d.node)}, "
        f"mappings {mapped(d.node)}")


# ---- 4. a write cut by the restart ------------------------------------------------------------

MIB = 1 << 20
WRITE_TTL = 10.0  # the quarantine; long enough for the checks below on a loaded 2-vCPU machine


class Locations:
    """Where the entries a client reads lie: (pool, offset) from its gets' replies."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[int, int]] = {}

    def __call__(self, request, send):
        from ecd.protocol import Location
        reply = send(request)
        keys = getattr(request, "keys", None) or [getattr(request, "key", None)]
        for key, result in zip(keys, getattr(reply, "results", [])):
            if isinstance(result, Location):
                self.seen[key] = (result.pool, result.offset)
        return reply


def test_a_write_cut_by_a_restart_never_lands_on_an_entry(daemon_factory):
    from ecd.client.testing import intercept_round_trips
    d = daemon_factory(size="32MiB", extra=f'[leases]\nwrite_ttl = "{WRITE_TTL:g}s"')
    adopted = {f"a{i}": payload(f"a{i}", 0, MIB) for i in range(8)}
    with d.client() as c:
        for key, tensor in adopted.items():
            c.put(key, tensor)
    stale = subprocess.Popen([sys.executable, str(WRITER), "stale-put", d.endpoint, "cut", str(MIB)],
                             stdout=subprocess.PIPE, text=True)
    try:
        said = stale.stdout.readline().split()
        assert said[0] == "allocated", said
        extent = (int(said[1]), int(said[2]))
        assert wait_for(lambda: Path(f"/proc/{stale.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T")

        d.stop(signal.SIGKILL)
        d.start()
        restarted = time.monotonic()
        locations = Locations()
        # local_reads=False: each get asks the daemon where its entry is (the interceptor sees it)
        with d.client(local_reads=False) as c, intercept_round_trips(c, locations):
            stats = c.stats()
            assert stats["restart"]["adopted"] and stats["restart"]["entries"] == len(adopted)
            assert stats["restart"]["quarantined"] == 1
            assert entry_bytes(stats) == (len(adopted) + 1) * MIB  # the cut write's extent is held
            # Fill the pool while the extent is kept out of use: no entry is placed on it.
            free = stats["capacity_bytes"] - stats["used_bytes"]
            fill = {f"f{i}": payload(f"f{i}", 0, MIB) for i in range(free // MIB - 3)}  # room for reservations
            for key, tensor in fill.items():
                c.put(key, tensor)
            for key in [*adopted, *fill]:
                c.get(key)
            assert time.monotonic() - restarted < WRITE_TTL, "too slow to check within the quarantine"
            assert extent not in {locations.seen[k] for k in [*adopted, *fill]}
            # The cut writer goes on: it copies into the quarantined extent, then its commit
            # reaches the new daemon, which never gave out that generation.
            stale.send_signal(signal.SIGCONT)
            outcome = stale.stdout.readline().strip()
            print(f"the cut write's put: {outcome}")
            assert outcome == "ok" or outcome.startswith(("error StaleGeneration", "error DaemonUnavailable")), outcome
            assert time.monotonic() - restarted < WRITE_TTL, "too slow to check within the quarantine"
            for key, tensor in {**adopted, **fill}.items():
                assert digest(c.get(key)) == digest(tensor), f"{key} was overwritten by the cut write"
            if outcome == "ok":  # the client put it again, into another extent
                assert digest(c.get("cut")) == digest(payload("cut", 0, MIB))
            else:
                assert c.exists("cut") is False
            assert c.stats()["evictions"] == 0
            assert "free again" not in d.log()

            # After the write TTL the extent is free again, and the next put may take it.
            assert wait_for(lambda: "free again" in d.log(), timeout=WRITE_TTL + 10, interval=0.1)
            assert time.monotonic() - restarted >= WRITE_TTL * 0.9  # never before (the daemon's clock)
            stats = c.stats()
            live = len(adopted) + len(fill) + (outcome == "ok")
            assert entry_bytes(stats) == live * MIB, "the quarantined extent was not given back"
        with d.client(local_reads=False) as fresh, intercept_round_trips(fresh, locations):  # no reservation: an Alloc
            placed = []
            for i in range(3):
                fresh.put(f"after{i}", payload(f"after{i}", 0, MIB))
                fresh.get(f"after{i}")
                placed.append(locations.seen[f"after{i}"])
            assert extent in placed, (extent, placed)
            assert fresh.stats()["evictions"] == 0
            for key, tensor in {**adopted, **fill}.items():
                assert digest(fresh.get(key)) == digest(tensor)
    finally:
        stale.send_signal(signal.SIGCONT)
        stale.kill()
        stale.wait()


# ---- restart after restart, with evictions between ------------------------------------------

def test_restarts_in_a_row_keep_exactly_what_the_pool_held(daemon_factory):
    """Four restarts (SIGKILL and SIGTERM in turn), each after puts, replaces, deletes and
    evictions (a small pool) on the adopted pool and journal of the previous one: after each, the
    daemon holds exactly the keys it held before, each with its last bytes; an evicted key never
    comes back (its extent holds another entry's bytes by then)."""
    import random
    rng = random.Random(27)
    d = daemon_factory(size="24MiB")
    c = d.client()
    written: dict[str, str] = {}  # key -> digest of its last put
    version = 0
    try:
        for cycle in range(4):
            for _ in range(400):
                r = rng.random()
                key = f"k{rng.randrange(300)}"
                if r < 0.85:
                    version += 1
                    nbytes = rng.choice([rng.randint(1, 4096), rng.randint(4097, 200_000), rng.randint(200_001, 1_500_000)])
                    tensor = payload(key, version, nbytes)
                    c.put(key, tensor, checksum=rng.random() < 0.3)
                    written[key] = digest(tensor)
                else:
                    c.delete(key)
                    written.pop(key, None)
            held = {k for _, k in listed(c)}
            assert held <= set(written)
            evictions = c.stats()["evictions"]
            d.stop(signal.SIGKILL if cycle % 2 == 0 else signal.SIGTERM)
            d.start()
            stats = c.stats()
            assert stats["restart"]["adopted"] and stats["restart"]["entries"] == len(held), (cycle, stats["restart"])
            assert {k for _, k in listed(c)} == held, f"cycle {cycle}: other keys after the restart"
            for key in sorted(held):
                assert digest(c.get(key, verify=True)) == written[key], f"cycle {cycle}: {key} has other bytes"
            for key in set(written) - held:  # evicted: gone for good
                assert c.exists(key) is False
                written.pop(key)
            assert cycle == 0 or evictions > 0
    finally:
        c.close()


def test_a_write_cut_by_a_restart_with_a_full_journal_never_lands_on_an_entry(daemon_factory):
    """As above with the journal full (a 1 MiB journal, thousands of small entries) and a put of
    16 extents cut: their intents may not all fit, yet their client may still copy into every one
    after the restart: none may hold another entry meanwhile."""
    d = daemon_factory(size="32MiB", extra=f'[leases]\nwrite_ttl = "{WRITE_TTL:g}s"\n[restart]\njournal_size = "1MiB"')
    small: dict[str, str] = {}
    with d.client() as c:
        n = 0
        while c.stats()["restart"]["journal_full"] == 0:
            batch = {f"s{n + i}": payload(f"s{n + i}", 0, 1 + (n + i) % 200) for i in range(500)}
            c.put_many(batch)
            small.update({k: digest(t) for k, t in batch.items()})
            n += len(batch)
            assert n < 50_000, "the journal never filled"
    stale = subprocess.Popen([sys.executable, str(WRITER), "stale-put", d.endpoint, "cut", str(MIB // 4), "16"],
                             stdout=subprocess.PIPE, text=True)
    try:
        said = stale.stdout.readline().split()
        assert said[0] == "allocated", said
        assert wait_for(lambda: Path(f"/proc/{stale.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T")
        d.stop(signal.SIGKILL)
        d.start()
        restarted = time.monotonic()
        with d.client() as c:
            restart = c.stats()["restart"]
            assert restart["adopted"] and 0 < restart["entries"] < len(small), restart
            stats = c.stats()
            free = stats["capacity_bytes"] - stats["used_bytes"]
            fill = {f"f{i}": payload(f"f{i}", 0, MIB) for i in range(free // MIB - 3)}
            for key, tensor in fill.items():
                c.put(key, tensor)
            stale.send_signal(signal.SIGCONT)
            outcome = stale.stdout.readline().strip()
            print(f"the cut write's put: {outcome}; {restart}")
            assert time.monotonic() - restarted < WRITE_TTL, "too slow to check within the write TTL"
            got = c.get_many(list(fill), missing_ok=True)  # evicted ones aside (the fill's reservations)
            bad = [key for key, t in zip(fill, got) if t is not None and digest(t) != digest(fill[key])]
            assert not bad, f"{bad} were overwritten by the cut write (its extent was handed out at once)"
            assert sum(t is not None for t in got) > len(fill) // 2
            for key, got in zip(small, c.get_many(list(small), missing_ok=True)):
                assert got is None or digest(got) == small[key], f"{key} has other bytes"
    finally:
        stale.send_signal(signal.SIGCONT)
        stale.kill()
        stale.wait()
