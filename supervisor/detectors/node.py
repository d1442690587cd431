"""NODE_FAULT: what a reachable node's agent says is wrong with its GPUs or disks.

One finding per (node, code), straight from the agent's verdict (agent/health.py), so
the agent stays the one place that knows what an XID or a low disk means. GPU, XID and
ECC codes are hardware (`evidence["hardware"]`: the policy may exclude the node); disk
codes are not (the operator frees space, the node stays).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import NODE_FAULT, Finding, History
from ..state import ClusterObs, NodeObs
from .registration import Detector

if TYPE_CHECKING:
    from . import DetectorConfig


@dataclass(frozen=True)
class NodeConfig:
    """[detectors.node]: the agent's node verdict (hardware, disk, memory faults)."""

    enabled: bool = True


HARDWARE_CODES = frozenset({"gpu_lost", "gpus_missing", "nvml_unavailable", "ecc_uncorrected"})
DISK_CODES = frozenset({"checkpoint_disk_low", "data_disk_low"})


def is_hardware(code: str) -> bool:
    return code in HARDWARE_CODES or code.startswith("xid_")


def relevant(code: str) -> bool:
    """Codes that bear on training; collector failures and the like are the agent's own
    health, visible on its dashboards."""
    return is_hardware(code) or code in DISK_CODES


def detect(obs: ClusterObs, history: History, cfg: DetectorConfig) -> list[Finding]:
    out = []
    for n in obs.nodes:
        if not n.reachable:
            continue  # no verdict to read; the unreachable detector speaks for it
        by_code: dict[str, list[dict]] = {}
        for reason in n.reasons:
            code = str(reason.get("code", ""))
            if relevant(code):
                by_code.setdefault(code, []).append(reason)
        # one finding per (node, code), even when several GPUs share the code
        out.extend(_finding(n, code, reasons) for code, reasons in sorted(by_code.items()))
    return out


def _finding(n: NodeObs, code: str, reasons: list[dict]) -> Finding:
    unhealthy = [r for r in reasons if r.get("severity") == "unhealthy"]
    reason = (unhealthy or reasons)[0]  # the worst one speaks for the code
    messages = [str(r.get("message") or code) for r in reasons]
    return Finding(
        kind=NODE_FAULT,
        key=f"node_fault:{n.node}:{code}",
        severity="critical" if unhealthy else "warning",
        summary=f"node {n.node}: " + "; ".join(messages),
        node=n.node,
        occurred_at=n.observed_at,
        evidence={
            "reason": dict(reason),
            "code": code,
            "messages": messages,
            "agent_status": n.status,
            "url": n.url,
            "hardware": is_hardware(code),
        },
    )


DETECTOR = Detector("node", NODE_FAULT, NodeConfig, detect, every_pass=True)
