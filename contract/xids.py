"""What an XID means and what it asks of the node: NVIDIA's XID catalogue, by its
"resolution bucket (immediate action)", in the four answers rankguard acts on.

An XID is an event, not a state. Health is judged on the events of the last
`XID_RECENT_SECONDS` (contract/answers.py; the agent keeps each event's time), never on
counts since the agent started: a row remap recorded last week says nothing about the node today, and a
GPU that stays broken shows so by its state (lost, remap pending), which is judged on its
own.

* ``application``: the application must restart (RESTART_APP: a fault of the program on
  the GPU, or one the driver contained to it). The node is fine: reported, never drained.
* ``watch``: nothing to do now (IGNORE, or "reset when convenient": a row remap recorded,
  a high single-bit ECC rate). Reported; a trend of them is a failing GPU.
* ``reset_gpu``: the GPU must be reset before it can be trusted (RESET_GPU: a double-bit
  ECC error, an uncontained one, a GSP or NVLink error, a failed remap). The node leaves
  the job (a critical hardware fault) until an operator resets the GPU.
* ``drain``: the node must go (RESTART_BM: the GPU fell off the bus). As reset_gpu, and the
  GPU will not come back without a reboot.

Codes not in the table are ``watch``: an unknown code is worth a look, not a drain.
"""

from __future__ import annotations

from dataclasses import dataclass

from .causes import GPU, GPU_MEMORY, NVLINK, UNKNOWN, USER_CODE

APPLICATION, WATCH, RESET_GPU, DRAIN = "application", "watch", "reset_gpu", "drain"
ACTIONS = (APPLICATION, WATCH, RESET_GPU, DRAIN)
# the actions that take the node out of the job (a critical hardware fault)
HARDWARE_ACTIONS = frozenset({RESET_GPU, DRAIN})


@dataclass(frozen=True)
class Xid:
    code: int
    what: str
    action: str
    cause: str  # contract/causes.py: the class of interruption it stands for


XIDS = {
    x.code: x
    for x in (
        Xid(8, "GPU stopped processing (channel idle timeout)", APPLICATION, USER_CODE),
        Xid(13, "graphics engine exception", APPLICATION, USER_CODE),
        Xid(31, "GPU memory page fault", APPLICATION, USER_CODE),
        Xid(43, "GPU stopped processing (the application's channel)", APPLICATION, USER_CODE),
        Xid(45, "preemptive cleanup after an earlier error", WATCH, UNKNOWN),
        Xid(48, "double-bit ECC error", RESET_GPU, GPU_MEMORY),
        Xid(61, "internal micro-controller breakpoint", RESET_GPU, GPU),
        Xid(62, "internal micro-controller halt", RESET_GPU, GPU),
        Xid(63, "row remapping recorded (reset when convenient)", WATCH, GPU_MEMORY),
        Xid(64, "row remapping failed", RESET_GPU, GPU_MEMORY),
        Xid(68, "video decoder exception", APPLICATION, USER_CODE),
        Xid(69, "graphics engine class error", APPLICATION, USER_CODE),
        Xid(74, "NVLink error", RESET_GPU, NVLINK),
        Xid(79, "GPU fell off the bus", DRAIN, GPU),
        Xid(92, "high single-bit ECC error rate", WATCH, GPU_MEMORY),
        Xid(
            94,
            "contained ECC error (only the application using that memory is hit)",
            APPLICATION,
            GPU_MEMORY,
        ),
        Xid(95, "uncontained ECC error", RESET_GPU, GPU_MEMORY),
        Xid(119, "GSP RPC timeout", RESET_GPU, GPU),
        Xid(120, "GSP error", RESET_GPU, GPU),
        Xid(140, "unrecovered ECC error", RESET_GPU, GPU_MEMORY),
    )
}


def meaning(code: int) -> Xid:
    """The table's entry, or ``watch`` for a code it does not hold."""
    return XIDS.get(code) or Xid(code, "an XID not in rankguard's table", WATCH, UNKNOWN)


def hardware_codes() -> tuple[int, ...]:
    """The codes that take the node out of the job, ascending (the alert rules' regex)."""
    return tuple(sorted(c for c, x in XIDS.items() if x.action in HARDWARE_ACTIONS))
