"""What the supervisor observes: one immutable picture of the cluster per poll.

Built from the agents' `/v1/node` and `/v1/ranks` answers, read through the contract's
models (contract/answers.py), which have already checked every field's type.
Detectors and the policy read only these types, so they are testable from literal data.
Times are unix seconds as the agents report them; `observed_at` is the supervisor's clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from ..contract.answers import (
    CollectiveAnswer,
    MainThreadAnswer,
    NodeAnswer,
    RankAnswer,
    RankGpuAnswer,
    RanksAnswer,
    Sample,
)
from ..contract.states import DEAD_STATES, LIVE_STATES

__all__ = ["DEAD_STATES", "LIVE_STATES", "ClusterObs", "NodeObs", "RankObs", "StepSample"]


@dataclass(frozen=True)
class StepSample:
    step: int
    phase: str
    restart: int
    step_seconds: float
    compute_seconds: float
    comm_seconds: float
    data_wait_seconds: float
    loss: float | None
    # of compute, the run-queue wait (preempted, not working); None: unknown
    compute_wait_seconds: float | None = None

    @classmethod
    def of(cls, s: Sample) -> StepSample:
        return cls(s.step, s.phase, s.restart, s.step_seconds, s.compute_seconds,
                   s.comm_seconds, s.data_wait_seconds, s.loss,
                   s.compute_wait_seconds)  # fmt: skip


@dataclass(frozen=True)
class RankObs:
    node: str
    job: str
    rank: int
    world_size: int
    pid: int
    restart: int
    state: str  # contract/states.py: alive, stopped, zombie, exited, finished
    step: int | None
    phase: str | None
    heartbeat_age_seconds: float | None
    exited_at: float | None
    step_seconds: float | None
    compute_seconds: float | None
    comm_seconds: float | None
    comm_compute_ratio: float | None
    loss: float | None
    checkpoint_step: int | None
    cpu_utilization: float | None
    recent: tuple[StepSample, ...] = ()
    # "telemetry" (the rank reports steps) or "process" (a torchrun worker the agent found
    # in /proc: no steps; judged by process state and CPU progress)
    source: str = "telemetry"
    state_since: float | None = None  # when the agent saw the process state change
    cpu_active_at: float | None = None  # when the process last used CPU (agent's window)
    # the process torchrun watches in place of this rank (a warm-start shim), if any:
    # alive, stopped or gone, and since when (agent/stand_ins.py)
    stand_in_pid: int | None = None
    stand_in_state: str | None = None
    stand_in_since: float | None = None
    # data steps this incarnation's resume skipped (a loss spike's window), as ranges
    resume_skips: tuple[tuple[int, int], ...] = ()
    # the GPU it computes on and that GPU's faults, as its agent saw them (None: unknown)
    gpu: RankGpuAnswer | None = None
    # its main thread's own state, run time and where it sleeps (None: an older agent, or
    # unreadable): on NCCL the process's CPU says nothing (detectors/hang.py)
    main_thread: MainThreadAnswer | None = None
    # its flight recorder's wavefront (each process group's last enqueued and completed
    # collective), sent while it stalls, and how old that is (aged like the heartbeat);
    # () and None when it sent none (supervisor/wavefront.py)
    collectives: tuple[CollectiveAnswer, ...] = ()
    collectives_age_seconds: float | None = None
    exit_code: int | None = None  # its waitpid status, when the agent read it (a zombie)
    # a zero-code worker's optimizer step, counted by its watch (None: a telemetry rank,
    # whose `step` is its own, or not known)
    script_step: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.job, self.rank)

    @property
    def dead(self) -> bool:
        return self.state in DEAD_STATES

    @classmethod
    def of(cls, node: str, a: RankAnswer, recent: tuple[StepSample, ...] | None = None) -> RankObs:
        """`recent`: the rank's window merged from incremental reads (supervisor/windows.py)
        instead of the answer's own."""
        if recent is None:
            recent = tuple(StepSample.of(s) for s in a.recent)
        shim = a.stand_in
        return cls(
            node=node, job=a.job, rank=a.rank, world_size=a.world_size, pid=a.pid,
            restart=a.restart, state=a.state, step=a.step, phase=a.phase,
            heartbeat_age_seconds=a.heartbeat_age_seconds, exited_at=a.exited_at,
            step_seconds=a.step_seconds, compute_seconds=a.compute_seconds,
            comm_seconds=a.comm_seconds, comm_compute_ratio=a.comm_compute_ratio, loss=a.loss,
            checkpoint_step=a.checkpoint_step, cpu_utilization=a.cpu_utilization,
            recent=recent, source=a.source, state_since=a.state_since,
            cpu_active_at=a.cpu_active_at, stand_in_pid=shim.pid if shim else None,
            stand_in_state=shim.state if shim else None,
            stand_in_since=shim.state_since if shim else None, resume_skips=a.resume_skips,
            gpu=a.gpu, main_thread=a.main_thread, collectives=a.collectives,
            collectives_age_seconds=a.collectives_age_seconds, exit_code=a.exit_code,
            script_step=a.script_step,
        )  # fmt: skip


def _aged_rank(r: RankObs, late: float) -> RankObs:
    """The rank `late` seconds older (its heartbeat and its wavefront): dataclasses.replace
    without its per-field overhead, as every rank of every node is aged on every pass (80 ms
    a pass at 8,192 ranks)."""
    new = object.__new__(RankObs)
    new.__dict__.update(r.__dict__, heartbeat_age_seconds=r.heartbeat_age_seconds + late)
    if r.collectives_age_seconds is not None:
        new.__dict__["collectives_age_seconds"] = r.collectives_age_seconds + late
    return new


@dataclass(frozen=True)
class NodeObs:
    node: str
    url: str
    reachable: bool
    observed_at: float
    error: str | None = None
    status: str | None = None  # the agent's verdict: healthy, degraded, unhealthy
    reasons: tuple[dict, ...] = ()
    ranks: tuple[RankObs, ...] = ()
    # seconds since the agent's telemetry socket last showed lost records (quota refusals,
    # a full queue), None for never: a silent rank there may be a busy one whose records
    # were dropped (detectors/hang.py)
    telemetry_pressure_age: float | None = None

    @classmethod
    def of(
        cls,
        url: str,
        node: NodeAnswer,
        ranks: RanksAnswer,
        observed_at: float,
        windows: dict[tuple[str, int], tuple[StepSample, ...]] | None = None,
    ) -> NodeObs:
        """`windows`: each rank's merged samples (an incremental read), else the answer's."""
        name = node.node or url
        w = windows or {}
        return cls(
            node=name,
            url=url,
            reachable=True,
            observed_at=observed_at,
            status=node.status,
            reasons=tuple(r.to_json() for r in node.reasons),
            ranks=tuple(RankObs.of(name, r, w.get((r.job, r.rank))) for r in ranks.ranks),
            telemetry_pressure_age=None
            if ranks.telemetry.pressure_at is None
            else max(0.0, ranks.time - ranks.telemetry.pressure_at),
        )

    def aged(self, now: float) -> NodeObs:
        """This answer seen at `now`: every heartbeat is older by the time since the answer
        (a node still answering shows its last answer; a hang must not hide behind it)."""
        late = now - self.observed_at
        if late <= 0 or not self.ranks:
            return self
        pressure = self.telemetry_pressure_age
        return replace(self, telemetry_pressure_age=None if pressure is None else pressure + late,
                       ranks=tuple(
            _aged_rank(r, late) if r.heartbeat_age_seconds is not None else r
            for r in self.ranks
        ))  # fmt: skip

    @classmethod
    def unreachable(
        cls, url: str, error: str, observed_at: float, node: str | None = None
    ) -> NodeObs:
        return cls(node=node or url, url=url, reachable=False, observed_at=observed_at, error=error)


@dataclass(frozen=True)
class ClusterObs:
    time: float
    nodes: tuple[NodeObs, ...] = field(default_factory=tuple)

    # An observation is immutable and read by every detector, the recording and the HTTP
    # views, each asking for a job's ranks: at 8,192 ranks the scans were an eighth of the
    # supervisor's CPU (bench/results/supervisor_scale.md), so each is built once per
    # observation. Callers get a copy of the lists and must not mutate the ranks' tuple.
    @cached_property
    def _by_job(self) -> dict[str, list[RankObs]]:
        out: dict[str, list[RankObs]] = {}
        for n in self.nodes:
            for r in n.ranks:
                out.setdefault(r.job, []).append(r)
        return out

    @cached_property
    def _current(self) -> dict[str, list[RankObs]]:
        """Each job's newest incarnation's ranks (highest restart count per rank)."""
        out = {}
        for job, ranks in self._by_job.items():
            best: dict[int, RankObs] = {}
            for r in ranks:
                b = best.get(r.rank)
                if b is None or (r.restart, r.pid) > (b.restart, b.pid):
                    best[r.rank] = r
            out[job] = [best[k] for k in sorted(best)]
        return out

    def ranks(self, job: str | None = None) -> list[RankObs]:
        if job is None:
            return [r for n in self.nodes for r in n.ranks]
        return list(self._by_job.get(job, ()))

    def jobs(self) -> list[str]:
        return sorted(self._by_job)

    def newest_restarts(self) -> dict[str, int]:
        """Each job's newest incarnation in view (its highest restart count)."""
        return {job: max(r.restart for r in ranks) for job, ranks in self._by_job.items()}

    def current_ranks(self, job: str) -> list[RankObs]:
        """The newest incarnation's ranks of a job (highest restart count per rank)."""
        return list(self._current.get(job, ()))
