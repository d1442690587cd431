"""A death announced by an agent's ``/v1/rank-events``, applied to the supervisor's last
view of that node (pure).

Why: the agent knows of an exit at once (pidfd), while the supervisor's next sample poll
of that node may be a round of 1,024 polls away (docs/scaling.md). The event is applied
to the node as last seen, and the state detectors run on it at once (reconcile.py,
`Supervisor.reconcile_events`); the node's next answer replaces the patched view.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from ..contract.answers import RankEventAnswer
from .state import DEAD_STATES, NodeObs, RankObs


def _applies(r: RankObs, e: RankEventAnswer) -> bool:
    """The event is news for this rank: the very process seen, or a newer incarnation's
    (one that started and died between two polls of the node); never an older one."""
    if r.state in DEAD_STATES and r.pid == e.pid:
        return False  # seen dead already
    if r.pid == e.pid:
        return True
    return e.restart is not None and e.restart > r.restart


def apply_deaths(node: NodeObs, events: Iterable[RankEventAnswer]) -> NodeObs:
    """`node` with each dead-state event applied to its rank; the same object when none
    applies (a rank not in view yet is left to the next poll: too little is known of it)."""
    deaths = {(e.job, e.rank): e for e in events if e.state in DEAD_STATES}
    if not deaths or not node.reachable:
        return node
    ranks, changed = [], False
    for r in node.ranks:
        e = deaths.get((r.job, r.rank))
        if e is not None and _applies(r, e):
            restart = r.restart if e.restart is None else e.restart
            # the rank's last step as the agent knew it at the exit: the view may be a poll
            # old, and the incident's steps lost are counted from the newest step seen
            step = r.step if e.step is None or (r.step or 0) > e.step else e.step
            # and its newest checkpoint, for the crash-loop guard: an incarnation that lived
            # less than a poll was seen with none (supervisor/policy.py)
            ckpt = r.checkpoint_step if e.checkpoint_step is None else e.checkpoint_step
            r = replace(r, state=e.state, pid=e.pid, restart=restart, exited_at=e.at,
                        state_since=e.at, cpu_utilization=0.0, step=step,
                        checkpoint_step=ckpt)  # fmt: skip
            changed = True
        ranks.append(r)
    return replace(node, ranks=tuple(ranks)) if changed else node
