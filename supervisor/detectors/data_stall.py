"""DATA_STALL: a rank whose data wait stands out from its own history and from its peers'
(its GPU waits while the next batch loads: a slow filesystem, a starved worker pool).

Medians again, never means: a rank's newest `window` steps against (a) its own older
steps of the same incarnation and (b) the other ranks' newest steps. Both comparisons
must hold, so a job whose every rank waits on a shared, slow store is not blamed on one
rank (the DataLoadingStall alert covers that), and one page-cache miss (a single slow step
in the window) is not a stall. The wait must also be a real share of the step: a few
milliseconds against microseconds is not one.

A loader that never returns leaves the step unfinished: no sample arrives, and the hang
detector names that rank (it is the one outside the collective its peers wait in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import DATA_STALL, Finding, History
from ..state import LIVE_STATES, ClusterObs, StepSample
from .common import (
    at_least,
    check_settings,
    incarnation,
    job_finding,
    median,
    median_without,
    node_url,
    samples_of,
)
from .registration import Detector

if TYPE_CHECKING:
    from . import DetectorConfig

PHASES = ("train", "eval")  # the phases that read batches


@dataclass(frozen=True)
class DataStallConfig:
    """[detectors.data_stall]: a rank waiting for its data far longer than it used to and
    than its peers do."""

    enabled: bool = True
    window: int = 3  # newest steps judged (their median: two slow steps of three)
    min_history: int = 8  # older steps of the incarnation needed as the rank's own baseline
    warmup_steps: int = 3  # first steps of an incarnation (workers starting) not judged
    factor: float = 4.0  # the window's wait >= factor x max(own baseline, peers')
    min_seconds: float = 0.2  # ... and longer than that by at least this
    min_share: float = 0.2  # ... and at least this share of the step (the GPU waited)

    def __post_init__(self) -> None:
        check_settings(self)
        at_least(self, window=1, min_history=1, warmup_steps=0)
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, not {self.factor}")
        if not 0 <= self.min_share <= 1:
            raise ValueError(f"min_share must be in [0, 1], not {self.min_share}")


@dataclass(frozen=True)
class _Wait:
    steps: list[StepSample]  # every judged step of the incarnation, oldest first
    recent: list[StepSample]  # the newest `window` steps
    baseline: float | None  # median data wait of the older steps (None: too few)


def detect(obs: ClusterObs, history: History, cfg: DetectorConfig) -> list[Finding]:
    c = cfg.data_stall
    out = []
    for job in obs.jobs():
        restart, ranks = incarnation(obs, job)
        start = history.incarnation_start.get(f"{job}:{restart}", 0)
        waits = {}
        # Every rank of the incarnation is a peer, a finished or dead one too (its window
        # still says how long batches took); only live ranks are judged. A rank still
        # draining its last steps after its peers finished keeps its peers' reference.
        for r in ranks:
            steps = [
                s
                for s in samples_of(r, restart)
                if s.phase in PHASES and s.step > start + c.warmup_steps
            ]
            if len(steps) < c.window:
                continue
            older = steps[: -c.window]
            baseline = (
                median([s.data_wait_seconds for s in older])
                if len(older) >= c.min_history
                else None
            )
            waits[r.rank] = (r, _Wait(steps, steps[-c.window :], baseline))
        recent = {k: median([s.data_wait_seconds for s in w.recent]) for k, (_, w) in waits.items()}
        ordered = sorted(recent.values())  # the peers' median by bisection: O(N log N)
        for k, (r, w) in waits.items():
            if w.baseline is None or r.state not in LIVE_STATES:
                continue
            peers_wait = median_without(ordered, recent[k]) if len(ordered) > 1 else None
            wait = recent[k]
            step = median([s.step_seconds for s in w.recent])
            reference = max(w.baseline, peers_wait or 0.0)
            share = wait / step if step > 0 else 0.0
            if not (
                wait >= c.factor * reference
                and wait - reference >= c.min_seconds
                and share >= c.min_share
            ):
                continue
            newest = w.recent[-1]
            first = _first_slow(w.steps, reference, c)
            # when the first slow step began: the newest record's age, then the slow steps
            began = (
                obs.time
                - (r.heartbeat_age_seconds or 0.0)
                - sum(s.step_seconds for s in w.steps if s.step >= first)
            )
            peers_text = f"peers' {peers_wait:.3f}s" if peers_wait is not None else "no peers"
            out.append(
                job_finding(
                    DATA_STALL,
                    job,
                    f"{r.rank}:{restart}",  # in a later incarnation, a new incident
                    r,
                    severity="warning",
                    summary=f"job {job} rank {r.rank} on {r.node} stalls on data in phase "
                    f"{newest.phase}: waits {wait:.3f}s a step ({share:.0%} of it) vs its own "
                    f"{w.baseline:.3f}s before and {peers_text}",
                    occurred_at=began,
                    evidence={
                        "restart": restart,
                        "step": newest.step,
                        "phase": newest.phase,
                        "pid": r.pid,
                        "node_url": node_url(obs, r.node),
                        "data_wait_seconds": wait,
                        "own_baseline_seconds": w.baseline,
                        "peers_data_wait_seconds": peers_wait,
                        "step_seconds": step,
                        "data_wait_share": share,
                        "window": c.window,
                        "first_slow_step": first,
                    },
                )
            )
    return out


def _first_slow(steps: list[StepSample], reference: float, c: DataStallConfig) -> int:
    """Where the stall began: the first step of the newest run of steps that waited past
    the bar (the window's first slow step when the stall is intermittent)."""
    first = None
    for s in reversed(steps):
        wait = s.data_wait_seconds
        if wait >= c.factor * reference and wait - reference >= c.min_seconds:
            first = s.step
        elif first is not None:
            break
    return first if first is not None else steps[-1].step


DETECTOR = Detector("data_stall", DATA_STALL, DataStallConfig, detect)
