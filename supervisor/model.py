"""The supervisor's vocabulary: findings (detect), decisions (decide), incidents (record).

Everything here is plain data. Detectors turn a `ClusterObs` (+ `History`) into
`Finding`s; the policy turns findings and the recorded incidents into `Decision`s;
the loop carries decisions out through the agents and records them as incidents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .history import History  # noqa: F401  (its own module now; the old import path)

# Finding kinds the policy and the incident lifecycle act on by name. Each detector
# declares the kind it makes in its registration (supervisor/detectors/<name>.py), and
# detectors.KINDS is these and any other kind a registered detector makes.
RANK_DEAD = "rank_dead"
RANK_HUNG = "rank_hung"
STRAGGLER = "straggler"
BAD_NUMERICS = "bad_numerics"
NODE_FAULT = "node_fault"
CHECKPOINT_STALE = "checkpoint_stale"
AGENT_UNREACHABLE = "agent_unreachable"
CRASH_LOOP = "crash_loop"
DATA_STALL = "data_stall"
KINDS = (RANK_DEAD, RANK_HUNG, STRAGGLER, BAD_NUMERICS, NODE_FAULT, CHECKPOINT_STALE,
         AGENT_UNREACHABLE, CRASH_LOOP, DATA_STALL)  # fmt: skip

SEVERITIES = ("info", "warning", "critical")

# Actions the policy may decide on.
ACT_NONE = "none"  # record only (e.g. torchrun restarts a dead rank's group by itself)
ACT_KILL_RANK = "kill_rank"  # capture stacks, then SIGKILL the culprit: torchrun restarts the group
ACT_STOP_JOB = "stop_job"  # end the job with a verdict (crash loop, budget exhausted)
ACT_EXCLUDE_NODE = "exclude_node"  # stop the job's processes on a faulty node (elastic jobs go on)
ACTIONS = (ACT_NONE, ACT_KILL_RANK, ACT_STOP_JOB, ACT_EXCLUDE_NODE)


@dataclass(frozen=True)
class Finding:
    """One detected fault. `key` identifies the fault itself, so the same fault seen in
    many polls (or again after a supervisor restart) maps to one incident."""

    kind: str
    key: str
    severity: str
    summary: str
    job: str | None = None
    node: str | None = None
    rank: int | None = None
    occurred_at: float | None = (
        None  # best estimate of when it happened (exit time, last heartbeat)
    )
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """What to do about one finding."""

    finding: Finding
    action: str
    reason: str
    target: dict[str, Any] = field(default_factory=dict)  # e.g. {"node_url", "job", "rank"}
    # Postponed, not settled: decided again on a later pass (backoff, culprit unknown, ...)
    deferred: bool = False
