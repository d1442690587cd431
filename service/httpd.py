"""A small routed JSON/metrics HTTP server, shared by the agent and the supervisor.

Stdlib `ThreadingHTTPServer`: one thread per connection, a socket timeout against slow
clients, caps on connections (in all and per client address: 1,100 slow connections no
longer starve `/metrics` or exhaust the process's descriptors), a hard body limit, a
request body always consumed or the connection closed when a request is refused unread (a
body left on a keep-alive connection would be parsed as the next request), clients that
hang up handled quietly, optional TLS (handshake in the connection's thread, never in the
accept loop), errors as JSON (`{"api", "error": {"status", "message"}}`),
405 with `Allow` for a known path and the wrong method, and every request counted by
route (unknown paths folded into "other") and status. Routes that change anything take
a bearer token, compared in constant time. GET routes named in `query_routes` receive the
query string, parsed strictly (a malformed or repeated parameter is a 400). JSON is
compact: the clients are programs (the CLI pretty-prints), and a poll of 1,024 agents a
second pays for every byte.
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import socket
import ssl
import threading
import time
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
MAX_CONNECTIONS = 256  # open at once, all clients together
MAX_CONNECTIONS_PER_CLIENT = 64  # from one address: one client cannot take every slot
ACCEPT_BACKOFF_SECONDS = 0.1  # out of descriptors: wait, do not spin on the listening socket
#: Why a connection was refused or cut short (a bounded label set for counters).
REFUSALS = ("connection_cap", "client_cap", "accept_failed", "tls_handshake", "unread_body")
# A client that hangs up mid-answer is routine, not an error to log with a traceback.
CLIENT_GONE = (ConnectionError, TimeoutError, ssl.SSLError)


class ServeError(Exception):
    """The server could not start: the address is in use, does not resolve, or is not ours."""


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
    """A non-JSON response body (e.g. Prometheus text), with extra headers (e.g.
    Content-Encoding)."""

    body: bytes
    content_type: str
    headers: dict | None = None


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
        self.header_routes: set[str] = set()  # GET routes called with the request headers
        self.post_routes: dict[str, Callable[[dict, str], dict]] = {}
        self.auth_failures = 0
        self.stats = RequestStats(())
        self.refusals: Counter[str] = Counter()  # by REFUSALS reason
        self._refusals_lock = threading.Lock()

    def refuse(self, reason: str) -> None:
        with self._refusals_lock:
            self.refusals[reason] += 1

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
        # Headers and body leave in two writes: with Nagle on, the body waited for the
        # client's delayed ACK, 44 ms per request on a keep-alive connection (measured).
        disable_nagle_algorithm = True

        def log_message(self, fmt: str, *args) -> None:  # through logging, quietly
            log.debug("%s %s", self.address_string(), fmt % args)

        def _path(self) -> str:
            return self.path.split("?", 1)[0].rstrip("/") or "/"

        def _send(self, status: int, body: bytes, content_type: str, headers=None) -> None:
            try:
                self._write(status, body, content_type, headers)
            except CLIENT_GONE:  # the client hung up: nothing to answer, nothing to log
                self.close_connection = True
            service.stats.add(self._path(), status)

        def _write(self, status: int, body: bytes, content_type: str, headers=None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, status: int, payload: dict, headers=None) -> None:
            payload = {"api": service.api_version, **payload}
            try:  # the C encoder at once; a walk only for what it refuses (NaN, odd keys)
                body = json.dumps(payload, separators=COMPACT, allow_nan=False)
            except (ValueError, TypeError):
                body = json.dumps(json_safe(payload), separators=COMPACT)
            self._send(status, body.encode() + b"\n", "application/json", headers)

        def _respond(self, payload) -> None:
            if isinstance(payload, Raw):
                self._send(200, payload.body, payload.content_type, payload.headers)
            else:
                self._json(200, payload)

        def _dispatch(self) -> None:
            self._body_read = False
            try:
                self._answer()
            finally:
                self._discard_unread_body()

        def _discard_unread_body(self) -> None:
            """A request answered without reading its body (refused for its token, a wrong
            method): read the body away if it is small and announced, else close, so it is
            never taken for the next request on this keep-alive connection."""
            if self._body_read or self.close_connection:
                return
            length = self.headers.get("Content-Length", "0").strip()
            if (
                self.headers.get("Transfer-Encoding")
                or not length.isdigit()
                or int(length) > MAX_BODY_BYTES
            ):
                self.close_connection = True
                service.refuse("unread_body")
                return
            try:
                if int(length) and len(self.rfile.read(int(length))) != int(length):
                    self.close_connection = True
            except (OSError, *CLIENT_GONE):
                self.close_connection = True

        def _answer(self) -> None:
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
                if path in service.header_routes:  # content negotiation (/metrics)
                    return self._respond(service.get_routes[path](self.headers))
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
            length = (self.headers.get("Content-Length") or "").strip()
            if not length.isdigit() or self.headers.get("Transfer-Encoding"):
                raise HttpError(411, "a JSON body with Content-Length is required")
            if int(length) > MAX_BODY_BYTES:
                self.close_connection = True  # don't read a hostile body
                raise HttpError(413, f"body larger than {MAX_BODY_BYTES} bytes")
            raw = self.rfile.read(int(length))
            self._body_read = True
            if len(raw) != int(length):  # the client hung up or stalled mid-body
                self.close_connection = True
                raise HttpError(400, "body shorter than its Content-Length")
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                raise HttpError(400, "body is not valid JSON") from None
            if not isinstance(body, dict):
                raise HttpError(400, "body must be a JSON object")
            return body

        do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _dispatch

    return Handler


class _Server(ThreadingHTTPServer):
    """Caps open connections in all and per client address, backs off when accept fails
    (out of descriptors), and does the TLS handshake in the connection's own thread."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64
    service: Service
    tls: ssl.SSLContext | None = None
    max_connections = MAX_CONNECTIONS
    max_per_client = MAX_CONNECTIONS_PER_CLIENT

    def server_activate(self) -> None:
        self._open: Counter[str] = Counter()  # client address -> open connections
        self._open_lock = threading.Lock()
        super().server_activate()

    def get_request(self):
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # the pending connection stays queued: without a pause the loop spins
                self.service.refuse("accept_failed")
                time.sleep(ACCEPT_BACKOFF_SECONDS)
            raise

    def verify_request(self, request, client_address) -> bool:
        client = client_address[0]
        with self._open_lock:
            if sum(self._open.values()) >= self.max_connections:
                reason = "connection_cap"
            elif self._open[client] >= self.max_per_client:
                reason = "client_cap"
            else:
                self._open[client] += 1
                return True
        self.service.refuse(reason)
        _refuse_quickly(request)  # shutdown_request closes it
        return False

    def process_request(self, request, client_address) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread to run it (TasksMax): give its slot back
            self._release(client_address[0])
            raise

    def _release(self, client: str) -> None:
        with self._open_lock:
            self._open[client] -= 1
            if self._open[client] <= 0:
                del self._open[client]

    def process_request_thread(self, request, client_address) -> None:
        try:
            if self.tls is not None:
                request.settimeout(REQUEST_TIMEOUT_SECONDS)
                try:
                    request = self.tls.wrap_socket(request, server_side=True)
                except (OSError, ssl.SSLError):  # a plain-HTTP client, a scanner, a stall
                    self.service.refuse("tls_handshake")
                    self.shutdown_request(request)
                    return
            super().process_request_thread(request, client_address)
        finally:
            self._release(client_address[0])

    def handle_error(self, request, client_address) -> None:
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, CLIENT_GONE):
            log.debug("client %s went away: %r", client_address[0], exc)
        else:
            log.exception("error serving %s", client_address[0])


def _refuse_quickly(sock: socket.socket) -> None:
    """A 503 without waiting on the client (the accept loop must not block), then close."""
    try:
        sock.setblocking(False)
        sock.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                  b"Connection: close\r\nRetry-After: 1\r\n\r\n")  # fmt: skip
    except OSError:
        pass


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A server context for `cert` (PEM, the chain) and `key`; TLS 1.2 at least."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def serve(
    service: Service, host: str, port: int, domain_errors=(), tls: ssl.SSLContext | None = None
) -> ThreadingHTTPServer:
    """Bind (IPv4 or IPv6 by the host's form) and serve in a daemon thread; over TLS when
    given a context (tls_context)."""
    service.finalize()
    attrs = {"service": service, "tls": tls}
    if ":" in host:
        attrs["address_family"] = socket.AF_INET6
    server_cls = type("_BoundServer", (_Server,), attrs)
    try:
        server = server_cls((host, port), make_handler(service, domain_errors))
    except OSError as exc:  # EADDRINUSE, EADDRNOTAVAIL, EACCES, an unresolvable name
        why = exc.strerror or str(exc)
        raise ServeError(f"cannot serve on {host}:{port}: {why}") from None
    threading.Thread(
        target=server.serve_forever, name=f"rankguard-{service.name}-http", daemon=True
    ).start()
    return server
