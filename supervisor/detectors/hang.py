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
a full queue: `NodeObs.telemetry_pressure_age`) and the rank's main thread ran recently
(its own run time: NCCL's proxy and watchdog threads keep the process's CPU up while it
waits), its silence proves nothing; when every overdue rank is such a rank, there is no
finding.
A rank that is silent and idle, or silent on a quiet socket, is judged as before, so a
flood cannot hide a job whose ranks sleep in a collective behind one spinning rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ...contract.telemetry import STALL_WATCH_THREAD
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
    track_phases,
)
from ..state import DEAD_STATES, LIVE_STATES, ClusterObs, RankObs
from ..wavefront import BEHIND, DESYNC, Wavefront, fresh, read_wavefront
from .common import (
    at_least,
    check_settings,
    gpu_note,
    hang_finding,
    incarnation,
    node_url,
    positive,
    quantile,
    restart_via,
    samples_of,
)
from .registration import Detector

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


# The socket's pressure must be this fresh, and the main thread's CPU activity too, for a
# silence to count as records lost rather than progress stopped.
PRESSURE_RECENT_SECONDS = 5.0
WATCHDOG_SHARE = 0.5  # of the job's collective timeout: the most a hang budget may be
SURVIVORS = "survivors of a death"  # decided_by of a hang behind a dead rank
BUSY_RECENT_SECONDS = 5.0


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


def under_watchdog(budgets: dict[int, Budget], live: list[RankObs]) -> dict[int, Budget]:
    """The budgets kept below the job's own collective timeout, which the ranks' wavefronts
    carry: past it, NCCL's watchdog aborts the waiting ranks (a victim dies first, the
    culprit is harder to name), so rankguard must decide by WATCHDOG_SHARE of it."""
    timeouts = [c.timeout_s for r in live if fresh(r) for c in r.collectives if c.timeout_s]
    if not timeouts:
        return budgets
    watchdog = min(timeouts)
    cap = WATCHDOG_SHARE * watchdog
    return {
        rank: b if b.seconds <= cap else Budget(b.phase, cap, "watchdog", watchdog_seconds=watchdog)
        for rank, b in budgets.items()
    }


def _overdue(r: RankObs, budget: float, since_suspend: float) -> bool:
    # time the whole job spent suspended is not silence (a SIGCONT'ed rank reports soon)
    return (
        r.heartbeat_age_seconds is not None and min(r.heartbeat_age_seconds, since_suspend) > budget
    )


def _job_hang(obs: ClusterObs, job: str, cfg: DetectorConfig, trace: PhaseTrace) -> Finding | None:
    restart, ranks = incarnation(obs, job)
    dead = [r for r in ranks if r.state in DEAD_STATES]
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
    budgets = under_watchdog(budgets, live)
    behind: dict = {}
    wave = None
    if dead:  # a death explains the stop (the dead detector reports it), unless it lasts
        survivors = _survivors_of(obs, dead, live, budgets, since_suspend)
        if survivors is None:
            return None
        culprit, decided_by, (reason, behind) = None, SURVIVORS, survivors
        hung_phase = phase_of[behind["restart_via"]["rank"]]
    elif (evidence := _evidence(obs, live, phase_of, cfg.hang.phases, since_suspend)) is not None:
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
        # Behind a partition the ranks out of view cannot be compared: a lower step or a
        # flight-recorder wavefront among the ranks in view names the wrong one.
        partition = (
            None if any(r.state == "stopped" for r in live) else _behind_unreachable(obs, ranks)
        )
        if partition is not None:
            culprit, (reason, behind) = None, partition
        else:
            culprit, reason = pick_culprit(live, cfg, wave := read_wavefront(live))
        decided_by = "budget"
        phases = [phase_of[r.rank] for r in judged]
        hung_phase = max(set(phases), key=lambda p: (phases.count(p), str(p)))
    if culprit is None and not behind:
        reason, behind = _behind_unreachable(obs, ranks) or (reason, {})
    if wave is not None:
        behind["wavefront"] = wave.to_json()
        if wave.verdict == DESYNC:
            behind["desync"] = True  # a code bug: the policy stops the job with a verdict
        if culprit is None and not behind.get("restart_via"):
            # a desync of two (which side is wrong cannot be told), below the ranks, or a
            # chain with no end in view: nothing blames one rank; the stacks may still,
            # else the job restarts (_refine), but for a desync, which stops it
            reason = f"flight recorder: {wave.detail}"
    steps = [r.step for r in live if r.step is not None]
    min_step = min(steps) if steps else None
    ages = [r.heartbeat_age_seconds for r in live if r.heartbeat_age_seconds is not None]
    quiet = min(min(ages) if ages else 0.0, since_suspend)
    phases = [r.phase for r in live]
    phase = max(set(phases), key=lambda p: (phases.count(p), str(p)))
    blame = f"culprit rank {culprit.rank} ({reason})" if culprit else f"no culprit yet: {reason}"
    if behind.get("desync"):
        blame = f"desync, a code bug: {reason}"
    deciding = budgets[culprit.rank] if culprit else _phase_budget_of(budgets, phase_of, hung_phase)
    if decided_by in ("budget", SURVIVORS):
        who = "every rank" if decided_by == "budget" else "every live rank after a death"
        why = f"{who} silent past its budget, {deciding.describe(cfg.hang.phases)}"
        blame = reason if decided_by == SURVIVORS else blame
    else:
        why = f"{decided_by} for over {cfg.hang.phases.confirm_seconds:g}s (no budget needed)"
    gpu, gpu_clause = gpu_note(culprit)
    occurred = obs.time - quiet
    if decided_by == "stopped" and culprit is not None and culprit.state_since is not None:
        occurred = culprit.state_since
    return hang_finding(
        job,
        f"{restart}:{min_step}",
        culprit,
        summary=f"job {job} hung at step {min_step} in phase {hung_phase}: {why}; "
        f"no progress for {quiet:.1f}s; {blame}{gpu_clause}",
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
            # the main threads' own state: where a waiting or stuck rank sleeps, or spins
            "main_threads": {
                str(r.rank): r.main_thread.to_json() for r in live if r.main_thread is not None
            },
            "culprit_reason": reason,
            "stacks_needed": culprit is None and not ({"restart_via", "desync"} & behind.keys()),
            **_culprit_process(obs, culprit),
            **behind,
            **gpu,
        },
    )


def _phase_budget_of(budgets: dict, phase_of: dict, phase: str | None) -> Budget:
    return next(
        (budgets[k] for k, p in phase_of.items() if p == phase), next(iter(budgets.values()))
    )


def _survivors_of(
    obs: ClusterObs,
    dead: list[RankObs],
    live: list[RankObs],
    budgets: dict[int, Budget],
    since_suspend: float,
) -> tuple[str, dict] | None:
    """A rank died and the live ranks of its incarnation are stuck waiting for it. On gloo
    they fail their collective within milliseconds and torchrun re-forms the job; on NCCL
    they spin until the watchdog's timeout (10 minutes by default), and a survivor whose
    node's launcher was stopped (an excluded node) can leave them waiting for good. Once
    the latest death is older than the survivors' budget and every survivor is silent past
    its own, ending one (the lowest rank: `restart_via`, as for a partition) makes its
    torchrun re-form the job, with the crash-loop guard and the restart budget applying as
    to any restart. The culprit is the dead rank, already reported; none is named here."""
    died_at = [r.state_since for r in dead if r.state_since is not None]
    judged = [r for r in live if r.state != "stopped"]
    if not died_at or not judged:
        return None
    since_death = obs.time - max(died_at)
    if since_death < max(budgets[r.rank].seconds for r in judged):
        return None
    if not all(_overdue(r, budgets[r.rank].seconds, since_suspend) for r in judged):
        return None
    via = restart_via(obs, judged)
    names = ", ".join(str(r.rank) for r in sorted(dead, key=lambda r: r.rank))
    reason = (
        f"waiting for dead rank(s) {names} for {since_death:.1f}s: restart the job through "
        f"rank {via['rank']}"
    )
    return reason, {"dead_ranks": sorted(r.rank for r in dead), "restart_via": via}


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
    """Whether a silent rank's records may be being dropped while it works: its node's
    telemetry socket is under pressure now and its main thread ran recently."""
    if r.state != "alive" or pressure_age is None:
        return False
    return pressure_age < PRESSURE_RECENT_SECONDS and main_thread_busy(now, r)


def main_thread_busy(now: float, r: RankObs) -> bool:
    """Whether the rank's own work used CPU in the last BUSY_RECENT_SECONDS: its main
    thread's run time, not the process's CPU, which NCCL's proxy and watchdog threads (and
    gloo's loop, a loader, a saver) keep up while the main thread waits. The process's CPU
    only where the agent does not read the main thread (an older one). A main thread that
    spins in a CUDA sync still counts: to the kernel it runs like one at work (no wchan,
    syscall "running"); only its stack tells them apart, read once a hang is found."""
    main = r.main_thread
    active_at = main.active_at if main is not None else r.cpu_active_at
    return active_at is not None and now - active_at < BUSY_RECENT_SECONDS


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
    reason = (
        f"{world - len(ranks)} of {world} ranks out of view behind unreachable agent(s) "
        f"{', '.join(unreachable)}: restart the job without them"
    )
    return reason, {"missing_ranks": world - len(ranks), "unreachable_nodes": unreachable,
                    "restart_via": restart_via(obs, live)}  # fmt: skip


def _culprit_process(obs: ClusterObs, culprit: RankObs | None) -> dict:
    """Where the culprit runs, so the policy can target exactly that process."""
    if culprit is None:
        return {}
    return {"pid": culprit.pid, "node_url": node_url(obs, culprit.node)}


def pick_culprit(
    live: list[RankObs], cfg: DetectorConfig, wave: Wavefront | None = None
) -> tuple[RankObs | None, str]:
    """The rank the others wait for, from telemetry alone, strongest evidence first: a
    stopped process, the flight recorders' wavefront (one rank behind in a group and
    waiting in none), a lower step, a rank busy while the others idle."""
    stopped = [r for r in live if r.state == "stopped"]
    if stopped:
        return stopped[0], "stopped (SIGSTOP): the process cannot progress"
    if len(live) == 1:
        return live[0], "the only live rank: nobody else to wait for"
    if wave is not None and wave.verdict in (BEHIND, DESYNC) and len(wave.ranks) == 1:
        (rank,) = wave.ranks
        return next(r for r in live if r.rank == rank), f"flight recorder: {wave.detail}"
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
    # With two ranks "the busy one" is ambiguous: on NCCL (or `--wait-mode spin`) the
    # waiter spins while the culprit may sleep. With more, a lone busy rank among idle
    # ones is still the one stuck at work: NCCL waiters would be busy too.
    if len(live) < 3 or any(r.cpu_utilization is None for r in live):
        return None  # without every rank's figure, "stands out" means nothing
    top = max(live, key=lambda r: r.cpu_utilization)
    others_idle = all(r.cpu_utilization < cfg.hang.idle_cpu_cores for r in live if r is not top)
    return top if top.cpu_utilization >= cfg.hang.spin_cpu_cores and others_idle else None


# -- stacks -----------------------------------------------------------------------------
#
# A rank's main thread is judged by its innermost frame that says where it is, from the
# file a frame is in (py-spy names a Python frame's file by its package path), never from
# a bare function name: "wait" is as much a DataLoader's `multiprocessing.connection.wait`,
# the most common real culprit, as a collective's `Work.wait`.
# - waiting (in, or on its way into, a collective): a Python frame under torch/distributed
#   (but DCP's file I/O) or torch/autograd (DDP's all-reduce runs inside backward); a
#   CUDA sync (a `synchronize` under torch/cuda, or natively cuda*/cu*Synchronize: on NCCL
#   a waiting rank spins there, in `.item()` or in rankguard's clock); native NCCL, c10d
#   (ProcessGroupNCCL/Gloo, Work::wait), gloo or autograd-engine frames. rankguard's own
#   clock (client/timing.py) reads CUDA events while the rank is in a collective: it
#   waits too, so that timing a peer never makes it look outside.
# - behind its own thread: waiting for a Future (concurrent/futures; the trainer waiting
#   for its save): not blamed itself; the save threads decide (_save_thread_culprit).
# - outside: any other Python frame: user code or a library at work, a DataLoader waiting
#   for its workers (torch/utils/data, multiprocessing, queue), a stuck C call under the
#   user's frame. A wait passes through frames that say nothing: native ones that match
#   none of the above, threading's and selectors' plumbing; a thread with nothing else is
#   outside too. The innermost frame that decides wins, so that a wrapper further out (an
#   FSDP module around a layer stuck computing, elastic's @record around main) does not
#   make a stuck rank look like a waiting one.

WAITING, OUTSIDE, OWN_THREAD = "waiting", "outside", "own_thread"

_WAIT_FILES = ("torch/distributed/", "torch/autograd/")
_NOT_WAIT_FILES = ("torch/distributed/checkpoint/",)  # DCP: its collectives go through c10d
_OWN_THREAD_FILES = ("concurrent/futures/_base.py",)  # Future.result, wait: not the workers
_PLUMBING = ("threading.py", "selectors.py")  # what a wait passes through, saying nothing
_CLOCK_FILE = "client/timing.py"  # rankguard's clock (Clock.seconds: Event.synchronize)
# The CPU stand-in for a CUDA sync (the trainer's `--wait-mode spin`): a Python frame where
# a real NCCL waiter shows a native cudaStreamSynchronize one.
_SPIN_WAIT_FILE = "trainer/spin_wait.py"
_NATIVE_WAIT = re.compile(
    r"cu(?:da)?(?:Stream|Device|Ctx|Event)Synchronize"
    r"|c10::cuda::(?:memcpy_and_sync|device_synchronize|stream_synchronize)"
    r"|^p?nccl[A-Z]|\bc10d::|\bgloo::|\btorch::autograd::"
)
_THREAD = re.compile(r'^Thread (?P<tid>\S+) \([^)]*\)(?:: "(?P<name>[^"]*)")?')
_PROCESS = re.compile(r"^Process (?P<pid>\d+):")


class Frame(NamedTuple):
    """One frame of a py-spy dump: `function (file:line)` for Python, `function (library)`
    or `function (file.cc:line)` for a native one (`--native`)."""

    function: str
    file: str  # without the line number

    @property
    def native(self) -> bool:
        return not self.file.endswith(".py")


def _in(file: str, prefixes: tuple[str, ...]) -> bool:
    """Whether `file` (a package path, or a full one) lies under one of `prefixes`."""
    return any(file.startswith(p) or f"/{p}" in file for p in prefixes)


def frame_kind(frame: Frame) -> str | None:
    """WAITING, OWN_THREAD or OUTSIDE, or None for a frame that says nothing (above)."""
    if frame.native:
        return WAITING if _NATIVE_WAIT.search(frame.function) else None
    file = frame.file
    if _in(file, _NOT_WAIT_FILES):
        return OUTSIDE
    if _in(file, _WAIT_FILES) or file.endswith((_CLOCK_FILE, _SPIN_WAIT_FILE)):
        return WAITING
    if _in(file, ("torch/cuda/",)) and frame.function.endswith("synchronize"):
        return WAITING
    if _in(file, _OWN_THREAD_FILES):
        return OWN_THREAD
    return None if _in(file, _PLUMBING) else OUTSIDE


def thread_verdict(frames: Sequence[Frame]) -> str:
    """Where a thread is, from its innermost frame that says (py-spy lists innermost
    first); OUTSIDE when none does."""
    return next((k for f in frames if (k := frame_kind(f)) is not None), OUTSIDE)


def main_thread_frames(dump: str) -> list[Frame]:
    """The main thread's frames in a `py-spy dump` text (all threads' frames when the dump
    names no threads). Other threads (checkpoint writers, data loaders, threading's own
    waits) must not make an idle main thread look busy in a collective, so only the main
    thread counts."""
    blocks = thread_frames(dump)
    if "MainThread" in blocks:
        return blocks["MainThread"]
    return [f for frames in blocks.values() for f in frames]


def thread_frames(dump: str) -> dict[str, list[Frame]]:
    """{thread name: its frames, innermost first} of a `py-spy dump` ("" when the dump
    names no threads). py-spy names no thread of a process that never imported threading:
    the one whose id is the process's is "MainThread", the others "Thread <id>"."""
    blocks: dict[str, list[Frame]] = {}
    current: str | None = "" if "Thread " not in dump else None
    pid = None
    for line in dump.splitlines():
        if pid is None and (process := _PROCESS.match(line)):
            pid = process.group("pid")
        header = _THREAD.match(line.strip())
        if header:
            tid, current = header.group("tid"), header.group("name")
            if current is None:
                current = "MainThread" if tid == pid else f"Thread {tid}"
            blocks.setdefault(current, [])
            continue
        # frames are indented "function (file:line)" lines under a thread header; a native
        # function's name may hold " (" itself (a template argument): the file is the last
        text = line.strip()
        if current is None or not line.startswith((" ", "\t")) or not text.endswith(")"):
            continue
        function, sep, where = text[:-1].rpartition(" (")
        if sep:
            file = where.rsplit(":", 1)[0] if where.rpartition(":")[2].isdigit() else where
            blocks.setdefault(current, []).append(Frame(function, file))
    return blocks


def pick_culprit_from_stacks(stacks: dict[int, str]) -> int | None:
    """The single rank whose main thread is outside a collective while every other rank's
    waits in one (or behind its own save thread); None when that is not clear-cut (several
    such ranks, none, or an unreadable dump: blaming the wrong rank is worse than saying we
    do not know)."""
    outside = []
    for rank, dump in stacks.items():
        frames = main_thread_frames(dump or "")
        if not frames:
            return None  # no frames: the dump failed, nothing can be said about this rank
        if thread_verdict(frames) == OUTSIDE:
            outside.append(rank)
    if len(outside) == 1:
        return outside[0]
    return _save_thread_culprit(stacks) if not outside else None


# The trainer's background save threads (trainer/checkpoint.py's executor).
SAVE_THREAD_PREFIX = "rankguard-ckpt"


def _save_thread_culprit(stacks: dict[int, str]) -> int | None:
    """Every main thread waits (a save the trainer waits for, say): the rank whose save
    thread is outside the checkpoint group's collective while every other rank's waits in
    it, is the one the save waits for (a write stuck on slow storage)."""
    outside = []
    for rank, dump in stacks.items():
        saves = [fs for name, fs in thread_frames(dump or "").items()
                 if name.startswith(SAVE_THREAD_PREFIX) and fs]  # fmt: skip
        if not saves:
            return None
        if all(thread_verdict(fs) == OUTSIDE for fs in saves):
            outside.append(rank)
    return outside[0] if len(outside) == 1 else None


# How long past its stall a rank with a stall watch is given for its wavefront to arrive,
# beyond twice the job's p99 step (a loaded host delays the watch and the agent's drain).
WAVEFRONT_WAIT_SECONDS = 5.0


def wavefront_awaited(stacks: dict[int, str], evidence: dict, stalled_for: float) -> bool:
    """Whether a hang the stacks name no culprit for should wait for the flight recorders
    before the job restarts: no wavefront read yet, a rank runs a stall watch that sends
    one, and the stall is young. A desync restarted on the stacks alone would repeat."""
    if "wavefront" in evidence:
        return False
    wait = WAVEFRONT_WAIT_SECONDS + 2 * (evidence.get("p99_step_seconds") or 0.0)
    if stalled_for >= wait:
        return False
    return any(STALL_WATCH_THREAD in thread_frames(dump or "") for dump in stacks.values())


DETECTOR = Detector("hang", RANK_HUNG, HangConfig, detect, track=track_phases)
