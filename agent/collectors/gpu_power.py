"""Power limit sampler, at the slow cadence: the limit the GPU enforces now (the lowest
of the operator's, the board's and the system's caps) and its default. An enforced limit
below the default is a capped GPU: slower by configuration, not by fault.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import Metric, gauge
from .gpu_samplers import GpuSampler, register_sampler

LIMIT_CALLS = {
    "enforced": "nvmlDeviceGetEnforcedPowerLimit",
    "default": "nvmlDeviceGetPowerManagementDefaultLimit",
}


@register_sampler
class PowerLimitSampler(GpuSampler):
    name = "power_limit"

    def read_slow(self, call: Callable[..., Any], values: dict[str, float | None]) -> dict | None:
        limits = {}
        for kind, fn in LIMIT_CALLS.items():
            mw = call(fn)
            if isinstance(mw, int) and mw > 0:
                limits[kind] = mw / 1000.0
        return {"watts": limits} if limits else None

    def metrics(self, gpus: list[tuple[tuple[str, str], dict]]) -> list[Metric]:
        m = gauge("rankguard_gpu_power_limit_watts",
                  "Power limit: enforced now, and the default", ("gpu", "uuid", "type"))  # fmt: skip
        for labels, r in gpus:
            for kind, watts in sorted(r["watts"].items()):
                m.add((*labels, kind), watts)
        return [m]

    def facts(self, reading: dict) -> dict[str, Any]:
        return {"power_limit_watts": reading.get("watts")}
