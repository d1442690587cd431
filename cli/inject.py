"""`rankguard inject`: faults against a running job, for drills and fault-injection tests."""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

Opt = typer.Option


class Kind(str, Enum):
    kill = "kill"
    hang = "hang"
    slow = "slow"
    nan = "nan"
    exception = "exception"
    corrupt_checkpoint = "corrupt-checkpoint"


SIGNALS = {"kill": "SIGKILL", "hang": "SIGSTOP"}


class InjectError(Exception):
    pass


def _agent_rank(agent: str, job: str | None, rank: int) -> dict:
    """The one live rank `rank` (of `job`) on the agent, as its answer shows it; InjectError
    for a URL that is not an agent's, or no such rank."""
    from rankguard.contract.answers import RanksAnswer
    from rankguard.contract.errors import ContractError
    from rankguard.supervisor.agents import AgentClient, AgentError, parse_agents

    if parse_agents(agent)[1] is not None:
        raise InjectError(f"--agent {agent!r} is not an http(s) URL")
    try:
        answer = AgentClient(agent).get("/v1/ranks")
        RanksAnswer.from_json(answer)  # checked: a URL of another service is named as such
    except AgentError as exc:
        raise InjectError(str(exc)) from None
    except ContractError as exc:
        raise InjectError(f"{agent} is not a rankguard agent ({exc})") from None
    ranks = answer["ranks"]
    live = [r for r in ranks if r["rank"] == rank and r["up"] and (job is None or r["job"] == job)]
    if len(live) != 1:
        jobs = sorted({r["job"] for r in ranks})
        raise InjectError(f"no single live rank {rank}" + (f" of job {job}" if job else "")
                          + f" on {agent} (jobs there: {', '.join(jobs) or 'none'})")  # fmt: skip
    return live[0]


def corrupt_newest_checkpoint(ckpt_dir: Path) -> dict:
    """Flip one byte in the middle of the newest validated checkpoint's largest file."""
    from rankguard.client import checkpoint_store as store

    valid = [s for s in store.scan(ckpt_dir, verify_checksums=False) if s.state == "validated"]
    if not valid:
        raise InjectError(f"no validated checkpoint in {ckpt_dir}")
    newest = valid[-1]
    victim = max(
        (p for p in newest.path.iterdir() if p.name != "manifest.json"),
        key=lambda p: p.stat().st_size,
    )
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return {"checkpoint": str(newest.path), "file": victim.name, "step": newest.step}


def inject(
    kind: Kind,
    rank: Annotated[int, Opt(help="the rank to hit")] = 0,
    job: Annotated[str, Opt(help="the job (needed when the node runs several)")] = None,
    agent: Annotated[
        str, Opt(envvar="RANKGUARD_AGENT", help="the rank's node agent")
    ] = "http://127.0.0.1:9407",
    token_file: Annotated[
        Path, Opt(envvar="RANKGUARD_TOKEN_FILE", help="the agent's control token")
    ] = None,
    fault_file: Annotated[
        Path, Opt(envvar="RANKGUARD_FAULT_FILE", help="the job's fault file (slow, nan, exception)")
    ] = None,  # fmt: skip
    factor: Annotated[float, Opt(help="slow: compute takes this many times as long")] = 1.2,
    ckpt_dir: Annotated[
        Path, Opt(help="corrupt-checkpoint: the job's checkpoint directory")
    ] = None,
    as_json: Annotated[bool, Opt("--json")] = False,
) -> None:
    """Inject a fault into a running job.

    kill: SIGKILL the rank (through its agent). hang: SIGSTOP it. slow / nan / exception:
    written to the job's fault file, which the trainer re-reads every step; they start two
    steps after the rank's current one. corrupt-checkpoint: flip a byte in the newest
    validated checkpoint.

    Exit codes: 0 injected; 2 could not inject (message says why).
    """
    import ssl

    from rankguard.agent.config import AgentConfigError, read_token
    from rankguard.supervisor.agents import AgentClient, AgentError, trust_agents_signed_by

    try:
        # an https agent is checked against the cluster's CA when given (docs/security.md)
        trust_agents_signed_by(os.environ.get("RANKGUARD_CA_FILE") or None)
        if kind is Kind.corrupt_checkpoint:
            if ckpt_dir is None:
                raise InjectError("corrupt-checkpoint needs --ckpt-dir")
            result = corrupt_newest_checkpoint(ckpt_dir)
        elif kind.value in SIGNALS:
            target = _agent_rank(agent, job, rank)
            token = read_token(token_file) if token_file else None
            result = AgentClient(agent, token).signal(target["job"], rank, SIGNALS[kind.value])
        else:
            if fault_file is None:
                raise InjectError(
                    f"{kind.value} needs the job's --fault-file ($RANKGUARD_FAULT_FILE)"
                )
            target = _agent_rank(agent, job, rank)
            step = (target["step"] or 0) + 2
            spec = f"{kind.value}:step={step}:rank={rank}:restart={target['restart']}"
            if kind is Kind.slow:
                spec += f":factor={factor}"
            with open(fault_file, "a") as f:
                f.write(spec + "\n")
            result = {"fault_file": str(fault_file), "spec": spec}
    except (InjectError, AgentError, AgentConfigError, OSError, ssl.SSLError) as exc:
        typer.echo(f"rankguard inject: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(result) if as_json else f"injected {kind.value}: {result}")
