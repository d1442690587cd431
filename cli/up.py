"""`rankguard up`: everything on one machine: an agent, the supervisor and the trainer."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Annotated

import typer

Opt = typer.Option

EXIT_STOPPED = 3  # the supervisor stopped the job (crash loop): distinct from a plain failure
INJECT_RE = re.compile(r"^(kill|hang|slow|nan|exception|corrupt-checkpoint)((?::[a-z]+=[^:]+)*)$")


def parse_inject(spec: str) -> dict:
    """`kill:rank=1:at=30s` -> {"kind": "kill", "rank": 1, "at": 30.0} (at: seconds after start)."""
    m = INJECT_RE.match(spec)
    if not m:
        raise typer.BadParameter(f"{spec!r}: expected KIND[:rank=N][:at=SECONDS[s]][:factor=F]")
    out: dict = {"kind": m.group(1), "rank": 0, "at": 10.0, "factor": 1.2}
    for part in filter(None, m.group(2).split(":")):
        key, _, value = part.partition("=")
        if key not in ("rank", "at", "factor"):
            raise typer.BadParameter(f"{spec!r}: unknown key {key!r}")
        out[key] = int(value) if key == "rank" else float(value.rstrip("s"))
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def _start(args: list[str], log: Path, health: str, env: dict) -> subprocess.Popen:
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rankguard.cli.main", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip
    for _ in range(600):
        if proc.poll() is not None:
            raise typer.Exit(_fail(f"{args[0]} exited at start; see {log}"))
        if _get(health):
            return proc
        time.sleep(0.1)
    raise typer.Exit(_fail(f"{args[0]} did not start; see {log}"))


def _start_warm_server(run_dir: Path, env: dict) -> subprocess.Popen:
    from rankguard.trainer.warm import start_server

    with open(run_dir / "warm.log", "w") as out:
        try:
            return start_server(run_dir / "warm.sock", env, stdout=out)
        except RuntimeError as exc:
            raise typer.Exit(_fail(f"{exc}; see {run_dir}/warm.log")) from None


def _fail(message: str) -> int:
    typer.echo(f"rankguard up: {message}", err=True)
    return 2


def _status_line(supervisor: str) -> str:
    ranks = (_get(supervisor + "/v1/ranks") or {}).get("ranks", [])
    cluster = _get(supervisor + "/v1/cluster") or {}
    incidents = (_get(supervisor + "/v1/incidents") or {}).get("incidents", [])
    per_rank = (
        " ".join(f"r{r['rank']}:{r['state'][:5]}@{r['step']}" for r in ranks) or "waiting for ranks"
    )
    last = (
        f" | last incident: {incidents[0]['kind']} rank {incidents[0]['rank']} [{incidents[0]['state']}]"
        if incidents
        else ""
    )
    return f"[{cluster.get('status', '?'):9}] {per_rank} | incidents {len(incidents)}{last}"


def up(
    nproc: Annotated[int, Opt(help="ranks (processes) on this machine")] = 2,
    preset: Annotated[str, Opt(help="model size: tiny, small, 1b")] = "tiny",
    steps: Annotated[int, Opt(help="optimizer steps to train")] = 300,
    ckpt_dir: Annotated[Path, Opt(help="checkpoints (default: RUN_DIR/ckpt)")] = None,
    ckpt_every: Annotated[int, Opt(help="save every N steps")] = 20,
    inject: Annotated[
        list[str], Opt("--inject", help="fault to schedule, e.g. kill:rank=1:at=30s")
    ] = None,
    run_dir: Annotated[
        Path, Opt(help="logs, database, sockets (default: runs/up-TIMESTAMP)")
    ] = None,
    trainer_arg: Annotated[
        list[str], Opt("--trainer-arg", help="extra trainer flag (repeatable)")
    ] = None,
    warm_start: Annotated[
        bool,
        Opt(
            help="fork workers from a process that imported torch once: restarts skip the "
            "import (trainer/warm.py)"
        ),
    ] = False,
) -> None:
    """Train on this machine under full supervision: starts a node agent, the supervisor
    (incidents in RUN_DIR/rankguard.db) and torchrun with the bundled trainer (gloo on CPU,
    NCCL on GPUs), shows a live status line, and exits when training ends.

    Exit codes: 0 training completed; 1 training failed; 2 could not start;
    3 the supervisor stopped the job (crash loop: see `rankguard incidents`).
    """
    faults = [parse_inject(s) for s in inject or []]
    run_dir = run_dir or Path("runs") / time.strftime("up-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = ckpt_dir or run_dir / "ckpt"
    token = run_dir / "token"
    token.write_text(secrets.token_urlsafe(32))
    token.chmod(0o600)
    fault_file = run_dir / "faults"
    fault_file.touch()
    agent_port, sup_port = _free_port(), _free_port()
    agent_url, sup_url = f"http://127.0.0.1:{agent_port}", f"http://127.0.0.1:{sup_port}"
    env = {**os.environ, "RANKGUARD_TELEMETRY_SOCKET": str(run_dir / "telemetry.sock"),
           "RANKGUARD_FAULT_FILE": str(fault_file), "RANKGUARD_SUPERVISOR": sup_url}  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_start(["agent", "--bind", f"127.0.0.1:{agent_port}", "--token-file", str(token),
                             "--telemetry-socket", env["RANKGUARD_TELEMETRY_SOCKET"],
                             "--ckpt-dir", str(ckpt_dir), "--interval", "0.5"],
                            run_dir / "agent.log", agent_url + "/healthz", env))  # fmt: skip
        procs.append(_start(["supervisor", "--agents", agent_url, "--db", str(run_dir / "rankguard.db"),
                             "--token-file", str(token), "--bind", f"127.0.0.1:{sup_port}"],
                            run_dir / "supervisor.log", sup_url + "/healthz", env))  # fmt: skip
        entry = ["rankguard.trainer"]
        if warm_start:
            procs.append(_start_warm_server(run_dir, env))
            env["RANKGUARD_WARM_SOCKET"] = str(run_dir / "warm.sock")
            entry = ["rankguard.trainer.warm", "run"]
        job = run_dir.name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--max-restarts=10", "-m", *entry, "--preset", preset, "--steps", str(steps),
               "--ckpt-dir", str(ckpt_dir), "--ckpt-every", str(ckpt_every), "--job", job,
               "--summary", str(run_dir / "summary.json"), "--log-every", "50", *(trainer_arg or [])]  # fmt: skip
        typer.echo(f"rankguard up: run {run_dir} | agent {agent_url} | supervisor {sup_url}")
        with open(run_dir / "trainer.log", "w") as log:
            trainer = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(trainer)
        start = time.monotonic()
        for f in faults:
            threading.Timer(
                f["at"], _inject, (f, agent_url, token, fault_file, ckpt_dir, job)
            ).start()
        while trainer.poll() is None:
            typer.echo(f"{time.monotonic() - start:6.1f}s {_status_line(sup_url)}")
            time.sleep(2 if sys.stdout.isatty() else 5)
        typer.echo(f"{time.monotonic() - start:6.1f}s {_status_line(sup_url)}")
        cluster = _get(sup_url + "/v1/cluster") or {}
        state = cluster.get("jobs", {}).get(job, {})
        if trainer.returncode == 0:
            summary = json.loads((run_dir / "summary.json").read_text())
            typer.echo(f"rankguard up: training completed: step {summary['final_step']}, loss "
                       f"{summary['final_loss']:.4f}, digest {summary['param_digest'][:16]}")  # fmt: skip
            code = 0
        elif state.get("state") == "stopped":
            typer.echo(
                f"rankguard up: the supervisor stopped the job: {state.get('verdict')}", err=True
            )
            code = EXIT_STOPPED
        else:
            typer.echo(
                f"rankguard up: training failed (exit {trainer.returncode}); see {run_dir}/trainer.log",
                err=True,
            )
            code = 1
        typer.echo(f"rankguard up: incidents: rankguard incidents --supervisor {sup_url} (while running) "
                   f"or {run_dir}/rankguard.db")  # fmt: skip
        raise typer.Exit(code)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def _inject(
    fault: dict, agent_url: str, token: Path, fault_file: Path, ckpt_dir: Path, job: str
) -> None:
    args = [sys.executable, "-m", "rankguard.cli.main", "inject", fault["kind"], "--rank", str(fault["rank"]),
            "--agent", agent_url, "--token-file", str(token), "--fault-file", str(fault_file),
            "--ckpt-dir", str(ckpt_dir), "--job", job, "--factor", str(fault["factor"])]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True)
    typer.echo((proc.stdout or proc.stderr).strip())
