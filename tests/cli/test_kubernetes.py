"""`rankguard deploy kubernetes` (cli/kubernetes.py): every object it renders, with the
default and other values, is valid for the Kubernetes API of a stated version (the
`kubernetes-validate` package's schemas, offline, strict: an unknown field fails); the
PrometheusRule's rules pass promtool as the rule file does; the dashboards are the
checked-in ones; deploy/kubernetes/rankguard.yaml is the default rendering.

The Prometheus operator's two kinds (ServiceMonitor, PrometheusRule) are checked by hand
here, not against the operator's CRD schemas: no package reachable from this machine ships
them in a form Python reads. No helm: the chart is rendered by rankguard itself."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from rankguard.cli.kubernetes import (
    AGENT_PORT,
    JOBSET_EXAMPLE_HEADER,
    KubeValues,
    MonitoringValues,
    RendezvousValues,
    SupervisorValues,
    dump,
    example_jobset,
    render,
    value_rows,
    values_table,
)
from rankguard.cli.launch import job_of
from rankguard.cli.main import build as build_app
from rankguard.contract import exit_codes
from rankguard.dashboards.common import AGENT_JOB, SUPERVISOR_JOB
from rankguard.dashboards.rules import rule_file
from rankguard.deploy import deploy_dir

KUBERNETES = "1.30"  # the oldest minor version still maintained upstream when written
# the custom kinds, by their CRD's schema in tests/cli/crds (sources in its README)
CRDS = Path(__file__).resolve().parent / "crds"
CRD_FILES = {"ServiceMonitor": "servicemonitors", "PrometheusRule": "prometheusrules",
             "JobSet": "jobsets"}  # fmt: skip
CLUSTER_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
ROOT = Path(__file__).resolve().parents[2]

OTHER = KubeValues(
    namespace="gpu-ops", create_namespace=False, image_pull_policy="Always",
    tls_secret="rankguard-tls",
    supervisor=SupervisorValues(storage_class="fast", pdb_min_available=0, node_backend=False),
    rendezvous=RendezvousValues(enabled=False),
    monitoring=MonitoringValues(release="kube-prometheus-stack", dashboards=False),
)  # fmt: skip


def _rendered(values: KubeValues) -> list[dict]:
    """What kubectl would read: the YAML text parsed back, not the dicts."""
    return [d for d in yaml.safe_load_all(dump(render(values))) if d is not None]


def _by_kind(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _strict(schema: Any) -> Any:
    """A CRD's schema as `kubectl apply --validate=strict` applies it: an object that lists
    its properties and keeps no unknown fields refuses any other field."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):  # fmt: skip
        out["additionalProperties"] = False
    return out


def validate_custom(obj: dict) -> None:
    """Against the CRD's own schema (tests/cli/crds: the operator's and JobSet's, stated
    there); the CEL rules (x-kubernetes-validations) are the API server's and not run."""
    crd = json.loads((CRDS / f"{CRD_FILES[obj['kind']]}.json").read_text())
    assert obj["apiVersion"] == crd["apiVersion"], obj["apiVersion"]
    jsonschema.Draft7Validator(_strict(crd["openAPIV3Schema"])).validate(obj)


@pytest.mark.parametrize("values", [KubeValues(), OTHER], ids=["defaults", "other-values"])
def test_every_object_is_valid_for_the_kubernetes_api(values):
    objects = _rendered(values)
    for o in objects:
        if o["kind"] in CRD_FILES:
            validate_custom(o)
            continue
        kubernetes_validate.validate(o, KUBERNETES, strict=True)
        if o["kind"] not in CLUSTER_KINDS:
            assert o["metadata"]["namespace"] == values.namespace, o["metadata"]
    kinds = [o["kind"] for o in objects]
    assert kinds.count("Namespace") == int(values.create_namespace)
    assert ("Deployment", "rankguard-rendezvous") in _by_kind(
        objects
    ) or not values.rendezvous.enabled


def test_the_supervisor_may_patch_nodes_and_their_status_only_with_the_node_backend():
    objects = _by_kind(_rendered(KubeValues()))
    role = objects["ClusterRole", f"{SUPERVISOR_JOB}-nodes"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
    ]
    binding = objects["ClusterRoleBinding", f"{SUPERVISOR_JOB}-nodes"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": SUPERVISOR_JOB,
                                    "namespace": "rankguard"}]  # fmt: skip
    pod = objects["Deployment", SUPERVISOR_JOB]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert (
        '[scheduler]\nbackend = "kubernetes"'
        in objects["ConfigMap", SUPERVISOR_JOB]["data"]["supervisor.toml"]
    )
    assert "--config" in pod["containers"][0]["args"]
    off = _by_kind(_rendered(OTHER))
    assert not any(kind.startswith("ClusterRole") for kind, _ in off)
    pod = off["Deployment", SUPERVISOR_JOB]["spec"]["template"]["spec"]
    assert (
        pod["automountServiceAccountToken"] is False
        and "--config" not in pod["containers"][0]["args"]
    )


def test_the_services_are_the_job_names_the_rules_use_and_the_supervisor_finds_the_agents():
    objects = _by_kind(_rendered(KubeValues()))
    agent_svc, sup_svc = objects["Service", AGENT_JOB], objects["Service", SUPERVISOR_JOB]
    assert agent_svc["spec"]["clusterIP"] == "None"  # headless: an address per agent
    (sup,) = objects["Deployment", SUPERVISOR_JOB]["spec"]["template"]["spec"]["containers"]
    dns = sup["args"][sup["args"].index("--agents-dns") + 1]
    assert dns == f"http://{AGENT_JOB}.rankguard.svc:{AGENT_PORT}"
    assert sup_svc["spec"]["ports"][0]["port"] == 9408
    agent = objects["DaemonSet", AGENT_JOB]["spec"]["template"]["spec"]
    assert agent["hostPID"] and agent["tolerations"] == [{"operator": "Exists"}]
    caps = agent["containers"][0]["securityContext"]["capabilities"]
    assert caps == {"drop": ["ALL"], "add": ["KILL", "SYS_PTRACE"]}
    monitor = objects["ServiceMonitor", "rankguard"]["spec"]
    assert monitor["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert {"agent", "supervisor"} == set(monitor["selector"]["matchExpressions"][0]["values"])


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="needs promtool (Debian's prometheus; scripts/test installs it as root)")  # fmt: skip
def test_the_prometheus_rule_holds_the_rule_files_groups_and_promtool_passes_them(tmp_path):
    objects = _by_kind(_rendered(OTHER))
    rule = objects["PrometheusRule", "rankguard"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == rule_file() and set(rule["spec"]) == {"groups"}
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(rule["spec"]))
    checked = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True,
                             text=True)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_dashboards_are_the_checked_in_ones_and_the_default_rendering_is_shipped():
    objects = _rendered(KubeValues())
    maps = [o for o in objects if "grafana_dashboard" in o["metadata"].get("labels", {})]
    assert len(maps) == 4
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = m["data"].items()
        assert text == (deploy_dir() / "grafana" / name).read_text(), name
    shipped = (deploy_dir() / "kubernetes" / "rankguard.yaml").read_text()
    assert shipped == dump(render(KubeValues())), (
        "run: rankguard deploy kubernetes > deploy/kubernetes/rankguard.yaml"
    )


def test_values_from_a_file_and_set_and_a_bad_one_named_by_its_key(tmp_path):
    runner = CliRunner()
    app = build_app()
    values = tmp_path / "values.toml"
    values.write_text('namespace = "gpu-ops"\n[agent]\ninterval = 2.0\n')
    out = runner.invoke(app, ["deploy", "kubernetes", "--values", str(values), "--set",
                              "monitoring.dashboards=false", "--set", "agent.image=r:1"])  # fmt: skip
    assert out.exit_code == 0, out.output
    objects = _by_kind([d for d in yaml.safe_load_all(out.output) if d])
    (agent,) = objects["DaemonSet", AGENT_JOB]["spec"]["template"]["spec"]["containers"]
    assert agent["image"] == "r:1" and "2.0" in agent["args"]
    assert objects["DaemonSet", AGENT_JOB]["metadata"]["namespace"] == "gpu-ops"
    assert not any(kind == "ConfigMap" and "dashboard" in name for kind, name in objects)
    for bad, named in (("agent.interval=-1", "agent.interval must be > 0"),
                       ("agent.speed=3", "agent.speed: unknown key"),
                       ("image_pull_policy=Sometimes", "image_pull_policy must be"),
                       ("nokey", "expected KEY=VALUE")):  # fmt: skip
        out = runner.invoke(app, ["deploy", "kubernetes", "--set", bad])
        assert out.exit_code == 2 and named in out.output, (bad, out.output)


def test_every_value_has_help_and_the_deploy_docs_show_the_table_as_it_is():
    rows = value_rows()
    assert len(rows) == len({key for key, _, _ in rows}) > 15
    assert all(help_text for _, _, help_text in rows)
    docs = ROOT / "docs" / "deploy.md"
    assert values_table() in docs.read_text(), "paste cli.kubernetes.values_table() there"


def test_a_bad_field_in_a_custom_object_is_caught():
    """The CRD check can fail: a misspelt field and a wrong type are refused."""
    monitor = _by_kind(_rendered(KubeValues()))["ServiceMonitor", "rankguard"]
    for broken in ({**monitor, "spec": {**monitor["spec"], "endpoint": []}},
                   {**monitor, "spec": {**monitor["spec"], "endpoints": "http"}}):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            validate_custom(broken)


def _pod_failure_outcome(job: dict, jobset: dict, code: int) -> str:
    """What Kubernetes does with a worker pod that exits ``code``: the Job's first
    matching podFailurePolicy rule, then the JobSet's rule for a Job that policy failed."""
    for rule in job["podFailurePolicy"]["rules"]:
        match = rule.get("onExitCodes")
        if match and match["operator"] == "In" and code in match["values"]:
            if rule["action"] != "FailJob":
                return rule["action"]  # Ignore: a replacement pod, not counted
            (fail,) = [r for r in jobset["spec"]["failurePolicy"]["rules"]
                       if "PodFailurePolicy" in r.get("onJobFailureReasons", [])]  # fmt: skip
            return fail["action"]
    return "Count"  # against backoffLimit, then the JobSet's maxRestarts


def test_the_example_jobset_restarts_by_the_launchers_exit_codes():
    """The example is valid (JobSet's CRD schema; its Job against the Kubernetes API), is
    the shipped file, and its policies do what the exit codes promise."""
    jobset = example_jobset(KubeValues())
    validate_custom(jobset)
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job",
                                  "metadata": {"name": "workers"}, "spec": job},
                                 KUBERNETES, strict=True)  # fmt: skip
    outcome = {e.name: _pod_failure_outcome(job, jobset, e.code) for e in exit_codes.EXIT_CODES
               if e.code != 0}  # fmt: skip
    assert outcome == {
        "failed": "Count",  # no cause known: retried, within the budgets
        "bad_argument": "FailJobSet", "user_error": "FailJobSet",  # a retry repeats it
        "interrupted": "Count",
        "terminated": "Ignore", "infrastructure": "Ignore",  # that pod again, elsewhere
    }, outcome  # fmt: skip
    (pod,) = job["template"]["spec"]["containers"]
    assert pod["command"][:3] == ["rankguard", "launch", "--"], pod["command"]
    assert job_of(pod["command"][3:]) == "$(JOBSET_NAME)"  # the pod's env expands it
    shipped = (deploy_dir() / "kubernetes" / "jobset-example.yaml").read_text()
    assert shipped == dump([jobset], JOBSET_EXAMPLE_HEADER), (
        "run: rankguard deploy kubernetes --example-jobset > deploy/kubernetes/jobset-example.yaml"
    )


def test_the_supervisor_serves_https_from_the_secret_and_is_scraped_so():
    objects = _by_kind(_rendered(OTHER))
    (sup,) = objects["Deployment", SUPERVISOR_JOB]["spec"]["template"]["spec"]["containers"]
    args = sup["args"]
    assert args[args.index("--tls-cert") + 1].endswith("/tls.crt") and "--tls-key" in args
    assert sup["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert objects["Service", SUPERVISOR_JOB]["spec"]["ports"][0]["name"] == "https"
    (_, https) = objects["ServiceMonitor", "rankguard"]["spec"]["endpoints"]
    assert https["scheme"] == "https" and https["tlsConfig"]["ca"]["secret"] == {
        "name": "rankguard-tls",
        "key": "ca.crt",
    }
    assert https["tlsConfig"]["serverName"] == f"{SUPERVISOR_JOB}.gpu-ops.svc"
    plain = _by_kind(_rendered(KubeValues()))
    assert (
        "--tls-cert"
        not in plain["Deployment", SUPERVISOR_JOB]["spec"]["template"]["spec"]["containers"][0][
            "args"
        ]
    )
