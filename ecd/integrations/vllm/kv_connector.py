"""EcdKVConnector: vLLM's paged KV cache, block by block, through the node's ecd daemon.

Name it with `--kv-transfer-config '{"kv_connector": "EcdKVConnector",
"kv_connector_module_path": "ecd.integrations.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"endpoint": "ipc:///run/ecd/ecd.sock"}}'`.

Entries: one per full block of tokens, holding that block of every layer this worker owns
(`[layers, *block]`, the KV dtype), keyed by vLLM's chained block hash in hex, so a prefix shared
by many prompts is stored once and a key names its whole prefix. docs/vllm.md (## KV connector)
explains the choice of granularity with measurements.

vLLM makes one connector per role, in different processes; this class is a thin facade that
makes the side its role needs and hands vLLM's calls to it, as vLLM's NixlConnector does:

- scheduler side (kv_scheduler.py): one batched `exists(pin_s=...)` per lookup finds and pins
  the blocks ecd holds; `build_connector_meta` names the blocks to load and to save. Across
  nodes (kv_peers.py) it pulls a remote producer's blocks through the local daemon, and as a
  producer it answers `do_remote_decode` with where the blocks are.
- worker side (kv_worker.py): `start_load_kv` copies the planned blocks from the pool into the
  paged cache (paged_kv.py); `wait_for_save` copies the step's new blocks out of it into the pool.

The two meet in metadata.py (the step's metadata, how blocks are keyed). A method of the other
role is answered as "nothing to do" (vLLM never calls one).

Every daemon failure is caught, logged (rate-limited) and becomes a miss, a skipped save, or a
load error reported through `get_block_ids_with_load_errors` (vLLM then recomputes those blocks
with `kv_load_failure_policy: "recompute"`, or fails the request with the default "fail"). The
Client is created on first use, dropped after DaemonUnavailable and re-created after a short
back-off (lazy_client.py, shared with the EC connector).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorTransferResults,
                                                               SupportsHMA)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .kv_scheduler import EcdKVConnectorScheduler
from .kv_worker import EcdKVConnectorWorker
from .lazy_client import LOG_INTERVAL_S, LazyClient
from .metadata import BlockTransfer, EcdKVConnectorMetadata, hashes_per_block, kv_groups, world_size
from .ratelimit import RateLimitedLog, connector_logger
from .settings import kv_namespace, parse_settings
from .telemetry.handshake import WorkerDaemons
from .telemetry.hooks import KVConnectorHooks
from .telemetry.recorders import KVTelemetry

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["BlockTransfer", "EcdKVConnector", "EcdKVConnectorMetadata"]

logger = connector_logger("kv_connector")  # "vllm.ecd.kv_connector": shown in the engine's log


class EcdKVConnector(KVConnectorHooks, KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector keeping full KV blocks in the node's ecd daemon. SupportsHMA: vLLM
    keeps its hybrid memory allocator on (several KV cache groups, e.g. sliding window plus full
    attention layers); each group's blocks are keyed apart (metadata.KVGroups)."""

    _cache_hit_source = CacheHitSource.HOST  # ecd's pool is host shared memory

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # A bad configuration fails here, at engine start, in either role.
        self.settings = parse_settings(self._kv_transfer_config.kv_connector_extra_config,
                                       "kv_connector_extra_config")
        self.namespace = kv_namespace(self.settings, vllm_config)
        per_block = hashes_per_block(vllm_config.cache_config.block_size, kv_cache_config)
        groups = kv_groups(kv_cache_config, vllm_config.cache_config.block_size)
        log = RateLimitedLog(logger, LOG_INTERVAL_S, prefix="ecd kv connector: ")
        # The daemon, failures contained (lazy_client.py). The scheduler only asks exists/unpin:
        # no need to pre-fault the pool's pages into it.
        self.client = LazyClient(self.settings, self.namespace, f"vllm-kv-{role.name.lower()}", log,
                                 populate=role == KVConnectorRole.WORKER)
        self.connector_scheduler: EcdKVConnectorScheduler | None = None
        self.connector_worker: EcdKVConnectorWorker | None = None
        # statistics, KV events, handshake (telemetry/: the hooks are KVConnectorHooks')
        self.telemetry = KVTelemetry(vllm_config, world_size(vllm_config))
        self.worker_daemons = WorkerDaemons(self.client, logger) if role == KVConnectorRole.SCHEDULER else None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = EcdKVConnectorScheduler(vllm_config, self.settings, per_block,
                                                               self.client, log, groups)
        else:
            self.connector_worker = EcdKVConnectorWorker(vllm_config, kv_cache_config, self.client, log, groups)
            self.connector_worker.on_saved = self._on_saved
        logger.info("ecd kv connector (%s): endpoint %s, namespace %s", role.name.lower(),
                    self.settings.endpoint, self.namespace)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a save that never happened is a later miss

    # ==== scheduler side (kv_scheduler.py) =======================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.connector_scheduler is None:
            return 0, False
        answer = self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        self.telemetry.asked(request, num_computed_tokens, answer)
        return answer

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if self.connector_scheduler is not None:
            self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
            self.telemetry.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self.connector_scheduler is None:
            return EcdKVConnectorMetadata()
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any):
        if self.connector_scheduler is not None:
            self.connector_scheduler.update_connector_output(connector_output)
            self.telemetry.events.received(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.connector_scheduler is None:
            return False, None
        self.telemetry.finished(request)
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        if self.connector_scheduler is None:
            return False, None
        self.telemetry.finished(request)
        return self.connector_scheduler.request_finished_all_groups(request, block_ids)

    # ==== worker side (kv_worker.py) =============================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.connector_worker is not None:
            self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.connector_worker is not None:
            self.telemetry.load_started()
            self.connector_worker.start_load_kv(self._connector_metadata)
            self.telemetry.load_done(self._connector_metadata, self._entry_nbytes())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv finished every layer before the forward pass started

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        # Nothing per layer: the blocks to save stay where they are until the step ends, and
        # wait_for_save copies them, every layer of a block at once, straight into ecd's pool
        # (docs/vllm.md: staging per layer here costs a copy on the forward pass and saves none).
        return

    def wait_for_save(self):
        if self.connector_worker is not None:
            started = time.perf_counter()
            self.connector_worker.wait_for_save(self._connector_metadata)
            self.telemetry.save_time(self._connector_metadata, time.perf_counter() - started)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        if self.connector_worker is not None:  # hybrid models' asynchronous loads (kv_worker.py)
            done, failed = self.connector_worker.take_finished_loads()
            results.finished_recving |= done
            results.failed_recving |= failed
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        errors = self.connector_worker.get_block_ids_with_load_errors()
        self.telemetry.load_failed(errors, self._entry_nbytes())
        return errors

    # ==== both ===================================================================================

    def shutdown(self):
        for side in (self.connector_scheduler, self.connector_worker):
            if side is not None:
                side.shutdown()
        return None
