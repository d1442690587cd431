"""What the supervisor observes: one immutable picture of the cluster per poll.

Built from the agents' `/v1/node` and `/v1/ranks` JSON (see agent/api.py, agent/ranks.py).
Detectors and the policy read only these types, so they are testable from literal data.
Times are unix seconds as the agents report them; `observed_at` is the supervisor's clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

LIVE_STATES = frozenset({"alive", "stopped"})
DEAD_STATES = frozenset({"zombie", "exited"})  # "finished" is a clean exit, not a death


def _float(value: Any) -> float | None:
    """Agents send NaN/Infinity as strings (JSON has no such numbers)."""
    if value is None:
        return None
    if isinstance(value, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(value)
    return float(value)


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

    @classmethod
    def from_json(cls, d: dict) -> StepSample:
        return cls(
            step=int(d["step"]),
            phase=str(d.get("phase", "train")),
            restart=int(d.get("restart", 0)),
            step_seconds=_float(d.get("step_seconds")) or 0.0,
            compute_seconds=_float(d.get("compute_seconds")) or 0.0,
            comm_seconds=_float(d.get("comm_seconds")) or 0.0,
            data_wait_seconds=_float(d.get("data_wait_seconds")) or 0.0,
            loss=_float(d.get("loss")),
        )


@dataclass(frozen=True)
class RankObs:
    node: str
    job: str
    rank: int
    world_size: int
    pid: int
    restart: int
    state: str  # alive, stopped, zombie, exited, finished
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

    @property
    def key(self) -> tuple[str, int]:
        return (self.job, self.rank)

    @property
    def dead(self) -> bool:
        return self.state in DEAD_STATES

    @classmethod
    def from_json(cls, node: str, d: dict, recent: tuple[StepSample, ...] | None = None) -> RankObs:
        """`recent`: the rank's window merged from incremental reads (supervisor/windows.py)
        instead of the answer's own."""
        if recent is None:
            recent = tuple(StepSample.from_json(s) for s in d.get("recent") or ())
        return cls(
            node=node,
            job=str(d["job"]),
            rank=int(d["rank"]),
            world_size=int(d.get("world_size", 1)),
            pid=int(d.get("pid", 0)),
            restart=int(d.get("restart", 0)),
            state=str(d.get("state", "alive")),
            step=d.get("step"),
            phase=d.get("phase"),
            heartbeat_age_seconds=_float(d.get("heartbeat_age_seconds")),
            exited_at=_float(d.get("exited_at")),
            step_seconds=_float(d.get("step_seconds")),
            compute_seconds=_float(d.get("compute_seconds")),
            comm_seconds=_float(d.get("comm_seconds")),
            comm_compute_ratio=_float(d.get("comm_compute_ratio")),
            loss=_float(d.get("loss")),
            checkpoint_step=d.get("checkpoint_step"),
            cpu_utilization=_float(d.get("cpu_utilization")),
            recent=recent,
            source="process" if d.get("source") == "process" else "telemetry",
            state_since=_float(d.get("state_since")),
            cpu_active_at=_float(d.get("cpu_active_at")),
            **_stand_in(d.get("stand_in")),
        )


def _stand_in(d) -> dict:
    if not isinstance(d, dict) or not isinstance(d.get("pid"), int):
        return {}
    state = d.get("state")
    return {"stand_in_pid": d["pid"], "stand_in_state": state if isinstance(state, str) else None,
            "stand_in_since": _float(d.get("state_since"))}  # fmt: skip


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

    @classmethod
    def from_json(
        cls,
        url: str,
        node_json: dict,
        ranks_json: dict,
        observed_at: float,
        windows: dict[tuple[str, int], tuple[StepSample, ...]] | None = None,
    ) -> NodeObs:
        """`windows`: each rank's merged samples (an incremental read), else the answer's."""
        name = str(node_json.get("node") or url)
        w = windows or {}
        return cls(
            node=name,
            url=url,
            reachable=True,
            observed_at=observed_at,
            status=node_json.get("status"),
            reasons=tuple(node_json.get("reasons") or ()),
            ranks=tuple(
                RankObs.from_json(name, r, w.get((str(r["job"]), int(r["rank"]))))
                for r in ranks_json.get("ranks") or ()
            ),
        )

    def aged(self, now: float) -> NodeObs:
        """This answer seen at `now`: every heartbeat is older by the time since the answer
        (a node still answering shows its last answer; a hang must not hide behind it)."""
        late = now - self.observed_at
        if late <= 0 or not self.ranks:
            return self
        return replace(self, ranks=tuple(
            replace(r, heartbeat_age_seconds=r.heartbeat_age_seconds + late)
            if r.heartbeat_age_seconds is not None else r for r in self.ranks
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

    def ranks(self, job: str | None = None) -> list[RankObs]:
        out = [r for n in self.nodes for r in n.ranks]
        return [r for r in out if job is None or r.job == job]

    def jobs(self) -> list[str]:
        return sorted({r.job for r in self.ranks()})

    def current_ranks(self, job: str) -> list[RankObs]:
        """The newest incarnation's ranks of a job (highest restart count per rank)."""
        best: dict[int, RankObs] = {}
        for r in self.ranks(job):
            if r.rank not in best or (r.restart, r.pid) > (best[r.rank].restart, best[r.rank].pid):
                best[r.rank] = r
        return [best[k] for k in sorted(best)]
