"""Per-step phase timing and communication measurement.

Phases of a step: data wait (host), forward+backward, optimizer, checkpoint blocking
(host). Communication is measured where it happens: a DDP comm hook wraps every
gradient all-reduce and records when the bucket was handed to the process group and
when its future completed.

- `comm_seconds`: wall time during which at least one all-reduce was in flight (the
  union of the buckets' intervals), overlapped with backward or not.
- `comm_exposed_seconds`: the part of backward spent only waiting for communication,
  measured where the step waits: the DDP hook queues an autograd callback at its first
  bucket, which runs when autograd's graph is done, just before DDP's reducer
  finalization (queued after the last bucket's launch) blocks on every bucket's future;
  from that mark to backward's return the step did nothing but wait. Without the mark
  (FSDP2, or a timer fed by hand) it is the all-reduce time after the last launch and
  before backward's return.
- `compute_seconds`: forward+backward minus the exposed communication.

FSDP2 (`fully_shard`) is timed the same way through its public custom-collective API
(`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`, torch >= 2.8):
:func:`attach_fsdp` wraps each module's all-gather and reduce-scatter so every call is
marked at launch and at completion (the `Work`'s future for an asynchronous all-gather),
and the intervals join the DDP buckets' in the same union.

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


def _is_cuda(device: Any) -> bool:
    """A `torch.device`, a string such as "cuda:0", or None (CPU)."""
    if device is None:
        return False
    kind = getattr(device, "type", None)
    return (kind if kind is not None else str(device).split(":")[0]) == "cuda"


class Clock:
    """Timestamps on the host (CPU) or on the CUDA stream, as float seconds when read."""

    def __init__(self, device: Any = None):
        self.cuda = _is_cuda(device)
        self._origin = None
        if self.cuda:
            import torch

            self._event = torch.cuda.Event
            # The device's index, resolved once: `Event.record()` without a stream looks up
            # the current device and stream in Python each time (about 50 us on an H100
            # host), several times a step; with an int index the lookup is a C call.
            index = getattr(device, "index", None)
            if index is None and ":" in str(device):
                index = int(str(device).split(":")[1])
            self._index = torch.cuda.current_device() if index is None else index
            self._current_stream = torch.cuda.current_stream
            self._origin = self._event(enable_timing=True)
            self._origin.record(self._current_stream(self._index))

    def mark(self):
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
        start = s.get("compute_start")
        bwd_end = s.get("backward_end", start)
        opt_end = s.get("optimizer_end", bwd_end)
        fwd_bwd = bwd_end - start if start is not None and bwd_end is not None else 0.0
        optimizer = opt_end - bwd_end if bwd_end is not None and opt_end is not None else 0.0
        exposed = 0.0
        done = s.get("autograd_done")
        if done is not None and bwd_end is not None and comm:  # measured where it blocked
            exposed = min(max(0.0, bwd_end - done), union_length(comm))
        elif (
            comm and bwd_end is not None
        ):  # in flight after the last launch, until backward returned
            last_launch, end = max(a for a, _ in comm), bwd_end
            exposed = union_length(
                [(max(a, last_launch), min(b, end)) for a, b in comm if b > last_launch and a < end]
            )
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


def timed_allreduce_hook(timer: StepTimer, bucket):
    """DDP comm hook: average the bucket like DDP's default hook, timing the all-reduce.

    Register with ``ddp.register_comm_hook(timer, timed_allreduce_hook)``."""
    import torch.distributed as dist

    group = dist.group.WORLD
    world = dist.get_world_size(group)
    tensor = bucket.buffer()
    # Averaging is the hook's only real cost (measured on an H100: the timing is free, a
    # separate `div_` over every bucket is +1.2% of a 29 ms step); DDP's built-in path
    # folds it into its copy of the gradients. NCCL averages inside the collective; other
    # backends sum, after a division that a single rank does not need.
    op = dist.ReduceOp.SUM
    if world > 1:
        if dist.get_backend(group) == "nccl":
            op = dist.ReduceOp.AVG
        else:
            tensor.div_(world)
    _mark_autograd_done(timer)
    launched = timer.comm_launched()
    fut = dist.all_reduce(tensor, op=op, group=group, async_op=True).get_future()
    delay = timer.comm_delay_seconds
    if delay:
        return _delayed(timer, fut, launched, delay, tensor)

    def done(f):
        timer.comm_done(launched)
        return f.value()[0]

    return _chain(timer, fut, done)


def _delayed(timer: StepTimer, fut, launched, delay: float, tensor):
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
            out.set_result(f.value()[0])

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


def _fsdp_comms(timer: StepTimer):
    """A timed all-gather and reduce-scatter for FSDP2 (torch >= 2.8's custom-comm API)."""
    import torch
    import torch.distributed as dist

    # What FSDP2's default collectives call (their older names before torch 2.9).
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

    # Duck-typed: FSDP calls allocate() and __call__() (the Comm ABCs live in a private
    # module, so they are not subclassed here).
    class _Alloc:
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

    class TimedAllGather(_Alloc):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            launched = timer.comm_launched()
            work = all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
            return _timed_work(timer, launched, work)

    class TimedReduceScatter(_Alloc):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            launched = timer.comm_launched()
            work = reduce_scatter(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
            return _timed_work(timer, launched, work)

    return TimedAllGather(), TimedReduceScatter()


def attach_fsdp(timer: StepTimer, model) -> int:
    """Time every all-gather and reduce-scatter of the FSDP2 modules in ``model``.

    Returns how many FSDP modules now report their communication. A module FSDP refuses
    a custom collective for (several parameter groups, symmetric-memory or process-group
    allocation turned on) keeps its own and is not counted; on a torch without the API
    (before 2.8) nothing is timed and 0 is returned.
    """
    try:
        from torch.distributed.fsdp import FSDPModule

        all_gather, reduce_scatter = _fsdp_comms(timer)
    except Exception:
        return 0
    timed = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
        except Exception:
            continue
        timed += 1
    return timed
