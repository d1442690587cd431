"""A hostile agent's answers (issue 13): too deep, mistyped, too large, or anything at all.
Each makes that one node unseen for the pass and is counted on /metrics; the pass
completes, and a real death on another node is still recorded."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from builders import json_values_without_nan
from builders import node_of as node
from builders import sup_metric as metric
from fake_agents import FakeAgent, rank
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankguard.contract.answers import RanksAnswer
from rankguard.supervisor.agents import MAX_ANSWER_BYTES
from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
from rankguard.supervisor.store import IncidentStore


@pytest.fixture
def cluster(tmp_path):
    honest, hostile = FakeAgent("honest"), FakeAgent("hostile")
    honest.ranks = [rank("j", 0), rank("j", 1)]
    hostile.ranks = [rank("h", 0, world=1)]
    store = IncidentStore(tmp_path / "db.sqlite")
    sup = Supervisor(store, lambda: [honest.url, hostile.url], None, SupervisorConfig())
    yield sup, honest, hostile
    sup.close()
    store.close()
    honest.close()
    hostile.close()


def deep_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def ranks_answer_with(node_name: str, **fields) -> bytes:
    body = RanksAnswer(node=node_name, time=0.0).to_json()  # a sound answer ...
    body["ranks"] = [{**rank("h", 0, world=1).to_json(), **fields}]  # ... with one bad rank
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "hostile_answer,reason",
    [(deep_json(200_000), "not_json"),
     (ranks_answer_with("hostile", checkpoint_step="x"), "bad_type"),
     (b"\xff\xfe{}", "not_utf8")],
    ids=["200k-deep", "checkpoint_step-x", "not-utf8"],
)  # fmt: skip
def test_a_hostile_answer_leaves_its_node_unseen_and_a_death_elsewhere_recorded(
    cluster, hostile_answer, reason
):
    sup, honest, hostile = cluster
    sup.reconcile_once()
    assert node(sup, hostile.url).reachable and sup.passes == 1
    hostile.raw["/v1/ranks"] = hostile_answer
    honest.ranks = [rank("j", 0), rank("j", 1, state="exited", exit_code=1)]
    sup.reconcile_once()
    assert sup.passes == 2  # the pass completed
    assert not node(sup, hostile.url).reachable
    assert "malformed answer" in node(sup, hostile.url).error
    assert node(sup, honest.url).reachable
    [dead] = [i for i in sup.store.list_incidents() if i.kind == "rank_dead"]
    assert (dead.job, dead.rank, dead.node) == ("j", 1, "honest")
    line = f'rankguard_supervisor_malformed_answers_total{{reason="{reason}"}}'
    assert metric(sup, line) == 1
    assert not hostile.controls  # nothing asked of the hostile agent


def test_a_300_mb_answer_is_refused_unread_and_memory_stays_bounded(cluster):
    sup, honest, hostile = cluster
    # declared: refused by its Content-Length, before one byte of the body is read
    hostile.raw["/v1/node"] = b"{}"
    hostile.headers_override["/v1/node"] = {"Content-Length": str(300 * 2**20)}
    sup.reconcile_once()
    assert not node(sup, hostile.url).reachable
    assert metric(sup, 'rankguard_supervisor_malformed_answers_total{reason="too_large"}') == 1
    # undeclared (chunked): read up to the cap, then the connection is dropped
    hostile.headers_override.clear()
    hostile.raw.clear()
    hostile.stream["/v1/ranks"] = 64 * 2**20
    tracemalloc.start()
    try:
        sup.reconcile_once()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not node(sup, hostile.url).reachable and node(sup, honest.url).reachable
    assert metric(sup, 'rankguard_supervisor_malformed_answers_total{reason="too_large"}') == 2
    assert peak < 4 * MAX_ANSWER_BYTES, f"a pass peaked at {peak / 2**20:.0f} MiB"
    assert sup.passes == 2


# Arbitrary JSON, and sound answers with one field replaced by arbitrary JSON: the two
# ways an agent can be wrong (nonsense, or one value out of contract).
RANK_FIELDS = sorted(rank().to_json())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    node_answer=st.one_of(st.none(), json_values_without_nan),
    ranks_answer=st.one_of(
        json_values_without_nan,
        st.tuples(st.sampled_from(RANK_FIELDS), json_values_without_nan),
        st.tuples(st.sampled_from(RANK_FIELDS), st.integers(-(2**70), 2**70) | st.floats()),
    ),
)
def test_no_answer_stops_a_pass(cluster, node_answer, ranks_answer):
    sup, honest, hostile = cluster
    hostile.raw.clear()
    if node_answer is not None:
        hostile.raw["/v1/node"] = json.dumps(node_answer).encode()
    if isinstance(ranks_answer, tuple):
        name, value = ranks_answer
        value = "NaN" if isinstance(value, float) and value != value else value
        hostile.raw["/v1/ranks"] = ranks_answer_with("hostile", **{name: value})
    else:
        hostile.raw["/v1/ranks"] = json.dumps(ranks_answer).encode()
    before = sup.passes
    sup.reconcile_once()
    assert sup.passes == before + 1
    assert node(sup, honest.url).reachable
    assert [r.job for r in node(sup, honest.url).ranks] == ["j", "j"]


def test_agents_from_dns_are_every_address_kept_through_a_failed_lookup():
    """--agents-dns: one agent URL per address the name resolves to (a headless Service),
    resolved again after the TTL; a failed or empty lookup keeps the last good list."""
    import socket

    from rankguard.supervisor.agents import AgentsDns

    answers = [
        [(socket.AF_INET, 0, 0, "", ("10.0.0.2", 9407)), (socket.AF_INET6, 0, 0, "", ("fd00::1", 9407, 0, 0)),
         (socket.AF_INET, 0, 0, "", ("10.0.0.2", 9407))],
        OSError("temporary failure in name resolution"),
        [],
        [(socket.AF_INET, 0, 0, "", ("10.0.0.3", 9407))],
    ]  # fmt: skip
    now = [0.0]

    def resolve(host, port, type):
        assert (host, port, type) == ("rankguard-agent.rankguard.svc", 9407, socket.SOCK_STREAM)
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    dns = AgentsDns("http://rankguard-agent.rankguard.svc:9407", ttl=10, resolve=resolve,
                    clock=lambda: now[0])  # fmt: skip
    first = ["http://10.0.0.2:9407", "http://[fd00::1]:9407"]
    assert dns.urls() == first
    now[0] = 5.0
    assert dns.urls() == first and len(answers) == 3  # within the TTL: not resolved again
    for t in (10.0, 20.0):  # the failure, then the empty answer: the last good list stays
        now[0] = t
        assert dns.urls() == first
    assert dns.errors == 2
    now[0] = 30.0
    assert dns.urls() == ["http://10.0.0.3:9407"]
    with pytest.raises(ValueError, match="NAME:PORT"):
        AgentsDns("http://rankguard-agent")
