"""Per-GPU samplers: the GPU collector's extra NVML readings, one file each, registered
by name, run inside the collector's per-GPU read (so under its deadline: a hung NVML
call holds that GPU's read thread only, never the agent's loop).

A sampler declares the NVML field ids it wants (`fields`, read every collection;
`slow_fields`, read every `slow_interval` seconds of [collectors.gpu]). The runner reads
each set in **one** batched `nvmlDeviceGetFieldValues` call per GPU, decodes the values
(`field_value`: None for a field the GPU does not support) and hands them to the
sampler's `read` / `read_slow`, which may make further NVML calls of its own through
`optional` (a query the GPU does not support gives None). A slow reading is kept between
its samples. `metrics` turns every GPU's readings into metric families and `facts` adds
the sampler's keys to the GPU's `/v1/node` facts; both are pure.

Failure model: NVML_ERROR_NOT_SUPPORTED (and any other error but a lost GPU) leaves the
sampler's values out, with the reason in the GPU's `samplers_skipped` fact; a sampler
that raises anything else is skipped the same way (logged once per sampler and reason),
never failing the collection. GPU_IS_LOST / RESET_REQUIRED propagate as `NVMLError`: the
collector marks the GPU lost.

Adding a sampler: a new `gpu_<name>.py` with a `@register_sampler` subclass of
`GpuSampler`, imported in `gpu.py:load_samplers()` (the collector that runs them: a
sampler module imports this one, so this one cannot import them).
"""

from __future__ import annotations

import logging
from abc import ABC
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pynvml

from . import Metric, registrar

log = logging.getLogger("rankguard.agent.collectors.gpu")

LOST_ERRORS = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED})


# --- pure helpers --------------------------------------------------------------------------


def field_value(fv: Any) -> float | None:
    """The value of one `c_nvmlFieldValue_t` by its valueType; None when NVML answered the
    field with an error (NOT_SUPPORTED on this GPU) or an unknown value type."""
    if fv.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    member = {
        pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        getattr(pynvml, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
    }.get(fv.valueType)
    return None if member is None else float(getattr(fv.value, member))


def ns_to_seconds(ns: float) -> float:
    return ns / 1e9


# --- the sampler interface ----------------------------------------------------------------


class Skip(Exception):
    """A sampler's clear "nothing to read on this GPU" (unsupported, garbage)."""


class GpuSampler(ABC):
    """One kind of extra per-GPU reading. `read` / `read_slow` return a JSON-able dict
    (or None: nothing on this GPU); `metrics` and `facts` are pure."""

    name: ClassVar[str]
    fields: ClassVar[dict[str, int]] = {}  # key -> NVML_FI_DEV_* id, read every collection
    slow_fields: ClassVar[dict[str, int]] = {}  # read every slow_interval seconds

    def read(self, call: Callable[..., Any], values: dict[str, float | None]) -> dict | None:
        """Every collection: `values` holds this sampler's `fields` by key."""
        return None

    def read_slow(self, call: Callable[..., Any], values: dict[str, float | None]) -> dict | None:
        """Every slow_interval seconds: `values` holds this sampler's `slow_fields`."""
        return None

    def metrics(self, gpus: list[tuple[tuple[str, str], dict]]) -> list[Metric]:
        """Families from ((gpu, uuid), merged reading) of every GPU with a reading."""
        return []

    def facts(self, reading: dict) -> dict[str, Any]:
        """Keys added to the GPU's facts (what health.py judges)."""
        return {}


SAMPLERS: dict[str, type[GpuSampler]] = {}


register_sampler = registrar(SAMPLERS, "GPU sampler")


# --- running them inside one GPU's read ----------------------------------------------------


@dataclass
class SamplerState:
    """What one GPU keeps between reads: the slow readings and when they are next due."""

    slow: dict[str, dict | None] = field(default_factory=dict)
    slow_skipped: dict[str, str | None] = field(default_factory=dict)  # why, by sampler
    next_slow: float = float("-inf")


def _optional(nvml: Any, handle: Any) -> Callable[..., Any]:
    def call(fn_name: str, *args: Any) -> Any:
        """One NVML query on this GPU; None if unsupported; a lost GPU propagates."""
        try:
            return getattr(nvml, fn_name)(handle, *args)
        except pynvml.NVMLError as exc:
            if exc.value in LOST_ERRORS:
                raise
            return None

    return call


def _read_fields(nvml: Any, handle: Any, wanted: dict[tuple[str, str], int]) -> dict:
    """One batched nvmlDeviceGetFieldValues for every (sampler, key) -> field id; all None
    when the call itself is unsupported (an old driver)."""
    if not wanted:
        return {}
    ids = list(wanted.values())
    try:
        raw = nvml.nvmlDeviceGetFieldValues(handle, ids)
    except pynvml.NVMLError as exc:
        if exc.value in LOST_ERRORS:
            raise
        return dict.fromkeys(wanted)
    return {key: field_value(raw[i]) for i, key in enumerate(wanted)}


class Samplers:
    """The registered samplers, run per GPU by the collector."""

    def __init__(
        self,
        slow_interval: float,
        registry: dict[str, type[GpuSampler]],
        names: Iterable[str] | None = None,
        core_fields: dict[str, int] | None = None,
    ) -> None:
        self.slow_interval = slow_interval
        self.samplers = [registry[n]() for n in (names if names is not None else sorted(registry))]
        # The collector's own counters ride in the same batched call (sampler name "").
        self._core = {("", k): fid for k, fid in (core_fields or {}).items()}
        self._fast = {**self._core,
                      **{(s.name, k): fid for s in self.samplers for k, fid in s.fields.items()}}  # fmt: skip
        self._slow = {(s.name, k): fid for s in self.samplers for k, fid in s.slow_fields.items()}
        self._logged: set[tuple[str, str]] = set()

    def read(self, nvml: Any, handle: Any, state: SamplerState,
             now: float) -> tuple[dict[str, Any], dict[str, float | None]]:  # fmt: skip
        """(name -> merged reading (slow values kept from their last sample), plus
        "_skipped": {name: reason} for samplers that had nothing to say on this GPU;
        the collector's `core_fields` by key, None where unsupported)."""
        call = _optional(nvml, handle)
        fast_values = _read_fields(nvml, handle, self._fast)
        core = {key: fast_values[(name, key)] for name, key in self._core}
        slow_due = now >= state.next_slow
        if slow_due:
            slow_values = _read_fields(nvml, handle, self._slow)
            state.next_slow = now + self.slow_interval
        out: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        for s in self.samplers:
            if slow_due:
                mine = {k: slow_values.get((s.name, k)) for k in s.slow_fields}
                why: dict[str, str] = {}
                state.slow[s.name] = self._run(s, s.read_slow, call, mine, why)
                state.slow_skipped[s.name] = why.get(s.name)
            mine = {k: fast_values.get((s.name, k)) for k in s.fields}
            fast = self._run(s, s.read, call, mine, skipped)
            merged = {**(state.slow.get(s.name) or {}), **(fast or {})}
            if merged:
                out[s.name] = merged
            if s.name not in skipped:  # the slow part's reason holds until its next sample
                why = state.slow_skipped.get(s.name)
                why = why or (None if merged else "not supported on this GPU")
                if why:
                    skipped[s.name] = why
        if skipped:
            out["_skipped"] = skipped
        return out, core

    def _run(self, s: GpuSampler, fn: Callable, call: Callable, values: dict,
             skipped: dict[str, str]) -> dict | None:  # fmt: skip
        try:
            return fn(call, values)
        except pynvml.NVMLError as exc:
            if exc.value in LOST_ERRORS:
                raise
            reason = f"NVML: {exc}"
        except Skip as exc:
            reason = str(exc)
        except Exception as exc:  # a sampler's bug or garbage from the driver: skip it
            reason = f"{type(exc).__name__}: {exc}"
        if (s.name, reason) not in self._logged:
            self._logged.add((s.name, reason))
            log.warning("GPU sampler %s skipped: %s", s.name, reason)
        skipped[s.name] = reason
        return None

    def metrics(self, readings: Iterable[Any]) -> list[Metric]:
        """Families of every sampler over the collection's GpuReadings (lost ones have no
        samples)."""
        families: list[Metric] = []
        for s in self.samplers:
            gpus = [((str(r.index), r.uuid), r.samples[s.name]) for r in readings
                    if s.name in r.samples]  # fmt: skip
            families += s.metrics(gpus)
        return families

    def facts(self, samples: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for s in self.samplers:
            if s.name in samples:
                out.update(s.facts(samples[s.name]))
        if samples.get("_skipped"):
            out["samplers_skipped"] = dict(samples["_skipped"])
        return out
