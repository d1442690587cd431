"""Pure pieces of the trainer: fault specs, timing arithmetic, batch layout, schedule."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rankguard.client import StepTimer, union_length
from rankguard.trainer.config import BatchConfig, ConfigError, config_from_args
from rankguard.trainer.faults import FaultInjector, FaultSpec, FaultSpecError, parse_fault_spec
from rankguard.trainer.model import GPT, parameter_digest
from rankguard.trainer.train import lr_schedule


def test_fault_spec_parsing():
    s = parse_fault_spec("slow:step=10:rank=1:factor=1.2")
    assert (s.kind, s.step, s.rank, s.factor, s.restart) == ("slow", 10, 1, 1.2, 0)
    assert parse_fault_spec("kill:step=3:restart=any").restart is None
    assert parse_fault_spec("crash:step=3").kind == "kill"  # the old name, still accepted
    for bad in (
        "stop:step=1",  # done from outside, never by the trainer
        "corrupt-checkpoint",
        "boom:step=1",
        "crash",
        "crash:step=x",
        "crash:step=1:color=red",
        "slow:step=1:factor=0.5",
        "comm-delay:step=1",
        "crash:step=-1",
        "crash:1",
    ):
        with pytest.raises(FaultSpecError):
            parse_fault_spec(bad)


def test_faults_target_one_rank_and_one_incarnation():
    specs = (FaultSpec("nan", step=5, rank=1), FaultSpec("comm-delay", step=3, rank=1, seconds=0.5))
    assert not FaultInjector(specs, rank=0, restart_count=0).corrupt_loss(5)
    inj = FaultInjector(specs, rank=1, restart_count=0)
    assert inj.corrupt_loss(5) and not inj.corrupt_loss(6)
    assert inj.comm_delay(2) == 0 and inj.comm_delay(3) == inj.comm_delay(99) == 0.5
    assert not FaultInjector(specs, rank=1, restart_count=1).corrupt_loss(5)


def test_exception_fault_raises():
    inj = FaultInjector((FaultSpec("exception", step=2),), rank=0, restart_count=0)
    inj.at_step_start(1)
    with pytest.raises(RuntimeError, match="injected"):
        inj.at_step_start(2)


def test_union_length():
    assert union_length([]) == 0
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == 3
    assert union_length([(3, 4), (0, 1)]) == 2


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 10)), max_size=20))
def test_union_length_bounds(pairs):
    intervals = [(a, a + d) for a, d in pairs]
    u = union_length(intervals)
    assert u <= sum(d for _, d in pairs) + 1e-9
    assert u >= max((d for _, d in pairs), default=0) - 1e-9


def test_step_timer_splits_exposed_communication():
    timer = StepTimer(torch.device("cpu"))
    timer.begin(1)
    timer.host("data_wait", 0.25)
    # Fake host clock values: buckets in flight 4..6 and 9..12, backward returns at 12:
    # everything after the last launch (9) is waiting: exposed = 12 - 9.
    timer._current.marks.update(compute_start=0.0, backward_end=12.0, optimizer_end=13.0)
    timer._current.comm.extend([(4.0, 6.0), (9.0, 12.0)])
    timer.end()
    (t,) = timer.ready()
    assert t.data_wait_seconds == 0.25
    assert t.comm_seconds == 5.0
    assert t.comm_exposed_seconds == 3.0
    assert t.compute_seconds == 9.0
    assert t.optimizer_seconds == 1.0
    assert math.isclose(t.comm_compute_ratio, 5 / 9)


def test_accumulation_keeps_global_batch():
    b = BatchConfig(global_batch=16, micro_batch=4)
    assert [b.accum_steps(w) for w in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(ConfigError, match="multiple"):
        b.accum_steps(3)


def test_config_validation_and_env_faults():
    cfg = config_from_args(
        ["--steps", "5"], environ={"RANKGUARD_FAULTS": "nan:step=2;crash:step=3"}
    )
    assert [f.kind for f in cfg.faults] == ["nan", "kill"]
    assert cfg.telemetry_socket == "/run/rankguard/telemetry.sock"
    assert config_from_args(["--telemetry-socket", "off"], environ={}).telemetry_socket is None
    with pytest.raises(ConfigError):
        config_from_args(["--ckpt-every", "5"], environ={})  # no --ckpt-dir
    with pytest.raises(ConfigError):
        config_from_args(["--steps", "0"], environ={})
    assert config_from_args(["--data", "x"], environ={}).model.vocab_size == 256


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_schedule(s, 100, 10, 0.1) for s in range(100)]
    assert lrs[0] < lrs[5] < lrs[10]
    assert max(lrs) <= 1.0 and min(lrs[10:]) >= 0.1 - 1e-9
    assert lrs[99] < lrs[50] < lrs[11]


def test_presets_have_the_advertised_size():
    from rankguard.trainer.config import PRESETS

    with torch.device("meta"):
        small = GPT(PRESETS["small"].model).num_params()
        big = GPT(PRESETS["1b"].model).num_params()
    assert 110e6 < small < 140e6
    assert 1.0e9 < big < 1.6e9


def test_parameter_digest_is_order_independent_and_sensitive():
    a = [("w", torch.ones(3)), ("b", torch.zeros(2))]
    assert parameter_digest(a) == parameter_digest(list(reversed(a)))
    assert parameter_digest(a) != parameter_digest(
        [("w", torch.ones(3) * 2), ("b", torch.zeros(2))]
    )


def test_fault_file_is_picked_up_when_it_changes(tmp_path):
    f = tmp_path / "faults"
    inj = FaultInjector((), rank=1, restart_count=2, fault_file=str(f))
    inj.poll_file()  # no file yet: nothing
    assert not inj.corrupt_loss(7)
    f.write_text("nan:step=7:rank=1:restart=2\nbogus line\nnan:step=8:rank=0\n")
    inj.poll_file()
    assert inj.corrupt_loss(7) and not inj.corrupt_loss(8)


def test_fault_file_restart_is_the_incarnation_and_flags_the_torchrun_count(tmp_path):
    """Runtime faults name the incarnation the telemetry shows (what `rankguard inject`
    reads); command-line faults keep the node's torchrun restart count."""
    f = tmp_path / "faults"
    static = (FaultSpec("exception", step=3, rank=0, restart=0),)
    inj = FaultInjector(static, rank=0, restart_count=0, fault_file=str(f), incarnation=5)
    f.write_text("nan:step=7:rank=0:restart=5\nnan:step=8:rank=0:restart=0\n")
    inj.poll_file()
    assert inj.corrupt_loss(7) and not inj.corrupt_loss(8)
    assert [s.kind for s in inj.specs] == ["exception", "nan"]


def test_datasheet_peaks_pick_the_most_specific_name():
    from rankguard.trainer.mfu import datasheet_peak

    assert datasheet_peak("NVIDIA H100 80GB HBM3") == 989e12  # SXM
    assert datasheet_peak("NVIDIA H100 PCIe") == 756e12
    assert datasheet_peak("NVIDIA H100 NVL") == 835e12
    assert datasheet_peak("NVIDIA H200") == 989e12
    assert datasheet_peak("NVIDIA A100-SXM4-80GB") == 312e12  # not the A10's figure
    assert datasheet_peak("NVIDIA A10") == 125e12
    assert datasheet_peak("NVIDIA GB200") == 2500e12 and datasheet_peak("NVIDIA B200") == 2250e12
    assert datasheet_peak("NVIDIA L40S") == 362e12
    assert datasheet_peak("Some Future GPU") is None


def test_unknown_device_peak_is_a_measured_matmul():
    from rankguard.trainer.mfu import measured_matmul_flops, peak_flops

    cpu = torch.device("cpu")
    assert peak_flops(cpu, override=5e12) == 5e12
    assert 1e8 < measured_matmul_flops(cpu, seconds=0.02) < 1e14  # fp32 on this CPU


def test_digest_expectation_names_when_resume_is_bit_identical():
    from rankguard.trainer.train import digest_expectation

    assert digest_expectation("cpu", False)["digest_reproducible"] is True
    assert digest_expectation("cuda", True)["digest_reproducible"] is True
    gpu = digest_expectation("cuda", False)
    assert gpu["digest_reproducible"] is False and "--deterministic" in gpu["digest_note"]


def test_deterministic_flag():
    assert config_from_args(["--deterministic"]).deterministic is True
    assert config_from_args([]).deterministic is False
