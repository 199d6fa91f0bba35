#!/usr/bin/env python3
"""vLLM connector benchmark: ecd's EC and KV connectors against vLLM's reference connectors.

Drives real vLLM 0.33 (CPU build) connector objects the way vLLM's scheduler and model runner
call them (as tests/vllm does), each against vLLM's own file-based reference measured in the
same run, interleaved rep by rep so the machine's drift hits both alike:

  1. EC, per item: a bf16 encoder output of 576x4096 and of 2304x4096 goes producer worker
     `save_caches` -> consumer scheduler `ensure_cache_available` + `has_cache_item` +
     `update_state_after_alloc` + `build_connector_meta` -> consumer worker
     `bind_connector_metadata` + `start_load_caches`, until the tensor is in the consumer's
     encoder_cache. EcdECConnector vs ECExampleConnector (safetensors files under
     `shared_storage_path`: a dir under /tmp, vLLM's default place, for the headline; also one
     under /dev/shm). Producer and consumer live in this one process; a second variant puts the
     producer in its own process (end to end across processes, the pipe message that tells the
     consumer to go included). Loaded bytes are compared with the saved ones (int16 view).
  2. KV: a 2048-token prompt (32 layers, 8 KV heads, head size 128, block 16, bf16; vLLM's CPU
     layout LBHNC from vLLM's own allocate_kv_cache) is saved from one paged cache and loaded into
     other block ids of another. EcdKVConnector vs ExampleConnector (one safetensors file per
     layer). Both load the 127 blocks vLLM may take (never the prompt's last token).

The executor hand-off between scheduler and worker (a pickle round trip of the SchedulerOutput
or of the KV metadata, as MultiprocExecutor does) is made but not timed, for both connectors.
Starts its own daemon (`python -m ecd serve`, temp config, metrics on 127.0.0.1:0), stops it with
SIGTERM (must exit 0) and removes every file it made. No targets: ratios only.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import pickle
import platform
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # config notices; the example connectors log every load

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import ECTransferConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import get_forward_context, set_forward_context  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from bench_daemon import BenchDaemon, write_results  # noqa: E402
from ecd.client.client import Client  # noqa: E402

now_ns = time.perf_counter_ns  # CLOCK_MONOTONIC on Linux: stamps from two processes subtract

HIDDEN = 4096
EC_SIZES = (576, 2304)  # embeddings per item (e.g. one 336px and one 672px image)
EC_WARMUP = 3
BS, LAYERS_N, KV_HEADS, HEAD = 16, 32, 8, 128
PROMPT = 2048
KV_BLOCKS = PROMPT // BS  # 128 blocks the prompt fills; vLLM loads at most 127 (last token rule)
NUM_BLOCKS = 2 * KV_BLOCKS + 1  # block 0 is vLLM's null block; source and target ids disjoint
LAYERS = [f"language_model.model.layers.{i}.self_attn.attn" for i in range(LAYERS_N)]

# A PaliGemma config (tests/vllm/vllm_env.py's TINY_MODEL, copied) at the benchmark's sizes:
# no weights, nothing loaded; it only gives VllmConfig and the namespaces their facts.
MODEL = {
    "architectures": ["PaliGemmaForConditionalGeneration"], "model_type": "paligemma",
    "image_token_index": 257152, "hidden_size": HIDDEN, "projection_dim": HIDDEN, "torch_dtype": "bfloat16",
    "text_config": {"model_type": "gemma", "hidden_size": HIDDEN, "intermediate_size": 8192,
                    "num_attention_heads": 32, "num_key_value_heads": KV_HEADS, "head_dim": HEAD,
                    "num_hidden_layers": LAYERS_N, "vocab_size": 257216, "max_position_embeddings": 4096,
                    "torch_dtype": "bfloat16"},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                      "num_attention_heads": 2, "num_hidden_layers": 2, "image_size": 224,
                      "patch_size": 14, "projection_dim": HIDDEN, "num_image_tokens": 256},
}

# Without a tokenizer vLLM cannot build PaliGemma's processor to learn which fields only size a
# placeholder; it warns (with a traceback) once per connector and treats every field as media,
# which changes nothing for these requests (they carry their media). Quiet that one warning.
logging.getLogger("vllm.distributed.ec_transfer.ec_connector.utils").setLevel(logging.ERROR)

_HASH = get_hash_fn_by_name("sha256")
init_none_hash(_HASH)
_HASHER = get_request_block_hasher(BS, _HASH)


# ---- small helpers ------------------------------------------------------------------------

def stats_ms(samples_ns) -> dict:
    a = np.asarray(samples_ns, dtype=np.float64) / 1e6
    return {"p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
            "min_ms": float(a.min()), "mean_ms": float(a.mean()), "n": int(a.size)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def write_model(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(MODEL, f)
    return path


def vllm_config(model_dir: str, *, ec: dict | None = None, kv: dict | None = None) -> VllmConfig:
    """tests/vllm/vllm_env.py's make_vllm_config, taking any connector's transfer config."""
    kwargs = {"model_config": ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16")}
    if ec is not None:
        kwargs["ec_transfer_config"] = ECTransferConfig(**ec)
    if kv is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv)
    config = VllmConfig(**kwargs)
    config.cache_config.block_size = BS
    return config


def ec_transfer(kind: str, role: str, endpoint: str, storage: str) -> dict:
    if kind == "ecd":
        return {"ec_connector": "EcdECConnector", "ec_connector_module_path": "ecd.integrations.vllm",
                "ec_role": role, "ec_connector_extra_config": {"endpoint": endpoint}}
    return {"ec_connector": "ECExampleConnector", "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": storage}}


def clear_dir(path: str) -> None:
    for name in os.listdir(path):
        shutil.rmtree(os.path.join(path, name), ignore_errors=True)


def embeddings(n: int) -> torch.Tensor:
    """The same 'encoder output' in every process: bf16 [n, HIDDEN] from a fixed seed."""
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)


def mark(t: torch.Tensor, marker: int) -> None:
    """A per-rep value at both ends, so a stale or half-written load cannot compare equal."""
    t[0, 0] = t[-1, -1] = float(marker % 251 + 1)


# ---- 1. EC ------------------------------------------------------------------------------------

def drop_item(kind: str, admin: dict, storage: str, mm_hash: str) -> None:
    """Remove one saved item so the next rep writes into a fresh place (ecd: delete; example:
    its safetensors directory)."""
    if kind == "ecd":
        admin["ec"].delete(mm_hash)
    else:
        shutil.rmtree(os.path.join(storage, mm_hash))


def image_request(req_id: str, mm_hash: str, num_embeds: int) -> Request:
    """tests/vllm/test_ec_connector.py's image_request for one image: a real Request whose
    prompt is the image's placeholder (media attached, as vLLM's EPD proxy sends it)."""
    feature = MultiModalFeatureSpec(data=MultiModalKwargsItem.dummy(), modality="image", identifier=mm_hash,
                                    mm_position=PlaceholderRange(offset=0, length=num_embeds))
    return Request(req_id, [7] * (num_embeds + 8), SamplingParams(max_tokens=1), None, mm_features=[feature])


class ECConsumer:
    """A prefill engine's EC connector pair (scheduler side and worker side) of one kind."""

    def __init__(self, model_dir: str, kind: str, endpoint: str, storage: str) -> None:
        config = vllm_config(model_dir, ec=ec_transfer(kind, "ec_consumer", endpoint, storage))
        self.scheduler = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
        self.worker = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)

    def lookup(self, req: Request) -> SchedulerOutput:
        """Scheduler.schedule()'s calls for a waiting request with one image: timed as 'lookup'."""
        sched = self.scheduler
        out = SchedulerOutput.make_empty()
        h = req.mm_features[0].identifier
        if not sched.ensure_cache_available(req, req.num_computed_tokens):
            raise RuntimeError(f"{type(sched).__name__}: request deferred")
        if not sched.has_cache_item(h):
            raise RuntimeError(f"{type(sched).__name__}: {h} not found after the save")
        sched.update_state_after_alloc(req, 0)
        out.ec_connector_metadata = sched.build_connector_meta(out)
        return out

    def load(self, worker_output: SchedulerOutput, encoder_cache: dict) -> None:
        """The model runner's calls before it gathers embeddings: timed as 'load'."""
        self.worker.bind_connector_metadata(worker_output.ec_connector_metadata)
        self.worker.start_load_caches(encoder_cache)

    def finish(self, req: Request) -> None:
        self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        self.scheduler.request_finished(req)  # ecd: unpins the item


_READ_BUF: dict[int, np.ndarray] = {}


def first_read(loaded: torch.Tensor) -> int:
    """ns to read the loaded embeddings once (np.copyto into a pre-faulted buffer), as the model
    runner does right after the load when it gathers them. Not free for a tensor that is only
    mapped: safetensors 0.8's load_file (mmap backend) returns the file's pages unread."""
    src = loaded.view(torch.int16).numpy()
    buf = _READ_BUF.get(src.size)
    if buf is None:
        buf = _READ_BUF[src.size] = np.ones(src.shape, np.int16)
    t0 = now_ns()
    np.copyto(buf.reshape(src.shape), src)
    return now_ns() - t0


def ec_consume(consumer: ECConsumer, mm_hash: str, n: int, t: dict) -> torch.Tensor:
    """Lookup + load of one item (then its first read); phase times (ns) into t. Returns what
    landed in encoder_cache."""
    req = image_request(f"req-{mm_hash}", mm_hash, n)
    t0 = now_ns()
    out = consumer.lookup(req)
    t1 = now_ns()
    worker_output = pickle.loads(pickle.dumps(out))  # MultiprocExecutor's hand-off, not timed
    cache: dict[str, torch.Tensor] = {}
    t2 = now_ns()
    consumer.load(worker_output, cache)
    loaded = cache.get(mm_hash)
    t3 = now_ns()
    t0f = now_ns()
    consumer.finish(req)
    t["finish"] = now_ns() - t0f
    t["lookup"], t["load"] = t1 - t0, t3 - t2
    if loaded is None:
        raise RuntimeError(f"{type(consumer.worker).__name__}: {mm_hash} not in encoder_cache after the load")
    t["read"] = first_read(loaded)
    return loaded


def ec_one_process(model_dir: str, endpoint: str, stores: dict[str, str], admin: dict[str, Client],
                   reps: int) -> dict:
    kinds = {"ecd": ("ecd", ""), **{f"example_{place}": ("example", path) for place, path in stores.items()}}
    producers, consumers = {}, {}
    for name, (kind, storage) in kinds.items():
        config = vllm_config(model_dir, ec=ec_transfer(kind, "ec_producer", endpoint, storage))
        producers[name] = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
        consumers[name] = ECConsumer(model_dir, kind, endpoint, storage)
    admin["ec"] = Client(endpoint, consumers["ecd"].scheduler.namespace, name="bench-vllm-admin-ec")
    res: dict = {}
    for n in EC_SIZES:
        src = embeddings(n)
        samples = {name: {"save": [], "lookup": [], "load": [], "total": [], "read": [], "total_read": [],
                          "finish": []} for name in kinds}
        bad = {name: 0 for name in kinds}
        names = list(kinds)
        for i in range(EC_WARMUP + reps):
            for name in names[i % len(names):] + names[:i % len(names)]:  # rotate who goes first
                kind, storage = kinds[name]
                mm_hash = f"img-{n}-{i}-{name}"
                mark(src, i)
                t: dict = {}
                t0 = now_ns()
                producers[name].save_caches({mm_hash: src}, mm_hash)
                t["save"] = now_ns() - t0
                loaded = ec_consume(consumers[name], mm_hash, n, t)
                bad[name] += not same_bits(loaded, src)
                del loaded
                drop_item(kind, admin, storage, mm_hash)
                if i >= EC_WARMUP:
                    t["total"] = t["save"] + t["lookup"] + t["load"]
                    t["total_read"] = t["total"] + t["read"]
                    for k, v in t.items():
                        samples[name][k].append(v)
        res[str(n)] = {name: {"bytes": src.numel() * 2, "bit_identical": bad[name] == 0, "mismatches": bad[name],
                              **{k: stats_ms(v) for k, v in s.items()}} for name, s in samples.items()}
        res[str(n)]["memcpy"] = memcpy_ref(src, reps)
    for p in producers.values():
        p.shutdown()
    for c in consumers.values():
        c.scheduler.shutdown()
        c.worker.shutdown()
    return res


def memcpy_ref(src: torch.Tensor, reps: int) -> dict:
    """Diagnostics: one single-threaded memcpy (np.copyto) of the item's bytes into a pre-faulted
    buffer, and into a new torch tensor (what a fresh allocation's page faults add)."""
    src_np = src.view(torch.int16).numpy()
    hot = np.empty_like(src_np)
    hot.fill(1)
    warm, fresh = [], []
    for _ in range(reps):
        t0 = now_ns()
        np.copyto(hot, src_np)
        t1 = now_ns()
        out = torch.empty_like(src)
        np.copyto(out.view(torch.int16).numpy(), src_np)
        t2 = now_ns()
        del out
        warm.append(t1 - t0)
        fresh.append(t2 - t1)
    return {"prefaulted_dst": stats_ms(warm), "new_torch_dst": stats_ms(fresh)}


def _ec_producer_process(model_dir: str, endpoint: str, storage: str, conn) -> None:
    """The encoder engine of the cross-process variant: save_caches on command, stamped."""
    producers = {kind: ECConnectorFactory.create_connector(
        vllm_config(model_dir, ec=ec_transfer(kind, "ec_producer", endpoint, storage)), ECConnectorRole.WORKER)
        for kind in ("ecd", "example")}
    srcs = {n: embeddings(n) for n in EC_SIZES}
    for n in EC_SIZES:  # first saves map the pool / create the folder
        producers["ecd"].save_caches({f"warm-{n}": srcs[n]}, f"warm-{n}")
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        _, kind, mm_hash, n, marker = cmd
        src = srcs[n]
        mark(src, marker)
        t0 = now_ns()
        producers[kind].save_caches({mm_hash: src}, mm_hash)
        t1 = now_ns()
        conn.send((t0, t1))
    producers["ecd"].shutdown()
    conn.send("bye")


def ec_cross_process(model_dir: str, endpoint: str, storage: str, admin: dict[str, Client], reps: int) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ec_producer_process, args=(model_dir, endpoint, storage, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(180) or parent.recv() != "ready":
            raise RuntimeError("the producer process did not start")
        for n in EC_SIZES:
            admin["ec"].delete(f"warm-{n}")
        consumers = {kind: ECConsumer(model_dir, kind, endpoint, storage) for kind in ("ecd", "example")}
        res: dict = {}
        for n in EC_SIZES:
            src = embeddings(n)
            samples = {k: {"save": [], "notify": [], "lookup": [], "load": [], "total": [], "read": [],
                           "total_read": []} for k in consumers}
            bad = {k: 0 for k in consumers}
            for i in range(EC_WARMUP + reps):
                for kind in (("ecd", "example") if i % 2 else ("example", "ecd")):
                    mm_hash = f"xp-{n}-{i}-{kind}"
                    parent.send(("save", kind, mm_hash, n, i))
                    if not parent.poll(60):
                        raise RuntimeError("no answer from the producer process")
                    t0, t1 = parent.recv()
                    t_recv = now_ns()
                    t: dict = {}
                    loaded = ec_consume(consumers[kind], mm_hash, n, t)
                    t_end = t_recv + t["lookup"] + t["load"]  # the untimed pickle left out
                    mark(src, i)
                    bad[kind] += not same_bits(loaded, src)
                    del loaded
                    drop_item(kind, admin, storage, mm_hash)
                    if i >= EC_WARMUP:
                        s = samples[kind]
                        s["save"].append(t1 - t0)
                        s["notify"].append(t_recv - t1)
                        s["lookup"].append(t["lookup"])
                        s["load"].append(t["load"])
                        s["total"].append(t_end - t0)
                        s["read"].append(t["read"])
                        s["total_read"].append(t_end - t0 + t["read"])
            res[str(n)] = {k: {"bit_identical": bad[k] == 0, "mismatches": bad[k],
                               **{p: stats_ms(v) for p, v in s.items()}} for k, s in samples.items()}
        parent.send(("stop",))
        parent.poll(30) and parent.recv()
        proc.join(30)
        for c in consumers.values():
            c.scheduler.shutdown()
            c.worker.shutdown()
        return res
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(10)


# ---- 2. KV ------------------------------------------------------------------------------------

def scheduler_output(new=(), scheduled=None) -> SchedulerOutput:
    """tests/vllm/test_kv_connector.py's scheduler_output."""
    scheduled = scheduled or {}
    return SchedulerOutput(scheduled_new_reqs=list(new), scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids=set(), free_encoder_mm_hashes=[])


def kv_cache_config(config: VllmConfig):
    config.cache_config.kv_cache_layout = "LBHNC"  # what vLLM resolves for its CPU attention backend
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16)
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    return get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(LAYERS, spec)],
                                           NUM_BLOCKS * LAYERS_N * spec.page_size_bytes)


class KVEngine:
    """One engine's KV connector pair over a paged cache (the tests' Engine, trimmed): the
    worker's attention layers are stand-ins carrying `kv_cache`, which is all vLLM's
    ExampleConnector reads from the forward context; ecd's worker gets register_kv_caches."""

    def __init__(self, model_dir: str, transfer: dict, caches: dict[str, torch.Tensor], kv_config) -> None:
        self.config = vllm_config(model_dir, kv=transfer)
        self.config.cache_config.kv_cache_layout = "LBHNC"
        self.config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
        self.config.compilation_config.static_forward_context = {
            name: SimpleNamespace(kv_cache=cache) for name, cache in caches.items()}
        self.caches = caches
        self.attn = {name: None for name in LAYERS}  # per-layer attention metadata (non-MLA)
        self.scheduler = KVConnectorFactory.create_connector(self.config, KVConnectorRole.SCHEDULER, kv_config)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kv_config)
        self.worker.register_kv_caches(caches)

    def step(self, req: Request, block_ids: list[int], t: dict, phase: str) -> int:
        """Admit `req` and run its first step over `block_ids`; scheduler- and worker-side
        connector calls are timed into t[phase] (and the lookup into t['lookup'] for loads)."""
        blocks = KVCacheBlocks(([KVCacheBlock(b) for b in block_ids],))
        t0 = now_ns()
        n_ext, load_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        t1 = now_ns()
        assert load_async is False
        self.scheduler.update_state_after_alloc(req, blocks, n_ext)
        t2 = now_ns()
        req.num_computed_tokens = n_ext
        out = scheduler_output([NewRequestData.from_request(req, (block_ids,))],
                               {req.request_id: req.num_tokens - n_ext})
        t3 = now_ns()
        meta = self.scheduler.build_connector_meta(out)
        t4 = now_ns()
        meta = pickle.loads(pickle.dumps(meta))  # crosses to the worker process in vLLM: not timed
        t5 = now_ns()
        w = self.worker
        w.bind_connector_metadata(meta)
        with set_forward_context(self.attn, self.config):
            w.start_load_kv(get_forward_context())
            for name in LAYERS:  # the forward pass: each attention layer waits, then saves
                w.wait_for_layer_load(name)
                w.save_kv_layer(name, self.caches[name], None)
        w.wait_for_save()
        errors = w.get_block_ids_with_load_errors() if hasattr(w, "get_block_ids_with_load_errors") else set()
        w.clear_connector_metadata()
        t6 = now_ns()
        self.scheduler.request_finished(req, block_ids)  # ecd: unpins what the lookup pinned
        t7 = now_ns()
        if errors:
            raise RuntimeError(f"{type(w).__name__}: load errors on blocks {sorted(errors)[:8]}")
        if phase == "load":
            t["lookup"] = t1 - t0
            t["load"] = (t2 - t1) + (t4 - t3) + (t6 - t5)
        else:
            t["save"] = (t2 - t0) + (t4 - t3) + (t6 - t5)
        t[f"{phase}_finish"] = t7 - t6
        return n_ext


def kv_request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, list(prompt), SamplingParams(max_tokens=1), None, block_hasher=_HASHER)


def bench_kv(model_dir: str, endpoint: str, stores: dict[str, str], admin: dict[str, Client], reps: int) -> dict:
    layout = KVCacheLayout.LBHNC
    kv_config = kv_cache_config(vllm_config(model_dir))
    src = allocate_kv_cache(kv_config, torch.device("cpu"), layout)  # [blocks, heads, 16, 2*128]
    dst = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
    g = torch.Generator().manual_seed(1)
    for cache in src.values():
        cache.copy_(torch.randn(cache.shape, generator=g).to(torch.bfloat16))
    src_ids = list(range(1, 1 + KV_BLOCKS))
    dst_ids = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - KV_BLOCKS, -1))  # other ids, descending
    ecd_t = {"kv_connector": "EcdKVConnector", "kv_connector_module_path": "ecd.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute",  # as docs/vllm.md advises
             "kv_connector_extra_config": {"endpoint": endpoint, "pin_seconds": 60.0}}
    kinds = {"ecd": ecd_t, **{f"example_{place}": {
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": path}} for place, path in stores.items()}}
    engines = {name: (KVEngine(model_dir, tr, src, kv_config), KVEngine(model_dir, tr, dst, kv_config))
               for name, tr in kinds.items()}
    ns = engines["ecd"][0].scheduler.namespace
    admin["kv"] = Client(endpoint, ns, name="bench-vllm-admin-kv")
    block_bytes = LAYERS_N * 2 * KV_HEADS * BS * HEAD * 2
    expect = (PROMPT - 1) // BS  # 127 blocks may be loaded
    src_idx = torch.tensor(src_ids[:expect])
    dst_idx = torch.tensor(dst_ids[:expect])
    samples = {name: {"save": [], "lookup": [], "load": [], "total": [], "load_finish": []} for name in kinds}
    bad = {name: 0 for name in kinds}
    stored_blocks = {}
    names = list(kinds)
    warmup = 1
    for i in range(warmup + reps):
        prompt = torch.randint(10, 30000, (PROMPT,), generator=torch.Generator().manual_seed(100 + i)).tolist()
        for cache in src.values():  # a per-rep mark in every source block
            cache[src_idx, 0, 0, 0] = float(i % 251 + 1)
        for name in names[i % len(names):] + names[:i % len(names)]:
            producer, consumer = engines[name]
            for cache in dst.values():  # so a load that did nothing cannot compare equal
                cache.index_fill_(0, dst_idx, 0)
            t: dict = {}
            producer.step(kv_request(f"{name}-p{i}", prompt), src_ids, t, "save")
            if name == "ecd":
                keys = [h.hex() for h in kv_request("k", prompt).block_hashes]
                stored_blocks[name] = sum(admin["kv"].exists(keys))
            else:  # one folder per prompt, one file per layer: count the tokens in one of them
                (folder,) = os.listdir(stores[name.split("_", 1)[1]])
                path = os.path.join(stores[name.split("_", 1)[1]], folder, f"{LAYERS[0]}.safetensors")
                with safetensors.safe_open(path, "pt") as f:
                    stored_blocks[name] = f.get_slice("kv_cache").get_shape()[0] // BS
            matched = consumer.step(kv_request(f"{name}-c{i}", prompt), dst_ids, t, "load")
            ok = matched == expect * BS and all(
                same_bits(src[n].index_select(0, src_idx), dst[n].index_select(0, dst_idx)) for n in LAYERS)
            bad[name] += not ok
            if name == "ecd":
                admin["kv"].delete(keys)
            else:
                clear_dir(stores[name.split("_", 1)[1]])
            if i >= warmup:
                t["total"] = t["save"] + t["lookup"] + t["load"]
                for k in samples[name]:
                    samples[name][k].append(t[k])
    res = {"prompt_tokens": PROMPT, "blocks_loaded": expect, "block_bytes": block_bytes,
           "bytes_loaded": expect * block_bytes}
    for name, s in samples.items():
        res[name] = {"bit_identical": bad[name] == 0, "mismatches": bad[name], "blocks_saved": stored_blocks[name],
                     **{k: stats_ms(v) for k, v in s.items()},
                     "total_samples_ms": [round(v / 1e6, 3) for v in s["total"]]}
    # diagnostic: gathering the 127 blocks of every layer into one buffer (one memcpy's worth)
    buf = torch.empty((LAYERS_N, expect, *src[LAYERS[0]].shape[1:]), dtype=torch.bfloat16)
    gather = []
    for _ in range(3):
        t0 = now_ns()
        for li, n in enumerate(LAYERS):
            torch.index_select(src[n], 0, src_idx, out=buf[li])
        gather.append(now_ns() - t0)
    res["gather_all_layers_ref"] = stats_ms(gather)
    for pair in engines.values():
        for e in pair:
            e.scheduler.shutdown()
            e.worker.shutdown()
    return res


# ---- report -----------------------------------------------------------------------------------

def report(res: dict, stores: dict[str, str]) -> None:
    p = print
    env = res["env"]
    p(f"\necd vLLM connector benchmark  (vLLM {env['vllm']} CPU, torch {env['torch']}, {env['cpus']} CPUs, "
      f"EC reps {env['reps']}, KV reps {env['kv_reps']})")
    p(f"example connectors' shared_storage_path: /tmp -> {stores['tmp']}, /dev/shm -> {stores['shm']}")
    p("ms, p50 of each phase; total = save + lookup + load of the same rep (p50, p90); +read = total plus the "
      "first read of the loaded tensor; ecd/x = ecd's p50 / this row's p50 (below 1: ecd faster)\n")
    p("| case | connector | save | lookup | load | total p50 | total p90 | ecd/x | +read p50 | ecd/x (+read) "
      "| bit-identical |")
    p("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")

    def row(case: str, label: str, r: dict, ecd: dict, extra: str = "") -> None:
        mine = r is ecd
        ratio = "-" if mine else f"{ecd['total']['p50_ms'] / r['total']['p50_ms']:.2f}"
        if "total_read" in r:
            read = f"{r['total_read']['p50_ms']:.2f}"
            ratio_read = "-" if mine else f"{ecd['total_read']['p50_ms'] / r['total_read']['p50_ms']:.2f}"
        else:
            read = ratio_read = "n/a"
        p(f"| {case} | {label}{extra} | {r['save']['p50_ms']:.2f} | {r['lookup']['p50_ms']:.2f} | "
          f"{r['load']['p50_ms']:.2f} | **{r['total']['p50_ms']:.2f}** | {r['total']['p90_ms']:.2f} | {ratio} | "
          f"{read} | {ratio_read} | {'yes' if r['bit_identical'] else 'NO'} |")

    ec_labels = (("ecd", "EcdECConnector"), ("example_tmp", "ECExampleConnector /tmp"),
                 ("example_shm", "ECExampleConnector /dev/shm"))
    for n in EC_SIZES:
        e = res["ec"][str(n)]
        for name, label in ec_labels:
            row(f"EC {n}x{HIDDEN} ({e['ecd']['bytes'] / 2**20:.1f} MiB), 1 process", label, e[name], e["ecd"])
    for n in EC_SIZES if "ec_cross" in res else ():
        e = res["ec_cross"][str(n)]
        for name, label in ec_labels[:2]:
            row(f"EC {n}x{HIDDEN}, producer in another process", label, e[name.split("_")[0]], e["ecd"],
                extra=f" (notify {e[name.split('_')[0]]['notify']['p50_ms']:.2f})")
    k = res["kv"]
    for name, label in (("ecd", "EcdKVConnector"), ("example_tmp", "ExampleConnector /tmp"),
                        ("example_shm", "ExampleConnector /dev/shm")):
        row(f"KV {PROMPT} tokens, {k['blocks_loaded']} blocks ({k['bytes_loaded'] / 2**20:.0f} MiB)", label,
            k[name], k["ecd"])
    p("\nnotes")
    p("  EC: 'load' ends when the tensor is in encoder_cache. ECExampleConnector's is safetensors' mmap of the "
      "file, unread; '+read' adds one read of it (np.copyto into a pre-faulted buffer), as the model runner's "
      "gather does next.")
    for n in EC_SIZES:
        m = res["ec"][str(n)]["memcpy"]
        r = res["ec"][str(n)]
        p(f"  EC {n}: one memcpy of the item {m['prefaulted_dst']['p50_ms']:.2f} ms (pre-faulted dst), "
          f"{m['new_torch_dst']['p50_ms']:.2f} ms (new torch tensor); first read after the load: ecd "
          f"{r['ecd']['read']['p50_ms']:.2f}, example /tmp {r['example_tmp']['read']['p50_ms']:.2f}, "
          f"/dev/shm {r['example_shm']['read']['p50_ms']:.2f} ms")
    if "ec_cross" in res:
        p("  EC cross-process: total runs from the producer's save_caches call to the tensor in the consumer's "
          "encoder_cache (CLOCK_MONOTONIC in both), including the pipe message (notify) that starts the consumer.")
    p(f"  KV: {k['block_bytes'] / 2**20:.0f} MiB per block (all {LAYERS_N} layers); stored per prompt: ecd "
      f"{k['ecd']['blocks_saved']} blocks (every full prompt block), example {k['example_tmp']['blocks_saved']} "
      f"(its file key leaves out the last token's block); both load {k['blocks_loaded']}. Gathering those blocks "
      f"of all layers into one buffer (index_select, a copy-speed reference): "
      f"{k['gather_all_layers_ref']['p50_ms']:.1f} ms")
    p(f"  request_finished, not in the totals: EC (ecd: unpin) "
      f"{res['ec'][str(EC_SIZES[0])]['ecd']['finish']['p50_ms']:.2f} ms, "
      f"KV (ecd: unpin of 128 blocks) {k['ecd']['load_finish']['p50_ms']:.2f} ms")


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--reps", type=int, default=40, help="timed reps per EC case (>= 20 advised; default 40)")
    ap.add_argument("--kv-reps", type=int, default=12, help="timed reps per KV connector (>= 5 advised; default 12)")
    ap.add_argument("--no-cross-process", action="store_true", help="skip the cross-process EC variant")
    args = ap.parse_args()
    t_start = time.monotonic()
    shm_before = shm_names()
    workdir = tempfile.mkdtemp(prefix="ecd-bench-vllm-", dir="/tmp")
    shm_dir = tempfile.mkdtemp(prefix="ecd-bench-tmp-", dir="/dev/shm")
    stores = {"tmp": os.path.join(workdir, "store"), "shm": os.path.join(shm_dir, "store")}
    for path in stores.values():
        os.makedirs(path)
    daemon = BenchDaemon(workdir, node_prefix="benchvllm")
    admin: dict[str, Client] = {}
    ok = False
    res: dict = {"env": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                         "vllm": vllm.__version__, "reps": args.reps, "kv_reps": args.kv_reps,
                         "storage": stores, "loadavg_start": os.getloadavg()}}
    try:
        daemon.connect(name="bench-vllm-main").close()
        model_dir = write_model(os.path.join(workdir, "model"))
        res["ec"] = ec_one_process(model_dir, daemon.endpoint, stores, admin, args.reps)
        if not args.no_cross_process:
            res["ec_cross"] = ec_cross_process(model_dir, daemon.endpoint, stores["tmp"], admin, args.reps)
        res["kv"] = bench_kv(model_dir, daemon.endpoint, stores, admin, args.kv_reps)
        ok = True
    finally:
        for c in admin.values():
            c.close()
        rc = daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
        # only what this run made: other processes (a test suite, another daemon) may come and go
        mine = (f"ecd.{daemon.node}.", os.path.basename(shm_dir))
        left = sorted(n for n in shm_names() - shm_before if n.startswith(mine))
        left += [p for p in (workdir, shm_dir) if os.path.exists(p)]
        res["daemon_exit_code"], res["files_left"] = rc, left
    if ok:
        report(res, stores)
    bad = [f"{sec} {case} {name}" for sec in ("ec", "ec_cross") for case, r in res.get(sec, {}).items()
           for name, v in r.items() if isinstance(v, dict) and v.get("bit_identical") is False]
    bad += [f"kv {name}" for name, v in res.get("kv", {}).items()
            if isinstance(v, dict) and v.get("bit_identical") is False]
    print(f"\ndaemon stopped with SIGTERM: exit code {rc}; files left in /dev/shm and the tmp dirs: "
          f"{left or 'none'}; bit mismatches: {bad or 'none'}; benchmark took {time.monotonic() - t_start:.0f}s")
    if rc != 0:
        print(daemon.log_tail())
    ok = ok and rc == 0 and not left and not bad
    if ok and args.json:
        write_results(args.json, res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
