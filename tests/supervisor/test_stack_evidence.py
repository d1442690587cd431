"""Stack evidence that holds on NCCL as on gloo: pure functions of literal py-spy dumps.

The gloo and DataLoader dumps were captured with py-spy 0.4.3 from real processes on a CPU
machine, plain (`dump --nonblocking`) and with native frames (`dump --native`): rank 0 of
a 2-rank gloo job waiting in all_reduce for rank 1, rank 1 asleep in user code before its
collective, and a process whose DataLoader (one worker, stuck in __getitem__) waits in
multiprocessing.connection.wait. The NCCL ones (a peer spinning in `.item()`'s CUDA sync,
a peer in rankguard's clock) are written in py-spy's format from the frames torch's CUDA
build has, as no GPU is here.
"""

from __future__ import annotations

import dataclasses

import pytest
from builders import CFG, T0, cluster, hung

from rankguard.contract.answers import MainThreadAnswer
from rankguard.supervisor.detectors import hang
from rankguard.supervisor.detectors.hang import (
    OUTSIDE,
    OWN_THREAD,
    WAITING,
    Frame,
    main_thread_frames,
    pick_culprit_from_stacks,
    thread_verdict,
)
from rankguard.supervisor.state import ClusterObs

HEADER = """\
Process {pid}: /work/main/.venv/bin/python {script}
Python v3.11.7 (/root/.pyenv/versions/3.11.7/bin/python3.11)

"""

GLOO_WAITING = (
    HEADER.format(pid=26859, script="gloo_wait.py")
    + """\
Thread 26859 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:3252)
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    main (gloo_wait.py:13)
    <module> (gloo_wait.py:15)
"""
)

PYBIND_FRAME = (
    "    pybind11::cpp_function::initialize<pybind11::cpp_function::cpp_function<bool, c1"
    "0d::Work, std::chrono::duration<long, std::ratio<(long)1, (long)1000> >, pybind11::n"
    "ame, pybind11::is_method, pybind11::sibling, pybind11::arg_v, pybind11::call_guard<p"
    "ybind11::gil_scoped_release>, char [654]>(pybind11::name const, pybind11::is_method&"
    ", pybind11::sibling, pybind11::arg_v, pybind11::call_guard<pybind11::gil_scoped_rele"
    "ase>, char [654])::{lambda(c10d::Work*, std::chrono::duration<long, std::ratio<(long"
    ")1, (long)1000> >)#1}, bool, c10d::Work*, std::chrono::duration<long, std::ratio<(lo"
    "ng)1, (long)1000> >, pybind11::name, pybind11::is_method, pybind11::sibling, pybind1"
    "1::arg_v, pybind11::call_guard<pybind11::gil_scoped_release>, char [654]>(pybind11::"
    "cpp_function::cpp_function<bool, c10d::Work, std::chrono::duration<long, std::ratio<"
    "(long)1, (long)1000> >, pybind11::name, pybind11::is_method, pybind11::sibling, pybi"
    "nd11::arg_v, pybind11::call_guard<pybind11::gil_scoped_release>, char [654]>(pybind1"
    "1::name const, pybind11::is_method&, pybind11::sibling, pybind11::arg_v, pybind11::c"
    "all_guard<pybind11::gil_scoped_release>, char [654])::{lambda(c10d::Work*, std::chro"
    "no::duration<long, std::ratio<(long)1, (long)1000> >&&)#1}, bool (*)(c10d::Work*, st"
    "d::chrono::duration<long, std::ratio<(long)1, (long)1000> >), pybind11::name const, "
    "pybind11::is_method&, pybind11::sibling, pybind11::arg_v, pybind11::call_guard<pybin"
    "d11::gil_scoped_release>, char [654])::{lambda(pybind11::detail::function_call&)#1}:"
    ":_FUN (libtorch_python.so)"
)

GLOO_WAITING_NATIVE = HEADER.format(pid=26859, script="gloo_wait.py") + "\n".join([
    'Thread 26859 (idle): "MainThread"',
    "    0x7fb241ca3f16 (libc.so.6)",
    "    pthread_cond_wait (libc.so.6)",
    "    std::condition_variable::wait (libstdc++.so.6.0.30)",
    "    c10d::Work::wait (libtorch_cpu.so)",
    PYBIND_FRAME,
    "    pybind11::cpp_function::dispatcher (libtorch_python.so)",
    "    all_reduce (torch/distributed/distributed_c10d.py:3252)",
    "    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)",
    "    main (gloo_wait.py:13)",
    "    <module> (gloo_wait.py:15)",
    "    0x7fb241c4524a (libc.so.6)",
    "",
])  # fmt: skip

STUCK_IN_PYTHON = (
    HEADER.format(pid=26860, script="gloo_wait.py")
    + """\
Thread 26860 (idle): "MainThread"
    main.<locals>.user_stuck (gloo_wait.py:11)
    main (gloo_wait.py:12)
    <module> (gloo_wait.py:15)
"""
)

STUCK_IN_PYTHON_NATIVE = (
    HEADER.format(pid=26860, script="gloo_wait.py")
    + """\
Thread 26860 (idle): "MainThread"
    clock_nanosleep (libc.so.6)
    time_sleep (libpython3.11.so.1.0)
    main.<locals>.user_stuck (gloo_wait.py:11)
    main (gloo_wait.py:12)
    <module> (gloo_wait.py:15)
    0x7f496364524a (libc.so.6)
"""
)

DATALOADER = (
    HEADER.format(pid=26861, script="dl_real.py")
    + """\
Thread 26861 (idle): "MainThread"
    _PollLikeSelector.select (selectors.py:415)
    wait (multiprocessing/connection.py:947)
    Connection._poll (multiprocessing/connection.py:440)
    _ConnectionBase.poll (multiprocessing/connection.py:257)
    Queue.get (multiprocessing/queues.py:113)
    _MultiProcessingDataLoaderIter._try_get_data (torch/utils/data/dataloader.py:1291)
    _MultiProcessingDataLoaderIter._get_data (torch/utils/data/dataloader.py:1464)
    _MultiProcessingDataLoaderIter._next_data (torch/utils/data/dataloader.py:1505)
    _BaseDataLoaderIter.__next__ (torch/utils/data/dataloader.py:725)
    <module> (dl_real.py:13)
Thread 26944 (idle): "QueueFeederThread"
    Condition.wait (threading.py:327)
    Queue._feed (multiprocessing/queues.py:231)
    Thread.run (threading.py:982)
    Thread._bootstrap_inner (threading.py:1045)
    Thread._bootstrap (threading.py:1002)
"""
)

DATALOADER_NATIVE = (
    HEADER.format(pid=26861, script="dl_real.py")
    + """\
Thread 26861 (idle): "MainThread"
    poll (libc.so.6)
    select_poll_poll_impl (selectmodule.c:655)
    select_poll_poll (selectmodule.c.h:223)
    _PollLikeSelector.select (selectors.py:415)
    wait (multiprocessing/connection.py:947)
    Connection._poll (multiprocessing/connection.py:440)
    _ConnectionBase.poll (multiprocessing/connection.py:257)
    Queue.get (multiprocessing/queues.py:113)
    _MultiProcessingDataLoaderIter._try_get_data (torch/utils/data/dataloader.py:1291)
    _MultiProcessingDataLoaderIter._get_data (torch/utils/data/dataloader.py:1464)
    _MultiProcessingDataLoaderIter._next_data (torch/utils/data/dataloader.py:1505)
    _BaseDataLoaderIter.__next__ (torch/utils/data/dataloader.py:725)
    <module> (dl_real.py:13)
    0x7f13dfa4524a (libc.so.6)
Thread 26944 (idle): "QueueFeederThread"
    0x7f13dfaa3f16 (libc.so.6)
    0x7f13dfaaed90 (libc.so.6)
    PyThread_acquire_lock_timed (libpython3.11.so.1.0)
    lock_PyThread_acquire_lock (libpython3.11.so.1.0)
    Condition.wait (threading.py:327)
    Queue._feed (multiprocessing/queues.py:231)
    Thread.run (threading.py:982)
    Thread._bootstrap_inner (threading.py:1045)
    Thread._bootstrap (threading.py:1002)
    thread_run (libpython3.11.so.1.0)
    0x7f13dfaa71f5 (libc.so.6)
    0x7f13dfb278ec (libc.so.6)
"""
)

# A process that never imported threading: py-spy names none of its threads (captured).
UNNAMED = """\
Process 25280: /work/main/.venv/bin/python -c import time; time.sleep(30)
Python v3.11.7 (/root/.pyenv/versions/3.11.7/bin/python3.11)

Thread 25280 (idle)
    clock_nanosleep (libc.so.6)
    time_sleep (libpython3.11.so.1.0)
    <module> (<string>:1)
    0x7f0fc8c4524a (libc.so.6)
"""

# NCCL: a peer whose NCCL kernel waits for the culprit spins in `loss.item()`'s stream sync
# (a user frame in Python; only native frames show where).
NCCL_ITEM_NATIVE = (
    HEADER.format(pid=5121, script="train.py")
    + """\
Thread 5121 (active): "MainThread"
    0x7f3a5c2e1b2a (libcuda.so.1)
    0x7f3a5c1f0e11 (libcuda.so.1)
    cudaStreamSynchronize (libcudart.so.12)
    at::native::_local_scalar_dense_cuda (libtorch_cuda.so)
    at::_ops::_local_scalar_dense::call (libtorch_cpu.so)
    at::native::item (libtorch_cpu.so)
    at::_ops::item::call (libtorch_cpu.so)
    THPVariable_item (libtorch_python.so)
    train_step (train.py:41)
    main (train.py:60)
    <module> (train.py:64)
Thread 5230 (idle): "pt_autograd_0"
    0x7f3a61ea3f16 (libc.so.6)
    torch::autograd::ReadyQueue::pop (libtorch_cpu.so)
"""
)

# ... and one in rankguard's clock, reading the last step's CUDA events (plain dump)
NCCL_CLOCK = (
    HEADER.format(pid=5122, script="train.py")
    + """\
Thread 5122 (active+gil): "MainThread"
    Event.synchronize (torch/cuda/streams.py:227)
    Clock.seconds (rankguard/client/timing.py:182)
    StepTimer._resolve.<locals>.<dictcomp> (rankguard/client/timing.py:315)
    StepTimer._resolve (rankguard/client/timing.py:315)
    StepTimer.ready (rankguard/client/timing.py:309)
    Reporter._end_step (rankguard/client/reporter.py:462)
    Step.__exit__ (rankguard/client/reporter.py:262)
    train_step (train.py:43)
    main (train.py:60)
    <module> (train.py:64)
"""
)


def test_frames_keep_function_and_file_native_ones_too():
    frames = main_thread_frames(GLOO_WAITING_NATIVE)
    assert frames[3] == Frame("c10d::Work::wait", "libtorch_cpu.so") and frames[3].native
    # a native name with " (" in it (a template argument) ends at its library
    assert frames[4].function.endswith("::_FUN") and frames[4].file == "libtorch_python.so"
    assert frames[6] == Frame("all_reduce", "torch/distributed/distributed_c10d.py")
    assert not frames[6].native
    assert main_thread_frames(DATALOADER_NATIVE)[1] == Frame(
        "select_poll_poll_impl", "selectmodule.c"
    )
    assert [f.function for f in main_thread_frames(STUCK_IN_PYTHON)] == [
        "main.<locals>.user_stuck", "main", "<module>",
    ]  # fmt: skip
    # a process that never imported threading: its main thread is the one with its pid
    assert main_thread_frames(UNNAMED)[2] == Frame("<module>", "<string>")


@pytest.mark.parametrize(
    ("dump", "verdict"),
    [
        (GLOO_WAITING, WAITING),
        (GLOO_WAITING_NATIVE, WAITING),
        (STUCK_IN_PYTHON, OUTSIDE),
        (STUCK_IN_PYTHON_NATIVE, OUTSIDE),
        (DATALOADER, OUTSIDE),
        (DATALOADER_NATIVE, OUTSIDE),
        (NCCL_ITEM_NATIVE, WAITING),
        (NCCL_CLOCK, WAITING),
        (UNNAMED, OUTSIDE),
    ],
)
def test_where_the_main_thread_is(dump, verdict):
    assert thread_verdict(main_thread_frames(dump)) == verdict


def test_a_rank_stuck_in_its_dataloader_is_the_culprit_not_a_waiting_peer():
    """multiprocessing.connection.wait is no collective's wait: the DataLoader rank is the
    one the others wait for (the bare marker "wait" made it a waiting peer: no culprit)."""
    for peer, stuck in ((GLOO_WAITING, DATALOADER), (GLOO_WAITING_NATIVE, DATALOADER_NATIVE),
                        (NCCL_ITEM_NATIVE, DATALOADER_NATIVE)):  # fmt: skip
        assert pick_culprit_from_stacks({0: peer, 1: stuck, 2: peer}) == 1


def test_nccl_peers_spinning_in_a_cuda_sync_are_waiting():
    """On NCCL the peers sit in a CUDA sync (`.item()`, rankguard's clock), not in a frame
    named after a collective: the rank stuck before its collective is still the odd one."""
    stacks = {0: NCCL_ITEM_NATIVE, 1: NCCL_CLOCK, 2: STUCK_IN_PYTHON_NATIVE, 3: NCCL_CLOCK}
    assert pick_culprit_from_stacks(stacks) == 2
    # rankguard's clock is a waiting peer wherever rankguard is installed
    editable = NCCL_CLOCK.replace("rankguard/client/", "/work/main/client/")
    assert pick_culprit_from_stacks({0: editable, 1: STUCK_IN_PYTHON}) == 1


def test_a_cuda_sync_in_user_code_without_native_frames_says_nothing():
    """Without native frames, `.item()` is only the user's frame: such a peer looks outside,
    and two ranks outside name no culprit (never the wrong one)."""
    plain_item = NCCL_ITEM_NATIVE.replace(
        NCCL_ITEM_NATIVE[
            NCCL_ITEM_NATIVE.index("    0x7f3a5c2e") : NCCL_ITEM_NATIVE.index("    train_step")
        ],
        "",
    )
    assert thread_verdict(main_thread_frames(plain_item)) == OUTSIDE
    assert pick_culprit_from_stacks({0: plain_item, 1: STUCK_IN_PYTHON, 2: GLOO_WAITING}) is None


def test_the_innermost_frame_that_says_decides():
    """A DataLoader iterated inside rankguard's timing (timed_batches) is still a DataLoader
    wait; a collective reached from user code under a DataLoader frame is a collective."""
    loader_in_timing = DATALOADER.replace(
        "    <module> (dl_real.py:13)",
        "    timed_batches (rankguard/client/timing.py:371)\n    <module> (dl_real.py:13)",
    )
    assert thread_verdict(main_thread_frames(loader_in_timing)) == OUTSIDE
    frames = [Frame("wait", "multiprocessing/connection.py"), Frame("f", "torch/distributed/x.py")]
    assert thread_verdict(frames) == OUTSIDE
    assert thread_verdict(frames[::-1]) == WAITING
    assert thread_verdict([Frame("Future.result", "concurrent/futures/_base.py")]) == OWN_THREAD


def test_a_collective_wrapper_further_out_does_not_hide_a_stuck_rank():
    """The innermost frame that says decides: user code under elastic's @record, a layer
    stuck computing inside an FSDP module, DCP stuck writing its file are outside; a wait
    through threading's plumbing is judged by what waits."""
    record = STUCK_IN_PYTHON_NATIVE.replace(
        "    <module> (gloo_wait.py:15)",
        "    record.<locals>.wrapper (torch/distributed/elastic/multiprocessing/errors/"
        "__init__.py:355)\n    <module> (gloo_wait.py:15)",
    )
    assert thread_verdict(main_thread_frames(record)) == OUTSIDE
    assert pick_culprit_from_stacks({0: GLOO_WAITING, 1: record}) == 1
    layer = [
        Frame("aten::addmm", "libtorch_cpu.so"),
        Frame("Block.forward", "model.py"),
        Frame("Module._call_impl", "torch/nn/modules/module.py"),
        Frame("FullyShardedDataParallel.forward",
              "torch/distributed/fsdp/fully_sharded_data_parallel.py"),
    ]  # fmt: skip
    assert thread_verdict(layer) == OUTSIDE
    writing = [
        Frame("write", "libc.so.6"),
        Frame("_write_item", "torch/distributed/checkpoint/filesystem.py"),
        Frame("_write_files_from_queue", "torch/distributed/checkpoint/filesystem.py"),
    ]
    gathering = [
        Frame("all_gather_object", "torch/distributed/distributed_c10d.py"),
        Frame("_DistWrapper.all_gather_object", "torch/distributed/checkpoint/utils.py"),
    ]
    assert (thread_verdict(writing), thread_verdict(gathering)) == (OUTSIDE, WAITING)
    saving = [
        Frame("Condition.wait", "threading.py"),
        Frame("Future.result", "concurrent/futures/_base.py"),
        Frame("train_step", "rankguard/trainer/train.py"),
    ]
    assert thread_verdict(saving) == OWN_THREAD


def test_unreadable_or_ambiguous_stacks_name_no_culprit():
    failed = "Error: Failed to find python version from target process"
    assert pick_culprit_from_stacks({0: failed, 1: GLOO_WAITING, 2: DATALOADER}) is None
    assert pick_culprit_from_stacks({0: DATALOADER, 1: STUCK_IN_PYTHON, 2: GLOO_WAITING}) is None
    assert pick_culprit_from_stacks({0: GLOO_WAITING, 1: NCCL_ITEM_NATIVE}) is None


# -- the main thread's own state, in place of the process's CPU -------------------------


def _main(active_at: float, state: str = "R", wchan=None, syscall="running"):
    return MainThreadAnswer(state, 50.0, active_at, 1.0 if state == "R" else 0.0, wchan, syscall)


def _pressured(ranks) -> ClusterObs:
    obs = cluster(*ranks)
    node = dataclasses.replace(obs.nodes[0], telemetry_pressure_age=0.5)
    return dataclasses.replace(obs, nodes=(node,))


def test_records_lost_is_judged_by_the_main_thread_not_the_process():
    """Under socket pressure a silent rank is excused only if its own work ran: a process
    kept busy by its other threads (NCCL's proxy polling) while its main thread sleeps in
    the collective is not (the process's CPU excused it, and the hang went unseen)."""
    polling = [
        dataclasses.replace(r, cpu_active_at=T0 - 1.0,
                            main_thread=_main(T0 - 30.0, "S", "futex_wait_queue", "202"))
        for r in hung(2, age=10.0)
    ]  # fmt: skip
    assert not hang.records_lost_while_busy(T0, polling[0], 0.5)
    (finding,) = hang.detect(_pressured(polling), None, CFG)
    assert finding.evidence["main_threads"]["0"]["wchan"] == "futex_wait_queue"
    working = [dataclasses.replace(r, cpu_active_at=T0 - 30.0, main_thread=_main(T0 - 1.0))
               for r in hung(2, age=10.0)]  # fmt: skip
    assert hang.records_lost_while_busy(T0, working[0], 0.5)
    assert not hang.detect(_pressured(working), None, CFG)  # its records may be lost
    # an agent that does not read the main thread: the process's CPU, as before
    older = [dataclasses.replace(r, cpu_active_at=T0 - 1.0) for r in hung(2, age=10.0)]
    assert not hang.detect(_pressured(older), None, CFG)
