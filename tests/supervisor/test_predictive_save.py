"""Predictive drain's "save now" through the loop (supervisor/reconcile.py): the jobs on a
node whose GPU is failing are asked once to save at one step, through every agent with
their ranks; never when a rank is out of view, and withdrawn when an agent refuses."""

from __future__ import annotations

from fake_agents import FakeAgent, rank

from rankguard.contract.answers import HealthReason
from rankguard.supervisor.policy import PolicyConfig
from rankguard.supervisor.reconcile import EV_SAVE_REQUESTED, Supervisor, SupervisorConfig
from rankguard.supervisor.store import IncidentStore

SAVE = "/v1/control/save"


def _failing(agent: FakeAgent) -> None:
    reason = HealthReason("gpu_failing", "degraded", "GPU 1: 400 new correctable ECC errors")
    agent.verdict("degraded", reason)


def _run(tmp_path, agents, passes=2):
    store = IncidentStore(tmp_path / "rankguard.db")
    cfg = SupervisorConfig(policy=PolicyConfig(predictive_drain=True))
    sup = Supervisor(store, lambda: [a.url for a in agents], "t" * 16, cfg)
    sup.poller.node_interval = 0
    try:
        for _ in range(passes):
            sup.reconcile_once()
        (inc,) = store.list_incidents()
        saved = [e.detail for e in store.events(inc.id) if e.what == EV_SAVE_REQUESTED]
        return inc, saved
    finally:
        sup.close()
        store.close()


def _saves(agent: FakeAgent) -> list[dict]:
    return [body for path, body, _ in agent.controls if path == SAVE]


def test_every_agent_of_the_job_is_asked_once_for_the_same_step(tmp_path):
    a, b = FakeAgent("a"), FakeAgent("b")
    try:
        a.ranks = [rank("j", 0, 2, step=100, step_seconds=0.5, restart=3)]
        b.ranks = [rank("j", 1, 2, step=99, step_seconds=0.5, restart=3)]
        _failing(a)
        inc, saved = _run(tmp_path, [a, b], passes=3)
        # the newest step plus ten seconds of half-second steps, on both nodes, once
        want = {"job": "j", "restart": 3, "step": 120}
        for agent in (a, b):
            (body,) = _saves(agent)
            assert {k: body[k] for k in want} == want and "GPU 1" in body["reason"], body
        assert saved == [{"j": {"step": 120, "restart": 3, "agents": 2}}]
        assert inc.state == "open" and "waiting for the next checkpoint of j" in inc.action_reason
    finally:
        a.close()
        b.close()


def test_a_job_with_a_rank_out_of_view_is_not_asked(tmp_path):
    a = FakeAgent("a")
    try:
        a.ranks = [rank("j", 0, 2, step=100, step_seconds=0.5)]  # rank 1: nowhere in view
        _failing(a)
        _, saved = _run(tmp_path, [a])
        assert _saves(a) == []
        assert saved == [{"j": {"step": 120, "restart": 0, "agents": 0,
                                "error": "not every rank of the incarnation is in view"}}]  # fmt: skip
    finally:
        a.close()


def test_a_request_one_agent_refuses_is_withdrawn_from_the_others(tmp_path):
    a, b = FakeAgent("a"), FakeAgent("b")
    try:
        a.ranks = [rank("j", 0, 2, step=100, step_seconds=0.5)]
        b.ranks = [rank("j", 1, 2, step=100, step_seconds=0.5)]
        _failing(a)
        b.control_refused.add(SAVE)
        _, saved = _run(tmp_path, [a, b])
        asked = _saves(a)
        # a's ranks alone would save, and wait in the save's collectives for b's
        assert [body["step"] for body in asked] == [120, None]
        (detail,) = saved
        assert detail["j"]["agents"] == 0 and detail["j"]["error"].startswith("withdrawn: ")
    finally:
        a.close()
        b.close()
