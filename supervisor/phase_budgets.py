"""Per-phase hang budgets learned from the job's own history (pure: no I/O, no clock).

A rank spends time in phases outside the training loop: `init` (from its process start:
imports, rendezvous, process-group init, model build), `checkpoint_load`, `first_step`
(phase `train` with no timed step of its incarnation yet), `checkpoint_save` and `eval`.
`advance` follows each rank of each job's newest incarnation from pass to pass and, when a
rank leaves a phase in the normal way (it moves on, alive), keeps how long it took. A
phase's budget is then `max(floor_seconds, margin x quantile(past durations))`; before the
job has shown the phase (its first start, the first checkpoint load), the budget is the
phase's default from `[detectors.hang.phases]`, which is conservative on purpose.

The same pass also remembers when the job was last seen suspended (every rank of its
world stopped at once: Slurm's suspend, a scheduler's SIGSTOP), so that neither the stop
nor the silence right after SIGCONT is taken for a hang.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .detectors.common import check_settings, incarnation, quantile, samples_of
from .state import DEAD_STATES, LIVE_STATES, ClusterObs, RankObs

if TYPE_CHECKING:
    from .detectors import DetectorConfig
    from .history import History

# The phases with a budget of their own, in the order a start goes through them.
PHASES = ("init", "checkpoint_load", "first_step", "checkpoint_save", "eval")
# Where a rank is along a start: a rank at a lower position than all its peers is behind.
START_ORDER = {"init": 0, "checkpoint_load": 1, "first_step": 2, "train": 3}


@dataclass(frozen=True)
class PhaseBudgetConfig:
    """[detectors.hang.phases]: the first start's budgets and how later ones are learned."""

    # Budgets before the job has shown a phase (its first start): generous, since a cold
    # import, a large cluster's rendezvous or a first compilation can take minutes.
    init: float = 120.0
    checkpoint_load: float = 120.0
    first_step: float = 60.0
    checkpoint_save: float = 30.0
    eval: float = 300.0
    # Once shown: margin x this quantile of the phase's past durations, at least the floor.
    quantile: float = 0.95
    margin: float = 3.0
    floor_seconds: float = 5.0
    min_samples: int = 1
    keep: int = 32  # durations kept per phase (the newest)
    # A restarted incarnation's first few steps make a thin p99: until it has shown this
    # many, the step times of the job's last settled incarnation bound its train budget
    # from below (a restart does not make the job faster).
    settled_steps: int = 20
    # Evidence that needs no budget (a stopped rank; a rank idle behind its peers) must
    # hold this long: long enough for a scheduler's stop of every rank to show whole.
    confirm_seconds: float = 1.5

    def __post_init__(self) -> None:
        check_settings(self)
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], not {self.quantile}")
        for name in ("margin", "floor_seconds", *PHASES):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)!r}")
        for name in ("min_samples", "keep", "settled_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, not {value!r}")

    def default(self, phase: str) -> float:
        return getattr(self, phase)


@dataclass(frozen=True)
class Budget:
    phase: str
    seconds: float
    # "default" (nothing learned yet), "learned", or for train (hang.py): "steps", or
    # "earlier steps" while a restarted incarnation has not settled
    source: str
    samples: int = 0
    quantile_seconds: float | None = None
    watchdog_seconds: float | None = None  # source "watchdog": the job's collective timeout

    def describe(self, cfg: PhaseBudgetConfig) -> str:
        if self.source == "watchdog":
            return (
                f"{self.seconds:.1f}s ({self.phase}: half the job's {self.watchdog_seconds:g}s "
                "collective timeout, so that rankguard decides before the watchdog does)"
            )
        if self.source == "default":
            return f"{self.seconds:.1f}s ({self.phase} default: the job has not shown this phase)"
        if self.source == "earlier steps":
            return (
                f"{self.seconds:.1f}s ({self.phase}: from this incarnation's step times and "
                f"the last settled incarnation's, until this one has shown "
                f"{cfg.settled_steps} steps)"
            )
        if self.source == "steps" or self.quantile_seconds is None:
            return f"{self.seconds:.1f}s ({self.phase}: from this incarnation's step times)"
        return (
            f"{self.seconds:.1f}s (learned: max({cfg.floor_seconds:g}s, {cfg.margin:g} x "
            f"p{cfg.quantile * 100:g} {self.quantile_seconds:.2f}s of {self.samples} past "
            f"{self.phase} phases))"
        )

    def to_json(self) -> dict:
        return {"phase": self.phase, "seconds": self.seconds, "source": self.source,
                "samples": self.samples, "quantile_seconds": self.quantile_seconds,
                "watchdog_seconds": self.watchdog_seconds}  # fmt: skip


@dataclass(frozen=True)
class PhaseTrace:
    """What the budgets carry from pass to pass (kept in History.phases)."""

    # (job, rank) -> (restart, pid, phase, entered at)
    current: Mapping[tuple[str, int], tuple[int, int, str, float]] = field(default_factory=dict)
    # job -> phase -> the newest durations, oldest first
    durations: Mapping[str, Mapping[str, tuple[float, ...]]] = field(default_factory=dict)
    # job -> the last time every rank of its world was seen stopped (a suspend)
    suspended_at: Mapping[str, float] = field(default_factory=dict)
    # job -> (restart, step times) of its newest incarnation that showed settled_steps
    settled_steps: Mapping[str, tuple[int, tuple[float, ...]]] = field(default_factory=dict)


def rank_phase(r: RankObs, restart: int) -> str | None:
    """The phase a rank is in, `first_step` for `train` before its incarnation's first
    timed step."""
    if r.phase == "train" and not samples_of(r, restart):
        return "first_step"
    return r.phase


def budget(trace: PhaseTrace, job: str, phase: str, cfg: PhaseBudgetConfig) -> Budget:
    past = trace.durations.get(job, {}).get(phase, ())
    if len(past) < cfg.min_samples:
        return Budget(phase, cfg.default(phase), "default")
    q = quantile(past, cfg.quantile)
    return Budget(phase, max(cfg.floor_seconds, cfg.margin * q), "learned", len(past), q)


def suspended(live: list[RankObs]) -> bool:
    """Every rank of the world is here and stopped: a deliberate stop of the whole job."""
    world = max((r.world_size for r in live), default=0)
    return bool(live) and len(live) >= world and all(r.state == "stopped" for r in live)


def advance(trace: PhaseTrace, obs: ClusterObs, cfg: PhaseBudgetConfig) -> PhaseTrace:
    """The trace after this pass: phases entered and left, durations kept, suspends seen."""
    current = dict(trace.current)
    durations = {job: dict(d) for job, d in trace.durations.items()}
    suspends = dict(trace.suspended_at)
    settled = dict(trace.settled_steps)
    for job in obs.jobs():
        restart, ranks = incarnation(obs, job)
        times = _settled_step_times(ranks, restart, cfg)
        if times:
            settled[job] = (restart, times)
        live = [r for r in ranks if r.state in LIVE_STATES]
        if suspended(live):
            suspends[job] = obs.time
        for r in ranks:
            if r.source != "telemetry":
                continue
            key = (job, r.rank)
            phase = rank_phase(r, restart)
            if r.state in DEAD_STATES or phase in (None, "done", "train"):
                current.pop(key, None)  # a death ends nothing normally; train has its own budget
                if phase == "train" and key in trace.current:
                    _left(trace.current[key], r, restart, obs, suspends.get(job), cfg,
                          durations.setdefault(job, {}))  # fmt: skip
                continue
            seen_at = obs.time - (r.heartbeat_age_seconds or 0.0)
            old = current.get(key)
            if old is None or (old[0], old[1]) != (restart, r.pid):
                current[key] = (restart, r.pid, phase, seen_at)
            elif old[2] != phase:
                _left(old, r, restart, obs, suspends.get(job), cfg, durations.setdefault(job, {}))
                current[key] = (restart, r.pid, phase, seen_at)
    # forget ranks no longer in view (their job ended, or they were forgotten)
    seen = {(r.job, r.rank) for r in obs.ranks()}
    current = {k: v for k, v in current.items() if k in seen}
    return PhaseTrace(
        current=current, durations=durations, suspended_at=suspends, settled_steps=settled
    )


def track_phases(history: History, obs: ClusterObs, cfg: DetectorConfig) -> History:
    """The hang detector's state after this pass (`History.phases`: `advance`)."""
    trace = advance(history.phases or PhaseTrace(), obs, cfg.hang.phases)
    return dataclasses.replace(history, phases=trace)


# Ranks read for an incarnation's step times: under DDP every rank takes each step's time,
# so a few stand for all, and a 1,000-rank job costs no more per pass than a small one.
SETTLED_RANKS_READ = 8
SETTLED_SAMPLES_KEPT = 128  # per job, for as long as the supervisor runs


def _settled_step_times(
    ranks: list[RankObs], restart: int, cfg: PhaseBudgetConfig
) -> tuple[float, ...]:
    """The incarnation's step times once a rank has shown `settled_steps`, else ()."""
    windows = [samples_of(r, restart) for r in ranks[:SETTLED_RANKS_READ]]
    if max(map(len, windows), default=0) < cfg.settled_steps:
        return ()
    return tuple(s.step_seconds for w in windows for s in w)[-SETTLED_SAMPLES_KEPT:]


def earlier_step_times(trace: PhaseTrace, job: str, restart: int) -> tuple[float, ...]:
    """The step times of the job's last settled incarnation before `restart`, or ()."""
    kept = trace.settled_steps.get(job)
    return kept[1] if kept is not None and kept[0] < restart else ()


def _left(
    old: tuple[int, int, str, float],
    r: RankObs,
    restart: int,
    obs: ClusterObs,
    suspended_at: float | None,
    cfg: PhaseBudgetConfig,
    into: dict[str, tuple[float, ...]],
) -> None:
    """Keep the duration of the phase the rank just left, if it left it normally: the same
    process, alive, and no suspend of the job in between (a stop is not the phase's time)."""
    o_restart, o_pid, o_phase, entered = old
    if (o_restart, o_pid) != (restart, r.pid) or r.state != "alive" or o_phase not in PHASES:
        return
    if suspended_at is not None and suspended_at >= entered:
        return
    left_at = obs.time - (r.heartbeat_age_seconds or 0.0)
    if left_at < entered:
        return
    into[o_phase] = (*into.get(o_phase, ()), left_at - entered)[-cfg.keep :]
