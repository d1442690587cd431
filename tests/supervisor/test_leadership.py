"""Two supervisors, one acting (supervisor/leadership.py), against a real etcd cluster
(Debian's etcd-server): the lease, the takeover, the split brain, and the intent log that
makes an action happen once across them."""

from __future__ import annotations

import time

import pytest
from etcd_cluster import ETCD, SKIP_REASON, EtcdCluster
from fake_agents import FakeAgent, rank
from harness import wait_until

from rankguard.contract.answers import HealthReason
from rankguard.service.etcd import EtcdClient, parse_endpoints
from rankguard.supervisor.leadership import ETCD_CALL_SECONDS, Leadership, SharedIntents
from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
from rankguard.supervisor.scheduler import SchedulerConfig
from rankguard.supervisor.store import IncidentStore

pytestmark = pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)
TTL = 3


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster(tmp_path)
    yield cluster
    cluster.close()


def _leader(etcd: EtcdCluster, name: str) -> Leadership:
    client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=ETCD_CALL_SECONDS)
    return Leadership(client, name, ttl=TTL)


def _never_both(a: Leadership, b: Leadership, seconds: float, renewing: list) -> list:
    """Renew the ones in `renewing` every 0.2 s for `seconds`; every 50 ms, who may act."""
    seen, next_renew = [], 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if time.monotonic() >= next_renew:
            for lead in renewing:
                lead.renew()
            next_renew = time.monotonic() + 0.2
        acting = (a.acting(), b.acting())
        assert acting != (True, True), "two supervisors may act at once"
        seen.append(acting)
        time.sleep(0.05)
    return seen


def test_one_leads_the_other_takes_over_when_its_lease_lapses(etcd):
    a, b = _leader(etcd, "a"), _leader(etcd, "b")
    assert a.renew() and not b.renew() and b.holder == "a"
    _never_both(a, b, 1.0, [a, b])
    # a stops renewing (paused, or dead): b leads once a's lease ran out, never before
    started = time.monotonic()
    seen = _never_both(a, b, TTL + 3, [b])
    took = started + 0.05 * next(i for i, (_, bb) in enumerate(seen) if bb)
    assert TTL - 1.5 <= took - started <= TTL + 3, took - started
    assert not a.renew() and a.holder == "b"  # back: its lease is gone, b keeps the key
    b.step_down()  # a clean stop hands the key over at once
    assert a.renew()


def test_a_leader_cut_off_from_etcd_stops_acting_before_the_other_starts(etcd):
    """Split brain: a can no longer reach etcd (its members are out of its reach), b can.
    a stops acting within its lease less the margin; b takes the key only after etcd let
    the lease expire; at no instant may both act."""
    a, b = _leader(etcd, "a"), _leader(etcd, "b")
    assert a.renew() and not b.renew()
    a.client.endpoints = ["http://127.0.0.1:9"]  # nothing listens: every call fails
    seen = _never_both(a, b, TTL + 4, [a, b])
    assert seen[-1] == (False, True) and a.errors > 0


def test_an_intent_is_claimed_once_and_read_back(etcd):
    client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=5)
    intents = SharedIntents(client)
    from rankguard.supervisor.leadership import Intent

    first = Intent("node_fault:n1:xid_79", "exclude_node", {"node": "n1"}, "a", 1.0)
    assert intents.claim(first) is None
    other = intents.claim(Intent(first.incident_key, first.kind, {"node": "n1"}, "b", 2.0))
    assert other == first  # b finds a's intent: never twice
    intents.complete(Intent(first.incident_key, first.kind, {"node": "n1"}, "a", 1.0, True, True,
                            {"ok": 1}))  # fmt: skip
    (done,) = intents.all()
    assert done.done and done.ok and done.result == {"ok": 1}


def test_finished_intents_leave_etcd_after_an_hour_unfinished_ones_stay(etcd):
    client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=5)
    intents = SharedIntents(client)
    from rankguard.supervisor.leadership import Intent

    now = 10_000.0
    old_done = Intent("a", "kill_rank", {}, "s1", now - 3700, True, True)
    old_open = Intent("b", "kill_rank", {}, "s1", now - 3700)
    new_done = Intent("c", "kill_rank", {}, "s1", now - 60, True, True)
    for intent in (old_done, old_open, new_done):
        assert intents.claim(intent) is None
    assert intents.expire(intents.all(), now) == 1
    assert {i.incident_key for i in intents.all()} == {"b", "c"}
    assert intents.claim(Intent("a", "kill_rank", {}, "s2", now)) is None  # a new incident's


def _hardware_fault(agent: FakeAgent) -> None:
    agent.verdict("unhealthy", HealthReason("gpu_lost", "unhealthy", "GPU 1 is lost (GPU_IS_LOST)"))


def test_the_leader_acts_once_the_standby_records_it_and_takes_over_without_repeating(
    tmp_path, etcd
):
    """Two supervisors over one agent whose GPU is lost. Only the leader stops the job
    (one stop-job); the standby's database shows the same action. The leader then goes
    silent; the standby takes over once its lease ran out and does not act again."""
    agent = FakeAgent("gpu7")
    agent.ranks = [rank("j", r, 2) for r in range(2)]
    _hardware_fault(agent)
    sups, stores = [], []
    try:
        for name in ("a", "b"):
            store = IncidentStore(tmp_path / f"{name}.db")
            drains = SchedulerConfig(drain_command="true {node} {reason}",  # drained as asked
                                     resume_command="true {node}")  # fmt: skip
            cfg = SupervisorConfig(etcd=etcd.endpoint, name=name, lease_seconds=TTL,
                                   scheduler=drains)  # fmt: skip
            sup = Supervisor(store, lambda: [agent.url], "t" * 16, cfg)
            sup.poller.node_interval = 0
            sups.append(sup)
            stores.append(store)
        a, b = sups
        a.reconcile_once()  # a leads (first to the key) and acts
        b.reconcile_once()
        stops = [p for p, _, _ in agent.controls if p == "/v1/control/stop-job"]
        assert len(stops) == 1 and a.leading and not b.leading

        def copied():  # b reads the intents once a second, off its loop
            b.reconcile_once()
            (inc_b,) = stores[1].list_incidents()
            return stores[1].actions(inc_b.id)

        (action,) = wait_until(copied, 10, "b's copy of a's action", interval=0.2)
        assert (action.kind, action.ok) == ("exclude_node", True)  # one timeline
        # the node a drained is b's to resume should b lead; a standby resumes nothing
        assert set(a.scheduler.drained) == set(b.scheduler.drained) == {"gpu7"}
        # a dies (its lease is not given up): b leads once it ran out, and acts no more
        a._watch.stop()
        deadline = time.monotonic() + TTL + 5
        while not b.leading and time.monotonic() < deadline:
            b.reconcile_once()
            time.sleep(0.2)
        assert b.leading
        b.reconcile_once()
        assert len([p for p, _, _ in agent.controls if p == "/v1/control/stop-job"]) == 1
    finally:
        for sup in sups:
            sup.close()
        for store in stores:
            store.close()
        agent.close()
