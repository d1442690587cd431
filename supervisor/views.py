"""What the supervisor shows: the cluster verdict, ranks, incidents, and /metrics.

`cluster_verdict` is a pure function of the last observation, the job bookkeeping and the
open incidents; the others read the supervisor and its store.
"""

from __future__ import annotations

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import CollectorRegistry

from ..contract.errors import REASONS as CONTRACT_REASONS
from ..contract.metrics import JOB_LABEL
from ..service.httpd import REFUSALS
from ..service.version import VERSION
from .agents import REFUSED_ANSWERS
from .detectors import KINDS
from .lifecycle import JOB_STATES
from .stacks import SKIPS as STACK_SKIPS

VERDICTS = ("healthy", "degraded", "unhealthy")
TIME_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300)
# Incidents detected this recently keep a detection-time series: longer than any alert
# rule's window on it (dashboards/rules.py), short enough that old jobs' series go away.
RECENT_INCIDENT_SECONDS = 900.0


def _worst(a: str, b: str) -> str:
    return max(a, b, key=VERDICTS.index)


def cluster_view(sup) -> dict:
    """The verdict with reasons, per job and per node, of the supervisor as it is now."""
    with sup._lock:
        obs, loop_seconds = sup.last_obs, sup.loop_seconds
    open_ = sup.store.open_incidents() if obs is not None else []
    view = cluster_verdict(obs, dict(sup.jobs), open_, sup.clock(), loop_seconds)
    if sup.leadership is not None:  # one of several supervisors: who acts
        view["leadership"] = sup.leadership.view()
    return view


def cluster_verdict(obs, jobs: dict, open_incidents: list, now: float, loop_seconds=0.0) -> dict:
    """The cluster verdict as a pure function of the last observation, each job's progress
    (`lifecycle.JobProgress`) and the open incidents: healthy, degraded or unhealthy, with
    one reason per thing that made it so."""
    reasons: list[dict] = []
    status = "healthy"

    def add(severity: str, code: str, message: str) -> None:
        nonlocal status
        reasons.append({"severity": severity, "code": code, "message": message})
        status = _worst(status, severity)

    if obs is None:
        add("unhealthy", "no_observation", "the supervisor has not polled its agents yet")
        return {"status": status, "reasons": reasons, "jobs": {}, "nodes": []}
    for n in obs.nodes:
        if not n.reachable:
            add("degraded", "agent_unreachable", f"agent {n.url}: {n.error}")
        elif n.status in ("degraded", "unhealthy"):
            for r in n.reasons:
                add(n.status if r.get("severity") == "unhealthy" else "degraded",
                    f"node_{r.get('code')}", f"{n.node}: {r.get('message')}")  # fmt: skip
    out_jobs = {}
    for job, progress in sorted(jobs.items()):
        out_jobs[job] = {
            "state": progress.state,
            "verdict": progress.verdict,
            "goodput": progress.goodput(now),
            "first_seen": progress.first_seen,
            "useful_seconds": progress.useful_seconds,
            "max_step": progress.max_step,
            **_job_ranks(obs, job),
        }
        if progress.state == "stopped":
            add("unhealthy", "job_stopped", f"job {job} stopped: {progress.verdict}")
        elif progress.state == "recovering":
            add("degraded", "job_recovering", f"job {job} is recovering from a fault")
    for inc in open_incidents:
        if inc.kind in ("straggler", "checkpoint_stale") and inc.state in ("open", "reported"):
            add("degraded", inc.kind, inc.summary)
    return {"status": status, "reasons": reasons, "jobs": out_jobs, "nodes": _node_rows(obs),
            "loop_seconds": loop_seconds, "time": obs.time}  # fmt: skip


# One observation serves every read until the next pass: at 1,024 nodes building these
# rows was most of a /v1/cluster answer (bench/results/supervisor_scale.md). The memo holds
# the observation itself, so its id cannot be reused while it is cached.
_memo: dict[str, tuple[object, object]] = {}


def _per_obs(name: str, obs, build):
    cached = _memo.get(name)
    if cached is None or cached[0] is not obs:
        cached = _memo[name] = (obs, build(obs))
    return cached[1]


def _jobs_ranks(obs) -> dict[str, dict]:
    out = {}
    for job in obs.jobs():
        ranks = obs.current_ranks(job)
        out[job] = {
            "ranks": len(ranks),
            "world_size": max((r.world_size for r in ranks), default=0),
            "restart": max((r.restart for r in ranks), default=0),
            "newest_checkpoint_step": max((r.checkpoint_step or 0 for r in ranks), default=None),
        }
    return out


_NO_RANKS = {"ranks": 0, "world_size": 0, "restart": 0, "newest_checkpoint_step": None}


def _job_ranks(obs, job: str) -> dict:
    return dict(_per_obs("jobs", obs, _jobs_ranks).get(job, _NO_RANKS))


def _node_rows(obs) -> list[dict]:
    return _per_obs("nodes", obs, lambda obs: [
        {"node": n.node, "url": n.url, "reachable": n.reachable, "status": n.status,
         "error": n.error, "reasons": list(n.reasons), "ranks": len(n.ranks)}
        for n in obs.nodes
    ])  # fmt: skip


def ranks_view(sup) -> dict:
    obs = sup.last_obs
    ranks = [] if obs is None else obs.ranks()
    return {
        "ranks": [
            {"node": r.node, "job": r.job, "rank": r.rank, "restart": r.restart, "pid": r.pid,
             "state": r.state, "step": r.step, "phase": r.phase,
             "heartbeat_age_seconds": r.heartbeat_age_seconds, "step_seconds": r.step_seconds,
             "comm_compute_ratio": r.comm_compute_ratio, "loss": r.loss,
             "checkpoint_step": r.checkpoint_step, "source": r.source,
             "stand_in": None if r.stand_in_pid is None else {
                 "pid": r.stand_in_pid, "state": r.stand_in_state, "state_since": r.stand_in_since}}
            for r in sorted(ranks, key=lambda r: (r.job, r.rank))
        ]
    }  # fmt: skip


def incidents_view(sup, limit: int = 200) -> dict:
    """Newest first, each with its actions (results include captured stacks) and events."""
    out = []
    for inc in sup.store.list_incidents(limit=limit):
        d = inc.to_dict()
        d["actions"] = [a.to_dict() for a in sup.store.actions(inc.id)]
        d["events"] = [e.to_dict() for e in sup.store.events(inc.id)]
        out.append(d)
    return {"incidents": out}


def causes_view(sup) -> dict:
    """The interruptions-by-cause table (supervisor/causes.py), over every incident."""
    return {"causes": [t.to_dict() for t in sup.store.by_cause()]}


class SupervisorCollector:
    """Prometheus families built fresh from the store and the last pass on every scrape."""

    def __init__(self, sup):
        self.sup = sup

    def describe(self):
        return []

    def collect(self):
        sup = self.sup
        info = GaugeMetricFamily(
            "rankguard_supervisor_info", "The supervisor's version.", labels=["version"]
        )
        info.add_metric([VERSION], 1.0)
        yield info
        incidents = sup.store.list_incidents(limit=100_000)
        total = CounterMetricFamily(
            "rankguard_supervisor_incidents", "Incidents by kind.", labels=["kind"]
        )
        restarts = CounterMetricFamily(
            "rankguard_supervisor_restarts",
            "Job restarts that followed an incident, by kind.",
            labels=["kind"],
        )
        open_ = GaugeMetricFamily(
            "rankguard_supervisor_open_incidents", "Incidents not yet resolved.", labels=["kind"]
        )
        for kind in KINDS:
            mine = [i for i in incidents if i.kind == kind]
            total.add_metric([kind], len(mine))
            restarts.add_metric([kind], sum(1 for i in mine if i.restarted_at is not None))
            open_.add_metric(
                [kind], sum(1 for i in mine if i.state not in ("resolved", "stopped", "failed"))
            )
        yield from (total, restarts, open_)
        yield from _by_cause(sup.store.by_cause())
        service = sup.service  # None until the supervisor serves HTTP
        yield _by_reason(
            "rankguard_supervisor_malformed_answers",
            "Agent answers that broke the contract (the node was left unseen), by reason.",
            CONTRACT_REASONS, sup.poller.malformed,
        )  # fmt: skip
        yield _by_reason(
            "rankguard_supervisor_refused_answers",
            "Agent answers refused for who sent them (the agent was left unseen), by reason.",
            REFUSED_ANSWERS, sup.poller.refused,
        )  # fmt: skip
        captures = CounterMetricFamily(
            "rankguard_supervisor_stack_captures", "Stack dumps asked of agents (py-spy)."
        )
        captures.add_metric([], sup.stack_budget.captured)
        yield captures
        yield _by_reason(
            "rankguard_supervisor_stack_captures_skipped",
            "Stack dumps not asked for now: the pass's budget was spent, or the rank backs off.",
            STACK_SKIPS, sup.stack_budget.skipped,
        )  # fmt: skip
        yield _by_reason(
            "rankguard_supervisor_http_refused_connections",
            "HTTP connections refused or cut short, by reason (caps, TLS, unread bodies).",
            REFUSALS, service.refusals if service else {},
        )  # fmt: skip
        # The open incidents by who they name, so alerts can say which rank and node
        # (a count: two incarnations' deaths of one rank can both be open).
        named = GaugeMetricFamily(
            "rankguard_supervisor_incident_open",
            "Open incidents by kind and the job, node and rank they name ('' when none).",
            labels=["kind", JOB_LABEL, "node", "rank"],
        )
        counts: dict[tuple[str, str, str, str], int] = {}
        for i in sup.store.open_incidents():
            key = _named(i)
            counts[key] = counts.get(key, 0) + 1
        for key, n in sorted(counts.items()):
            named.add_metric(list(key), n)
        yield named
        yield _recently_detected(incidents, sup.clock() - RECENT_INCIDENT_SECONDS)
        for name, attr, help_ in (
            (
                "rankguard_supervisor_time_to_detect_seconds",
                "time_to_detect",
                "Fault to detection.",
            ),
            (
                "rankguard_supervisor_time_to_recover_seconds",
                "time_to_recover",
                "Fault to the first step after recovery.",
            ),
        ):
            hist = HistogramMetricFamily(name, help_, labels=["kind"])
            for kind in KINDS:
                values = [
                    v for i in incidents if i.kind == kind and (v := getattr(i, attr)) is not None
                ]
                buckets = [(str(b), sum(1 for v in values if v <= b)) for b in TIME_BUCKETS]
                hist.add_metric([kind], buckets + [("+Inf", len(values))], sum_value=sum(values))
            yield hist
        now = sup.clock()
        goodput = GaugeMetricFamily("rankguard_supervisor_goodput_ratio",
                                    "Productive step time over wall time.", labels=[JOB_LABEL])  # fmt: skip
        state = GaugeMetricFamily("rankguard_supervisor_job_state", "1 for the job's state.",
                                  labels=[JOB_LABEL, "state"])  # fmt: skip
        for job, progress in sorted(sup.jobs.items()):
            goodput.add_metric([job], progress.goodput(now))
            for s in JOB_STATES:
                state.add_metric([job, s], 1.0 if progress.state == s else 0.0)
        yield from (goodput, state)
        # The newest validated checkpoint as the supervisor saw it advance; its age is
        # time() - timestamp in PromQL (a timestamp, not an age, so it stays exact between scrapes).
        ckpt_step = GaugeMetricFamily("rankguard_supervisor_checkpoint_step",
                                      "Newest validated checkpoint step of the job.", labels=[JOB_LABEL])  # fmt: skip
        ckpt_time = GaugeMetricFamily(
            "rankguard_supervisor_checkpoint_timestamp_seconds",
            "When the supervisor first saw the job's newest validated checkpoint (unix time); "
            "when it first saw the job, while the job has none.",
            labels=[JOB_LABEL],
        )
        for job, (step, _, seen) in sorted(sup.history.checkpoint_progress.items()):
            if step is not None:
                ckpt_step.add_metric([job], step)
            ckpt_time.add_metric([job], seen)
        yield from (ckpt_step, ckpt_time)
        up = GaugeMetricFamily("rankguard_supervisor_agent_up", "1 if the agent answered the last poll.",
                               labels=["node", "url"])  # fmt: skip
        for n in sup.last_obs.nodes if sup.last_obs else ():
            up.add_metric([n.node, n.url], 1.0 if n.reachable else 0.0)
        yield up
        loop = GaugeMetricFamily(
            "rankguard_supervisor_loop_seconds", "Duration of the last reconcile pass."
        )
        loop.add_metric([], sup.loop_seconds)
        passes = CounterMetricFamily("rankguard_supervisor_passes", "Reconcile passes run.")
        passes.add_metric([], sup.passes)
        verdict = GaugeMetricFamily("rankguard_supervisor_cluster_health", "1 for the cluster verdict.",
                                    labels=["status"])  # fmt: skip
        current = cluster_view(sup)["status"]
        for v in VERDICTS:
            verdict.add_metric([v], 1.0 if v == current else 0.0)
        yield from (loop, passes, verdict)


def make_registry(sup) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SupervisorCollector(sup))
    ProcessCollector(registry=registry)  # process_*: CPU, memory, open fds, as exporters have
    return registry


def _by_reason(name: str, help_text: str, reasons, counts) -> CounterMetricFamily:
    """A counter family with one sample per known reason (0 where none was counted)."""
    family = CounterMetricFamily(name, help_text, labels=["reason"])
    for reason in reasons:
        family.add_metric([reason], counts.get(reason, 0))
    return family


def _by_cause(totals) -> tuple[CounterMetricFamily, ...]:
    """Incidents, time lost and steps done again by cause: the interruptions table."""
    families = (
        ("incidents_by_cause", "Incidents by cause (supervisor/causes.py).", "incidents"),
        ("lost_seconds_by_cause", "Seconds from a fault to the first step after its restart, "
         "by cause.", "lost_seconds"),
        ("lost_steps_by_cause", "Steps done again after a restart, by cause.", "lost_steps"),
    )  # fmt: skip
    out = []
    for name, help_text, attr in families:
        family = CounterMetricFamily(f"rankguard_supervisor_{name}", help_text, labels=["cause"])
        for t in totals:
            family.add_metric([t.cause], getattr(t, attr))
        out.append(family)
    return tuple(out)


def _named(i) -> tuple[str, str, str, str]:
    """An incident's labels: its kind and the job, node and rank it names ('' when none)."""
    return (i.kind, i.job or "", i.node or "", "" if i.rank is None else str(i.rank))


def _recently_detected(incidents, since: float) -> GaugeMetricFamily:
    """When the newest incident of each kind and target was detected, for those detected
    after `since`: a warm restart closes a death's incident within about a second, often
    between two scrapes, so the open gauge alone would never show it to an alert."""
    family = GaugeMetricFamily(
        "rankguard_supervisor_incident_detected_timestamp_seconds",
        "Unix time of the newest incident detected recently (the last "
        f"{RECENT_INCIDENT_SECONDS:.0f} s), by kind and the job, node and rank it names.",
        labels=["kind", JOB_LABEL, "node", "rank"],
    )
    newest: dict[tuple[str, str, str, str], float] = {}
    for i in incidents:
        if i.detected_at >= since:
            key = _named(i)
            newest[key] = max(newest.get(key, 0.0), i.detected_at)
    for key, t in sorted(newest.items()):
        family.add_metric(list(key), t)
    return family
