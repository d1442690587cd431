"""The agent's HTTP interface: /metrics, the versioned JSON API, and token-guarded control.

Reads are open (trusted network; loopback by default). Every endpoint that changes
anything needs `Authorization: Bearer <token>`, compared in constant time; a wrong or
missing token is answered 401 and nothing happens. Bodies are small JSON objects with a
hard size limit; slow clients time out; every request is counted by route and status.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from .control import ControlError

log = logging.getLogger("rankguard.agent.api")

API_VERSION = "rankguard.agent/v1"
MAX_BODY_BYTES = 16 * 1024
REQUEST_TIMEOUT_SECONDS = 10

READ_ROUTES = ("/metrics", "/v1/node", "/v1/ranks", "/v1", "/healthz")
CONTROL_ROUTES = ("/v1/control/signal", "/v1/control/stacks")


def json_safe(value: Any) -> Any:
    """JSON has no NaN/Infinity: send them as strings so the document stays valid."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class RequestStats:
    """Requests by (route, status), with unknown paths folded into one label value."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, int]] = Counter()

    def add(self, path: str, status: int) -> None:
        route = path if path in READ_ROUTES + CONTROL_ROUTES else "other"
        with self._lock:
            self.counts[(route, status)] += 1

    def items(self) -> list[tuple[tuple[str, int], int]]:
        with self._lock:
            return list(self.counts.items())


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


def make_handler(agent) -> type[BaseHTTPRequestHandler]:
    """A handler class bound to one agent (its views, token and request counters)."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "rankguard-agent"
        sys_version = ""
        timeout = REQUEST_TIMEOUT_SECONDS
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args) -> None:  # route through logging, quietly
            log.debug("%s %s", self.address_string(), fmt % args)

        # -- plumbing ------------------------------------------------------------
        def _path(self) -> str:
            return self.path.split("?", 1)[0].rstrip("/") or "/"

        def _send(self, status: int, body: bytes, content_type: str, headers=None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            agent.http_stats.add(self._path(), status)

        def _json(self, status: int, payload: dict, headers=None) -> None:
            body = json.dumps(json_safe({"api": API_VERSION, **payload}), indent=1).encode()
            self._send(status, body + b"\n", "application/json", headers)

        def _error(self, status: int, message: str, headers=None) -> None:
            self._json(status, {"error": {"status": status, "message": message}}, headers)

        def _dispatch(self, handler) -> None:
            try:
                handler()
            except HttpError as exc:
                self._error(exc.status, str(exc), exc.headers)
            except ControlError as exc:
                self._error(exc.status, str(exc))
            except Exception:  # a bug must not take the agent down
                log.exception("error serving %s %s", self.command, self.path)
                self._error(500, "internal error (logged by the agent)")

        # -- methods -------------------------------------------------------------
        def do_GET(self) -> None:
            self._dispatch(self._get)

        def do_HEAD(self) -> None:
            self._dispatch(self._get)

        def do_POST(self) -> None:
            self._dispatch(self._post)

        def _not_allowed(self) -> None:
            self._dispatch(self._method_not_allowed)

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

        def _method_not_allowed(self) -> None:
            path = self._path()
            if path in CONTROL_ROUTES:
                raise HttpError(405, f"{path} accepts POST", {"Allow": "POST"})
            if path in READ_ROUTES:
                raise HttpError(405, f"{path} accepts GET", {"Allow": "GET, HEAD"})
            raise HttpError(404, f"no such endpoint: {path}")

        def _get(self) -> None:
            path = self._path()
            if path == "/metrics":
                body = generate_latest(agent.registry)
                self._send(200, body, CONTENT_TYPE_LATEST)
            elif path == "/v1/node":
                self._json(200, agent.node_view())
            elif path == "/v1/ranks":
                self._json(200, agent.ranks_view())
            elif path == "/healthz":
                self._json(200, {"ok": True})
            elif path == "/v1":
                self._json(200, {"endpoints": list(READ_ROUTES + CONTROL_ROUTES)})
            elif path in CONTROL_ROUTES:
                raise HttpError(405, f"{path} accepts POST", {"Allow": "POST"})
            else:
                raise HttpError(404, f"no such endpoint: {path}")

        def _post(self) -> None:
            path = self._path()
            if path not in CONTROL_ROUTES:
                if path in READ_ROUTES:
                    raise HttpError(405, f"{path} accepts GET", {"Allow": "GET, HEAD"})
                raise HttpError(404, f"no such endpoint: {path}")
            self._authorize()
            body = self._read_json_body()
            if path == "/v1/control/signal":
                result = agent.control_signal(body, caller=self.client_address[0])
            else:
                result = agent.control_stacks(body, caller=self.client_address[0])
            self._json(200, {"result": result})

        def _authorize(self) -> None:
            if agent.token is None:
                raise HttpError(403, "control is disabled: the agent runs without --token-file")
            header = self.headers.get("Authorization", "")
            scheme, _, presented = header.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                presented.strip().encode(), agent.token.encode()
            )
            if not ok:
                agent.auth_failures += 1
                raise HttpError(
                    401,
                    "missing or wrong bearer token",
                    {"WWW-Authenticate": 'Bearer realm="rankguard"'},
                )

        def _read_json_body(self) -> dict:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise HttpError(411, "a JSON body with Content-Length is required")
            if int(length) > MAX_BODY_BYTES:
                self.close_connection = True  # don't read a hostile body
                raise HttpError(413, f"body larger than {MAX_BODY_BYTES} bytes")
            raw = self.rfile.read(int(length))
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                raise HttpError(400, "body is not valid JSON") from None
            if not isinstance(body, dict):
                raise HttpError(400, "body must be a JSON object")
            return body

    return Handler


class AgentHttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


def start_http(agent, host: str, port: int) -> tuple[AgentHttpServer, threading.Thread]:
    server = AgentHttpServer((host, port), make_handler(agent))
    thread = threading.Thread(target=server.serve_forever, name="rankguard-http", daemon=True)
    thread.start()
    return server, thread
