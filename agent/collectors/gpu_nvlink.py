"""NVLink sampler: error counters every collection (one batched field read), the state of
each link at the slow cadence.

Error counters are NVML's per-GPU totals over all links, since the driver loaded: CRC
errors in flow-control units (flits) and in data, replays (a link retransmitting after a
CRC error) and recoveries (a link retrained after too many). A rising count is a failing
link or cable, long before XID 74; a link that is down on a GPU whose NVLink is in use
cuts its bandwidth to its peers (health: `nvlink_down`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml

from . import Metric, counter, gauge
from .gpu_samplers import GpuSampler, Skip, register_sampler

# type label -> NVML field id (totals over every link)
NVLINK_ERROR_FIELDS: dict[str, int] = {
    "crc_flit": pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
    "crc_data": pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
    "replay": pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
    "recovery": pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
}
MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS


def links_state(states: list[int | None]) -> dict[str, list[int]]:
    """Link numbers that are up and down from nvmlDeviceGetNvLinkState answers (None: the
    link does not exist or is not supported on this GPU: neither)."""
    up = [i for i, s in enumerate(states) if s == pynvml.NVML_FEATURE_ENABLED]
    down = [i for i, s in enumerate(states) if s is not None and s != pynvml.NVML_FEATURE_ENABLED]
    return {"up": up, "down": down}


@register_sampler
class NvlinkSampler(GpuSampler):
    name = "nvlink"
    fields = NVLINK_ERROR_FIELDS
    slow_fields = {"link_count": pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT}

    def read(self, call: Callable[..., Any], values: dict[str, float | None]) -> dict | None:
        errors = {k: int(v) for k, v in values.items() if v is not None}
        return {"errors": errors} if errors else None

    def read_slow(self, call: Callable[..., Any], values: dict[str, float | None]) -> dict | None:
        count = values.get("link_count")
        n = MAX_LINKS if count is None else int(count)
        if not 0 <= n <= MAX_LINKS:
            raise Skip(f"NVLink link count {n} out of range")
        states = [call("nvmlDeviceGetNvLinkState", link) for link in range(n)]
        if all(s is None for s in states):
            return None  # no NVLink on this GPU (a PCIe card without bridges)
        return {"links": links_state(states)}

    def metrics(self, gpus: list[tuple[tuple[str, str], dict]]) -> list[Metric]:
        g = ("gpu", "uuid")
        errors = counter("rankguard_gpu_nvlink_errors_total",
                         "NVLink errors since driver load, over all links, by type "
                         "(crc_flit, crc_data, replay, recovery)", (*g, "type"))  # fmt: skip
        # counts per GPU, not a series per link (18 a GPU): which links are down is in the
        # GPU's facts and its health reason
        up = gauge("rankguard_gpu_nvlink_links_up", "NVLink links that are up", g)
        down = gauge("rankguard_gpu_nvlink_links_down", "NVLink links that are down", g)
        for labels, r in gpus:
            for kind, n in sorted((r.get("errors") or {}).items()):
                errors.add((*labels, kind), n)
            if "links" in r:
                up.add(labels, len(r["links"]["up"]))
                down.add(labels, len(r["links"]["down"]))
        return [errors, up, down]

    def facts(self, reading: dict) -> dict[str, Any]:
        out: dict[str, Any] = {"nvlink_errors": reading.get("errors")}
        if "links" in reading:
            out["nvlink_links_up"] = list(reading["links"]["up"])
            out["nvlink_links_down"] = list(reading["links"]["down"])
        return out
