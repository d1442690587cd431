"""Prometheus exposition: render collector results as metric families, one snapshot per scrape.

Nothing carries over between scrapes: `SnapshotCollector.collect()` builds fresh families
from the snapshot the agent swapped in last, plus each collector's own duration and
success. The registry is our own, never prometheus_client's global one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from .collectors import CollectorRun, Metric, gauge


def to_family(metric: Metric):
    if metric.kind == "counter":
        family = CounterMetricFamily(metric.name, metric.help, labels=metric.labels)
    else:  # gauges, and _info metrics as gauges of 1 (the text format has no info type)
        family = GaugeMetricFamily(metric.name, metric.help, labels=metric.labels)
    for values, value in metric.samples:
        family.add_metric(list(values), value)
    return family


def collector_meta(runs: Iterable[CollectorRun]) -> list[Metric]:
    """node_exporter's per-collector duration and success, for every collector."""
    duration = gauge(
        "rankguard_collector_duration_seconds",
        "Time the collector's last run took.",
        ("collector",),
    )
    success = gauge(
        "rankguard_collector_success", "1 if the collector's last run succeeded.", ("collector",)
    )
    for run in runs:
        duration.add((run.name,), run.duration_seconds)
        success.add((run.name,), 1.0 if run.success else 0.0)
    return [duration, success]


def merge(metrics: Iterable[Metric]) -> list[Metric]:
    """One family per name (two collectors may contribute to one name, e.g. rank series)."""
    by_name: dict[str, Metric] = {}
    for m in metrics:
        if m.name in by_name:
            existing = by_name[m.name]
            if (existing.kind, existing.labels) != (m.kind, m.labels):
                raise ValueError(f"{m.name}: conflicting definitions from two collectors")
            existing.samples.extend(m.samples)
        else:
            by_name[m.name] = Metric(m.name, m.kind, m.help, m.labels, list(m.samples))
    return list(by_name.values())


class SnapshotCollector:
    """A prometheus_client custom collector over the agent's latest snapshot."""

    def __init__(self, snapshot: Callable[[], list[Metric]]):
        self._snapshot = snapshot

    def collect(self):
        for metric in merge(self._snapshot()):
            yield to_family(metric)

    def describe(self):
        return []  # unchecked collector: its families change with the node


def make_registry(snapshot: Callable[[], list[Metric]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    ProcessCollector(registry=registry)  # process_*: CPU, memory, open fds, as exporters have
    return registry
