"""The supervisor's configuration file: defaults < TOML file < command-line flags.

One table per part, each built by the dataclass its part owns (service/settings.py checks
keys and types, the dataclass its ranges):

    [supervisor]             interval, agent_timeout, cpu_share, etcd  (LoopSettings, here)
    [detectors.<name>]       one per detector                     (detectors/<name>.py)
    [policy]                 restart budget, backoff, exclusion   (policy.py PolicyConfig)
    [scheduler]              drain / resume of excluded nodes     (scheduler.py)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..service.etcd import parse_endpoints
from ..service.settings import SettingsError, build, read_toml, to_toml
from .detectors import DetectorConfig
from .policy import PolicyConfig
from .reconcile import SupervisorConfig
from .scheduler import SchedulerConfig


@dataclass(frozen=True)
class LoopSettings:
    """[supervisor]: the reconcile loop."""

    interval: float = 0.25  # seconds between reconcile passes
    agent_timeout: float = 2.0  # seconds to wait for an agent's answer
    # the workers' startup milestones (RANKGUARD_STARTUP_TRACE, on a path the supervisor
    # can read): each restart's phases go into its incident's timeline; "" = not read
    startup_trace: str = ""
    # at most this share of one core, averaged over each pass and the pause after it: a
    # supervisor of more nodes than it can read every `interval` slows its passes (and its
    # detection) instead of taking a training node's CPU (docs/scaling.md)
    cpu_share: float = 0.5
    # Two or more supervisors, one acting (leadership.py): the etcd members every one of
    # them names ("etcd://M1:2379,M2:2379,M3:2379"; "" = this supervisor acts alone), this
    # one's name (default host:pid) and the seconds of its leader lease
    etcd: str = ""
    name: str = ""
    lease_seconds: int = 5

    def __post_init__(self) -> None:
        if not 0.01 <= self.interval <= 3600:
            raise ValueError(f"interval must be in [0.01, 3600] seconds, not {self.interval!r}")
        if not 0.05 <= self.agent_timeout <= 600:
            raise ValueError(
                f"agent_timeout must be in [0.05, 600] seconds, not {self.agent_timeout!r}"
            )
        if not 0.05 <= self.cpu_share <= 16:
            raise ValueError(f"cpu_share must be in [0.05, 16] cores, not {self.cpu_share!r}")
        if self.etcd:
            parse_endpoints(self.etcd)  # ValueError names what is wrong
        if not 3 <= self.lease_seconds <= 60:
            raise ValueError(f"lease_seconds must be in [3, 60], not {self.lease_seconds!r}")


@dataclass(frozen=True)
class SupervisorFile:
    """The whole file; every table optional."""

    supervisor: LoopSettings = field(default_factory=LoopSettings)
    detectors: DetectorConfig = field(default_factory=DetectorConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def runtime(self) -> SupervisorConfig:
        return SupervisorConfig(
            interval=self.supervisor.interval,
            agent_timeout=self.supervisor.agent_timeout,
            startup_trace=self.supervisor.startup_trace,
            cpu_share=self.supervisor.cpu_share,
            etcd=self.supervisor.etcd,
            name=self.supervisor.name,
            lease_seconds=self.supervisor.lease_seconds,
            detectors=self.detectors,
            policy=self.policy,
            scheduler=self.scheduler,
        )

    def to_toml(self) -> str:
        parts = [to_toml(getattr(self, f.name), f.name) for f in dataclasses.fields(self)]
        return "\n\n".join(parts) + "\n"


def load(path: Path | None, flags: dict[str, tuple[str, object]] | None = None) -> SupervisorFile:
    """The file (None: defaults only), then the command-line flags given:
    {"table.key": ("--flag", value)}, None values left out. SettingsError, one line naming
    the file's key or the flag, for anything wrong."""
    data = read_toml(path) if path is not None else {}
    where = f"config file {path}: " if path is not None else ""
    try:
        settings = build(SupervisorFile, data, "")
    except SettingsError as exc:
        raise SettingsError(f"{where}{exc}") from None
    for dotted, (flag, value) in (flags or {}).items():
        if value is None:
            continue
        *tables, key = dotted.split(".")
        patch: dict = {key: value}
        for name in reversed(tables):
            patch = {name: patch}
        try:  # one flag at a time, so an error names the flag
            settings = build(SupervisorFile, patch, "", settings)
        except SettingsError as exc:
            raise SettingsError(f"{flag} {value!r}: {exc}") from None
    return settings
