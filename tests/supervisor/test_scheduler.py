"""Persistent node exclusion (issue 15): a node excluded for a hardware fault is drained in
the scheduler through a configurable command, and resumed only after its agent's verdict
was healthy for N passes in a row. The scheduler is a stub `scontrol` on PATH that records
its arguments."""

from __future__ import annotations

import json
import os
import stat

import pytest
from fake_agents import FakeAgent, rank

from rankguard.contract.answers import HealthReason
from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
from rankguard.supervisor.scheduler import (
    SLURM_DRAIN,
    Drained,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    command,
    readmit,
)
from rankguard.supervisor.state import ClusterObs, NodeObs
from rankguard.supervisor.store import IncidentStore

# -- pure parts -----------------------------------------------------------------------------


def test_readmit_counts_healthy_passes_in_a_row_and_resumes_at_n():
    d = {"n1": Drained("n1", "r", 1.0)}
    d, ready = readmit(d, {"n1": "healthy"}, 3)
    d, ready = readmit(d, {"n1": "healthy"}, 3)
    assert ready == [] and d["n1"].healthy_passes == 2
    d, ready = readmit(d, {"n1": "healthy"}, 3)
    assert ready == ["n1"]


@pytest.mark.parametrize("bad", ["unhealthy", "degraded", None])
def test_readmit_starts_over_on_anything_but_healthy(bad):
    d = {"n1": Drained("n1", "r", 1.0, healthy_passes=2)}
    d, ready = readmit(d, {"n1": bad} if bad else {}, 3)  # None: unreachable or not polled
    assert ready == [] and d["n1"].healthy_passes == 0


def test_command_fills_placeholders_per_argument_without_a_shell():
    argv = command(SLURM_DRAIN, "gpu7", 'rankguard: GPU 1 is "lost"; rm -rf /')
    assert argv == ["scontrol", "update", "nodename=gpu7", "state=drain",
                    'reason=rankguard: GPU 1 is "lost"; rm -rf /']  # fmt: skip


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"drain_command": "scontrol update nodename={host}"}, "drain_command"),
        ({"drain_command": "scontrol update state=drain"}, "{node}"),
        ({"resume_command": ""}, "resume_command"),
        ({"resume_command": "scontrol 'unclosed {node}"}, "resume_command"),
        ({"resume_after_healthy_passes": 0}, "resume_after_healthy_passes"),
    ],
)
def test_config_refuses_bad_templates_and_counts(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("{", r"\{").replace("}", r"\}")):
        SchedulerConfig(**kwargs)


# -- the stub scontrol ----------------------------------------------------------------------


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A stub `scontrol` first on PATH: appends its argv as one JSON line to calls.jsonl,
    and exits with the code in ./exit_code (0 when absent)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.jsonl"
    exit_file = tmp_path / "exit_code"
    stub = bin_dir / "scontrol"
    stub.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys, pathlib\n"
        f"with open({str(log)!r}, 'a') as f: f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"p = pathlib.Path({str(exit_file)!r})\n"
        "code = int(p.read_text()) if p.exists() else 0\n"
        "if code: print('slurm_update error: Invalid node name specified', file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    class Stub:
        def calls(self) -> list[list[str]]:
            return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []

        def fail(self, code: int) -> None:
            exit_file.write_text(str(code))

    return Stub()


def obs(status: str | None, node: str = "gpu7") -> ClusterObs:
    if status is None:
        return ClusterObs(0.0, (NodeObs.unreachable("http://x", "refused", 0.0, node=node),))
    return ClusterObs(0.0, (NodeObs(node, "http://x", True, 0.0, status=status),))


def test_drain_then_resume_after_n_healthy_passes_and_remembered_across_restarts(
    tmp_path, scontrol
):
    db = tmp_path / "rankguard.db"
    cfg = SchedulerConfig(resume_after_healthy_passes=3)
    s = Scheduler(cfg, db)
    outcome = s.exclude("gpu7", "critical hardware fault: GPU 1 is lost")
    assert outcome["ok"] and scontrol.calls() == [
        ["update", "nodename=gpu7", "state=drain",
         "reason=rankguard: critical hardware fault: GPU 1 is lost"]
    ]  # fmt: skip
    s.observe(obs("healthy"))
    s.observe(obs("unhealthy"))  # the count starts over
    s.observe(obs("healthy"))
    s.close()
    s = Scheduler(cfg, db)  # a supervisor restart: the drained node is still known
    assert set(s.drained) == {"gpu7"}
    for _ in range(2):
        assert s.observe(obs("healthy")) == []
    assert s.observe(obs(None)) == []  # unreachable is not a passed health check
    assert len(scontrol.calls()) == 1
    for _ in range(2):
        s.observe(obs("healthy"))
    assert s.observe(obs("healthy"))[0]["ok"]
    assert scontrol.calls()[1:] == [["update", "nodename=gpu7", "state=resume"]]
    assert s.drained == {}
    s.close()
    assert Scheduler(cfg, db).drained == {}  # resumed: forgotten in the database too


def test_a_standby_remembers_the_leaders_drain_and_resumes_only_once_it_leads(tmp_path, scontrol):
    # Two supervisors, one acting: the node the leader drained is the next leader's to
    # resume; a standby (or a leader that stepped down) counts the healthy passes only.
    db = tmp_path / "standby.db"
    s = Scheduler(SchedulerConfig(resume_after_healthy_passes=2), db)
    s.remember("gpu7", "by sup-a: GPU 1 is lost", 100.0)
    for _ in range(4):
        assert s.observe(obs("healthy"), act=False) == []
    assert scontrol.calls() == [] and set(s.drained) == {"gpu7"}
    s.close()
    s = Scheduler(SchedulerConfig(resume_after_healthy_passes=2), db)  # kept on disk
    assert s.drained["gpu7"].drained_at == 100.0
    s.observe(obs("healthy"), act=False)
    s.observe(obs("healthy"), act=False)
    assert s.observe(obs("healthy"))[0]["ok"]  # it leads now: past its streak, resumed
    assert scontrol.calls() == [["update", "nodename=gpu7", "state=resume"]]
    s.close()


def test_a_refused_drain_is_not_remembered_and_a_refused_resume_is_retried(tmp_path, scontrol):
    cfg = SchedulerConfig(resume_after_healthy_passes=1)
    s = Scheduler(cfg, tmp_path / "db")
    scontrol.fail(1)
    outcome = s.exclude("gpu7", "x")
    assert not outcome["ok"] and "Invalid node name" in outcome["error"]
    assert s.drained == {}  # never drained by us: never resumed by us either
    scontrol.fail(0)
    s.exclude("gpu7", "x")
    scontrol.fail(1)
    assert not s.observe(obs("healthy"))[0]["ok"]
    assert "gpu7" in s.drained  # still out; tried again after another run of healthy passes
    scontrol.fail(0)
    assert s.observe(obs("healthy"))[0]["ok"] and s.drained == {}
    assert [c[-1] for c in scontrol.calls()] == ["reason=rankguard: x"] * 2 + ["state=resume"] * 2


def test_a_missing_command_or_drain_off_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol anywhere
    s = Scheduler(SchedulerConfig(), tmp_path / "db")
    assert s.exclude("gpu7", "x")["error"] == "scontrol: command not found"
    assert Scheduler(SchedulerConfig(drain=False), None).exclude("gpu7", "x") is None


# -- through the supervisor -----------------------------------------------------------------


def test_supervisor_drains_a_node_with_a_hardware_fault_and_resumes_it_when_healthy(
    tmp_path, scontrol
):
    agent = FakeAgent("gpu7")
    agent.ranks = [rank("j", r, 2) for r in range(2)]
    agent.verdict("unhealthy", HealthReason("gpu_lost", "unhealthy", "GPU 1 is lost (GPU_IS_LOST)"))
    store = IncidentStore(tmp_path / "rankguard.db")
    cfg = SupervisorConfig(scheduler=SchedulerConfig(resume_after_healthy_passes=3))
    sup = Supervisor(store, lambda: [agent.url], "t" * 16, cfg)
    sup.poller.node_interval = 0  # read the verdict on every pass (it is cached 1 s)
    try:
        decisions = sup.reconcile_once()
        assert [d.action for d in decisions] == ["exclude_node"]
        ((*drain, reason),) = scontrol.calls()
        assert drain == ["update", "nodename=gpu7", "state=drain"]
        assert reason.startswith("reason=rankguard: ") and "GPU 1 is lost" in reason
        (action,) = [a for i in store.list_incidents() for a in store.actions(i.id)]
        assert action.kind == "exclude_node" and action.result["scheduler"]["ok"] is True
        assert [path for path, _, _ in agent.controls] == ["/v1/control/stop-job"]
        sup.reconcile_once()  # still unhealthy: no resume, no second drain
        assert len(scontrol.calls()) == 1
        del agent.raw["/v1/node"]  # the fake agent answers healthy again
        for _ in range(2):
            sup.reconcile_once()
        assert len(scontrol.calls()) == 1
        sup.reconcile_once()
        assert scontrol.calls()[-1] == ["update", "nodename=gpu7", "state=resume"]
    finally:
        sup.close()
        store.close()
        agent.close()


def test_an_unusable_database_is_one_clear_error(tmp_path):
    bad = tmp_path / "not.db"
    bad.write_bytes(b"\x00garbage" * 512)
    with pytest.raises(SchedulerError, match="not.db: cannot keep the drained nodes there"):
        Scheduler(SchedulerConfig(), bad)
