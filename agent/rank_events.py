"""``/v1/rank-events``: rank state changes as they happen, for a supervisor's long poll.

Why: a death is known here at once (the pidfd watcher), but a supervisor reading
``/v1/ranks`` sees it only on its next poll of this node, and at 1,024 nodes a round of
polls takes seconds (docs/scaling.md). This endpoint carries only the state changes, so
a supervisor can hold one request open per agent and act on a death within a pass.

A bounded buffer of the table's events (fed by ``RankTable.subscribe``), numbered by its
own counter, read with the cursor form of ``/v1/ranks`` (contract/cursor.py). A request
with nothing new waits up to ``wait`` seconds (at most :data:`MAX_WAIT_SECONDS`) for the
next event. A held request costs the agent one thread and one connection of the HTTP
server's caps (service/httpd.py: 256 in all, 64 per client), so at most ``max_waiters``
wait at once; one more is answered 503 at once (a supervisor holds one per agent).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from ..contract.answers import RankEventAnswer, RankEventsAnswer
from ..contract.cursor import CursorError, Since, answer_fields, since
from ..contract.cursor import new_incarnation as _new_incarnation
from ..contract.states import RANK_STATES
from ..service.httpd import HttpError
from .ranks import RankEvent

MAX_WAIT_SECONDS = 30.0
CAPACITY = 1024  # events kept: a node's 8 ranks change state a few times per restart
MAX_WAITERS = 8


class Busy(HttpError):
    def __init__(self) -> None:
        super().__init__(503, "too many held /v1/rank-events requests", {"Retry-After": "1"})


def parse_wait(query: dict[str, str]) -> float:
    """``wait``: seconds in [0, MAX_WAIT_SECONDS]; absent is 0 (answer at once)."""
    text = query.get("wait")
    if text is None:
        return 0.0
    try:
        value = float(text) if len(text) <= 16 else math.nan
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= MAX_WAIT_SECONDS:  # NaN fails too
        raise CursorError(
            f"wait: expected seconds from 0 to {MAX_WAIT_SECONDS:g}, got {text[:20]!r}"
        )
    return value


def parse_states(query: dict[str, str]) -> frozenset[str] | None:
    """``states``: a comma-separated list of rank states; only changes into one of them
    are answered (and only they end a held request). Absent: every change."""
    text = query.get("states")
    if text is None:
        return None
    states = frozenset(text.split(","))
    if not states <= set(RANK_STATES):
        bad = sorted(states - set(RANK_STATES))[0]
        raise CursorError(f"states: {bad[:20]!r} is not one of {', '.join(RANK_STATES)}")
    return states


def select(
    events: deque[RankEventAnswer], s: Since, newest: int, states: frozenset[str] | None = None
) -> tuple[tuple, str | None]:
    """The events after ``s`` (into one of ``states``, when given) and why the answer is
    full (None: only what is new). A cursor whose next event fell out of the buffer is
    full: what follows it may be missing."""
    oldest = events[0].seq if events else newest + 1
    full = s.full
    if full is None and s.seq + 1 < oldest:
        full = "cursor older than the agent's event buffer (events dropped)"
    if full is not None:
        out = list(events)
    else:  # events are in seq order, the newest last: walk back from the end
        out = []
        for e in reversed(events):
            if e.seq <= s.seq:
                break
            out.append(e)
        out.reverse()
    if states is not None:
        out = [e for e in out if e.state in states]
    return tuple(out), full


class RankEventLog:
    def __init__(
        self,
        capacity: int = CAPACITY,
        max_waiters: int = MAX_WAITERS,
        to_unix: Callable[[float], float] = lambda t: t,
    ):
        self.incarnation = _new_incarnation()
        self.max_waiters = max_waiters
        self._to_unix = to_unix  # the table's clock -> Unix time
        self._events: deque[RankEventAnswer] = deque(maxlen=capacity)
        self._seq = 0
        self._cond = threading.Condition()
        self._waiters = 0
        self._closed = False
        self.busy = 0  # requests refused for the waiter cap

    def add(self, event: RankEvent) -> None:
        """A ``RankTable.subscribe`` callback (any thread)."""
        with self._cond:
            self._seq += 1
            self._events.append(RankEventAnswer(
                self._seq, event.job, event.rank, event.pid, event.restart, event.previous,
                event.state, self._to_unix(event.at), event.detail, event.step,
                event.checkpoint_step,
            ))  # fmt: skip
            self._cond.notify_all()

    def _news(self, seq: int, states: frozenset[str] | None) -> bool:
        """An event after ``seq`` into one of ``states`` (None: any)."""
        if states is None:
            return self._seq > seq
        for e in reversed(self._events):
            if e.seq <= seq:
                return False
            if e.state in states:
                return True
        return False

    def read(
        self,
        after: str | None,
        wait: float,
        node: str = "",
        states: frozenset[str] | None = None,
    ) -> RankEventsAnswer:
        """The answer to ``after`` (absent: every event held), after waiting up to ``wait``
        seconds for one (into one of ``states``, when given) when there is none. The
        cursor moves past the events left out. Raises CursorError (400), Busy (503)."""
        deadline = time.monotonic() + wait
        with self._cond:
            s = since(after or "start", self.incarnation, self._seq)
            assert s is not None
            if s.full is None and not self._news(s.seq, states) and wait > 0 and not self._closed:
                if self._waiters >= self.max_waiters:
                    self.busy += 1
                    raise Busy()
                self._waiters += 1
                try:
                    while not self._news(s.seq, states) and not self._closed:
                        left = deadline - time.monotonic()
                        if left <= 0 or not self._cond.wait(left):
                            break
                finally:
                    self._waiters -= 1
            events, full = select(self._events, s, self._seq, states)
            fields = answer_fields(Since(s.seq, full), self.incarnation, self._seq)
        return RankEventsAnswer(node=node, time=time.time(), events=events, **fields)

    def close(self) -> None:
        """Answer every held request now (the agent is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
