"""CHECKPOINT_STALE: training went on far past the newest validated checkpoint.

Rule (the simplest robust one the observations allow): stale when
    max_step - ckpt_step > checkpoint_stale_factor * max(gap, 1)
where `gap`, the job's checkpoint interval in steps, is estimated as `ckpt_step` itself.
Checkpoints land on multiples of the interval, so the newest one's step is never below
the interval: the estimate can be lax (late in a long run), never too strict, so a
healthy job never alarms. A tighter estimate needs the step of the previous checkpoint,
which `History` does not keep (the finding says how the gap was estimated).

`track` carries the job's checkpoint progress from poll to poll (`History.checkpoint_progress`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import CHECKPOINT_STALE, Finding, History
from ..state import LIVE_STATES, ClusterObs, RankObs
from .common import check_settings, incarnation, positive
from .registration import Detector

if TYPE_CHECKING:
    from . import DetectorConfig


@dataclass(frozen=True)
class CheckpointConfig:
    """[detectors.checkpoint]: the newest validated checkpoint falls behind."""

    enabled: bool = True
    stale_factor: float = 3.0  # behind by more than this many checkpoint intervals

    def __post_init__(self) -> None:
        check_settings(self)
        positive(self, "stale_factor")


def _newest_checkpoint(ranks: list[RankObs]) -> int | None:
    steps = [r.checkpoint_step for r in ranks if r.checkpoint_step is not None]
    return max(steps) if steps else None


def _max_step(ranks: list[RankObs]) -> int | None:
    steps = [r.step for r in ranks if r.step is not None]
    return max(steps) if steps else None


def detect(obs: ClusterObs, history: History, cfg: DetectorConfig) -> list[Finding]:
    out = []
    for job in obs.jobs():
        restart, ranks = incarnation(obs, job)
        if not any(r.state in LIVE_STATES for r in ranks):
            continue  # a finished or dead job trains no further
        progress = history.checkpoint_progress.get(job)
        ckpt = _newest_checkpoint(ranks)
        if ckpt is None and progress is not None:
            ckpt = progress[0]  # a fresh incarnation may not have reported it yet
        top = _max_step(ranks)
        if ckpt is None or top is None:
            continue
        gap = max(ckpt, 1)
        behind = top - ckpt
        if behind <= cfg.checkpoint.stale_factor * gap:
            continue
        out.append(
            Finding(
                kind=CHECKPOINT_STALE,
                key=f"checkpoint_stale:{job}:{ckpt}",
                severity="warning",
                summary=f"job {job} is at step {top}, {behind} steps past its newest validated "
                f"checkpoint (step {ckpt}); more than {cfg.checkpoint.stale_factor:g}x the "
                f"estimated interval of {gap} steps",
                job=job,
                occurred_at=obs.time,
                evidence={
                    "restart": restart,
                    "checkpoint_step": ckpt,
                    "max_step": top,
                    "steps_since_checkpoint": behind,
                    "gap_estimate_steps": gap,
                    "gap_estimated_from": "newest checkpoint step (a multiple of the interval)",
                    "factor": cfg.checkpoint.stale_factor,
                    "last_advanced_at_step": progress[1] if progress else None,
                    "last_advanced_at": progress[2] if progress else None,
                },
            )
        )
    return out


def track(history: History, obs: ClusterObs, cfg: DetectorConfig) -> History:
    """checkpoint_progress[job]: updated when the job's newest validated checkpoint changes
    (to the step training had reached and the time); kept as is when it did not, or when
    the job is out of sight this poll (an unreachable node hides it, nothing changed)."""
    progress = dict(history.checkpoint_progress)
    for job in obs.jobs():
        _, ranks = incarnation(obs, job)
        ckpt, top = _newest_checkpoint(ranks), _max_step(ranks)
        old = progress.get(job)
        if top is None or (ckpt is None and old is not None):
            continue  # nothing new: a restarted rank that has not reported its checkpoint yet
        if old is None or old[0] != ckpt:
            progress[job] = (ckpt, top, obs.time)
    return dataclasses.replace(history, checkpoint_progress=progress)


DETECTOR = Detector("checkpoint", CHECKPOINT_STALE, CheckpointConfig, detect, track=track)
