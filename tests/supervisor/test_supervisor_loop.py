"""The reconcile loop against a real agent (in process) and real rank processes: fast
checks that observe -> detect -> decide -> act -> record is wired end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from harness import wait_until

from rankguard.agent.config import AgentConfig
from rankguard.agent.daemon import Agent
from rankguard.agent.nvml_double import NvmlDouble, make_double
from rankguard.contract.secrets import write_secret_file
from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
from rankguard.supervisor.store import IncidentStore
from rankguard.supervisor.views import RECENT_INCIDENT_SECONDS, cluster_view, make_registry

RANK = """
import os, sys, time
from rankguard.client import TelemetrySender
from rankguard.contract.telemetry import SCHEMA_VERSION
sender, rank = TelemetrySender(sys.argv[1]), int(sys.argv[2])
restart = int(sys.argv[3]) if len(sys.argv) > 3 else 0
ckpt = int(sys.argv[4]) if len(sys.argv) > 4 else None
for step in range(1, 10**6):
    sender.send(dict(v=SCHEMA_VERSION, job="j", rank=rank, local_rank=rank, world_size=2,
        pid=os.getpid(), restart=restart, step=step, phase="train", time=time.time(),
        step_seconds=0.05, data_wait_seconds=0.0, compute_seconds=0.04, comm_seconds=0.01,
        comm_exposed_seconds=0.0, optimizer_seconds=0.0, checkpoint_block_seconds=0.0,
        tokens_per_second=1000.0, mfu=0.1, peak_memory_bytes=1, loss=2.0, checkpoint_step=ckpt))
    time.sleep(0.05)
"""


@pytest.fixture
def node(tmp_path):
    token = tmp_path / "token"
    token.write_text("a-token-for-the-loop-tests-0123")
    token.chmod(0o600)
    cfg = AgentConfig(bind="127.0.0.1:0", interval=0.2, token_file=token,
                      telemetry_socket=str(tmp_path / "t.sock"), node="n1")  # fmt: skip
    agent = Agent(cfg, nvml=NvmlDouble(make_double(n_gpus=1)))
    agent.collect_once()
    host, port = agent.start_http()
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, cfg.telemetry_socket, str(r)]) for r in (0, 1)
    ]
    store = IncidentStore(tmp_path / "db.sqlite")
    sup = Supervisor(store, lambda: [f"http://{host}:{port}"], agent.token, SupervisorConfig())
    yield sup, ranks
    for p in ranks:  # the list may have grown: a test's later incarnations
        p.kill()
        p.wait()
    sup.close()
    store.close()
    agent.close()


def test_loop_sees_ranks_and_records_a_death(node):
    sup, ranks = node
    wait_until(lambda: (sup.reconcile_once(), len(sup.last_obs.ranks()) == 2)[1], 20, "two ranks")
    assert sup.store.list_incidents() == []
    assert cluster_view(sup)["jobs"]["j"]["state"] == "running"
    ranks[1].kill()
    inc = wait_until(
        lambda: (sup.reconcile_once(), sup.store.list_incidents())[1], 10, "an incident"
    )
    (dead,) = inc
    assert (dead.kind, dead.rank, dead.action) == ("rank_dead", 1, "none")
    assert dead.time_to_detect is not None and dead.time_to_detect < 1.0
    sup.reconcile_once()  # a second pass: still one incident, no action twice
    assert len(sup.store.list_incidents()) == 1
    assert cluster_view(sup)["status"] == "degraded"  # the job is recovering
    text = b"".join(m.name.encode() for m in make_registry(sup).collect())
    assert b"rankguard_supervisor_incidents" in text


def test_hang_is_acted_on_once_through_the_agent(node):
    sup, ranks = node
    wait_until(lambda: (sup.reconcile_once(), len(sup.last_obs.ranks()) == 2)[1], 20, "two ranks")
    wait_until(lambda: (sup.reconcile_once(), all((r.step or 0) > 6 for r in sup.last_obs.ranks()))[1],
               20, "a few steps")  # fmt: skip
    # SIGSTOP rank 1 only: every rank stopped at once would be a scheduler's suspend
    ranks[1].send_signal(19)
    hung = wait_until(
        lambda: (sup.reconcile_once(), [i for i in sup.store.list_incidents() if i.kind == "rank_hung"])[1],
        15, "a hang incident",
    )  # fmt: skip
    wait_until(lambda: ranks[1].poll() is not None, 10, "the culprit killed")
    for _ in range(3):
        sup.reconcile_once()
    (inc,) = [i for i in sup.store.list_incidents() if i.kind == "rank_hung"]
    assert inc.id == hung[0].id and inc.action == "kill_rank"
    assert len([a for a in sup.store.actions(inc.id) if a.kind == "kill_rank"]) == 1
    time.sleep(0.1)


def test_a_restart_dead_before_reporting_its_checkpoint_keeps_the_known_one(node, tmp_path):
    """Ranks of a new incarnation report no checkpoint until they have resumed; one that
    dies before then (a full disk failing the resume) is recorded with the newest
    validated checkpoint the job last reported, not with none."""
    sup, ranks = node
    wait_until(lambda: (sup.reconcile_once(), len(sup.last_obs.ranks()) == 2)[1], 20, "two ranks")
    for p in ranks:
        p.kill()
        p.wait()
    sock = str(tmp_path / "t.sock")
    ranks.clear()
    ranks.extend(subprocess.Popen([sys.executable, "-c", RANK, sock, str(r), "1", "60"])
                 for r in (0, 1))  # fmt: skip
    wait_until(
        lambda: (sup.reconcile_once(), {r.checkpoint_step for r in sup.last_obs.ranks()} == {60})[1],
        20, "checkpoint 60 reported",
    )  # fmt: skip
    for p in ranks:
        p.kill()
        p.wait()
    ranks.extend(subprocess.Popen([sys.executable, "-c", RANK, sock, str(r), "2"]) for r in (0, 1))
    wait_until(
        lambda: (sup.reconcile_once(), {r.restart for r in sup.last_obs.current_ranks("j")} == {2})[1],
        20, "the second incarnation",
    )  # fmt: skip
    ranks[-1].kill()
    dead = wait_until(
        lambda: (sup.reconcile_once(), sup.store.by_key("rank_dead:j:2"))[1], 10, "its death"
    )
    assert dead.checkpoint_step == 60


def test_a_killed_hung_rank_is_one_incident_with_its_timeline(node, tmp_path):
    """The supervisor kills the culprit of a hang; the rank then shows dead. That death is
    a step of the hang incident (no rank_dead incident, so one alert), and the incident's
    timeline runs: detected, stacks captured, killed, the rank's exit, group restarted,
    first new step; then the restart's phases from the workers' startup milestones."""
    sup, ranks = node
    trace = tmp_path / "startup.jsonl"
    sup.cfg.startup_trace = str(trace)
    wait_until(lambda: (sup.reconcile_once(), len(sup.last_obs.ranks()) == 2)[1], 20, "two ranks")
    wait_until(lambda: (sup.reconcile_once(), all((r.step or 0) > 6 for r in sup.last_obs.ranks()))[1],
               20, "a few steps")  # fmt: skip
    # SIGSTOP rank 1: a hang whose culprit is the stopped process (both stopped would be
    # a scheduler's suspend of the job, never acted on)
    ranks[1].send_signal(19)
    hung = wait_until(
        lambda: (sup.reconcile_once(), [i for i in sup.store.list_incidents() if i.action == "kill_rank"])[1],
        15, "the hang acted on",
    )  # fmt: skip
    wait_until(lambda: (sup.reconcile_once(), any(r.dead for r in sup.last_obs.ranks()))[1],
               10, "the culprit dead")  # fmt: skip
    for _ in range(3):
        sup.reconcile_once()
    assert [i.kind for i in sup.store.list_incidents()] == ["rank_hung"]  # no rank_dead
    assert hung[0].state == "acting" or sup.store.get(hung[0].id).state == "recovering"
    assert cluster_view(sup)["jobs"]["j"]["state"] == "recovering"
    # one alert: the open-incident gauge the alert rules read names the hang only
    (gauge,) = [
        m for m in make_registry(sup).collect() if m.name == "rankguard_supervisor_incident_open"
    ]
    assert [(s.labels["kind"], s.value) for s in gauge.samples] == [("rank_hung", 1)]
    for p in ranks:  # the "group restart": a new incarnation of both ranks
        p.kill()
        p.wait()
    wait_until(lambda: (sup.reconcile_once(), all(r.exited_at for r in sup.last_obs.ranks()))[1],
               10, "the old group's exits seen")  # fmt: skip
    old_end = max(r.exited_at for r in sup.last_obs.ranks())
    sock = str(tmp_path / "t.sock")
    new = [subprocess.Popen([sys.executable, "-c", RANK, sock, str(r), "1"]) for r in (0, 1)]
    ranks.extend(new)
    # what the new workers' trainer would write (trainer/startup_trace.py): job and
    # incarnation from "built" on; rank 1 the slower one
    t0 = max(time.time(), old_end + 0.2)
    lines = [{"rank": r, "restart": 1, "pid": p.pid, "event": e, "time": t0 + r * 0.1 + k * 0.5,
              **({"job": "j", "incarnation": 1} if k >= 3 else {})}
             for r, p in enumerate(new) for k, e in enumerate(
                 ("process_start", "imported", "process_group", "built", "resumed", "first_step"))]  # fmt: skip
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    inc = wait_until(
        lambda: (sup.reconcile_once(), sup.store.get(hung[0].id))[1].state == "resolved"
        and sup.store.get(hung[0].id), 20, "the recovery",
    )  # fmt: skip
    what = [e.what for e in sup.store.events(inc.id)]
    for step in ("detected", "kill_rank requested", "kill_rank done", "stacks captured",
                 "rank exited (our action)", "group restarted", "first new step", "resolved"):  # fmt: skip
        assert step in what, (step, what)
    order = [what.index(s) for s in ("detected", "kill_rank done", "rank exited (our action)",
                                     "group restarted", "first new step")]  # fmt: skip
    assert order == sorted(order), what
    assert what.count("rank exited (our action)") == 1
    assert inc.restarted_at and inc.first_step_at and inc.resumed_step == 0
    assert [i.kind for i in sup.store.list_incidents()] == ["rank_hung"]
    (phases,) = [e.detail for e in sup.store.events(inc.id) if e.what == "restart phases"]
    assert phases["teardown"] == pytest.approx(old_end - inc.acted_at, abs=0.002)
    assert phases["respawn"] == pytest.approx(t0 + 0.1 - old_end, abs=0.002)
    assert [phases[k] for k in ("imports", "rendezvous", "build", "state_load", "first_step")] == [
        0.5, 0.5, 0.5, 0.5, 0.5]  # fmt: skip
    wait_until(lambda: (sup.reconcile_once(), cluster_view(sup)["jobs"]["j"]["state"])[1] == "running",
               10, "the job running again")  # fmt: skip
    # resolved: no longer open, but its detection stays visible to the alert rules for a
    # while (a restart this quick would otherwise fall between two scrapes)
    families = {m.name: m for m in make_registry(sup).collect()}
    assert families["rankguard_supervisor_incident_open"].samples == []
    (seen,) = families["rankguard_supervisor_incident_detected_timestamp_seconds"].samples
    assert seen.labels == {"kind": "rank_hung", "training_job": "j", "node": inc.node, "rank": "1"}
    assert seen.value == inc.detected_at
    sup.clock = lambda: inc.detected_at + RECENT_INCIDENT_SECONDS + 1  # and then it grows old
    families = {m.name: m for m in make_registry(sup).collect()}
    assert families["rankguard_supervisor_incident_detected_timestamp_seconds"].samples == []


def test_a_dead_rank_is_explained_by_a_new_xid_on_its_gpu(tmp_path):
    """Zero GPU code in the rank: its GPU is the one NVML (the double) lists its pid on;
    an XID there while it runs is in its incident, another GPU's XID is not."""
    token = tmp_path / "token"
    write_secret_file(token, "a-token-for-the-loop-tests-0123")
    cfg = AgentConfig(bind="127.0.0.1:0", interval=0.2, token_file=token,
                      telemetry_socket=str(tmp_path / "t.sock"), node="n1")  # fmt: skip
    nvml = NvmlDouble(make_double(n_gpus=2))
    agent = Agent(cfg, nvml=nvml)
    host, port = agent.start_http()
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, cfg.telemetry_socket, str(r)]) for r in (0, 1)
    ]
    store = IncidentStore(tmp_path / "db.sqlite")
    sup = Supervisor(store, lambda: [f"http://{host}:{port}"], agent.token, SupervisorConfig())
    try:
        for r, p in enumerate(ranks):
            nvml.update_gpu(r, processes=[{"pid": p.pid, "used_memory": 2**30}])
        uuid = nvml.state()["gpus"][1]["uuid"]

        def gpus() -> dict:
            agent.collect_once()
            sup.reconcile_once()
            return {r.rank: r.gpu for r in sup.last_obs.ranks() if r.gpu is not None}

        wait_until(lambda: len(gpus()) == 2, 20, "both ranks tied to their GPUs")
        assert gpus()[1].uuid == uuid and gpus()[1].source == "nvml"
        nvml.inject_xid(1, 79)
        nvml.inject_xid(0, 13)
        wait_until(lambda: gpus()[1].xid_recent == {"79": 1}, 10, "the XID on rank 1's GPU")
        ranks[1].kill()
        nvml.update_gpu(1, processes=[])  # as a real GPU does: a dead process leaves its list
        [dead] = wait_until(
            lambda: (gpus(), [i for i in store.list_incidents() if i.kind == "rank_dead"])[1],
            10, "the death",
        )  # fmt: skip
        assert f"its GPU {uuid} (index 1): XID 79 x1" in dead.summary, dead.summary
        assert "XID 13" not in dead.summary
    finally:
        for p in ranks:
            p.kill()
            p.wait()
        sup.close()
        store.close()
        agent.close()
