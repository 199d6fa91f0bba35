"""vLLM's connector API beyond transfers, for ecd's connectors: statistics in vLLM's metrics
(stats.py), the blocks ecd stored in vLLM's KV event stream (kv_events.py), handshake metadata
(handshake.py); recorders.py counts, hooks.py holds the connector methods. docs/vllm.md explains."""
from .handshake import EcdHandshakeMetadata, WorkerDaemons
from .hooks import ECConnectorHooks, KVConnectorHooks
from .kv_events import EcdKVEvents
from .recorders import ECTelemetry, KVTelemetry
from .stats import EcdECConnectorStats, EcdKVConnectorStats

__all__ = ["ECConnectorHooks", "ECTelemetry", "EcdECConnectorStats", "EcdHandshakeMetadata", "EcdKVConnectorStats",
           "EcdKVEvents", "KVConnectorHooks", "KVTelemetry", "WorkerDaemons"]
