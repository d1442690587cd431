"""The node's health verdict: a pure function of the collectors' facts and runs.

healthy < degraded < unhealthy. Each reason carries a stable code, a severity and a
message that names the GPU, directory or collector, so an operator (and the supervisor)
knows what to do without reading metrics.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..contract.answers import NODE_STATUSES as SEVERITIES  # a verdict is its worst reason
from ..contract.answers import NodeWarning  # leaves the verdict as it is
from ..contract.xids import HARDWARE_ACTIONS, meaning
from .collectors.gpu_pcie import downtrained

DISK_UNHEALTHY_RATIO = 0.05
DISK_DEGRADED_RATIO = 0.10


@dataclass(frozen=True)
class Reason:
    code: str
    severity: str
    message: str

    def to_dict(self) -> dict:
        return {"code": self.code, "severity": self.severity, "message": self.message}


@dataclass
class Verdict:
    status: str
    reasons: list[Reason] = field(default_factory=list)
    warnings: list[NodeWarning] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"status": self.status, "reasons": [r.to_dict() for r in self.reasons]}


def worst(reasons: Iterable[Reason]) -> str:
    return max((r.severity for r in reasons), key=SEVERITIES.index, default="healthy")


def gpu_reasons(facts: dict | None, expected: int | None) -> list[Reason]:
    if facts is None:
        return [Reason("gpu_collector_missing", "degraded", "no GPU facts collected yet")]
    if not facts.get("available"):
        why = facts.get("reason") or "NVML unavailable"
        if expected:
            # the agent cannot see the GPUs (a sandbox, a driver upgrade, persistenced
            # restarting): its own fault, shared by many nodes at once, not the GPUs'
            return [Reason("nvml_unavailable", "degraded", f"{expected} GPUs expected but {why}")]
        return []  # a CPU node: nothing expected, nothing wrong
    out = []
    gpus = facts.get("gpus", [])
    nvlink_in_use = any(g.get("nvlink_links_up") for g in gpus)
    present = len([g for g in gpus if not g.get("lost")])
    if expected is not None and present < expected:
        out.append(
            Reason("gpus_missing", "unhealthy", f"{present} of {expected} expected GPUs answer")
        )
    for g in gpus:
        name = f"GPU {g.get('index')} ({g.get('uuid', '?')})"
        if g.get("lost"):
            out.append(Reason("gpu_lost", "unhealthy", f"{name} is lost (GPU_IS_LOST)"))
        if g.get("unresponsive_seconds") is not None:  # a GPU whose driver calls hang
            out.append(Reason("gpu_unresponsive", "unhealthy",
                              f"{name}: NVML has not answered for "
                              f"{g['unresponsive_seconds']:.0f}s"))  # fmt: skip
        # XIDs by meaning (contract/xids.py), on the events of the last XID_RECENT_SECONDS
        for code, count in sorted((g.get("xid_recent") or {}).items(), key=lambda kv: int(kv[0])):
            if count:
                x = meaning(int(code))
                severity = "unhealthy" if x.action in HARDWARE_ACTIONS else "degraded"
                out.append(Reason(f"xid_{code}", severity,
                                  f"{name}: XID {code} ({x.what}) {count}x lately: {x.action}"))  # fmt: skip
        if g.get("failing"):  # its error counters' trends (agent/gpu_trends.py)
            out.append(Reason("gpu_failing", "degraded", f"{name} is failing: {g['failing']}"))
        if g.get("ecc_uncorrected"):
            out.append(
                Reason(
                    "ecc_uncorrected",
                    "unhealthy",
                    f"{name}: {g['ecc_uncorrected']} uncorrected ECC errors",
                )  # fmt: skip
            )
        out += gpu_link_reasons(g, name, nvlink_in_use)
    return out


def gpu_link_reasons(g: dict, name: str, nvlink_in_use: bool) -> list[Reason]:
    """A GPU's links and memory repair state (agent/collectors/gpu_*.py facts): an NVLink
    link down while the node's GPUs use NVLink, a downtrained PCIe link, a row remap that
    failed (the GPU has no spare rows: unhealthy) or awaits a GPU reset (degraded)."""
    out = []
    down = g.get("nvlink_links_down") or []
    if down and nvlink_in_use:
        links = ", ".join(str(x) for x in down)
        out.append(Reason("nvlink_down", "unhealthy", f"{name}: NVLink link(s) {links} down"))
    why = downtrained(g.get("pcie_link"), g.get("utilization"))
    if why:
        out.append(Reason("pcie_downtrained", "degraded", f"{name}: {why}"))
    rows = g.get("remapped_rows") or {}
    if rows.get("failure"):
        out.append(Reason("row_remap_failure", "unhealthy",
                          f"{name}: a memory row remap failed (no spare rows): replace the GPU"))  # fmt: skip
    elif rows.get("pending"):
        out.append(Reason("row_remap_pending", "degraded",
                          f"{name}: a memory row remap awaits a GPU reset"))  # fmt: skip
    return out


def infiniband_reasons(network: dict | None) -> list[Reason]:
    """InfiniBand/RoCE ports (agent/collectors/network.py facts): one that was ACTIVE and
    is not (unhealthy: NCCL's traffic over it fails), one running below the best rate it
    ran at (degraded: a retrained, slower link)."""
    out = []
    for p in (network or {}).get("infiniband") or []:
        where = f"InfiniBand port {p.get('device')}/{p.get('port')}"
        if p.get("down"):
            out.append(Reason("ib_port_down", "unhealthy",
                              f"{where} is {p.get('state') or 'not ACTIVE'} (it was ACTIVE)"))  # fmt: skip
        elif p.get("below_rate"):
            rate, best = p.get("rate_bytes_per_second"), p.get("best_rate_bytes_per_second")
            out.append(Reason("ib_port_below_rate", "degraded",
                              f"{where} runs at {rate * 8 / 1e9:g} Gb/s, "
                              f"below the {best * 8 / 1e9:g} Gb/s it ran at"))  # fmt: skip
    return out


def disk_reasons(filesystems: dict | None) -> list[Reason]:
    """`filesystems`: role -> {"path", "free_bytes", "size_bytes"} or {"path", "error"}."""
    out = []
    for role, fs in sorted((filesystems or {}).items()):
        if fs.get("error"):
            out.append(Reason(f"{role}_dir_unreadable", "degraded", f"{role} dir: {fs['error']}"))
            continue
        size, free = fs.get("size_bytes") or 0, fs.get("free_bytes") or 0
        if size <= 0:
            continue
        ratio = free / size
        if ratio < DISK_DEGRADED_RATIO:
            severity = "unhealthy" if ratio < DISK_UNHEALTHY_RATIO else "degraded"
            out.append(Reason(f"{role}_disk_low", severity, _disk_message(role, fs, ratio)))
    return out


def _disk_message(role: str, fs: dict, ratio: float) -> str:
    """Names the filesystem itself (mount point and type), not only the directory: that
    is what the operator must free; a full one says so in the kernel's words."""
    mount, fstype = fs.get("mountpoint"), fs.get("fstype")
    where = f" {mount}" + (f" ({fstype})" if fstype else "") if mount else ""
    free, size = fs.get("free_bytes") or 0, fs.get("size_bytes") or 0
    state = "full: no space left on device" if free <= 0 else f"{ratio:.1%} free"
    return (
        f"{role} filesystem{where} holding {fs.get('path')}: {state} "
        f"({_human_bytes(free)} of {_human_bytes(size)})"
    )


def _human_bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def permission_warnings(filesystems: dict | None) -> list[NodeWarning]:
    """A checkpoint root writable by group or others: anyone who can write there can plant
    symlinks, fake step dirs or forged checkpoints (docs/security.md, "Checkpoint roots")."""
    fs = (filesystems or {}).get("checkpoint") or {}
    mode = fs.get("mode")
    if not isinstance(mode, int) or isinstance(mode, bool) or not mode & 0o022:
        return []
    who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if mode & bit)
    sticky = " (sticky)" if mode & 0o1000 else ""
    return [
        NodeWarning(
            "checkpoint_dir_writable_by_others",
            f"checkpoint dir {fs.get('path')} is writable by {who} (mode {mode:o}{sticky}): "
            "they can plant symlinks and forged checkpoints there; chmod go-w it, and set "
            "a checkpoint key (RANKGUARD_CHECKPOINT_KEY_FILE) so forgeries are refused",
        )
    ]


def collector_reasons(runs) -> list[Reason]:
    return [
        Reason(f"collector_{r.name}_failed", "degraded", f"collector {r.name} failed: {r.error}")
        for r in runs
        if not r.success
    ]


def node_verdict(facts: dict, runs, expected_gpus: int | None) -> Verdict:
    # no GPU verdict when the gpu collector is turned off ([collectors.gpu] enabled = false):
    # runs name every collector that runs, and are empty only before the first collection
    gpu_on = not runs or any(r.name == "gpu" for r in runs)
    reasons = (
        (gpu_reasons(facts.get("gpu"), expected_gpus) if gpu_on else [])
        + disk_reasons((facts.get("storage") or {}).get("filesystems"))
        + infiniband_reasons(facts.get("network"))
        + collector_reasons(runs)
    )
    filesystems = (facts.get("storage") or {}).get("filesystems")
    return Verdict(worst(reasons), reasons, permission_warnings(filesystems))
