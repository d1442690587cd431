"""torch's `Store` on etcd, for `--rdzv-backend rankguard --rdzv-endpoint etcd://M1,M2,M3`.

What torchrun's dynamic rendezvous and its agent call on a store (the signed rendezvous
state's compare-and-set, the bootstrap address of each round's worker store, barriers),
with TCPStore's semantics, kept in a replicated etcd cluster instead of one process: a job
rendezvouses while any one of three members is down, and the state outlives every member's
restart. Each job's keys live under ``rankguard/rdzv/<run id>/``.

Blocking reads (``get`` of a key not yet there, ``wait``) poll every 50 ms until the
store's timeout, as TCPStore's clients wait. ``add`` and ``append`` are compare-and-set
loops; an answer lost with the member that gave it can, rarely, apply one twice (etcd's
client has the same limit without its own retry keys).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from rankguard.service.etcd import EtcdClient

POLL_SECONDS = 0.05


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta) -> None:
        super().__init__()
        self.client, self.prefix, self.read_timeout = client, prefix.encode(), timeout

    def _key(self, key: str) -> bytes:
        return self.prefix + _bytes(key)

    def _until(self, keys: list[str], timeout: timedelta | None) -> None:
        limit = (timeout or self.read_timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"etcd store: keys {keys} not set within {limit:g}s")
            time.sleep(POLL_SECONDS)

    # -- the Store methods --------------------------------------------------------------
    def set(self, key, value) -> None:
        self.client.put(self._key(key), _bytes(value))

    def get(self, key) -> bytes:
        found = self.client.get(self._key(key))
        if found is None:
            self._until([key], None)
            found = self.client.get(self._key(key))
        return found.value if found is not None else b""

    def check(self, keys) -> bool:
        return all(self.client.get(self._key(k)) is not None for k in keys)

    def wait(self, keys, timeout=None) -> None:
        self._until(list(keys), timeout)

    def compare_set(self, key, expected, desired) -> bytes:
        """TCPStore's: ``desired`` is put if the value is ``expected`` (or the key is missing
        and ``expected`` empty); the value after, ``expected`` itself for a missing key."""
        expected, desired = _bytes(expected), _bytes(desired)
        while True:
            current = self.client.get(self._key(key))
            if current is None and expected:
                return expected
            if current is not None and current.value != expected:
                return current.value
            revision = current.mod_revision if current is not None else 0
            put, _ = self.client.put_if(self._key(key), desired, mod_revision=revision)
            if put:
                return desired  # else it changed meanwhile: judge the new value

    def add(self, key, value: int) -> int:
        return int(self._update(key, lambda old: str(int(old or b"0") + int(value)).encode()))

    def append(self, key, value) -> None:
        self._update(key, lambda old: (old or b"") + _bytes(value))

    def _update(self, key, change) -> bytes:
        while True:
            current = self.client.get(self._key(key))
            new = change(current.value if current is not None else None)
            revision = current.mod_revision if current is not None else 0
            if self.client.put_if(self._key(key), new, mod_revision=revision)[0]:
                return new

    def delete_key(self, key) -> bool:
        return self.client.delete(self._key(key))

    def num_keys(self) -> int:
        return self.client.count(self.prefix)

    def multi_get(self, keys) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys, values) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)
