"""The worker side of EcdKVConnector (kv_connector.py): the step's blocks between the engine's
paged KV cache (paged_kv.py) and the node's ecd pool, as the scheduler side planned them.

`start_load_kv` fetches every block of the step with one `view_many` (a CPU engine: one copy,
from the pool into its blocks) or `get_many` (a GPU engine: straight to its device) and copies it
into the paged cache; `wait_for_save` writes the step's new blocks with `put_many(wait=False)` (no
message per block) and one flush, copying straight out of the paged cache. Loads are synchronous (the step that consumes them waits for
them); a save is finished when `wait_for_save` returns. With tensor or pipeline parallelism each
worker stores its own part of a block under the block's key plus its rank (metadata.rank_suffix).

Every failure is caught, logged (rate-limited) and becomes a skipped save or a load error
reported through `get_block_ids_with_load_errors` (vLLM then recomputes those blocks with
`kv_load_failure_policy: "recompute"`, or fails the request with the default "fail"). With
`verify` a block whose bytes do not match its producer's checksum is such a load error, alone:
the step's other blocks still load (lazy_client.skipping_corrupt).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ...protocol import KVBlockMeta
from .lazy_client import LazyClient, batches, skipping_corrupt
from .metadata import NULL_BLOCK_ID, EcdKVConnectorMetadata, KVGroups, rank_suffix, world_size
from .paged_kv import PagedKV
from .ratelimit import RateLimitedLog, connector_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = connector_logger("kv_connector")  # the connector's logger, shared by its two sides

STAGING_MAX_BYTES = 256 << 20  # saves that must be staged (layers not in one allocation) go in
                               # put_many batches of at most this many bytes


def worker_rank() -> int:
    """This worker's place among the tensor x pipeline parallel workers."""
    try:
        from vllm.distributed.parallel_state import (get_pp_group, get_tensor_model_parallel_rank,
                                                      get_tensor_model_parallel_world_size)
        return get_pp_group().rank_in_group * get_tensor_model_parallel_world_size() + \
            get_tensor_model_parallel_rank()
    except Exception:  # pragma: no cover - no distributed environment (single-process tests)
        return 0


class EcdKVConnectorWorker:
    """The worker-side methods of EcdKVConnector (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None", client: LazyClient,
                 log: RateLimitedLog, groups: KVGroups | None = None) -> None:
        self.client = client
        self._groups = groups  # several KV cache groups: one PagedKV each (metadata.KVGroups)
        self._group_paged: dict[int, PagedKV] = {}
        self._recving: set[str] = set()  # hybrid: requests whose (asynchronous) load ran
        self._failed_recving: set[str] = set()  # ... and failed (vLLM recomputes them)
        self._log = log
        self._kv_cache_config = kv_cache_config  # its num_blocks sizes the caches, when vLLM gives it
        self._world = world_size(vllm_config)
        self._paged: PagedKV | None = None
        self._rank_suffix = ""
        self._load_errors: set[int] = set()
        # Told of every put_many that stored: (keys, their KVBlockMeta), for the connector's
        # statistics and KV events (telemetry/recorders.py).
        self.on_saved: Callable[[list[str], list[KVBlockMeta]], None] | None = None

    @property
    def paged(self) -> PagedKV | None:
        """The registered KV caches as ecd copies them; None before register_kv_caches, or when
        they could not be used (then loads fail and nothing is saved)."""
        return self._paged

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            if self._groups is not None and self._groups.hybrid:
                self._paged = self._register_groups(kv_caches, self._groups)
            else:
                self._paged = PagedKV(kv_caches, getattr(self._kv_cache_config, "num_blocks", None))
        except Exception as exc:
            self._paged = None
            self._group_paged = {}
            logger.error("ecd kv connector: cannot use these KV caches (%s); loads will be reported "
                         "as failed and nothing will be saved", exc)
            return
        if self._world > 1:
            self._rank_suffix = rank_suffix(worker_rank(), self._world)
        logger.info("ecd kv connector: %d layers, entry %s %s (%.1f KiB per block), %s", len(self._paged.names),
                    list(self._paged.entry_shape), self._paged.dtype, self._paged.entry_nbytes / 1024,
                    "zero-staging strided copies" if self._paged.stacked is not None else "staged copies")

    def _register_groups(self, kv_caches: dict[str, torch.Tensor], groups: KVGroups) -> PagedKV:
        """One PagedKV per KV cache group, of the group's own layers: a group's block is the
        entry `[its layers, *block]` (vLLM's hybrid allocator gives layers of different groups
        the same memory, each block id belonging to one group at a time). Returns the first
        group's."""
        if groups.unsupported is not None or not groups.groups:
            raise ValueError(groups.unsupported or "no KV cache group to store")
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        self._group_paged = {}
        for group in groups.groups:
            missing = [n for n in group.layer_names if n not in kv_caches]
            if missing:
                raise ValueError(f"KV cache group {group.index}: layers {missing} were not registered")
            self._group_paged[group.index] = PagedKV({n: kv_caches[n] for n in group.layer_names}, num_blocks)
            logger.info("ecd kv connector: group %d (%s): %d layers", group.index,
                        f"sliding window {group.sliding_window}" if group.sliding_window else "full attention",
                        len(group.layer_names))
        return self._group_paged[groups.groups[0].index]

    def _per_group(self, transfers: list) -> list[tuple[PagedKV | None, list]]:
        """The step's transfers by the PagedKV of their group (one entry, this worker's PagedKV,
        without several groups)."""
        if not self._group_paged:
            return [(self._paged, transfers)]
        return [(self._group_paged.get(g), [t for t in transfers if t.group == g])
                for g in sorted({t.group for t in transfers})]

    # ---- loads ----

    def start_load_kv(self, meta: Any) -> None:
        """Load the step's planned blocks (`meta`: the step's bound metadata, or None)."""
        if not isinstance(meta, EcdKVConnectorMetadata) or not meta.loads:
            return
        try:
            for paged, loads in self._per_group(meta.loads):
                self._load(EcdKVConnectorMetadata(loads=loads), paged)
        except Exception as exc:  # never out of the connector: every planned block failed
            self._load_errors.update(b for t in meta.loads for b in t.block_ids if b != NULL_BLOCK_ID)
            self._log.warning("load", "loading failed: %s: %s", type(exc).__name__, exc)
        if self._groups is not None and self._groups.hybrid:
            self._settle_loads(meta)

    def _settle_loads(self, meta: EcdKVConnectorMetadata) -> None:
        """Several groups: a load's failed blocks fail its request (vLLM takes no block ids
        back from such a model: kv_scheduler.EcdKVConnectorScheduler._match_groups)."""
        errors, self._load_errors = self._load_errors, set()
        for transfer in meta.loads:
            self._recving.add(transfer.req_id)
            if errors.intersection(transfer.block_ids):
                self._failed_recving.add(transfer.req_id)

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """(requests whose asynchronous load finished, those of them that failed) since the
        last call: vLLM's finished_recving and failed_recving."""
        done, failed = self._recving, self._failed_recving
        self._recving, self._failed_recving = set(), set()
        return done, failed

    def _load(self, meta: EcdKVConnectorMetadata, paged: PagedKV | None) -> None:
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
        client = self.client.get("get_many") if paged is not None else None
        if paged is None or client is None:
            self._load_errors.update(ids)
            self._log.warning("load", "cannot load %d blocks: %s", len(ids),
                              "no usable KV caches" if paged is None else "the daemon is unavailable")
            return
        missing = 0
        corrupt: list[int] = []
        for key_chunk, id_chunk in zip(batches(keys, client.limits.max_batch),
                                       batches(ids, client.limits.max_batch)):
            def load(c, keys=key_chunk, ids=id_chunk):
                return self._load_verified(c, paged, keys, ids, corrupt)
            done = self.client.call("get_many", load)
            if done is None:
                self._load_errors.update(id_chunk)
                continue
            missing += done[0]
            self._load_errors.update(done[1])
        if corrupt:
            self._log.warning("load-corrupt", "%d of %d pinned blocks failed verification (their bytes do not "
                              "match the producer's checksum): not loaded; vLLM recomputes them", len(corrupt),
                              len(ids))
        if missing:
            self._log.warning("load-miss", "%d of %d pinned blocks could not be read (evicted, deleted "
                              "or of another layout); vLLM recomputes them", missing, len(ids))

    def _load_verified(self, c: Any, paged: PagedKV, keys: list[str], ids: list[int],
                       corrupt: list[int]) -> tuple[int, list[int]]:
        """One batch into the paged cache: (missing, block ids that did not load). A block that
        fails verification (`verify`, or a verify namespace) is not loaded, like a missing one:
        its id is added to `corrupt` and to the failed ids, and the others still load."""
        verify = self.client.settings.verify

        def read(picked: list[int]) -> tuple[int, list[int]]:
            some_keys, some_ids = [keys[i] for i in picked], [ids[i] for i in picked]
            if not some_keys:
                return 0, []
            if paged.use_numpy:  # a CPU engine: one copy, out of the pool straight into its blocks
                # (without a round trip where the blocks' locations are known: read_many)
                return c.read_many(some_keys, lambda views: self._scatter_found(paged, some_ids, views),
                                   missing_ok=True, verify=verify)
            # a GPU engine: straight onto the cache's device, complete when get_many returns
            return self._scatter_found(paged, some_ids, c.get_many(some_keys, missing_ok=True, verify=verify,
                                                                   device=paged.device))

        (missing, failed), bad = skipping_corrupt(keys, read)
        corrupt.extend(ids[i] for i in bad)
        return missing, failed + [ids[i] for i in bad]

    def _scatter_found(self, paged: PagedKV, ids: list[int], got: list[torch.Tensor | None]) -> tuple[int, list[int]]:
        """PagedKV.scatter_found, its failure logged: (missing, block ids that did not load)."""
        missing, failed, error = paged.scatter_found(ids, got)
        if error is not None:
            self._log.warning("scatter", "copying %d blocks into the KV cache failed: %s: %s",
                              len(ids) - missing, type(error).__name__, error)
        return missing, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves ----

    def wait_for_save(self, meta: Any) -> None:
        """Save the step's new blocks (`meta`: the step's bound metadata, or None)."""
        if not isinstance(meta, EcdKVConnectorMetadata) or not meta.saves or self._paged is None:
            return
        try:
            for paged, saves in self._per_group(meta.saves):
                if paged is not None:
                    self._save(EcdKVConnectorMetadata(saves=saves), paged)
        except Exception as exc:  # never out of the connector: a skipped save is a later miss
            self._log.warning("save", "saving failed: %s: %s", type(exc).__name__, exc)

    def _save(self, meta: EcdKVConnectorMetadata, paged: PagedKV) -> None:
        items: list[tuple[str, int]] = []
        about: dict[str, KVBlockMeta] = {}  # what each block is, for the daemon's KV events
        for transfer in meta.saves:
            items.extend((k + self._rank_suffix, b) for k, b in zip(transfer.keys, transfer.block_ids)
                         if b != NULL_BLOCK_ID)
            if transfer.blocks:
                about.update((k + self._rank_suffix, m) for k, m in zip(transfer.keys, transfer.blocks))
        if not items:
            return
        client = self.client.get("put_many")
        if client is None:
            self._log.warning("save", "skipped saving %d blocks: the daemon is unavailable", len(items))
            return
        # Every block posted without waiting (no message per put: ecd/writes), then one flush: the
        # step's blocks are visible to other engines when wait_for_save returns. Batches of at most
        # what the daemon takes in one, or what a bounded staging buffer holds.
        per_put = client.limits.max_batch
        if paged.stacked is None or not paged.use_numpy:
            per_put = min(per_put, max(1, STAGING_MAX_BYTES // paged.entry_nbytes))
        posted: list[str] = []
        for chunk in batches(items, per_put):
            if self.client.backing_off:
                break  # the daemon went away during this save: the rest would be misses too
            try:
                tensors = paged.gather([b for _, b in chunk])
            except Exception as exc:
                self._log.warning("gather", "staging %d blocks to save failed: %s: %s", len(chunk),
                                  type(exc).__name__, exc)
                continue
            def put(c, chunk=chunk, tensors=tensors) -> bool:
                c.put_many({key: t for (key, _), t in zip(chunk, tensors)},
                           meta={key: about[key] for key, _ in chunk if key in about},
                           checksum=self.client.settings.verify, wait=False)
                return True
            if self.client.call("put_many", put):
                posted.extend(key for key, _ in chunk)
        def flush(c) -> bool:
            c.flush()  # every block of the step visible to other engines (or the refusal raised)
            return True
        flushed = bool(posted) and self.client.call("put_many", flush) is True
        if flushed and self.on_saved is not None:
            stored = list(dict.fromkeys(posted))  # a block two requests share: once
            self.on_saved(stored, [about[key] for key in stored if key in about])

    def shutdown(self) -> None:
        self.client.close()
