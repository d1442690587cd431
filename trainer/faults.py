"""Fault hooks for fault-injection tests and drills. Off unless asked for.

A spec is one of the grammar's trainer faults (`rankguard.contract.faults`, described in
docs/faults.md): `KIND:step=N[:rank=R][:factor=F][:seconds=S][:restart=K|any]`, KIND one
of kill, exception, hang, spin, native-stall, slow, nan, comm-delay, ckpt-delay,
load-delay, data-stall, poison (`crash` is the old name of `kill`: accepted with a
deprecation line). `stop` and `corrupt-checkpoint` are
done from outside (`rankguard inject`), never by the trainer.

A fault fires only in the incarnation whose torchrun restart count is `restart`
(default 0), so a kill at step 27 does not kill again after the resume.

Faults can also arrive while training runs (`rankguard inject`): a fault file (one spec
per line) named by `--fault-file` / `$RANKGUARD_FAULT_FILE` is re-read when it changes,
checked with one stat() per step. There `restart` is the job-wide incarnation number the
telemetry reports (what `rankguard inject` reads from the agent), not the node's torchrun
count: the two differ once a checkpoint directory is reused or nodes have come and gone.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import stat
import sys
import time
from dataclasses import dataclass

from rankguard.contract import faults as grammar

KINDS = tuple(k.name for k in grammar.KINDS.values() if grammar.TRAINER in k.by)


class FaultSpecError(ValueError):
    pass


class InjectedFault(RuntimeError):
    """Raised by the `exception` fault."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    step: int
    rank: int = 0
    factor: float = 1.0
    seconds: float = 0.0
    restart: int | None = 0  # None: every incarnation

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FaultSpecError(f"unknown fault kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.step < 0 or self.rank < 0:
            raise FaultSpecError("fault step and rank must be >= 0")
        if self.kind == "poison" and not (self.factor > 1 and math.isfinite(self.factor)):
            raise FaultSpecError("poison needs factor > 1")
        if self.kind == "slow" and not (self.factor >= 1 and math.isfinite(self.factor)):
            raise FaultSpecError("slow needs factor >= 1")
        if self.kind in ("comm-delay", "ckpt-delay", "data-stall") and not (
            0 < self.seconds < 3600
        ):
            raise FaultSpecError(f"{self.kind} needs 0 < seconds < 3600")


def parse_fault_spec(text: str) -> FaultSpec:
    """One spec of the shared grammar, checked as a trainer fault (rank 0 when not given)."""
    try:
        f = grammar.for_trainer(grammar.parse(text))
    except grammar.FaultError as exc:
        raise FaultSpecError(str(exc)) from None
    if f.note:
        print(f"rankguard trainer: {f.note}", file=sys.stderr)
    return FaultSpec(kind=f.kind, step=f.step, rank=f.rank or 0, factor=f.factor or 1.0,
                     seconds=f.seconds or 0.0, restart=f.restart)  # fmt: skip


def parse_fault_specs(texts: list[str]) -> tuple[FaultSpec, ...]:
    return tuple(parse_fault_spec(t) for t in texts if t.strip())


def fault_file_problem(st: os.stat_result) -> str | None:
    """Why a fault file (its fstat) must not be obeyed, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this job's user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class FaultInjector:
    """The faults that apply to this rank in this incarnation, asked at fixed points."""

    def __init__(
        self,
        specs: tuple[FaultSpec, ...],
        rank: int,
        restart_count: int,
        fault_file: str | None = None,
        incarnation: int | None = None,
    ):
        self.rank, self.restart_count = rank, restart_count
        self.incarnation = restart_count if incarnation is None else incarnation
        self.static = self._mine(specs, self.restart_count)
        self.fault_file = fault_file
        self._file_mtime: int | None = None
        self._refused: str | None = None  # why the fault file was last ignored
        self.specs = list(self.static)

    def _mine(self, specs, restart: int) -> list[FaultSpec]:
        return [s for s in specs if s.rank == self.rank and s.restart in (None, restart)]

    def poll_file(self) -> None:
        """Pick up faults injected at run time; a bad line is reported and skipped."""
        if not self.fault_file:
            return
        text = self._read_fault_file()
        if text is None:
            return
        specs = []
        for line in text.splitlines():
            if line.strip() and not line.startswith("#"):
                try:
                    specs.append(parse_fault_spec(line))
                except FaultSpecError as exc:
                    print(f"rankguard trainer: ignoring fault {line!r}: {exc}", file=sys.stderr)
        self.specs = self.static + self._mine(specs, self.incarnation)

    def _read_fault_file(self) -> str | None:
        """The fault file's text when it changed since the last read and is this user's own
        (a regular file, not a link, writable by no one else: another user must not be
        able to kill this job through it); None otherwise."""
        try:
            if os.stat(self.fault_file).st_mtime_ns == self._file_mtime:
                return None  # the usual case: one stat() a step
            fd = os.open(self.fault_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            self._file_mtime = st.st_mtime_ns
            problem = fault_file_problem(st)
            if problem:
                if self._refused != problem:  # once per cause, not at every step
                    self._refused = problem
                    print(f"rankguard trainer: ignoring the fault file {self.fault_file}: "
                          f"{problem}", file=sys.stderr)  # fmt: skip
                return None
            return f.read(1 << 20).decode(errors="replace")

    def _active(self, kind: str, step: int, *, from_step: bool) -> FaultSpec | None:
        for s in self.specs:
            if s.kind == kind and (step >= s.step if from_step else step == s.step):
                return s
        return None

    def at_step_start(self, step: int) -> None:
        self.poll_file()
        if self._active("kill", step, from_step=False):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._active("exception", step, from_step=False):
            raise InjectedFault(f"injected exception at step {step}")
        if self._active("hang", step, from_step=False):
            while True:  # alive, idle, never progressing
                time.sleep(3600)
        if self._active("spin", step, from_step=False):
            _spin_forever()
        stall = self._active("native-stall", step, from_step=False)
        if stall:
            _stall_natively(stall.seconds)
        if self._active("desync", step, from_step=False):
            _desync()

    def slow_compute(self, step: int, compute_seconds: float) -> float:
        """Sleep (factor - 1) x the natural compute time; the seconds slept, which the
        caller leaves out of its next natural time (else the slowdown would compound)."""
        spec = self._active("slow", step, from_step=True)
        if not (spec and spec.factor > 1):
            return 0.0
        extra = compute_seconds * (spec.factor - 1)
        time.sleep(extra)
        return extra

    def corrupt_loss(self, step: int) -> bool:
        return self._active("nan", step, from_step=False) is not None

    def comm_delay(self, step: int) -> float:
        spec = self._active("comm-delay", step, from_step=True)
        return spec.seconds if spec else 0.0

    def data_stall(self, step: int) -> float:
        """Extra seconds to load step `step`'s batches (asked by the loader, maybe in a
        DataLoader worker: a copy of this injector that polls the fault file itself)."""
        self.poll_file()
        spec = self._active("data-stall", step, from_step=True)
        return spec.seconds if spec else 0.0

    def poison_factor(self, data_step: int) -> float:
        """How many times larger the loss of data step `data_step`'s batch is (1: clean)."""
        spec = self._active("poison", data_step, from_step=False)
        return spec.factor if spec else 1.0

    def ckpt_delay(self, step: int) -> float:
        """The longest active one: a stuck save injected at run time over a slow one."""
        return max((s.seconds for s in self.specs if s.kind == "ckpt-delay" and step >= s.step),
                   default=0.0)  # fmt: skip

    def load_delay(self, step: int | None) -> None:
        """At resume, after the checkpoint of `step` (None: nothing) was loaded."""
        spec = None if step is None else self._active("load-delay", step, from_step=True)
        if spec:
            time.sleep(spec.seconds)


def _spin_forever() -> None:
    x = 0
    while True:  # stuck in Python: holds the GIL, burns a core
        x = (x + 1) % 1_000_003


STALL_ROUND = 100_000  # PBKDF2 iterations a call: about 50 ms in OpenSSL's loop


def _stall_natively(seconds: float) -> None:
    """Stuck in native code, spinning, as a host thread waiting on a GPU kernel that never
    ends: OpenSSL's PBKDF2 loop runs with the GIL released at about one core, and this
    frame (not a collective's) is the innermost Python one. Forever when `seconds` is 0."""
    end = time.monotonic() + seconds if seconds else math.inf
    while time.monotonic() < end:
        hashlib.pbkdf2_hmac("sha256", b"rankguard", b"native-stall", STALL_ROUND)


def _desync() -> None:
    """A collective its peers do not issue at this point: they are about to all-reduce the
    step's first gradient bucket, this rank broadcasts instead, with the same sequence id.
    On gloo both wait for good, as NCCL's would until its watchdog."""
    import torch
    import torch.distributed as dist

    dist.broadcast(torch.zeros(1), src=0)
