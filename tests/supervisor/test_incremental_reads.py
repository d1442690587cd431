"""Incremental /v1/ranks reads end to end: a real agent process fed by a telemetry sender,
polled incrementally by the supervisor's poll_node, shows the same RankObs.recent as full
reads; and the scale simulator answers in the real agent's shape, cursors included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import start_agent, wait_until

from rankguard.client import TelemetrySender
from rankguard.contract.answers import NodeAnswer, RanksAnswer
from rankguard.contract.telemetry import SCHEMA_VERSION
from rankguard.supervisor.agents import AgentClient, poll_node
from rankguard.supervisor.windows import NodeWindows

ROOT = Path(__file__).resolve().parents[2]


class FakeRanks:
    """Two ranks of job "j" in this process, a step every ~5 ms each, a checkpoint
    heartbeat every 25 steps, a new incarnation (restart, steps from 0) every 150."""

    def __init__(self, socket_path: Path):
        self.sender = TelemetrySender(str(socket_path))
        self.running = threading.Event()
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _record(self, rank: int, step: int, restart: int, timed: bool) -> dict:
        return dict(
            v=SCHEMA_VERSION, job="j", rank=rank, local_rank=rank, world_size=2,
            pid=os.getpid(), restart=restart, step=step,
            phase="train" if timed else "checkpoint_save", time=time.time(),
            step_seconds=0.005 * (1 + rank) if timed else 0.0, data_wait_seconds=0.0,
            compute_seconds=0.004, comm_seconds=0.001, comm_exposed_seconds=0.0,
            optimizer_seconds=0.0, checkpoint_block_seconds=0.0, tokens_per_second=1.0,
            mfu=0.1, peak_memory_bytes=1, loss=1.0 / (1 + step), checkpoint_step=None,
        )  # fmt: skip

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            if not self.running.wait(0.05):
                continue
            n += 1
            restart, step = divmod(n, 150)
            for rank in (0, 1):
                self.sent += self.sender.send(self._record(rank, step, restart, True))
                if step % 25 == 0:
                    self.sent += self.sender.send(self._record(rank, step, restart, False))
            time.sleep(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def settled(client: AgentClient, fake: FakeRanks) -> bool:
    """The agent has taken everything sent (or counted it dropped)."""
    view = client.get("/v1/ranks")
    tel = view["telemetry"]
    return tel["accepted"] + tel["rejected_total"] >= fake.sent


def test_incremental_polls_match_full_reads(tmp_path):
    agent = start_agent(tmp_path)
    fake = FakeRanks(agent.socket)
    client = AgentClient(agent.url)
    windows = NodeWindows()
    node_json = NodeAnswer.from_json(client.get("/v1/node"))
    try:
        compared = 0
        for _ in range(4):
            fake.running.set()
            end = time.monotonic() + 1.5
            while time.monotonic() < end:  # polls while the samples flow
                obs, _ = poll_node(client, time.time(), node_json, windows)
                assert obs.reachable, obs.error
                time.sleep(0.03)
            fake.running.clear()
            time.sleep(0.05)
            wait_until(lambda: settled(client, fake), 10, "the agent to take every record")
            inc, _ = poll_node(client, time.time(), node_json, windows)
            full, _ = poll_node(client, time.time(), node_json)
            assert [r.key for r in inc.ranks] == [r.key for r in full.ranks] == [("j", 0), ("j", 1)]
            for a, b in zip(inc.ranks, full.ranks, strict=True):
                assert len(b.recent) == 64  # older samples left the window
                assert a.recent == b.recent
                assert (a.step, a.restart, a.pid) == (b.step, b.restart, b.pid)
            compared += 1
        assert compared == 4 and fake.sent > 1000
        assert windows.full_reads == 1  # the first read only
        assert min(r.restart for r in full.ranks) >= 2  # polled across restarts
    finally:
        fake.close()
        agent.stop()


@pytest.fixture
def sim(tmp_path):
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench/agent_sim.py"), "--nodes", "1",
         "--step-seconds", "0.02", "--ready-file", str(ready)],
    )  # fmt: skip
    try:
        wait_until(ready.exists, 30, "the simulator to serve")
        yield f"http://127.0.0.1:{json.loads(ready.read_text())['port']}/agents/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _shape(answer: dict) -> tuple:
    r = answer["ranks"][0]
    return (list(answer), list(r), [list(s) for s in r["recent"][:1]])


def test_simulator_speaks_the_agents_protocol(tmp_path, sim):
    """Same fields in the same order as a real agent, legacy and incremental; the same
    400 for a malformed cursor; incremental merges equal full reads."""
    agent = start_agent(tmp_path)
    fake = FakeRanks(agent.socket)
    fake.running.set()
    real, simulated = AgentClient(agent.url), AgentClient(sim)
    try:
        wait_until(lambda: real.get("/v1/ranks")["ranks"], 10, "a rank")
        for query in ("", "?after=start"):
            a, b = real.get("/v1/ranks" + query), simulated.get("/v1/ranks" + query)
            assert _shape(a) == _shape(b), query
            for answer in (a, b):  # both keep the contract
                assert RanksAnswer.from_json(answer).incremental == bool(query)
        for client in (real, simulated):
            with pytest.raises(Exception, match="HTTP 400: after: expected"):
                client.get("/v1/ranks?after=nonsense")
        windows, node_json = NodeWindows(), NodeAnswer.from_json(simulated.get("/v1/node"))
        for _ in range(10):
            inc, _ = poll_node(simulated, time.time(), node_json, windows)
            time.sleep(0.1)
        full, _ = poll_node(simulated, time.time(), node_json)
        # steps went on between the two reads: the full window is the merged one moved on
        for a, b in zip(inc.ranks, full.ranks, strict=True):
            assert len(a.recent) == len(b.recent) == 64
            moved = b.recent.index(a.recent[-1]) + 1
            assert moved > 16 and b.recent[:moved] == a.recent[-moved:]
    finally:
        fake.close()
        agent.stop()
