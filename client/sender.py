"""Rank-side telemetry sender: one datagram per record, never raising, and never blocking
unless asked to (:attr:`TelemetrySender.patience`, at the end of training).

Training must not slow down or die because the node agent is absent, restarting or
behind. :class:`TelemetrySender` therefore sends over a non-blocking ``AF_UNIX``
``SOCK_DGRAM`` socket created once, and any failure (no socket file, nobody bound to
it, receiver queue full, encoding error, anything else) drops the record and bumps a
counter instead. At the end, when nothing is left to slow down, the Reporter sets
``patience``: a record that finds the queue full then waits that long for room (the last
steps and "done" of all of a node's ranks arrive at once; a lost "done" reads as a death).
Every record that leaves carries those counters, and the caller's own
(``errors``: the Reporter's), in its ``client_errors`` field, so the agent shows them per
rank (``/v1/ranks``, ``rankguard_client_errors_total``); drops are named ``dropped_<reason>``.
Stdlib only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import socket
import struct
import threading
from collections.abc import Mapping
from typing import Any

from ..contract.telemetry import MAX_CLIENT_ERRORS, TelemetryRecord, encode, is_reason_name

__all__ = ["DROP_REASONS", "TelemetrySender"]

log = logging.getLogger(__name__)

#: Every key dropped_by_reason can hold.
DROP_REASONS = (
    "disabled",  # path is None: telemetry turned off
    "closed",  # send after close()
    "invalid",  # record failed validation / encoding
    "no_socket",  # ENOENT: no socket file (agent not running)
    "refused",  # ECONNREFUSED: stale socket file, nobody bound
    "queue_full",  # EAGAIN / EWOULDBLOCK / ENOBUFS: receiver is behind
    "socket_error",  # any other OSError (including failing to create the socket)
)

_ERRNO_REASONS = {
    errno.ENOENT: "no_socket",
    errno.ECONNREFUSED: "refused",
    errno.EAGAIN: "queue_full",
    errno.EWOULDBLOCK: "queue_full",
    errno.ENOBUFS: "queue_full",
}


class TelemetrySender:
    """Fire-and-forget sender of :class:`TelemetryRecord` datagrams to ``path``.

    ``path=None`` disables it: every send is dropped with reason ``"disabled"``.
    ``sent``/``dropped`` count records; ``dropped_by_reason`` maps a reason from
    :data:`DROP_REASONS` to its count. The first drop of each reason is logged once
    at WARNING (``"disabled"`` is not logged). Thread safe: the counters and the
    socket are guarded by a lock (a heartbeat thread may send beside the loop).
    """

    def __init__(self, path: str | None, errors: Mapping[str, int] | None = None) -> None:
        self.path = path
        # the caller's failure counters, sent along with ours (read, never written, here)
        self.caller_errors: Mapping[str, int] = {} if errors is None else errors
        self.sent = 0
        self.dropped = 0
        self.dropped_by_reason: dict[str, int] = {}
        self.closed = False
        # seconds a record that finds the receiver's queue full waits for room (0: drop it)
        self.patience = 0.0
        self._sock: socket.socket | None = None
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.path is not None and not self.closed

    def send(self, record: TelemetryRecord | Mapping[str, Any]) -> bool:
        """Send one record; True if the kernel took it, False if it was dropped.

        ``record`` is a :class:`TelemetryRecord` or a mapping of its fields (a
        mapping that fails validation is dropped as ``"invalid"`` rather than
        raising). Never blocks, never raises an ``Exception``.
        """
        with self._lock:
            return self._send(record)

    def _send(self, record: TelemetryRecord | Mapping[str, Any]) -> bool:
        if self.path is None:
            return self._drop("disabled")
        if self.closed:
            return self._drop("closed")
        try:
            counts = self._error_counts()
            if isinstance(record, TelemetryRecord):
                if counts:
                    record = dataclasses.replace(record, client_errors=counts)
                data = encode(record)  # revalidated: a record can be altered after its check
            else:  # validated by its constructor just now
                if counts:
                    record = {**record, "client_errors": counts}
                data = encode(TelemetryRecord.from_dict(record), validate=False)
        except Exception as e:  # nothing may reach the training loop
            return self._drop("invalid", e)
        try:
            sock = self._sock
            if sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.setblocking(False)
                self._sock = sock
            try:
                sock.sendto(data, self.path)
            except BlockingIOError:
                if self.patience <= 0:
                    raise
                _send_waiting(data, self.path, self.patience)
        except OSError as e:
            return self._drop(_ERRNO_REASONS.get(e.errno, "socket_error"), e)
        except Exception as e:  # e.g. a path with a NUL byte
            return self._drop("socket_error", e)
        self.sent += 1
        return True

    def _error_counts(self) -> dict[str, int] | None:
        """What ``client_errors`` carries: drops and the caller's counts, only names the
        contract takes (a bad one must not get every later record dropped), bounded."""
        counts = {f"dropped_{r}": n for r, n in self.dropped_by_reason.items() if n}
        counts.update((r, n) for r, n in dict(self.caller_errors).items() if n)
        valid = [(r, n) for r, n in counts.items() if is_reason_name(r) and type(n) is int]
        return dict(valid[:MAX_CLIENT_ERRORS]) or None

    def _drop(self, reason: str, exc: BaseException | None = None) -> bool:
        self.dropped += 1
        self.dropped_by_reason[reason] = self.dropped_by_reason.get(reason, 0) + 1
        if reason != "disabled" and reason not in self._logged:
            self._logged.add(reason)
            with contextlib.suppress(Exception):  # logging must not break training either
                log.warning(
                    "telemetry record dropped (%s) sending to %s: %s; further drops "
                    "for this reason are only counted",
                    reason,
                    self.path,
                    exc,
                )
        return False

    def count_drop(self, reason: str, exc: BaseException | None = None) -> None:
        """Count a record that never reached :meth:`send` (e.g. ``"invalid"`` when the
        caller could not even build its fields)."""
        with self._lock:
            self._drop(reason, exc)

    def close(self) -> None:
        """Close the socket; later sends are dropped as ``"closed"``. Idempotent."""
        with self._lock:
            self.closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> TelemetrySender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"TelemetrySender(path={self.path!r}, sent={self.sent}, dropped={self.dropped}, "
            f"dropped_by_reason={self.dropped_by_reason!r})"
        )


def _send_waiting(data: bytes, path: str, patience: float) -> None:
    """Send on a blocking socket whose send timeout is ``patience``: the kernel waits for
    room in the receiver's queue (an unconnected datagram socket is never reported writable
    by poll for that, so a non-blocking retry loop would only spin). OSError (EAGAIN) when
    no room came in time."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        seconds = int(patience)
        timeout = struct.pack("ll", seconds, int((patience - seconds) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
        sock.sendto(data, path)
