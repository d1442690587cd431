"""Rank process states: one set, one meaning, for the agent and the supervisor alike.

* ``alive``: running or sleeping (uninterruptible sleep too): the process can progress;
* ``stopped``: SIGSTOP/SIGTSTP or held by a tracer: it exists but makes no progress;
* ``zombie``: terminated, not yet reaped by its parent (torchrun reaps at its next poll);
* ``exited``: terminated and reaped (or its pid now names another process), without
  saying it ended well;
* ``finished``: terminated after saying it ended well: its last telemetry record had
  phase ``done``, or (a worker found in /proc) its exit status was 0.

Three groups, each with one use:

* :data:`LIVE_STATES` (alive, stopped): the process exists. The agent's ``up`` field and
  ``rankguard_rank_up`` are exactly ``state in LIVE_STATES``.
* :data:`DEAD_STATES` (zombie, exited): the process died. Only these are faults: the
  supervisor's dead detector, and a hang check that finds a dead peer, look at them.
* :data:`ENDED_STATES` (dead or finished): the process is gone. The agent stamps
  ``exited_at``, lets such a rank make room in a full table and forgets it later.

**A clean exit is not a death.** ``finished`` is neither live nor dead: a job whose ranks
all finished is over, not failed, and nothing restarts it. (Before this module the agent
counted ``finished`` among its dead states and the supervisor did not.)
"""

from __future__ import annotations

__all__ = [
    "DEAD_STATES",
    "ENDED_STATES",
    "LIVE_STATES",
    "RANK_SOURCES",
    "RANK_STATES",
    "STAND_IN_STATES",
]

RANK_STATES = ("alive", "stopped", "zombie", "exited", "finished")
LIVE_STATES = frozenset({"alive", "stopped"})
DEAD_STATES = frozenset({"zombie", "exited"})
ENDED_STATES = DEAD_STATES | {"finished"}

#: How the agent knows a rank: "telemetry" (it reports its steps) or "process" (a torchrun
#: worker found in /proc that sends nothing: no step, phase, heartbeat or loss).
RANK_SOURCES = ("telemetry", "process")

#: A rank's stand-in (the warm-start shim torchrun watches in its place, agent/stand_ins.py).
STAND_IN_STATES = ("alive", "stopped", "gone")
