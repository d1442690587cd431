"""`rankguard launch -- torchrun ...`: run a job's launcher and end with an exit code that
says whether a retry can help (contract/exit_codes.py), for a job controller to act on.

torchrun ends with 1 however its workers failed. When the supervisor stopped the job on
this node, the node's agent wrote why (the incident's cause) beside its telemetry socket
before it signalled torchrun; this command reads it once torchrun has ended, exits with
the cause's code and leaves the same in a pod's termination message. Without such a
status torchrun's own code is kept. SIGTERM and SIGINT are passed on to the launcher.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Annotated

import typer

from ..contract import exit_codes

DEFAULT_SOCKET = "/run/rankguard/telemetry.sock"
DEFAULT_TERMINATION_LOG = Path("/dev/termination-log")  # Kubernetes' default path


def job_of(command: list[str]) -> str | None:
    """The job name a torchrun command line gives its workers (``--rdzv-id``/``--rdzv_id``,
    which torchrun passes on as ``TORCHELASTIC_RUN_ID``)."""
    for i, arg in enumerate(command):
        for flag in ("--rdzv-id", "--rdzv_id"):
            if arg == flag and i + 1 < len(command):
                return command[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def launch(
    command: Annotated[
        list[str],
        typer.Argument(help="the launcher and its arguments, after `--`", show_default=False),
    ],  # fmt: skip
    job: Annotated[
        str | None,
        typer.Option(
            help="the job's name as the agent knows it (default: the command's --rdzv-id)",
            show_default=False,
        ),
    ] = None,  # fmt: skip
    telemetry_socket: Annotated[
        str,
        typer.Option(
            envvar="RANKGUARD_TELEMETRY_SOCKET",
            help="the node agent's telemetry socket; the job's status is read beside it",
        ),
    ] = DEFAULT_SOCKET,  # fmt: skip
    termination_log: Annotated[
        Path,
        typer.Option(
            help="where to leave the outcome as one line of JSON (a pod's terminationMessagePath); "
            "skipped when its folder does not exist"
        ),
    ] = DEFAULT_TERMINATION_LOG,  # fmt: skip
) -> None:
    """Run a job's launcher (torchrun) and end with an exit code a job controller can retry
    by: the cause of the incident the supervisor stopped the job for, else the launcher's own.

    `rankguard launch -- torchrun --nnodes 4 --rdzv-id job1 ... train.py`. In a pod, its
    termination message gets the outcome as JSON. Exit codes: EXIT_CODES (docs/deploy.md:
    which a controller retries).
    """
    name = job or job_of(command)
    if not name:
        typer.echo("rankguard launch: name the job with --job, or give the command "
                   "--rdzv-id (the name its workers report)", err=True)  # fmt: skip
        raise typer.Exit(exit_codes.BAD_ARGUMENT.code)
    started = time.time()
    try:
        proc = subprocess.Popen(command)
    except OSError as exc:
        typer.echo(f"rankguard launch: cannot run {command[0]}: {exc.strerror}", err=True)
        raise typer.Exit(exit_codes.BAD_ARGUMENT.code) from None
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    returncode = proc.wait()
    code, outcome = outcome_of(returncode, received, telemetry_socket, name, started)
    typer.echo(f"rankguard launch: {outcome['summary']} (exit {code})", err=code != 0)
    _leave_message(termination_log, outcome)
    raise typer.Exit(code)


def outcome_of(
    returncode: int, received: list[int], socket: str, job: str, started: float
) -> tuple[int, dict]:
    """The exit code and what the termination message says: a completed run 0; a signal
    this command received, its own code (130, 143); a job the supervisor stopped here, its
    cause's code; otherwise the launcher's code (a signal that ended it as 128 + n)."""
    if returncode == 0:
        return 0, {"exit_code": 0, "name": exit_codes.COMPLETED.name, "summary": "completed"}
    if received:
        ended = exit_codes.INTERRUPTED if received[0] == signal.SIGINT else exit_codes.TERMINATED
        why = f"{signal.Signals(received[0]).name} received: passed on to the launcher"
        return ended.code, {"exit_code": ended.code, "name": ended.name, "summary": why}
    status = exit_codes.read_status(socket, job, since=started)
    if status is not None:
        why = (f"the supervisor stopped job {job} here ({status.action}, incident "
               f"{status.incident}): cause {status.cause}, {status.why}")  # fmt: skip
        return status.exit_code.code, {**status.outcome(), "summary": why}
    code = 128 - returncode if returncode < 0 else returncode
    return code, {"exit_code": code, "name": "launcher", "summary": f"the launcher exited "
                  f"{code} and the supervisor recorded no cause here"}  # fmt: skip


def _leave_message(path: Path, outcome: dict) -> None:
    if not path.parent.is_dir():
        return
    try:
        with open(path, "w") as f:
            f.write(json.dumps(outcome, sort_keys=True)[:4000] + "\n")
    except OSError as exc:
        typer.echo(f"rankguard launch: cannot write {path}: {exc.strerror}", err=True)


launch.__doc__ = launch.__doc__.replace("EXIT_CODES", exit_codes.help_line())
