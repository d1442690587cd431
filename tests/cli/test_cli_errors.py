"""Bad input to the daemons and the query commands (issue 13): one line on stderr and exit
2, never a traceback, for each of: a URL that is not one, a missing agents file, a port in
use, a host that does not resolve, a foreign or corrupt database, a URL of another service."""

from __future__ import annotations

import socket
import sqlite3
import subprocess

import pytest
from fake_agents import FakeAgent
from harness import RANKGUARD

pytestmark = pytest.mark.slow  # a fresh interpreter per case


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*RANKGUARD, *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_exit_2(proc: subprocess.CompletedProcess, *words: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err and "\n" not in err, err
    for word in words:
        assert word in err, err


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def supervisor(tmp_path, *args: str) -> list[str]:
    base = {"--db": str(tmp_path / "db"), "--bind": "127.0.0.1:0"}
    flags = dict(zip(args[::2], args[1::2], strict=True))
    if "--agents-file" not in flags:
        base["--agents"] = "http://127.0.0.1:9"
    merged = {**base, **flags}
    return ["supervisor", *[x for kv in merged.items() for x in kv]]


@pytest.mark.parametrize(
    "args,words",
    [
        (("--agents", "node-1:9407"), ("--agents", "not an http(s) URL")),
        (("--agents-file", "/nonexistent/agents"), ("--agents-file", "No such file")),
        (("--bind", "no-such-host.invalid:0"), ("cannot serve on no-such-host.invalid",)),
        (("--bind", "127.0.0.1:99999"), ("--bind",)),
        (("--interval", "0"), ("--interval",)),
        (("--tls-cert", "/nonexistent.crt"), ("--tls-key",)),
        (("--token-file", "/nonexistent/token"), ("token file",)),
        (("--log-level", "bogus"), ("--log-level", "bogus")),
    ],
    ids=["agents-not-url", "agents-file-missing", "host-unresolvable", "port-range",
         "interval", "tls-half", "token-missing", "log-level"],
)  # fmt: skip
def test_supervisor_refuses_bad_input_in_one_line(tmp_path, args, words):
    assert_one_line_exit_2(run(*supervisor(tmp_path, *args)), *words)


def test_supervisor_refuses_a_port_in_use(tmp_path, busy_port):
    proc = run(*supervisor(tmp_path, "--bind", f"127.0.0.1:{busy_port}"))
    assert_one_line_exit_2(proc, f"127.0.0.1:{busy_port}", "in use")


def test_supervisor_refuses_a_corrupt_or_foreign_database(tmp_path):
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"\x00garbage" * 512)
    assert_one_line_exit_2(run(*supervisor(tmp_path, "--db", str(corrupt))), "corrupt.db")
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE songs (title TEXT)")
    assert_one_line_exit_2(run(*supervisor(tmp_path, "--db", str(foreign))), "foreign.db")


def test_the_agent_refuses_a_port_in_use_and_an_unresolvable_host(tmp_path, busy_port):
    common = ["agent", "--telemetry-socket", str(tmp_path / "t.sock"), "--discover-workers",
              "off"]  # fmt: skip
    proc = run(*common, "--bind", f"127.0.0.1:{busy_port}")
    assert_one_line_exit_2(proc, "rankguard agent:", "in use")
    proc = run(*common, "--bind", "no-such-host.invalid:0")
    assert_one_line_exit_2(proc, "rankguard agent:", "no-such-host.invalid")
    proc = run(*common, "--bind", "127.0.0.1:0", "--log-level", "bogus")
    assert_one_line_exit_2(proc, "rankguard agent:", "--log-level")


def test_query_commands_name_a_url_of_another_service():
    agent = FakeAgent("n")  # answers JSON, but not the supervisor's
    try:
        proc = run("health", "--supervisor", agent.url)
        assert_one_line_exit_2(proc, "not a rankguard supervisor")
        proc = run("incidents", "--supervisor", "not-a-url")
        assert_one_line_exit_2(proc, "not-a-url")
        proc = run("inject", "kill", "--agent", "http://127.0.0.1:1/")
        assert_one_line_exit_2(proc, "rankguard inject:")
        agent.raw["/v1/ranks"] = b'{"api": "something else"}'
        proc = run("inject", "kill", "--agent", agent.url)
        assert_one_line_exit_2(proc, "not a rankguard agent")
        proc = run("inject", "kill", "--agent", "node-1:9407")
        assert_one_line_exit_2(proc, "not an http(s) URL")
    finally:
        agent.close()
