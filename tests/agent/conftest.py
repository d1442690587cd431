"""Fixtures shared by the agent's tests."""

from __future__ import annotations

import pytest
from builders import FakeClock

from rankguard.agent.collectors import CollectorContext
from rankguard.agent.collectors.gpu import GpuCollector, GpuConfig
from rankguard.agent.nvml_double import NvmlDouble, make_double


@pytest.fixture
def gpu_collector():
    """gpu_collector(state | NvmlDouble, ranks=..., expected=..., **GpuConfig) -> (collector, double, clock)."""
    made = []

    def _make(state=None, *, ranks=list, expected=None, table=None, **config):
        nvml = state if isinstance(state, NvmlDouble) else NvmlDouble(state or make_double(2))
        clock = FakeClock()
        ctx = CollectorContext(nvml=nvml, clock=clock, rank_processes=ranks, expected_gpus=expected,
                               rank_table=table)  # fmt: skip
        collector = GpuCollector(ctx, GpuConfig(event_timeout_ms=50, **config))
        made.append(collector)
        return collector, nvml, clock

    yield _make
    for collector in made:
        collector.close()
