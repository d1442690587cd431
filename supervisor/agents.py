"""Talking to agents: concurrent polls with a timeout per agent, control calls off the
loop's thread, and the agents file.

A slow or dead agent costs the loop at most one timeout, never the sum of them: every
agent is polled in parallel and the loop waits for all of them up to the same deadline.
The HTTP client (`AgentClient`, `AgentError`, the event-driven `get`) lives in
agent_http.py; its public names are re-exported here, where the CLI imports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import socket
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, wait
from dataclasses import replace
from pathlib import Path

from ..contract.answers import NodeAnswer, RanksAnswer
from ..contract.errors import ContractError
from .agent_http import (  # noqa: F401  (re-exported: the CLI and tests import them here)
    MAX_ANSWER_BYTES,
    AgentClient,
    AgentError,
    AsyncConnections,
    EventLoop,
    decode_answer,
    get,
    trust_agents_signed_by,
)
from .state import ClusterObs, NodeObs
from .windows import NodeWindows

log = logging.getLogger("rankguard.supervisor")

#: Why an agent's answer was refused for who sent it (a bounded label set for counters).
REFUSED_ANSWERS = ("node_name_taken",)


class BackgroundCalls:
    """Blocking calls (control requests) run off the caller's thread, at most `workers` at
    once, on daemon threads started at the first call. Not a ThreadPoolExecutor: its
    threads are joined at exit, and a stacks request to a cut-off agent, which waits out
    its 30 s timeout, held the supervisor's exit that long."""

    def __init__(self, workers: int = 16, name: str = "rankguard-calls"):
        self.workers, self.name = workers, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def submit(self, fn: Callable, *args) -> Future:
        if not self._threads:
            for i in range(self.workers):
                t = threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the caller reads it from the future
                future.set_exception(exc)

    def close(self) -> None:
        """Stop the threads once the calls in hand end (calls not started yet still run)."""
        for _ in self._threads:
            self._queue.put(None)
        self._threads = []


def poll_node(
    client: AgentClient,
    now: float,
    node: NodeAnswer | None = None,
    windows: NodeWindows | None = None,
    on_malformed: Callable[[ContractError], None] | None = None,
) -> tuple[NodeObs, NodeAnswer | None]:
    """Ranks every poll; the node verdict only when `node` (a recent answer) is None.

    With `windows` (the node's samples from earlier polls), ranks are read incrementally:
    only the samples after the last answer's cursor travel (supervisor/windows.py).
    Answers are read through the contract's models; one that breaks the contract makes
    this node unseen and is passed to `on_malformed` (counted by reason).
    Blocking; the Poller runs the same steps event-driven (`poll_node_async`).
    """

    async def fetch(path: str) -> dict:
        return client.get(path)

    coro = poll_node_async(fetch, client, now, node, windows, on_malformed)
    try:
        coro.send(None)  # never suspends: fetch does not await
    except StopIteration as done:
        return done.value
    raise RuntimeError("poll_node suspended")  # pragma: no cover


async def poll_node_async(
    fetch: Callable[[str], Awaitable[dict]],
    client: AgentClient,
    now: float,
    node: NodeAnswer | None = None,
    windows: NodeWindows | None = None,
    on_malformed: Callable[[ContractError], None] | None = None,
) -> tuple[NodeObs, NodeAnswer | None]:
    """poll_node with `fetch(path)` (the decoded answer) for the transport."""
    try:
        if node is None:
            node = NodeAnswer.from_json(await fetch("/v1/node"))
        if windows is None:
            ranks = RanksAnswer.from_json(await fetch("/v1/ranks"))
            return NodeObs.of(client.url, node, ranks, now), node
        ranks = await _read_ranks(fetch, client, windows)
        return NodeObs.of(client.url, node, ranks, now, windows.merge(ranks)), node
    except AgentError as exc:
        return NodeObs.unreachable(client.url, str(exc), now), None
    except ContractError as exc:
        # JSON that is not an agent's answer: this node goes unseen (a monitoring fault),
        # the rest of the cluster does not.
        if windows is not None:
            windows.reset()
        if on_malformed is not None:
            on_malformed(exc)
        log.warning("%s: malformed answer (%s): %s", client.url, exc.reason, exc)
        return NodeObs.unreachable(client.url, f"malformed answer: {exc}", now), None
    except Exception as exc:  # a bug reading one answer must not fail the pass
        if windows is not None:
            windows.reset()
        log.exception("%s: answer could not be read", client.url)
        return NodeObs.unreachable(client.url, f"answer could not be read: {exc!r}", now), None


async def _read_ranks(
    fetch: Callable[[str], Awaitable[dict]], client: AgentClient, windows: NodeWindows
) -> RanksAnswer:
    try:
        return RanksAnswer.from_json(
            await fetch("/v1/ranks?after=" + urllib.parse.quote(windows.after))
        )
    except AgentError as exc:
        if exc.status != 400 or windows.cursor is None:
            raise
    # Our cursor refused (a bug on either side): start over rather than go blind.
    log.warning("%s refused cursor %r; reading in full", client.url, windows.cursor)
    windows.reset()
    return RanksAnswer.from_json(await fetch("/v1/ranks?after=" + windows.after))


def _wait_all(futures: list[Future], seconds: float) -> None:
    wait(futures, timeout=seconds)


class Poller:
    """Polls every agent concurrently, event-driven: one asyncio loop on one thread
    (agent_http.py), at most `max_in_flight` requests at once, keep-alive connections.

    Ranks change every step and are read on every poll; a node's hardware verdict changes
    rarely and is re-read every `node_interval` seconds, which halves the load the
    supervisor puts on each agent (and on the training node's CPUs).

    No head-of-line blocking: a pass waits at most `wait_seconds` for the answers it asked
    for, not for the slowest agent's timeout. An agent still answering is not asked again
    (its request stays in flight, bounded by its own timeouts) and is shown by its last
    answer until the new one arrives; an agent that never answered yet is left out until its
    first request completes (a refused or timed-out request then reports it unreachable).
    One stuck agent thus costs one pass `wait_seconds` per request it times out on, and
    every other node is seen on every pass. A request's timeout counts from when a worker
    starts it, not from when it was queued: when the supervisor falls behind (more agents
    than its loop and CPU serve in one interval) its nodes show older answers, and are
    not reported unreachable for the supervisor's own backlog.
    """

    def __init__(
        self, node_interval: float = 1.0, wait_seconds: float = 0.5, max_in_flight: int = 64
    ):
        self._loop = EventLoop()  # every poll runs here, event-driven (agent_http.py)
        self._connections = AsyncConnections()
        self.max_in_flight = max_in_flight
        self._slots: asyncio.Semaphore | None = None
        self.node_interval = node_interval
        self.wait_seconds = wait_seconds
        self._node_cache: dict[str, tuple[float, NodeAnswer]] = {}
        # answers that broke the contract, by ContractError.reason (a node left unseen)
        self.malformed: Counter[str] = Counter()
        self._malformed_lock = threading.Lock()
        self._inflight: dict[str, tuple[Future, list[float]]] = {}  # url -> (poll, [started])
        self._last: dict[str, NodeObs] = {}  # url -> newest completed observation
        self._windows: dict[str, NodeWindows] = {}  # url -> samples kept between polls
        # node name -> the agent URL that first reported it: a second agent claiming the
        # name is refused, so every action on a node's ranks goes to that node's agent
        self._owners: dict[str, str] = {}
        self.refused: Counter[str] = Counter()  # answers refused for who sent them, by reason

    async def _poll_one(self, client: AgentClient, now: float) -> NodeObs:
        cached = self._node_cache.get(client.url)
        fresh = cached[1] if cached and now - cached[0] < self.node_interval else None
        windows = self._windows.setdefault(client.url, NodeWindows())

        async def fetch(path: str) -> dict:
            return await get(client, self._connections, path)

        obs, node = await poll_node_async(fetch, client, now, fresh, windows, self._count_malformed)
        if node is not None and fresh is None:
            self._node_cache[client.url] = (now, node)
        return obs

    def _count_malformed(self, exc: ContractError) -> None:
        with self._malformed_lock:  # called from the loop's thread
            self.malformed[exc.reason] += 1

    async def _timed(self, client: AgentClient, now: float, started: list[float]) -> NodeObs:
        if self._slots is None:  # made on the loop's thread, where it is used
            self._slots = asyncio.Semaphore(self.max_in_flight)
        # At most max_in_flight requests at once: with all 1,024 started together, the
        # loop's own parsing of the first answers counted against the last ones' timeouts
        # and made 1,153 agents "unreachable" (docs/scaling.md).
        async with self._slots:
            started.append(time.monotonic())  # queued until now: the wait is ours
            obs = await self._poll_one(client, now)
        # The agent's ages are as of its answer, not of the pass that asked for it.
        return replace(obs, observed_at=max(now, time.time()))

    def poll(self, clients: list[AgentClient], now: float | None = None, waiter=None) -> ClusterObs:
        """One view of the cluster, timed at the end of the poll (`now` overrides it, for
        tests). Answers from earlier passes are aged to that time. `waiter(futures,
        seconds)` waits for the answers in place of `wait` (the supervisor handles
        announced deaths meanwhile: reconcile.py)."""
        fixed = now
        now = time.time() if fixed is None else fixed
        asked = []
        for c in clients:
            if c.url not in self._inflight:
                started: list[float] = []
                future = self._loop.submit(self._timed(c, now, started))
                self._inflight[c.url] = (future, started)
                asked.append(future)
        (waiter or _wait_all)(asked, self.wait_seconds)
        now = time.time() if fixed is None else fixed
        nodes = []
        for c in clients:
            future, started = self._inflight[c.url]
            if future.done():
                del self._inflight[c.url]
                self._last[c.url] = future.result()
                nodes.append(self._last[c.url].aged(now))
                continue
            running = time.monotonic() - started[0] if started else 0.0
            last = self._last.get(c.url)
            # node + ranks requests, each with its own timeout: past that it is stuck
            if running >= c.timeout * 2 + 1:
                why = f"no answer after {running:.1f}s (stuck)"
                nodes.append(NodeObs.unreachable(c.url, why, now, last.node if last else None))
            elif last is not None:
                nodes.append(last.aged(now))
            # else: never answered yet, nothing known (not "unreachable": it may be queued
            # behind a thousand others); a failed first request reports itself when done.
        urls = {c.url for c in clients}
        nodes = self._one_agent_per_name(nodes, urls, now)
        for gone in [u for u in self._last if u not in urls]:  # removed from the agents file
            self._last.pop(gone)
            self._node_cache.pop(gone, None)
        for gone in [u for u in self._windows if u not in urls]:
            self._windows.pop(gone)  # a poll still in flight merges into its own copy
        return ClusterObs(time=now, nodes=tuple(nodes))

    def _one_agent_per_name(self, nodes: list[NodeObs], urls: set[str], now: float) -> list:
        """Bind each node name to the first agent URL that reports it, for as long as that
        URL is listed; an answer from another URL under a taken name makes that agent unseen
        (counted): a hostile agent cannot pose as a node to steer actions at its ranks."""
        for name, owner in list(self._owners.items()):
            if owner not in urls:
                del self._owners[name]
        names_of: dict[str, list[str]] = {}  # url -> the names it owns (one pass: O(N))
        for name, owner in self._owners.items():
            names_of.setdefault(owner, []).append(name)
        for n in nodes:  # an agent that renamed itself gives its old name up
            if n.reachable:
                for name in names_of.get(n.url, ()):
                    if name != n.node:
                        del self._owners[name]
        out = []
        for n in nodes:
            owner = self._owners.setdefault(n.node, n.url) if n.reachable else None
            owner = self._owners.get(n.node) if owner is None else owner
            if owner is None or owner == n.url:
                out.append(n)
                continue
            if not n.reachable:  # unseen under a name it may not use: shown by its URL
                out.append(replace(n, node=n.url))
                continue
            self.refused["node_name_taken"] += 1
            log.warning("%s claims node name %r, which %s reports: ignored", n.url, n.node, owner)
            out.append(NodeObs.unreachable(
                n.url, f"claims node name {n.node!r} of agent {owner}", now
            ))  # fmt: skip
        return out

    def close(self) -> None:
        async def _close() -> None:
            self._connections.close_all()

        with contextlib.suppress(Exception):  # closing: nothing left to report to
            self._loop.submit(_close()).result(timeout=5)
        self._loop.close()


class AgentsFile:
    """Agent URLs from a file (one per line, # comments), re-read when it changes, so a
    scheduler prolog can add nodes while the supervisor runs.

    A file that cannot be read, or holds a line that is not an http(s) URL (a writer
    caught mid-write, a typo), leaves the last good list in force and is logged once per
    change: a bad edit must not make the supervisor forget every node. Writers should
    still replace the file atomically (write a temporary file, rename it over): an empty
    file is valid (the last node left) and is taken as it is.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._signature: tuple | None = None
        self._urls: list[str] = []
        self.errors = 0  # rejected versions of the file, for tests and logs

    def urls(self) -> list[str]:
        try:
            st = self.path.stat()
        except OSError as exc:
            self._reject(("missing",), f"cannot stat: {exc.strerror}")
            return self._urls  # keep the last good list if the file is briefly gone
        # mtime alone misses two writes within the clock's granularity; a rename
        # changes the inode, a rewrite usually the size.
        signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        if signature == self._signature:
            return self._urls
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            self._reject(signature, f"cannot read: {exc}")
            return self._urls
        urls, bad = parse_agents(text)
        if bad:
            self._reject(signature, f"line {bad[0]}: not an http(s) URL: {bad[1]!r}")
            return self._urls
        if urls != self._urls:
            added = [u for u in urls if u not in self._urls]
            removed = [u for u in self._urls if u not in urls]
            log.info("agents file %s: %d agents (+%d -%d)", self.path, len(urls),
                     len(added), len(removed))  # fmt: skip
        self._urls, self._signature = urls, signature
        return self._urls

    def _reject(self, signature: tuple, why: str) -> None:
        if signature != self._signature:  # once per version of the file, not every pass
            self.errors += 1
            log.warning("agents file %s: %s; keeping the last good list (%d agents)",
                        self.path, why, len(self._urls))  # fmt: skip
        self._signature = signature


class AgentsDns:
    """Agent URLs from a DNS name that resolves to every agent (a Kubernetes headless
    Service over the agent DaemonSet): `http://rankguard-agent.rankguard.svc:9407` gives
    `http://ADDRESS:9407` for each address, resolved again every `ttl` seconds. A failed
    resolution keeps the last good list (a DNS hiccup must not make the supervisor forget
    every node); an empty answer is not taken either, for the same reason."""

    def __init__(
        self, url: str, ttl: float = 10.0, resolve=socket.getaddrinfo, clock=time.monotonic
    ):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"--agents-dns needs http(s)://NAME:PORT, got {url!r}")
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        self.ttl, self._resolve, self._clock = ttl, resolve, clock
        self._next = float("-inf")
        self._urls: list[str] = []
        self.errors = 0  # failed or empty resolutions, for tests and logs

    def urls(self) -> list[str]:
        now = self._clock()
        if now < self._next:
            return self._urls
        self._next = now + self.ttl
        try:
            found = self._resolve(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            return self._keep(f"cannot resolve: {exc}")
        addresses = sorted({info[4][0] for info in found})
        if not addresses:
            return self._keep("no address")
        urls = [f"{self.scheme}://{f'[{a}]' if ':' in a else a}:{self.port}" for a in addresses]
        if urls != self._urls:
            log.info("agents from %s: %d", self.host, len(urls))
        self._urls = urls
        return urls

    def _keep(self, why: str) -> list[str]:
        self.errors += 1
        log.warning("agents from %s: %s; keeping the last good list (%d agents)",
                    self.host, why, len(self._urls))  # fmt: skip
        return self._urls


def parse_agents(text: str) -> tuple[list[str], tuple[int, str] | None]:
    """(URLs in file order without duplicates, the first bad line as (number, text))."""
    urls: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        url = line.split("#", 1)[0].strip()
        if not url:
            continue
        try:
            parts = urllib.parse.urlsplit(url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            _ = parts.port  # ValueError for a port that is not a number
        except ValueError:
            ok = False
        if not ok:
            return urls, (number, url)
        if url.rstrip("/") not in urls:
            urls.append(url.rstrip("/"))
    return urls, None
