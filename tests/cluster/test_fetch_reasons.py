"""A fetch says why, per key: Client.fetch_detailed() (fetch() keeps answering bools), carried by
the Flags reply's trailing `reasons`, which daemons and clients of either age skip or default."""
from __future__ import annotations

import signal

import msgspec
import torch
from peerutil import cluster  # noqa: F401 - the fixture

from ecd import FetchOutcome
from ecd.protocol import Flags, encoder, reply_decoder


def test_missing_key_and_a_down_peer_say_why(cluster):
    a, b = cluster(2)
    with a.client() as ca, b.client() as cb:
        ca.put("x", torch.arange(8))
        out = cb.fetch_detailed(["x", "nope"], peer=a.peer_endpoint, timeout=10)
        assert [(o.key, o.local, o.reason) for o in out] == [("x", True, ""), ("nope", False, "not_found")]
        assert [bool(o) for o in out] == [True, False] and out[1].message == "no peer asked holds it"
        # the bool API is unchanged, and a key already local is local
        assert cb.fetch(["x", "nope"], peer=a.peer_endpoint, timeout=10) == [True, False]
        assert cb.fetch_detailed("x", peer=a.peer_endpoint, timeout=10) == FetchOutcome("x", True, "")
        # configured peers (no peer named): the same reasons
        assert cb.fetch_detailed("nope", timeout=10).reason == "not_found"

        ca.put("y", torch.arange(4))
        a.stop(signal.SIGKILL)
        down = cb.fetch_detailed("y", peer=a.peer_endpoint, timeout=3)
        assert not down and down.reason == "timeout", down
        assert "within the fetch's timeout" in down.message
        assert cb.stats()["fetch_failures"].get("timeout", 0) >= 1


def test_reasons_are_a_trailing_field_with_a_default():
    dec = reply_decoder()
    # an older daemon's Flags (no reasons) decodes with none; the client then says "unknown"
    assert dec.decode(msgspec.msgpack.encode(["flags", 4, [True, False]])) == Flags(4, [True, False], [])

    class OldFlags(msgspec.Struct, array_like=True, tag="flags"):
        id: int
        values: list[bool]

    # a newer daemon's reasons are skipped by an older client
    old = msgspec.msgpack.decode(encoder.encode(Flags(5, [False], ["timeout"])), type=OldFlags)
    assert old.values == [False]
