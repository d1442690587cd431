"""Control actions on local rank processes: only registered, still-alive ranks, never a PID.

The caller names a rank of a job; the rank table turns that into a PID only if the rank
registered through telemetry (its pid verified by the kernel), is alive, and its
process create time is unchanged (no recycled PID).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from ..contract import exit_codes, save_requests
from ..contract.errors import ContractError
from ..contract.exit_codes import JobStatus
from ..contract.save_requests import SaveRequest, request_path
from . import processes
from .processes import (
    REFUSED,
    RankLookupError,
    descendants,
    launcher_identity,
    launcher_pid,
    process_uid,
    signal_exact,
    still_launcher,
)

ALLOWED_SIGNALS = (
    "SIGTERM",
    "SIGKILL",
    "SIGINT",
    "SIGSTOP",
    "SIGCONT",
    "SIGUSR1",
    "SIGUSR2",
    "SIGABRT",
)


def refused_counts() -> dict[str, int]:
    return dict(REFUSED)


class ControlError(Exception):
    """A refused or failed action; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_target(body: dict) -> tuple[str, int]:
    job, rank = body.get("job"), body.get("rank")
    if not isinstance(job, str) or not job:
        raise ControlError(400, "body needs 'job' (a non-empty string)")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ControlError(400, "body needs 'rank' (an integer >= 0)")
    return job, rank


def resolve_pid(table, job: str, rank: int) -> int:
    try:
        return table.verified_pid(job, rank)
    except RankLookupError as exc:
        raise ControlError(404, str(exc)) from None


def send_signal(table, body: dict) -> dict:
    job, rank = parse_target(body)
    name = body.get("signal", "SIGTERM")
    if name not in ALLOWED_SIGNALS:
        raise ControlError(400, f"signal must be one of {', '.join(ALLOWED_SIGNALS)}")
    # SIGKILL reaches the rank's stand-in too (a warm-start shim: what torchrun watches),
    # since a stand-in cannot forward it; a stopped one would otherwise keep the killed
    # rank's death from torchrun. Other signals the shim forwards itself.
    stand_in = table.stand_in_pid(job, rank) if name == "SIGKILL" else None
    try:
        pid = resolve_pid(table, job, rank)
    except ControlError:
        if stand_in is None:
            raise
        pid = None  # the rank has ended (finished, say) but torchrun cannot see it
    sig = getattr(signal, name)
    # SIGKILL ends what the rank started too (its DataLoader workers: one blocked in a read
    # never notices its parent's death and would outlive it), listed before the rank dies
    # and they lose their parent link
    children = descendants(pid) if pid is not None and name == "SIGKILL" else []
    if pid is not None:
        try:
            if stand_in is None:
                os.kill(pid, sig)
            else:
                _kill_and_wait(pid, sig, STAND_IN_WAIT_SECONDS)
        except ProcessLookupError:
            if stand_in is None:  # else it died with its stand-in
                raise ControlError(
                    404, f"rank {rank} of job {job}: process {pid} is gone"
                ) from None
        except PermissionError:
            raise ControlError(403, f"not permitted to signal process {pid}") from None
    if stand_in is not None:
        try:
            os.kill(stand_in, sig)
        except ProcessLookupError:
            pass  # it ended with its worker (the shim exits the way its worker did)
        except PermissionError:
            raise ControlError(403, f"not permitted to signal process {stand_in}") from None
    for child in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)
    out = {"job": job, "rank": rank, "pid": pid, "signal": name, "sent": True}
    if children:
        out["descendants"] = children
    if stand_in is not None:
        out["stand_in"] = stand_in
    return out


# How long a SIGKILL waits for a warm-started rank to be gone before its stand-in is
# killed. The rank first: torchrun reacts to the stand-in's death by tearing the peers
# down, so a stand-in killed first let a peer die (SIGTERM through its own shim) before
# the killed rank had finished exiting (a large process takes tens of milliseconds under
# load), and the dead detector, which names the first rank to die, named the peer.
STAND_IN_WAIT_SECONDS = 2.0


def _kill_and_wait(pid: int, sig: int, timeout: float) -> bool:
    """Signal `pid` through a pidfd and wait until it has terminated (a zombie counts);
    False if it still runs after `timeout`. ProcessLookupError if it is gone already."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except (OSError, AttributeError):  # no pidfds here (old kernel, seccomp): no wait
        os.kill(pid, sig)
        return False
    try:
        signal.pidfd_send_signal(fd, sig)
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


def py_spy_path() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_stacks(table, body: dict, timeout: float = 20.0) -> dict:
    """Stacks of a rank with py-spy, native frames included where py-spy can read them: a
    rank waiting on NCCL sits in a CUDA sync or an NCCL/c10d call, which only native frames
    show. `--native` pauses the process while it unwinds (py-spy has no non-blocking native
    mode), so a stopped rank, which must stay stopped, and a failed or slow native read get
    the plain non-blocking dump instead: a capture never fails because of --native."""
    job, rank = parse_target(body)
    pid = resolve_pid(table, job, rank)
    tool = py_spy_path()
    if tool is None:
        raise ControlError(501, "py-spy is not installed on this node")
    deadline = time.monotonic() + timeout
    stat = processes.read_proc_stat(pid)
    if stat is not None and stat.state not in "Tt":
        # half the time at most, so that the plain dump keeps the rest
        done = _py_spy(tool, pid, "--native", timeout / 2)
        if done is not None and done.returncode == 0:
            return {"job": job, "rank": rank, "pid": pid, "stacks": done.stdout, "native": True}
    proc = _py_spy(tool, pid, "--nonblocking", max(1.0, deadline - time.monotonic()))
    if proc is None:
        raise ControlError(504, f"py-spy did not answer within {timeout:.0f} s")
    if proc.returncode != 0:
        raise ControlError(502, f"py-spy failed: {(proc.stderr or proc.stdout).strip()[-500:]}")
    return {"job": job, "rank": rank, "pid": pid, "stacks": proc.stdout, "native": False}


def _py_spy(tool: str, pid: int, mode: str, timeout: float) -> subprocess.CompletedProcess | None:
    """`py-spy dump` of `pid` in `mode`; None when it took longer than `timeout` (py-spy is
    killed, and the kernel lets go of a process it had paused)."""
    try:
        return subprocess.run(
            [tool, "dump", "--pid", str(pid), mode],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None


def stop_job(table, socket_path: str, body: dict) -> dict:
    """End a job on this node: SIGTERM its torchrun launcher(s), so the elastic agent tears
    the workers down and does not restart them; live ranks without a launcher get SIGTERM.
    Works between incarnations too (every rank dead, torchrun about to restart them): the
    launchers are remembered from the ranks' registration.

    A launcher is a rank's real parent remembered by pid and start time, and it is
    signalled only while that pid still has that start time and the rank owner's uid
    (a recycled pid, or a process of another user, is never signalled).

    ``status`` (the incident's cause, contract/exit_codes.py) is written, before any
    signal, where the job's launcher wrapper reads it to choose its exit code."""
    job = body.get("job")
    if not isinstance(job, str) or not job:
        raise ControlError(400, "body needs 'job' (a non-empty string)")
    status, given = None, body.get("status")
    if given is not None:
        if not isinstance(given, dict):
            raise ControlError(400, "'status' must be an object")
        try:
            status = JobStatus.from_json({**given, "job": job, "time": time.time()})
        except ContractError as exc:
            raise ControlError(400, f"bad status: {exc}") from None
    remembered = table.launchers(job)
    launchers = {pid for (pid, start), uid in remembered.items() if still_launcher(pid, start, uid)}
    REFUSED["stale_launcher"] += len(remembered) - len(launchers)
    starts = {pid: start for pid, start in remembered}
    orphans = []
    for j, rank, _ in table.processes():
        if j != job:
            continue
        try:
            verified = resolve_pid(table, job, rank)
        except ControlError:
            continue  # gone since the listing (torchrun tore it down): the remembered
            # launchers cover it, and a rank that ended needs no signal
        stat = processes.read_proc_stat(verified)
        launcher = launcher_pid(verified, stat.ppid) if stat is not None else None
        ident = launcher_identity(launcher)
        if ident is not None and still_launcher(*ident, process_uid(verified)):
            launchers.add(ident[0])
            starts[ident[0]] = ident[1]
        else:
            orphans.append(verified)
    if not launchers and not orphans:
        raise ControlError(404, f"no launcher or live rank of job {job} on this node")
    if status is not None:
        _write_beside_socket(exit_codes.status_path(socket_path, job), exit_codes.encode(status))
    launchers = {pid for pid in launchers if signal_exact(pid, starts[pid], signal.SIGTERM)}
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):  # already gone: that is the goal
            os.kill(pid, signal.SIGTERM)
    return {"job": job, "launchers": sorted(launchers), "ranks_signalled": orphans}


def write_save_request(table, socket_path: str, body: dict) -> dict:
    """Ask a job's ranks on this node to checkpoint at a step (contract/save_requests.py):
    the request goes, whole or not at all, where their Reporters read it; ``step`` None
    withdraws it. Only for a job with live ranks here."""
    try:
        request = SaveRequest.from_json(body)
    except ContractError as exc:
        raise ControlError(400, f"bad save request: {exc}") from None
    path = request_path(socket_path, request.job)
    if request.step is None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return {"job": request.job, "withdrawn": True, "path": str(path)}
    ranks = sorted(rank for job, rank, _ in table.processes() if job == request.job)
    if not ranks:
        raise ControlError(404, f"no live rank of job {request.job} on this node")
    _write_beside_socket(path, save_requests.encode(request))
    return {"job": request.job, "step": request.step, "ranks": ranks, "path": str(path)}


def _write_beside_socket(path: Path, data: bytes) -> None:
    """Write a file the job's processes read, whole or not at all, into a folder beside
    the telemetry socket that the agent owns (never through a link)."""
    path.parent.mkdir(mode=0o755, exist_ok=True)
    folder = os.lstat(path.parent)
    if not stat.S_ISDIR(folder.st_mode) or folder.st_uid != os.geteuid():
        # a link or another user's folder: writing there could land anywhere
        raise ControlError(500, f"{path.parent} is not a folder of the agent's own")
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)  # the job reads it, whoever it runs as (and whatever the umask)
    os.replace(tmp, path)
