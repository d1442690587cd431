"""Agent configuration: defaults < config file (TOML) < command-line flags."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..contract.telemetry import DEFAULT_SOCKET_PATH


class AgentConfigError(ValueError):
    pass


@dataclass(frozen=True)
class AgentConfig:
    bind: str = "127.0.0.1:9407"  # loopback unless the operator chooses otherwise
    interval: float = 1.0
    token_file: Path | None = None
    telemetry_socket: str = DEFAULT_SOCKET_PATH
    socket_mode: int = 0o660  # owner and group may send (each record pinned to its pid)
    # the socket's group: the users whose ranks may send (name or gid; None: the agent's)
    telemetry_group: str | int | None = None
    telemetry_quota: float = 2000.0  # records/s per sender uid (x10 for root and the agent's)
    telemetry_ranks_per_uid: int = 256  # table entries per sender uid (root/agent's: all)
    # seconds the receiver lets datagrams gather between drains; unset: 0.1 where the
    # kernel queue (net.unix.max_dgram_qlen) holds >= 64, else 0 (receiver.batch_wait)
    telemetry_batch_wait: float | None = None
    ckpt_dir: Path | None = None
    data_dir: Path | None = None
    expected_gpus: int | None = None
    nvml_double: Path | None = None  # an NVML double's JSON state, for GPU-less test nodes
    node: str = field(default_factory=socket.gethostname)
    # watch torchrun workers that send no telemetry (zero-code protection, discovery.py):
    # auto (those naming this agent's socket; those naming none if it is the default
    # socket), all, off
    discover_workers: str = "auto"
    # HTTPS with this certificate (PEM, the chain) and key; both or neither
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # [collectors.<name>]: each collector's settings by name, built by the collector's own
    # Config (collectors/__init__.py settings_for); empty: every collector with defaults
    collectors: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise AgentConfigError("tls_cert and tls_key go together: give both or neither")
        if not 0.05 <= self.interval <= 3600:
            raise AgentConfigError("interval must be between 0.05 and 3600 seconds")
        if self.discover_workers not in ("auto", "all", "off"):
            raise AgentConfigError("discover_workers must be auto, all or off")
        if self.expected_gpus is not None and self.expected_gpus < 0:
            raise AgentConfigError("expected_gpus must be >= 0")
        if not 1 <= self.telemetry_quota <= 1e7:
            raise AgentConfigError("telemetry_quota must be between 1 and 1e7 records/s")
        if self.telemetry_batch_wait is not None and not 0 <= self.telemetry_batch_wait <= 1:
            raise AgentConfigError("telemetry_batch_wait must be between 0 and 1 second")
        if not 1 <= self.telemetry_ranks_per_uid <= 1 << 20:
            raise AgentConfigError("telemetry_ranks_per_uid must be >= 1")
        self.telemetry_gid()
        self.host_port()

    def telemetry_gid(self) -> int | None:
        """The telemetry socket's gid from ``telemetry_group`` (a name or a number)."""
        g = self.telemetry_group
        if g is None or (isinstance(g, int) and not isinstance(g, bool) and g >= 0):
            return g
        if isinstance(g, str) and g.isdigit():
            return int(g)
        if isinstance(g, str) and g:
            import grp

            try:
                return grp.getgrnam(g).gr_gid
            except KeyError:
                raise AgentConfigError(f"telemetry_group: no group named {g!r}") from None
        raise AgentConfigError(f"telemetry_group must be a group name or gid, got {g!r}")

    def host_port(self) -> tuple[str, int]:
        host, sep, port = self.bind.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
            raise AgentConfigError(f"bind must be HOST:PORT, got {self.bind!r}")
        # ":9407" is every interface, as for exporters (the default names loopback)
        return host.strip("[]"), int(port)

    @property
    def watch_dirs(self) -> dict[str, Path]:
        dirs = {"checkpoint": self.ckpt_dir, "data": self.data_dir}
        return {role: path for role, path in dirs.items() if path is not None}


def load_config(path: Path | None, overrides: dict) -> AgentConfig:
    """The file's [agent] and [collectors.<name>] tables, then every override that is not
    None (the flags, each named as `--flag` in an error). AgentConfigError, one line naming
    the key and the expected type, for anything wrong."""
    from ..service.settings import SettingsError, build, read_toml
    from .collectors import settings_for

    where = f"config file {path}: " if path is not None else ""
    try:
        data = dict(read_toml(path)) if path is not None else {}
        collector_tables = data.pop("collectors", None)
        agent_table = data.pop("agent", None) if "agent" in data else data
        if agent_table is not data and data:
            raise SettingsError(f"{sorted(data)[0]}: unknown table (known: agent, collectors)")
        cfg = build(AgentConfig, agent_table, "agent")
        cfg = replace(cfg, collectors=settings_for(collector_tables))
    except SettingsError as exc:
        raise AgentConfigError(f"{where}{exc}") from None
    for key, value in overrides.items():
        if value is None:
            continue
        value = str(value) if isinstance(value, Path) else value
        try:  # one flag at a time, so an error names the flag
            cfg = build(AgentConfig, {key: value}, "agent", cfg)
        except SettingsError as exc:
            flag = "--" + key.replace("_", "-")
            raise AgentConfigError(f"{flag} {value!r}: {exc}") from None
    return cfg


def config_toml(cfg: AgentConfig) -> str:
    """The effective configuration as TOML (`rankguard agent --print-config`)."""
    from ..service.settings import to_toml
    from .collectors import settings_for

    mode = f"socket_mode = {cfg.socket_mode}"  # a file mode reads better in octal (TOML 0o)
    parts = [to_toml(cfg, "agent").replace(mode, f"socket_mode = 0o{cfg.socket_mode:o}", 1)]
    for name, settings in sorted((cfg.collectors or settings_for(None)).items()):
        parts.append(to_toml(settings, f"collectors.{name}"))
    return "\n\n".join(parts) + "\n"


def read_token(path: Path) -> str:
    """The bearer token; the file must be readable by its owner only."""
    from ..contract.secrets import SecretFileError, read_secret_file

    try:
        return read_secret_file(path, "token").decode()
    except (SecretFileError, UnicodeDecodeError) as exc:
        raise AgentConfigError(str(exc)) from None


def load_tls(cert: Path | None, key: Path | None):
    """The server's TLS context, or None without a certificate; AgentConfigError naming
    the file for a missing or unreadable certificate or key, or a key that does not match."""
    if cert is None or key is None:
        return None
    import ssl

    from ..service.httpd import tls_context

    try:
        return tls_context(str(cert), str(key))
    except FileNotFoundError as exc:
        raise AgentConfigError(f"TLS: {exc.filename}: no such file") from None
    except (OSError, ssl.SSLError) as exc:
        raise AgentConfigError(f"TLS certificate {cert} and key {key}: {exc}") from None
