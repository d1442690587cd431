"""Which physical GPU a rank computes on: its NVML UUID, from the rank's own CUDA device.

A `cuda:N` index means nothing outside the process (it counts the devices
`CUDA_VISIBLE_DEVICES` leaves visible, in CUDA's order), while NVML numbers GPUs in PCI
order for the whole node. The UUID is the same everywhere: the agent ties a rank to its
GPU's faults by it, and ranks that share a GPU are told apart from ranks that merely
see one device each (trainer/distributed.py). Torch is imported only when asked.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from ..contract.telemetry import is_gpu_uuid


def device_uuid(device: Any, environ: Mapping[str, str] = os.environ) -> str | None:
    """The NVML UUID (`GPU-...`, or `MIG-...` for a MIG instance made visible by its UUID)
    of a CUDA device (a torch.device or an index); None for a CPU device, without torch
    or CUDA, or when CUDA cannot tell."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    index = device if isinstance(device, int) else getattr(device, "index", None)
    if getattr(device, "type", "cuda") != "cuda":
        return None
    if index is None:
        index = torch.cuda.current_device()
    try:
        raw = str(torch.cuda.get_device_properties(index).uuid)
    except (RuntimeError, AssertionError, AttributeError):
        return None
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if index < len(visible) and visible[index].startswith("MIG-"):
        uuid = visible[index]  # NVML's own name for the instance, as the user gave it
    else:
        uuid = raw if raw.startswith("GPU-") else f"GPU-{raw}"
    return uuid if is_gpu_uuid(uuid) else None
