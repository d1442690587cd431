"""A small YAML writer for the files Prometheus reads (rules, unit tests, config).

Block style for mappings and lists, every string double-quoted with JSON escapes (a valid
YAML scalar that never turns into a number, a boolean or a comment). Keys are written in
the order given, so the files read like Prometheus's own examples. The repository has no
YAML library and needs none for this.
"""

from __future__ import annotations

import json
from typing import Any

_PLAIN_KEY = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _key(k: str) -> str:
    return k if k and set(k) <= _PLAIN_KEY else json.dumps(k)


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    if isinstance(v, str):
        return json.dumps(v)
    raise TypeError(f"cannot write {type(v).__name__} as YAML")


def _lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return [pad + "{}"]
        out = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{_key(k)}:")
                out += _lines(v, indent + 2)
            else:
                out.append(f"{pad}{_key(k)}: {_inline(v)}")
        return out
    if isinstance(value, list):
        if not value:
            return [pad + "[]"]
        out = []
        for item in value:
            if isinstance(item, (dict, list)) and item:
                body = _lines(item, indent + 2)
                out.append(f"{pad}- {body[0].lstrip()}")
                out += body[1:]
            else:
                out.append(f"{pad}- {_inline(item)}")
        return out
    return [pad + _scalar(value)]


def _inline(v: Any) -> str:
    if isinstance(v, dict):
        return "{}"
    if isinstance(v, list):
        return "[]"
    return _scalar(v)


def dump(value: Any, header: str = "") -> str:
    """`value` as YAML text; `header` lines become comments at the top."""
    comments = [f"# {line}".rstrip() for line in header.splitlines()]
    return "\n".join([*comments, *_lines(value, 0)]) + "\n"
