"""Detectors: pure functions from one observed cluster (plus its history) to findings.

Each file holds one detector, `detect(obs, history, cfg) -> list[Finding]`. A finding's
`key` names the fault itself (job, rank, incarnation, step where relevant), so the same
fault seen in many polls, or again after a supervisor restart, is one incident, and a
new fault (a new incarnation, a new step) is a new one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from ..model import Finding, History
from ..state import ClusterObs

log = logging.getLogger("rankguard.supervisor.detectors")


@dataclass(frozen=True)
class DetectorConfig:
    # hang: per-phase budgets learned from this job's own step times
    # 1 s: below it a scheduler hiccup on a loaded host looks like a hang; above it, the
    # job's own 10 x p99 step time decides (no hand-set timeout for real step times).
    hang_floor_seconds: float = 1.0
    hang_quantile: float = 0.99
    hang_quantile_factor: float = 10.0
    hang_min_samples: int = 5
    hang_warmup_seconds: float = 60.0  # before enough samples: first-step compilation, data
    hang_startup_seconds: float = 120.0  # phases init and checkpoint_load
    hang_checkpoint_floor_seconds: float = 30.0
    hang_eval_seconds: float = 300.0
    hang_spin_cpu_cores: float = 0.5  # a culprit stuck busy in Python uses at least this
    hang_idle_cpu_cores: float = 0.2  # ... while the others, asleep in the collective, stay below
    # hang of ranks without telemetry (zero-code: process state and CPU time only)
    process_stopped_seconds: float = 2.0  # a rank (or its stand-in) stopped this long is hung
    process_idle_seconds: float = 120.0  # all but one rank without CPU progress this long
    # straggler
    straggler_window: int = 12
    straggler_threshold: float = 0.10
    straggler_consistency: float = 0.75  # share of window steps on which it must be slower
    straggler_wait_share: float = 0.5  # peers' extra comm wait, as a share of the compute gap
    straggler_warmup_steps: int = 20  # first steps of an incarnation are not judged
    straggler_persist_steps: int = 8  # a suspect must stay slow this many steps...
    straggler_persist_seconds: float = 2.5  # ... and this long (host noise comes in bursts)
    # numerics
    spike_mads: float = 10.0
    spike_min_ratio: float = 2.0
    spike_min_samples: int = 20
    # checkpoint and agents
    checkpoint_stale_factor: float = 3.0
    unreachable_grace_seconds: float = 3.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"DetectorConfig.{f.name} must be a number, not {value!r}")
            if value != value or value < 0:  # NaN or negative
                raise ValueError(f"DetectorConfig.{f.name} must be >= 0, not {value!r}")
        if not 0 < self.hang_quantile <= 1:
            raise ValueError(f"hang_quantile must be in (0, 1], not {self.hang_quantile}")
        if self.hang_idle_cpu_cores >= self.hang_spin_cpu_cores:
            raise ValueError("hang_idle_cpu_cores must be below hang_spin_cpu_cores")
        for name, least in (
            ("hang_min_samples", 1),
            ("straggler_window", 3),
            ("spike_min_samples", 3),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, not {value!r}")
        for name in (
            "hang_floor_seconds",
            "hang_quantile_factor",
            "straggler_threshold",
            "spike_mads",
            "checkpoint_stale_factor",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)!r}")
        if not 0 < self.straggler_consistency <= 1:
            raise ValueError(
                f"straggler_consistency must be in (0, 1], not {self.straggler_consistency}"
            )
        if self.spike_min_ratio < 1:
            raise ValueError(f"spike_min_ratio must be >= 1, not {self.spike_min_ratio!r}")


Detector = Callable[[ClusterObs, History, DetectorConfig], list[Finding]]

# Imported after DetectorConfig: the detector modules only use it for type hints.
from . import (  # noqa: E402
    checkpoint,
    dead,
    hang,
    node,
    numerics,
    process_hang,
    stand_in,
    straggler,
    unreachable,
)

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
