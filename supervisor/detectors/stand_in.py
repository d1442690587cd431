"""RANK_HUNG when the process torchrun watches in place of a rank is stopped.

With warm start a rank runs in a process forked by a warm server; torchrun watches a
light shim that stands in for it (trainer/warm.py, agent/stand_ins.py). A stopped shim
(SIGSTOP) hides its rank from torchrun: the rank trains on, but its exit, clean or not,
never reaches torchrun, which then waits forever, and a failure elsewhere cannot tear the
group down until torchrun's 30 s kill timeout. So a stand-in stopped for
``process_stopped_seconds`` is a fault like a stopped rank, whatever the rank itself is
doing (training, or finished): its rank is the culprit, and killing it (the agent kills
the stand-in with it) lets torchrun see a failed worker and restart the group, which
resumes from the newest validated checkpoint.

A stand-in that died took its rank with it (the rank watches it by pidfd): the dead
detector reports that death. One finding per rank and incarnation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import RANK_HUNG, Finding, History
from ..state import ClusterObs, RankObs
from .common import hang_finding, incarnation, node_url
from .registration import Detector

if TYPE_CHECKING:
    from . import DetectorConfig


@dataclass(frozen=True)
class StandInConfig:
    """[detectors.stand_in]: a warm-started rank's stand-in stopped longer than
    [detectors.process_hang] stopped_seconds is hung (one threshold for both)."""

    enabled: bool = True


def detect(obs: ClusterObs, history: History, cfg: DetectorConfig) -> list[Finding]:
    out = []
    for job in obs.jobs():
        restart, ranks = incarnation(obs, job)
        for r in ranks:
            stopped_for = _stand_in_stopped_for(obs, r)
            if stopped_for is not None and stopped_for >= cfg.process_hang.stopped_seconds:
                out.append(_finding(obs, r, restart, stopped_for))
    return out


def _stand_in_stopped_for(obs: ClusterObs, r: RankObs) -> float | None:
    if r.stand_in_state != "stopped" or r.stand_in_since is None:
        return None
    return max(0.0, obs.time - r.stand_in_since)


def _finding(obs: ClusterObs, r: RankObs, restart: int, stopped_for: float) -> Finding:
    reason = (
        f"its stand-in (warm-start shim, pid {r.stand_in_pid}) has been stopped for "
        f"{stopped_for:.1f}s: torchrun cannot see the rank (it is {r.state})"
    )
    return hang_finding(
        r.job,
        f"{restart}:stand_in:{r.rank}",
        r,
        summary=f"job {r.job} rank {r.rank} on {r.node}: {reason}",
        occurred_at=obs.time - stopped_for,
        evidence={
            "restart": restart,
            "pid": r.pid,
            "rank_state": r.state,
            "stand_in_pid": r.stand_in_pid,
            "stand_in_state": r.stand_in_state,
            "stand_in_stopped_seconds": stopped_for,
            "culprit_reason": reason,
            "stacks_needed": False,
            "node_url": node_url(obs, r.node),
        },
    )


DETECTOR = Detector("stand_in", RANK_HUNG, StandInConfig, detect, every_pass=True)
