"""Zero-code hang evidence: the flight-recorder wavefront of a worker that runs no
Reporter, sent to the agent while its collectives stand still.

`rankguard up` and the Slurm script put ``client/bootstrap`` on the workers'
``PYTHONPATH``; its ``sitecustomize`` starts a daemon thread, ``rankguard-collectives``,
in each torchrun worker, without a line of the script changed. Once the script has its
process group, the thread imports this module and runs :func:`run`: it looks every
``LOOK_SECONDS`` at the process groups' sequence ids (``flight_recorder.read_status``: a
few hundred bytes) and, while they move, does nothing else. Once they have stood still
``STILL_SECONDS``, it reads the wavefront and sends it as evidence (a record with
``progress`` false): again when it changes, and every ``REPEAT_SECONDS`` while it holds;
once they move again, an empty one takes it back.
The agent attaches it to the worker it found in /proc, by the kernel-verified sender pid
(agent/ranks.py), and ``supervisor/detectors/process_hang.py`` compares the job's
wavefronts: the rank that never enqueued the collective its peers wait in is the culprit.

Steps. While collectives move, the watch also sends the script's optimizer step
(client/optimizer_steps.py, counted by a hook the bootstrap registers) when it changed,
at every look: a record with ``progress`` false, ``collectives`` null
and that ``step``, which the agent keeps as the worker's ``script_step``. An incident then
names the step a zero-code rank died or hung at.

A rank stuck in Python, in its DataLoader or in native code that releases the GIL still
runs this thread, so it reports itself behind; a stopped rank reports nothing (the agent
sees it stopped). A Reporter in the same process has its own stall watch
(its ``rankguard-wavefront`` thread): this one then ends.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..contract.telemetry import (
    NO_STEP,
    SCHEMA_VERSION,
    STALL_WATCH_THREAD,
    Collective,
    socket_path_from_env,
)
from . import flight_recorder, optimizer_steps
from .sender import TelemetrySender

LOOK_SECONDS = 0.5  # how often the sequence ids are read
STILL_SECONDS = 2.0  # standing still this long: the wavefront is sent
REPEAT_SECONDS = 5.0  # an unchanged wavefront is sent again this often (the agent ages it)
# the script's step is sent at most this often, when it changed: an incident names the
# step last sent (a datagram a look costs the rank nothing it would notice)
BEACON_SECONDS = LOOK_SECONDS


def evidence_record(
    environ: Mapping[str, str], front: tuple[Collective, ...] | None, step: int = 0
) -> dict:
    """The record that carries a worker's wavefront (or, with `front` None, its script's
    step): its place from torchrun's variables, no timings (the agent reads only the
    collectives and the step from it)."""
    return dict(
        v=SCHEMA_VERSION, job=environ["TORCHELASTIC_RUN_ID"], rank=int(environ["RANK"]),
        local_rank=int(environ["LOCAL_RANK"]), world_size=int(environ.get("WORLD_SIZE", "1")),
        pid=os.getpid(), restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        phase="train", time=time.time(), collectives=front, progress=False,
        **{**NO_STEP, "step": step},
    )  # fmt: skip


class CollectiveWatch:
    """The watch's decisions, apart from the thread and the clock: `look(now)` once per
    look returns the wavefront to send, or None."""

    def __init__(
        self,
        read_status: Callable[[], Any] = flight_recorder.read_status,
        read: Callable[[], tuple[Any, tuple[Collective, ...]]] = flight_recorder.read,
    ) -> None:
        self._read_status, self._read = read_status, read
        self.status: Any = None  # the ids at the last look
        self.still_since = 0.0  # when they last moved
        self.sent: Any = None  # the ids the last wavefront sent was read with
        self.sent_at = 0.0

    def look(self, now: float) -> tuple[Collective, ...] | None:
        """The wavefront to send now; ``()`` once collectives move again after one was
        sent (the agent then drops it: a stall that ended is no evidence); None: nothing."""
        status = self._read_status()
        if status is None or status != self.status:  # no group yet, or collectives move
            moved = self.sent is not None
            self.status, self.still_since, self.sent = status, now, None
            return () if moved else None
        if now - self.still_since < STILL_SECONDS:
            return None
        if status == self.sent and now - self.sent_at < REPEAT_SECONDS:
            return None
        self.sent, front = self._read()
        self.sent_at = now
        if not front:
            self.sent = None  # nothing went out: nothing to take back
            return None
        return front


def run(environ: Mapping[str, str]) -> None:
    """The watch's loop, in the bootstrap's thread, once the script has its process group
    (sitecustomize waits for it): never returns while the process lives, but for a
    Reporter found watching the same rank."""
    sender = TelemetrySender(socket_path_from_env(environ))
    watch = CollectiveWatch()
    beacon = StepBeacon()
    while True:
        time.sleep(LOOK_SECONDS)
        if any(t.name == STALL_WATCH_THREAD for t in threading.enumerate()):
            return  # a Reporter watches this rank itself
        try:
            now = time.monotonic()
            front = watch.look(now)
            if front is not None:
                sender.send(evidence_record(environ, front))
            elif watch.sent is None and (step := beacon.due(optimizer_steps.step(), now)):
                sender.send(evidence_record(environ, None, step))
        except Exception:  # torch refused a dump, a bad variable: never the script's problem
            continue


class StepBeacon:
    """When to send the script's step: when it changed, at most every BEACON_SECONDS."""

    def __init__(self) -> None:
        self.sent: int | None = None
        self.sent_at = float("-inf")

    def due(self, step: int | None, now: float) -> int | None:
        """The step to send now, or None."""
        if not step or step == self.sent or now - self.sent_at < BEACON_SECONDS:
            return None
        self.sent, self.sent_at = step, now
        return step
