"""Exposed communication through a real Prometheus: the agent exports each rank's exposed
share (`rankguard_rank_comm_exposed_step_ratio`, measured where the step blocks: backward
waiting for the all-reduce in DDP's finalization) beside the share in flight, and the
generated CommunicationOverheadHigh rule, judging the exposed share, stays silent on a
clean job and fires on a job whose all-reduces an injected delay makes the step wait for.

The rule is the generated one with its window and `for` shortened (`Targets`), so a run
of seconds is judged as production judges ten minutes."""

from __future__ import annotations

import time

import pytest
from harness import start_agent, torchrun, wait_until
from prometheus_harness import Prometheus, prometheus_bin

from rankguard.dashboards import build, rules, yamlout

# A clean job's exposed communication is its ranks waiting for each other: a test beside it
# on the same cores slows one rank and makes it real (seen with two workers).
pytestmark = [pytest.mark.slow, pytest.mark.alone]

# ~75 ms steps: compute well above the tiny model's all-reduce, on two loaded cores
MODEL = ["--d-model", "128", "--n-layer", "4", "--n-head", "4"]
ALERT = 'ALERTS{alertname="CommunicationOverheadHigh", alertstate="firing"}'


def test_exposed_comm_alert_silent_on_a_clean_job_and_firing_on_a_delayed_one(tmp_path):
    prometheus_bin()
    # `for` as production has it, shortened: one evaluation over the bar (a scheduler
    # blip on two shared cores, seen once on the clean job) is pending, not firing
    targets = rules.Targets(comm_window="10s", comm_for="5s")
    gen = tmp_path / "gen"
    build.write(gen, build.render_all(targets))
    prom_dir = gen / "prometheus"
    agent = start_agent(tmp_path)
    (prom_dir / "live").mkdir()
    (prom_dir / "live/agents.json").write_text(build.file_sd([agent.url.removeprefix("http://")]))
    config = prom_dir / "test-prometheus.yml"
    config.write_text(yamlout.dump(build.prometheus_config(
        scrape_interval="1s", evaluation_interval="1s",
        agent_targets="live/agents*.json", supervisor_targets="live/none*.json")))  # fmt: skip
    prom = Prometheus(config, tmp_path)
    env = {"RANKGUARD_TELEMETRY_SOCKET": str(agent.socket)}
    try:
        wait_until(lambda: prom.query('up{job="rankguard-agent"} == 1'), 60, "the agent scraped")
        # the clean job, then the same job with 0.1 s more on every all-reduce of rank 0
        for job, extra in (
            ("clean", []),
            ("delayed", ["--fault", "comm-delay:step=1:rank=0:seconds=0.1"]),
        ):
            proc = torchrun(["--steps", "100", "--job", job, *MODEL, *extra], cwd=tmp_path,
                            env=env, timeout=240)  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-3000:]
        time.sleep(2)  # the last scrapes and rule evaluations
        end = time.time()
        start = end - 600

        def series(expr: str) -> dict[tuple[str, str], list[float]]:
            return {(r["metric"]["training_job"], r["metric"]["rank"]):
                    [float(v) for _, v in r["values"]] for r in prom.query_range(expr, start, end, 1)}  # fmt: skip

        exposed = series("rankguard_rank_comm_exposed_step_ratio")
        in_flight = series("rankguard_rank_comm_step_ratio")
        fired = series(ALERT)
        clean_exposed = max(max(v) for k, v in exposed.items() if k[0] == "clean")
        delayed_exposed = min(max(v) for k, v in exposed.items() if k[0] == "delayed")
        # the exposed share is part of the share in flight, and the delay shows in it
        assert all(k in in_flight for k in exposed), (exposed.keys(), in_flight.keys())
        assert delayed_exposed > 0.3, exposed
        # the clean job never fired; the delayed job did, for the rank the delay is on
        assert [k for k in fired if k[0] == "clean"] == [], (fired, clean_exposed)
        assert ("delayed", "0") in fired, (fired, exposed)
    finally:
        prom.stop()
        agent.stop()
