"""A detector is one file and one line (supervisor/detectors/registration.py): the file
declares `DETECTOR` (name, finding kind, settings, detect, optional state tracking), the
line is its name in `REGISTERED`. Shown here with a trivial detector whose file is the text
below: registered, the supervisor's detector pass runs it and its settings are a
`[detectors.example]` table; unregistered, neither."""

from __future__ import annotations

import dataclasses
import importlib.util
import pkgutil
import sys

import pytest
from builders import cluster, rank

from rankguard.service.settings import SettingsError, build, settings_fields, to_toml
from rankguard.supervisor import detectors
from rankguard.supervisor.detectors import REGISTERED, DetectorConfig, config_class, registry
from rankguard.supervisor.detectors.registration import Detector
from rankguard.supervisor.history import History, advance
from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
from rankguard.supervisor.store import IncidentStore

NAME = "rankguard.supervisor.detectors.example"

# The whole of a new detector: supervisor/detectors/example.py.
EXAMPLE_FILE = '''\
"""EXAMPLE: a job in view for `passes` observations (it keeps its own count)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..model import Finding
from .registration import Detector


@dataclass(frozen=True)
class ExampleConfig:
    """[detectors.example]"""

    enabled: bool = True
    passes: int = 2


def detect(obs, history, cfg):
    seen = history.state.get("example", 0)
    if seen < cfg.example.passes:
        return []
    return [Finding("example", f"example:{job}", "info", f"{job} seen {seen} times", job)
            for job in obs.jobs()]


def track(history, obs, cfg):
    seen = history.state.get("example", 0) + 1
    return dataclasses.replace(history, state={**history.state, "example": seen})


DETECTOR = Detector("example", "example", ExampleConfig, detect, track=track, every_pass=True)
'''


@pytest.fixture
def example_file(tmp_path, monkeypatch):
    """supervisor/detectors/example.py, written and importable for this test only."""
    path = tmp_path / "example.py"
    path.write_text(EXAMPLE_FILE)
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, NAME, module)
    spec.loader.exec_module(module)
    return module


def detector_pass(tmp_path, cfg, passes: int) -> list[str]:
    """The kinds the supervisor's detector pass finds on each of `passes` passes."""
    store = IncidentStore(tmp_path / f"{id(cfg)}.sqlite")
    sup = Supervisor(store, lambda: [], "t" * 16, SupervisorConfig(detectors=cfg))
    try:
        obs = cluster(rank(0), rank(1))
        return [sorted({f.kind for f in sup._detect(obs)}) for _ in range(passes)]
    finally:
        sup.close()
        store.close()


def test_a_registered_detector_is_run_and_has_its_settings_table(example_file, tmp_path):
    # the one line: its name in REGISTERED
    with_example = config_class(registry((*REGISTERED, "example")))
    cfg = with_example()

    assert [d.name for d in cfg.REGISTRY][-1] == "example"
    assert detector_pass(tmp_path, cfg, 3) == [[], ["example"], ["example"]]

    text = to_toml(cfg, "detectors")
    assert "\n[detectors.example]\nenabled = true\npasses = 2" in text
    assert (".detectors.example.passes", int, 2) in settings_fields(with_example, ".detectors")
    assert build(with_example, {"example": {"passes": 5}}, "detectors").example.passes == 5
    with pytest.raises(SettingsError, match=r"detectors\.example\.pass: unknown key"):
        build(with_example, {"example": {"pass": 5}}, "detectors")
    off = build(with_example, {"example": {"enabled": False}}, "detectors")
    assert detector_pass(tmp_path, off, 3) == [[], [], []]
    # its state is tracked with the others', by its own track
    history = advance(advance(History(), cluster(rank(0)), cfg), cluster(rank(0)), cfg)
    assert history.state == {"example": 2}


def test_unregistered_it_is_neither_run_nor_configured(example_file, tmp_path):
    cfg = DetectorConfig()  # the registry as it is: no line for it
    assert "example" not in {f.name for f in dataclasses.fields(cfg)}
    assert "[detectors.example]" not in to_toml(cfg, "detectors")
    with pytest.raises(SettingsError, match=r"detectors\.example: unknown key"):
        build(DetectorConfig, {"example": {}}, "detectors")
    assert detector_pass(tmp_path, cfg, 3) == [[], [], []]
    assert advance(History(), cluster(rank(0)), cfg).state == {}


def test_every_detector_file_is_registered_once_under_its_own_name():
    declared = {
        m.name
        for m in pkgutil.iter_modules(detectors.__path__)
        if hasattr(importlib.import_module(f"{detectors.__name__}.{m.name}"), "DETECTOR")
    }
    assert sorted(REGISTERED) == sorted(declared)  # a file without its line would never run
    assert [d.name for d in detectors.REGISTRY] == list(REGISTERED)
    assert [f.name for f in dataclasses.fields(DetectorConfig)] == list(REGISTERED)
    assert {d.kind for d in detectors.REGISTRY} <= set(detectors.KINDS)


def test_a_registration_that_does_not_fit_is_refused():
    dead = detectors.REGISTRY[0]
    with pytest.raises(ValueError, match="registered twice"):
        config_class((dead, dead))
    with pytest.raises(ValueError, match="lower-case identifier"):
        config_class((dataclasses.replace(dead, name="enabled"),))

    @dataclasses.dataclass(frozen=True)
    class NoSwitch:
        limit: int = 1

    with pytest.raises(TypeError, match="no `enabled` setting"):
        config_class((Detector("x", "x", NoSwitch, dead.detect),))
