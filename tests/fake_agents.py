"""Fake agents served from the tests: an honest one answering from contract models, and a
hostile one answering whatever a test tells it (raw bytes, huge or deep JSON, another
node's name). Every control call is recorded with its token, so a test can say which agent
was asked to kill what."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rankguard.contract.answers import NodeAnswer, RankAnswer, RanksAnswer


def rank(job: str = "j", rank: int = 0, world: int = 2, **kw) -> RankAnswer:
    """A live telemetry rank (pass state="exited", exit_code=1 for a dead one)."""
    fields = dict(local_rank=rank, pid=1000 + rank, restart=0, state="alive", step=10,
                  phase="train", heartbeat_age_seconds=0.1)  # fmt: skip
    return RankAnswer(job=job, rank=rank, world_size=world, **{**fields, **kw})


class FakeAgent(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, node: str, host: str = "127.0.0.1"):
        self.node = node
        self.ranks: list[RankAnswer] = []
        self.raw: dict[str, bytes] = {}  # path -> the exact body to answer (hostile)
        self.headers_override: dict[str, dict[str, str]] = {}  # path -> extra headers
        self.stream: dict[str, int] = {}  # path -> bytes to stream chunked, unannounced
        self.controls: list[tuple[str, dict, str]] = []  # (path, body, Authorization)
        self.control_delay: dict[str, float] = {}  # path -> seconds before its answer
        self.control_refused: set[str] = set()  # paths answered 404, as for a rank not here
        self.stacks = "Thread 1\n  wait (x.py:1)\n"  # what a stacks control answers
        self.lock = threading.Lock()
        super().__init__((host, 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def verdict(self, status: str, *reasons) -> None:
        """Answer /v1/node with this verdict and its HealthReasons (not healthy)."""
        self.raw["/v1/node"] = json.dumps(
            NodeAnswer(node=self.node, version="0", time=0.0, uptime_seconds=1.0,
                       status=status, reasons=tuple(reasons)).to_json()
        ).encode()  # fmt: skip

    def answer(self, path: str) -> bytes:
        if path in self.raw:
            return self.raw[path]
        if path == "/v1/node":
            body = NodeAnswer(node=self.node, version="0", time=0.0, uptime_seconds=1.0,
                              status="healthy").to_json()  # fmt: skip
        else:
            body = RanksAnswer(node=self.node, time=0.0, ranks=tuple(self.ranks)).to_json()
        return json.dumps(body).encode()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed ACK

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        server: FakeAgent = self.server  # type: ignore[assignment]
        if path in server.stream:
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"[" * 65536
            try:
                for _ in range(server.stream[path] // len(chunk)):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                pass  # the supervisor hung up: what we want
            self.close_connection = True
            return
        if path == "/v1/rank-events" and path not in server.raw:  # an agent before it
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = server.answer(path)
        self.send_response(200)
        headers = {"Content-Length": str(len(data)), **server.headers_override.get(path, {})}
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError:
            self.close_connection = True

    def do_POST(self) -> None:
        server: FakeAgent = self.server  # type: ignore[assignment]
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        with server.lock:
            server.controls.append((self.path, body, self.headers.get("Authorization", "")))
        time.sleep(server.control_delay.get(self.path, 0.0))  # an agent behind a cut link
        refused = self.path in server.control_refused
        result = (
            {"error": "no live rank here"}
            if refused
            else {"result": {**body, "sent": True, "stacks": server.stacks}}
        )
        data = json.dumps(result).encode()
        self.send_response(404 if refused else 200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
