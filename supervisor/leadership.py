"""Two or more supervisors, one acting: leadership by an etcd lease, and the intent log
every candidate reads.

Each supervisor of a cluster names the same etcd members (`[supervisor] etcd`). Every pass
it renews its lease and tries to hold the leader key with it (created only where absent: a
transaction on the key's create revision). The holder acts; the others watch, detect and
record, and touch nothing. A leader that cannot renew (etcd out of reach, the process
paused) stops acting `ttl - margin` seconds after its last renewal began, while etcd hands
the key on only `ttl` seconds after it saw that renewal: two never act at once, even cut
off from each other, since only a side that reaches etcd's majority holds or takes the key.

The lease is renewed, and the intents read, by a thread of their own (`Watch`): a pass
never waits on etcd. Before an action, the leader writes its intent to etcd (`claim`: created only where
absent, so never twice across supervisors), and its outcome after (`complete`). A
supervisor that takes over adopts the intents left unfinished into its own database,
where the replay of a crashed supervisor's intents finishes them exactly once (a kill
reaches the very process it was meant for or none); a standby copies the finished ones
into its database, so `rankguard incidents` on either shows one timeline.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..service.etcd import EtcdClient, EtcdError

log = logging.getLogger("rankguard.supervisor.leadership")

LEADER_KEY = b"rankguard/supervisor/leader"
INTENTS = b"rankguard/supervisor/intents/"
KEEP_DONE_SECONDS = 3600.0  # a finished intent stays in etcd this long (SharedIntents.expire)
ETCD_CALL_SECONDS = 2.0  # one pass never waits longer on etcd than this


@dataclass
class Leadership:
    client: EtcdClient
    name: str
    ttl: int = 5
    margin: float = 1.5  # stop acting this long before the lease can have expired
    monotonic: Callable[[], float] = time.monotonic
    lease: int = 0
    holder: str | None = None  # the leader as last read ("" when nobody holds the key)
    valid_until: float = 0.0  # acting is allowed before this (monotonic)
    errors: int = 0

    def renew(self) -> bool:
        """Renew the lease and hold or read the leader key; whether this one may act now."""
        started = self.monotonic()
        try:
            if self.lease and self.client.keepalive(self.lease) <= 0:
                self.lease = 0  # expired: the key went with it
            if not self.lease:
                self.lease = self.client.grant(self.ttl)
            put, now = self.client.put_if(LEADER_KEY, self.name.encode(), mod_revision=0,
                                          lease=self.lease)  # fmt: skip
        except EtcdError as exc:
            self.errors += 1
            log.warning("leadership: etcd did not answer (%s); acting stops when the lease may "
                        "have run out", exc)  # fmt: skip
            return self.acting()
        mine = put or (now is not None and now.lease == self.lease)
        self.holder = self.name if mine else (now.value.decode(errors="replace") if now else "")
        self.valid_until = started + self.ttl - self.margin if mine else 0.0
        return self.acting()

    def acting(self) -> bool:
        return self.monotonic() < self.valid_until

    def step_down(self) -> None:
        """Give the key up at once (a clean stop): a standby takes over at its next pass."""
        self.valid_until = 0.0
        if self.lease:
            with contextlib.suppress(EtcdError):  # else it runs out by itself
                self.client.revoke(self.lease)
            self.lease = 0

    def view(self) -> dict[str, Any]:
        return {"name": self.name, "leading": self.acting(), "leader": self.holder or None}


class Watch:
    """Renews the lease and reads the intents off the supervisor's loop, once a second: a
    pass never waits on etcd (a standby cut off from it still detects at full speed). The
    loop reads `leadership.acting()` and takes each new read of the intents once."""

    def __init__(self, leadership: Leadership, intents: SharedIntents, every: float = 1.0):
        self.leadership, self.shared, self.every = leadership, intents, every
        self._lock = threading.Lock()
        self._read: list[Intent] | None = None  # the newest read, until taken
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankguard-leadership",
                                        daemon=True)  # fmt: skip

    def start(self) -> Watch:
        self.leadership.renew()  # the first pass knows its role
        self._thread.start()
        return self

    def _run(self) -> None:
        next_expiry = 0.0
        while not self._stop.wait(self.every):
            self.leadership.renew()
            try:
                read = self.shared.all()
                if self.leadership.acting() and time.monotonic() >= next_expiry:
                    self.shared.expire(read, time.time())
                    next_expiry = time.monotonic() + 60
            except EtcdError:
                continue
            with self._lock:
                self._read = read

    def take(self) -> list[Intent]:
        """The intents as last read, once (empty until the next read)."""
        with self._lock:
            read, self._read = self._read, None
        return read or []

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * ETCD_CALL_SECONDS + self.every)


@dataclass(frozen=True)
class Intent:
    incident_key: str
    kind: str
    target: dict
    leader: str
    requested_at: float
    done: bool = False
    ok: bool | None = None
    result: Any = None
    error: str | None = None

    @classmethod
    def from_json(cls, raw: bytes) -> Intent | None:
        """An intent as read back from etcd; None for one that does not parse."""
        try:
            v = json.loads(raw)
            intent = cls(str(v["incident_key"]), str(v["kind"]), dict(v["target"]),
                         str(v["leader"]), float(v["requested_at"]), bool(v.get("done")),
                         v.get("ok"), v.get("result"), v.get("error"))  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return None
        return intent

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True, default=str).encode()


def intent_key(incident_key: str, kind: str) -> bytes:
    return INTENTS + hashlib.sha256(f"{incident_key}\0{kind}".encode()).hexdigest()[:40].encode()


@dataclass
class SharedIntents:
    client: EtcdClient
    adopted: set[bytes] = field(default_factory=set)  # keys already in this database

    def claim(self, intent: Intent) -> Intent | None:
        """Record the intent unless one exists; None when claimed, else the one there."""
        put, now = self.client.put_if(intent_key(intent.incident_key, intent.kind),
                                      intent.to_json(), mod_revision=0)  # fmt: skip
        if put:
            return None
        return Intent.from_json(now.value) if now is not None else None

    def complete(self, intent: Intent) -> None:
        """Record the outcome, unless one is there: the first outcome stands (a leader cut
        off mid-action may report its failure after another finished the action)."""
        key = intent_key(intent.incident_key, intent.kind)
        now = self.client.get(key)
        old = Intent.from_json(now.value) if now is not None else None
        if old is not None and old.done:
            return
        self.client.put_if(key, intent.to_json(), mod_revision=now.mod_revision if now else 0)

    def all(self) -> list[Intent]:
        return [i for kv in self.client.prefix(INTENTS) if (i := Intent.from_json(kv.value))]

    def expire(self, intents: list[Intent], now: float, keep: float = KEEP_DONE_SECONDS) -> int:
        """Delete the finished intents requested over `keep` seconds ago (every standby
        has copied them by then; an incident key that recurs later is a new incident and
        must not find the old intent claimed). Unfinished ones stay for a replay."""
        old = [i for i in intents if i.done and i.requested_at < now - keep]
        return sum(self.client.delete(intent_key(i.incident_key, i.kind)) for i in old)
