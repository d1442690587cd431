"""Per-step phase timing and communication measurement.

Phases of a step: data wait (host), forward+backward, optimizer, checkpoint blocking
(host). Communication is measured where it happens: a DDP comm hook wraps every
gradient all-reduce and records when the bucket was handed to the process group and
when its future completed.

- `comm_seconds`: wall time during which at least one all-reduce was in flight (the
  union of the buckets' intervals), overlapped with backward or not.
- `comm_exposed_seconds`: the part of backward spent only waiting for communication:
  all-reduce time after the last bucket's launch (autograd has no work left then) and
  before backward's return.
- `compute_seconds`: forward+backward minus the exposed communication.

On CPU the marks are `time.perf_counter()`; on CUDA they are events recorded on the
stream, read one step later (by then they have completed), so the hot path never
synchronises the host with the device.
"""

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..agent.telemetry import comm_compute_ratio


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


class Clock:
    """Timestamps on the host (CPU) or on the CUDA stream, as float seconds when read."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._origin = torch.cuda.Event(enable_timing=True) if self.cuda else None
        if self.cuda:
            self._origin.record()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, mark) -> float:
        if not self.cuda:
            return mark
        mark.synchronize()  # a step old by the time we read it: already complete
        return self._origin.elapsed_time(mark) / 1000.0


@dataclass
class _PendingStep:
    step: int
    host_start: float
    marks: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    comm: list = field(default_factory=list)


class StepTimer:
    """Collects the marks of each step; `ready()` returns the timings that can be read."""

    def __init__(self, device: torch.device):
        self.clock = Clock(device)
        self._pending: deque[_PendingStep] = deque()
        self._current: _PendingStep | None = None
        self.comm_delay_seconds = 0.0  # fault hook: extra latency per all-reduce

    # -- hot path ---------------------------------------------------------------
    def begin(self, step: int) -> None:
        self._current = _PendingStep(step, time.perf_counter())

    def mark(self, name: str) -> None:
        self._current.marks[name] = self.clock.mark()

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
        s = {k: self.clock.seconds(v) for k, v in p.marks.items()}
        comm = [(self.clock.seconds(a), self.clock.seconds(b)) for a, b in p.comm]
        fwd_bwd = s["backward_end"] - s["compute_start"]
        exposed = 0.0
        if comm:  # communication still in flight after the last launch, until backward returned
            last_launch, end = max(a for a, _ in comm), s["backward_end"]
            exposed = union_length(
                [(max(a, last_launch), min(b, end)) for a, b in comm if b > last_launch and a < end]
            )
        return StepTiming(
            step=p.step,
            step_seconds=p.host["step"],
            data_wait_seconds=p.host.get("data_wait", 0.0),
            compute_seconds=max(0.0, fwd_bwd - exposed),
            comm_seconds=union_length(comm),
            comm_exposed_seconds=exposed,
            optimizer_seconds=max(0.0, s["optimizer_end"] - s["backward_end"]),
            checkpoint_block_seconds=p.host.get("checkpoint_block", 0.0),
        )


def timed_allreduce_hook(
    timer: StepTimer, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket like DDP's default hook, timing the all-reduce."""
    group = dist.group.WORLD
    world = dist.get_world_size(group)
    tensor = bucket.buffer().div_(world)
    launched = timer.comm_launched()
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    delay = timer.comm_delay_seconds

    def done(f: torch.futures.Future) -> torch.Tensor:
        if delay:
            time.sleep(delay)  # fault hook: a slow link
        timer.comm_done(launched)
        return f.value()[0]

    return fut.then(done)
