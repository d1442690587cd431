"""Collectors: one file each, registered by name, run by one shared wrapper.

A collector reads one part of the node (NVML, /proc, /sys, the ranks' telemetry) and
returns a `CollectorResult`: Prometheus metric families (rendered generically by the
agent's exposition code) and JSON-able facts for `/v1/node` and the health verdict.
`run_collector` times every collector and catches its failure, so the agent reports
`rankguard_collector_duration_seconds{collector}` and
`rankguard_collector_success{collector}` for all of them, as node_exporter does.
Adding a collector is a one-file change: subclass `Collector`, decorate with `@register`,
import the module in `load_all()`.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

# The collectors' label names are the contract's (JOB_LABEL: training_job, not job).
from ...contract.metrics import JOB_LABEL, RANK_LABELS  # noqa: F401

log = logging.getLogger("rankguard.agent.collectors")

METRIC_KINDS = ("gauge", "counter", "info")


@dataclass
class Metric:
    """One metric family: name (with the `rankguard_` prefix; counters end in `_total`),
    kind, help, label names, and samples as (label values, value). For `info` families
    the name ends in `_info` and every sample's value is 1."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in METRIC_KINDS:
            raise ValueError(f"{self.name}: kind must be one of {METRIC_KINDS}")
        if not self.name.startswith("rankguard_"):
            raise ValueError(f"{self.name}: metric names start with rankguard_")
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters end in _total")
        if self.kind == "info" and not self.name.endswith("_info"):
            raise ValueError(f"{self.name}: info metrics end in _info")

    def add(self, label_values: tuple[str, ...] | list[str], value: float = 1.0) -> Metric:
        values = tuple(str(v) for v in label_values)
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name}: expected labels {self.labels}, got {values}")
        self.samples.append((values, float(value)))
        return self


def gauge(name: str, help: str, labels: tuple[str, ...] = ()) -> Metric:
    return Metric(name, "gauge", help, labels)


def counter(name: str, help: str, labels: tuple[str, ...] = ()) -> Metric:
    return Metric(name, "counter", help, labels)


def info(name: str, help: str, labels: tuple[str, ...]) -> Metric:
    return Metric(name, "info", help, labels)


@dataclass
class CollectorResult:
    metrics: list[Metric] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)  # JSON-able


@dataclass
class CollectorContext:
    """What a collector may read; every root is injectable so tests use fixtures."""

    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")
    # Directories whose filesystems are watched for space, by role ("checkpoint", "data").
    watch_dirs: dict[str, Path] = field(default_factory=dict)
    # Live training processes on this node as (job, rank, pid), from the rank table.
    rank_processes: Callable[[], list[tuple[str, int, int]]] = list
    # An NVML module (pynvml, or the double); None means "import pynvml".
    nvml: Any = None
    expected_gpus: int | None = None
    node: str = ""
    clock: Callable[[], float] = time.monotonic


class Collector(ABC):
    name: ClassVar[str]

    def __init__(self, ctx: CollectorContext):
        self.ctx = ctx

    @abstractmethod
    def collect(self) -> CollectorResult:
        """Read once; raise on failure (the wrapper records it)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most collectors hold nothing
        """Release handles and threads."""


REGISTRY: dict[str, type[Collector]] = {}


def register(cls: type[Collector]) -> type[Collector]:
    if cls.name in REGISTRY:
        raise ValueError(f"collector {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls
    return cls


@dataclass
class CollectorRun:
    name: str
    success: bool
    duration_seconds: float
    finished_at: float  # unix time
    result: CollectorResult | None
    error: str | None = None


def run_collector(collector: Collector) -> CollectorRun:
    start = time.perf_counter()
    try:
        result = collector.collect()
        return CollectorRun(collector.name, True, time.perf_counter() - start, time.time(), result)
    except Exception as exc:  # one collector's failure never stops the others
        log.warning("collector %s failed: %s", collector.name, exc)
        return CollectorRun(
            collector.name, False, time.perf_counter() - start, time.time(), None, repr(exc)
        )


def load_all() -> dict[str, type[Collector]]:
    """Import every collector module so it registers itself."""
    from . import backup, gpu, host, network, ranks, storage  # noqa: F401

    return REGISTRY
