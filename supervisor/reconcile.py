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
from .detectors import DetectorConfig, run_all
from .detectors.checkpoint import advance_history
from .detectors.hang import pick_culprit_from_stacks
from .model import (
    ACT_EXCLUDE_NODE,
    ACT_KILL_RANK,
    ACT_NONE,
    ACT_STOP_JOB,
    CRASH_LOOP,
    RANK_HUNG,
    Decision,
    Finding,
    History,
)
from .policy import PolicyConfig, decide
from .state import ClusterObs, RankObs
from .store import IncidentStore, build_view

log = logging.getLogger("rankguard.supervisor")

RESTARTING_ACTIONS = (ACT_KILL_RANK,)


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


class Supervisor:
    def __init__(self, store: IncidentStore, urls, token: str | None, cfg: SupervisorConfig):
        self.store = store
        self._urls = urls  # a callable returning the current agent URLs
        self.token = token
        self.cfg = cfg
        self.poller = Poller()
        self.history = History()
        self.last_obs: ClusterObs | None = None
        self.jobs: dict[str, JobProgress] = {}
        self.loop_seconds = 0.0
        self.passes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def clients(self) -> list[AgentClient]:
        return [AgentClient(u, self.token, self.cfg.agent_timeout) for u in self._urls()]

    def client_for(self, node_url: str) -> AgentClient:
        return AgentClient(node_url, self.token, self.cfg.agent_timeout)

    # -- one pass -----------------------------------------------------------------
    def reconcile_once(self, now: float | None = None) -> list[Decision]:
        start = time.perf_counter()
        now = time.time() if now is None else now
        obs = self.poller.poll(self.clients(), now)
        self.history = advance_history(self.history, obs)
        findings = [self._refine(f, obs) for f in run_all(obs, self.history, self.cfg.detectors)]
        for f in findings:
            self._record(f, obs, now)
        view = build_view(self.store, findings, now)
        decisions = decide(findings, view, self.cfg.policy, now)
        for d in decisions:
            self._act(d, obs, now)
        self._track_recoveries(obs, now)
        self._track_progress(obs, now)
        with self._lock:
            self.last_obs = obs
            self.loop_seconds = time.perf_counter() - start
            self.passes += 1
        return decisions

    def _refine(self, finding: Finding, obs: ClusterObs) -> Finding:
        """A hang without a culprit yet: read every rank's stacks and pick the odd one out."""
        if finding.kind != RANK_HUNG or finding.rank is not None:
            return finding
        existing = self.store.by_key(finding.key)
        if existing is not None and existing.rank is not None:
            return dataclasses.replace(finding, rank=existing.rank, node=existing.node)
        stacks, nodes = {}, {}
        for r in obs.current_ranks(finding.job):
            try:
                stacks[r.rank] = self.client_for(self._url_of(obs, r)).stacks(r.job, r.rank)["stacks"]
                nodes[r.rank] = r.node
            except AgentError as exc:
                log.warning("stacks of rank %s: %s", r.rank, exc)
        culprit = pick_culprit_from_stacks(stacks)
        evidence = {**finding.evidence, "stacks": stacks}
        if culprit is None:
            return dataclasses.replace(finding, evidence=evidence)
        evidence["culprit_reason"] = "its stack is the only one not waiting in a collective"
        return dataclasses.replace(finding, rank=culprit, node=nodes[culprit], evidence=evidence)

    @staticmethod
    def _url_of(obs: ClusterObs, rank: RankObs) -> str:
        return next(n.url for n in obs.nodes if n.node == rank.node)

    def _record(self, finding: Finding, obs: ClusterObs, now: float) -> None:
        ranks = obs.current_ranks(finding.job) if finding.job else []
        restart = max((r.restart for r in ranks), default=0)
        step = max((r.step or 0 for r in ranks), default=0)
        incident, created = self.store.upsert_finding(finding, now, restart, step)
        if created:
            log.warning("incident %s: %s", incident.id, finding.summary)
            self.store.add_event(incident.id, now, "detected", finding.summary)
            if finding.job in self.jobs and finding.kind in ("rank_dead", "rank_hung", "bad_numerics"):
                self.jobs[finding.job].state = "recovering"

    # -- act ----------------------------------------------------------------------
    def _act(self, decision: Decision, obs: ClusterObs, now: float) -> None:
        f = decision.finding
        incident, _ = self.store.upsert_finding(f, now, 0, 0)
        if decision.action == ACT_NONE:
            if incident.action is None:
                self.store.set_state(incident.id, incident.state, now, action=ACT_NONE,
                                     action_reason=decision.reason)  # fmt: skip
            return
        if self.store.has_action(incident.id, decision.action):
            return  # acted already (maybe by our previous life): never twice
        action_id = self.store.begin_action(incident.id, decision.action, decision.target, now)
        self.store.set_state(incident.id, "acting", now, action=decision.action,
                             action_reason=decision.reason)  # fmt: skip
        try:
            result = self._execute(decision, obs)
        except AgentError as exc:
            log.error("action %s for incident %s failed: %s", decision.action, incident.id, exc)
            self.store.complete_action(action_id, False, error=str(exc), now=time.time())
            self.store.set_state(incident.id, "failed", time.time())
            return
        done = time.time()
        self.store.complete_action(action_id, True, result=result, now=done)
        self.store.add_event(incident.id, done, decision.action, decision.reason)
        if decision.action in RESTARTING_ACTIONS:
            self.store.set_state(incident.id, "recovering", done, acted_at=done)
        else:
            self.store.set_state(incident.id, "stopped" if decision.action == ACT_STOP_JOB else "resolved",
                                 done, acted_at=done, verdict=decision.reason)  # fmt: skip
        if decision.action == ACT_STOP_JOB and f.job in self.jobs:
            self.jobs[f.job].state = "stopped"
            self.jobs[f.job].verdict = decision.reason

    def _execute(self, decision: Decision, obs: ClusterObs) -> dict:
        t = decision.target
        f = decision.finding
        if decision.action == ACT_KILL_RANK:
            rank = next(r for r in obs.current_ranks(t["job"]) if r.rank == t["rank"])
            client = self.client_for(self._url_of(obs, rank))
            result = {}
            if f.kind == RANK_HUNG and "stacks" not in f.evidence:
                try:  # the culprit's stacks before it is gone
                    result["stacks"] = client.stacks(rank.job, rank.rank)["stacks"]
                except AgentError as exc:
                    result["stacks_error"] = str(exc)
            if rank.state == "stopped":
                client.signal(rank.job, rank.rank, "SIGCONT")  # a stopped process dies only when run
            result["signal"] = client.signal(rank.job, rank.rank, "SIGKILL")
            return result
        if decision.action in (ACT_STOP_JOB, ACT_EXCLUDE_NODE):
            nodes = {r.node for r in obs.current_ranks(t["job"]) if not r.dead}
            if decision.action == ACT_EXCLUDE_NODE:
                nodes &= {t["node"]}
            results = {}
            for node in sorted(nodes):
                url = next(n.url for n in obs.nodes if n.node == node)
                results[node] = self.client_for(url).stop_job(t["job"])
            return results
        raise ValueError(f"unknown action {decision.action}")

    # -- recovery and progress ------------------------------------------------------------
    def _track_recoveries(self, obs: ClusterObs, now: float) -> None:
        """Fill in restarted / first step / lost steps for incidents that restart the job."""
        for inc in self.store.open_incidents():
            if inc.kind == CRASH_LOOP or inc.job is None or inc.restart_before is None:
                continue
            ranks = obs.current_ranks(inc.job)
            newer = [r for r in ranks if r.restart > inc.restart_before]
            if not newer:
                continue
            fields: dict = {}
            if inc.restarted_at is None:
                fields["restarted_at"] = now
                self.store.add_event(inc.id, now, "restarted", f"incarnation {newer[0].restart}")
            samples = [s for r in newer for s in r.recent if s.restart > inc.restart_before]
            if samples and inc.first_step_at is None:
                resumed = min(s.step for s in samples) - 1
                fields.update(first_step_at=now, resumed_step=resumed,
                              lost_steps=max(0, (inc.step_at_detect or 0) - resumed))  # fmt: skip
                self.store.add_event(inc.id, now, "first step", f"resumed from step {resumed}")
                fields["state"] = "resolved"
                fields["resolved_at"] = now
            if fields:
                state = fields.pop("state", "recovering" if inc.state != "reported" else inc.state)
                self.store.set_state(inc.id, state, now, **fields)
                if state == "resolved" and inc.job in self.jobs:
                    self.jobs[inc.job].state = "running"

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
