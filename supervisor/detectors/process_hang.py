"""RANK_HUNG for ranks without telemetry (zero-code protection): judged by the process.

A torchrun worker the agent found in /proc (``source == "process"``) reports no steps and
no heartbeat, so the step-time budgets of ``hang.py`` cannot apply. What the kernel shows
is enough for two clear cases:

* **stopped**: a rank in state stopped (SIGSTOP, SIGTSTP, a tracer) for at least
  ``process_stopped_seconds`` cannot progress, and with DDP every other rank waits for it
  at the next collective. It is the culprit.
* **no CPU progress**: every live rank but at most one has used no CPU (under 0.05 cores
  over the agent's window) for ``process_idle_seconds``: they are blocked, and the one
  still busy is the rank they wait for. When all are idle, nothing in the process table
  names a culprit: the loop reads every rank's stacks (py-spy) and picks the only one not
  waiting in a collective, as for telemetry ranks; without such a rank nothing is done and
  nothing is recorded (the loop drops the finding: idle CPU alone is weak evidence).

* **collectives stand still** (the zero-code collective watch, client/collective_watch.py,
  sends each worker's flight-recorder wavefront once its collectives have stood still):
  every live rank has a fresh wavefront and together they say the same thing
  (supervisor/wavefront.py) for ``wavefront_seconds``. A rank that never enqueued the
  collective its peers wait in is the culprit; a desync is a code bug (the policy stops
  the job); every member waiting in the same collective is a fault below the ranks, and
  the stacks are read, then the job restarts through one rank. This is the rule that
  holds on NCCL, where the waiting ranks spin and are never idle. Its budget is the
  longest a rank may work alone while its peers wait in a collective (rank 0 writing a
  checkpoint before a barrier): a job that does longer raises it.

The idle budget is long (120 s by default) because without telemetry a detector cannot
tell a hang from legitimate single-rank work (rank 0 writing a large checkpoint while the
others wait in a barrier): the library's step times make the budget adaptive instead.
One finding per incarnation (torchrun's restart count), like the dead detector.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ..model import RANK_HUNG, Finding, History
from ..state import DEAD_STATES, LIVE_STATES, ClusterObs, RankObs
from ..wavefront import BEHIND, DESYNC, Wavefront, read_wavefront
from .common import check_settings, gpu_note, hang_finding, incarnation, node_url
from .registration import Detector

if TYPE_CHECKING:
    from . import DetectorConfig


@dataclass(frozen=True)
class ProcessHangConfig:
    """[detectors.process_hang]: hangs of ranks without telemetry (zero-code: process state,
    CPU time, the workers' flight recorders). stopped_seconds also applies to stand-ins
    (detectors/stand_in.py)."""

    enabled: bool = True
    stopped_seconds: float = 2.0  # a rank (or its stand-in) stopped this long is hung
    idle_seconds: float = 120.0  # all but one rank without CPU progress this long
    # the ranks' flight-recorder wavefronts agree on a stuck collective this long (on top
    # of the 2 s a worker's collectives stand still before it sends one)
    wavefront_seconds: float = 15.0

    def __post_init__(self) -> None:
        check_settings(self)


BUSY_RECENT_SECONDS = 5.0  # "still using CPU": active within this long (or half the budget)


def _jobs(obs: ClusterObs):
    """(job, incarnation, live ranks) of each job run without telemetry, none dead (a death
    explains the stop: the dead detector reports it)."""
    for job in obs.jobs():
        restart, ranks = incarnation(obs, job)
        if not ranks or any(r.source != "process" for r in ranks):
            continue
        if any(r.state in DEAD_STATES for r in ranks):
            continue
        live = [r for r in ranks if r.state in LIVE_STATES]
        if live:
            yield job, restart, live


def detect(obs: ClusterObs, history: History, cfg: DetectorConfig) -> list[Finding]:
    out = []
    held = history.state.get(DETECTOR.name, {})
    for job, restart, live in _jobs(obs):
        finding = (
            _stopped(obs, job, restart, live, cfg)
            or _collectives(obs, job, restart, live, cfg, held.get(job))
            or _no_progress(obs, job, restart, live, cfg)
        )
        if finding is not None:
            out.append(finding)
    return out


class _Held(NamedTuple):
    """A job's wavefront verdict of the newest observation, and since when it holds."""

    restart: int
    wave: Wavefront
    since: float


def _same(a: Wavefront, b: Wavefront) -> bool:
    return (a.verdict, a.pg, a.seq) == (b.verdict, b.pg, b.seq)


def track(history: History, obs: ClusterObs, cfg: DetectorConfig) -> History:
    """state["process_hang"]: job -> its wavefront verdict (read once per observation, here)
    and when it was first seen; kept while the same verdict (group, sequence id) holds."""
    before = history.state.get(DETECTOR.name, {})
    now = {}
    for job, restart, live in _jobs(obs):
        if (wave := read_wavefront(live)) is not None:
            old = before.get(job)
            same = old is not None and old.restart == restart and _same(old.wave, wave)
            now[job] = _Held(restart, wave, old.since if same else obs.time)
    if not now and not before:
        return history
    return dataclasses.replace(history, state={**history.state, DETECTOR.name: now})


def _collectives(
    obs: ClusterObs,
    job: str,
    restart: int,
    live: list[RankObs],
    cfg: DetectorConfig,
    held: _Held | None,
) -> Finding | None:
    if held is None or held.restart != restart:
        return None
    wave, since = held.wave, held.since
    if obs.time - since < cfg.process_hang.wavefront_seconds:
        return None
    culprit = None
    if wave.verdict in (BEHIND, DESYNC) and len(wave.ranks) == 1:
        culprit = next((r for r in live if r.rank == wave.ranks[0]), None)
    extra = {"wavefront": wave.to_json(), "decided_by": "flight recorder"}
    if wave.verdict == DESYNC:
        extra["desync"] = True  # a code bug: the policy stops the job with a verdict
    reason = f"flight recorder: {wave.detail}"
    return _finding(obs, job, restart, live, culprit, reason, since, obs.time - since, extra)


def _stopped_for(obs: ClusterObs, r: RankObs) -> float | None:
    if r.state != "stopped" or r.state_since is None:
        return None
    return max(0.0, obs.time - r.state_since)


def _idle_for(obs: ClusterObs, r: RankObs) -> float | None:
    if r.state != "alive" or r.cpu_active_at is None:
        return None
    return max(0.0, obs.time - r.cpu_active_at)


def _stopped(
    obs: ClusterObs, job: str, restart: int, live: list[RankObs], cfg: DetectorConfig
) -> Finding | None:
    stopped = [
        (s, r)
        for r in live
        if (s := _stopped_for(obs, r)) is not None and s >= cfg.process_hang.stopped_seconds
    ]
    if not stopped:
        return None
    for_s, culprit = max(stopped, key=lambda x: (x[0], -x[1].rank))
    reason = f"stopped (SIGSTOP) for {for_s:.1f}s: the process cannot progress"
    return _finding(obs, job, restart, live, culprit, reason, obs.time - for_s, for_s)


def _no_progress(
    obs: ClusterObs, job: str, restart: int, live: list[RankObs], cfg: DetectorConfig
) -> Finding | None:
    if len(live) < 2:
        return None  # a lone rank waits for nobody: idle may be I/O
    idle = {r.rank: s for r in live if (s := _idle_for(obs, r)) is not None}
    blocked = [r for r in live if idle.get(r.rank, -1.0) >= cfg.process_hang.idle_seconds]
    busy = [r for r in live if r not in blocked]
    if len(busy) > 1 or len(blocked) < len(live) - 1:
        return None
    # The one rank left must still be using CPU to be blamed for it: a rank that went idle
    # a moment after the others (it blocked in the collective they wait in, seen on a
    # loaded machine) is on its way to "all idle", which the stacks decide.
    if busy and idle.get(busy[0].rank, 0.0) >= min(
        BUSY_RECENT_SECONDS, cfg.process_hang.idle_seconds / 2
    ):
        return None
    quiet = min(idle[r.rank] for r in blocked)
    if busy:
        culprit = busy[0]
        reason = f"the only rank using CPU while the others made no CPU progress for {quiet:.0f}s"
        return _finding(obs, job, restart, live, culprit, reason, obs.time - quiet, quiet)
    reason = f"no rank made CPU progress for {quiet:.0f}s: stacks needed"
    return _finding(obs, job, restart, live, None, reason, obs.time - quiet, quiet)


def _finding(
    obs: ClusterObs,
    job: str,
    restart: int,
    live: list[RankObs],
    culprit: RankObs | None,
    reason: str,
    occurred_at: float,
    quiet: float,
    extra: dict | None = None,
) -> Finding:
    blame = f"culprit rank {culprit.rank} ({reason})" if culprit else f"no culprit yet: {reason}"
    evidence = {
        "restart": restart,
        "source": "process",
        "phase": None,
        "states": {str(r.rank): r.state for r in live},
        "pids": {str(r.rank): r.pid for r in live},
        "cpu_utilization": {str(r.rank): r.cpu_utilization for r in live},
        "cpu_idle_seconds": {
            str(r.rank): None if r.cpu_active_at is None else max(0.0, obs.time - r.cpu_active_at)
            for r in live
        },
        "culprit_reason": reason,
        "stacks_needed": culprit is None,
    }
    evidence.update(extra or {})
    if culprit is not None:
        evidence.update(pid=culprit.pid, node_url=node_url(obs, culprit.node))
    gpu, gpu_clause = gpu_note(culprit)
    evidence.update(gpu)
    return hang_finding(
        job,
        f"{restart}:process",
        culprit,
        summary=f"job {job} hung (no telemetry; judged by process): no progress for "
        f"{quiet:.1f}s; {blame}{gpu_clause}",
        occurred_at=occurred_at,
        evidence=evidence,
    )


DETECTOR = Detector(
    "process_hang", RANK_HUNG, ProcessHangConfig, detect, track=track, every_pass=True
)
