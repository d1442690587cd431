"""Cursors for incremental ``/v1/ranks`` reads (``GET /v1/ranks?after=<cursor>``).

Every step sample an agent keeps gets a sequence number from one per-agent counter that
only grows, so "the samples after this one" is well defined for every rank at once, and
stays so when old samples fall out of a rank's 64-deep window (a step number would not:
steps go back after a restart from a checkpoint, and the same step number recurs).

A cursor is ``<incarnation>-<seq>``: ``incarnation`` is random per agent process (so a
cursor from before an agent restart is recognised as foreign, never misread as a position
in the new counter), ``seq`` the newest number handed out when the answer was made.

What an ``after`` value means (:func:`since`):

- absent: the legacy answer, exactly as before cursors (no ``seq``, no ``cursor``);
- ``start``: everything, in the incremental format (a client's first read);
- a cursor of this incarnation: only the samples numbered above it;
- a well-formed cursor of another incarnation, or one ahead of this agent's counter:
  everything, marked ``"full": true`` with the reason, so the client replaces what it
  holds instead of losing or mixing samples;
- anything else (not ``<hex>-<digits>``, too long, a number over 2**63): a 400, a client
  bug that a silent full answer would hide.

The agent (agent/ranks.py), the simulator in ``bench/agent_sim.py`` and the supervisor
(supervisor/windows.py, for :data:`START`) use these functions; the answer's fields are
:class:`~.answers.RanksAnswer`'s ``cursor``, ``full`` and ``full_reason``.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, NamedTuple

START = "start"
MAX_SEQ = 2**63 - 1
_CURSOR = re.compile(r"([0-9a-f]{1,32})-([0-9]{1,19})")


class CursorError(ValueError):
    """A malformed ``after`` value: answered 400."""


class Since(NamedTuple):
    seq: int  # serve samples numbered above this (0: every sample)
    full: str | None  # why the answer holds everything (None: only what is new)


def new_incarnation() -> str:
    return secrets.token_hex(8)


def format_cursor(incarnation: str, seq: int) -> str:
    return f"{incarnation}-{seq}"


def parse_cursor(text: str) -> tuple[str, int]:
    m = _CURSOR.fullmatch(text)
    if m is None:
        raise CursorError(
            f"after: expected {START!r} or a cursor '<hex>-<number>' from an earlier answer, "
            f"got {text[:40]!r}"
        )
    seq = int(m.group(2))
    if seq > MAX_SEQ:
        raise CursorError(f"after: sequence number {seq} is out of range")
    return m.group(1), seq


def since(after: str | None, incarnation: str, newest: int) -> Since | None:
    """What an answer to ``after`` holds, given the agent's incarnation and the newest
    sequence number it handed out; None for the legacy answer. Raises CursorError."""
    if after is None:
        return None
    if after == START:
        return Since(0, START)
    theirs, seq = parse_cursor(after)
    if theirs != incarnation:
        return Since(0, "cursor from another agent incarnation (agent restarted)")
    if seq > newest:
        return Since(0, "cursor ahead of this agent's samples")
    return Since(seq, None)


def answer_fields(s: Since, incarnation: str, newest: int) -> dict[str, Any]:
    """The answer-level fields of an incremental answer: :class:`~.answers.RanksAnswer`'s
    ``cursor``, ``full`` and ``full_reason``."""
    return {"cursor": format_cursor(incarnation, newest), "full": s.full is not None,
            "full_reason": s.full}  # fmt: skip
