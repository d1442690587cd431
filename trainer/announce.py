"""A worker tells the agent it has started before anything slow (stdlib only).

Without this, a restarted worker sends its first record after `import torch`, the
rendezvous and process-group init, so a worker stopped or stuck there is invisible: the
agent does not know its process, and the supervisor sees only the dead incarnation.
`announce()` runs first thing (`python -m rankguard.trainer` calls it before importing
the trainer; a warm-started worker at the top of `main`): one `init` record, and a
daemon thread that re-announces `init` each second while the process moves (CPU or I/O,
client/reporter.py ProcessProgress), until the trainer's reporter takes over (`stop`).

The record's `restart` is the incarnation rank 0 is about to claim (`agree_incarnation`):
the checkpoint directory's next number, at least torchrun's restart count. Every rank
reads it before its process-group init, and rank 0 claims only after that init, which
waits for every rank: so the guess is what the claim will be. Nothing here raises.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping

_state: dict = {}  # pid -> (sender, stop event) of this process's announcement


def guess_incarnation(ckpt_dir: str | os.PathLike | None, restart_count: int) -> int:
    if ckpt_dir is None:
        return restart_count
    try:
        fd = os.open(os.path.join(ckpt_dir, "incarnation"), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            current = int(os.read(fd, 64).strip() or 0)
        finally:
            os.close(fd)
    except (OSError, ValueError):
        current = 0
    return max(current, restart_count)


def announce(argv: list[str] | None = None, environ: Mapping[str, str] = os.environ) -> None:
    if os.getpid() in _state:
        return
    with contextlib.suppress(Exception):
        _announce(argv, environ)


def _announce(argv: list[str] | None, environ: Mapping[str, str]) -> None:
    import io

    from ..client.reporter import ProcessProgress
    from ..client.sender import TelemetrySender
    from ..contract.telemetry import NO_STEP, SCHEMA_VERSION
    from .config import config_from_args

    # argparse prints and exits on a bad command line: quiet here, main() reports it
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            cfg = config_from_args(argv, environ)
        except BaseException:  # a bad command line: main() reports it
            return
    if cfg.telemetry_socket is None:
        return
    world = max(1, int(environ.get("WORLD_SIZE", "1")))
    rank = int(environ.get("RANK", "0"))
    restart = guess_incarnation(cfg.ckpt.dir, int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    record = dict(
        v=SCHEMA_VERSION, job=cfg.job[:128], rank=rank,
        local_rank=int(environ.get("LOCAL_RANK", rank)), world_size=world, pid=os.getpid(),
        restart=restart, phase="init", **NO_STEP,
    )  # fmt: skip
    sender = TelemetrySender(cfg.telemetry_socket)
    stop, lock = threading.Event(), threading.Lock()
    _state[os.getpid()] = (sender, stop, lock)
    sender.send({**record, "time": time.time()})
    progress = ProcessProgress()

    def beat() -> None:
        while not stop.wait(1.0):
            with lock:  # never a stale "init" after the reporter's first record
                if not stop.is_set() and progress.moved():
                    sender.send({**record, "time": time.time()})

    threading.Thread(target=beat, name="rankguard-init", daemon=True).start()


def stop() -> None:
    """The trainer's reporter speaks for the rank from now on."""
    held = _state.get(os.getpid())
    if held is not None:
        sender, event, lock = held
        with lock:
            event.set()
        with contextlib.suppress(Exception):
            sender.close()
