"""Non-finite numbers on the wire: the one encoding, both ways.

JSON has no NaN or infinities, and a diverged loss is exactly what the supervisor must
see, so every non-finite float crosses a process boundary as one of the strings
``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (the spellings Python's ``json`` module uses
for its non-standard literals, so a human reading an answer sees the same words). The
telemetry datagram, the agent's answers and the supervisor's records all use these
functions; nothing else encodes or decodes them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import ContractError

__all__ = ["NON_FINITE", "decode_float", "encode_float", "json_safe"]

#: The wire spelling of each non-finite float.
NON_FINITE: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_float(value: float | None) -> float | str | None:
    """A float for strict JSON: itself when finite, else its :data:`NON_FINITE` string."""
    if value is None or math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def decode_float(value: Any, field: str, *, finite: bool = True) -> float:
    """A wire number as a float: an int or float, or (``finite=False``) a
    :data:`NON_FINITE` string. Raises :class:`ContractError` naming ``field`` otherwise
    (a bool, another string, a non-finite value where only finite ones are allowed)."""
    if isinstance(value, str):
        if finite or value not in NON_FINITE:
            raise ContractError(
                "bad_type", f"{field}: expected a number, got {value[:20]!r}", field
            )
        return NON_FINITE[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ContractError(
            "bad_type", f"{field}: expected a number, got {type(value).__name__}", field
        )
    try:
        number = float(value)
    except OverflowError:
        raise ContractError(
            "out_of_range", f"{field}: integer too large for a float", field
        ) from None
    if finite and not math.isfinite(number):
        raise ContractError("out_of_range", f"{field}: {number!r} is not finite", field)
    return number


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float encoded (:func:`encode_float`), recursively
    through mappings, lists and tuples: the last step before ``json.dumps(allow_nan=False)``."""
    if isinstance(value, float):
        return encode_float(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
