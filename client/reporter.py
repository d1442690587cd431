"""`Reporter`: a few lines in any training loop give the agent what the bundled trainer sends.

    rg = Reporter(model)                  # torchrun's env, $RANKGUARD_TELEMETRY_SOCKET;
    for n in range(1, steps + 1):         # DDP or FSDP2: communication timed
        s = rg.step(n, tokens=tokens)     # or: with rg.step(n) as s:
        x, y = next(batches)              # before "compute": the data wait (or wrap the
                                          # loader: `for x, y in rg.batches(loader)`)
        s.phase("compute"); loss = model(x, y); loss.backward()
        s.phase("optimizer"); opt.step(); opt.zero_grad()
        s.loss(loss)                      # a tensor is read a step late, never synced
        if n % 100 == 0:
            with rg.phase("checkpoint_save"):   # ends the step; heartbeats while saving
                save(...)
            rg.checkpoint_saved(n)
    rg.close()                            # (or at exit) flush the last steps, say "done"

Contract: nothing here blocks on the agent or raises into the loop. A wrong call (an
unknown phase, a bad value, a broken timer) is counted in :attr:`Reporter.errors` by
reason and the step goes on; a record the schema refuses or the socket cannot take is
counted by the sender (:attr:`Reporter.sender`, ``dropped_by_reason``). The agent sees
what the schema allows: every record that arrives, with its phase and step, and the
``restart`` and ``checkpoint_step`` fields; it cannot see records that never left.

Timing: "data" and "checkpoint" are host phases (the loop waits on them);
"compute" (forward + backward) and "optimizer" are read on the device clock (CUDA
events when ``device`` is a GPU, read one step late, so the host never waits for the
device). Of compute, the part the loop thread spent runnable but without a CPU (the
run-queue wait, Linux's schedstat) is sent as ``compute_wait_seconds``: the supervisor
tells a preempted rank from a slow one by it. Communication comes from the DDP comm hook or the FSDP2 custom collectives
(:meth:`Reporter.attach`); its exposed part is subtracted from compute.

The Reporter only observes: attaching changes nothing that is communicated, nor on which
group, nor with which arithmetic; training ends bit-identical with and without it. What it
cannot time is counted in :attr:`Reporter.errors` by why (``attach_*``, ``untimed_*``);
which collectives are timed is in :mod:`rankguard.client.timing` and ``docs/client.md``.

Stalls (``flight_recorder=True``, the default): built before the process group, the
Reporter turns torch's flight recorder on (:func:`~.flight_recorder.enable`). A daemon
thread, ``rankguard-wavefront``, looks every 0.25 s at how long the rank has shown no
progress (a step begun or reported, a phase announced, a heartbeat sent): one clock read
while steps flow, nothing else. Once that exceeds ``max(0.5, 2 x the median of the last 20
step times)`` seconds, it reads the rank's wavefront (each process group's last enqueued
and completed collective, :mod:`rankguard.client.flight_recorder`) and sends it in a
record with ``progress`` false (the current phase and step, as a heartbeat has them):
evidence for the supervisor, which the agent never takes for progress. While the stall
lasts it looks again each second: it sends again when the wavefront moved and then held
still for a look (a rank whose collectives still move is not hung in one), else every
5 s. It reads the groups' sequence ids alone (a few hundred bytes) and dumps the whole
recorder only when they changed. It issues no collective and waits on no device: the
training is the same with it; what fails is counted (``flight_recorder``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import resource
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from ..contract.errors import ContractError
from ..contract.save_requests import MAX_REQUEST_BYTES, decode, request_path
from ..contract.telemetry import (
    MAX_DATAGRAM_BYTES,
    MAX_JOB_CHARS,
    PHASES,
    SCHEMA_VERSION,
    STALL_WATCH_THREAD,
    Collective,
    TelemetryRecord,
    encode,
    skip_ranges,
    socket_path_from_env,
)
from . import flight_recorder
from .gpu_identity import device_uuid
from .sender import TelemetrySender
from .timing import StepTimer, StepTiming, attach_ddp, attach_fsdp, timed_batches

__all__ = ["ERROR_REASONS", "STEP_PHASES", "Reporter", "Step"]

log = logging.getLogger(__name__)

#: Phases inside a step, in the order a loop usually runs them.
STEP_PHASES = ("data", "compute", "optimizer", "checkpoint")
PEAK_MEMORY_EVERY = 5.0  # seconds between reads of the peak memory (sent with every record)
# seconds a closing Reporter's records wait for room in the agent's queue (TelemetrySender)
CLOSE_PATIENCE = 1.0
# The stall watch (rankguard-wavefront): how often it looks at the clock, the shortest
# stall it reports, how many step times its median takes, how often it reads the recorder
# while stalled, and how often it repeats an unchanged wavefront.
STALL_LOOK_SECONDS = 0.25
# half the hang detector's 1 s floor: the wavefront is in before a hang is decided
STALL_MIN_SECONDS = 0.5
STALL_STEPS = 20
STALL_READ_SECONDS = 1.0
# After this many steps the watch reads the groups' collective timeouts once (a warning when
# too short); the margin is what the supervisor needs after a stall is reported.
TIMEOUT_CHECK_STEPS = 3
TIMEOUT_MARGIN_SECONDS = 2.0
STALL_REPEAT_SECONDS = 5.0
# How often save_requested() reads the request file: far under its lead (ten seconds)
SAVE_REQUEST_POLL_SECONDS = 0.5

# Every key Reporter.errors can hold, with what it means (logged at its first count). The
# attach_* and untimed_* ones say which communication is not timed: it counts as compute.
_REASONS = {
    "bad_phase": "s.phase()/rg.phase() with a name that is not a phase",
    "bad_value": "a loss, token count or step that is not a number (or is negative)",
    "timer": "the step timer failed (e.g. a CUDA event could not be read)",
    "record": "the record's fields could not be built",
    "attach": "attach() found no DDP or FSDP2 module to time, or failed",
    "attach_hook_taken": "DDP already had a comm hook (it takes one): its all-reduces are "
    "not timed; register yours after the Reporter to have it run inside the Reporter's, timed",
    "attach_unreadable": "a DDP or FSDP2 module whose process group or collectives could "
    "not be read (another torch, compiled DDP): left as it was, not timed",
    "untimed_hsdp_all_reduce": "HSDP's all-reduce across replicas is not timed",
    "untimed_other_groups": "collectives outside the data-parallel group (TP, PP, EP, CP) "
    "are not timed",
    "flight_recorder": "reading the flight recorder while the rank stalled failed (torch's "
    "dump raised or gave what could not be read): that wavefront was not sent",
    "save_request": "the supervisor's save request beside the telemetry socket could not be "
    "read (not a request, or too large): ignored",
    "internal": "anything else caught on the way",
}
#: Every key Reporter.errors can hold.
ERROR_REASONS = tuple(_REASONS)

_HOST_PHASES = {"data": "data_wait", "checkpoint": "checkpoint_block"}


class ProcessProgress:
    """Whether this process did work since the last look: CPU time of its Python threads
    (the process's CPU, less that of its native threads and of the thread looking, all in
    nanoseconds), at least :attr:`MIN_CPU_SECONDS`, or bytes read or written
    (``/proc/self/io`` rchar + wchar, minus the bytes of these very reads). Linux only;
    elsewhere every look says it moved.

    Why not the process's CPU (``/proc/self/stat``, as before): native service threads use
    CPU while the phase is stuck (gloo's TCP loop, idle, about 3 ms a second per process
    group; NCCL's watchdogs), and in that file's 10 ms ticks their CPU crossed a tick every
    few seconds, so a save stuck for good kept sending beats and never met its budget.
    The phase's work runs in Python threads (the loop, a save thread, a stager), which are
    counted even when they end between two looks (the process's clock keeps their time);
    the minimum absorbs their bookkeeping wake-ups (a timed wait costs microseconds)."""

    MIN_CPU_SECONDS = 0.002

    def __init__(self, footprint: Callable[[], tuple[set[int], int]] | None = None) -> None:
        """``footprint``: rankguard's own threads besides the looking one (the stall
        watch) and the bytes they sent so far: neither is progress of the phase (a stall's
        evidence sent every few seconds read as I/O, and the phase never fell silent)."""
        self._footprint = footprint or (lambda: (set(), 0))
        self._own = 0  # bytes of our own /proc reads since the last sample
        self._last = self._read()

    def _read(self) -> tuple[int, dict[int, int], set[int], int, set[int]] | None:
        """(process CPU ns, {thread id: its CPU ns}, the Python threads' ids, rchar + wchar
        less the footprint's bytes, the footprint's threads) now."""
        theirs, sent = self._footprint()
        own = 0
        threads: dict[int, int] = {}
        try:
            python = {t.native_id for t in threading.enumerate()}
            total = time.process_time_ns()
            for name in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{name}/schedstat", "rb") as f:
                        text = f.read()
                except FileNotFoundError:
                    continue  # the thread ended since the listing
                own += len(text)
                threads[int(name)] = int(text.split()[0])
            with open("/proc/self/io", "rb") as f:
                io = f.read()
        except (OSError, ValueError, IndexError):
            return None
        counters = dict(line.split(b":", 1) for line in io.splitlines() if b":" in line)
        chars = int(counters.get(b"rchar", 0)) + int(counters.get(b"wchar", 0)) - sent
        self._own = own + len(io)
        return total, threads, python, chars, theirs

    def rebase(self) -> None:
        """Start the next look from now: what we did ourselves (a heartbeat's send, counted
        in wchar) is not progress of the phase."""
        self._last = self._read()

    def moved(self) -> bool:
        before, own = self._last, self._own
        now = self._read()
        self._last = now
        if before is None or now is None:
            return True
        # the looking thread's own CPU is not progress, nor rankguard's other threads'
        ours = {threading.get_native_id()} | now[4]
        python = now[2] | before[2]  # a Python thread that just ended is still listed
        # native: seen at both looks and Python at neither (service threads live long; a
        # thread new since the last look counts as work, once)
        not_work = sum(ns - before[1].get(tid, 0) for tid, ns in now[1].items()
                       if tid in ours or (tid in before[1] and tid not in python))  # fmt: skip
        work = now[0] - before[0] - not_work
        return work >= self.MIN_CPU_SECONDS * 1e9 or now[3] - before[3] > own + self._own


def _device_of(model: Any):
    """A function giving the device of ``model``'s first parameter when the clock asks, at
    the first step (after ``to_empty()`` or ``set_device()``); warns now, once, when the
    model is still on the meta device."""
    try:
        ref = weakref.ref(model)
    except TypeError:  # not weakly referable: held (the Reporter lives until exit)
        ref = lambda: model  # noqa: E731

    def device() -> Any:
        try:
            return next(iter(ref().parameters())).device
        except Exception:  # no parameters, or the model is gone: the host clock
            return None

    if getattr(device(), "type", None) == "meta":
        log.warning(
            "rankguard.client: the model is on the meta device; the clock is chosen at the "
            "first step, from where its parameters are then"
        )
    return device


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(environ.get(name, default))
    except (TypeError, ValueError):
        return default


class Step:
    """One training step, from :meth:`Reporter.step` until :meth:`end` (or the end of its
    ``with`` block, or the next ``rg.step()``, ``rg.phase()`` or ``rg.close()``).

    ``s.phase(name)`` closes the running phase and opens ``name`` (one of
    :data:`STEP_PHASES`). A step opens unnamed: what runs before ``s.phase("compute")``
    is its data wait, and a step that never names a phase is all compute. One compute
    phase per step: a second one extends the first. ``s.loss(x)`` and ``s.tokens(n)``
    attach the step's loss (float or 0-d tensor) and the tokens this rank processed.
    Nothing here raises: a wrong call is counted in ``Reporter.errors``.
    """

    __slots__ = ("_rg", "step", "_phase", "_host_start", "_loss", "_tokens", "_computed")

    def __init__(self, rg: Reporter, step: int, tokens: int | float | None) -> None:
        self._rg, self.step = rg, step
        self._phase: str | None = None  # unnamed: data wait if compute follows, else compute
        self._host_start = time.perf_counter()
        self._loss: Any = None
        self._tokens = tokens
        self._computed = False  # a compute phase has begun (its start mark stands)

    def phase(self, name: str) -> None:
        """Close the running phase, open ``name``. Never raises."""
        try:
            if name not in STEP_PHASES:
                self._rg._count("bad_phase")
                return
            if name == self._phase or self._rg._open is not self:
                return
            timer, now = self._rg.timer, time.perf_counter()
            current = self._phase
            if current is None:
                if name == "compute":  # the unnamed start was the data wait
                    timer.host("data_wait", now - self._host_start)
                elif name != "data":  # it was compute (begun at the step's start)
                    self._computed = True
                    timer.mark("backward_end")
            else:
                self._leave(now)
            self._phase = name
            self._host_start = now
            if name == "compute" and not self._computed:
                self._computed = True
                timer.mark("compute_start")
        except Exception:
            self._rg._count("timer")

    def _leave(self, now: float) -> None:
        timer, current = self._rg.timer, self._phase
        if current in _HOST_PHASES:
            timer.host(_HOST_PHASES[current], now - self._host_start)
        elif current == "compute" or current is None:
            timer.mark("backward_end")
        elif current == "optimizer":
            timer.mark("optimizer_end")

    def loss(self, value: Any) -> None:
        """The step's loss: a float, or a tensor (copied off the device without waiting and
        read when the step's timings are, a step later on a GPU)."""
        self._loss = self._rg._hold_loss(value)

    def tokens(self, count: int | float) -> None:
        """Tokens this rank processed in the step (for tokens/s and MFU)."""
        if isinstance(count, bool) or not isinstance(count, (int, float)) or not count >= 0:
            self._rg._count("bad_value")
            return
        self._tokens = count

    def end(self) -> None:
        """Close the step and report the steps whose timings can be read. Idempotent."""
        rg = self._rg
        if rg._open is not self:
            return
        rg._open = None
        try:
            self._leave(time.perf_counter())
        except Exception:
            rg._count("timer")
        rg._end_step(self)

    def __enter__(self) -> Step:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.end()


class _HeldLoss:
    """A loss tensor on its way to the host: a non-blocking copy and the event after it."""

    __slots__ = ("cpu", "event")

    def __init__(self, tensor: Any) -> None:
        import torch

        t = tensor.detach().reshape(())
        self.cpu = torch.empty((), dtype=t.dtype, pin_memory=True)
        self.cpu.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(t.device.index))  # an int: no lookup

    def value(self) -> float:
        self.event.synchronize()  # recorded a step ago: already complete
        return float(self.cpu)


class Reporter:
    """The rank side of rankguard's telemetry for any training script.

    ``model``: a DDP model or a model holding FSDP2 modules, passed to :meth:`attach`.
    Every argument is optional: the rank, local rank, world size and restart count come
    from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``TORCHELASTIC_RESTART_COUNT``), the job from ``RANKGUARD_JOB`` or
    ``TORCHELASTIC_RUN_ID``, the socket from ``RANKGUARD_TELEMETRY_SOCKET`` (``off``
    disables sending; unset is the agent's default path).

    ``device``: a ``torch.device``, "cuda" or "cuda:N" to time compute with CUDA events
    (default: the device of ``model``'s first parameter, else the host clock), resolved at
    the first step: "cuda" is the current device then, and a model built on the meta
    device is timed where it was materialized. ``flops_per_token``
    and ``peak_flops`` (per rank) give MFU (0 without them). ``heartbeat_seconds``: how often a long phase (:meth:`phase`) re-announces
    itself; ``heartbeat_limit_seconds``: after this long in one phase the beats stop, so a
    save that is truly stuck still looks hung to the supervisor. ``heartbeat_progress``:
    beat only when the process used CPU or read or wrote since the last beat
    (:class:`ProcessProgress`), so a slow but moving phase stays fresh while a stuck one
    (asleep, blocked) falls silent and meets its budget at once.

    ``flight_recorder``: while the rank stalls, send its flight-recorder wavefront as
    evidence (see the module's "Stalls"); built before ``init_process_group``, the
    Reporter turns torch's recorder on (its buffer size, unless the user set one).
    """

    def __init__(
        self,
        model: Any = None,
        *,
        job: str | None = None,
        socket_path: str | None | bool = True,
        device: Any = None,
        flops_per_token: float = 0.0,
        peak_flops: float = 0.0,
        restart: int | None = None,
        heartbeat_seconds: float = 10.0,
        heartbeat_limit_seconds: float = 1800.0,
        heartbeat_progress: bool = False,
        environ: Mapping[str, str] | None = None,
        flight_recorder: bool = True,
    ) -> None:
        env = os.environ if environ is None else environ
        self.errors: dict[str, int] = {}
        self.world_size = max(1, _env_int(env, "WORLD_SIZE", 1))
        self.rank = min(max(0, _env_int(env, "RANK", 0)), self.world_size - 1)
        self.local_rank = min(max(0, _env_int(env, "LOCAL_RANK", self.rank)), self.world_size - 1)
        self.restart = (
            restart if restart is not None else _env_int(env, "TORCHELASTIC_RESTART_COUNT", 0)
        )
        job = job or env.get("RANKGUARD_JOB") or env.get("TORCHELASTIC_RUN_ID") or "local"
        self.job = job[:MAX_JOB_CHARS]
        path = socket_path_from_env(env) if socket_path is True else (socket_path or None)
        self.sender = TelemetrySender(path, errors=self.errors)
        if device is None and model is not None:
            device = _device_of(model)
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.heartbeat_seconds = heartbeat_seconds
        self.heartbeat_limit_seconds = heartbeat_limit_seconds
        self.heartbeat_progress = heartbeat_progress
        self.timer = StepTimer(device)
        self._peak_memory: tuple[float, bool, int] | None = None  # (read at, cuda, bytes)
        self._gpu_uuid: str | None = None  # "" once read and unknown
        self.current_phase = "init"
        self.last_step = 0
        self.last_loss: float | None = None
        # the first step whose loss was NaN/Inf: CheckpointStore validates nothing after it
        self.nonfinite_loss_step: int | None = None
        self.checkpoint_step: int | None = None
        self.resume_skips: tuple[tuple[int, int], ...] = ()  # see data_skipped()
        self.timings: list[StepTiming] = []  # the newest resolved steps (bounded)
        self._open: Step | None = None
        self._pending: dict[int, tuple[Any, float | None]] = {}
        self._pid = os.getpid()
        # when the rank last showed progress (perf_counter): the stall watch's one input
        self._progress_at = time.perf_counter()
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._evidence_sent = 0  # records the stall watch sent (ProcessProgress ignores them)
        self._save_read_at = 0.0  # monotonic time of the next read of the save request
        self._save_step: int | None = None  # the step this incarnation is asked to save at
        self.heartbeat()
        if model is not None:
            self.attach(model)
        if flight_recorder:
            self._watch_stalls()
        atexit.register(self._close_quietly)

    # -- counters -----------------------------------------------------------------------
    def _count(self, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1
        if self.errors[reason] == 1:
            with contextlib.suppress(Exception):
                log.warning(
                    "rankguard.client: %s: %s (further ones are only counted)",
                    reason, _REASONS.get(reason, ""),
                )  # fmt: skip

    @property
    def sent(self) -> int:
        return self.sender.sent

    @property
    def dropped(self) -> int:
        return self.sender.dropped

    # -- stalls -------------------------------------------------------------------------
    def _watch_stalls(self) -> None:
        """Turn the recorder on if no process group exists yet, and start the watch when
        recording is (or may be) on and records can leave."""
        try:
            dist = sys.modules.get("torch.distributed")  # never imported here
            if dist is None or not (dist.is_available() and dist.is_initialized()):
                on = flight_recorder.enable()  # torch reads the process's own environment
            else:  # too late to turn it on: on unless the user turned it off
                on = flight_recorder.buffer_size() != 0
            if on and self.sender.enabled:
                self._watcher = threading.Thread(
                    target=self._watch, name=STALL_WATCH_THREAD, daemon=True
                )
                self._watcher.start()
        except Exception:
            self._count("flight_recorder")

    def stall_seconds(self) -> float:
        """How long without progress is a stall: ``max(1, 2 x the median of the last 20
        step times)``."""
        times = sorted(t.step_seconds for t in self.timings[-STALL_STEPS:])
        if not times:
            return STALL_MIN_SECONDS
        n = len(times)
        median = times[n // 2] if n % 2 else (times[n // 2 - 1] + times[n // 2]) / 2
        return max(STALL_MIN_SECONDS, 2.0 * median)

    def _watch(self) -> None:
        """The rankguard-wavefront thread (see the module's "Stalls")."""
        stall = None  # the progress mark of the stall being watched
        looked = sent_at = 0.0
        seen = sent = None  # the recorder's status at the last look, and in the last send
        front: tuple[Collective, ...] = ()
        timeout_checked = False
        while not self._watch_stop.wait(STALL_LOOK_SECONDS):
            if not timeout_checked and len(self.timings) >= TIMEOUT_CHECK_STEPS:
                timeout_checked = True
                self._check_timeout()
            mark = self._progress_at
            now = time.perf_counter()
            if now - mark < STALL_MIN_SECONDS:  # steps flow: one clock read, nothing else
                continue
            if self.sender.closed or self.current_phase == "done":
                return
            if now - mark < self.stall_seconds() or now - looked < STALL_READ_SECONDS:
                continue
            if stall != mark:  # a new stall: report it at once
                stall, seen, sent, front, sent_at = mark, None, None, (), 0.0
            looked = now
            try:
                status = flight_recorder.read_status()
                if status is None:  # no process group, or a recorder without groups
                    continue
                moving, seen = seen is not None and status != seen, status
                if moving:  # collectives still complete: not hung in one; look again
                    continue
                if status != sent:
                    sent, front = flight_recorder.read()
                    seen = sent
                elif now - sent_at < STALL_REPEAT_SECONDS:
                    continue
                if front and self._progress_at == mark:
                    self._send(None, self.last_loss, None, collectives=front)
                    sent_at = now
            except Exception:
                self._count("flight_recorder")

    def _watch_footprint(self) -> tuple[set[int], int]:
        """The stall watch's thread and the bytes its evidence records took (at most a
        datagram each, counted as a whole one): not progress of a phase."""
        w = self._watcher
        ids = {w.native_id} if w is not None and w.native_id is not None else set()
        return ids, self._evidence_sent * MAX_DATAGRAM_BYTES

    def _check_timeout(self) -> None:
        """Warn, once, when a process group of this job times out sooner than rankguard can
        name a hang's culprit: NCCL's watchdog would then abort the waiting ranks first (a
        victim dies first; the supervisor keeps its budget under half the timeout, which
        needs a stall reported and a pass or two after it)."""
        try:
            timeouts = [c.timeout_s for c in flight_recorder.read()[1] if c.timeout_s]
        except Exception:
            self._count("flight_recorder")
            return
        if not timeouts:
            return
        slowest = max(t.step_seconds for t in self.timings[-STALL_STEPS:])
        needed = max(10 * slowest, 2 * (self.stall_seconds() + TIMEOUT_MARGIN_SECONDS))
        if min(timeouts) < needed:
            log.warning(
                "rankguard: a process group of this job times out after %gs, sooner than "
                "rankguard can name a hung rank (%.0fs: its hang budget, 10x the slowest "
                "recent step, and half the timeout must leave time to report a stall); the "
                "watchdog will decide first. Raise timeout= in init_process_group / new_group.",
                min(timeouts), needed,
            )  # fmt: skip

    def _fitting(self, record: dict, front: tuple[Collective, ...]) -> list[dict]:
        """The leading groups of ``front`` (the busiest first) that fit in one datagram
        with the rest of ``record`` and the sender's counters."""
        counts = self.sender._error_counts()
        rest = {**record, "client_errors": counts} if counts else record
        room = MAX_DATAGRAM_BYTES - 64 - len(encode(TelemetryRecord.from_dict(rest)))
        room -= len(',"collectives":[]')  # 64 above: a count that appears meanwhile
        out: list[dict] = []
        for c in front:
            item = c.to_json()
            room -= len(json.dumps(item, separators=(",", ":"), allow_nan=False)) + 1
            if room < 0:
                break
            out.append(item)
        return out

    # -- set-up -------------------------------------------------------------------------
    def attach(self, model: Any) -> Any:
        """Time the communication of a DDP model (:func:`~.timing.attach_ddp`) or of FSDP2
        modules (:func:`~.timing.attach_fsdp`) without changing it: what is communicated,
        on which group, with which arithmetic and hooks, stays as it was. Returns
        ``model``. Never raises: what cannot be timed is counted by why (``attach``,
        ``attach_*``, ``untimed_*`` in :attr:`errors`, and so in ``/v1/ranks``)."""
        reasons: list[str] = []
        try:
            if hasattr(model, "register_comm_hook"):
                attach_ddp(self.timer, model, reasons)
            elif attach_fsdp(self.timer, model, reasons) == 0 and not reasons:
                reasons.append("attach")
        except Exception:
            reasons.append("attach")
        for reason in reasons:
            self._count(reason)
        return model

    attach_ddp = attach
    attach_fsdp = attach

    def set_comm_delay(self, seconds: float) -> None:
        """Fault injection: sleep this long in every gradient all-reduce's completion."""
        self.timer.comm_delay_seconds = seconds

    def batches(self, iterable: Any):
        """``for x, y in rg.batches(loader):``: the time blocked in ``next()`` (a
        `DataLoader`'s workers with nothing ready included) is the data wait of the step it
        feeds, whether fetched inside the step or just before it opens."""

        def counted_by_step() -> bool:  # the open step's data phase already counts it
            s = self._open
            return s is not None and s._phase in (None, "data")

        return timed_batches(self.timer, iterable, in_step_data_phase=counted_by_step)

    # -- the step -----------------------------------------------------------------------
    def step(self, step: int, *, tokens: int | float | None = None) -> Step:
        """Open step ``step`` (ending a step still open): ``with rg.step(n) as s:`` or
        ``s = rg.step(n)`` at the top of the loop. Closing it reports the finished steps
        whose timings can be read (on a GPU, the one before)."""
        self.end_step()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            self._count("bad_value")
            step = self.last_step + 1
        s = Step(self, step, tokens)
        self._progress_at = s._host_start  # a step begun is progress (no clock read)
        try:
            self.timer.begin(step, s._host_start)  # one start for the step and its data wait
            self.timer.mark("compute_start")
            self._open = s
        except Exception:
            self._count("timer")
        return s

    def end_step(self) -> None:
        """End the open step, if any."""
        if self._open is not None:
            self._open.end()

    def _end_step(self, s: Step) -> None:
        try:
            self.timer.end()
            if len(self._pending) >= 64:  # steps whose timings never came: forget them
                self._pending.clear()
                self._count("timer")
            self._pending[s.step] = (s._loss, s._tokens)
            self.last_step = s.step
            if self.current_phase != "train":
                self.current_phase = "train"
            self._report(self.timer.ready())
        except Exception:
            self._count("timer")
            self.timer._current = None

    def flush(self) -> None:
        """End the open step; report every step still waiting for its timings."""
        self.end_step()
        try:
            self._report(self.timer.ready(flush=True))
        except Exception:
            self._count("timer")

    def _hold_loss(self, value: Any) -> Any:
        try:
            if value is None:
                return None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if getattr(getattr(value, "device", None), "type", None) == "cuda":
                return _HeldLoss(value)
            if hasattr(value, "detach"):
                return float(value.detach())
        except Exception:
            pass
        self._count("bad_value")
        return None

    def _report(self, timings: list[StepTiming]) -> None:
        for t in timings:
            held, tokens = self._pending.pop(t.step, (None, None))
            loss = None
            try:
                loss = held.value() if isinstance(held, _HeldLoss) else held
            except Exception:
                self._count("bad_value")
            self.report(t, loss, tokens)

    def report(
        self, timing: StepTiming, loss: float | None = None, tokens: int | float | None = None
    ) -> None:
        """Send one resolved step: for a loop that drives :attr:`timer` itself
        (``begin``/``mark``/``host``/``end``, then ``for t in timer.ready(): rg.report(t,
        loss, tokens)``), as the bundled trainer does. ``loss``: a float (or anything
        ``float()`` takes); ``tokens``: this rank's tokens in the step. Never raises."""
        try:
            if loss is not None:
                loss = float(loss)
                self.last_loss = loss
                if self.nonfinite_loss_step is None and not math.isfinite(loss):
                    self.nonfinite_loss_step = timing.step
            self.timings.append(timing)
            if len(self.timings) > 1024:
                del self.timings[:512]
        except Exception:
            self._count("bad_value")
            loss = None
        self._send(timing, loss, tokens)

    # -- long phases --------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str, *, heartbeat: bool = True):
        """A long phase outside the step (``checkpoint_save``, ``eval``,
        ``checkpoint_load``): announced at once, re-announced every
        ``heartbeat_seconds`` from a daemon thread while it runs (up to
        ``heartbeat_limit_seconds``), back to ``train`` (or the phase before) after."""
        if name not in PHASES:
            self._count("bad_phase")
            yield
            return
        self.end_step()  # a long phase is not part of a step's time
        before = self.current_phase
        self.heartbeat(name)
        stop = threading.Event()
        beater = None
        if heartbeat and self.heartbeat_seconds > 0:
            beater = threading.Thread(
                target=self._beat, args=(name, stop), name=f"rankguard-{name}", daemon=True
            )
            with contextlib.suppress(Exception):
                beater.start()
        try:
            yield
        finally:
            stop.set()
            if beater is not None and beater.is_alive():
                beater.join(timeout=1.0)  # its last beat lands before the phase change
            self.current_phase = before if before not in ("init", name) else "train"
            self.heartbeat()

    def _beat(self, name: str, stop: threading.Event) -> None:
        deadline = time.monotonic() + self.heartbeat_limit_seconds
        progress = ProcessProgress(self._watch_footprint) if self.heartbeat_progress else None
        while not stop.wait(self.heartbeat_seconds) and time.monotonic() < deadline:
            if self.current_phase != name:
                return
            if progress is not None and not progress.moved():
                continue  # no CPU, no I/O: silence, which the supervisor judges
            self._send(None, self.last_loss, None, phase=name)
            if progress is not None:
                progress.rebase()  # our own send must not read as the next beat's progress

    def heartbeat(self, phase: str | None = None) -> None:
        """Send a record without step timings (announces ``phase``, or the current one)."""
        if phase is not None:
            if phase not in PHASES:
                self._count("bad_phase")
                return
            self.current_phase = phase
        self._send(None, self.last_loss, None)

    def checkpoint_saved(self, step: int) -> None:
        """The newest checkpoint that is known whole (reported as ``checkpoint_step``)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            self._count("bad_value")
            return
        self.checkpoint_step = step

    def save_requested(self, step: int) -> bool:
        """Whether the supervisor asked this job to checkpoint at ``step``: its predictive
        drain takes a node whose GPU is failing out at the job's next checkpoint, and a
        save now costs less than waiting for the scheduled one. Ask once a step, after the
        optimizer step, and save as a scheduled save would: every rank of the job is asked
        for the same step. Reads the request (contract/save_requests.py) at most every half
        second; never raises."""
        try:
            now = time.monotonic()
            if now >= self._save_read_at:
                self._save_read_at = now + SAVE_REQUEST_POLL_SECONDS
                self._save_step = self._read_save_request()
            return self._save_step is not None and step == self._save_step
        except Exception:
            self._count("internal")
            return False

    def _read_save_request(self) -> int | None:
        if self.sender.path is None:
            return None
        try:
            with open(request_path(self.sender.path, self.job), "rb") as f:
                data = f.read(MAX_REQUEST_BYTES + 1)
        except OSError:  # none (the usual case), or unreadable
            return None
        try:
            request = decode(data)
        except ContractError:
            self._count("save_request")
            return None
        if request.job != self.job or request.restart != self.restart:
            return None  # another incarnation's, or a digest's collision
        return request.step

    def data_skipped(self, steps: Any) -> None:
        """The data steps (whole numbers >= 1) this run's resume skips, e.g. the batches
        before a loss spike: every later record carries them (as ranges, at most 16), and
        the supervisor writes them into the incident whose restart this is."""
        try:
            steps = list(steps)
            if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in steps):
                raise ValueError(steps)
            self.resume_skips = skip_ranges(steps)
        except Exception:
            self._count("bad_value")

    def close(self) -> None:
        """Flush pending steps, announce ``done`` and close the socket. Idempotent; runs
        by itself at interpreter exit."""
        if self.sender.closed:
            return
        with contextlib.suppress(Exception):
            atexit.unregister(self._close_quietly)
        self.sender.patience = CLOSE_PATIENCE  # training is over: waiting costs it nothing
        self._stop_watch()
        self.flush()
        self.heartbeat("done")
        self.sender.close()

    def _close_quietly(self) -> None:
        """At interpreter exit. An exit on an uncaught exception (``sys.last_exc`` is set
        before atexit runs) is a crash, not the end of training: the last steps are sent
        but not "done", which would make the agent take the dead rank as finished."""
        with contextlib.suppress(Exception):
            if getattr(sys, "last_exc", None) is None and getattr(sys, "last_value", None) is None:
                self.close()
                return
            atexit.unregister(self._close_quietly)
            self.sender.patience = CLOSE_PATIENCE
            self._stop_watch()
            self.flush()
            self.sender.close()

    def _stop_watch(self) -> None:
        """End the stall watch; a read it is in finishes first (torch's dump must not run
        on while the interpreter ends)."""
        self._watch_stop.set()
        w = self._watcher
        if w is not None and w.is_alive() and w is not threading.current_thread():
            w.join(timeout=2.0)

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- records ------------------------------------------------------------------------
    @property
    def device(self) -> Any:
        """The device the clock times (None until the first step resolves it)."""
        return self.timer.clock.device

    def gpu_uuid(self) -> str | None:
        """The NVML UUID of the GPU this rank computes on, read once the first step has put
        the clock on a CUDA device (the agent ties the rank to that GPU's faults by it)."""
        if self._gpu_uuid is None and self.timer.clock.resolved:
            self._gpu_uuid = device_uuid(self.device) or ""  # None on the host clock
        return self._gpu_uuid or None

    def peak_memory_bytes(self) -> int:
        """Read at most every PEAK_MEMORY_EVERY seconds: on a GPU the read builds all of the
        caching allocator's statistics (about 0.5 ms of host time), too dear per step. Read
        again when the first step has put the clock on the GPU."""
        now, cuda = time.monotonic(), self.timer.clock.cuda
        peak = self._peak_memory
        if peak is None or now - peak[0] >= PEAK_MEMORY_EVERY or peak[1] != cuda:
            self._peak_memory = peak = (now, cuda, self._read_peak_memory(cuda))
        return peak[2]

    def _read_peak_memory(self, cuda: bool) -> int:
        if cuda:
            import torch

            return int(torch.cuda.max_memory_allocated(self.device))
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    def _send(
        self,
        t: StepTiming | None,
        loss: float | None,
        tokens: int | float | None,
        phase: str | None = None,
        collectives: tuple[Collective, ...] | None = None,
    ) -> None:
        """One record; with ``collectives``, a stall's evidence (``progress`` false), which
        is no progress of the rank."""
        if collectives is None:
            self._progress_at = time.perf_counter()
        if not self.sender.enabled:  # cheap when telemetry is off: count, build nothing
            self.sender.send({})
            return
        try:
            tps = tokens / t.step_seconds if t and tokens and t.step_seconds > 0 else 0.0
            mfu = 0.0
            if tps and self.peak_flops > 0 and self.flops_per_token > 0:
                mfu = min(1.0, self.flops_per_token * tps / self.peak_flops)
            if loss is not None and not isinstance(loss, float):
                loss = float(loss)
            record = dict(
                v=SCHEMA_VERSION, job=self.job, rank=self.rank, local_rank=self.local_rank,
                world_size=self.world_size, pid=self._pid, restart=self.restart,
                step=t.step if t else self.last_step, phase=phase or self.current_phase,
                time=time.time(),
                step_seconds=t.step_seconds if t else 0.0,
                data_wait_seconds=t.data_wait_seconds if t else 0.0,
                compute_seconds=t.compute_seconds if t else 0.0,
                comm_seconds=t.comm_seconds if t else 0.0,
                comm_exposed_seconds=t.comm_exposed_seconds if t else 0.0,
                optimizer_seconds=t.optimizer_seconds if t else 0.0,
                checkpoint_block_seconds=t.checkpoint_block_seconds if t else 0.0,
                tokens_per_second=tps if math.isfinite(tps) else 0.0, mfu=mfu,
                # evidence comes from the watch thread while the loop may be inside the
                # allocator: the last reading, not a new one
                peak_memory_bytes=self.peak_memory_bytes() if collectives is None
                else (self._peak_memory or (0, False, 0))[2],
                loss=loss, checkpoint_step=self.checkpoint_step,
            )  # fmt: skip
            if t and tokens and self.flops_per_token > 0:  # FLOPs done: the agent's counter
                record["flops"] = float(self.flops_per_token * tokens)
            if self.peak_flops > 0:
                record["peak_flops"] = float(self.peak_flops)
            if t and t.compute_wait_seconds is not None:  # preempted part of compute
                record["compute_wait_seconds"] = t.compute_wait_seconds
            if self.resume_skips:
                record["resume_skips"] = self.resume_skips
            uuid = self.gpu_uuid() if collectives is None else (self._gpu_uuid or None)
            if uuid is not None:
                record["gpu_uuid"] = uuid
            if collectives is not None:
                record["progress"] = False
                record["collectives"] = self._fitting(record, collectives)
                self._evidence_sent += 1
        except Exception as exc:
            self._count("record")
            self.sender.count_drop("invalid", exc)
            return
        self.sender.send(record)  # validates; counts and drops a bad one; never raises
