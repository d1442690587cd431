"""What `rankguard up` shows while it runs and when it ends: pure functions, state in,
text or a rich renderable out (the polling, the terminal and the clock live in up.py).

One `Snapshot` is what up read in one look: the supervisor's `/v1/cluster` and
`/v1/incidents`, the agent's `/v1/ranks` (the only answer with tokens/s and MFU), the
seconds since training started and the steps asked for. `view()` turns it into a
`View`; `panel()` draws that on a terminal, `plain_line()` as one line for a pipe or a
log, and `summary_lines()` closes the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

OPEN_STATES = ("open", "acting", "recovering")


@dataclass(frozen=True)
class Snapshot:
    job: str
    elapsed: float  # seconds since torchrun started
    total_steps: int | None  # None: a script of the user's own (its length is unknown)
    cluster: dict | None  # /v1/cluster; None: the supervisor did not answer
    ranks: list[dict] = field(default_factory=list)  # the agent's /v1/ranks rows
    incidents: list[dict] = field(default_factory=list)  # /v1/incidents, newest first
    notes: tuple[str, ...] = ()  # up's own remarks (a daemon restarted)
    # the newest checkpoint step up has seen: restarted ranks report none until resumed
    checkpoint_step: int | None = None


@dataclass(frozen=True)
class RankRow:
    rank: int
    state: str  # the full word: training, resuming, stopped, finished, exited, ...
    step: int | None
    detail: str  # e.g. "restart 1, from checkpoint 40"


@dataclass(frozen=True)
class View:
    status: str  # healthy / degraded / unhealthy, or "no supervisor"
    job_state: str  # the supervisor's job state (running, recovering, stopped, ...) or "-"
    step: int | None
    total_steps: int | None
    elapsed: float
    eta_seconds: float | None
    tokens_per_second: float | None
    mfu: float | None
    loss: float | None
    restart: int
    ranks: tuple[RankRow, ...]
    open_incidents: tuple[str, ...]
    incident_count: int
    last_incident: str | None
    timeline: tuple[str, ...]
    notes: tuple[str, ...]


def _mine(ranks: list[dict], job: str) -> list[dict]:
    """This job's rows, the newest incarnation of each rank (a restarted rank's old row
    lingers as exited for a while)."""
    newest: dict[int, dict] = {}
    for r in ranks:
        if r.get("job") != job or not isinstance(r.get("rank"), int):
            continue
        old = newest.get(r["rank"])
        if old is None or (r.get("restart") or 0) >= (old.get("restart") or 0):
            newest[r["rank"]] = r
    return [newest[k] for k in sorted(newest)]


def rank_row(r: dict, checkpoint_step: int | None) -> RankRow:
    """A rank's state in words. A restarted rank that has not trained its first step
    again reports step 0 (or none): it is shown resuming from its checkpoint, not as
    training from scratch at step 0, when a resume is known (it is loading one, or it
    reports its phases and a checkpoint is known); else (a zero-code script, seen only as
    a process) it is shown restarted."""
    state, phase, step = r.get("state") or "?", r.get("phase"), r.get("step")
    restart = r.get("restart") or 0
    ckpt = r.get("checkpoint_step") if r.get("checkpoint_step") is not None else checkpoint_step
    if state == "alive":
        if phase in ("init", "checkpoint_load") or (restart and not step):
            resume_known = phase == "checkpoint_load" or (phase is not None and bool(ckpt))
            word = ("resuming" if resume_known else "restarted") if restart else "starting"
            detail = f"restart {restart}" if restart else ""
            if restart and ckpt and resume_known:
                detail += f", from checkpoint {ckpt}"
            return RankRow(r["rank"], word, None if restart else step, detail)
        word = {"checkpoint_save": "saving", "eval": "evaluating", "done": "finishing"}.get(
            phase or "", "training"
        )
        return RankRow(r["rank"], word, step, f"restart {restart}" if restart else "")
    return RankRow(r["rank"], state, step, f"restart {restart}" if restart else "")


def _finite(values: list) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def eta(step: int | None, total: int | None, steps_per_second: float | None) -> float | None:
    if step is None or not total or not steps_per_second or steps_per_second <= 0:
        return None
    return max(0.0, (total - step) / steps_per_second)


def steps_per_second(history: list[tuple[float, int]], window: float = 20.0) -> float | None:
    """Training speed from (elapsed, step) observations over the last `window` seconds;
    None until two observations with progress between them (a restart's step going back
    starts the window again)."""
    if not history:
        return None
    t1, s1 = history[-1]
    start = len(history) - 1
    while start > 0 and history[start - 1][1] <= history[start][1]:
        if t1 - history[start - 1][0] > window:
            break
        start -= 1
    t0, s0 = history[start]
    if t1 - t0 <= 0 or s1 <= s0:
        return None
    return (s1 - s0) / (t1 - t0)


def _clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _describe(inc: dict) -> str:
    rank = "" if inc.get("rank") is None else f" rank {inc['rank']}"
    return f"#{inc.get('id')} {inc.get('kind')}{rank} [{inc.get('state')}]"


def timeline(inc: dict) -> tuple[str, ...]:
    """The incident's milestones, seconds after the fault (or its detection), its lost
    steps and its verdict: what the live view and `rankguard incidents` print."""
    out = milestones(inc)
    if inc.get("verdict"):
        out += (f"verdict: {inc['verdict']}",)
    return out


def milestones(inc: dict) -> tuple[str, ...]:
    """Fault, detected, acted, restarted, first step and resolved as offsets from the
    fault (one format everywhere), then the steps lost."""
    origin = inc.get("occurred_at") or inc.get("detected_at")
    if origin is None:
        return ()
    marks = [
        ("fault", inc.get("occurred_at")),
        ("detected", inc.get("detected_at")),
        (f"acted ({inc['action']})" if inc.get("action") else "acted", inc.get("acted_at")),
        ("restarted", inc.get("restarted_at")),
        ("first step", inc.get("first_step_at")),
        ("resolved", inc.get("resolved_at")),
    ]
    out = [f"+{at - origin:5.1f}s {what}" for what, at in marks if isinstance(at, (int, float))]
    if inc.get("lost_steps") is not None:
        out.append(f"lost steps {inc['lost_steps']}")
    return tuple(out)


def checkpoint_step(snap: Snapshot) -> int | None:
    """The newest validated checkpoint step known: the ranks', the supervisor's, up's."""
    job = (snap.cluster or {}).get("jobs", {}).get(snap.job) or {}
    steps = [r.get("checkpoint_step") for r in _mine(snap.ranks, snap.job)]
    steps += [job.get("newest_checkpoint_step"), snap.checkpoint_step]
    return max((s for s in steps if isinstance(s, int) and s > 0), default=None)


def view(snap: Snapshot, speed: float | None = None, previous: View | None = None) -> View:
    """`speed`: steps per second (steps_per_second over up's own observations);
    `previous`: the last view, whose tokens/s, MFU and loss stand while no rank is
    training (a restart, the end)."""
    job = (snap.cluster or {}).get("jobs", {}).get(snap.job) or {}
    mine = _mine(snap.ranks, snap.job)
    ckpt = checkpoint_step(snap)
    rows = tuple(rank_row(r, ckpt) for r in mine)
    training = [r for r in mine if r.get("state") == "alive" and r.get("phase") == "train"]
    # a resuming rank shows no step: the job's step is then its checkpoint's
    step = max((r.step for r in rows if r.step is not None), default=None)
    if step is None and any(r.state == "resuming" for r in rows):
        step = ckpt
    tps = _finite([r.get("tokens_per_second") for r in training])
    mfus = _finite([r.get("mfu") for r in training])
    losses = [r.get("loss") for r in sorted(training, key=lambda r: r["rank"])]
    loss = next((v for v in losses if isinstance(v, (int, float))), None)
    if not training and previous is not None:
        tps = [previous.tokens_per_second] if previous.tokens_per_second is not None else []
        mfus = [previous.mfu] if previous.mfu is not None else []
        loss = previous.loss
    incidents = snap.incidents or []
    open_ = tuple(_describe(i) for i in incidents if i.get("state") in OPEN_STATES)
    last = incidents[0] if incidents else None
    return View(
        status=snap.cluster.get("status", "?") if snap.cluster else "no supervisor",
        job_state=job.get("state") or "-",
        step=step,
        total_steps=snap.total_steps,
        elapsed=snap.elapsed,
        eta_seconds=eta(step, snap.total_steps, speed) if training else None,
        tokens_per_second=sum(tps) if tps else None,
        mfu=sum(mfus) / len(mfus) if mfus else None,
        loss=loss,
        restart=max((r.get("restart") or 0 for r in mine), default=0),
        ranks=rows,
        open_incidents=open_,
        incident_count=len(incidents),
        last_incident=(_describe(last) + f" {last.get('summary') or ''}".rstrip())
        if last
        else None,
        timeline=timeline(last) if last else (),
        notes=snap.notes,
    )


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, fmt)


def _pct(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value * 100:.1f}%"


def _loss(value) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return _num(value, ".4f") if isinstance(value, (int, float)) else "-"


def progress_text(v: View) -> str:
    """`step 120/300 (40%)`; without a known total, `step 120`."""
    step = "-" if v.step is None else str(v.step)
    if not v.total_steps:
        return f"step {step}"
    done = "" if v.step is None else f" ({min(1.0, max(0.0, v.step / v.total_steps)):.0%})"
    return f"step {step}/{v.total_steps}{done}"


def _rank_text(r: RankRow) -> str:
    step = "" if r.step is None else f"@{r.step}"
    return f"r{r.rank} {r.state}{step}" + (f" ({r.detail})" if r.detail else "")


def plain_line(v: View) -> str:
    """One line for a pipe or a log file: the same facts as the panel."""
    ranks = ", ".join(_rank_text(r) for r in v.ranks) or "waiting for ranks"
    parts = [
        f"{_clock(v.elapsed):>7} [{v.status}] job {v.job_state}",
        progress_text(v),
        f"eta {_clock(v.eta_seconds)}",
        f"tokens/s {_num(v.tokens_per_second, ',.0f')}",
        f"mfu {_pct(v.mfu)}",
        f"loss {_loss(v.loss)}",
        ranks,
        f"incidents {v.incident_count} open {len(v.open_incidents)}",
    ]
    if v.last_incident:
        parts.append(f"last {_describe_short(v.last_incident)}")
    return " | ".join(parts + list(v.notes))


def _describe_short(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


def panel(v: View, title: str = "rankguard up"):
    """The terminal view: one panel, redrawn in place by rich.live."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    head = Table.grid(padding=(0, 2))
    head.add_row(
        Text(f"cluster {v.status}", style=_status_style(v.status)),
        Text(f"job {v.job_state}"),
        Text(f"elapsed {_clock(v.elapsed)}"),
        Text(f"eta {_clock(v.eta_seconds)}"),
    )
    step = f"step {v.step if v.step is not None else '-'}" + (
        f"/{v.total_steps}" if v.total_steps else ""
    )
    bar = Table.grid(padding=(0, 2))
    if v.total_steps:
        done = 0 if v.step is None else min(v.step, v.total_steps)
        bar.add_row(Text(step), ProgressBar(total=v.total_steps, completed=done, width=40),
                    Text(f"{done / v.total_steps:.0%}"))  # fmt: skip
    else:
        bar.add_row(Text(step))
    figures = Text(
        f"tokens/s {_num(v.tokens_per_second, ',.0f')}   "
        f"MFU {_pct(v.mfu)}   "
        f"loss {_loss(v.loss)}   restarts {v.restart}"
    )
    ranks = Table(box=None, padding=(0, 2), show_edge=False)
    for name in ("rank", "state", "step", ""):
        ranks.add_column(name, style="bold" if name == "rank" else None)
    for r in v.ranks:
        ranks.add_row(str(r.rank), Text(r.state, style=_rank_style(r.state)),
                      "-" if r.step is None else str(r.step), r.detail)  # fmt: skip
    if not v.ranks:
        ranks.add_row("-", "waiting for ranks", "", "")
    parts = [head, bar, figures, ranks]
    inc = f"incidents {v.incident_count}, open {len(v.open_incidents)}"
    if v.open_incidents:
        inc += ": " + "; ".join(v.open_incidents)
    parts.append(Text(inc, style="yellow" if v.open_incidents else None))
    if v.last_incident:
        parts.append(Text(f"last: {v.last_incident}"))
        if v.timeline:
            parts.append(Text("  " + "  ".join(v.timeline), style="dim"))
    for note in v.notes:
        parts.append(Text(note, style="yellow"))
    return Panel(Group(*parts), title=title, expand=False)


def _status_style(status: str) -> str:
    return {"healthy": "green", "degraded": "yellow"}.get(status, "red")


def _rank_style(state: str) -> str | None:
    if state in ("training", "saving", "evaluating", "finished", "finishing"):
        return "green"
    if state in ("resuming", "restarted", "starting"):
        return "cyan"
    return "red"


@dataclass(frozen=True)
class Outcome:
    """How the run ended, for the closing summary."""

    how: str  # "completed", "failed (exit 1)", "stopped by the supervisor", "interrupted"
    wall_seconds: float  # since torchrun started
    step: int | None
    total_steps: int | None
    useful_seconds: float | None  # productive step time the supervisor counted
    incidents: list[dict]
    final_loss: float | None = None


def goodput(useful_seconds: float | None, wall_seconds: float) -> float | None:
    """Useful step time over wall time (capped at 1: the supervisor's sum is per job
    step, and its clock and up's differ by a poll)."""
    if useful_seconds is None or wall_seconds <= 0:
        return None
    return min(1.0, max(0.0, useful_seconds / wall_seconds))


def summary_lines(o: Outcome) -> list[str]:
    """The closing summary: what was trained, in how long, how much of it was useful, and
    what went wrong on the way."""
    steps = "-" if o.step is None else str(o.step)
    if o.total_steps:
        steps += f"/{o.total_steps}"
    g = goodput(o.useful_seconds, o.wall_seconds)
    # no step reported (a zero-code script), or no supervisor: nothing to count it by
    shown = "unknown" if g is None else _pct(g)
    lines = [
        f"rankguard up: summary: {o.how}; steps {steps} in {_clock(o.wall_seconds)} "
        f"({o.wall_seconds:.1f}s); goodput {shown}"
        + (f" (useful step time {o.useful_seconds:.1f}s)" if o.useful_seconds is not None else "")
        + (f"; final loss {_loss(o.final_loss)}" if o.final_loss is not None else "")
    ]
    by_kind: dict[str, int] = {}
    for inc in o.incidents:
        by_kind[inc.get("kind") or "?"] = by_kind.get(inc.get("kind") or "?", 0) + 1
    if by_kind:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(by_kind.items()))
        lines.append(f"rankguard up: summary: incidents {len(o.incidents)} ({kinds})")
        for inc in reversed(o.incidents[:5]):
            ttr = inc.get("time_to_recover")
            rec = f", recovered in {ttr:.1f}s" if isinstance(ttr, (int, float)) else ""
            lines.append(f"  {_describe(inc)}{rec}: {inc.get('summary') or ''}".rstrip(": "))
    else:
        lines.append("rankguard up: summary: incidents 0")
    return lines
