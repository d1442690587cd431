"""A restart split into its phases, for the incident timeline: pure, no I/O.

The supervisor sees a restart only at its pass interval (0.25 s) and the agents' (0.5 s
under `up`), too coarse for phases of tens of milliseconds. The workers write their own
startup milestones (`trainer/startup_trace.py`, JSON lines: process_start, imported,
process_group, built, resumed, first_step); the agent stamps when each old rank exited.
From those:

    teardown    the old group stopping: from the moment it was doomed (the fault for a
                dead rank, our kill for a hang) to its last rank's exit
    respawn     the launcher noticing, re-forming its rendezvous and starting the new
                workers: to the newest worker's process start (its fork, warm)
    imports     interpreter + `import torch` (about zero for a warm start)
    rendezvous  the c10d store and the process group's init
    build       model, optimizer, DDP wrapping (its parameter broadcast), the incarnation
    state_load  the state loaded from the fastest tier that has it
    first_step  the first new optimizer step

Each milestone is the slowest rank's: the group goes on only when every rank has.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

PHASES = ("teardown", "respawn", "imports", "rendezvous", "build", "state_load", "first_step")
# the milestone that ends each phase after respawn, in order
_ENDS = (("imports", "imported"), ("rendezvous", "process_group"), ("build", "built"),
         ("state_load", "resumed"), ("first_step", "first_step"))  # fmt: skip


def parse_lines(text: str) -> list[dict]:
    """The trace's lines; a torn or foreign line is skipped (a worker may die mid-write)."""
    out = []
    for line in text.splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(m, dict)
            and isinstance(m.get("event"), str)
            and isinstance(m.get("time"), (int, float))
        ):
            out.append(m)
    return out


def milestones(
    lines: Iterable[Mapping], job: str, incarnation: int, world_size: int
) -> dict[str, float] | None:
    """Per milestone, when the slowest of the incarnation's `world_size` ranks reached it;
    None until every rank has reached every one. A worker learns its job and incarnation
    only after the process group is up, so its earlier lines are matched by pid."""
    lines = list(lines)
    pids = {m.get("pid") for m in lines
            if m.get("job") == job and m.get("incarnation") == incarnation}  # fmt: skip
    per_event: dict[str, dict[int, float]] = {}
    for m in lines:
        if m.get("pid") in pids and isinstance(m.get("rank"), int):
            ranks = per_event.setdefault(m["event"], {})
            ranks[m["rank"]] = max(ranks.get(m["rank"], 0.0), float(m["time"]))
    needed = ["process_start", *(end for _, end in _ENDS)]
    if any(len(per_event.get(e, {})) < world_size for e in needed):
        return None
    return {e: max(per_event[e].values()) for e in needed}


def phases(
    doomed_at: float, old_exited_at: float | None, m: Mapping[str, float]
) -> dict[str, float | None]:
    """Seconds per phase (PHASES order). Without the old ranks' exit time (an agent that
    did not see them end), teardown and respawn are one span, given as respawn."""
    out: dict[str, float | None] = {}
    start = m["process_start"]
    if old_exited_at is not None and doomed_at <= old_exited_at <= start:
        out["teardown"] = old_exited_at - doomed_at
        out["respawn"] = start - old_exited_at
    else:
        out["teardown"] = None
        out["respawn"] = start - doomed_at
    prev = start
    for phase, end in _ENDS:
        out[phase] = max(0.0, m[end] - prev)
        prev = m[end]
    return {p: (None if v is None else round(v, 3)) for p, v in out.items()}
