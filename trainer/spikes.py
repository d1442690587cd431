"""Loss spikes, trainer side: never validate a spiked state, and skip the data before it.

A rollback replays the same data (the stream is a pure function of (seed, step)), so a
spike caused by the data recurs at the same place until the crash-loop guard stops the
job. So, on a spike at data step D (this rank's loss far above its recent losses, the
supervisor's own rule: `max(median + 10 MAD, 2 x median)` over at least 20 losses):

1. the rank appends D to `CKPT/spikes.jsonl` (fsynced: the restart reads it);
2. no checkpoint is taken for the rest of the incarnation (all ranks agree at each save),
   so the newest validated checkpoint predates the spike, and the supervisor's
   BAD_NUMERICS policy (a spike after the newest checkpoint: kill a rank) rolls back to it;
3. at the resume, every spike in the file past the checkpoint's data position skips the
   `--spike-skip-batches` W data steps D-W+1..D: training step t then reads the t-th data
   step not skipped. The skips are saved in every later checkpoint, so a later resume
   keeps the same mapping.

Pure functions apart from the file helpers.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

SPIKES_FILE = "spikes.jsonl"
MADS, MIN_RATIO, MIN_SAMPLES = 10.0, 2.0, 20  # the supervisor's [detectors.numerics] defaults
HISTORY = 64  # losses kept to judge the next one (the supervisor's window depth)


def is_spike(history: Sequence[float], loss: float) -> bool:
    """A finite loss far above the recent ones (NaN/Inf are handled as bad numerics)."""
    finite = sorted(x for x in history if math.isfinite(x))
    if len(finite) < MIN_SAMPLES or not math.isfinite(loss):
        return False
    med = _median(finite)
    spread = _median(sorted(abs(x - med) for x in finite))
    return loss > max(med + MADS * spread, MIN_RATIO * med)


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def window(spike_data_step: int, skip: int, after: int) -> list[int]:
    """The data steps a spike at `spike_data_step` skips: the `skip` up to and including
    it, those already trained (at or before data step `after`) excepted."""
    return [d for d in range(spike_data_step - skip + 1, spike_data_step + 1) if d > after]


def data_step(step: int, skips: Sequence[int]) -> int:
    """The data step training step `step` reads: the `step`-th one not in `skips`."""
    d = step
    for k in sorted(skips):
        if k <= d:
            d += 1
        else:
            break
    return d


def plan_skips(
    saved: Iterable[int], spikes: Iterable[int], skip: int, resumed_step: int
) -> list[int]:
    """Skips after a resume at training step `resumed_step`: those the checkpoint saved,
    plus the window of every recorded spike past the checkpoint's data position."""
    saved = sorted(set(saved))
    position = data_step(resumed_step, saved) if resumed_step else 0
    out = set(saved)
    for d in spikes:
        if d > position:
            out.update(window(d, skip, position))
    return sorted(out)


def record_spike(root: Path, data_step_: int, step: int, loss: float, rank: int) -> None:
    line = json.dumps({"data_step": data_step_, "step": step, "loss": loss, "rank": rank})
    fd = os.open(root / SPIKES_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        # a leading newline ends a line a crash tore, so this record stays whole
        os.write(fd, ("\n" + line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_spikes(root: Path) -> list[int]:
    """The data steps of the recorded spikes; a torn or foreign line is skipped."""
    try:
        text = (root / SPIKES_FILE).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for line in text.splitlines():
        try:
            d = json.loads(line)["data_step"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(d, int) and not isinstance(d, bool) and d > 0:
            out.append(d)
    return out
