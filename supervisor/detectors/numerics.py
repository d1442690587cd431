"""BAD_NUMERICS: a non-finite loss, or a loss spike far outside the job's recent range.

One finding per job and incarnation: the remedy (resume from a checkpoint that
predates the anomaly) is per job, so the evidence carries the first bad step and the
newest validated checkpoint step for the policy to compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING

from ...contract.numbers import json_safe
from ..model import BAD_NUMERICS, Finding, History
from ..state import ClusterObs, RankObs
from .common import (
    at_least,
    check_settings,
    finite,
    incarnation,
    mad,
    median,
    node_url,
    positive,
    samples_of,
)
from .registration import Detector

if TYPE_CHECKING:
    from . import DetectorConfig


@dataclass(frozen=True)
class NumericsConfig:
    """[detectors.numerics]: NaN/Inf losses always; a finite loss spike above
    max(median + spike_mads * MAD, spike_min_ratio * median) of the incarnation's losses."""

    enabled: bool = True
    spike_mads: float = 10.0
    spike_min_ratio: float = 2.0
    spike_min_samples: int = 20
    # A spike is judged in each rank's newest steps, not its latest loss alone: a spike one
    # batch long (a bad batch) is over before the next poll, and a rollback must still
    # skip past it (issue 20). The newest only: early training's falling loss is far above
    # the window's median in its oldest steps.
    spike_recent_steps: int = 8

    def __post_init__(self) -> None:
        check_settings(self)
        at_least(self, spike_min_samples=3, spike_recent_steps=1)
        positive(self, "spike_mads")
        if self.spike_min_ratio < 1:
            raise ValueError(f"spike_min_ratio must be >= 1, not {self.spike_min_ratio!r}")


_LOSS = attrgetter("loss")


def _bad(x: float | None) -> bool:
    return x is not None and not math.isfinite(x)


def detect(obs: ClusterObs, history: History, cfg: DetectorConfig) -> list[Finding]:
    out = []
    for job in obs.jobs():
        restart, ranks = incarnation(obs, job)
        window = chain.from_iterable(samples_of(r, restart) for r in ranks)
        losses = [x for x in map(_LOSS, window) if x is not None]
        # a sum is finite only if every term is: one C-speed check spares the per-rank
        # scan in the usual case (a finite sum can overflow to inf: then the scan decides)
        clean = math.isfinite(sum(losses)) and not any(_bad(r.loss) for r in ranks)
        if not clean:
            losses = finite(losses)
        hit = (None if clean else _non_finite(ranks, restart)) or _spike(
            losses, ranks, restart, cfg
        )
        if hit is None:
            continue
        rank, step, loss, how = hit
        out.append(_finding(obs, job, restart, ranks, rank, step, loss, how))
    return out


Hit = tuple[RankObs, int | None, float | None, dict]


def _non_finite(ranks: list[RankObs], restart: int) -> Hit | None:
    """The earliest non-finite loss of any rank: in its recent samples, or its latest."""
    first: tuple[int, RankObs, float | None] | None = None
    for r in ranks:
        candidates = [(s.step, s.loss) for s in samples_of(r, restart) if _bad(s.loss)]
        if _bad(r.loss) and r.step is not None:
            candidates.append((r.step, r.loss))
        for step, loss in candidates:
            if first is None or step < first[0]:
                first = (step, r, loss)
    if first is None:
        return None
    step, r, loss = first
    return r, step, loss, {"reason": "non_finite"}


def _spike(
    recent: list[float], ranks: list[RankObs], restart: int, cfg: DetectorConfig
) -> Hit | None:
    """A rank's newest losses far above the job's recent losses (`recent`: every rank's
    window, finite): both many MADs above the median (robust to a few outliers) and a
    multiple of it (a tiny MAD once the loss flattens must not turn noise into a spike)."""
    losses = recent
    if len(losses) < cfg.numerics.spike_min_samples:
        return None
    n = cfg.numerics.spike_recent_steps
    newest = finite(r.loss for r in ranks)  # each rank's latest and its newest n steps
    newest += finite(s.loss for r in ranks for s in samples_of(r, restart)[-n:])
    if not newest:
        return None
    center = median(losses)
    if max(newest) <= cfg.numerics.spike_min_ratio * center:
        return None  # below the limit whatever the spread: skip the MAD (scale)
    spread = mad(losses, center)
    limit = max(center + cfg.numerics.spike_mads * spread, cfg.numerics.spike_min_ratio * center)
    spiking = []  # (step, loss, rank) of each recent loss above the limit
    for r in ranks:
        recent = samples_of(r, restart)[-cfg.numerics.spike_recent_steps :]
        seen = [(s.step, s.loss) for s in recent if _above(s.loss, limit)]
        if _above(r.loss, limit) and (r.step, r.loss) not in seen:
            seen.append((r.step, r.loss))
        spiking += [(step, loss, r) for step, loss in seen]
    if not spiking:
        return None
    # the earliest spiking step (where the anomaly began), its highest loss
    first = min(step if step is not None else math.inf for step, _, _ in spiking)
    step, loss, r = max((x for x in spiking if x[0] == first or first == math.inf),
                        key=lambda x: x[1])  # fmt: skip
    how = {"reason": "spike", "median_loss": center, "mad": spread, "limit": limit}
    how["samples"] = len(losses)
    return r, step, loss, how


def _above(loss: float | None, limit: float) -> bool:
    return loss is not None and math.isfinite(loss) and loss > limit


def _estimated_time(obs: ClusterObs, r: RankObs, restart: int, step: int | None) -> float:
    """When `step` ran: the rank's last record time, minus the steps since at its median
    step time. The observation time when that cannot be derived."""
    if r.heartbeat_age_seconds is None or step is None or r.step is None:
        return obs.time
    last = obs.time - r.heartbeat_age_seconds
    times = [s.step_seconds for s in samples_of(r, restart)]
    per_step = median(times) if times else 0.0
    return last - max(0, r.step - step) * per_step


def _finding(
    obs: ClusterObs,
    job: str,
    restart: int,
    ranks: list[RankObs],
    r: RankObs,
    step: int | None,
    loss: float | None,
    how: dict,
) -> Finding:
    ckpts = [x.checkpoint_step for x in ranks if x.checkpoint_step is not None]
    ckpt = max(ckpts) if ckpts else None
    what = "non-finite loss" if how["reason"] == "non_finite" else "loss spike"
    return Finding(
        kind=BAD_NUMERICS,
        key=f"bad_numerics:{job}:{restart}",
        severity="critical",
        summary=f"job {job}: {what} ({loss}) on rank {r.rank} from step {step}; newest "
        f"validated checkpoint: {ckpt}",
        job=job,
        node=r.node,
        rank=r.rank,
        occurred_at=_estimated_time(obs, r, restart, step),
        evidence={
            **how,
            "restart": restart,
            "pid": r.pid,
            "node_url": node_url(obs, r.node),
            "anomaly_step": step,
            "loss": json_safe(loss),
            "checkpoint_step": ckpt,
            "checkpoint_predates_anomaly": None if ckpt is None or step is None else ckpt < step,
        },
    )


DETECTOR = Detector("numerics", BAD_NUMERICS, NumericsConfig, detect)
