"""`rankguard up`: everything on one machine: an agent, the supervisor and the trainer."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from ..client import bootstrap, flight_recorder
from ..client.checkpoint_store import KEY_FILE_ENV, CheckpointError, load_key
from ..contract import exit_codes, startup_guard
from ..contract.secrets import new_secret_file, private_dir_problem
from ..supervisor.detectors.process_hang import ProcessHangConfig
from . import live_view as lv
from .keeper import KeptDaemon
from .local_stack import free_ports, holder_up
from .rendezvous import reachable, torchrun_args
from .supervisor import PROCESS_IDLE_HELP

Opt = typer.Option

# the bundled trainer's run when up is not told otherwise (a short demonstration run)
DEFAULT_PRESET, DEFAULT_STEPS, DEFAULT_CKPT_EVERY = "tiny", 300, 20
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it
EXIT_TERMINATED = 143  # SIGTERM: 128 + 15


class _Terminated(KeyboardInterrupt):
    """SIGTERM, taken like Ctrl-C: up ends what it started (a default SIGTERM would leave
    the daemons and torchrun running without it)."""


# Every Ctrl-C or SIGTERM taken, so one raised while the main thread ran a finalizer (a
# `__del__`, where Python prints and drops it) still ends up as an interruption.
_SIGNALLED: list[KeyboardInterrupt] = []


def _on_signal(signum, frame) -> None:
    exc = _Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
    _SIGNALLED.append(exc)
    raise exc


def _interruption(exc: KeyboardInterrupt) -> tuple[str, int]:
    if isinstance(exc, _Terminated):
        return "terminated (SIGTERM)", EXIT_TERMINATED
    return "interrupted (Ctrl-C)", EXIT_INTERRUPTED


def parse_inject(spec: str, script: bool = False):
    """`kill:rank=1:at=30s` -> a Fault of the one grammar (contract/faults.py,
    docs/faults.md); one clear line (exit 2) for anything it refuses."""
    from rankguard.contract import faults as grammar

    try:
        fault = grammar.for_up(grammar.parse(spec), script)
    except grammar.FaultError as exc:  # one line, not click's usage box
        raise typer.Exit(_fail(f"--inject {exc}")) from None
    if fault.note:
        typer.echo(f"rankguard up: {fault.note}", err=True)
    return fault


def _local_supervisor_config(run_dir: Path) -> Path:
    """One machine, not a cluster: a hardware fault here must not drain this node in a
    scheduler that may be running on it (Slurm); the job's processes are still stopped.
    The workers' startup milestones split each restart into phases in its incident."""
    path = run_dir / "supervisor.toml"
    trace = json.dumps(str((run_dir / STARTUP_TRACE).absolute()))  # a TOML basic string
    with _private_file(path) as f:
        f.write(f"[supervisor]\nstartup_trace = {trace}\n\n[scheduler]\ndrain = false\n")
    return path


STARTUP_TRACE = "startup.jsonl"  # the workers' startup milestones (trainer/startup_trace.py)
STARTUP_GUARD = "worker-exits.jsonl"  # the workers' own exits (contract/startup_guard.py)


def _get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def _private_file(path: Path, append: bool = False):
    """`path` opened for writing, created 0600, never through a symbolic link (exit 2)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | (os.O_APPEND if append else os.O_TRUNC), 0o600)
    except OSError as exc:
        why = "a symbolic link: not followed" if exc.errno == errno.ELOOP else exc.strerror
        raise typer.Exit(_fail(f"{path}: {why}")) from None
    return os.fdopen(fd, "a" if append else "w")


def _own_dir(path: Path, what: str, private: bool) -> None:
    """`path` made (0700) if missing; an existing one must be the user's own and writable
    by no one else (exit 2 with the reason). `private`: an existing one is made 0700 too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise typer.Exit(_fail(f"{what} {path}: {exc.strerror}")) from None
    problem = private_dir_problem(path)
    if problem is not None:
        raise typer.Exit(
            _fail(f"{what}: {problem}; give one of your own (a new one is made for you)")
        )
    if private:
        path.chmod(0o700)


# A Unix socket's path holds at most 107 bytes; the agent binds under a temporary name 8
# bytes longer. up's longest socket in the run directory is the telemetry socket.
_SOCKET_PATH_MAX = 107 - 8


def _check_socket_room(run_dir: Path) -> None:
    longest = run_dir / "telemetry.sock"
    if len(os.fsencode(str(longest))) > _SOCKET_PATH_MAX:
        raise typer.Exit(_fail(
            f"--run-dir {run_dir}: too long a path for the Unix sockets up makes in it "
            f"({len(os.fsencode(str(longest)))} of at most {_SOCKET_PATH_MAX} bytes for "
            f"{longest.name}); give a shorter --run-dir"))  # fmt: skip


def _prepare_run_dir(run_dir: Path, ckpt_dir: Path | None) -> None:
    """The run directory: the user's own, private, and without symbolic links in it (up
    writes logs, secrets and the fault file there); the checkpoint root the user's own."""
    _own_dir(run_dir, "--run-dir", private=True)
    links = sorted(p.name for p in run_dir.iterdir() if p.is_symlink())
    if links:
        raise typer.Exit(_fail(f"--run-dir {run_dir} holds symbolic links ({', '.join(links)}): "
                               "up follows no link in its run directory"))  # fmt: skip
    if ckpt_dir is not None:
        _own_dir(ckpt_dir, "--ckpt-dir", private=False)


def user_checkpoint_key(environ=os.environ) -> Path:
    """The user's checkpoint key: `$RANKGUARD_CHECKPOINT_KEY_FILE` when set, else
    `$XDG_CONFIG_HOME/rankguard/checkpoint.key` (~/.config/...), made at first use (0600 in
    a 0700 folder). Checked like every key (exit 2 with the reason)."""
    named = environ.get(KEY_FILE_ENV)
    if named:
        path = Path(named).absolute()
    else:
        config = Path(environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        folder = config / "rankguard"
        _own_dir(folder, "checkpoint key folder", private=True)
        path = folder / "checkpoint.key"
        if not path.exists() and not path.is_symlink():
            new_secret_file(path)
    try:
        load_key(path)
    except CheckpointError as exc:
        raise typer.Exit(_fail(str(exc))) from None
    return path


def _spawn(args: list[str], log: Path, env: dict, append: bool = False) -> subprocess.Popen:
    with _private_file(log, append) as out:
        return subprocess.Popen([sys.executable, "-m", "rankguard.cli.main", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip


@dataclass
class _Starting:
    """A daemon spawned and not yet waited for: `up` spawns them all, then waits for each,
    so their start-ups (imports: torch for the rendezvous store and the warm server)
    overlap instead of adding up."""

    name: str
    args: list[str]  # `rankguard` arguments (empty: not a kept daemon)
    proc: subprocess.Popen
    log: Path
    ready: Callable[[], bool]

    def wait(self, timeout: float = 60.0) -> subprocess.Popen:
        """The process once ready; exit 2 (could not start) if it exits or times out."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.proc.poll() is not None:
                raise typer.Exit(_fail(f"{self.name} exited at start; see {self.log}"))
            if time.monotonic() > deadline:
                raise typer.Exit(_fail(f"{self.name} did not start; see {self.log}"))
            time.sleep(0.05)
        return self.proc


def _start(name: str, args: list[str], run_dir: Path, env: dict, ready) -> _Starting:
    log = run_dir / f"{name}.log"
    return _Starting(name, args, _spawn(args, log, env), log, ready)


def _keep(started: _Starting, env: dict) -> KeptDaemon:
    """Wait for a started daemon (exit 2 when it cannot start) and keep it running: a
    restart appends to the same log and reuses the same arguments (port, database, token)."""
    return KeptDaemon(
        started.name,
        spawn=lambda: _spawn(started.args, started.log, env, append=True),
        healthy=started.ready,
        proc=started.wait(),
    )


def _start_warm_server(run_dir: Path, env: dict) -> _Starting:
    from rankguard.trainer.warm import spawn_server

    sock, log = run_dir / "warm.sock", run_dir / "warm.log"
    with _private_file(log) as out:
        proc = spawn_server(sock, env, stdout=out)
    return _Starting("the warm-start server", [], proc, log, sock.exists)


def _start_holders(run_dir: Path, env: dict) -> tuple[list[_Starting], list[str]]:
    """Holder B, and A replicating to it (A reaches B when it has something to send), and
    the trainer's flags for them."""
    a, b = (str((run_dir / f"holder-{n}.sock").absolute()) for n in "ab")
    started = [
        _start(f"holder-{name}", ["snapshot-holder", "run", "--socket", path, *peer], run_dir,
               env, lambda path=path: holder_up(path))
        for name, path, peer in (("b", b, []), ("a", a, ["--peer", b]))
    ]  # fmt: skip
    return started, ["--snapshot-holder", a, "--snapshot-peers", b]


EXPORT_FILE = "env.sh"  # the export line, for `. RUN/env.sh` in another shell


def export_line(values: dict) -> str:
    """`export NAME=VALUE ...` for a shell, each value quoted; None values left out."""
    import shlex

    pairs = (f"{k}={shlex.quote(str(v))}" for k, v in values.items() if v is not None)
    return "export " + " ".join(pairs)


def _fail(message: str) -> int:
    typer.echo(f"rankguard up: {message}", err=True)
    return 2


def _check_endpoint(endpoint: str) -> str:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise typer.BadParameter(f"{endpoint!r}: expected HOST:PORT of `rankguard rendezvous`")
    return endpoint


def _stop_verdict(db: Path, job: str) -> str | None:
    """Why the supervisor stopped the job, from its database: the answer survives a
    supervisor that is not answering at the end."""
    from rankguard.supervisor.model import ACT_STOP_JOB
    from rankguard.supervisor.store import IncidentStore, StoreError

    if not db.exists():
        return None
    try:
        store = IncidentStore(db)
    except (OSError, StoreError) as exc:
        typer.echo(f"rankguard up: cannot read {db}: {exc}", err=True)
        return None
    try:
        stops = [i for i in store.list_incidents(job=job) if i.action == ACT_STOP_JOB]
    finally:
        store.close()
    return (stops[0].verdict or stops[0].summary) if stops else None


SCRIPT_HELP = """\
SCRIPT.py [ARGS...] or -m MODULE [ARGS...] after `--`: run your own torchrun-compatible
training script instead of the bundled trainer (zero-code protection)."""

# Options that only the bundled trainer understands: refused with a script.
TRAINER_ONLY = ("--preset", "--steps", "--ckpt-every", "--trainer-arg", "--snapshot-every")
SCRIPT_INJECT = ("kill", "hang")  # faults done to a process from outside: any script


RUN, TRAINER, CKPT, FAULTS, START = (
    "Run", "The bundled trainer (refused with a script)", "Checkpoints",
    "Faults and hang detection", "Worker start-up",
)  # fmt: skip


def up(
    script: Annotated[
        list[str],
        typer.Argument(
            metavar="-- SCRIPT.py|-m MODULE [ARGS]",
            help=SCRIPT_HELP,
            show_default=False,
        ),
    ] = None,
    nproc: Annotated[int, Opt(help="ranks (processes) on this machine", rich_help_panel=RUN)] = 2,
    max_restarts: Annotated[
        int, Opt(help="torchrun's restart budget", min=0, rich_help_panel=RUN)
    ] = 10,
    run_dir: Annotated[
        Path,
        Opt(help="logs, database, sockets (default: runs/up-TIMESTAMP)", rich_help_panel=RUN),
    ] = None,
    rendezvous: Annotated[
        str,
        Opt(
            help="HOST:PORT of a running `rankguard rendezvous` (default: up starts one on "
            "a free loopback port)",
            rich_help_panel=RUN,
        ),
    ] = None,
    preset: Annotated[
        str,
        Opt(
            help=f"model size: tiny, small or 1b (default: {DEFAULT_PRESET})",
            rich_help_panel=TRAINER,
        ),
    ] = None,
    steps: Annotated[
        int,
        Opt(help=f"optimizer steps to train (default: {DEFAULT_STEPS})", rich_help_panel=TRAINER),
    ] = None,
    ckpt_every: Annotated[
        int,
        Opt(help=f"save every N steps (default: {DEFAULT_CKPT_EVERY})", rich_help_panel=TRAINER),
    ] = None,
    trainer_arg: Annotated[
        list[str],
        Opt("--trainer-arg", help="an extra trainer flag (repeatable)", rich_help_panel=TRAINER),
    ] = None,
    snapshot_every: Annotated[
        int,
        Opt(
            help="tier-0 snapshots every N steps into a snapshot holder, replicated to a "
            "second one",
            min=1,
            rich_help_panel=TRAINER,
        ),
    ] = None,
    ckpt_dir: Annotated[
        Path,
        Opt(
            help="checkpoints (default: RUN_DIR/ckpt; with a script: none, or yours, only "
            "watched for space)",
            rich_help_panel=CKPT,
        ),
    ] = None,
    no_ckpt_key: Annotated[
        bool,
        Opt(
            "--no-ckpt-key",
            help="checkpoints without an HMAC: a planted checkpoint is then trusted "
            "(default: signed with the key in $RANKGUARD_CHECKPOINT_KEY_FILE, else in "
            "~/.config/rankguard, made at first use)",
            rich_help_panel=CKPT,
        ),
    ] = False,
    inject: Annotated[
        list[str],
        Opt(
            "--inject",
            help="a fault to schedule, e.g. kill:rank=1:at=30s or nan:rank=0:step=50 "
            "(docs/faults.md; with a script: kill, stop at=)",
            rich_help_panel=FAULTS,
        ),
    ] = None,
    process_idle_seconds: Annotated[
        float,
        Opt(
            "--process-idle-seconds",
            help="a script's ranks are " + PROCESS_IDLE_HELP,
            min=1,
            rich_help_panel=FAULTS,
        ),
    ] = ProcessHangConfig.idle_seconds,
    cold_start: Annotated[
        bool,
        Opt(
            help="start every worker as a new interpreter, torch imported at each restart "
            "(default for a script)",
            rich_help_panel=START,
        ),
    ] = False,
    warm_start: Annotated[
        bool,
        Opt(
            help="fork workers from a process that imported torch once (default for the "
            "bundled trainer; for a script, best with the telemetry library: README)",
            rich_help_panel=START,
        ),
    ] = False,
) -> None:
    """Train on this machine under full supervision: a node agent, the supervisor and
    torchrun with the bundled trainer (gloo on CPU, NCCL on GPUs), a live view, and exit
    when training ends.

    Your own script, unchanged: `rankguard up --nproc 2 -- train.py --lr 3e-4` (or `-- -m
    pkg.train ARGS`). Zero-code, a dead rank is an incident within a second and torchrun
    restarts the group; a hung rank is found by process state, by the workers' flight
    recorders or by CPU progress, its stack captured and killed. With the telemetry library
    (the bundled trainer has it): steps, loss, hangs judged against the job's own step time,
    stragglers, NaN loss, checkpoint progress for the crash-loop guard. A script resumes
    only if it loads its own checkpoints (examples/ddp_plain.py does).

    Bad arguments are refused before anything starts. Workers that fail at start by
    themselves (an argument or import error) end the job at once with their error on
    screen, unrestarted.

    Exit codes, by what a retry can do (docs/deploy.md): EXIT_CODES. A job the supervisor
    stopped ends with its cause's code (`rankguard incidents`); on Ctrl-C or SIGTERM
    everything up started is ended and the summary printed.
    """
    plan = _parse(script, nproc, max_restarts, run_dir, rendezvous, preset, steps, ckpt_every,
                  trainer_arg, snapshot_every, ckpt_dir, no_ckpt_key, inject,
                  process_idle_seconds, cold_start, warm_start)  # fmt: skip
    stack = _prepare(plan)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    try:
        _start_daemons(plan, stack)
        trainer, display, stuck_after_training = _train(plan, stack)
        raise typer.Exit(_summarise(plan, stack, trainer, display, stuck_after_training))
    except KeyboardInterrupt as exc:  # before training started: nothing to summarize
        _ignore_signals()
        how, code = _interruption(exc)
        typer.echo(f"rankguard up: {how} while starting", err=True)
        raise typer.Exit(code) from None
    finally:
        stack.end()


up.__doc__ = up.__doc__.replace("EXIT_CODES", exit_codes.help_line())  # from the table


@dataclass
class _Plan:
    """What up's arguments decided, every one checked (`_parse`): nothing started yet."""

    script: list[str]  # a user's script and its arguments ([] for the bundled trainer)
    nproc: int
    max_restarts: int
    run_dir: Path  # absolute: the export line and the paths in it work from any directory
    rendezvous: str | None  # a running `rankguard rendezvous`, else up starts one
    preset: str
    steps: int
    ckpt_every: int
    trainer_arg: list[str]  # with the step= faults as the trainer's --fault flags
    snapshot_every: int | None
    ckpt_dir: Path | None  # a script keeps its checkpoints where it chooses
    no_ckpt_key: bool
    timed: list  # at= faults: up's own, on a timer
    process_idle_seconds: float
    warm: bool  # workers forked from a process that imported torch once


def _parse(script, nproc, max_restarts, run_dir, rendezvous, preset, steps, ckpt_every,
           trainer_arg, snapshot_every, ckpt_dir, no_ckpt_key, inject, process_idle_seconds,
           cold_start, warm_start) -> _Plan:  # fmt: skip
    """Every argument checked, the trainer's too, before anything is started or made: one
    line and exit 2 for the first refused."""
    given = {"--preset": preset, "--steps": steps, "--ckpt-every": ckpt_every,
             "--trainer-arg": trainer_arg or None, "--cold-start": cold_start or None,
             "--warm-start": warm_start or None, "--snapshot-every": snapshot_every}  # fmt: skip
    if cold_start and warm_start:
        raise typer.Exit(_fail("--cold-start and --warm-start: choose one (warm is the default "
                               "for the bundled trainer, cold for a script)"))  # fmt: skip
    if script:
        _check_script(script)
        refused = [name for name in TRAINER_ONLY if given[name] is not None]
        if refused:
            raise typer.BadParameter(
                f"{', '.join(refused)}: only for the bundled trainer; a script takes its own "
                "arguments after `--`"
            )
    preset = preset if preset is not None else DEFAULT_PRESET
    steps = steps if steps is not None else DEFAULT_STEPS
    ckpt_every = ckpt_every if ckpt_every is not None else DEFAULT_CKPT_EVERY
    if nproc < 1:
        raise typer.Exit(_fail(f"--nproc {nproc}: the ranks on this machine: 1 or more"))
    if rendezvous is not None:
        _check_endpoint(rendezvous)
    faults = [parse_inject(s, script=bool(script)) for s in inject or []]
    trainer_arg = [*(trainer_arg or []),
                   *(f"--fault={f.text()}" for f in faults if f.step is not None)]  # fmt: skip
    if not script:
        _check_trainer_args(preset, steps, ckpt_every, trainer_arg, snapshot_every)
    run_dir = (run_dir or Path("runs") / time.strftime("up-%Y%m%d-%H%M%S")).absolute()
    if ckpt_dir is not None:
        ckpt_dir = ckpt_dir.absolute()
    elif not script:
        ckpt_dir = run_dir / "ckpt"
    return _Plan(
        script=list(script or []), nproc=nproc, max_restarts=max_restarts, run_dir=run_dir,
        rendezvous=rendezvous, preset=preset, steps=steps, ckpt_every=ckpt_every,
        trainer_arg=trainer_arg, snapshot_every=snapshot_every, ckpt_dir=ckpt_dir,
        no_ckpt_key=no_ckpt_key, timed=[f for f in faults if f.at is not None],
        process_idle_seconds=process_idle_seconds,
        # warm by default for the bundled trainer; a script opts in (docs/architecture.md:
        # the agent sees a zero-code script's warm worker only through its shim)
        warm=warm_start or not (cold_start or script),
    )  # fmt: skip


@dataclass
class _Stack:
    """The run's files and environment (`_prepare`), then what `_start_daemons` started;
    `end` ends all of it."""

    run_dir: Path
    job: str
    env: dict  # the trainer's
    daemon_env: dict  # the daemons', as they were started
    key_file: Path | None
    token: Path
    fault_file: Path
    db: Path
    ports: tuple[int, int, int]  # agent, supervisor, rendezvous: distinct, each its daemon's
    rendezvous: str = ""  # HOST:PORT torchrun meets at
    started: float = field(default_factory=time.time)  # a job status older than this is not ours
    procs: list[subprocess.Popen] = field(default_factory=list)  # ended on the way out
    kept: list[KeptDaemon] = field(default_factory=list)  # restarted while the run lasts
    timers: list[threading.Timer] = field(default_factory=list)

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    @property
    def sup_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[1]}"

    def end(self) -> None:
        for t in self.timers:  # a pending fault never outlives the run
            t.cancel()
        procs = [d.proc for d in self.kept] + self.procs
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def _prepare(plan: _Plan) -> _Stack:
    """The run directory, its secrets and the environment of everything up starts."""
    run_dir = plan.run_dir
    _check_socket_room(run_dir)
    _prepare_run_dir(run_dir, plan.ckpt_dir)
    key_file = None if plan.no_ckpt_key else user_checkpoint_key()
    token, rdzv_secret = run_dir / "token", run_dir / "rendezvous.key"
    new_secret_file(token)
    new_secret_file(rdzv_secret)
    fault_file = run_dir / "faults"
    _private_file(fault_file).close()
    ports = free_ports(3)
    env = {**os.environ, "RANKGUARD_TELEMETRY_SOCKET": str(run_dir / "telemetry.sock"),
           "RANKGUARD_FAULT_FILE": str(fault_file),
           "RANKGUARD_SUPERVISOR": f"http://127.0.0.1:{ports[1]}",
           "RANKGUARD_STARTUP_TRACE": str(run_dir / STARTUP_TRACE)}  # fmt: skip
    if key_file is not None:  # the trainer's and the client library's checkpoint key
        env[KEY_FILE_ENV] = str(key_file)
    daemon_env = dict(env)  # as started: later additions are for the trainer only
    # The workers' flight recorders (what the Reporter reads while a rank stalls, and what
    # NCCL's watchdog dumps on a collective timeout, into the run's folder), unless the
    # user chose otherwise: client/flight_recorder.py
    recorder = run_dir / "flight-recorder"
    _own_dir(recorder, "the flight recorder's folder", private=True)
    flight_recorder.enable(env, dump_to=str(recorder / "rank_"))
    # zero-code scripts: the workers' collective watch reads those recorders live
    bootstrap.put_on_path(env)
    if plan.warm:  # restarts skip `import torch`: workers forked from a server that has it
        env["RANKGUARD_WARM_SOCKET"] = str(run_dir / "warm.sock")
    else:  # workers torchrun starts itself record their own exits: a start-up error
        # (every one failing before its process group formed) ends the job, unrestarted
        env[startup_guard.ENV] = str(run_dir / STARTUP_GUARD)
    if plan.script:
        # torchrun's c10d rendezvous shares one store across restarts, and a plain
        # script's init_process_group (env://) writes its gloo addresses under the same
        # keys each time: a restarted group could read the dead one's and hang (seen:
        # docs/architecture.md). With this, each round gets a fresh store.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return _Stack(run_dir=run_dir, job=run_dir.name, env=env, daemon_env=daemon_env,
                  key_file=key_file, token=token, fault_file=fault_file,
                  db=run_dir / "rankguard.db", ports=ports)  # fmt: skip


def _start_daemons(plan: _Plan, stack: _Stack) -> None:
    """The agent, the supervisor and (unless one was given) the rendezvous, kept running;
    the warm server and the snapshot holders, started with them."""
    run_dir, env, denv, token = stack.run_dir, stack.env, stack.daemon_env, stack.token
    agent_port, sup_port, rdzv_port = stack.ports
    agent_url, sup_url = stack.agent_url, stack.sup_url
    ckpt = ["--ckpt-dir", str(plan.ckpt_dir)] if plan.ckpt_dir else []
    starting = [
        _start("agent", ["agent", "--bind", f"127.0.0.1:{agent_port}", "--token-file", str(token),
                         "--telemetry-socket", env["RANKGUARD_TELEMETRY_SOCKET"], *ckpt,
                         "--interval", "0.5"],
               run_dir, denv, lambda: _get(agent_url + "/healthz") is not None),
        _start("supervisor", ["supervisor", "--agents", agent_url, "--db", str(stack.db),
                              "--token-file", str(token), "--bind", f"127.0.0.1:{sup_port}",
                              "--process-idle-seconds", str(plan.process_idle_seconds),
                              "--config", str(_local_supervisor_config(run_dir))],
               run_dir, denv, lambda: _get(sup_url + "/healthz") is not None),
    ]  # fmt: skip
    stack.procs.extend(d.proc for d in starting)  # ended on the way out if a start fails
    # torchrun's rendezvous store in its own process, not inside torchrun: the job
    # survives its restart (trainer/rendezvous.py), as on a cluster's control node
    stack.rendezvous = plan.rendezvous or f"127.0.0.1:{rdzv_port}"
    if plan.rendezvous is None:
        starting.append(_start("rendezvous", ["rendezvous", "--port", str(rdzv_port),
                                              "--bind", "127.0.0.1"],
                               run_dir, denv, lambda: reachable("127.0.0.1", rdzv_port)))  # fmt: skip
        stack.procs.append(starting[-1].proc)
    helpers: list[_Starting] = []  # started with the daemons, not restarted by `up`
    if plan.warm:
        helpers.append(_start_warm_server(run_dir, env))
    if plan.snapshot_every:  # holder A, replicating to B: a second node's holder, on one machine
        holders, flags = _start_holders(run_dir, denv)
        helpers += holders
        plan.trainer_arg += ["--snapshot-every", str(plan.snapshot_every), *flags]
    stack.procs.extend(h.proc for h in helpers)
    for started in starting:
        stack.kept.append(_keep(started, denv))
        stack.procs.remove(started.proc)  # the keeper's now (it may replace it)
    for helper in helpers:
        helper.wait()


def _torchrun_command(plan: _Plan, stack: _Stack) -> list[str]:
    rdzv = torchrun_args(stack.rendezvous, stack.job, (stack.run_dir / "rendezvous.key"))
    # a named rendezvous, so the workers' TORCHELASTIC_RUN_ID (the job's name in the
    # agent, discovery.py) is this run's name; --standalone would draw a random one
    head = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", *rdzv,
            f"--nproc-per-node={plan.nproc}", f"--max-restarts={plan.max_restarts}"]  # fmt: skip
    if plan.script:
        return [*head, *(warm_script(plan.script) if plan.warm else plan.script)]
    entry = ["rankguard.trainer.warm", "run"] if plan.warm else ["rankguard.trainer"]
    return [*head, "-m", *entry, "--preset", plan.preset, "--steps", str(plan.steps),
            "--ckpt-dir", str(plan.ckpt_dir), "--ckpt-every", str(plan.ckpt_every),
            "--job", stack.job, "--summary", str(stack.run_dir / "summary.json"),
            "--log-every", "50", *plan.trainer_arg]  # fmt: skip


def _train(plan: _Plan, stack: _Stack) -> tuple[subprocess.Popen, _Display, bool]:
    """torchrun with the job, the live view until it exits, the timed faults on their
    timers: (torchrun, the view, whether it was stopped after every rank had finished).
    Ctrl-C or SIGTERM meanwhile: training stopped, the summary printed, exit 130 or 143."""
    run_dir, sup_url, agent_url = stack.run_dir, stack.sup_url, stack.agent_url
    cmd = _torchrun_command(plan, stack)
    typer.echo(f"rankguard up: run {run_dir} | agent {agent_url} | supervisor {sup_url} "
               f"| rendezvous {stack.rendezvous}")  # fmt: skip
    # a second shell: `rankguard health`, `ranks`, `incidents`, `inject` find this run
    line = export_line({"RANKGUARD_SUPERVISOR": sup_url, "RANKGUARD_AGENT": agent_url,
                        "RANKGUARD_TOKEN_FILE": stack.token,
                        "RANKGUARD_FAULT_FILE": stack.fault_file,
                        "RANKGUARD_CKPT_DIR": plan.ckpt_dir, KEY_FILE_ENV: stack.key_file})  # fmt: skip
    with _private_file(run_dir / EXPORT_FILE) as f:
        f.write(line + "\n")
    typer.echo(f"rankguard up: in another shell: {line}")
    typer.echo(f"rankguard up: (or: . {run_dir / EXPORT_FILE})")
    with _private_file(run_dir / "trainer.log") as log:
        trainer = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=stack.env)
    stack.procs.append(trainer)
    display = _Display(sup_url, agent_url, stack.job, None if plan.script else plan.steps,
                       time.monotonic())  # fmt: skip
    for f in plan.timed:  # daemon timers, cancelled at the end
        t = threading.Timer(f.at, _inject, (f, agent_url, stack.token, stack.fault_file,
                                            plan.ckpt_dir, stack.job, display))  # fmt: skip
        t.daemon = True
        t.start()
        stack.timers.append(t)
    try:
        stuck_after_training = _Watch(display, stack.kept).run(trainer)
        if _SIGNALLED:  # taken, and dropped on the way (see _SIGNALLED)
            raise _SIGNALLED[-1]
    except KeyboardInterrupt as exc:
        _ignore_signals()  # a second one must not cut the cleanup
        how, code = _interruption(exc)
        display.close()
        typer.echo(f"rankguard up: {how}: stopping training", err=True)
        _end(trainer)
        _print_summary(display, how, stack.db, run_dir)
        typer.echo(f"rankguard up: incidents: rankguard incidents --db {stack.db}")
        raise typer.Exit(code) from None
    for t in stack.timers:
        t.cancel()
    display.look()
    display.close()
    return trainer, display, stuck_after_training


def _summarise(
    plan: _Plan, stack: _Stack, trainer: subprocess.Popen, display: _Display, stuck: bool
) -> int:
    """How the run ended, in words and an exit code (contract/exit_codes.py), the last
    error when it failed, and the summary."""
    run_dir, job, db = stack.run_dir, stack.job, stack.db
    cluster = _get(stack.sup_url + "/v1/cluster") or {}
    state = cluster.get("jobs", {}).get(job, {})
    verdict = state.get("verdict") if state.get("state") == "stopped" else None
    if trainer.returncode != 0 and verdict is None:
        verdict = _stop_verdict(db, job)
    completed = trainer.returncode == 0 or stuck
    failed_at_start = status = None
    if not completed:
        exits = startup_guard.read(run_dir / STARTUP_GUARD)
        failed_at_start = startup_guard.startup_failure(exits)
        status = exit_codes.read_status(stack.env["RANKGUARD_TELEMETRY_SOCKET"], job,
                                        since=stack.started)  # fmt: skip
    if failed_at_start is not None:
        typer.echo(f"rankguard up: training failed at start: rank {failed_at_start.rank} "
                   f"exited {failed_at_start.lived:.1f} s after its start, before its "
                   "process group formed; not restarted (it would fail the same way)",
                   err=True)  # fmt: skip
        code, how = exit_codes.USER_ERROR.code, "failed at start"
    elif completed and plan.script:
        typer.echo(f"rankguard up: training completed: {' '.join(plan.script)} exited 0")
        code, how = 0, "completed"
    elif completed and (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
        typer.echo(f"rankguard up: training completed: step {summary['final_step']}, loss "
                   f"{summary['final_loss']:.4f}, digest {summary['param_digest'][:16]}")  # fmt: skip
        code, how = 0, "completed"
    elif status is not None or verdict is not None:
        ended = status.exit_code if status else exit_codes.FAILED
        cause = f"cause {status.cause}: {status.why}" if status else "cause not recorded"
        typer.echo(f"rankguard up: the supervisor stopped the job: {verdict or status.why} "
                   f"({cause}; exit {ended.code}, {ended.name})", err=True)  # fmt: skip
        code, how = ended.code, "stopped by the supervisor"
    else:
        typer.echo(f"rankguard up: training failed (exit {trainer.returncode}); see "
                   f"{run_dir}/trainer.log", err=True)  # fmt: skip
        code, how = exit_codes.FAILED.code, f"failed (exit {trainer.returncode})"
    if code != 0:
        # the worker's own record first: the log interleaves every rank's output
        error = (failed_at_start and failed_at_start.error) or last_error(
            (run_dir / "trainer.log").read_text(errors="replace")
        )
        if error:
            whose = "the script's" if plan.script else "the trainer's"
            typer.echo(f"rankguard up: {whose} last error:\n{error}", err=True)
    restarted = [f"{d.name} {d.restarts}x" for d in stack.kept if d.restarts]
    if restarted:
        typer.echo(f"rankguard up: restarted during the run: {', '.join(restarted)}")
    _print_summary(display, how, db, run_dir)
    # the supervisor ends with `up`: point at its database, not at its URL
    typer.echo(f"rankguard up: incidents: rankguard incidents --db {db}")
    return code


def _ignore_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


FINISHED_GRACE_SECONDS = 60.0  # torchrun exits within a second or so of its last worker


def training_finished(ranks: list[dict], job: str) -> bool:
    """Every rank of the job's newest incarnation has finished (`/v1/ranks` rows)."""
    mine = [r for r in ranks if r.get("job") == job and isinstance(r.get("restart"), int)]
    if not mine:
        return False
    newest = max(r["restart"] for r in mine)
    return all(r.get("state") == "finished" for r in mine if r["restart"] == newest)


class _Display:
    """The live view's I/O: reads the supervisor and the agent, keeps what up saw last
    (for the summary: the supervisor may be gone by then), and draws it: one rich panel
    redrawn in place on a terminal, a plain line now and then on a pipe."""

    def __init__(self, sup_url: str, agent_url: str, job: str, total: int | None, start: float):
        self.sup_url, self.agent_url, self.job, self.total, self.start = (
            sup_url, agent_url, job, total, start)  # fmt: skip
        self.tty = sys.stdout.isatty()
        self.period = 1.0 if self.tty else 5.0
        self.history: list[tuple[float, int]] = []
        self.snapshot: lv.Snapshot | None = None
        self.view: lv.View | None = None
        self.checkpoint_step: int | None = None
        self.stepped = False  # a rank reported a step: the supervisor can count useful time
        self.last_cluster: dict | None = None  # the summary's goodput, if the supervisor has gone
        self._lock = threading.Lock()  # inject timers print too
        self._live = None
        if self.tty:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(), auto_refresh=False, transient=False)
            self._live.start()

    def look(self, notes: tuple[str, ...] = ()) -> lv.View:
        cluster = _get(self.sup_url + "/v1/cluster")
        incidents = (_get(self.sup_url + "/v1/incidents") or {}).get("incidents")
        ranks = (_get(self.agent_url + "/v1/ranks") or {}).get("ranks")
        old = self.snapshot
        if cluster is None:  # not "waiting for ranks": nobody is watching them right now
            notes = ("supervisor not answering", *notes)
        elapsed = time.monotonic() - self.start
        snap = lv.Snapshot(
            job=self.job, elapsed=elapsed, total_steps=self.total, cluster=cluster,
            ranks=ranks if ranks is not None else (old.ranks if old else []),
            incidents=incidents if incidents is not None else (old.incidents if old else []),
            notes=notes, checkpoint_step=self.checkpoint_step,
        )  # fmt: skip
        self.checkpoint_step = lv.checkpoint_step(snap)
        first = lv.view(snap)
        if first.step is not None:
            self.stepped = True
            if self.history and first.step < self.history[-1][1]:
                self.history.clear()  # a restart went back to a checkpoint
            self.history = [*self.history[-40:], (elapsed, first.step)]
        self.snapshot = snap
        self.view = lv.view(snap, lv.steps_per_second(self.history), previous=self.view)
        if cluster is not None:
            self.last_cluster = cluster
        with self._lock:
            if self._live is not None:
                self._live.update(lv.panel(self.view, f"rankguard up: {self.job}"), refresh=True)
            else:
                typer.echo(lv.plain_line(self.view))
        return self.view

    def event(self, text: str, err: bool = False) -> None:
        with self._lock:
            if self._live is not None:
                self._live.console.print(text, markup=False, highlight=False)
            else:
                typer.echo(text, err=err)

    def close(self) -> None:
        with self._lock:
            if self._live is not None:
                self._live.stop()
                self._live = None

    def ranks(self) -> list[dict]:
        return self.snapshot.ranks if self.snapshot else []

    def useful_seconds(self) -> float | None:
        """The useful step time the supervisor counted; None (unknown) for a job whose
        ranks never reported a step (a zero-code script): its 0 means nothing was seen."""
        if not self.stepped:
            return None
        job = (self.last_cluster or {}).get("jobs", {}).get(self.job) or {}
        return job.get("useful_seconds")


class _Watch:
    """Until the trainer exits: keep the daemons running (checked every half second, so a
    dead supervisor is back within seconds) and refresh the view.

    Never without a bound once training is over: when every rank has finished and
    torchrun is still there FINISHED_GRACE_SECONDS later (a stopped launcher, or a
    stand-in the supervisor could not end), torchrun is stopped; run() returns True then."""

    def __init__(self, display: _Display, kept: list[KeptDaemon]):
        self.display, self.kept = display, kept

    def run(self, trainer: subprocess.Popen) -> bool:
        d, start = self.display, self.display.start
        next_look = 0.0
        finished_at: float | None = None
        while trainer.poll() is None:
            now = time.monotonic()
            for k in self.kept:
                event = k.tick()
                if event:
                    d.event(f"{now - start:6.1f}s rankguard up: {event}")
            if now >= next_look:
                d.look(tuple(n for n in (k.note() for k in self.kept) if n))
                next_look = now + d.period
                if not training_finished(d.ranks(), d.job):
                    finished_at = None
                elif finished_at is None:
                    finished_at = now
                elif now - finished_at > FINISHED_GRACE_SECONDS:
                    d.event(f"rankguard up: every rank finished {now - finished_at:.0f}s ago but "
                            "torchrun has not exited; stopping it", err=True)  # fmt: skip
                    _end(trainer)
                    return True
            time.sleep(0.5)
        return False


def _print_summary(display: _Display, how: str, db: Path, run_dir: Path) -> None:
    """The closing summary from what up saw last, with the incidents from the database
    when the supervisor no longer answers (Ctrl-C reaches it too on a terminal)."""
    incidents = (_get(display.sup_url + "/v1/incidents") or {}).get("incidents")
    if incidents is None and db.is_file():
        incidents = _incidents_from_db(db)
    if incidents is None:
        incidents = display.snapshot.incidents if display.snapshot else []
    view = display.view
    loss = None
    if how == "completed" and (run_dir / "summary.json").is_file():
        with contextlib.suppress(OSError, ValueError):
            loss = json.loads((run_dir / "summary.json").read_text()).get("final_loss")
    outcome = lv.Outcome(
        how=how, wall_seconds=time.monotonic() - display.start,
        step=view.step if view else None, total_steps=display.total,
        useful_seconds=display.useful_seconds(),
        incidents=[i for i in incidents if i.get("job") in (None, display.job)],
        final_loss=loss,
    )  # fmt: skip
    for line in lv.summary_lines(outcome):
        typer.echo(line)


def _incidents_from_db(db: Path) -> list[dict] | None:
    from .supervisor import read_incidents_db

    try:
        return read_incidents_db(db)["incidents"]
    except typer.Exit:
        return None


def _end(proc: subprocess.Popen, grace: float = 15.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()  # a stopped torchrun: SIGKILL ends it all the same
        proc.wait()


def warm_script(script: list[str]) -> list[str]:
    """torchrun's program for a script run warm: the shim, told what to run
    (trainer/warm.py parse_target): `-m rankguard.trainer.warm run --script PATH ARGS` or
    `... run --module NAME ARGS`."""
    if script[0] == "-m":
        return ["-m", "rankguard.trainer.warm", "run", "--module", *script[1:]]
    return ["-m", "rankguard.trainer.warm", "run", "--script", *script]


# up's own flags that the trainer's errors name by the same name; any other was a --trainer-arg
_UP_FLAGS = ("--preset", "--steps", "--ckpt-every", "--snapshot-every")


def _check_trainer_args(
    preset: str, steps: int, ckpt_every: int, extra: list[str], snapshot_every: int | None
) -> None:
    """The bundled trainer's command line as up will give it, checked by the trainer's own
    rules (trainer/config.py) before anything starts: exit 2 with its one line. The paths
    up fills in later are stand-ins here: only the values the user chose are judged."""
    from rankguard.trainer.config import check_args

    argv = ["--preset", preset, "--steps", str(steps), "--ckpt-dir", "ckpt",
            "--ckpt-every", str(ckpt_every), "--job", "check", *extra]  # fmt: skip
    if snapshot_every:
        argv += ["--snapshot-every", str(snapshot_every), "--snapshot-holder", "holder.sock"]
    problem = check_args(argv, environ={})
    if problem is None:
        return
    where = "" if any(f in problem for f in _UP_FLAGS) else " (--trainer-arg)"
    raise typer.Exit(_fail(f"the bundled trainer: {problem}{where}"))


def _check_script(script: list[str]) -> None:
    """`SCRIPT.py [ARGS]` (an existing file) or `-m MODULE [ARGS]`: what torchrun takes."""
    if script[0] == "-m":
        if len(script) < 2 or not script[1] or script[1].startswith("-"):
            raise typer.BadParameter("-m needs a module name: -- -m MODULE [ARGS...]")
        return
    if script[0].startswith("-"):
        raise typer.BadParameter(
            f"{script[0]!r} after `--`: expected SCRIPT.py [ARGS...] or -m MODULE [ARGS...]"
        )
    if not Path(script[0]).is_file():
        raise typer.BadParameter(f"{script[0]}: no such file")


_TRACEBACK = "Traceback (most recent call last):"
# `ModuleNotFoundError: ...`, `torch.OutOfMemoryError: ...`, `KeyboardInterrupt`
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(:|$)")
# torchrun's own exceptions, never the workers': a worker failed (ChildFailedError), torchrun
# was told to stop (SignalException: up's teardown), a start-up error was not restarted
_LAUNCHER_ERRORS = ("ChildFailedError", "SignalException", "StartupFailure")
# argparse's last line: `train.py: error: unrecognized arguments: --stepz 10`
_ARGPARSE_ERROR = re.compile(r"^(?:\[\w-]+\]:)?\S+: error: .+$")


def _tracebacks(log: str, limit: int) -> list[tuple[int, str]]:
    """(line index, text) of each complete worker traceback in a log."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if line.rstrip().endswith(_TRACEBACK)]
    found = []
    for start in starts:
        prefix = lines[start][: len(lines[start].rstrip()) - len(_TRACEBACK)]
        out = [_TRACEBACK]
        for line in lines[start + 1 :]:
            body = line[len(prefix) :] if prefix and line.startswith(prefix) else line
            if body.startswith(" "):
                out.append(body)
            elif _EXCEPTION_LINE.match(body):
                out.append(body)
                break
        else:
            continue  # no exception line: cut off, or only another rank's fragments
        if not any(name in out[-1] for name in _LAUNCHER_ERRORS):
            found.append((start, "\n".join(out[-limit:])))
    return found


def last_traceback(log: str, limit: int = 40) -> str | None:
    """The last Python traceback of the script in a log (its workers' stderr, as torchrun
    passes it on), up to its exception line; torchrun's own (a ChildFailedError, the
    SignalException of its teardown) are skipped. Ranks write their tracebacks to one log
    at once, so a line from another rank may cut into one: an unindented line that is not
    an exception line is left out. None when there is none."""
    found = _tracebacks(log, limit)
    return found[-1][1] if found else None


def last_error(log: str, limit: int = 40) -> str | None:
    """The workers' last error in a log: their last traceback (last_traceback), or an
    argument parser's `PROG: error: ...` line, whichever came later. None when neither."""
    found = _tracebacks(log, limit)
    for i, line in reversed(list(enumerate(log.splitlines()))):
        if _ARGPARSE_ERROR.match(line.strip()):
            if not found or found[-1][0] < i:
                return line.strip()
            break
    return found[-1][1] if found else None


def _inject(
    fault, agent_url: str, token: Path, fault_file: Path, ckpt_dir: Path | None, job: str, display
) -> None:
    """A timed `--inject`: `rankguard inject` with the same spec, less its time."""
    from dataclasses import replace

    spec = replace(fault, at=None, note=None).text()
    args = [sys.executable, "-m", "rankguard.cli.main", "inject", spec,
            "--agent", agent_url, "--token-file", str(token), "--fault-file", str(fault_file),
            *(["--ckpt-dir", str(ckpt_dir)] if ckpt_dir else []), "--job", job]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True)
    display.event(f"{time.monotonic() - display.start:6.1f}s "
                  + (proc.stdout or proc.stderr).strip())  # fmt: skip
