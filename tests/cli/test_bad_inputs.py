"""Every bad input of issues 13 and 17, in one table: one line on stderr, exit 2, never a
traceback. Each row runs the real command line in a fresh interpreter; the daemons some
rows point at (a real agent and a real supervisor, a port held by someone else) are
started once for the module."""

from __future__ import annotations

import socket
import sqlite3
import subprocess

import pytest
from harness import RANKGUARD, start_agent, start_supervisor

pytestmark = pytest.mark.slow  # a fresh interpreter per row

# (id, command line, words the one line must hold). {tmp}: a scratch directory with the
# files below; {busy}: a port in use; {agent}, {sup}: URLs of a real agent and supervisor.
SUP = ["supervisor", "--db", "{tmp}/db", "--bind", "127.0.0.1:0"]
SUP_A = [*SUP, "--agents", "http://127.0.0.1:9"]
AGENT = ["agent", "--telemetry-socket", "{tmp}/t.sock", "--discover-workers", "off"]
AGENT_B = [*AGENT, "--bind", "127.0.0.1:0"]
UP = ["up", "--run-dir", "{tmp}/run"]
CASES = [
    # `up --inject`: the fault grammar (docs/faults.md)
    ("inject-rank-not-a-number", [*UP, "--inject", "kill:rank=x:at=5s"], ["rank takes a whole number"]),
    ("inject-at-in-minutes", [*UP, "--inject", "kill:rank=1:at=15m"], ["at takes a number", "seconds"]),
    ("inject-unknown-kind", [*UP, "--inject", "explode:rank=1"], ["kinds: kill"]),
    ("inject-no-rank", [*UP, "--inject", "kill:at=5s"], ["which rank"]),
    ("inject-no-time", [*UP, "--inject", "kill:rank=1"], ["at=SECONDS", "step=N"]),
    ("up-cold-and-warm", [*UP, "--cold-start", "--warm-start"], ["choose one"]),
    # the supervisor's flags and files
    ("sup-port-in-use", [*SUP_A, "--bind", "127.0.0.1:{busy}"], ["127.0.0.1:{busy}", "in use"]),
    ("sup-bind-not-local", [*SUP_A, "--bind", "192.0.2.1:0"], ["192.0.2.1"]),
    ("sup-bind-unresolvable", [*SUP_A, "--bind", "no-such-host.invalid:0"], ["cannot serve on no-such-host.invalid"]),
    ("sup-port-range", [*SUP_A, "--bind", "127.0.0.1:99999"], ["--bind"]),
    ("sup-db-not-sqlite", [*SUP_A, "--db", "{tmp}/garbage.db"], ["garbage.db"]),
    ("sup-db-foreign", [*SUP_A, "--db", "{tmp}/foreign.db"], ["foreign.db", "not a rankguard"]),
    ("sup-log-level", [*SUP_A, "--log-level", "bogus"], ["--log-level", "bogus"]),
    ("sup-interval-negative", [*SUP_A, "--interval", "-1"], ["--interval"]),
    ("sup-interval-zero", [*SUP_A, "--interval", "0"], ["--interval"]),
    ("sup-agents-and-file", [*SUP_A, "--agents-file", "{tmp}/agents"], ["--agents, --agents-file, not several"]),
    ("sup-agents-dns-no-port", [*SUP, "--agents-dns", "http://rankguard-agent"], ["--agents-dns", "NAME:PORT"]),
    ("sup-agents-not-url", [*SUP, "--agents", "node-1:9407"], ["--agents", "not an http(s) URL"]),
    ("sup-agents-file-missing", [*SUP, "--agents-file", "/nonexistent/agents"], ["--agents-file", "No such file"]),
    ("sup-tls-half", [*SUP_A, "--tls-cert", "/nonexistent.crt"], ["--tls-key"]),
    ("sup-token-missing", [*SUP_A, "--token-file", "/nonexistent/token"], ["token file"]),
    # the agent's
    ("agent-port-in-use", [*AGENT, "--bind", "127.0.0.1:{busy}"], ["rankguard agent:", "in use"]),
    ("agent-bind-not-local", [*AGENT, "--bind", "192.0.2.1:0"], ["rankguard agent:", "192.0.2.1"]),
    ("agent-bind-unresolvable", [*AGENT, "--bind", "no-such-host.invalid:0"], ["no-such-host.invalid"]),
    ("agent-log-level", [*AGENT_B, "--log-level", "bogus"], ["rankguard agent:", "--log-level"]),
    ("agent-interval-negative", [*AGENT_B, "--interval", "-1"], ["rankguard agent:", "interval"]),
    ("agent-config-interval-text", [*AGENT_B, "--config", "{tmp}/fast.toml"], ["agent.interval", "number"]),
    # the query commands and inject, pointed at the wrong thing
    ("ranks-at-an-agent", ["ranks", "--supervisor", "{agent}"], ["not a rankguard supervisor"]),
    ("incidents-at-an-agent", ["incidents", "--supervisor", "{agent}"], ["not a rankguard supervisor"]),
    ("health-at-an-agent", ["health", "--supervisor", "{agent}"], ["not a rankguard supervisor"]),
    ("incidents-not-a-url", ["incidents", "--supervisor", "not-a-url"], ["not-a-url"]),
    ("incidents-db-not-sqlite", ["incidents", "--db", "{tmp}/garbage.db"], ["garbage.db"]),
    ("incidents-db-missing", ["incidents", "--db", "{tmp}/missing.db"], ["no such database"]),
    ("inject-at-the-supervisor", ["inject", "kill", "--rank", "1", "--agent", "{sup}"], ["not a rankguard agent"]),
    ("inject-unreachable", ["inject", "kill", "--rank", "1", "--agent", "http://127.0.0.1:1/"], ["rankguard inject:"]),
    ("inject-agent-not-url", ["inject", "kill", "--rank", "1", "--agent", "node-1:9407"], ["not an http(s) URL"]),
    ("inject-without-rank", ["inject", "kill", "--agent", "{agent}"], ["kill needs --rank N"]),
    ("inject-bad-spec", ["inject", "slow:rank=1:factor=fast", "--agent", "{agent}"], ["factor takes a number"]),
    ("inject-at-in-inject", ["inject", "kill:rank=1:at=5s", "--agent", "{agent}"], ["acts now"]),
    ("inject-trainer-kind-without-file", ["inject", "nan", "--rank", "0", "--agent", "{agent}"], ["--fault-file"]),
    ("inject-corrupt-without-dir", ["inject", "corrupt-checkpoint"], ["--ckpt-dir"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "garbage.db").write_bytes(b"\x00garbage" * 512)
    with sqlite3.connect(tmp / "foreign.db") as db:
        db.execute("CREATE TABLE songs (title TEXT)")
    (tmp / "agents").write_text("http://127.0.0.1:9\n")
    (tmp / "fast.toml").write_text('[agent]\ninterval = "fast"\n')
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    agent = start_agent(tmp, extra=["--discover-workers", "off"])
    sup = start_supervisor(tmp, [agent.url])
    try:
        yield {"tmp": str(tmp), "busy": str(busy.getsockname()[1]), "agent": agent.url,
               "sup": sup.url}  # fmt: skip
    finally:
        sup.stop()
        agent.stop()
        busy.close()


@pytest.mark.parametrize("args,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(world, args, words):
    proc = subprocess.run([*RANKGUARD, *(a.format(**world) for a in args)], capture_output=True,
                          text=True, timeout=60, env={**__import__("os").environ, "COLUMNS": "300"})  # fmt: skip
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err, proc.stdout[-500:])
    assert "Traceback" not in err and "\n" not in err, err
    for word in words:
        assert word.format(**world) in err, err
