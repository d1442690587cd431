"""Fault hooks for fault-injection tests and drills. Off unless asked for.

A spec is `KIND:step=N[:rank=R][:factor=F][:seconds=S][:restart=K|any]`:

- crash       SIGKILL this rank at step N (a hard death: no cleanup, no exception)
- exception   raise an exception at step N (a Python-level failure)
- hang        stop progressing at step N, staying alive and idle (sleeping)
- spin        stop progressing at step N, stuck in a busy Python loop
- slow        from step N on, compute takes `factor` times as long (a straggler)
- nan         the loss of step N becomes NaN (bad numerics)
- comm-delay  from step N on, every gradient all-reduce is `seconds` longer
- ckpt-delay  from step N on, every background checkpoint write is `seconds` longer
- poison      the batch of data step N makes rank R's loss `factor` times larger (default
              20: a loss spike caused by the data, so a rollback that replays the batch
              meets it again; fires in every incarnation unless `restart=` is given)
- data-stall  from step N on, loading each of this rank's batches takes `seconds` longer
              (a slow filesystem or a starved loader; in the DataLoader's worker when
              `--data-workers` > 0; a large `seconds` is a stuck loader)

A fault fires only in the incarnation whose torchrun restart count is `restart`
(default 0), so a crash at step 27 does not crash again after the resume.

Faults can also arrive while training runs (`rankguard inject`): a fault file (one spec
per line) named by `--fault-file` / `$RANKGUARD_FAULT_FILE` is re-read when it changes,
checked with one stat() per step. There `restart` is the job-wide incarnation number the
telemetry reports (what `rankguard inject` reads from the agent), not the node's torchrun
count: the two differ once a checkpoint directory is reused or nodes have come and gone.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = ("crash", "exception", "hang", "spin", "slow", "nan", "comm-delay", "ckpt-delay",
         "data-stall", "poison")  # fmt: skip


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
    kind, *parts = text.strip().split(":")
    fields: dict = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep:
            raise FaultSpecError(f"{text!r}: expected key=value, got {part!r}")
        try:
            if key in ("step", "rank"):
                fields[key] = int(value)
            elif key in ("factor", "seconds"):
                fields[key] = float(value)
            elif key == "restart":
                fields[key] = None if value == "any" else int(value)
            else:
                raise FaultSpecError(f"{text!r}: unknown key {key!r}")
        except ValueError as exc:
            if isinstance(exc, FaultSpecError):
                raise
            raise FaultSpecError(f"{text!r}: bad value for {key}: {value!r}") from None
    if "step" not in fields:
        raise FaultSpecError(f"{text!r}: step=N is required")
    if kind == "poison":  # bad data is bad in every incarnation, and spikes by default 20x
        fields.setdefault("restart", None)
        fields.setdefault("factor", 20.0)
    return FaultSpec(kind=kind, **fields)


def parse_fault_specs(texts: list[str]) -> tuple[FaultSpec, ...]:
    return tuple(parse_fault_spec(t) for t in texts if t.strip())


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
        self._file_mtime: float | None = None
        self.specs = list(self.static)

    def _mine(self, specs, restart: int) -> list[FaultSpec]:
        return [s for s in specs if s.rank == self.rank and s.restart in (None, restart)]

    def poll_file(self) -> None:
        """Pick up faults injected at run time; a bad line is reported and skipped."""
        if not self.fault_file:
            return
        try:
            mtime = os.stat(self.fault_file).st_mtime_ns
        except OSError:
            return
        if mtime == self._file_mtime:
            return
        self._file_mtime = mtime
        specs = []
        try:
            lines = Path(self.fault_file).read_text().splitlines()
        except OSError:
            return
        for line in lines:
            if line.strip() and not line.startswith("#"):
                try:
                    specs.append(parse_fault_spec(line))
                except FaultSpecError as exc:
                    print(f"rankguard trainer: ignoring fault {line!r}: {exc}", file=sys.stderr)
        self.specs = self.static + self._mine(specs, self.incarnation)

    def _active(self, kind: str, step: int, *, from_step: bool) -> FaultSpec | None:
        for s in self.specs:
            if s.kind == kind and (step >= s.step if from_step else step == s.step):
                return s
        return None

    def at_step_start(self, step: int) -> None:
        self.poll_file()
        if self._active("crash", step, from_step=False):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._active("exception", step, from_step=False):
            raise InjectedFault(f"injected exception at step {step}")
        if self._active("hang", step, from_step=False):
            while True:  # alive, idle, never progressing
                time.sleep(3600)
        if self._active("spin", step, from_step=False):
            _spin_forever()

    def slow_compute(self, step: int, compute_seconds: float) -> None:
        spec = self._active("slow", step, from_step=True)
        if spec and spec.factor > 1:
            time.sleep(compute_seconds * (spec.factor - 1))

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
        spec = self._active("ckpt-delay", step, from_step=True)
        return spec.seconds if spec else 0.0


def _spin_forever() -> None:
    x = 0
    while True:  # stuck in Python: holds the GIL, burns a core
        x = (x + 1) % 1_000_003
