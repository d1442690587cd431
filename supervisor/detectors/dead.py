"""RANK_DEAD: a rank of the job's current incarnation exited or is a zombie.

The agent learns of an exit at once (pidfd), so this is the fastest and surest finding.
A "finished" rank exited cleanly after phase "done" and is not dead; processes of an
earlier incarnation were ended by torchrun itself and are not news, except those of an
incarnation that was current at the last poll: a warm restart takes about a second, so a
rank can die and be replaced between two polls, and its death shows only there.

One finding per failed incarnation, naming the first rank to die: when one rank dies,
torchrun tears down the others within a moment, and those deaths are consequences, not
faults of their own (they are listed in the evidence). Except when the first died waiting
in a collective that the flight recorders show another rank never enqueued: a collective
timeout (`nccl_timeout`), whose culprit is that other rank, alive or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import RANK_DEAD, Finding, History
from ..state import DEAD_STATES, ClusterObs, RankObs
from ..wavefront import BEHIND, FRESH_SECONDS, Wavefront, read_wavefront
from .common import gpu_note, incarnation, known_step, node_url, progress
from .registration import Detector

if TYPE_CHECKING:
    from . import DetectorConfig


# The cause of a death by collective timeout (the watchdog's SIGABRT on NCCL, a timeout
# error on gloo), named after the rank the dead one waited for.
NCCL_TIMEOUT = "nccl_timeout"


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
            out.append(_finding(first, node_url(obs, first.node), dead, obs, ranks))
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


def timed_out_behind(
    first: RankObs, ranks: list[RankObs], now: float
) -> tuple[RankObs, Wavefront] | None:
    """The rank the first to die was waiting for, when it died waiting in a collective:
    NCCL's watchdog (or a gloo timeout) ends the ranks that wait, never the one they wait
    for, so the first death is a victim. Read from the wavefronts the ranks sent while
    the job was stalled, before the death."""
    if first.exited_at is None:
        return None
    wave = read_wavefront(ranks, max_age=max(0.0, now - first.exited_at) + FRESH_SECONDS)
    if wave is None or wave.verdict != BEHIND or len(wave.ranks) != 1:
        return None
    mine = {c.pg: c for c in first.collectives}
    waiting = mine.get(wave.pg)
    if waiting is None or waiting.enqueued <= waiting.completed or wave.ranks[0] == first.rank:
        return None
    culprit = next((r for r in ranks if r.rank == wave.ranks[0]), None)
    return (culprit, wave) if culprit is not None else None


def _finding(r: RankObs, url: str | None, dead: list[RankObs], obs=None, ranks=()) -> Finding:
    """The death of `r`, the first to die; named after the rank it waited for when it died
    of a collective timeout (`timed_out_behind`)."""
    timeout = timed_out_behind(r, list(ranks), obs.time) if obs is not None else None
    named, extra = r, {}
    summary = (f"job {r.job} rank {r.rank} on {r.node} is {r.state} (pid {r.pid}, "
               f"{progress(r)}, restart {r.restart})")  # fmt: skip
    if timeout is not None:
        named, wave = timeout
        url = node_url(obs, named.node)
        summary = (
            f"job {r.job} rank {r.rank} on {r.node} died ({r.state}) waiting in collective "
            f"{wave.seq} of group {wave.pg}: a collective timeout ({NCCL_TIMEOUT}); culprit "
            f"rank {named.rank} on {named.node}, which never enqueued it ({progress(named)})"
        )
        extra = {"cause": NCCL_TIMEOUT, "culprit_reason": f"flight recorder: {wave.detail}",
                 "first_to_die": {"rank": r.rank, "node": r.node, "pid": r.pid},
                 "wavefront": wave.to_json()}  # fmt: skip
    gpu, gpu_clause = gpu_note(named)
    return Finding(
        kind=RANK_DEAD,
        key=f"rank_dead:{r.job}:{r.restart}",
        severity="critical",
        summary=summary + gpu_clause,
        job=r.job,
        node=named.node,
        rank=named.rank,
        occurred_at=r.exited_at,
        evidence={
            "state": r.state,
            "exit_code": r.exit_code,  # the first to die's waitpid status (supervisor/causes.py)
            "pid": named.pid,
            "step": known_step(named),
            "phase": named.phase,
            "restart": r.restart,
            "node_url": url,
            "dead_ranks": {str(d.rank): {"state": d.state, "exited_at": d.exited_at} for d in dead},
            **extra,
            **gpu,
        },
    )


DETECTOR = Detector("dead", RANK_DEAD, DeadConfig, detect, every_pass=True)
