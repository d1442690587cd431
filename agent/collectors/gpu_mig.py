"""MIG sampler, at the slow cadence: whether MIG mode is on and how many MIG devices
(GPU instance slices) exist. A GPU in MIG mode runs no whole-GPU training job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml

from . import Metric, gauge
from .gpu_samplers import GpuSampler, register_sampler


@register_sampler
class MigSampler(GpuSampler):
    name = "mig"

    def read_slow(self, call: Callable[..., Any], values: dict[str, float | None]) -> dict | None:
        mode = call("nvmlDeviceGetMigMode")
        if not isinstance(mode, list | tuple) or not mode:
            return None  # not a MIG-capable GPU
        enabled = mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        devices = 0
        if enabled:
            slots = call("nvmlDeviceGetMaxMigDeviceCount") or 0
            # empty slots answer NOT_FOUND (None here)
            devices = sum(call("nvmlDeviceGetMigDeviceHandleByIndex", i) is not None
                          for i in range(int(slots)))  # fmt: skip
        return {"enabled": enabled, "devices": devices}

    def metrics(self, gpus: list[tuple[tuple[str, str], dict]]) -> list[Metric]:
        g = ("gpu", "uuid")
        enabled = gauge("rankguard_gpu_mig_enabled", "1 if MIG mode is on", g)
        devices = gauge("rankguard_gpu_mig_devices", "MIG devices (instances) on the GPU", g)
        for labels, r in gpus:
            enabled.add(labels, int(r["enabled"]))
            devices.add(labels, r["devices"])
        return [enabled, devices]

    def facts(self, reading: dict) -> dict[str, Any]:
        return {"mig_enabled": reading.get("enabled"), "mig_devices": reading.get("devices")}
