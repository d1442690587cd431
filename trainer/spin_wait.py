"""Waiting on collectives by busy-polling: the trainer's `--wait-mode spin`, a CPU
stand-in for how a rank waits on NCCL.

On NCCL a rank waiting for a collective does not sleep in the kernel as it does on gloo:
its host thread spins in CUDA's default spin-wait (cudaStreamSynchronize, `.item()`),
runnable (state R, no wchan) and using about one core. In spin mode the trainer waits
that way on gloo too, so hang detection can be tested against both signatures on CPU:
DDP's gradient all-reduce (:class:`SpinningAllreduce`) and the trainer's own collectives
on its main thread (:func:`all_reduce`).

The supervisor's stack reader takes a frame in this file for "waiting in a collective",
the stand-in for a native CUDA-sync frame: keep the file's name, and keep the busy-poll
loop (:func:`wait_spinning`) in it. What the stand-in does not reproduce is in
docs/faults.md.
"""

import os
import threading

import torch.distributed as dist


def wait_spinning(done) -> None:
    """Poll `done()` until it is true. Each round yields the CPU, as CUDA's spin-wait also
    does: the thread stays runnable and busy (about one core), yet on a small machine the
    agent and the peers still get to run."""
    while not done():
        os.sched_yield()


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, *, spin: bool) -> None:
    """`dist.all_reduce` in place, waited by busy-polling when `spin`."""
    if not spin:
        dist.all_reduce(tensor, op=op, group=group)
        return
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    wait_spinning(work.is_completed)
    work.wait()  # already complete: returns at once, or raises the collective's error


class SpinningAllreduce:
    """DDP comm hook state: the gradient all-reduce with DDP's own arithmetic, waited by
    busy-polling where DDP would block.

    DDP blocks on the buckets' futures in its reducer's finalization, an autograd callback
    queued after the last bucket's launch. The hook queues a callback of its own at every
    bucket (all run before that one, in order; the first waits for every bucket launched,
    the rest find nothing), so the buckets still overlap the backward pass, the wait lands
    where DDP's would, and the step timer's autograd mark (queued at the first bucket,
    before this hook runs) still counts it as exposed communication, not as compute."""

    def __init__(self, process_group) -> None:
        self.process_group = process_group
        self._pending: list = []
        self._lock = threading.Lock()  # on a GPU, hooks and callbacks run on autograd's threads

    def wait(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for fut in pending:
            wait_spinning(fut.done)


def spinning_allreduce_hook(state: SpinningAllreduce, bucket):
    """Register with ``ddp.register_comm_hook(SpinningAllreduce(ddp.process_group),
    spinning_allreduce_hook)`` (the `bucket` parameter is unannotated: DDP refuses a hook
    whose annotations are not its own types)."""
    tensor = bucket.buffer()
    group = state.process_group or dist.group.WORLD
    # DDP's arithmetic without a hook: times 1/n, then the sum. Not torch's allreduce_hook,
    # which divides: x / 3 is not always x * (1/3), and 3 ranks' digests then differ.
    world = dist.get_world_size(group)
    if world > 1:
        tensor.mul_(1.0 / world)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    fut = work.get_future().then(_first)
    with state._lock:
        state._pending.append(fut)
    try:
        from torch.autograd import Variable

        Variable._execution_engine.queue_callback(state.wait)
    except Exception:  # not inside a backward pass (a hook called by hand): wait here
        state.wait()
    return fut


def _first(fut):
    return fut.value()[0]  # a collective's future holds a list of tensors
