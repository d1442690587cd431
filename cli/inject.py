"""`rankguard inject`: faults against a running job, for drills and fault-injection tests."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated

import typer

from rankguard.contract import faults as grammar

Opt = typer.Option


SIGNALS = {"kill": "SIGKILL", "stop": "SIGSTOP"}


# The help lists kinds from the grammar's table (contract/faults.py KINDS), never by hand.
def _kinds(pred) -> list[str]:
    return [k.name for k in grammar.KINDS.values() if pred(k)]


def _takes(key: str) -> str:
    """The kinds that take `key`, each with its default where it has one: "slow [1.5]"."""
    out = []
    for name in _kinds(lambda k: key in k.keys):
        default = None if key in grammar.KINDS[name].required else getattr(grammar.parse(name), key)
        out.append(name if default is None else f"{name} [{default:g}]")
    return ", ".join(out)


PROCESS_KINDS = _kinds(lambda k: grammar.PROCESS in k.by)  # signalled now, even kill
TRAINER_KINDS = _kinds(lambda k: grammar.TRAINER in k.by and grammar.PROCESS not in k.by)
CHECKPOINT_KINDS = _kinds(lambda k: grammar.CHECKPOINT in k.by)


def _no_rank(kind: str) -> str:
    return f"{kind} (no rank): {grammar.KINDS[kind].help}"


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


LEAD_SECONDS = 2.0  # a trainer fault fires this long after it is written (at least 2 steps)


def _next_step(rank: dict) -> int:
    """The step a trainer fault fires at: about LEAD_SECONDS ahead of the rank's newest
    step, so the rank cannot have passed it by the time it reads the fault file (a tiny
    model trains tens of steps a second)."""
    seconds = rank.get("step_seconds")
    lead = 2 if not seconds or seconds <= 0 else max(2, math.ceil(LEAD_SECONDS / seconds))
    return (rank["step"] or 0) + lead


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
    spec: Annotated[
        str,
        typer.Argument(
            metavar="KIND[:key=value]...",
            help=f"{', '.join(grammar.KINDS)} (docs/faults.md); keys may also be given as options",
        ),
    ],
    rank: Annotated[
        int, Opt(help="the rank to hit (required but for corrupt-checkpoint)", min=0)
    ] = None,
    step: Annotated[
        int, Opt(help="trainer faults: the step it fires at (default: about 2 s ahead)", min=0)
    ] = None,
    job: Annotated[str, Opt(help="the job (needed when the node runs several)")] = None,
    agent: Annotated[
        str, Opt(envvar="RANKGUARD_AGENT", help="the rank's node agent")
    ] = "http://127.0.0.1:9407",
    token_file: Annotated[
        Path, Opt(envvar="RANKGUARD_TOKEN_FILE", help="the agent's control token")
    ] = None,
    fault_file: Annotated[
        Path, Opt(envvar="RANKGUARD_FAULT_FILE", help="the job's fault file (trainer faults)")
    ] = None,  # fmt: skip
    factor: Annotated[float, Opt(help=f"the factor= of {_takes('factor')}")] = None,
    seconds: Annotated[float, Opt(help=f"the seconds= of {_takes('seconds')}")] = None,
    ckpt_dir: Annotated[
        Path, Opt(envvar="RANKGUARD_CKPT_DIR", help="corrupt-checkpoint: the job's checkpoints")
    ] = None,
    as_json: Annotated[bool, Opt("--json", help="the result as JSON")] = False,
) -> None:
    import ssl

    from rankguard.agent.config import AgentConfigError, read_token
    from rankguard.supervisor.agents import AgentClient, AgentError, trust_agents_signed_by

    def refuse(message: str) -> typer.Exit:
        typer.echo(f"rankguard inject: {message}", err=True)
        return typer.Exit(2)

    extra = [f"{k}={v}" for k, v in (("rank", rank), ("step", step), ("factor", factor),
                                      ("seconds", seconds)) if v is not None]  # fmt: skip
    try:
        fault = grammar.for_inject(grammar.parse(":".join([spec, *extra])))
    except grammar.FaultError as exc:
        raise refuse(str(exc)) from None
    if fault.note:
        typer.echo(f"rankguard inject: {fault.note}", err=True)
    try:
        # an https agent is checked against the cluster's CA when given (docs/security.md)
        trust_agents_signed_by(os.environ.get("RANKGUARD_CA_FILE") or None)
        if fault.kind == "corrupt-checkpoint":
            if ckpt_dir is None:
                raise InjectError("corrupt-checkpoint needs --ckpt-dir ($RANKGUARD_CKPT_DIR)")
            result = corrupt_newest_checkpoint(ckpt_dir)
            text = (f"injected corrupt-checkpoint: flipped a byte of {result['file']} in step "
                    f"{result['step']} ({result['checkpoint']}); a resume must refuse it")  # fmt: skip
        elif fault.kind in SIGNALS:
            target = _agent_rank(agent, job, fault.rank)
            token = read_token(token_file) if token_file else None
            sent = AgentClient(agent, token).signal(target["job"], fault.rank, SIGNALS[fault.kind])
            result = {"kind": fault.kind, "job": target["job"], "rank": fault.rank,
                      "pid": target["pid"], "signal": SIGNALS[fault.kind], "agent": agent,
                      "answer": sent}  # fmt: skip
            text = (f"injected {fault.kind}: {SIGNALS[fault.kind]} to rank {fault.rank} of job "
                    f"{target['job']} (pid {target['pid']}) through {agent}")  # fmt: skip
        else:
            if fault_file is None:
                raise InjectError(
                    f"{fault.kind} is done by the trainer: it needs the job's --fault-file "
                    "($RANKGUARD_FAULT_FILE)"
                )
            target = _agent_rank(agent, job, fault.rank)
            at = fault.step if fault.step is not None else _next_step(target)
            line = grammar.Fault(fault.kind, rank=fault.rank, step=at, factor=fault.factor,
                                 seconds=fault.seconds, restart=target["restart"]).text()  # fmt: skip
            with open(fault_file, "a") as f:
                f.write(line + "\n")
            result = {"kind": fault.kind, "job": target["job"], "rank": fault.rank, "step": at,
                      "restart": target["restart"], "fault_file": str(fault_file), "spec": line}  # fmt: skip
            text = (f"injected {fault.kind}: rank {fault.rank} of job {target['job']} at step "
                    f"{at} (incarnation {target['restart']}), written to {fault_file}")  # fmt: skip
    except (InjectError, AgentError, AgentConfigError, OSError, ssl.SSLError) as exc:
        raise refuse(str(exc)) from None
    typer.echo(json.dumps(result) if as_json else text)


# Typer shows the docstring as the command's help: the kinds come from the table.
inject.__doc__ = f"""Inject a fault into a running job, now.

{" / ".join(PROCESS_KINDS)}: {" / ".join(SIGNALS[k] for k in PROCESS_KINDS)} the rank through \
its node agent (any script).

{", ".join(TRAINER_KINDS)}: written to the job's fault file, which the trainer re-reads \
every step; they fire at --step (default: about two seconds ahead of the rank's current \
step, at least two steps), in the rank's current incarnation.

{"; ".join(_no_rank(k) for k in CHECKPOINT_KINDS)}.

`rankguard inject kill --rank 1` and `rankguard inject kill:rank=1` are the same.

Exit codes: 0 injected; 2 could not inject (message says why).
"""
