"""Run one real vLLM engine in a fresh Python process and return its outputs as JSON.

Each engine of a test runs in its own process, as engines do in a deployment: nothing (prefix
cache, connector state, a Client) can leak from one engine to the next. `run_engine(...)` writes a
spec file, starts `python engine_runner.py SPEC OUT` with the environment vLLM's CPU build needs,
waits, and returns what the child wrote:

    {"batches": [[{"prompt", "token_ids", "logprobs", "num_cached_tokens", "text"}, ...], ...],
     "stderr": "...", "seconds": {"start": s, "batches": [s, ...]}}

The spec is general: a model path, LLM(...) keyword arguments (kv_transfer_config /
ec_transfer_config dicts included), batches of prompts (a string, a token id list, or a dict as
vLLM's `generate` takes it, e.g. {"prompt": ..., "multi_modal_data": ...} where the data is
JSON-able) and SamplingParams keyword arguments per batch; `"kv_transfer_params": [dict or null per prompt]` in a batch passes them as vLLM's P/D proxy does
(SamplingParams.extra_args; each output reports the engine's own); `"reset_prefix_cache": true` in a
batch empties the engine's own prefix cache first, so its prompts are computed or loaded anew.
A prompt {"prompt": text, "image_seed": n} carries mm_engine.make_image(n) as its image (a PIL
image is not JSON). With `"disable_log_stats": false` in llm_kwargs each output also carries
vLLM's per-request "metrics" (first_token_latency: TTFT from arrival, seconds; engine-core
timestamps), "seconds" the monotonic start of each batch ("batch_starts"), and the result's
"ecd_metrics" vLLM's own Prometheus counters of ecd's connectors (`vllm:ecd_*`, summed over labels). For a hand-off
decided at run time (NIXL's, whose parameters come from the producer's outputs) a batch may name
`"kv_transfer_params_file"` (JSON, a list as for "kv_transfer_params", read when the batch starts)
and `"publish": true` writes that batch's outputs to `OUT.batch.N.json` as soon as it is done.

Between batches the child can stop and wait for the test (`pause_before`: batch indices): it
creates `OUT.paused.N`, waits for `OUT.go.N`, then runs batch N. A test uses that to change the
world (restart the daemon, run another engine) while this engine stays up.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# What vLLM's CPU build needs (issue 13): KV cache space in GiB (its default of 4 GiB per engine
# would be wasted here), threads bound automatically ("all" fails on small VMs), and no network.
ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# LLM(...) defaults for the tiny test models: block size a multiple of 32 (vLLM's CPU attention
# requires it), eager mode (no torch.compile: engine start-up in seconds, not minutes).
LLM_DEFAULTS: dict[str, Any] = {
    "block_size": 32,
    "max_model_len": 1024,
    "max_num_seqs": 16,
    "enforce_eager": True,
    "seed": 0,
}


class EngineFailed(RuntimeError):
    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(f"{message}\n---- engine stderr (tail) ----\n{stderr[-6000:]}")
        self.stderr = stderr


class EngineProcess:
    """A started engine child: `wait_paused(n)`, `resume(n)`, `result()`."""

    def __init__(self, spec: dict[str, Any], workdir: Path, env: dict[str, str] | None, timeout: float) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="engine-", dir=workdir))
        self.spec_path = self.workdir / "spec.json"
        self.out_path = self.workdir / "out.json"
        self.stderr_path = self.workdir / "stderr.log"
        self.spec_path.write_text(json.dumps(spec))
        child_env = {**os.environ, **ENGINE_ENV, **(env or {})}
        # The child imports ecd from this checkout and test connectors from here (vLLM loads a
        # connector by module path, in the engine core and worker processes it spawns).
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(HERE), child_env.get("PYTHONPATH"))
                                                  if p)
        self.deadline = time.monotonic() + timeout
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(self.spec_path),
                                      str(self.out_path)], stdout=self._stderr, stderr=subprocess.STDOUT,
                                     env=child_env, cwd=self.workdir, start_new_session=True)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def _wait_for(self, path: Path, what: str) -> None:
        while not path.exists():
            if self.proc.poll() is not None and not path.exists():
                raise EngineFailed(f"engine exited with {self.proc.returncode} before {what}", self.stderr())
            if time.monotonic() > self.deadline:
                self.kill()
                raise EngineFailed(f"engine timed out before {what}", self.stderr())
            time.sleep(0.1)

    def wait_paused(self, batch: int) -> None:
        self._wait_for(Path(f"{self.out_path}.paused.{batch}"), f"pausing before batch {batch}")

    def resume(self, batch: int) -> None:
        Path(f"{self.out_path}.go.{batch}").touch()

    def result(self) -> dict[str, Any]:
        try:
            self.proc.wait(max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise EngineFailed("engine timed out", self.stderr()) from None
        except BaseException:  # interrupted (pytest-timeout, Ctrl-C): leave no engine behind
            self.kill()
            raise
        finally:
            self._stderr.close()
        if self.proc.returncode != 0 or not self.out_path.exists():
            raise EngineFailed(f"engine exited with {self.proc.returncode}", self.stderr())
        result = json.loads(self.out_path.read_text())
        result["stderr"] = self.stderr()
        return result

    def kill(self) -> None:
        """Kill the engine and the engine core and worker processes it spawned (its own session:
        one process group), e.g. after a failed test left it paused."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._stderr.close()


def start_engine(model: str, batches: list[dict[str, Any]], *, workdir: str | os.PathLike,
                 llm_kwargs: dict[str, Any] | None = None, pause_before: list[int] | tuple[int, ...] = (),
                 env: dict[str, str] | None = None, timeout: float = 600.0) -> EngineProcess:
    """Start one engine process. `batches`: [{"prompts": [...], "sampling": {SamplingParams
    kwargs}}, ...], run in order by one LLM. `llm_kwargs` override LLM_DEFAULTS (e.g.
    {"kv_transfer_config": {...}})."""
    spec = {"model": model, "llm_kwargs": {**LLM_DEFAULTS, **(llm_kwargs or {})},
            "batches": batches, "pause_before": list(pause_before)}
    return EngineProcess(spec, Path(workdir), env, timeout)


def run_engine(model: str, batches: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    """start_engine(...) and wait for its result (no pauses)."""
    return start_engine(model, batches, **kwargs).result()


def kv_transfer_config(role: str, endpoint: str, **extra: Any) -> dict[str, Any]:
    """The --kv-transfer-config of docs/vllm.md for ecd's KV connector, as an LLM(...) argument.
    Keys of kv_connector_extra_config (namespace, pin_seconds, ...) go in `extra`;
    `connector`/`module_path` name another class (a test subclass)."""
    connector = extra.pop("connector", "EcdKVConnector")
    module_path = extra.pop("module_path", "ecd.integrations.vllm")
    policy = extra.pop("kv_load_failure_policy", "recompute")
    return {"kv_connector": connector, "kv_connector_module_path": module_path, "kv_role": role,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"endpoint": endpoint, **extra}}


# ---- the child --------------------------------------------------------------------------------

def _engine_prompt(prompt: Any) -> Any:
    """A spec prompt as vLLM's `generate` takes it: token ids, text, or a dict (image_seed: an image)."""
    if isinstance(prompt, list):
        return {"prompt_token_ids": prompt}
    if isinstance(prompt, dict) and "image_seed" in prompt:
        from mm_engine import make_image
        rest = {k: v for k, v in prompt.items() if k != "image_seed"}
        return {**rest, "multi_modal_data": {"image": make_image(prompt["image_seed"])}}
    return prompt


def _metrics(out: Any) -> dict[str, float] | None:
    """vLLM's per-request stats (None unless the LLM was built with disable_log_stats=False)."""
    stats = getattr(out, "metrics", None)
    if stats is None or not hasattr(stats, "first_token_latency"):
        return None
    return {name: float(getattr(stats, name)) for name in
            ("first_token_latency", "queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts",
             "num_generation_tokens")}


def _ecd_metrics(llm: Any, spec: dict[str, Any]) -> dict[str, float]:
    """vLLM's own Prometheus metrics named vllm:ecd_* (ecd's connector statistics), summed over
    their labels; empty unless the LLM was built with disable_log_stats=False."""
    if spec["llm_kwargs"].get("disable_log_stats", True):
        return {}
    found: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if metric.name.startswith("vllm:ecd_") and isinstance(value, (int, float)):
            found[metric.name] = found.get(metric.name, 0.0) + float(value)
    return found


def _child(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    started = time.monotonic()
    if isinstance(spec["llm_kwargs"].get("kv_events_config"), dict):  # LLM() converts only kv_transfer_config
        from vllm.config.kv_events import KVEventsConfig
        spec["llm_kwargs"]["kv_events_config"] = KVEventsConfig(**spec["llm_kwargs"]["kv_events_config"])
    llm = LLM(model=spec["model"], **spec["llm_kwargs"])
    seconds: dict[str, Any] = {"start": time.monotonic() - started, "batches": [], "batch_starts": []}
    batches = []
    for n, batch in enumerate(spec["batches"]):
        if n in spec["pause_before"]:
            Path(f"{out_path}.paused.{n}").touch()
            while not Path(f"{out_path}.go.{n}").exists():
                time.sleep(0.05)
        if batch.get("reset_prefix_cache"):  # forget what earlier batches computed locally
            assert llm.reset_prefix_cache(), "vLLM refused to reset the prefix cache"
        prompts = [_engine_prompt(p) for p in batch["prompts"]]
        params: Any = SamplingParams(**batch.get("sampling", {}))
        if batch.get("kv_transfer_params_file"):
            batch["kv_transfer_params"] = json.loads(Path(batch["kv_transfer_params_file"]).read_text())
        if batch.get("kv_transfer_params") is not None:  # per prompt, as vLLM's P/D proxy sends them
            params = [SamplingParams(**batch.get("sampling", {}), extra_args={"kv_transfer_params": kv})
                      if kv is not None else SamplingParams(**batch.get("sampling", {}))
                      for kv in batch["kv_transfer_params"]]
        t0 = time.monotonic()
        seconds["batch_starts"].append(t0)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds["batches"].append(time.monotonic() - t0)
        results = []
        for prompt, out in zip(batch["prompts"], outputs):
            completion = out.outputs[0]
            logprobs = None
            if completion.logprobs is not None:  # the sampled token's logprob at each position
                logprobs = [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]
            results.append({"prompt": prompt, "prompt_token_ids": list(out.prompt_token_ids or []),
                            "token_ids": list(completion.token_ids), "text": completion.text,
                            "logprobs": logprobs, "num_cached_tokens": out.num_cached_tokens,
                            "kv_transfer_params": out.kv_transfer_params, "metrics": _metrics(out)})
        batches.append(results)
        if batch.get("publish"):
            Path(f"{out_path}.batch.{n}.json.tmp").write_text(json.dumps(results))
            os.replace(f"{out_path}.batch.{n}.json.tmp", f"{out_path}.batch.{n}.json")
    tmp = f"{out_path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"batches": batches, "seconds": seconds, "ecd_metrics": _ecd_metrics(llm, spec)}, f)
    os.replace(tmp, out_path)
    print(f"engine_runner: done in {time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":  # the engine core is spawned: vLLM re-imports this module in it
    _child(sys.argv[1], sys.argv[2])
