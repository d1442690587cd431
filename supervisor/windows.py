"""One node's step-sample windows, kept between polls and fed by incremental reads.

The supervisor asks an agent `GET /v1/ranks?after=<cursor>` (contract/cursor.py) and gets,
per rank, only the samples numbered above the cursor, plus `recent_from`: the number of
the oldest sample still in the agent's window. Merging is then exact, whatever happened
between two polls: keep what we hold from `recent_from` on, append what is new, so every
rank's window equals the one a full read would have returned (a property test checks
this against random histories). That also covers a rank's process being replaced (the
agent keeps its window across restarts, and so do we) and a rank forgotten and
registered again (its new samples are numbered above everything we hold).

A `"full": true` answer (first read, agent restarted, cursor not accepted) replaces every
window. An agent without cursors ignores `after` and answers in full without `cursor`:
its samples are taken as they are and the next read asks from the start again.

Not thread-safe: the Poller never polls one node twice at once, so one thread at a time
touches a node's windows.
"""

from __future__ import annotations

from bisect import bisect_left

from ..contract.answers import RankAnswer, RanksAnswer
from ..contract.cursor import START
from .state import StepSample

DEPTH = 64  # samples per rank, as the agent keeps (agent/ranks.py RankTable.recent)

Key = tuple[str, int]


class NodeWindows:
    def __init__(self, depth: int = DEPTH):
        self.depth = depth
        self.cursor: str | None = None  # None: the next read asks for everything
        # (job, rank) -> (sample numbers, samples), oldest first, at most `depth` each
        self._windows: dict[Key, tuple[list[int], list[StepSample]]] = {}
        self.full_reads = 0  # answers that replaced every window, for tests and logs
        self._shown: dict[Key, tuple[StepSample, ...]] = {}  # the windows last returned

    @property
    def after(self) -> str:
        return self.cursor or START

    def reset(self) -> None:
        self.cursor = None
        self._windows.clear()
        self._shown = {}

    def merge(self, answer: RanksAnswer) -> dict[Key, tuple[StepSample, ...]] | None:
        """Fold one /v1/ranks answer (already checked by the contract) in; each rank's
        merged window, or None for a legacy answer (its `recent` is the whole window)."""
        cursor = answer.cursor
        if cursor is None:
            self.reset()
            return None
        full = answer.full
        held = {} if full else self._windows
        windows: dict[Key, tuple[list[int], list[StepSample]]] = {}
        out: dict[Key, tuple[StepSample, ...]] = {}
        shown = {} if full else self._shown
        for r in answer.ranks:
            key = (r.job, r.rank)
            seqs, samples = self._merge_rank(held.get(key), r)
            windows[key] = (seqs, samples)
            # the same window object while nothing changed: the detectors' per-window
            # caches (detectors/common.py samples_of) then carry over between passes
            before = shown.get(key)
            out[key] = before if _same(before, samples) else tuple(samples)
        self._windows = windows  # a rank the agent no longer shows is dropped
        self._shown = out
        self.cursor = cursor
        self.full_reads += full
        return out

    def _merge_rank(
        self, held: tuple[list[int], list[StepSample]] | None, r: RankAnswer
    ) -> tuple[list[int], list[StepSample]]:
        first = r.recent_from
        if first is None:  # the agent's window is empty
            return [], []
        seqs, samples = ([], []) if held is None else held
        keep = bisect_left(seqs, first)  # older samples left the agent's window
        seqs, samples = seqs[keep:], samples[keep:]
        newest = seqs[-1] if seqs else -1
        for s in r.recent:
            seq = s.seq if s.seq is not None else -1
            if seq > newest:  # never twice, never out of order
                seqs.append(seq)
                samples.append(StepSample.of(s))
                newest = seq
        if len(seqs) > self.depth:
            del seqs[: -self.depth], samples[: -self.depth]
        return seqs, samples


def _same(before: tuple[StepSample, ...] | None, samples: list[StepSample]) -> bool:
    """Whether a window is unchanged: merging only trims the front and appends new sample
    objects, so the same length, first and last object mean the same window."""
    if before is None or len(before) != len(samples):
        return False
    return not samples or (before[0] is samples[0] and before[-1] is samples[-1])
