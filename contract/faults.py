"""One fault grammar for `rankguard up --inject`, `rankguard inject`, the trainer's
`--fault` and the fault file (docs/faults.md is its one description). Stdlib only.

A fault is `KIND[:key=value]...`, e.g. `kill:rank=1:at=30s`, `nan:rank=0:step=50`,
`slow:rank=1:factor=2`, `ckpt-delay:rank=1:step=10:seconds=3`, `native-stall:step=9`,
`corrupt-checkpoint`.

Each kind says who carries it out:

* ``process``: done to the rank's process from outside, through its node agent (a
  signal): works for any training script;
* ``trainer``: the bundled trainer (or a script reading the fault file) does it to
  itself at a step;
* ``checkpoint``: done to the newest validated checkpoint on disk.

`kill` is both: `kill:at=` or `rankguard inject kill` signals the process; `kill:step=`
makes the trainer SIGKILL itself at that step. Adding a kind is one `Kind` entry here and
its action where it is carried out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

PROCESS, TRAINER, CHECKPOINT = "process", "trainer", "checkpoint"


@dataclass(frozen=True)
class Kind:
    name: str
    by: tuple[str, ...]  # who can carry it out: PROCESS, TRAINER, CHECKPOINT
    keys: tuple[str, ...] = ()  # kind-specific keys it takes beyond rank/step/at/restart
    required: tuple[str, ...] = ()
    help: str = ""


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("kill", (PROCESS, TRAINER), help="SIGKILL the rank (a hard death, no cleanup)"),
        Kind("stop", (PROCESS,), help="SIGSTOP the rank: alive, frozen (a hang by process state)"),
        Kind("hang", (TRAINER,), help="the rank stops progressing, alive and idle (sleeping)"),
        Kind("spin", (TRAINER,), help="the rank stops progressing, stuck in a busy Python loop"),
        Kind("native-stall", (TRAINER,), ("seconds",),
             help="the rank stops progressing, stuck spinning in native code (GIL released), as"
                  " a host thread waiting on a stuck GPU kernel: forever, or SECONDS"),
        Kind("desync", (TRAINER,),
             help="the rank issues a broadcast where its peers issue the step's all-reduce:"
                  " collectives that no longer match (a code bug), and the job hangs"),
        Kind("exception", (TRAINER,), help="the rank raises an exception (a Python-level failure)"),
        Kind("slow", (TRAINER,), ("factor",), help="compute takes FACTOR times as long (a straggler)"),
        Kind("nan", (TRAINER,), help="the rank's loss becomes NaN (bad numerics)"),
        Kind("comm-delay", (TRAINER,), ("seconds",), ("seconds",),
             help="every gradient all-reduce takes SECONDS longer"),
        Kind("ckpt-delay", (TRAINER,), ("seconds",), ("seconds",),
             help="every background checkpoint write takes SECONDS longer"),
        Kind("load-delay", (TRAINER,), ("seconds",), ("seconds",),
             help="loading a checkpoint of step N or later takes SECONDS longer (slow storage)"),
        Kind("data-stall", (TRAINER,), ("seconds",), ("seconds",),
             help="from step N on, loading each of the rank's batches takes SECONDS longer"),
        Kind("poison", (TRAINER,), ("factor",),
             help="the batch of data step N makes the loss FACTOR (20) times larger, in every"
                  " incarnation: a spike the data causes"),
        Kind("corrupt-checkpoint", (CHECKPOINT,),
             help="flip one byte of the newest validated checkpoint (a resume must refuse it)"),
    )
}  # fmt: skip

#: Old spellings still accepted, each with the line that says what to write instead.
DEPRECATED = {"crash": "kill"}

KEYS = ("rank", "step", "at", "factor", "seconds", "restart")
DEFAULT_FACTOR = 1.5  # slow: a straggler the detector names (a 20% one is within noise on CI)
POISON_FACTOR = 20.0  # poison: a spike far outside the loss's noise
# the incarnation a kind fires in when restart= is not given: bad data is bad in every one
DEFAULT_RESTART: dict[str, int | None] = {"poison": None}
_NAME = re.compile(r"^[a-z][a-z-]*$")
_NUMBER = r"[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"  # what repr() of a float can print
_SECONDS = re.compile(rf"^({_NUMBER})s?$")
_PLAIN = re.compile(rf"^({_NUMBER})$")


class FaultError(ValueError):
    """A spec that does not parse or does not apply here: one line that says why."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None  # None: not given (required where a rank is hit)
    step: int | None = None  # the trainer acts at this step
    at: float | None = None  # `up --inject`: seconds after training started
    factor: float | None = None
    seconds: float | None = None
    restart: int | None = 0  # the incarnation it fires in; None: every one ("any")
    note: str | None = None  # a deprecation line for the user, when an old spelling was used

    @property
    def spec(self) -> Kind:
        return KINDS[self.kind]

    def text(self) -> str:
        """The canonical spelling: parse(f.text()) == f (less the note)."""
        parts = [self.kind]
        for key in ("rank", "step"):
            if getattr(self, key) is not None:
                parts.append(f"{key}={getattr(self, key)}")
        if self.at is not None:
            parts.append(f"at={_num(self.at)}s")
        for key in ("factor", "seconds"):
            if getattr(self, key) is not None:
                parts.append(f"{key}={_num(getattr(self, key))}")
        if self.restart != DEFAULT_RESTART.get(self.kind, 0):
            parts.append(f"restart={'any' if self.restart is None else self.restart}")
        return ":".join(parts)


def _num(x: float) -> str:
    return repr(float(x)).removesuffix(".0") if float(x).is_integer() else repr(float(x))


def _int(spec: str, key: str, value: str) -> int:
    if not value.isdigit():
        raise FaultError(f"{spec!r}: {key} takes a whole number >= 0, got {value!r}")
    return int(value)


def _float(spec: str, key: str, value: str, unit: str = "") -> float:
    m = (_SECONDS if unit == "s" else _PLAIN).match(value)
    if not m:
        hint = f" (seconds: {key}=30s or {key}=30)" if unit == "s" else ""
        raise FaultError(f"{spec!r}: {key} takes a number{hint}, got {value!r}")
    x = float(m.group(1))
    if not math.isfinite(x):
        raise FaultError(f"{spec!r}: {key} must be finite")
    return x


def parse(spec: str) -> Fault:
    """`KIND[:key=value]...` -> Fault; FaultError (one line) for anything malformed. Checks
    what holds everywhere; where a fault is used, `check` adds that place's rules."""
    text = spec.strip()
    kind, *parts = text.split(":")
    note = None
    if kind in DEPRECATED:
        note = f"fault kind {kind!r} is now {DEPRECATED[kind]!r}; {kind!r} will be removed"
        kind = DEPRECATED[kind]
    if kind not in KINDS:
        what = "a fault kind" if _NAME.match(kind) else "KIND[:key=value]..."
        raise FaultError(f"{spec!r}: expected {what}; kinds: {', '.join(KINDS)}")
    k = KINDS[kind]
    fields: dict = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not value:
            raise FaultError(f"{spec!r}: expected key=value, got {part!r}")
        if key not in KEYS:
            raise FaultError(f"{spec!r}: unknown key {key!r}; keys: {', '.join(KEYS)}")
        if key in fields:
            raise FaultError(f"{spec!r}: {key} given twice")
        if key in ("factor", "seconds") and key not in k.keys:
            raise FaultError(f"{spec!r}: {kind} takes no {key}")
        if key in ("rank", "step"):
            fields[key] = _int(spec, key, value)
        elif key == "at":
            fields[key] = _float(spec, key, value, unit="s")
        elif key == "restart":
            fields[key] = None if value == "any" else _int(spec, key, value)
        else:
            fields[key] = _float(spec, key, value)
    for key in k.required:
        if key not in fields:
            raise FaultError(f"{spec!r}: {kind} needs {key}=")
    if "step" in fields and "at" in fields:
        raise FaultError(f"{spec!r}: give step= (the trainer acts at a step) or at= (up acts "
                         "at a time), not both")  # fmt: skip
    if "step" in fields and TRAINER not in k.by:
        raise FaultError(f"{spec!r}: {kind} is done from outside the trainer: no step=")
    if kind == "slow":
        fields.setdefault("factor", DEFAULT_FACTOR)
        if fields["factor"] < 1:
            raise FaultError(f"{spec!r}: slow needs factor >= 1")
    if kind == "poison":
        fields.setdefault("factor", POISON_FACTOR)
    if kind in DEFAULT_RESTART:
        fields.setdefault("restart", DEFAULT_RESTART[kind])
    if "seconds" in fields and not 0 < fields["seconds"] < 3600:
        raise FaultError(f"{spec!r}: {kind} needs 0 < seconds < 3600")
    if CHECKPOINT in k.by and set(fields) - {"at"}:
        raise FaultError(f"{spec!r}: {kind} takes only at= (it acts on the checkpoint "
                         "directory, not on a rank)")  # fmt: skip
    return Fault(kind, note=note, **fields)


def for_trainer(f: Fault) -> Fault:
    """A fault the trainer carries out (`--fault`, the fault file): a trainer kind at a step."""
    if TRAINER not in f.spec.by:
        raise FaultError(f"{f.text()!r}: {f.kind} is not done by the trainer"
                         f" ({_outside(f.kind)})")  # fmt: skip
    if f.step is None:
        raise FaultError(f"{f.text()!r}: the trainer needs step=N")
    if f.at is not None:
        raise FaultError(f"{f.text()!r}: at= is for `rankguard up --inject`")
    return f


def for_up(f: Fault, script: bool) -> Fault:
    """`up --inject`: a rank where one is hit; at=SECONDS (up runs `rankguard inject` then)
    or step=N (passed to the bundled trainer's --fault). A script of the user's own only
    takes what is done to its processes from outside."""
    if script and (f.step is not None or PROCESS not in f.spec.by):
        done = ", ".join(k.name for k in KINDS.values() if PROCESS in k.by)
        raise FaultError(f"{f.text()!r}: with a script only {done} at=SECONDS (done to the "
                         "process; the others need the bundled trainer)")  # fmt: skip
    if f.spec.by != (CHECKPOINT,) and f.rank is None:
        raise FaultError(f"{f.text()!r}: which rank? add rank=N")
    if f.at is None and f.step is None:
        raise FaultError(f"{f.text()!r}: when? add at=SECONDS (after training starts) or step=N")
    return f


def for_inject(f: Fault) -> Fault:
    """`rankguard inject`: acts now; a rank where one is hit."""
    if f.at is not None:
        raise FaultError(f"{f.text()!r}: `rankguard inject` acts now; at= is for `up --inject`")
    if f.spec.by != (CHECKPOINT,) and f.rank is None:
        raise FaultError(f"{f.kind} needs --rank N (or {f.kind}:rank=N)")
    if f.kind in ("kill", "stop") and f.step is not None:
        raise FaultError(f"{f.text()!r}: {f.kind} is sent now; for a step, use the trainer's "
                         f"--fault {f.kind}:step=N")  # fmt: skip
    return f


def _outside(kind: str) -> str:
    if kind == "stop":
        return "SIGSTOP from outside: `rankguard inject stop` or `up --inject stop:at=`"
    return "done to the checkpoint directory: `rankguard inject` or `up --inject ...:at=`"
