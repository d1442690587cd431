"""AgentClient's keep-alive connections: reused across clients and passes, and a
connection the agent closed while idle is replaced without failing the request."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rankguard.contract.answers import NodeAnswer
from rankguard.supervisor.agents import AgentClient, AgentError

NODE = NodeAnswer(node="n", version="0", time=0.0, uptime_seconds=0.0, status="healthy")


class _Agent(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        self.connections = 0
        self.close_after_each = False
        self.answer = None  # None: echo the path
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        self.server.connections += 1

    def log_message(self, *args):
        pass

    def do_GET(self):
        status = 404 if self.path == "/missing" else 200
        body = {"error": {"message": "no such thing"}} if status == 404 else {"path": self.path}
        if self.server.answer is not None:  # a sound node, ranks answered as told
            body = NODE.to_json() if self.path == "/v1/node" else self.server.answer
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if self.server.close_after_each:
            self.close_connection = True  # as an idle timeout would, after answering


@pytest.fixture
def agent():
    server = _Agent()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_connections_are_reused_across_clients(agent):
    for i in range(5):  # the loop makes new clients every pass
        assert AgentClient(agent.url).get(f"/v1/ranks?n={i}") == {"path": f"/v1/ranks?n={i}"}
    assert agent.connections == 1


def test_a_connection_closed_by_the_agent_is_replaced(agent):
    agent.close_after_each = True
    for _ in range(3):
        assert AgentClient(agent.url).get("/v1/node") == {"path": "/v1/node"}
    assert agent.connections == 3


def test_errors_keep_their_status_and_message(agent):
    with pytest.raises(AgentError) as err:
        AgentClient(agent.url).get("/missing")
    assert err.value.status == 404 and "no such thing" in str(err.value)
    nobody = _Agent()  # a port nobody listens on once closed
    nobody.server_close()
    with pytest.raises(AgentError) as err:
        AgentClient(nobody.url, timeout=1).get("/v1/node")
    assert err.value.status is None and "refused" in str(err.value).lower()


@pytest.mark.parametrize(
    "answer,reason",
    [([1, 2], "not_object"), ({"ranks": [{"job": "j"}]}, "missing_field"),
     ({"node": "n", "time": 0, "ranks": [{"job": "j", "rank": "x"}]}, "missing_field"),
     ({"node": "n", "time": 0, "ranks": 5}, "bad_type"),
     ({"node": "n", "time": 0, "ranks": [{"job": "j", "rank": 0, "recent_from": 1,
                                          "recent": [{"seq": 1, "step": "?"}]}],
       "cursor": "c", "full": True}, "missing_field")],
)  # fmt: skip
def test_a_malformed_answer_makes_one_node_unseen_not_the_poll_fail(agent, answer, reason):
    from rankguard.supervisor.agents import Poller

    agent.answer = answer
    poller = Poller()
    try:
        [node] = poller.poll([AgentClient(agent.url)]).nodes
    finally:
        poller.close()
    assert not node.reachable and "malformed answer" in node.error
    assert dict(poller.malformed) == {reason: 1}  # counted by reason
