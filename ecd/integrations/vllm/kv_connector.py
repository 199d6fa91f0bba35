"""EcdKVConnector: vLLM's paged KV cache, block by block, through the node's ecd daemon.

Name it with `--kv-transfer-config '{"kv_connector": "EcdKVConnector",
"kv_connector_module_path": "ecd.integrations.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"endpoint": "ipc:///run/ecd/ecd.sock"}}'`.

Entries: one per full block of tokens, holding that block of every layer this worker owns
(`[layers, *block]`, the KV dtype), keyed by vLLM's chained block hash in hex, so a prefix shared
by many prompts is stored once and a key names its whole prefix. docs/vllm.md (## KV connector)
explains the choice of granularity with measurements.

Scheduler side: one batched `exists(pin_s=...)` per lookup gives the longest run of present
blocks after the local prefix-cache hit (never the prompt's last token) and pins it until the
request finishes; `build_connector_meta` names the blocks to load (into which block ids) and the
new full prompt blocks to save. Worker side: `start_load_kv` fetches every block of the step with
one `view_many` (a CPU engine: one copy, from the pool into its blocks) or `get_many` (a GPU
engine: straight to its device) and copies it into the paged cache; `wait_for_save` writes the
step's new blocks with one `put_many`, copying straight out of the paged cache. Loads are synchronous (the step
that consumes them waits for them); a save is finished when `wait_for_save` returns.

Across nodes (the daemons' peer plane; kv_peers.py): a producer asked `do_remote_decode` answers
from `request_finished` with transfer params naming its daemon and the blocks it holds; a
consumer given them (or with `fetch_from_peers`) has its daemon pull the blocks it lacks on a
connector thread while the lookup answers "not decided yet", then loads them as local ones.

Every daemon failure is caught, logged (rate-limited) and becomes a miss, a skipped save, or a
load error reported through `get_block_ids_with_load_errors` (vLLM then recomputes those blocks
with `kv_load_failure_policy: "recompute"`, or fails the request with the default "fail"). The
Client is created on first use, dropped after DaemonUnavailable and re-created after a short
back-off (lazy_client.py, shared with the EC connector).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .kv_peers import PeerPulls, remote_source
from .lazy_client import LOG_INTERVAL_S, LazyClient, batches
from .paged_kv import PagedKV
from .ratelimit import RateLimitedLog, connector_logger
from .settings import default_namespace, parse_settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = connector_logger("kv_connector")  # "vllm.ecd.kv_connector": shown in the engine's log

NULL_BLOCK_ID = 0  # vLLM's BlockPool reserves block 0 as the null block: never loaded or saved
STAGING_MAX_BYTES = 256 << 20  # saves that must be staged (layers not in one allocation) go in
                               # put_many batches of at most this many bytes


# ---- metadata: scheduler -> worker ----------------------------------------------------------

@dataclass
class BlockTransfer:
    """Blocks of one request: keys[i] (a chained block hash, hex) <-> paged block block_ids[i]."""

    req_id: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class EcdKVConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


# ---- helpers --------------------------------------------------------------------------------

def _hash_hex(block_hash: Any) -> str:
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return bytes(block_hash).hex()
    return hashlib.blake2b(repr(block_hash).encode(), digest_size=16).hexdigest()


def _kv_dtype_name(vllm_config: Any) -> str:
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype == "auto":
        return str(getattr(vllm_config.model_config, "dtype", None))
    return cache_dtype


def _layout_facts(vllm_config: Any) -> dict[str, Any]:
    """What makes two engines' KV blocks interchangeable (the default namespace hashes it)."""
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    try:
        from vllm.platforms import current_platform
        platform = current_platform.device_type
    except Exception:  # pragma: no cover
        platform = None
    attention = getattr(vllm_config, "attention_config", None)
    return {
        "block_size": vllm_config.cache_config.block_size,
        "num_layers": model_config.get_total_num_hidden_layers(),
        "num_kv_heads": model_config.get_num_kv_heads(parallel),  # per tensor-parallel rank
        "head_size": model_config.get_head_size(),
        "kv_cache_dtype": _kv_dtype_name(vllm_config),
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "platform": platform,
        "attention_backend": str(getattr(attention, "backend", None)),
        "hash_algo": getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None),
    }


# ---- scheduler-side state -------------------------------------------------------------------

@dataclass
class _RequestState:
    request: Any  # vllm Request (the scheduler's own object; its block_hashes grow with it)
    keys: list[str]  # one per full block of the request's tokens, at lookup time
    present: list[bool]  # per key: in ecd at lookup time (and pinned)
    start_block: int  # blocks below this were a local prefix-cache hit
    pinned: set[str] = field(default_factory=set)
    load: BlockTransfer | None = None  # planned by update_state_after_alloc, sent once
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0  # blocks below this were saved or skipped already


class EcdKVConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector keeping full KV blocks in the node's ecd daemon."""

    _cache_hit_source = CacheHitSource.HOST  # ecd's pool is host shared memory

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = parse_settings(transfer.kv_connector_extra_config, "kv_connector_extra_config")
        self.namespace = self.settings.namespace or default_namespace("kv", vllm_config, _layout_facts(vllm_config))
        self._block_size = vllm_config.cache_config.block_size
        hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or self._block_size
        if self._block_size % hash_block_size:
            raise ValueError(f"block size {self._block_size} is not a multiple of vLLM's block hash "
                             f"size {hash_block_size}")
        self._hashes_per_block = self._block_size // hash_block_size
        self._loads_enabled = transfer.is_kv_consumer
        self._saves_enabled = transfer.is_kv_producer
        parallel = vllm_config.parallel_config
        self._world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self._log = RateLimitedLog(logger, LOG_INTERVAL_S, prefix="ecd kv connector: ")
        # The scheduler only asks exists/unpin: no need to pre-fault the pool's pages into it.
        self._client = LazyClient(self.settings, self.namespace, f"vllm-kv-{role.name.lower()}",
                                  self._log, populate=role == KVConnectorRole.WORKER)
        # scheduler side
        self._requests: dict[str, _RequestState] = {}
        self._peers = PeerPulls(self._client, self.settings, self._log, logger)  # across nodes
        # worker side
        self._paged: PagedKV | None = None
        self._rank_suffix = ""
        self._load_errors: set[int] = set()
        logger.info("ecd kv connector (%s): endpoint %s, namespace %s", role.name.lower(),
                    self.settings.endpoint, self.namespace)
        if (role == KVConnectorRole.SCHEDULER and self._loads_enabled
                and getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute"):
            logger.warning("ecd kv connector: kv_load_failure_policy is %r: a block evicted or lost "
                           "between lookup and load fails its request instead of being recomputed; "
                           "set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config",
                           transfer.kv_load_failure_policy)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a save that never happened is a later miss

    # ==== keys ===================================================================================

    def _block_keys(self, request: "Request") -> list[str]:
        """Hex of vLLM's chained hash of each full block (the hash of a block's last hash unit
        when hashes are finer than blocks). They already cover multimodal inputs, LoRA and the
        cache salt. Without them (no hasher configured), plain token prompts are hashed here."""
        hashes = list(getattr(request, "block_hashes", None) or ())
        per = self._hashes_per_block
        if hashes:
            return [_hash_hex(hashes[(i + 1) * per - 1]) for i in range(len(hashes) // per)]
        if (getattr(request, "mm_features", None) or getattr(request, "lora_request", None)
                or getattr(request, "prompt_embeds", None) is not None
                or getattr(request, "cache_salt", None)):
            return []  # the tokens alone do not determine the KV: never share it
        tokens = list(request.all_token_ids)
        keys, parent = [], b"ecd-kv"
        for start in range(0, len(tokens) - self._block_size + 1, self._block_size):
            block = np.asarray(tokens[start:start + self._block_size], dtype=np.int64).tobytes()
            parent = hashlib.blake2b(parent + block, digest_size=32).digest()
            keys.append(parent.hex())
        return keys

    def _rank_keys(self, key: str) -> list[str]:
        """Every worker's entry for one block (tensor/pipeline-parallel ranks store their part)."""
        if self._world == 1:
            return [key]
        return [f"{key}.{rank}" for rank in range(self._world)]

    # ==== scheduler side =========================================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            if self._loads_enabled and self._fetching(request, num_computed_tokens):
                return None, False  # blocks on their way from a peer: vLLM asks again next step
            return self._match(request, num_computed_tokens), False
        except Exception as exc:  # never out of the connector: a miss
            self._log.warning("lookup", "lookup for %s failed: %s: %s", request.request_id,
                              type(exc).__name__, exc)
            return 0, False

    # ---- across nodes ----

    def _fetching(self, request: "Request", num_computed_tokens: int) -> bool:
        """Whether this request waits for blocks being pulled from a peer. The first call starts
        the pull (when the request names a producer on another node, or fetch_from_peers is on
        and blocks are missing here); later calls answer until it settles (done, or its deadline
        passed). Once settled, never again for this request."""
        req_id = request.request_id
        waiting = self._peers.waiting(req_id)
        if waiting is not None:
            return waiting
        self._peers.settle(req_id)  # settled unless a pull starts below
        if getattr(request, "skip_reading_prefix_cache", False):
            return False
        source = remote_source(getattr(request, "kv_transfer_params", None))
        if source is None and not self.settings.fetch_from_peers:
            return False
        bs = self._block_size
        keys = self._block_keys(request)
        loadable = min(len(keys), (request.num_tokens - 1) // bs)
        peer: str | None = None
        if source is not None:
            peer, blocks, last = source
            if blocks <= 0 or blocks > len(keys) or keys[blocks - 1] != last:
                self._log.warning("fetch-params", "request %s: the producer's blocks (%d, last %s) are not "
                                  "this engine's (other model, namespace or block size?): not fetched",
                                  req_id, blocks, last[:16])
                return False
            loadable = min(loadable, blocks)
            if peer in self._peers.identity():
                return False  # the producer shares our daemon: a local lookup finds them
        wanted = [k for key in keys[num_computed_tokens // bs:loadable] for k in self._rank_keys(key)]
        if not wanted:
            return False
        local = self._client.call("exists", lambda c: c.exists(wanted))
        missing = [k for k, hit in zip(wanted, local or [False] * len(wanted)) if not hit]
        if local is None or not missing:
            return False  # no daemon (a miss anyway) or all here already
        self._peers.start(req_id, missing, peer)
        return True

    def _transfer_params(self, request: "Request", state: _RequestState | None) -> dict[str, Any] | None:
        """A producer's answer to `do_remote_decode`: where the request's blocks are."""
        asked = getattr(request, "kv_transfer_params", None)
        if not (self._saves_enabled and isinstance(asked, dict) and asked.get("do_remote_decode")):
            return None
        if state is None:
            return None
        blocks = 0
        while blocks < min(state.next_save, len(state.keys)) and state.present[blocks]:
            blocks += 1
        return self._peers.transfer_params(blocks, state.keys[blocks - 1] if blocks else "")

    def _match(self, request: "Request", num_computed_tokens: int) -> int:
        bs = self._block_size
        keys = self._block_keys(request) if self._loads_enabled or self._saves_enabled else []
        # The last token is always computed here (vLLM needs its logits): at most num_tokens - 1.
        loadable = min(len(keys), (request.num_tokens - 1) // bs) if self._loads_enabled else 0
        wanted = min(len(keys), max(loadable, request.num_prompt_tokens // bs))
        keys = keys[:wanted]
        start = num_computed_tokens // bs
        state = self._requests.get(request.request_id)
        pinned = state.pinned if state is not None else set()
        present = [False] * len(keys)
        if keys and not getattr(request, "skip_reading_prefix_cache", False):
            present = self._lookup(keys, pinned)
        self._requests[request.request_id] = _RequestState(request, keys, present, start, pinned)
        end = start
        while end < loadable and present[end]:
            end += 1
        return (end - start) * bs if end > start else 0

    def _lookup(self, keys: list[str], pinned: set[str]) -> list[bool]:
        """One batched exists (pinning hits) over every block's keys; False for all on failure."""
        asked = [k for key in keys for k in self._rank_keys(key)]
        pin_s = self.settings.pin_seconds if self._loads_enabled else 0.0

        def exists(client) -> list[bool]:
            found: list[bool] = []
            for chunk in batches(asked, client.limits.max_batch):
                found.extend(client.exists(chunk, pin_s=pin_s))
            return found

        found = self._client.call("exists", exists)
        if found is None:
            return [False] * len(keys)
        if pin_s > 0:
            pinned.update(k for k, hit in zip(asked, found) if hit)
        per = len(asked) // len(keys) if keys else 1
        return [all(found[i * per:(i + 1) * per]) for i in range(len(keys))]

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        try:
            state = self._requests.get(request.request_id)
            if state is None:
                return
            state.load = None
            if num_external_tokens <= 0 or not self._loads_enabled:
                return
            (block_ids, *_) = blocks.get_block_ids()
            count = -(-num_external_tokens // self._block_size)
            first = state.start_block
            ids = list(block_ids[first:first + count])
            keys = state.keys[first:first + len(ids)]
            if len(keys) < len(ids) or len(ids) < count:
                self._log.warning("plan", "%s: %d blocks to load from block %d, but it has %d keys and "
                                  "%d blocks", request.request_id, count, first, len(state.keys), len(block_ids))
                keys += [""] * (len(ids) - len(keys))  # no key: the worker reports a load error
            state.load = BlockTransfer(request.request_id, keys, ids)
        except Exception as exc:
            self._log.warning("plan", "planning the load of %s failed: %s: %s", request.request_id,
                              type(exc).__name__, exc)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = EcdKVConnectorMetadata()
        try:
            self._build(scheduler_output, meta)
        except Exception as exc:  # keep what was planned; a failure is a skipped save
            self._log.warning("meta", "building the step's metadata failed: %s: %s", type(exc).__name__, exc)
        return meta

    def _build(self, out: "SchedulerOutput", meta: EcdKVConnectorMetadata) -> None:
        scheduled: list[tuple[_RequestState, int]] = []
        for new in out.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0]) if new.block_ids else []
                scheduled.append((state, new.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            scheduled.append((state, cached.num_computed_tokens[i]))
        bs = self._block_size
        for state, computed in scheduled:
            req_id = state.request.request_id
            if state.load is not None:
                meta.loads.append(state.load)
                state.load = None
            if not self._saves_enabled:
                continue
            # Blocks whose KV exists once this step ran: the prompt's full blocks only.
            done = computed + out.num_scheduled_tokens.get(req_id, 0)
            full = min(done, state.request.num_prompt_tokens) // bs
            full = min(full, len(state.keys), len(state.block_ids))
            keys, ids = [], []
            for b in range(state.next_save, full):
                if not state.present[b] and state.block_ids[b] != NULL_BLOCK_ID:
                    keys.append(state.keys[b])
                    ids.append(state.block_ids[b])
                    state.present[b] = True
            state.next_save = max(state.next_save, full)
            if keys:
                meta.saves.append(BlockTransfer(req_id, keys, ids))

    def update_connector_output(self, connector_output: Any):
        """Blocks that failed to load are recomputed by vLLM: save them again once they are."""
        try:
            invalid = getattr(connector_output, "invalid_block_ids", None)
            if not invalid:
                return
            for state in self._requests.values():
                for b, block_id in enumerate(state.block_ids[:len(state.keys)]):
                    if block_id in invalid:
                        state.present[b] = False
                        state.next_save = min(state.next_save, b)
        except Exception as exc:
            self._log.warning("output", "handling the workers' output failed: %s: %s", type(exc).__name__, exc)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # the ignore: dict.pop takes any key at run time; a request without an id finds nothing
        req_id = getattr(request, "request_id", None)
        state = self._requests.pop(req_id, None)  # type: ignore[arg-type]
        self._peers.forget(req_id)
        if state is not None and state.pinned:
            pinned = sorted(state.pinned)  # on failure, the pins run out by themselves after pin_seconds
            self._client.call("unpin", lambda c: c.unpin(pinned))
        try:
            params = self._transfer_params(request, state)
        except Exception as exc:  # never out of the connector: the decode side recomputes
            self._log.warning("params", "no kv_transfer_params for %s: %s: %s", req_id, type(exc).__name__, exc)
            params = None
        return False, params  # saves finish inside the step (wait_for_save): free the blocks now

    # ==== worker side ============================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        try:
            self._paged = PagedKV(kv_caches, num_blocks)
        except Exception as exc:
            self._paged = None
            logger.error("ecd kv connector: cannot use these KV caches (%s); loads will be reported "
                         "as failed and nothing will be saved", exc)
            return
        if self._world > 1:
            self._rank_suffix = f".{self._worker_rank()}"
        logger.info("ecd kv connector: %d layers, entry %s %s (%.1f KiB per block), %s", len(self._paged.names),
                    list(self._paged.entry_shape), self._paged.dtype, self._paged.entry_nbytes / 1024,
                    "zero-staging strided copies" if self._paged.stacked is not None else "staged copies")

    @staticmethod
    def _worker_rank() -> int:
        """This worker's place among the tensor x pipeline parallel workers."""
        try:
            from vllm.distributed.parallel_state import (get_pp_group, get_tensor_model_parallel_rank,
                                                          get_tensor_model_parallel_world_size)
            return get_pp_group().rank_in_group * get_tensor_model_parallel_world_size() + \
                get_tensor_model_parallel_rank()
        except Exception:  # pragma: no cover - no distributed environment (single-process tests)
            return 0

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, EcdKVConnectorMetadata) or not meta.loads:
            return
        try:
            self._load(meta)
        except Exception as exc:  # never out of the connector: every planned block failed
            self._load_errors.update(b for t in meta.loads for b in t.block_ids if b != NULL_BLOCK_ID)
            self._log.warning("load", "loading failed: %s: %s", type(exc).__name__, exc)

    def _load(self, meta: EcdKVConnectorMetadata) -> None:
        keys: list[str] = []
        ids: list[int] = []
        for transfer in meta.loads:
            for key, block_id in zip(transfer.keys, transfer.block_ids):
                if block_id == NULL_BLOCK_ID:
                    continue
                if not key:  # the scheduler could not name this block's entry
                    self._load_errors.add(block_id)
                    continue
                keys.append(key + self._rank_suffix)
                ids.append(block_id)
        if not keys:
            return
        paged = self._paged
        client = self._client.get("get_many") if paged is not None else None
        if client is None:
            self._load_errors.update(ids)
            self._log.warning("load", "cannot load %d blocks: %s", len(ids),
                              "no usable KV caches" if paged is None else "the daemon is unavailable")
            return
        device = None if paged.use_numpy else paged.device
        missing = 0
        for key_chunk, id_chunk in zip(batches(keys, client.limits.max_batch),
                                       batches(ids, client.limits.max_batch)):
            if paged.use_numpy:  # a CPU engine: one copy, out of the pool straight into its blocks
                def load(c, keys=key_chunk, ids=id_chunk):
                    with c.view_many(keys, missing_ok=True) as views:
                        return self._scatter_found(paged, ids, views)
            else:  # a GPU engine: straight onto the cache's device, complete when get_many returns
                def load(c, keys=key_chunk, ids=id_chunk):
                    return self._scatter_found(paged, ids, c.get_many(keys, missing_ok=True, device=device))
            done = self._client.call("get_many", load)
            if done is None:
                self._load_errors.update(id_chunk)
                continue
            missing += done[0]
            self._load_errors.update(done[1])
        if missing:
            self._log.warning("load-miss", "%d of %d pinned blocks could not be read (evicted, deleted "
                              "or of another layout); vLLM recomputes them", missing, len(ids))

    def _scatter_found(self, paged: PagedKV, ids: list[int], got: list[torch.Tensor | None]) -> tuple[int, list[int]]:
        """PagedKV.scatter_found, its failure logged: (missing, block ids that did not load)."""
        missing, failed, error = paged.scatter_found(ids, got)
        if error is not None:
            self._log.warning("scatter", "copying %d blocks into the KV cache failed: %s: %s",
                              len(ids) - missing, type(error).__name__, error)
        return missing, failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv finished every layer before the forward pass started

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        # Nothing per layer: the blocks to save stay where they are until the step ends, and
        # wait_for_save copies them, every layer of a block at once, straight into ecd's pool
        # (docs/vllm.md: staging per layer here costs a copy on the forward pass and saves none).
        return

    def wait_for_save(self):
        meta = self._connector_metadata
        if not isinstance(meta, EcdKVConnectorMetadata) or not meta.saves or self._paged is None:
            return
        try:
            self._save(meta)
        except Exception as exc:  # never out of the connector: a skipped save is a later miss
            self._log.warning("save", "saving failed: %s: %s", type(exc).__name__, exc)

    def _save(self, meta: EcdKVConnectorMetadata) -> None:
        items: list[tuple[str, int]] = []
        for transfer in meta.saves:
            items.extend((k + self._rank_suffix, b) for k, b in zip(transfer.keys, transfer.block_ids)
                         if b != NULL_BLOCK_ID)
        if not items:
            return
        client = self._client.get("put_many")
        if client is None:
            self._log.warning("save", "skipped saving %d blocks: the daemon is unavailable", len(items))
            return
        # One put_many (one allocation, one commit) for all of them, unless there are more
        # than the daemon takes in one batch or they must be staged through a bounded buffer.
        per_put = client.limits.max_batch
        if self._paged.stacked is None or not self._paged.use_numpy:
            per_put = min(per_put, max(1, STAGING_MAX_BYTES // self._paged.entry_nbytes))
        for chunk in batches(items, per_put):
            if self._client.backing_off:
                return  # the daemon went away during this save: the rest would be misses too
            try:
                tensors = self._paged.gather([b for _, b in chunk])
            except Exception as exc:
                self._log.warning("gather", "staging %d blocks to save failed: %s: %s", len(chunk),
                                  type(exc).__name__, exc)
                continue
            self._client.call("put_many", lambda c: c.put_many({key: t for (key, _), t in zip(chunk, tensors)}))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        self._peers.shutdown()
        self._client.close()
        return None
