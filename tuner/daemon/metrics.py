"""Prometheus metrics of the daemon, kept off the hot path.

The serving loop only bumps plain Python counters (a dict increment and a bisect per request); a custom
collector turns them into Prometheus families when the endpoint is scraped. The HTTP endpoint binds
127.0.0.1 unless told otherwise.

The families about profiles (served, current, stale, not served) carry a `provenance` label, one sample for each of
the profile record's values (`PROVENANCES`: measured, node_model, preset), so a dashboard tells a node serving
modelled numbers from one serving measured ones; no other label value is ever made (bounded cardinality).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from moetune.runtime.profile_record import PROVENANCES

# Latency buckets in seconds: 25 us .. 1 s.
LATENCY_BUCKETS: tuple[float, ...] = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1.0,
)


class DaemonMetrics:
    """Counters the serving loop and the workers update; read by the collector on scrape. The request counters are
    bumped from three threads (the serving loop, and the list and retune workers for the requests they answer): each
    update takes the lock (uncontended it costs well under a microsecond), since a read-modify-write of a dict entry
    from two threads loses counts."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}
        # op -> [bucket counts..., +Inf count], sum
        self._hist: dict[str, list[int]] = {}
        self._hist_sum: dict[str, float] = {}
        self.dropped_frames = 0
        # get_profile replies carrying a profile, by the profile's provenance (every value present: a 0 is shown)
        self.profiles_served: dict[str, int] = dict.fromkeys(PROVENANCES, 0)
        self.jobs: dict[str, int] = {}  # finished jobs by outcome
        self.discoveries: dict[str, int] = {}
        self.fabric_changes = 0
        # gauges read through callbacks (set by the daemon)
        self.gauges: dict[str, Callable[[], float]] = {}
        # gauges of profiles held, counted by provenance (set by the daemon): name -> {provenance: count}
        self.provenance_gauges: dict[str, Callable[[], Mapping[str, float]]] = {}
        self._lock = threading.Lock()  # every counter updated from more than one thread, and the scrape's copy

    # -- hot path (the serving loop, and the list and retune workers) ---------------------------------------
    def observe(self, op: str, outcome: str, seconds: float) -> None:
        k = (op, outcome)
        slot = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        with self._lock:
            self.requests[k] = self.requests.get(k, 0) + 1
            h = self._hist.get(op)
            if h is None:
                h = self._hist[op] = [0] * (len(LATENCY_BUCKETS) + 1)
                self._hist_sum[op] = 0.0
            h[slot] += 1
            self._hist_sum[op] += seconds

    def profile_served(self, provenance: str) -> None:
        """A get_profile reply carried a profile of `provenance` (one of PROVENANCES: `provenance_of` gives no other;
        anything else is refused rather than made a new label value)."""
        if provenance not in self.profiles_served:
            raise ValueError(f"provenance must be one of {', '.join(PROVENANCES)}, got {provenance!r}")
        with self._lock:
            self.profiles_served[provenance] += 1

    def total_requests(self) -> int:
        with self._lock:
            return sum(self.requests.values())

    # -- worker side -----------------------------------------------------------------------------
    def job_finished(self, outcome: str) -> None:
        with self._lock:
            self.jobs[outcome] = self.jobs.get(outcome, 0) + 1

    def discovery(self, outcome: str) -> None:
        with self._lock:
            self.discoveries[outcome] = self.discoveries.get(outcome, 0) + 1

    # -- prometheus ------------------------------------------------------------------------------
    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self._lock:  # one consistent copy: a histogram's counts and its sum from the same moment
            requests = list(self.requests.items())
            hist = [(op, list(counts), self._hist_sum.get(op, 0.0)) for op, counts in self._hist.items()]
            served = dict(self.profiles_served)
        c = CounterMetricFamily("moetune_requests", "Requests answered, by op and outcome", labels=["op", "outcome"])
        for (op, outcome), n in requests:
            c.add_metric([op, outcome], n)
        yield c
        h = HistogramMetricFamily("moetune_request_seconds", "Time from receipt to reply", labels=["op"])
        for op, counts, total in hist:
            cum, buckets = 0, []
            for le, n in zip((*LATENCY_BUCKETS, float("inf")), counts, strict=True):
                cum += n
                buckets.append(("+Inf" if le == float("inf") else repr(le), cum))
            h.add_metric([op], buckets, total)
        yield h
        yield CounterMetricFamily("moetune_dropped_frames", "Multipart messages dropped as unparseable", value=self.dropped_frames)
        ps = CounterMetricFamily("moetune_profiles_served", "get_profile replies carrying a profile, by the profile's "
                                 "provenance (measured, or modelled: node_model, preset)", labels=["provenance"])
        for prov in PROVENANCES:
            ps.add_metric([prov], served[prov])
        yield ps
        j = CounterMetricFamily("moetune_jobs", "Re-tune jobs finished, by outcome", labels=["outcome"])
        for outcome, n in list(self.jobs.items()):
            j.add_metric([outcome], n)
        yield j
        d = CounterMetricFamily("moetune_discoveries", "Fabric discoveries, by outcome", labels=["outcome"])
        for outcome, n in list(self.discoveries.items()):
            d.add_metric([outcome], n)
        yield d
        yield CounterMetricFamily("moetune_fabric_changes", "Fingerprint changes seen", value=self.fabric_changes)
        for name, fn in list(self.gauges.items()):
            try:
                value = float(fn())
            except Exception:  # broad: one failing gauge must not break the whole /metrics scrape
                continue
            yield GaugeMetricFamily(f"moetune_{name}", name.replace("_", " "), value=value)
        for name, counts_fn in list(self.provenance_gauges.items()):
            try:
                counts = counts_fn()
                values = [float(counts.get(prov, 0)) for prov in PROVENANCES]  # only the record's values: bounded
            except Exception:  # broad: as above
                continue
            g = GaugeMetricFamily(f"moetune_{name}", f"{name.replace('_', ' ')}, by provenance",
                                  labels=["provenance"])
            for prov, value in zip(PROVENANCES, values, strict=True):
                g.add_metric([prov], value)
            yield g


def metrics_registry(metrics: DaemonMetrics) -> Any:
    """A prometheus-client registry holding only the daemon's collector: what /metrics serves (and tests read with
    `generate_latest`)."""
    from prometheus_client import CollectorRegistry

    class _Collector:
        def collect(self) -> Iterator[Any]:
            return metrics.collect()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return registry


def start_metrics_server(metrics: DaemonMetrics, port: int, addr: str = "127.0.0.1") -> Any:
    """Serve /metrics on addr:port from `metrics_registry`."""
    from prometheus_client import start_http_server

    return start_http_server(port, addr=addr, registry=metrics_registry(metrics))
