"""Talking to agents: concurrent polls with a timeout per agent, and control calls.

A slow or dead agent costs the loop at most one timeout, never the sum of them: every
agent is polled in parallel and the loop waits for all of them up to the same deadline.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from .state import ClusterObs, NodeObs


class AgentError(Exception):
    def __init__(self, url: str, message: str, status: int | None = None):
        super().__init__(f"{url}: {message}")
        self.url, self.status = url, status


class AgentClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 2.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _request(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method="GET" if body is None else "POST"
        )
        if body is not None:
            req.add_header("Content-Type", "application/json")
            if self.token:
                req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = err.reason
            raise AgentError(self.url, f"HTTP {err.code}: {message}", err.code) from None
        except (OSError, ValueError) as exc:  # refused, timed out, reset, not JSON
            raise AgentError(self.url, str(getattr(exc, "reason", exc))) from None

    def get(self, path: str) -> dict:
        return self._request(path)

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        return self._request(path, body, timeout)["result"]

    # -- control --------------------------------------------------------------------
    def signal(self, job: str, rank: int, signal: str) -> dict:
        return self.post("/v1/control/signal", {"job": job, "rank": rank, "signal": signal})

    def stacks(self, job: str, rank: int) -> dict:
        return self.post("/v1/control/stacks", {"job": job, "rank": rank}, timeout=30)

    def stop_job(self, job: str) -> dict:
        return self.post("/v1/control/stop-job", {"job": job})


def poll_node(
    client: AgentClient, now: float, node_json: dict | None = None
) -> tuple[NodeObs, dict | None]:
    """Ranks every poll; the node verdict only when `node_json` (a recent copy) is None."""
    try:
        if node_json is None:
            node_json = client.get("/v1/node")
        ranks = client.get("/v1/ranks")
    except AgentError as exc:
        return NodeObs.unreachable(client.url, str(exc), now), None
    return NodeObs.from_json(client.url, node_json, ranks, now), node_json


class Poller:
    """Polls every agent concurrently; the same threads are reused from poll to poll.

    Ranks change every step and are read on every poll; a node's hardware verdict changes
    rarely and is re-read every `node_interval` seconds, which halves the load the
    supervisor puts on each agent (and on the training node's CPUs).
    """

    def __init__(self, max_workers: int = 64, node_interval: float = 1.0):
        self._pool = ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="rankguard-poll"
        )
        self.node_interval = node_interval
        self._node_cache: dict[str, tuple[float, dict]] = {}

    def _poll_one(self, client: AgentClient, now: float) -> NodeObs:
        cached = self._node_cache.get(client.url)
        fresh = cached[1] if cached and now - cached[0] < self.node_interval else None
        obs, node_json = poll_node(client, now, fresh)
        if node_json is not None and fresh is None:
            self._node_cache[client.url] = (now, node_json)
        return obs

    def poll(self, clients: list[AgentClient], now: float | None = None) -> ClusterObs:
        now = time.time() if now is None else now
        futures = {self._pool.submit(self._poll_one, c, now): c for c in clients}
        deadline = max((c.timeout for c in clients), default=0) * 2 + 1  # node + ranks requests
        done, _ = wait(futures, timeout=deadline)
        nodes = []
        for future, client in futures.items():
            if future in done:
                nodes.append(future.result())
            else:  # hung past its own timeouts: report and move on
                nodes.append(NodeObs.unreachable(client.url, "poll timed out", now))
        return ClusterObs(time=now, nodes=tuple(nodes))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class AgentsFile:
    """Agent URLs from a file (one per line, # comments), re-read when it changes, so a
    scheduler prolog can add nodes while the supervisor runs."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._mtime: float | None = None
        self._urls: list[str] = []

    def urls(self) -> list[str]:
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return self._urls  # keep the last good list if the file is briefly gone
        if mtime != self._mtime:
            lines = self.path.read_text().splitlines()
            self._urls = [ln.split("#", 1)[0].strip() for ln in lines]
            self._urls = [u for u in self._urls if u]
            self._mtime = mtime
        return self._urls
