"""The reconcile loop: observe -> detect -> decide -> act -> record.

Level-based, as controller-runtime's reconcilers are: each pass looks at the cluster as
it is, so running it twice acts once (every action is tied to an incident whose key
identifies the fault, and is written to SQLite before it is carried out). Detectors and
policy are pure; this module does the I/O around them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

from .agents import AgentClient, AgentError, Poller
from .detectors import DetectorConfig, advance_history, pick_culprit_from_stacks, run_all
from .model import (
    ACT_EXCLUDE_NODE,
    ACT_KILL_RANK,
    ACT_NONE,
    ACT_STOP_JOB,
    BAD_NUMERICS,
    CRASH_LOOP,
    NODE_FAULT,
    RANK_DEAD,
    RANK_HUNG,
    Decision,
    Finding,
    History,
)
from .policy import PolicyConfig, decide
from .scheduler import Scheduler, SchedulerConfig
from .stacks import StackBudget
from .state import LIVE_STATES, ClusterObs, RankObs
from .store import ActionExists, IncidentStore, build_view
from .tokens import AgentTokens

log = logging.getLogger("rankguard.supervisor")


def _unnamed_process_hang(f: Finding) -> bool:
    """A hang of ranks without telemetry that neither the process table nor the stacks pin
    on one rank: idle CPU alone is weak evidence (ranks may all wait on I/O or sleep), so it
    is not an incident until a culprit is named (detectors/process_hang.py)."""
    return f.kind == RANK_HUNG and f.rank is None and f.evidence.get("source") == "process"


RESTARTING_ACTIONS = (ACT_KILL_RANK, ACT_EXCLUDE_NODE)
# Faults torchrun itself recovers from (the group restarts): the loop follows the recovery.
RECOVERING_KINDS = (RANK_DEAD, RANK_HUNG, BAD_NUMERICS)


@dataclass
class JobProgress:
    """Goodput bookkeeping: step time counts once per step, replayed steps do not."""

    first_seen: float
    max_step: int = 0
    useful_seconds: float = 0.0
    state: str = "running"  # running, recovering, finished, stopped
    verdict: str | None = None

    def goodput(self, now: float) -> float:
        wall = now - self.first_seen
        return min(1.0, self.useful_seconds / wall) if wall > 0 else 0.0


@dataclass
class SupervisorConfig:
    interval: float = 0.25
    agent_timeout: float = 2.0
    detectors: DetectorConfig = field(default_factory=DetectorConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


class Supervisor:
    def __init__(
        self, store: IncidentStore, urls, token: str | AgentTokens | None, cfg: SupervisorConfig
    ):
        """`token`: one token for every agent, or AgentTokens (per-agent tokens)."""
        self.store = store
        self._urls = urls  # a callable returning the current agent URLs
        self.tokens = token if isinstance(token, AgentTokens) else AgentTokens(shared=token)
        self.cfg = cfg
        self.poller = Poller()
        self.history = History()
        self.last_obs: ClusterObs | None = None
        self.jobs: dict[str, JobProgress] = {}
        self.loop_seconds = 0.0
        self.passes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.clock = time.time
        self.monotonic = time.monotonic  # paces stack captures (a test may drive it)
        self.stack_budget = StackBudget()  # py-spy dumps: bounded per pass, per rank backoff
        self.service = None  # its HTTP service once serving (supervisor/daemon.py)
        self.scheduler = Scheduler(cfg.scheduler, store.path)  # drains, resumes nodes

    def clients(self) -> list[AgentClient]:
        return [self.client_for(u) for u in self._urls()]

    def client_for(self, node_url: str) -> AgentClient:
        return AgentClient(node_url, self.tokens.for_url(node_url), self.cfg.agent_timeout)

    # -- one pass -----------------------------------------------------------------
    def reconcile_once(self, now: float | None = None) -> list[Decision]:
        start = time.perf_counter()
        obs = self.poller.poll(self.clients(), now)
        now = obs.time  # after the poll: nothing is detected before it is seen
        self.stack_budget.new_pass(self.monotonic())
        self.history = advance_history(self.history, obs, self.cfg.detectors)
        refined = [self._refine(f, obs) for f in run_all(obs, self.history, self.cfg.detectors)]
        findings = [f for f in refined if not _unnamed_process_hang(f)]
        for f in findings:
            self._record(f, obs, now)
        checkpoints = {j: self._checkpoint_step(obs, j) for j in obs.jobs()}
        view = build_view(self.store, findings, self.cfg.policy, now, checkpoints)
        decisions = decide(findings, view, self.cfg.policy, now)
        for d in decisions:
            self._act(d, obs, now)
        self._track_recoveries(obs, now)
        self._resolve_gone({f.key for f in findings}, now)
        self._track_progress(obs, now)
        self.scheduler.observe(obs)
        with self._lock:
            self.last_obs = obs
            self.loop_seconds = time.perf_counter() - start
            self.passes += 1
        return decisions

    def _refine(self, finding: Finding, obs: ClusterObs) -> Finding:
        """A hang without a culprit yet: read every rank's stacks and pick the odd one out."""
        if finding.kind != RANK_HUNG or finding.rank is not None:
            return finding
        if not finding.evidence.get("stacks_needed", True):
            return finding  # explained without stacks (ranks behind an unreachable agent)
        existing = self.store.by_key(finding.key)
        if existing is not None and existing.rank is not None:
            return dataclasses.replace(finding, rank=existing.rank, node=existing.node)
        stacks, nodes = {}, {}
        budget, ranks = self.stack_budget, obs.current_ranks(finding.job)
        for r in ranks:
            key = (r.job, r.rank, r.pid)
            if budget.may_capture(key, self.monotonic()):
                dump = None
                try:
                    dump = self.client_for(self._url_of(obs, r)).stacks(r.job, r.rank)["stacks"]
                except AgentError as exc:
                    log.warning("stacks of rank %s: %s", r.rank, exc)
                budget.record(key, self.monotonic(), dump)
            if (dump := budget.dump(key)) is not None:
                stacks[r.rank], nodes[r.rank] = dump, r.node
        if not all(budget.tried((r.job, r.rank, r.pid)) for r in ranks):
            # some ranks wait for a later pass's budget: blame no rank on part of the picture
            return dataclasses.replace(finding, evidence={**finding.evidence, "stacks": stacks})
        culprit = pick_culprit_from_stacks(stacks)
        evidence = {**finding.evidence, "stacks": stacks}
        if culprit is None:
            return dataclasses.replace(finding, evidence=evidence)
        evidence["culprit_reason"] = "its stack is the only one not waiting in a collective"
        return dataclasses.replace(finding, rank=culprit, node=nodes[culprit], evidence=evidence)

    @staticmethod
    def _url_of(obs: ClusterObs, rank: RankObs) -> str:
        return next(n.url for n in obs.nodes if n.node == rank.node)

    def _checkpoint_step(self, obs: ClusterObs, job: str | None) -> int | None:
        """The job's newest validated checkpoint: what its current ranks report, else the
        last one they reported. A restarted rank reports none until it has resumed, and
        one that dies before then (a full disk failing the resume) would otherwise make a
        crash-loop verdict read "no validated checkpoint" while one was there."""
        if not job:
            return None
        steps = [r.checkpoint_step for r in obs.current_ranks(job)]
        reported = max((c for c in steps if c is not None), default=None)
        if reported is not None:
            return reported
        progress = self.history.checkpoint_progress.get(job)
        return progress[0] if progress else None

    def _record(self, finding: Finding, obs: ClusterObs, now: float) -> None:
        ranks = obs.current_ranks(finding.job) if finding.job else []
        incident, created = self.store.upsert_finding(
            finding, now,
            restart_before=max((r.restart for r in ranks), default=None),
            step_at_detect=max((r.step or 0 for r in ranks), default=None),
            checkpoint_step=self._checkpoint_step(obs, finding.job),
        )  # fmt: skip
        if created:
            log.warning("incident %s: %s", incident.id, finding.summary)
            if finding.job in self.jobs and finding.kind in RECOVERING_KINDS:
                self.jobs[finding.job].state = "recovering"

    # -- act ----------------------------------------------------------------------
    def _act(self, decision: Decision, obs: ClusterObs, now: float) -> None:
        f = decision.finding
        incident = self.store.by_key(f.key)
        if incident is None:  # a finding the policy made itself (crash loop)
            incident, _ = self.store.upsert_finding(
                f, now, checkpoint_step=f.evidence.get("checkpoint_step")
            )
        if decision.action == ACT_NONE:
            if incident.state == "open" and not decision.deferred:
                state = "recovering" if f.kind in RECOVERING_KINDS else "reported"
                self.store.set_state(
                    incident.id, state, now, action=ACT_NONE, action_reason=decision.reason
                )
            return
        try:
            action_id = self.store.begin_action(
                incident.id, decision.action, decision.target, now, reason=decision.reason
            )
        except ActionExists:
            return  # acted already (maybe in our previous life): never twice
        try:
            result = self._execute(decision, obs)
        except (AgentError, StopIteration, KeyError) as exc:
            log.error("action %s for incident %s failed: %r", decision.action, incident.id, exc)
            self.store.complete_action(action_id, False, time.time(), error=repr(exc))
            self.store.set_state(
                incident.id, "failed", time.time(), verdict=f"action failed: {exc!r}"
            )
            return
        done = time.time()
        self.store.complete_action(action_id, True, done, result=result)
        log.warning("incident %s: %s (%s)", incident.id, decision.action, decision.reason)
        if decision.action in RESTARTING_ACTIONS and f.kind != CRASH_LOOP:
            self.store.set_state(incident.id, "recovering", done, acted_at=done)
        else:
            state = "stopped" if decision.action == ACT_STOP_JOB else "resolved"
            self.store.set_state(incident.id, state, done, acted_at=done, verdict=decision.reason)
        if decision.action == ACT_STOP_JOB and f.job in self.jobs:
            self.jobs[f.job].state = "stopped"
            self.jobs[f.job].verdict = decision.reason

    def _execute(self, decision: Decision, obs: ClusterObs) -> dict:
        t, f = decision.target, decision.finding
        if decision.action == ACT_KILL_RANK:
            rank = next(r for r in obs.current_ranks(t["job"]) if r.rank == t["rank"])
            client = self.client_for(self._url_of(obs, rank))
            result: dict = {}
            if f.kind == RANK_HUNG and "stacks" not in f.evidence:
                try:  # the culprit's stacks, before it is gone
                    result["stacks"] = {rank.rank: client.stacks(rank.job, rank.rank)["stacks"]}
                except AgentError as exc:
                    result["stacks_error"] = str(exc)
            result["signal"] = client.signal(rank.job, rank.rank, "SIGKILL")
            return result
        # stop_job: every node of the job; exclude_node: that node, every job on it
        if decision.action == ACT_STOP_JOB:  # dead ranks too: their launcher may restart them
            targets = {(r.node, r.job) for r in obs.current_ranks(t["job"])}
        else:
            targets = {(r.node, r.job) for r in obs.ranks() if r.node == t["node"] and not r.dead}
        results = {}
        for node, job in sorted(targets):
            url = next(n.url for n in obs.nodes if n.node == node)
            results[f"{node}/{job}"] = self.client_for(url).stop_job(job)
        if decision.action == ACT_EXCLUDE_NODE and f.kind == NODE_FAULT:
            results["scheduler"] = self.scheduler.exclude(t["node"], f.summary)
        return results

    # -- recovery and progress ------------------------------------------------------------
    def _track_recoveries(self, obs: ClusterObs, now: float) -> None:
        """Restarted and first-step times, resumed step and lost steps of each recovery."""
        for inc in self.store.open_incidents():
            if (
                inc.kind not in RECOVERING_KINDS
                or inc.state != "recovering"
                or inc.restart_before is None
            ):
                continue
            newer = [r for r in obs.current_ranks(inc.job) if r.restart > inc.restart_before]
            if not newer:
                continue
            if inc.restarted_at is None:
                self.store.set_state(inc.id, "recovering", now, restarted_at=now)
            samples = [s for r in newer for s in r.recent if s.restart > inc.restart_before]
            if all(r.source == "process" for r in newer):
                # no telemetry, so no first step: the new incarnation running is the end
                if all(r.state in LIVE_STATES for r in newer):
                    self.store.set_state(inc.id, "resolved", now)
                    if inc.job in self.jobs and self.jobs[inc.job].state == "recovering":
                        self.jobs[inc.job].state = "running"
            elif samples:
                resumed = min(s.step for s in samples) - 1
                self.store.set_state(
                    inc.id, "resolved", now, first_step_at=now, resumed_step=resumed
                )
                if inc.job in self.jobs and self.jobs[inc.job].state == "recovering":
                    self.jobs[inc.job].state = "running"

    def _resolve_gone(self, keys: set[str], now: float) -> None:
        """A reported fault that is no longer seen (agent back, straggler gone) is resolved."""
        for inc in self.store.open_incidents():
            if inc.state == "reported" and inc.key not in keys:
                self.store.set_state(inc.id, "resolved", now)

    def _track_progress(self, obs: ClusterObs, now: float) -> None:
        for job in obs.jobs():
            progress = self.jobs.setdefault(job, JobProgress(first_seen=now))
            ranks = obs.current_ranks(job)
            for s in sorted({(s.step, s.step_seconds) for r in ranks[:1] for s in r.recent}):
                if s[0] > progress.max_step:
                    progress.useful_seconds += s[1]
                    progress.max_step = s[0]
            if ranks and all(r.state == "finished" for r in ranks):
                progress.state = "finished"

    # -- run ----------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.reconcile_once()
            except Exception:  # one bad pass must not end supervision
                log.exception("reconcile pass failed")
            self._stop.wait(max(0.0, self.cfg.interval - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.stop()
        self.poller.close()
        self.scheduler.close()
