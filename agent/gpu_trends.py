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
from dataclasses import dataclass, field


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


@dataclass
class _Series:
    """One GPU's signal: its newest sample, and (for a counter) the rises still in the
    window, each with the time of the sample it rose from. Only rises are kept, so a
    quiet counter costs nothing however long the window (was: every sample, summed again
    at each collection)."""

    last: tuple[float, float] | None = None  # (time, value) of the newest sample
    rises: deque[tuple[float, float]] = field(default_factory=deque)


class Trends:
    """Each GPU's signals over the window."""

    def __init__(self, window: float = WINDOW_SECONDS) -> None:
        self.window = window
        self._series: dict[str, dict[str, _Series]] = {}
        self._cutoff: dict[str, float] = {}  # per GPU: samples before it left the window

    def observe(self, gpu: str, t: float, values: Mapping[str, float | None]) -> None:
        """One collection's values of `gpu` (a None or missing value: not read this time)."""
        series = self._series.setdefault(gpu, {})
        cutoff = self._cutoff[gpu] = t - self.window
        for s in SIGNALS:
            v = values.get(s.name)
            one = series.setdefault(s.name, _Series())
            if isinstance(v, (int, float)):
                v = float(v)
                # a reset to zero is no fall to count; the pair counts while its earlier
                # sample is in the window
                if s.counter and one.last is not None and v > one.last[1]:
                    one.rises.append((one.last[0], v - one.last[1]))
                one.last = (t, v)
            while one.rises and one.rises[0][0] < cutoff:
                one.rises.popleft()

    def forget(self, keep: set[str]) -> None:
        """Drop the GPUs not in `keep` (gone from the node)."""
        for gpu in set(self._series) - keep:
            del self._series[gpu], self._cutoff[gpu]

    def over(self, gpu: str) -> list[tuple[Signal, float]]:
        """The signals of `gpu` over their limits, with their values."""
        series, cutoff = self._series.get(gpu, {}), self._cutoff.get(gpu, 0.0)
        out = []
        for s in SIGNALS:
            one = series.get(s.name)
            if one is None or one.last is None or one.last[0] < cutoff:
                continue  # no sample in the window
            value = sum(r for _, r in one.rises) if s.counter else one.last[1]
            if value >= s.limit:
                out.append((s, value))
        return out

    def failing(self) -> dict[str, list[tuple[Signal, float]]]:
        """The GPUs with at least FAILING_SIGNALS signals over their limits."""
        return {
            g: over for g in sorted(self._series) if len(over := self.over(g)) >= FAILING_SIGNALS
        }


def describe(over: list[tuple[Signal, float]], window: float = WINDOW_SECONDS) -> str:
    """The signals in words, for the health reason's message."""
    parts = [f"{value:g} {s.what}" for s, value in over]
    return f"{', '.join(parts)} (limits per {window / 60:g} min)"
