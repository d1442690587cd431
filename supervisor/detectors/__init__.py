"""Detectors: pure functions from one observed cluster (plus its history) to findings.

Each file holds one detector, `detect(obs, history, cfg) -> list[Finding]`. A finding's
`key` names the fault itself (job, rank, incarnation, step where relevant), so the same
fault seen in many polls, or again after a supervisor restart, is one incident, and a
new fault (a new incarnation, a new step) is a new one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..model import Finding, History
from ..state import ClusterObs

log = logging.getLogger("rankguard.supervisor.detectors")


# Each detector module owns its settings (a frozen dataclass, `[detectors.<name>]` in the
# supervisor's config file); DetectorConfig only gathers them. Imported before
# DetectorConfig is defined: the modules use it for type hints only.
from . import (  # noqa: E402
    checkpoint,
    data_stall,
    dead,
    hang,
    node,
    numerics,
    process_hang,
    stand_in,
    straggler,
    unreachable,
)


@dataclass(frozen=True)
class DetectorConfig:
    dead: dead.DeadConfig = field(default_factory=dead.DeadConfig)
    hang: hang.HangConfig = field(default_factory=hang.HangConfig)
    process_hang: process_hang.ProcessHangConfig = field(
        default_factory=process_hang.ProcessHangConfig
    )
    stand_in: stand_in.StandInConfig = field(default_factory=stand_in.StandInConfig)
    straggler: straggler.StragglerConfig = field(default_factory=straggler.StragglerConfig)
    numerics: numerics.NumericsConfig = field(default_factory=numerics.NumericsConfig)
    node: node.NodeConfig = field(default_factory=node.NodeConfig)
    checkpoint: checkpoint.CheckpointConfig = field(default_factory=checkpoint.CheckpointConfig)
    unreachable: unreachable.UnreachableConfig = field(
        default_factory=unreachable.UnreachableConfig
    )
    data_stall: data_stall.DataStallConfig = field(default_factory=data_stall.DataStallConfig)

    def enabled(self, name: str) -> bool:
        section = getattr(self, name, None)
        return section is None or section.enabled


Detector = Callable[[ClusterObs, History, DetectorConfig], list[Finding]]

DETECTORS: tuple[tuple[str, Detector], ...] = (
    ("dead", dead.detect),
    ("hang", hang.detect),
    ("process_hang", process_hang.detect),
    ("stand_in", stand_in.detect),
    ("straggler", straggler.detect),
    ("numerics", numerics.detect),
    ("node", node.detect),
    ("checkpoint", checkpoint.detect),
    ("unreachable", unreachable.detect),
    ("data_stall", data_stall.detect),
)

advance_history = checkpoint.advance_history
pick_culprit_from_stacks = hang.pick_culprit_from_stacks


def run_all(
    obs: ClusterObs,
    history: History,
    cfg: DetectorConfig | None = None,
    detectors: Sequence[tuple[str, Detector]] | None = None,
) -> list[Finding]:
    """Every detector's findings. One detector's failure is logged and costs only its own
    findings: a bug in one must never blind the others."""
    cfg = cfg or DetectorConfig()
    out: list[Finding] = []
    for name, detect in DETECTORS if detectors is None else detectors:
        if not cfg.enabled(name):  # turned off in [detectors.<name>]
            continue
        try:
            out.extend(detect(obs, history, cfg))
        except Exception:
            log.exception("detector %s failed; its findings are skipped this poll", name)
    return out


__all__ = [
    "DETECTORS",
    "DetectorConfig",
    "advance_history",
    "pick_culprit_from_stacks",
    "run_all",
]
