"""The decision: a pure function from findings and what the incident store knows to actions.

`decide(findings, view, cfg, now)` does no I/O and reads no clock, so every rule is tested
from literal data. The loop builds the `PolicyView` from the store (`store.build_view`),
calls `decide` on every pass with the findings the detectors still report, and carries out
the decisions. Like a Kubernetes reconcile it is level based: a fault that is still there is
decided again on the next pass, and one whose incident already has an action is not acted
on twice (it gets no decision at all), so calling `decide` twice acts once.

Rules, per finding kind:

- RANK_DEAD: none, torchrun restarts the worker group by itself (crash-loop guard aside).
- RANK_HUNG: kill the culprit (the rank that never reached the collective the others wait
  in). A desync (the flight recorders show ranks at the same collective with a different
  operation or size: `evidence["desync"]`) stops the job with a verdict instead. When the missing ranks sit behind an unreachable agent (a partition), kill a
  reachable rank (`evidence["restart_via"]`): torchrun then re-forms the job without the
  cut-off node. Without a culprit the decision is ACT_NONE "culprit unknown: capture stacks": the
  loop captures the stacks of the job's ranks, re-runs culprit selection, and calls
  `decide` again with the refined finding (same key, `evidence["culprit"]` filled in).
- BAD_NUMERICS: kill a rank (the finding's, else rank 0) so torchrun restarts the group and
  the trainer resumes from its newest validated checkpoint. The trainer never validates a
  checkpoint holding a non-finite loss, so for NaN/Inf that checkpoint predates the anomaly.
  Known limitation: a *finite* loss spike may already be inside the newest checkpoint (the
  trainer validates files, not loss values), so a spike at or before the newest checkpoint
  step is only reported.
- STRAGGLER: reported; its node is excluded only if `cfg.exclude_stragglers`.
- NODE_FAULT: a critical hardware fault (`evidence["hardware"]`) excludes the node; other
  node faults (disk, memory pressure, ...) are reported. Exclusions pass the fleet brake
  first: at most `max_exclusions` (and `max_exclusion_share` of the nodes) within
  `exclusion_window_seconds`, cluster-wide; past it the fault is recorded, not acted on.
- Dry run: an action kind named in `dry_run` is recorded as what would have been done
  (ACT_NONE, "dry run: would ..."), never carried out.
- AGENT_UNREACHABLE, CHECKPOINT_STALE: always reported. Monitoring faults never kill training.

Restart-causing actions (kill_rank, exclude_node: both make torchrun restart the group) of a
job go through, in order: the job's stop (nothing more for a stopped job), the crash-loop
guard, the restart budget (exhausted: stop the job with a verdict), the backoff (a deferral,
ACT_NONE "backoff until T", decided again on a later pass), and at most one per job per pass.
The budget lives in the store (actions rows), so it survives supervisor restarts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..contract.causes import LOW, UNKNOWN
from ..contract.save_requests import save_step
from .causes import Cause, classify
from .model import (
    ACT_EXCLUDE_NODE,
    ACT_KILL_RANK,
    ACT_NONE,
    ACT_STOP_JOB,
    ACTIONS,
    AGENT_UNREACHABLE,
    BAD_NUMERICS,
    CHECKPOINT_STALE,
    CRASH_LOOP,
    NODE_FAULT,
    RANK_DEAD,
    RANK_HUNG,
    STRAGGLER,
    Decision,
    Finding,
)

RESTART_ACTIONS = frozenset({ACT_KILL_RANK, ACT_EXCLUDE_NODE})
MONITORING_KINDS = frozenset({AGENT_UNREACHABLE, CHECKPOINT_STALE})
CULPRIT_UNKNOWN = "culprit unknown: capture stacks"
SPIKE_IN_CHECKPOINT = "report only: newest checkpoint may include the spike"


@dataclass(frozen=True)
class PolicyConfig:
    max_restarts: int = 10  # restart-causing actions per job within the budget window
    budget_window_seconds: float = 3600.0
    backoff_base_seconds: float = 1.0  # wait after the n-th action: base * 2**(n-1) ...
    backoff_max_seconds: float = 60.0  # ... capped here
    crash_loop_restarts: int = 3  # restarts in a row without checkpoint progress -> stop
    # a job that reports no checkpoint (a zero-code script): an incarnation that lived this
    # long before its death is progress, or every third restart, however rare, stopped it
    crash_loop_progress_seconds: float = 600.0
    # restarts in a row with one known cause (an XID, a desync, a full disk) -> stop, even
    # with progress between them: restarting again will meet the same fault (0: never)
    same_cause_restarts: int = 5
    exclude_stragglers: bool = False
    stop_on_budget_exhausted: bool = True  # else defer (ACT_NONE) until the window frees up
    # The fleet brake: nodes excluded across the cluster within `exclusion_window_seconds`,
    # at most `max_exclusions` and at most `max_exclusion_share` of the nodes in view (one
    # at least). Past it a node fault is recorded and alerted, not acted on: one cause
    # across the fleet (a driver upgrade, a bad rule) must not take the cluster down.
    max_exclusions: int = 4
    max_exclusion_share: float = 0.25
    exclusion_window_seconds: float = 3600.0
    # action kinds recorded as what would have been done, never carried out (a new rule
    # measured before it acts): comma-separated, of kill_rank, stop_job, exclude_node
    dry_run: str = ""
    # predictive drain: a node whose GPU trends toward failure (`gpu_failing`) is excluded
    # at its jobs' next checkpoint boundary, so the fault costs the steps since that
    # checkpoint, not a crash's; after `predictive_drain_wait_seconds` without one, at once.
    # Meanwhile each job is asked to save this far ahead of its newest step (every rank
    # must have the request before that step)
    predictive_drain: bool = False
    predictive_drain_wait_seconds: float = 1800.0
    predictive_drain_save_lead_seconds: float = 10.0

    def __post_init__(self) -> None:
        if self.max_restarts < 1:
            raise ValueError(f"max_restarts must be >= 1, got {self.max_restarts}")
        if not self.budget_window_seconds > 0:
            raise ValueError(f"budget_window_seconds must be > 0, got {self.budget_window_seconds}")
        if not 0 <= self.backoff_base_seconds <= self.backoff_max_seconds:
            raise ValueError(
                "need 0 <= backoff_base_seconds <= backoff_max_seconds, got "
                f"{self.backoff_base_seconds} and {self.backoff_max_seconds}"
            )
        if self.crash_loop_restarts < 1:
            raise ValueError(f"crash_loop_restarts must be >= 1, got {self.crash_loop_restarts}")
        if not self.crash_loop_progress_seconds > 0:
            raise ValueError(
                f"crash_loop_progress_seconds must be > 0, got {self.crash_loop_progress_seconds}"
            )
        if self.same_cause_restarts < 0:
            raise ValueError(f"same_cause_restarts must be >= 0, got {self.same_cause_restarts}")
        if not self.predictive_drain_wait_seconds > 0:
            raise ValueError("predictive_drain_wait_seconds must be > 0, got "
                             f"{self.predictive_drain_wait_seconds}")  # fmt: skip
        if not self.predictive_drain_save_lead_seconds > 0:
            raise ValueError("predictive_drain_save_lead_seconds must be > 0, got "
                             f"{self.predictive_drain_save_lead_seconds}")  # fmt: skip
        if self.max_exclusions < 0:
            raise ValueError(f"max_exclusions must be >= 0, got {self.max_exclusions}")
        if not 0 <= self.max_exclusion_share <= 1:
            raise ValueError(
                f"max_exclusion_share must be in [0, 1], got {self.max_exclusion_share}"
            )
        if not self.exclusion_window_seconds > 0:
            raise ValueError(
                f"exclusion_window_seconds must be > 0, got {self.exclusion_window_seconds}"
            )
        unknown = set(self.dry_runs) - (set(ACTIONS) - {ACT_NONE})
        if unknown:
            raise ValueError(
                f"dry_run: unknown action {', '.join(sorted(unknown))} (known: kill_rank, "
                "stop_job, exclude_node)"
            )

    @property
    def dry_runs(self) -> frozenset[str]:
        return frozenset(a.strip() for a in self.dry_run.split(",") if a.strip())


@dataclass(frozen=True)
class IncidentInfo:
    """What the policy needs to know about the incident recorded for one finding key."""

    id: int
    actions: tuple[str, ...] = ()  # kinds of the actions recorded (intents included)
    detected_at: float | None = None

    @property
    def acted(self) -> bool:
        return any(a != ACT_NONE for a in self.actions)


@dataclass(frozen=True)
class RestartRecord:
    """One incident that restarted a job: a dead rank, or one we killed or excluded."""

    key: str
    at: float  # detected_at, supervisor clock
    restart: int | None  # torchrun restart count when detected (same count = same restart)
    checkpoint_step: int | None  # the job's newest validated checkpoint step at detection
    cause: str | None = None  # its cause when known and not a guess (supervisor/causes.py)


@dataclass(frozen=True)
class JobView:
    restarts: tuple[RestartRecord, ...] = ()  # oldest first
    restart_actions: tuple[float, ...] = ()  # requested_at of kill/exclude actions, oldest first
    stopped_at: float | None = None  # newest stop_job action; earlier history no longer counts
    checkpoint_step: int | None = None  # newest validated checkpoint step now, if observed


@dataclass(frozen=True)
class PolicyView:
    incidents: Mapping[str, IncidentInfo] = field(default_factory=dict)  # by Finding.key
    jobs: Mapping[str, JobView] = field(default_factory=dict)
    # (requested_at, node) of the cluster's exclude_node actions in the exclusion window
    exclusions: tuple[tuple[float, str], ...] = ()
    nodes: int = 0  # nodes in view (the brake's share is of these)

    def job(self, job: str | None) -> JobView:
        return self.jobs.get(job or "", JobView())


# --------------------------------------------------------------------------- decide


def decide(
    findings: list[Finding], incidents: PolicyView, cfg: PolicyConfig, now: float
) -> list[Decision]:
    """One decision per finding that has no action yet (in input order), then one
    CRASH_LOOP stop per job whose guard tripped."""
    ctx = _Pass(incidents, cfg, now)
    out: list[Decision] = []
    for f in findings:
        info = incidents.incidents.get(f.key)
        if info is not None and info.acted:
            continue  # idempotent: this fault was already acted on
        out.append(ctx.gate(_wanted(f, ctx.view, cfg)))
    return [_dry(d, cfg) for d in out + list(ctx.crash_loops.values())]


def _dry(d: Decision, cfg: PolicyConfig) -> Decision:
    """A decision whose action runs dry: recorded as what would have been done."""
    if d.action not in cfg.dry_runs:
        return d
    return Decision(d.finding, ACT_NONE, f"dry run: would {d.action}: {d.reason}", d.target)


def _wanted(f: Finding, view: PolicyView, cfg: PolicyConfig) -> Decision:
    """What a finding calls for on its own, before budgets and guards."""
    rule = _RULES.get(f.kind, _report)
    return rule(f, view, cfg)


def _report(f: Finding, view: PolicyView, cfg: PolicyConfig) -> Decision:
    if f.kind in MONITORING_KINDS:
        return Decision(f, ACT_NONE, "report only: monitoring fault, never a reason to kill")
    return Decision(f, ACT_NONE, f"report only: {f.kind}")


def _dead(f: Finding, view: PolicyView, cfg: PolicyConfig) -> Decision:
    return Decision(f, ACT_NONE, "torchrun restarts the worker group by itself")


def _hung(f: Finding, view: PolicyView, cfg: PolicyConfig) -> Decision:
    if f.evidence.get("desync") is True and f.job:
        # ranks issued different collectives at the same point: a bug a restart repeats
        why = f"desync, a code bug (no restart): {f.evidence.get('culprit_reason')}"
        return Decision(f, ACT_STOP_JOB, why, {"job": f.job})
    culprit = _culprit(f)
    via = f.evidence.get("restart_via")
    if culprit is None and isinstance(via, Mapping) and _int(via.get("rank")) is not None:
        # the culprit is out of reach (partition): end a reachable rank so torchrun
        # re-forms the job without the missing ones
        target = _drop_none({"job": f.job, "node": via.get("node"), "rank": _int(via["rank"]),
                             "node_url": via.get("node_url"), "pid": via.get("pid")})  # fmt: skip
        return Decision(f, ACT_KILL_RANK, f"hung: {f.evidence.get('culprit_reason')}", target)
    if culprit is None:
        return Decision(f, ACT_NONE, CULPRIT_UNKNOWN, deferred=True)
    return Decision(f, ACT_KILL_RANK, f"hung: rank {culprit['rank']} is the culprit", culprit)


def _numerics(f: Finding, view: PolicyView, cfg: PolicyConfig) -> Decision:
    ev = f.evidence
    target = _rank_target(f, f.rank if f.rank is not None else 0, same_node=f.rank is not None)
    if _nonfinite(ev):
        return Decision(
            f, ACT_KILL_RANK, "non-finite loss: resume from the newest checkpoint", target
        )
    anomaly = _int(ev.get("anomaly_step", ev.get("step")))
    ckpt = _int(ev.get("checkpoint_step"))
    if ckpt is None:
        ckpt = view.job(f.job).checkpoint_step
    if anomaly is None or ckpt is None or anomaly <= ckpt:
        return Decision(f, ACT_NONE, SPIKE_IN_CHECKPOINT)
    reason = f"loss spike at step {anomaly}: resume from checkpoint step {ckpt}"
    return Decision(f, ACT_KILL_RANK, reason, target)


def _straggler(f: Finding, view: PolicyView, cfg: PolicyConfig) -> Decision:
    if cfg.exclude_stragglers and f.node:
        return Decision(f, ACT_EXCLUDE_NODE, "straggler: exclude its node", _node_target(f))
    return Decision(f, ACT_NONE, "report only: straggler")


def _node_fault(f: Finding, view: PolicyView, cfg: PolicyConfig) -> Decision:
    if f.evidence.get("hardware") is True and f.severity == "critical" and f.node:
        return Decision(
            f, ACT_EXCLUDE_NODE, "critical hardware fault: exclude node", _node_target(f)
        )
    if f.evidence.get("failing") is True and f.node:
        return _failing(f, view, cfg)
    return Decision(f, ACT_NONE, "report only: node fault is not a critical hardware fault")


def _failing(f: Finding, view: PolicyView, cfg: PolicyConfig) -> Decision:
    """A GPU predicted to fail: drained at the next checkpoint boundary of every job on the
    node (a checkpoint first seen after the prediction), when predictive drain is on. While
    it waits, each job that reports steps is asked to save now (`target["save"]`: a step
    `predictive_drain_save_lead_seconds` ahead, contract/save_requests.py); the loop asks
    once per incident."""
    if not cfg.predictive_drain:
        return Decision(f, ACT_NONE, "report only: a failing GPU (predictive drain is off)")
    info = view.incidents.get(f.key)
    since = info.detected_at if info is not None else None  # None: first seen in this pass
    jobs = f.evidence.get("jobs")
    jobs = jobs if isinstance(jobs, Mapping) else {}
    waiting = sorted(job for job, ckpt in jobs.items() if not _seen_after(ckpt, since))
    # a node finding's time is when its agent's verdict was observed: this pass
    overdue = (
        since is not None and (f.occurred_at or 0.0) >= since + cfg.predictive_drain_wait_seconds
    )
    if waiting and not overdue:
        why = f"predictive drain: waiting for the next checkpoint of {', '.join(waiting)}"
        saves = {} if ACT_EXCLUDE_NODE in cfg.dry_runs else _save_requests(jobs, waiting, cfg)
        return Decision(f, ACT_NONE, why, {"save": saves} if saves else {}, deferred=True)
    if waiting:
        why = f"no checkpoint within {cfg.predictive_drain_wait_seconds:g}s"
    else:
        why = "its jobs' next checkpoint was taken" if jobs else "no job on it"
    return Decision(f, ACT_EXCLUDE_NODE, f"predictive drain: a failing GPU, {why}", _node_target(f))


def _save_requests(jobs: Mapping, waiting: list[str], cfg: PolicyConfig) -> dict[str, dict]:
    """The save each waiting job is asked for: its incarnation and the step to save at."""
    out = {}
    for job in waiting:
        where = jobs[job] if isinstance(jobs[job], Mapping) else {}
        step, restart = _int(where.get("step")), _int(where.get("restart"))
        if step is None or restart is None:
            continue  # a job that reports no steps (zero-code) saves on its own schedule
        pace = where.get("step_seconds")
        pace = float(pace) if isinstance(pace, (int, float)) else None
        out[job] = {"restart": restart,
                    "step": save_step(step, pace, cfg.predictive_drain_save_lead_seconds)}  # fmt: skip
    return out


def _seen_after(ckpt: object, since: float | None) -> bool:
    """Whether a job's newest checkpoint was first seen after `since`."""
    seen = ckpt.get("checkpoint_seen_at") if isinstance(ckpt, Mapping) else None
    return since is not None and isinstance(seen, (int, float)) and seen > since


_RULES = {
    RANK_DEAD: _dead,
    RANK_HUNG: _hung,
    BAD_NUMERICS: _numerics,
    STRAGGLER: _straggler,
    NODE_FAULT: _node_fault,
}


# --------------------------------------------------------------------------- guards


class _Pass:
    """State of one `decide` call: restarts planned so far and the crash loops found."""

    def __init__(self, view: PolicyView, cfg: PolicyConfig, now: float) -> None:
        self.view, self.cfg, self.now = view, cfg, now
        self.planned: set[str] = set()  # jobs with a restart decided in this pass
        self.stopping: set[str] = set()  # jobs stopped in this pass
        self.crash_loops: dict[str, Decision] = {}  # CRASH_LOOP key -> decision
        self.excluded: set[str] = set()  # nodes whose exclusion was decided in this pass

    def gate(self, d: Decision) -> Decision:
        f, job = d.finding, d.finding.job
        if d.action == ACT_EXCLUDE_NODE and (braked := self._brake(d)) is not None:
            return braked
        if job is None:
            return d  # node-level (no job): no job budget to charge
        if f.kind == RANK_DEAD:  # the restart already happened: only the guard applies
            if job in self.stopping:
                return _defer(d, f"{d.reason}; the job is being stopped")
            if self._crash_loop(job, f):
                return _defer(d, f"{d.reason}; crash loop: stopping the job")
            return d
        if d.action not in RESTART_ACTIONS:
            return d
        return self._gate_restart(job, d)

    def _brake(self, d: Decision) -> Decision | None:
        """The fleet brake on exclusions (a deferral past it; None: go on)."""
        cfg, view = self.cfg, self.view
        limit = cfg.max_exclusions
        if view.nodes:
            limit = min(limit, max(1, math.floor(cfg.max_exclusion_share * view.nodes)))
        since = self.now - cfg.exclusion_window_seconds
        done = {n for t, n in view.exclusions if t > since} | self.excluded
        node = str(d.target.get("node"))
        if node not in done and len(done) >= limit:  # a node already out costs nothing
            return _defer(d, f"fleet brake: {len(done)} nodes excluded within "
                             f"{cfg.exclusion_window_seconds:g}s (at most {limit}): recorded, "
                             f"not acted on ({d.reason})")  # fmt: skip
        self.excluded.add(node)
        return None

    def _gate_restart(self, job: str, d: Decision) -> Decision:
        f, jv, cfg = d.finding, self.view.job(job), self.cfg
        if job in self.stopping:
            return _defer(d, "job is being stopped")
        if jv.stopped_at is not None and _when(f, self.now) <= jv.stopped_at:
            return _defer(d, f"job was stopped at {jv.stopped_at:.3f}")
        if self._crash_loop(job, f):
            return _defer(d, "crash loop: stopping the job instead")
        if job in self.planned:
            return _defer(d, "another restart of this job was decided in this pass")
        times = self._recent_actions(job)
        if len(times) >= cfg.max_restarts:
            return self._exhausted(job, d, len(times))
        if times:
            wait = min(cfg.backoff_base_seconds * 2 ** (len(times) - 1), cfg.backoff_max_seconds)
            if self.now < times[-1] + wait:
                return _defer(d, f"backoff until {times[-1] + wait:.3f}")
        self.planned.add(job)
        return d

    def _recent_actions(self, job: str) -> list[float]:
        jv = self.view.job(job)
        since = self.now - self.cfg.budget_window_seconds
        if jv.stopped_at is not None:
            since = max(since, jv.stopped_at)
        return sorted(t for t in jv.restart_actions if t > since)

    def _exhausted(self, job: str, d: Decision, n: int) -> Decision:
        why = (
            f"restart budget exhausted: {n} restarts within "
            f"{self.cfg.budget_window_seconds:g}s (max {self.cfg.max_restarts})"
        )
        if not self.cfg.stop_on_budget_exhausted:
            return _defer(d, why)
        self.stopping.add(job)
        return Decision(d.finding, ACT_STOP_JOB, why, {"job": job})

    def _crash_loop(self, job: str, f: Finding) -> bool:
        """Count this restart (done or about to be) on top of the recorded ones; stop the
        job when the last `crash_loop_restarts` of them saw no checkpoint progress, or the
        last `same_cause_restarts` had one known cause."""
        records = _carry_checkpoints_forward(self._history(job, f))
        stuck = _restarts_without_progress(records, self.cfg.crash_loop_progress_seconds)
        same = _same_cause(records, self.cfg.same_cause_restarts)
        cause = classify(f)
        if len(stuck) >= self.cfg.crash_loop_restarts:
            step = stuck[-1].checkpoint_step
            shown = "none" if step is None else str(step)
            key = f"crash_loop:{job}:{shown}"
            past = "(no validated checkpoint)" if step is None else f"past step {step}"
            verdict = f"crash loop: {len(stuck)} restarts without checkpoint progress {past}"
            if step is None:  # progress was judged by the incarnations' life
                limit = self.cfg.crash_loop_progress_seconds
                verdict += f", the incarnations between them each under {limit:g} s"
        elif same:
            stuck, step = same, same[-1].checkpoint_step
            key = f"crash_loop:{job}:cause:{f.key}"
            verdict = (f"crash loop: {len(same)} restarts in a row for one cause, {cause.cause} "
                       f"({cause.why}): restarting again meets the same fault")  # fmt: skip
        else:
            return False
        info = self.view.incidents.get(key)
        if info is not None and info.acted:
            return False  # already stopped for this loop
        loop = Finding(
            kind=CRASH_LOOP,
            key=key,
            severity="critical",
            summary=verdict,
            job=job,
            occurred_at=self.now,
            evidence={
                "restarts": [r.key for r in stuck],
                "checkpoint_step": step,
                "trigger": f.key,
                # the loop's cause, where its restarts share one (supervisor/causes.py)
                **(
                    {"cause": cause.to_json()}
                    if all(r.cause == cause.cause for r in stuck) and cause.confidence != LOW
                    else {}
                ),  # fmt: skip
            },
        )
        self.crash_loops[key] = Decision(loop, ACT_STOP_JOB, verdict, {"job": job})
        self.stopping.add(job)
        return True

    def _history(self, job: str, f: Finding) -> list[RestartRecord]:
        """The job's restarts since its last stop, this finding's restart last."""
        jv = self.view.job(job)
        since = jv.stopped_at if jv.stopped_at is not None else -math.inf
        records = [r for r in jv.restarts if r.at > since and r.key != f.key]
        current = next((r for r in jv.restarts if r.key == f.key), None)
        if current is None:
            ckpt = _int(f.evidence.get("checkpoint_step"))
            current = RestartRecord(
                key=f.key,
                at=self.now,
                restart=_int(f.evidence.get("restart")),
                checkpoint_step=ckpt if ckpt is not None else jv.checkpoint_step,
                cause=known_cause(classify(f)),
            )
        return sorted(records, key=lambda r: r.at) + [current]


def _carry_checkpoints_forward(records: list[RestartRecord]) -> list[RestartRecord]:
    """A restart recorded without a checkpoint step (its ranks died before reporting one,
    or the supervisor restarted and had seen none) keeps the step known before it: a
    validated checkpoint does not vanish because it was not reported, and a lower step
    reported later (the newest one quarantined at resume) is still taken as it is."""
    out: list[RestartRecord] = []
    known: int | None = None
    for r in records:
        if r.checkpoint_step is None and known is not None:
            r = dataclasses.replace(r, checkpoint_step=known)
        known = r.checkpoint_step
        out.append(r)
    return out


def _restarts_without_progress(
    records: list[RestartRecord], progress_seconds: float
) -> list[RestartRecord]:
    """The trailing run of distinct restarts at which the checkpoint had not advanced past
    the newest one's step. Incidents seen in the same torchrun incarnation (a killed rank
    and its dead record, or several ranks dying together) are one restart. Where no
    checkpoint is known on either side (a script that reports none), an incarnation that
    lived `progress_seconds` between two restarts is the progress instead."""
    if not records:
        return []
    newest = _step(records[-1].checkpoint_step)
    run: list[RestartRecord] = []
    seen: set[int] = set()
    for r in reversed(records):
        if _step(r.checkpoint_step) < newest:
            break  # the checkpoint advanced after this restart
        if r.restart is not None:
            if r.restart in seen:
                continue
            seen.add(r.restart)
        if run and _lived_long(r, run[-1], progress_seconds):
            break  # the incarnation between this restart and the next trained long
        run.append(r)
    return run[::-1]


def _same_cause(records: list[RestartRecord], n: int) -> list[RestartRecord]:
    """The last `n` distinct restarts, when they all had the same known cause (else [])."""
    run: list[RestartRecord] = []
    seen: set[int] = set()
    for r in reversed(records):
        if r.cause is None or (run and r.cause != run[0].cause):
            break
        if r.restart is not None:
            if r.restart in seen:
                continue
            seen.add(r.restart)
        run.append(r)
    return run[::-1] if n and len(run) >= n else []


def known_cause(c: Cause) -> str | None:
    """A cause that counts toward a same-cause loop: named, and more than a guess."""
    return None if c.cause == UNKNOWN or c.confidence == LOW else c.cause


def _lived_long(earlier: RestartRecord, later: RestartRecord, progress_seconds: float) -> bool:
    """Whether the incarnation between two restarts counts as progress by its life alone:
    only where neither knows a checkpoint (a known one is the better measure)."""
    unknown = earlier.checkpoint_step is None and later.checkpoint_step is None
    return unknown and later.at - earlier.at >= progress_seconds


# --------------------------------------------------------------------------- helpers


def _defer(d: Decision, reason: str) -> Decision:
    return Decision(d.finding, ACT_NONE, reason, deferred=True)


def _when(f: Finding, now: float) -> float:
    return f.occurred_at if f.occurred_at is not None else now


def _step(step: int | None) -> int:
    return -1 if step is None else step


def _int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _nonfinite(ev: Mapping[str, Any]) -> bool:
    """The numerics detector says `reason: "non_finite"` (or `nonfinite`); else judge the
    loss itself (agents and detectors spell NaN/Infinity as strings)."""
    if "nonfinite" in ev:
        return bool(ev["nonfinite"])
    if ev.get("reason") in ("non_finite", "spike"):
        return ev["reason"] == "non_finite"
    loss = ev.get("loss")
    if isinstance(loss, str):
        return loss in ("NaN", "nan", "Infinity", "-Infinity", "inf", "-inf")
    return isinstance(loss, (int, float)) and not math.isfinite(loss)


def _culprit(f: Finding) -> dict[str, Any] | None:
    """`evidence["culprit"]` as a rank number or {rank, node, node_url, pid}; a hang finding
    without that key names its culprit in `rank`/`node`."""
    ev = f.evidence
    if "culprit" in ev:
        c = ev["culprit"]
        if isinstance(c, Mapping) and _int(c.get("rank")) is not None:
            target = {"job": f.job, "node": c.get("node", f.node), "rank": _int(c["rank"])}
            target.update({k: c[k] for k in ("node_url", "pid", "restart") if k in c})
            return _drop_none(target)
        rank = _int(c)
        return None if rank is None else _rank_target(f, rank, same_node=rank == f.rank)
    if f.rank is None:
        return None
    return _rank_target(f, f.rank, same_node=True)


def _rank_target(f: Finding, rank: int, same_node: bool) -> dict[str, Any]:
    """A kill target. The node (and pid) are included only when known to be the rank's,
    else the loop resolves the rank's node from the newest observation."""
    target: dict[str, Any] = {"job": f.job, "rank": rank}
    if same_node:
        target["node"] = f.node
        target.update({k: f.evidence[k] for k in ("node_url", "pid", "restart") if k in f.evidence})
    return _drop_none(target)


def _node_target(f: Finding) -> dict[str, Any]:
    url = f.evidence.get("node_url", f.evidence.get("url"))  # node detector: `url`
    target = {"node": f.node, "job": f.job, "node_url": url}
    return _drop_none(target)


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}
