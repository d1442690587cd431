"""AGENT_UNREACHABLE: an agent has not answered for longer than a grace period.

A monitoring fault, not a training fault (DESIGN): the evidence says so, and it is never
by itself a reason to touch training.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import AGENT_UNREACHABLE, Finding, History
from ..state import ClusterObs
from .common import check_settings
from .registration import Detector

if TYPE_CHECKING:
    from . import DetectorConfig


@dataclass(frozen=True)
class UnreachableConfig:
    """[detectors.unreachable]: an agent that does not answer."""

    enabled: bool = True
    grace_seconds: float = 3.0  # unanswered this long before it is an incident

    def __post_init__(self) -> None:
        check_settings(self)


def detect(obs: ClusterObs, history: History, cfg: DetectorConfig) -> list[Finding]:
    out = []
    for n in obs.nodes:
        if n.reachable:
            continue
        # history is advanced after the poll: a first failure is not in it yet
        since = history.unreachable_since.get(n.url, n.observed_at)
        down = obs.time - since
        if down <= cfg.unreachable.grace_seconds:
            continue
        out.append(
            Finding(
                kind=AGENT_UNREACHABLE,
                key=f"agent_unreachable:{n.url}:{int(since)}",
                severity="warning",
                summary=f"agent {n.url} ({n.node}) unreachable for {down:.1f}s: {n.error}",
                node=n.node,
                occurred_at=since,
                evidence={
                    "url": n.url,
                    "error": n.error,
                    "since": since,
                    "unreachable_seconds": down,
                    "monitoring_only": True,
                },
            )
        )
    return out


def track(history: History, obs: ClusterObs, cfg: DetectorConfig) -> History:
    """unreachable_since[url]: the first poll that failed; dropped once the agent answers."""
    unreachable = {
        n.url: history.unreachable_since.get(n.url, n.observed_at)
        for n in obs.nodes
        if not n.reachable
    }
    return dataclasses.replace(history, unreachable_since=unreachable)


DETECTOR = Detector(
    "unreachable", AGENT_UNREACHABLE, UnreachableConfig, detect, track=track, every_pass=True
)
