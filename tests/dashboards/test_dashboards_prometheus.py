"""End to end: a real Prometheus, configured like the example prometheus.yml (file-based
discovery, the generated rules), scrapes the agent and supervisor of `rankguard up` while
the trainer runs and one rank is killed. Then every panel and annotation query of every
dashboard, run through Prometheus's HTTP API over the run, returns data, and the RankDead
alert fired naming the killed rank.

The agent reads GPUs from the NVML double (RANKGUARD_NVML_DOUBLE), so the GPU panels are
checked too; the rank processes are entered in the double so per-rank GPU memory exists.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import http_json, wait_until
from prometheus_harness import Prometheus, prometheus_bin

from rankguard.agent.nvml_double import ENV_VAR, make_double, write_state
from rankguard.dashboards import build, promql, yamlout

pytestmark = pytest.mark.slow

# Queries that legitimately have no data on the test machine, and why.
NO_DATA_HERE = {
    "rankguard / Storage and network / InfiniBand throughput": "no InfiniBand port on this machine",
    "rankguard / Storage and network / InfiniBand link rate": "no InfiniBand port on this machine",
}


def atomic_write(path: Path, text: str) -> None:
    """Prometheus's file_sd reacts to file events: never let it read half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_every_panel_query_has_data_and_rank_dead_fires(tmp_path):
    prometheus_bin()
    gen = tmp_path / "gen"
    build.write(gen, build.render_all())
    prom_dir = gen / "prometheus"
    (prom_dir / "live").mkdir()
    config = prom_dir / "test-prometheus.yml"
    prom_config = build.prometheus_config(
        scrape_interval="1s", evaluation_interval="1s",
        agent_targets="live/agents*.json", supervisor_targets="live/supervisor*.json")  # fmt: skip
    for scrape in prom_config["scrape_configs"]:
        # the files are also re-read every second: a host out of inotify instances (a
        # shared CI runner) leaves file_sd on its 5-minute refresh otherwise
        scrape["file_sd_configs"][0]["refresh_interval"] = "1s"
    config.write_text(yamlout.dump(prom_config))
    prom = Prometheus(config, tmp_path)
    double = tmp_path / "nvml.json"
    write_state(double, make_double(n_gpus=2))
    run = tmp_path / "run"
    start = time.time()
    # Warm restarts (up's default) close the death's incident within about a second, often
    # between two scrapes: RankDead must fire from the incident's detection time then.
    up = subprocess.Popen(
        [sys.executable, "-m", "rankguard.cli.main", "up", "--steps", "200", "--ckpt-every", "20",
         "--run-dir", str(run),
         "--trainer-arg=--d-model=128", "--trainer-arg=--n-layer=4", "--trainer-arg=--n-head=4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, ENV_VAR: str(double)},
    )  # fmt: skip
    output: list[str] = []
    try:
        # `rankguard up: run DIR | agent URL | supervisor URL`: register both with file_sd.
        while not (
            m := re.search(
                r"agent http://(\S+) \| supervisor http://(\S+)", line := up.stdout.readline()
            )
        ):
            output.append(line)
            assert line, "rankguard up ended before starting:\n" + "".join(output)
        agent, supervisor = m.groups()
        atomic_write(prom_dir / "live/agents.json", build.file_sd([agent]))
        atomic_write(prom_dir / "live/supervisor.json", build.file_sd([supervisor]))
        # Put the ranks' processes on the double's GPUs (per-rank GPU memory).
        ranks = wait_until(lambda: len(r := http_json(f"http://{agent}/v1/ranks")["ranks"]) == 2 and r,
                           120, "two ranks")  # fmt: skip
        state = make_double(n_gpus=2)
        for gpu, rank in zip(state["gpus"], sorted(ranks, key=lambda r: r["rank"]), strict=True):
            gpu["processes"] = [{"pid": rank["pid"], "used_memory": 8 * 2**30}]
        write_state(double, state)
        # Prometheus must have scraped both daemons before the fault: a counter first
        # scraped after its incident starts at 1, and increase() never sees that step.
        try:
            wait_until(lambda: prom.query('up{job="rankguard-supervisor"} == 1')
                       and prom.query("rankguard_rank_gpu_memory_bytes"),
                       120, "Prometheus scraping the supervisor and the ranks' GPU memory")  # fmt: skip
        except AssertionError as e:
            targets = [(t["scrapePool"], t["health"], t["lastError"])
                       for t in prom.get("/targets")["data"]["activeTargets"]]  # fmt: skip
            memory = prom.query("rankguard_rank_gpu_memory_bytes")
            now = [
                (r["rank"], r["pid"], r["state"])
                for r in http_json(f"http://{agent}/v1/ranks")["ranks"]
            ]
            listed = [g["processes"] for g in state["gpus"]]
            raise AssertionError(f"{e}; targets {targets}; rank GPU memory {memory}; ranks (rank, "
                                 f"pid, state) {now}; the double's processes {listed}") from None  # fmt: skip
        # The one fault: kill rank 1 once training is past its first checkpoint (a fixed
        # delay would race torch's start-up on a loaded machine).
        wait_until(lambda: min(r["step"] or 0 for r in http_json(f"http://{agent}/v1/ranks")["ranks"]) >= 25,
                   120, "training past step 25")  # fmt: skip
        inject = subprocess.run(
            [sys.executable, "-m", "rankguard.cli.main", "inject", "kill", "--rank", "1", "--job", run.name,
             "--agent", f"http://{agent}", "--token-file", str(run / "token")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert inject.returncode == 0, inject.stderr
        fired = wait_until(lambda: prom.query('ALERTS{alertname="RankDead", alertstate="firing"}'), 120,
                           "the RankDead alert to fire")  # fmt: skip
        output += up.stdout.readlines()
        assert up.wait(timeout=300) == 0, "".join(output)[-3000:]
        time.sleep(3)  # let the last scrapes and rule evaluations land
        end = time.time()

        labels = fired[0]["metric"]
        assert (labels["rank"], labels["severity"], labels["training_job"]) == (
            "1",
            "critical",
            run.name,
        )

        empty: set[str] = set()  # panels (and annotations) none of whose queries has data
        for dash in (build.dashboard_data(n) for n in build.DASHBOARDS):
            shown = [
                (f"{dash['title']} / {p['title']}", [t["expr"] for t in p["targets"]])
                for p in dash["panels"]
            ]
            shown += [
                (f"{dash['title']} / annotation {a['name']}", [a["expr"]])
                for a in dash["annotations"]["list"]
            ]
            for where, exprs in shown:
                # Grafana's All is ".*"; its $__rate_interval is 4 scrape intervals.
                subs = (promql.substitute_variables(e, interval="4s") for e in exprs)
                if not any(prom.query_range(q, start, end, 1) for q in subs):
                    empty.add(where)
        assert empty == set(NO_DATA_HERE), f"queries without data: {sorted(empty)}"
        # The recording rules the dashboards join on were evaluated.
        assert prom.query_range("rankguard:agent_node:info", start, end, 5)
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=60)
        prom.stop()
    # Prometheus found the targets through the files.
    assert json.loads((prom_dir / "live/agents.json").read_text())[0]["targets"] == [agent]
