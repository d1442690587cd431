"""The incident lifecycle and the job's state: pure functions, no I/O, no clock.

    open ──act──> acting ──done──> recovering ──new incarnation, first step──> resolved
      │                     └─failed─> failed          (restart actions)
      ├──report──> reported ──finding gone──> resolved
      └──stop_job done──> stopped

The loop (reconcile.py) observes, detects, records the findings, decides, acts, and then
asks `transitions` what the pass means for every open incident, given what was decided
and what the actions did; it writes back what this returns. `attribute` says beforehand
which findings are consequences of our own actions (the death of a rank we killed, the
same hang seen under another key), so they join the incident that caused them instead
of opening new ones. `job_state` and `advance_progress` give the job's state and goodput
from the same records, so a restarted supervisor derives the same answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .model import (
    ACT_EXCLUDE_NODE,
    ACT_KILL_RANK,
    ACT_NONE,
    ACT_STOP_JOB,
    BAD_NUMERICS,
    CRASH_LOOP,
    RANK_DEAD,
    RANK_HUNG,
    Decision,
    Finding,
)
from .state import LIVE_STATES, ClusterObs

OPEN, ACTING, RECOVERING, RESOLVED, REPORTED, FAILED, STOPPED = (
    "open", "acting", "recovering", "resolved", "reported", "failed", "stopped",
)  # fmt: skip
TERMINAL = frozenset({RESOLVED, FAILED, STOPPED})
RESTARTING_ACTIONS = frozenset({ACT_KILL_RANK, ACT_EXCLUDE_NODE})
# Faults torchrun itself recovers from (the group restarts): the loop follows the recovery.
RECOVERING_KINDS = frozenset({RANK_DEAD, RANK_HUNG, BAD_NUMERICS})
JOB_STATES = ("running", "recovering", "finished", "stopped")

# Timeline events (the `events` table), besides the state names themselves.
EV_STACKS = "stacks captured"
EV_CAUSED_DEATH = "rank exited (our action)"
EV_RESTARTED = "group restarted"
EV_FIRST_STEP = "first new step"
EV_DATA_SKIPPED = "data skipped"  # the resume skipped data steps (a loss spike's window)


@dataclass(frozen=True)
class Outcome:
    """What carrying out (or replaying) one recorded action did."""

    incident_id: int
    action: str
    ok: bool
    reason: str = ""
    error: str | None = None
    stacks: bool = False  # the culprit's stacks were captured with it


@dataclass(frozen=True)
class Transition:
    """One write to an incident: its (possibly unchanged) state, columns, timeline events."""

    incident_id: int
    state: str
    values: Mapping[str, Any] = field(default_factory=dict)
    events: tuple[tuple[str, Mapping[str, Any]], ...] = ()


# --------------------------------------------------------------------------- attribute


def attribute(findings: Sequence[Finding], incidents: Iterable) -> tuple[list[Finding], list]:
    """(the findings to record, [(incident, finding)] that are steps of an incident).

    - A death in the incarnation where we killed a rank or excluded a node (the incident
      is acting or recovering on that restart) is what the action did: one step of that
      incident, not a new fault, and no second alert.
    - A hang of a job's incarnation that already has an unresolved hang incident is that
      same hang (its key names the lowest step, which moves when a partitioned node's
      last answer drops out of view): the finding takes the incident's key.
    """
    open_ = [i for i in incidents if i.state not in TERMINAL]
    keep: list[Finding] = []
    steps: list = []
    for f in findings:
        restart = f.evidence.get("restart")
        if f.kind == RANK_DEAD:
            cause = next((i for i in open_ if _caused_by(i, f.job, restart)), None)
            if cause is not None:
                steps.append((cause, f))
                continue
        if f.kind == RANK_HUNG and restart is not None:
            same = next((i for i in open_ if i.kind == RANK_HUNG and i.job == f.job
                         and i.restart_before == restart and i.key != f.key), None)  # fmt: skip
            if same is not None:
                f = dataclasses.replace(f, key=same.key)
        keep.append(f)
    return keep, steps


def _caused_by(inc, job: str | None, restart: Any) -> bool:
    return (
        inc.job == job
        and inc.kind != CRASH_LOOP
        and inc.action in RESTARTING_ACTIONS
        and inc.state in (ACTING, RECOVERING)
        and inc.restarted_at is None
        and inc.restart_before is not None
        and inc.restart_before == restart
    )


# --------------------------------------------------------------------------- transitions


def transitions(
    incidents: Sequence,
    decisions: Sequence[Decision],
    outcomes: Sequence[Outcome],
    findings: Sequence[Finding],
    obs: ClusterObs,
    held: Collection[str] = frozenset(),
) -> list[Transition]:
    """What this pass means for each incident not yet terminal (`incidents`, oldest
    first, as recorded before the pass's actions were applied): one Transition per
    incident that changes, in the order they apply. Rules, in order:

    1. an action's outcome: failed -> failed; a restart done -> recovering (the loop then
       follows the new incarnation); a stop done -> stopped; anything else -> resolved;
    2. a settled decision to do nothing about an open incident: recovering for faults
       torchrun recovers from by itself, reported for the rest; a deferred one leaves it
       open with the reason it waits (a backoff, the fleet brake);
    3. a recovering incident whose job shows a newer incarnation: restarted (once); its
       first timed step (or, without telemetry, every new rank alive) resolves it;
    4. a reported incident whose finding is no longer seen, nor `held` by its detector
       (a straggler whose rank is still slower, under the threshold), is resolved;
    5. a stop done ends the job's other incidents not yet ended: stopped, naming the stop
       (the death that tipped a crash loop is recorded too, and no restart follows it).
    """
    by_id = {i.id: i for i in incidents}
    by_key = {i.key: i for i in incidents}
    out: list[Transition] = []
    state: dict[int, str] = {i.id: i.state for i in incidents}

    def move(inc, new: str, values: Mapping | None = None, events=()) -> None:
        state[inc.id] = new
        out.append(Transition(inc.id, new, dict(values or {}), tuple(events)))

    for o in outcomes:  # 1
        inc = by_id.get(o.incident_id)
        if inc is None:
            continue
        events = ((EV_STACKS, {"action": o.action}),) if o.stacks else ()
        if not o.ok:
            move(inc, FAILED, {"verdict": f"action failed: {o.error}"}, events)
        elif o.action in RESTARTING_ACTIONS and inc.kind != CRASH_LOOP:
            move(inc, RECOVERING, {}, events)
        elif o.action == ACT_STOP_JOB:
            move(inc, STOPPED, {"verdict": o.reason}, events)
        else:
            move(inc, RESOLVED, {"verdict": o.reason}, events)

    for d in decisions:  # 2
        inc = by_key.get(d.finding.key)
        if d.action != ACT_NONE or inc is None or state[inc.id] != OPEN:
            continue
        if d.deferred:  # decided again later; meanwhile the incident says why it waits
            if d.reason != inc.action_reason:
                move(inc, OPEN, {"action_reason": d.reason})
            continue
        new = RECOVERING if inc.kind in RECOVERING_KINDS else REPORTED
        move(inc, new, {"action": ACT_NONE, "action_reason": d.reason})

    for inc in incidents:  # 3
        if state[inc.id] != RECOVERING or inc.kind not in RECOVERING_KINDS:
            continue
        if inc.restart_before is None:
            continue
        t = _recovery(inc, obs)
        if t is not None:
            move(inc, t.state, t.values, t.events)

    seen = {f.key for f in findings} | set(held)  # 4
    for inc in incidents:
        if state[inc.id] == REPORTED and inc.state == REPORTED and inc.key not in seen:
            move(inc, RESOLVED)

    stops = {by_id[o.incident_id].job: o.incident_id for o in outcomes  # 5
             if o.ok and o.action == ACT_STOP_JOB and o.incident_id in by_id}  # fmt: skip
    for inc in incidents:
        stop = stops.get(inc.job)
        if stop is not None and inc.id != stop and state[inc.id] not in TERMINAL:
            move(inc, STOPPED, {"verdict": f"the job was stopped (incident {stop})"})
    return out


def _recovery(inc, obs: ClusterObs) -> Transition | None:
    """Restarted and first-step marks, resumed step of one recovering incident."""
    newer = [r for r in obs.current_ranks(inc.job) if r.restart > inc.restart_before]
    if not newer:
        return None
    values: dict[str, Any] = {}
    events: list = []
    if inc.restarted_at is None:
        values["restarted_at"] = obs.time
        restart = max(r.restart for r in newer)
        events.append((EV_RESTARTED, {"restart": restart}))
    samples = [s for r in newer for s in r.recent if s.restart > inc.restart_before]
    if all(r.source == "process" for r in newer):
        # no telemetry, so no first step: the new incarnation running is the end
        if all(r.state in LIVE_STATES for r in newer):
            return Transition(inc.id, RESOLVED, values, tuple(events))
    elif samples:
        first = min(s.step for s in samples)
        values.update(first_step_at=obs.time, resumed_step=first - 1)
        events.append((EV_FIRST_STEP, {"step": first}))
        newest = max(r.restart for r in newer)
        skipped = data_skipped([r for r in newer if r.restart == newest], first - 1)
        if skipped is not None:
            events.append((EV_DATA_SKIPPED, skipped))
        return Transition(inc.id, RESOLVED, values, tuple(events))
    if values:
        return Transition(inc.id, RECOVERING, values, tuple(events))
    return None


def data_skipped(ranks: Sequence, resumed_step: int) -> dict | None:
    """What the new incarnation's resume skipped, as its ranks report it (every rank
    plans the same skips; their union in case one differs), and the step it resumed
    from: the timeline event that says which batches a loss spike's rollback left out."""
    merged: list[list[int]] = []  # ranges merged, never expanded (a record bounds no range)
    for a, b in sorted(x for r in ranks for x in r.resume_skips):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    if not merged:
        return None
    count = sum(b - a + 1 for a, b in merged)
    return {
        "data_steps": merged[:16],
        "count": count,
        "resumed_step": resumed_step,
        "text": f"skipped data steps {describe_ranges(merged[:16])} ({count} steps) after "
        f"the rollback to the checkpoint of step {resumed_step}",
    }


def describe_ranges(ranges: Sequence) -> str:
    return ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in ranges)


# --------------------------------------------------------------------------- the job


@dataclass(frozen=True)
class JobProgress:
    """A job's state and goodput bookkeeping: step time counts once per step (replayed
    steps after a restart from a checkpoint do not), wall time from when it was first
    seen. Kept in the store, so a restarted supervisor goes on from the same figures."""

    job: str
    first_seen: float
    max_step: int = 0
    useful_seconds: float = 0.0
    state: str = "running"  # running, recovering, finished, stopped
    verdict: str | None = None

    def goodput(self, now: float) -> float:
        wall = now - self.first_seen
        return min(1.0, self.useful_seconds / wall) if wall > 0 else 0.0


def advance_progress(progress: JobProgress, obs: ClusterObs) -> JobProgress:
    """Count the productive step time of steps above the highest one counted so far."""
    ranks = obs.current_ranks(progress.job)
    top, useful = progress.max_step, progress.useful_seconds
    for step, seconds in sorted({(s.step, s.step_seconds) for r in ranks[:1] for s in r.recent}):
        if step > top:
            useful += seconds
            top = step
    return dataclasses.replace(progress, max_step=top, useful_seconds=useful)


def job_state(
    progress: JobProgress, incidents: Iterable, obs: ClusterObs
) -> tuple[str, str | None]:
    """(state, verdict) of a job from its incidents (all of them, newest or not) and what
    its ranks do now. A stop is final: stopped with the stop's verdict. Otherwise every
    rank finished -> finished; an unresolved fault torchrun recovers from -> recovering."""
    mine = [i for i in incidents if i.job == progress.job]
    stopped = [i for i in mine if i.state == STOPPED]
    if stopped:
        # the stop itself, not an incident it ended with the job (transitions, rule 5)
        last = max(stopped, key=lambda i: (i.resolved_at or 0, i.action == ACT_STOP_JOB, i.id))
        return "stopped", last.verdict or last.summary
    if progress.state == "stopped":
        return progress.state, progress.verdict
    ranks = obs.current_ranks(progress.job)
    if ranks and all(r.state == "finished" for r in ranks):
        return "finished", None
    if any(i.kind in RECOVERING_KINDS and i.state not in TERMINAL | {REPORTED} for i in mine):
        return "recovering", None
    return "running", None
