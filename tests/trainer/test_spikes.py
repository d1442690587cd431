"""Loss spikes, trainer side, as pure functions: the rule, the skip window, the mapping
from training steps to data steps, and the spikes file."""

from __future__ import annotations

import pytest

from rankguard.trainer.faults import FaultInjector, FaultSpecError, parse_fault_spec
from rankguard.trainer.spikes import (
    SPIKES_FILE,
    data_step,
    is_spike,
    plan_skips,
    read_spikes,
    record_spike,
    window,
)


def test_the_rule_needs_history_and_a_loss_far_above_it():
    calm = [3.0 + 0.01 * (i % 5) for i in range(30)]
    assert is_spike(calm, 60.0) and not is_spike(calm, 3.1)
    assert not is_spike(calm[:10], 60.0)  # too little history to judge
    assert not is_spike(calm, float("nan"))  # non-finite: bad numerics, not a spike


def test_skips_map_training_steps_to_the_data_steps_left():
    assert [data_step(t, []) for t in (1, 5)] == [1, 5]
    skips = window(45, 8, after=40)
    assert skips == [41, 42, 43, 44, 45]  # trained data (<= 40) cannot be skipped
    assert [data_step(t, skips) for t in (40, 41, 42, 80)] == [40, 46, 47, 85]
    assert data_step(3, [1, 2]) == 5 and data_step(3, [9]) == 3


def test_plan_keeps_the_checkpoints_skips_and_adds_new_spikes_past_its_position():
    assert plan_skips([], [45], 8, resumed_step=40) == [41, 42, 43, 44, 45]
    # resumed again later from a checkpoint that already skips: nothing new, same mapping
    assert plan_skips([41, 42, 43, 44, 45], [45], 8, resumed_step=50) == [41, 42, 43, 44, 45]
    # a spike already behind the checkpoint's data position skips nothing more
    assert plan_skips([], [30], 8, resumed_step=40) == []
    # a spike before the first checkpoint: resume from scratch, skip up to it
    assert plan_skips([], [5], 3, resumed_step=0) == [3, 4, 5]
    assert plan_skips([], [45], 0, resumed_step=40) == []  # --spike-skip-batches 0


def test_spikes_file_round_trip_skips_torn_lines(tmp_path):
    assert read_spikes(tmp_path) == []
    record_spike(tmp_path, 45, 45, 61.2, 1)
    with open(tmp_path / SPIKES_FILE, "a") as f:
        f.write('{"data_step": "x"}\n{"data_st')  # foreign and torn lines
    record_spike(tmp_path, 90, 85, 70.0, 0)
    assert read_spikes(tmp_path) == [45, 90]


def test_poison_fault_is_bound_to_the_data_step_in_every_incarnation():
    spec = parse_fault_spec("poison:step=45:rank=1")
    assert (spec.factor, spec.restart) == (20.0, None)
    later = FaultInjector((spec,), rank=1, restart_count=3)
    assert later.poison_factor(45) == 20.0 and later.poison_factor(46) == 1.0
    assert FaultInjector((spec,), rank=0, restart_count=0).poison_factor(45) == 1.0
    with pytest.raises(FaultSpecError):
        parse_fault_spec("poison:step=4:factor=0.5")
