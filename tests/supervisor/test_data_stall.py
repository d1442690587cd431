"""The data-stall detector as a pure function: observations in, findings out."""

from __future__ import annotations

import dataclasses

import pytest
from builders import CFG, cluster, rank

from rankguard.supervisor.detectors import DetectorConfig, data_stall, run_all
from rankguard.supervisor.model import DATA_STALL, History
from rankguard.supervisor.state import StepSample


def waits(
    first, last, wait=0.002, *, compute=0.08, phase="train", restart=0, slow_from=None, slow=1.0
):
    """Steps whose data wait is `wait`, or `slow` from step `slow_from` on."""
    out = []
    for s in range(first, last + 1):
        w = slow if slow_from is not None and s >= slow_from else wait
        out.append(StepSample(s, phase, restart, w + compute + 0.01, compute, 0.01, w, 3.0))
    return tuple(out)


def job(*recents, restart=0):
    return cluster(*(rank(r, step=rec[-1].step, restart=restart, recent=rec)
                     for r, rec in enumerate(recents)))  # fmt: skip


def test_a_rank_whose_loader_slows_is_named_with_its_phase():
    obs = job(waits(1, 40), waits(1, 40, slow_from=38), waits(1, 40))
    (f,) = data_stall.detect(obs, History(), CFG)
    assert f.kind == DATA_STALL and f.rank == 1 and f.key == "data_stall:j:1:0"
    assert f.evidence["phase"] == "train" and "phase train" in f.summary
    assert f.evidence["first_slow_step"] == 38 and f.evidence["step"] == 40
    assert f.evidence["data_wait_seconds"] == 1.0
    assert f.evidence["own_baseline_seconds"] == 0.002
    assert f.evidence["peers_data_wait_seconds"] == 0.002
    assert f.evidence["data_wait_share"] > 0.9
    assert [x.kind for x in run_all(obs, History())] == [DATA_STALL]
    # a stall longer than the window: still dated from its first slow step
    (f,) = data_stall.detect(job(waits(1, 40), waits(1, 40, slow_from=33)), History(), CFG)
    assert f.evidence["first_slow_step"] == 33


def test_one_slow_batch_is_not_a_stall():
    # a page-cache miss: one step of the window of three
    obs = job(waits(1, 40), waits(1, 40, slow_from=40))
    assert data_stall.detect(obs, History(), CFG) == []
    # two of three is
    assert [f.rank for f in data_stall.detect(job(waits(1, 40), waits(1, 40, slow_from=39)),
                                              History(), CFG)] == [1]  # fmt: skip


def test_every_rank_waiting_on_shared_storage_blames_no_rank():
    obs = job(waits(1, 40, slow_from=35), waits(1, 40, slow_from=35))
    assert data_stall.detect(obs, History(), CFG) == []


def test_a_rank_that_always_waited_is_not_a_new_stall():
    # its own history says it always waits this long (e.g. the rank that reads a slower disk)
    obs = job(waits(1, 40), waits(1, 40, wait=1.0))
    assert data_stall.detect(obs, History(), CFG) == []


def test_small_waits_and_small_shares_are_not_stalls():
    tiny = job(waits(1, 40), waits(1, 40, slow_from=35, slow=0.05))  # 25x, but only 50 ms
    assert data_stall.detect(tiny, History(), CFG) == []
    # 0.3 s more, but the step is 10 s of compute: the GPU barely waited
    long_steps = job(waits(1, 40, compute=10), waits(1, 40, compute=10, slow_from=35, slow=0.3))
    assert data_stall.detect(long_steps, History(), CFG) == []


def test_needs_history_ignores_other_phases_earlier_incarnations_and_dead_ranks():
    assert data_stall.detect(job(waits(1, 8), waits(1, 8, slow_from=6)), History(), CFG) == []
    ckpt = job(waits(1, 40), waits(1, 40, phase="checkpoint_save", slow_from=35))
    assert data_stall.detect(ckpt, History(), CFG) == []
    new = cluster(rank(0, restart=1, step=40, recent=waits(1, 40, restart=1)),
                  rank(1, restart=0, step=40, recent=waits(1, 40, slow_from=35)))  # fmt: skip
    assert data_stall.detect(new, History(), CFG) == []
    dead = cluster(rank(0, step=40, recent=waits(1, 40)),
                   rank(1, step=40, state="exited", recent=waits(1, 40, slow_from=35)))  # fmt: skip
    assert data_stall.detect(dead, History(), CFG) == []


def test_eval_phase_is_named_and_a_single_rank_uses_its_own_history():
    obs = cluster(rank(0, step=40, world=1, recent=waits(1, 40, phase="eval", slow_from=37)))
    (f,) = data_stall.detect(obs, History(), CFG)
    assert f.evidence["phase"] == "eval" and f.evidence["peers_data_wait_seconds"] is None


def test_settings_are_checked_and_can_turn_it_off():
    for bad in ({"window": 0}, {"factor": 0.5}, {"min_share": 2.0}, {"min_seconds": -1.0}):
        with pytest.raises(ValueError):
            data_stall.DataStallConfig(**bad)
    off = DetectorConfig(data_stall=dataclasses.replace(CFG.data_stall, enabled=False))
    assert run_all(job(waits(1, 40), waits(1, 40, slow_from=35)), History(), off) == []


def test_peers_that_finished_still_set_the_reference():
    # the end of a job: rank 0 finished its last step while rank 1 still loads its own
    done = cluster(rank(0, step=40, state="finished", recent=waits(1, 40)),
                   rank(1, step=40, recent=waits(1, 40, slow_from=35)))  # fmt: skip
    (f,) = data_stall.detect(done, History(), CFG)
    assert f.rank == 1 and f.evidence["peers_data_wait_seconds"] == 0.002
    # and a shared slow store is not blamed on the last rank running
    shared = cluster(rank(0, step=40, state="finished", recent=waits(1, 40, slow_from=35)),
                     rank(1, step=40, recent=waits(1, 40, slow_from=35)))  # fmt: skip
    assert data_stall.detect(shared, History(), CFG) == []
