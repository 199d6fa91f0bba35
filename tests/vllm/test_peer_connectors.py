"""ecd's vLLM connectors across nodes (issue 14): two real `ecd serve` daemons peered on 127.0.0.1
(tests/cluster/peerutil.py), real vLLM 0.33 classes. The KV producer's kv_transfer_params, the
consumer's fetch of them through its own daemon (get_num_new_matched_tokens answers None while it
runs), the failure paths (dead owner, foreign params), and the EC consumer's fetch_from_peers."""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from vllm_env import SKIP_REASON, tiny_model_dir  # noqa: F401 (fixture)

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
if getattr(vllm, "__file__", None) is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cluster"))
from peerutil import cluster  # noqa: E402,F401 - the fixture
from test_ec_connector import SCHEDULER, encoder_output, make_connector  # noqa: E402
from test_kv_connector import BS, LAYERS, Engine, make_request, tokens  # noqa: E402

from ecd.integrations.vllm.kv_peers import advertised_endpoint, remote_source  # noqa: E402

ASK = {"do_remote_decode": True, "do_remote_prefill": False}


def peer_totals(daemon) -> dict[str, int]:
    with daemon.client() as client:
        peers = client.stats()["peers"]
    return {k: sum(p[k] for p in peers) for k in ("fetched_entries", "served_entries", "failures")}


def produce(model_dir, a, prompt):
    """A kv_producer engine on daemon A prefills `prompt` for a remote decode: its params."""
    producer = Engine(model_dir, a.endpoint, kv_role="kv_producer")
    request = make_request("p", prompt)
    request.kv_transfer_params = dict(ASK)
    step = producer.prefill(request)
    delay, params = producer.scheduler.request_finished(request, step.block_ids)
    assert delay is False
    return producer, step, params


def matched(engine: Engine, request, timeout: float = 20.0) -> tuple[int, int, float]:
    """Ask like vLLM's scheduler, each step, until the connector decides: (tokens, Nones, s)."""
    start, nones = time.monotonic(), 0
    while True:
        n, asynchronous = engine.scheduler.get_num_new_matched_tokens(request, 0)
        assert asynchronous is False
        if n is not None:
            return n, nones, time.monotonic() - start
        nones += 1
        assert time.monotonic() - start < timeout
        time.sleep(0.005)


def test_params_name_the_producer_and_its_blocks(cluster, tiny_model_dir):
    a, b = cluster(2)
    prompt = tokens(1, 5 * BS + 3)
    _, _, params = produce(tiny_model_dir, a, prompt)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["ecd_node"] == a.node and params["ecd_peer"] == a.peer_endpoint
    assert params["ecd_blocks"] == 5
    assert remote_source(params) == (a.peer_endpoint, 5, params["ecd_last_key"])
    # A request that did not ask for a remote decode gets none; nor a prompt without a full block.
    producer = Engine(tiny_model_dir, a.endpoint, kv_role="kv_producer")
    plain = make_request("plain", tokens(2, 2 * BS + 1))
    producer.prefill(plain)
    assert producer.scheduler.request_finished(plain, [])[1] is None
    short = make_request("short", tokens(3, BS - 1))
    short.kv_transfer_params = dict(ASK)
    producer.prefill(short)
    assert producer.scheduler.request_finished(short, [])[1] is None


def test_decode_on_another_node_fetches_then_loads_bit_identical(cluster, tiny_model_dir):
    a, b = cluster(2)
    prompt = tokens(4, 4 * BS + 5)
    producer, p_step, params = produce(tiny_model_dir, a, prompt)
    consumer = Engine(tiny_model_dir, b.endpoint, kv_role="kv_consumer")
    request = make_request("d", prompt)
    request.kv_transfer_params = params
    n, nones, seconds = matched(consumer, request)
    assert nones >= 1  # the scheduler was told to come back while the blocks crossed over
    assert n == 4 * BS
    step = consumer.prefill(request)  # asks once more (settled: no second fetch), loads
    assert step.matched == 4 * BS and not step.errors
    for layer in LAYERS:
        for x, y in zip(p_step.block_ids[:4], step.block_ids[:4]):
            assert producer.block(layer, x).view(-1).equal(consumer.block(layer, y).view(-1))
    assert peer_totals(b)["fetched_entries"] == 4
    consumer.scheduler.request_finished(request, step.block_ids)
    print(f"fetch of 4 blocks settled in {seconds * 1000:.1f} ms after {nones} None answers")


def test_dead_owner_or_foreign_params_are_a_miss_never_an_exception(cluster, tiny_model_dir):
    a, b = cluster(2)
    prompt = tokens(5, 3 * BS + 1)
    _, _, params = produce(tiny_model_dir, a, prompt)
    consumer = Engine(tiny_model_dir, b.endpoint, kv_role="kv_consumer", fetch_timeout_s=2.0)
    # Params for other blocks (another model, namespace...): not fetched, decided at once.
    foreign = make_request("foreign", prompt)
    foreign.kv_transfer_params = {**params, "ecd_last_key": "00" * 32}
    assert consumer.scheduler.get_num_new_matched_tokens(foreign, 0) == (0, False)
    # The owner killed between prefill and decode: the fetch fails within its bounds; a miss.
    assert a.stop(signal.SIGKILL) != 0
    request = make_request("d", prompt)
    request.kv_transfer_params = params
    n, _, seconds = matched(consumer, request)
    assert n == 0 and seconds < 2.0 + 2.0 + 1.0  # fetch_timeout_s + load_timeout_s, and slack
    step = consumer.prefill(request)
    assert step.matched == 0 and not step.errors


def test_same_node_params_need_no_fetch(cluster, tiny_model_dir):
    a, _ = cluster(2)
    prompt = tokens(6, 2 * BS + 1)
    _, _, params = produce(tiny_model_dir, a, prompt)
    consumer = Engine(tiny_model_dir, a.endpoint, kv_role="kv_consumer")
    consumer.scheduler.get_num_new_matched_tokens(make_request("warm", tokens(7, 4)), 0)  # learns its node
    request = make_request("d", prompt)
    request.kv_transfer_params = params
    assert consumer.scheduler.get_num_new_matched_tokens(request, 0) == (2 * BS, False)


def test_advertised_endpoint():
    assert advertised_endpoint("tcp://10.0.0.5:7000") == "tcp://10.0.0.5:7000"
    assert advertised_endpoint("tcp://0.0.0.0:7000") == ""
    assert advertised_endpoint("") == ""


def test_ec_consumer_finds_an_item_encoded_on_another_node(cluster, tiny_model_dir):
    a, b = cluster(2)
    on = make_connector(tiny_model_dir, "ec_consumer", SCHEDULER, endpoint=b.endpoint, fetch_from_peers=True,
                        fetch_timeout_s=3.0)
    embedding = encoder_output(16, 256, seed=1)
    with a.client(namespace=on.namespace) as ca:
        ca.put("h-remote", embedding)
    assert make_connector(tiny_model_dir, "ec_consumer", SCHEDULER, endpoint=b.endpoint
                          ).has_cache_item("h-remote") is False  # default: this node only
    t0 = time.monotonic()
    assert on.has_cache_item("h-remote") is True
    assert on.has_cache_item("h-absent") is False
    assert time.monotonic() - t0 < 3.0
    assert peer_totals(b)["fetched_entries"] == 1
    with b.client(namespace=on.namespace) as cb:  # the worker's load then reads it locally
        assert cb.get("h-remote").view(-1).equal(embedding.view(-1))
        # found, not scheduled yet: a hit is pinned by the step that schedules its load
        assert cb.stats()["pins"] == 0
    on.shutdown()
