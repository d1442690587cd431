"""The process group's backend by physical GPU identity: UUIDs, not device counts.

GPU-free: the UUIDs are given; the exchange runs through a real TCPStore between threads
that act as ranks. On a GPU machine `scripts/gpu-check --part tests` runs the real
device's UUID through the same code (tests/trainer/test_trainer_gpu.py)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from rankguard.trainer.distributed import NCCL_BACKEND, agree_backend, backend_for  # noqa: E402

A, B = "GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000"


def test_one_visible_gpu_per_process_with_distinct_uuids_is_nccl():
    # per-process CUDA_VISIBLE_DEVICES: every rank sees cuda:0, each its own GPU
    assert backend_for([A, B]) == (NCCL_BACKEND, None)


def test_two_ranks_on_one_uuid_is_gloo_and_says_which():
    assert backend_for([A, B, A]) == ("gloo", f"ranks 0 and 2 share GPU {A}")


def test_a_rank_without_a_gpu_is_gloo():
    assert backend_for([A, None]) == ("gloo", "rank(s) [1] have no GPU")


def exchange(uuids: list[str | None]) -> list[tuple[str, str | None]]:
    """agree_backend on every rank at once, each with its own store client."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))  # fmt: skip
    out: list = [None] * len(uuids)

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                               timeout=timedelta(seconds=30))  # fmt: skip
        out[r] = agree_backend(client, r, len(uuids), uuids[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in reversed(range(len(uuids)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_every_rank_agrees_through_the_store():
    assert exchange([A, B]) == [(NCCL_BACKEND, None)] * 2
    shared = exchange([A, B, B, A])
    assert shared == [("gloo", f"ranks 1 and 2 share GPU {B}")] * 4
