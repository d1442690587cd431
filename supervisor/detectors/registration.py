"""A detector's registration: everything the supervisor needs to run it, in one place.

A detector is one file, `supervisor/detectors/<name>.py`, that declares

    DETECTOR = Detector("<name>", KIND, <Name>Config, detect)

and one line, its name, in `REGISTERED` (`supervisor/detectors/__init__.py`). From those
two: its settings are the `[detectors.<name>]` table of the supervisor's file (built,
checked, printed by --print-config, and documented in docs/configuration.md as every
setting is), the reconcile loop runs `detect` (every pass, or paced with the window
detectors), its finding kind is one of the kinds the supervisor counts (`KINDS`), and
`track`, when given, advances the state it keeps with each observation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..history import History
    from ..model import Finding
    from ..state import ClusterObs


@dataclass(frozen=True)
class Detector:
    # its `[detectors.<name>]` table, its module's name, its name in logs
    name: str
    # the kind of finding it makes (supervisor/model.py names the ones the policy acts on)
    kind: str
    # its settings: a frozen dataclass with `enabled: bool = True`, every field defaulted
    config: type
    # (observation, history, the detectors' settings) -> findings; pure
    detect: Callable[[ClusterObs, History, Any], list[Finding]]
    # (history, observation, settings) -> the history after this observation, for a
    # detector that keeps state from pass to pass (a field of History, or its entry in
    # `History.state`); a new object, the input left as it was. Run before any detect.
    track: Callable[[History, ClusterObs, Any], History] | None = None
    # history -> keys of its reported incidents still present though not a finding this
    # pass (kept open, not resolved: a straggler that flickers under its threshold)
    holds: Callable[[History], frozenset[str]] | None = None
    # judged on each rank's state alone (a comparison or two a rank): run every pass, with
    # its `track`; the others read step windows and are paced (reconcile.py)
    every_pass: bool = False


def _enabled(self: Any, name: str) -> bool:
    """Whether the detector `name` runs: on unless its table says `enabled = false`."""
    section = getattr(self, name, None)
    return section is None or section.enabled


def config_class(detectors: Sequence[Detector]) -> type:
    """`DetectorConfig` of these detectors: a frozen dataclass with one field per detector,
    named after it and holding its settings (`[detectors.<name>]`), in their order.
    `REGISTRY`, a class attribute, is the detectors themselves, in the same order."""
    names = [d.name for d in detectors]
    for d in detectors:
        if not d.name.isidentifier() or d.name != d.name.lower() or d.name == "enabled":
            raise ValueError(f"detector name {d.name!r}: a lower-case identifier, not 'enabled'")
        if names.count(d.name) > 1:
            raise ValueError(f"detector {d.name!r} registered twice")
        if not dataclasses.is_dataclass(d.config):
            raise TypeError(f"detector {d.name!r}: its config must be a dataclass")
        if "enabled" not in {f.name for f in dataclasses.fields(d.config)}:
            raise TypeError(f"detector {d.name!r}: its config has no `enabled` setting")
    cls = dataclasses.make_dataclass(
        "DetectorConfig",
        [(d.name, d.config, field(default_factory=d.config)) for d in detectors],
        frozen=True,
        namespace={
            "__doc__": "Every detector's settings, `[detectors.<name>]` each.",
            "REGISTRY": tuple(detectors),
            "enabled": _enabled,
        },
    )
    cls.__module__ = __name__.rpartition(".")[0]  # rankguard.supervisor.detectors
    return cls
