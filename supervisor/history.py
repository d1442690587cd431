"""What the detectors need beyond one poll, carried from pass to pass.

`History` is plain data; `advance(history, obs, cfg)` returns the history after one more
observation, a new object (the input is left as it was), so the detectors stay pure
functions of (observation, history). What a detector keeps is advanced by the detector
itself (its registration's `track`); this module names the fields and runs the tracks.
The straggler suspects of the observation are computed once when the history is advanced
and kept with it (`suspects`, `suspects_at`): the straggler detector reads them instead of
judging every rank a second time in the same pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .detectors import DetectorConfig
    from .state import ClusterObs


@dataclass
class History:
    unreachable_since: dict[str, float] = field(default_factory=dict)  # agent url -> first failure
    # job -> (newest validated checkpoint step, training step when it last advanced, time)
    checkpoint_progress: dict[str, tuple[int | None, int, float]] = field(default_factory=dict)
    # f"{job}:{restart}" -> the first training step seen of that incarnation
    incarnation_start: dict[str, int] = field(default_factory=dict)
    # straggler finding key -> (time, training step) since when the rank has looked slow
    straggler_since: dict[str, tuple[float, int]] = field(default_factory=dict)
    # straggler keys of the ranks still slower than their peers (not all suspects): their
    # incidents stay open (detectors/straggler.py `holds`)
    straggler_slower: frozenset[str] = frozenset()
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
    # detector name -> the state of a detector that keeps its own (its registration's
    # `track` sets it), for one whose state is not a field above
    state: dict[str, Any] = field(default_factory=dict)


def advance(history: History, obs: ClusterObs, cfg: DetectorConfig) -> History:
    """The history after this poll: what every detector may read (each incarnation's first
    step and the jobs' newest incarnations), then each registered detector's own state
    (its `track`, registration.py), in the registry's order.

    incarnation_start[job:restart]: the first training step seen of each incarnation.
    restarts_before, restarts[job]: the job's newest incarnation at the last poll and now.
    The detectors' own: checkpoint_progress (checkpoint.py), unreachable_since
    (unreachable.py), straggler_since, preempted and the suspects (straggler.py), phases
    (the hang detector's, phase_budgets.py).
    """
    history = dataclasses.replace(
        history, incarnation_start=_starts(history, obs), **_incarnations(history, obs)
    )
    return _track(history, obs, cfg, every_pass_only=False)


def advance_every_pass(history: History, obs: ClusterObs, cfg: DetectorConfig) -> History:
    """The history after a pass that runs only the per-pass detectors (reconcile.py: the
    window detectors and their state are paced): the jobs' incarnations and the state of
    the detectors registered to run every pass."""
    history = dataclasses.replace(history, **_incarnations(history, obs))
    return _track(history, obs, cfg, every_pass_only=True)


advance_unreachable = advance_every_pass  # its former name: unreachable_since is one of those


def _track(
    history: History, obs: ClusterObs, cfg: DetectorConfig, every_pass_only: bool
) -> History:
    # the detectors come with their settings (DetectorConfig.REGISTRY): this module does not
    # import them, they import it
    for detector in cfg.REGISTRY:
        if detector.track is not None and (detector.every_pass or not every_pass_only):
            history = detector.track(history, obs, cfg)
    return history


def _starts(history: History, obs: ClusterObs) -> dict[str, int]:
    """incarnation_start after this poll."""
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
    return starts


def _incarnations(history: History, obs: ClusterObs) -> dict[str, dict[str, int]]:
    """restarts_before and restarts after this poll; a job out of view keeps its last."""
    return {
        "restarts_before": history.restarts,
        "restarts": {**history.restarts, **obs.newest_restarts()},
    }
