"""Per-step phase timing and communication measurement.

Phases of a step: data wait (host), forward+backward, optimizer, checkpoint blocking
(host). Communication is measured where it happens: a DDP comm hook wraps every
gradient all-reduce and records when the bucket was handed to the process group and
when its future completed.

- `comm_seconds`: wall time during which at least one timed collective was in flight
  (the union of their intervals), overlapped with compute or not.
- `comm_exposed_seconds`: the part of forward+backward spent only waiting for
  communication. DDP: measured where the step waits: the hook queues an autograd
  callback at its first bucket, which runs when autograd's graph is done, just before
  DDP's reducer finalization (queued after the last bucket's launch) blocks on every
  bucket's future; from that mark to backward's return the step did nothing but wait.
  FSDP2: each parameter group's wait for its parameters before its module runs, forward
  and backward, while an all-gather was in flight, plus the collectives in flight after
  the last launch and before backward's return (that tail alone for a timer fed by hand).
- `compute_seconds`: forward+backward minus the exposed communication.

Attaching only observes: what is communicated, on which process group, with which
arithmetic, stays as it was (training is bit-identical with and without it).

- DDP (:func:`attach_ddp`): the gradient all-reduces, on DDP's own process group
  (``DDP(process_group=...)``, ``device_mesh=``), with DDP's own arithmetic (times 1/n,
  then the sum; NCCL's AVG where the bucket's backend is NCCL). A comm hook the user
  registers after attaching (compression, PowerSGD) runs inside ours and is timed from its
  call to its future. DDP takes one hook: one registered before cannot be wrapped, so
  nothing is attached (``attach_hook_taken``).
- FSDP2 (:func:`attach_fsdp`): every all-gather (forward and backward) and reduce-scatter,
  by wrapping the parameter group's own collective object (FSDP's default, a custom one,
  symmetric memory) rather than replacing it.
- Not timed, and so inside `compute_seconds`: HSDP's all-reduce across replicas
  (``untimed_hsdp_all_reduce``); collectives on groups other than the data-parallel one,
  i.e. tensor-parallel all-reduces/all-gathers (DTensor), pipeline send/recv, expert
  all-to-all, context-parallel rings (``untimed_other_groups`` when the data-parallel
  ranks are fewer than the world); DDP's forward buffer broadcast, its unused-parameter
  map, ``delay_all_reduce_named_params``; the optimizer's collectives (gradient-norm
  clipping over DTensors); anything the user issues. The named ones are counted in the
  Reporter's errors, which every record carries to ``/v1/ranks``.

On CPU the marks are `time.perf_counter()`; on CUDA they are events recorded on the
stream, read one step later (by then they have completed), so the hot path never
synchronises the host with the device.

Data wait is the host time the loop spends getting its next batch: for a `DataLoader`
with workers, the time blocked in `next(iterator)` while the workers have nothing ready
(a slow filesystem, a starved pool), measured where the loop blocks (:func:`timed_batches`).
A batch fetched between two steps (``for batch in loader:`` around the step) is carried
into the step that follows: its data wait, and its step time from the fetch's start.

Run-queue wait (issue 16): at the compute phase's start and end marks the loop thread's
``/proc/thread-self/schedstat`` is read (field 2: nanoseconds it was runnable but waiting
for a CPU), and the difference is ``compute_wait_seconds``, the part of compute the rank
spent preempted rather than working. One fd per thread, read with ``pread`` (about 2 us a
read here; an open per read costs several times that). Linux only: elsewhere, or when the
file cannot be read, the field is None (unknown). On CUDA it is the host thread's wait,
an upper bound of what preemption added to the device's compute (a starved stream).

Torch is imported lazily: this module imports with the standard library alone, and only
a CUDA clock, the DDP hook and the FSDP wrappers touch torch.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..contract.telemetry import comm_compute_ratio


@dataclass
class StepTiming:
    step: int
    step_seconds: float
    data_wait_seconds: float
    compute_seconds: float
    comm_seconds: float
    comm_exposed_seconds: float
    optimizer_seconds: float
    checkpoint_block_seconds: float
    # of compute_seconds, the time the loop thread was runnable but had no CPU (None:
    # unknown: not Linux, or the marks came from different threads)
    compute_wait_seconds: float | None = None

    @property
    def comm_compute_ratio(self) -> float:
        return comm_compute_ratio(self.comm_seconds, self.compute_seconds)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end] intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length covered by both the union of `a` and the union of `b`."""
    return union_length(a) + union_length(b) - union_length(a + b)


def _is_cuda(device: Any) -> bool:
    """A `torch.device`, a string such as "cuda:0", or None (CPU)."""
    if device is None:
        return False
    kind = getattr(device, "type", None)
    return (kind if kind is not None else str(device).split(":")[0]) == "cuda"


class Clock:
    """Timestamps on the host (CPU) or on the CUDA stream, as float seconds when read.

    ``device`` (a `torch.device`, "cuda[:N]", None for the host, or a function returning
    one) is resolved at the first mark, not here: "cuda" is the current device when the
    first step begins (a script may call ``torch.cuda.set_device`` after building the
    Reporter), and a model on the meta device is timed where it was materialized.
    """

    def __init__(self, device: Any = None):
        self._spec = device
        self.device: Any = None  # what `device` resolved to (a CUDA one with its index)
        self.cuda = False
        self.resolved = False
        self._lock = threading.Lock()

    def _resolve(self) -> None:
        with self._lock:  # a comm hook on autograd's thread may mark first
            if self.resolved:
                return
            device = self._spec
            if callable(device):
                try:
                    device = device()
                except Exception:  # the model is gone or unreadable: the host clock
                    device = None
            if _is_cuda(device):
                import torch

                self._event = torch.cuda.Event
                # The device's index, resolved once: `Event.record()` without a stream looks
                # up the current device and stream in Python each time (about 50 us on an
                # H100 host), several times a step; with an int index the lookup is a C call.
                index = getattr(device, "index", None)
                if index is None and ":" in str(device):
                    index = int(str(device).split(":")[1])
                self._index = torch.cuda.current_device() if index is None else index
                self._current_stream = torch.cuda.current_stream
                self._origin = self._event(enable_timing=True)
                self._origin.record(self._current_stream(self._index))
                device = torch.device("cuda", self._index)
                self.cuda = True
            self.device = device
            self.resolved = True

    def mark(self):
        if not self.resolved:
            self._resolve()
        if not self.cuda:
            return time.perf_counter()
        ev = self._event(enable_timing=True)
        ev.record(self._current_stream(self._index))
        return ev

    def seconds(self, mark) -> float:
        if not self.cuda:
            return mark
        mark.synchronize()  # a step old by the time we read it: already complete
        return self._origin.elapsed_time(mark) / 1000.0


class _ThreadFile:
    """One thread's schedstat file, open for the thread's life (closed with it)."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        try:
            self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, AttributeError):
            self.fd = -1  # not Linux, or no /proc: unknown for good

    def __del__(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)


class RunQueueWait:
    """The calling thread's run-queue wait so far, in ns (``/proc/thread-self/schedstat``
    field 2), from one fd per thread kept open and read by ``pread`` at offset 0. The fd
    lives in a ``threading.local`` (dropped with its thread: a file of a thread that ended
    still reads, its stale numbers, so it must never serve the next thread)."""

    def __init__(self) -> None:
        self._local = threading.local()
        # a forked child's thread is not the parent's: it opens its own file
        with contextlib.suppress(AttributeError):
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._local = threading.local()

    def read(self) -> tuple[_ThreadFile, int] | None:
        """(the thread's file, ns waited), or None when unknown."""
        f = getattr(self._local, "file", None)
        if f is None:
            f = self._local.file = _ThreadFile()
        if f.fd < 0:
            return None
        try:
            return f, int(os.pread(f.fd, 64, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return None


RUN_QUEUE = RunQueueWait()  # one per process: the fds belong to threads, not to timers
_WAIT_MARKS = ("compute_start", "backward_end")  # compute's bounds


@dataclass
class _PendingStep:
    step: int
    host_start: float
    marks: dict = field(default_factory=dict)
    waits: dict = field(default_factory=dict)  # compute's bounds -> (thread file, ns waited)
    host: dict = field(default_factory=dict)
    comm: list = field(default_factory=list)
    # (start, end) marks of the compute stream's waits before a module can run (FSDP2's
    # unshard in forward and backward): their overlap with `comm` is exposed communication
    comm_waits: list = field(default_factory=list)
    autograd_queued: bool = False  # the "autograd_done" callback is queued for this step


class StepTimer:
    """Collects the marks of each step; `ready()` returns the timings that can be read."""

    def __init__(self, device: Any = None):
        self.clock = Clock(device)
        self._pending: deque[_PendingStep] = deque()
        self._current: _PendingStep | None = None
        self.comm_delay_seconds = 0.0  # fault hook: extra latency per all-reduce
        # the futures `then` made this step: their last reference stays on this thread
        self._chained: list = []
        self._carried: tuple[float, float] | None = None  # (fetch start, seconds) before begin

    def carry_data_wait(self, started: float, seconds: float) -> None:
        """A batch fetched before the step opened: counted in the next step begun."""
        if self._carried is not None:  # two fetches for one step: both are its wait
            started, seconds = self._carried[0], self._carried[1] + seconds
        self._carried = (started, seconds)

    # -- hot path ---------------------------------------------------------------
    def begin(self, step: int, start: float | None = None) -> None:
        """Open `step`, started at `start` (perf_counter; now by default)."""
        start = time.perf_counter() if start is None else start
        carried, self._carried = self._carried, None
        if carried is not None:
            start = min(start, carried[0])
        self._current = _PendingStep(step, start)
        self._chained = []
        if carried is not None:
            self._current.host["data_wait"] = carried[1]

    def mark(self, name: str) -> None:
        self._current.marks[name] = self.clock.mark()
        if name in _WAIT_MARKS:
            self._current.waits[name] = RUN_QUEUE.read()

    def host(self, name: str, seconds: float) -> None:
        self._current.host[name] = self._current.host.get(name, 0.0) + seconds

    def comm_launched(self):
        return self.clock.mark()

    def comm_done(self, launched) -> None:
        if self._current is not None:
            self._current.comm.append((launched, self.clock.mark()))

    def comm_wait(self, began) -> None:
        """The compute stream waited on communication from the mark `began` until now."""
        if self._current is not None:
            self._current.comm_waits.append((began, self.clock.mark()))

    def end(self) -> None:
        self._current.host["step"] = time.perf_counter() - self._current.host_start
        self._pending.append(self._current)
        self._current = None

    # -- read side ------------------------------------------------------------------
    def ready(self, flush: bool = False) -> list[StepTiming]:
        """Timings of finished steps; on CUDA all but the newest unless `flush`."""
        keep = 0 if (flush or not self.clock.cuda) else 1
        out = []
        while len(self._pending) > keep:
            out.append(self._resolve(self._pending.popleft()))
        return out

    def _resolve(self, p: _PendingStep) -> StepTiming:
        """Missing marks count as zero-length phases (a step may skip the optimizer)."""
        s = {k: self.clock.seconds(v) for k, v in p.marks.items()}
        comm = [(self.clock.seconds(a), self.clock.seconds(b)) for a, b in p.comm]
        waits = [(self.clock.seconds(a), self.clock.seconds(b)) for a, b in p.comm_waits]
        start = s.get("compute_start")
        bwd_end = s.get("backward_end", start)
        opt_end = s.get("optimizer_end", bwd_end)
        fwd_bwd = bwd_end - start if start is not None and bwd_end is not None else 0.0
        optimizer = opt_end - bwd_end if bwd_end is not None and opt_end is not None else 0.0
        exposed = 0.0
        done = s.get("autograd_done")
        if done is not None and bwd_end is not None and comm:  # measured where it blocked
            exposed = min(max(0.0, bwd_end - done), union_length(comm))
        elif comm and bwd_end is not None:
            # in flight after the last launch, until backward returned (the tail), and in
            # flight while the compute stream waited for it (FSDP2's forward and backward
            # all-gathers): |tail| + |waits & comm| - |tail & waits|, the tail being in comm
            last_launch, end = max(a for a, _ in comm), bwd_end
            tail = [(max(a, last_launch), min(b, end)) for a, b in comm if b > last_launch and a < end]  # fmt: skip
            exposed = union_length(tail)
            if waits:
                exposed += overlap_length(waits, comm) - overlap_length(tail, waits)
        compute = max(0.0, fwd_bwd - exposed)
        return StepTiming(
            step=p.step,
            step_seconds=p.host["step"],
            data_wait_seconds=p.host.get("data_wait", 0.0),
            compute_seconds=compute,
            comm_seconds=union_length(comm),
            comm_exposed_seconds=exposed,
            optimizer_seconds=max(0.0, optimizer),
            checkpoint_block_seconds=p.host.get("checkpoint_block", 0.0),
            compute_wait_seconds=_compute_wait(p.waits, compute),
        )


def _compute_wait(waits: dict, compute: float) -> float | None:
    """Run-queue wait between compute's marks, at most compute itself (a wait in the
    exposed communication's interval is not part of compute); None when unknown."""
    a, b = waits.get("compute_start"), waits.get("backward_end")
    if a is None or b is None or a[0] is not b[0]:  # unknown, or two threads
        return None
    return min(max(0.0, (b[1] - a[1]) / 1e9), compute)


def timed_batches(timer: StepTimer, iterable, *, in_step_data_phase=lambda: False):
    """Yield from ``iterable`` (a `DataLoader`, with workers or not), timing each
    ``next()``: inside an open step it is that step's data wait, before one it is carried
    into the next step begun. ``in_step_data_phase()`` True means the caller already
    counts this time as data wait (the Reporter's unnamed or "data" phase)."""
    it = iter(iterable)
    while True:
        start = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            return
        seconds = time.perf_counter() - start
        if timer._current is None:
            timer.carry_data_wait(start, seconds)
        elif not in_step_data_phase():
            timer.host("data_wait", seconds)
        yield item


def backend_for(backend: str, device_type: str) -> str:
    """The backend that a process group's backend string gives tensors of `device_type`:
    ``"nccl"`` for every device, or ``"cpu:gloo,cuda:nccl"`` one per device type ("" when
    the string names none for it)."""
    for part in backend.lower().split(","):
        device, sep, name = part.strip().partition(":")
        if not sep:
            return device
        if device == device_type:
            return name.strip()
    return ""


def reduce_op(group, device_type: str):
    """AVG where the group's backend for this device is NCCL (it averages inside the
    collective: for floating types a premultiply by 1/n, as DDP's copy into the bucket
    does), SUM elsewhere (after the hook's own premultiply). SUM when the backend cannot
    be read: correct everywhere, AVG is only faster."""
    import torch.distributed as dist

    try:
        nccl = backend_for(str(dist.get_backend(group)), device_type) == "nccl"
    except Exception:
        nccl = False
    return dist.ReduceOp.AVG if nccl else dist.ReduceOp.SUM


class DDPHook:
    """The state of :func:`timed_allreduce_hook` as :func:`attach_ddp` registers it: the
    step timer, the DDP module (held weakly: DDP's C++ reducer holds this state, a cycle
    the garbage collector cannot see), whose process group is read at every bucket
    (``DDP._update_process_group`` may change it), and a user's hook registered after
    the Reporter (``user``: ``(hook, state)``), which runs in its place, timed."""

    __slots__ = ("timer", "_ddp", "user", "_op")

    def __init__(self, timer: StepTimer, ddp) -> None:
        self.timer = timer
        self._ddp = weakref.ref(ddp)
        self.user: tuple[Any, Any] | None = None
        self._op: tuple[Any, str, Any] = (None, "", None)  # (group, device type, op)

    def group(self):
        return self._ddp().process_group

    def op(self, group, device_type: str):
        """`reduce_op`, kept for the group and device DDP's buckets keep using."""
        if self._op[0] is not group or self._op[1] != device_type:
            self._op = (group, device_type, reduce_op(group, device_type))
        return self._op[2]

    def register(self, state: object, hook: Any) -> None:
        """``DDP.register_comm_hook`` while the Reporter holds DDP's one hook: the user's
        hook is kept as DDP would keep it and runs inside ours. A second one is refused
        with DDP's own error, as DDP would refuse it."""
        if self.user is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        ddp = self._ddp()
        ddp._check_comm_hook(hook)
        ddp.logger._set_comm_hook_name(hook.__qualname__)
        ddp._comm_hooks.append((hook, state))
        self.user = (hook, state)


def timed_allreduce_hook(state, bucket):
    """DDP comm hook: all-reduce the bucket on DDP's process group with DDP's own
    arithmetic (each gradient times 1/n, then the sum: bit-identical to DDP without a
    hook), timing it; or, when the user registered a hook after the Reporter, run that
    hook and time it from its call until its future completes.

    Attach with :func:`attach_ddp` (or ``Reporter(ddp)``). Registered by hand,
    ``ddp.register_comm_hook(timer, timed_allreduce_hook)`` with a :class:`StepTimer` as
    the state, it all-reduces over the default group: only for DDP built on it."""
    import torch.distributed as dist

    if isinstance(state, DDPHook):
        if state.user is not None:
            return _timed_user_hook(state, bucket)
        timer, group, op_for = state.timer, state.group(), state.op
    else:
        timer, group, op_for = state, dist.group.WORLD, reduce_op
    tensor = bucket.buffer()
    world = dist.get_world_size(group)
    # Averaging is the hook's only real cost (measured on an H100: the timing is free, a
    # separate `div_` over every bucket is +1.2% of a 29 ms step); DDP's built-in path
    # folds it into its copy of the gradients. NCCL averages inside the collective; other
    # backends sum, after the multiply by 1/n (not a division: DDP multiplies, and x / 3
    # is not always x * (1/3)) that a single rank does not need.
    op = dist.ReduceOp.SUM
    if world > 1:
        op = op_for(group, tensor.device.type)
        if op != dist.ReduceOp.AVG:
            tensor.mul_(1.0 / world)
    _mark_autograd_done(timer)
    launched = timer.comm_launched()
    fut = dist.all_reduce(tensor, op=op, group=group, async_op=True).get_future()
    return _timed_future(timer, fut, launched, tensor, _first)


def _first(value):
    return value[0]  # a collective's future holds a list of tensors


def _same(value):
    return value  # a comm hook's future holds the bucket's tensor


def _timed_user_hook(state: DDPHook, bucket):
    """The user's hook, timed from its call (its encoding included) to its future."""
    hook, user_state = state.user
    _mark_autograd_done(state.timer)
    launched = state.timer.comm_launched()
    fut = hook(user_state, bucket)
    return _timed_future(state.timer, fut, launched, bucket.buffer(), _same)


def _timed_future(timer: StepTimer, fut, launched, tensor, result):
    """`fut`, marked done when it completes; the bucket's tensor is `result(value)`."""
    delay = timer.comm_delay_seconds
    if delay:
        return _delayed(timer, fut, launched, delay, tensor, result)

    def done(f):
        timer.comm_done(launched)
        return result(f.value())

    return _chain(timer, fut, done)


def attach_ddp(timer: StepTimer, ddp, reasons: list[str] | None = None) -> bool:
    """Time the gradient communication of a DDP module, changing none of it: the hook
    all-reduces on DDP's own process group with DDP's own arithmetic, and a comm hook the
    user registers afterwards (compression, PowerSGD) runs inside it, timed.

    Returns whether it is attached. When it is not, `reasons` gets why, and DDP is left
    as it was: ``"attach_hook_taken"`` (DDP already has a comm hook, Python or built-in:
    its reducer takes one and none can be wrapped once registered), ``"attach_unreadable"``
    (a DDP whose process group or hooks cannot be read, or compiled DDP's Python reducer,
    which calls hooks per parameter). ``"untimed_other_groups"`` is added when the DDP
    group is a sub-group: the other dimensions' collectives (TP, PP, EP, CP) are not
    timed. Attaching twice is a no-op."""
    import torch.distributed as dist

    reasons = [] if reasons is None else reasons
    try:
        group, hooks = ddp.process_group, ddp._comm_hooks
        builtin = ddp._get_ddp_logging_data().get("comm_hook")
        readable = isinstance(hooks, list) and not ddp._use_python_reducer
        size = dist.get_world_size(group)
    except Exception:
        readable = False
    if not readable:
        reasons.append("attach_unreadable")
        return False
    if any(isinstance(s, DDPHook) and s.timer is timer for _, s in hooks):
        return True
    if hooks or builtin:
        reasons.append("attach_hook_taken")
        return False
    state = DDPHook(timer, ddp)
    try:
        ddp.register_comm_hook(state, timed_allreduce_hook)
    except Exception:  # a hook set on the reducer itself: DDP keeps it, and its bookkeeping
        with contextlib.suppress(ValueError):
            hooks.remove((timed_allreduce_hook, state))
        reasons.append("attach_hook_taken")
        return False
    ddp.register_comm_hook = state.register  # on this instance only
    if size < dist.get_world_size():
        reasons.append("untimed_other_groups")
    return True


def _delayed(timer: StepTimer, fut, launched, delay: float, tensor, result):
    """Fault hook, a slow link: the bucket's future completes `delay` seconds after its
    all-reduce did, from a thread of its own. Never by sleeping in the callback: a future
    already complete runs `then` inline, in the backward pass, and the delay would be
    taken for compute instead of a wait on communication."""
    import torch

    cuda = tensor.device.type == "cuda"
    out = torch.futures.Future(devices=[tensor.device] if cuda else None)

    def late(f):
        def finish():
            time.sleep(delay)
            timer.comm_done(launched)  # the step is open: backward waits on `out`
            out.set_result(result(f.value()))

        threading.Thread(target=finish, name="rankguard-comm-delay", daemon=True).start()

    _chain(timer, fut, late)
    return out


def _mark_autograd_done(timer: StepTimer) -> None:
    """Queue, once per step, an autograd callback marking when the graph is done. Queued
    at the first bucket, it runs before DDP's finalization (queued after the last bucket's
    launch), which waits there for the buckets' all-reduces."""
    cur = timer._current
    if cur is None or cur.autograd_queued:
        return
    cur.autograd_queued = True
    try:
        from torch.autograd import Variable

        Variable._execution_engine.queue_callback(lambda: _mark_if_open(timer, cur))
    except Exception:  # not inside a backward pass (a hook called by hand): interval method
        pass


def _mark_if_open(timer: StepTimer, step: _PendingStep) -> None:
    if timer._current is step:  # never raise inside backward
        timer.mark("autograd_done")


def _timed_work(timer: StepTimer, launched, work):
    """Mark the end of a collective: now if it ran synchronously (gloo blocks; NCCL made
    the current stream wait for it), else when its future completes."""
    if work is None or not hasattr(work, "get_future"):
        timer.comm_done(launched)
        return work
    try:
        _chain(timer, work.get_future(), lambda _f: timer.comm_done(launched))
    except Exception:  # a backend without futures: count it as done at launch return
        timer.comm_done(launched)
    return work


# -- Python callbacks on collective futures, and interpreter exit ------------------------
#
# A backend thread (gloo's worker, NCCL's watchdog) that completes a future runs its
# `then` callback and afterwards drops the callback and, if it holds the last reference,
# the chained future with the callback's Python result: both need the GIL. If the main
# thread has begun finalizing by then (the script returned right after its last step),
# CPython 3.11 ends the backend thread inside that C++ destructor, and the rank aborts
# with SIGABRT, "terminate called without an active exception" (seen with gloo on two
# loaded cores: about 1 run in 10). So: the step's chained futures are also referenced
# here (their last reference goes on the training thread), every callback is counted
# until it is released, and at exit the interpreter waits, briefly, for the count to
# reach zero.

_released = threading.Condition(threading.RLock())
_held = 0
_exit_wait_registered = False
EXIT_WAIT_SECONDS = 5.0  # bounded: a collective that never completes must not hang exit


class _CountedCallback:
    """A future callback that counts itself held from creation until it is released."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        global _held, _exit_wait_registered
        with _released:
            _held += 1
            if not _exit_wait_registered:
                _exit_wait_registered = True
                atexit.register(wait_for_released_callbacks)
        self.fn = fn

    def __call__(self, fut):
        return self.fn(fut)

    def __del__(self):
        global _held
        with _released:
            _held -= 1
            _released.notify_all()


def _chain(timer: StepTimer, fut, fn):
    chained = fut.then(_CountedCallback(fn))
    timer._chained.append(chained)
    return chained


def held_callbacks() -> int:
    return _held


def wait_for_released_callbacks(timeout: float = EXIT_WAIT_SECONDS) -> bool:
    """Wait until no backend thread holds one of our callbacks; True if none does."""
    with _released:
        done = _released.wait_for(lambda: _held <= 0, timeout)
    # the releasing thread may still be leaving the GIL-holding destructor: let it
    time.sleep(0.01)
    return done


def _timed_comm(timer: StepTimer, comm):
    """FSDP2's all-gather or reduce-scatter object `comm` (its default, one with
    process-group or symmetric-memory buffers, or a user's own), timed: an instance of a
    subclass of its class that shares its attributes (the same ``__dict__``), so every call
    does what it did, on the group FSDP passes, and FSDP's isinstance checks (symmetric
    memory, buffer allocation) see what they saw. A call is marked at launch and at
    completion (:func:`_timed_work`)."""
    base = getattr(type(comm), "_rankguard_base", type(comm))  # timed by another timer
    if getattr(type(comm), "_rankguard_timer", None) is timer:
        return comm

    def __call__(self, *args, **kwargs):
        launched = timer.comm_launched()
        return _timed_work(timer, launched, base.__call__(self, *args, **kwargs))

    timed_class = type(base.__name__, (base,), {"__call__": __call__, "_rankguard_timer": timer,
                                                "_rankguard_base": base})  # fmt: skip
    timed = object.__new__(timed_class)
    timed.__dict__ = comm.__dict__  # raises for a class with __slots__: not timed
    return timed


def _time_unshard_waits(timer: StepTimer, param_group) -> None:
    """Mark, on the compute stream, each wait of an FSDP2 parameter group for its
    parameters before its module runs (``pre_forward``, ``pre_backward``: the unshard, the
    all-gather's wait, the copy-out). Where an all-gather is in flight meanwhile, the step
    waited on communication: exposed, not compute."""
    for name in ("pre_forward", "pre_backward"):
        inner = getattr(param_group, name)
        if getattr(inner, "_rankguard_timer", None) is timer:
            continue

        def timed(*args, _inner=inner, **kwargs):
            began = timer.clock.mark()
            try:
                return _inner(*args, **kwargs)
            finally:
                timer.comm_wait(began)

        timed._rankguard_timer = timer
        setattr(param_group, name, timed)


def attach_fsdp(timer: StepTimer, model, reasons: list[str] | None = None) -> int:
    """Time the communication of the FSDP2 (``fully_shard``) modules in ``model``,
    changing none of it: each parameter group's own all-gather and reduce-scatter (FSDP's
    default, or the one set with ``set_custom_all_gather``/``set_custom_reduce_scatter``
    or symmetric memory) is wrapped (:func:`_timed_comm`), never replaced, and the compute
    stream's waits for the all-gathers are marked (:func:`_time_unshard_waits`).

    Returns how many FSDP modules now report their communication. `reasons` gets
    ``"attach_unreadable"`` for a module whose parameter groups cannot be read (its
    collectives are left as they were), ``"untimed_hsdp_all_reduce"`` when a module is
    HSDP (the all-reduce across replicas is not timed) and ``"untimed_other_groups"``
    when the data-parallel ranks are fewer than the world (TP, PP, EP, CP collectives).
    On a torch without FSDP2, 0.
    """
    reasons = [] if reasons is None else reasons
    try:
        import torch.distributed as dist
        from torch.distributed.fsdp import FSDPModule
    except Exception:
        return 0
    timed, untimed = 0, set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:  # read and build everything first: a module is timed whole or left alone
            groups = list(module._get_fsdp_state()._fsdp_param_groups)
            comms = [(_timed_comm(timer, g._all_gather_comm),
                      _timed_comm(timer, g._reduce_scatter_comm)) for g in groups]  # fmt: skip
            for g in groups:
                info = g.mesh_info
                if g._is_hsdp:
                    untimed.add("untimed_hsdp_all_reduce")
                dp = getattr(info, "shard_mesh_size", 1) * getattr(info, "replicate_mesh_size", 1)
                if dp < dist.get_world_size():
                    untimed.add("untimed_other_groups")
        except Exception:
            reasons.append("attach_unreadable")
            continue
        for g, (all_gather, reduce_scatter) in zip(groups, comms, strict=True):
            g._all_gather_comm, g._reduce_scatter_comm = all_gather, reduce_scatter
            _time_unshard_waits(timer, g)
        timed += 1
    reasons.extend(sorted(untimed))
    return timed
