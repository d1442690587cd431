"""Deployment files: the systemd units (and the supervisor's pair drop-in) verify; the
units' own command lines start what they promise (the supervisor; an etcd member from the
example env file, with Debian's real etcd; a supervisor pair on a real etcd cluster);
README and CI agree on the test command. Not run here: systemd itself (no unit is started
by systemctl; its `Restart=` rule is modelled below)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_port, http_json, wait_until

from rankguard.cli.local_stack import free_ports

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


UNITS = sorted(p.name for p in (ROOT / "deploy/systemd").glob("*.service"))
ETCD_UNIT = "rankguard-etcd.service"
PAIR_DROP_IN = ROOT / "deploy/systemd/rankguard-supervisor.service.d/pair.conf"


def _local_units(tmp_path: Path, unit: str) -> Path:
    """The unit and its drop-ins copied to tmp_path with ExecStart pointing at this
    checkout's console script, so verify can check that it exists."""
    exe = Path(sys.executable).with_name("rankguard")
    local = tmp_path / unit
    local.write_text((ROOT / "deploy/systemd" / unit).read_text()
                     .replace("/opt/rankguard/.venv/bin/rankguard", str(exe)))  # fmt: skip
    drop_ins = ROOT / "deploy/systemd" / f"{unit}.d"
    if drop_ins.is_dir():
        (tmp_path / drop_ins.name).mkdir()
        for conf in drop_ins.glob("*.conf"):
            text = conf.read_text().replace("/opt/rankguard/.venv/bin/rankguard", str(exe))
            (tmp_path / drop_ins.name / conf.name).write_text(text)
    return local


def _verify(local: Path) -> subprocess.CompletedProcess:
    # the unit's folder on the search path (trailing ":": and the system's), so that its
    # drop-ins (UNIT.d/*.conf) are read too
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{local.parent}:"}
    return subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True,
                          text=True, env=env)  # fmt: skip


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_unit_verifies(tmp_path, unit):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    if unit == ETCD_UNIT and not Path("/usr/bin/etcd").exists():
        pytest.skip("needs /usr/bin/etcd (Debian's etcd-server) for verify to find ExecStart")
    local = _local_units(tmp_path, unit)
    proc = _verify(local)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr  # no warnings either
    sec = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(local)],
        capture_output=True,
        text=True,
    )
    score = float(re.search(r"Overall exposure level for \S+: ([0-9.]+)", sec.stdout).group(1))
    assert score <= 3.0, sec.stdout[-2000:]


def test_verify_reads_the_supervisors_pair_drop_in(tmp_path):
    """The check above covers the drop-in: a bad line in it is reported."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    local = _local_units(tmp_path, "rankguard-supervisor.service")
    conf = tmp_path / "rankguard-supervisor.service.d" / PAIR_DROP_IN.name
    conf.write_text(conf.read_text() + "NoSuchSetting=1\n")
    assert "NoSuchSetting" in _verify(local).stderr


# systemd.service(5), Restart=: a clean exit is code 0 or one of these signals.
CLEAN_SIGNALS = {signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE}


def systemd_restarts(policy: str, returncode: int) -> bool:
    """Whether systemd starts a unit again after its main process ended with this
    (Popen-style) return code, for the Restart= policies a unit may use."""
    clean = returncode == 0 or (returncode < 0 and -returncode in CLEAN_SIGNALS)
    return {"always": True, "on-failure": not clean,
            "on-abnormal": returncode < 0 and not clean}.get(policy, False)  # fmt: skip


def service_section(unit: str | Path) -> dict[str, list[str]]:
    """The [Service] settings of a unit or drop-in (a name in deploy/systemd, or a path)."""
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


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_restarts_a_killed_or_failed_daemon_within_seconds(unit):
    """What `rankguard up` does itself, the installed units leave to systemd: a daemon
    killed (OOM killer, SIGKILL) or failing is started again after RestartSec; a daemon
    stuck without dying stops its watchdog pings and is restarted too (rankguard's own
    daemons: etcd sends no watchdog pings, so its unit must not ask for them)."""
    service = service_section(unit)
    (policy,) = service["Restart"]
    assert systemd_restarts(policy, -signal.SIGKILL) and systemd_restarts(policy, 1), policy
    (delay,) = service["RestartSec"]
    assert seconds(delay) <= 5
    if unit == ETCD_UNIT:
        assert "WatchdogSec" not in service and service["Type"] == ["notify"]
        return
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


# -- the control plane: an etcd member from the example env file, a supervisor pair -----


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them: comments and blank lines
    skipped, one pair of surrounding quotes taken off."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), line
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key] = value
    return out


def _member_env(example: dict[str, str], i: int, ports: dict[str, int], data: Path) -> dict:
    """Member `i` (1..3) as docs/deploy.md says to derive it from the example (the first
    member's file): its name and its own four addresses changed, the initial cluster kept;
    then every example address 10.0.0.N:PORT mapped to a free port on this host."""
    env = dict(example)
    env["ETCD_NAME"] = f"m{i}"
    env["ETCD_DATA_DIR"] = str(data / f"m{i}")
    own = ("ETCD_LISTEN_CLIENT_URLS", "ETCD_ADVERTISE_CLIENT_URLS", "ETCD_LISTEN_PEER_URLS",
           "ETCD_INITIAL_ADVERTISE_PEER_URLS")  # fmt: skip
    for key in own:
        env[key] = env[key].replace("10.0.0.1:", f"10.0.0.{i}:")
    for key, value in env.items():
        env[key] = re.sub(r"10\.0\.0\.(\d):(\d+)",
                          lambda m: f"127.0.0.1:{ports[m.group(1) + ':' + m.group(2)]}", value)  # fmt: skip
    return env


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only that etcd is in it
            proc.wait(timeout=10)


def _etcd_call(url: str, path: str, body: dict) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def test_the_etcd_unit_with_the_example_env_file_starts_members_that_answer(tmp_path):
    """The etcd unit's ExecStart, three times with the example env file made into three
    members (as docs/deploy.md says), run as systemd would (only the file's variables,
    $NOTIFY_SOCKET for Type=notify): each reports READY=1, the three form one cluster
    named as the files say, and a value written through one member is read through
    another by rankguard's own etcd client. etcd must understand every variable of the
    file (it names the ones it does not know). Not run: systemd's sandbox (no root here)."""
    import socket

    from etcd_cluster import ETCD, SKIP_REASON

    from rankguard.service.etcd import EtcdClient

    if ETCD is None:
        pytest.skip(SKIP_REASON)
    service = service_section(ETCD_UNIT)
    assert service["EnvironmentFile"] == ["/etc/rankguard/etcd.env"]
    assert service["Type"] == ["notify"]
    (exec_start,) = service["ExecStart"]
    args = shlex.split(exec_start)
    assert args[0] == "/usr/bin/etcd"
    example = env_file(ROOT / "deploy/systemd/rankguard-etcd.env")
    # the data folder is inside the unit's StateDirectory= (the only place it may write)
    (state,) = service["StateDirectory"]
    assert example["ETCD_DATA_DIR"].startswith(f"/var/lib/{state}/")
    assert set(re.findall(r"10\.0\.0\.(\d):(\d+)", example["ETCD_INITIAL_CLUSTER"])) == {
        ("1", "2380"), ("2", "2380"), ("3", "2380")}  # fmt: skip
    # each example address N:PORT (member N, 2379 clients, 2380 peers) on a port of this host
    ports = dict(zip((f"{i}:{p}" for i in (1, 2, 3) for p in (2379, 2380)), free_ports(6),
                     strict=True))  # fmt: skip
    procs, notify = [], []
    try:
        for i in (1, 2, 3):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind(str(tmp_path / f"notify-m{i}.sock"))
            sock.settimeout(60)
            notify.append(sock)
            env = {"PATH": "/usr/bin:/bin", "NOTIFY_SOCKET": str(tmp_path / f"notify-m{i}.sock"),
                   **_member_env(example, i, ports, tmp_path)}  # fmt: skip
            with open(tmp_path / f"m{i}.log", "wb") as log:
                procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))  # fmt: skip
        for i, sock in enumerate(notify, 1):
            try:
                message = sock.recv(4096).decode()
            except TimeoutError:
                raise AssertionError((tmp_path / f"m{i}.log").read_text()[-3000:]) from None
            assert message.startswith("READY=1"), message
        urls = [f"http://127.0.0.1:{ports[f'{i}:2379']}" for i in (1, 2, 3)]
        members = _etcd_call(urls[2], "/v3/cluster/member/list", {})["members"]
        assert sorted(m["name"] for m in members) == ["m1", "m2", "m3"]
        assert sorted(m["peerURLs"][0] for m in members) == sorted(
            f"http://127.0.0.1:{ports[f'{i}:2380']}" for i in (1, 2, 3))  # fmt: skip
        EtcdClient([urls[0]], timeout=10).put(b"rankguard/test", b"through m1")
        kv = EtcdClient([urls[1]], timeout=10).get(b"rankguard/test")
        assert kv is not None and kv.value == b"through m1"
        logs = "".join((tmp_path / f"m{i}.log").read_text() for i in (1, 2, 3))
        assert "unrecognized environment variable" not in logs, logs[-3000:]
    finally:
        _stop(procs)
        for sock in notify:
            sock.close()


def test_the_pair_drop_in_runs_the_units_command_with_the_pairs_settings():
    """The drop-in replaces ExecStart by the unit's own command plus the pair's file and
    this host's name: a change to the unit's flags must be made in both."""
    (unit_exec,) = service_section("rankguard-supervisor.service")["ExecStart"]
    reset, pair_exec = service_section(PAIR_DROP_IN)["ExecStart"]
    assert reset == ""  # clears the unit's ExecStart instead of adding a second one
    assert pair_exec == f"{unit_exec} --config /etc/rankguard/supervisor.toml --name %H"


def test_two_supervisors_from_the_pair_drop_in_one_leads_the_other_takes_over(tmp_path):
    """The drop-in's ExecStart on two "hosts" (%H: sup-a, sup-b) with the example pair
    file pointed at a real three-member etcd: one leads, the other stands by naming it;
    the leader SIGKILLed, the other leads within its lease, and the first, started again
    by systemd (Restart=), stands by. Not run: two hosts (both here, on loopback ports)."""
    from etcd_cluster import ETCD, SKIP_REASON, EtcdCluster

    from rankguard.service.settings import read_toml

    if ETCD is None:
        pytest.skip(SKIP_REASON)
    pair = read_toml(ROOT / "deploy/supervisor-pair.toml")["supervisor"]
    assert pair["etcd"] == "etcd://m1:2379,m2:2379,m3:2379"
    cluster = EtcdCluster(tmp_path)
    config = tmp_path / "supervisor.toml"
    config.write_text((ROOT / "deploy/supervisor-pair.toml").read_text()
                      .replace(pair["etcd"], cluster.endpoint))  # fmt: skip
    secret = tmp_path / "agent.secret"
    secret.write_text("a-secret-for-the-unit-test-0123456789abcdef")
    secret.chmod(0o600)
    (tmp_path / "agents").write_text("http://127.0.0.1:9\n")
    _, pair_exec = service_section(PAIR_DROP_IN)["ExecStart"]
    restart = service_section("rankguard-supervisor.service")["Restart"][0]
    ports = {"sup-a": free_port(), "sup-b": free_port()}

    def command(host: str) -> list[str]:
        swap = {"/etc/rankguard/agents": str(tmp_path / "agents"),
                "/etc/rankguard/agent.secret": str(secret),
                "/var/lib/rankguard/supervisor.db": str(tmp_path / f"{host}.db"),
                "0.0.0.0:9408": f"127.0.0.1:{ports[host]}",
                "/etc/rankguard/supervisor.toml": str(config), "%H": host}  # fmt: skip
        args = shlex.split(pair_exec)
        return [sys.executable, "-m", "rankguard.cli.main", *(swap.get(a, a) for a in args[1:])]

    def leadership(host: str) -> dict:
        return http_json(f"http://127.0.0.1:{ports[host]}/v1/cluster", timeout=2)["leadership"]

    procs = {}
    try:
        for host in ports:
            procs[host] = subprocess.Popen(command(host), stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL)  # fmt: skip
        views = wait_until(lambda: [leadership(h) for h in ports]
                           if all(leadership(h)["leader"] for h in ports) else None,
                           60, "both supervisors naming a leader")  # fmt: skip
        assert sorted(v["name"] for v in views) == ["sup-a", "sup-b"]
        (leader,) = [v["name"] for v in views if v["leading"]]
        assert all(v["leader"] == leader for v in views), views
        other = "sup-b" if leader == "sup-a" else "sup-a"
        procs[leader].kill()
        assert systemd_restarts(restart, procs[leader].wait())
        wait_until(lambda: leadership(other)["leading"], 5 + 10, f"{other} taking over")
        procs[leader] = subprocess.Popen(command(leader), stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)  # fmt: skip
        back = wait_until(lambda: (v := leadership(leader))["leader"] and v, 60,
                          f"{leader} serving again")  # fmt: skip
        assert back["leader"] == other and not back["leading"], back
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        cluster.close()
