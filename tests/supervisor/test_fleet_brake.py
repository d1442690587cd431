"""Node health an operator can trust, across a fleet: eight real agents (in process, each
with two GPUs of the NVML double: no GPU here) and the real reconcile loop. XIDs are judged
by what they mean, NVML unavailable is the agents' fault, and the fleet brake caps how many
nodes a burst of hardware faults takes out."""

from __future__ import annotations

import pytest
from harness import wait_until

from rankguard.agent.config import AgentConfig
from rankguard.agent.daemon import Agent
from rankguard.agent.nvml_double import NvmlDouble, make_double
from rankguard.contract.secrets import write_secret_file
from rankguard.supervisor.policy import PolicyConfig
from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
from rankguard.supervisor.store import IncidentStore

NODES = 8
BLIND = (5, 6, 7)  # nodes whose agent cannot load NVML


@pytest.fixture
def fleet(tmp_path):
    token = tmp_path / "token"
    write_secret_file(token, "a-token-for-the-fleet-tests-0123")
    agents, nvmls, urls = [], [], []
    for i in range(NODES):
        nvml = NvmlDouble(make_double(n_gpus=2))
        if i in BLIND:
            nvml.set_unavailable("NVML_ERROR_LIBRARY_NOT_FOUND")
        cfg = AgentConfig(bind="127.0.0.1:0", interval=0.2, token_file=token, expected_gpus=2,
                          telemetry_socket=str(tmp_path / f"t{i}.sock"), node=f"n{i}")  # fmt: skip
        agent = Agent(cfg, nvml=nvml)
        host, port = agent.start_http()
        agents.append(agent)
        nvmls.append(nvml)
        urls.append(f"http://{host}:{port}")
    store = IncidentStore(tmp_path / "db.sqlite")
    policy = PolicyConfig(max_exclusions=2, max_exclusion_share=1.0)
    sup = Supervisor(store, lambda: urls, agents[0].token, SupervisorConfig(policy=policy))

    def passes(n: int = 3) -> list:
        for _ in range(n):
            for agent in agents:
                agent.collect_once()
            sup.reconcile_once()
        return store.list_incidents()

    yield nvmls, passes, store
    sup.close()
    store.close()
    for agent in agents:
        agent.close()


def _excluded(store) -> list[str]:
    return sorted(
        i.node for i in store.list_incidents() if "exclude_node" in store.action_kinds(i.id)
    )


def test_xids_by_meaning_nvml_blindness_and_the_fleet_brake(fleet):
    nvmls, passes, store = fleet
    # a row remap recorded and a contained ECC error on every node that can see its GPUs
    for i, nvml in enumerate(nvmls):
        if i not in BLIND:
            nvml.inject_xid(0, 63)
            nvml.inject_xid(1, 94)
    found = wait_until(
        lambda: [i for i in passes() if i.kind == "node_fault" and "xid_" in i.key], 20,
        "the XIDs reported",
    )  # fmt: skip
    blind = [i for i in store.list_incidents() if i.key.endswith(":nvml_unavailable")]
    assert sorted(i.node for i in blind) == [f"n{b}" for b in BLIND]
    assert all(i.severity == "warning" for i in found + blind), found + blind
    assert _excluded(store) == []  # nothing drained
    # the GPU fell off the bus on one node: that node only
    nvmls[0].inject_xid(1, 79)
    wait_until(lambda: (passes(), _excluded(store))[1] == ["n0"], 20, "n0 excluded")
    # ... then on four more: the brake (2) lets one more go, records the rest
    for i in (1, 2, 3, 4):
        nvmls[i].inject_xid(0, 79)
    wait_until(
        lambda: len([i for i in passes() if i.key.endswith(":xid_79")]) == 5, 20, "five XID 79s"
    )
    assert len(_excluded(store)) == 2 and "n0" in _excluded(store)
    braked = [i for i in store.list_incidents()
              if i.key.endswith(":xid_79") and i.node not in _excluded(store)]  # fmt: skip
    assert len(braked) == 3
    assert all("fleet brake" in (i.action_reason or "") for i in braked), [
        (i.node, i.action_reason) for i in braked
    ]
