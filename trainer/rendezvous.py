"""torchrun's c10d rendezvous against an external store that may restart: `--rdzv-backend
rankguard` (registered through the `torchrun.handlers` entry point).

The store is `rankguard rendezvous` on the control node (cli/rendezvous.py), so no
training node hosts it. torch's own c10d backend holds one TCPStore client for the whole
run, and a TCPStore client never reconnects: when the store restarts, the next keep-alive
or membership check fails and every torchrun exits, taking its workers with it. Here the
client reconnects instead (retrying until the read timeout), re-seeds the rendezvous key
the restarted, empty store lacks, and retries the call once. torchrun then reads an empty
rendezvous state: the running group does not notice (no node is waiting), the keep-alives
fill it in again, and the next membership change forms a new round in the new store.

The rendezvous state is signed (`SignedBackend`). torch's dynamic rendezvous keeps it in
the store as a pickle that every launcher unpickles at each sync, and a store has no
authentication: whoever can reach the port could make every launcher run code of their
choosing. Here each state is written with an HMAC-SHA256 of the job's rendezvous secret (a
file only the job's user can read: `--rdzv-conf secret_file=PATH` or
`$RANKGUARD_RDZV_SECRET_FILE`), and a state whose MAC fails is refused before anything is
unpickled, counted, and overwritten by the next honest write; the launcher goes on with the
last state it verified, so a forged or garbage state neither runs code nor ends the job.

One more difference: a restart's rendezvous skips the random 0-0.3 s wait torch puts
before a first join (`RankguardHandler`). Everything else is torch's dynamic rendezvous.
"""

from __future__ import annotations

import binascii
import contextlib
import hashlib
import hmac
import logging
import os
import pickle
import threading
import time
from base64 import b64decode, b64encode
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    _RendezvousState,
    create_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from rankguard.contract.secrets import SecretFileError, read_secret_file

log = logging.getLogger("rankguard.rendezvous")

DEFAULT_PORT = 29400
SECRET_FILE_ENV = "RANKGUARD_RDZV_SECRET_FILE"
CONNECT_TIMEOUT = timedelta(seconds=2)
# errors of a lost connection (DistNetworkError is a RuntimeError); a missing key in
# get/wait is a DistStoreError timeout and is not retried here
_LOST = (dist.DistNetworkError, ConnectionError)


class ReconnectingStore(dist.Store):
    """A TCPStore client that opens a new connection when the server went away.

    Only the connection is restored: a restarted server starts empty. `on_reconnect`
    callbacks run after each new connection, before the failed call is retried."""

    def __init__(self, host: str, port: int, timeout: timedelta, connect=None):
        super().__init__()
        self.host, self.port, self.read_timeout = host, port, timeout
        self._connect_once = connect or self._tcp_client
        self._lock = threading.Lock()
        self.on_reconnect: list[Callable[[dist.Store], None]] = []
        self.reconnects = 0
        self._client = self._connect()

    def _tcp_client(self) -> dist.Store:
        # a short connect timeout: TCPStore's own retries back off to 20 s and more, which
        # would keep a node away long after the store is back
        client = dist.TCPStore(
            self.host, self.port, is_master=False, timeout=CONNECT_TIMEOUT, multi_tenant=True
        )
        client.set_timeout(self.read_timeout)
        return client

    def _connect(self) -> dist.Store:
        """Connect, retrying every half second until the read timeout has passed."""
        deadline = time.monotonic() + self.read_timeout.total_seconds()
        while True:
            try:
                return self._connect_once()
            except (RuntimeError, ConnectionError) as exc:  # not there (yet, or again)
                if time.monotonic() > deadline:
                    raise RendezvousConnectionError(
                        f"no rendezvous store at {self.host}:{self.port} for "
                        f"{self.read_timeout.total_seconds():.0f}s (is `rankguard rendezvous` "
                        f"running?): {exc}"
                    ) from exc
                time.sleep(0.5)

    def _reconnect(self, broken) -> dist.Store:
        with self._lock:
            if self._client is not broken:  # another thread already did it
                return self._client
            client = self._connect()
            for hook in self.on_reconnect:
                hook(client)
            self._client = client
            self.reconnects += 1
            log.warning("rendezvous store %s:%d: reconnected", self.host, self.port)
            return client

    def _call(self, op: str, *args):
        client = self._client
        try:
            return getattr(client, op)(*args)
        except _LOST as exc:
            log.warning("rendezvous store %s:%d lost (%s); reconnecting", self.host, self.port, exc)
            return getattr(self._reconnect(client), op)(*args)

    # the Store methods torch's rendezvous, torchrun's agent and PrefixStore call
    def set(self, key, value):
        return self._call("set", key, value)

    def get(self, key):
        return self._call("get", key)

    def add(self, key, value):
        return self._call("add", key, value)

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, expected, desired)

    def delete_key(self, key):
        return self._call("delete_key", key)

    def num_keys(self):
        return self._call("num_keys")

    def check(self, keys):
        return self._call("check", keys)

    def wait(self, keys, timeout=None):
        return self._call("wait", keys) if timeout is None else self._call("wait", keys, timeout)

    def multi_get(self, keys):
        return self._call("multi_get", keys)

    def multi_set(self, keys, values):
        return self._call("multi_set", keys, values)

    def append(self, key, value):
        return self._call("append", key, value)


class SignedBackend(C10dRendezvousBackend):
    """torch's c10d backend, its state signed with the job's secret, under the name torchrun
    was given (it checks the two agree).

    In the store: base64(HMAC-SHA256(secret, key NUL state) + state). The key is part of the
    MAC, so a state signed for another job cannot be moved into this one. A value that does
    not verify is never handed to torch's unpickling: get/set answer the last state this
    launcher verified (an empty one before the first) with the bad value as the token, so the
    handler's next write replaces it (compare-and-set against exactly that value)."""

    _MAC_BYTES = hashlib.sha256().digest_size
    _WARN_EVERY = 10.0  # seconds between two warnings of a store under attack

    def __init__(self, store: dist.Store, run_id: str, secret: bytes):
        super().__init__(store, run_id)
        self._secret = secret
        self._last_good = pickle.dumps(_RendezvousState())
        self.refused = 0  # values that failed their MAC, read or answered to a write
        self._warned_at = -self._WARN_EVERY

    @property
    def name(self) -> str:
        return "rankguard"

    def _mac(self, state: bytes) -> bytes:
        return hmac.new(self._secret, self._key.encode() + b"\0" + state, hashlib.sha256).digest()

    def get_state(self) -> tuple[bytes, bytes] | None:
        raw = self._call_store("get", self._key)
        verified = self._verify(raw)
        return None if verified is None else verified[:2]

    def set_state(self, state: bytes, token=None) -> tuple[bytes, bytes, bool] | None:
        if token and not isinstance(token, bytes):  # not one of ours: cannot be current
            current = self.get_state()
            return None if current is None else (*current, False)
        expected = token.decode() if token else self._NULL_SENTINEL
        signed = b64encode(self._mac(state) + state).decode()
        raw = self._call_store("compare_set", self._key, expected, signed)
        verified = self._verify(raw)
        if verified is None:
            return None
        new_state, new_token, ok = verified
        return new_state, new_token, ok and new_state == state

    def _verify(self, raw: bytes) -> tuple[bytes, bytes, bool] | None:
        """(state, token, verified) for a stored value; None for the empty marker."""
        if raw == self._NULL_SENTINEL.encode():
            return None
        try:
            blob = b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            blob = b""
        mac, state = blob[: self._MAC_BYTES], blob[self._MAC_BYTES :]
        if len(mac) == self._MAC_BYTES and hmac.compare_digest(mac, self._mac(state)):
            self._last_good = state
            return state, raw, True
        self._refuse(len(raw))
        return self._last_good, raw, False

    def _refuse(self, size: int) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._warned_at >= self._WARN_EVERY:
            self._warned_at = now
            log.warning(
                "rendezvous state %s (%d bytes) failed its signature: refused without "
                "unpickling it (%d refused so far); someone without the job's secret wrote "
                "to the store, or a launcher runs with another secret",
                self._key, size, self.refused,
            )  # fmt: skip


def job_secret(params: RendezvousParameters, environ=os.environ) -> bytes:
    """The rendezvous secret from `--rdzv-conf secret_file=PATH`, else the file named by
    `$RANKGUARD_RDZV_SECRET_FILE`; ValueError (torchrun shows it) when there is none."""
    path = params.get("secret_file") or environ.get(SECRET_FILE_ENV)
    if not path:
        raise ValueError(
            "--rdzv-backend rankguard needs the job's rendezvous secret, a file only you can "
            f"read: --rdzv-conf secret_file=PATH or ${SECRET_FILE_ENV} (make one with: "
            "(umask 077; head -c 32 /dev/urandom | base64 > PATH))"
        )
    try:
        return read_secret_file(path, "rendezvous secret")
    except SecretFileError as exc:
        raise ValueError(str(exc)) from None


def _seed(key: str, sentinel: str) -> Callable[[dist.Store], None]:
    # what C10dRendezvousBackend.__init__ writes: without it a restarted store has no
    # state key and every get_state() would block until the read timeout
    return lambda client: client.compare_set(key, "", sentinel)


class RankguardHandler(DynamicRendezvousHandler):
    """torch's handler, less the random wait at a restart's rendezvous.

    torch waits a random 0-0.3 s before joining while the rendezvous state's round is 0, to
    spread the nodes' first joins over the store. The round moves on only once every member
    has left, so the first restart of a job waits as well (bench/recovery.py, a hang: 0.27 s
    of the 0.45 s between our kill and the new workers' start), while every later restart
    joins at once. Here the first restart joins at once too: torchrun's agents of a job
    restart together after a failure whichever round it is."""

    joined = False

    def next_rendezvous(self):
        if not self.joined:
            self.joined = True
            return super().next_rendezvous()
        _refuse_startup_failure(os.environ)
        with _no_spreading_delay():
            return super().next_rendezvous()


class StartupFailure(RuntimeError):
    """The first incarnation's workers failed at start (contract/startup_guard.py): a
    restart would fail the same way, so torchrun ends instead (exit 1)."""


def _refuse_startup_failure(environ) -> None:
    """Before a restart's rendezvous: end the job (raise) when the workers of the first
    incarnation failed at start by themselves ($RANKGUARD_STARTUP_GUARD names their exits)."""
    from rankguard.contract import startup_guard

    path = environ.get(startup_guard.ENV)
    failed = startup_guard.startup_failure(startup_guard.read(path)) if path else None
    if failed is not None:
        raise StartupFailure(
            f"rank {failed.rank} exited {failed.lived:.1f} s after its start, before its "
            "process group formed: a start-up error, not restarted"
        )


@contextlib.contextmanager
def _no_spreading_delay() -> Iterator[None]:
    """torch's `_delay` in dynamic_rendezvous without its random (range) form, which only
    the first join's spreading uses; its fixed poll delay while waiting stays."""
    torch_delay = dynamic_rendezvous._delay

    def delay(seconds):
        if not isinstance(seconds, tuple):
            torch_delay(seconds)

    dynamic_rendezvous._delay = delay
    try:
        yield
    finally:
        dynamic_rendezvous._delay = torch_delay


ETCD_SCHEME = "etcd://"


def _etcd_store(endpoint: str, run_id: str, timeout: timedelta) -> dist.Store:
    """The job's store on an etcd cluster (`etcd://HOST:PORT,HOST:PORT,...`)."""
    from rankguard.service.etcd import EtcdClient, parse_endpoints

    from .etcd_store import EtcdStore

    client = EtcdClient(parse_endpoints(endpoint), timeout=timeout.total_seconds())
    return EtcdStore(client, f"rankguard/rdzv/{run_id}/", timeout)


def create_rankguard_handler(params: RendezvousParameters):
    if params.get_as_bool("is_host", False):
        raise ValueError(
            "--rdzv-backend rankguard: the store is `rankguard rendezvous`, never a training "
            "node (drop is_host from --rdzv-conf)"
        )
    if not params.endpoint.startswith(ETCD_SCHEME):
        host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout <= 0:
        raise ValueError("The read timeout must be a positive integer.")
    secret = job_secret(params)
    if params.endpoint.startswith(ETCD_SCHEME):  # a replicated store: nothing to re-seed
        store = _etcd_store(params.endpoint, params.run_id, timedelta(seconds=read_timeout))
    else:
        store = ReconnectingStore(host, port, timedelta(seconds=read_timeout))
    backend = SignedBackend(store, params.run_id, secret)
    if isinstance(store, ReconnectingStore):
        store.on_reconnect.append(_seed(backend._key, backend._NULL_SENTINEL))
    handler = create_handler(store, backend, params)
    handler.__class__ = RankguardHandler  # torch's settings parsing, our restart path
    return handler


def handler():
    """The `torchrun.handlers` entry point: torch calls it and registers what it returns."""
    return create_rankguard_handler
