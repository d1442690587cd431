"""RANK_HUNG: every live rank of a job stopped making progress for longer than its phase
normally takes, judged against this job's own step times (DESIGN: adaptive, quantile
based, with a floor).

With DDP every rank must finish a step's all-reduce before any starts the next, so one
hung rank stops them all; the culprit is the rank that has not reached the collective
the others wait in. Telemetry names it when it can (a stopped process, a lower step, a
rank spinning while the others sleep); otherwise the loop dumps every rank's stack and
asks `pick_culprit_from_stacks`.

No kill on missing evidence: a silent rank is not a stuck one when its records may be
getting lost. When the agent's telemetry socket shows pressure right now (quota refusals,
a full queue: `NodeObs.telemetry_pressure_age`) and the rank's process used CPU recently,
its silence proves nothing; when every overdue rank is such a rank, there is no finding.
A rank that is silent and idle, or silent on a quiet socket, is judged as before, so a
flood cannot hide a job whose ranks sleep in a collective behind one spinning rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..model import RANK_HUNG, Finding, History
from ..phase_budgets import (
    PHASES,
    START_ORDER,
    Budget,
    PhaseBudgetConfig,
    PhaseTrace,
    budget,
    earlier_step_times,
    rank_phase,
    suspended,
)
from ..state import DEAD_STATES, LIVE_STATES, ClusterObs, RankObs
from .common import (
    at_least,
    check_settings,
    gpu_note,
    incarnation,
    node_url,
    positive,
    quantile,
    samples_of,
)

if TYPE_CHECKING:
    from . import DetectorConfig


@dataclass(frozen=True)
class HangConfig:
    """[detectors.hang]: per-phase budgets learned from this job's own step times."""

    enabled: bool = True
    # 1 s: below it a scheduler hiccup on a loaded host looks like a hang; above it, the
    # job's own 10 x p99 step time decides (no hand-set timeout for real step times).
    floor_seconds: float = 1.0
    quantile: float = 0.99
    quantile_factor: float = 10.0
    min_samples: int = 5
    warmup_seconds: float = 60.0  # after the first step, before min_samples steps
    spin_cpu_cores: float = 0.5  # a culprit stuck busy in Python uses at least this
    idle_cpu_cores: float = 0.2  # ... while the others, asleep in the collective, stay below
    # the phases outside the loop: first-start budgets, learning, confirmation window
    phases: PhaseBudgetConfig = field(default_factory=PhaseBudgetConfig)

    def __post_init__(self) -> None:
        check_settings(self)
        at_least(self, min_samples=1)
        positive(self, "floor_seconds", "quantile_factor")
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], not {self.quantile}")
        if self.idle_cpu_cores >= self.spin_cpu_cores:
            raise ValueError("idle_cpu_cores must be below spin_cpu_cores")


# Frames of a rank that waits in (or on its way into) a collective, matched against
# function names of the main thread's frames in a py-spy dump.
# The socket's pressure must be this fresh, and the process's CPU activity too, for a
# silence to count as records lost rather than progress stopped.
PRESSURE_RECENT_SECONDS = 5.0
BUSY_RECENT_SECONDS = 5.0

COLLECTIVE_MARKERS = (
    "all_reduce",
    "allreduce",
    "backward",
    "_engine_run_backward",
    "barrier",
    "broadcast",
    "all_gather",
    "wait",
)


def detect(obs: ClusterObs, history: History, cfg: DetectorConfig) -> list[Finding]:
    trace = getattr(history, "phases", None) or PhaseTrace()
    out = []
    for job in obs.jobs():
        finding = _job_hang(obs, job, cfg, trace)
        if finding is not None:
            out.append(finding)
    return out


def train_budget(
    step_seconds: list[float], cfg: DetectorConfig, earlier: Sequence[float] = ()
) -> tuple[float, float | None]:
    """(budget of a training step, the quantile it came from). Until the job has shown
    a few steps, a generous warm-up budget covers compilation and first data loads.
    `earlier`: the step times of the job's last settled incarnation, while this one has
    not settled; its budget is then the larger of the two."""
    if len(step_seconds) < cfg.hang.min_samples:
        return cfg.hang.warmup_seconds, None
    q = quantile(step_seconds, cfg.hang.quantile)
    if earlier:
        q = max(q, quantile(earlier, cfg.hang.quantile))
    return max(cfg.hang.floor_seconds, cfg.hang.quantile_factor * q), q


def phase_budget(
    phase: str | None,
    train: float,
    cfg: DetectorConfig,
    trace: PhaseTrace | None = None,
    job: str = "",
    train_source: str = "steps",
) -> Budget:
    """The budget of a rank in `phase` (as `rank_phase` names it): learned from this job's
    past phases (phase_budgets.py), the step-time budget in `train` (from `train_source`)."""
    if phase == "done":
        return Budget("done", math.inf, "default")  # the job is ending; an exit tells the rest
    if phase not in PHASES:
        return Budget("train", train, train_source)
    b = budget(trace or PhaseTrace(), job, phase, cfg.hang.phases)
    if phase == "checkpoint_save" and b.source == "default" and train > b.seconds:
        return Budget(phase, train, b.source)  # no save shown yet: a slow job's save
    # Once saves were seen, their own durations decide: the step-time budget is 10 x the
    # p99 of steps that include the saves' blocking, so as a floor it hid the learned one
    # (a stuck save ran 15 s and more instead of 5 s before it was caught).
    return b


def _overdue(r: RankObs, budget: float, since_suspend: float) -> bool:
    # time the whole job spent suspended is not silence (a SIGCONT'ed rank reports soon)
    return (
        r.heartbeat_age_seconds is not None and min(r.heartbeat_age_seconds, since_suspend) > budget
    )


def _job_hang(obs: ClusterObs, job: str, cfg: DetectorConfig, trace: PhaseTrace) -> Finding | None:
    restart, ranks = incarnation(obs, job)
    if any(r.state in DEAD_STATES for r in ranks):
        return None  # a death explains the stop: the dead detector reports it
    if any(r.source == "process" for r in ranks):
        return None  # no steps to judge by: detectors/process_hang.py watches these
    live = [r for r in ranks if r.state in LIVE_STATES]
    if not live or suspended(live):
        return None  # a deliberate stop of the whole job (scheduler suspend) is not a hang
    at = trace.suspended_at.get(job)
    since_suspend = math.inf if at is None else max(0.0, obs.time - at)
    windows = [samples_of(r, restart) for r in ranks]
    step_seconds = [s.step_seconds for w in windows for s in w]
    settled = max(map(len, windows), default=0) >= cfg.hang.phases.settled_steps
    earlier = () if settled else earlier_step_times(trace, job, restart)
    train, q = train_budget(step_seconds, cfg, earlier)
    source = "earlier steps" if earlier and q is not None else "steps"
    phase_of = {r.rank: rank_phase(r, restart) for r in live}
    budgets = {r.rank: phase_budget(phase_of[r.rank], train, cfg, trace, job, source) for r in live}
    evidence = _evidence(obs, live, phase_of, cfg.hang.phases, since_suspend)
    if evidence is not None:
        culprit, reason, decided_by = evidence
        hung_phase = phase_of[culprit.rank]
    else:
        # A stopped rank is overdue by nature; the hang shows in the ranks that wait for it.
        judged = [r for r in live if r.state != "stopped"] or live
        if not all(_overdue(r, budgets[r.rank].seconds, since_suspend) for r in judged):
            return None
        pressure = {n.node: n.telemetry_pressure_age for n in obs.nodes}
        if all(records_lost_while_busy(obs.time, r, pressure.get(r.node)) for r in judged):
            return None  # missing evidence, not evidence of a hang
        culprit, reason = pick_culprit(live, cfg)
        decided_by = "budget"
        phases = [phase_of[r.rank] for r in judged]
        hung_phase = max(set(phases), key=lambda p: (phases.count(p), str(p)))
    behind: dict = {}
    if culprit is None:
        reason, behind = _behind_unreachable(obs, ranks) or (reason, {})
    steps = [r.step for r in live if r.step is not None]
    min_step = min(steps) if steps else None
    ages = [r.heartbeat_age_seconds for r in live if r.heartbeat_age_seconds is not None]
    quiet = min(min(ages) if ages else 0.0, since_suspend)
    phases = [r.phase for r in live]
    phase = max(set(phases), key=lambda p: (phases.count(p), str(p)))
    blame = f"culprit rank {culprit.rank} ({reason})" if culprit else f"no culprit yet: {reason}"
    deciding = budgets[culprit.rank] if culprit else _phase_budget_of(budgets, phase_of, hung_phase)
    if decided_by == "budget":
        why = f"every rank silent past its budget, {deciding.describe(cfg.hang.phases)}"
    else:
        why = f"{decided_by} for over {cfg.hang.phases.confirm_seconds:g}s (no budget needed)"
    gpu, gpu_clause = gpu_note(culprit)
    occurred = obs.time - quiet
    if decided_by == "stopped" and culprit is not None and culprit.state_since is not None:
        occurred = culprit.state_since
    return Finding(
        kind=RANK_HUNG,
        key=f"rank_hung:{job}:{restart}:{min_step}",
        severity="critical",
        summary=f"job {job} hung at step {min_step} in phase {hung_phase}: {why}; "
        f"no progress for {quiet:.1f}s; {blame}{gpu_clause}",
        job=job,
        node=culprit.node if culprit else None,
        rank=culprit.rank if culprit else None,
        occurred_at=occurred,
        evidence={
            "restart": restart,
            "phase": phase,
            "hung_phase": hung_phase,
            "decided_by": decided_by,
            "budget": deciding.to_json(),
            "budget_reason": deciding.describe(cfg.hang.phases),
            "budgets": {str(phase_of[r.rank]): budgets[r.rank].seconds for r in live},
            "train_budget_seconds": train,
            "step_seconds_quantile": cfg.hang.quantile,
            "p99_step_seconds": q,
            "sample_count": len(step_seconds),
            "earlier_sample_count": len(earlier),
            "heartbeat_ages": {str(r.rank): r.heartbeat_age_seconds for r in live},
            "steps": {str(r.rank): r.step for r in live},
            "states": {str(r.rank): r.state for r in live},
            "phases": {str(r.rank): r.phase for r in live},
            "cpu_utilization": {str(r.rank): r.cpu_utilization for r in live},
            "culprit_reason": reason,
            "stacks_needed": culprit is None and not behind,
            **_culprit_process(obs, culprit),
            **behind,
            **gpu,
        },
    )


def _phase_budget_of(budgets: dict, phase_of: dict, phase: str | None) -> Budget:
    return next(
        (budgets[k] for k, p in phase_of.items() if p == phase), next(iter(budgets.values()))
    )


def _evidence(
    obs: ClusterObs,
    live: list[RankObs],
    phase_of: dict[int, str | None],
    pcfg: PhaseBudgetConfig,
    since_suspend: float,
) -> tuple[RankObs, str, str] | None:
    """(culprit, reason, kind) when a rank is hung whatever its phase's budget:
    - stopped (T state) for the confirmation window while a peer is not (not a suspend);
    - idle behind its peers: every peer has reached a start-up phase it has not entered,
      and it has used no CPU and sent no record (a progress beat) for the window.
    Both wait out the window after the job was last seen suspended: a SIGCONT reaches
    the ranks one by one."""
    confirm = pcfg.confirm_seconds
    if since_suspend < confirm:
        return None
    stopped = [
        (obs.time - r.state_since, r)
        for r in live
        if r.state == "stopped"
        and r.state_since is not None
        and obs.time - r.state_since >= confirm
    ]
    if stopped:
        for_s, r = max(stopped, key=lambda x: (x[0], -x[1].rank))
        return (
            r,
            f"stopped (SIGSTOP, T state) for {for_s:.1f}s: the process cannot progress",
            "stopped",
        )
    world = max(r.world_size for r in live)
    if len(live) < 2 or len(live) < world:
        return None  # a peer out of view may be behind too
    # Only a rank alone at the earliest start-up phase, every peer's phase known and
    # later, can be behind them all: found in one pass (comparing each rank with every
    # peer was O(N^2), 60% of a pass at 1,024 ranks).
    orders = [START_ORDER.get(str(phase_of[r.rank])) for r in live]
    if None in orders:
        return None
    first = min(orders)
    if orders.count(first) != 1:
        return None
    for r, mine in zip(live, orders, strict=True):
        if mine != first:
            continue
        idle = None if r.cpu_active_at is None else obs.time - r.cpu_active_at
        silent = r.heartbeat_age_seconds
        if idle is None or silent is None or min(idle, silent) < confirm:
            continue
        return (
            r,
            (
                f"still in {phase_of[r.rank]} while every peer has moved past it, with no CPU "
                f"use for {idle:.1f}s and no record for {silent:.1f}s"
            ),
            "idle behind its peers",
        )
    return None


def records_lost_while_busy(now: float, r: RankObs, pressure_age: float | None) -> bool:
    """Whether a silent rank's records may be being dropped while its process works: its
    node's telemetry socket is under pressure now and the process used CPU recently."""
    if r.state != "alive" or pressure_age is None or r.cpu_active_at is None:
        return False
    return pressure_age < PRESSURE_RECENT_SECONDS and now - r.cpu_active_at < BUSY_RECENT_SECONDS


def _behind_unreachable(obs: ClusterObs, ranks: list[RankObs]) -> tuple[str, dict] | None:
    """A partition: the job's world is larger than the ranks in view, and an agent is
    unreachable. The missing ranks are where the others wait, and no agent can end them;
    ending a reachable rank instead makes torchrun re-form the job without them (an
    elastic job goes on at the smaller size, like after a node loss)."""
    world = max((r.world_size for r in ranks), default=0)
    unreachable = sorted(n.node for n in obs.nodes if not n.reachable)
    live = [r for r in ranks if r.state in LIVE_STATES and r.state != "stopped"]
    if world <= len(ranks) or not unreachable or not live:
        return None
    via = min(live, key=lambda r: r.rank)
    reason = (
        f"{world - len(ranks)} of {world} ranks out of view behind unreachable agent(s) "
        f"{', '.join(unreachable)}: restart the job without them"
    )
    return reason, {
        "missing_ranks": world - len(ranks),
        "unreachable_nodes": unreachable,
        "restart_via": {"rank": via.rank, "node": via.node, "pid": via.pid,
                        "node_url": node_url(obs, via.node)},
    }  # fmt: skip


def _culprit_process(obs: ClusterObs, culprit: RankObs | None) -> dict:
    """Where the culprit runs, so the policy can target exactly that process."""
    if culprit is None:
        return {}
    return {"pid": culprit.pid, "node_url": node_url(obs, culprit.node)}


def pick_culprit(live: list[RankObs], cfg: DetectorConfig) -> tuple[RankObs | None, str]:
    """The rank the others wait for, from telemetry alone, strongest evidence first."""
    stopped = [r for r in live if r.state == "stopped"]
    if stopped:
        return stopped[0], "stopped (SIGSTOP): the process cannot progress"
    if len(live) == 1:
        return live[0], "the only live rank: nobody else to wait for"
    lagging = _unique_lowest_step(live)
    if lagging is not None:
        return lagging, f"at step {lagging.step}, behind the step the others wait in"
    spinning = _cpu_outlier(live, cfg)
    if spinning is not None:
        return spinning, (
            f"busy at {spinning.cpu_utilization:.2f} cores while the others idle in the collective"
        )
    return None, "stacks needed: telemetry does not single out a rank"


def _unique_lowest_step(live: list[RankObs]) -> RankObs | None:
    known = [r for r in live if r.step is not None]
    if len(known) < 2:
        return None
    low = min(r.step for r in known)
    lowest = [r for r in known if r.step == low]
    return lowest[0] if len(lowest) == 1 else None


def _cpu_outlier(live: list[RankObs], cfg: DetectorConfig) -> RankObs | None:
    if any(r.cpu_utilization is None for r in live):
        return None  # without every rank's figure, "stands out" means nothing
    top = max(live, key=lambda r: r.cpu_utilization)
    others_idle = all(r.cpu_utilization < cfg.hang.idle_cpu_cores for r in live if r is not top)
    return top if top.cpu_utilization >= cfg.hang.spin_cpu_cores and others_idle else None


# -- stacks -----------------------------------------------------------------------------

_THREAD = re.compile(r'^Thread \S+ \(([^)]*)\): "(?P<name>[^"]*)"')


def main_thread_functions(dump: str) -> list[str]:
    """Function names of the main thread's frames in a `py-spy dump` text (all threads'
    frames when the dump names no threads). Other threads (checkpoint writers, data
    loaders, threading's own waits) must not make an idle main thread look busy in a
    collective, so only the main thread counts."""
    blocks = thread_functions(dump)
    if "MainThread" in blocks:
        return blocks["MainThread"]
    return [f for frames in blocks.values() for f in frames]


def thread_functions(dump: str) -> dict[str, list[str]]:
    """{thread name: function names of its frames} of a `py-spy dump` ("" when the dump
    names no threads)."""
    blocks: dict[str, list[str]] = {}
    current: str | None = "" if "Thread " not in dump else None
    for line in dump.splitlines():
        header = _THREAD.match(line.strip())
        if header:
            current = header.group("name")
            blocks.setdefault(current, [])
            continue
        # frames are indented "function (file:line)" lines under a thread header
        if current is not None and line.startswith((" ", "\t")) and " (" in line:
            blocks.setdefault(current, []).append(line.strip().split(" (", 1)[0])
    return blocks


def _waits_in_collective(functions: list[str]) -> bool:
    return any(m in f.lower() for f in functions for m in COLLECTIVE_MARKERS)


def pick_culprit_from_stacks(stacks: dict[int, str]) -> int | None:
    """The single rank whose main thread is NOT in a collective while every other rank's
    is; None when that is not clear-cut (several such ranks, none, or an unreadable
    dump: blaming the wrong rank is worse than saying we do not know)."""
    outside = []
    for rank, dump in stacks.items():
        functions = main_thread_functions(dump or "")
        if not functions:
            return None  # no frames: the dump failed, nothing can be said about this rank
        if not _waits_in_collective(functions):
            outside.append(rank)
    if len(outside) == 1:
        return outside[0]
    return _save_thread_culprit(stacks) if not outside else None


# The trainer's background save threads (trainer/checkpoint.py's executor).
SAVE_THREAD_PREFIX = "rankguard-ckpt"


def _save_thread_culprit(stacks: dict[int, str]) -> int | None:
    """Every main thread waits (a save the trainer waits for, say): the rank whose save
    thread is not in the checkpoint group's collective while every other rank's is, is the
    one the save waits for (a write stuck on slow storage)."""
    outside = []
    for rank, dump in stacks.items():
        saves = [f for name, fs in thread_functions(dump or "").items()
                 if name.startswith(SAVE_THREAD_PREFIX) for f in fs]  # fmt: skip
        if not saves:
            return None
        if not _waits_in_collective(saves):
            outside.append(rank)
    return outside[0] if len(outside) == 1 else None
