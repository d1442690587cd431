"""Whether a GPU is failing before it crashes the job: the trends of its error counters.

A GPU on its way out shows it first in counters that do not stop training: correctable
ECC errors piling up, row remaps pending, XIDs that only ask to be watched (a remap
recorded, a high single-bit rate), NVLink and PCIe replays, time held back by thermal
limits. Each signal below has a limit over the last `WINDOW_SECONDS`: for a counter its
increase (a GPU reset that zeroes it counts nothing), for a level its newest value. A GPU
with `FAILING_SIGNALS` signals over their limits at once is failing (health reason
`gpu_failing`, degraded: the node still works); one noisy counter alone never is. The
supervisor acts on it only with predictive drain on (docs/configuration.md).

Pure: fed each collection's values per GPU, no I/O, no clock of its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Signal:
    name: str
    what: str
    limit: float  # over the window
    counter: bool  # True: its increase over the window; False: its newest level


SIGNALS = (
    Signal("ecc_corrected", "new correctable ECC errors", 100, True),
    Signal("remap_pending", "row remaps pending", 1, False),
    Signal("xid_watch", "XIDs to watch (row remap recorded, single-bit ECC rate)", 2, False),
    Signal("nvlink_replay", "new NVLink replays", 1000, True),
    Signal("pcie_replay", "new PCIe replays", 100, True),
    Signal("thermal_violation", "seconds held back by thermal limits", 60, True),
)
WINDOW_SECONDS = 600.0
FAILING_SIGNALS = 2


class Trends:
    """Each GPU's samples of the signals over the window."""

    def __init__(self, window: float = WINDOW_SECONDS) -> None:
        self.window = window
        self._samples: dict[str, deque[tuple[float, dict[str, float]]]] = {}

    def observe(self, gpu: str, t: float, values: Mapping[str, float | None]) -> None:
        """One collection's values of `gpu` (a None or missing value: not read this time)."""
        kept = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        samples = self._samples.setdefault(gpu, deque())
        samples.append((t, kept))
        while samples and samples[0][0] < t - self.window:
            samples.popleft()

    def forget(self, keep: set[str]) -> None:
        """Drop the GPUs not in `keep` (gone from the node)."""
        for gpu in set(self._samples) - keep:
            del self._samples[gpu]

    def over(self, gpu: str) -> list[tuple[Signal, float]]:
        """The signals of `gpu` over their limits, with their values."""
        samples = self._samples.get(gpu, ())
        out = []
        for s in SIGNALS:
            series = [v[s.name] for _, v in samples if s.name in v]
            if not series:
                continue
            value = _increase(series) if s.counter else series[-1]
            if value >= s.limit:
                out.append((s, value))
        return out

    def failing(self) -> dict[str, list[tuple[Signal, float]]]:
        """The GPUs with at least FAILING_SIGNALS signals over their limits."""
        return {
            g: over for g in sorted(self._samples) if len(over := self.over(g)) >= FAILING_SIGNALS
        }


def _increase(series: list[float]) -> float:
    """A counter's increase: the sum of its rises (a reset to zero is no fall to count)."""
    return sum(max(0.0, b - a) for a, b in zip(series, series[1:], strict=False))


def describe(over: list[tuple[Signal, float]], window: float = WINDOW_SECONDS) -> str:
    """The signals in words, for the health reason's message."""
    parts = [f"{value:g} {s.what}" for s, value in over]
    return f"{', '.join(parts)} (limits per {window / 60:g} min)"
