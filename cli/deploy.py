"""`rankguard deploy`: the deployment files shipped with the package (systemd units, an
example agent.toml, the Slurm scripts, the Grafana dashboards and Prometheus rules)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Annotated

import typer

EXIT_OK, EXIT_ERROR = 0, 2

app = typer.Typer(
    no_args_is_help=True,
    help="The deployment files installed with rankguard: systemd units, agent.toml, Slurm "
    "scripts, Grafana dashboards and Prometheus rules (docs/deploy.md).",
)


@app.command("path")
def path_cmd() -> None:
    """Print the installed deploy folder (read-only: copy it out with `rankguard deploy copy`
    before editing anything)."""
    from rankguard.deploy import deploy_dir

    typer.echo(str(deploy_dir()))


@app.command("copy")
def copy_cmd(
    dest: Annotated[
        Path,
        typer.Argument(
            help="Folder to copy into (created if missing), e.g. /opt/rankguard/deploy, "
            "which the Slurm prolog and epilog use.",
            show_default=False,
        ),
    ],
) -> None:
    """Copy every deployment file to DEST, keeping the layout (DEST/systemd/,
    DEST/slurm/, DEST/grafana/, DEST/prometheus/, DEST/agent.toml). Existing files are
    replaced; scripts (the Slurm prolog, epilog, helper and sbatch file) are made
    executable. Prints each file written.

    Exit codes: 0 copied; 2 DEST cannot be written.
    """
    from rankguard.deploy import deploy_dir, deploy_files, is_script

    src = deploy_dir()
    written = []
    try:
        for rel in deploy_files():
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, target)
            mode = 0o755 if is_script(rel) else 0o644
            os.chmod(target, mode)
            written.append(target)
    except OSError as exc:
        typer.echo(f"rankguard deploy copy: cannot write under {dest}: {exc}", err=True)
        raise typer.Exit(EXIT_ERROR) from None
    for path in written:
        mode = stat.filemode(path.stat().st_mode)
        typer.echo(f"{mode} {path}")


@app.command("agent-token")
def agent_token_cmd(
    hosts: Annotated[
        list[str],
        typer.Argument(
            help="agent hosts exactly as the supervisor's agents file names them "
            "(http://HOST:9407)",
            show_default=False,
        ),
    ],
    secret_file: Annotated[
        Path, typer.Option(help="the supervisor's --agent-secret-file (owner-only)")
    ],
) -> None:
    """Print each host's agent control token, derived from the supervisor's secret: put it
    in that node's agent token file (owner-only). One host: the token alone; several:
    `HOST TOKEN` lines.

    Exit codes: 0 printed; 2 the secret file is missing, too short or readable by others.
    """
    from rankguard.agent.config import AgentConfigError, read_token
    from rankguard.supervisor.tokens import AgentTokens, derive_agent_token

    try:
        tokens = AgentTokens(secret=read_token(secret_file))
    except (AgentConfigError, ValueError) as exc:
        typer.echo(f"rankguard deploy agent-token: {exc}", err=True)
        raise typer.Exit(EXIT_ERROR) from None
    for host in hosts:
        token = derive_agent_token(tokens.secret, host.strip("[]"))
        typer.echo(token if len(hosts) == 1 else f"{host} {token}")


@app.command("kubernetes")
def kubernetes_cmd(
    values: Annotated[
        Path,
        typer.Option("--values", help="TOML file of values (docs/deploy.md lists every key)"),
    ] = None,
    set_: Annotated[
        list[str],
        typer.Option(
            "--set",
            help="KEY=VALUE over the file, e.g. agent.interval=2 or "
            "namespace=gpu-ops (a TOML value; plain text is a string)",
        ),  # fmt: skip
    ] = None,
    example_jobset: Annotated[
        bool,
        typer.Option(
            "--example-jobset",
            help="print instead an example training JobSet whose failure policy restarts by "
            "the cause in `rankguard launch`'s exit code",
        ),
    ] = False,
) -> None:
    """Print every Kubernetes object rankguard needs, as YAML for `kubectl apply -f -`: the
    agent DaemonSet and its headless Service, the supervisor with its volume claim, PDB and
    Service, the rendezvous store, and for the Prometheus operator a ServiceMonitor, a
    PrometheusRule and the dashboards as ConfigMaps. Create the token Secret first
    (docs/deploy.md).

    Exit codes: 0 printed; 2 a bad value (named by its key).
    """
    from rankguard.cli.kubernetes import JOBSET_EXAMPLE_HEADER, KubeValues, dump, render
    from rankguard.cli.kubernetes import example_jobset as jobset
    from rankguard.service.settings import SettingsError, build, read_toml

    try:
        table = read_toml(values) if values else {}
        for item in set_ or []:
            key, sep, text = item.partition("=")
            if not sep or not key:
                raise SettingsError(f"--set {item!r}: expected KEY=VALUE")
            *parents, last = key.split(".")
            node = table
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise SettingsError(f"--set {key}: {part} is not a table")
            node[last] = _toml_value(text)
        chosen = build(KubeValues, table, "")
    except SettingsError as exc:
        typer.echo(f"rankguard deploy kubernetes: {exc}", err=True)
        raise typer.Exit(EXIT_ERROR) from None
    if example_jobset:
        typer.echo(dump([jobset(chosen)], JOBSET_EXAMPLE_HEADER), nl=False)
        return
    typer.echo(dump(render(chosen)), nl=False)


def _toml_value(text: str):
    """A --set value as TOML reads it (2, true, "x", {a = "b"}); anything else as text."""
    import tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
