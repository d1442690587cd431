"""The trainer's data pipeline: token datasets, the global sample order, rank slicing.

Two datasets serve fixed-length samples of ``seq_len + 1`` tokens (inputs and
shifted targets come from one window):

- :class:`SyntheticTokens`: an endless-looking, learnable stream generated on the
  fly (a fixed random first-order Markov chain with peaked transitions). Sample ``i``
  is a pure function of ``(seed, i)``.
- :class:`MemmapTokens`: a byte-level corpus written by :func:`prepare_corpus`
  (``rankguard trainer prepare``), memory-mapped from uint8 shards described by an
  ``index.json``.

Data position. There is no data-loader state to save: the position is the number of
global steps consumed; the stream is a pure function of (seed, step).
:class:`GlobalSampler` maps a step to the ``global_batch`` sample indices of that
step (epoch after epoch of a permutation seeded by ``(seed, epoch)``), random access,
so resuming at any step is exact. :func:`rank_slice` cuts a step's global batch into
this rank's micro-batches; because the cut depends only on
``world_size * accum_steps * micro_batch == global_batch``, a resume at another world
size (with accumulation adjusted to keep the global batch) consumes exactly the same
samples at every step.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "VOCAB_SIZE_BYTES",
    "DataError",
    "GlobalSampler",
    "MemmapTokens",
    "StepBatches",
    "StepLoader",
    "SyntheticTokens",
    "collate",
    "prepare_corpus",
    "rank_slice",
]

VOCAB_SIZE_BYTES = 256
FORMAT = "rankguard-tokens"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
DOC_SEPARATOR = b"\x00"

_SHARD_RE = re.compile(r"^shard-\d{5}\.bin$")
_CHUNK = 1 << 20  # bytes read / hashed at a time
_U64 = 1 << 64


class DataError(ValueError):
    """Bad input data: missing files, a corrupt or mismatched corpus, unsafe output dir."""


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _normalize_index(i: Any, n: int) -> int:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
        raise TypeError(f"sample index must be an int, got {type(i).__name__}")
    i = int(i)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"sample index {i} out of range for {n} samples")
    return i


# --------------------------------------------------------------------------- synthetic


class SyntheticTokens:
    """A learnable synthetic token stream: a fixed random first-order Markov chain.

    The chain is derived from ``seed``: every token has ``min(4, vocab_size)``
    distinct likely successors taken with probabilities 0.6/0.25/0.1/0.05, and with
    probability ``noise`` the next token is uniform instead. The entropy rate is
    about 1.7 nats per token, far below ``log(vocab_size)``, so a tiny model's loss
    falls quickly. Sample ``i`` (``seq_len + 1`` tokens) depends only on
    ``(seed, i)``: its random numbers come from a Philox stream keyed by ``seed``
    whose counter block is ``i``.
    """

    _BRANCH_PROBS = (0.6, 0.25, 0.1, 0.05)

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        seed: int,
        num_samples: int = 1_000_000,
        noise: float = 0.05,
    ) -> None:
        self.vocab_size = _check_int("vocab_size", vocab_size, 2)
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.seed = _check_int("seed", seed, 0) % _U64
        self.num_samples = _check_int("num_samples", num_samples, 1)
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"noise must be in [0, 1), got {noise}")
        self.noise = float(noise)

        branches = min(len(self._BRANCH_PROBS), self.vocab_size)
        probs = np.asarray(self._BRANCH_PROBS[:branches], dtype=np.float64)
        probs /= probs.sum()
        # Thresholds over one uniform draw u in [0, 1): searchsorted gives 0 when
        # u < noise (a uniform token), else the successor choice 1..branches.
        cum = np.concatenate([[self.noise], self.noise + (1.0 - self.noise) * np.cumsum(probs)])
        cum[-1] = 2.0  # absorb rounding: u < 1 always lands in the last bucket at most
        self._cum = cum
        table_rng = np.random.Generator(np.random.Philox(key=[self.seed, 0x5EED]))
        # Row t: [unused, successor 1, ..., successor `branches`] of token t.
        self._succ: list[list[int]] = [
            [-1, *table_rng.choice(self.vocab_size, size=branches, replace=False).tolist()]
            for _ in range(self.vocab_size)
        ]

    def __len__(self) -> int:
        return self.num_samples

    def _rng(self, i: int) -> np.random.Generator:
        # The counter's two high words hold the sample index and the low words count
        # blocks within the sample, so distinct samples never share random numbers.
        return np.random.Generator(np.random.Philox(key=self.seed, counter=[0, 0, i, 0]))

    def __getitem__(self, i: int) -> torch.Tensor:
        i = _normalize_index(i, self.num_samples)
        n = self.seq_len + 1
        rng = self._rng(i)
        u = rng.random(n)
        uniform_tokens = rng.integers(0, self.vocab_size, size=n).tolist()
        choice = np.searchsorted(self._cum, u, side="right").tolist()
        succ = self._succ
        out = [0] * n
        t = out[0] = uniform_tokens[0]
        for j in range(1, n):
            c = choice[j]
            t = succ[t][c] if c else uniform_tokens[j]
            out[j] = t
        return torch.tensor(out, dtype=torch.long)

    def __repr__(self) -> str:
        return (
            f"SyntheticTokens(vocab_size={self.vocab_size}, seq_len={self.seq_len}, "
            f"seed={self.seed}, num_samples={self.num_samples})"
        )


# ---------------------------------------------------------------------- preparation


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_previous_token_dir(out_dir: Path) -> tuple[bool, str]:
    """Whether out_dir holds only what prepare_corpus writes (so it may be replaced)."""
    for entry in out_dir.iterdir():
        name = entry.name
        if name == INDEX_NAME:
            try:
                index = json.loads(entry.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                return False, f"{entry} is not a {FORMAT} index"
            if not isinstance(index, dict) or index.get("format") != FORMAT:
                return False, f"{entry} is not a {FORMAT} index"
        elif _SHARD_RE.match(name) or (
            name.endswith(".tmp") and name.startswith(("shard-", "index"))
        ):
            if not entry.is_file():
                return False, f"{entry} is not a regular file"
        else:
            return False, f"unexpected entry {entry.name!r}"
    return True, ""


class _ShardWriter:
    """Writes consecutive shards of at most shard_tokens bytes, each atomically."""

    def __init__(self, out_dir: Path, shard_tokens: int) -> None:
        self.out_dir = out_dir
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._f: Any = None
        self._hash: Any = None
        self._n = 0

    def _open(self) -> None:
        name = _shard_name(len(self.shards))
        self._tmp = self.out_dir / (name + ".tmp")
        self._final = self.out_dir / name
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed in _close
        self._hash = hashlib.sha256()
        self._n = 0

    def _close(self) -> None:
        f = self._f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._f = None
        os.replace(self._tmp, self._final)
        self.shards.append(
            {"file": self._final.name, "tokens": self._n, "sha256": self._hash.hexdigest()}
        )

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while len(view):
            if self._f is None:
                self._open()
            take = min(len(view), self.shard_tokens - self._n)
            part = view[:take]
            self._f.write(part)
            self._hash.update(part)
            self._n += take
            view = view[take:]
            if self._n == self.shard_tokens:
                self._close()

    def finish(self) -> list[dict[str, Any]]:
        if self._f is not None:
            self._close()
        return self.shards

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
            self._tmp.unlink(missing_ok=True)


def prepare_corpus(
    texts: Sequence[Path],
    out_dir: Path,
    shard_tokens: int = 64 * 2**20,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Tokenize text files byte-level into uint8 shards plus an ``index.json``.

    Files are read in order, in chunks, and concatenated with a single 0 byte
    between documents. Each shard holds at most ``shard_tokens`` tokens. Shards and
    the index are written to temporary names, synced and renamed; the index is
    written last, so a directory with an ``index.json`` always describes complete
    shards. ``out_dir`` may be absent, empty, or a previous output of this function
    (which is then replaced); anything else is refused. ``progress(done, total)``
    is called with input bytes read so far. Returns the index dictionary.
    """
    shard_tokens = _check_int("shard_tokens", shard_tokens, 1)
    paths = [Path(p) for p in texts]
    out_dir = Path(out_dir)
    if not paths:
        raise DataError("no input files given")

    sizes: list[int] = []
    for p in paths:
        if not p.exists():
            raise DataError(f"input file not found: {p}")
        if not p.is_file():
            raise DataError(f"input is not a regular file: {p}")
        sizes.append(p.stat().st_size)
    total_bytes = sum(sizes)
    if total_bytes == 0:
        raise DataError("empty corpus: every input file is empty")

    if out_dir.exists():
        if not out_dir.is_dir():
            raise DataError(f"output path exists and is not a directory: {out_dir}")
        ok, why = _is_previous_token_dir(out_dir)
        if not ok:
            raise DataError(
                f"refusing to write into {out_dir}: it is not empty and not a "
                f"{FORMAT} directory ({why})"
            )
        # Drop the old index first: from here on the directory reads as "not prepared"
        # until the new index lands, never as an index over mismatched shards.
        (out_dir / INDEX_NAME).unlink(missing_ok=True)
        _fsync_dir(out_dir)
        old_files = [e for e in out_dir.iterdir() if e.is_file()]
    else:
        out_dir.mkdir(parents=True)
        old_files = []

    writer = _ShardWriter(out_dir, shard_tokens)
    done = 0
    if progress is not None:
        progress(0, total_bytes)
    try:
        for k, p in enumerate(paths):
            if k > 0:
                writer.write(DOC_SEPARATOR)
            with open(p, "rb") as f:
                while chunk := f.read(_CHUNK):
                    writer.write(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total_bytes)
        shards = writer.finish()
    except BaseException:
        writer.abort()
        raise

    total_tokens = sum(s["tokens"] for s in shards)
    if total_tokens == 0 or done == 0:  # the files emptied between stat and read
        raise DataError("empty corpus: no bytes read from the input files")

    keep = {s["file"] for s in shards}
    for old in old_files:
        if old.name not in keep and old.exists():
            old.unlink()

    index = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "vocab_size": VOCAB_SIZE_BYTES,
        "dtype": "uint8",
        "shards": shards,
        "total_tokens": total_tokens,
    }
    tmp = out_dir / (INDEX_NAME + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_dir / INDEX_NAME)
    _fsync_dir(out_dir)
    return index


# --------------------------------------------------------------------------- memmap


def _load_index(data_dir: Path) -> dict[str, Any]:
    path = data_dir / INDEX_NAME
    if not data_dir.is_dir():
        raise DataError(f"data directory not found: {data_dir}")
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(
            f"no {INDEX_NAME} in {data_dir} (not a prepared corpus, or preparation did "
            "not finish; run `rankguard trainer prepare`)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    try:
        index = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DataError(f"corrupt index {path}: invalid JSON ({e})") from None

    def bad(why: str) -> DataError:
        return DataError(f"corrupt index {path}: {why}")

    if not isinstance(index, dict):
        raise bad("not a JSON object")
    if index.get("format") != FORMAT:
        raise bad(f"format is {index.get('format')!r}, expected {FORMAT!r}")
    if index.get("version") != FORMAT_VERSION:
        raise bad(f"unsupported version {index.get('version')!r} (this reader knows 1)")
    if index.get("dtype") != "uint8":
        raise bad(f"dtype is {index.get('dtype')!r}, expected 'uint8'")
    if index.get("vocab_size") != VOCAB_SIZE_BYTES:
        raise bad(f"vocab_size is {index.get('vocab_size')!r}, expected {VOCAB_SIZE_BYTES}")
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise bad("'shards' is not a list")
    seen: set[str] = set()
    for k, s in enumerate(shards):
        if not isinstance(s, dict):
            raise bad(f"shard entry {k} is not an object")
        name, tokens, digest = s.get("file"), s.get("tokens"), s.get("sha256")
        if not isinstance(name, str) or not _SHARD_RE.match(name):
            raise bad(f"shard entry {k} has an invalid file name {name!r}")
        if name in seen:
            raise bad(f"shard file {name} listed twice")
        seen.add(name)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise bad(f"shard {name} has an invalid token count {tokens!r}")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise bad(f"shard {name} has an invalid sha256 {digest!r}")
    total = index.get("total_tokens")
    if total != sum(s["tokens"] for s in shards):
        raise bad(f"total_tokens {total!r} does not equal the sum of the shard sizes")
    return index


class MemmapTokens:
    """A prepared byte-level corpus as non-overlapping windows of ``seq_len + 1`` tokens.

    Opening validates ``index.json`` and checks every shard's size (not its hash:
    call :meth:`verify` for that). Windows never cross a shard boundary; the tail of
    each shard shorter than a window is unused. Shards are memory-mapped read-only,
    lazily per process, so the dataset pickles cheaply into data-loader workers.
    """

    def __init__(self, data_dir: Path, seq_len: int) -> None:
        self.data_dir = Path(data_dir)
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.index = _load_index(self.data_dir)
        self.vocab_size = VOCAB_SIZE_BYTES
        self.total_tokens: int = self.index["total_tokens"]
        window = self.seq_len + 1
        self._files: list[Path] = []
        self._tokens: list[int] = []
        self._starts: list[int] = []  # first global window index of each used shard
        count = 0
        for s in self.index["shards"]:
            path = self.data_dir / s["file"]
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise DataError(f"missing shard {path} (listed in {INDEX_NAME})") from None
            if size != s["tokens"]:
                raise DataError(
                    f"shard {path} has {size} bytes but {INDEX_NAME} says {s['tokens']} "
                    "(truncated or modified)"
                )
            n = s["tokens"] // window
            if n == 0:
                continue
            self._files.append(path)
            self._tokens.append(s["tokens"])
            self._starts.append(count)
            count += n
        if count == 0:
            raise DataError(
                f"corpus in {self.data_dir} has {self.total_tokens} tokens, fewer than one "
                f"window of seq_len + 1 = {window} tokens in any shard"
            )
        self._len = count
        self._maps: list[np.memmap] | None = None

    def __len__(self) -> int:
        return self._len

    def _mmaps(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [
                np.memmap(p, dtype=np.uint8, mode="r", shape=(n,))
                for p, n in zip(self._files, self._tokens, strict=True)
            ]
        return self._maps

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = None
        return state

    def __getitem__(self, i: int) -> torch.Tensor:
        i = _normalize_index(i, self._len)
        k = bisect.bisect_right(self._starts, i) - 1
        window = self.seq_len + 1
        start = (i - self._starts[k]) * window
        arr = np.asarray(self._mmaps()[k][start : start + window], dtype=np.int64)
        return torch.from_numpy(arr)

    def verify(self) -> None:
        """Hash every shard and compare with the index; raise DataError on a mismatch."""
        bad = []
        for s in self.index["shards"]:
            path = self.data_dir / s["file"]
            h = hashlib.sha256()
            try:
                with open(path, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
            except FileNotFoundError:
                raise DataError(f"missing shard {path}") from None
            if h.hexdigest() != s["sha256"]:
                bad.append(s["file"])
        if bad:
            raise DataError(
                f"checksum mismatch in {self.data_dir}: {', '.join(bad)} "
                "(corrupt; prepare the corpus again)"
            )

    def __repr__(self) -> str:
        return f"MemmapTokens({str(self.data_dir)!r}, seq_len={self.seq_len}, windows={self._len})"


# ------------------------------------------------------------------ order and slicing


class GlobalSampler:
    """The global order of samples: epoch after epoch of a seeded permutation.

    Stream position ``p`` is sample ``perm(seed, p // num_samples)[p % num_samples]``;
    step ``s`` uses positions ``[s * global_batch, (s + 1) * global_batch)``. Any step
    can be computed directly, so a resumed run sees exactly the samples an
    uninterrupted run would have. The permutation of each epoch comes from numpy's
    PCG64 seeded with ``(seed, epoch)``; the two most recent are cached.
    """

    _CACHE = 2

    def __init__(self, num_samples: int, global_batch: int, seed: int) -> None:
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.global_batch = _check_int("global_batch", global_batch, 1)
        self.seed = _check_int("seed", seed, 0)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (read-only array)."""
        epoch = _check_int("epoch", epoch, 0)
        perm = self._perms.get(epoch)
        if perm is None:
            rng = np.random.default_rng([self.seed, epoch])
            perm = rng.permutation(self.num_samples)
            perm.flags.writeable = False
            self._perms[epoch] = perm
            while len(self._perms) > self._CACHE:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def epoch(self, step: int) -> float:
        """Epochs completed at the start of ``step`` (fractional)."""
        step = _check_int("step", step, 0)
        return step * self.global_batch / self.num_samples

    def indices(self, step: int) -> list[int]:
        """The ``global_batch`` sample indices of training step ``step`` (0-based)."""
        step = _check_int("step", step, 0)
        pos = step * self.global_batch
        end = pos + self.global_batch
        out: list[int] = []
        while pos < end:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(end - pos, self.num_samples - offset)
            out.extend(self.permutation(epoch)[offset : offset + take].tolist())
            pos += take
        return out


def rank_slice(
    global_indices: Sequence[int],
    rank: int,
    world_size: int,
    accum_steps: int,
    micro_batch: int,
) -> list[list[int]]:
    """This rank's ``accum_steps`` micro-batches of ``micro_batch`` indices.

    Rank ``r`` takes the contiguous block ``[r * accum_steps * micro_batch,
    (r + 1) * accum_steps * micro_batch)`` of the step's global indices, split in order
    into micro-batches. All ranks together cover every index exactly once.
    """
    world_size = _check_int("world_size", world_size, 1)
    accum_steps = _check_int("accum_steps", accum_steps, 1)
    micro_batch = _check_int("micro_batch", micro_batch, 1)
    rank = _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    per_rank = accum_steps * micro_batch
    if len(global_indices) != world_size * per_rank:
        raise ValueError(
            f"global batch of {len(global_indices)} indices does not equal world_size "
            f"{world_size} x accum_steps {accum_steps} x micro_batch {micro_batch} "
            f"= {world_size * per_rank}"
        )
    block = list(global_indices[rank * per_rank : (rank + 1) * per_rank])
    return [block[a * micro_batch : (a + 1) * micro_batch] for a in range(accum_steps)]


def collate(dataset: Any, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``dataset[i]`` for ``indices``; return ``(x[:, :-1], x[:, 1:])`` as int64."""
    if len(indices) == 0:
        raise ValueError("collate needs at least one index")
    x = torch.stack([dataset[int(i)] for i in indices]).to(torch.long)
    return x[:, :-1], x[:, 1:]


# ------------------------------------------------------------------------ loading


class StepBatches:
    """Map-style: item ``step`` is this rank's micro-batches of training step ``step``,
    collated on the CPU. What a DataLoader worker runs (so it pickles: the dataset's
    memory maps are reopened in each worker).

    ``faults`` (the rank's FaultInjector, or None) may slow the load of a step down: the
    ``data-stall`` fault, in the process that loads, as a slow filesystem would.
    """

    def __init__(
        self,
        dataset: Any,
        sampler: GlobalSampler,
        rank: int,
        world_size: int,
        accum_steps: int,
        micro_batch: int,
        faults: Any = None,
    ) -> None:
        self.dataset, self.sampler, self.faults = dataset, sampler, faults
        self.rank, self.world_size = rank, world_size
        self.accum_steps, self.micro_batch = accum_steps, micro_batch

    def __getitem__(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.faults is not None:
            delay = self.faults.data_stall(step)
            if delay:
                time.sleep(delay)
        micro = rank_slice(
            self.sampler.indices(step - 1), self.rank, self.world_size, self.accum_steps,
            self.micro_batch,
        )  # fmt: skip
        return [collate(self.dataset, idx) for idx in micro]


class StepLoader:
    """``next()`` gives the batches of data steps ``steps`` in order: loaded in this
    process when ``workers`` is 0, else by a ``torch.utils.data.DataLoader`` with that
    many worker processes, each loading whole steps ahead of the loop (``prefetch``
    steps per worker). The loop's data wait is the time blocked in ``next()``."""

    def __init__(
        self, batches: StepBatches, steps: Sequence[int], workers: int = 0, *,
        prefetch: int = 2, pin_memory: bool = False,
    ) -> None:  # fmt: skip
        self.batches, self.workers = batches, workers
        if workers == 0 or not steps:
            self._it = (batches[s] for s in steps)
            self._loader = None
            return
        from torch.utils.data import DataLoader

        self._loader = DataLoader(
            batches,  # type: ignore[arg-type]
            batch_size=None,  # an item is already a step's batches
            sampler=steps,
            num_workers=workers,
            prefetch_factor=prefetch,
            pin_memory=pin_memory,
        )
        self._it = iter(self._loader)

    def __iter__(self) -> StepLoader:
        return self

    def __next__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return next(self._it)

    def close(self) -> None:
        """Stop the worker processes now (they also end with this process)."""
        it, self._it = self._it, iter(())
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
