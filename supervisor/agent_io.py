"""Event-driven reads of the agents: one thread, one asyncio loop, a keep-alive
connection per agent, and a small HTTP/1.1 client for the two GETs a poll makes; and
`EventWatch`, the long poll of each agent's rank state changes (a death at once).

Why not the thread pool and http.client it replaces: at 1,024 agents the supervisor
spent most of its CPU in 64 poll threads fighting the main loop for the GIL (a pass took
5 s) and in http.client's per-response header parsing (docs/scaling.md). Here the answers
are read and parsed one after another on one thread while the main loop waits for them,
so the two never contend. Control calls (POST) still go through AgentClient.

What an answer may be is unchanged: a declared length over the cap is refused unread, a
chunked or close-delimited body is read to the cap + 1 and then refused, anything that is
not HTTP is an AgentError, and the whole request (connect, TLS handshake, answer) is
bounded by the client's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import threading
import time
import urllib.parse
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

from ..contract.answers import RankEventAnswer, RankEventsAnswer
from ..contract.cursor import START
from ..contract.errors import ContractError
from ..contract.states import DEAD_STATES
from .agents import _CONNECTIONS, AgentClient, AgentError, decode_answer

log = logging.getLogger("rankguard.supervisor")

_HEAD_LIMIT = 64 * 1024  # status line and headers; an agent's are a few hundred bytes


class _BadHttp(Exception):
    """Not an HTTP/1.x answer."""


class EventLoop:
    """An asyncio loop on its own daemon thread; `submit` runs a coroutine there and
    returns a concurrent Future, as ThreadPoolExecutor.submit did."""

    def __init__(self, name: str = "rankguard-poll"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def _stop() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        with contextlib.suppress(Exception):  # closing: nothing to report to
            asyncio.run_coroutine_threadsafe(_stop(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class AsyncConnections:
    """Idle keep-alive connections per agent (scheme, host, port, path); used only on the
    loop's thread, so no lock."""

    def __init__(self, idle_per_agent: int = 2):
        self.idle_per_agent = idle_per_agent
        self._idle: dict[tuple, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._generation = _CONNECTIONS.generation

    async def take(self, key: tuple, fresh: bool) -> tuple[tuple, bool]:
        if self._generation != _CONNECTIONS.generation:  # the trusted CA changed
            self.close_all()
            self._generation = _CONNECTIONS.generation
        idle = self._idle.get(key)
        while idle and not fresh:
            conn = idle.pop()
            if not conn[1].is_closing() and not conn[0].at_eof():
                return conn, True
            conn[1].close()
        scheme, host, port, _ = key
        tls = None
        if scheme == "https":
            tls = _CONNECTIONS.tls or ssl.create_default_context()
        port = port or (443 if scheme == "https" else 80)
        reader, writer = await asyncio.open_connection(
            host, port, ssl=tls, server_hostname=host if tls else None, limit=_HEAD_LIMIT
        )
        return (reader, writer), False

    def give(self, key: tuple, conn: tuple) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.idle_per_agent:
            idle.append(conn)
        else:
            conn[1].close()

    def close_all(self) -> None:
        for idle in self._idle.values():
            for _, writer in idle:
                writer.close()
        self._idle.clear()


async def _read_answer(reader: asyncio.StreamReader, limit: int) -> tuple[int, str, bytes, bool]:
    """(status, reason, body, the server will close) of one answer."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise _BadHttp("headers too long") from None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise _BadHttp(f"not an HTTP answer: {lines[0][:80]!r}")
        status = int(parts[1])
        if status >= 200 or status == 101:
            break  # 1xx interim answers are skipped
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    close = headers.get("connection", "").lower() == "close" or parts[0] == "HTTP/1.0"
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return status, _reason(parts), await _read_chunked(reader, limit), close
    declared = headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _BadHttp(f"bad Content-Length {declared[:40]!r}")
        if int(declared) > limit:
            raise ContractError("too_large", f"answer of {int(declared)} bytes (limit {limit})")
        return status, _reason(parts), await reader.readexactly(int(declared)), close
    body = await reader.read(limit + 1)  # delimited by the close
    while len(body) <= limit and not reader.at_eof():
        more = await reader.read(limit + 1 - len(body))
        if not more:
            break
        body += more
    if len(body) > limit:
        raise ContractError("too_large", f"answer larger than {limit} bytes")
    return status, _reason(parts), body, True


def _reason(parts: list[str]) -> str:
    return parts[2] if len(parts) > 2 else ""


async def _read_chunked(reader: asyncio.StreamReader, limit: int) -> bytes:
    chunks, total = [], 0
    while True:
        try:
            size_line = await reader.readuntil(b"\r\n")
        except asyncio.LimitOverrunError:
            raise _BadHttp("chunk size line too long") from None
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise _BadHttp("bad chunk size") from None
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailers
            return b"".join(chunks)
        total += size
        if total > limit:
            raise ContractError("too_large", f"answer larger than {limit} bytes")
        chunks.append((await reader.readexactly(size + 2))[:-2])


def _drop(held: list) -> None:
    if held:
        held[0][1].close()


# The agent closed an idle connection before this request reached it: safe to send again.
_STALE = (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError)


async def get(client: AgentClient, pool: AsyncConnections, path: str) -> dict:
    """`client.get(path)`, event-driven: the decoded JSON answer; AgentError for a
    transport failure or an HTTP error, ContractError for a body that is not JSON."""
    scheme, host, port, prefix = client._key
    request = (
        f"GET {prefix}{path} HTTP/1.1\r\nHost: {host}{'' if port is None else f':{port}'}\r\n"
        "Accept: application/json\r\nAccept-Encoding: identity\r\n\r\n"
    ).encode()
    for attempt in (1, 2):
        held: list = []  # the connection, once taken (to close it on any failure)

        async def exchange(held=held, fresh=attempt == 2) -> tuple[int, str, bytes, bool]:
            conn, reused = await pool.take(client._key, fresh=fresh)
            held.extend((conn, reused))
            conn[1].write(request)
            return await _read_answer(conn[0], client.max_answer_bytes)

        try:  # the whole request is bounded: connect, TLS, answer
            status, reason, raw, close = await asyncio.wait_for(exchange(), client.timeout)
        except _STALE as exc:
            _drop(held)
            if held and held[1] and attempt == 1:
                continue
            raise AgentError(client.url, str(exc) or type(exc).__name__) from None
        except asyncio.TimeoutError:
            _drop(held)
            raise AgentError(client.url, "timed out") from None
        except (ContractError, asyncio.CancelledError):
            _drop(held)  # the rest of the answer is still on the wire
            raise
        except (OSError, _BadHttp, ValueError) as exc:  # refused, TLS, garbage
            _drop(held)
            raise AgentError(client.url, str(exc) or type(exc).__name__) from None
        conn = held[0]
        if close:
            conn[1].close()
        else:
            pool.give(client._key, conn)
        break
    if status >= 400:
        try:
            message = str(json.loads(raw)["error"]["message"])[:500]
        except (ValueError, KeyError, TypeError, RecursionError):
            message = reason
        raise AgentError(client.url, f"HTTP {status}: {message}", status)
    return decode_answer(raw)


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
