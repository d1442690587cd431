"""`rankguard agent`: the per-node daemon."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .daemon_options import LogLevel, PrintConfig, TlsCert, TlsKey

Opt = typer.Option


def _help(name: str, text: str) -> str:
    from rankguard.agent.config import AgentConfig
    from rankguard.service.settings import flag_help

    return flag_help(text, AgentConfig, name, "agent")


def agent(
    bind: Annotated[
        str,
        Opt(help=_help("bind", "HOST:PORT for /metrics and /v1 (0.0.0.0:PORT exposes it)")),
    ] = None,
    interval: Annotated[float, Opt(help=_help("interval", "seconds between collections"))] = None,
    token_file: Annotated[
        Path, Opt(help="bearer token for control endpoints (owner-only file, >= 16 chars)")
    ] = None,
    telemetry_socket: Annotated[
        str, Opt(help=_help("telemetry_socket", "Unix datagram socket the trainer's ranks send to"))
    ] = None,
    telemetry_group: Annotated[
        str,
        Opt(
            help=_help(
                "telemetry_group",
                "group of the telemetry socket (mode 0660): users "
                "whose ranks may send (unset: the agent's own group)",
            )
        ),
    ] = None,
    telemetry_quota: Annotated[
        float,
        Opt(
            help=_help(
                "telemetry_quota",
                "telemetry records per second per sender uid (x10 for root and the agent's uid)",
            )
        ),
    ] = None,
    telemetry_ranks_per_uid: Annotated[
        int,
        Opt(
            help=_help(
                "telemetry_ranks_per_uid",
                "rank table entries per sender uid (root and the agent's uid: all)",
            )
        ),
    ] = None,
    telemetry_batch_wait: Annotated[
        float,
        Opt(
            help=_help(
                "telemetry_batch_wait",
                "seconds the receiver lets telemetry datagrams "
                "gather between drains (0: one wake-up per datagram; unset: 0.1 if "
                "net.unix.max_dgram_qlen >= 64, else 0)",
            )
        ),
    ] = None,
    ckpt_dir: Annotated[
        Path, Opt(help="checkpoint directory: its filesystem's space is watched")
    ] = None,
    data_dir: Annotated[
        Path, Opt(help="training data directory: its filesystem's space is watched")
    ] = None,
    expected_gpus: Annotated[
        int, Opt(help="GPUs this node should have (fewer is unhealthy)")
    ] = None,
    nvml_double: Annotated[
        Path, Opt(help="JSON state of an NVML double (GPU-less test nodes)")
    ] = None,
    node: Annotated[str, Opt(help="node name in metrics and the API (default: hostname)")] = None,
    discover_workers: Annotated[
        str,
        Opt(
            help=_help(
                "discover_workers",
                "watch torchrun workers that send no telemetry, found in /proc (zero-code "
                "protection: death and hang, no steps): auto = those whose "
                "RANKGUARD_TELEMETRY_SOCKET is this agent's socket, and those without one when "
                "this agent has the default socket; all = also those without one; off",
            )
        ),
    ] = None,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    config: Annotated[
        Path,
        Opt(
            help="TOML config file: [agent] (same keys as the flags) and [collectors.<name>] "
            "(docs/configuration.md); flags override it"
        ),
    ] = None,
    print_config: PrintConfig = False,
    log_level: LogLevel = "info",
) -> None:
    """Run the node agent: GPU, host, storage, network and rank telemetry collection,
    Prometheus /metrics, the /v1 JSON API and token-guarded control of local ranks.

    Exit codes: 0 stopped by SIGTERM/SIGINT; 2 bad configuration.
    """
    from rankguard.agent.config import AgentConfigError, config_toml, load_config
    from rankguard.service.logs import LogConfigError, setup_logging

    try:
        setup_logging(log_level)
    except LogConfigError as e:
        typer.echo(f"rankguard agent: {e}", err=True)
        raise typer.Exit(2) from None
    overrides = dict(
        bind=bind, interval=interval, token_file=token_file, telemetry_socket=telemetry_socket,
        ckpt_dir=ckpt_dir, data_dir=data_dir, expected_gpus=expected_gpus,
        nvml_double=nvml_double, node=node, discover_workers=discover_workers,
        tls_cert=tls_cert, tls_key=tls_key, telemetry_group=telemetry_group,
        telemetry_quota=telemetry_quota, telemetry_ranks_per_uid=telemetry_ranks_per_uid,
        telemetry_batch_wait=telemetry_batch_wait,
    )  # fmt: skip
    try:
        cfg = load_config(config, overrides)
        if print_config:
            typer.echo(config_toml(cfg), nl=False)
            return
        from rankguard.agent.daemon import Agent

        daemon = Agent(cfg)
    except (AgentConfigError, OSError) as exc:
        typer.echo(f"rankguard agent: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        daemon.run()
    except AgentConfigError as exc:  # the address: in use, or not resolvable
        daemon.close()
        typer.echo(f"rankguard agent: {exc}", err=True)
        raise typer.Exit(2) from None
