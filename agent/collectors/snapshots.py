"""Snapshot holder collector: tier-0 memory on this node, from the holder's `status` answer
(agent/snapshot_holder.py; the typed model is `contract/snapshots.HolderStatus`).

The holder is its own process (its memory must outlive the agent's restarts), so the agent
asks it over its owner-only unix socket (or TCP with the snapshot token) each collection,
with a short timeout. Per job and kind (local copies, replicas of a peer's): bytes held,
rank snapshots held, steps, the newest and the newest complete step; and the holder's
replication and refusal counters (wrong token, oversized or malformed frames).

No holder configured: nothing is exported. A configured holder that does not answer is
`rankguard_snapshot_holder_up 0`, not a collector failure: holders come and go with jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...contract import snapshots as wire
from . import JOB_LABEL, Collector, CollectorResult, counter, gauge, register


@dataclass(frozen=True)
class SnapshotsConfig:
    """[collectors.snapshots]"""

    enabled: bool = True
    holder: str = ""  # socket path or HOST:PORT; "" = $RANKGUARD_SNAPSHOT_HOLDER, or none
    token_file: str = ""  # the snapshot token, for a holder on TCP
    timeout_seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.holder:
            wire.parse_address(self.holder)  # ValueError: one line naming the address
        if not 0 < self.timeout_seconds <= 60:
            raise ValueError("SnapshotsConfig.timeout_seconds must be in (0, 60]")


def holder_metrics(status: wire.HolderStatus | None, up: bool) -> list:
    """The families for one holder's status (pure: tests feed literal models)."""
    up_g = gauge("rankguard_snapshot_holder_up", "1 when the node's snapshot holder answers.")
    up_g.add((), 1 if up else 0)
    if status is None:
        return [up_g]
    labels = (JOB_LABEL, "kind")
    bytes_g = gauge("rankguard_snapshot_bytes", "Tier-0 snapshot bytes held in memory.", labels)
    held = gauge("rankguard_snapshot_held", "Rank snapshots held (per step, one per rank).",
                 labels)  # fmt: skip
    newest = gauge("rankguard_snapshot_newest_step", "Newest snapshot step held.", labels)
    complete = gauge(
        "rankguard_snapshot_newest_complete_step",
        "Newest snapshot step held with every rank of its node (usable for a resume).",
        labels,
    )
    for j in status.jobs():
        key = (j.job, j.kind)
        bytes_g.add(key, j.bytes)
        held.add(key, j.snapshots)
        newest.add(key, j.newest_step)
        if j.newest_complete_step is not None:
            complete.add(key, j.newest_complete_step)
    total = gauge("rankguard_snapshot_holder_bytes", "All snapshot bytes the holder holds.")
    total.add((), status.bytes)
    spare = gauge(
        "rankguard_snapshot_holder_spare_bytes",
        "Buffers of dropped snapshots the holder keeps to receive the next ones into.",
    )
    spare.add((), status.spare_bytes)
    evicted = counter(
        "rankguard_snapshot_evicted_total", "Snapshot steps evicted by --snapshot-keep."
    )
    evicted.add((), status.evicted)
    refused = counter(
        "rankguard_snapshot_refused_total",
        "Requests and connections the holder refused, by reason (a wrong token, an "
        "oversized or malformed frame, a handshake past its deadline, too many "
        "unauthenticated connections from one address).",
        ("reason",),
    )
    for reason in wire.REFUSALS:
        refused.add((reason,), status.refused.get(reason, 0))
    out = [up_g, bytes_g, held, newest, complete, total, spare, evicted, refused]
    rep = status.replication
    if rep is not None:
        sent = counter("rankguard_snapshot_replicated_total", "Snapshots sent to the peer holder.")
        dropped = counter(
            "rankguard_snapshot_replication_dropped_total",
            "Snapshots not replicated (peer slow, absent or refusing); the next is newer.",
        )
        out += [sent.add((), rep["sent"]), dropped.add((), rep["dropped"])]
    return out


def holder_facts(status: wire.HolderStatus | None, address: str, error: str | None) -> dict:
    facts: dict[str, Any] = {"holder": address, "up": status is not None, "error": error}
    if status is not None:
        facts.update(bytes=status.bytes, spare_bytes=status.spare_bytes,
                     evicted=status.evicted, refused=dict(status.refused),
                     replication=status.replication,
                     jobs=[j.to_json() for j in status.jobs()])  # fmt: skip
    return facts


@register
class SnapshotsCollector(Collector):
    name = "snapshots"
    Config = SnapshotsConfig

    def __init__(self, ctx, config=None):
        super().__init__(ctx, config)
        self.address = self.config.holder or wire.default_address() or ""
        self.token = wire.read_token(self.config.token_file) if self.config.token_file else None

    def collect(self) -> CollectorResult:
        result = CollectorResult()
        if not self.address:
            return result
        status, error = None, None
        try:
            answer, _ = wire.request(self.address, {"op": "status"},
                                     timeout=self.config.timeout_seconds, token=self.token)  # fmt: skip
            status = wire.HolderStatus.from_json(answer)
        except (OSError, EOFError, ValueError, wire.WireError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:500]
        result.metrics = holder_metrics(status, status is not None)
        result.facts = holder_facts(status, self.address, error)  # /v1/node facts.snapshots
        return result
