"""Settings: frozen dataclasses built from TOML tables, checked, and written back as TOML.

Both daemons read their configuration through here, so a bad value reads the same
everywhere: one line naming the key by its dotted path and the expected type
(`detectors.hang.floor_seconds: expected a number, got "1s" (a string)`). A component
owns its settings as a dataclass (field type = the expected type, default = the default,
`__post_init__` checks ranges); `build` checks types first so `__post_init__` only ever
sees values of the right type. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


class SettingsError(ValueError):
    """A bad setting: `str()` is one line naming the key."""


def read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SettingsError(f"config file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(
            f"config file {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path}: not valid TOML: {exc}") from None


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _options(tp: Any) -> tuple[Any, ...]:
    """`int | None` -> (int, NoneType); a plain type -> (type,)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def type_name(tp: Any) -> str:
    names = []
    for t in _options(tp):
        if t is type(None):
            continue
        names.append({
            bool: "a boolean (true or false)", int: "an integer", float: "a number",
            str: "a string", Path: "a path (string)",
        }.get(t, getattr(t, "__name__", str(t))))  # fmt: skip
    if type(None) in _options(tp):
        names.append("unset (leave the key out)")
    return " or ".join(names)


# What a TOML value is, in words; bool before int, which it subclasses.
_TOML_KINDS = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a number"),
    (str, "a string"),
    (Mapping, "a table"),
    (list, "an array"),
)


def _toml_kind(value: Any) -> str:
    return next((kind for t, kind in _TOML_KINDS if isinstance(value, t)), type(value).__name__)


def _convert(value: Any, tp: Any, key: str) -> Any:
    """The value as the field's type, or SettingsError naming the key and the type."""
    opts = _options(tp)
    for t in opts:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, int | float) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                raise SettingsError(f"{key}: expected a finite number, got {value!r}")
            return float(value)
        if t is str and isinstance(value, str):
            return value
        if t is Path and isinstance(value, str):
            return Path(value)
        if dataclasses.is_dataclass(t) and isinstance(value, Mapping):
            return build(t, value, key)
    shown = repr(value) if not isinstance(value, Mapping | list) else _toml_kind(value)
    raise SettingsError(f"{key}: expected {type_name(tp)}, got {shown} ({_toml_kind(value)})")


def build(cls: type, table: Mapping | None, prefix: str, base: Any = None) -> Any:
    """An instance of the dataclass `cls` from a TOML table: every key known and of its
    field's type, unset fields from `base` (else the defaults). Nested dataclass fields are
    nested tables. Range checks are the class's own (__post_init__ raising ValueError)."""
    if table is not None and not isinstance(table, Mapping):
        raise SettingsError(f"{prefix}: expected a table, got {_toml_kind(table)}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    values: dict[str, Any] = {}
    for key, value in (table or {}).items():
        path = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise SettingsError(f"{path}: unknown key (known: {', '.join(names)})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):  # a nested table starts from the base's value
            inner = getattr(base, key) if base is not None else None
            values[key] = build(tp, value, path, inner)
        else:
            values[key] = _convert(value, tp, path)
    try:
        if base is not None:
            return dataclasses.replace(base, **values)
        return cls(**values)
    except SettingsError:
        raise
    except (ValueError, TypeError) as exc:
        where = prefix or cls.__name__
        raise SettingsError(f"{where}: {exc}") from None


# --------------------------------------------------------------------------- TOML out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def to_toml(obj: Any, table: str) -> str:
    """The dataclass `obj` as TOML under `[table]`, nested dataclasses as sub-tables.
    An unset (None) value is written as a comment, since TOML has no null."""
    scalars, nested = [], []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            nested.append(to_toml(value, f"{table}.{f.name}"))
        elif isinstance(value, Mapping):
            continue  # tables by name are written by their owner (agent/config.py)
        elif value is None:
            scalars.append(f"# {f.name} = (unset)")
        else:
            scalars.append(f"{f.name} = {_toml_value(value)}")
    out = [f"[{table}]", *scalars] if scalars or not nested else []
    return "\n\n".join(["\n".join(out)] * bool(out) + nested)


def settings_fields(cls: type, prefix: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, type, default) of every setting under `cls`, nested ones included:
    what docs/configuration.md must cover."""
    out = []
    default = cls()
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(settings_fields(tp, f"{prefix}.{f.name}"))
        else:
            out.append((f"{prefix}.{f.name}", tp, getattr(default, f.name)))
    return out


def flag_help(text: str, cls: type, name: str, table: str) -> str:
    """The help of a flag over a setting: `text`, then the setting's key in the settings
    file and its default, read from `cls` (so no help repeats a default by hand). An unset
    (None) default is left to `text` to describe."""
    default = getattr(cls(), name)
    shown = "" if default is None else f" = {_toml_value(default)}"
    return f"{text} [{table}] {name}{shown}"
