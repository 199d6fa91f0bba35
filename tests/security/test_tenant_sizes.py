"""A tenant's size (issue 44, item 4): `[tenants.NAME] size` is its part of the pool, its quota
and its guaranteed share at once. A tenant filling past its size evicts its own least recently
used entries and nobody else's; no other tenant's put (nor the default tenant's, which has what
the sizes leave) evicts it below its size. Real client processes of other uids
(tests/security/tenant_client.py) against a real daemon.

On main before this change `size` was an unknown key: the daemon refused the config.
"""
from __future__ import annotations

import os

import pytest
import torch

from ecd import Client
from ecd.config import load_config
from ecd.errors import ConfigError, InvalidRequest
from secutil import metric
from tenant_util import A_UID, B_UID, SIZE_MIB, SIZED, TENANTS, run_as, start

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="clients of other uids are made by dropping root's "
                                                           "privileges: these tests need to run as root")

MIB = 1 << 20
# (entries are 1 MiB: tenant_client.pattern)


def survey(d, uid: int, prefix: str, n: int, seed: int) -> list[int]:
    seen = run_as(d.endpoint, uid, "survey", "kv", prefix, n, seed)
    assert seen["wrong"] == [], seen  # never another entry's bytes under a key
    return seen["intact"]


def test_a_tenant_over_its_size_evicts_only_its_own_and_nobody_evicts_it_below(daemon_factory):
    d = daemon_factory(start=False)
    start(d, SIZED)

    # B stores a few; A then puts three times its size: every put succeeds, A's oldest go
    assert run_as(d.endpoint, B_UID, "fill", "kv", "b", 6, 500)["refused"] == []
    assert run_as(d.endpoint, A_UID, "fill", "kv", "a", 3 * SIZE_MIB, 100)["refused"] == []
    kept = survey(d, A_UID, "a", 3 * SIZE_MIB, 100)
    assert SIZE_MIB - 2 <= len(kept) <= SIZE_MIB and kept == list(range(3 * SIZE_MIB - len(kept), 3 * SIZE_MIB)), kept
    assert survey(d, B_UID, "b", 6, 500) == list(range(6))  # none of B's went for A's size
    assert metric(d, "ecd_tenant_used_bytes", tenant="team-a") <= SIZE_MIB * MIB
    assert metric(d, "ecd_tenant_size_bytes", tenant="team-a") == SIZE_MIB * MIB
    assert metric(d, "ecd_evictions_total", reason="quota") >= 2 * SIZE_MIB

    # the default tenant (the daemon's own uid) floods the whole pool: it evicts its own, never
    # a tenant's entries below that tenant's size
    with Client(d.endpoint, namespace="kv", timeout=30.0) as root:
        for i in range(80):
            root.put(f"flood-{i}", torch.full((MIB // 4,), float(i)))
        assert not root.exists("flood-0") and root.exists("flood-79")
    assert survey(d, A_UID, "a", 3 * SIZE_MIB, 100) == kept
    assert survey(d, B_UID, "b", 6, 500) == list(range(6))

    # an entry larger than the size itself: refused, the reason naming the tenant (as its clients
    # know it), and nothing of A's evicted for it (it could never fit in A's segments)
    big = run_as(d.endpoint, A_UID, "put-big", "kv", "huge", SIZE_MIB + 1)
    assert big["error"] == InvalidRequest.__name__, big
    assert "larger than the largest of tenant 'team-a''s segments" in big["message"], big
    assert "\0" not in big["message"], big
    assert survey(d, A_UID, "a", 3 * SIZE_MIB, 100) == kept


def test_a_reload_that_would_not_add_up_with_the_sizes_it_cannot_change_is_refused(daemon_factory):
    """A size changes at a restart only: a SIGHUP whose file lowers team-a's size and gives a
    namespace a guaranteed share that fits only beside the lowered size is refused whole (the
    running sizes and the new share would add up to more than the pool)."""
    import signal

    from secutil import wait_for, write_node_toml
    d = daemon_factory(start=False)
    start(d, SIZED)
    lowered = SIZED.replace(f'size = "{SIZE_MIB}MiB"', 'size = "1MiB"', 1)
    write_node_toml(d, tables=lowered + '[namespaces.big]\nguaranteed = "48MiB"\n')
    d.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "SIGHUP: not reloading" in d.log(), timeout=10), d.log()
    assert "guaranteed shares and tenant sizes add up to" in d.log()
    assert metric(d, "ecd_tenant_size_bytes", tenant="team-a") == SIZE_MIB * MIB
    assert metric(d, "ecd_namespace_guaranteed_bytes", namespace="big") == 0


@pytest.mark.parametrize("tables, error", [
    (TENANTS + '[tenants.default]\nsize = "1MiB"\n', "tenants.default.size: none: it has what the other tenants leave"),
    (TENANTS.replace("[tenants.team-b]", 'size = "1000"\n[tenants.team-b]'), "tenants.team-a.size: must be a multiple"),
    (TENANTS.replace("[tenants.team-b]", 'size = "24MiB"\n[tenants.team-b]') + 'size = "24MiB"\n'
     + '[namespaces.kv]\nguaranteed = "20MiB"\n',
     "tenants: guaranteed shares and tenant sizes add up to 71303168 bytes, more than pool.host.size"),
    (TENANTS.replace("[tenants.team-b]", 'size = "40MiB"\n[tenants.team-b]') + 'size = "40MiB"\n',
     "tenants: sizes add up to 83886080 bytes: they must leave part of pool.host.size"),
])
def test_bad_tenant_sizes_are_refused_with_the_reason(tables, error):
    import tomllib
    data = tomllib.loads('[pool.host]\nsize = "64MiB"\n[control]\nendpoint = "ipc:///tmp/x.sock"\n' + tables)
    with pytest.raises(ConfigError) as refused:
        load_config(data)
    assert error in str(refused.value)
