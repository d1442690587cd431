"""What the detectors need beyond one poll, carried from pass to pass.

`History` is plain data; `advance(history, obs, cfg)` returns the history after one more
observation, a new object (the input is left as it was), so the detectors stay pure
functions of (observation, history). The straggler suspects of the observation are
computed here once and kept with it (`suspects`, `suspects_at`): the straggler detector
reads them instead of judging every rank a second time in the same pass.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .detectors import DetectorConfig
    from .state import ClusterObs

log = logging.getLogger("rankguard.supervisor.detectors")


@dataclass
class History:
    unreachable_since: dict[str, float] = field(default_factory=dict)  # agent url -> first failure
    # job -> (newest validated checkpoint step, training step when it last advanced, time)
    checkpoint_progress: dict[str, tuple[int | None, int, float]] = field(default_factory=dict)
    # f"{job}:{restart}" -> the first training step seen of that incarnation
    incarnation_start: dict[str, int] = field(default_factory=dict)
    # straggler finding key -> (time, training step) since when the rank has looked slow
    straggler_since: dict[str, tuple[float, int]] = field(default_factory=dict)
    # the straggler suspects of the observation taken at `suspects_at` (Finding objects)
    suspects: tuple[Any, ...] = ()
    suspects_at: float | None = None
    # straggler finding key -> (time, step) since when the rank has looked slow only by its
    # run-queue wait (preempted, not a straggler: detectors/straggler.py); logged once
    preempted: dict[str, tuple[float, int]] = field(default_factory=dict)
    # each rank's phase outside the loop since when, the job's past phase durations (the
    # learned hang budgets) and when it was last seen suspended (phase_budgets.py)
    phases: Any = None
    # job -> its newest incarnation (restart count) in view at the previous poll and at
    # this one: a death that torchrun restarted from between two polls shows only as the
    # step between them (detectors/dead.py)
    restarts_before: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)


def advance(history: History, obs: ClusterObs, cfg: DetectorConfig | None = None) -> History:
    """The history after this poll.

    checkpoint_progress[job]: updated when the job's newest validated checkpoint changes
    (to the step training had reached and the time); kept as is when it did not, or when
    the job is out of sight this poll (an unreachable node hides it, nothing changed).
    unreachable_since[url]: the first poll that failed; dropped once the agent answers.
    incarnation_start[job:restart]: the first training step seen of each incarnation.
    straggler_since[key]: when (time, step) a straggler suspect was first seen, kept while it
    stays suspect, dropped when it does not.
    restarts_before, restarts[job]: the job's newest incarnation at the last poll and now.
    """
    from .detectors import DetectorConfig, straggler
    from .detectors.checkpoint import _max_step, _newest_checkpoint
    from .detectors.common import incarnation
    from .phase_budgets import PhaseTrace
    from .phase_budgets import advance as advance_phases

    starts = dict(history.incarnation_start)
    for r in obs.ranks():
        recent = r.recent
        if not recent:
            continue
        first = recent[0]
        key = f"{r.job}:{first.restart}"
        known = starts.get(key)
        if first.restart == recent[-1].restart and known is not None and known <= first.step:
            continue  # one incarnation in the window, its start already known: O(1) a rank
        for sample in recent:
            key = f"{r.job}:{sample.restart}"
            starts[key] = min(starts.get(key, sample.step), sample.step)
    history = dataclasses.replace(history, incarnation_start=starts)
    found, preempted_now = straggler.judge(obs, cfg or DetectorConfig(), history)
    now_suspect = tuple(found)
    stragglers = {
        f.key: history.straggler_since.get(f.key, (obs.time, f.evidence["step"]))
        for f in now_suspect
    }
    preempted = {}
    for p in preempted_now:
        since = history.preempted.get(p.key)
        if since is None:  # once per episode: the rank's raw compute is not the rank's fault
            log.info(
                "job %s rank %d on %s is preempted, not a straggler: compute %.2fx its peers'"
                " but own work %.2fx; run-queue wait %.3fs a step vs peers' %.3fs",
                p.job, p.rank, p.node, p.ratio, p.own_ratio, p.wait, p.peers_wait,
            )  # fmt: skip
        preempted[p.key] = since or (obs.time, p.step)
    progress = dict(history.checkpoint_progress)
    for job in obs.jobs():
        _, ranks = incarnation(obs, job)
        ckpt, top = _newest_checkpoint(ranks), _max_step(ranks)
        old = progress.get(job)
        if top is None or (ckpt is None and old is not None):
            continue  # nothing new: a restarted rank that has not reported its checkpoint yet
        if old is None or old[0] != ckpt:
            progress[job] = (ckpt, top, obs.time)

    unreachable = {
        n.url: history.unreachable_since.get(n.url, n.observed_at)
        for n in obs.nodes
        if not n.reachable
    }
    return dataclasses.replace(
        history,
        checkpoint_progress=progress,
        unreachable_since=unreachable,
        straggler_since=stragglers,
        preempted=preempted,
        suspects=now_suspect,
        suspects_at=obs.time,
        phases=advance_phases(
            history.phases or PhaseTrace(), obs, (cfg or DetectorConfig()).hang.phases
        ),
        **_incarnations(history, obs),
    )


def advance_unreachable(history: History, obs: ClusterObs, cfg: object = None) -> History:
    """Only `unreachable_since` after this poll: a pass that runs the per-pass detectors
    alone (reconcile.py: the window detectors and the rest of the history are paced)."""
    unreachable = {
        n.url: history.unreachable_since.get(n.url, n.observed_at)
        for n in obs.nodes
        if not n.reachable
    }
    return dataclasses.replace(
        history, unreachable_since=unreachable, **_incarnations(history, obs)
    )


def _incarnations(history: History, obs: ClusterObs) -> dict[str, dict[str, int]]:
    """restarts_before and restarts after this poll; a job out of view keeps its last."""
    return {
        "restarts_before": history.restarts,
        "restarts": {**history.restarts, **obs.newest_restarts()},
    }
