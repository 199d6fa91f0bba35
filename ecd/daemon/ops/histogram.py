"""One latency histogram for /metrics: counts per bucket as plain ints (a hot path only bumps
them: prometheus_client's own histograms would add several µs per observation), turned into a
Prometheus histogram's cumulative buckets at scrape time. Used for request handling (metrics.py),
peer fetches (peer/cluster.py) and disk write-throughs (tiers/disk_records.py)."""
from __future__ import annotations

import bisect


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # upper bounds of the buckets, ascending; +Inf follows them
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def buckets(self) -> list[tuple[str, int]]:
        """(le, cumulative count) per bucket, +Inf last: HistogramMetricFamily's `buckets`."""
        out, cumulative = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            cumulative += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return out
