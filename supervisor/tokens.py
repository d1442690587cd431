"""Which bearer token the supervisor presents to which agent.

Per-agent tokens (docs/security.md): each agent's token is HMAC-SHA256 of the host in its
URL under a cluster secret that only the supervisor holds, so an agent (or someone who
reads one agent's token) can control that node only. The agent needs nothing new: its
token file holds its derived token (`rankguard deploy agent-token`). The host is the one
the supervisor dials (the agents file's URL), never a name an agent reports about itself.

A single shared token (`--token-file`) still works, for one node or a trusted network.
"""

from __future__ import annotations

import hashlib
import hmac
import urllib.parse
from dataclasses import dataclass

MIN_SECRET_CHARS = 32
_CONTEXT = b"rankguard agent token v1\0"  # domain separation: this HMAC means only this


def derive_agent_token(secret: str, host: str) -> str:
    """The control token of the agent at `host` (case-insensitive, as DNS names are)."""
    if not host:
        raise ValueError("an agent token needs a host name")
    mac = hmac.new(secret.encode(), _CONTEXT + host.lower().encode(), hashlib.sha256)
    return "rg1-" + mac.hexdigest()


@dataclass(frozen=True)
class AgentTokens:
    """`secret` (per-agent tokens) or `shared` (one token for every agent), or neither."""

    shared: str | None = None
    secret: str | None = None

    def __post_init__(self) -> None:
        if self.shared is not None and self.secret is not None:
            raise ValueError("give a shared token or an agent secret, not both")
        if self.secret is not None and len(self.secret) < MIN_SECRET_CHARS:
            raise ValueError(f"agent secret shorter than {MIN_SECRET_CHARS} characters")

    def for_url(self, url: str) -> str | None:
        if self.secret is None:
            return self.shared
        return derive_agent_token(self.secret, urllib.parse.urlsplit(url).hostname or "")
