"""Agent-to-supervisor trust (issue 13): a hostile agent claiming another node's name is
refused and counted, and never steers a kill at the real node; each agent gets its own
token, derived from a secret only the supervisor holds, so one agent's token (or a sniffer
of one agent's traffic) controls that node only."""

from __future__ import annotations

import subprocess
import sys

import pytest
from builders import node_of as node
from builders import sup_metric as metric
from fake_agents import FakeAgent, rank
from hypothesis import given
from hypothesis import strategies as st

from rankguard.contract.answers import Sample
from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
from rankguard.supervisor.store import IncidentStore
from rankguard.supervisor.tokens import AgentTokens, derive_agent_token

SECRET = "s" * 40


def nan_rank(job: str, r: int, world: int = 2) -> object:
    """A rank whose newest step has a NaN loss: the supervisor kills it (bad numerics)."""
    samples = tuple(
        Sample(step=s, phase="train", restart=0, pid=1000 + r, step_seconds=0.1,
               data_wait_seconds=0.0, compute_seconds=0.1, comm_seconds=0.0,
               loss=float("nan") if s == 10 else 2.0)
        for s in range(5, 11)
    )  # fmt: skip
    return rank(job, r, world, pid=9999, loss=float("nan"), recent=samples)


@pytest.fixture
def two_agents(tmp_path):
    honest, hostile = FakeAgent("node-a"), FakeAgent("node-b", host="127.0.0.2")
    store = IncidentStore(tmp_path / "db.sqlite")
    sup = Supervisor(store, lambda: [honest.url, hostile.url], AgentTokens(secret=SECRET),
                     SupervisorConfig())  # fmt: skip
    yield sup, honest, hostile
    sup.close()
    store.close()
    honest.close()
    hostile.close()


def test_an_agent_claiming_another_nodes_name_is_refused_and_steers_no_kill(two_agents):
    sup, honest, hostile = two_agents
    honest.ranks = [rank("j", 0), rank("j", 1)]
    hostile.node = "node-a"  # the hostile agent poses as node-a (listed first), with a NaN
    hostile.ranks = [nan_rank("j", 1)]  # rank 1 newer than node-a's own
    for _ in range(3):
        sup.reconcile_once()
    assert not honest.controls and not hostile.controls  # nothing killed anywhere
    assert sup.passes == 3
    assert not node(sup, hostile.url).reachable
    assert "claims node name 'node-a'" in node(sup, hostile.url).error
    assert node(sup, honest.url).reachable and node(sup, honest.url).node == "node-a"
    assert [r.node for r in sup.last_obs.ranks()] == ["node-a", "node-a"]
    assert metric(sup, 'rankguard_supervisor_refused_answers_total{reason="node_name_taken"}') == 3
    assert sup.store.list_incidents() == []


def test_a_kill_goes_to_the_agent_that_reported_the_rank_with_its_own_token(two_agents):
    sup, honest, hostile = two_agents
    honest.ranks = [rank("j", 0)]
    hostile.ranks = [nan_rank("j", 1)]  # a real fault on node-b
    sup.reconcile_once()
    assert not honest.controls
    [(path, body, auth)] = hostile.controls
    assert (path, body["job"], body["rank"], body["signal"]) == ("/v1/control/signal", "j", 1,
                                                                 "SIGKILL")  # fmt: skip
    assert auth == "Bearer " + derive_agent_token(SECRET, "127.0.0.2")
    assert derive_agent_token(SECRET, "127.0.0.1") not in auth  # node-a's token never sent


def test_a_released_name_can_be_taken_by_a_new_agent(tmp_path):
    first, second = FakeAgent("node-a"), FakeAgent("node-a", host="127.0.0.2")
    urls = [first.url]
    store = IncidentStore(tmp_path / "db.sqlite")
    sup = Supervisor(store, lambda: list(urls), None, SupervisorConfig())
    try:
        sup.reconcile_once()
        urls[:] = [second.url]  # node-a's agent moved (the agents file was edited)
        sup.reconcile_once()
        assert node(sup, second.url).reachable and node(sup, second.url).node == "node-a"
    finally:
        sup.close()
        store.close()
        first.close()
        second.close()


HOSTS = st.from_regex(r"[A-Za-z0-9.:-]{1,40}", fullmatch=True)  # names and addresses


@given(HOSTS, HOSTS)
def test_tokens_differ_per_host_and_secret(host, other):
    token = derive_agent_token(SECRET, host)
    assert len(token) >= 16 and token == derive_agent_token(SECRET, host.upper())
    if host.lower() != other.lower():
        assert token != derive_agent_token(SECRET, other)
    assert token != derive_agent_token(SECRET + "x", host)


def test_a_short_secret_or_both_kinds_of_token_are_refused():
    with pytest.raises(ValueError, match="shorter"):
        AgentTokens(secret="short")
    with pytest.raises(ValueError, match="not both"):
        AgentTokens(shared="t" * 16, secret=SECRET)
    assert AgentTokens(shared="t" * 16).for_url("http://any:1") == "t" * 16


def test_deploy_agent_token_prints_what_the_supervisor_derives(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    cli = [sys.executable, "-m", "rankguard.cli.main", "deploy", "agent-token"]
    out = subprocess.run([*cli, "--secret-file", str(secret), "Node-7"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == AgentTokens(secret=SECRET).for_url("http://node-7:9407")
    secret.chmod(0o644)
    out = subprocess.run([*cli, "--secret-file", str(secret), "n"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "chmod 600" in out.stderr and "Traceback" not in out.stderr
