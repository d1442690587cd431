"""GPU memory sampler: the memory clock and the memory (HBM) temperature, every
collection (the temperature in the batched field read). HBM runs hotter than the core
and throttles on its own limit: the core temperature alone misses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml

from . import Metric, gauge
from .gpu_samplers import GpuSampler, register_sampler

# NVML reports 0 (or garbage above this) where a board has no memory sensor
MAX_PLAUSIBLE_CELSIUS = 200.0


@register_sampler
class MemorySampler(GpuSampler):
    name = "memory"
    fields = {"temperature": pynvml.NVML_FI_DEV_MEMORY_TEMP}

    def read(self, call: Callable[..., Any], values: dict[str, float | None]) -> dict | None:
        out: dict[str, float] = {}
        temp = values.get("temperature")
        if temp is not None and 0 < temp < MAX_PLAUSIBLE_CELSIUS:
            out["temperature_celsius"] = float(temp)
        mhz = call("nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_MEM)
        if isinstance(mhz, int) and mhz > 0:
            out["clock_hertz"] = mhz * 1e6
        return out or None

    def metrics(self, gpus: list[tuple[tuple[str, str], dict]]) -> list[Metric]:
        g = ("gpu", "uuid")
        temp = gauge("rankguard_gpu_memory_temperature_celsius", "GPU memory (HBM) temperature", g)
        clock = gauge("rankguard_gpu_memory_clock_hertz", "GPU memory clock", g)
        for labels, r in gpus:
            if "temperature_celsius" in r:
                temp.add(labels, r["temperature_celsius"])
            if "clock_hertz" in r:
                clock.add(labels, r["clock_hertz"])
        return [temp, clock]

    def facts(self, reading: dict) -> dict[str, Any]:
        return {"memory_temperature": reading.get("temperature_celsius")}
