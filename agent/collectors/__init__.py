"""Collectors: one file each, registered by name, run by one shared wrapper.

A collector reads one part of the node (NVML, /proc, /sys, the ranks' telemetry) and
returns a `CollectorResult`: Prometheus metric families (rendered generically by the
agent's exposition code) and JSON-able facts for `/v1/node` and the health verdict.
`run_collector` times every collector and catches its failure, so the agent reports
`rankguard_collector_duration_seconds{collector}` and
`rankguard_collector_success{collector}` for all of them, as node_exporter does.
Adding a collector is a one-file change: subclass `Collector`, decorate with `@register`,
import the module in `load_all()`. Its settings are its own `Config` dataclass (at least
`enabled`), read from the agent's `[collectors.<name>]` table by `settings_for`.
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

METRIC_KINDS = ("gauge", "counter", "info", "histogram")


@dataclass
class Metric:
    """One metric family: name (with the `rankguard_` prefix; counters end in `_total`),
    kind, help, label names, and samples as (label values, value). For `info` families
    the name ends in `_info` and every sample's value is 1. A `histogram` keeps its
    series in `buckets` instead: (label values, cumulative (le, count) pairs with `+Inf`
    last, sum)."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    buckets: list[tuple[tuple[str, ...], list[tuple[str, float]], float]] = field(
        default_factory=list
    )

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
        values = tuple(map(str, label_values))  # ~1,000 calls a collection: no generator
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name}: expected labels {self.labels}, got {values}")
        self.samples.append((values, float(value)))
        return self

    def add_histogram(
        self, label_values: tuple[str, ...], buckets: list[tuple[str, float]], total: float
    ) -> Metric:
        values = tuple(str(v) for v in label_values)
        if self.kind != "histogram" or len(values) != len(self.labels):
            raise ValueError(f"{self.name}: not a histogram with labels {self.labels}")
        self.buckets.append((values, buckets, float(total)))
        return self


def gauge(name: str, help: str, labels: tuple[str, ...] = ()) -> Metric:
    return Metric(name, "gauge", help, labels)


def counter(name: str, help: str, labels: tuple[str, ...] = ()) -> Metric:
    return Metric(name, "counter", help, labels)


def histogram(name: str, help: str, labels: tuple[str, ...] = ()) -> Metric:
    return Metric(name, "histogram", help, labels)


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
    # The agent's rank table and telemetry receiver (the ranks collector reports them).
    rank_table: Any = None
    receiver: Any = None


@dataclass(frozen=True)
class CollectorSettings:
    """[collectors.<name>] of a collector without settings of its own."""

    enabled: bool = True  # false: not run, no metrics, no facts, not in the node verdict


class Collector(ABC):
    name: ClassVar[str]
    Config: ClassVar[type] = CollectorSettings  # a subclass of it when it has settings

    def __init__(self, ctx: CollectorContext, config: Any = None):
        self.ctx = ctx
        self.config = config if config is not None else self.Config()

    @abstractmethod
    def collect(self) -> CollectorResult:
        """Read once; raise on failure (the wrapper records it)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most collectors hold nothing
        """Release handles and threads."""


REGISTRY: dict[str, type[Collector]] = {}


def registrar(table: dict[str, type], what: str) -> Callable[[type], type]:
    """A class decorator entering a class in `table` under its `name`, once."""

    def register(cls: type) -> type:
        if cls.name in table:
            raise ValueError(f"{what} {cls.name!r} registered twice")
        table[cls.name] = cls
        return cls

    return register


register = registrar(REGISTRY, "collector")


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
    from . import backup, gpu, host, network, ranks, snapshots, storage  # noqa: F401

    return REGISTRY


def settings_for(tables: Any) -> dict[str, Any]:
    """Every registered collector's settings, from the `[collectors]` table (None: all
    defaults), each built by the collector's own `Config`. SettingsError, one line naming
    the key, for an unknown collector, key or a value of the wrong type."""
    from ...service.settings import SettingsError, build

    registry = load_all()
    if tables is None:
        tables = {}
    if not isinstance(tables, dict):
        raise SettingsError("collectors: expected a table of [collectors.<name>] tables")
    unknown = sorted(set(tables) - set(registry))
    if unknown:
        raise SettingsError(
            f"collectors.{unknown[0]}: no such collector (known: {', '.join(sorted(registry))})"
        )
    return {
        name: build(cls.Config, tables.get(name), f"collectors.{name}")
        for name, cls in sorted(registry.items())
    }
