"""How often the supervisor may ask agents for a rank's stacks (py-spy dumps).

A dump costs the node ~0.1 s of CPU and the pass an HTTP round trip. Reading every rank
of a hung job on every retry cost 833 dumps a minute with 30 silent ranks and slowed
passes from 4/s to 1.3/s. Here captures are bounded per pass, and each rank process backs
off (2 s, 4 s, ... up to 60 s) while its hang persists; dumps taken on earlier passes are
kept, so a job's stacks are completed over a few passes instead of all in one. A capture
is started on one pass and may finish on a later one (an agent behind a cut link answers
only after its timeout; reconcile.py waits for it no longer than a moment). Pure: the
clock is passed in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

Key = tuple[str, int, int]  # (job, rank, pid): a new process starts its backoff afresh

#: Why a capture was not made now (a bounded label set for counters).
SKIPS = ("pass_budget", "backoff")


@dataclass
class StackBudget:
    per_pass: int = 8
    first_delay: float = 2.0
    max_delay: float = 60.0
    captured: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    _left: int = 0
    _due: dict[Key, tuple[float, float]] = field(default_factory=dict)  # key -> (due, delay)
    _dumps: dict[Key, tuple[float, str]] = field(default_factory=dict)  # key -> (taken, text)

    def new_pass(self, now: float) -> None:
        self._left = self.per_pass
        # ranks no longer asked about for a while start over (their hang ended or they left)
        stale = now - 2 * self.max_delay
        for key in [k for k, (due, _) in self._due.items() if due < stale]:
            self._due.pop(key)
            self._dumps.pop(key, None)

    def may_capture(self, key: Key, now: float) -> bool:
        due = self._due.get(key)
        if due is not None and now < due[0]:
            self.skipped["backoff"] += 1
            return False
        if self._left <= 0:
            self.skipped["pass_budget"] += 1
            return False
        return True

    def start(self, key: Key, now: float) -> None:
        """A capture asked for: spend the pass's budget and back off."""
        self._left -= 1
        self.captured += 1
        previous = self._due.get(key)
        delay = self.first_delay if previous is None else min(previous[1] * 2, self.max_delay)
        self._due[key] = (now + delay, delay)

    def finish(self, key: Key, now: float, dump: str | None) -> None:
        """Its answer, on this pass or a later one (`dump` None when it failed: the last
        good one stays). The backoff counts from the answer: a capture that took longer
        than it is not asked for again at once. A rank forgotten meanwhile is not brought
        back."""
        if key not in self._due:
            return
        due, delay = self._due[key]
        self._due[key] = (max(due, now + delay), delay)
        if dump is not None:
            self._dumps[key] = (now, dump)

    def tried(self, key: Key) -> bool:
        return key in self._due

    def dump(self, key: Key) -> str | None:
        """The newest dump of this rank process, from this pass or an earlier one."""
        held = self._dumps.get(key)
        return held[1] if held else None
