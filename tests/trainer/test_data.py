"""The trainer's data pipeline: datasets, corpus preparation, global order, rank slices."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rankguard.cli.main import build
from rankguard.trainer.data import (
    VOCAB_SIZE_BYTES,
    DataError,
    GlobalSampler,
    MemmapTokens,
    SyntheticTokens,
    collate,
    prepare_corpus,
    rank_slice,
)

cli_app = build()

# ----------------------------------------------------------------------------- helpers


def bigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Empirical H(next | current) in nats."""
    pairs = tokens[:-1] * vocab_size + tokens[1:]
    counts = np.bincount(pairs, minlength=vocab_size * vocab_size).reshape(vocab_size, -1)
    row = counts.sum(axis=1, keepdims=True)
    p = np.where(counts > 0, counts / np.maximum(row, 1), 1.0)
    return float(-(counts * np.log(p)).sum() / counts.sum())


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[list[Path], bytes]:
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 256, size=n, dtype=np.uint8).tobytes() for n in (1000, 37, 2500)]
    files = [write(tmp_path / f"doc{k}.txt", d) for k, d in enumerate(docs)]
    return files, b"\x00".join(docs)


def read_all(data_dir: Path) -> bytes:
    index = json.loads((data_dir / "index.json").read_text())
    return b"".join((data_dir / s["file"]).read_bytes() for s in index["shards"])


# -------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic_across_instances_and_order():
    a = SyntheticTokens(vocab_size=256, seq_len=64, seed=3)
    b = SyntheticTokens(vocab_size=256, seq_len=64, seed=3)
    forward = [a[i] for i in range(50)]
    backward = [b[i] for i in reversed(range(50))][::-1]
    for x, y in zip(forward, backward, strict=True):
        assert x.dtype == torch.long and x.shape == (65,)
        assert torch.equal(x, y)
    assert torch.equal(a[999_999], b[-1])
    # Different seeds and different indices give different samples.
    c = SyntheticTokens(vocab_size=256, seq_len=64, seed=4)
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0], a[1])
    assert len(a) == 1_000_000


def test_synthetic_bounds_and_range():
    d = SyntheticTokens(vocab_size=50, seq_len=16, seed=0, num_samples=10)
    assert len(d) == 10
    for i in range(10):
        x = d[i]
        assert int(x.min()) >= 0 and int(x.max()) < 50
    with pytest.raises(IndexError):
        d[10]
    with pytest.raises(IndexError):
        d[-11]
    with pytest.raises(ValueError):
        SyntheticTokens(vocab_size=1, seq_len=16, seed=0)


def test_synthetic_is_learnable():
    d = SyntheticTokens(vocab_size=VOCAB_SIZE_BYTES, seq_len=128, seed=11)
    tokens = np.concatenate([d[i].numpy() for i in range(2000)])
    h = bigram_entropy(tokens, VOCAB_SIZE_BYTES)
    # Uniform tokens would be log(256) = 5.55 nats; the chain's true rate is ~1.5.
    assert h < 2.2 < math.log(VOCAB_SIZE_BYTES)
    # And it is not degenerate: every token value shows up.
    assert len(np.unique(tokens)) == VOCAB_SIZE_BYTES


def test_synthetic_small_vocab_no_noise():
    d = SyntheticTokens(vocab_size=2, seq_len=32, seed=5, noise=0.0)
    for i in range(20):
        x = d[i]
        assert set(x.tolist()) <= {0, 1}


# ------------------------------------------------------------------ prepare + memmap


def test_prepare_memmap_round_trip(tmp_path: Path, corpus):
    files, expected = corpus
    out = tmp_path / "tok"
    calls: list[tuple[int, int]] = []
    index = prepare_corpus(files, out, progress=lambda d, t: calls.append((d, t)))
    assert index == json.loads((out / "index.json").read_text())
    assert index["format"] == "rankguard-tokens" and index["version"] == 1
    assert index["vocab_size"] == 256 and index["dtype"] == "uint8"
    assert index["total_tokens"] == len(expected)
    assert read_all(out) == expected
    total = sum(f.stat().st_size for f in files)
    assert calls[-1] == (total, total)
    assert all(t == total for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert not list(out.glob("*.tmp"))

    seq_len = 31
    ds = MemmapTokens(out, seq_len=seq_len)
    assert len(ds) == len(expected) // (seq_len + 1)
    got = b"".join(bytes(ds[i].to(torch.uint8).tolist()) for i in range(len(ds)))
    assert got == expected[: len(ds) * (seq_len + 1)]
    assert ds[0].dtype == torch.long
    ds.verify()


def test_prepare_shard_boundaries(tmp_path: Path, corpus):
    files, expected = corpus
    out = tmp_path / "tok"
    index = prepare_corpus(files, out, shard_tokens=100)
    sizes = [s["tokens"] for s in index["shards"]]
    assert all(n == 100 for n in sizes[:-1]) and 0 < sizes[-1] <= 100
    assert [s["file"] for s in index["shards"]][:2] == ["shard-00000.bin", "shard-00001.bin"]
    assert read_all(out) == expected

    # Windows of 30 tokens: 3 per full 100-token shard, never crossing a boundary.
    ds = MemmapTokens(out, seq_len=29)
    assert len(ds) == sum(n // 30 for n in sizes)
    k = 0
    for s, n in zip(index["shards"], sizes, strict=True):
        shard = (out / s["file"]).read_bytes()
        for w in range(n // 30):
            assert bytes(ds[k].to(torch.uint8).tolist()) == shard[w * 30 : (w + 1) * 30]
            k += 1
    assert k == len(ds)


def test_prepare_replaces_previous_output(tmp_path: Path, corpus):
    files, _ = corpus
    out = tmp_path / "tok"
    prepare_corpus(files, out, shard_tokens=100)
    small = write(tmp_path / "small.txt", b"abc")
    index = prepare_corpus([small], out, shard_tokens=100)
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "shard-00000.bin"]
    assert index["total_tokens"] == 3 and read_all(out) == b"abc"


def test_prepare_errors(tmp_path: Path, corpus):
    files, _ = corpus
    with pytest.raises(DataError, match="not found.*missing.txt"):
        prepare_corpus([files[0], tmp_path / "missing.txt"], tmp_path / "o1")
    assert not (tmp_path / "o1").exists()  # nothing written before inputs are checked
    empty = write(tmp_path / "empty.txt", b"")
    with pytest.raises(DataError, match="empty corpus"):
        prepare_corpus([empty, empty], tmp_path / "o2")
    with pytest.raises(DataError, match="no input"):
        prepare_corpus([], tmp_path / "o3")
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    write(unrelated / "notes.md", b"keep me")
    with pytest.raises(DataError, match="refusing.*notes.md"):
        prepare_corpus(files, unrelated)
    assert (unrelated / "notes.md").read_bytes() == b"keep me"
    assert sorted(p.name for p in unrelated.iterdir()) == ["notes.md"]
    foreign_index = tmp_path / "foreign"
    foreign_index.mkdir()
    write(foreign_index / "index.json", b'{"format": "something-else"}')
    with pytest.raises(DataError, match="refusing"):
        prepare_corpus(files, foreign_index)
    with pytest.raises(DataError, match="not a directory"):
        prepare_corpus(files, files[0])


@pytest.fixture
def prepared(tmp_path: Path, corpus) -> Path:
    files, _ = corpus
    out = tmp_path / "tok"
    prepare_corpus(files, out, shard_tokens=1000)
    return out


def test_memmap_missing_index(tmp_path: Path, prepared: Path):
    (prepared / "index.json").unlink()
    with pytest.raises(DataError, match="no index.json"):
        MemmapTokens(prepared, seq_len=15)
    with pytest.raises(DataError, match="not found"):
        MemmapTokens(tmp_path / "nowhere", seq_len=15)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda ix: "{not json", "invalid JSON"),
        (lambda ix: [], "not a JSON object"),
        (lambda ix: {**ix, "format": "other"}, "format"),
        (lambda ix: {**ix, "version": 2}, "unsupported version"),
        (lambda ix: {**ix, "total_tokens": ix["total_tokens"] + 1}, "total_tokens"),
        (lambda ix: {**ix, "shards": "x"}, "'shards' is not a list"),
        (
            lambda ix: {**ix, "shards": [{**ix["shards"][0], "file": "../etc/passwd"}]},
            "invalid file name",
        ),
        (
            lambda ix: {**ix, "shards": [{**ix["shards"][0], "tokens": -1}, *ix["shards"][1:]]},
            "invalid token count",
        ),
    ],
)
def test_memmap_corrupt_index(prepared: Path, mutate, message):
    path = prepared / "index.json"
    new = mutate(json.loads(path.read_text()))
    path.write_text(new if isinstance(new, str) else json.dumps(new))
    with pytest.raises(DataError, match=message):
        MemmapTokens(prepared, seq_len=15)


def test_memmap_truncated_and_missing_shard(prepared: Path):
    shard = prepared / "shard-00001.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1])
    with pytest.raises(DataError, match="shard-00001.bin has 999 bytes but index.json says 1000"):
        MemmapTokens(prepared, seq_len=15)
    shard.unlink()
    with pytest.raises(DataError, match="missing shard .*shard-00001.bin"):
        MemmapTokens(prepared, seq_len=15)


def test_memmap_verify_catches_flipped_byte(prepared: Path):
    ds = MemmapTokens(prepared, seq_len=15)
    ds.verify()
    shard = prepared / "shard-00002.bin"
    data = bytearray(shard.read_bytes())
    data[123] ^= 0xFF
    shard.write_bytes(bytes(data))
    ds = MemmapTokens(prepared, seq_len=15)  # same size: opening does not notice
    with pytest.raises(DataError, match="checksum mismatch.*shard-00002.bin"):
        ds.verify()


def test_memmap_too_small_for_a_window(tmp_path: Path):
    out = tmp_path / "tok"
    prepare_corpus([write(tmp_path / "a.txt", b"x" * 40)], out, shard_tokens=20)
    assert len(MemmapTokens(out, seq_len=19)) == 2
    with pytest.raises(DataError, match="fewer than one window"):
        MemmapTokens(out, seq_len=20)  # 40 tokens, but no 21-token window fits a shard


def test_memmap_pickles_without_mapping(prepared: Path):
    import pickle

    ds = MemmapTokens(prepared, seq_len=15)
    first = ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 10_000
    assert torch.equal(clone[0], first)


# ----------------------------------------------------------------------------- sampler


def test_sampler_resume_exact():
    s = GlobalSampler(num_samples=103, global_batch=16, seed=1)
    sequential = [s.indices(step) for step in range(40)]  # crosses several epochs
    for step in (0, 6, 7, 13, 39, 25):
        assert GlobalSampler(103, 16, 1).indices(step) == sequential[step]
    assert all(len(b) == 16 for b in sequential)


def test_sampler_epochs_are_permutations_and_seeds_differ():
    n, b = 120, 8
    s = GlobalSampler(n, b, seed=2)
    stream = [i for step in range(3 * n // b) for i in s.indices(step)]
    epochs = [stream[k * n : (k + 1) * n] for k in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(n))
    assert epochs[0] != epochs[1]
    assert GlobalSampler(n, b, seed=3).indices(0) != s.indices(0)


def test_sampler_batch_larger_than_dataset():
    s = GlobalSampler(num_samples=5, global_batch=12, seed=0)
    stream = s.indices(0) + s.indices(1) + s.indices(2) + s.indices(3) + s.indices(4)
    for k in range(12):
        assert sorted(stream[5 * k : 5 * k + 5]) == list(range(5))


def test_sampler_large_is_cheap():
    s = GlobalSampler(num_samples=1_000_000, global_batch=512, seed=0)
    batch = s.indices(123_456)  # epoch 63
    assert len(set(batch)) == 512 and all(0 <= i < 1_000_000 for i in batch)
    assert s.indices(123_456) == batch


@settings(max_examples=40, deadline=None)
@given(
    num_samples=st.integers(1, 60),
    global_batch=st.integers(1, 40),
    seed=st.integers(0, 2**32),
    step=st.integers(0, 30),
)
def test_sampler_matches_stream_definition(num_samples, global_batch, seed, step):
    s = GlobalSampler(num_samples, global_batch, seed)
    positions = range(step * global_batch, (step + 1) * global_batch)
    expected = [
        int(
            np.random.default_rng([seed, p // num_samples]).permutation(num_samples)[
                p % num_samples
            ]
        )
        for p in positions
    ]
    assert s.indices(step) == expected


# --------------------------------------------------------------------------- slicing


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_slice_covers_once(world_size):
    accum, micro = 3, 2
    g = list(range(100, 100 + world_size * accum * micro))
    seen = []
    for r in range(world_size):
        mbs = rank_slice(g, r, world_size, accum, micro)
        assert len(mbs) == accum and all(len(mb) == micro for mb in mbs)
        block = [i for mb in mbs for i in mb]
        assert block == g[r * accum * micro : (r + 1) * accum * micro]
        seen += block
    assert sorted(seen) == g


def test_rank_slice_keeps_global_batch_across_world_sizes():
    g = GlobalSampler(1000, 16, seed=9).indices(5)
    two = [i for r in range(2) for mb in rank_slice(g, r, 2, 2, 4) for i in mb]
    one = [i for mb in rank_slice(g, 0, 1, 4, 4) for i in mb]
    four = [i for r in range(4) for mb in rank_slice(g, r, 4, 1, 4) for i in mb]
    assert sorted(two) == sorted(one) == sorted(four) == sorted(g)


@settings(max_examples=50, deadline=None)
@given(
    world_size=st.integers(1, 8),
    accum=st.integers(1, 4),
    micro=st.integers(1, 4),
)
def test_rank_slice_partition_property(world_size, accum, micro):
    g = list(range(world_size * accum * micro))
    parts = [rank_slice(g, r, world_size, accum, micro) for r in range(world_size)]
    flat = [i for p in parts for mb in p for i in mb]
    assert flat == g


def test_rank_slice_errors():
    with pytest.raises(ValueError, match="does not equal"):
        rank_slice(list(range(15)), 0, 2, 2, 4)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        rank_slice(list(range(16)), 2, 2, 2, 4)


def test_collate():
    d = SyntheticTokens(vocab_size=256, seq_len=8, seed=0, num_samples=100)
    x, y = collate(d, [3, 1, 4])
    assert x.shape == y.shape == (3, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[0], d[3][:-1]) and torch.equal(y[0], d[3][1:])
    assert torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError):
        collate(d, [])


# ------------------------------------------------------------------------------- CLI


def test_cli_prepare_success_and_json(tmp_path: Path, corpus):
    files, expected = corpus
    runner = CliRunner()
    out = tmp_path / "tok"
    args = ["trainer", "prepare", *map(str, files), "--out", str(out), "--shard-tokens", "1000"]
    res = runner.invoke(cli_app, args)
    assert res.exit_code == 0, res.output
    assert "4 shards" in res.stdout and str(out) in res.stdout
    assert "100%" in res.stderr
    res = runner.invoke(cli_app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["total_tokens"] == len(expected) and len(doc["shards"]) == 4
    assert doc["out_dir"] == str(out)
    assert read_all(out) == expected


def test_cli_prepare_errors(tmp_path: Path, corpus):
    files, _ = corpus
    runner = CliRunner()
    res = runner.invoke(
        cli_app, ["trainer", "prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")]
    )
    assert res.exit_code == 2
    assert res.stderr.strip() == f"error: input file not found: {tmp_path / 'nope.txt'}"
    assert "Traceback" not in res.output
    (tmp_path / "o2").mkdir()
    write(tmp_path / "o2" / "x", b"")
    res = runner.invoke(
        cli_app, ["trainer", "prepare", str(files[0]), "--out", str(tmp_path / "o2")]
    )
    assert res.exit_code == 2 and "refusing" in res.stderr


def test_cli_does_not_import_torch():
    code = "import sys, rankguard.cli.main; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    )
    assert out.stdout.strip() == "False"
