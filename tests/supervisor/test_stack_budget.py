"""Bounded stack captures (issue 13): 30 silent ranks of a hung job once cost 833 py-spy
dumps a minute and slowed passes from 4/s to 1.3/s. Now captures are capped per pass and
each rank process backs off while its hang persists; the skips are counted on /metrics."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from builders import sup_metric as metric
from fake_agents import FakeAgent, rank
from harness import wait_until

from rankguard.supervisor.agents import AgentError
from rankguard.supervisor.detectors import DetectorConfig
from rankguard.supervisor.model import ACT_STOP_JOB, CRASH_LOOP, Decision, Finding
from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
from rankguard.supervisor.stacks import StackBudget
from rankguard.supervisor.store import IncidentStore

WORLD = 30


def test_a_pass_spends_at_most_its_budget():
    budget = StackBudget(per_pass=3)
    budget.new_pass(0.0)
    allowed = [k for k in range(10) if budget.may_capture(("j", k, k), 0.0)
               and budget.start(("j", k, k), 0.0) is None]  # fmt: skip
    assert allowed == [0, 1, 2] and budget.skipped["pass_budget"] == 7
    budget.new_pass(0.1)
    assert budget.may_capture(("j", 3, 3), 0.1) and not budget.may_capture(("j", 0, 0), 0.1)


def test_a_rank_backs_off_doubling_to_the_ceiling_and_a_new_process_starts_afresh():
    budget = StackBudget(per_pass=100, first_delay=2, max_delay=16)
    taken, t = [], 0.0
    while t < 100:
        budget.new_pass(t)
        if budget.may_capture(("j", 0, 7), t):
            budget.start(("j", 0, 7), t)
            budget.finish(("j", 0, 7), t, None if t else "dump")
            taken.append(t)
        t += 0.5
    assert taken[:5] == [0, 2, 6, 14, 30] and taken[5] - taken[4] == 16
    assert budget.dump(("j", 0, 7)) == "dump"  # a failed capture keeps the last good one
    assert budget.may_capture(("j", 0, 8), t)  # the rank's new process: no backoff


def test_the_backoff_counts_from_a_late_answer():
    budget, key = StackBudget(first_delay=2), ("j", 1, 9)
    budget.new_pass(0.0)
    budget.start(key, 0.0)
    budget.new_pass(5.0)
    assert budget.may_capture(key, 5.0)  # due (the caller skips a capture still out)
    budget.finish(key, 5.0, "dump")  # answered after 5 s
    assert not budget.may_capture(key, 6.0) and budget.may_capture(key, 7.0)
    assert budget.dump(key) == "dump"


@pytest.fixture
def hung_job(tmp_path):
    agent = FakeAgent("n")
    agent.ranks = [rank("j", r, WORLD, heartbeat_age_seconds=100.0) for r in range(WORLD)]
    store = IncidentStore(tmp_path / "db.sqlite")
    sup = Supervisor(store, lambda: [agent.url], "t" * 16, SupervisorConfig())
    yield sup, agent
    sup.close()
    store.close()
    agent.close()


def test_thirty_silent_ranks_cost_a_bounded_number_of_dumps_a_minute(hung_job):
    sup, agent = hung_job
    clock = [0.0]
    sup.monotonic = lambda: clock[0]
    per_pass = []
    for i in range(120):  # one minute at 2 passes a second
        clock[0] = i / 2
        before = len(agent.controls)
        sup.reconcile_once(now=1000.0 + clock[0])
        per_pass.append(len(agent.controls) - before)
    dumps = Counter(body["rank"] for path, body, _ in agent.controls if path.endswith("stacks"))
    assert [i.kind for i in sup.store.list_incidents()] == ["rank_hung"]
    assert max(per_pass) <= sup.stack_budget.per_pass
    assert set(dumps) == set(range(WORLD))  # every rank's stacks were read ...
    assert max(dumps.values()) <= 6  # ... at 0, 2, 6, 14, 30 and 62 s at most
    assert sum(dumps.values()) <= 180, f"{sum(dumps.values())} dumps a minute"
    print(f"{sum(dumps.values())} dumps in a minute, at most {max(per_pass)} a pass")
    assert metric(sup, 'rankguard_supervisor_stack_captures_skipped_total{reason="backoff"}') > 0
    assert metric(sup, "rankguard_supervisor_stack_captures_total") == sum(dumps.values())


@pytest.fixture
def one_agent_slow_with_stacks(tmp_path):
    """Rank 0's agent answers at once; rank 1's answers stacks after 5 s (a cut link's
    agent answers only after the request's timeout)."""
    fast, slow = FakeAgent("a"), FakeAgent("b")
    slow.control_delay["/v1/control/stacks"] = 5.0
    store = IncidentStore(tmp_path / "db.sqlite")
    urls = [fast.url, slow.url]
    sup = Supervisor(store, lambda: urls, "t" * 16, SupervisorConfig())  # stacks_wait 2 s
    yield sup, fast, slow
    sup.close()
    store.close()
    fast.close()
    slow.close()


def _timed_pass(sup) -> float:
    started = time.monotonic()
    sup.reconcile_once()
    return time.monotonic() - started


def test_a_slow_stacks_answer_holds_no_pass_back_and_completes_the_picture_later(
    one_agent_slow_with_stacks,
):
    sup, fast, slow = one_agent_slow_with_stacks
    fast.ranks = [rank("j", 0, 2, heartbeat_age_seconds=100.0)]
    slow.ranks = [rank("j", 1, 2, heartbeat_age_seconds=100.0)]
    took = _timed_pass(sup)
    assert took < 3.0, f"the pass waited {took:.1f}s for the slow agent"
    (hang,) = sup.store.list_incidents()
    assert hang.kind == "rank_hung" and hang.rank is None
    assert set(hang.evidence["stacks"]) == {"0"}  # the fast rank's, and no blame on half
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(hang.evidence["stacks"]) < 2:
        # the capture still out is not waited for again
        assert _timed_pass(sup) < 1.0
        (hang,) = sup.store.list_incidents()
        time.sleep(0.2)
    assert set(hang.evidence["stacks"]) == {"0", "1"}, hang.evidence
    asked = [body["rank"] for path, body, _ in slow.controls if path.endswith("stacks")]
    assert asked == [1]  # asked once: a capture in flight is not asked again


def test_a_slow_stacks_answer_does_not_hold_the_kill_of_the_culprit_back(
    one_agent_slow_with_stacks,
):
    sup, fast, slow = one_agent_slow_with_stacks
    fast.ranks = [rank("j", 0, 2, step=10, heartbeat_age_seconds=100.0)]
    slow.ranks = [rank("j", 1, 2, step=5, heartbeat_age_seconds=100.0)]  # behind: named
    took = _timed_pass(sup)
    assert took < 3.0, f"the pass waited {took:.1f}s for the slow agent"
    (hang,) = sup.store.list_incidents()
    (act,) = sup.store.actions(hang.id)
    assert (act.kind, act.target["rank"], act.ok) == ("kill_rank", 1, True), act
    assert act.result["stacks_error"] == "no answer within 2 s", act.result
    assert [p for p, _, _ in slow.controls] == ["/v1/control/stacks", "/v1/control/signal"]


EXIT_WITH_A_CAPTURE_OUT = """
import sys
sys.path.insert(0, sys.argv[1])
from fake_agents import FakeAgent, rank
from rankguard.supervisor.detectors import DetectorConfig
from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
from rankguard.supervisor.store import IncidentStore
fast, slow = FakeAgent("a"), FakeAgent("b")
slow.control_delay["/v1/control/stacks"] = 60.0
fast.ranks = [rank("j", 0, 2, heartbeat_age_seconds=100.0)]
slow.ranks = [rank("j", 1, 2, heartbeat_age_seconds=100.0)]
store = IncidentStore(sys.argv[2])
sup = Supervisor(store, lambda: [fast.url, slow.url], "t" * 16, SupervisorConfig(stacks_wait=0.2))
sup.reconcile_once()
sup.close()
store.close()
print("closed", flush=True)
"""


def test_a_capture_still_out_does_not_hold_the_supervisors_exit(tmp_path):
    """A ThreadPoolExecutor's threads are joined at exit: the supervisor's exit once waited
    for a cut-off agent's stacks request to time out."""
    tests = Path(__file__).resolve().parents[1]
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_A_CAPTURE_OUT, str(tests), str(tmp_path / "db")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - started
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stderr[-2000:]
    assert took < 30, f"the exit waited {took:.0f} s for the capture (60 s)"


# py-spy's dump of a rank waiting in a collective whose Reporter runs its stall watch
WATCHED_STACKS = """Process 1000: python
Thread 1000 (idle): "MainThread"
    wait (torch/distributed/distributed_c10d.py:3151)
    train_step (train.py:306)
Thread 1001 (idle): "rankguard-wavefront"
    _watch (rankguard/client/reporter.py:481)
"""


@pytest.fixture
def two_waiting_ranks(tmp_path):
    """Two ranks of a job at its first step (its budget set to 1 s) that stopped stepping
    3 s ago; a stack dump of each shows it waiting in a collective."""
    agent = FakeAgent("n")
    agent.ranks = [rank("j", r, 2, heartbeat_age_seconds=3.0) for r in range(2)]
    store = IncidentStore(tmp_path / "db.sqlite")
    hang = DetectorConfig().hang
    hang = dataclasses.replace(hang, phases=dataclasses.replace(hang.phases, first_step=1.0))
    cfg = SupervisorConfig(detectors=DetectorConfig(hang=hang))
    sup = Supervisor(store, lambda: [agent.url], "t" * 16, cfg)
    yield sup, agent, store
    sup.close()
    store.close()
    agent.close()


def test_a_hang_with_a_stall_watch_waits_for_its_wavefront_before_restarting(
    two_waiting_ranks,
):
    """The stacks name nobody. A rank running a Reporter's stall watch sends its
    flight-recorder wavefront within about a second: until the stall is
    WAVEFRONT_WAIT_SECONDS old, the job is not restarted on the stacks alone (a desync,
    which the wavefront shows, must be stopped, not restarted)."""
    sup, agent, store = two_waiting_ranks
    agent.stacks = WATCHED_STACKS
    sup.reconcile_once()
    (hang,) = store.list_incidents()
    assert set(hang.evidence["stacks"]) == {"0", "1"}, hang.evidence
    assert "restart_via" not in hang.evidence and not store.actions(hang.id)
    agent.ranks = [dataclasses.replace(r, heartbeat_age_seconds=60.0) for r in agent.ranks]
    sup.reconcile_once()
    (hang,) = store.list_incidents()
    assert hang.evidence["restart_via"]["rank"] == 0, hang.evidence
    assert [a.kind for a in store.actions(hang.id)] == ["kill_rank"]


def test_without_a_stall_watch_the_stacks_restart_the_hang_at_once(two_waiting_ranks):
    sup, agent, store = two_waiting_ranks
    agent.stacks = WATCHED_STACKS.replace("rankguard-wavefront", "Thread-2")
    sup.reconcile_once()
    (hang,) = store.list_incidents()
    assert hang.evidence["restart_via"]["rank"] == 0, hang.evidence


def test_a_stop_reaches_every_node_at_once_a_slow_agent_holds_none_back(tmp_path):
    """A job's stop goes to all its nodes together: the first agent taking 5 s to answer
    (behind a cut link) does not keep the others' ranks running meanwhile."""
    agents = [FakeAgent(f"n{i}") for i in range(4)]
    for i, agent in enumerate(agents):
        agent.ranks = [rank("j", i, len(agents))]
    agents[0].control_delay["/v1/control/stop-job"] = 5.0
    store = IncidentStore(tmp_path / "db.sqlite")
    sup = Supervisor(store, lambda: [a.url for a in agents], "t" * 16, SupervisorConfig())
    try:
        sup.reconcile_once()
        finding = Finding(CRASH_LOOP, "crash_loop:j:test", "critical", "a crash loop", job="j")
        decision = Decision(finding, ACT_STOP_JOB, "test", {"job": "j"})
        outcome: list[BaseException | dict] = []

        def stop() -> None:
            try:
                outcome.append(sup._execute(decision, sup.last_obs, 1))
            except AgentError as exc:
                outcome.append(exc)

        stopping = threading.Thread(target=stop, daemon=True)
        stopping.start()

        def every_node_asked() -> bool:
            return all(any(p == "/v1/control/stop-job" for p, _, _ in a.controls) for a in agents)

        wait_until(every_node_asked, 3.0, "the stop at every node")
        assert not outcome  # the slow agent has not answered yet
        stopping.join(15)
        # its request timed out: the action fails (and is retried), the others are stopped
        (error,) = outcome
        assert isinstance(error, AgentError) and agents[0].url in str(error), outcome
    finally:
        sup.close()
        store.close()
        for agent in agents:
            agent.close()
