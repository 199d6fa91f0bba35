"""The vLLM connector hooks for statistics, KV events and handshake metadata, as mixins of
EcdKVConnector and EcdECConnector (so the facades keep to vLLM's transfer calls; each of those
adds one line that records into `self.telemetry`). Every hook exists in vLLM 0.32 and 0.33 alike.
None of them raises into the engine."""
from __future__ import annotations

import logging
from typing import Any, Iterable

from .handshake import EcdHandshakeMetadata, WorkerDaemons, local_daemon
from .kv_events import EcdKVEvents
from .recorders import ECTelemetry, KVTelemetry
from .stats import EcdECConnectorStats, EcdECPromMetrics, EcdKVConnectorStats, EcdKVPromMetrics

logger = logging.getLogger("vllm.ecd.kv_connector")


class KVConnectorHooks:
    """Mixed into EcdKVConnector. Needs `telemetry` (KVTelemetry), `client` (LazyClient),
    `connector_worker` / `connector_scheduler`, `worker_daemons` (WorkerDaemons or None)."""

    telemetry: KVTelemetry
    client: Any
    connector_worker: Any
    connector_scheduler: Any
    worker_daemons: WorkerDaemons | None

    def _entry_nbytes(self) -> int:
        paged = getattr(self.connector_worker, "paged", None)
        return int(paged.entry_nbytes) if paged is not None else 0

    def _on_saved(self, keys: list[str], metas: list[Any]) -> None:
        self.telemetry.saved(keys, metas, self._entry_nbytes())

    # ---- statistics (stats.py) ----

    def get_kv_connector_stats(self) -> EcdKVConnectorStats | None:
        """What this side counted since the last call (worker: after each step; scheduler: after
        vLLM updated it from the step's output)."""
        return self.telemetry.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> EcdKVConnectorStats | None:
        return EcdKVConnectorStats(data=dict(data)) if data is not None else EcdKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> EcdKVPromMetrics:
        return EcdKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- KV events (kv_events.py) ----

    def get_kv_connector_kv_cache_events(self) -> EcdKVEvents | None:
        return self.telemetry.take_worker_events()

    def take_events(self) -> Iterable[Any]:
        return self.telemetry.events.take_events()

    # ---- handshake (handshake.py) ----

    def get_handshake_metadata(self) -> EcdHandshakeMetadata | None:
        if self.connector_worker is None:
            return None
        try:
            return local_daemon(self.client)
        except Exception as exc:  # never out of the connector
            logger.warning("ecd kv connector: no handshake metadata (%s: %s)", type(exc).__name__, exc)
            return None

    def set_xfer_handshake_metadata(self, metadata: dict[Any, Any]) -> None:
        if self.worker_daemons is None:
            return
        try:
            self.worker_daemons.received(metadata)
        except Exception as exc:  # never out of the connector
            logger.warning("ecd kv connector: cannot check the workers' daemons (%s: %s)", type(exc).__name__, exc)


class ECConnectorHooks:
    """Mixed into EcdECConnector. Needs `telemetry` (ECTelemetry)."""

    telemetry: ECTelemetry
    connector_scheduler: Any

    def get_ec_connector_stats(self) -> EcdECConnectorStats | None:
        """The scheduler's: its lookups plus the workers' counts (their step reports). A worker
        answers None: its counts go in build_connector_worker_meta, which both of vLLM's model
        runners deliver (only the V2 runner collects a worker's get_ec_connector_stats)."""
        if self.connector_scheduler is None:
            return None
        return self.telemetry.take_stats()

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> EcdECConnectorStats | None:
        return EcdECConnectorStats(data=dict(data)) if data is not None else EcdECConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> EcdECPromMetrics:
        return EcdECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
