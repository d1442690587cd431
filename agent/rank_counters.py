"""Per-rank counters for rates: steps, tokens, step time (a histogram), phase time, FLOPs.

A 15 s scrape of a last-step gauge sees one step in hundreds; a counter sees them all, and
Prometheus' ``rate()`` turns it into an exact mean over any window (tokens/s, seconds per
step, MFU as FLOPs done over the peak). Pure: fed one timed record at a time by the rank
table (a few additions per record); the cumulative histogram buckets are built at scrape
time, not per record.

The counters live as long as the rank's entry in the table, across process restarts (work
done is work done, replayed steps too). A rank forgotten and seen again starts from zero:
a counter reset, which ``rate()`` handles.
"""

from __future__ import annotations

from bisect import bisect_left

from ..contract.telemetry import SPLIT_FIELDS, TelemetryRecord

#: Upper bounds (seconds) of the step-time histogram: tiny CPU steps to minute-long ones.
STEP_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

#: The phase label of each split field (``data_wait_seconds`` -> ``data_wait``).
PHASE_NAMES: tuple[str, ...] = tuple(f.removesuffix("_seconds") for f in SPLIT_FIELDS)


class RankCounters:
    """Totals over every timed step the agent received from one rank."""

    __slots__ = ("steps", "tokens", "step_seconds", "_buckets", "phase_seconds", "flops",
                 "peak_flops")  # fmt: skip

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0.0
        self.step_seconds = 0.0  # the histogram's sum
        self._buckets = [0] * (len(STEP_BUCKETS) + 1)  # per bucket, not cumulative; last +Inf
        self.phase_seconds = [0.0] * len(SPLIT_FIELDS)
        self.flops: float | None = None  # None until a record carries ``flops``
        self.peak_flops: float | None = None  # the newest record's, a capacity (a gauge)

    def observe(self, r: TelemetryRecord) -> None:
        """Count one record; heartbeats (no timings) count nothing."""
        if r.peak_flops is not None:
            self.peak_flops = r.peak_flops
        if r.step_seconds <= 0:
            return
        self.steps += 1
        # the client sends tokens / step_seconds: this is the step's token count again
        self.tokens += r.tokens_per_second * r.step_seconds
        self.step_seconds += r.step_seconds
        self._buckets[bisect_left(STEP_BUCKETS, r.step_seconds)] += 1
        for i, name in enumerate(SPLIT_FIELDS):
            self.phase_seconds[i] += getattr(r, name)
        if r.flops is not None:
            self.flops = (self.flops or 0.0) + r.flops

    def copy(self) -> RankCounters:
        out = RankCounters()
        out.steps, out.tokens, out.step_seconds = self.steps, self.tokens, self.step_seconds
        out._buckets, out.phase_seconds = list(self._buckets), list(self.phase_seconds)
        out.flops, out.peak_flops = self.flops, self.peak_flops
        return out

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative (le, count) pairs, ``+Inf`` last (equal to ``steps``)."""
        out, total = [], 0
        for bound, n in zip((*map(str, STEP_BUCKETS), "+Inf"), self._buckets, strict=True):
            total += n
            out.append((bound, total))
        return out
