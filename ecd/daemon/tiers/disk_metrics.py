"""The disk tier's /metrics families (ecd_disk_*), read from its counters at scrape time
(DiskTier.metric_families; ops/metrics.py asks the lower tier for them, whatever it is)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..ops.metrics import counter_by
from .disk_records import SPILL_DROP_REASONS

if TYPE_CHECKING:  # pragma: no cover
    from .disk import DiskTier


def disk_metrics(disk: "DiskTier") -> Iterator[Any]:
    """The disk tier's families ([pool.disk]: DiskTier.metric_families)."""
    yield GaugeMetricFamily("ecd_disk_capacity_bytes", "The disk tier's byte budget ([pool.disk] size)",
                            value=disk.capacity)
    yield GaugeMetricFamily("ecd_disk_used_bytes", "Bytes of records on disk (headers and padding included)",
                            value=disk.used)
    yield GaugeMetricFamily("ecd_disk_entries", "Records on disk (spilled and persisted)", value=len(disk.records))
    yield GaugeMetricFamily("ecd_disk_degraded", "1 while the disk tier's filesystem refuses writes (full or "
                            "read-only: records still served, writes fail, probed every second), else 0",
                            value=1 if disk.health.degraded else 0)
    yield GaugeMetricFamily("ecd_disk_writes_in_flight", "Spills and write-throughs being written", value=disk.writes)
    yield GaugeMetricFamily("ecd_disk_spill_buffer_bytes", "Evicted bytes waiting in RAM for their spill",
                            value=disk.staging_alloc.used if disk.staging_alloc is not None else 0)
    c = disk.counters
    yield CounterMetricFamily("ecd_disk_spills", "Entries evicted from the host pool and written to disk",
                              value=c["spills"])
    yield counter_by("ecd_disk_spills_dropped", "Evicted entries not spilled, by reason: too_small "
                     "(min_spill_size), too_large, disk_full (persisted records fill it), backlog (spill_buffer "
                     "full), disabled (spill = false), failed (the write failed)", "reason",
                     ((reason, disk.dropped[reason]) for reason in SPILL_DROP_REASONS))
    yield CounterMetricFamily("ecd_disk_promotions", "Entries read back from disk into the host pool",
                              value=c["promotions"])
    yield CounterMetricFamily("ecd_disk_promotion_failures", "Reads of disk records that failed (see "
                              "ecd_disk_errors_total and ecd_integrity_failures_total)", value=c["promotion_failures"])
    yield CounterMetricFamily("ecd_disk_evictions", "Spilled records dropped for room on disk",
                              value=c["disk_evictions"])
    errors = CounterMetricFamily("ecd_disk_errors", "Failed disk operations by kind (enospc, eio, readonly, "
                                 "missing, full, io, shutdown)", labels=["kind"])
    for kind, n in sorted(disk.errors.items()):
        errors.add_metric([kind], n)
    yield errors
    hist = disk.persist_latency
    yield HistogramMetricFamily("ecd_disk_write_through_seconds", "put(persist=True): commit to durable on disk",
                                buckets=hist.buckets(), sum_value=hist.sum)
