"""Training ranks on this node: process state and the step telemetry they send.

Renders one :class:`~..ranks.RankTable` snapshot (taken after a ``refresh()``) and the
receiver's counters. Per-rank series carry ``training_job`` and ``rank``; known label values
(states, phases, reject reasons) are pre-created at 0 so panels never read "No data".
Without a table (the generic registry builds collectors from a context alone) it
reports no ranks, only zeroed node-level series.
"""

from __future__ import annotations

from typing import Any

from ...contract.answers import RankAnswer
from ...contract.metrics import CLIENT_ERRORS, RANK_INFO, RANK_UP, REASON_LABEL
from ...contract.states import RANK_STATES
from ...contract.telemetry import PHASES, SPLIT_FIELDS
from ..rank_counters import PHASE_NAMES, RankCounters
from ..ranks import RankTable
from ..receiver import RECEIVER_REASONS, TelemetryReceiver
from . import (
    RANK_LABELS,
    Collector,
    CollectorContext,
    CollectorResult,
    CollectorSettings,
    Metric,
    counter,
    gauge,
    histogram,
    info,
    register,
)

RANK = RANK_LABELS

# rankguard_rank_<name>: (snapshot key, help). Omitted for a rank while the key is None.
# Gauges only where a gauge is the honest shape (a position, an age, a level); what the
# rank does per step (steps, tokens, step time, FLOPs) is counted (rank_counters.py), so
# rate() sees every step and not the one a scrape happens to catch.
_PER_RANK_GAUGES = (
    ("step", "step", "Newest step the rank reported."),
    ("heartbeat_age_seconds", "heartbeat_age_seconds",
     "Seconds since the agent last received a record from the rank."),
    ("last_heartbeat_timestamp_seconds", "last_heartbeat_at",
     "Unix time the agent last received a record from the rank."),
    ("comm_compute_ratio", "comm_compute_ratio",
     "Communication time over compute time of the last timed step (may exceed 1)."),
    ("loss", "loss", "Newest training loss the rank reported (NaN when it diverged)."),
    ("peak_memory_bytes", "peak_memory_bytes", "Peak accelerator memory of the rank."),
    ("checkpoint_step", "checkpoint_step", "Step of the newest validated checkpoint the rank knows."),
    ("restarts", "restart", "Restart count of the rank's worker group, as the rank reports it."),
)  # fmt: skip


@register
class RanksCollector(Collector):
    name = "ranks"

    def __init__(
        self,
        ctx: CollectorContext,
        config: CollectorSettings | None = None,
        *,
        table: RankTable | None = None,
        receiver: TelemetryReceiver | None = None,
    ) -> None:
        super().__init__(ctx, config)
        # the agent's, from the context; a test may hand its own
        self.table = table if table is not None else ctx.rank_table
        self.receiver = receiver if receiver is not None else ctx.receiver

    def collect(self) -> CollectorResult:
        ranks: list[RankAnswer] = []
        counts = dict.fromkeys(RANK_STATES, 0)
        if self.table is not None:
            self.table.refresh()
            ranks = self.table.answers(recent=0)
            for r in ranks:
                counts[r.state] += 1
        stats = self.receiver.stats() if self.receiver is not None else None
        metrics = rank_metrics(ranks) + node_metrics(counts, stats)
        if self.table is not None:
            metrics += counter_metrics(self.table.counters())
        facts: dict[str, Any] = {"ranks": counts, "receiver": stats}
        if self.table is not None:
            facts["table"] = self.table.stats()
        return CollectorResult(metrics=metrics, facts=facts)


def rank_metrics(ranks: list[RankAnswer]) -> list[Metric]:
    """Per-rank families from the table's answers."""
    p = "rankguard_rank_"
    rank_info = info(RANK_INFO, "Identity of a training rank on this node.",
                     (*RANK_LABELS, "local_rank", "world_size", "pid"))  # fmt: skip
    up = gauge(RANK_UP, "1 while the rank's process is alive or stopped, 0 once it is gone.", RANK)
    state = gauge(f"{p}process_state", "1 for the rank process's current state.", (*RANK, "state"))
    phase = gauge(f"{p}phase", "1 for the phase the rank last reported.", (*RANK, "phase"))
    split = gauge(f"{p}phase_seconds", "Split of the rank's last timed step.", (*RANK, "phase"))
    comm_step = gauge(f"{p}comm_step_ratio",
                      "Communication time (in flight, overlapped or not) over step time, 0..1.",
                      RANK)  # fmt: skip
    # What the step waited for (not hidden behind backward): what costs throughput, and
    # what the 20% communication alert judges.
    comm_exposed = gauge(f"{p}comm_exposed_step_ratio",
                         "Exposed communication (the step blocked on it, not overlapped with "
                         "compute) over step time, 0..1.", RANK)  # fmt: skip
    data_wait = gauge(f"{p}data_wait_ratio", "Data wait over step time, 0..1.", RANK)
    cpu = counter(f"{p}cpu_seconds_total", "CPU time (user + system) of the rank's process.", RANK)
    client = counter(CLIENT_ERRORS,
                     "Failures the rank's client library counted (records it dropped, calls it "
                     "refused), by reason, as its newest record reports them.",
                     (*RANK, REASON_LABEL))  # fmt: skip
    simple = {name: gauge(f"{p}{name}", help, RANK) for name, _, help in _PER_RANK_GAUGES}

    for r in ranks:
        key = (r.job, r.rank)
        rank_info.add((*key, r.local_rank, r.world_size, r.pid))
        up.add(key, 1.0 if r.up else 0.0)
        for s in RANK_STATES:
            state.add((*key, s), 1.0 if r.state == s else 0.0)
        for ph in PHASES:
            phase.add((*key, ph), 1.0 if r.phase == ph else 0.0)
        for name, field, _ in _PER_RANK_GAUGES:
            value = getattr(r, field)
            if value is not None:
                simple[name].add(key, value)
        if r.step_seconds is not None:
            for field in SPLIT_FIELDS:
                split.add((*key, field.removesuffix("_seconds")), getattr(r, field))
            comm_step.add(key, _share(r.comm_seconds, r.step_seconds))
            comm_exposed.add(key, _share(r.comm_exposed_seconds, r.step_seconds))
            data_wait.add(key, _share(r.data_wait_seconds, r.step_seconds))
        if r.cpu_seconds is not None:
            cpu.add(key, r.cpu_seconds)
        for reason, count in sorted(r.client_errors.items()):
            client.add((*key, reason), count)
    return [rank_info, up, state, phase, *simple.values(), split, comm_step, comm_exposed,
            data_wait, cpu, client]  # fmt: skip


def counter_metrics(ranks: list[tuple[str, int, RankCounters]]) -> list[Metric]:
    """Per-rank counters for rate(): one series per (job, rank) entry of the table."""
    p = "rankguard_rank_"
    steps = counter(f"{p}steps_total", "Timed steps the agent received from the rank.", RANK)
    tokens = counter(f"{p}tokens_total", "Tokens the rank processed in those steps.", RANK)
    step = histogram(f"{p}step_seconds", "Wall time of the rank's timed steps.", RANK)
    # not rank_phase_seconds_total: in OpenMetrics that counter is the family
    # rankguard_rank_phase_seconds, the last-step gauge's name
    phase = counter(f"{p}step_phase_seconds_total",
                    "Step time by part (data wait, compute, ...), summed over timed steps.",
                    (*RANK, "phase"))  # fmt: skip
    flops = counter(f"{p}flops_total",
                    "Model FLOPs the rank's steps did (the client's flops_per_token x tokens).",
                    RANK)  # fmt: skip
    peak = gauge(f"{p}peak_flops",
                 "Peak FLOP/s of the rank's device, as the rank reports it (MFU's denominator).",
                 RANK)  # fmt: skip
    for job, rank, c in ranks:
        key = (job, rank)
        steps.add(key, c.steps)
        tokens.add(key, c.tokens)
        step.add_histogram(key, c.buckets(), c.step_seconds)
        for name, seconds in zip(PHASE_NAMES, c.phase_seconds, strict=True):
            phase.add((*key, name), seconds)
        if c.flops is not None:
            flops.add(key, c.flops)
        if c.peak_flops is not None:
            peak.add(key, c.peak_flops)
    return [steps, tokens, step, phase, flops, peak]


def node_metrics(counts: dict[str, int], stats: dict[str, Any] | None) -> list[Metric]:
    """Node-level families: ranks by state and the receiver's counters (0 without one)."""
    by_state = gauge("rankguard_ranks", "Training ranks on this node by process state.", ("state",))
    for s in RANK_STATES:
        by_state.add((s,), counts.get(s, 0))
    accepted = counter("rankguard_telemetry_records_total", "Telemetry records accepted.")
    accepted.add((), stats["accepted"] if stats else 0)
    rejected = counter("rankguard_telemetry_rejected_total",
                       "Telemetry datagrams rejected, by reason.", ("reason",))  # fmt: skip
    for reason in RECEIVER_REASONS:
        rejected.add((reason,), stats["rejected"].get(reason, 0) if stats else 0)
    from ..control import refused_counts

    refused = counter("rankguard_control_refused_total",
                      "Processes control refused as a rank's stand-in or launcher, by reason.",
                      ("reason",))  # fmt: skip
    for reason, n in sorted(refused_counts().items()):
        refused.add((reason,), n)
    return [by_state, accepted, rejected, refused]


def _share(part: float, whole: float) -> float:
    """part / whole clamped to 0..1 (timers of overlapping work can disagree a little)."""
    if whole <= 0:
        return 0.0
    return min(1.0, max(0.0, part / whole))
