"""The snapshot holder's trust boundary and its memory on the agent: real sockets, holders
as threads, an agent with its real HTTP server.

- TCP (holders on other nodes, ranks fetching a lost node's replica) needs the snapshot
  token, proved by HMAC over fresh nonces; a wrong token, an unauthenticated put, an
  oversized or malformed frame is refused and counted, and the holder keeps serving.
- `/v1/node` and `/metrics` show what the node's holder holds, per job.
"""

from __future__ import annotations

import json
import select
import socket
import struct
import threading
import time
import urllib.request

import pytest
from builders import FAST, json_values_without_nan
from hypothesis import given, settings
from hypothesis import strategies as st

from rankguard.agent.collectors import CollectorContext, settings_for
from rankguard.agent.collectors.snapshots import SnapshotsCollector, SnapshotsConfig
from rankguard.agent.config import AgentConfig
from rankguard.agent.daemon import Agent
from rankguard.agent.snapshot_holder import HolderServer
from rankguard.client.snapshots import SnapshotClient
from rankguard.contract import snapshots as wire

TOKEN = "snapshot-token-for-tests-0123456789"


def _serve(**kw) -> HolderServer:
    server = HolderServer(**kw)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _wait(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def _hung_up(sock) -> bool:
    """The peer closed: a clean end, or a reset (a close with our unread bytes queued
    makes the kernel send RST instead of FIN)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _put(step: int, rank: int, data: bytes, world: int = 2) -> dict:
    return {"op": "put", "job": "j", "step": step, "rank": rank, "world": world,
            "local_world": world, "keep": 2, "checksum": wire.checksum(data)}  # fmt: skip


@pytest.fixture
def tcp_holder(tmp_path):
    h = _serve(socket_path=str(tmp_path / "h.sock"), bind=("127.0.0.1", 0), token=TOKEN,
               max_snapshot_bytes=4096)  # fmt: skip
    h.addr, h.path = f"127.0.0.1:{h.tcp_port}", str(tmp_path / "h.sock")
    yield h
    h.shutdown()


# -- the trust boundary ------------------------------------------------------------------
def test_tcp_needs_the_token_and_refusals_are_counted(tcp_holder):
    h, addr = tcp_holder, tcp_holder.addr
    data = b"x" * 1000
    assert wire.request(addr, _put(5, 0, data), data, token=TOKEN)[0]["ok"]
    assert wire.request(addr, {"op": "get", "job": "j", "step": 5, "rank": 0},
                        token=TOKEN)[1] == data  # fmt: skip
    # a wrong token: refused during the handshake, nothing else is read
    with pytest.raises(wire.WireError, match="prove|authentication"):
        wire.request(addr, {"op": "status"}, token="another-token-0123456789abcdef")
    with pytest.raises(wire.WireError, match="needs the snapshot token"):
        wire.request(addr, {"op": "status"})  # the client refuses to go unauthenticated
    # an unauthenticated put: refused before its payload is read (no memory allotted)
    with socket.create_connection(("127.0.0.1", h.tcp_port), timeout=5) as sock:
        wire.send_frame(sock, _put(6, 0, data), data)
        answer, _ = wire.recv_frame(sock)
        assert not answer["ok"] and "authenticate first" in answer["error"]
        assert sock.recv(1) == b""  # hung up
    # a reflected proof (the server's role) is not a client proof
    with socket.create_connection(("127.0.0.1", h.tcp_port), timeout=5) as sock:
        wire.send_frame(sock, {"op": "hello", "nonce": "n" * 32})
        answer, _ = wire.recv_frame(sock)
        theirs = answer["nonce"]
        wire.send_frame(sock, {"op": "auth", "proof": wire.proof(TOKEN, "server", "n" * 32,
                                                                 theirs)})  # fmt: skip
        answer, _ = wire.recv_frame(sock)
        assert not answer["ok"] and "authentication failed" in answer["error"]
    # oversized: refused on the header, the connection closed, the holder goes on
    big = b"y" * 5000
    with pytest.raises((wire.WireError, OSError, EOFError)):
        wire.request(addr, _put(7, 0, big), big, token=TOKEN)
    refused = wire.request(addr, {"op": "status"}, token=TOKEN)[0]["refused"]
    assert refused == {"auth_failed": 2, "unauthenticated": 1, "too_large": 1}, refused
    st_ = wire.HolderStatus.from_json(wire.request(addr, {"op": "status"}, token=TOKEN)[0])
    assert [(s.step, s.ranks) for s in st_.snapshots] == [(5, (0,))]  # nothing else held


def test_bad_requests_keep_the_connection_bad_frames_close_it(tcp_holder):
    path = tcp_holder.path
    with wire.connect(path) as sock:  # unix: owner-only, no token
        wire.send_frame(sock, {"op": "put", "job": "j", "step": -1})
        answer, _ = wire.recv_frame(sock)
        assert not answer["ok"] and "world" in answer["error"]
        wire.send_frame(sock, {"op": "status"})  # the frame was read whole: still in step
        assert wire.recv_frame(sock)[0]["ok"]
        head = json.dumps({"op": "list", "job": "j", "rank": 0, "world": 1, "size": 4}).encode()
        sock.sendall(struct.pack(">I", len(head)) + head + b"junk")
        answer, _ = wire.recv_frame(sock)  # a payload where none belongs: unread, hang up
        assert not answer["ok"]
        assert _hung_up(sock)
    with wire.connect(path) as sock:
        sock.sendall(struct.pack(">I", 10**6))  # a header over the limit
        answer, _ = wire.recv_frame(sock)
        assert not answer["ok"] and "header of" in answer["error"]
    assert wire.request(path, {"op": "status"})[0]["refused"]["too_large"] == 1


def _idle(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def _trickle_until_hung_up(sock, every: float = 0.25, limit: float = 10.0) -> float:
    """Send a frame that never ends, a byte every `every` s (each recv of the holder gets
    one in time), until the holder hangs up; the seconds that took."""
    frame = struct.pack(">I", 1000) + b"{" + b" " * 999
    start = time.monotonic()
    for byte in frame:
        sock.sendall(bytes([byte]))
        if select.select([sock], [], [], every)[0] and _hung_up(sock):
            return time.monotonic() - start
        assert time.monotonic() - start < limit, "the holder never hung up"
    raise AssertionError("the whole frame was read")


def test_unauthenticated_connections_are_few_per_peer_address():
    h = _serve(socket_path=None, bind=("127.0.0.1", 0), token=TOKEN, handshake_seconds=60)
    addr = f"127.0.0.1:{h.tcp_port}"
    idle = []
    try:
        idle += [_idle(h.tcp_port) for _ in range(4)]
        _wait(lambda: h.unauthenticated.held() == 4)
        with _idle(h.tcp_port) as extra:  # one more: closed on accept, not at the deadline
            assert _hung_up(extra)
        for sock in idle:  # the four keep waiting
            sock.settimeout(0.2)
            with pytest.raises(TimeoutError):
                sock.recv(1)
        # the cap is per address: a peer from 127.0.0.2 authenticates and is served
        with _idle(h.tcp_port, source="127.0.0.2") as sock:
            wire.client_handshake(sock, TOKEN)
            wire.send_frame(sock, {"op": "status"})
            assert wire.recv_frame(sock)[0]["refused"] == {"too_many_unauthenticated": 1}
        idle.pop().close()  # a slot given back is free again
        _wait(lambda: h.unauthenticated.held() == 3)
        assert wire.request(addr, {"op": "status"}, token=TOKEN)[0]["ok"]
    finally:
        for sock in idle:
            sock.close()
        h.shutdown()


def test_a_connection_that_does_not_authenticate_in_time_is_closed():
    h = _serve(socket_path=None, bind=("127.0.0.1", 0), token=TOKEN, handshake_seconds=1.0)
    addr = f"127.0.0.1:{h.tcp_port}"
    try:
        with wire.connect(addr, token=TOKEN) as trusted, _idle(h.tcp_port) as idle, \
                _idle(h.tcp_port) as trickle:  # fmt: skip
            start = time.monotonic()
            assert 0.5 < _trickle_until_hung_up(trickle) < 5  # the deadline is for the whole
            idle.settimeout(5)
            assert _hung_up(idle)
            assert 0.5 < time.monotonic() - start < 5
            assert h.status()["refused"] == {"handshake_timeout": 2}
            # authenticated before the deadline: it may idle past it, as before (300 s)
            time.sleep(max(0.0, start + 1.5 - time.monotonic()))
            assert h.unauthenticated.held() == 0
            wire.send_frame(trusted, {"op": "status"})
            assert wire.recv_frame(trusted)[0]["ok"]
    finally:
        h.shutdown()


def test_holder_without_a_token_does_not_listen_on_tcp(tmp_path):
    with pytest.raises(ValueError, match="needs a token"):
        HolderServer(str(tmp_path / "h.sock"), bind=("127.0.0.1", 0))


def test_replication_over_tcp_with_the_token_and_a_refusing_peer(tmp_path):
    b = _serve(socket_path=None, bind=("127.0.0.1", 0), token=TOKEN)
    wrong = _serve(socket_path=None, bind=("127.0.0.1", 0), token="x" * 32)
    # the first peer refuses our token: the next in the ring takes over
    a = _serve(socket_path=str(tmp_path / "a.sock"), token=TOKEN,
               peer=[f"127.0.0.1:{wrong.tcp_port}", f"127.0.0.1:{b.tcp_port}"])  # fmt: skip
    try:
        c = SnapshotClient(str(tmp_path / "a.sock"), (), "j", 0, 1, 1, keep=2)
        for step in (1, 2, 3):
            c.save(step, b"s%d" % step * 100)
            c.wait()
            time.sleep(0.3)  # the replicator's pause after a failure
        c.close()
        _wait(lambda: [e["step"] for e in b.store.listing("j", 0, 1)] == [3, 2])
        rep = a.status()["replication"]
        assert rep["failures"] == 1 and rep["peer"].endswith(str(b.tcp_port)), rep
        assert wrong.status()["refused"] == {"auth_failed": 1}
        assert wrong.store.status()["bytes"] == 0
    finally:
        for h in (a, b, wrong):
            h.shutdown()


_FIELDS = st.sampled_from(["op", "job", "step", "rank", "world", "local_world", "keep",
                           "checksum", "size", "kind", "after", "all_ranks", "replica"])  # fmt: skip
_OPS = st.sampled_from([*wire.OPS, "drop", 3, None])


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        _FIELDS, json_values_without_nan | _OPS | st.integers(-(2**70), 2**70), max_size=10
    )
)
def test_parse_request_refuses_with_one_error_type(header):
    try:
        req = wire.parse_request(header, max_payload=1024)
    except wire.WireError as exc:
        assert exc.reason in wire.REFUSALS
        return
    assert req.op in wire.OPS and 0 <= req.size <= 1024
    assert req.op == "put" or req.size == 0


@FAST
@given(st.binary(max_size=64) | st.builds(lambda b: struct.pack(">I", len(b)) + b,
                                          st.binary(max_size=64)))  # fmt: skip
def test_frame_parser_on_arbitrary_bytes(raw):
    a, b = socket.socketpair()
    try:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        try:
            header = wire.recv_header(b)
        except (wire.WireError, EOFError) as exc:
            assert not isinstance(exc, wire.WireError) or exc.reason in wire.REFUSALS
            return
        assert isinstance(header, dict) and 0 <= header.get("size", 0) <= wire.MAX_PAYLOAD
    finally:
        a.close()
        b.close()


# -- snapshot memory on the agent ---------------------------------------------------------
def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read()


def test_agent_shows_the_holders_memory_on_node_and_metrics(tmp_path):
    holder = _serve(socket_path=str(tmp_path / "h.sock"))
    collectors = settings_for({"snapshots": {"holder": str(tmp_path / "h.sock")}})
    agent = Agent(AgentConfig(bind="127.0.0.1:0", telemetry_socket=str(tmp_path / "t.sock"),
                              node="n1", collectors=collectors))  # fmt: skip
    try:
        for step in (10, 20):
            for rank in (0, 1):
                data = bytes(1000 + rank)
                wire.request(str(tmp_path / "h.sock"), _put(step, rank, data), data)
        data = bytes(500)
        wire.request(str(tmp_path / "h.sock"), _put(30, 0, data), data)  # 30: rank 1 missing
        agent.collect_once()
        host, port = agent.start_http()
        base = f"http://{host}:{port}"
        facts = json.loads(_get(base + "/v1/node"))["facts"]["snapshots"]
        # keep 2: step 10 evicted; 20 (complete) and 30 (rank 1 missing) held
        assert facts["up"] and facts["bytes"] == 2001 + 500 and facts["evicted"] == 1
        (job,) = facts["jobs"]
        assert job == {"job": "j", "kind": "local", "bytes": 2001 + 500, "snapshots": 3,
                       "steps": 2, "newest_step": 30, "newest_complete_step": 20}  # fmt: skip
        text = _get(base + "/metrics").decode()
        for line in ('rankguard_snapshot_holder_up 1.0',
                     'rankguard_snapshot_bytes{kind="local",training_job="j"} 2501.0',
                     'rankguard_snapshot_held{kind="local",training_job="j"} 3.0',
                     'rankguard_snapshot_evicted_total 1.0',
                     'rankguard_snapshot_newest_step{kind="local",training_job="j"} 30.0',
                     'rankguard_snapshot_newest_complete_step{kind="local",training_job="j"} 20.0',
                     'rankguard_snapshot_refused_total{reason="auth_failed"} 0.0',
                     'rankguard_collector_success{collector="snapshots"} 1.0'):  # fmt: skip
            assert line in text, line
        holder.shutdown()  # a holder that does not answer: up 0, not a failed collector
        agent.collect_once()
        facts = json.loads(_get(base + "/v1/node"))["facts"]["snapshots"]
        assert not facts["up"] and facts["error"]
        text = _get(base + "/metrics").decode()
        assert "rankguard_snapshot_holder_up 0.0" in text
        assert "rankguard_snapshot_bytes{" not in text
    finally:
        agent.close()


def test_no_holder_configured_exports_nothing_and_bad_status_is_refused(monkeypatch):
    monkeypatch.delenv("RANKGUARD_SNAPSHOT_HOLDER", raising=False)
    assert SnapshotsCollector(CollectorContext()).collect().metrics == []
    with pytest.raises(ValueError, match="HOST:PORT"):
        SnapshotsConfig(holder="nohost")
    for bad in ({}, {"pid": 1, "uptime_seconds": 1, "bytes": -1, "evicted": 0, "max_keep": 2,
                     "keep": {}, "snapshots": [], "replication": None, "requests": {},
                     "refused": {}},
                {"pid": 1, "uptime_seconds": 1, "bytes": 1, "evicted": 0, "max_keep": 2,
                 "keep": {}, "snapshots": [{"job": "j", "kind": "elsewhere"}],
                 "replication": None, "requests": {}, "refused": {}}):  # fmt: skip
        with pytest.raises(wire.WireError):
            wire.HolderStatus.from_json(bad)
