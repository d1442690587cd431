"""`rankguard supervisor` and the query commands `health`, `ranks`, `incidents`."""

from __future__ import annotations

import json
import math
import os
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated

import typer

from rankguard.supervisor.restart_phases import PHASES as RESTART_PHASES

from .daemon_options import LogLevel, PrintConfig, TlsCert, TlsKey
from .live_view import milestones

Opt = typer.Option
DEFAULT_SUPERVISOR = "http://127.0.0.1:9408"
SupervisorUrl = Annotated[
    str, Opt("--supervisor", envvar="RANKGUARD_SUPERVISOR", help="the supervisor's URL")
]
JsonOpt = Annotated[bool, Opt("--json", help="machine-readable output")]

EXIT = {"healthy": 0, "degraded": 1, "unhealthy": 2}


# the flags over the config file's [detectors.process_hang] settings, named in their help
DETECTION = "Ranks without telemetry: flags over the config's [detectors.process_hang]"
PROCESS_IDLE_HELP = "hung when all ranks but one made no CPU progress this long"


def _loop_help(name: str, text: str) -> str:
    from rankguard.service.settings import flag_help
    from rankguard.supervisor.config import LoopSettings

    return flag_help(text, LoopSettings, name, "supervisor")


def _hang_help(name: str, text: str) -> str:
    from rankguard.service.settings import flag_help
    from rankguard.supervisor.detectors.process_hang import ProcessHangConfig

    return flag_help(text, ProcessHangConfig, name, "detectors.process_hang")


def supervisor(
    agents: Annotated[list[str], Opt("--agents", help="agent URL (repeat for each node)")] = None,
    agents_file: Annotated[
        Path, Opt(help="file with one agent URL per line, re-read when it changes")
    ] = None,
    agents_dns: Annotated[
        str,
        Opt(
            help="http(s)://NAME:PORT: an agent at every address NAME resolves to, resolved "
            "again every 10 s (Kubernetes: the agents' headless Service)"
        ),  # fmt: skip
    ] = None,
    db: Annotated[Path, Opt(help="SQLite file for incidents (kept across restarts)")] = Path(
        "rankguard.db"
    ),
    token_file: Annotated[
        Path, Opt(help="one bearer token for every agent's control endpoints")
    ] = None,
    agent_secret_file: Annotated[
        Path,
        Opt(
            help="per-agent tokens: each agent's token is derived from this secret and the "
            "host of its URL (`rankguard deploy agent-token`; docs/security.md)"
        ),
    ] = None,
    bind: Annotated[str, Opt(help="HOST:PORT for /metrics and /v1")] = "127.0.0.1:9408",
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    ca_file: Annotated[
        Path, Opt(help="CA bundle (PEM) that https agents' certificates are checked against")
    ] = None,
    interval: Annotated[
        float, Opt(help=_loop_help("interval", "seconds between reconcile passes"))
    ] = None,
    agent_timeout: Annotated[
        float, Opt(help=_loop_help("agent_timeout", "seconds to wait for an agent's answer"))
    ] = None,
    etcd: Annotated[
        str,
        Opt(
            help=_loop_help(
                "etcd",
                "etcd://M1,M2,M3 shared by two or more supervisors: the "
                "one holding the leader lease acts, the others stand by",
            ),
            metavar="ENDPOINTS",
        ),
    ] = None,  # fmt: skip
    name: Annotated[
        str, Opt(help=_loop_help("name", "this supervisor's name among them (default host:pid)"))
    ] = None,
    process_stopped_seconds: Annotated[
        float,
        Opt(
            help=_hang_help("stopped_seconds", "a rank stopped this long is hung"),
            min=0,
            metavar="SECONDS",
            rich_help_panel=DETECTION,
        ),
    ] = None,
    process_idle_seconds: Annotated[
        float,
        Opt(
            help=_hang_help("idle_seconds", PROCESS_IDLE_HELP),
            min=0,
            metavar="SECONDS",
            rich_help_panel=DETECTION,
        ),
    ] = None,
    config: Annotated[
        Path,
        Opt(
            help="TOML file: [supervisor], [detectors.<name>], [policy], [scheduler] "
            "(docs/configuration.md); flags override it"
        ),
    ] = None,
    print_config: PrintConfig = False,
    log_level: LogLevel = "info",
) -> None:
    """Watch every agent, detect dead, hung and straggling ranks, bad numerics and node
    faults, and restart the job through torchrun from the newest validated checkpoint.
    Incidents are recorded in --db and survive a supervisor restart.

    Exit codes: 0 stopped by SIGTERM/SIGINT; 2 bad configuration.
    """
    from rankguard.agent.config import AgentConfigError, load_tls, read_token
    from rankguard.service.httpd import ServeError
    from rankguard.service.logs import LogConfigError, setup_logging
    from rankguard.service.settings import SettingsError
    from rankguard.supervisor.agents import (
        AgentsDns,
        AgentsFile,
        parse_agents,
        trust_agents_signed_by,
    )
    from rankguard.supervisor.config import load as load_settings
    from rankguard.supervisor.daemon import run_supervisor
    from rankguard.supervisor.reconcile import Supervisor
    from rankguard.supervisor.store import IncidentStore, StoreError
    from rankguard.supervisor.tokens import AgentTokens

    def refuse(message: str) -> typer.Exit:
        typer.echo(f"rankguard supervisor: {message}", err=True)
        return typer.Exit(2)

    try:
        setup_logging(log_level)
    except LogConfigError as e:
        raise refuse(str(e)) from None

    try:  # the settings first: --print-config needs no agents
        settings = load_settings(config, {
            "supervisor.interval": ("--interval", interval),
            "supervisor.agent_timeout": ("--agent-timeout", agent_timeout),
            "supervisor.etcd": ("--etcd", etcd),
            "supervisor.name": ("--name", name),
            "detectors.process_hang.stopped_seconds": (
                "--process-stopped-seconds", process_stopped_seconds),
            "detectors.process_hang.idle_seconds": ("--process-idle-seconds", process_idle_seconds),
        })  # fmt: skip
    except SettingsError as exc:
        raise refuse(str(exc)) from None
    if print_config:
        typer.echo(settings.to_toml(), nl=False)
        return
    given = [o for o, v in (("--agents", agents), ("--agents-file", agents_file),
                            ("--agents-dns", agents_dns)) if v]  # fmt: skip
    if not given:
        raise refuse("give --agents URL..., --agents-file FILE or --agents-dns URL")
    if len(given) > 1:
        raise refuse(f"give one of {', '.join(given)}, not several")
    if agents:
        _, bad = parse_agents("\n".join(agents))
        if bad:
            raise refuse(f"--agents {bad[1]!r} is not an http(s) URL")
    elif agents_dns:
        try:
            dns = AgentsDns(agents_dns)
        except ValueError as exc:
            raise refuse(str(exc)) from None
    else:
        try:
            _, bad = parse_agents(agents_file.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise refuse(f"--agents-file {agents_file}: {why}") from None
        if bad:
            raise refuse(f"--agents-file {agents_file} line {bad[0]}: not an http(s) URL: "
                         f"{bad[1]!r}")  # fmt: skip
    host, _, port = bind.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise refuse(f"--bind must be HOST:PORT, got {bind!r}")
    try:
        tokens = AgentTokens(
            shared=read_token(token_file) if token_file else None,
            secret=read_token(agent_secret_file) if agent_secret_file else None,
        )
        if (tls_cert is None) != (tls_key is None):
            raise AgentConfigError("--tls-cert and --tls-key go together")
        tls = load_tls(tls_cert, tls_key)
        if ca_file is not None:
            trust_agents_signed_by(str(ca_file))
        store = IncidentStore(db)
    except ssl.SSLError as exc:
        raise refuse(f"--ca-file {ca_file}: {exc}") from None
    except FileNotFoundError as exc:
        raise refuse(f"{exc.filename}: no such file") from None
    except (AgentConfigError, StoreError, OSError, ValueError) as exc:
        raise refuse(str(exc)) from None
    if agents_dns:
        source = dns.urls
    else:
        source = AgentsFile(agents_file).urls if agents_file else (lambda: list(agents))
    try:
        sup = Supervisor(store, source, tokens, settings.runtime())
    except ValueError as exc:  # SchedulerError: the drained-node table
        store.close()
        raise refuse(str(exc)) from None
    try:
        run_supervisor(sup, host.strip("[]") or "127.0.0.1", int(port), tls=tls)
    except ServeError as exc:  # port in use, an address that does not resolve
        store.close()
        raise refuse(str(exc)) from None


def fetch(url: str, path: str) -> dict:
    """The supervisor's JSON answer at `path`, or one line on stderr and exit 2: unreachable,
    not JSON, or not a rankguard supervisor. HTTPS is checked against $RANKGUARD_CA_FILE
    when set (the cluster's CA, docs/security.md), else the system's CAs."""
    from rankguard.supervisor.daemon import API_VERSION

    def fail(why: str) -> typer.Exit:
        typer.echo(f"rankguard: supervisor at {url}: {why}", err=True)
        return typer.Exit(2)

    ca_file = os.environ.get("RANKGUARD_CA_FILE")
    try:
        context = ssl.create_default_context(cafile=ca_file) if ca_file else None
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=5, context=context) as resp:
            data = json.loads(resp.read(64 * 1024 * 1024))
    except ValueError as exc:  # a URL without a scheme, or an answer that is not JSON
        raise fail(f"unusable: {exc}") from None
    except urllib.error.HTTPError as exc:  # it answers, but not as a supervisor (an agent: 404)
        raise fail(f"not a rankguard supervisor (HTTP {exc.code} at {path})") from None
    except (OSError, ssl.SSLError) as exc:
        raise fail(f"unreachable: {getattr(exc, 'reason', exc)}") from None
    except RecursionError:
        raise fail("unusable: answer nested too deeply") from None
    if not isinstance(data, dict) or data.get("api") != API_VERSION:
        raise fail(f"not a rankguard supervisor (no {API_VERSION!r} answer at {path})")
    return data


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def table(rows: list[list], headers: list[str]) -> str:
    cells = [headers] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def job_line(job: str, j: dict) -> str:
    """One job of /v1/cluster for `health`. A job none of whose ranks reported a step (a
    zero-code script, or one not yet at its first) has no step and no goodput to show: both
    read unknown, not 0."""
    stepped = bool(j.get("max_step"))
    step = j["max_step"] if stepped else "-"
    goodput = f"{j['goodput']:.1%}" if stepped else "unknown (no steps reported)"
    return (f"job {job}: {j['state']}, step {step}, {j['ranks']} ranks, restart {j['restart']}, "
            f"goodput {goodput}" + (f" ({j['verdict']})" if j.get("verdict") else ""))  # fmt: skip


def health(url: SupervisorUrl = DEFAULT_SUPERVISOR, as_json: JsonOpt = False) -> None:
    """The cluster verdict and its reasons.

    Exit codes: 0 healthy, 1 degraded, 2 unhealthy or the supervisor unreachable.
    """
    view = fetch(url, "/v1/cluster")
    if as_json:
        typer.echo(json.dumps(view, indent=2))
    else:
        typer.echo(f"cluster: {view['status']}")
        if lead := view.get("leadership"):  # one of several supervisors
            role = "leading" if lead["leading"] else f"standing by (leader: {lead['leader']})"
            typer.echo(f"supervisor {lead['name']}: {role}")
        for r in view["reasons"]:
            typer.echo(f"  [{r['severity']}] {r['message']}")
        for job, j in view["jobs"].items():
            typer.echo(job_line(job, j))
        for n in view["nodes"]:
            typer.echo(f"node {n['node']}: {n['status'] if n['reachable'] else 'UNREACHABLE'}")
    raise typer.Exit(EXIT.get(view["status"], 2))


def ranks(url: SupervisorUrl = DEFAULT_SUPERVISOR, as_json: JsonOpt = False) -> None:
    """Every rank the agents report: state, step, phase, heartbeat age, comm/compute."""
    view = fetch(url, "/v1/ranks")
    if as_json:
        typer.echo(json.dumps(view, indent=2))
        return
    rows = [[r["job"], r["rank"], r["node"], r["restart"], r["state"], r["step"], r["phase"],
             r["heartbeat_age_seconds"], r["step_seconds"], r["comm_compute_ratio"], r["loss"]]
            for r in view["ranks"]]  # fmt: skip
    typer.echo(table(rows, ["JOB", "RANK", "NODE", "RESTART", "STATE", "STEP", "PHASE",
                            "HEARTBEAT_S", "STEP_S", "COMM/COMPUTE", "LOSS"]))  # fmt: skip


def incidents(
    url: SupervisorUrl = DEFAULT_SUPERVISOR,
    as_json: JsonOpt = False,
    db: Annotated[
        Path,
        Opt(help="read a supervisor's database instead (e.g. RUN_DIR/rankguard.db after `up`)"),
    ] = None,
    by_cause: Annotated[
        bool,
        Opt(
            "--by-cause",
            help="the interruptions table: incidents, time lost and steps done "
            "again per cause, over every incident recorded",
        ),
    ] = False,
) -> None:
    """The incident timeline: what was detected, its cause, what was done, and each
    recovery's phases."""
    what = "causes" if by_cause else "incidents"
    view = read_incidents_db(db, what) if db is not None else fetch(url, f"/v1/{what}")
    if as_json or by_cause:
        typer.echo(json.dumps(view, indent=2) if as_json else cause_table(view["causes"]))
        return
    if not view["incidents"]:
        typer.echo("no incidents recorded")
    for inc in view["incidents"]:
        when = time.strftime("%H:%M:%S", time.localtime(inc["detected_at"]))
        typer.echo(f"#{inc['id']} {when} {inc['kind']} job={inc['job']} rank={_fmt(inc['rank'])} "
                   f"node={inc['node']} [{inc['state']}] {who_acted(inc)}")  # fmt: skip
        typer.echo(f"    {inc['summary']}")
        if inc.get("cause"):
            typer.echo(f"    cause: {inc['cause']} ({inc.get('cause_confidence')} confidence): "
                       f"{inc.get('cause_why')}")  # fmt: skip
        if marks := milestones(inc):  # the live view's offsets from the fault
            typer.echo("    " + "  ".join(marks))
        for e in inc.get("events") or []:  # the workers' own milestones (restart_phases.py)
            if e["what"] == "restart phases":
                parts = [(k, e["detail"].get(k)) for k in RESTART_PHASES]
                typer.echo("    restart: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}s"
                                                       for k, v in parts if v is not None))  # fmt: skip
            elif e["what"] == "data skipped" and isinstance(e["detail"].get("text"), str):
                typer.echo(f"    {e['detail']['text']}")  # a loss spike's batches left out
        if line := _wavefront_line((inc.get("evidence") or {}).get("wavefront")):
            typer.echo(f"    {line}")
        if inc.get("verdict"):
            typer.echo(f"    verdict: {inc['verdict']}")


def who_acted(inc: dict) -> str:
    """What was done about an incident, and by whom, in words."""
    action, rank, node = inc.get("action"), _fmt(inc.get("rank")), inc.get("node")
    done = {"kill_rank": f"rankguard killed rank {rank}", "stop_job": "rankguard stopped the job",
            "exclude_node": f"rankguard excluded node {node}"}  # fmt: skip
    if action in done:
        return done[action]
    if inc.get("restarted_at") is not None:
        return "torchrun restarted the group"
    return "reported, nothing done"


def cause_table(causes: list[dict]) -> str:
    """The fleet's interruptions by cause, as the published tables print them: each
    cause's share of the incidents, the time lost and the steps done again."""
    total = sum(c["incidents"] for c in causes) or 1
    rows = [[c["cause"], c["incidents"], f"{100 * c['incidents'] / total:.1f}%",
             f"{c['lost_seconds']:.1f}", c["lost_steps"], c["restarts"]]
            for c in causes]  # fmt: skip
    return table(rows, ["CAUSE", "INCIDENTS", "SHARE", "LOST_S", "LOST_STEPS", "RESTARTS"])


def _wavefront_line(wave: object) -> str | None:
    """The flight recorders' reading of a hang, in one line: the verdict, the group and
    collective the others wait in, and how far each rank got (supervisor/wavefront.py)."""
    if not isinstance(wave, dict) or not isinstance(wave.get("reached"), dict):
        return None
    reached = ", ".join(f"rank {r} at {s}" for r, s in sorted(
        wave["reached"].items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0))  # fmt: skip
    return (f"flight recorder: {wave.get('verdict')} in group {wave.get('pg')}, collective "
            f"{wave.get('seq')}: {reached}")  # fmt: skip


def read_incidents_db(db: Path, what: str = "incidents") -> dict:
    """What `/v1/incidents` (or `/v1/causes`) would answer, read from the database itself."""
    from types import SimpleNamespace

    from rankguard.supervisor.store import IncidentStore, StoreError
    from rankguard.supervisor.views import causes_view, incidents_view

    if not db.is_file():
        typer.echo(f"rankguard: {db}: no such database", err=True)
        raise typer.Exit(2)
    try:
        store = IncidentStore(db)
    except (OSError, StoreError) as exc:
        typer.echo(f"rankguard: {db}: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        view = causes_view if what == "causes" else incidents_view
        return view(SimpleNamespace(store=store))
    finally:
        store.close()
