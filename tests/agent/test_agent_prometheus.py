"""End to end: a real `rankguard agent`, a real torchrun trainer sending telemetry, and a
real Prometheus server (Debian's package, on a loopback port) scraping the agent."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest
from harness import check_sd_notify_lifecycle, free_port, http_json, run_ok, wait_until
from prometheus_harness import Prometheus, prometheus_bin

from rankguard.agent.nvml_double import make_double

pytestmark = pytest.mark.slow


@pytest.fixture
def running_agent(tmp_path):
    prometheus_bin()  # skip before starting anything where it is missing
    port = free_port()
    double = tmp_path / "nvml.json"
    double.write_text(json.dumps(make_double(n_gpus=2)))
    (tmp_path / "ckpt").mkdir()
    with open(tmp_path / "agent.log", "w") as log:  # the child keeps its own copy of the fd
        proc = subprocess.Popen(
            [sys.executable, "-m", "rankguard.cli.main", "agent", "--bind", f"127.0.0.1:{port}",
         "--interval", "0.5", "--telemetry-socket", str(tmp_path / "telemetry.sock"),
         "--ckpt-dir", str(tmp_path / "ckpt"), "--data-dir", str(tmp_path),
         "--nvml-double", str(double), "--node", "node-a", "--expected-gpus", "2"],
            stderr=log,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_json(base + "/healthz")["ok"], 30, "the agent to serve")
    yield {"base": base, "port": port, "socket": tmp_path / "telemetry.sock", "dir": tmp_path}
    proc.terminate()
    assert proc.wait(timeout=15) == 0, (tmp_path / "agent.log").read_text()[-3000:]


def test_prometheus_scrapes_rank_and_storage_series_during_training(tmp_path, running_agent):
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: rankguard-agent\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{running_agent['port']}']\n"
    )
    prom = Prometheus(config, tmp_path)
    query = prom.query
    try:
        run_ok(
            ["--steps", "150", "--ckpt-dir", str(running_agent["dir"] / "ckpt"),
             "--ckpt-every", "50", "--job", "e2e"],
            cwd=tmp_path, env={"RANKGUARD_TELEMETRY_SOCKET": str(running_agent["socket"])},
        )  # fmt: skip
        # The ranks' series, by rank, as Prometheus stored them.
        steps = wait_until(
            lambda: (r := query('max_over_time(rankguard_rank_step{training_job="e2e"}[5m])')) and len(r) == 2 and r,
            30, "rank series in prometheus",
        )  # fmt: skip
        assert sorted(s["metric"]["rank"] for s in steps) == ["0", "1"]
        assert all(float(s["value"][1]) > 0 for s in steps)
        assert query('rankguard_rank_comm_compute_ratio{training_job="e2e"}')
        assert query("rankguard_disk_read_bytes_total")
        assert query('rankguard_filesystem_free_bytes{role="checkpoint"}')
        # per-process I/O exists only while the ranks live: look back over the run
        assert query('max_over_time(rankguard_rank_written_bytes_total{training_job="e2e"}[5m])')
        up = query('up{job="rankguard-agent"}')
        assert up and up[0]["value"][1] == "1"
    finally:
        prom.stop()
    # The agent itself saw the job finish cleanly.
    ranks = http_json(running_agent["base"] + "/v1/ranks")["ranks"]
    assert {(r["rank"], r["state"]) for r in ranks if r["job"] == "e2e"} == {
        (0, "finished"),
        (1, "finished"),
    }
    assert all(r["checkpoint_step"] == 150 for r in ranks if r["job"] == "e2e")
    text = urllib.request.urlopen(running_agent["base"] + "/metrics").read().decode()
    assert 'rankguard_rank_step{rank="0",training_job="e2e"} 150.0' in text


def test_agent_speaks_sd_notify(tmp_path):
    """Under systemd (Type=notify, WatchdogSec): READY once serving, WATCHDOG every
    interval, STOPPING on SIGTERM, all through $NOTIFY_SOCKET."""
    check_sd_notify_lifecycle(
        tmp_path,
        ["agent", "--bind", f"127.0.0.1:{free_port()}", "--interval", "0.2",
         "--telemetry-socket", str(tmp_path / "t.sock")],
    )  # fmt: skip
