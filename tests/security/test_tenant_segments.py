"""A sized tenant's bytes are its own (issue 44, item 2): its entries live in segments of its own
(memfds) and are announced on a ring of its own, and its clients' read slots and submission
pages lie in its first segment; the fd socket hands its clients those and a doorbell of their own,
and nothing else (no other tenant's segment, ring or doorbell), and a restart adopts each
tenant's segments apart. Real client processes
of other uids (tests/security/tenant_client.py) against real daemons; B's scan of everything it
can reach is in test_tenants.py (test_b_finds_nothing_of_a_s_bytes_in_the_pool_it_maps).

On main before this change every admitted client was handed every segment and the ring.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ecd import ControlClient
from ecd.config import load_config
from ecd.errors import ConfigError
from secutil import metric
from tenant_util import A_UID, B_UID, SIZE_MIB, SIZED, TENANT_CLIENT, TENANTS, run_as, start

MIB = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="clients of other uids are made by dropping root's "
                                                           "privileges: these tests need to run as root")


def handout(d, uid: int) -> list[list]:
    got = run_as(d.endpoint, uid, "fds", "kv")
    assert "items" in got, got
    return got["items"]


def test_each_sized_tenant_is_handed_its_own_segments_and_nothing_else(daemon_factory):
    d = daemon_factory(start=False)
    start(d, SIZED)
    a, b, default = handout(d, A_UID), handout(d, B_UID), handout(d, os.geteuid())
    assert {kind for kind, _ in a} == {"pool", "ring", "doorbell"} == {kind for kind, _ in b}, (a, b)  # its own
    assert {kind for kind, _ in default} == {"pool", "ring", "doorbell"}, default
    pools = [{index for kind, index in got if kind == "pool"} for got in (a, b, default)]
    assert pools[0] and pools[1] and pools[2], pools
    assert not (pools[0] & pools[1]) and not (pools[0] & pools[2]) and not (pools[1] & pools[2]), pools
    # its read slots and submission page lie in its own first segment: a put, a get and a view take
    # no Alloc, Commit or Acquire (the node's counts, while nothing else runs)
    local = run_as(d.endpoint, A_UID, "local", "kv", "block-0", 3)
    assert local["same"] is True and local["ops"] == {"alloc": 0, "acquire": 0, "commit": 0}, local
    assert local["read_slots"][0] == local["submissions"][0] == min(pools[0]) == min(local["pools"]), local
    assert set(local["pools"]) == pools[0], local
    # a tenant's ring is its own: its client reads what it can locate there with no request (no
    # Acquire), and nobody else's mappings name its namespace (the shared ring's entry index did)
    assert run_as(d.endpoint, A_UID, "put", "kv", "block-1", 1)["put"]
    checked = run_as(d.endpoint, A_UID, "check", "kv", "block-1", 1)
    assert checked["same"] is True and checked["acquires"] == 0, checked
    assert run_as(d.endpoint, A_UID, "scan", "kv", 77, "team-a")["name_found"] is True
    assert run_as(d.endpoint, B_UID, "scan", "kv", 77, "team-a")["name_found"] is False
    assert run_as(d.endpoint, os.geteuid(), "scan", "kv", 77, "team-a")["name_found"] is False
    mine = run_as(d.endpoint, A_UID, "probe", "kv", "block-1")
    assert mine["block-1"] == {"exists": True, "get": "hit", "view": "hit"}, mine
    assert run_as(d.endpoint, B_UID, "probe", "kv", "block-1")["block-1"]["get"] == "miss"
    # Stats shows a tenant's client its own segments' use and none of another tenant's
    with ControlClient(d.endpoint) as root:
        used = [u for _, u in root.stats()["pools"]]
    assert sum(used[i] for i in pools[0]) >= 1 << 20, used
    seen_by_b = run_as(d.endpoint, B_UID, "pools", "kv")["pools"]
    assert all(seen_by_b[i] == [0, 0] for i in pools[0]) and all(seen_by_b[i][0] > 0 for i in pools[1]), seen_by_b


def test_a_restart_adopts_each_tenant_s_entries_in_its_own_segments(daemon_factory):
    d = daemon_factory(start=False)
    start(d, SIZED.replace('"12MiB"', '"24MiB"'))
    assert run_as(d.endpoint, A_UID, "secret", "kv", "secret", 77)["put"]
    assert run_as(d.endpoint, B_UID, "put", "kv", "block-1", 5)["put"]
    d.stop()
    d.start()
    with ControlClient(d.endpoint) as root:
        restart = root.stats()["restart"]
    assert restart["adopted"] and restart["entries"] >= 2, restart
    assert run_as(d.endpoint, A_UID, "scan", "kv", 77)["found"] is True
    scan = run_as(d.endpoint, B_UID, "scan", "kv", 77)
    assert scan["mapped_bytes"] > 0 and scan["found"] is False, scan
    assert run_as(d.endpoint, B_UID, "check", "kv", "block-1", 5)["same"] is True


def test_a_sized_tenant_s_pins_hold_at_most_half_of_its_own_part(daemon_factory):
    """Pins keep entries only within `pinned_share` (0.5) of each part: A pinning everything its
    12 MiB part holds keeps 6 MiB of them, and its next puts find room (one budget for the whole
    pool, 32 MiB, let A's pins fill its part: its puts were refused, PoolFull)."""
    d = daemon_factory(start=False)
    start(d, SIZED)
    assert run_as(d.endpoint, A_UID, "pin-fill", "kv", "a", 12, 100)["pinned"] == 12
    assert run_as(d.endpoint, A_UID, "fill", "kv", "b", 4, 200)["refused"] == []
    kept = run_as(d.endpoint, A_UID, "survey", "kv", "a", 12, 100)
    assert kept["wrong"] == [] and 6 <= len(kept["intact"]) <= 8, kept
    assert metric(d, "ecd_pinned_bytes", pool="host", of="budget") == 20 * MIB  # half the default part (40 MiB)


def test_slots_naming_another_tenant_s_generations_hold_nothing_of_it(daemon_factory):
    """Generations are small integers: B (and a default-tenant client) write every slot of their
    read-slot pages with the generations A's entries will have. A then puts three times its size:
    its puts still evict its own oldest entries (before, the forged slots held them: PoolFull)."""
    d = daemon_factory(start=False)
    start(d, SIZED)
    forgers = [subprocess.Popen([sys.executable, str(TENANT_CLIENT), d.endpoint, str(uid), str(uid), "-",
                                 "forge-slots", "kv", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for uid in (B_UID, os.geteuid())]
    try:
        for forger in forgers:
            assert json.loads(forger.stdout.readline())["forged"] > 3 * SIZE_MIB, forger
        assert run_as(d.endpoint, A_UID, "fill", "kv", "a", 3 * SIZE_MIB, 100)["refused"] == []
        kept = run_as(d.endpoint, A_UID, "survey", "kv", "a", 3 * SIZE_MIB, 100)
        assert kept["wrong"] == [] and SIZE_MIB - 2 <= len(kept["intact"]) <= SIZE_MIB, kept
    finally:
        for forger in forgers:
            forger.stdin.close()
            forger.wait(timeout=30)


@pytest.mark.parametrize("change, reason", [
    ("rename", "the pool's tenants' segments were"),
    ("resize", "the pool was made with segments"),
])
def test_moving_a_tenant_s_segments_starts_the_pool_cold_saying_why(daemon_factory, change, reason):
    d = daemon_factory(start=False)
    start(d, SIZED)
    assert run_as(d.endpoint, A_UID, "put", "kv", "block-1", 1)["put"]
    d.stop()
    tables = (SIZED.replace("team-b", "team-c") if change == "rename"
              else SIZED.replace('size = "12MiB"', 'size = "8MiB"', 1))
    start(d, tables)
    assert reason in d.log(), d.log()[-3000:]
    with ControlClient(d.endpoint) as root:
        restart = root.stats()["restart"]
    assert not restart["adopted"] and restart["entries"] == 0, restart
    assert run_as(d.endpoint, A_UID, "probe", "kv", "block-1")["block-1"]["get"] == "miss"


@pytest.mark.parametrize("pool, tables, error", [
    ('size = "64MiB"\nbacking = "named"', SIZED, 'sizes need [pool.host] backing = "memfd"'),
    ('size = "64MiB"', SIZED.replace('"12MiB"', '"32MiB"'), "they must leave part of pool.host.size"),
])
def test_sizes_the_segments_cannot_honour_are_refused(pool, tables, error):
    import tomllib
    data = tomllib.loads(f'[pool.host]\n{pool}\n[control]\nendpoint = "ipc:///tmp/x.sock"\n' + tables)
    with pytest.raises(ConfigError) as refused:
        load_config(data)
    assert error in str(refused.value)
    load_config(tomllib.loads(f'[pool.host]\n{pool}\n[control]\nendpoint = "ipc:///tmp/x.sock"\n' + TENANTS))
