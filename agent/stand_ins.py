"""Stand-ins: the process torchrun started for a rank that runs in another process.

With warm start (trainer/warm.py) torchrun starts a light shim that asks a warm server to
fork the rank; torchrun watches the shim, the agent the rank. A shim that is stopped
(SIGSTOP) while its rank trains on hides the rank from torchrun: the rank's exit, clean
or not, never reaches torchrun, which then waits forever (seen: `rankguard up
--warm-start` sat at the last step for ten minutes). A shim that dies takes its rank with
it (the rank watches it by pidfd), which the rank's own death already reports.

So the agent watches each rank's stand-in too and shows it in `/v1/ranks` as
`stand_in: {pid, state, state_since}` (`alive`, `stopped`, `gone`); a supervisor detector
(supervisor/detectors/stand_in.py) treats a stopped stand-in like a stopped rank, and
killing such a rank kills its stand-in too (agent/control.py). The state rule is pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..contract.answers import StandInAnswer


def stand_in_state(stat: Any, start_ticks: int) -> str:
    """A ProcStat (or None: no such process) -> alive, stopped or gone. A pid that now
    names another process (another start time) is gone."""
    if stat is None or stat.start_ticks != start_ticks or stat.state in "ZXx":
        return "gone"
    return "stopped" if stat.state in "Tt" else "alive"


@dataclass
class StandIn:
    pid: int
    start_ticks: int
    state: str
    state_since: float  # agent clock

    def observe(self, stat: Any, now: float) -> None:
        state = stand_in_state(stat, self.start_ticks)
        if state != self.state:
            self.state, self.state_since = state, now

    @property
    def watched(self) -> bool:
        return self.state != "gone"  # a process gone never comes back

    def answer(self, to_unix: float) -> StandInAnswer:
        return StandInAnswer(self.pid, self.state, self.state_since + to_unix)
