"""The agent's end of the telemetry socket: receive, verify the sender, feed the table.

One ``AF_UNIX`` ``SOCK_DGRAM`` socket; one daemon thread drains it. Every datagram is
either accepted into the :class:`~.ranks.RankTable` or counted as rejected under a
bounded reason (:data:`RECEIVER_REASONS`); no input stops the thread.

Trust. ``SO_PASSCRED`` makes the kernel attach the sender's credentials to every
datagram, and a record is accepted only if its ``pid`` is that kernel-verified PID
(reason ``pid_mismatch`` otherwise). So a local user allowed to write to the socket
cannot register someone else's process (pid 1, say) as a rank and later have the agent
signal it. Only a sender with CAP_SYS_ADMIN can forge credentials, and it needs no
agent to signal anything. A trainer in another PID namespace (a container without
``--pid=host``) shows up as ``pid_mismatch`` too: its own idea of its PID is not the
agent's.

Ownership and quotas (docs/security.md). The kernel also vouches for the sender's uid:
a (job, rank) belongs to the uid and launcher of its first registration until that
launcher exits (``foreign_owner`` otherwise; see ranks.py). Each sender uid has a token
bucket of records per second, checked before decoding so that refusing a flood is cheap
(``quota``), and a share of the table (``rank_quota``); root and the agent's own uid get
``privileged_factor`` times the rate. ``pressure_at`` remembers when the socket was last
under pressure (a refusal for quota, or a drain that found a full batch waiting): records
of honest ranks may have been lost then, and the supervisor's hang detector does not take
their silence as a hang while their processes are busy.

Queueing. The kernel bounds a Unix datagram queue by ``net.unix.max_dgram_qlen``
(often 10 datagrams) as well as by buffer space; senders drop on a full queue without
blocking, so this thread only decodes and hands over, nothing slow.

Batching (issue 16). A wake-up costs several times what judging a record does (the
scheduler, ``poll``, the GIL hand-over: about 150 us against 15 us on a 2-core VM), so the
thread does not wake per datagram: after a drain it lets datagrams gather for a while
(:class:`Pacer`: half the kernel queue, at most 128 datagrams, at the rate just seen,
at most 0.5 s); with sparse traffic, or after an empty drain, it blocks until the next
datagram (an idle agent never wakes, and a lone record is judged at once). Each record is
dated by the kernel's receive timestamp, not by the drain. Only where the kernel queue is
long enough (:func:`batch_wait`: ``net.unix.max_dgram_qlen`` >= 64, which deploy/sysctl.d
sets): with the default 10, ranks' bursts overflow it during a wait. Records may then wait
in the queue, so whoever needs the table current drains first (:meth:`flush`): the rank
table before it marks an exited process dead (a final "done" record makes it finished, not
exited), and ``/v1/ranks`` before it answers.
"""

from __future__ import annotations

import array
import contextlib
import errno
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from ..contract.telemetry import (
    MAX_DATAGRAM_BYTES,
    REASONS,
    TelemetryError,
    TelemetryRecord,
    decode,
    fast_record,
)
from .ranks import ForeignOwnerError, RankQuotaError, RankTable, RankTableFullError

__all__ = [
    "RECEIVER_REASONS",
    "Pacer",
    "SocketInUseError",
    "TelemetryReceiver",
    "batch_wait",
    "unix_dgram_qlen",
]

log = logging.getLogger("rankguard.agent.receiver")

#: Every reason a datagram can be rejected for (a bounded label set).
RECEIVER_REASONS: tuple[str, ...] = (
    *REASONS,
    "pid_mismatch",  # the record's pid is not the kernel-verified sender's
    "no_credentials",  # no SCM_CREDENTIALS attached (should not happen with SO_PASSCRED)
    "table_full",  # a new rank beyond the table's cap
    "foreign_owner",  # the (job, rank) belongs to another uid or launcher
    "quota",  # the sender's uid sent more records per second than its quota
    "rank_quota",  # a new rank beyond the sender uid's share of the table
    "internal_error",  # a bug on our side; logged with its traceback
)

_UCRED = struct.Struct("iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid
# The kernel's receive time of each datagram (SCM_TIMESTAMP, a struct timeval): a record
# that waited in the queue for a batched drain is dated when it arrived, so a rank's
# heartbeat age does not shrink by the wait. Not in Python's socket module: Linux's
# generic SO_TIMESTAMP(_OLD), the same number as SCM_TIMESTAMP.
_SO_TIMESTAMP = 29
_TIMEVAL = struct.Struct("@ll")
# room for credentials and the timestamp, nothing more
_ANC_BUFSIZE = socket.CMSG_SPACE(_UCRED.size) + socket.CMSG_SPACE(_TIMEVAL.size)
_RECV_BUFSIZE = MAX_DATAGRAM_BYTES + 1  # one byte more than allowed reveals oversize
_DRAIN_BATCH = 256  # datagrams per wake-up before checking for close()
_QLEN_FILE = "/proc/sys/net/unix/max_dgram_qlen"
_DEFAULT_QLEN = 10  # the kernel's default, when the sysctl cannot be read
_MAX_PATH_BYTES = 107  # sun_path is 108 bytes with the terminating NUL
_MAX_BUCKETS = 4096  # sender uids with a token bucket; full buckets are dropped beyond
# seconds between drains when batching: how stale an unread record may get. Readers
# that need the table current drain first (flush), so the wait never shows in answers.
BATCH_WAIT = 0.5
BATCH_MAX = 128  # datagrams a wait aims at: within a default receive buffer, with room
BATCH_MIN_QLEN = 64  # kernel queue that batching needs (auto): 8 ranks' bursts, with room


class Quota:
    """Records per second per sender uid: a token bucket each (pure, clock passed in).

    ``rate`` tokens a second up to ``burst``; the ``privileged`` uids get ``factor``
    times both. Bounded: beyond ``_MAX_BUCKETS`` uids, buckets that are full again (their
    uid has been quiet) are forgotten.
    """

    def __init__(
        self, rate: float, burst: float, privileged: frozenset[int], factor: float = 10.0
    ) -> None:
        if rate <= 0 or burst < 1 or factor < 1:
            raise ValueError("quota rate must be > 0, burst >= 1, factor >= 1")
        self.rate, self.burst, self.privileged, self.factor = rate, burst, privileged, factor
        self._buckets: dict[int, tuple[float, float]] = {}  # uid -> (tokens, at)

    def allow(self, uid: int, now: float) -> bool:
        scale = self.factor if uid in self.privileged else 1.0
        rate, burst = self.rate * scale, self.burst * scale
        tokens, at = self._buckets.get(uid, (burst, now))
        tokens = min(burst, tokens + max(0.0, now - at) * rate)
        ok = tokens >= 1.0
        self._buckets[uid] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > _MAX_BUCKETS:
            self._forget_full(now)
        return ok

    def _forget_full(self, now: float) -> None:
        for uid, (tokens, at) in list(self._buckets.items()):
            scale = self.factor if uid in self.privileged else 1.0
            if tokens + (now - at) * self.rate * scale >= self.burst * scale:
                del self._buckets[uid]


class Pacer:
    """How long the receiver lets datagrams gather before its next drain (pure: the
    caller passes the time).

    ``qlen`` datagrams fit in the kernel's queue; a sender that finds it full drops its
    record. So the wait aims at ``fill`` of the queue (at most ``max_batch`` datagrams: the
    receive buffer holds a few hundred) at the rate the last drain saw, and never exceeds
    ``max_wait`` (how stale an unread record may get). Where fewer than
    ``min_batch`` records would gather in ``max_wait`` (sparse traffic, or the first drain:
    no rate yet) waiting saves nothing and only delays: block until the next datagram. A
    drain that found the queue at its cap halves the wait and reports pressure (senders
    may have dropped); an empty drain blocks too (an idle agent never wakes).
    """

    def __init__(
        self,
        qlen: int,
        *,
        max_wait: float = BATCH_WAIT,
        fill: float = 0.5,
        min_batch: float = 2.0,
        max_batch: int = BATCH_MAX,
    ) -> None:
        if qlen < 1 or max_wait < 0 or not 0 < fill <= 1 or min_batch < 0 or max_batch < 1:
            raise ValueError(
                "qlen >= 1, max_wait >= 0, 0 < fill <= 1, min_batch >= 0, max_batch >= 1"
            )
        self.qlen, self.max_wait, self.fill, self.min_batch = qlen, max_wait, fill, min_batch
        self.target = min(fill * qlen, max_batch)  # datagrams to let gather
        self.wait: float | None = None  # None: block until a datagram arrives
        self._last: float | None = None

    def next_wait(self, n: int, now: float) -> tuple[float | None, bool]:
        """After a drain of ``n`` datagrams at ``now``: (seconds to wait before the next
        drain, or None to block until one arrives; whether the queue was at its cap)."""
        elapsed = None if self._last is None else now - self._last
        self._last = now
        if n >= self.qlen:
            self.wait = None if self.wait is None else self.wait / 2
            return self.wait, True
        rate = n / elapsed if elapsed else 0.0  # records per second, as this drain saw
        if n == 0 or rate * self.max_wait < self.min_batch:
            self.wait = None
        elif rate == 0:  # no rate yet (min_batch 0: always wait)
            self.wait = self.max_wait
        else:
            self.wait = min(self.max_wait, self.target / rate)
        return self.wait, False


def unix_dgram_qlen(path: str = _QLEN_FILE) -> int:
    """The kernel's cap on a Unix datagram socket's queue (``net.unix.max_dgram_qlen``)."""
    try:
        return max(1, int(Path(path).read_text()))
    except (OSError, ValueError):
        return _DEFAULT_QLEN


def batch_wait(setting: float | None, qlen: int) -> float:
    """The receiver's longest wait between drains: ``setting`` itself, or with None (auto)
    :data:`BATCH_WAIT` where the kernel queue holds at least :data:`BATCH_MIN_QLEN`
    datagrams and 0 (block per datagram) where it does not. With the default queue of 10,
    a wait let 2 ranks' final bursts (last steps, checkpoint, "done") overflow it, and a
    dropped "done" read as a death; a queue raised by sysctl (deploy/sysctl.d) holds a
    whole node's records for the wait."""
    if setting is not None:
        return setting
    return BATCH_WAIT if qlen >= BATCH_MIN_QLEN else 0.0


class SocketInUseError(OSError):
    """Another process is listening on the telemetry socket path."""


class TelemetryReceiver:
    """Receives telemetry datagrams on ``path`` and feeds ``table``.

    Binds at construction and starts the receiving thread. ``mode`` is the socket
    file's permission (who may send: owner and group by default). ``rcvbuf`` is asked
    for as SO_RCVBUF (the kernel may cap it). Raises :class:`SocketInUseError` if
    another receiver answers on ``path``, ``FileExistsError`` if ``path`` exists and is
    not a socket (it is never deleted), ``ValueError`` for a path too long for a Unix
    socket.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        table: RankTable,
        mode: int = 0o660,
        *,
        rcvbuf: int = 4 << 20,
        group: int | None = None,
        quota_rate: float = 2000.0,
        quota_burst: float = 4000.0,
        privileged_factor: float = 10.0,
        clock=time.monotonic,
        # None (auto): gather only where the kernel queue is long enough (BATCH_MIN_QLEN);
        # 0: block per datagram; > 0: wait up to this long between drains.
        max_wait: float | None = None,
    ) -> None:
        self.path = Path(path)
        self.table = table
        self.mode = mode
        self.group = group  # the socket file's gid (who may send, with mode 0o660)
        privileged = getattr(table, "privileged_uids", frozenset({0, os.getuid()}))
        self.quota = Quota(quota_rate, quota_burst, privileged, privileged_factor)
        self._clock = clock
        self.pressure_at: float | None = None  # Unix time of the last sign of lost records
        self._lock = threading.Lock()
        self._accepted = 0
        self._rejected = dict.fromkeys(RECEIVER_REASONS, 0)
        self._last_error: dict[str, str] = {}
        self._closed = False
        # one drain at a time: the receiving thread's, or a reader's flush()
        self._drain_lock = threading.Lock()
        qlen = unix_dgram_qlen()
        self.pacer = Pacer(qlen, max_wait=batch_wait(max_wait, qlen))
        self.wakeups = 0  # drains by the receiving thread (what batching saves)
        self._sock = self._bind(rcvbuf)
        self._inode = os.stat(self.path).st_ino
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(
            target=self._run, name="rankguard-telemetry-receiver", daemon=True
        )
        self._thread.start()
        # The table drains the socket before it marks an exited process dead.
        table.flush_telemetry = self.flush

    # -- socket set-up ----------------------------------------------------------------
    def _bind(self, rcvbuf: int) -> socket.socket:
        if len(os.fsencode(self.path)) > _MAX_PATH_BYTES - 8:  # room for the temp suffix
            raise ValueError(f"telemetry socket path too long for a Unix socket: {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            # Before bind, so that no datagram is ever queued without credentials.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            with contextlib.suppress(OSError):  # without it, records are dated when drained
                sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMP, 1)
            sock.setblocking(False)
            # Bind under a temporary name, chmod, then rename into place: the socket is
            # never reachable with the umask's (possibly wider) permissions.
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.lstat(tmp).st_mode):
                    os.unlink(tmp)
            sock.bind(str(tmp))
            if self.group is not None:
                os.chown(tmp, -1, self.group)
            os.chmod(tmp, self.mode)
            os.rename(tmp, self.path)
        except BaseException:
            sock.close()
            raise
        return sock

    # -- receiving --------------------------------------------------------------------
    def _run(self) -> None:
        both, wake = select.poll(), select.poll()
        both.register(self._sock.fileno(), select.POLLIN)
        both.register(self._wake_r, select.POLLIN)
        wake.register(self._wake_r, select.POLLIN)
        wait: float | None = None  # None: block until a datagram arrives
        while not self._closed:
            try:
                # a wait lets datagrams gather; only close() cuts it short
                ready = both.poll() if wait is None else wake.poll(int(wait * 1000))
            except OSError as e:  # not expected; never let the thread die
                log.warning("telemetry poll failed: %s", e)
                wait = None
                continue
            if any(fd == self._wake_r for fd, _ in ready):
                return
            self.wakeups += 1
            n = self.flush()
            try:
                wait, full = self.pacer.next_wait(n, self._clock())
            except Exception:  # a pacing bug must not stop the receiving
                log.exception("telemetry pacing failed")
                wait, full = None, False
            if full:  # the queue was at its cap: senders may have found it full
                with self._lock:
                    self.pressure_at = time.time()

    def flush(self) -> int:
        """Judge every datagram waiting on the socket now (up to 256); how many there were.
        Safe from any thread: the receiving thread calls it after each wait, and readers
        that need the table current call it first."""
        with self._drain_lock:
            if self._closed:
                return 0
            n = self._drain()
        if n >= _DRAIN_BATCH:  # a full batch: the queue was long
            with self._lock:
                self.pressure_at = time.time()
        return n

    def _drain(self) -> int:
        sock, handle = self._sock, self.handle
        drained_at = time.time()  # a datagram's age: from its kernel timestamp to now
        for n in range(_DRAIN_BATCH):
            try:
                data, ancdata, flags, _addr = sock.recvmsg(_RECV_BUFSIZE, _ANC_BUFSIZE)
            except (BlockingIOError, InterruptedError):
                return n
            except OSError as e:
                if e.errno != errno.EAGAIN:
                    self._reject("internal_error", f"recvmsg failed: {e}")
                return n
            try:
                cred, arrived = _ancillary(ancdata)
                pid, uid = (cred[0], cred[1]) if cred else (None, None)
                age = 0.0 if arrived is None else max(0.0, drained_at - arrived)
                handle(data, pid, truncated=bool(flags & socket.MSG_TRUNC), uid=uid, age=age)
            except Exception as e:
                log.exception("telemetry datagram handling failed")
                self._reject("internal_error", repr(e))
        return _DRAIN_BATCH

    def handle(
        self,
        data: bytes,
        sender_pid: int | None,
        truncated: bool = False,
        *,
        uid: int | None = None,
        age: float = 0.0,
    ) -> str | None:
        """Judge one datagram from ``sender_pid`` and ``uid`` (pid None: no credentials
        came with it; uid None: the agent's own uid, for in-process callers) that arrived
        ``age`` seconds ago.

        Returns None when the record was accepted into the table, else the reason it
        was rejected (also counted). The receiving thread calls this for each datagram.
        """
        if sender_pid is None:
            return self._reject("no_credentials", "datagram arrived without sender credentials")
        uid = os.getuid() if uid is None else uid
        # Before anything costly: a flood is refused for the price of a dict lookup.
        if not self.quota.allow(uid, self._clock()):
            with self._lock:
                self.pressure_at = time.time()
            return self._reject("quota", f"uid {uid} sent more than its records per second")
        if truncated or len(data) > MAX_DATAGRAM_BYTES:
            return self._reject("too_large", f"datagram larger than {MAX_DATAGRAM_BYTES} bytes")
        try:
            record = decode_record(data)
        except TelemetryError as e:
            return self._reject(e.reason, str(e))
        if record.pid != sender_pid:
            return self._reject("pid_mismatch", _mismatch_message(record.pid, sender_pid))
        try:
            self.table.update(record, sender_pid, uid=uid, age=age)
        except ForeignOwnerError as e:
            return self._reject("foreign_owner", str(e))
        except RankQuotaError as e:
            return self._reject("rank_quota", str(e))
        except RankTableFullError as e:
            return self._reject("table_full", str(e))
        with self._lock:
            self._accepted += 1
        return None

    def _reject(self, reason: str, message: str) -> str:
        with self._lock:
            self._rejected[reason] += 1
            self._last_error[reason] = message[:300]
        return reason

    # -- reading ------------------------------------------------------------------------
    @property
    def accepted(self) -> int:
        with self._lock:
            return self._accepted

    def stats(self) -> dict[str, Any]:
        """Counters: accepted, rejected by reason (every reason present), the last error
        message of each reason seen, and the socket path."""
        with self._lock:
            return {
                "path": str(self.path),
                "accepted": self._accepted,
                "rejected": dict(self._rejected),
                "rejected_total": sum(self._rejected.values()),
                "last_error": dict(self._last_error),
                "pressure_at": self.pressure_at,
            }

    # -- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the thread, close the socket and remove its file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if getattr(self.table, "flush_telemetry", None) == self.flush:
            self.table.flush_telemetry = None
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        with self._drain_lock:  # no flush() is reading it
            self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        # Remove the file only if it is still ours (not a successor's socket).
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(self.path).st_ino == self._inode:
                os.unlink(self.path)

    def __enter__(self) -> TelemetryReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def decode_record(data: bytes) -> TelemetryRecord:
    """orjson and the contract's fast path for the common record (about 4x cheaper than
    json.loads and the field-by-field checks, bench/agent_overhead.py); anything they do
    not take whole (bad UTF-8, NaN literals, 65-bit integers, a field out of range) goes
    through the contract's own decode, so the agent accepts and refuses exactly what it
    does, for the same reasons."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        obj = None
    record = fast_record(obj) if type(obj) is dict else None
    return record or decode(data)


def _remove_stale_socket(path: Path) -> None:
    """Remove a socket file nobody listens on; refuse anything else that is in the way."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(
            f"{path} exists and is not a socket; refusing to delete it "
            "(choose another telemetry socket path or remove the file)"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        os.unlink(path)  # stale: left by an agent that did not shut down cleanly
        return
    finally:
        probe.close()
    raise SocketInUseError(
        errno.EADDRINUSE, f"another process is receiving telemetry on {path}", str(path)
    )


def _ancillary(
    ancdata: list[tuple[int, int, bytes]],
) -> tuple[tuple[int, int, int] | None, float | None]:
    """The kernel-verified sender (pid, uid, gid) from SCM_CREDENTIALS and the Unix time
    the datagram arrived from SCM_TIMESTAMP; None for what is absent.

    Any file descriptors passed along (SCM_RIGHTS) are closed at once: the ancillary
    buffer has no room meant for them, but one that slipped in must not leak.
    """
    cred = arrived = None
    for level, kind, payload in ancdata:
        if level != socket.SOL_SOCKET:
            continue
        if kind == socket.SCM_CREDENTIALS and len(payload) >= _UCRED.size:
            cred = _UCRED.unpack_from(payload)
        elif kind == _SO_TIMESTAMP and len(payload) >= _TIMEVAL.size:
            seconds, micros = _TIMEVAL.unpack_from(payload)
            arrived = seconds + micros / 1e6
        elif kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
    return cred, arrived


def _mismatch_message(claimed: int, sender: int) -> str:
    if sender == 0:  # the sender's PID has no number in the agent's PID namespace
        return (
            f"record claims pid {claimed}, but the sender runs in another PID namespace "
            "(a container without the host's PID namespace?)"
        )
    return f"record claims pid {claimed}, but the kernel says the sender is pid {sender}"
