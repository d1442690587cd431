"""Dashboards and rules: the generated Grafana JSON is well formed, the rules pass promtool
and their unit tests, the checked-in files are the generator's output, and every metric
and label a query reads is one the agent and supervisor really export (a live scrape)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import http_json, start_agent, start_supervisor, wait_until
from prometheus_client.parser import text_string_to_metric_families
from prometheus_harness import prometheus_bin

from rankguard.agent.collectors import CollectorContext
from rankguard.agent.collectors.network import NetworkCollector
from rankguard.agent.nvml_double import make_double, write_state
from rankguard.dashboards import build, promql, rule_tests, rules

REPO = Path(__file__).resolve().parents[2]
PANEL_TYPES = {"timeseries", "stat", "heatmap", "table"}
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__range", "__all"}
TARGET_LABELS = {"instance", "job"}  # what Prometheus adds to every scraped series
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def all_dashboards() -> dict[str, dict]:
    return {name: build.dashboard_data(name) for name in build.DASHBOARDS}


def panel_queries(dash: dict) -> list[tuple[str, str]]:
    """(where, expr) of every panel target and annotation of a dashboard."""
    out = [
        (f"{dash['title']} / {p['title']}", t["expr"]) for p in dash["panels"] for t in p["targets"]
    ]
    out += [
        (f"{dash['title']} / annotation {a['name']}", a["expr"])
        for a in dash["annotations"]["list"]
    ]
    return out


def template_queries(dash: dict) -> list[tuple[str, str]]:
    """label_values(METRIC, LABEL) of the query variables, as (metric, label)."""
    out = []
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((\S+), (\w+)\)", v["query"])
            assert m, v["query"]
            out.append((m.group(1), m.group(2)))
    return out


# -- structure of the generated JSON -------------------------------------------------------


@pytest.mark.parametrize("name", list(build.DASHBOARDS))
def test_dashboard_structure(name):
    dash = build.dashboard_data(name)
    panels = dash["panels"]
    assert panels and dash["uid"].startswith("rankguard-") and "rankguard" in dash["tags"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        where = f"{name}: {p['title']}"
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0, where
        assert g["x"] + g["w"] <= 24, f"{where} leaves the 24-column grid"
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{where} overlaps another panel"
        cells |= mine
        assert p["type"] in PANEL_TYPES, where
        assert p["fieldConfig"]["defaults"].get("unit"), f"{where} has no unit"
        assert p["datasource"] == DATASOURCE, where
        assert p["targets"] and all(
            t["expr"] and t["datasource"] == DATASOURCE for t in p["targets"]
        ), where
        assert p["title"] and p.get("description") is not None, where
    for a in dash["annotations"]["list"]:
        assert a["datasource"] == DATASOURCE and a["expr"]


@pytest.mark.parametrize("name", list(build.DASHBOARDS))
def test_every_variable_is_declared(name):
    dash = build.dashboard_data(name)
    declared = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "training_job", "node"} <= declared
    used = set(re.findall(r"\$\{?(\w+)", json.dumps(dash)))
    assert used - declared - BUILTIN_VARIABLES == set()
    # and every declared variable filters something
    exprs = " ".join(e for _, e in panel_queries(dash))
    assert "$training_job" in exprs or name == "gpus"  # GPU series carry no job (hardware)
    assert "$node" in exprs


def test_panel_ids_and_uids_unique_across_dashboards():
    uids = [d["uid"] for d in all_dashboards().values()]
    assert len(uids) == len(set(uids))


# -- rules ---------------------------------------------------------------------------------


def test_every_alert_has_severity_and_a_summary_naming_what_failed():
    alerts = rules.alerting_rules()
    names = [a.name for a in alerts]
    assert len(names) == len(set(names))
    for a in alerts:
        assert a.severity in ("warning", "critical"), a.name
        # what failed by its labels, or for a fleet-wide count how many nodes
        named = r"\$labels\.(node|gpu|rank|training_job|instance)|\{\{ \$value \}\} node"
        assert re.search(named, a.summary), a.name
        assert "{{" not in a.description, f"{a.name}: description is static text"


def test_every_alert_has_a_firing_and_a_silent_promtool_case():
    covered = rule_tests.covered_alerts()
    for a in rules.alerting_rules():
        assert covered.get(a.name, {}).get("firing", 0) >= 1, f"{a.name}: no firing case"
        assert covered.get(a.name, {}).get("silent", 0) >= 1, f"{a.name}: no silent case"
    assert set(covered) <= {a.name for a in rules.alerting_rules()}


def test_every_incident_kind_the_supervisor_opens_has_an_alert():
    from rankguard.supervisor import detectors, model

    exprs = " ".join(a.expr for a in rules.alerting_rules())
    # a crash loop ends in the supervisor's stop verdict, which has its own alert
    stopped = 'rankguard_supervisor_job_state{state="stopped"}'
    for kind in detectors.KINDS:  # the policy's kinds and any a registered detector adds
        assert f'kind="{kind}"' in exprs or (kind == model.CRASH_LOOP and stopped in exprs), kind


def test_operating_targets_are_the_default_thresholds():
    by_name = {a.name: a.expr for a in rules.alerting_rules()}
    assert "< 0.9" in by_name["GpuUnderutilized"]
    assert "> 0.2" in by_name["CommunicationOverheadHigh"]
    assert "> 0.05" in by_name["DataLoadingStall"]
    tighter = {a.name: a.expr for a in rules.alerting_rules(rules.Targets(comm_step_ratio_max=0.1))}
    assert "> 0.1" in tighter["CommunicationOverheadHigh"]


def test_promtool_checks_rules_config_and_runs_the_unit_tests(tmp_path):
    promtool = prometheus_bin("promtool")
    build.write(tmp_path, build.render_all())
    prom = tmp_path / "prometheus"
    for args in (["check", "rules", "rankguard-rules.yml"], ["check", "config", "prometheus.yml"],
                 ["test", "rules", "rankguard-rules.test.yml"]):  # fmt: skip
        proc = subprocess.run([promtool, *args], cwd=prom, capture_output=True, text=True)
        assert proc.returncode == 0, f"promtool {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout + proc.stderr
    assert "SUCCESS" in out


def test_promtool_unit_tests_can_fail(tmp_path):
    """The unit tests catch a broken rule: raise the comm threshold and its case fails."""
    promtool = prometheus_bin("promtool")
    files = build.render_all(rules.Targets(comm_step_ratio_max=0.5))
    # keep the test file written for the default targets
    files["prometheus/rankguard-rules.test.yml"] = build.render_all()[
        "prometheus/rankguard-rules.test.yml"
    ]
    build.write(tmp_path, files)
    proc = subprocess.run([promtool, "test", "rules", "rankguard-rules.test.yml"],
                          cwd=tmp_path / "prometheus", capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0 and "CommunicationOverheadHigh" in proc.stdout + proc.stderr


# -- generated files -----------------------------------------------------------------------


def test_checked_in_files_are_the_generator_output():
    stale = build.differences(REPO / "deploy", build.render_all())
    assert stale == [], f"regenerate with `rankguard dashboards build --out deploy`: {stale}"


def test_cli_build_writes_checks_and_reports_errors(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "rankguard.cli.main", "dashboards", *args],
                              capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})  # fmt: skip

    out = tmp_path / "out"
    proc = cli("build", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    for rel in build.render_all():
        assert (out / rel).is_file() and str(out / rel) in proc.stdout
    json.loads((out / "grafana/rankguard-overview.json").read_text())
    assert cli("build", "--out", str(out), "--check").returncode == 0
    (out / "prometheus/rankguard-rules.yml").write_text("groups: []\n")
    proc = cli("build", "--out", str(out), "--check")
    assert proc.returncode == 1 and "rankguard-rules.yml" in proc.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = cli("build", "--out", str(blocker))
    assert proc.returncode == 2 and "cannot write" in proc.stderr
    assert cli("build", "--help").returncode == 0


# -- the PromQL reader ---------------------------------------------------------------------


def test_promql_reads_selectors_and_grouping_labels():
    r = promql.reads(
        'sum by (node) (rate(a_total{x="1", y=~"$v"}[$__rate_interval]) offset 5m) '
        "* on (instance) group_left (node) b:c:info and max without (z) (d) > 0.5"
    )
    assert [(s.metric, set(s.labels)) for s in r.selectors] == [
        ("a_total", {"x", "y"}), ("b:c:info", set()), ("d", set())]  # fmt: skip
    assert r.grouping == {"node", "instance", "z"} and r.top_by == ("node",)
    with pytest.raises(promql.PromQLSyntaxError):
        promql.reads('{__name__="x"}')


# -- the contract with what the agent and supervisor export ---------------------------------

RANK = """
import os, sys, time
from rankguard.client import TelemetrySender
from rankguard.contract.telemetry import SCHEMA_VERSION
sender, rank = TelemetrySender(sys.argv[1]), int(sys.argv[2])
with open(f"{sys.argv[3]}/big-{rank}", "wb") as f:
    f.write(b"x" * 65536)  # some write I/O of its own
for step in range(1, 10**6):
    sender.send(dict(v=SCHEMA_VERSION, job="contract", rank=rank, local_rank=rank, world_size=2,
        pid=os.getpid(), restart=0, step=step, phase="train", time=time.time(),
        step_seconds=0.05, data_wait_seconds=0.001, compute_seconds=0.04, comm_seconds=0.01,
        comm_exposed_seconds=0.002, optimizer_seconds=0.005, checkpoint_block_seconds=0.0,
        tokens_per_second=1000.0, mfu=0.1, peak_memory_bytes=2**30, loss=2.0, checkpoint_step=10,
        flops=5e7, peak_flops=1e12))
    time.sleep(0.05)
"""


def ib_fixture(root: Path) -> Path:
    """One InfiniBand port in a sysfs-shaped tree (this machine has none)."""
    port = root / "class/infiniband/mlx5_0/ports/1"
    (port / "counters").mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (port / "counters/port_rcv_data").write_text("1000\n")
    (port / "counters/port_xmit_data").write_text("2000\n")
    return root


def scrape(url: str) -> dict[str, set[str]]:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def exported_metrics(tmp_path: Path) -> dict[str, set[str]]:
    """Metric name -> label names, as a real agent (NVML double, two rank processes, one of
    which dies) and a real supervisor export them, plus Prometheus's target labels."""
    double = tmp_path / "nvml.json"
    write_state(double, make_double(n_gpus=2))
    (tmp_path / "ckpt").mkdir()
    agent = start_agent(tmp_path, extra=["--nvml-double", str(double), "--ckpt-dir", str(tmp_path / "ckpt"),
                                         "--data-dir", str(tmp_path), "--expected-gpus", "2"])  # fmt: skip
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(agent.socket), str(r), str(tmp_path)])
             for r in (0, 1)]  # fmt: skip
    sup = None
    try:
        # the ranks' processes hold memory on the (double's) GPUs
        state = make_double(n_gpus=2)
        for gpu, proc in zip(state["gpus"], ranks, strict=True):
            gpu["processes"] = [{"pid": proc.pid, "used_memory": 8 * 2**30}]
        write_state(double, state)
        sup = start_supervisor(tmp_path, [agent.url])
        wait_until(lambda: len(http_json(sup.url + "/v1/ranks")["ranks"]) == 2, 30, "two ranks")
        wait_until(
            lambda: "rankguard_rank_gpu_memory_bytes" in scrape(agent.url), 30, "rank GPU memory"
        )
        ranks[1].kill()
        wait_until(
            lambda: "rankguard_supervisor_incident_open" in scrape(sup.url),
            30,
            "a dead-rank incident",
        )
        exported = scrape(agent.url)
        for name, labels in scrape(sup.url).items():
            exported.setdefault(name, set()).update(labels)
    finally:
        for p in ranks:
            p.kill()
            p.wait()
        if sup is not None:
            sup.stop()
        agent.stop()
    # InfiniBand needs a port: render the agent's network collector over a fixture tree.
    for metric in (
        NetworkCollector(CollectorContext(sys_root=ib_fixture(tmp_path / "sys"))).collect().metrics
    ):
        exported.setdefault(metric.name, set()).update(metric.labels)
    exported["up"] = set()
    return {name: labels | TARGET_LABELS for name, labels in exported.items()}


def contract_problems(exported: dict[str, set[str]]) -> list[str]:
    """Every metric and label each query reads, against `exported` and the recording rules."""
    available = dict(exported)
    for record in rules.recording_rules():  # recorded series: the labels their rule keeps
        r = promql.reads(record.expr)
        if r.top_by is not None:
            labels = set(r.top_by)
        else:
            labels = (
                set().union(*(available.get(s.metric, set()) for s in r.selectors)) | r.grouping
            )
        available[record.name] = labels
    queries = [(f"record {r.name}", r.expr) for r in rules.recording_rules()]
    queries += [(f"alert {a.name}", a.expr) for a in rules.alerting_rules()]
    problems = []
    for dash in all_dashboards().values():
        queries += panel_queries(dash)
        for metric, label in template_queries(dash):
            if label not in available.get(metric, set()):
                problems.append(f"{dash['title']} variable: {metric} has no label {label}")
    for where, expr in queries:
        r = promql.reads(expr)
        for s in r.selectors:
            if s.metric not in available:
                problems.append(f"{where}: {s.metric} is not exported")
            elif missing := set(s.labels) - available[s.metric]:
                problems.append(f"{where}: {s.metric} has no label {sorted(missing)}")
        in_scope = set().union(*(available.get(s.metric, set()) for s in r.selectors))
        if missing := r.grouping - in_scope:
            problems.append(f"{where}: groups by {sorted(missing)}, on none of its metrics")
    return problems


def test_every_query_reads_metrics_and_labels_that_are_exported(tmp_path):
    exported = exported_metrics(tmp_path)
    assert contract_problems(exported) == []
    # and the check can fail: a metric or label the exporters lack is reported
    broken = {k: v for k, v in exported.items() if k != "rankguard_rank_comm_step_ratio"}
    broken["rankguard_supervisor_incident_open"] -= {"kind"}
    problems = contract_problems(broken)
    assert any("rankguard_rank_comm_step_ratio is not exported" in p for p in problems)
    assert any(
        p.startswith("alert RankDead: rankguard_supervisor_incident_open has no label")
        for p in problems
    )
