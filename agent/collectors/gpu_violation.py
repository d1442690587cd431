"""Clock violation time sampler: how long each policy (power, thermal, sync boost, board
limit, reliability, low utilisation, application and base clocks) held the GPU's clocks
below what was asked, as NVML's cumulative counters, read every collection in one
batched field read.

The clock event reasons of gpu.py are a snapshot at each collection: a throttle shorter
than the interval is missed. These counters add up every nanosecond, so
`rate(rankguard_gpu_clock_violation_seconds_total[5m])` is the share of time throttled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml

from . import Metric, counter
from .gpu_samplers import GpuSampler, ns_to_seconds, register_sampler

# reason label -> NVML field id (nanoseconds since driver load)
VIOLATION_FIELDS: dict[str, int] = {
    "power": pynvml.NVML_FI_DEV_PERF_POLICY_POWER,
    "thermal": pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL,
    "sync_boost": pynvml.NVML_FI_DEV_PERF_POLICY_SYNC_BOOST,
    "board_limit": pynvml.NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT,
    "low_utilization": pynvml.NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION,
    "reliability": pynvml.NVML_FI_DEV_PERF_POLICY_RELIABILITY,
    "total_app_clocks": pynvml.NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS,
    "total_base_clocks": pynvml.NVML_FI_DEV_PERF_POLICY_TOTAL_BASE_CLOCKS,
}


@register_sampler
class ViolationSampler(GpuSampler):
    name = "violation"
    fields = VIOLATION_FIELDS

    def read(self, call: Callable[..., Any], values: dict[str, float | None]) -> dict | None:
        seconds = {k: ns_to_seconds(v) for k, v in values.items() if v is not None and v >= 0}
        return {"seconds": seconds} if seconds else None

    def metrics(self, gpus: list[tuple[tuple[str, str], dict]]) -> list[Metric]:
        m = counter("rankguard_gpu_clock_violation_seconds_total",
                    "Time a policy held the GPU's clocks down, since driver load, by reason",
                    ("gpu", "uuid", "reason"))  # fmt: skip
        for labels, r in gpus:
            for reason, s in sorted(r["seconds"].items()):
                m.add((*labels, reason), s)
        return [m]

    def facts(self, reading: dict) -> dict[str, Any]:
        return {"clock_violation_seconds": reading.get("seconds")}
