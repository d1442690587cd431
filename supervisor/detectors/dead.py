"""RANK_DEAD: a rank of the job's current incarnation exited or is a zombie.

The agent learns of an exit at once (pidfd), so this is the fastest and surest finding.
A "finished" rank exited cleanly after phase "done" and is not dead; processes of an
earlier incarnation were ended by torchrun itself and are not news, except those of an
incarnation that was current at the last poll: a warm restart takes about a second, so a
rank can die and be replaced between two polls, and its death shows only there.

One finding per failed incarnation, naming the first rank to die: when one rank dies,
torchrun tears down the others within a moment, and those deaths are consequences, not
faults of their own (they are listed in the evidence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import RANK_DEAD, Finding, History
from ..state import DEAD_STATES, ClusterObs, RankObs
from .common import gpu_note, incarnation, node_url

if TYPE_CHECKING:
    from . import DetectorConfig


@dataclass(frozen=True)
class DeadConfig:
    """[detectors.dead]: a rank process that died (zombie or exited)."""

    enabled: bool = True


def detect(obs: ClusterObs, history: History, cfg: DetectorConfig) -> list[Finding]:
    out = []
    for job in obs.jobs():
        restart, ranks = incarnation(obs, job)
        dead = [r for r in ranks if r.state in DEAD_STATES]
        if dead:
            first = _first(dead, obs.time)
            out.append(_finding(first, node_url(obs, first.node), dead))
        # A warm restart can die and come back between two polls: the incarnations the
        # last poll saw current and this one sees replaced are judged by their dead too.
        # (Ranks our own action ended are attributed to its incident: lifecycle.attribute.)
        before = history.restarts_before.get(job)
        if before is not None and before < restart:
            for missed in range(before, restart):
                gone = [r for r in obs.ranks(job) if r.restart == missed and r.dead]
                if gone:
                    first = _first(gone, obs.time)
                    out.append(_finding(first, node_url(obs, first.node), gone))
    return out


def _first(dead: list[RankObs], now: float) -> RankObs:
    return min(dead, key=lambda r: (r.exited_at if r.exited_at is not None else now, r.rank))


def _finding(r: RankObs, url: str | None, dead: list[RankObs]) -> Finding:
    gpu, gpu_clause = gpu_note(r)
    return Finding(
        kind=RANK_DEAD,
        key=f"rank_dead:{r.job}:{r.restart}",
        severity="critical",
        summary=f"job {r.job} rank {r.rank} on {r.node} is {r.state} (pid {r.pid}, "
        f"step {r.step}, phase {r.phase}, restart {r.restart}){gpu_clause}",
        job=r.job,
        node=r.node,
        rank=r.rank,
        occurred_at=r.exited_at,
        evidence={
            "state": r.state,
            "pid": r.pid,
            "step": r.step,
            "phase": r.phase,
            "restart": r.restart,
            "node_url": url,
            "dead_ranks": {str(d.rank): {"state": d.state, "exited_at": d.exited_at} for d in dead},
            **gpu,
        },
    )
