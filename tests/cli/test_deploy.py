"""Deployment files: the systemd unit verifies; README and CI agree on the test command."""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_port, http_json, wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)\n```", readme, flags=re.S)
    test_cmd = next(b for b in blocks if "test" in b)
    ci_lines = [
        line for line in (ROOT / ".ci/run").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "set ", "cd "))
    ]  # fmt: skip
    assert ci_lines == [test_cmd]


@pytest.mark.parametrize(
    "unit", sorted(p.name for p in (ROOT / "deploy/systemd").glob("*.service"))
)
def test_systemd_unit_verifies(tmp_path, unit):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    text = (ROOT / "deploy/systemd" / unit).read_text()
    # Point ExecStart at this checkout's console script so verify can check it exists.
    exe = Path(sys.executable).with_name("rankguard")
    local = tmp_path / unit
    local.write_text(text.replace("/opt/rankguard/.venv/bin/rankguard", str(exe)))
    proc = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr  # no warnings either
    sec = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(local)],
        capture_output=True,
        text=True,
    )
    score = float(re.search(r"Overall exposure level for \S+: ([0-9.]+)", sec.stdout).group(1))
    assert score <= 3.0, sec.stdout[-2000:]


# systemd.service(5), Restart=: a clean exit is code 0 or one of these signals.
CLEAN_SIGNALS = {signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE}


def systemd_restarts(policy: str, returncode: int) -> bool:
    """Whether systemd starts a unit again after its main process ended with this
    (Popen-style) return code, for the Restart= policies a unit may use."""
    clean = returncode == 0 or (returncode < 0 and -returncode in CLEAN_SIGNALS)
    return {"always": True, "on-failure": not clean,
            "on-abnormal": returncode < 0 and not clean}.get(policy, False)  # fmt: skip


def service_section(unit: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    section = None
    for line in (ROOT / "deploy/systemd" / unit).read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|min)?", value)
    assert m, f"unexpected time span {value!r}"
    return float(m.group(1)) * {"ms": 0.001, "s": 1.0, "min": 60.0, None: 1.0}[m.group(2)]


def test_systemd_restart_policy_rule():
    assert systemd_restarts("on-failure", -signal.SIGKILL) and systemd_restarts("on-failure", 1)
    assert not systemd_restarts("on-failure", 0)
    assert not systemd_restarts("on-failure", -signal.SIGTERM)  # systemctl stop
    assert not systemd_restarts("no", -signal.SIGKILL)


@pytest.mark.parametrize(
    "unit", sorted(p.name for p in (ROOT / "deploy/systemd").glob("*.service"))
)
def test_systemd_restarts_a_killed_or_failed_daemon_within_seconds(unit):
    """What `rankguard up` does itself, the installed units leave to systemd: a daemon
    killed (OOM killer, SIGKILL) or failing is started again after RestartSec; a daemon
    stuck without dying stops its watchdog pings and is restarted too."""
    service = service_section(unit)
    (policy,) = service["Restart"]
    assert systemd_restarts(policy, -signal.SIGKILL) and systemd_restarts(policy, 1), policy
    (delay,) = service["RestartSec"]
    assert seconds(delay) <= 5
    (watchdog,) = service["WatchdogSec"]
    assert seconds(watchdog) <= 60


def test_supervisor_unit_command_restarted_after_sigkill_keeps_port_and_incidents(tmp_path):
    """The supervisor unit's own ExecStart, run as systemd would run it again after a
    SIGKILL: the same port answers with the incidents recorded before the kill."""
    from rankguard.supervisor.model import Finding
    from rankguard.supervisor.store import IncidentStore

    service = service_section("rankguard-supervisor.service")
    (exec_start,) = service["ExecStart"]
    port = free_port()
    secret = tmp_path / "agent.secret"  # per-agent tokens are derived from it
    secret.write_text("a-secret-for-the-unit-test-0123456789abcdef")
    secret.chmod(0o600)
    (tmp_path / "agents").write_text("http://127.0.0.1:9\n")  # nobody there: unreachable
    db = tmp_path / "supervisor.db"
    store = IncidentStore(db)
    store.upsert_finding(Finding("rank_dead", "rank_dead:j:0", "critical", "rank 1 died", "j",
                                 "n1", 1, 1.0, {}), 2.0)  # fmt: skip
    store.close()
    args = shlex.split(exec_start)
    assert args[0] == "/opt/rankguard/.venv/bin/rankguard"
    swap = {"/etc/rankguard/agents": str(tmp_path / "agents"), "/etc/rankguard/agent.secret":
            str(secret), "/var/lib/rankguard/supervisor.db": str(db),
            "0.0.0.0:9408": f"127.0.0.1:{port}"}  # fmt: skip
    cmd = [sys.executable, "-m", "rankguard.cli.main", *(swap.get(a, a) for a in args[1:])]
    url = f"http://127.0.0.1:{port}"
    for life in range(2):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            kinds = wait_until(
                lambda: [i["kind"] for i in http_json(url + "/v1/incidents")["incidents"]],
                30, f"the supervisor serving (life {life})",
            )  # fmt: skip
            assert "rank_dead" in kinds
        finally:
            proc.kill()
        assert systemd_restarts(service["Restart"][0], proc.wait())
