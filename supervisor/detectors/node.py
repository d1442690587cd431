"""NODE_FAULT: what a reachable node's agent says is wrong with its GPUs or disks.

One finding per (node, code), straight from the agent's verdict (agent/health.py), so
the agent stays the one place that judges GPUs and disks. GPU state, ECC and the XIDs
whose meaning takes the node out of the job (contract/xids.py: reset the GPU, drain) are
hardware (`evidence["hardware"]`: the policy may exclude the node); an application's XID,
one to watch, NVML unavailable (the agent's own fault) and disk codes are not (reported;
the operator frees space, the node stays). A GPU whose error counters trend toward failure
(`gpu_failing`) is neither: its finding carries, per job with ranks on the node, when the
supervisor first saw the job's newest checkpoint, so the policy can drain the node at the
next checkpoint boundary (predictive drain, off by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...contract.xids import HARDWARE_ACTIONS, meaning
from ..model import NODE_FAULT, Finding, History
from ..state import ClusterObs, NodeObs
from .registration import Detector

if TYPE_CHECKING:
    from . import DetectorConfig


@dataclass(frozen=True)
class NodeConfig:
    """[detectors.node]: the agent's node verdict (hardware, disk, memory faults)."""

    enabled: bool = True


# NVML unavailable is not among them: on its own it is the agent's fault (a sandbox, a
# driver upgrade), often of many nodes at once; a GPU really gone shows as lost or missing
HARDWARE_CODES = frozenset({"gpu_lost", "gpu_unresponsive", "gpus_missing", "ecc_uncorrected",
                            "nvlink_down", "row_remap_failure", "ib_port_down"})  # fmt: skip
# a link or memory running on, worse: reported (a trend of them is a failing GPU)
LINK_CODES = frozenset({"pcie_downtrained", "row_remap_pending", "ib_port_below_rate"})
DISK_CODES = frozenset({"checkpoint_disk_low", "data_disk_low"})
AGENT_CODES = frozenset({"nvml_unavailable"})  # reported, never acted on
FAILING_CODES = frozenset({"gpu_failing"})  # a prediction: acted on only by predictive drain


def is_hardware(code: str) -> bool:
    """A fault of the node's hardware: GPU state, or an XID whose meaning takes the node out
    of the job (contract/xids.py); an application's XID or one to watch is not."""
    if code.startswith("xid_") and code[4:].isdigit():
        return meaning(int(code[4:])).action in HARDWARE_ACTIONS
    return code in HARDWARE_CODES


def relevant(code: str) -> bool:
    """Codes that bear on training; collector failures and the like are the agent's own
    health, visible on its dashboards."""
    return (
        is_hardware(code)
        or code.startswith("xid_")
        or code in DISK_CODES | AGENT_CODES | FAILING_CODES | LINK_CODES
    )


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
        out.extend(
            _finding(n, code, reasons, _jobs_on(n, obs, history) if code in FAILING_CODES else None)
            for code, reasons in sorted(by_code.items())
        )  # fmt: skip
    return out


def _jobs_on(n: NodeObs, obs: ClusterObs, history: History) -> dict[str, dict]:
    """The jobs with live ranks on the node, each with its newest validated checkpoint step
    and when the supervisor first saw it (detectors/checkpoint.py keeps that), and where
    its current incarnation is: its newest step and median step time (a save request's
    step, supervisor/policy.py), None for a job that reports no steps."""
    out = {}
    for job in sorted({r.job for r in n.ranks if not r.dead}):
        step, _, seen = history.checkpoint_progress.get(job, (None, 0, None))
        ranks = [r for r in obs.current_ranks(job) if r.source == "telemetry"]
        steps = [r.step for r in ranks if r.step is not None]
        paces = sorted(r.step_seconds for r in ranks if r.step_seconds)
        out[job] = {
            "checkpoint_step": step,
            "checkpoint_seen_at": seen,
            "restart": max((r.restart for r in ranks), default=None),
            "step": max(steps) if steps else None,
            "step_seconds": paces[len(paces) // 2] if paces else None,
        }
    return out


def _finding(n: NodeObs, code: str, reasons: list[dict], jobs: dict | None) -> Finding:
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
            **({"failing": True, "jobs": jobs} if jobs is not None else {}),
        },
    )


DETECTOR = Detector("node", NODE_FAULT, NodeConfig, detect, every_pass=True)
