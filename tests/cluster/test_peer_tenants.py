"""A fetch from a peer daemon is its tenant's (issue 44, item 5): both nodes name the same
tenants; a client's Fetch names its tenant's stored namespace (TENANT NUL NAME, as its every
request does), so the owner serves only that tenant's entry. Client processes of the tenants'
uids (tests/security/tenant_client.py) on two real daemons joined by the peer plane.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from peerutil import cluster  # noqa: F401 - the fixture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "security"))
from tenant_util import A_UID, B_UID, TENANTS, run_as  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="clients of other uids are made by dropping root's "
                                                           "privileges: these tests need to run as root")


def test_a_tenant_fetches_its_own_entries_from_a_peer_and_no_other_tenant_does(cluster):
    a, b = cluster(2, other=TENANTS)
    assert run_as(a.endpoint, A_UID, "put", "kv", "blk", 5)["put"]
    # B's process on the other node names the same namespace and key: B's namespace, a miss
    other = run_as(b.endpoint, B_UID, "fetch", "kv", a.peer_endpoint, "blk", 5)
    assert other == {"uid": B_UID, "tenant": "team-b", "fetched": False}, other
    with b.client(namespace="kv") as root:  # the default tenant too
        assert root.fetch(["blk"], peer=a.peer_endpoint, timeout=20) == [False]
    # A's own process there gets A's bytes
    mine = run_as(b.endpoint, A_UID, "fetch", "kv", a.peer_endpoint, "blk", 5)
    assert mine == {"uid": A_UID, "tenant": "team-a", "fetched": True, "same": True}, mine
    assert run_as(b.endpoint, B_UID, "probe", "kv", "blk")["blk"]["get"] == "miss"
