"""The culprit of a hang from the ranks' flight recorders: how far each rank got in each
process group's sequence of collectives (its wavefront). Pure logic, no I/O.

Every rank of a process group issues the group's collectives in the same order, each
numbered by a per-group sequence id. A rank's recorder (client/flight_recorder.py) says
the last id it enqueued, the last that completed, and the operation and size of the first
it still waits in. While a job is hung, each group is stuck at the first collective a
member waits in:

* **behind**: a rank never enqueued the collective its group is stuck at, so the peers
  wait in one it never reached. The culprit is a rank behind that is not itself
  waiting in any collective (it is stuck in its own code, its data, a native call); a
  rank behind that waits in another group is a victim of a chain, named only when no
  rank at its end is found.
* **desync**: the members wait in the same collective with a different operation or
  size: a code bug that a restart only repeats.
* **below the ranks**: every member of a group waits in the same collective, alike: the
  ranks did their part, the fault is beneath them (GPU, link, NIC) on the nodes they
  share.

A rank without a fresh wavefront (its recorder off, its Reporter thread unable to run, an
older client, or one taken before its last progress) makes the reading incomplete: nothing is concluded from the others alone,
since the missing rank may be the one behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..contract.answers import CollectiveAnswer
from .state import RankObs

BEHIND, DESYNC, BELOW = "behind", "desync", "below the ranks"
# A wavefront older than this says where the rank was, not where it is.
FRESH_SECONDS = 15.0


@dataclass(frozen=True)
class Wavefront:
    """What the ranks' recorders say: `verdict` (BEHIND, DESYNC, BELOW), the `ranks` it
    names (the culprits; for BELOW the ranks left waiting), the group and the sequence id
    the others wait in, and every rank's reach in that group."""

    verdict: str
    ranks: tuple[int, ...]
    pg: str
    seq: int
    reached: dict[int, int] = field(default_factory=dict)  # rank -> last enqueued id
    detail: str = ""

    def to_json(self) -> dict:
        return {
            "verdict": self.verdict,
            "ranks": list(self.ranks),
            "pg": self.pg,
            "seq": self.seq,
            "reached": {str(r): s for r, s in sorted(self.reached.items())},
            "detail": self.detail,
        }


def fresh(rank: RankObs, max_age: float = FRESH_SECONDS) -> bool:
    """A wavefront that says where the rank is: recent, and taken since its last progress
    (one from an earlier stall, a start-up wait say, is where it was: a rank that stalls
    again within `max_age` must not be judged by it before it sends a new one)."""
    age = rank.collectives_age_seconds
    if not rank.collectives or age is None or age > max_age:
        return False
    beat = rank.heartbeat_age_seconds
    return beat is None or age <= beat


def read_wavefront(live: Sequence[RankObs], max_age: float = FRESH_SECONDS) -> Wavefront | None:
    """The verdict of the live ranks' wavefronts, or None when they are incomplete (a rank
    without a fresh one) or say nothing (nothing pending anywhere).

    A group is stuck at the first collective one of its members waits in (the lowest
    `completed + 1` of those with one pending). Members that never enqueued it are behind;
    members that all did are compared by what they enqueued there (each rank's `op` and
    `shape` are of its first pending collective)."""
    if len(live) < 2 or not all(fresh(r, max_age) for r in live):
        return None
    groups: dict[str, dict[int, CollectiveAnswer]] = {}
    for r in live:
        for c in r.collectives:
            groups.setdefault(c.pg, {})[r.rank] = c
    waiting = {r.rank for r in live if any(c.enqueued > c.completed for c in r.collectives)}
    behind, level = [], []
    for pg, members in sorted(groups.items()):
        pending = [c.completed + 1 for c in members.values() if c.enqueued > c.completed]
        if not pending:
            continue
        stuck = min(pending)
        late = tuple(sorted(rank for rank, c in members.items() if c.enqueued < stuck))
        if late:
            behind.append((pg, stuck, late, members))
            continue
        at = {rank: c for rank, c in members.items() if c.completed + 1 == stuck}
        desync = _desync(pg, stuck, at, members)
        if desync is not None:
            return desync
        if len(at) == len(members) >= 2:
            level.append((pg, stuck, members))
    # the end of a chain: behind somewhere and waiting nowhere; else the first rank behind
    for pg, stuck, late, members in behind:
        if ends := tuple(rank for rank in late if rank not in waiting):
            return _behind(pg, stuck, ends, members, "and waits in no collective")
    if behind:
        pg, stuck, late, members = behind[0]
        return _behind(pg, stuck, late, members, "and waits in a collective of its own")
    for pg, stuck, members in level:
        return Wavefront(
            BELOW, tuple(sorted(members)), pg, stuck, _reach(members),
            f"every member of group {pg} enqueued collective {stuck} and none completed it",
        )  # fmt: skip
    return None


def _reach(members: dict[int, object]) -> dict[int, int]:
    return {rank: c.enqueued for rank, c in members.items()}


def _behind(pg: str, top: int, late: tuple[int, ...], members: dict, why: str) -> Wavefront:
    reached = _reach(members)
    names = ", ".join(f"rank {r} at {reached[r]}" for r in late)
    return Wavefront(
        BEHIND, late, pg, top, reached,
        f"group {pg} waits in collective {top}; {names} never enqueued it {why}",
    )  # fmt: skip


def _desync(pg: str, seq: int, at: dict[int, CollectiveAnswer], members: dict) -> Wavefront | None:
    """Ranks waiting in the same collective with a different operation or size."""
    kinds: dict[tuple, list[int]] = {}
    for rank, c in sorted(at.items()):
        if c.op is not None:
            kinds.setdefault((c.op, c.shape), []).append(rank)
    if len(kinds) < 2:
        return None
    parts = [f"{op} {shape or ''}".strip() + f" on rank(s) {', '.join(map(str, ranks))}"
             for (op, shape), ranks in sorted(kinds.items(), key=lambda kv: kv[1])]  # fmt: skip
    # the odd rank(s): a side smaller than every other; with a tie (two ranks, two
    # operations) which side is wrong cannot be told, and every rank involved is named
    sizes = sorted(len(ranks) for ranks in kinds.values())
    odd = (min(kinds.values(), key=len) if sizes[0] < sizes[1]
           else [r for ranks in kinds.values() for r in ranks])  # fmt: skip
    return Wavefront(
        DESYNC, tuple(sorted(odd)), pg, seq, _reach(members),
        f"group {pg}, collective {seq}: " + "; ".join(parts),
    )  # fmt: skip
