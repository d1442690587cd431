"""The reconcile loop: observe -> detect -> decide -> act -> record.

Level-based, as controller-runtime's reconcilers are: each pass looks at the cluster as
it is, so running it twice acts once (every action is tied to an incident whose key
identifies the fault, and is written to SQLite before it is carried out). Detectors and
policy are pure; this module does the I/O around them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from ..contract.save_requests import SaveRequest
from ..service.etcd import EtcdClient, EtcdError, parse_endpoints
from .agent_io import EventWatch
from .agents import AgentClient, AgentError, BackgroundCalls, Poller
from .causes import classify
from .detectors import (
    REGISTRY,
    DetectorConfig,
    pick_culprit_from_stacks,
    run_all,
    wavefront_awaited,
)
from .detectors.common import known_step, restart_via
from .events import apply_deaths
from .heap import HeapPacer
from .history import History, advance, advance_every_pass
from .leadership import (
    ETCD_CALL_SECONDS,
    Intent,
    Leadership,
    SharedIntents,
    Watch,
    intent_key,
)
from .lifecycle import (
    EV_CAUSED_DEATH,
    EV_RESTARTED,
    RECOVERING_KINDS,
    JobProgress,
    Outcome,
    advance_progress,
    attribute,
    job_state,
    transitions,
)
from .model import (
    ACT_EXCLUDE_NODE,
    ACT_KILL_RANK,
    ACT_NONE,
    ACT_STOP_JOB,
    CRASH_LOOP,
    NODE_FAULT,
    RANK_DEAD,
    RANK_HUNG,
    Decision,
    Finding,
)
from .policy import IncidentInfo, JobView, PolicyConfig, PolicyView, decide
from .restart_phases import milestones, parse_lines, phases
from .scheduler import Scheduler, SchedulerConfig
from .stacks import StackBudget
from .state import LIVE_STATES, ClusterObs, RankObs
from .store import ActionExists, IncidentStore, InvalidTransition
from .tokens import AgentTokens

log = logging.getLogger("rankguard.supervisor")

EV_RESTART_PHASES = "restart phases"  # timeline event: restart_phases.phases() of a restart
EV_SAVE_REQUESTED = "save requested"  # predictive drain asked the jobs on the node to save
PHASES_WAIT_SECONDS = 60.0  # how long after a restart its workers' milestones are awaited


def _restart_through_any(obs: ClusterObs, ranks: list[RankObs], reason: object) -> dict:
    """`restart_via` the lowest live rank of a hang nothing names a culprit for."""
    live = [r for r in ranks if r.state == "alive"]
    if not live:
        return {}
    via = restart_via(obs, live)
    return {
        "culprit_reason": f"{reason}; no stack singled out a rank either: restart the job "
        f"through rank {via['rank']}",
        "restart_via": via,
    }


def _drained(result: object) -> bool:
    """Whether an exclusion's result (read back from etcd: any JSON) says the scheduler
    drained the node."""
    scheduler = result.get("scheduler") if isinstance(result, dict) else None
    return isinstance(scheduler, dict) and scheduler.get("ok") is True


def _unnamed_process_hang(f: Finding) -> bool:
    """A hang of ranks without telemetry that neither the process table nor the stacks pin
    on one rank: idle CPU alone is weak evidence (ranks may all wait on I/O or sleep), so it
    is not an incident until a culprit is named (detectors/process_hang.py). Their flight
    recorders' agreement is strong evidence: that one stands, restarted through a rank."""
    return (
        f.kind == RANK_HUNG
        and f.rank is None
        and f.evidence.get("source") == "process"
        and "wavefront" not in f.evidence
    )


def fault_point(name: str) -> None:
    """Die here, as a crash would (SIGKILL, nothing flushed), when
    RANKGUARD_SUPERVISOR_FAULT names this point: the restart tests kill the supervisor at
    each step of a recovery. Points: mid_pass, before_action, after_action, during_restart."""
    if os.environ.get("RANKGUARD_SUPERVISOR_FAULT") == name:
        log.error("fault point %s: killing the supervisor", name)
        os.kill(os.getpid(), signal.SIGKILL)


# An answer older than this is the last one of an agent that stopped answering (a cut
# link shows a node's last answer, aged, until the request times out): never kill a rank
# seen only there. In a partition that answer holds the cut-off rank at a lower step, and
# acting on it failed (unreachable) and left the hang to a second incident. So is an
# answer that lags the freshest node's by more than LAG_SECONDS: a hang found within two
# seconds of a cut (a budget of one second) once blamed the cut-off rank on an answer not
# yet two seconds old, while every other agent had answered since.
STALE_ANSWER_SECONDS = 2.0
LAG_SECONDS = 0.75


def _seen_only_stale(target: Mapping, obs: ClusterObs) -> bool:
    node = next((n for n in obs.nodes if n.node == target.get("node")), None)
    if node is None:
        return False  # resolved when carried out (and failed there if it is gone)
    freshest = max((n.observed_at for n in obs.nodes if n.reachable), default=node.observed_at)
    return (not node.reachable or obs.time - node.observed_at > STALE_ANSWER_SECONDS
            or freshest - node.observed_at > LAG_SECONDS)  # fmt: skip


# Detectors that judge each rank by its state (a comparison or two a rank): every pass, so
# a death is recorded one pass after it is seen. The others read every rank's step
# window (statistics over 8,192 ranks x 64 samples at 1,024 nodes: ~1 s of CPU a pass);
# they are paced (`Supervisor._window_due`) and their findings carried between runs.
# Which is which, each detector's registration says (`every_pass`).
EVERY_PASS = frozenset(d.name for d in REGISTRY if d.every_pass)


def _finding_of(inc) -> Finding:
    """The finding an incident was recorded from (to replay its action)."""
    return Finding(inc.kind, inc.key, inc.severity, inc.summary, inc.job, inc.node, inc.rank,
                   inc.occurred_at, dict(inc.evidence))  # fmt: skip


def _still_waiting(action, inc, obs: ClusterObs) -> bool | None:
    """Whether a pending action's target is still as it was when the intent was written
    (True: carry it out now), gone (False), or out of view (None: wait)."""
    t = action.target
    if action.kind == ACT_KILL_RANK:
        rank = next((r for r in obs.current_ranks(t.get("job")) if r.rank == t.get("rank")), None)
        if rank is None:
            return None
        same = rank.pid == t["pid"] if "pid" in t else rank.restart == inc.restart_before
        return same and rank.state in LIVE_STATES
    if action.kind == ACT_STOP_JOB:
        return any(r.state in LIVE_STATES for r in obs.current_ranks(t.get("job")))
    if action.kind == ACT_EXCLUDE_NODE:
        node = next((n for n in obs.nodes if n.node == t.get("node")), None)
        if node is None or not node.reachable:
            return None
        return any(r.state in LIVE_STATES for r in node.ranks)
    return False


@dataclass
class SupervisorConfig:
    interval: float = 0.25
    agent_timeout: float = 2.0
    cpu_share: float = 0.5  # cores, over a pass and its pause (config.py LoopSettings)
    detectors: DetectorConfig = field(default_factory=DetectorConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    startup_trace: str = ""  # the workers' startup milestones ([supervisor] startup_trace)
    # how long a pass waits for the stacks it asked for: the rest come to a later pass. A
    # stacks request to an agent behind a cut link waits out its 30 s timeout, and the
    # loop once stood still that long, on the partitioned node it was meant to notice
    stacks_wait: float = 2.0
    # Two or more supervisors, one acting (leadership.py): the etcd members they share
    # (`etcd://M1,M2,M3`; empty: this one acts alone), this one's name, the lease's seconds
    etcd: str = ""
    name: str = ""
    lease_seconds: int = 5


@dataclass(frozen=True)
class _PhaseWatch:
    """A restart whose phases are not in its incident's timeline yet."""

    job: str
    incarnation: int
    world_size: int
    doomed_at: float  # the fault (a dead rank) or our kill
    old_exited_at: float | None  # the old group's last exit, as the agents saw it
    until: float


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
        # each agent's rank state changes, long-polled: a death starts a state-only pass
        # at once instead of waiting for the node's next sample poll (docs/scaling.md)
        self.events = EventWatch()
        self.event_passes = 0
        # (job, incarnation) an event pass applied a death of, oldest first (bounded)
        self._event_judged: dict[tuple[str, int | None], None] = {}
        self.history = History()
        self.last_obs: ClusterObs | None = None
        self.jobs: dict[str, JobProgress] = store.jobs()  # goes on from a previous life
        self.loop_seconds = 0.0
        self.passes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.clock = time.time
        self.monotonic = time.monotonic  # paces stack captures (a test may drive it)
        self.stack_budget = StackBudget()  # py-spy dumps: bounded per pass, per rank backoff
        # captures in flight, answered off the loop's thread (stacks_wait)
        self._stack_pool = BackgroundCalls(16, "rankguard-stacks")
        self._broadcast_pool = BackgroundCalls(32, "rankguard-stop")  # a stop to every node
        self._stack_requests: dict[tuple[str, int, int], Future] = {}
        self._stacks_deadline = 0.0
        self.service = None  # its HTTP service once serving (supervisor/daemon.py)
        self.scheduler = Scheduler(cfg.scheduler, store.path)  # drains, resumes nodes
        self._phase_watch: dict[int, _PhaseWatch] = {}  # incident id -> restart awaited
        # (job, incarnation) -> its ranks' last exit seen: an agent replaces a rank's row
        # when the next incarnation's rank registers, so the old exits are noted as seen
        self._exits: dict[tuple[str, int], dict[int, float]] = {}  # rank -> exited_at
        # the window detectors' last findings by detector, when they may next run, and the
        # incarnations they judged (a new one runs them at once)
        self._window_findings: dict[str, list[Finding]] = {}
        self._window_next = 0.0
        self._window_restarts: dict[str, int] | None = None
        self._pass_started = 0.0
        self._credit = 0.0  # CPU seconds the share allowed and the loop did not use
        self._credit_cap = max(1.0, cfg.cpu_share * 2)
        self.heap = HeapPacer()  # full collections paced (heap.py)
        self.leadership: Leadership | None = None  # None: the only supervisor, always acting
        self.intents: SharedIntents | None = None
        self._watch: Watch | None = None
        if cfg.etcd:
            client = EtcdClient(parse_endpoints(cfg.etcd), timeout=ETCD_CALL_SECONDS)
            name = cfg.name or f"{socket.gethostname()}:{os.getpid()}"
            self.leadership = Leadership(client, name, cfg.lease_seconds)
            self.intents = SharedIntents(client)
            self._watch = Watch(self.leadership, self.intents).start()
        self.leading = self.leadership is None

    def clients(self) -> list[AgentClient]:
        return [self.client_for(u) for u in self._urls()]

    def client_for(self, node_url: str) -> AgentClient:
        return AgentClient(node_url, self.tokens.for_url(node_url), self.cfg.agent_timeout)

    # -- one pass -----------------------------------------------------------------
    def reconcile_once(self, now: float | None = None) -> list[Decision]:
        start = time.perf_counter()
        self._pass_started = time.monotonic()
        clients = self.clients()
        self.events.sync(clients)
        obs = self.poller.poll(clients, now, self._await_polls)  # observe
        return self._pass(obs, start)

    def _await_polls(self, futures: list, seconds: float) -> None:
        """Wait up to `seconds` for this round's answers, running an event pass whenever a
        death is announced meanwhile: a death otherwise waited for the end of the round
        (docs/scaling.md)."""
        deadline = time.monotonic() + seconds
        left = [len(futures)]
        lock, done = threading.Lock(), threading.Event()

        def one(_) -> None:  # on the poll loop's thread
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
                    self.events.wake.set()

        if not futures:
            done.set()
        for f in futures:
            f.add_done_callback(one)
        while not done.is_set() and not self._stop.is_set():
            wait = deadline - time.monotonic()
            if wait <= 0:
                return
            self.events.wake.wait(wait)
            if self.events.settle() and not self._stop.is_set():
                try:
                    self.reconcile_events()
                except Exception:  # the round goes on
                    log.exception("event pass failed")

    def reconcile_events(self) -> list[Decision]:
        """A state-only pass on the deaths the agents announced since the last one: each
        applied to its node as last seen (events.py), then the per-pass detectors (dead,
        ...), record, policy and action, without waiting for the next round of polls."""
        with self._lock:
            last = self.last_obs
        if last is None:
            return []
        start = time.perf_counter()
        patched = self._with_announced_deaths(last)
        if patched is None:
            return []  # seen already by a poll, or of ranks not in view yet
        return self._pass(patched, start, state_only=True)

    def _with_announced_deaths(self, obs: ClusterObs) -> ClusterObs | None:
        """`obs` (the newest view: the last pass's, or the one a full pass is judging) with
        the deaths announced since they were last taken applied to their nodes; None when
        none is news (counted in `event_passes` otherwise: the pass judging it is one).
        Deaths of an incarnation judged already are its teardown (torchrun ends the other
        ranks at once): the next poll shows them, and at 1,024 nodes a pass for each
        agent's news cost seconds of CPU (docs/scaling.md)."""
        judged = self._event_judged
        deaths = [(u, e) for u, e in self.events.take() if (e.job, e.restart) not in judged]
        if not deaths:
            return None
        now = time.time()
        by_url: dict[str, list] = {}
        for url, event in deaths:
            by_url.setdefault(url, []).append(event)
        nodes, changed = [], False
        for n in obs.nodes:
            base = self.poller._last.get(n.url) if n.url in by_url and n.reachable else None
            if base is not None and base.node == n.node:
                patched = apply_deaths(base, by_url[n.url])
                if patched is not base:
                    for e in by_url[n.url]:
                        if e.restart is not None:
                            judged[e.job, e.restart] = None
                    # kept until the agent's next answer replaces it, so the next pass
                    # does not see the rank alive again
                    self.poller._last[n.url] = patched
                    n, changed = patched.aged(now), True
            nodes.append(n)
        while len(judged) > 256:  # a few incarnations per job are enough
            del judged[next(iter(judged))]
        if not changed:
            return None
        self.event_passes += 1
        return ClusterObs(time=now, nodes=tuple(nodes))

    def _pass(self, obs: ClusterObs, start: float, state_only: bool = False) -> list[Decision]:
        full = not state_only
        leading = self._lead(obs.time)
        # intents a previous life (or the leader before) recorded and did not finish
        outcomes = self._replay(obs) if leading else []
        # A death announced while a full pass polls or detects is judged in this pass, on
        # its view, before anything is recorded: a full pass at 1,024 nodes takes about a
        # second, and a death waited for its end (docs/scaling.md). The window detectors
        # then wait a pass (their findings are carried), as in an event pass.
        if full and (patched := self._with_announced_deaths(obs)) is not None:
            obs, state_only = patched, True
        findings = self._detect(obs, state_only)  # detect
        if not state_only and (patched := self._with_announced_deaths(obs)) is not None:
            obs, state_only = patched, True
            findings = self._detect(obs, state_only)  # the state detectors again, on it
        now = obs.time  # after the poll: nothing is detected before it is seen
        findings, steps = attribute(findings, self.store.open_incidents())
        self._record(findings, steps, obs, now)  # record what was seen
        if any(f.kind in RECOVERING_KINDS for f in findings):
            fault_point("mid_pass")  # a fault seen and recorded, not yet decided
        checkpoints = {j: self._checkpoint_step(obs, j) for j in obs.jobs()}
        view = build_policy_view(self.store, findings, self.cfg.policy, now, checkpoints,
                                 len(obs.nodes))  # fmt: skip
        decisions = decide(findings, view, self.cfg.policy, now)  # decide
        if not leading:  # a standby decides as the leader would, and leaves the acting to it
            decisions = [d for d in decisions if d.action == ACT_NONE and not d.target]
        outcomes += [o for d in decisions if (o := self._act(d, obs, now)) is not None]  # act
        self._request_saves(decisions, obs, now)
        held = {k for d in self.cfg.detectors.REGISTRY if d.holds for k in d.holds(self.history)}
        moves = transitions(self.store.open_incidents(), decisions, outcomes, findings, obs, held)
        for t in moves:  # record what it meant
            if "restarted_at" in t.values:
                fault_point("during_restart")  # the group restarted; not yet recorded
            try:
                self.store.apply(t, now)
            except InvalidTransition as exc:  # a rule's bug must not cost the other moves
                log.error("lifecycle: %s", exc)
        self._restart_phases(moves, obs, now)
        self._track_progress(obs, now)
        self.scheduler.observe(obs, act=leading)
        with self._lock:
            self.last_obs = obs
            if full:  # the loop's figures are of the full passes
                self.loop_seconds = time.perf_counter() - start
                self.passes += 1
        return decisions

    def _detect(self, obs: ClusterObs, state_only: bool = False) -> list[Finding]:
        self.stack_budget.new_pass(self.monotonic())
        self._collect_stacks()  # answers to earlier passes, late ones too
        cfg = self.cfg.detectors
        restarts = obs.newest_restarts()
        # an announced death waiting is served first (the pass ends sooner without the
        # window detectors; they are due again next pass): at 1,024 nodes they take most
        # of a second, and a death waited for them (docs/scaling.md)
        window = not state_only and self._window_due(restarts) and not self.events.settle()
        cpu = time.process_time()
        self.history = (advance if window else advance_every_pass)(self.history, obs, cfg)
        registry = cfg.REGISTRY  # the detectors these settings are of
        every = {d.name: run_all(obs, self.history, cfg, ((d.name, d.detect),))
                 for d in registry if d.every_pass}  # fmt: skip
        complete = window
        for d in registry if window else ():
            if d.every_pass:
                continue
            if self.events.settle():  # a death came meanwhile: the rest wait a pass
                complete = False
                break
            self._window_findings[d.name] = run_all(obs, self.history, cfg, ((d.name, d.detect),))
        found: list[Finding] = []
        for d in registry:  # in their order, as run_all
            found += every[d.name] if d.every_pass else self._window_findings.get(d.name, [])
        if complete:
            # at most half the CPU share for the window detectors: the rest is the
            # polls' and the per-pass detectors' (a death's time to incident)
            # (while that fits in an interval, as on small clusters: every pass)
            cost = time.process_time() - cpu
            spacing = 2 * cost / self.cfg.cpu_share
            self._window_next = self._pass_started + spacing if spacing > self.cfg.interval else 0.0
            self._window_restarts = restarts
            self._credit_cap = max(self._credit_cap, 1.5 * cost)
        self._stacks_deadline = time.monotonic() + self.cfg.stacks_wait
        refined = [self._refine(f, obs) for f in found]
        return [f for f in refined if not _unnamed_process_hang(f)]

    def _window_due(self, restarts: dict[str, int]) -> bool:
        """Whether the window detectors run this pass: when their pace allows, and at once
        when a job's incarnation changed (their carried findings are of the old one)."""
        return time.monotonic() >= self._window_next or restarts != self._window_restarts

    def _refine(self, finding: Finding, obs: ClusterObs) -> Finding:
        """A hang without a culprit yet: read every rank's stacks and pick the odd one out."""
        if finding.kind != RANK_HUNG or finding.rank is not None:
            return finding
        if not finding.evidence.get("stacks_needed", True):
            return finding  # explained without stacks (ranks behind an unreachable agent)
        existing = self.store.by_key(finding.key)
        if existing is not None and existing.rank is not None:
            # the stacks that named it stay in the incident: a pass that re-emits the
            # carried finding (an event pass, a paced one) would otherwise overwrite them
            kept = {k: existing.evidence[k] for k in ("stacks", "culprit_reason")
                    if k in existing.evidence and k not in finding.evidence}  # fmt: skip
            evidence = {**finding.evidence, **kept}
            return dataclasses.replace(
                finding, rank=existing.rank, node=existing.node, evidence=evidence
            )
        budget, ranks = self.stack_budget, obs.current_ranks(finding.job)
        keys = {(r.job, r.rank, r.pid): r for r in ranks}
        asked = []  # this pass's captures: one still out from an earlier pass is not waited for
        for key, r in keys.items():
            if key not in self._stack_requests and budget.may_capture(key, self.monotonic()):
                budget.start(key, self.monotonic())
                client = self.client_for(self._url_of(obs, r))
                asked.append(self._stack_pool.submit(client.stacks, *key[:2]))
                self._stack_requests[key] = asked[-1]
        wait(asked, timeout=max(0.0, self._stacks_deadline - time.monotonic()))
        self._collect_stacks()
        stacks, nodes = {}, {}
        for key, r in keys.items():
            if (dump := budget.dump(key)) is not None:
                stacks[r.rank], nodes[r.rank] = dump, r.node
        if any(k in self._stack_requests or not budget.tried(k) for k in keys):
            # some ranks wait for a later pass's budget or answer: blame no rank on part of
            # the picture
            return dataclasses.replace(finding, evidence={**finding.evidence, "stacks": stacks})
        culprit = pick_culprit_from_stacks(stacks)
        evidence = {**finding.evidence, "stacks": stacks}
        if culprit is None and wavefront_awaited(stacks, evidence, obs.time - finding.occurred_at):
            return dataclasses.replace(finding, evidence=evidence)  # a later pass decides
        if culprit is None:
            # every rank's stack read and none singled out: the evidence is kept, and the job
            # restarts through one rank rather than wait for the watchdog's timeout
            evidence.update(_restart_through_any(obs, ranks, evidence.get("culprit_reason")))
            return dataclasses.replace(finding, evidence=evidence)
        evidence["culprit_reason"] = "its stack is the only one not waiting in a collective"
        return dataclasses.replace(finding, rank=culprit, node=nodes[culprit], evidence=evidence)

    def _collect_stacks(self) -> None:
        """The captures answered since the last look, into the budget's dumps."""
        for key, future in list(self._stack_requests.items()):
            if not future.done():
                continue
            del self._stack_requests[key]
            try:
                dump = future.result()["stacks"]
            except Exception as exc:  # refused, timed out, garbled: a later pass asks again
                log.warning("stacks of rank %s: %s", key[1], exc)
                dump = None
            self.stack_budget.finish(key, self.monotonic(), dump)

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
        # its current ranks first, then any of its processes in view: the incarnation that
        # just died still shows what it reported (a death judged after torchrun restarted,
        # detectors/dead.py), while the history is updated on window passes only
        for ranks in (obs.current_ranks(job), obs.ranks(job)):
            reported = max((r.checkpoint_step for r in ranks if r.checkpoint_step is not None),
                           default=None)  # fmt: skip
            if reported is not None:
                return reported
        progress = self.history.checkpoint_progress.get(job)
        return progress[0] if progress else None

    def _record(self, findings: list[Finding], steps: list, obs: ClusterObs, now: float) -> None:
        for finding in findings:
            ranks = obs.current_ranks(finding.job) if finding.job else []
            restart = max((r.restart for r in ranks), default=None)
            if finding.kind == RANK_DEAD and isinstance(finding.evidence.get("restart"), int):
                # the incarnation that died: older than the current one when the death is
                # judged after torchrun restarted (detectors/dead.py), and the incident is
                # restarted once a newer one than it shows
                restart = finding.evidence["restart"]
            incident, created = self.store.upsert_finding(
                finding, now,
                restart_before=restart,
                # a zero-code worker reports no step: its optimizer's count, else unknown
                step_at_detect=max((s for r in ranks if (s := known_step(r)) is not None),
                                   default=None),
                checkpoint_step=self._checkpoint_step(obs, finding.job),
            )  # fmt: skip
            if created:
                log.warning("incident %s: %s", incident.id, finding.summary)
        for incident, finding in steps:  # our own action's consequence: a step, not an alert
            if not self.store.has_event(incident.id, EV_CAUSED_DEATH):
                detail = {"rank": finding.rank, "node": finding.node, "summary": finding.summary}
                self.store.add_event(incident.id, EV_CAUSED_DEATH, now, detail)

    # -- act ----------------------------------------------------------------------
    def _act(self, decision: Decision, obs: ClusterObs, now: float) -> Outcome | None:
        """Carry out one decision: the intent is written first (never twice per incident),
        then the action; its outcome goes to `lifecycle.transitions`."""
        f = decision.finding
        if decision.action == ACT_NONE:
            return None
        incident = self.store.by_key(f.key)
        if incident is None:  # a finding the policy made itself (crash loop)
            incident, _ = self.store.upsert_finding(
                f, now, checkpoint_step=f.evidence.get("checkpoint_step")
            )
        target = self._pin(decision, obs)
        if decision.action == ACT_KILL_RANK and _seen_only_stale(target, obs):
            log.info("incident %s: %s waits for a fresh answer from %s",
                     incident.id, decision.action, target.get("node"))  # fmt: skip
            return None  # decided again next pass; the incident stays open
        if not self._claim(f.key, decision.action, target, now):
            return None  # another supervisor's, or etcd out of reach: decided again next pass
        try:
            action_id = self.store.begin_action(
                incident.id, decision.action, target, now, reason=decision.reason
            )
        except ActionExists:
            return None  # acted already (maybe in our previous life): never twice
        fault_point("before_action")
        return self._carry_out(
            action_id, incident.id, dataclasses.replace(decision, target=target), obs
        )

    def _carry_out(self, action_id: int, incident_id: int, decision: Decision, obs) -> Outcome:
        try:
            result = self._execute(decision, obs, incident_id)
        except (AgentError, StopIteration, KeyError) as exc:
            log.error("action %s for incident %s failed: %r", decision.action, incident_id, exc)
            self._complete(action_id, decision, False, error=repr(exc))
            return Outcome(incident_id, decision.action, False, decision.reason, repr(exc))
        fault_point("after_action")
        self._complete(action_id, decision, True, result=result)
        log.warning("incident %s: %s (%s)", incident_id, decision.action, decision.reason)
        stacks = bool(result.get("stacks")) or "stacks" in decision.finding.evidence
        return Outcome(incident_id, decision.action, True, decision.reason, stacks=stacks)

    def _request_saves(self, decisions: list[Decision], obs: ClusterObs, now: float) -> None:
        """Predictive drain's "save now" (policy._failing): each job the drain waits for is
        asked once per incident to save at a step, through every agent with ranks of it."""
        for d in decisions:
            saves = d.target.get("save")
            inc = self.store.by_key(d.finding.key) if saves else None
            if inc is None or self.store.has_event(inc.id, EV_SAVE_REQUESTED):
                continue
            detail = {job: self._request_save(SaveRequest(job, want["restart"], want["step"],
                                                          d.finding.summary[:200]), obs)
                      for job, want in sorted(saves.items())}  # fmt: skip
            self.store.add_event(inc.id, EV_SAVE_REQUESTED, now, detail)
            log.warning("incident %s: save requested: %s", inc.id, detail)

    def _request_save(self, request: SaveRequest, obs: ClusterObs) -> dict:
        """Every rank must save at the same step (a sharded save is a collective): a job
        with ranks out of view is not asked, and a request one agent refused is withdrawn
        from the others."""
        ranks = [r for r in obs.current_ranks(request.job)
                 if r.restart == request.restart and not r.dead]  # fmt: skip
        nodes = {r.node for r in ranks}
        urls = sorted(n.url for n in obs.nodes if n.node in nodes)
        world = max((r.world_size for r in ranks), default=0)
        out: dict = {"step": request.step, "restart": request.restart, "agents": 0}
        if len({r.rank for r in ranks}) < world or not ranks:
            return {**out, "error": "not every rank of the incarnation is in view"}
        asked, errors = [], {}
        for url in urls:
            try:
                self.client_for(url).request_save(request)
                asked.append(url)
            except AgentError as exc:
                errors[url] = str(exc)
        if errors:
            for url in asked:
                with contextlib.suppress(AgentError):
                    self.client_for(url).request_save(dataclasses.replace(request, step=None))
            return {
                **out,
                "error": "withdrawn: " + "; ".join(f"{u}: {e}" for u, e in errors.items()),
            }
        return {**out, "agents": len(asked)}

    # -- leadership: one of several supervisors acts (leadership.py) ---------------------
    def _lead(self, now: float) -> bool:
        """Renew the lease; a new leader adopts the intents its predecessor left unfinished
        (the replay finishes them), a standby copies the finished ones into its database."""
        if self.leadership is None or self._watch is None:
            return True
        was, self.leading = self.leading, self.leadership.acting()
        if self.leading != was:
            log.warning("supervisor %s: %s (leader: %s)", self.leadership.name,
                        "leading" if self.leading else "standing by",
                        self.leadership.holder or "none")  # fmt: skip
        for intent in self._watch.take():
            if intent.done or self.leading:
                self._adopt(intent, now)
        return self.leading

    def _adopt(self, intent: Intent, now: float) -> None:
        """An intent of another supervisor, into this database once: a finished one with its
        outcome; an unfinished one pending, for the replay."""
        key = intent_key(intent.incident_key, intent.kind)
        inc = None if key in self.intents.adopted else self.store.by_key(intent.incident_key)
        if inc is None:
            return  # copied already, or an incident this supervisor has not seen (yet)
        self.intents.adopted.add(key)
        try:
            action_id = self.store.begin_action(inc.id, intent.kind, intent.target,
                                                intent.requested_at, reason=f"by {intent.leader}")  # fmt: skip
        except ActionExists:  # its own attempt (cut off mid-action?), or copied before
            mine = next(a for a in self.store.actions(inc.id) if a.kind == intent.kind)
            if intent.done and intent.ok and mine.ok is not True:  # finished by another
                self.store.complete_action(mine.id, True, now, result={"by": intent.leader,
                                                                       "result": intent.result})  # fmt: skip
            return
        if intent.done:
            self.store.complete_action(action_id, bool(intent.ok), now, result=intent.result,
                                       error=intent.error)  # fmt: skip
            if intent.kind == ACT_EXCLUDE_NODE and _drained(intent.result):  # theirs to resume
                self.scheduler.remember(str(intent.target.get("node")), f"by {intent.leader}: "
                                        f"{inc.summary}", intent.requested_at)  # fmt: skip

    def _claim(self, incident_key: str, kind: str, target: dict, now: float) -> bool:
        """Write the intent where every supervisor reads it, first: False when another has
        one for this incident and kind, or etcd cannot be reached (never act unrecorded)."""
        if self.intents is None or self.leadership is None:
            return True
        if not self.leadership.acting():
            return False  # the lease may have run out since the pass began
        intent = Intent(incident_key, kind, dict(target), self.leadership.name, now)
        try:
            other = self.intents.claim(intent)
        except EtcdError as exc:
            log.warning("intent for %s not recorded (%s): not acting", incident_key, exc)
            return False
        if other is not None and other.leader != self.leadership.name:
            log.warning("incident %s: %s is %s's", incident_key, kind, other.leader)
            return False
        return True

    def _complete(self, action_id: int, decision: Decision, ok: bool, *, result=None,
                  error: str | None = None) -> None:  # fmt: skip
        now = time.time()
        action = self.store.complete_action(action_id, ok, now, result=result, error=error)
        if self.intents is None or self.leadership is None:
            return
        intent = Intent(decision.finding.key, decision.action, dict(action.target),
                        self.leadership.name, action.requested_at, True, ok, result, error)  # fmt: skip
        try:
            self.intents.complete(intent)
        except EtcdError as exc:  # the adopting supervisor's replay finds the target gone
            log.warning("outcome of %s not shared (%s)", decision.finding.key, exc)

    @staticmethod
    def _pin(decision: Decision, obs: ClusterObs) -> dict:
        """The kill target as it is now: its process and incarnation go into the intent,
        so a restarted supervisor can tell whether the kill already happened."""
        t = dict(decision.target)
        if decision.action == ACT_KILL_RANK:
            rank = next((r for r in obs.current_ranks(t.get("job")) if r.rank == t.get("rank")),
                        None)  # fmt: skip
            if rank is not None:
                t.update(pid=rank.pid, restart=rank.restart, node=rank.node)
        return t

    # -- replay: the intent log after a crash ----------------------------------------------
    def _replay(self, obs: ClusterObs) -> list[Outcome]:
        """Actions a previous supervisor recorded and never completed (it died between the
        intent and the outcome): done now if their target is still as it was, else marked
        done (the target is gone: the action took effect before the crash, or the fault
        ended it). Never twice: a kill reaches the very process it was meant for or none."""
        out = []
        for a in self.store.pending_actions():
            inc = self.store.get(a.incident_id)
            if inc is None:
                continue
            waiting = _still_waiting(a, inc, obs)
            if waiting is None:
                continue  # the target is out of view this pass: decide when it is seen
            decision = Decision(_finding_of(inc), a.kind, inc.action_reason or "", a.target)
            if waiting:
                log.warning("incident %s: replaying %s left pending by a crash", inc.id, a.kind)
                out.append(self._carry_out(a.id, inc.id, decision, obs))
                continue
            result = {"replayed": "the target was already gone; nothing done again"}
            self._complete(a.id, decision, True, result=result)
            out.append(Outcome(inc.id, a.kind, True, decision.reason))
        return out

    def _execute(self, decision: Decision, obs: ClusterObs, incident_id: int) -> dict:
        t, f = decision.target, decision.finding
        if decision.action == ACT_KILL_RANK:
            rank = next(r for r in obs.current_ranks(t["job"]) if r.rank == t["rank"])
            client = self.client_for(self._url_of(obs, rank))
            result: dict = {}
            if f.kind == RANK_HUNG and "stacks" not in f.evidence:
                # the culprit's stacks, before it is gone; an agent slow to answer does
                # not hold the kill back
                capture = self._stack_pool.submit(client.stacks, rank.job, rank.rank)
                try:
                    result["stacks"] = {rank.rank: capture.result(self.cfg.stacks_wait)["stacks"]}
                except AgentError as exc:
                    result["stacks_error"] = str(exc)
                except TimeoutError:
                    result["stacks_error"] = f"no answer within {self.cfg.stacks_wait:g} s"
            result["signal"] = client.signal(rank.job, rank.rank, "SIGKILL")
            return result
        # stop_job: every node of the job; exclude_node: that node, every job on it
        if decision.action == ACT_STOP_JOB:  # dead ranks too: their launcher may restart them
            targets = {(r.node, r.job) for r in obs.current_ranks(t["job"])}
        else:
            targets = {(r.node, r.job) for r in obs.ranks() if r.node == t["node"] and not r.dead}
        cause = classify(f)  # the launchers' exit codes say it (contract/exit_codes.py)
        status = {"cause": cause.cause, "confidence": cause.confidence, "why": cause.why[:500],
                  "action": decision.action, "incident": incident_id,
                  "repeated": f.kind == CRASH_LOOP}  # fmt: skip
        # every node at once: one after the other, a job on 4,096 nodes took seconds to
        # stop (and an agent timing out held the rest back)
        urls = {n.node: n.url for n in obs.nodes}
        calls = {f"{node}/{job}": self._broadcast_pool.submit(
                     self.client_for(urls[node]).stop_job, job, status)
                 for node, job in sorted(targets)}  # fmt: skip
        wait(calls.values())
        # an agent's error fails the action, as before; the others have stopped meanwhile
        results = {key: call.result() for key, call in calls.items()}
        if decision.action == ACT_EXCLUDE_NODE and f.kind == NODE_FAULT:
            results["scheduler"] = self.scheduler.exclude(t["node"], f.summary)
        return results

    # -- each restart's phases, from the workers' startup milestones ---------------------
    def _restart_phases(self, moves, obs: ClusterObs, now: float) -> None:
        """Watch each restart this pass recorded; once every new worker has written its
        milestones up to its first step, add the phases to the incident's timeline. The
        old ranks' exit times are taken now, while the agents still show them."""
        if not self.cfg.startup_trace:
            return
        for r in obs.ranks():
            if r.exited_at is not None:
                self._exits.setdefault((r.job, r.restart), {})[r.rank] = r.exited_at
        newest: dict[str, int] = {}
        for job, restart in self._exits:
            newest[job] = max(newest.get(job, restart), restart)
        for job, restart in list(self._exits):  # bounded: a few incarnations per job
            if restart < newest[job] - 3:
                del self._exits[job, restart]
        for t in moves:
            restarted = next((d for what, d in t.events if what == EV_RESTARTED), None)
            inc = self.store.get(t.incident_id) if restarted else None
            if inc is None or inc.job is None or inc.id in self._phase_watch:
                continue
            new = [r for r in obs.current_ranks(inc.job) if r.restart == restarted["restart"]]
            doomed = inc.acted_at or inc.occurred_at or inc.detected_at
            if new:
                world = max(r.world_size for r in new)
                # the old group's end: only when every old rank's exit was seen
                exits = self._exits.get((inc.job, inc.restart_before), {})
                ended = max(exits.values()) if len(exits) >= world else None
                self._phase_watch[inc.id] = _PhaseWatch(inc.job, restarted["restart"], world,
                                                        doomed, ended, now + PHASES_WAIT_SECONDS)  # fmt: skip
        if not self._phase_watch:
            return
        try:
            with open(self.cfg.startup_trace, errors="replace") as f:
                lines = parse_lines(f.read())
        except OSError:
            lines = []
        for iid, w in list(self._phase_watch.items()):
            m = milestones(lines, w.job, w.incarnation, w.world_size)
            if m is not None:
                detail = {"incarnation": w.incarnation,
                          **phases(w.doomed_at, w.old_exited_at, m)}  # fmt: skip
                self.store.add_event(iid, EV_RESTART_PHASES, now, detail)
            elif now < w.until:
                continue
            else:
                log.warning("incident %d: no startup milestones of incarnation %d of %s in %s",
                            iid, w.incarnation, w.job, self.cfg.startup_trace)  # fmt: skip
            del self._phase_watch[iid]

    # -- the job: state and goodput, kept in the store --------------------------------------
    def _track_progress(self, obs: ClusterObs, now: float) -> None:
        incidents = self.store.open_incidents() + self.store.stopped_incidents()
        # a job out of view keeps its state (finished stays finished), unless it was stopped
        stopped = {i.job for i in incidents if i.state == "stopped"} & set(self.jobs)
        for job in sorted(set(obs.jobs()) | stopped):
            old = self.jobs.get(job) or JobProgress(job, first_seen=now)
            p = advance_progress(old, obs)
            state, verdict = job_state(p, incidents, obs)
            p = dataclasses.replace(p, state=state, verdict=verdict)
            if p != old or job not in self.jobs:
                self.store.save_job(p, now)
                self.jobs[job] = p

    # -- run ----------------------------------------------------------------------
    def run(self) -> None:
        # CPU is counted from one pause to the next: the poll thread goes on parsing
        # answers during a pause, and counting only the pass itself let the supervisor
        # use 0.61 cores at 1,024 nodes under a 0.5 share (bench/results/supervisor_scale.md)
        cpu_mark = time.process_time()
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.reconcile_once()
            except Exception:  # one bad pass must not end supervision
                log.exception("reconcile pass failed")
            self.heap.after_pass()
            mark = time.process_time()
            self._wait(self.pause(time.monotonic() - started, cpu_mark))
            cpu_mark = mark

    def _wait(self, seconds: float) -> None:
        """The pause between full passes, with a state-only pass whenever an agent
        announces a death (its CPU counts in the next pause's share)."""
        deadline = time.monotonic() + seconds
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self.events.wake.wait(left) and not self._stop.is_set():
                try:
                    self.reconcile_events()
                except Exception:
                    log.exception("event pass failed")

    def pause(self, elapsed: float, cpu_before: float) -> float:
        """Seconds to wait before the next pass: the rest of the interval, or longer when
        the loop has used more than `cpu_share` of a core (every thread of the process:
        the poll loop's parsing too). A credit of CPU time (the share's unused part, up to
        a bound a little above one window-detector run) lets a pass that runs the window
        detectors be followed by a short pause, while the average stays within the share."""
        share = self.cfg.cpu_share
        cpu = time.process_time() - cpu_before
        credit = getattr(self, "_credit", 0.0) + share * elapsed - cpu
        wait = max(0.0, self.cfg.interval - elapsed, -credit / share)
        self._credit = min(credit + share * wait, getattr(self, "_credit_cap", 2 * share))
        return wait

    def stop(self) -> None:
        self._stop.set()
        self.events.wake.set()

    def close(self) -> None:
        self.stop()
        if self._watch is not None:
            self._watch.stop()
            self.leadership.step_down()  # a standby leads at its next pass
        self.heap.close()
        self.events.close()
        self.poller.close()
        self._stack_pool.close()
        self._broadcast_pool.close()
        self.scheduler.close()


def build_policy_view(
    store: IncidentStore,
    findings: list[Finding],
    cfg: PolicyConfig,
    now: float,
    checkpoint_steps: Mapping[str, int | None] | None = None,
    nodes: int = 0,
) -> PolicyView:
    """The policy's plain-data picture, read from the store's queries: the incident (and
    its actions) of every finding key, plus, for every job the findings touch, its restart
    history, the restart actions within the budget window, its last stop and its newest
    validated checkpoint step now (`checkpoint_steps`, from the observation); the cluster's
    exclusions within the brake's window and its `nodes` in view."""
    checkpoint_steps = checkpoint_steps or {}
    incidents: dict[str, IncidentInfo] = {}
    for key in sorted({f.key for f in findings}):
        inc = store.by_key(key)
        if inc is not None:
            incidents[key] = IncidentInfo(inc.id, store.action_kinds(inc.id), inc.detected_at)
    jobs: dict[str, JobView] = {}
    for job in sorted({f.job for f in findings if f.job is not None}):
        for inc in store.crash_loops(job):  # so a stop already decided is not decided again
            incidents[inc.key] = IncidentInfo(inc.id, store.action_kinds(inc.id))
        jobs[job] = JobView(
            restarts=tuple(store.restart_history(job, limit=max(50, 4 * cfg.crash_loop_restarts))),
            restart_actions=tuple(store.restart_action_times(job, now - cfg.budget_window_seconds)),
            stopped_at=store.stopped_at(job),
            checkpoint_step=checkpoint_steps.get(job),
        )
    since = now - cfg.exclusion_window_seconds
    return PolicyView(incidents=incidents, jobs=jobs, exclusions=tuple(store.exclusions(since)),
                      nodes=nodes)  # fmt: skip
