"""`rankguard deploy kubernetes` (cli/kubernetes.py): every object it renders, with the
default and other values, is valid for the Kubernetes API of a stated version (the
`kubernetes-validate` package's schemas, offline, strict: an unknown field fails); the
PrometheusRule's rules pass promtool as the rule file does; the dashboards are the
checked-in ones; deploy/kubernetes/rankguard.yaml is the default rendering. The control
plane's etcd StatefulSet runs here for real as far as it can: its members' own command
lines, with Debian's etcd, on this host.

The Prometheus operator's two kinds (ServiceMonitor, PrometheusRule) are checked by hand
here, not against the operator's CRD schemas: no package reachable from this machine ships
them in a form Python reads. No helm: the chart is rendered by rankguard itself."""

from __future__ import annotations

import json
import re
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
    EtcdValues,
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
# the control plane without a single point of failure: etcd and a supervisor pair
PAIR = KubeValues(etcd=EtcdValues(enabled=True), supervisor=SupervisorValues(replicas=2))
# ... with every etcd value changed, three supervisors, HTTPS, no node backend
PAIR_OTHER = KubeValues(
    namespace="ml-ops", create_namespace=False, tls_secret="rankguard-tls",
    etcd=EtcdValues(enabled=True, replicas=5, image="quay.io/coreos/etcd:v3.5.21",
                    storage="20Gi", storage_class="local-ssd", cpu_request="500m",
                    memory_limit="2Gi"),
    supervisor=SupervisorValues(replicas=3, storage_class="fast", node_backend=False),
)  # fmt: skip
ALL_VALUES = [KubeValues(), OTHER, PAIR, PAIR_OTHER]
ALL_IDS = ["defaults", "other-values", "pair", "pair-other-values"]


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


@pytest.mark.parametrize("values", ALL_VALUES, ids=ALL_IDS)
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
    by_kind = _by_kind(objects)
    assert (("Deployment", "rankguard-rendezvous") in by_kind) == (
        values.rendezvous.enabled and not values.etcd.enabled)  # fmt: skip
    assert (("StatefulSet", "rankguard-etcd") in by_kind) == values.etcd.enabled
    pair = values.supervisor.replicas > 1
    assert (("StatefulSet", SUPERVISOR_JOB) in by_kind) == pair
    assert (("Deployment", SUPERVISOR_JOB) in by_kind) == (not pair)
    assert (("PersistentVolumeClaim", SUPERVISOR_JOB) in by_kind) == (not pair)


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


# -- the control plane: etcd and the supervisor pair ------------------------------------


def _expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it in a container's args (VAR from its env)."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)


def _container_env_names(container: dict) -> set[str]:
    return {e["name"] for e in container.get("env", [])}


def _pod_name_from_downward_api(container: dict) -> None:
    (pod_name,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


@pytest.mark.parametrize("values", [PAIR, PAIR_OTHER], ids=["pair", "pair-other-values"])
def test_the_etcd_statefulset_names_its_members_by_their_stable_dns_names(values):
    """Each member is pod N of the StatefulSet under its headless Service: its name, its
    advertised URLs and every entry of --initial-cluster are those DNS names and the
    Service's ports; the members start together and keep apart, one may go at a time."""
    objects = _by_kind(_rendered(values))
    ns, n = values.namespace, values.etcd.replicas
    sts, svc = objects["StatefulSet", "rankguard-etcd"], objects["Service", "rankguard-etcd"]
    pdb = objects["PodDisruptionBudget", "rankguard-etcd"]
    spec = sts["spec"]
    assert spec["replicas"] == n and spec["podManagementPolicy"] == "Parallel"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert ports == {"client": 2379, "peer": 2380}
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": spec["selector"]}
    assert svc["spec"]["selector"] == spec["selector"]["matchLabels"]
    pod = spec["template"]["spec"]
    assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        0]["topologyKey"] == "kubernetes.io/hostname"  # fmt: skip
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == values.etcd.storage
    assert claim["spec"].get("storageClassName", "") == values.etcd.storage_class
    (etcd,) = pod["containers"]
    assert etcd["image"] == values.etcd.image
    _pod_name_from_downward_api(etcd)
    assert set(re.findall(r"\$\((\w+)\)", " ".join(etcd["args"]))) <= _container_env_names(etcd)
    flags = dict(a.removeprefix("--").split("=", 1) for a in etcd["args"])
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(n)]
    dns = {p: f"{p}.{spec['serviceName']}.{ns}.svc" for p in pods}
    assert spec["serviceName"] == svc["metadata"]["name"]
    assert flags["initial-cluster"] == ",".join(
        f"{p}=http://{dns[p]}:{ports['peer']}" for p in pods)  # fmt: skip
    for p in pods:  # what each pod's flags say once the kubelet expanded $(POD_NAME)
        env = {"POD_NAME": p}
        assert _expand(flags["name"], env) == p
        assert _expand(flags["advertise-client-urls"], env) == f"http://{dns[p]}:{ports['client']}"
        assert _expand(flags["initial-advertise-peer-urls"], env) == f"http://{dns[p]}:2380"
    mount = {m["name"]: m["mountPath"] for m in etcd["volumeMounts"]}["data"]
    assert flags["data-dir"].startswith(mount + "/")


@pytest.mark.parametrize("values", [PAIR, PAIR_OTHER], ids=["pair", "pair-other-values"])
def test_the_supervisors_of_a_pair_name_every_etcd_member_and_themselves_by_pod(values):
    """Every supervisor pod: --etcd lists each etcd member's DNS name and client port (as
    the supervisor's own settings parse it), --name is its pod's name through the downward
    API; each has a database claim of its own, they keep apart, one may go at a time."""
    from rankguard.service.etcd import parse_endpoints
    from rankguard.supervisor.config import load

    objects = _by_kind(_rendered(values))
    sts = objects["StatefulSet", SUPERVISOR_JOB]
    etcd = objects["StatefulSet", "rankguard-etcd"]
    spec = sts["spec"]
    assert spec["replicas"] == values.supervisor.replicas
    (sup,) = spec["template"]["spec"]["containers"]
    args = sup["args"]
    endpoint = args[args.index("--etcd") + 1]
    members = [f"http://rankguard-etcd-{i}.{etcd['spec']['serviceName']}.{values.namespace}"
               f".svc:2379" for i in range(etcd["spec"]["replicas"])]  # fmt: skip
    assert parse_endpoints(endpoint) == members
    assert args[args.index("--name") + 1] == "$(POD_NAME)"
    _pod_name_from_downward_api(sup)
    settings = load(None, {"supervisor.etcd": ("--etcd", endpoint),
                           "supervisor.name": ("--name", _expand("$(POD_NAME)", {
                               "POD_NAME": f"{SUPERVISOR_JOB}-1"}))})  # fmt: skip
    assert settings.supervisor.name == f"{SUPERVISOR_JOB}-1"
    (claim,) = spec["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in sup["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/var/lib/rankguard"
    assert args[args.index("--db") + 1].startswith("/var/lib/rankguard/")
    assert claim["spec"].get("storageClassName", "") == values.supervisor.storage_class
    assert not any(v.get("persistentVolumeClaim") for v in spec["template"]["spec"]["volumes"])
    pdb = objects["PodDisruptionBudget", SUPERVISOR_JOB]["spec"]
    assert pdb == {"maxUnavailable": 1, "selector": spec["selector"]}
    assert spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    # the Service (the API, /metrics) reaches every one of them
    svc = objects["Service", SUPERVISOR_JOB]["spec"]
    assert svc["selector"] == spec["selector"]["matchLabels"]
    assert spec["serviceName"] == SUPERVISOR_JOB
    # one supervisor: today's Deployment, no etcd flags
    single = _by_kind(_rendered(KubeValues()))["Deployment", SUPERVISOR_JOB]
    (alone,) = single["spec"]["template"]["spec"]["containers"]
    assert "--etcd" not in alone["args"] and "--name" not in alone["args"]


def test_with_etcd_the_jobs_rendezvous_there():
    """No c10d store is rendered, and the example job's torchrun names the etcd members."""
    objects = _by_kind(_rendered(PAIR))
    assert ("Deployment", "rankguard-rendezvous") not in objects
    jobset = example_jobset(PAIR)
    validate_custom(jobset)
    (replicated,) = jobset["spec"]["replicatedJobs"]
    (pod,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
    (endpoint,) = [a.split("=", 1)[1] for a in pod["command"] if a.startswith("--rdzv-endpoint")]
    sup = objects["StatefulSet", SUPERVISOR_JOB]["spec"]["template"]["spec"]["containers"][0]
    assert endpoint == sup["args"][sup["args"].index("--etcd") + 1]
    assert "--rdzv-backend=rankguard" in pod["command"]


def test_bad_control_plane_values_are_named():
    runner, app = CliRunner(), build_app()
    for sets, named in (
        (["supervisor.replicas=2"], "supervisor.replicas = 2 needs etcd.enabled = true"),
        (["supervisor.replicas=4", "etcd.enabled=true"], "supervisor.replicas must be 1, 2 or 3"),
        (["etcd.enabled=true", "etcd.replicas=4"], "etcd.replicas must be 3, 5 or 7"),
        (["etcd.image="], "etcd.image must not be empty"),
    ):
        args = ["deploy", "kubernetes"] + [a for kv in sets for a in ("--set", kv)]
        out = runner.invoke(app, args)
        assert out.exit_code == 2 and named in out.output, (sets, out.output)
    out = runner.invoke(app, ["deploy", "kubernetes", "--set", "etcd.enabled=true", "--set",
                              "supervisor.replicas=2"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert 'kind: "StatefulSet"' in out.output


@pytest.mark.slow
def test_the_etcd_pods_command_lines_form_a_cluster_with_real_etcd(tmp_path):
    """The StatefulSet's container, run three times as the kubelet would ($(POD_NAME)
    expanded), with Debian's etcd on this host: every flag is one etcd knows, the members
    find each other by the names in --initial-cluster, the probes' path answers on the
    metrics port, and rankguard's client writes through one member and reads through
    another. Not run here: a kubelet, cluster DNS, the image (etcd 3.5; Debian's is 3.4):
    each pod's DNS name and port are mapped to a loopback port instead."""
    import os
    import signal
    import urllib.request

    from etcd_cluster import ETCD, SKIP_REASON

    from rankguard.cli.local_stack import free_ports, wait_until
    from rankguard.service.etcd import EtcdClient

    if ETCD is None:
        pytest.skip(SKIP_REASON)
    objects = _by_kind(_rendered(PAIR))
    (etcd,) = objects["StatefulSet", "rankguard-etcd"]["spec"]["template"]["spec"]["containers"]
    pods = [f"rankguard-etcd-{i}" for i in range(3)]
    named = {p: {"client": 2379, "peer": 2380, "metrics": 2381} for p in pods}
    local = dict(zip([(p, k) for p in pods for k in named[p]], free_ports(9), strict=True))

    def on_this_host(arg: str, pod: str) -> str:
        arg = _expand(arg, {"POD_NAME": pod})
        for p in pods:
            for kind, port in named[p].items():
                arg = arg.replace(f"{p}.rankguard-etcd.rankguard.svc:{port}",
                                  f"127.0.0.1:{local[p, kind]}")  # fmt: skip
        for kind, port in named[pod].items():  # its own listeners
            arg = arg.replace(f"0.0.0.0:{port}", f"127.0.0.1:{local[pod, kind]}")
        return arg.replace("/var/lib/etcd/", f"{tmp_path}/{pod}/")

    procs = []
    try:
        for pod in pods:
            args = [on_this_host(a, pod) for a in etcd["args"]]
            assert not any("svc" in a or "0.0.0.0" in a for a in args), args
            with open(tmp_path / f"{pod}.log", "wb") as log:
                procs.append(subprocess.Popen([ETCD, *args], stdout=log,
                                              stderr=subprocess.STDOUT,
                                              start_new_session=True))  # fmt: skip
        probe = etcd["readinessProbe"]["httpGet"]
        assert probe["port"] == "metrics"

        def ready(pod: str) -> bool:
            url = f"http://127.0.0.1:{local[pod, 'metrics']}{probe['path']}"
            with urllib.request.urlopen(url, timeout=2) as resp:
                return json.loads(resp.read())["health"] == "true"

        for pod in pods:
            try:
                wait_until(lambda pod=pod: ready(pod), 60, f"{pod} ready")
            except AssertionError:
                raise AssertionError((tmp_path / f"{pod}.log").read_text()[-3000:]) from None
        first, second = (f"http://127.0.0.1:{local[p, 'client']}" for p in pods[:2])
        EtcdClient([first], timeout=10).put(b"rankguard/k8s", b"via pod 0")
        kv = EtcdClient([second], timeout=10).get(b"rankguard/k8s")
        assert kv is not None and kv.value == b"via pod 0"
        logs = "".join((tmp_path / f"{p}.log").read_text() for p in pods)
        assert "unrecognized" not in logs, logs[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only that etcd
                proc.wait(timeout=10)
