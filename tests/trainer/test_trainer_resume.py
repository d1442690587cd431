"""Exact resume, corruption fallback, elastic resize and in-flight crashes, on real torchrun.

Every run is the `tiny` preset on CPU with gloo and 2 ranks (unless said otherwise).
The reference is `clean_40`: 40 uninterrupted steps with checkpoints every 10.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from harness import read_json, run_ok, torchrun

from rankguard.cli.local_stack import TelemetrySink
from rankguard.client import checkpoint_store as store

pytestmark = pytest.mark.slow


def _steps(root: Path) -> dict[str, str]:
    return {s.path.name: s.state for s in store.scan(root)}


def test_crash_and_torchrun_restart_resumes_exactly(tmp_path, clean_40):
    proc = run_ok(
        ["--steps", "40", "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "10",
         "--summary", str(tmp_path / "s.json"), "--fault", "crash:step=27:rank=1"],
        cwd=tmp_path, max_restarts=2,
    )  # fmt: skip
    s = read_json(tmp_path / "s.json")
    assert "exitcode: -9" in proc.stderr  # rank 1 really died by SIGKILL
    assert s["restart_count"] == 1 and s["resumed_from"] == 20
    assert s["final_step"] == 40
    assert s["final_loss"] == clean_40["final_loss"]
    assert s["param_digest"] == clean_40["param_digest"]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated-shard": (lambda d: _truncate(d / "__1_0.distcp"), "corrupt", "truncated"),
    "flipped-byte": (lambda d: _flip_byte(d / "__0_0.distcp"), "corrupt", "mismatch"),
    "deleted-manifest": (lambda d: (d / "manifest.json").unlink(), "incomplete", "manifest"),
}


@pytest.fixture(scope="module")
def saved_30(tmp_path_factory) -> Path:
    """A 2-rank run stopped after 30 steps, every checkpoint (10, 20, 30) kept."""
    d = tmp_path_factory.mktemp("saved30")
    run_ok(
        ["--steps", "30", "--ckpt-dir", str(d / "ckpt"), "--ckpt-every", "10", "--keep", "0"],
        cwd=d,
    )  # fmt: skip
    return d / "ckpt"


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_newest_checkpoint_falls_back_and_quarantines(tmp_path, saved_30, kind):
    corrupt, state, reason_word = CORRUPTIONS[kind]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_30, ckpt)
    corrupt(ckpt / "step-00000030")
    # The run's steps total 40 as in clean_40, so the schedule matches exactly.
    run_ok(
        ["--steps", "40", "--ckpt-dir", str(ckpt), "--ckpt-every", "10", "--keep", "0",
         "--summary", str(tmp_path / "s.json")],
        cwd=tmp_path,
    )  # fmt: skip
    s = read_json(tmp_path / "s.json")
    assert s["resumed_from"] == 20 and s["final_step"] == 40
    quarantined = [q for q in store.scan(ckpt) if q.state == "quarantined"]
    assert len(quarantined) == 1, [(q.path, q.state) for q in store.scan(ckpt)]
    note = json.loads((quarantined[0].path / "QUARANTINE.json").read_text())
    assert note["state"] == state and reason_word in note["reason"].lower(), note
    # Nothing deleted: the corrupt checkpoint's files are all still there.
    assert len(list(quarantined[0].path.iterdir())) >= 5
    assert _steps(ckpt)["step-00000040"] == "validated"


def test_elastic_resume_at_smaller_world_keeps_global_batch(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_ok(["--steps", "20", "--ckpt-dir", str(ckpt), "--ckpt-every", "10",
            "--summary", str(tmp_path / "a.json")], cwd=tmp_path)  # fmt: skip
    run_ok(["--steps", "30", "--ckpt-dir", str(ckpt), "--ckpt-every", "10",
            "--summary", str(tmp_path / "b.json")], cwd=tmp_path, nproc=1)  # fmt: skip
    a, b = read_json(tmp_path / "a.json"), read_json(tmp_path / "b.json")
    assert (a["world_size"], b["world_size"]) == (2, 1)
    assert a["global_batch"] == b["global_batch"] == 16
    assert (a["accum_steps"], b["accum_steps"]) == (2, 4)
    assert b["resumed_from"] == 20 and b["final_step"] == 30
    assert b["final_loss"] < 5.0  # still learning, not restarted from scratch
    assert _steps(ckpt)["step-00000030"] == "validated"


def test_crash_during_inflight_save_never_validates_it(tmp_path, clean_40):
    """Rank 1's write of step 10 is slowed; rank 0 is killed at step 12 while it is in
    flight. The half-written checkpoint must never be committed nor reported validated."""
    sock = tmp_path / "telemetry.sock"
    with TelemetrySink(sock) as collector:
        run_ok(
            ["--steps", "40", "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "10",
             "--summary", str(tmp_path / "s.json"),
             "--fault", "ckpt-delay:step=10:rank=1:seconds=3", "--fault", "crash:step=12:rank=0"],
            cwd=tmp_path, max_restarts=1, env={"RANKGUARD_TELEMETRY_SOCKET": str(sock)},
        )  # fmt: skip
    s = read_json(tmp_path / "s.json")
    assert s["restart_count"] == 1 and s["resumed_from"] is None  # nothing was validated
    assert s["param_digest"] == clean_40["param_digest"]
    first = [r for r in collector.records if r.restart == 0]
    assert first and max(r.step for r in first) >= 11
    assert all(r.checkpoint_step is None for r in first), "step 10 reported before durable"
    states = [q for q in store.scan(tmp_path / "ckpt") if q.state == "quarantined"]
    assert [q.path.name.split(".")[0] for q in states] == ["step-00000010"]


def test_telemetry_arrives_valid_at_a_real_socket(tmp_path):
    sock = tmp_path / "telemetry.sock"
    with TelemetrySink(sock) as collector:
        run_ok(
            ["--steps", "12", "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "5",
             "--job", "t1", "--summary", str(tmp_path / "s.json")],
            cwd=tmp_path, env={"RANKGUARD_TELEMETRY_SOCKET": str(sock)},
        )  # fmt: skip
    assert collector.errors == []
    s = read_json(tmp_path / "s.json")
    assert s["telemetry_dropped"] == 0 and s["telemetry_sent"] > 12
    for rank in (0, 1):
        mine = [r for r in collector.records if r.rank == rank]
        steps = sorted(r.step for r in mine if r.phase == "train" and r.step_seconds > 0)
        assert steps == list(range(1, 13))
        assert {r.phase for r in mine} >= {
            "init",
            "checkpoint_load",
            "train",
            "checkpoint_save",
            "done",
        }
        assert all(r.job == "t1" and r.world_size == 2 and r.pid > 1 for r in mine)
        last = [r for r in mine if r.phase == "done"][-1]
        assert last.checkpoint_step == 10 and last.step == 12
        trained = [r for r in mine if r.step_seconds > 0]
        assert all(r.compute_seconds > 0 and r.tokens_per_second > 0 for r in trained)
        assert all(0 < r.mfu <= 1 and r.peak_memory_bytes > 0 for r in trained)
        assert all(r.comm_seconds > 0 for r in trained)  # a real all-reduce every step
        assert all(r.loss is not None and r.loss == r.loss for r in trained)


def test_no_listener_drops_records_and_trains(tmp_path):
    proc = torchrun(
        ["--steps", "5", "--summary", str(tmp_path / "s.json")],
        cwd=tmp_path, env={"RANKGUARD_TELEMETRY_SOCKET": str(tmp_path / "absent.sock")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = read_json(tmp_path / "s.json")
    assert s["final_step"] == 5 and s["telemetry_sent"] == 0 and s["telemetry_dropped"] >= 5


def test_fsdp2_matches_ddp_after_a_crash_and_resume(tmp_path, clean_40):
    """`--fsdp` (fully_shard per block, gloo on CPU): same result as DDP, and a crash at
    step 27 resumes from the sharded checkpoint and ends where the uninterrupted DDP run does."""
    run_ok(
        ["--steps", "40", "--fsdp", "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "10",
         "--summary", str(tmp_path / "s.json"), "--fault", "crash:step=27:rank=1"],
        cwd=tmp_path, max_restarts=1,
    )  # fmt: skip
    s = read_json(tmp_path / "s.json")
    assert s["resumed_from"] == 20 and s["final_step"] == 40
    assert s["final_loss"] == pytest.approx(clean_40["final_loss"], rel=1e-4)


def test_a_save_the_supervisor_asks_for_is_taken_at_its_step_by_every_rank(tmp_path):
    """A save request (what the agent writes for predictive drain) beside the telemetry
    socket: both ranks save at step 7 though no save is scheduled, as one checkpoint (a
    collective save that only one rank took would hang the run)."""
    from rankguard.contract.save_requests import SaveRequest, encode, request_path

    sock = tmp_path / "telemetry.sock"
    path = request_path(sock, "asked")
    path.parent.mkdir()
    path.write_bytes(encode(SaveRequest("asked", 0, 7, "test")))
    run_ok(
        ["--steps", "12", "--job", "asked", "--ckpt-dir", str(tmp_path / "ckpt"),
         "--ckpt-every", "1000", "--keep", "0", "--summary", str(tmp_path / "s.json")],
        cwd=tmp_path, env={"RANKGUARD_TELEMETRY_SOCKET": str(sock)},
    )  # fmt: skip
    assert _steps(tmp_path / "ckpt") == {"step-00000007": "validated"}
    assert read_json(tmp_path / "s.json")["checkpoint_saves"] == 1
