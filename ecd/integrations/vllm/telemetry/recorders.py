"""What the connectors' facades call to count, report events and check the handshake: one
recorder per connector, so each vLLM hook is one added line in kv_connector.py / ec_connector.py."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from ....protocol import KVBlockMeta
from ..metadata import NULL_BLOCK_ID, EcdECWorkerMetadata
from .kv_events import ConnectorEvents, EcdKVEvents
from .stats import EcdECConnectorStats, EcdKVConnectorStats, add_counts

MAX_ASKED = 65536  # lookups remembered until their request is allocated or finished


def kv_events_enabled(vllm_config: Any) -> bool:
    """The engine publishes KV cache events (`--kv-events-config` with enable_kv_cache_events)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and getattr(config, "enable_kv_cache_events", False))


def tensor_nbytes(t: Any) -> int:
    try:
        return int(t.numel() * t.element_size())
    except Exception:
        return 0


class KVTelemetry:
    """EcdKVConnector's statistics and events, both roles (see stats.py, kv_events.py)."""

    def __init__(self, vllm_config: Any, world: int = 1) -> None:
        self.stats = EcdKVConnectorStats()
        self.events = ConnectorEvents(kv_events_enabled(vllm_config), world)
        self._asked: dict[str, int] = {}  # req_id -> prompt tokens past the local hit, last asked
        self._load_started = 0.0

    # ---- scheduler ----

    def asked(self, request: Any, num_computed_tokens: int, answer: tuple[int | None, bool]) -> None:
        """After get_num_new_matched_tokens: remembered until vLLM allocates the request."""
        if answer[0] is None:  # still fetching from a peer: asked again next step
            return
        if len(self._asked) >= MAX_ASKED:
            self._asked.clear()
        self._asked[request.request_id] = max(0, int(request.num_tokens) - int(num_computed_tokens))

    def allocated(self, request: Any, num_external_tokens: int) -> None:
        asked = self._asked.pop(request.request_id, None)
        if asked is None:
            return
        hit = max(0, int(num_external_tokens))
        self.stats.record(lookup_requests=1, lookup_tokens=asked, hit_requests=int(hit > 0), hit_tokens=hit)

    def finished(self, request: Any) -> None:
        self._asked.pop(str(getattr(request, "request_id", "")), None)

    # ---- worker ----

    def load_started(self) -> None:
        self._load_started = time.perf_counter()

    def load_done(self, meta: Any, entry_nbytes: int) -> None:
        loads = getattr(meta, "loads", None) or []
        planned = sum(1 for t in loads for b in t.block_ids if b != NULL_BLOCK_ID)
        if planned:
            self.stats.record(load_blocks=planned, load_bytes=planned * entry_nbytes, load_steps=1,
                              load_seconds=time.perf_counter() - self._load_started)

    def load_failed(self, block_ids: set[int], entry_nbytes: int) -> None:
        """The blocks a step reported failed: they were counted as loaded by load_done."""
        if block_ids:
            n = len(block_ids)
            self.stats.record(load_blocks=-n, load_failed_blocks=n, load_bytes=-n * entry_nbytes)

    def saved(self, keys: list[str], metas: Iterable[KVBlockMeta], entry_nbytes: int) -> None:
        """A put_many stored these entries (kv_worker's on_saved)."""
        self.stats.record(save_blocks=len(keys), save_bytes=len(keys) * entry_nbytes)
        self.events.stored(metas)

    def save_time(self, meta: Any, seconds: float) -> None:
        if getattr(meta, "saves", None):
            self.stats.record(save_seconds=seconds, save_steps=1)

    def take_stats(self) -> EcdKVConnectorStats | None:
        return self.stats.take()

    def take_worker_events(self) -> EcdKVEvents | None:
        return self.events.take()


@dataclass
class EcdECWorkerReport(EcdECWorkerMetadata):
    """The worker's step report (EcdECWorkerMetadata) plus what it counted: vLLM's V1 model
    runner does not collect an EC connector's worker-side `get_ec_connector_stats()` (only its
    V2 runner does), but both hand `build_connector_worker_meta()` to the scheduler, whose
    `get_ec_connector_stats()` reports the sum."""

    stats: dict[str, float] = field(default_factory=dict)

    def aggregate(self, other: Any) -> Any:
        super().aggregate(other)
        if isinstance(other, EcdECWorkerReport) and other is not self:
            add_counts(self.stats, other.stats)
        return self


class ECTelemetry:
    """EcdECConnector's statistics, both roles: the worker's travel in its step report."""

    def __init__(self) -> None:
        self.stats = EcdECConnectorStats()

    def looked_up(self, found: bool) -> None:
        self.stats.record(lookups=1, hits=int(bool(found)))

    def loading(self, meta: Any, encoder_cache: dict) -> tuple[float, list[str]]:
        """Before start_load_caches: the planned items not yet in the encoder cache."""
        hashes = [getattr(load, "mm_hash", None) for load in (getattr(meta, "loads", None) or [])]
        return time.perf_counter(), [h for h in hashes if h and h not in encoder_cache]

    def loaded(self, started: tuple[float, list[str]], encoder_cache: dict) -> None:
        t0, planned = started
        if not planned:
            return
        got = [encoder_cache[h] for h in planned if h in encoder_cache]
        self.stats.record(load_items=len(got), load_failed_items=len(planned) - len(got), load_steps=1,
                          load_bytes=sum(tensor_nbytes(t) for t in got), load_seconds=time.perf_counter() - t0)

    def saved(self, encoder_cache: dict, mm_hash: str, seconds: float) -> None:
        t = encoder_cache.get(mm_hash)
        if t is not None:
            self.stats.record(save_items=1, save_bytes=tensor_nbytes(t), save_seconds=seconds, save_steps=1)

    def take_stats(self) -> EcdECConnectorStats | None:
        return self.stats.take()

    def report(self, meta: Any) -> Any:
        """Worker: the step's report with what was counted since the last one."""
        counted = self.stats.take()
        if counted is None:
            return meta
        report = EcdECWorkerReport(stats=dict(counted.data))
        if isinstance(meta, EcdECWorkerMetadata):
            report.loaded, report.recomputed, report.failed = meta.loaded, meta.recomputed, meta.failed
        return report

    def received(self, connector_output: Any) -> None:
        """Scheduler: the workers' reports, added to what it counted itself."""
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(meta, EcdECWorkerReport):
            self.stats.record(**meta.stats)
