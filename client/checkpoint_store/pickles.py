"""Data-only pickles: ``DataUnpickler`` reads a pickle as ``torch.load(weights_only=True)``
does (checkpoints' ``state.pkl`` and tier-0 snapshots)."""

from __future__ import annotations

import _compat_pickle
import codecs
import collections
import pickle
from typing import Any

from .layout import _short

#: What a data-only pickle may name: the standard library's part of the allowlist of
#: ``torch.load(weights_only=True)`` (torch/_weights_only_unpickler.py), plus frozenset
#: (protocols < 4 name it). Each builds data whatever its arguments: no code of the file's.
_DATA_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "Counter"): collections.Counter,
    ("_codecs", "encode"): codecs.encode,  # bytes, in protocols < 3
    ("builtins", "bytearray"): bytearray,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
}


class DataUnpickler(pickle.Unpickler):
    """Unpickles data only, as ``torch.load(weights_only=True)`` does: containers, strings,
    bytes and numbers. Any other global (a class or function: how a pickle runs code) is
    refused with ``pickle.UnpicklingError`` before it is called; so is a persistent id.
    Checkpoints (``state.pkl``) and tier-0 snapshots are read with it."""

    def find_class(self, module: str, name: str) -> Any:
        # protocols < 3 write Python 2's names (__builtin__.set): read them as pickle does
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        else:
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        found = _DATA_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(
                f"{_short(f'{module}.{name}', 80)} is not allowed: data only (weights_only)"
            )
        return found
