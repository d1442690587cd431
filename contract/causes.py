"""Why an interruption happened: the fixed cause taxonomy every incident is labelled with.

The classes follow the published interruption tables of large training runs (the Llama 3
paper's 419 interruptions on 16,384 H100s, by root cause), so a fleet can build the same
table from its own incidents (`rankguard incidents --by-cause`) and see which cause costs
it most. A cause comes with a confidence: `high` when the evidence names it (an XID, a
flight recorder's verdict, a full disk), `medium` when it is the usual reason for what was
seen, `low` when it is a guess worth a look. The supervisor's rules are in
supervisor/causes.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CauseClass:
    name: str
    what: str
    published: str  # the rows of the published tables it gathers


CAUSE_CLASSES = (
    CauseClass("gpu", "the GPU itself: fallen off the bus, unresponsive, lost, a GSP or "
               "micro-controller fault, thermal or power slowdown", "faulty GPU, thermal"),
    CauseClass("gpu_memory", "GPU memory: uncorrected or uncontained ECC errors, failed row "
               "remaps", "GPU HBM3 memory, GPU SRAM memory"),
    CauseClass("nvlink", "NVLink or NVSwitch errors between the GPUs of a node",
               "GPU system processor, NVSwitch"),
    CauseClass("network", "the network between nodes: an InfiniBand or RoCE port, a NIC, "
               "a collective that every rank posted and none completed", "network switch/cable, NIC"),
    CauseClass("storage", "checkpoint or data storage: a full disk, a write or read that "
               "stalls or fails", "dependency (storage)"),
    CauseClass("host", "the host: the process stopped or killed from outside (the OOM "
               "killer, an operator), host memory", "host maintenance, unplanned host"),
    CauseClass("collective", "a collective that timed out or desynchronized (NCCL's "
               "watchdog): the ranks waited for one that never joined", "NCCL watchdog timeouts"),
    CauseClass("data", "the training data: a stalled input pipeline, a non-finite loss or a "
               "loss spike", "data (and silent data corruption's visible part)"),
    CauseClass("user_code", "the training script: an exception, an application XID (a bad "
               "memory access on the GPU)", "software bug"),
    CauseClass("rankguard", "rankguard's own view: an agent unreachable or blind (NVML "
               "unavailable); the training may be fine", "(monitoring)"),
    CauseClass("unknown", "not enough evidence to say", "unknown"),
)  # fmt: skip
CAUSES = tuple(c.name for c in CAUSE_CLASSES)
(GPU, GPU_MEMORY, NVLINK, NETWORK, STORAGE, HOST, COLLECTIVE, DATA, USER_CODE, RANKGUARD,
 UNKNOWN) = CAUSES  # fmt: skip
CONFIDENCES = ("low", "medium", "high")
LOW, MEDIUM, HIGH = CONFIDENCES
