"""EcdKVConnector under vLLM's hybrid memory allocator: two KV cache groups (a full attention
layer and a sliding-window layer, as Gemma 2/3 or Mistral-with-sliding-window models have), with
vLLM's own Scheduler (its HybridKVCacheCoordinator allocates per group and hands the sliding
window's blocks outside the window as the null block) and vLLM's own KV cache allocation (the two
groups' layers share memory, each block id belonging to one group at a time), a real `ecd serve`.

A producer engine computes prompts; a consumer engine with another block-id order loads them: every
full attention block, and the sliding-window blocks its window needs, bit-exact.
"""
from __future__ import annotations

import zlib

import pytest

from vllm_env import SKIP_REASON, make_vllm_config, tiny_model_dir  # noqa: F401 (fixtures)

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
if getattr(vllm, "__file__", None) is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma  # noqa: E402
from vllm.forward_context import get_forward_context, set_forward_context  # noqa: E402

try:  # vLLM 0.33; 0.32 has it in kv_cache_utils
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
except ImportError:  # pragma: no cover
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from ecd.integrations.vllm import EcdKVConnector  # noqa: E402
from ecd.integrations.vllm.metadata import NULL_BLOCK_ID, kv_groups  # noqa: E402
from test_kv_connector import BS, bits, tokens  # noqa: E402
from test_kv_connector import make_request as kv_request  # noqa: E402

WINDOW = 2 * BS  # the sliding window, in tokens: the window of a hit ending at block e is blocks e-2, e-1
FULL_LAYER = "language_model.model.layers.1.self_attn.attn"
SLIDING_LAYER = "language_model.model.layers.0.self_attn.attn"
LAYER_GROUP = {FULL_LAYER: 0, SLIDING_LAYER: 1}
NUM_BLOCKS = 48


def make_request(req_id: str, toks: list[int], max_tokens: int = 1) -> Request:
    """test_kv_connector's request (its block hasher, BS tokens a block), one new token by default."""
    return kv_request(req_id, toks, max_tokens)


def token_kv(prefix: list[int], layer: str, shape: tuple[int, ...]) -> torch.Tensor:
    seed = zlib.crc32(torch.tensor(prefix, dtype=torch.int64).numpy().tobytes()) ^ (LAYER_GROUP[layer] + 1 << 20)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


class HybridEngine:
    """vLLM's Scheduler (which makes the scheduler-side connector) over a two-group KV cache
    config, and a worker-side connector over vLLM's own allocation of it; the "forward pass"
    writes each new token's KV (a function of its prefix) into each layer's group's blocks."""

    def __init__(self, model_dir: str, endpoint: str, kv_role: str = "kv_both", descending: bool = False) -> None:
        self.config = make_vllm_config(model_dir, kv_role=kv_role, block_size=BS, extra={
            "endpoint": endpoint, "pin_seconds": 30.0, "load_timeout_s": 2.0})
        assert self.config.scheduler_config.disable_hybrid_kv_cache_manager is False  # SupportsHMA
        cfg = self.config
        cfg.cache_config.kv_cache_layout = "LBHNC"
        cfg.cache_config.num_gpu_blocks_override = NUM_BLOCKS
        cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
        cfg.kv_transfer_config.kv_load_failure_policy = "recompute"
        cfg.model_config.multimodal_config.language_model_only = True
        cfg.model_config.multimodal_config.enable_mm_embeds = False
        common = dict(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        full, sliding = FullAttentionSpec(**common), SlidingWindowSpec(sliding_window=WINDOW, **common)
        self.kv_cache_config = get_kv_cache_config_from_groups(
            cfg, [KVCacheGroupSpec([FULL_LAYER], full), KVCacheGroupSpec([SLIDING_LAYER], sliding)],
            NUM_BLOCKS * full.page_size_bytes)
        assert self.kv_cache_config.num_blocks == NUM_BLOCKS
        self.caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                        cfg.cache_config.get_resolved_kv_cache_layout())
        g = torch.Generator().manual_seed(777 + descending)
        for t in self.caches.values():  # garbage, so a load that did nothing shows
            t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
        self.scheduler = Scheduler(cfg, self.kv_cache_config, StructuredOutputManager(cfg), block_size=BS)
        assert isinstance(self.scheduler.connector, EcdKVConnector)
        if descending:  # another block-id order than the other engine's: loads land elsewhere
            pool = self.scheduler.kv_cache_manager.block_pool
            taken = pool.get_new_blocks(NUM_BLOCKS // 3)
            self._spacer = taken  # held: the allocator hands out later ids
        self.worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, self.kv_cache_config)
        self.worker.register_kv_caches(self.caches)
        self.requests: dict[str, Request] = {}
        self.tables: dict[str, list[list[int]]] = {}  # req -> per group block ids
        self.metas: list = []

    def block(self, layer: str, block_id: int) -> torch.Tensor:
        return self.caches[layer][block_id]

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def step(self):
        out = self.scheduler.schedule()
        starts = {}
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            starts[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = [list(ids) for ids in new_ids]
            elif new_ids:
                for table, ids in zip(self.tables[req_id], new_ids):
                    table.extend(ids)
            starts[req_id] = cached.num_computed_tokens[i]
        meta = out.kv_connector_metadata
        self.metas.append(meta)
        self.worker.bind_connector_metadata(meta)
        with set_forward_context(None, self.config):
            self.worker.start_load_kv(get_forward_context())
        for req_id, n in out.num_scheduled_tokens.items():
            toks = self.requests[req_id].all_token_ids
            for layer, group in LAYER_GROUP.items():
                table = self.tables[req_id][group]
                for i in range(starts[req_id], starts[req_id] + n):
                    assert table[i // BS] != NULL_BLOCK_ID  # vLLM allocates every block it computes
                    dst = self.caches[layer][table[i // BS], :, i % BS]
                    dst.copy_(token_kv(toks[:i + 1], layer, tuple(dst.shape)))
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(out.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        sampled = [[42] if starts[r] + n == self.requests[r].num_tokens else []
                   for r, n in out.num_scheduled_tokens.items()]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=results.finished_recving, failed_recving=results.failed_recving,
                invalid_block_ids=errors)))
        assert errors == set()  # vLLM takes no block ids back from several groups: requests fail
        return out, results

    def run(self, request: Request, steps: int = 8):
        self.add(request)
        outs = []
        for _ in range(steps):
            if request.is_finished():
                break
            outs.append(self.step())
        assert request.is_finished()
        return outs


@pytest.fixture
def engines(tiny_model_dir, daemon):
    def make(**kwargs) -> HybridEngine:
        return HybridEngine(tiny_model_dir, daemon.endpoint, **kwargs)
    return make


def keys_in(daemon, namespace: str) -> set[str]:
    with daemon.client(namespace=namespace) as c:
        return {e["key"] for e in c.keys(namespace)[1]}


def test_vllm_keeps_the_hybrid_allocator_with_ecd(engines):
    engine = engines()
    assert supports_hma(EcdKVConnector)
    groups = kv_groups(engine.kv_cache_config, BS)
    assert groups.hybrid and groups.unsupported is None
    assert [(g.index, g.layer_names, g.sliding_window) for g in groups.groups] == [
        (0, (FULL_LAYER,), None), (1, (SLIDING_LAYER,), WINDOW)]
    # vLLM's allocation: the two groups' layers share one memory
    assert engine.caches[FULL_LAYER].data_ptr() == engine.caches[SLIDING_LAYER].data_ptr()


def test_every_group_saved_and_loaded_bit_exact(engines, daemon):
    producer = engines()
    prompt = tokens(1, 6 * BS + 5)
    producer.run(make_request("p", prompt))
    ns = producer.scheduler.connector.namespace
    hashes = [h.hex() for h in make_request("x", prompt).block_hashes]
    assert len(hashes) == 6
    # every full prompt block of both groups, keyed by group
    assert keys_in(daemon, ns) == {f"{h}.g{g}" for h in hashes for g in (0, 1)}
    (saves,) = [m.saves for m in producer.metas if m.saves]
    assert sorted(t.group for t in saves) == [0, 1]
    assert all(b.group_idx == t.group for t in saves for b in t.blocks)  # KVBlockMeta.group_idx

    consumer = engines(descending=True)
    req = make_request("c", prompt + tokens(2, 3))
    consumer.add(req)
    out, results = consumer.step()  # the hit loads asynchronously: nothing computed this step
    assert out.num_scheduled_tokens == {} and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert results.finished_recving == {"c"} and results.failed_recving == set()
    full_ids, sliding_ids = consumer.scheduler.kv_cache_manager.get_block_ids("c")
    load_meta = out.kv_connector_metadata
    out, results = consumer.step()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 6 * BS and out.num_scheduled_tokens == {"c": 8}
    assert [list(ids[:6]) for ids in new.block_ids] == [full_ids[:6], sliding_ids[:6]]
    assert NULL_BLOCK_ID not in full_ids[:6]
    # the sliding window's blocks before the window are the null block: not loaded
    assert sliding_ids[:4] == [NULL_BLOCK_ID] * 4 and NULL_BLOCK_ID not in sliding_ids[4:6]
    loads = {t.group: t for t in load_meta.loads}
    assert loads[0].block_ids == full_ids[:6]
    assert loads[1].block_ids == sliding_ids[4:6] and all(loads[1].keys)
    p_full, p_sliding = producer.tables["p"]
    assert set(full_ids[:6]).isdisjoint(p_full[:6])  # other block ids than the producer's
    for pb, cb in zip(p_full[:6], full_ids[:6]):
        assert torch.equal(bits(producer.block(FULL_LAYER, pb)), bits(consumer.block(FULL_LAYER, cb)))
    for pb, cb in zip(p_sliding[4:6], sliding_ids[4:6]):
        assert torch.equal(bits(producer.block(SLIDING_LAYER, pb)), bits(consumer.block(SLIDING_LAYER, cb)))
    assert req.is_finished()


def test_a_hit_only_where_every_group_has_what_it_needs(engines, daemon):
    producer = engines()
    prompt = tokens(3, 6 * BS + 5)
    producer.run(make_request("p", prompt))
    ns = producer.scheduler.connector.namespace
    hashes = [h.hex() for h in make_request("x", prompt).block_hashes]
    with daemon.client(namespace=ns) as c:
        assert c.delete(f"{hashes[5]}.g1")  # the window of a hit at 6 blocks lacks block 5
        assert c.delete(f"{hashes[0]}.g1")  # in no window of a hit at 3 blocks or more: not needed
    consumer = engines(descending=True)
    lookup = consumer.scheduler.connector
    assert lookup.get_num_new_matched_tokens(make_request("c1", prompt), 0) == (5 * BS, True)
    with daemon.client(namespace=ns) as c:
        assert c.delete(f"{hashes[3]}.g0")  # full attention needs every block: 3 at most
    assert lookup.get_num_new_matched_tokens(make_request("c2", prompt), 0) == (3 * BS, True)
    with daemon.client(namespace=ns) as c:
        assert c.delete(f"{hashes[2]}.g1")  # the windows of 3 (blocks 1, 2), 2 (0, 1), 1 (0) lack one
    assert lookup.get_num_new_matched_tokens(make_request("c3", prompt), 0) == (0, False)


def test_vllm_calls_request_finished_all_groups_and_pins_are_released(engines, daemon):
    producer = engines()
    prompt = tokens(4, 4 * BS + 2)
    producer.run(make_request("p", prompt))
    consumer = engines(descending=True)
    connector = consumer.scheduler.connector
    seen = []
    orig = connector.request_finished_all_groups

    def spy(request, block_ids):
        seen.append(tuple(len(ids) for ids in block_ids))
        return orig(request, block_ids)

    connector.request_finished_all_groups = spy
    req = make_request("c", prompt)
    consumer.run(req)
    assert seen and all(len(groups) == 2 for groups in seen)
    ns = connector.namespace
    import time
    deadline = time.monotonic() + 10
    while True:
        with daemon.client(namespace=ns) as c:
            pins = {e["key"]: e["pins"] for e in c.keys(ns)[1]}
        if all(v == 0 for v in pins.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert pins and all(v == 0 for v in pins.values()), pins


def test_recompute_after_a_sliding_block_lost_before_its_load(engines, daemon):
    producer = engines()
    prompt = tokens(5, 5 * BS + 3)
    producer.run(make_request("p", prompt))
    ns = producer.scheduler.connector.namespace
    hashes = [h.hex() for h in make_request("x", prompt).block_hashes]
    consumer = engines(descending=True)
    connector = consumer.scheduler.connector
    orig = connector.get_num_new_matched_tokens

    def lookup_then_delete(request, num_computed):
        result = orig(request, num_computed)
        with daemon.client(namespace=ns) as c:
            assert c.delete(f"{hashes[4]}.g1")
        return result

    connector.get_num_new_matched_tokens = lookup_then_delete
    req = make_request("c", prompt)
    consumer.add(req)
    out, results = consumer.step()
    (load,) = [t for t in out.kv_connector_metadata.loads if t.group == 1]
    assert len(load.block_ids) == 2  # the window's blocks, 3 and 4
    assert results.finished_recving == {"c"} and results.failed_recving == {"c"}
    connector.get_num_new_matched_tokens = orig
    out, results = consumer.step()  # vLLM recomputes the whole request: ecd's lookup is a miss now
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 0 and out.num_scheduled_tokens == {"c": len(prompt)}
    assert out.kv_connector_metadata.loads == []
    while not req.is_finished():
        consumer.step()
    # the recomputed block is saved again, and every block the consumer holds is the producer's
    assert f"{hashes[4]}.g1" in keys_in(daemon, ns)
    p_full, p_sliding = producer.tables["p"]
    c_full, c_sliding = consumer.tables["c"]
    for pb, cb in zip(p_full[:5], c_full[:5]):
        assert torch.equal(bits(producer.block(FULL_LAYER, pb)), bits(consumer.block(FULL_LAYER, cb)))
    assert c_sliding[4] != NULL_BLOCK_ID
    assert torch.equal(bits(producer.block(SLIDING_LAYER, p_sliding[4])),
                       bits(consumer.block(SLIDING_LAYER, c_sliding[4])))


def test_a_group_ecd_cannot_store_turns_the_connector_off(tiny_model_dir, daemon):
    """Chunked local attention (like Mamba state) is not a kind ecd stores: the connector says
    why at start-up and neither loads nor saves, rather than load a partial state."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec
    config = make_vllm_config(tiny_model_dir, kv_role="kv_both", block_size=BS,
                              extra={"endpoint": daemon.endpoint})
    config.cache_config.kv_cache_layout = "LBHNC"
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    common = dict(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    full, local = FullAttentionSpec(**common), ChunkedLocalAttentionSpec(attention_chunk_size=4 * BS, **common)
    kv_cache_config = get_kv_cache_config_from_groups(
        config, [KVCacheGroupSpec([FULL_LAYER], full), KVCacheGroupSpec([SLIDING_LAYER], local)],
        NUM_BLOCKS * full.page_size_bytes)
    groups = kv_groups(kv_cache_config, BS)
    assert groups.unsupported is not None and "ChunkedLocalAttentionSpec" in groups.unsupported
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    request = make_request("r", tokens(6, 4 * BS + 1))
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)


def test_chunked_prefill_saves_sliding_blocks_before_vllm_frees_them(engines, daemon):
    """A prompt prefilled in chunks of two blocks: vLLM frees the sliding window's blocks that
    fall out of the window at each later chunk, so each block must be saved by the step that
    completes it. Every block of both groups is in ecd, and a consumer loads them bit-exact."""
    producer = engines()
    producer.scheduler.scheduler_config.max_num_batched_tokens = 2 * BS
    prompt = tokens(7, 6 * BS + 5)
    request = make_request("p", prompt)
    producer.add(request)
    for _ in range(3):  # 2 + 2 + 2 blocks
        producer.step()
    # vLLM freed the sliding blocks out of the window: saved by the steps that completed them
    assert producer.scheduler.kv_cache_manager.get_block_ids("p")[1][:2] == [NULL_BLOCK_ID] * 2
    producer.step()  # the last 5 tokens
    assert request.is_finished() and len(producer.metas) == 4
    ns = producer.scheduler.connector.namespace
    hashes = [h.hex() for h in make_request("x", prompt).block_hashes]
    assert keys_in(daemon, ns) == {f"{h}.g{g}" for h in hashes for g in (0, 1)}
    saved = [sorted((t.group, len(t.block_ids)) for t in m.saves) for m in producer.metas]
    assert saved == [[(0, 2), (1, 2)]] * 3 + [[]]  # each chunk saves its own two blocks per group
    consumer = engines(descending=True)
    req = make_request("c", prompt)
    consumer.add(req)
    out, results = consumer.step()
    assert results.finished_recving == {"c"} and results.failed_recving == set()
    full_ids, sliding_ids = consumer.scheduler.kv_cache_manager.get_block_ids("c")
    p_full = [t.block_ids for m in producer.metas for t in m.saves if t.group == 0]
    p_sliding = [t.block_ids for m in producer.metas for t in m.saves if t.group == 1]
    p_full, p_sliding = sum(p_full, []), sum(p_sliding, [])
    for pb, cb in zip(p_full, full_ids[:6]):
        assert torch.equal(bits(producer.block(FULL_LAYER, pb)), bits(consumer.block(FULL_LAYER, cb)))
    for pb, cb in zip(p_sliding[4:6], sliding_ids[4:6]):
        assert torch.equal(bits(producer.block(SLIDING_LAYER, pb)), bits(consumer.block(SLIDING_LAYER, cb)))
