"""Bounded stack captures (issue 13): 30 silent ranks of a hung job once cost 833 py-spy
dumps a minute and slowed passes from 4/s to 1.3/s. Now captures are capped per pass and
each rank process backs off while its hang persists; the skips are counted on /metrics."""

from __future__ import annotations

from collections import Counter

import pytest
from builders import sup_metric as metric
from fake_agents import FakeAgent, rank

from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
from rankguard.supervisor.stacks import StackBudget
from rankguard.supervisor.store import IncidentStore

WORLD = 30


def test_a_pass_spends_at_most_its_budget():
    budget = StackBudget(per_pass=3)
    budget.new_pass(0.0)
    allowed = [k for k in range(10) if budget.may_capture(("j", k, k), 0.0)
               and budget.record(("j", k, k), 0.0, "dump") is None]  # fmt: skip
    assert allowed == [0, 1, 2] and budget.skipped["pass_budget"] == 7
    budget.new_pass(0.1)
    assert budget.may_capture(("j", 3, 3), 0.1) and not budget.may_capture(("j", 0, 0), 0.1)


def test_a_rank_backs_off_doubling_to_the_ceiling_and_a_new_process_starts_afresh():
    budget = StackBudget(per_pass=100, first_delay=2, max_delay=16)
    taken, t = [], 0.0
    while t < 100:
        budget.new_pass(t)
        if budget.may_capture(("j", 0, 7), t):
            budget.record(("j", 0, 7), t, None if t else "dump")
            taken.append(t)
        t += 0.5
    assert taken[:5] == [0, 2, 6, 14, 30] and taken[5] - taken[4] == 16
    assert budget.dump(("j", 0, 7)) == "dump"  # a failed capture keeps the last good one
    assert budget.may_capture(("j", 0, 8), t)  # the rank's new process: no backoff


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
