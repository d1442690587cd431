"""TLS for agent and supervisor HTTP (issue 13): the bearer token no longer crosses the
network in clear text. A small CA made with openssl as docs/security.md shows; the agent
serves HTTPS, the supervisor checks its certificate against the CA and controls it; a
plain-HTTP client or an unverified certificate gets nothing, and is counted."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import urllib.request

import pytest
from harness import free_port, wait_until

from rankguard.agent.config import AgentConfig, AgentConfigError, load_tls
from rankguard.agent.daemon import Agent
from rankguard.agent.nvml_double import NvmlDouble, make_double
from rankguard.supervisor.agents import AgentClient, AgentError, trust_agents_signed_by

TOKEN = "a-token-for-the-tls-tests-0123"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The recipe of docs/security.md: a CA, and one node's key and certificate."""
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650", "-subj", "/CN=rankguard CA",
            cwd=d)  # fmt: skip
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=localhost", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "node.crt", "-days", "825", "-extfile", "san.ext",
            cwd=d)  # fmt: skip
    (d / "node.key").chmod(0o600)
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", "other-ca.key", "-out", "other-ca.crt", "-days", "1", "-subj",
            "/CN=someone else", cwd=d)  # fmt: skip
    return d


@pytest.fixture
def tls_agent(tmp_path, pki):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    cfg = AgentConfig(bind="127.0.0.1:0", token_file=token, node="n1",
                      telemetry_socket=str(tmp_path / "t.sock"), tls_cert=pki / "node.crt",
                      tls_key=pki / "node.key")  # fmt: skip
    agent = Agent(cfg, nvml=NvmlDouble(make_double(n_gpus=1)))
    agent.collect_once()
    host, port = agent.start_http()
    yield agent, port
    trust_agents_signed_by(None)
    agent.close()


def test_the_supervisor_reads_and_controls_an_https_agent_it_verified(tls_agent, pki):
    agent, port = tls_agent
    trust_agents_signed_by(str(pki / "ca.crt"))
    client = AgentClient(f"https://127.0.0.1:{port}", TOKEN)
    assert client.get("/v1/node")["node"] == "n1"
    with pytest.raises(AgentError, match="HTTP 404"):  # authenticated, the rank is unknown
        client.signal("j", 0, "SIGTERM")
    assert agent.service.auth_failures == 0


def test_an_unverified_certificate_is_refused_before_the_token_is_sent(tls_agent, pki):
    agent, port = tls_agent
    trust_agents_signed_by(str(pki / "other-ca.crt"))
    with pytest.raises(AgentError, match="CERTIFICATE_VERIFY_FAILED"):
        AgentClient(f"https://127.0.0.1:{port}", TOKEN).signal("j", 0, "SIGTERM")
    assert not [route for (route, _), _ in agent.service.stats.items() if "control" in route]


def test_plain_http_to_a_tls_port_gets_nothing_and_is_counted(tls_agent):
    agent, port = tls_agent
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/control/signal HTTP/1.1\r\nAuthorization: Bearer " +
                  TOKEN.encode() + b"\r\n\r\n")  # fmt: skip
        with contextlib.suppress(ConnectionResetError):
            assert not s.recv(1024).startswith(b"HTTP")  # a TLS alert or nothing
    wait_until(lambda: agent.service.refusals["tls_handshake"] == 1, 5, "the refusal counted")
    text = b"".join(
        f"{m.name} {m.samples}".encode() for m in agent.registry.collect()
    )  # the agent's /metrics families
    assert b"rankguard_agent_http_refused_connections" in text


def test_a_stalled_handshake_does_not_block_other_clients(tls_agent, pki):
    agent, port = tls_agent
    stalled = socket.create_connection(("127.0.0.1", port), timeout=5)  # says nothing
    try:
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=5,
                                    context=context) as resp:  # fmt: skip
            assert json.loads(resp.read())["ok"] is True
    finally:
        stalled.close()


def test_bad_tls_files_are_one_clear_error(pki, tmp_path):
    with pytest.raises(AgentConfigError, match="no such file"):
        load_tls(tmp_path / "missing.crt", pki / "node.key")
    with pytest.raises(AgentConfigError, match="certificate"):
        load_tls(pki / "node.crt", pki / "other-ca.key")  # a key of another certificate
    with pytest.raises(AgentConfigError, match="go together"):
        AgentConfig(tls_cert=pki / "node.crt")


@pytest.mark.slow
def test_supervisor_and_query_cli_over_https(tmp_path, pki, tls_agent):
    """The real supervisor process: polls the https agent, serves HTTPS itself, and
    `rankguard health` reaches it with the CA."""
    agent, agent_port = tls_agent
    token = tmp_path / "sup.token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    port = free_port()
    cli = [sys.executable, "-m", "rankguard.cli.main"]
    proc = subprocess.Popen(
        [*cli, "supervisor", "--agents", f"https://localhost:{agent_port}", "--token-file",
         str(token), "--db", str(tmp_path / "db"), "--bind", f"127.0.0.1:{port}",
         "--tls-cert", str(pki / "node.crt"), "--tls-key", str(pki / "node.key"),
         "--ca-file", str(pki / "ca.crt")],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    err: list[str] = []
    threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True).start()
    try:
        health = [*cli, "health", "--json", "--supervisor", f"https://localhost:{port}"]

        def healthy():
            out = subprocess.run(health, capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "RANKGUARD_CA_FILE": str(pki / "ca.crt")})  # fmt: skip
            view = json.loads(out.stdout) if out.stdout else {}
            nodes = view.get("nodes", [])
            return nodes and nodes[0]["reachable"] and nodes[0]["node"] == "n1"

        wait_until(healthy, 60, "the supervisor to see the https agent")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert "Traceback" not in "".join(err)
