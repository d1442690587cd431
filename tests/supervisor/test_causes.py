"""One cause for every incident (supervisor/causes.py): the strongest evidence speaks
first, and every finding kind a registered detector makes gets a cause from its rules."""

from __future__ import annotations

import pytest

from rankguard.contract.causes import CAUSE_CLASSES, CAUSES, CONFIDENCES
from rankguard.supervisor import detectors
from rankguard.supervisor.causes import NOT_KNOWN, RULES, classify
from rankguard.supervisor.model import (
    AGENT_UNREACHABLE,
    BAD_NUMERICS,
    CHECKPOINT_STALE,
    CRASH_LOOP,
    DATA_STALL,
    KINDS,
    NODE_FAULT,
    RANK_DEAD,
    RANK_HUNG,
    STRAGGLER,
    Finding,
)


def finding(kind: str, **evidence) -> Finding:
    return Finding(kind, f"{kind}:j", "critical", kind, "j", "n0", 1, 100.0, evidence)


def status(exit_code: int = 0, signal: int = 0) -> int:
    """A waitpid status, as the agent reads it from a zombie's /proc/PID/stat."""
    return (exit_code << 8) | signal


GPU_XID_48 = {"uuid": "GPU-1", "xid_recent": {"48": 2}, "lost": False, "throttle": []}
BEHIND_WAVE = {"verdict": "behind", "pg": "0", "seq": 12, "ranks": [1]}

CASES = [
    # a rank's GPU speaks first, whatever the rank was doing
    (finding(RANK_DEAD, gpu=GPU_XID_48, exit_code=status(1)), "gpu_memory", "high"),
    (finding(RANK_HUNG, gpu={"uuid": "GPU-1", "lost": True}), "gpu", "high"),
    (finding(RANK_HUNG, gpu={"uuid": "GPU-1", "xid_recent": {"74": 1}}), "nvlink", "high"),
    (finding(RANK_DEAD, gpu={"uuid": "GPU-1", "xid_recent": {"13": 1}}), "user_code", "high"),
    # node health reasons, by code
    (finding(NODE_FAULT, code="xid_79"), "gpu", "high"),
    (finding(NODE_FAULT, code="xid_63"), "gpu_memory", "high"),
    (finding(NODE_FAULT, code="ecc_uncorrected"), "gpu_memory", "high"),
    (finding(NODE_FAULT, code="gpu_unresponsive"), "gpu", "high"),
    (finding(NODE_FAULT, code="checkpoint_disk_low"), "storage", "high"),
    (finding(NODE_FAULT, code="nvml_unavailable"), "rankguard", "high"),
    (finding(NODE_FAULT, code="nvlink_down"), "nvlink", "high"),
    (finding(NODE_FAULT, code="ib_port_down"), "network", "high"),
    (finding(NODE_FAULT, code="ib_port_below_rate"), "network", "high"),
    (finding(NODE_FAULT, code="pcie_downtrained"), "gpu", "high"),
    (finding(NODE_FAULT, code="row_remap_pending"), "gpu_memory", "high"),
    (finding(NODE_FAULT, code="gpu_failing"), "gpu", "high"),
    (finding(NODE_FAULT, code="something_new"), "unknown", "low"),
    # deaths
    (finding(RANK_DEAD, cause="nccl_timeout"), "collective", "high"),
    (finding(RANK_DEAD, exit_code=status(1)), "user_code", "medium"),
    (finding(RANK_DEAD, exit_code=status(signal=9)), "host", "low"),
    (finding(RANK_DEAD, exit_code=status(signal=6)), "collective", "low"),
    (finding(RANK_DEAD, exit_code=status(signal=11)), "user_code", "low"),
    (finding(RANK_DEAD, exit_code=None, phase="checkpoint_save"), "storage", "low"),
    (finding(RANK_DEAD, exit_code=None, phase="train"), "unknown", "low"),
    # hangs
    (finding(RANK_HUNG, desync=True, wavefront={"verdict": "desync"}), "user_code", "medium"),
    (finding(RANK_HUNG, decided_by="stopped"), "host", "medium"),
    (finding(RANK_HUNG, stand_in_state="stopped"), "host", "medium"),
    # decided by its budget (first, on a loaded host), the culprit seen stopped
    (
        finding(RANK_HUNG, decided_by="budget", states={"0": "running", "1": "stopped"}),
        "host",
        "medium",
    ),
    (
        finding(RANK_HUNG, decided_by="budget", states={"0": "stopped", "1": "running"}),
        "unknown",
        "low",
    ),
    (finding(RANK_HUNG, hung_phase="checkpoint_load"), "storage", "medium"),
    (finding(RANK_HUNG, wavefront={"verdict": "below the ranks"}), "network", "medium"),
    (finding(RANK_HUNG, wavefront=BEHIND_WAVE), "collective", "medium"),
    (finding(RANK_HUNG, hung_phase="train"), "unknown", "low"),
    # the rest
    (finding(STRAGGLER, gpu={"uuid": "GPU-1", "throttle": ["thermal"]}), "gpu", "medium"),
    (finding(STRAGGLER, ratio=1.3), "unknown", "low"),
    (finding(BAD_NUMERICS, reason="spike"), "data", "medium"),
    (finding(BAD_NUMERICS, reason="non_finite"), "data", "low"),
    (finding(DATA_STALL), "data", "medium"),
    (finding(CHECKPOINT_STALE), "storage", "medium"),
    (finding(AGENT_UNREACHABLE), "rankguard", "medium"),
    (
        finding(CRASH_LOOP, cause={"cause": "gpu_memory", "confidence": "high", "why": "XID 48"}),
        "gpu_memory",
        "high",
    ),  # fmt: skip
    (finding(CRASH_LOOP, restarts=["a", "b", "c"]), "unknown", "low"),
]


@pytest.mark.parametrize(("f", "cause", "confidence"), CASES,
                         ids=[f"{c[0].kind}-{i}" for i, c in enumerate(CASES)])  # fmt: skip
def test_the_cause_of_each_finding(f, cause, confidence):
    got = classify(f)
    assert (got.cause, got.confidence) == (cause, confidence), got
    assert got.why  # every cause says why


def test_every_kind_a_detector_makes_has_rules_and_the_taxonomy_is_closed():
    assert set(detectors.KINDS) | set(KINDS) <= set(RULES)
    assert {c[1] for c in CASES} == set(CAUSES)  # each class is reached by some evidence
    assert {c[2] for c in CASES} == set(CONFIDENCES)
    assert all(c.what and c.published for c in CAUSE_CLASSES)


def test_hostile_evidence_gives_unknown_not_an_exception():
    for ev in ({"gpu": "x"}, {"gpu": {"xid_recent": ["48"]}}, {"gpu": {"xid_recent": {"x": 1}}},
               {"exit_code": True}, {"exit_code": "1"}, {"wavefront": [1]}, {"code": 5}):  # fmt: skip
        for kind in RULES:
            assert classify(finding(kind, **ev)).cause in CAUSES
    assert classify(finding(RANK_DEAD, gpu={"xid_recent": {"x": 1}})) == NOT_KNOWN
