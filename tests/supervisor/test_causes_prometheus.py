"""A cause on every incident, counted and drawn: real agents (in process, GPUs from the
NVML double: no GPU here) on a fault of each node-level cause class, the real reconcile
loop and HTTP service, and a real Prometheus scraping the supervisor. The overview's
"Interruptions by cause" query returns every class, and `rankguard incidents --by-cause`
prints the same table from the database.

The classes a training process causes (data, host, user code) are driven by the trainer's
faults in one job, under the same Prometheus query."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from builders import small_tmpfs
from harness import http_json, start_agent, start_supervisor, torchrun, wait_until
from prometheus_harness import Prometheus, prometheus_bin

from rankguard.agent.config import AgentConfig
from rankguard.agent.daemon import Agent
from rankguard.agent.nvml_double import NvmlDouble, make_double
from rankguard.contract.secrets import write_secret_file
from rankguard.dashboards import build, promql, yamlout
from rankguard.service.httpd import serve
from rankguard.supervisor.daemon import supervisor_service
from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
from rankguard.supervisor.store import IncidentStore

pytestmark = pytest.mark.slow

# node -> (how its fault is made, the cause it must be counted under)
XIDS = {"n0": (79, "gpu"), "n1": (48, "gpu_memory"), "n2": (74, "nvlink")}
# NVML cannot load (rankguard); a full checkpoint disk (storage); an InfiniBand port goes
# down (network: a fake /sys tree, no InfiniBand here)
BLIND, FULL, PORT = "n3", "n4", "n5"
NODE_CAUSES = {**{n: c for n, (_, c) in XIDS.items()}, BLIND: "rankguard", FULL: "storage",
               PORT: "network"}  # fmt: skip


def ib_port(sys_root, state: str) -> None:
    port = sys_root / "class/infiniband/mlx5_0/ports/1"
    (port / "counters").mkdir(parents=True, exist_ok=True)
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (port / "state").write_text(state + "\n")


def _panel_query(title: str) -> str:
    """The overview panel's first query, over a range that holds the whole test."""
    dash = json.loads(build.render_all()["grafana/rankguard-overview.json"])
    panel = next(p for p in dash["panels"] if p.get("title") == title)
    return promql.substitute_variables(panel["targets"][0]["expr"], interval="10m")


def test_each_cause_is_labelled_counted_and_drawn(tmp_path):
    prometheus_bin()
    token = tmp_path / "token"
    write_secret_file(token, "a-token-for-the-cause-tests-0123")
    with contextlib.ExitStack() as stack:
        full = stack.enter_context(small_tmpfs(tmp_path / "ckfs", "4m"))
        with open(full / "filler", "wb") as f:  # all but nothing left: unhealthy
            f.write(b"\0" * (4 * 1024 * 1024 - 64 * 1024))
        agents, nvmls, urls = [], {}, []
        ib_port(tmp_path / "sys", "4: ACTIVE")
        for node in NODE_CAUSES:
            nvml = NvmlDouble(make_double(n_gpus=2))
            if node == BLIND:
                nvml.set_unavailable("NVML_ERROR_LIBRARY_NOT_FOUND")
            cfg = AgentConfig(bind="127.0.0.1:0", interval=0.2, token_file=token,
                              expected_gpus=2, telemetry_socket=str(tmp_path / f"{node}.sock"),
                              node=node, ckpt_dir=full if node == FULL else None)  # fmt: skip
            agent = Agent(cfg, nvml=nvml, sys_root=tmp_path / "sys" if node == PORT else None)
            stack.callback(agent.close)
            host, port = agent.start_http()
            agents.append(agent)
            nvmls[node] = nvml
            urls.append(f"http://{host}:{port}")
        db = tmp_path / "db.sqlite"
        store = IncidentStore(db)
        stack.callback(store.close)
        sup = Supervisor(store, lambda: urls, agents[0].token, SupervisorConfig())
        stack.callback(sup.close)
        server = serve(supervisor_service(sup), "127.0.0.1", 0)
        stack.callback(server.shutdown)
        config = tmp_path / "prometheus.yml"
        config.write_text(yamlout.dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "rankguard-supervisor", "static_configs": [
                {"targets": [f"127.0.0.1:{server.server_address[1]}"]}]}],
        }))  # fmt: skip
        prom = Prometheus(config, tmp_path)
        stack.callback(prom.stop)
        incidents = _panel_query("Interruptions by cause")

        def passes() -> list:
            for agent in agents:
                agent.collect_once()
            sup.reconcile_once()
            return store.list_incidents()

        for agent in agents:  # the agents' first look (the port is seen active)
            agent.collect_once()
        # the counters scraped at zero first, so their increase counts every incident
        wait_until(lambda: prom.query("rankguard_supervisor_incidents_by_cause_total"), 30,
                   "the supervisor scraped before its first pass")  # fmt: skip
        for node, (code, _) in XIDS.items():
            nvmls[node].inject_xid(1, code)
        ib_port(tmp_path / "sys", "1: DOWN")  # seen active since the agent started
        found = wait_until(
            lambda: {i.node: i for i in passes() if i.kind == "node_fault"}.keys() >= NODE_CAUSES.keys()
            and {i.node: i for i in store.list_incidents() if i.kind == "node_fault"}, 30,
            "a node fault on every node",
        )  # fmt: skip
        for node, cause in NODE_CAUSES.items():
            inc = next(i for i in found.values() if i.node == node)
            assert (inc.cause, inc.cause_confidence) == (cause, "high"), inc
            assert inc.cause_why, inc

        def counted() -> dict:
            passes()
            return {r["metric"]["cause"]: float(r["value"][1]) for r in prom.query(incidents)}

        got = wait_until(lambda: (c := counted()) and all(c.get(v, 0) >= 1 for v in
                                                          NODE_CAUSES.values()) and c,
                         30, "the panel's query to count every cause")  # fmt: skip
        assert got.get("unknown", 0) == 0, got
        cli = subprocess.run([sys.executable, "-m", "rankguard.cli.main", "incidents",
                              "--by-cause", "--db", str(db)], capture_output=True, text=True)  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        rows = {line.split()[0]: line.split()[1] for line in cli.stdout.splitlines()[1:]}
        assert all(int(rows[c]) >= 1 for c in NODE_CAUSES.values()), cli.stdout
        timeline = subprocess.run([sys.executable, "-m", "rankguard.cli.main", "incidents",
                                   "--db", str(db)], capture_output=True, text=True).stdout  # fmt: skip
        assert "cause: nvlink (high confidence): XID 74: NVLink error" in timeline, timeline


def test_the_trainers_faults_are_labelled_counted_and_drawn(tmp_path):
    """One job, three faults of three classes, as processes (agent, supervisor, torchrun):
    a NaN loss (data), its next incarnation's rank 1 stopped by SIGSTOP (host), the one
    after calling a different collective than its peer (a desync: user code, which stops
    the job). A collective timeout (collective) is labelled in test_supervisor_faults.py."""
    prometheus_bin()
    agent = start_agent(tmp_path)
    sup = start_supervisor(tmp_path, [agent.url])
    try:
        config = tmp_path / "prometheus.yml"
        config.write_text(yamlout.dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "rankguard-supervisor", "static_configs": [
                {"targets": [sup.url.removeprefix("http://")]}]}],
        }))  # fmt: skip
        prom = Prometheus(config, tmp_path)
        try:
            wait_until(lambda: prom.query("rankguard_supervisor_incidents_by_cause_total"), 30,
                       "the supervisor scraped before the job")  # fmt: skip

            def stop_rank_1_of_the_second_incarnation():
                rank = wait_until(lambda: next((
                    r for r in http_json(agent.url + "/v1/ranks")["ranks"]
                    if r["rank"] == 1 and r["restart"] == 1 and (r["step"] or 0) >= 35
                    and r["state"] == "alive"), None), 180, "rank 1 of restart 1 at step 35")  # fmt: skip
                os.kill(rank["pid"], signal.SIGSTOP)

            stopper = threading.Thread(target=stop_rank_1_of_the_second_incarnation, daemon=True)
            stopper.start()
            proc = torchrun(
                ["--steps", "120", "--ckpt-every", "10", "--keep", "0", "--d-model", "128",
                 "--n-layer", "4", "--n-head", "4", "--ckpt-dir", str(tmp_path / "ckpt"),
                 "--job", "job", "--fault", "nan:step=20:rank=0",
                 "--fault", "desync:step=70:rank=1:restart=2"],
                cwd=tmp_path, max_restarts=3, timeout=300,
                env={"RANKGUARD_TELEMETRY_SOCKET": str(agent.socket)},
            )  # fmt: skip
            assert proc.returncode != 0, proc.stderr[-3000:]  # the desync stopped the job
            found = http_json(sup.url + "/v1/incidents")["incidents"]
            causes = {(i["kind"], i["cause"]) for i in found}
            assert {("bad_numerics", "data"), ("rank_hung", "host"),
                    ("rank_hung", "user_code")} <= causes, json.dumps(found, indent=1)[:4000]  # fmt: skip
            query = _panel_query("Interruptions by cause")
            wait_until(lambda: {r["metric"]["cause"] for r in prom.query(query)
                                if float(r["value"][1]) > 0} >= {"data", "host", "user_code"},
                       30, "the panel's query to count the trainer's causes")  # fmt: skip
        finally:
            prom.stop()
    finally:
        sup.stop()
        agent.stop()
