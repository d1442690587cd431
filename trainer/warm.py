"""Warm start: workers forked from a process that has already imported torch.

A cold torchrun restart spends most of its time importing torch in every new worker
(`bench/recovery.py`: 1.6 s of a 2.5 s restart on the tiny preset). Here a per-node
server imports the trainer once and forks a worker per request; torchrun starts a light
shim instead of the trainer, which hands its argv, environment, cwd and stdio to the
server and then stands in for the worker:

    python -m rankguard.trainer.warm serve --socket /run/rankguard/warm.sock &
    RANKGUARD_WARM_SOCKET=/run/rankguard/warm.sock \\
        torchrun ... -m rankguard.trainer.warm run --preset tiny ...

The shim forwards signals to the worker and exits the way the worker did (same exit code,
same fatal signal), so torchrun's failure handling is unchanged. A worker whose shim
dies (torchrun SIGKILLs it) kills itself. Without a server the shim runs the trainer
itself, cold. The server must never have touched CUDA or started a process group: it
only imports. Where a fork would not be what a cold start is, the server refuses and the
shim starts cold, saying why in one line (trainer/warm_checks.py): CUDA initialised in the
server, or the job's environment differing in a variable torch read at import
(TORCHINDUCTOR_*, TORCH_LOGS, ...). The worker takes the shim's CPUs (and, on cgroup v2
where permitted, its cgroup), so torchrun's, numactl's or Slurm's binding holds.

The user's own script runs warm too (`run --script PATH ARGS` or `run --module NAME
ARGS`): the worker runs it with runpy as `python PATH ARGS` / `python -m NAME ARGS` would
(`__main__`, sys.argv, sys.path[0]); the server pre-imports torch (through the trainer)
and the modules the shim's RANKGUARD_WARM_PRELOAD names (comma-separated; importing them
must start no process group; one that initialises CUDA makes every later worker start cold).

The worker's parent is the server, not torchrun; the agent finds the job's torchrun
launcher (for stop-job) through the pidfd the worker holds on its shim
(`agent/control.py: launcher_pid`). `rankguard up` runs all of this (docs: README).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from pathlib import Path

from . import warm_checks

ENV = "RANKGUARD_WARM_SOCKET"
PRELOAD_ENV = "RANKGUARD_WARM_PRELOAD"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_LEN = struct.Struct("!I")
MAX_REQUEST = 1 << 20


# -- shim (no torch import: it must start in milliseconds) ---------------------------------


def run(argv: list[str]) -> int:
    path = os.environ.get(ENV)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not path:
            raise OSError(f"{ENV} is not set")
        conn.connect(path)
    except OSError as exc:
        conn.close()
        return _start_cold(argv, f"no server ({exc})")
    preload = [m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m]
    request = json.dumps(
        {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "preload": preload,
         "cpus": sorted(os.sched_getaffinity(0))}  # the worker takes them: torchrun's binding
    ).encode()  # fmt: skip
    fds = array.array("i", [0, 1, 2])
    conn.sendmsg([_LEN.pack(len(request)) + request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    replies = conn.makefile("r")
    reply = json.loads(replies.readline())
    if "cold" in reply:  # the server would not fork a worker like a cold one (warm_checks)
        conn.close()
        return _start_cold(argv, reply["cold"])
    child = reply["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: _signal_quietly(child, s))
    line = replies.readline()
    if not line:  # the server died: the worker is nobody's child now; wait for it to end
        _wait_for_exit(child)
        return 1
    status = json.loads(line)
    sig = status.get("signal")
    if sig:
        if sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)  # SIGKILL has no handler to reset
        os.kill(os.getpid(), sig)  # die as the worker did: torchrun reads it
    return int(status.get("exit", 1))


def _start_cold(argv: list[str], why: str) -> int:
    print(f"rankguard warm: {why}; starting cold", file=sys.stderr, flush=True)
    return run_target(argv)


def _signal_quietly(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    select.select([fd], [], [])
    os.close(fd)


# -- what a worker runs (pure parts apart) ----------------------------------------------------


def parse_target(argv: list[str]) -> tuple[str, str | None, list[str]]:
    """The shim's argv -> (kind, name, args): ("trainer", None, trainer args),
    ("script", PATH, args) for `--script PATH ARGS`, ("module", NAME, args) for
    `--module NAME ARGS`. ValueError when the path or name is missing."""
    if argv[:1] in (["--script"], ["--module"]):
        if len(argv) < 2 or not argv[1]:
            raise ValueError(f"{argv[0]} needs a {argv[0][2:]} name")
        return argv[0][2:], argv[1], argv[2:]
    return "trainer", None, list(argv)


def script_path0(kind: str, name: str, cwd: str) -> str:
    """sys.path[0] as Python sets it: the script's own directory (symlinks resolved) for
    `python PATH`, the working directory for `python -m NAME`."""
    if kind == "script":
        return os.path.dirname(os.path.realpath(os.path.join(cwd, name)))
    return cwd


def exit_code(exc: BaseException | None) -> int:
    """The exit status a Python process ends with: SystemExit(None) 0, SystemExit(n) n,
    SystemExit(anything else) 1 (printed to stderr, as Python does); an uncaught exception
    1 (the caller prints its traceback)."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        print(code, file=sys.stderr)
        return 1
    return 1


def run_target(argv: list[str]) -> int:
    """Run the trainer, a script or a module in this process, the way `python` would;
    returns its exit status (a KeyboardInterrupt ends the process by SIGINT, as Python's)."""
    import runpy

    try:
        kind, name, args = parse_target(argv)
    except ValueError as exc:
        print(f"rankguard warm: {exc}", file=sys.stderr)
        return 2
    if kind == "trainer":
        from .train import main

        return main(args)
    sys.path[0:1] = [script_path0(kind, name, os.getcwd())]
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in `python`
    error: BaseException | None = None
    try:
        if kind == "script":
            sys.argv = [name, *args]
            runpy.run_path(name, run_name="__main__")
        else:
            sys.argv = ["-m", *args]  # run_module puts the module's file in argv[0]
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except SystemExit as exc:
        error = exc
    except BaseException as exc:  # noqa: BLE001 - an uncaught exception, as Python ends
        traceback.print_exc()
        error = exc
    _python_exit()
    return exit_code(error)


def _python_exit() -> None:
    """What the interpreter does at a normal exit before the worker's os._exit: wait for
    non-daemon threads, run atexit handlers."""
    import atexit

    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()


# -- server -------------------------------------------------------------------------------


def spawn_server(path, env: dict | None = None, stdout=None):
    """`serve` as a child process, not waited for: its socket appears once torch is imported."""
    import subprocess

    return subprocess.Popen(
        [sys.executable, "-m", "rankguard.trainer.warm", "serve", "--socket", str(path)],
        env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
    )  # fmt: skip


def start_server(path, env: dict | None = None, stdout=None, timeout: float = 60):
    """Start `serve` as a child process and wait for its socket (importing torch takes a
    few seconds); RuntimeError if it exits or does not listen in time."""
    import time

    proc = spawn_server(path, env, stdout)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the warm-start server did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return proc


def serve(path: str) -> int:
    server_env = dict(os.environ)  # what torch reads at import below: warm_checks.unhonoured
    # DDP's constructor imports torch._dynamo on first use (0.74 s of a worker's 1.0 s
    # model build on this machine, by cProfile of a resumed start): import it here once,
    # else every warm restart pays it. An import only: no CUDA, no process group.
    import torch._dynamo  # noqa: F401

    from . import train  # noqa: F401 - the point of the server: pay for torch once

    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)  # forks run as the server's user: only that user may ask
    listener.listen(64)
    print(f"rankguard warm: serving on {path}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    cuda_by: str | None = None  # the preloaded module that initialised CUDA, if one did
    while True:
        conn, _ = listener.accept()
        try:
            request, fds, shim_pid = _read_request(conn)
        except (OSError, ValueError) as exc:
            print(f"rankguard warm: bad request refused: {exc}", file=sys.stderr, flush=True)
            conn.close()
            continue
        cuda_by = cuda_by or _preload(request.get("preload"))
        why = _why_cold(request["env"], server_env, cuda_by)
        if why:
            _refuse(conn, fds, shim_pid, why)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            _become_worker(conn, request, fds, shim_pid, server_env)  # never returns
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        threading.Thread(target=_report_exit, args=(conn, pid), daemon=True).start()


def _preload(names) -> str | None:
    """Import what the shim's request names, once, in the server: later forks have it. A
    module that fails to import is skipped (the worker will raise it). Returns the first
    module whose import left CUDA initialised: no worker is forked from then on."""
    for name in names if isinstance(names, list) else []:
        if isinstance(name, str) and name and name not in sys.modules:
            try:
                __import__(name)
            except Exception as exc:  # noqa: BLE001 - the user's module: report, go on
                print(f"rankguard warm: preload {name}: {exc}", file=sys.stderr, flush=True)
            if warm_checks.cuda_initialised():
                return name
    return None


def _why_cold(job_env: dict, server_env: dict, cuda_by: str | None) -> str | None:
    """Why a fork of this server would not be the worker a cold start gives, or None."""
    if warm_checks.cuda_initialised():
        by = f" by {PRELOAD_ENV} module {cuda_by}" if cuda_by else ""
        return f"CUDA was initialised in the warm server{by}: a forked worker cannot use it"
    names = warm_checks.unhonoured(server_env, job_env)
    return warm_checks.env_reason(names) if names else None


def _refuse(conn: socket.socket, fds: list[int], shim: int, why: str) -> None:
    """Tell the shim to run its target itself; the server's log says so too."""
    print(f"rankguard warm: shim {shim} starts cold: {why}", file=sys.stderr, flush=True)
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):  # the shim is gone already
        conn.sendall(json.dumps({"cold": why}).encode() + b"\n")
    conn.close()


def _read_request(conn: socket.socket) -> tuple[dict, list[int], int]:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    shim_pid, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise ValueError(f"peer uid {uid} is not the server's")
    fds_size = socket.CMSG_LEN(3 * array.array("i").itemsize)
    data, ancdata, _, _ = conn.recvmsg(MAX_REQUEST, fds_size)
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected stdin, stdout and stderr, got {len(fds)} descriptors")
    (size,) = _LEN.unpack_from(data)
    while len(data) < _LEN.size + size:
        more = conn.recv(MAX_REQUEST)
        if not more:
            raise ValueError("request cut short")
        data += more
    request = json.loads(data[_LEN.size : _LEN.size + size])
    env, cpus = request.get("env"), request.get("cpus", [])
    if not isinstance(request.get("argv"), list) or not isinstance(env, dict):
        raise ValueError("request needs argv (list) and env (object)")
    if not all(isinstance(v, str) for kv in env.items() for v in kv):
        raise ValueError("env must map strings to strings")
    if not isinstance(cpus, list) or not all(isinstance(c, int) and c >= 0 for c in cpus):
        raise ValueError("cpus must be a list of CPU numbers")
    return request, list(fds), shim_pid


def _become_worker(conn: socket.socket, request: dict, fds: list[int], shim: int, server_env: dict):
    code = 1
    try:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request.get("cwd") or "/")
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["rankguard.trainer", *request["argv"]]  # a script's: run_target
        # before any thread starts: threads take the CPUs of the thread that creates them
        _take_shims_place(shim, request.get("cpus"))
        _set_threads(server_env.get("OMP_NUM_THREADS"))
        _die_with(shim)
        code = run_target(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _take_shims_place(shim: int, cpus: list[int] | None) -> None:
    """Run where the shim was put (torchrun, numactl, Slurm --cpu-bind): its cgroup where
    permitted (cgroup v2; a cgroup that refuses us is no error: often only root may move
    processes), then its CPUs, saying so in one line when they cannot be had."""
    with contextlib.suppress(OSError):
        procs = warm_checks.cgroup_procs(Path(f"/proc/{shim}/cgroup").read_text())
        if procs and procs != warm_checks.cgroup_procs(Path("/proc/self/cgroup").read_text()):
            Path(procs).write_text(str(os.getpid()))
    if not cpus:
        return
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cpus)
    got = sorted(os.sched_getaffinity(0))
    if got != cpus:
        print(
            f"rankguard warm: the worker runs on CPUs {got}, not the shim's {cpus}",
            file=sys.stderr,
            flush=True,
        )


def _set_threads(server_omp: str | None) -> None:
    """torch fixed its thread count from the server's environment and CPUs at import."""
    import torch

    threads = warm_checks.worker_threads(
        os.environ.get("OMP_NUM_THREADS"),
        server_omp,
        torch.get_num_threads(),
        len(os.sched_getaffinity(0)),
    )
    if threads:
        torch.set_num_threads(threads)


def _die_with(shim: int) -> None:
    """torchrun watches and kills the shim; the worker must not outlive it."""
    try:
        fd = os.pidfd_open(shim)
    except ProcessLookupError:
        os._exit(1)

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="warm-shim-watch").start()


def _report_exit(conn: socket.socket, pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    reply = (
        {"signal": os.WTERMSIG(status)}
        if os.WIFSIGNALED(status)
        else {"exit": os.waitstatus_to_exitcode(status)}
    )
    try:
        conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:
        pass  # the shim is gone already
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"] and len(argv) == 3 and argv[1] == "--socket":
        return serve(argv[2])
    if argv[:1] == ["run"]:
        return run(argv[1:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
