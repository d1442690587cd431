"""Configuration per component (issue 15): the supervisor's and the agent's TOML files,
one-line errors naming the key and the expected type (exit 2), --print-config, flags over
the file, collectors and detectors turned off by name, and docs/configuration.md covering
every setting with its default."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rankguard.agent.collectors import CollectorContext, settings_for
from rankguard.agent.config import AgentConfig, AgentConfigError, config_toml, load_config
from rankguard.agent.daemon import Agent
from rankguard.service.settings import SettingsError, settings_fields, tomllib
from rankguard.supervisor.config import SupervisorFile, load
from rankguard.supervisor.detectors import DetectorConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"


def rankguard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rankguard.cli.main", *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def one_line_exit_2(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def refused_in_one_line(path: Path, text: str, load_file, error: type, key: str, expected: str):
    """`load_file(path)` of `text` raises `error` in one line naming `key` and `expected`."""
    path.write_text(text)
    with pytest.raises(error) as err:
        load_file(path)
    assert key in str(err.value) and expected in str(err.value) and "\n" not in str(err.value)


# -- supervisor -----------------------------------------------------------------------------

BAD_SUPERVISOR = [
    ('[detectors.hang]\nfloor_seconds = "1s"\n', "detectors.hang.floor_seconds", "a number"),
    ("[detectors.straggler]\nwindow = 2.5\n", "detectors.straggler.window", "an integer"),
    ("[policy]\nmax_restarts = true\n", "policy.max_restarts", "an integer"),
    ('[policy]\nexclude_stragglers = "yes"\n', "policy.exclude_stragglers", "a boolean"),
    ("[scheduler]\ndrain_command = 3\n", "scheduler.drain_command", "a string"),
    ("[supervisor]\ninterval = [1]\n", "supervisor.interval", "a number"),
    ("[detectors]\nhang = 1\n", "detectors.hang", "a table"),
    ("[detectors.hangs]\n", "detectors.hangs", "unknown key"),
    ("[detectors.hang]\nfloor = 1\n", "detectors.hang.floor", "unknown key"),
    ("[policy]\nmax_restarts = 0\n", "policy", "max_restarts must be >= 1"),
    ("[detectors.hang]\nquantile = 2\n", "detectors.hang", "quantile must be in (0, 1]"),
    ("[detectors.hang]\nwarmup_seconds = nan\n", "detectors.hang.warmup_seconds", "finite"),
    ("[scheduler]\nresume_command = 'scontrol {host}'\n", "scheduler", "resume_command"),
    ("[policy\n", "not valid TOML", ""),
]


@pytest.mark.parametrize("text,key,expected", BAD_SUPERVISOR)
def test_a_bad_supervisor_setting_names_the_key_and_type(tmp_path, text, key, expected):
    refused_in_one_line(tmp_path / "supervisor.toml", text, load, SettingsError, key, expected)


def test_the_supervisor_cli_refuses_a_bad_file_in_one_line_exit_2(tmp_path):
    path = tmp_path / "supervisor.toml"
    path.write_text('[detectors.hang]\nfloor_seconds = "1s"\n')
    line = one_line_exit_2(
        rankguard("supervisor", "--config", str(path), "--agents", "http://127.0.0.1:9")
    )
    assert line == (f"rankguard supervisor: config file {path}: detectors.hang.floor_seconds: "
                    "expected a number, got '1s' (a string)")  # fmt: skip
    one_line_exit_2(rankguard("supervisor", "--config", str(tmp_path / "none.toml"),
                              "--print-config"), "none.toml", "no such file")  # fmt: skip


def test_print_config_shows_every_default_and_reads_back_unchanged(tmp_path):
    proc = rankguard("supervisor", "--print-config")
    assert proc.returncode == 0, proc.stderr
    printed = tomllib.loads(proc.stdout)
    for key, _, default in settings_fields(SupervisorFile, ""):
        *tables, name = key.lstrip(".").split(".")
        table = printed
        for t in tables:
            table = table[t]
        assert table[name] == default, key
    path = tmp_path / "all.toml"
    path.write_text(proc.stdout)
    assert load(path) == SupervisorFile()
    again = rankguard("supervisor", "--config", str(path), "--print-config")
    assert again.stdout == proc.stdout


def test_flags_override_the_file_and_a_bad_flag_is_named(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("[supervisor]\ninterval = 2.0\nagent_timeout = 5\n"
                    "[detectors.process_hang]\nidle_seconds = 30\n"
                    "[detectors.straggler]\nenabled = false\n[policy]\nmax_restarts = 4\n"
                    "[scheduler]\nresume_after_healthy_passes = 7\n")  # fmt: skip
    proc = rankguard("supervisor", "--config", str(path), "--interval", "0.5",
                     "--process-idle-seconds", "9", "--print-config")  # fmt: skip
    cfg = tomllib.loads(proc.stdout)
    assert cfg["supervisor"] == {
        "interval": 0.5,
        "agent_timeout": 5.0,
        "startup_trace": "",
        "cpu_share": 0.5,
        "etcd": "",
        "name": "",
        "lease_seconds": 5,
    }
    assert cfg["detectors"]["process_hang"]["idle_seconds"] == 9.0
    assert cfg["detectors"]["straggler"]["enabled"] is False
    assert cfg["policy"]["max_restarts"] == 4
    runtime = load(path).runtime()
    assert (runtime.interval, runtime.policy.max_restarts) == (2.0, 4)
    assert runtime.scheduler.resume_after_healthy_passes == 7
    assert not runtime.detectors.enabled("straggler") and runtime.detectors.enabled("hang")
    one_line_exit_2(rankguard("supervisor", "--config", str(path), "--agent-timeout", "0",
                              "--print-config"), "--agent-timeout", "agent_timeout")  # fmt: skip


def test_the_example_supervisor_file_is_valid_and_not_all_defaults():
    settings = load(ROOT / "deploy" / "supervisor.toml")
    assert settings != SupervisorFile()


def test_detector_config_is_one_dataclass_per_detector_module():
    for f in dataclasses.fields(DetectorConfig):
        section = getattr(DetectorConfig(), f.name)
        assert type(section).__module__ == f"rankguard.supervisor.detectors.{f.name}"
        assert section.enabled is True


# -- agent ----------------------------------------------------------------------------------

BAD_AGENT = [
    ("[collectors.gpu]\ngpm_interval = 'fast'\n", "collectors.gpu.gpm_interval", "a number"),
    ("[collectors.storage]\nenabled = 1\n", "collectors.storage.enabled", "a boolean"),
    ("[collectors.gpux]\n", "collectors.gpux", "no such collector"),
    ("[collectors.host]\nperiod = 1\n", "collectors.host.period", "unknown key"),
    ("[agent]\nexpected_gpus = 8.5\n", "agent.expected_gpus", "an integer"),
    ("[agent]\ntoken_file = 3\n", "agent.token_file", "a path"),
    ("[agent]\ninterval = 0.0\n", "agent", "interval must be between"),
    ("[agent]\n[other]\n", "other", "unknown table"),
]


@pytest.mark.parametrize("text,key,expected", BAD_AGENT)
def test_a_bad_agent_setting_names_the_key_and_type(tmp_path, text, key, expected):
    refused_in_one_line(tmp_path / "agent.toml", text, lambda path: load_config(path, {}),
                        AgentConfigError, key, expected)  # fmt: skip


def test_the_agent_cli_refuses_a_bad_file_in_one_line_exit_2(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text("[collectors.gpu]\ngpm_interval = 'fast'\n")
    one_line_exit_2(rankguard("agent", "--config", str(path)),
                    "collectors.gpu.gpm_interval", "expected a number")  # fmt: skip
    one_line_exit_2(rankguard("agent", "--expected-gpus", "-1", "--print-config"),
                    "--expected-gpus", "expected_gpus must be >= 0")  # fmt: skip


def test_agent_print_config_reads_back_unchanged(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('[agent]\ninterval = 2.0\n[collectors.gpu]\npcie_interval = 30\n'
                    '[collectors.network]\nenabled = false\n')  # fmt: skip
    proc = rankguard("agent", "--config", str(path), "--bind", "127.0.0.1:9999", "--print-config")
    assert proc.returncode == 0, proc.stderr
    printed = tomllib.loads(proc.stdout)
    assert printed["agent"]["bind"] == "127.0.0.1:9999" and printed["agent"]["interval"] == 2.0
    assert printed["collectors"]["gpu"]["pcie_interval"] == 30.0
    assert printed["collectors"]["network"] == {"enabled": False}
    assert printed["collectors"]["storage"]["statvfs_timeout_seconds"] == 2.0
    again = tmp_path / "again.toml"
    again.write_text(proc.stdout)
    assert config_toml(load_config(again, {})) == proc.stdout


def test_a_collector_turned_off_is_not_run_and_gpu_off_leaves_the_verdict_alone(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('[collectors.gpu]\nenabled = false\n[collectors.network]\nenabled = false\n'
                    '[collectors.storage]\nstatvfs_timeout_seconds = 0.5\n')  # fmt: skip
    cfg = load_config(path, {"bind": "127.0.0.1:0", "expected_gpus": 8, "node": "n",
                             "telemetry_socket": str(tmp_path / "t.sock")})  # fmt: skip
    agent = Agent(cfg)
    try:
        assert [c.name for c in agent.collectors] == ["backup", "host", "ranks", "snapshots",
                                                      "storage"]  # fmt: skip
        storage = next(c for c in agent.collectors if c.name == "storage")
        assert storage.statvfs_timeout_s == 0.5
        runs = agent.collect_once()
        assert {r.name for r in runs} == {"backup", "host", "ranks", "snapshots", "storage"}
        # 8 GPUs expected and no NVML here: degraded if the gpu collector ran, but it is off
        assert agent.node_view()["status"] == "healthy", agent.node_view()["reasons"]
    finally:
        agent.close()
    on = Agent(dataclasses.replace(cfg, collectors=settings_for(None)))
    try:
        on.collect_once()
        view = on.node_view()  # the same node with the gpu collector: NVML unavailable,
        assert view["status"] == "degraded", view  # the agent's own fault, not the GPUs'
        assert [r["code"] for r in view["reasons"]] == ["nvml_unavailable"], view
    finally:
        on.close()


def test_every_collector_builds_its_own_settings():
    settings = settings_for(None)
    assert set(settings) == {"backup", "gpu", "host", "network", "ranks", "snapshots", "storage"}
    assert type(settings["gpu"]).__name__ == "GpuConfig"
    assert all(s.enabled for s in settings.values())
    assert AgentConfig().collectors == {}  # empty: every collector with its defaults
    assert CollectorContext().rank_table is None


# -- docs -----------------------------------------------------------------------------------


def doc_tables() -> dict[str, dict[str, str]]:
    """{table: {key: default as written}} from docs/configuration.md."""
    out: dict[str, dict[str, str]] = {}
    table = None
    for line in DOC.read_text().splitlines():
        if m := re.match(r"### `\[([\w.]+)\]`", line):
            table = out.setdefault(m.group(1), {})
        elif table is not None and (m := re.match(r"\| `(\w+)` \| (.+?) \| .+ \|$", line)):
            table[m.group(1)] = m.group(2)
    return out


def documented_default(text: str):
    if text == "unset":
        return None
    assert text.startswith("`") and text.endswith("`"), text
    return tomllib.loads(f"v = {text[1:-1]}")["v"]


def every_setting():
    for key, _, default in settings_fields(SupervisorFile, ""):
        table, name = key.lstrip(".").rsplit(".", 1)
        yield table, name, default
    for f in dataclasses.fields(AgentConfig):
        if f.name != "collectors":
            yield "agent", f.name, getattr(AgentConfig(), f.name)
    for collector, settings in settings_for(None).items():
        for f in dataclasses.fields(settings):
            yield f"collectors.{collector}", f.name, getattr(settings, f.name)


def test_every_setting_is_documented_with_its_default():
    doc = doc_tables()
    seen = set()
    for table, name, default in every_setting():
        assert name in doc.get(table, {}), f"[{table}] {name} missing from {DOC.name}"
        seen.add((table, name))
        if (table, name) == ("agent", "node"):
            assert doc[table][name] == "the host name"
            continue
        value = default if not isinstance(default, Path) else str(default)
        assert documented_default(doc[table][name]) == value, (table, name)
    extra = {(t, k) for t, keys in doc.items() for k in keys} - seen
    assert not extra, f"documented but not settings: {sorted(extra)}"
