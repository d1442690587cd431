"""The trainer's DataLoader path: worker processes load whole steps ahead, the batches are
exactly the in-process ones, and the `data-stall` fault slows the loader where it runs."""

from __future__ import annotations

import time

import pytest
import torch

from rankguard.client import Reporter
from rankguard.trainer.data import GlobalSampler, StepBatches, StepLoader, SyntheticTokens
from rankguard.trainer.faults import FaultInjector, FaultSpecError, parse_fault_spec


def step_batches(faults=None, rank=1):
    data = SyntheticTokens(vocab_size=64, seq_len=16, seed=3)
    return StepBatches(data, GlobalSampler(len(data), 8, 3), rank, 2, 2, 2, faults)


def test_workers_give_exactly_the_in_process_batches_from_any_step():
    inline = list(StepLoader(step_batches(), range(5, 13), workers=0))
    loader = StepLoader(step_batches(), range(5, 13), workers=2)
    pooled = list(loader)
    loader.close()
    assert len(inline) == len(pooled) == 8
    for a, b in zip(inline, pooled, strict=True):
        assert len(a) == len(b) == 2  # accumulation micro-batches
        for (xa, ya), (xb, yb) in zip(a, b, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert list(StepLoader(step_batches(), range(3, 3), workers=2)) == []  # nothing left to train


def test_data_stall_fault_slows_the_worker_and_the_wait_is_timed_in_next():
    spec = parse_fault_spec("data-stall:step=4:rank=1:seconds=0.3")
    faults = FaultInjector((spec,), rank=1, restart_count=0)
    assert (faults.data_stall(3), faults.data_stall(4), faults.data_stall(9)) == (0.0, 0.3, 0.3)
    assert FaultInjector((spec,), rank=0, restart_count=0).data_stall(4) == 0.0
    with pytest.raises(FaultSpecError):
        parse_fault_spec("data-stall:step=4")  # needs seconds
    loader = StepLoader(step_batches(faults), range(1, 6), workers=1, prefetch=1)
    waits = []
    for _ in range(5):
        start = time.perf_counter()
        next(loader)
        waits.append(time.perf_counter() - start)
    loader.close()
    # the worker sleeps in steps 4 and 5: the loop blocks in next() for it
    assert min(waits[3:]) >= 0.2 and max(waits[1:3]) < 0.2, waits


def test_reporter_batches_time_next_inside_and_before_a_step():
    rg = Reporter(socket_path=None, heartbeat_seconds=0)

    def slow():
        for i in range(3):
            time.sleep(0.05)
            yield i

    for n, _ in enumerate(rg.batches(slow()), 1):  # fetched before the step opens
        with rg.step(n) as s:
            s.phase("compute")
    fetched_outside = rg.timings
    assert [round(t.data_wait_seconds, 1) for t in fetched_outside] == [0.1, 0.1, 0.1]
    assert all(t.step_seconds >= t.data_wait_seconds for t in fetched_outside)
    # inside the step's unnamed start it is counted once, not twice
    it = rg.batches(slow())
    with rg.step(4) as s:
        next(it)
        s.phase("compute")
    assert 0.04 < rg.timings[-1].data_wait_seconds < 0.09
