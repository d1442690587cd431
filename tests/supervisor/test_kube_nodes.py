"""The kubernetes scheduler backend (supervisor/kube_nodes.py) through the official client
against tests/fake_kube_api.py, a stand-in that enforces the API server's request shapes
(no API server runs on the test machine): a node excluded for a hardware fault gets
rankguard's taint and condition, other tools' taints and conditions stay, a concurrent
writer is met with a retry, a healthy streak clears both, and a restarted supervisor
still resumes the node it drained."""

from __future__ import annotations

import pytest
from fake_agents import FakeAgent, rank
from fake_kube_api import MERGE, STRATEGIC, FakeKubeApi

from rankguard.contract.answers import HealthReason
from rankguard.supervisor.kube_nodes import CONDITION, CORDONED, TAINT_KEY
from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
from rankguard.supervisor.scheduler import Scheduler, SchedulerConfig, SchedulerError
from rankguard.supervisor.store import IncidentStore

pytest.importorskip(
    "kubernetes", reason="the kubernetes extra (pip install 'rankguard[kubernetes]')"
)

FOREIGN_TAINT = {"key": "nvsentinel.nvidia.com/gpu-error", "value": "xid", "effect": "NoSchedule"}
FOREIGN_CONDITION = {"type": "GpuDriverHealthy", "status": "False", "reason": "FromNPD"}


@pytest.fixture
def kube(tmp_path, monkeypatch):
    api = FakeKubeApi({"gpu7": {"spec": {"taints": [FOREIGN_TAINT]},
                                "status": {"conditions": [FOREIGN_CONDITION]}}})  # fmt: skip
    api.kubeconfig(tmp_path / "kubeconfig")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: kubeconfig
    yield api
    api.close()


def _ours(node: dict) -> tuple[list[dict], dict | None]:
    taints = [t for t in node["spec"].get("taints", []) if t["key"] == TAINT_KEY]
    cond = next((c for c in node["status"]["conditions"] if c["type"] == CONDITION), None)
    return taints, cond


def _unhealthy(agent: FakeAgent) -> None:
    agent.verdict("unhealthy", HealthReason("gpu_lost", "unhealthy", "GPU 1 is lost (GPU_IS_LOST)"))


def test_a_node_out_and_back_through_the_api_across_a_supervisor_restart(tmp_path, kube):
    agent = FakeAgent("gpu7")
    agent.ranks = [rank("j", r, 2) for r in range(2)]
    _unhealthy(agent)
    db = tmp_path / "rankguard.db"
    cfg = SupervisorConfig(scheduler=SchedulerConfig(backend="kubernetes",
                                                     resume_after_healthy_passes=2))  # fmt: skip
    kube.conflicts = 1  # a concurrent writer changes the node under the first patch
    store = IncidentStore(db)
    sup = Supervisor(store, lambda: [agent.url], "t" * 16, cfg)
    sup.poller.node_interval = 0
    try:
        assert [d.action for d in sup.reconcile_once()] == ["exclude_node"]
        node = kube.nodes["gpu7"]
        taints, cond = _ours(node)
        assert taints == [{"key": TAINT_KEY, "effect": "NoSchedule"}]
        assert FOREIGN_TAINT in node["spec"]["taints"]  # never fought over
        assert FOREIGN_CONDITION in node["status"]["conditions"]
        assert (cond["status"], cond["reason"]) == ("False", "RankguardExcluded")
        assert "GPU 1 is lost" in cond["message"]
        patches = [(p, kind) for m, p, kind, _ in kube.requests if m == "PATCH"]
        # the first node patch met the writer (409) and was computed again
        assert patches == [("/api/v1/nodes/gpu7", MERGE), ("/api/v1/nodes/gpu7", MERGE),
                           ("/api/v1/nodes/gpu7/status", STRATEGIC)]  # fmt: skip
        (action,) = [a for i in store.list_incidents() for a in store.actions(i.id)]
        assert action.result["scheduler"]["ok"] is True, action.result
    finally:
        sup.close()
        store.close()
    del agent.raw["/v1/node"]  # healthy again; a new supervisor on the same database
    store = IncidentStore(db)
    sup = Supervisor(store, lambda: [agent.url], "t" * 16, cfg)
    sup.poller.node_interval = 0
    try:
        sup.reconcile_once()
        assert _ours(kube.nodes["gpu7"])[0]  # one healthy pass is not the streak
        sup.reconcile_once()
        taints, cond = _ours(kube.nodes["gpu7"])
        assert taints == [] and cond["status"] == "True"
        assert kube.nodes["gpu7"]["spec"]["taints"] == [FOREIGN_TAINT]
        assert FOREIGN_CONDITION in kube.nodes["gpu7"]["status"]["conditions"]
    finally:
        sup.close()
        store.close()
        agent.close()


def test_a_cordon_is_lifted_only_when_rankguard_set_it(tmp_path, kube):
    kube.nodes["other"] = {"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": "other", "resourceVersion": "1"},
                           "spec": {"unschedulable": True}, "status": {}}  # fmt: skip
    cfg = SchedulerConfig(backend="kubernetes", kubernetes_cordon=True,
                          resume_after_healthy_passes=1)  # fmt: skip
    s = Scheduler(cfg, tmp_path / "db")
    try:
        for node in ("gpu7", "other"):
            assert s.exclude(node, "XID 79")["ok"]
        assert kube.nodes["gpu7"]["spec"]["unschedulable"] is True
        assert kube.nodes["gpu7"]["metadata"]["annotations"] == {CORDONED: "true"}
        assert "annotations" not in kube.nodes["other"]["metadata"]  # cordoned by someone else
        from rankguard.supervisor.state import ClusterObs, NodeObs

        healthy = ClusterObs(0.0, tuple(NodeObs(n, f"http://{n}", True, 0.0, status="healthy")
                                        for n in ("gpu7", "other")))  # fmt: skip
        assert all(o["ok"] for o in s.observe(healthy))
        assert kube.nodes["gpu7"]["spec"]["unschedulable"] is False
        assert CORDONED not in kube.nodes["gpu7"]["metadata"].get("annotations", {})
        assert kube.nodes["other"]["spec"]["unschedulable"] is True  # not ours to lift
        assert _ours(kube.nodes["other"])[0] == []
    finally:
        s.close()


def test_a_refused_change_is_a_failed_drain_and_the_node_is_not_remembered(tmp_path, kube):
    s = Scheduler(SchedulerConfig(backend="kubernetes"), tmp_path / "db")
    try:
        out = s.exclude("no-such-node", "XID 79")
        assert out["ok"] is False and "404" in out["error"], out
        assert s.drained == {}
        kube.conflicts = 10  # a writer that never stops
        out = s.exclude("gpu7", "XID 79")
        assert out["ok"] is False and "conflicts in a row" in out["error"], out
    finally:
        s.close()
    with pytest.raises(ValueError, match="kubernetes_taint_effect"):
        SchedulerConfig(backend="kubernetes", kubernetes_taint_effect="Sometimes")
    assert issubclass(SchedulerError, ValueError)
