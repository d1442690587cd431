"""Small helpers the detectors share: the current incarnation and robust statistics."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from operator import attrgetter

from ..model import RANK_HUNG, Finding
from ..state import ClusterObs, RankObs, StepSample


def incarnation(obs: ClusterObs, job: str) -> tuple[int, list[RankObs]]:
    """The job's newest torchrun incarnation: its restart count and its ranks.

    `current_ranks` keeps each rank's newest process; a rank whose new process has not
    reported yet still shows its old one, which belongs to an earlier incarnation (torchrun
    ended it on purpose) and is left out here.
    """
    ranks = obs.current_ranks(job)
    if not ranks:
        return 0, []
    restart = max(r.restart for r in ranks)
    return restart, [r for r in ranks if r.restart == restart]


def gpu_note(rank: RankObs | None) -> tuple[dict, str]:
    """A rank's GPU as evidence (``{"gpu": ...}``, or nothing when unknown) and, when that
    GPU has faults, a clause for the finding's summary that names them: a dead, hung or
    slow rank on a GPU that reported an XID is explained by it."""
    gpu = rank.gpu if rank is not None else None
    if gpu is None:
        return {}, ""
    faults = gpu.faults()
    clause = f"; its GPU {gpu.uuid} (index {gpu.index}): {', '.join(faults)}" if faults else ""
    return {"gpu": gpu.to_json()}, clause


def job_finding(
    kind: str,
    job: str,
    key: str,
    rank: RankObs | None,
    *,
    severity: str,
    summary: str,
    occurred_at: float,
    evidence: dict,
) -> Finding:
    """A finding about a job, keyed `kind:job:key` (`key`: what was judged within the job);
    node and rank are `rank`'s when one is named."""
    return Finding(
        kind=kind,
        key=f"{kind}:{job}:{key}",
        severity=severity,
        summary=summary,
        job=job,
        node=rank.node if rank else None,
        rank=rank.rank if rank else None,
        occurred_at=occurred_at,
        evidence=evidence,
    )


def hang_finding(job: str, key: str, culprit: RankObs | None, **fields) -> Finding:
    """A hang, as every hang detector reports it (critical; `fields`: summary, occurred_at
    and evidence): node and rank are the culprit's when one is named."""
    return job_finding(RANK_HUNG, job, key, culprit, severity="critical", **fields)


def progress(r: RankObs) -> str:
    """Where a rank was, for a finding's summary: a zero-code worker reports no step, but
    its watch may count its optimizer's."""
    if r.step is None and r.phase is None:
        if r.script_step is not None:
            return f"step {r.script_step} (its optimizer's count)"
        return "no step reported"
    return f"step {r.step}, phase {r.phase}"


def known_step(r: RankObs) -> int | None:
    """The rank's step: its own report, else a zero-code worker's optimizer count."""
    return r.step if r.step is not None else r.script_step


def node_url(obs: ClusterObs, node: str) -> str | None:
    """The agent URL of a node, so a finding can say where to act."""
    return next((n.url for n in obs.nodes if n.node == node), None)


def restart_via(obs: ClusterObs, ranks: list[RankObs]) -> dict:
    """The lowest of `ranks`, as a hang's `restart_via`: the rank to end so that torchrun
    re-forms the job, when no culprit can be ended itself (out of reach, dead, unnamed)."""
    via = min(ranks, key=lambda r: r.rank)
    return {"rank": via.rank, "node": via.node, "pid": via.pid, "node_url": node_url(obs, via.node)}


# samples_of's answers, by the identity of the window they were cut from: several
# detectors ask for the same rank's samples in one pass (and windows.py keeps a rank's
# window object while no sample arrived), and at 8,192 ranks x 64 samples the repeated
# filtering was the largest part of a pass (docs/scaling.md). The entry holds the window
# itself, so its id cannot be reused while it is cached.
_SAMPLES: dict[tuple[int, int, str | None], tuple[tuple, tuple[StepSample, ...]]] = {}
_SAMPLES_MAX = 100_000
_SECONDS, _PHASE = attrgetter("step_seconds"), attrgetter("phase")


def samples_of(rank: RankObs, restart: int, phase: str | None = None) -> list[StepSample]:
    """The rank's timed samples of one incarnation (optionally one phase), oldest first."""
    recent = rank.recent
    key = (id(recent), restart, phase)
    hit = _SAMPLES.get(key)
    if hit is not None and hit[0] is recent:
        return list(hit[1])
    if (
        recent
        and recent[0].restart == restart == recent[-1].restart  # restarts only go up
        and min(map(_SECONDS, recent)) > 0
        and (phase is None or set(map(_PHASE, recent)) == {phase})
    ):
        out = recent  # the usual window: all of it (checked at C speed)
    else:
        out = tuple(
            s
            for s in recent
            if s.restart == restart and s.step_seconds > 0 and (phase is None or s.phase == phase)
        )
    if len(_SAMPLES) >= _SAMPLES_MAX:
        _SAMPLES.clear()  # windows of passes gone by: cheaper than tracking their age
    _SAMPLES[key] = (recent, out)
    return list(out)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of nothing")
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def median_without(ordered: list[float], value: float) -> float:
    """median(ordered with one occurrence of `value` removed); `ordered` is sorted. A
    rank's peers' median in O(log N): sorting the N-1 others per rank was O(N^2 log N)
    (85% of the supervisor's CPU at 2,048 ranks in the straggler detector)."""
    i = bisect_left(ordered, value)
    n = len(ordered) - 1

    def at(k: int) -> float:  # k-th element of the list without ordered[i]
        return ordered[k] if k < i else ordered[k + 1]

    if n <= 0:
        raise ValueError("median of nothing")
    mid = n // 2
    return at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2


def quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile of nothing")
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mad(values: Sequence[float], center: float) -> float:
    """Median absolute deviation: a spread that a few outliers cannot inflate."""
    return median([abs(v - center) for v in values])


def finite(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def check_settings(cfg: object) -> None:
    """Every number of a detector's settings is >= 0 and not NaN (the TOML loader has
    checked the types; a dataclass built in code gets the same check here)."""
    import dataclasses

    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if isinstance(value, bool) or dataclasses.is_dataclass(value):
            continue  # a nested table checks itself
        if not isinstance(value, int | float):
            raise ValueError(f"{f.name} must be a number, not {value!r}")
        if value != value or value < 0:  # NaN or negative
            raise ValueError(f"{f.name} must be >= 0, not {value!r}")


def at_least(cfg: object, **least: int) -> None:
    for name, low in least.items():
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, not {value!r}")


def positive(cfg: object, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{name} must be > 0, not {getattr(cfg, name)!r}")
