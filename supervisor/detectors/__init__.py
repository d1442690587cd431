"""Detectors: pure functions from one observed cluster (plus its history) to findings.

Each file holds one detector, `detect(obs, history, cfg) -> list[Finding]`, and declares
it in `DETECTOR` (registration.py: its name, finding kind, settings, detect, and the state
it tracks, if any). A finding's `key` names the fault itself (job, rank, incarnation, step
where relevant), so the same fault seen in many polls, or again after a supervisor
restart, is one incident, and a new fault (a new incarnation, a new step) is a new one.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence

from .. import history as _history
from ..model import KINDS as _POLICY_KINDS
from ..model import Finding, History
from ..state import ClusterObs
from .hang import pick_culprit_from_stacks, wavefront_awaited
from .registration import Detector, config_class

log = logging.getLogger("rankguard.supervisor.detectors")

# The registry: one line per detector, `supervisor/detectors/<name>.py`, in the order they
# run and their tables are printed.
REGISTERED = (
    "dead",
    "hang",
    "process_hang",
    "stand_in",
    "straggler",
    "numerics",
    "node",
    "checkpoint",
    "unreachable",
    "data_stall",
)


def registry(names: Sequence[str]) -> tuple[Detector, ...]:
    """The detectors of these names: the `DETECTOR` of `supervisor/detectors/<name>.py`."""
    out = []
    for name in names:
        detector = importlib.import_module(f"{__name__}.{name}").DETECTOR
        if detector.name != name:
            raise ImportError(f"{__name__}.{name} registers a detector named {detector.name!r}")
        out.append(detector)
    return tuple(out)


REGISTRY: tuple[Detector, ...] = registry(REGISTERED)
# Each detector module owns its settings (a frozen dataclass, `[detectors.<name>]` in the
# supervisor's config file); DetectorConfig only gathers them, one field per detector.
DetectorConfig = config_class(REGISTRY)

DetectFn = Callable[[ClusterObs, History, DetectorConfig], list[Finding]]
# (name, detect) of each registered detector, in order
DETECTORS: tuple[tuple[str, DetectFn], ...] = tuple((d.name, d.detect) for d in REGISTRY)
# Every kind of incident the supervisor opens: the policy's vocabulary, then any kind only
# a registered detector names
KINDS: tuple[str, ...] = tuple(dict.fromkeys((*_POLICY_KINDS, *(d.kind for d in REGISTRY))))


def advance_history(
    history: History, obs: ClusterObs, cfg: DetectorConfig | None = None
) -> History:
    """The history after this poll (history.py), tracked by the detectors of `cfg`."""
    return _history.advance(history, obs, cfg or DetectorConfig())


def run_all(
    obs: ClusterObs,
    history: History,
    cfg: DetectorConfig | None = None,
    detectors: Sequence[tuple[str, DetectFn]] | None = None,
) -> list[Finding]:
    """Every detector's findings (those registered in `cfg`, else `detectors`). One
    detector's failure is logged and costs only its own findings: a bug in one must never
    blind the others."""
    cfg = cfg or DetectorConfig()
    if detectors is None:
        detectors = [(d.name, d.detect) for d in cfg.REGISTRY]
    out: list[Finding] = []
    for name, detect in detectors:
        if not cfg.enabled(name):  # turned off in [detectors.<name>]
            continue
        try:
            out.extend(detect(obs, history, cfg))
        except Exception:
            log.exception("detector %s failed; its findings are skipped this poll", name)
    return out


__all__ = [
    "DETECTORS",
    "KINDS",
    "REGISTERED",
    "REGISTRY",
    "Detector",
    "DetectorConfig",
    "advance_history",
    "config_class",
    "pick_culprit_from_stacks",
    "wavefront_awaited",
    "registry",
    "run_all",
]
