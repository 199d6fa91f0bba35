"""Views and pins held by read slots (memory/entry_index.py, client/local_read.view_slotted,
client/pins.py), between real processes: a view of a located entry asks the daemon nothing, and
the daemon keeps the extent of a viewed entry that is deleted until the view ends, by a store in
the slot or by the viewer's death; a pin asks nothing either, keeps its entry through eviction,
follows a replace (as a daemon pin) and goes with its session; a session's slots are bounded (the
rest asks, with leases), and slots a hostile client forges hold at most its own page's worth of
entries, while every other client keeps being served."""
from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import torch

import ecd
from actor import make_tensor
from conftest import Actor, entry_bytes
from ecd.protocol import Acquire, Location, Release

NUMEL = 64 * 1024  # 256 KiB of float32


def ops(c: ecd.Client) -> dict[str, int]:
    return {op: n for op, n in c.stats()["ops"].items() if op != "stats"}


def wait_for(condition, within: float = 5.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def actors():
    made: list[Actor] = []

    def make(endpoint: str) -> Actor:
        made.append(Actor(endpoint))
        return made[-1]

    yield make
    for actor in made:
        actor.kill()


def test_a_view_of_another_process_s_entry_asks_nothing_and_outlives_its_delete(daemon, actors):
    producer, viewer = actors(daemon.endpoint), actors(daemon.endpoint)
    assert producer.ask(f"put k 3 {NUMEL}") == "ok"
    with daemon.client() as c:
        before = ops(c)
        assert viewer.ask(f"view-hold k 3 {NUMEL}") == "holding"  # located through the entry index
        assert c.delete("k") is True
        stats = c.stats()
        assert stats["entries_retired"] == 1, stats  # the viewer's slot keeps the extent
        asked = {op: n - before.get(op, 0) for op, n in ops(c).items()}
        assert asked.get("acquire", 0) == 0, asked  # the view took no lease
        assert viewer.ask("drop") == "ok"  # a store in the slot (and a Report: its entry is gone)
        assert wait_for(lambda: c.stats()["entries_retired"] == 0), c.stats()
        assert entry_bytes(c.stats()) == 0  # the extent is free again


def test_a_killed_viewer_s_slots_go_with_its_session(daemon, actors):
    producer, viewer = actors(daemon.endpoint), actors(daemon.endpoint)
    assert producer.ask(f"put k 4 {NUMEL}") == "ok"
    assert viewer.ask(f"view-hold k 4 {NUMEL}") == "holding"
    with daemon.client() as c:
        assert c.delete("k") is True
        assert c.stats()["entries_retired"] == 1
        viewer.kill()  # SIGKILL: no store clears its slot; the daemon zeroes its page at the reclaim
        assert wait_for(lambda: c.stats()["entries_retired"] == 0), c.stats()
        assert entry_bytes(c.stats()) == 0  # the extent is free again


def test_a_session_whose_slots_are_all_held_takes_leases_for_the_rest(daemon_factory):
    d = daemon_factory(extra="[leases]\nread_slots = 4\n")
    with d.client() as c:
        for i in range(6):
            c.put(f"k{i}", make_tensor(i, 1024))
        before = ops(c)
        with contextlib.ExitStack() as stack:
            views = [stack.enter_context(c.view(f"k{i}")) for i in range(6)]
            assert all(torch.equal(v, make_tensor(i, 1024)) for i, v in enumerate(views))
            asked = {op: n - before.get(op, 0) for op, n in ops(c).items()}
            assert asked.get("acquire", 0) == 2, asked  # 4 slots, then 2 leased views
            assert c.stats()["read_leases"] == 6  # held either way
        assert c.stats()["read_leases"] == 0


def test_forged_slots_hold_one_page_at_most_and_others_keep_putting(daemon_factory):
    """A client writes its own page full of generations it never read, with deadlines far past
    max_pin: the daemon ignores the deadlines it could not have been given, and holds no more
    entries than the page has slots; everyone else's puts keep landing."""
    d = daemon_factory(size="16MiB", extra="[leases]\nread_slots = 8\n")
    with d.client() as hostile, d.client() as honest:
        for i in range(32):
            honest.put(f"k{i}", make_tensor(i, 64 * 1024))  # 256 KiB each: 8 MiB of 16
        generations = []
        for i in range(32):
            (loc,) = hostile.request(Acquire(0, hostile.namespace, [f"k{i}"], 0.0)).results
            assert isinstance(loc, Location)
            hostile.request(Release(0, [loc.generation]))
            generations.append(loc.generation)
        pool, offset, slots = hostile.welcome.ring.read_slots
        assert slots == 8
        page = np.frombuffer(hostile.mapping.rw[pool], np.uint64, count=slots * 2, offset=offset).reshape(slots, 2)
        page[:4, 1] = 0  # four views (held until cleared)
        page[4:, 1] = time.monotonic_ns() + int(1e6 * 1e9)  # four pins far past max_pin: not honoured
        page[:, 0] = generations[:8]
        for i in range(200):  # 50 MiB through a 16 MiB pool: every old entry must go but the held ones
            honest.put(f"new{i}", make_tensor(i, 64 * 1024))
        kept = [honest.exists(f"k{i}") for i in range(32)]
        assert kept[:4] == [True] * 4, kept  # the forged views hold their entries
        assert not any(kept[4:]), kept  # and nothing else: the forged pins, the rest
        page[:] = 0


def fill(c: ecd.Client, mib: int, prefix: str = "fill") -> None:
    """Put `mib` MiB of new entries: everything evictable in a small pool goes."""
    for i in range(mib * 4):
        c.put(f"{prefix}{i}", make_tensor(i, 64 * 1024))


def test_a_pin_asks_nothing_and_keeps_another_process_s_entry_until_its_pinner_dies(daemon_factory, actors):
    d = daemon_factory(size="16MiB")
    producer, pinner = actors(d.endpoint), actors(d.endpoint)
    assert producer.ask(f"put k 5 {NUMEL}") == "ok"
    assert producer.ask(f"put other 6 {NUMEL}") == "ok"
    with d.client() as c:
        before = ops(c)
        assert pinner.ask("pin 60 k") == "ok True"  # located through the entry index
        asked = {op: n - before.get(op, 0) for op, n in ops(c).items()}
        assert asked.get("exists", 0) == 0, asked
        assert c.stats()["pins"] == 1
        fill(c, 48)  # 48 MiB through 16: "other" goes, the pinned "k" stays
        assert c.exists(["k", "other"]) == [True, False]
        pinner.kill()  # SIGKILL: the daemon zeroes its page at the reclaim
        assert wait_for(lambda: c.stats()["pins"] == 0), c.stats()
        fill(c, 48, "again")
        assert c.exists("k") is False


def test_a_slot_pin_follows_a_replace_as_a_daemon_pin_until_unpinned(daemon_factory):
    d = daemon_factory(size="16MiB")
    with d.client() as producer, d.client() as pinner:
        producer.put("k", make_tensor(1, 64 * 1024))
        before = ops(producer)
        assert pinner.exists("k", pin_s=60) is True
        producer.put("k", make_tensor(2, 64 * 1024))  # the pin moves to the new generation
        fill(producer, 48)
        assert torch.equal(pinner.get("k"), make_tensor(2, 64 * 1024))  # kept through the eviction
        assert pinner.unpin("k") is True  # the daemon is told its pin moved (no reply awaited)
        pinner.ping()  # handled after that message
        asked = {op: n - before.get(op, 0) for op, n in ops(producer).items()}
        assert asked.get("exists", 0) == 0 and asked.get("unpin", 0) == 1, asked
        assert wait_for(lambda: producer.stats()["pins"] == 0), producer.stats()
        fill(producer, 48, "again")
        assert producer.exists("k") is False


def test_a_restart_hands_the_slot_pins_to_the_new_daemon(daemon_factory):
    """The new run clears the old run's slot area (pins are not carried in it): a client whose
    pins were slots sends them as daemon pins, for the time they have left, with its new Hello."""
    d = daemon_factory(size="16MiB")
    with d.client() as pinner:
        pinner.put("k", make_tensor(1, 64 * 1024))
        assert pinner.exists("k", pin_s=60) is True
        assert pinner.stats()["pins"] == 1
        d.stop()
        d.start()
        assert pinner.stats()["restart"]["adopted"]  # the client reconnects: a new session, a new page
        pinner.ping()  # the pins it handed over were sent before this
        assert pinner.stats()["pins"] == 1
        with d.client() as other:
            fill(other, 48)
            assert other.exists("k") is True  # kept by the daemon pin
        assert pinner.unpin("k") is True  # no slot holds it now: the daemon's pin goes
        assert pinner.stats()["pins"] == 0


def test_forged_pin_slots_keep_no_more_than_the_pin_budget(daemon_factory):
    """A client writes its whole page with pins (valid deadlines) of 2 MiB entries it never
    pinned honestly: the plan keeps them only within the pin budget (half of the 16 MiB pool), so
    the honest client's puts keep landing, and its own pin, smaller, is kept first."""
    d = daemon_factory(size="16MiB", extra="[leases]\nread_slots = 8\n")
    with d.client() as hostile, d.client() as honest:
        for i in range(7):
            honest.put(f"big{i}", make_tensor(i, 512 * 1024))  # 2 MiB each
        honest.put("mine", make_tensor(9, 64 * 1024))
        generations = []
        for i in range(7):
            (loc,) = hostile.request(Acquire(0, hostile.namespace, [f"big{i}"], 0.0)).results
            hostile.request(Release(0, [loc.generation]))
            generations.append(loc.generation)
        pool, offset, slots = hostile.welcome.ring.read_slots
        page = np.frombuffer(hostile.mapping.rw[pool], np.uint64, count=slots * 2, offset=offset).reshape(slots, 2)
        page[:7, 1] = time.monotonic_ns() + int(60 * 1e9)
        page[:7, 0] = generations
        assert honest.exists("mine", pin_s=60) is True
        for i in range(100):  # 25 MiB of new entries through the 16 MiB pool
            honest.put(f"new{i}", make_tensor(i, 64 * 1024))
        kept = [honest.exists(f"big{i}") for i in range(7)]
        assert sum(kept) == 3, kept  # 8 MiB budget: the 256 KiB pin, then three of the 2 MiB ones
        assert honest.exists("mine") is True
        page[:] = 0
