"""bench/goodput.py --quick end to end under rankguard: every fault of the schedule reaches
the timeline, is recovered, and the accounting adds up (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "goodput.py"


def _bench():
    spec = importlib.util.spec_from_file_location("goodput_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _process(events: list, pid: int, resumed: int, upto: int, t: float, nan_from=None) -> float:
    events += [{"t": t, "pid": pid, "event": "start"},
               {"t": t, "pid": pid, "event": "resume", "step": resumed, "source": "disk"}]  # fmt: skip
    for s in range(resumed + 1, upto + 1):
        t += 1
        loss = "nan" if nan_from is not None and s >= nan_from else 1.0
        events.append({"t": t, "pid": pid, "event": "step", "step": s, "loss": loss})
    return t


def test_history_keeps_each_step_once_and_counts_rollbacks_as_lost():
    g, ev = _bench(), []
    t = _process(ev, 1, 0, 30, 0.0)  # trains 1..30, killed
    t = _process(ev, 2, 20, 45, t)  # resumed from 20: 21..30 redone, killed at 45
    _process(ev, 3, 40, 60, t)  # resumed from 40
    h = g.history(ev)
    assert (h["executed"], h["kept"], h["lost"], h["final_step"]) == (75, 60, 15, 60)
    assert h["useful_steps"] == 60 and h["poisoned_at"] is None


def test_the_runs_own_step_time_leaves_out_the_steps_near_a_fault_and_restarts():
    g, ev = _bench(), []
    t = _process(ev, 1, 0, 100, 0.0)  # 1 s a step
    for e in ev:  # ... but 5 s a step within 30 s after the fault at t=50
        if e["event"] == "step" and 50 < e["step"] <= 55:
            e["t"] = 50 + (e["step"] - 50) * 5.0
        elif e["event"] == "step" and e["step"] > 55:
            e["t"] += 20
    _process(ev, 2, 90, 120, t + 20 + 10)  # a restart: its gap to the old process is no step
    run = g.Run("rankguard", launched=0.0, events=ev)
    run.injected = [g.Injected(g.Fault(1, "slow", 1, 50.0), 50.0, {})]
    assert g.quiet_step_time(run) == 1.0
    run.injected = []
    assert g.quiet_step_time(run) > 1.0  # the slow steps count when no fault explains them


def test_steps_on_a_nan_model_are_not_useful():
    g, ev = _bench(), []
    _process(ev, 1, 0, 50, 0.0, nan_from=31)
    h = g.history(ev)
    assert h["kept"] == 50 and h["poisoned_at"] == 31 and h["useful_steps"] == 29


def test_the_schedule_is_seeded_with_nan_last():
    g = _bench()
    _, a = g.load_schedule(ROOT / "bench" / "goodput_schedule.toml", quick=False)
    _, b = g.load_schedule(ROOT / "bench" / "goodput_schedule.toml", quick=False)
    assert a == b and a[-1].kind == "nan" and len({f.kind for f in a}) == 7
    assert all(x.at < y.at for x, y in zip(a, a[1:], strict=False))


def test_spacing_keeps_kinds_and_order_and_sizes_the_job_to_span_them():
    g = _bench()
    toml = ROOT / "bench" / "goodput_schedule.toml"
    params, plain = g.load_schedule(toml, quick=False)
    spaced_params, spaced = g.load_schedule(toml, quick=False, spacing=120)
    assert [(f.id, f.kind, f.rank) for f in spaced] == [(f.id, f.kind, f.rank) for f in plain]
    first = params["first_at_seconds"]
    assert [f.at for f in spaced] == [first + 120 * i for i in range(len(plain))]
    # the job: first fault + 7 spacings of fault-free training at the calibrated step time
    assert g.steps_for(params, spaced, 120, 0.05) == math.ceil((first + 7 * 120) / 0.05)
    assert g.steps_for(params, spaced, 120, math.nan) == params["steps"]  # no calibration
    # unspaced, the full schedule is fitted too: its last fault + one mean gap
    span = plain[-1].at + params["mean_gap_seconds"]
    assert g.steps_for(params, plain, None, 0.02) == math.ceil(span / 0.02) > params["steps"]
    assert g.steps_for(params, plain, None, 0.2) == params["steps"]  # already long enough
    quick_params, quick_faults = g.load_schedule(toml, quick=True)
    assert g.steps_for(quick_params, quick_faults, None, 0.02) == quick_params["steps"]
    assert spaced_params["run_limit_seconds"] >= 1.5 * (first + 7 * 120)


def test_the_report_names_each_stacks_fitted_steps():
    g = _bench()
    toml = ROOT / "bench" / "goodput_schedule.toml"
    params, _ = g.load_schedule(toml, quick=False)
    params["spacing"] = None  # as main() sets it
    text = g.steps_text(
        [{"stack": "plain", "steps": 3418}, {"stack": "nvrx", "steps": 3356}], params
    )
    assert f"last fault + one mean gap, at least {params['steps']}: plain 3418, nvrx 3356" in text
    quick_params, _ = g.load_schedule(toml, quick=True)
    quick_params["spacing"] = None
    assert g.steps_text([], quick_params) == f"{quick_params['steps']} steps"  # not fitted


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("goodput")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--stacks", "rankguard",
         "--json", str(out / "g.json"), "--out", str(out / "g.md")],
        capture_output=True, text=True, timeout=900, cwd=out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads((out / "g.json").read_text()), "md": (out / "g.md").read_text()}


def test_every_scheduled_fault_is_in_each_stacks_timeline(quick):
    ids = sorted(f["id"] for f in quick["schedule"])
    assert len(ids) == 7
    for r in quick["results"]:
        assert r["not_injected"] == [], r["stack"]
        assert sorted(f["id"] for f in r["faults"]) == ids, r["stack"]
        for f in r["faults"]:
            assert f["kind"] in quick["md"] and f["outcome"]


def test_the_accounting_adds_up(quick):
    params, _ = _bench().load_schedule(ROOT / "bench" / "goodput_schedule.toml", quick=True)
    for r in quick["results"]:
        assert 0 < r["useful"] <= r["wall"], r["stack"]
        assert 0 < r["goodput"] <= 1
        assert r["executed"] == r["kept"] + r["lost"]
        assert r["useful_steps"] <= r["kept"] <= r["executed"]
        if r["finished"]:
            # the whole history, each step once
            assert r["kept"] == r["final_step"] == params["steps"]
        # the steps each fault's restart threw away are among the steps lost (a restart no
        # fault caused, e.g. a false alarm, would add lost steps no fault owns)
        assert 0 <= sum(f["lost"] or 0 for f in r["faults"]) <= r["lost"], r["stack"]
        # a fault's window cost cannot exceed the window
        for f in r["faults"]:
            assert f["cost"] <= r["wall"]


def test_rankguard_recovers_every_fault_of_the_schedule(quick):
    """Plain torchrun's side (it never notices a hang or a NaN) is the benchmark's to
    measure (bench/results); the suite runs rankguard's alone, half the time."""
    (r,) = quick["results"]
    for f in r["faults"]:  # a short slowdown or stalled write may be ridden out
        assert not f["outcome"].startswith("not recovered"), f
        if f["kind"] in ("kill", "stop", "spin", "corrupt_kill", "nan"):
            assert f["outcome"].startswith("recovered"), f


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "s.toml"
    bad.write_text("seed = 1\n")
    for args in (["--stacks", "nope"], ["--schedule", str(bad)], ["--spacing", "-5"]):
        proc = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 2
        assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("goodput: ")
