"""Shared builders for the tests: literal observations for the supervisor's pure parts, a
supervisor's /metrics read in process, and checkpoints made through the real write path.
(Fixtures live in conftest.py; processes and HTTP helpers in harness.py.)"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest

from rankguard.client import checkpoint_store as cs
from rankguard.client.checkpoint_store import FileEntry
from rankguard.contract import ContractError
from rankguard.contract.errors import REASONS
from rankguard.supervisor.detectors import DetectorConfig
from rankguard.supervisor.reconcile import Supervisor
from rankguard.supervisor.state import ClusterObs, NodeObs, RankObs, StepSample
from rankguard.supervisor.views import make_registry

# -- literal observations (supervisor detectors and lifecycle) ------------------------------

T0 = 1_700_000_000.0


CFG = DetectorConfig()


def telemetry_fields(**overrides) -> dict:
    """A valid telemetry record's fields, sent now by this process (rank 0 of job "llama"
    training at step 10); `overrides` replace or add fields."""
    f = dict(
        v=1, job="llama", rank=0, local_rank=0, world_size=4, pid=os.getpid(), restart=0,
        step=10, phase="train", time=time.time(), step_seconds=2.0, data_wait_seconds=0.1,
        compute_seconds=1.2, comm_seconds=0.5, comm_exposed_seconds=0.2,
        optimizer_seconds=0.1, checkpoint_block_seconds=0.0, tokens_per_second=1000.0,
        mfu=0.4, peak_memory_bytes=2**30, loss=2.5, checkpoint_step=None,
    )  # fmt: skip
    f.update(overrides)
    return f


# A child process that registers as rank 1 of job "j" (its own pid, step 7) with one
# telemetry record to the socket in argv[1] and prints "sent"; tests append what it does next.
STEP_RECORD_CHILD = """
import os, sys, time
from rankguard.client import TelemetrySender
from rankguard.contract.telemetry import SCHEMA_VERSION
sender = TelemetrySender(sys.argv[1])
rec = dict(v=SCHEMA_VERSION, job="j", rank=1, local_rank=1, world_size=2, pid=os.getpid(),
           restart=0, step=7, phase="train", time=time.time(), step_seconds=0.5,
           data_wait_seconds=0.01, compute_seconds=0.3, comm_seconds=0.1,
           comm_exposed_seconds=0.05, optimizer_seconds=0.05, checkpoint_block_seconds=0.0,
           tokens_per_second=1000.0, mfu=0.4, peak_memory_bytes=10**9, loss=2.5,
           checkpoint_step=5)
assert sender.send(rec)
print("sent", flush=True)
"""


class FakeClock:
    """A clock the test sets (`t`), for code that takes one."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def sample(step, *, restart=0, phase="train", seconds=0.1, compute=0.07, comm=0.02, loss=3.0):
    return StepSample(step, phase, restart, seconds, compute, comm, 0.001, loss)


def samples(first, last, **kw):
    return tuple(sample(s, **kw) for s in range(first, last + 1))


def rank(
    r,
    *,
    job="j",
    node="n0",
    restart=0,
    state="alive",
    step=10,
    phase="train",
    age=0.05,
    exited_at=None,
    loss=3.0,
    ckpt=None,
    cpu=None,
    recent=(),
    world=2,
    script_step=None,
):
    return RankObs(
        node=node, job=job, rank=r, world_size=world, pid=1000 + 100 * restart + r,
        restart=restart, state=state, step=step, phase=phase, heartbeat_age_seconds=age,
        exited_at=exited_at, step_seconds=0.1, compute_seconds=0.07, comm_seconds=0.02,
        comm_compute_ratio=0.3, loss=loss, checkpoint_step=ckpt, cpu_utilization=cpu,
        recent=tuple(recent), script_step=script_step,
    )  # fmt: skip


def nodeobs(*ranks, name="n0", url=None, reasons=(), at=T0, status="healthy"):
    return NodeObs(
        node=name, url=url or f"http://{name}:9400", reachable=True, observed_at=at,
        status=status, reasons=tuple(reasons), ranks=tuple(ranks),
    )  # fmt: skip


def cluster(*ranks, time=T0, nodes=()):
    return ClusterObs(time=time, nodes=((nodeobs(*ranks, at=time),) if ranks else ()) + nodes)


def trained(n=2, *, steps=30, **kw):
    """A healthy job: n ranks at step `steps`, each with its timed samples."""
    return [rank(r, step=steps, recent=samples(max(1, steps - 63), steps), **kw) for r in range(n)]


def hung(n=2, *, age=10.0, steps=30, **kw):
    return [
        dataclasses.replace(r, heartbeat_age_seconds=age) for r in trained(n, steps=steps, **kw)
    ]


# -- a supervisor's own /metrics and observation, in process -------------------------------


def sup_metric(sup: Supervisor, line_start: str) -> float:
    text = generate_latest(make_registry(sup)).decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(line_start)]  # fmt: skip
    assert values, f"{line_start} not on /metrics"
    return sum(values)


def node_of(sup: Supervisor, url: str):
    return next(n for n in sup.last_obs.nodes if n.url == url)


# -- checkpoints through the real write path ------------------------------------------------


def make_ckpt(root: Path, step: int, world_size: int = 2, size: int = 4096) -> Path:
    """A fake DCP checkpoint through the real write path: partial_dir, per-rank hash_file
    (entries sent to rank 0 as JSON), commit."""
    partial = cs.partial_dir(root, step)
    (partial / ".metadata").write_bytes(os.urandom(64))
    wire: list[str] = []
    for rank in range(world_size):
        data = partial / f"__{rank}_0.distcp"
        data.write_bytes(os.urandom(size))
        state = partial / f"trainer-state-rank{rank}.pt"
        state.write_bytes(os.urandom(100 + rank))
        wire += [json.dumps(cs.hash_file(p).to_dict()) for p in (data, state)]
    wire.append(json.dumps(cs.hash_file(partial / ".metadata").to_dict()))
    entries = [FileEntry.from_dict(json.loads(w)) for w in wire]
    return cs.commit(partial, step, world_size, entries, {"loss": 2.5, "tokens": step * 1000})


# The property tests' budget: enough examples to find a counterexample, no per-example deadline.
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def flip_byte(path: Path, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# Any JSON value, for the property tests that feed hostile input to a parser.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)

# Smaller JSON values without NaN, for the property tests whose input goes over the wire.
json_values_without_nan = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)  # fmt: skip


def break_one_field(data, obj: dict) -> tuple[str, object]:
    """Replace one field of `obj`, drawn by hypothesis' `data`, by a JSON value of another
    type; (the field's name, the value put there)."""
    name = data.draw(st.sampled_from(sorted(obj)))
    value = data.draw(json_values.filter(lambda v: type(v) is not type(obj[name])))
    obj[name] = value
    return name, value


def set_at(obj, path: tuple, value) -> None:
    """Put `value` at `path` (keys and list indices, outermost first) inside `obj`."""
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def assert_only_contract_errors(model, value) -> None:
    """`model.from_json` on any JSON value returns or raises a ContractError with a known
    reason, never another exception."""
    try:
        model.from_json(value)
    except ContractError as e:
        assert e.reason in REASONS


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A tmpfs of our own at `path` (skips without root): filling it touches nothing else."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
