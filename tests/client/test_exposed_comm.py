"""Exposed communication measured where the step waits: a real DDP model (gloo, one
process) and the timing hook; an injected delay on the all-reduce is time backward
blocks for, and it shows as exposed, while a clean step's exposed part stays small."""

from __future__ import annotations

import statistics

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from rankguard.client import StepTimer, timed_allreduce_hook


def steps(delay: float, n: int = 6):
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4))), bucket_cap_mb=0.25
    )  # fmt: skip  (several buckets, as a real model has)
    timer = StepTimer()
    model.register_comm_hook(timer, timed_allreduce_hook)
    timer.comm_delay_seconds = delay
    x = torch.randn(64, 256)
    for step in range(1, n + 1):
        timer.begin(step)
        timer.mark("compute_start")
        model(x).square().mean().backward()
        timer.mark("backward_end")
        timer.end()
    return timer.ready()


def test_a_delayed_all_reduce_is_exposed_and_a_clean_one_is_not(one_rank):
    clean = steps(0.0)[1:]  # the first step rebuilds DDP's buckets
    delayed = steps(0.1)[1:]
    for t in delayed:  # backward waited for the delayed buckets (their delays overlap)
        assert 0.09 <= t.comm_exposed_seconds <= t.comm_seconds + 1e-6, t
    # a clean step's all-reduce is a local copy here: milliseconds, however loaded
    assert statistics.median(t.comm_exposed_seconds for t in clean) < 0.05, clean
