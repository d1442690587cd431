"""The durable incident store: one SQLite file holding incidents, actions and their timeline.

Why these SQLite settings:

- WAL journal: `rankguard incidents` (another process) reads while the supervisor writes,
  and readers never block the writer nor see a half-written transaction.
- synchronous=FULL: every commit is fsynced, also against power loss. The action rows are
  an intent log (written before a rank is killed) and the restart budget; losing the last
  commits on a power cut could make a restarted supervisor act twice. The store writes a
  few rows per incident, so the fsync per commit costs nothing that matters.
- busy_timeout: another process (the CLI, a second supervisor by mistake) may hold the
  write lock briefly; wait for it instead of failing at once.
- Every public write is one `BEGIN IMMEDIATE` transaction: a crash between statements
  loses nothing half-done, and the write lock is taken up front (no lock upgrade deadlock).

One connection guarded by a lock, so the store is safe to share between threads.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..contract.causes import CAUSES, LOW, UNKNOWN
from ..contract.numbers import json_safe
from .causes import Cause, classify
from .lifecycle import JobProgress, Transition
from .model import ACT_EXCLUDE_NODE, ACT_NONE, ACT_STOP_JOB, CRASH_LOOP, RANK_DEAD, Finding
from .policy import RESTART_ACTIONS, RestartRecord, known_cause

# 2: the jobs table (state, verdict, goodput survive a restart); 3: each incident's cause
SCHEMA_VERSION = 3
BUSY_TIMEOUT_MS = 5000

OPEN, ACTING, RECOVERING, RESOLVED, REPORTED, FAILED, STOPPED = (
    "open", "acting", "recovering", "resolved", "reported", "failed", "stopped",
)  # fmt: skip
STATES = (OPEN, ACTING, RECOVERING, RESOLVED, REPORTED, FAILED, STOPPED)
TERMINAL = frozenset({RESOLVED, FAILED, STOPPED})
# Allowed moves; setting the state an incident already has is always allowed (updates fields).
TRANSITIONS: dict[str, frozenset[str]] = {
    OPEN: frozenset({ACTING, RECOVERING, REPORTED, RESOLVED, FAILED, STOPPED}),
    ACTING: frozenset({RECOVERING, RESOLVED, FAILED, STOPPED}),
    RECOVERING: frozenset({RESOLVED, FAILED, STOPPED}),
    REPORTED: frozenset({RESOLVED, FAILED, STOPPED}),
    RESOLVED: frozenset(),
    FAILED: frozenset(),
    STOPPED: frozenset(),
}
# Columns `set_state` may write besides state and updated_at.
SETTABLE = frozenset({
    "action", "action_reason", "acted_at", "restarted_at", "first_step_at", "resolved_at",
    "restart_before", "step_at_detect", "checkpoint_step", "resumed_step", "lost_steps",
    "verdict",
})  # fmt: skip

_JOBS = """
CREATE TABLE jobs (
    job            TEXT PRIMARY KEY,
    first_seen     REAL NOT NULL,
    max_step       INTEGER NOT NULL,
    useful_seconds REAL NOT NULL,
    state          TEXT NOT NULL,
    verdict        TEXT,
    updated_at     REAL NOT NULL
);
"""

# supervisor/causes.py; an older store's incidents are classified when it is upgraded
_CAUSE_COLUMNS = """cause            TEXT NOT NULL DEFAULT 'unknown',
    cause_confidence TEXT NOT NULL DEFAULT 'low',
    cause_why        TEXT NOT NULL DEFAULT ''"""

_SCHEMA = f"""
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE incidents (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    key             TEXT NOT NULL UNIQUE,
    kind            TEXT NOT NULL,
    severity        TEXT NOT NULL,
    job             TEXT,
    node            TEXT,
    rank            INTEGER,
    summary         TEXT NOT NULL,
    evidence        TEXT NOT NULL DEFAULT '{{}}',
    action          TEXT,
    action_reason   TEXT,
    state           TEXT NOT NULL CHECK (state IN ({", ".join(f"'{s}'" for s in STATES)})),
    detected_at     REAL NOT NULL,
    occurred_at     REAL,
    acted_at        REAL,
    restarted_at    REAL,
    first_step_at   REAL,
    resolved_at     REAL,
    restart_before  INTEGER,
    step_at_detect  INTEGER,
    checkpoint_step INTEGER,
    resumed_step    INTEGER,
    lost_steps      INTEGER,
    verdict         TEXT,
    updated_at      REAL NOT NULL,
    {_CAUSE_COLUMNS}
);
CREATE INDEX incidents_job_detected ON incidents (job, detected_at);
CREATE INDEX incidents_state ON incidents (state);
CREATE TABLE actions (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    incident_id  INTEGER NOT NULL REFERENCES incidents (id),
    kind         TEXT NOT NULL,
    target       TEXT NOT NULL DEFAULT '{{}}',
    requested_at REAL NOT NULL,
    completed_at REAL,
    ok           INTEGER,
    result       TEXT,
    error        TEXT,
    UNIQUE (incident_id, kind)
);
CREATE INDEX actions_kind_requested ON actions (kind, requested_at);
CREATE TABLE events (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    incident_id INTEGER NOT NULL REFERENCES incidents (id),
    at          REAL NOT NULL,
    what        TEXT NOT NULL,
    detail      TEXT NOT NULL DEFAULT '{{}}'
);
CREATE INDEX events_incident ON events (incident_id, at);
{_JOBS}"""


class StoreError(Exception):
    """The database file cannot be used (not SQLite, newer schema, foreign database)."""


class ActionExists(StoreError):
    """An action of this kind was already recorded for the incident: never act twice."""


class InvalidTransition(ValueError):
    pass


# --------------------------------------------------------------------------- records


def _delta(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start


@dataclass(frozen=True)
class Incident:
    """One row of `incidents`, evidence parsed. Times are unix seconds."""

    id: int
    key: str
    kind: str
    severity: str
    job: str | None
    node: str | None
    rank: int | None
    summary: str
    evidence: dict[str, Any]
    action: str | None
    action_reason: str | None
    state: str
    detected_at: float
    occurred_at: float | None
    acted_at: float | None
    restarted_at: float | None
    first_step_at: float | None
    resolved_at: float | None
    restart_before: int | None
    step_at_detect: int | None
    checkpoint_step: int | None
    resumed_step: int | None
    lost_steps: int | None
    verdict: str | None
    updated_at: float
    cause: str = UNKNOWN  # contract/causes.py, from the evidence (supervisor/causes.py)
    cause_confidence: str = LOW
    cause_why: str = ""

    @property
    def time_to_detect(self) -> float | None:
        return _delta(self.detected_at, self.occurred_at)

    @property
    def time_to_recover(self) -> float | None:
        return _delta(self.first_step_at, self.occurred_at)

    def phases(self) -> dict[str, float | None]:
        """Seconds spent in each phase of a recovery; None where a phase did not happen.
        A dead rank has no act phase: its restart phase runs from detection."""
        return {
            "detect": _delta(self.detected_at, self.occurred_at),
            "act": _delta(self.acted_at, self.detected_at),
            "restart": _delta(self.restarted_at, self.acted_at or self.detected_at),
            "first_step": _delta(self.first_step_at, self.restarted_at),
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["time_to_detect"] = self.time_to_detect
        d["time_to_recover"] = self.time_to_recover
        d["phases"] = self.phases()
        return d


@dataclass(frozen=True)
class Action:
    id: int
    incident_id: int
    kind: str
    target: dict[str, Any]
    requested_at: float
    completed_at: float | None
    ok: bool | None  # None: intent recorded, outcome unknown (in flight or crashed mid-action)
    result: Any
    error: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Event:
    id: int
    incident_id: int
    at: float
    what: str
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CauseTotals:
    cause: str
    incidents: int = 0
    lost_seconds: float = 0.0  # fault to the first step after the restart, summed
    lost_steps: int = 0  # steps done again from the checkpoint the restart resumed
    restarts: int = 0  # incidents after which the job trained again

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dumps(value: Any) -> str:
    return json.dumps(json_safe(value), sort_keys=True, default=str, allow_nan=False)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


_INCIDENT_COLUMNS = tuple(f.name for f in fields(Incident))


def _incident(row: sqlite3.Row) -> Incident:
    values = {k: row[k] for k in _INCIDENT_COLUMNS}
    values["evidence"] = _loads(values["evidence"]) or {}
    return Incident(**values)


def _action(row: sqlite3.Row) -> Action:
    return Action(
        id=row["id"],
        incident_id=row["incident_id"],
        kind=row["kind"],
        target=_loads(row["target"]) or {},
        requested_at=row["requested_at"],
        completed_at=row["completed_at"],
        ok=None if row["ok"] is None else bool(row["ok"]),
        result=_loads(row["result"]),
        error=row["error"],
    )


# --------------------------------------------------------------------------- store


class IncidentStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per write.
            self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._conn.row_factory = sqlite3.Row
            self._setup()
        except sqlite3.Error as e:
            self.close()
            raise StoreError(f"{self.path}: not a usable SQLite incident database: {e}") from e
        except StoreError:
            self.close()
            raise

    # ---- setup

    def _setup(self) -> None:
        conn = self._db
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode = WAL")  # the first read: fails on a non-SQLite file
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        with self._write() as c:
            tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not tables:
                # Statement by statement: executescript() would commit our BEGIN first.
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        c.execute(statement)
                c.execute(
                    "INSERT INTO meta (key, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
                return
            if "meta" not in tables:
                raise StoreError(
                    f"{self.path}: an SQLite database but not a rankguard incident store "
                    f"(no meta table; tables: {', '.join(sorted(tables))})"
                )
            self._check_version(c)

    def _check_version(self, c: sqlite3.Connection) -> None:
        row = c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            raise StoreError(f"{self.path}: incident store without a schema_version")
        version = int(row[0])
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: incident store schema version {version} is newer than this "
                f"rankguard understands ({SCHEMA_VERSION}); upgrade rankguard or use another file"
            )
        if version < 2:  # version 1 kept job state and goodput in memory only
            for statement in _JOBS.split(";"):
                if statement.strip():
                    c.execute(statement)
        if version < 3:  # causes: every incident so far classified from its evidence
            for column in _CAUSE_COLUMNS.split(","):
                c.execute(f"ALTER TABLE incidents ADD COLUMN {column.strip()}")
            old = "SELECT id, key, kind, severity, summary, evidence FROM incidents"
            for row in c.execute(old).fetchall():
                finding = Finding(row["kind"], row["key"], row["severity"], row["summary"],
                                  evidence=_loads(row["evidence"]) or {})  # fmt: skip
                c.execute("UPDATE incidents SET cause = ?, cause_confidence = ?, cause_why = ? "
                          "WHERE id = ?", (*_cause_values(finding), row["id"]))  # fmt: skip
        if version < SCHEMA_VERSION:
            c.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'",
                      (str(SCHEMA_VERSION),))  # fmt: skip

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"{self.path}: incident store is closed")
        return self._conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock; rolled back on any error."""
        with self._lock:
            conn = self._db
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def _read(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> IncidentStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- incidents

    def upsert_finding(
        self,
        finding: Finding,
        now: float,
        restart_before: int | None = None,
        step_at_detect: int | None = None,
        checkpoint_step: int | None = None,
    ) -> tuple[Incident, bool]:
        """The incident for `finding.key`, created on first sight (state `open`). Seen again,
        an incident that is not yet terminal takes the finding's newer summary, severity
        and evidence, its culprit once one is named or an earlier fault time is seen (a
        node polled later shows the first death) unless it was acted on already; when it
        was detected never changes.
        `checkpoint_step` (the job's newest validated step now) feeds the crash-loop guard;
        missing values default to evidence `restart`, `step`, `checkpoint_step`."""
        ev = finding.evidence
        restart_before = _first(restart_before, ev.get("restart"))
        step_at_detect = _first(step_at_detect, ev.get("step"))
        checkpoint_step = _first(checkpoint_step, ev.get("checkpoint_step"))
        evidence = _dumps(ev)
        cause = _cause_values(finding)
        with self._write() as c:
            row = c.execute("SELECT * FROM incidents WHERE key = ?", (finding.key,)).fetchone()
            if row is None:
                cur = c.execute(
                    """INSERT INTO incidents (key, kind, severity, job, node, rank, summary,
                       evidence, state, detected_at, occurred_at, restart_before,
                       step_at_detect, checkpoint_step, updated_at, cause, cause_confidence,
                       cause_why)
                       VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                    (finding.key, finding.kind, finding.severity, finding.job, finding.node,
                     finding.rank, finding.summary, evidence, OPEN, now, finding.occurred_at,
                     restart_before, step_at_detect, checkpoint_step, now, *cause),
                )  # fmt: skip
                detail = {"kind": finding.kind, "summary": finding.summary}
                self._event(c, cur.lastrowid, now, "detected", detail)
                return self._get(c, cur.lastrowid), True
            if row["state"] in TERMINAL:
                return self._get(c, row["id"]), False
            node, rank, occurred = row["node"], row["rank"], row["occurred_at"]
            earlier = finding.occurred_at is not None and (
                occurred is None or finding.occurred_at < occurred
            )
            # A culprit named later (stacks), or an earlier death seen on a node polled
            # later, replaces the first guess; never once something was done to it.
            if finding.rank is not None and row["acted_at"] is None and (rank is None or earlier):
                node, rank = finding.node, finding.rank
            if earlier:
                occurred = finding.occurred_at
            # a step first known on a later look (a dead worker's last count arriving
            # after its death was announced) is still the step it was detected at
            step = _first(row["step_at_detect"], step_at_detect)
            new = (finding.summary, finding.severity, evidence, node, rank, occurred, step,
                   *cause)  # fmt: skip
            old = tuple(row[k] for k in ("summary", "severity", "evidence", "node", "rank",
                                         "occurred_at", "step_at_detect", *_CAUSE_NAMES))  # fmt: skip
            if new != old:
                c.execute(
                    """UPDATE incidents SET summary = ?, severity = ?, evidence = ?, node = ?,
                       rank = ?, occurred_at = ?, step_at_detect = ?, cause = ?,
                       cause_confidence = ?, cause_why = ?, updated_at = ? WHERE id = ?""",
                    (*new, now, row["id"]),
                )
            return self._get(c, row["id"]), False

    def get(self, incident_id: int) -> Incident | None:
        rows = self._read("SELECT * FROM incidents WHERE id = ?", (incident_id,))
        return _incident(rows[0]) if rows else None

    def by_key(self, key: str) -> Incident | None:
        rows = self._read("SELECT * FROM incidents WHERE key = ?", (key,))
        return _incident(rows[0]) if rows else None

    def open_incidents(self, job: str | None = None) -> list[Incident]:
        """Incidents not yet in a terminal state (`reported` ones included: the loop
        resolves them when their finding goes away), oldest first."""
        terminal = tuple(sorted(TERMINAL))
        sql = f"SELECT * FROM incidents WHERE state NOT IN ({', '.join('?' * len(terminal))})"
        args: tuple = terminal
        if job is not None:
            sql, args = sql + " AND job = ?", args + (job,)
        return [_incident(r) for r in self._read(sql + " ORDER BY detected_at, id", args)]

    def list_incidents(self, limit: int = 100, job: str | None = None) -> list[Incident]:
        """The newest incidents first."""
        where, args = ("WHERE job = ?", (job,)) if job is not None else ("", ())
        sql = f"SELECT * FROM incidents {where} ORDER BY detected_at DESC, id DESC LIMIT ?"
        return [_incident(r) for r in self._read(sql, args + (int(limit),))]

    def set_state(self, incident_id: int, state: str, now: float, **values: Any) -> Incident:
        """Move an incident along its lifecycle and record phase times with it, e.g.
        `set_state(i, "recovering", now, restarted_at=t)`. Entering a terminal state sets
        resolved_at (unless given); lost_steps follows from step_at_detect - resumed_step."""
        with self._write() as c:
            return self._set_state(c, incident_id, state, now, values)

    def apply(self, t: Transition, now: float) -> Incident:
        """One transition of `lifecycle.transitions`: state, columns and timeline events
        in one transaction."""
        with self._write() as c:
            for what, detail in t.events:
                self._event(c, t.incident_id, now, what, detail)
            return self._set_state(c, t.incident_id, t.state, now, dict(t.values))

    def _set_state(
        self, c: sqlite3.Connection, incident_id: int, state: str, now: float, values: dict
    ) -> Incident:
        if state not in STATES:
            raise ValueError(f"unknown incident state {state!r}; one of {', '.join(STATES)}")
        unknown = set(values) - SETTABLE
        if unknown:
            raise ValueError(f"cannot set {', '.join(sorted(unknown))} on an incident")
        cur = self._get(c, incident_id)
        if state != cur.state and state not in TRANSITIONS[cur.state]:
            raise InvalidTransition(f"incident {incident_id}: {cur.state} -> {state}")
        if state in TERMINAL and state != cur.state:
            values.setdefault("resolved_at", now)
        resumed = values.get("resumed_step", cur.resumed_step)
        before = values.get("step_at_detect", cur.step_at_detect)
        if "lost_steps" not in values and resumed is not None and before is not None:
            values["lost_steps"] = max(0, before - resumed)
        values.update(state=state, updated_at=now)
        cols = ", ".join(f"{k} = ?" for k in values)
        c.execute(f"UPDATE incidents SET {cols} WHERE id = ?", (*values.values(), incident_id))
        if state != cur.state:
            self._event(c, incident_id, now, state, {"from": cur.state})
        return self._get(c, incident_id)

    def stopped_incidents(self) -> list[Incident]:
        """Incidents that stopped a job (their verdicts say why)."""
        rows = self._read("SELECT * FROM incidents WHERE state = ? ORDER BY id", (STOPPED,))
        return [_incident(r) for r in rows]

    # ---- jobs: state, verdict and goodput, so a restarted supervisor goes on from them

    def save_job(self, p: JobProgress, now: float) -> None:
        with self._write() as c:
            c.execute(
                """INSERT INTO jobs (job, first_seen, max_step, useful_seconds, state, verdict,
                   updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT (job) DO UPDATE SET max_step = excluded.max_step,
                   useful_seconds = excluded.useful_seconds, state = excluded.state,
                   verdict = excluded.verdict, updated_at = excluded.updated_at""",
                (p.job, p.first_seen, p.max_step, p.useful_seconds, p.state, p.verdict, now),
            )

    def jobs(self) -> dict[str, JobProgress]:
        rows = self._read("SELECT * FROM jobs ORDER BY job")
        return {
            r["job"]: JobProgress(
                r["job"],
                r["first_seen"],
                r["max_step"],
                r["useful_seconds"],
                r["state"],
                r["verdict"],
            )  # fmt: skip
            for r in rows
        }

    def has_event(self, incident_id: int, what: str) -> bool:
        sql = "SELECT 1 FROM events WHERE incident_id = ? AND what = ? LIMIT 1"
        return bool(self._read(sql, (incident_id, what)))

    # ---- actions

    def begin_action(
        self,
        incident_id: int,
        kind: str,
        target: Mapping[str, Any],
        now: float,
        reason: str | None = None,
    ) -> int:
        """Record the intent to act, before acting. Raises ActionExists if this incident
        already has an action of this kind (also one left by a supervisor that crashed
        mid-action): the database enforces "never twice". An open incident moves to
        `acting`, and its action and acted_at are set."""
        with self._write() as c:
            inc = self._get(c, incident_id)
            try:
                cur = c.execute(
                    """INSERT INTO actions (incident_id, kind, target, requested_at)
                       VALUES (?, ?, ?, ?)""",
                    (incident_id, kind, _dumps(dict(target)), now),
                )
            except sqlite3.IntegrityError as e:
                raise ActionExists(f"incident {incident_id} already has a {kind} action") from e
            state = ACTING if inc.state == OPEN else inc.state
            c.execute(
                """UPDATE incidents SET action = ?, action_reason = COALESCE(?, action_reason),
                   acted_at = COALESCE(acted_at, ?), state = ?, updated_at = ? WHERE id = ?""",
                (kind, reason, now, state, now, incident_id),
            )
            self._event(c, incident_id, now, f"{kind} requested", {"target": dict(target)})
            if state != inc.state:
                self._event(c, incident_id, now, state, {"from": inc.state})
            return int(cur.lastrowid)

    def complete_action(
        self,
        action_id: int,
        ok: bool,
        now: float,
        result: Any = None,
        error: str | None = None,
    ) -> Action:
        with self._write() as c:
            row = c.execute("SELECT * FROM actions WHERE id = ?", (action_id,)).fetchone()
            if row is None:
                raise KeyError(f"no action {action_id}")
            c.execute(
                """UPDATE actions SET completed_at = ?, ok = ?, result = ?, error = ?
                   WHERE id = ?""",
                (now, int(bool(ok)), None if result is None else _dumps(result), error,
                 action_id),
            )  # fmt: skip
            what = f"{row['kind']} {'done' if ok else 'failed'}"
            detail = {"result": json_safe(result)} if ok else {"error": error}
            self._event(c, row["incident_id"], now, what, detail)
            row = c.execute("SELECT * FROM actions WHERE id = ?", (action_id,)).fetchone()
            return _action(row)

    def has_action(self, incident_id: int, kind: str | None = None) -> bool:
        """Whether an action (of `kind`, or any) was ever requested for the incident."""
        sql, args = "SELECT 1 FROM actions WHERE incident_id = ?", (incident_id,)
        if kind is not None:
            sql, args = sql + " AND kind = ?", args + (kind,)
        return bool(self._read(sql + " LIMIT 1", args))

    def actions(self, incident_id: int) -> list[Action]:
        rows = self._read(
            "SELECT * FROM actions WHERE incident_id = ? ORDER BY requested_at, id", (incident_id,)
        )
        return [_action(r) for r in rows]

    def pending_actions(self) -> list[Action]:
        """Intents never completed: what a supervisor that crashed mid-action left behind."""
        rows = self._read("SELECT * FROM actions WHERE completed_at IS NULL ORDER BY id")
        return [_action(r) for r in rows]

    # ---- events

    def add_event(
        self, incident_id: int, what: str, now: float, detail: Mapping[str, Any] | None = None
    ) -> int:
        with self._write() as c:
            self._get(c, incident_id)
            return self._event(c, incident_id, now, what, detail or {})

    def events(self, incident_id: int) -> list[Event]:
        rows = self._read(
            "SELECT * FROM events WHERE incident_id = ? ORDER BY at, id", (incident_id,)
        )
        return [
            Event(r["id"], r["incident_id"], r["at"], r["what"], _loads(r["detail"]) or {})
            for r in rows
        ]

    # ---- what the policy needs

    def restart_history(self, job: str, limit: int = 100) -> list[RestartRecord]:
        """The job's newest `limit` restart incidents (dead ranks, and incidents we killed
        or excluded a node for), oldest first, with the checkpoint step at each."""
        kinds = tuple(sorted(RESTART_ACTIONS))
        rows = self._read(
            f"""SELECT key, detected_at, restart_before, checkpoint_step, cause,
                cause_confidence FROM incidents i
                WHERE job = ? AND (kind = ? OR EXISTS (
                    SELECT 1 FROM actions a WHERE a.incident_id = i.id
                    AND a.kind IN ({", ".join("?" * len(kinds))})))
                ORDER BY detected_at DESC, id DESC LIMIT ?""",
            (job, RANK_DEAD, *kinds, int(limit)),
        )
        records = [RestartRecord(*r[:4], known_cause(Cause(r[4], r[5], ""))) for r in rows]
        return records[::-1]

    def restart_action_times(self, job: str, since: float) -> list[float]:
        """When restart-causing actions (kill_rank, exclude_node) were requested for the
        job after `since`, oldest first: the restart budget and backoff."""
        kinds = tuple(sorted(RESTART_ACTIONS))
        rows = self._read(
            f"""SELECT a.requested_at FROM actions a JOIN incidents i ON i.id = a.incident_id
                WHERE i.job = ? AND a.requested_at > ?
                AND a.kind IN ({", ".join("?" * len(kinds))}) ORDER BY a.requested_at""",
            (job, since, *kinds),
        )
        return [r[0] for r in rows]

    def exclusions(self, since: float) -> list[tuple[float, str]]:
        """(requested_at, node) of every exclude_node action after `since`, cluster-wide,
        oldest first: the fleet brake."""
        rows = self._read(
            """SELECT a.requested_at, a.target FROM actions a
               WHERE a.kind = ? AND a.requested_at > ? ORDER BY a.requested_at""",
            (ACT_EXCLUDE_NODE, since),
        )
        return [(t, str(json.loads(target or "{}").get("node"))) for t, target in rows]

    def stopped_at(self, job: str) -> float | None:
        rows = self._read(
            """SELECT MAX(a.requested_at) FROM actions a JOIN incidents i ON i.id = a.incident_id
               WHERE i.job = ? AND a.kind = ?""",
            (job, ACT_STOP_JOB),
        )
        return rows[0][0]

    def by_cause(self) -> list[CauseTotals]:
        """Every cause class with its incidents, the time the job trained nothing (from the
        fault to the first step after the restart) and the steps it did again: the fleet's
        own interruptions-by-cause table, most incidents first."""
        rows = self._read(
            """SELECT cause, COUNT(*), SUM(first_step_at - COALESCE(occurred_at, detected_at)),
                      SUM(lost_steps), SUM(first_step_at IS NOT NULL) FROM incidents
               GROUP BY cause"""
        )
        found = {r[0]: CauseTotals(r[0], r[1], r[2] or 0.0, r[3] or 0, r[4]) for r in rows}
        totals = [found.get(c, CauseTotals(c)) for c in CAUSES] + [
            t
            for c, t in sorted(found.items())
            if c not in CAUSES  # a newer store's class
        ]
        return sorted(totals, key=lambda t: -t.incidents)

    def crash_loops(self, job: str) -> list[Incident]:
        rows = self._read(
            "SELECT * FROM incidents WHERE job = ? AND kind = ? ORDER BY id", (job, CRASH_LOOP)
        )
        return [_incident(r) for r in rows]

    def action_kinds(self, incident_id: int) -> tuple[str, ...]:
        rows = self._read(
            "SELECT kind FROM actions WHERE incident_id = ? ORDER BY id", (incident_id,)
        )
        return tuple(r[0] for r in rows if r[0] != ACT_NONE)

    # ---- internals

    def _get(self, c: sqlite3.Connection, incident_id: int) -> Incident:
        row = c.execute("SELECT * FROM incidents WHERE id = ?", (incident_id,)).fetchone()
        if row is None:
            raise KeyError(f"no incident {incident_id}")
        return _incident(row)

    @staticmethod
    def _event(
        c: sqlite3.Connection, incident_id: int, at: float, what: str, detail: Mapping[str, Any]
    ) -> int:
        cur = c.execute(
            "INSERT INTO events (incident_id, at, what, detail) VALUES (?, ?, ?, ?)",
            (incident_id, at, what, _dumps(dict(detail))),
        )
        return int(cur.lastrowid)


_CAUSE_NAMES = ("cause", "cause_confidence", "cause_why")


def _cause_values(finding: Finding) -> tuple[str, str, str]:
    c = classify(finding)
    return c.cause, c.confidence, c.why


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)
