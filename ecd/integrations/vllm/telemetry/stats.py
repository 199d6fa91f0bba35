"""ecd's connector statistics in vLLM's own metrics: `KVConnectorStats` / `ECConnectorStats`
subclasses (plain counters, summed across workers and steps) and the Prometheus counters vLLM
registers through `build_prom_metrics`.

How vLLM moves them (0.32 and 0.33 alike): each worker's connector answers
`get_kv_connector_stats()` after every step (what it counted since the last call); the executor
sums the workers' (`aggregate`), the scheduler adds its own connector's (`aggregate` again) and
sends `to_dict()` (`data`, plain numbers) to the front-end, where `build_kv_connector_stats(data)`
rebuilds the object for vLLM's logging stat logger (`reduce()`: the "KV Transfer metrics: ..."
line every log interval) and `build_prom_metrics(...).observe(data)` adds them to the counters
below. The EC connector's go the same way (`get_ec_connector_stats`, "EC Transfer metrics").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

MIB = float(1 << 20)

# What the KV connector counts (the keys of `data`), and the Prometheus counter each becomes.
KV_COUNTERS: dict[str, tuple[str, str]] = {
    # scheduler side: each request vLLM allocated after asking the connector
    "lookup_requests": ("vllm:ecd_kv_lookup_requests", "Requests whose prompt ecd was asked for"),
    "hit_requests": ("vllm:ecd_kv_hit_requests", "Requests ecd had at least one block of"),
    "lookup_tokens": ("vllm:ecd_kv_lookup_tokens", "Prompt tokens asked of ecd (past the local prefix cache)"),
    "hit_tokens": ("vllm:ecd_kv_hit_tokens", "Prompt tokens loaded from ecd instead of computed"),
    # worker side (summed over the workers: with TP/PP a block is one entry per rank)
    "load_blocks": ("vllm:ecd_kv_loaded_blocks", "Block entries loaded from ecd into the KV cache"),
    "load_failed_blocks": ("vllm:ecd_kv_load_failed_blocks",
                           "Planned block entries that could not be loaded (recomputed or failed)"),
    "load_bytes": ("vllm:ecd_kv_loaded_bytes", "Bytes loaded from ecd into the KV cache"),
    "load_seconds": ("vllm:ecd_kv_load_seconds", "Time workers spent loading from ecd (start_load_kv)"),
    "save_blocks": ("vllm:ecd_kv_saved_blocks", "Block entries saved into ecd"),
    "save_bytes": ("vllm:ecd_kv_saved_bytes", "Bytes saved into ecd"),
    "save_seconds": ("vllm:ecd_kv_save_seconds", "Time workers spent saving into ecd (wait_for_save)"),
}
KV_STEPS = ("load_steps", "save_steps")  # steps that loaded / saved anything: for the averages

EC_COUNTERS: dict[str, tuple[str, str]] = {
    "lookups": ("vllm:ecd_ec_lookups", "Encoder outputs asked of ecd by the scheduler"),
    "hits": ("vllm:ecd_ec_hits", "Encoder outputs ecd held when asked"),
    "load_items": ("vllm:ecd_ec_loaded_items", "Encoder outputs loaded from ecd"),
    "load_failed_items": ("vllm:ecd_ec_load_failed_items", "Planned encoder output loads that failed"),
    "load_bytes": ("vllm:ecd_ec_loaded_bytes", "Bytes of encoder outputs loaded from ecd"),
    "load_seconds": ("vllm:ecd_ec_load_seconds", "Time workers spent loading encoder outputs"),
    "save_items": ("vllm:ecd_ec_saved_items", "Encoder outputs saved into ecd"),
    "save_bytes": ("vllm:ecd_ec_saved_bytes", "Bytes of encoder outputs saved into ecd"),
    "save_seconds": ("vllm:ecd_ec_save_seconds", "Time workers spent saving encoder outputs"),
}
EC_STEPS = ("load_steps", "save_steps")


def add_counts(into: dict[str, Any], counts: dict[str, Any]) -> None:
    for key, value in counts.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            into[key] = into.get(key, 0) + value


def _rate(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole else 0.0


def _ms_per(seconds: float, steps: float) -> float:
    return round(1000.0 * seconds / steps, 3) if steps else 0.0


class _Counted:
    """Counters in `data` (str -> number): summed by `aggregate`, cleared by `reset`."""

    data: dict[str, Any]

    def reset(self) -> None:
        self.data = {}

    def record(self, **counts: float) -> None:
        add_counts(self.data, counts)

    def aggregate(self, other: Any) -> Any:
        if other is not None and other is not self:
            add_counts(self.data, getattr(other, "data", None) or {})
        return self

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> Any:
        """What was counted since the last take (a new object), or None when nothing was."""
        if self.is_empty():
            return None
        taken = type(self)(data=dict(self.data))  # type: ignore[call-arg]  # the dataclass's
        self.reset()
        return taken


@dataclass
class EcdKVConnectorStats(_Counted, KVConnectorStats):
    """EcdKVConnector's counters (KV_COUNTERS, KV_STEPS)."""

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        return {
            "ecd_hit_tokens": d.get("hit_tokens", 0),
            "ecd_lookup_tokens": d.get("lookup_tokens", 0),
            "ecd_token_hit_rate": _rate(d.get("hit_tokens", 0), d.get("lookup_tokens", 0)),
            "ecd_hit_requests": d.get("hit_requests", 0),
            "ecd_lookup_requests": d.get("lookup_requests", 0),
            "ecd_loaded_blocks": d.get("load_blocks", 0),
            "ecd_load_failed_blocks": d.get("load_failed_blocks", 0),
            "ecd_loaded_MiB": round(d.get("load_bytes", 0) / MIB, 3),
            "ecd_load_ms_per_step": _ms_per(d.get("load_seconds", 0.0), d.get("load_steps", 0)),
            "ecd_saved_blocks": d.get("save_blocks", 0),
            "ecd_saved_MiB": round(d.get("save_bytes", 0) / MIB, 3),
            "ecd_save_ms_per_step": _ms_per(d.get("save_seconds", 0.0), d.get("save_steps", 0)),
        }


@dataclass
class EcdECConnectorStats(_Counted, ECConnectorStats):
    """EcdECConnector's counters (EC_COUNTERS, EC_STEPS)."""

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        return {
            "ecd_hits": d.get("hits", 0),
            "ecd_lookups": d.get("lookups", 0),
            "ecd_hit_rate": _rate(d.get("hits", 0), d.get("lookups", 0)),
            "ecd_loaded_items": d.get("load_items", 0),
            "ecd_load_failed_items": d.get("load_failed_items", 0),
            "ecd_loaded_MiB": round(d.get("load_bytes", 0) / MIB, 3),
            "ecd_load_ms_per_step": _ms_per(d.get("load_seconds", 0.0), d.get("load_steps", 0)),
            "ecd_saved_items": d.get("save_items", 0),
            "ecd_saved_MiB": round(d.get("save_bytes", 0) / MIB, 3),
            "ecd_save_ms_per_step": _ms_per(d.get("save_seconds", 0.0), d.get("save_steps", 0)),
        }


def _make_counters(owner: Any, counters: dict[str, tuple[str, str]], labelnames: list[str]) -> dict[str, dict]:
    """One Prometheus counter per field, with a child per engine (vLLM's create_metric_per_engine)."""
    made: dict[str, dict] = {}
    for field, (name, doc) in counters.items():
        metric = owner._counter_cls(name=name, documentation=doc, labelnames=labelnames)
        made[field] = {idx: metric.labels(*values) for idx, values in owner.per_engine_labelvalues.items()}
    return made


def _observe(counters: dict[str, dict], data: dict[str, Any], engine_idx: int) -> None:
    for field, per_engine in counters.items():
        value = data.get(field)
        if value and engine_idx in per_engine:
            per_engine[engine_idx].inc(value)


class EcdKVPromMetrics(KVConnectorPromMetrics):
    """The KV counters as Prometheus counters (`vllm:ecd_kv_*_total`), labelled per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = _make_counters(self, KV_COUNTERS, labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        _observe(self.counters, transfer_stats_data, engine_idx)


class EcdECPromMetrics(ECConnectorPromMetrics):
    """The EC counters as Prometheus counters (`vllm:ecd_ec_*_total`), labelled per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = _make_counters(self, EC_COUNTERS, labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        _observe(self.counters, transfer_stats_data, engine_idx)
