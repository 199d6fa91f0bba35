"""The KV engine tests' prompts, sampling, reference run and comparisons (test_kv_engines.py,
test_kv_engine_faults.py, test_peer_kv_engines.py): four prompts (two sharing a two-block prefix,
one of five blocks, one shorter than a block), and the monolithic engine's output they must give."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine_runner import LLM_DEFAULTS, run_engine

BLOCK = LLM_DEFAULTS["block_size"]
# The byte tokenizer makes one token per character (plus <s>): these sizes are in tokens.
SHARED = "Disaggregated serving splits prefill from decode; ecd keeps the blocks in between. "  # 84
PROMPTS = [
    SHARED + "The decode engine loads every full block of this prompt from the daemon.",  # 4 blocks
    SHARED + "A second prompt shares the first two blocks with the one before it, then differs.",
    "An unrelated prompt, long enough for several blocks of thirty-two tokens each, so that a "
    "load covers more than one entry and the chained hashes of its blocks differ from the rest.",
    "Short: no full block.",  # nothing to store or load, the connector must leave it alone
]
GENERATE = {"max_tokens": 16, "temperature": 0.0, "logprobs": 1, "ignore_eos": True}
PREFILL = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
LOGPROB_TOLERANCE = 1e-5
# A request whose pull from a peer failed is recomputed once its own pull settles, so it may be
# batched with other requests than in the monolithic run, and vLLM's CPU kernels (bf16) are not
# batch-invariant: the same tokens, logprobs off in the second decimal (0.027 seen in CI).
RESCHEDULED_LOGPROB_TOLERANCE = 0.1


def generate(prompts=PROMPTS):
    return {"prompts": list(prompts), "sampling": GENERATE}


def prefill(prompts=PROMPTS):
    return {"prompts": list(prompts), "sampling": PREFILL}


def loadable_tokens(output: dict) -> int:
    """What a decode engine should load: every full block but the one holding the last token
    (vLLM always computes the last prompt token itself)."""
    return (len(output["prompt_token_ids"]) - 1) // BLOCK * BLOCK


def distinct_blocks(outputs: list[dict], tokens_of=lambda o: len(o["prompt_token_ids"])) -> set[tuple]:
    """The distinct prefixes ending at a block boundary within `tokens_of(output)` tokens: one
    entry each in ecd (a prefix shared by prompts is one entry)."""
    return {tuple(o["prompt_token_ids"][:(i + 1) * BLOCK]) for o in outputs for i in range(tokens_of(o) // BLOCK)}


def assert_same_generation(outputs: list[dict], reference: list[dict],
                           logprob_tolerance: float = LOGPROB_TOLERANCE) -> None:
    for out, ref in zip(outputs, reference, strict=True):
        assert out["token_ids"] == ref["token_ids"], f"tokens differ for {out['prompt'][:40]!r}"
        worst = max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"], strict=True))
        assert worst <= logprob_tolerance, f"logprobs differ by {worst:g} for {out['prompt'][:40]!r}"


# The reference outputs by checkpoint name ("llama-seed1"): each module that imports the fixture
# has a session fixture of its own, and the engine run (~40-60 s) is the same for all of them (the
# same seeded weights, the same prompts), so a test worker runs it once.
_REFERENCES: dict[str, list[dict]] = {}


@pytest.fixture(scope="session")
def monolithic(tiny_llama, engine_workdir) -> list[dict]:
    """The reference: one engine, no connector, the same prompts. Run once per test worker."""
    name = Path(tiny_llama).name
    if name in _REFERENCES:
        return _REFERENCES[name]
    result = run_engine(tiny_llama, [generate()], workdir=engine_workdir)
    outputs = result["batches"][0]
    # Sanity of the reference itself: the model depends on its prompt (distinct prompts, distinct
    # continuations), else matching it would prove nothing.
    assert len({tuple(o["token_ids"]) for o in outputs}) == len(outputs)
    assert all(len(o["token_ids"]) == GENERATE["max_tokens"] for o in outputs)
    _REFERENCES[name] = outputs
    return outputs
