"""A small routed JSON/metrics HTTP server, shared by the agent and the supervisor.

Stdlib `ThreadingHTTPServer`: one thread per request, a socket timeout against slow
clients, a hard body limit, errors as JSON (`{"api", "error": {"status", "message"}}`),
405 with `Allow` for a known path and the wrong method, and every request counted by
route (unknown paths folded into "other") and status. Routes that change anything take
a bearer token, compared in constant time. GET routes named in `query_routes` receive the
query string, parsed strictly (a malformed or repeated parameter is a 400). JSON is
compact: the clients are programs (the CLI pretty-prints), and a poll of 1,024 agents a
second pays for every byte.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..contract.numbers import json_safe

log = logging.getLogger("rankguard.httpd")

MAX_BODY_BYTES = 16 * 1024
MAX_QUERY_BYTES = 2048
MAX_QUERY_FIELDS = 16
COMPACT = (",", ":")  # json.dumps separators of every answer (bench/agent_sim.py too)
REQUEST_TIMEOUT_SECONDS = 10


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


def parse_query(raw: str) -> dict[str, str]:
    """A request's query string as one value per name; HttpError 400 for a hostile or
    ambiguous one (too long, malformed, a name given twice)."""
    if len(raw) > MAX_QUERY_BYTES:
        raise HttpError(400, f"query string longer than {MAX_QUERY_BYTES} bytes")
    try:
        pairs = urllib.parse.parse_qsl(
            raw, keep_blank_values=True, strict_parsing=bool(raw),
            max_num_fields=MAX_QUERY_FIELDS, errors="strict",
        )  # fmt: skip
    except (ValueError, UnicodeDecodeError) as exc:
        raise HttpError(400, f"malformed query string: {exc}") from None
    out: dict[str, str] = {}
    for name, value in pairs:
        if name in out:
            raise HttpError(400, f"query parameter {name!r} given more than once")
        out[name] = value
    return out


@dataclass(frozen=True)
class Raw:
    """A non-JSON response body (e.g. Prometheus text)."""

    body: bytes
    content_type: str


class RequestStats:
    def __init__(self, routes: tuple[str, ...]):
        self._routes = routes
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, int]] = Counter()

    def add(self, path: str, status: int) -> None:
        route = path if path in self._routes else "other"
        with self._lock:
            self.counts[(route, status)] += 1

    def items(self) -> list[tuple[tuple[str, int], int]]:
        with self._lock:
            return list(self.counts.items())


class Service:
    """What a daemon serves: GET routes (path -> () -> dict | Raw) and token-guarded POST
    routes (path -> (body, caller) -> dict), under one API version string."""

    def __init__(self, api_version: str, name: str, token: str | None = None):
        self.api_version = api_version
        self.name = name
        self.token = token
        self.get_routes: dict[str, Callable[..., Any]] = {}
        self.query_routes: set[str] = set()  # GET routes called with the parsed query
        self.post_routes: dict[str, Callable[[dict, str], dict]] = {}
        self.auth_failures = 0
        self.stats = RequestStats(())

    def finalize(self) -> None:
        self.stats = RequestStats(tuple(self.get_routes) + tuple(self.post_routes))

    def check_token(self, header: str) -> None:
        if self.token is None:
            raise HttpError(403, f"control is disabled: the {self.name} runs without --token-file")
        scheme, _, presented = header.partition(" ")
        if not (
            scheme.lower() == "bearer"
            and hmac.compare_digest(presented.strip().encode(), self.token.encode())
        ):
            self.auth_failures += 1
            raise HttpError(
                401,
                "missing or wrong bearer token",
                {"WWW-Authenticate": 'Bearer realm="rankguard"'},
            )


def make_handler(service: Service, domain_errors: tuple[type[Exception], ...] = ()):
    class Handler(BaseHTTPRequestHandler):
        server_version = f"rankguard-{service.name}"
        sys_version = ""
        timeout = REQUEST_TIMEOUT_SECONDS
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args) -> None:  # through logging, quietly
            log.debug("%s %s", self.address_string(), fmt % args)

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
            service.stats.add(self._path(), status)

        def _json(self, status: int, payload: dict, headers=None) -> None:
            body = json.dumps(
                json_safe({"api": service.api_version, **payload}), separators=COMPACT
            )
            self._send(status, body.encode() + b"\n", "application/json", headers)

        def _respond(self, payload) -> None:
            if isinstance(payload, Raw):
                self._send(200, payload.body, payload.content_type)
            else:
                self._json(200, payload)

        def _dispatch(self) -> None:
            try:
                self._route()
            except HttpError as exc:
                self._json(
                    exc.status, {"error": {"status": exc.status, "message": str(exc)}}, exc.headers
                )
            except domain_errors as exc:  # e.g. a refused control action, with its status
                status = getattr(exc, "status", 400)
                self._json(status, {"error": {"status": status, "message": str(exc)}})
            except Exception:  # a bug must not take the daemon down
                log.exception("error serving %s %s", self.command, self.path)
                self._json(
                    500,
                    {
                        "error": {
                            "status": 500,
                            "message": f"internal error (logged by the {service.name})",
                        }
                    },
                )

        def _route(self) -> None:
            path, method = self._path(), self.command
            if method in ("GET", "HEAD") and path in service.get_routes:
                if path in service.query_routes:
                    query = parse_query(self.path.partition("?")[2])
                    return self._respond(service.get_routes[path](query))
                return self._respond(service.get_routes[path]())
            if method == "POST" and path in service.post_routes:
                service.check_token(self.headers.get("Authorization", ""))
                return self._respond(
                    {
                        "result": service.post_routes[path](
                            self._read_json_body(), self.client_address[0]
                        )
                    }
                )
            if path in service.post_routes:
                raise HttpError(405, f"{path} accepts POST", {"Allow": "POST"})
            if path in service.get_routes:
                raise HttpError(405, f"{path} accepts GET", {"Allow": "GET, HEAD"})
            raise HttpError(404, f"no such endpoint: {path}")

        def _read_json_body(self) -> dict:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise HttpError(411, "a JSON body with Content-Length is required")
            if int(length) > MAX_BODY_BYTES:
                self.close_connection = True  # don't read a hostile body
                raise HttpError(413, f"body larger than {MAX_BODY_BYTES} bytes")
            try:
                body = json.loads(self.rfile.read(int(length)))
            except (ValueError, RecursionError):
                raise HttpError(400, "body is not valid JSON") from None
            if not isinstance(body, dict):
                raise HttpError(400, "body must be a JSON object")
            return body

        do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _dispatch

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


def serve(service: Service, host: str, port: int, domain_errors=()) -> ThreadingHTTPServer:
    """Bind (IPv4 or IPv6 by the host's form) and serve in a daemon thread."""
    service.finalize()
    server_cls = _Server
    if ":" in host:
        server_cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
    server = server_cls((host, port), make_handler(service, domain_errors))
    threading.Thread(
        target=server.serve_forever, name=f"rankguard-{service.name}-http", daemon=True
    ).start()
    return server
