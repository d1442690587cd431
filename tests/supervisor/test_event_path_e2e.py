"""A rank's death reaches an incident through /v1/rank-events, well before the next
sample poll: a real agent, a real rank process, a real supervisor polling every 5 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

from rankguard.cli.local_stack import Daemon, free_port, http_json, start_agent, wait_until

RANK = """
import sys, time
from rankguard.client import Reporter
env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "RANKGUARD_JOB": "ev"}
rg = Reporter(socket_path=sys.argv[1], environ=env)
step = 0
while True:
    step += 1
    with rg.step(step):
        time.sleep(0.05)
    rg.flush()
"""


def _passes(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("rankguard_supervisor_passes_total "):
                return int(float(line.split()[1]))
    raise AssertionError("no rankguard_supervisor_passes_total")


def _dead_incident(url: str):
    return next((i for i in http_json(url + "/v1/incidents")["incidents"]
                 if i["kind"] == "rank_dead"), None)  # fmt: skip


def test_a_death_reaches_an_incident_before_the_next_poll(tmp_path):
    agent = start_agent(tmp_path)
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(agent.socket)])
    sup = None
    try:
        wait_until(lambda: http_json(agent.url + "/v1/ranks")["ranks"], 20, "the rank")
        port = free_port()
        sup = Daemon(
            ["supervisor", "--bind", f"127.0.0.1:{port}", "--interval", "5",
             "--db", str(tmp_path / "rankguard.db"), "--token-file", str(tmp_path / "token"),
             "--agents", agent.url],
            tmp_path / "supervisor.log", f"http://127.0.0.1:{port}",
        )  # fmt: skip
        seen = lambda: http_json(sup.url + "/v1/ranks")["ranks"]  # noqa: E731
        wait_until(seen, 20, "the supervisor to see the rank")
        # a pass just ended: the next sample poll is ~5 s away
        passes = _passes(sup.url)
        wait_until(lambda: _passes(sup.url) > passes, 15, "a pass")
        passes = _passes(sup.url)
        killed = time.time()
        os.kill(rank.pid, signal.SIGKILL)
        incident = wait_until(lambda: _dead_incident(sup.url), 10, "a rank_dead incident",
                              interval=0.02)  # fmt: skip
        took = time.time() - killed
        assert _passes(sup.url) == passes, "a sample poll came first: not the event path"
        assert took < 1.5, f"incident {took:.2f} s after the kill"
        assert incident["rank"] == 0 and incident["job"] == "ev"
        assert incident["detected_at"] - killed < 1.5
    finally:
        rank.kill()
        rank.wait()
        if sup is not None:
            sup.stop()
        agent.stop()
