"""rankguard.client: the rank-side library, against a real Unix datagram listener.

Unit tests drive the Reporter in this process (host clock, no process group); the
example script runs under real torchrun (2 ranks, gloo) for DDP and FSDP2.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from harness import run_ok
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankguard.cli.local_stack import TelemetrySink, free_port
from rankguard.client import (
    ERROR_REASONS,
    STEP_PHASES,
    CheckpointError,
    CheckpointStore,
    Reporter,
    StepTimer,
)
from rankguard.contract.telemetry import PHASES

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ddp_client.py"
ENV = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "3"}


@pytest.fixture
def sock_dir():
    """A short directory for sockets (AF_UNIX paths are limited to 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="rgcl"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def reporter(path, **kw) -> Reporter:
    env = {**ENV, "RANKGUARD_TELEMETRY_SOCKET": str(path), "RANKGUARD_JOB": "myjob"}
    return Reporter(environ=env, **kw)


def wait_for(sink: TelemetrySink, count: int, timeout: float = 5.0) -> list:
    deadline = time.monotonic() + timeout
    while len(sink.records) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(sink.records)


def test_import_needs_only_the_standard_library():
    """`import rankguard.client` and a whole step loop with torch made unimportable."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from rankguard.client import Reporter\n"
        "rg = Reporter(socket_path=None)\n"
        "for n in range(1, 4):\n"
        "    with rg.step(n, tokens=10) as s:\n"
        "        s.phase('data'); s.phase('compute'); s.phase('optimizer'); s.loss(0.5)\n"
        "rg.close()\n"
        "assert len(rg.timings) == 3 and not rg.errors, (rg.timings, rg.errors)\n"
        "assert rg.sender.dropped_by_reason == {'disabled': 5}, rg.sender.dropped_by_reason\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_steps_phases_loss_tokens_reach_the_listener(sock_dir):
    path = sock_dir / "t.sock"
    with TelemetrySink(path) as sink:
        rg = reporter(path, flops_per_token=10.0, peak_flops=1e9)
        for n in (1, 2):
            with rg.step(n, tokens=1000) as s:
                time.sleep(0.02)  # data wait
                s.phase("compute")
                time.sleep(0.03)
                s.phase("optimizer")
                time.sleep(0.01)
                s.phase("checkpoint")
                time.sleep(0.01)
                s.loss(2.5 / n)
        rg.checkpoint_saved(2)
        rg.close()
        records = wait_for(sink, 4)
        assert not sink.errors
    init, s1, s2, done = records
    assert (init.phase, init.step, init.step_seconds) == ("init", 0, 0.0)
    assert init.flops is None and init.peak_flops == 1e9  # a heartbeat did no FLOPs
    assert (done.phase, done.step, done.checkpoint_step) == ("done", 2, 2)
    for r, n in ((s1, 1), (s2, 2)):
        assert (r.job, r.rank, r.local_rank, r.world_size) == ("myjob", 1, 1, 2)
        assert (r.restart, r.pid, r.phase, r.step) == (3, os.getpid(), "train", n)
        assert r.loss == pytest.approx(2.5 / n)
        assert (r.flops, r.peak_flops) == (10.0 * 1000, 1e9)  # the agent's FLOPs counter
        assert r.data_wait_seconds >= 0.02 and r.compute_seconds >= 0.03
        assert r.optimizer_seconds >= 0.01 and r.checkpoint_block_seconds >= 0.01
        parts = r.data_wait_seconds + r.compute_seconds + r.optimizer_seconds
        # nothing counted twice (a phase's end mark and the next phase's start are two
        # clock reads, microseconds apart: a loaded machine may put more between them)
        assert parts + r.checkpoint_block_seconds <= r.step_seconds + 1e-3
        assert r.tokens_per_second == pytest.approx(1000 / r.step_seconds)
        assert r.mfu == pytest.approx(10.0 * r.tokens_per_second / 1e9)
        assert r.comm_seconds == 0.0
        assert 0.0 <= r.compute_wait_seconds <= r.compute_seconds  # run-queue wait (Linux)
    assert init.compute_wait_seconds is None and done.compute_wait_seconds is None
    assert s1.checkpoint_step is None  # reported after the step that saved it
    assert rg.sent == 4 and rg.dropped == 0 and rg.errors == {}


def test_a_step_without_phases_is_all_compute():
    rg = Reporter(socket_path=None)
    s = rg.step(1)
    time.sleep(0.02)
    s.end()
    (t,) = rg.timings
    assert t.compute_seconds >= 0.02 and t.data_wait_seconds == 0.0
    # Unnamed start then "data": the data phase is the data wait, compute starts after it.
    with rg.step(2) as s:
        s.phase("data")
        time.sleep(0.02)
        s.phase("compute")
    t = rg.timings[-1]
    assert t.data_wait_seconds >= 0.02 and t.compute_seconds < 0.02


def test_next_step_and_long_phase_end_the_open_step(sock_dir):
    path = sock_dir / "t.sock"
    with TelemetrySink(path) as sink:
        rg = reporter(path, heartbeat_seconds=0)
        rg.step(1)
        rg.step(2)  # ends step 1
        with rg.phase("eval"):  # ends step 2: the eval is not part of its time
            time.sleep(0.05)
        rg.close()
        records = wait_for(sink, 6)
    assert [(r.phase, r.step) for r in records] == [
        ("init", 0), ("train", 1), ("train", 2), ("eval", 2), ("train", 2), ("done", 2)
    ]  # fmt: skip
    assert records[2].step_seconds < 0.05


def test_skipped_data_steps_ride_on_every_later_record(sock_dir):
    path = sock_dir / "t.sock"
    with TelemetrySink(path) as sink:
        rg = reporter(path, heartbeat_seconds=0)
        rg.data_skipped([45, 41, 42, 43, 44])
        rg.data_skipped([3, True])  # refused (counted): the skips stand
        rg.step(41)
        rg.close()
        records = wait_for(sink, 3)
    assert rg.errors == {"bad_value": 1}
    assert [(r.phase, r.resume_skips) for r in records] == [
        ("init", None), ("train", ((41, 45),)), ("done", ((41, 45),))]  # fmt: skip


def test_native_service_threads_are_not_a_phase_s_progress(tmp_path):
    """A save stuck for good kept beating: gloo's TCP loop uses CPU while idle, which
    the process's CPU counted as progress. Only this process's Python threads count."""
    import threading

    import torch.distributed as dist

    from rankguard.client.reporter import ProcessProgress

    # four groups, four idle gloo loops: about 10 ms of CPU in the window
    pgs = [dist.ProcessGroupGloo(dist.FileStore(str(tmp_path / f"s{n}"), 1), 0, 1)
           for n in range(4)]  # fmt: skip

    def native_ns() -> int:  # CPU of the threads that are not Python's
        python = {t.native_id for t in threading.enumerate()}
        tasks = [t for t in os.listdir("/proc/self/task") if int(t) not in python]
        return sum(int(Path(f"/proc/self/task/{t}/schedstat").read_text().split()[0])
                   for t in tasks)  # fmt: skip

    before = native_ns()  # (read before the looks: these reads are I/O of this process)
    progress = ProcessProgress()
    time.sleep(1.5)  # idle: the gloo loops alone run
    assert not progress.moved()  # no progress of ours...
    assert native_ns() - before >= 3e6  # ...while they used CPU (about 2 ms a second each)
    progress.rebase()
    for started in (False, True):  # a Python thread's work counts, even once it ended
        go = threading.Event()
        busy = threading.Thread(target=lambda go=go: go.wait() and sum(range(3_000_000)))
        busy.start()
        if started:
            assert not progress.moved()  # it exists, idle
        go.set()
        busy.join()
        assert progress.moved() and not progress.moved()
    del pgs


def test_the_stall_watch_s_own_work_is_not_a_phase_s_progress(tmp_path):
    """The stall watch reads the recorder and sends its evidence while a save is stuck:
    that CPU and those bytes are rankguard's own, and a stuck save must still fall silent
    (it beat every few seconds, and its hang was never found)."""
    import threading

    from rankguard.client.reporter import ProcessProgress

    sent = [0]
    go, done, end = threading.Event(), threading.Event(), threading.Event()

    def watch():  # works and writes as the watch does, between two looks; lives on
        go.wait()
        sum(range(3_000_000))
        (tmp_path / "evidence").write_bytes(b"x" * 3000)
        sent[0] += 4096
        done.set()
        end.wait()

    watcher = threading.Thread(target=watch)
    watcher.start()
    progress = ProcessProgress(lambda: ({watcher.native_id}, sent[0]))
    go.set()
    done.wait()
    assert not progress.moved()
    end.set()
    watcher.join()
    plain = ProcessProgress()  # the same work, not declared: progress
    busy = threading.Thread(target=lambda: sum(range(3_000_000)))
    busy.start()
    busy.join()
    assert plain.moved()


def test_heartbeats_during_a_long_phase_then_stop_at_the_limit(sock_dir):
    path = sock_dir / "t.sock"
    with TelemetrySink(path) as sink:
        rg = reporter(path, heartbeat_seconds=0.05)
        with rg.phase("checkpoint_save"):
            time.sleep(0.4)
        time.sleep(0.1)  # the listener's thread has received them all
        saves = [r for r in wait_for(sink, 4) if r.phase == "checkpoint_save"]
        assert len(saves) >= 4  # the announcement plus beats every 50 ms
        assert rg.current_phase == "train" and sink.records[-1].phase == "train"
        count = len(sink.records)
        time.sleep(0.15)
        assert len(sink.records) == count  # the beater stopped with the phase
        rg.heartbeat_limit_seconds = 0.12
        with rg.phase("eval"):
            time.sleep(0.5)
        evals = [r for r in wait_for(sink, count + 3) if r.phase == "eval"]
        assert 2 <= len(evals) <= 4  # beats stop after the limit: a stuck phase looks hung
        rg.close()


def test_no_socket_is_counted_never_raised(sock_dir):
    rg = reporter(sock_dir / "missing" / "agent.sock")
    start = time.monotonic()
    for n in range(1, 501):
        with rg.step(n, tokens=1) as s:
            s.phase("compute")
            s.loss(1.0)
    rg.close()
    assert time.monotonic() - start < 5
    assert rg.sent == 0 and rg.sender.dropped_by_reason == {"no_socket": 502}
    assert rg.errors == {}


def test_full_socket_is_counted_never_blocks(sock_dir):
    path = sock_dir / "full.sock"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(path))  # never read
    try:
        rg = reporter(path)
        start = time.monotonic()
        for n in range(1, 2001):
            rg.step(n).end()
        assert time.monotonic() - start < 10
        assert rg.sender.dropped_by_reason.get("queue_full", 0) > 0
        assert rg.sent + rg.dropped == 2001
        rg.close()
    finally:
        rx.close()


def test_closing_waits_for_room_so_done_is_not_lost(sock_dir):
    """Training over, the agent's queue full (every node's ranks finish at once): close()
    waits for room instead of dropping, so the agent reads "done", not a death."""
    path = sock_dir / "behind.sock"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(path))
    try:
        rg = reporter(path, heartbeat_seconds=0)
        n = 0
        while not rg.sender.dropped_by_reason.get("queue_full"):  # fill the kernel queue
            n += 1
            rg.step(n).end()
        received = []

        def drain_later():
            time.sleep(0.3)  # an agent in its wait between drains
            rx.settimeout(1.0)
            with contextlib.suppress(TimeoutError):
                while True:
                    received.append(json.loads(rx.recv(65536)))

        reader = threading.Thread(target=drain_later)
        reader.start()
        rg.close()
        reader.join()
        assert received[-1]["phase"] == "done", received[-1]
        assert rg.sender.dropped_by_reason == {"queue_full": 1}  # only the probe, mid-run
    finally:
        rx.close()


def test_bad_values_are_counted(sock_dir):
    path = sock_dir / "t.sock"
    with TelemetrySink(path) as sink:
        rg = reporter(path, heartbeat_seconds=0)
        with rg.step(-4) as s:  # a bad step number: counted, the next one used
            s.phase("lunch")
            s.loss("not a number")
            s.tokens(-3)
            s.tokens(True)
        with rg.phase("coffee"):  # not a phase: counted, the body still runs
            pass
        rg.heartbeat("nap")
        rg.checkpoint_saved(-1)
        with rg.step(2) as s:
            s.loss(float("nan"))  # a diverged loss is data, not an error
            s.tokens(math.inf)  # tokens/s would be infinite: sent as 0
        rg.close()
        records = wait_for(sink, 4)
        assert not sink.errors
    assert rg.errors == {"bad_value": 5, "bad_phase": 3}
    assert set(rg.errors) <= set(ERROR_REASONS)
    assert [r.step for r in records if r.step_seconds > 0] == [1, 2]
    last = [r for r in records if r.step == 2 and r.step_seconds > 0][0]
    assert math.isnan(last.loss) and last.tokens_per_second == 0.0


def test_a_job_the_schema_refuses_is_counted_by_the_sender(sock_dir):
    path = sock_dir / "t.sock"
    with TelemetrySink(path) as sink:
        rg = Reporter(job="bad\njob", socket_path=str(path), environ={})
        rg.step(1).end()
        rg.close()
        time.sleep(0.1)
        assert sink.records == []
    assert rg.sender.dropped_by_reason == {"invalid": 3}


def test_a_broken_timer_is_counted_and_training_goes_on():
    rg = Reporter(socket_path=None)

    def broken(*a, **k):
        raise RuntimeError("event pool exhausted")

    rg.timer.mark = broken
    with rg.step(1) as s:
        s.phase("compute")
        s.phase("optimizer")
    assert rg.errors.get("timer", 0) >= 1


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux only")
def test_compute_wait_is_the_time_runnable_without_a_cpu():
    """Issue 16: a compute phase sharing one CPU with a busy process spends about half its
    time runnable but off the CPU (the run-queue wait, reported as compute_wait_seconds);
    a compute phase that sleeps (a rank slowed by a device, not preempted) waits for no CPU."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(spinner.pid, {cpu})
        os.sched_setaffinity(0, {cpu})  # this thread only (Linux: 0 is the calling thread)
        time.sleep(0.1)  # the spinner is up and running
        rg = Reporter(socket_path=None)
        with rg.step(1) as s:
            s.phase("compute")
            end = time.perf_counter() + 0.3
            while time.perf_counter() < end:
                pass
        with rg.step(2) as s:
            s.phase("compute")
            time.sleep(0.2)
    finally:
        os.sched_setaffinity(0, before)
        spinner.kill()
        spinner.wait()
    busy, asleep = rg.timings
    assert 0.25 * busy.compute_seconds <= busy.compute_wait_seconds <= busy.compute_seconds
    assert 0.0 <= asleep.compute_wait_seconds <= 0.1 * asleep.compute_seconds, asleep


def test_attach_without_ddp_or_fsdp_is_counted():
    rg = Reporter(socket_path=None)
    assert rg.attach(object()) is not None
    assert rg.errors == {"attach": 1}


def test_cpu_loss_tensor_and_timer_api():
    torch = pytest.importorskip("torch")
    rg = Reporter(socket_path=None)
    with rg.step(1) as s:
        s.loss(torch.tensor(1.25))
    assert rg.last_loss == 1.25
    assert isinstance(rg.timer, StepTimer)


CRASHING_SCRIPT = """
import sys
from rankguard.client import Reporter
rg = Reporter(socket_path=sys.argv[1], heartbeat_seconds=0)
with rg.step(1, tokens=8) as s:
    s.loss(0.5)
with rg.step(2) as s:
    s.loss(0.25)
if sys.argv[2] == "crash":
    raise RuntimeError("boom")
"""


@pytest.mark.parametrize("how", ["exit", "crash"])
def test_exit_says_done_only_when_the_script_did_not_crash(sock_dir, how):
    """A "done" record makes the agent take the exiting rank as finished, not dead."""
    path = sock_dir / "agent.sock"
    with TelemetrySink(path) as sink:
        proc = subprocess.run(
            [sys.executable, "-c", CRASHING_SCRIPT, str(path), how],
            env={**os.environ, **ENV}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        records = wait_for(sink, 4 if how == "exit" else 3)
    assert proc.returncode == (1 if how == "crash" else 0), proc.stderr
    assert [r.step for r in records if r.step_seconds > 0] == [1, 2]  # flushed either way
    assert (records[-1].phase == "done") == (how == "exit"), [r.phase for r in records]


def test_checkpoint_store_save_latest_load_keep(tmp_path):
    torch = pytest.importorskip("torch")
    rg = Reporter(socket_path=None, heartbeat_seconds=0)
    store = CheckpointStore(tmp_path / "ckpt", keep=2, reporter=rg)
    assert store.latest() is None and store.resume() == (0, None)
    for step in (10, 20, 30):
        final = store.save(step, {"w": torch.full((3,), float(step)), "step": step})
        assert final == tmp_path / "ckpt" / f"step-{step:08d}"
        assert rg.checkpoint_step == step
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-00000020", "step-00000030"
    ]  # fmt: skip
    found = store.latest()
    assert found.step == 30
    state = store.load(found)
    assert state["step"] == 30 and torch.equal(state["w"], torch.full((3,), 30.0))
    assert store.load(20)["step"] == 20 and store.load()["step"] == 30
    # A corrupted newest one is quarantined with its reason; the one before is chosen.
    (found.path / "state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        store.load(found.path / ".." / "step-00000030")
    assert store.latest().step == 20
    step, state = store.resume(weights_only=True)  # no process group: this process selects
    assert step == 20 and state["step"] == 20 and rg.checkpoint_step == 20
    (entry,) = (tmp_path / "ckpt" / "quarantine").iterdir()
    assert "QUARANTINE.json" in {p.name for p in entry.iterdir()}
    assert store.failures == 0 and store.saves == 3


def test_checkpoint_store_failures_are_counted_not_raised(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    assert store.save(1, {"a": 1}) is not None
    assert store.save(1, {"a": 2}) is None  # already committed
    assert store.save(2, {"lock": __import__("threading").Lock()}) is None  # cannot pickle
    assert store.save(-1, {}) is None
    assert store.failures == 3 and "step" in store.last_error
    assert store.latest().step == 1  # the failed step 2 left a .partial: quarantined
    assert (tmp_path / "ckpt" / "quarantine").is_dir()
    blocked = tmp_path / "file"
    blocked.write_text("not a dir")
    assert CheckpointStore(blocked / "ckpt").save(1, {}) is None


def test_checkpoint_store_never_validates_bad_numerics(tmp_path):
    """The NaN remedy resumes from the newest validated checkpoint: it must predate the NaN."""
    torch = pytest.importorskip("torch")
    rg = Reporter(socket_path=None, heartbeat_seconds=0)
    store = CheckpointStore(tmp_path / "ckpt", reporter=rg)
    with rg.step(1) as s:
        s.loss(torch.tensor(0.5))
    assert store.save(1, {"w": torch.ones(2), "lr": 0.1}) is not None
    # NaN weights (another rank's NaN gradient, all-reduced) while this rank's loss is finite
    with rg.step(2) as s:
        s.loss(0.4)
    assert store.save(2, {"model": {"0.weight": torch.tensor([1.0, math.nan])}}) is None
    assert "state['model']['0.weight']" in store.last_error
    assert store.save(2, {"opt": [{"lr": math.inf}]}) is None
    assert store.refused == {"non_finite_state": 2}
    with rg.step(3) as s:
        s.loss(torch.tensor(math.nan))
    assert rg.nonfinite_loss_step == 3
    with rg.step(4) as s:
        s.loss(0.3)  # finite again, but the weights have seen the NaN
    assert store.save(4, {"w": torch.ones(2)}) is None
    assert store.refused == {"non_finite_state": 2, "non_finite_loss": 1}
    assert "step 3" in store.last_error
    assert store.latest().step == 1 and store.failures == 0 and store.saves == 1
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-00000001"]
    # without a reporter, and with the scan turned off, a NaN state is the caller's choice
    unchecked = CheckpointStore(tmp_path / "unchecked", check_finite=False)
    assert unchecked.save(1, {"w": torch.tensor(math.nan)}) is not None


@pytest.mark.gpu
def test_cuda_steps_are_read_a_step_late_and_loss_tensors_never_sync():
    torch = pytest.importorskip("torch")
    dev = torch.device("cuda")
    rg = Reporter(socket_path=None, device=dev)
    x = torch.randn(2048, 2048, device=dev)
    for n in (1, 2, 3):
        with rg.step(n, tokens=2048) as s:
            s.phase("compute")
            y = x @ x
            s.phase("optimizer")
            y.mul_(0.5)
            s.loss(y.mean())
    assert [t.step for t in rg.timings] == [1, 2]  # the newest waits for its events
    rg.flush()
    assert [t.step for t in rg.timings] == [1, 2, 3]
    assert all(t.compute_seconds > 0 and t.optimizer_seconds > 0 for t in rg.timings)
    assert isinstance(rg.last_loss, float) and rg.errors == {}


phase_calls = st.lists(st.sampled_from([*STEP_PHASES, "bogus"]), max_size=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.tuples(
            phase_calls,
            st.one_of(st.none(), st.floats(allow_nan=True), st.integers(), st.text(max_size=3)),
            st.one_of(st.none(), st.integers(-5, 10**6), st.floats(allow_nan=True)),
            st.booleans(),
        ),
        max_size=6,
    ),
    long_phase=st.sampled_from([*PHASES, "bogus"]),
)
def test_any_call_sequence_never_raises_and_every_record_is_counted(steps, long_phase):
    rg = Reporter(socket_path="/nonexistent/rankguard.sock", heartbeat_seconds=0, environ={})
    for n, (phases, loss, tokens, ctx) in enumerate(steps, 1):
        s = rg.step(n)
        for p in phases:
            s.phase(p)
        s.loss(loss)
        if tokens is not None:
            s.tokens(tokens)
        if ctx:
            s.end()
        with rg.phase(long_phase):
            pass
    rg.close()
    assert set(rg.errors) <= set(ERROR_REASONS)
    assert len(rg.timings) == len(steps)
    for t in rg.timings:
        for part in (t.data_wait_seconds, t.compute_seconds, t.optimizer_seconds):
            assert 0.0 <= part <= t.step_seconds + 1e-6
    valid_long = long_phase in PHASES
    # init + each step + (announce + back) per valid long phase + done
    assert rg.sent + rg.dropped == 1 + len(steps) * (1 + 2 * valid_long) + 1


def test_example_differs_from_the_plain_script_by_at_most_ten_lines():
    plain = (ROOT / "examples" / "ddp_plain.py").read_text().splitlines()
    client = EXAMPLE.read_text().splitlines()
    changed = [
        line
        for line in difflib.unified_diff(plain, client, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert 0 < len(changed) <= 10, changed


def run_example(sock_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess, list]:
    path = sock_dir / "agent.sock"
    with TelemetrySink(path) as sink:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKGUARD_TELEMETRY_SOCKET": str(path)}
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node=2", str(EXAMPLE), "--width", "64", *args],
            env=env, cwd=sock_dir, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        time.sleep(0.2)
        return proc, list(sink.records)


@pytest.mark.slow
def test_example_under_torchrun_reports_every_rank_with_communication(sock_dir):
    proc, records = run_example(sock_dir, "--steps", "12", "--save-every", "5")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        mine = [r for r in records if r.rank == rank]
        steps = [r for r in mine if r.step_seconds > 0]
        assert [r.step for r in steps] == list(range(1, 13))
        assert all(r.comm_seconds > 0 and r.loss is not None for r in steps)
        assert all(r.tokens_per_second > 0 and r.world_size == 2 for r in steps)
        assert mine[0].phase == "init" and mine[-1].phase == "done"
    saves = [r for r in records if r.phase == "checkpoint_save"]
    assert {r.rank for r in saves} == {0} and {r.step for r in saves} == {5, 10}


FSDP_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from rankguard.client import Reporter

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
rg = Reporter(model)
for n in range(1, 9):
    with rg.step(n, tokens=32) as s:
        x = torch.randn(32, 64)
        s.phase("compute")
        loss = model(x).square().mean()
        loss.backward()
        s.phase("optimizer")
        opt.step()
        opt.zero_grad()
        s.loss(loss)
rg.close()
assert rg.errors == {}, rg.errors
# a rank tearing gloo down alone, its peer still connected, can abort at exit (std::terminate)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_fsdp2_communication_is_timed(sock_dir):
    script = sock_dir / "fsdp_client.py"
    script.write_text(FSDP_SCRIPT)
    path = sock_dir / "agent.sock"
    with TelemetrySink(path) as sink:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKGUARD_TELEMETRY_SOCKET": str(path)}
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node=2", str(script)],
            env=env, cwd=sock_dir, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        time.sleep(0.2)
        records = list(sink.records)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        steps = [r for r in records if r.rank == rank and r.step_seconds > 0]
        assert [r.step for r in steps] == list(range(1, 9))
        # all-gathers in forward and backward, reduce-scatters in backward
        assert all(r.comm_seconds > 0 for r in steps), [r.comm_seconds for r in steps]


@pytest.mark.slow
def test_bundled_trainer_with_fsdp_reports_communication(sock_dir):
    """`--fsdp` used to report no communication; the client's FSDP2 collectives time it."""
    path = sock_dir / "agent.sock"
    with TelemetrySink(path) as sink:
        run_ok(
            ["--steps", "6", "--fsdp"], cwd=sock_dir, env={"RANKGUARD_TELEMETRY_SOCKET": str(path)}
        )
        time.sleep(0.2)
        for rank in (0, 1):
            steps = sink.train_records(rank)
            assert [r.step for r in steps] == list(range(1, 7))
            assert all(r.comm_seconds > 0 for r in steps), [r.comm_seconds for r in steps]


LATE_CALLBACK_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
from rankguard.client.timing import StepTimer, _chain

dist.init_process_group("gloo", rank=0, world_size=1)
timer = StepTimer()
timer.begin(1)
fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()

def late(f):
    time.sleep(0.3)  # the script returns meanwhile: gloo's thread needs the GIL after this
    open(sys.argv[1], "w").write("released")
    return f.value()[0]

_chain(timer, fut, late)
"""


def test_a_script_that_exits_while_a_collective_callback_runs_exits_cleanly(tmp_path):
    """The cause of a rank's SIGABRT/SIGSEGV at exit ("terminate called without an active
    exception"): a backend thread still holding a Python callback when the interpreter
    finalizes. Without the exit wait (a plain ``fut.then``) this script crashes every time
    on torch 2.13 / CPython 3.11; with it, it waits for the callback and exits 0."""
    script, marker = tmp_path / "late.py", tmp_path / "marker"
    script.write_text(LATE_CALLBACK_SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, str(script), str(marker)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.read_text() == "released"


def test_records_name_the_rank_s_gpu_once_the_first_step_put_the_clock_on_it(sock_dir, monkeypatch):
    """A GPU stand-in: the device's UUID is given (what `device_uuid` reads from torch on
    a GPU, checked for real by the gpu-marked trainer test). Records before the first step
    resolved the device name no GPU; from it on, every record does."""
    from rankguard.client import reporter as reporter_module

    uuid = "GPU-6f3c2a1e-8b7d-4c5e-9f0a-1b2c3d4e5f60"
    monkeypatch.setattr(reporter_module, "device_uuid", lambda device: uuid)
    path = sock_dir / "t.sock"
    with TelemetrySink(path) as sink:
        rg = reporter(path, heartbeat_seconds=0)
        rg.step(1)
        rg.step(2)
        rg.close()
        records = wait_for(sink, 4)
    assert [(r.phase, r.gpu_uuid) for r in records] == [
        ("init", None), ("train", uuid), ("train", uuid), ("done", uuid)]  # fmt: skip
