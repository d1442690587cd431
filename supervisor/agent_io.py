"""`EventWatch`: the long poll of each agent's rank state changes (a death at once), on
its own asyncio loop, through the event-driven client of agent_http.py (`get`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import urllib.parse
from concurrent.futures import Future

from ..contract.answers import RankEventAnswer, RankEventsAnswer
from ..contract.cursor import START
from ..contract.errors import ContractError
from ..contract.states import DEAD_STATES
from .agent_http import AgentClient, AgentError, AsyncConnections, EventLoop, get

log = logging.getLogger("rankguard.supervisor")

# How long one /v1/rank-events request is held by the agent when nothing happens: long
# enough that an idle cluster costs a request per agent every few seconds, short enough
# that a lost connection is noticed soon. A failed request is tried again after RETRY.
EVENT_WAIT_SECONDS = 10.0
EVENT_RETRY_SECONDS = 1.0
# Deaths only: a restart's new ranks are seen by the sample polls, and at 1,024 nodes
# each restart would otherwise answer every held request once more (docs/scaling.md).
_STATES = "&states=" + ",".join(sorted(DEAD_STATES))


class EventWatch:
    """One long-poll of `/v1/rank-events` per agent, on the poller's loop, apart from its
    sample polls (its own connections, not counted in their `max_in_flight`). Deaths are
    queued for the reconcile loop, which `wake` wakes; an agent without the endpoint (404:
    an older agent) is left to the sample polls, logged once."""

    def __init__(self, wait: float = EVENT_WAIT_SECONDS):
        # its own loop and thread: on the sample polls' loop an announced death was read
        # after whatever answers of a poll round were ready before it, up to 0.75 s at
        # 1,024 nodes (bench/results/supervisor_scale.md); here it waits for the GIL only
        self._loop = EventLoop("rankguard-events")
        self.wait = wait
        self._pool = AsyncConnections(idle_per_agent=1)
        self._tasks: dict[str, Future] = {}
        self.legacy: set[str] = set()  # agents without the endpoint
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._deaths: list[tuple[str, RankEventAnswer]] = []
        self.received = 0  # events read, all states
        self.errors = 0  # failed requests (retried)

    def sync(self, clients: list[AgentClient]) -> None:
        """Watch every listed agent, and stop watching the ones no longer listed."""
        urls = {c.url for c in clients}
        for c in clients:
            if c.url not in self._tasks and c.url not in self.legacy:
                self._tasks[c.url] = self._loop.submit(self._watch(c))
        for url in [u for u in self._tasks if u not in urls]:
            self._tasks.pop(url).cancel()

    def settle(self) -> bool:
        """Whether deaths wait to be taken; `wake` is cleared when none does (it is also
        set by other news, as a poll round's end: reconcile.py)."""
        with self._lock:
            if not self._deaths:
                self.wake.clear()
            return bool(self._deaths)

    def take(self) -> list[tuple[str, RankEventAnswer]]:
        """The deaths received since the last take, as (agent URL, event)."""
        with self._lock:
            out, self._deaths = self._deaths, []
            self.wake.clear()
        return out

    async def _watch(self, client: AgentClient) -> None:
        # held by the agent for `wait`, so the request's own bound is that plus the usual
        c = AgentClient(client.url, client.token, client.timeout + self.wait)
        cursor = START
        while True:
            wait = 0 if cursor == START else self.wait
            path = f"/v1/rank-events?after={urllib.parse.quote(cursor)}&wait={wait:g}{_STATES}"
            started = time.monotonic()
            try:
                answer = RankEventsAnswer.from_json(await get(c, self._pool, path))
            except AgentError as exc:
                if exc.status == 404:
                    log.info("%s has no /v1/rank-events (an older agent): its deaths are "
                             "seen by the sample polls only", client.url)  # fmt: skip
                    self.legacy.add(client.url)
                    self._tasks.pop(client.url, None)
                    return
                self.errors += 1
                if exc.status == 400:
                    cursor = START  # our cursor refused: start over
                await asyncio.sleep(EVENT_RETRY_SECONDS)
                continue
            except ContractError as exc:
                self.errors += 1
                log.warning("%s: malformed /v1/rank-events answer: %s", client.url, exc)
                cursor = START
                await asyncio.sleep(EVENT_RETRY_SECONDS)
                continue
            first, cursor = cursor == START, answer.cursor
            self.received += len(answer.events)
            # the first answer holds the agent's history: what the sample polls show
            deaths = [] if first else [e for e in answer.events if e.state in DEAD_STATES]
            if deaths:
                with self._lock:
                    self._deaths += [(client.url, e) for e in deaths]
                    self.wake.set()
            elif not first and time.monotonic() - started < wait / 2 and not answer.events:
                await asyncio.sleep(EVENT_RETRY_SECONDS)  # an agent that did not hold it

    def close(self) -> None:
        async def _close() -> None:
            self._pool.close_all()

        for f in self._tasks.values():
            f.cancel()
        with contextlib.suppress(Exception):  # closing: nothing left to report to
            self._loop.submit(_close()).result(timeout=5)
        self._loop.close()
