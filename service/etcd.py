"""A small etcd v3 client over etcd's JSON gateway (standard library only), for a cluster
of members of which any one may be down.

Every call goes to one member; when that member does not answer (refused, reset, timed
out) or answers that it cannot serve now (no leader, a leader change), the next member is
tried, round after round, until the call's deadline. Reads are linearizable (etcd's
default), so any member that answers gives the cluster's current value. A write whose
answer was lost may have been applied: callers make their writes compare-and-set, so a
retry sees its own write instead of applying it twice.

Keys and values are bytes; etcd's gateway wants them base64 in JSON, and answers int64s as
strings and leaves out fields at their zero value (false, 0, empty).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger("rankguard.etcd")

REQUEST_TIMEOUT = 2.0  # one member's answer; a dead member costs this once per round
MAX_ANSWER_BYTES = 64 * 2**20


class EtcdError(RuntimeError):
    """No member answered within the deadline, or the cluster refused the request."""


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0


def parse_endpoints(text: str) -> list[str]:
    """``etcd://h1:2379,h2:2379`` or ``h1:2379,h2`` (port 2379 by default) as base URLs."""
    text = text.removeprefix("etcd://")
    out = []
    for part in text.split(","):
        part = part.strip().removeprefix("http://")
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not port.isdigit():
            host, port = part, "2379"
        if not host or "/" in host:
            raise ValueError(f"etcd endpoint {part!r}: expected HOST[:PORT]")
        out.append(f"http://{host}:{int(port)}")
    if not out:
        raise ValueError(f"no etcd endpoint in {text!r}")
    return out


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _kv(raw: dict) -> KeyValue:
    return KeyValue(
        base64.b64decode(raw.get("key", "")),
        base64.b64decode(raw.get("value", "")),
        int(raw.get("mod_revision", 0)),
        int(raw.get("create_revision", 0)),
        int(raw.get("lease", 0)),
    )


class EtcdClient:
    def __init__(self, endpoints: Sequence[str], timeout: float = 60.0) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout  # a call's deadline across every member and retry
        self._current = 0
        self.failovers = 0

    # -- the calls --------------------------------------------------------------------
    def get(self, key: bytes) -> KeyValue | None:
        kvs = self._call("/v3/kv/range", {"key": _b64(key)}).get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    def count(self, prefix: bytes) -> int:
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        answer = self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end),
                                              "count_only": True})  # fmt: skip
        return int(answer.get("count", 0))

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self._call("/v3/kv/put", body)

    def prefix(self, prefix: bytes) -> list[KeyValue]:
        """Every key under ``prefix``, in key order."""
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        answer = self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end)})
        return [_kv(raw) for raw in answer.get("kvs") or []]

    # -- leases ---------------------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        return int(self._call("/v3/lease/grant", {"TTL": str(ttl)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; the seconds it has left now (0: it has expired)."""
        answer = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int((answer.get("result") or answer).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self._call("/v3/lease/revoke", {"ID": str(lease)})

    def delete(self, key: bytes) -> bool:
        return int(self._call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0)) > 0

    def put_if(
        self, key: bytes, value: bytes, *, mod_revision: int, lease: int = 0
    ) -> tuple[bool, KeyValue | None]:
        """Put ``value`` (bound to ``lease`` when given) if the key's mod revision is
        ``mod_revision`` (0: the key does not exist). (whether it was put, the key's value
        now when it was not)."""
        put = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        compare = (
            {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision}
            if mod_revision
            else {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        )
        answer = self._call("/v3/kv/txn", {
            "compare": [compare],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        })  # fmt: skip
        if answer.get("succeeded", False):
            return True, None
        responses = answer.get("responses") or [{}]
        kvs = (responses[0].get("response_range") or {}).get("kvs") or []
        return False, _kv(kvs[0]) if kvs else None

    # -- one call, member after member --------------------------------------------------
    def _call(self, path: str, body: dict) -> dict:
        deadline = time.monotonic() + self.timeout
        data = json.dumps(body).encode()
        last = ""
        while True:
            url = self.endpoints[self._current] + path
            try:
                return self._post(url, data, min(REQUEST_TIMEOUT, deadline - time.monotonic()))
            except _Retry as exc:
                last = f"{self.endpoints[self._current]}: {exc}"
            if time.monotonic() >= deadline:
                raise EtcdError(f"no etcd member answered {path} within {self.timeout:g}s "
                                f"(last: {last})")  # fmt: skip
            self._current = (self._current + 1) % len(self.endpoints)
            self.failovers += 1
            if self._current == 0:
                time.sleep(0.1)  # a whole round failed: a leader election, give it a moment

    @staticmethod
    def _post(url: str, data: bytes, timeout: float) -> dict:
        request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=max(0.05, timeout)) as resp:
                raw = resp.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as exc:
            detail = exc.read(4096).decode(errors="replace")
            if exc.code >= 500 or "leader" in detail:  # no leader now: another member, later
                raise _Retry(f"HTTP {exc.code}: {detail[:200]}") from None
            raise EtcdError(f"{url}: HTTP {exc.code}: {detail[:200]}") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:  # timeouts too
            raise _Retry(str(getattr(exc, "reason", exc))) from None
        if len(raw) > MAX_ANSWER_BYTES:
            raise EtcdError(f"{url}: an answer over {MAX_ANSWER_BYTES} bytes")
        try:
            answer = json.loads(raw)
        except ValueError:
            raise _Retry("an answer that is not JSON") from None
        if not isinstance(answer, dict):
            raise _Retry("an answer that is not a JSON object")
        if "error" in answer or "code" in answer and "message" in answer:
            raise _Retry(str(answer.get("message") or answer.get("error"))[:200])
        return answer


class _Retry(Exception):
    """This member cannot answer now: try the next."""
