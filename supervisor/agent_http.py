"""The supervisor's HTTP client of the agents, blocking and event-driven.

`AgentClient` makes the blocking requests: the control calls (POST, with the bearer
token), and GETs from the CLI and tests, over keep-alive connections shared by every
client (`_CONNECTIONS`: a new TCP connection per request was the supervisor's largest cost
at 1,024 agents). `get(client, pool, path)` makes the same GET on an asyncio loop
(`EventLoop`) over its own pool (`AsyncConnections`): the Poller's polls and EventWatch's
long polls (agents.py, agent_io.py). Why not the thread pool and http.client for the
polls: at 1,024 agents the supervisor spent most of its CPU in 64 poll threads fighting
the main loop for the GIL (a pass took 5 s) and in http.client's per-response header
parsing (docs/scaling.md). There the answers are read and parsed one after another on one
thread while the main loop waits for them, so the two never contend.

Either way an answer is held to the same rules: a declared length over the cap is refused
unread, a chunked or close-delimited body is read to the cap + 1 and then refused,
anything that is not HTTP is an AgentError, JSON that does not parse a ContractError, and
the whole request (connect, TLS handshake, answer) is bounded by the client's timeout.
`trust_agents_signed_by` sets the CA both verify https agents with.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import ssl
import threading
import urllib.parse
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

import orjson

from ..contract.errors import ContractError
from ..contract.save_requests import SaveRequest

# An agent's answer larger than this is refused unread: a healthy node's /v1/ranks is
# ~140 KB (8 ranks x 64 steps, docs/scaling.md), and one hostile 300 MB answer took the
# supervisor from 48 MB to 927 MB of memory.
MAX_ANSWER_BYTES = 4 * 1024 * 1024


class AgentError(Exception):
    def __init__(self, url: str, message: str, status: int | None = None):
        super().__init__(f"{url}: {message}")
        self.url, self.status = url, status


class _Connections:
    """Idle keep-alive HTTP connections per agent address, shared by every AgentClient
    (clients are made afresh each pass). A new TCP connection per request was the
    supervisor's largest cost at 1,024 agents (docs/scaling.md)."""

    def __init__(self, idle_per_agent: int = 2):
        self.idle_per_agent = idle_per_agent
        self.tls: ssl.SSLContext | None = None  # verifies https agents; None: system CAs
        self.generation = 0  # bumped when the trust changes: pools drop older connections
        self._idle: dict[tuple, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def take(
        self, key: tuple, timeout: float, fresh: bool = False
    ) -> tuple[http.client.HTTPConnection, bool]:
        """A connection to `key` (scheme, host, port, path), and whether it was used before."""
        with self._lock:
            idle = self._idle.get(key)
            conn = idle.pop() if idle and not fresh else None
        if conn is not None:
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            return conn, True
        scheme, host, port, _ = key
        if scheme == "https":
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=self.tls), False
        return http.client.HTTPConnection(host, port, timeout=timeout), False

    def give(self, key: tuple, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < self.idle_per_agent:
                idle.append(conn)
                return
        conn.close()


_CONNECTIONS = _Connections()


def trust_agents_signed_by(ca_file: str | None) -> None:
    """Verify https agents against this CA bundle (PEM) instead of the system's: the
    cluster's own CA (docs/security.md). Host names are checked as always."""
    _CONNECTIONS.tls = None if ca_file is None else ssl.create_default_context(cafile=ca_file)
    _CONNECTIONS.generation += 1  # the event-driven pools too (AsyncConnections, below)
    with _CONNECTIONS._lock:  # connections made under the old trust are not reused
        for idle in _CONNECTIONS._idle.values():
            for conn in idle:
                conn.close()
        _CONNECTIONS._idle.clear()


# The agent closed an idle connection before this request reached it: safe to send again.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


def _read_capped(resp: http.client.HTTPResponse, limit: int) -> bytes:
    """The answer's body, or ContractError("too_large") past `limit` bytes: a declared
    length over the limit is refused unread, an undeclared one (chunked) read to limit + 1."""
    declared = resp.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise ContractError("too_large", f"answer of {int(declared)} bytes (limit {limit})")
    raw = resp.read(limit + 1)
    if len(raw) > limit:
        raise ContractError("too_large", f"answer larger than {limit} bytes")
    return raw


def decode_answer(raw: bytes) -> dict:
    """JSON of an answer, or ContractError: bad UTF-8, not JSON, or nested deeper than the
    parser's recursion limit (a 200k-deep answer raised RecursionError out of every pass).

    orjson first (~3x faster than json at ~10 KB an answer, at 1,024 agents a pass); what it
    refuses (bad UTF-8, deep nesting, NaN literals) is read again by json, which accepts
    it or gives the reason as before. An integer past 64 bits comes back from orjson as a
    float: still refused where an integer goes (as a float, not as out of range)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ContractError("not_utf8", "answer is not UTF-8") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise ContractError("not_json", "answer nested too deeply") from None
    except ValueError:
        raise ContractError("not_json", "answer is not JSON") from None


class AgentClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 2.0,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.max_answer_bytes = max_answer_bytes
        parts = urllib.parse.urlsplit(self.url)
        # one pool per agent URL, path included: agents behind one address (a proxy, the
        # scale simulator's /agents/<i>) each keep their own connections, as separate hosts
        # would; keyed by host alone, 1,024 simulated agents shared 2 idle connections and
        # nearly every poll opened a new one
        self._key = (parts.scheme, parts.hostname, parts.port, parts.path)
        self._prefix = parts.path  # e.g. a simulator's /agents/7

    def _request(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {}
        if body is not None:
            headers["Content-Type"] = "application/json"
            if self.token:
                headers["Authorization"] = f"Bearer {self.token}"
        for attempt in (1, 2):
            conn, reused = _CONNECTIONS.take(self._key, timeout or self.timeout, attempt == 2)
            try:
                conn.request("GET" if body is None else "POST", self._prefix + path, data, headers)
                resp = conn.getresponse()
                raw = _read_capped(resp, self.max_answer_bytes)
            except _STALE as exc:
                conn.close()
                if reused and attempt == 1:
                    continue
                raise AgentError(self.url, str(exc) or type(exc).__name__) from None
            except (OSError, http.client.HTTPException) as exc:  # refused, timed out, garbage
                conn.close()
                raise AgentError(self.url, str(exc) or type(exc).__name__) from None
            except ContractError:
                conn.close()  # the rest of the answer is still on the wire
                raise
            if resp.will_close:
                conn.close()
            else:
                _CONNECTIONS.give(self._key, conn)
            break
        if resp.status >= 400:
            try:
                message = str(json.loads(raw)["error"]["message"])[:500]
            except (ValueError, KeyError, TypeError, RecursionError):
                message = resp.reason
            raise AgentError(self.url, f"HTTP {resp.status}: {message}", resp.status)
        return decode_answer(raw)

    def get(self, path: str) -> dict:
        return self._request(path)

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        """The `result` of a control call; AgentError for any answer without one (an action
        is then recorded as failed, never half-understood)."""
        try:
            answer = self._request(path, body, timeout)
        except ContractError as exc:
            raise AgentError(self.url, f"malformed answer: {exc}") from None
        result = answer.get("result") if isinstance(answer, dict) else None
        if not isinstance(result, dict):
            raise AgentError(self.url, "malformed answer: no 'result' object")
        return result

    # -- control --------------------------------------------------------------------
    def signal(self, job: str, rank: int, signal: str) -> dict:
        return self.post("/v1/control/signal", {"job": job, "rank": rank, "signal": signal})

    def stacks(self, job: str, rank: int) -> dict:
        result = self.post("/v1/control/stacks", {"job": job, "rank": rank}, timeout=30)
        if not isinstance(result.get("stacks"), str):
            raise AgentError(self.url, "malformed answer: 'stacks' is not text")
        return result

    def stop_job(self, job: str, status: dict | None = None) -> dict:
        """Stop the job on the agent's node; ``status`` (cause, confidence, why, action,
        incident) is what its launcher's exit code is chosen from (contract/exit_codes.py)."""
        return self.post("/v1/control/stop-job", {"job": job, "status": status})

    def request_save(self, request: SaveRequest) -> dict:
        return self.post("/v1/control/save", request.to_json())


# -- event-driven ------------------------------------------------------------------------

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
_STALE_ASYNC = (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError)


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
        except _STALE_ASYNC as exc:
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
