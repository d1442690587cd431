"""The Reporter only observes (issue 33): on DDP over data-parallel sub-groups, DDP with
a user's comm hook, FSDP2, HSDP and 2D DP x TP layouts (4 gloo ranks, CPU), training ends
bit-identical with and without it, and it still reports the communication it can time
and names what it cannot. Also: the hook's reduce op by the group's backend for the
bucket's device, and the clock resolved at the first step, not at construction."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import free_port, run_in_own_session

from rankguard.client import Reporter, StepTimer
from rankguard.client.timing import backend_for, reduce_op

JOB = Path(__file__).with_name("reporter_observes_job.py")
IDENTICAL = ("ddp_groups", "ddp_groups3", "fsdp", "fsdp_custom_comm", "hsdp", "tp_ddp",
             "tp_fsdp", "ddp_stall")  # fmt: skip
CASES = (*IDENTICAL, "ddp_user_hook", "fsdp_straggler")  # ddp_stall: the flight recorder
RANKS = range(4)
SEEDS = (1, 2)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    """{rank: {(case, seed): {variant: result}}} from one 4-rank torchrun of every case."""
    out = tmp_path_factory.mktemp("observes")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKGUARD_TELEMETRY_SOCKET": "off"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=4", str(JOB), str(out), *CASES]  # fmt: skip
    returncode, output = run_in_own_session(cmd, env=env, cwd=out, timeout=240)
    assert returncode == 0, output[-6000:]
    return {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in RANKS}


def same(a: dict, b: dict) -> bool:
    assert a["params"], "no parameters saved"
    return all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))


def runs(job: dict, case: str):
    for rank in RANKS:
        for (c, seed), variants in job[rank].items():
            if c == case:
                yield rank, seed, variants


@pytest.mark.slow
@pytest.mark.parametrize("case", IDENTICAL)
def test_training_is_bit_identical_with_and_without_the_reporter(job, case):
    seen = 0
    for rank, seed, v in runs(job, case):
        assert same(v["plain"], v["reporter"]), (case, rank, seed)
        seen += 1
    from reporter_observes_job import ONE_SEED

    assert seen == len(RANKS) * (1 if case in ONE_SEED else len(SEEDS))
    if case in (
        "ddp_groups",
        "ddp_groups3",
    ):  # each DP group trained on its own data: the groups differ
        assert not same(job[0][(case, 1)]["plain"], job[3][(case, 1)]["plain"])


@pytest.mark.slow
@pytest.mark.parametrize("case", IDENTICAL)
def test_the_reporter_still_times_the_communication(job, case):
    untimed = {
        "ddp_groups": {"untimed_other_groups"},  # other ranks outside the DP group
        "ddp_groups3": {"untimed_other_groups"},
        "fsdp": set(),
        "fsdp_custom_comm": set(),
        "hsdp": {"untimed_hsdp_all_reduce"},
        "tp_ddp": {"untimed_other_groups"},  # TP's collectives
        "tp_fsdp": {"untimed_other_groups"},
        "ddp_stall": set(),  # the whole world's group; the stall watch failed nowhere
    }[case]
    for rank, seed, v in runs(job, case):
        r = v["reporter"]
        assert set(r["errors"]) == untimed, (case, rank, r["errors"])
        if case == "ddp_groups3" and rank == 3:  # a group of one: DDP all-reduces locally
            assert len(r["comm"]) == 3
            continue
        assert len(r["comm"]) == 3 and all(c > 0 for c in r["comm"]), (case, rank, seed, r)


@pytest.mark.slow
def test_a_stall_sends_each_ranks_wavefront_and_changes_nothing(job):
    """Rank 0 stuck outside any collective, its peers waiting in DDP's all-reduce: every
    rank's stall watch sent its flight recorder's wavefront (the training stayed
    bit-identical, test above), and the peers are one all-reduce ahead of rank 0 in the
    world's group."""
    fronts = {}
    for rank, _, v in runs(job, "ddp_stall"):
        # sent while stuck in step 2, after step 1 (one in a slow start may come before)
        evidence = [front for step, front in v["reporter"]["evidence"] if step == 1]
        assert evidence and all(evidence), (rank, v["reporter"]["evidence"])
        fronts[rank] = {c["pg"]: c for c in evidence[0]}
    world = fronts[0]["0"]
    assert world["enqueued"] == world["completed"]  # rank 0 waits in nothing
    for rank in (1, 2, 3):
        mine = fronts[rank]["0"]
        assert mine["enqueued"] == world["enqueued"] + 1, (rank, mine, world)
        # DDP's own: the bucket order's broadcast (rebuilt at step 2) or the all-reduce
        assert mine["completed"] == world["enqueued"] and mine["op"].startswith("gloo:")


@pytest.mark.slow
def test_a_users_comm_hook_still_runs_and_is_timed_when_registered_after(job):
    for rank, seed, v in runs(job, "ddp_user_hook"):
        assert not same(v["hook"], v["plain"]), (rank, seed)  # the hook's effect shows
        # registered after the Reporter: wrapped, so it runs, and it is timed
        after = v["reporter_then_hook"]
        assert same(after, v["hook"]), (rank, seed)
        assert after["errors"] == {"untimed_other_groups": 1}, after["errors"]
        assert all(c > 0 for c in after["comm"]), after
        # registered before: DDP takes one hook, so the Reporter does not attach and says so
        before = v["hook_then_reporter"]
        assert same(before, v["hook"]), (rank, seed)
        assert before["errors"].get("attach_hook_taken") == 1, before["errors"]
        assert before["comm"] == [0.0, 0.0, 0.0], before


@pytest.mark.slow
def test_a_users_fsdp2_collective_is_wrapped_not_replaced(job):
    for rank, seed, v in runs(job, "fsdp_custom_comm"):
        # 2 modules x (forward + backward) all-gathers x 3 steps, with and without
        assert v["plain"]["custom_calls"] == v["reporter"]["custom_calls"] == 12, (rank, seed)


@pytest.mark.slow
def test_fsdp2_forward_all_gather_waits_are_exposed_communication(job):
    """Rank 3 sleeps before each forward; its peers wait in the first all-gather. That
    wait is exposed communication, not compute."""
    from reporter_observes_job import STRAGGLER_SLEEP

    for rank in (0, 1, 2):
        r = job[rank][("fsdp_straggler", 1)]["reporter"]
        assert all(e >= 0.7 * STRAGGLER_SLEEP for e in r["exposed"]), (rank, r)
        assert all(c < STRAGGLER_SLEEP / 2 for c in r["compute"]), (rank, r)
    late = job[3][("fsdp_straggler", 1)]["reporter"]
    assert all(c >= STRAGGLER_SLEEP for c in late["compute"]), late


def test_the_reduce_op_follows_the_backend_of_the_buckets_device():
    assert backend_for("nccl", "cuda") == "nccl"
    assert backend_for("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert backend_for("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_for("cpu:gloo", "cuda") == ""
    dist.init_process_group(
        "cpu:gloo,cuda:gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        group = dist.group.WORLD
        assert reduce_op(group, "cpu") == dist.ReduceOp.SUM  # gloo sums
        assert reduce_op(group, "cuda") == dist.ReduceOp.SUM
    finally:
        dist.destroy_process_group()


def test_a_cuda_clock_is_resolved_at_the_first_step_not_at_construction(monkeypatch):
    """Building the timer must not touch the GPU: the device set by set_device() after it
    is the one timed (here, without CUDA, the build would fail if it did)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: calls.append(1) or 0)
    timer = StepTimer("cuda")
    rg = Reporter(socket_path=None, heartbeat_seconds=0, device="cuda")
    assert calls == [] and rg.timer.clock.device is None
    picked = []
    timer = StepTimer(lambda: picked.append(1) or torch.device("cpu"))
    assert picked == []
    timer.begin(1)
    timer.mark("compute_start")
    timer.mark("backward_end")
    timer.end()
    assert picked == [1] and timer.clock.device == torch.device("cpu") and not timer.clock.cuda
    rg.close()


def test_a_meta_device_model_warns_once_and_is_resolved_at_the_first_step(caplog):
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with caplog.at_level(logging.WARNING, logger="rankguard.client.reporter"):
        rg = Reporter(model, socket_path=None, heartbeat_seconds=0)
    assert [r for r in caplog.records if "meta" in r.getMessage()], caplog.records
    model.to_empty(device="cpu")  # materialized after the Reporter was built
    with rg.step(1):
        pass
    assert rg.timer.clock.device == torch.device("cpu")
    rg.close()
    assert set(rg.errors) == {"attach"}  # a plain module: nothing to time, as before


@pytest.mark.gpu
def test_the_cuda_clock_times_the_device_set_after_the_reporter():
    rg = Reporter(socket_path=None, heartbeat_seconds=0, device="cuda")
    last = torch.cuda.device_count() - 1
    torch.cuda.set_device(last)
    with rg.step(1):
        torch.ones(8, device="cuda").sum()
    rg.close()
    assert rg.timer.clock.device == torch.device("cuda", last)
    assert len(rg.timings) == 1 and not rg.errors


def test_ddp_hook_slot_rules_match_ddp_s_own(one_rank):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(torch.nn.Linear(4, 4))
    rg = Reporter(ddp, socket_path=None, heartbeat_seconds=0)
    rg.attach(ddp)  # twice: a no-op
    ddp.register_comm_hook(None, allreduce_hook)  # runs inside the Reporter's
    with pytest.raises(RuntimeError, match="only be called once"):  # as DDP alone says
        ddp.register_comm_hook(None, allreduce_hook)
    with rg.step(1):
        ddp(torch.ones(2, 4)).sum().backward()
    rg.close()
    assert rg.errors == {} and rg.timings[0].comm_seconds > 0
    assert [h for h, _ in ddp._comm_hooks][1:] == [allreduce_hook]

    builtin = DDP(torch.nn.Linear(4, 4))
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    taken = Reporter(builtin, socket_path=None, heartbeat_seconds=0)
    taken.close()
    assert taken.errors == {"attach_hook_taken": 1}
