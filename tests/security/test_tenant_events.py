"""KV events per tenant (issue 44, item 5): a tenant's entries are published on topics of its own,
"@TENANT/" before the configured `topic` and `encoder_topic`, numbered and replayed apart; the
default tenant's keep the configured names. So a router of tenant A, subscribed to A's topics,
sees nothing of B's blocks (and a vLLM router on the plain "kv" topic nothing of either). The
puts come from client processes of the tenants' uids (tests/security/tenant_client.py).

On main before this change every tenant's blocks went out on "kv": A's router saw B's.
"""
from __future__ import annotations

import os
import shutil

import pytest

from ecd.errors import ConfigError
from kv_events import Subscriber, event_dir, events_config, replay, stored
from tenant_util import A_UID, B_UID, TENANTS, run_as, start

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="clients of other uids are made by dropping root's "
                                                           "privileges: these tests need to run as root")


@pytest.fixture
def evdir():
    path = event_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_each_tenant_s_blocks_go_on_its_own_topics(daemon_factory, evdir):
    d = daemon_factory(start=False)
    start(d, TENANTS + events_config(evdir))
    # each subscriber also takes the default's "kv", so that it can be seen to be connected
    subs = {who: Subscriber(evdir, (topic, b"kv")) for who, topic in
            (("a", b"@team-a/kv"), ("b", b"@team-b/kv"), ("plain", b"kv"))}
    try:
        with d.client() as root:
            for sub in subs.values():
                sub.connect_with(root)
            assert run_as(d.endpoint, A_UID, "put", "kv", "block-a", 1)["put"]
            assert run_as(d.endpoint, B_UID, "put", "kv", "block-b", 2)["put"]
            root.put("block-root", __import__("torch").zeros(4))
            for who, mine in (("a", b"block-a"), ("b", b"block-b"), ("plain", b"block-root")):
                topic = {"a": b"@team-a/kv", "b": b"@team-b/kv", "plain": b"kv"}[who]
                subs[who].wait_for(lambda ev, mine=mine: stored(ev, mine) != [], topic=topic)
            for sub in subs.values():
                sub.poll(0.5)  # whatever else was coming
        seen = {who: {h for e in sub.events() for h in e.get("block_hashes", [])} for who, sub in subs.items()}
        assert b"block-a" in seen["a"] and not {b"block-b"} & seen["a"], seen["a"]
        assert b"block-b" in seen["b"] and not {b"block-a"} & seen["b"], seen["b"]
        assert b"block-root" in seen["plain"] and not {b"block-a", b"block-b"} & seen["plain"], seen["plain"]
        assert {t for t, _, _ in subs["a"].received} == {b"@team-a/kv", b"kv"}

        # a tenant's topic is numbered and replayed on its own: A's replay holds A's block only
        replayed = replay(evdir, 0, [b"@team-a/kv"])
        assert {t for t, _, _ in replayed} == {b"@team-a/kv"}
        hashes = {h for _, _, batch in replayed for e in batch[1] for h in e.get("block_hashes", [])}
        assert b"block-a" in hashes and b"block-b" not in hashes and b"block-root" not in hashes, hashes
        assert subs["a"].seqs(b"@team-a/kv")[-1] == replayed[-1][1]
    finally:
        for sub in subs.values():
            sub.close()


def test_a_configured_topic_may_not_look_like_a_tenant_s():
    from ecd.config import load_config
    with pytest.raises(ConfigError, match="events.topic: may not start with '@'"):
        load_config({"events": {"publish": "ipc:///tmp/x-pub", "topic": "@team-a/kv"}})
