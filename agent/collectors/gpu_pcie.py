"""PCIe link sampler: the replay counter every collection (one batched field read), the
link's current and maximum generation and width at the slow cadence.

A replay is the link resending a packet after an error: a rising count is a bad slot,
riser or cable. A link trained below its maximum width (x8 instead of x16) is downtrained
and halves host-GPU bandwidth (health: `pcie_downtrained`). The generation drops by
design while a GPU idles (power saving), so a lower generation counts only while the GPU
is busy; a lower width always counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml

from . import Metric, counter, gauge
from .gpu_samplers import GpuSampler, register_sampler

LINK_CALLS = {
    "generation": "nvmlDeviceGetCurrPcieLinkGeneration",
    "max_generation": "nvmlDeviceGetMaxPcieLinkGeneration",
    "width": "nvmlDeviceGetCurrPcieLinkWidth",
    "max_width": "nvmlDeviceGetMaxPcieLinkWidth",
}
# a busy GPU's link runs at its top generation; below this utilisation it may idle down
BUSY_UTILIZATION = 0.5


def downtrained(link: dict | None, utilization: float | None) -> str | None:
    """Why a link is downtrained (pure), or None. `link`: generation, max_generation,
    width, max_width (any may be missing: not judged)."""
    if not link:
        return None
    w, max_w = link.get("width"), link.get("max_width")
    if w and max_w and w < max_w:
        return f"PCIe link x{w} of x{max_w}"
    gen, max_gen = link.get("generation"), link.get("max_generation")
    if gen and max_gen and gen < max_gen and (utilization or 0) >= BUSY_UTILIZATION:
        return f"PCIe link gen {gen} of gen {max_gen} while busy"
    return None


@register_sampler
class PcieSampler(GpuSampler):
    name = "pcie"
    fields = {"replays": pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER}

    def read(self, call: Callable[..., Any], values: dict[str, float | None]) -> dict | None:
        replays = values.get("replays")
        return None if replays is None else {"replays": int(replays)}

    def read_slow(self, call: Callable[..., Any], values: dict[str, float | None]) -> dict | None:
        link = {}
        for key, fn in LINK_CALLS.items():
            value = call(fn)
            if isinstance(value, int) and value > 0:  # 0 or garbage: unknown, left out
                link[key] = value
        return {"link": link} if link else None

    def metrics(self, gpus: list[tuple[tuple[str, str], dict]]) -> list[Metric]:
        g = ("gpu", "uuid")
        replays = counter("rankguard_gpu_pcie_replays_total",
                          "PCIe replays (packets resent after a link error) since driver load",
                          g)  # fmt: skip
        gen = gauge("rankguard_gpu_pcie_link_generation",
                    "PCIe link generation, current and the maximum the link supports",
                    (*g, "type"))  # fmt: skip
        width = gauge("rankguard_gpu_pcie_link_width_lanes",
                      "PCIe link width in lanes, current and maximum", (*g, "type"))  # fmt: skip
        for labels, r in gpus:
            if "replays" in r:
                replays.add(labels, r["replays"])
            link = r.get("link") or {}
            for family, stem in ((gen, "generation"), (width, "width")):
                if stem in link:
                    family.add((*labels, "current"), link[stem])
                if f"max_{stem}" in link:
                    family.add((*labels, "max"), link[f"max_{stem}"])
        return [replays, gen, width]

    def facts(self, reading: dict) -> dict[str, Any]:
        return {"pcie_replays": reading.get("replays"), "pcie_link": reading.get("link")}
