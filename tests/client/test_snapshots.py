"""Tier 0: the snapshot holder (store, wire, replication) and exact resume across tiers.

The unit tests run holders as threads on real unix sockets; the slow ones run two real
holder processes (A replicates to B, as two nodes would) beside real torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import read_json, run_ok, torchrun

from rankguard.agent.snapshot_holder import LOCAL, REPLICA, Held, HolderServer, SnapshotStore
from rankguard.client.snapshots import SnapshotClient, common_steps
from rankguard.contract import snapshots as wire
from rankguard.trainer.config import ConfigError, config_from_args


def _held(step: int, rank: int, local_world: int = 2, kind: str = LOCAL) -> Held:
    data = f"{step}/{rank}".encode() * 10
    return Held("j", step, rank, 2, local_world, wire.checksum(data), data, kind)


# -- the store (pure) -------------------------------------------------------------------
def test_store_keeps_newest_steps_and_the_newest_complete_one():
    s = SnapshotStore()
    for step in (10, 20):
        for rank in (0, 1):
            s.put(_held(step, rank), keep=2)
    assert s.put(_held(30, 0), keep=2) == [10]  # 30 is partial: 20 stays as newest complete
    # partial 40 and 50: 20 (newest complete) is never pushed out: at most keep + 1 steps
    assert s.put(_held(40, 0), keep=2) == []
    assert s.put(_held(50, 0), keep=2) == [30]
    assert [(e.step, e.complete) for e in s.status()["snapshots"]] == [
        (20, True),
        (40, False),
        (50, False),
    ]
    s.put(_held(50, 1), keep=2)  # 50 complete: 20 is no longer needed
    assert [e.step for e in s.status()["snapshots"]] == [40, 50]
    assert [e["step"] for e in s.listing("j", 1, 2)] == [50]
    assert s.listing("j", 1, 4) == []  # another world size: not offered
    assert s.truncate("j", 40) == 1 and [e["step"] for e in s.listing("j", 0, 2)] == [40]


def test_store_corrupt_changes_bytes_not_checksum():
    s = SnapshotStore()
    s.put(_held(5, 0), keep=2)
    before = s.get("j", 5, 0)
    assert s.corrupt("j", 5, 0, LOCAL) and not s.corrupt("j", 5, 0, REPLICA)
    after = s.get("j", 5, 0)
    assert after.checksum == before.checksum and wire.checksum(after.data) != after.checksum


def _put_fresh(s: SnapshotStore, step: int, size: int = 4096) -> int:
    """Put a one-rank snapshot in a new buffer that nothing else references; its id."""
    data = bytearray(size)
    data[:8] = step.to_bytes(8, "big")
    s.put(Held("j", step, 0, 1, 1, "x", data), keep=1)
    return id(data)


def test_dropped_snapshots_buffers_are_received_into_again_unless_still_read():
    s = SnapshotStore()
    first = _put_fresh(s, 10)
    _put_fresh(s, 20)  # 10 evicted: nothing reads it, its buffer is a spare
    assert s.status()["spare_bytes"] == 4096
    assert s.spare(100) is None  # another size: a new buffer
    buf = s.spare(4096)
    assert id(buf) == first and s.reused == 1 and s.status()["spare_bytes"] == 0
    # a reader that took step 20 before it was dropped keeps its bytes: no spare
    reader = s.get("j", 20, 0)
    _put_fresh(s, 30)
    assert s.spare(4096) is None and reader.data[:8] == (20).to_bytes(8, "big")
    # truncated steps give their buffers too; bytes (not receivable into) never do
    _put_fresh(s, 40)  # 30 evicted, a spare
    assert s.truncate("j", 0) == 1 and s.status()["spare_bytes"] == 2 * 4096
    s.put(Held("j", 50, 0, 1, 1, "x", bytes(4096)), keep=1)
    s.truncate("j", 0)
    assert s.status()["spare_bytes"] == 2 * 4096
    # a snapshot a few bytes off (a rank's trainer state varies) is received into one too
    assert len(s.spare(4000)) == 4000 and len(s.spare(4100)) == 4100 and s.reused == 3


def test_common_steps_needs_every_rank():
    assert common_steps([[10, 20, 30], [20, 30], [10, 30]]) == [30]
    assert common_steps([[10], []]) == []


def test_usable_steps_take_the_union_of_the_ranks_views():
    from rankguard.client.snapshots import source_rank, usable_steps

    # 3 saved ranks; saved rank 1 (a lost node's) only as a replica that rank 1 can reach
    views = [{40: {3: [0, 2]}, 30: {3: [0, 1, 2]}}, {40: {3: [1, 2]}}]
    assert usable_steps(views, 2) == [(40, 3), (30, 3)]
    assert usable_steps([{40: {3: [0, 2]}}], 2) == []  # saved rank 1 nowhere: not usable
    # a step saved at two world sizes: the current one first
    assert usable_steps([{50: {2: [0, 1], 3: [0, 1, 2]}}], 2) == [(50, 2)]
    assert usable_steps([{50: {2: [0, 1], 3: [0, 1, 2]}}], 4) == [(50, 3)]
    assert [source_rank(r, 2, 3) for r in (0, 1)] == [0, 1]
    assert [source_rank(r, 4, 2) for r in range(4)] == [0, 1, 0, 1]
    assert source_rank(2, 3, 3) == 2


def test_serialize_round_trip_is_exact_and_data_only():
    import collections
    import pickle

    import torch

    from rankguard.client.snapshots import _HEAD, MAGIC, deserialize, serialize

    state = {"model": collections.OrderedDict(w=torch.randn(3, 4), b=torch.arange(5)),
             "optim": {"state": {0: {"step": torch.tensor(7.0), "m": torch.randn(2)}},
                       "param_groups": [{"betas": (0.9, 0.95), "fused": None, "params": [0]}]},
             "trainer": {"rng": torch.get_rng_state(), "empty": torch.empty(0, 3),
                         "half": torch.randn(4).bfloat16(), "loss": float("nan")}}  # fmt: skip
    back = deserialize(serialize(state))
    assert isinstance(back["model"], collections.OrderedDict)
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert (
        back["model"]["b"].dtype == torch.int64 and back["trainer"]["half"].dtype == torch.bfloat16
    )
    assert torch.equal(back["trainer"]["half"], state["trainer"]["half"])
    assert torch.equal(back["trainer"]["rng"], state["trainer"]["rng"])
    assert back["trainer"]["empty"].shape == (0, 3) and back["optim"]["param_groups"][0][
        "betas"
    ] == (0.9, 0.95)
    assert back["optim"]["state"][0]["step"].item() == 7.0
    evil = pickle.dumps({"x": print})  # a global other than OrderedDict: refused
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        deserialize(MAGIC + _HEAD.pack(len(evil)) + evil)
    with pytest.raises(ValueError, match="not a rankguard snapshot"):
        deserialize(b"PK\x03\x04" + bytes(100))
    data = serialize(state)
    with pytest.raises((ValueError, RuntimeError)):
        deserialize(data[: len(data) - 8])  # truncated payload


def test_a_spare_buffer_of_the_same_size_is_refilled_in_place():
    import torch

    from rankguard.client.snapshots import deserialize, serialize

    first = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    spare = serialize(first)
    second = {"w": torch.arange(1000, dtype=torch.float32) * 2, "step": 2}
    out = serialize(second, reuse=spare)
    assert out is spare  # no new buffer: the old bytes are all overwritten
    back = deserialize(out)
    assert torch.equal(back["w"], second["w"]) and back["step"] == 2
    # another size (an optimizer's state appeared): a new buffer, the spare left alone
    bigger = {"w": torch.zeros(2000), "step": 3}
    out = serialize(bigger, reuse=spare)
    assert out is not spare and len(out) > len(spare)
    assert torch.equal(deserialize(spare)["w"], second["w"])


def test_the_gpu_paths_host_buffer_is_filled_sent_and_refilled_in_place(tmp_path, monkeypatch):
    """A GPU state is staged in a page-locked `host_buffer` (a memoryview over a torch
    tensor). No CUDA here: the same path, with the buffer's pinning left out, round-trips,
    is refilled in place, checksums and is held by a real holder as the bytes it was."""
    import functools

    import torch

    from rankguard.client import snapshots

    monkeypatch.setattr(snapshots, "_pinned_staging", lambda devices: True)
    monkeypatch.setattr(snapshots, "_pinning_failed", False)
    monkeypatch.setattr(snapshots, "host_buffer",
                        functools.partial(snapshots.host_buffer, pinned=False))  # fmt: skip
    state = {"w": torch.randn(300, 7), "b": torch.arange(9), "step": 1}
    out = snapshots.serialize(state)
    assert isinstance(out, memoryview) and snapshots._staging_of(out) is not None
    assert bytes(out) == bytes(snapshots.serialize(state, reuse=bytearray(len(out))))
    back = snapshots.deserialize(out)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    again = snapshots.serialize({**state, "w": state["w"] * 2, "step": 2}, reuse=out)
    assert again is out and torch.equal(snapshots.deserialize(out)["w"], state["w"] * 2)
    assert snapshots.serialize({"w": torch.zeros(5)}, reuse=out) is not out  # another size
    holder, addr = _serve(tmp_path, "a")
    try:
        client = SnapshotClient(addr, (), "j", 0, 1, 1, keep=2)
        client.save(2, out)
        client.wait()
        data, _ = client.fetch(2, client.candidates()[2])
        client.close()
    finally:
        holder.shutdown()
    assert data == bytes(out) and client.failures == 0


def test_a_failed_pinned_allocation_falls_back_to_pageable_memory(monkeypatch, caplog):
    import torch

    from rankguard.client import snapshots

    monkeypatch.setattr(snapshots, "_pinned_staging", lambda devices: True)
    monkeypatch.setattr(snapshots, "_pinning_failed", False)
    calls = []

    def no_locked_memory(size, pinned=True):
        calls.append(size)
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(snapshots, "host_buffer", no_locked_memory)
    state = {"w": torch.randn(50)}
    for _ in range(2):
        out = snapshots.serialize(state)
        assert isinstance(out, bytearray)
        assert torch.equal(snapshots.deserialize(out)["w"], state["w"])
    assert len(calls) == 1  # not tried again
    assert "pageable memory" in caplog.text and "out of memory" in caplog.text


@pytest.mark.gpu
def test_a_gpu_state_is_staged_in_pinned_memory_and_round_trips():
    import torch

    from rankguard.client.snapshots import _staging_of, deserialize, serialize

    dev = torch.device("cuda", 0)
    state = {"w": torch.randn(1024, 1024, device=dev), "h": torch.randn(64, device=dev).half(),
             "cpu": torch.arange(4), "step": 3}  # fmt: skip
    out = serialize(state)
    assert _staging_of(out).is_pinned()
    back = deserialize(out)
    assert torch.equal(back["w"], state["w"].cpu()) and torch.equal(back["h"], state["h"].cpu())
    assert torch.equal(back["cpu"], state["cpu"]) and back["step"] == 3
    state["w"].mul_(2)  # the next step's state, into the same buffer
    assert serialize(state, reuse=out) is out
    assert torch.equal(deserialize(out)["w"], state["w"].cpu())


def test_restored_model_and_optimizer_continue_bit_identically():
    """A GPT and its AdamW restored from a snapshot take the next step exactly as the
    originals do (what exact resume from tier 0 rests on)."""
    import torch

    from rankguard.client.snapshots import deserialize, serialize
    from rankguard.trainer.model import GPT

    cfg = config_from_args(["--preset", "tiny"], environ={})

    def build():
        torch.manual_seed(0)
        m = GPT(cfg.model)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    def step(m, opt, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=g)
        m(x, x).backward()
        opt.step()
        opt.zero_grad()

    m, opt = build()
    for seed in range(3):
        step(m, opt, seed)
    data = serialize({"model": m.state_dict(), "optim": opt.state_dict()})
    snap = deserialize(data)
    # the tied embedding and output weights are stored once, and both names load from it
    tied, untied = m.tok_emb.weight, m.state_dict()
    untied["head.weight"] = tied.detach().clone()  # the same values, in memory of its own
    grown = len(serialize({"model": untied, "optim": opt.state_dict()})) - len(data)
    assert 0 <= grown - tied.numel() * tied.element_size() < 100  # and a reference's bytes
    assert torch.equal(snap["model"]["head.weight"], snap["model"]["tok_emb.weight"])
    m2, opt2 = build()
    m2.load_state_dict(snap["model"])
    opt2.load_state_dict(snap["optim"])
    step(m, opt, 3)
    step(m2, opt2, 3)
    for (name, a), b in zip(m.state_dict().items(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_state_split_in_parts_restores_whole_and_bit_identically():
    """DDP: the ranks of a node each snapshot a part of the model and optimizer state they
    all hold; the parts, each serialized alone, put back together load and continue
    exactly, and each part holds about its share of the bytes."""
    import torch

    from rankguard.client.snapshots import deserialize, serialize
    from rankguard.trainer.model import GPT
    from rankguard.trainer.snapshots import merge_replicated, part_owners, split_replicated

    assert part_owners([5, 1, 4, 2, 3], 2) == [0, 0, 1, 0, 1]  # 8 and 7 bytes
    assert part_owners([3, 3], 4) == [0, 1]
    cfg = config_from_args(["--preset", "tiny"], environ={})
    torch.manual_seed(0)
    m = GPT(cfg.model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    m(x, x).backward()
    opt.step()
    opt.zero_grad()
    whole = serialize({"model": m.state_dict(), "optim": opt.state_dict(), "trainer": {}})
    parts = []
    for index in range(3):
        model, optim = split_replicated(m.state_dict(), opt.state_dict(), index, 3)
        assert ("tok_emb.weight" in model) == ("head.weight" in model)  # tied: one part
        data = serialize({"model": model, "optim": optim, "trainer": {"rank": index}})
        assert len(data) < len(whole) / 2  # a third of the tensors' bytes, and the structure
        parts.append(deserialize(data))
    merged = merge_replicated([parts[1], parts[0], parts[2]])
    assert merged["trainer"] == {"rank": 1}  # the caller's own part comes first
    assert list(merged["model"]) != list(m.state_dict())  # in part order, not the model's...
    torch.manual_seed(1)
    m2 = GPT(cfg.model)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    m2.load_state_dict(merged["model"])  # ...which loading does not mind
    opt2.load_state_dict(merged["optim"])
    for model, optim in ((m, opt), (m2, opt2)):
        model(x, x).backward()
        optim.step()
    for (name, a), b in zip(m.state_dict().items(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert opt.state_dict()["state"].keys() == opt2.state_dict()["state"].keys()


def test_config_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="needs a holder"):
        config_from_args(["--snapshot-every", "5"], environ={})
    with pytest.raises(ConfigError, match="HOST:PORT"):
        config_from_args(["--snapshot-every", "5", "--snapshot-holder", "nohost"], environ={})
    with pytest.raises(ConfigError, match="keep"):
        config_from_args(["--snapshot-keep", "0"], environ={})
    env = {
        "RANKGUARD_SNAPSHOT_HOLDER": "/tmp/a.sock",
        "RANKGUARD_SNAPSHOT_PEERS": "h2:7000,h3:7000",
    }
    with pytest.raises(ConfigError, match="needs the snapshot token"):  # peers on TCP
        config_from_args(["--snapshot-every", "3"], environ=env)
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        config_from_args(
            ["--snapshot-every", "3", "--snapshot-token-file", str(token)], environ=env
        )
    token.chmod(0o600)
    cfg = config_from_args(["--snapshot-every", "3"],
                           environ={**env, "RANKGUARD_SNAPSHOT_TOKEN_FILE": str(token)})  # fmt: skip
    assert cfg.snapshot.holder == "/tmp/a.sock" and cfg.snapshot.peers == ("h2:7000", "h3:7000")
    assert cfg.snapshot.token_file == token


# -- holders on real sockets (threads) ----------------------------------------------------
def _serve(tmp: Path, name: str, peer: str | None = None) -> tuple[HolderServer, str]:
    path = str(tmp / f"{name}.sock")
    server = HolderServer(path, peer=peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, path


def _wait(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_replication_and_verified_fetch(tmp_path):
    b, b_path = _serve(tmp_path, "b")
    a, a_path = _serve(tmp_path, "a", peer=b_path)
    try:
        clients = [SnapshotClient(a_path, (), "j", r, 2, 2, keep=2) for r in (0, 1)]
        for step in (4, 8, 12):
            for c in clients:
                c.save(step, f"state {step} rank {c.rank}".encode() * 1000)
        for c in clients:
            c.close()
        # every local snapshot is forwarded once; on a loaded machine a send the peer does
        # not take in time is dropped, not retried (the next snapshot is newer)
        _wait(lambda: (r := a.status()["replication"])["sent"] + r["dropped"] == 6)
        assert a.status()["replication"]["sent"] >= 2 and b.replicator is None
        # memory bounded by keep: 2 steps of 2 ranks each, locally and as replicas
        assert [e.step for e in a.store.status()["snapshots"]] == [8, 12]
        assert [e.kind for e in b.store.status()["snapshots"]] == [REPLICA, REPLICA]
        c = SnapshotClient(a_path, (), "j", 1, 2, 2, keep=2)
        cands = c.candidates()  # the local holder names its peer: both are searched
        assert sorted(cands) == [8, 12] and [s[1] for s in cands[12]] == [LOCAL, REPLICA]
        assert c.fetch(12, cands[12]) == (b"state 12 rank 1" * 1000, "holder")
        a.store.corrupt("j", 12, 1, LOCAL)  # refused; the peer's replica is used
        data, where = c.fetch(12, cands[12])
        assert data == b"state 12 rank 1" * 1000 and where == f"replica@{b_path}"
        b.store.corrupt("j", 12, 1, REPLICA)
        assert c.fetch(12, cands[12]) is None
        c.truncate(8)  # replicated to the peer in order
        _wait(lambda: [e["step"] for e in b.store.listing("j", 1, 2)] == [8])
        assert [e["step"] for e in a.store.listing("j", 1, 2)] == [8]
    finally:
        a.shutdown()
        b.shutdown()


def test_holders_receive_into_dropped_buffers_and_serve_the_new_bytes(tmp_path):
    b, b_path = _serve(tmp_path, "b")
    a, a_path = _serve(tmp_path, "a", peer=b_path)
    try:
        c = SnapshotClient(a_path, (b_path,), "j", 0, 1, 1, keep=1)
        for step in (10, 20, 30, 40):  # the same size each time
            c.save(step, f"state {step}".encode() * 5000)
            c.wait()
            _wait(lambda: a.replicator.pending() == 0)
        _wait(lambda: (r := a.status()["replication"])["sent"] + r["dropped"] == 4)
        assert a.store.reused >= 2 and b.store.reused >= 1  # b: when its replicas came
        cands = c.candidates()
        assert sorted(cands) == [40] and [s[1] for s in cands[40]] == [LOCAL, REPLICA]
        assert c.fetch(40, cands[40]) == (b"state 40" * 5000, "holder")
        a.store.corrupt("j", 40, 0, LOCAL)
        assert c.fetch(40, cands[40]) == (b"state 40" * 5000, f"replica@{b_path}")
        c.close()
    finally:
        a.shutdown()
        b.shutdown()


def test_malformed_requests_are_refused_not_fatal(tmp_path):
    a, a_path = _serve(tmp_path, "a")
    try:
        with pytest.raises(wire.WireError, match="unknown op"):
            wire.request(a_path, {"op": "drop-everything"})
        # Refused on the header: the holder answers without reading the payload, which is
        # larger than the socket's buffer, so the client's send breaks and the reason is
        # still what it shows.
        with pytest.raises(wire.WireError, match="step"):
            wire.request(a_path, {"op": "put", "job": "j", "step": -1, "rank": 0, "world": 1,
                                  "local_world": 1, "keep": 2, "checksum": "x"},
                         b"x" * (16 << 20))  # fmt: skip
        with pytest.raises(wire.WireError, match="no such snapshot"):
            wire.request(a_path, {"op": "get", "job": "j", "step": 1, "rank": 0})
        with wire.connect(a_path) as sock:  # a header that is not JSON
            sock.sendall(b"\x00\x00\x00\x03abc")
            answer, _ = wire.recv_frame(sock)
        assert not answer["ok"] and "JSON" in answer["error"]
        assert wire.request(a_path, {"op": "status"})[0]["refused"]["malformed"] == 1
        assert oct(os.stat(a_path).st_mode & 0o777) == "0o600"
    finally:
        a.shutdown()


def test_client_survives_an_absent_holder(tmp_path):
    c = SnapshotClient(str(tmp_path / "none.sock"), (), "j", 0, 1, 1, keep=2)
    c.save(1, b"x" * 100)
    c.close()
    assert c.failures == 1 and c.candidates() == {}


def test_cli_status_and_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rankguard.cli.main", "snapshot-holder",
                           "status", "--socket", str(tmp_path / "none.sock")],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "not answering" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "rankguard.cli.main", "snapshot-holder", "run",
                           "--socket", str(tmp_path / "a.sock"), "--peer", "nohost"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "HOST:PORT" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "rankguard.cli.main", "snapshot-holder", "run",
                           "--socket", str(tmp_path / "a.sock"), "--bind", "127.0.0.1:7999"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "needs --token-file" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- real holder processes beside real torchrun ---------------------------------------------
class Holders:
    """Holder A (the node's own) replicating to holder B (the peer node's), as processes."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.a, self.b = str(tmp / "holder-a.sock"), str(tmp / "holder-b.sock")
        self.procs: dict[str, subprocess.Popen] = {}
        self.start()

    def _start(self, name: str, path: str, peer: str | None) -> None:
        args = ["snapshot-holder", "run", "--socket", path] + (["--peer", peer] if peer else [])
        with open(self.tmp / f"holder-{name}.log", "a") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "rankguard.cli.main", *args], stdout=log, stderr=log
            )
        _wait(lambda: self._up(path), 30)

    @staticmethod
    def _up(path: str) -> bool:
        try:
            wire.request(path, {"op": "status"}, timeout=1)
            return True
        except (OSError, EOFError):
            return False

    def start(self) -> None:
        self._start("b", self.b, None)
        self._start("a", self.a, self.b)

    def status(self, path: str) -> dict:
        return wire.request(path, {"op": "status"})[0]

    def kill(self, name: str) -> None:
        p = self.procs.pop(name)
        p.send_signal(signal.SIGKILL)
        p.wait()

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name)


@pytest.fixture
def holders(tmp_path):
    h = Holders(tmp_path)
    yield h
    h.stop()


def _args(tmp: Path, holders: Holders, *extra: str) -> list[str]:
    return ["--steps", "40", "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", "10",
            "--snapshot-every", "5", "--snapshot-holder", holders.a, "--job", "snapjob",
            "--summary", str(tmp / "s.json"), *extra]  # fmt: skip


def _crash_at_29(tmp: Path, holders: Holders) -> None:
    """A run that dies at step 29 (no restart; four steps after snapshot 25, so under load it has landed): snapshot 25 held in A and replicated to B."""
    proc = torchrun(_args(tmp, holders, "--fault", "crash:step=29:rank=1"), cwd=tmp)
    assert proc.returncode != 0 and "exitcode: -9" in proc.stderr
    _wait(lambda: any(e["step"] == 25 and e["complete"]
                      for e in holders.status(holders.b)["snapshots"]))  # fmt: skip


@pytest.mark.slow
def test_tier0_exact_resume_after_sigkill(tmp_path, holders, clean_40):
    run_ok(_args(tmp_path, holders, "--fault", "crash:step=29:rank=1"), cwd=tmp_path,
           max_restarts=1)  # fmt: skip
    s = read_json(tmp_path / "s.json")
    assert s["restart_count"] == 1 and s["resumed_from"] == 25  # not the disk's 20
    assert s["resume_source"] == "holder" and s["snapshot_send_failures"] == 0
    # where the blocking went: CPU states are staged in a bytearray
    assert s["snapshot_staging"] == "pageable" and s["snapshot_wait_seconds"] >= 0
    assert s["snapshot_first_serialize_seconds"] > 0 and s["snapshot_steady_serialize_seconds"] > 0
    assert s["param_digest"] == clean_40["param_digest"]
    assert s["final_loss"] == clean_40["final_loss"]
    st = holders.status(holders.a)
    assert [e["step"] for e in st["snapshots"]] == [35, 40]  # bounded by --snapshot-keep 2
    assert st["bytes"] == sum(e["bytes"] for e in st["snapshots"]) > 0
    # the two ranks (DDP: the same model and optimizer state) each held a part: a step is
    # about one state (weights, tied ones once, and AdamW's two moments), not two
    from rankguard.trainer.model import GPT

    model = GPT(config_from_args(["--preset", "tiny"], environ={}).model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    state_bytes = 3 * params + sum(b.numel() * b.element_size() for b in model.buffers())
    assert state_bytes < st["snapshots"][0]["bytes"] < 1.3 * state_bytes, (st, state_bytes)


@pytest.mark.slow
def test_node_loss_resumes_from_the_peer_replica(tmp_path, holders, clean_40):
    _crash_at_29(tmp_path, holders)
    holders.kill("a")  # the node's holder is gone with its memory
    run_ok(_args(tmp_path, holders, "--snapshot-peers", holders.b), cwd=tmp_path)
    s = read_json(tmp_path / "s.json")
    assert s["resumed_from"] == 25 and s["resume_source"] == f"replica@{holders.b}"
    assert s["param_digest"] == clean_40["param_digest"]


@pytest.mark.slow
def test_corrupt_snapshots_are_refused(tmp_path, holders, clean_40):
    _crash_at_29(tmp_path, holders)
    ask = {"op": "corrupt", "job": "snapjob", "step": 25, "rank": 1}
    wire.request(holders.a, {**ask, "kind": "local"})
    wire.request(holders.b, {**ask, "kind": "replica"})  # no good copy of rank 1's step 25
    wire.request(holders.a, {**ask, "rank": 0, "kind": "local"})
    run_ok(_args(tmp_path, holders), cwd=tmp_path)
    s = read_json(tmp_path / "s.json")
    # step 25 refused (rank 1 has no verifying copy); step 20: tier 0 and disk tie, tier 0 wins
    assert s["resumed_from"] == 20 and s["resume_source"] == "holder"
    assert s["param_digest"] == clean_40["param_digest"]


@pytest.mark.slow
def test_tier1_exact_resume_with_tier0_wiped(tmp_path, holders, clean_40):
    _crash_at_29(tmp_path, holders)
    holders.stop()
    holders.start()  # fresh, empty holders
    run_ok(_args(tmp_path, holders), cwd=tmp_path)
    s = read_json(tmp_path / "s.json")
    assert s["resumed_from"] == 20 and s["resume_source"] == "disk"
    assert s["param_digest"] == clean_40["param_digest"]


@pytest.mark.slow
def test_up_with_snapshots_resumes_from_the_holder(tmp_path):
    """`rankguard up --snapshot-every 5`: two holders (A replicating to B), the trainer
    killed at step 33 resumes from snapshot 30, not from the disk's step 20."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rankguard.cli.main", "up", "--steps", "40", "--ckpt-every", "20",
         "--snapshot-every", "5", "--run-dir", str(run),
         "--trainer-arg=--fault=crash:step=33:rank=1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["restart_count"] == 1 and s["resumed_from"] == 30
    assert s["resume_source"] == "holder" and s["final_step"] == 40
    assert {"holder-a.log", "holder-b.log"} <= set(os.listdir(run))


@pytest.mark.slow
def test_fsdp2_tier0_exact_resume(tmp_path, holders):
    """FSDP2 (fully_shard, gloo on CPU): each rank snapshots its own shards (the DTensors'
    local tensors) and a SIGKILLed run resumes from them bit-identically to the
    uninterrupted FSDP run (same world size: shards are per rank)."""
    args = ["--steps", "12", "--fsdp", "--snapshot-every", "5", "--snapshot-holder", holders.a]
    run_ok([*args, "--job", "fsdp-clean", "--summary", str(tmp_path / "clean.json")],
           cwd=tmp_path)  # fmt: skip
    run_ok([*args, "--job", "fsdp", "--summary", str(tmp_path / "s.json"),
            "--fault", "crash:step=8:rank=1"], cwd=tmp_path, max_restarts=1)  # fmt: skip
    clean, s = read_json(tmp_path / "clean.json"), read_json(tmp_path / "s.json")
    assert s["restart_count"] == 1 and s["resumed_from"] == 5 and s["resume_source"] == "holder"
    assert s["resume_sources"] == ["holder", "holder"]
    assert s["param_digest"] == clean["param_digest"] and s["final_step"] == 12
