"""A deterministic start-up error: workers that end by themselves before their process
group ever formed (an argument error, an import error, a missing file) fail the same way
at every restart, so restarting them is a loop that hides the reason.

Three processes share this file's format. Each torchrun worker started with
``$RANKGUARD_STARTUP_GUARD=FILE`` (`rankguard up` sets it for workers it starts cold) appends
one JSON line when it exits by itself: its rank, restart count, pid, whether it ever had a
process group, and how long it lived (client/bootstrap/sitecustomize.py). A worker killed
by a signal writes nothing (an injected kill is a fault, not a start-up error). torchrun's
rendezvous handler (trainer/rendezvous.py) reads the file before a restart's rendezvous
and ends the job instead of restarting it when :func:`startup_failure` says so; `rankguard
up` reads it again to say why the job ended.

Standard library only: the workers' bootstrap imports it at exit.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

ENV = "RANKGUARD_STARTUP_GUARD"
# A worker that lived longer than this did work, whatever it was: never a start-up error.
STARTUP_SECONDS = 60.0


@dataclass(frozen=True)
class Exit:
    """One worker's own exit."""

    rank: int
    restart: int
    pid: int
    had_group: bool  # its process group formed (it met its peers) before it exited
    lived: float  # seconds from its start to its exit
    # its uncaught exception's traceback, when it died of one: its own words, where the
    # shared log interleaves every rank's output
    error: str | None = None


MAX_ERROR_CHARS = 4000  # the end of a long traceback: where it failed


def exit_line(rank: int, restart: int, pid: int, had_group: bool, lived: float,
              error: str | None = None) -> str:  # fmt: skip
    return json.dumps(dict(rank=rank, restart=restart, pid=pid, had_group=had_group,
                           lived=round(lived, 3),
                           error=error[-MAX_ERROR_CHARS:] if error else None)) + "\n"  # fmt: skip


def parse(text: str) -> list[Exit]:
    """The lines of a guard file; a line that is not one (a torn write) is skipped."""
    out = []
    for line in text.splitlines():
        try:
            d = json.loads(line)
            error = d.get("error")
            out.append(Exit(int(d["rank"]), int(d["restart"]), int(d["pid"]),
                            bool(d["had_group"]), float(d["lived"]),
                            error if isinstance(error, str) else None))  # fmt: skip
        except (ValueError, KeyError, TypeError):
            continue
    return out


def startup_failure(exits: Iterable[Exit], restart: int = 0) -> Exit | None:
    """The worker whose exit makes incarnation `restart` a start-up failure, or None.

    It is one when a worker of that incarnation exited by itself within STARTUP_SECONDS of
    its start, before its process group formed, and no worker of it ever had a group
    (none made progress); the first such worker to exit is named. Only the first
    incarnation is judged: a fault after a restart is the crash-loop guard's."""
    mine = [e for e in exits if e.restart == restart]
    if restart != 0 or not mine or any(e.had_group for e in mine):
        return None
    early = [e for e in mine if e.lived <= STARTUP_SECONDS]
    return early[0] if early else None


def read(path: str | os.PathLike[str]) -> list[Exit]:
    try:
        with open(path) as f:
            return parse(f.read())
    except OSError:
        return []


def uncaught_error() -> str | None:
    """The traceback of the exception this interpreter is exiting with, if any (Python sets
    sys.last_value for an uncaught one before atexit handlers run; not for SystemExit)."""
    import sys
    import traceback

    value = getattr(sys, "last_value", None)
    if value is None:
        return None
    return "".join(traceback.format_exception(type(value), value, value.__traceback__)).rstrip()


def record_exit(path: str, environ, had_group: bool, started: float) -> None:
    """Append this worker's exit line (one O_APPEND write)."""
    line = exit_line(int(environ.get("RANK", "0")),
                     int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")), os.getpid(),
                     had_group, time.monotonic() - started, uncaught_error())  # fmt: skip
    with open(path, "a") as f:
        f.write(line)
