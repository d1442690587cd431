"""One cause for every incident (contract/causes.py), from its finding's evidence alone:
pure, so a replayed or restored finding gets the same cause.

The strongest evidence speaks first. A rank whose GPU reported a recent XID, or was lost,
failed for that GPU's reason whatever the rank was doing; then what the finding's own
kind says (a flight recorder's verdict, a stopped process, the phase it hung in); then
`unknown`. Each rule says why, in words an operator can check against the incident.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..contract.causes import (
    COLLECTIVE,
    DATA,
    GPU,
    GPU_MEMORY,
    HIGH,
    HOST,
    LOW,
    MEDIUM,
    NETWORK,
    NVLINK,
    RANKGUARD,
    STORAGE,
    UNKNOWN,
    USER_CODE,
)
from ..contract.xids import meaning
from .model import (
    AGENT_UNREACHABLE,
    BAD_NUMERICS,
    CHECKPOINT_STALE,
    CRASH_LOOP,
    DATA_STALL,
    NODE_FAULT,
    RANK_DEAD,
    RANK_HUNG,
    STRAGGLER,
    Finding,
)
from .wavefront import BEHIND, BELOW, DESYNC


@dataclass(frozen=True)
class Cause:
    cause: str
    confidence: str
    why: str

    def to_json(self) -> dict[str, str]:
        return {"cause": self.cause, "confidence": self.confidence, "why": self.why}


NOT_KNOWN = Cause(UNKNOWN, LOW, "no evidence names a cause")

# A node's health reasons (agent/health.py) by code; an XID's by its table.
NODE_CODES = {
    "gpu_lost": (GPU, "a GPU fell off the bus or is lost to NVML"),
    "gpus_missing": (GPU, "fewer GPUs than expected"),
    "gpu_unresponsive": (GPU, "a GPU's NVML calls do not return"),
    "gpu_failing": (GPU, "a GPU's error counters trend toward failure"),
    "ecc_uncorrected": (GPU_MEMORY, "uncorrected ECC errors"),
    "row_remap_pending": (GPU_MEMORY, "a row remap is pending"),
    "row_remap_failure": (GPU_MEMORY, "a row remap failed"),
    "checkpoint_disk_low": (STORAGE, "the checkpoint disk is nearly full"),
    "data_disk_low": (STORAGE, "the data disk is nearly full"),
    "nvml_unavailable": (RANKGUARD, "the agent cannot load NVML: it is blind, the GPUs may be fine"),
    "nvlink_down": (NVLINK, "an NVLink link is down"),
    "pcie_downtrained": (GPU, "a GPU's PCIe link runs below its width or generation"),
    "ib_port_down": (NETWORK, "an InfiniBand port went down"),
    "ib_port_below_rate": (NETWORK, "an InfiniBand port runs below its rate"),
}  # fmt: skip
STORAGE_PHASES = frozenset({"checkpoint_save", "checkpoint_load"})


def classify(f: Finding) -> Cause:
    """The incident's cause and how sure it is."""
    rule = RULES.get(f.kind)
    return (_gpu(f.evidence) or (rule(f) if rule else None)) or NOT_KNOWN


def _gpu(ev: Mapping[str, Any]) -> Cause | None:
    """The rank's GPU as its agent saw it: lost, or a recent XID (the worst one)."""
    gpu = ev.get("gpu")
    if not isinstance(gpu, Mapping):
        return None
    if gpu.get("lost") is True:
        return Cause(GPU, HIGH, f"its GPU {gpu.get('uuid')} was lost (fallen off the bus)")
    xids = gpu.get("xid_recent")
    codes = [int(c) for c in xids if str(c).isdigit()] if isinstance(xids, Mapping) else []
    if codes:
        x = max((meaning(c) for c in codes), key=lambda x: (x.cause != UNKNOWN, x.code))
        return Cause(x.cause, HIGH, f"XID {x.code} on its GPU: {x.what}")
    return None


def _node(f: Finding) -> Cause | None:
    code = str(f.evidence.get("code", ""))
    if code.startswith("xid_") and code[4:].isdigit():
        x = meaning(int(code[4:]))
        return Cause(x.cause, HIGH, f"XID {x.code}: {x.what}")
    if code in NODE_CODES:
        cause, why = NODE_CODES[code]
        return Cause(cause, HIGH, why)
    return None


def _dead(f: Finding) -> Cause | None:
    ev = f.evidence
    if ev.get("cause") == "nccl_timeout":
        return Cause(COLLECTIVE, HIGH, "it died of a collective timeout waiting for another rank")
    exit_code = ev.get("exit_code")
    if isinstance(exit_code, int) and not isinstance(exit_code, bool):
        return _exit(exit_code)
    if ev.get("phase") in STORAGE_PHASES:
        return Cause(STORAGE, LOW, f"it died in {ev['phase']}")
    return None


def _exit(status: int) -> Cause:
    """A waitpid status (how a rank process ended) as a cause."""
    signal = status & 0x7F
    if signal == 0:
        code = (status >> 8) & 0xFF
        return Cause(USER_CODE, MEDIUM, f"the process exited with code {code} (an exception "
                                        "or an exit of the script)")  # fmt: skip
    if signal == 6:
        return Cause(COLLECTIVE, LOW, "SIGABRT: NCCL's watchdog aborts a rank on a timeout")
    if signal in (9, 15):
        return Cause(HOST, LOW, f"killed from outside ({'SIGKILL' if signal == 9 else 'SIGTERM'}"
                                "): the OOM killer, an operator or the scheduler")  # fmt: skip
    return Cause(USER_CODE, LOW, f"killed by signal {signal} (a crash in native code)")


def _hung(f: Finding) -> Cause | None:
    ev = f.evidence
    wave = ev.get("wavefront") if isinstance(ev.get("wavefront"), Mapping) else {}
    if ev.get("desync") or wave.get("verdict") == DESYNC:
        return Cause(USER_CODE, MEDIUM, "the ranks called different collectives (a desync: "
                                        "a code path that differs between ranks)")  # fmt: skip
    states = ev.get("states") if isinstance(ev.get("states"), Mapping) else {}
    # however the hang was decided (its state, or its budget first on a loaded host)
    stopped = (ev.get("decided_by") == "stopped" or ev.get("stand_in_state") == "stopped"
               or (f.rank is not None and states.get(str(f.rank)) == "stopped"))  # fmt: skip
    if stopped:
        return Cause(HOST, MEDIUM, "the process was stopped from outside (SIGSTOP)")
    if ev.get("hung_phase") in STORAGE_PHASES:
        return Cause(STORAGE, MEDIUM, f"it hung in {ev['hung_phase']}")
    if wave.get("verdict") == BELOW:
        return Cause(NETWORK, MEDIUM, "every rank posted the collective and none completed it: "
                                      "the transport between them")  # fmt: skip
    if wave.get("verdict") == BEHIND:
        return Cause(COLLECTIVE, MEDIUM, f"the ranks waited in collective {wave.get('seq')} of "
                                         f"group {wave.get('pg')} for one that never joined")  # fmt: skip
    return None


def _straggler(f: Finding) -> Cause | None:
    gpu = f.evidence.get("gpu")
    throttle = gpu.get("throttle") if isinstance(gpu, Mapping) else None
    if throttle:
        return Cause(GPU, MEDIUM, f"its GPU is throttled ({', '.join(map(str, throttle))})")
    return None


def _numerics(f: Finding) -> Cause:
    spike = f.evidence.get("reason") == "spike"
    return Cause(DATA, MEDIUM if spike else LOW,
                 "a loss spike (a bad batch)" if spike else "a non-finite loss")  # fmt: skip


def _crash_loop(f: Finding) -> Cause | None:
    """The cause its restarts shared, which the policy names when it stops the job."""
    shared = f.evidence.get("cause")
    if isinstance(shared, Mapping) and isinstance(shared.get("cause"), str):
        return Cause(shared["cause"], str(shared.get("confidence", LOW)),
                     f"every restart of the loop: {shared.get('why', '')}")  # fmt: skip
    return None


RULES: dict[str, Callable[[Finding], Cause | None]] = {
    NODE_FAULT: _node,
    RANK_DEAD: _dead,
    RANK_HUNG: _hung,
    STRAGGLER: _straggler,
    BAD_NUMERICS: _numerics,
    DATA_STALL: lambda f: Cause(DATA, MEDIUM, "the input pipeline stalled"),
    CHECKPOINT_STALE: lambda f: Cause(STORAGE, MEDIUM, "checkpoints stopped being validated"),
    AGENT_UNREACHABLE: lambda f: Cause(
        RANKGUARD, MEDIUM, "the node's agent does not answer: the training there may be fine"
    ),  # fmt: skip
    CRASH_LOOP: _crash_loop,
}
