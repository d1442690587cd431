"""An NVML double for machines without GPUs.

`NvmlDouble` is a module-like object with the same function names and signatures as
`pynvml` for the subset the GPU collector uses. It returns the real pynvml ctypes
structures (device handles, memory/utilisation structs, GPM samples and metric tables,
event data) and raises real `pynvml.NVMLError` instances, so the collector runs the
identical code path against the double and against a GPU. Anything not implemented
here that pynvml defines is forwarded: constants, structures and error classes as they
are; functions as stubs raising `NVMLError_FunctionNotFound` (what pynvml raises on a
driver that lacks the symbol).

State is a plain JSON-able dict (see `make_double` for every field):

    {"driver": "550.54.15", "unavailable": null | "library_not_found" | ...,
     "gpus": [{"name": ..., "uuid": ..., "util": 97, "mem_used": ..., "lost": false, ...}],
     "xid_events": [{"gpu": 0, "xid": 79}]}

Built from a dict or with `NvmlDouble.from_file(path)`. A file-backed double re-reads
the file when it has changed, at init, at each device count (a collection's first call)
and at each event wait, so another process (a test, a drill, `rankguard inject`)
can flip `"lost": true` on a GPU or append to `"xid_events"`; each appended event is
delivered once through `nvmlEventSetWait_v2`. Write the file with `write_state` (atomic
rename, strictly newer mtime) so that no change is missed or read half-written.
In-process tests can call `inject_xid`, `set_lost` and `update_gpu` instead.

Field values (`nvmlDeviceGetFieldValues`) come from the GPU's named fields (`FIELDS`
below: NVLink and PCIe error counters, violation times, memory temperature, power
limits); `"field_values": {"<field id>": value}` sets any other field, and a field
whose value is absent or null answers NVML_ERROR_NOT_SUPPORTED in its own entry, as
NVML does. `"nvlink_links"` (a list of booleans, null: no NVLink), `"pcie_link"`,
`"power_limit_mw"`/`"power_default_limit_mw"` and `"mig"` answer the per-call queries.

A GPU's `"delay_s"` makes every call on it take that many seconds (-1: hang until it is
changed), outside the double's lock, as a failing GPU's NVML calls block their caller
only: the collector's deadlines are tested against it. The top-level `"driver_delay_s"`
does the same to `nvmlInit` and the device count: a driver stuck as a whole.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
import types
import uuid
from collections import Counter
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

import pynvml

log = logging.getLogger("rankguard.agent.nvml_double")

ENV_VAR = "RANKGUARD_NVML_DOUBLE"

# Why nvmlInit fails, by the "unavailable" reason in the state.
UNAVAILABLE_ERRORS = {
    "library_not_found": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
    "driver_not_loaded": pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    "no_permission": pynvml.NVML_ERROR_NO_PERMISSION,
    "lib_rm_version_mismatch": pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    "unknown": pynvml.NVML_ERROR_UNKNOWN,
}

# Clock violation policies, by NVML_PERF_POLICY_<NAME> in lower case.
VIOLATION_POLICIES = ("power", "thermal", "sync_boost", "board_limit", "low_utilization",
                      "reliability", "total_app_clocks", "total_base_clocks")  # fmt: skip

# A file-backed double polls its file this often while blocked in an event wait. Rarely:
# every collector call rereads the file and wakes the waiter at once, so this only bounds
# the delay without collections, and each poll costs the agent's XID thread a wake-up
# (real NVML's wait sleeps until an event or its timeout).
_EVENT_POLL_S = 0.5


def make_double(n_gpus: int = 8, **overrides: Any) -> dict:
    """State for `n_gpus` H100-like GPUs. Overrides named `driver`, `unavailable` or
    `xid_events` set the top-level field; any other override is applied to every GPU."""
    top = {k: overrides.pop(k) for k in ("driver", "unavailable", "xid_events") if k in overrides}
    gpus = []
    for i in range(n_gpus):
        gpu = {
            "name": "NVIDIA H100 80GB HBM3",
            "uuid": f"GPU-{uuid.UUID(int=0x5EED_0000 + i, version=4)}",
            "util": 97,  # percent
            "mem_util": 45,  # percent
            "mem_used": 70 * 2**30,  # bytes
            "mem_total": 81559 * 2**20,  # bytes, what an H100 80GB HBM3 reports
            "temp": 62,  # Celsius
            "power_mw": 512_000,
            "energy_mj": 1_000_000_000 + i * 1000,
            "sm_clock_mhz": 1980,
            "mem_clock_mhz": 2619,
            "clock_event_reasons": 0,  # nvmlClocksEventReason* bitmask
            "ecc": {"corrected": 0, "uncorrected": 0},  # volatile; null: ECC off
            "retired_pages": None,  # Hopper retires rows, not pages: NOT_SUPPORTED
            "retired_pages_pending": False,
            "remapped_rows": {
                "correctable": 0,
                "uncorrectable": 0,
                "pending": False,
                "failure": False,
            },
            "pcie_tx_kbps": 1_500_000,
            "pcie_rx_kbps": 3_000_000,
            "gpm": True,
            # GPM metrics by NVML_GPM_METRIC_<NAME> in lower case, percent.
            "gpm_metrics": {"sm_util": 88.0, "any_tensor_util": 61.5, "dram_bw_util": 42.0},
            "xid_supported": True,
            # NVLink: 18 links up (H100 SXM), error totals over all links
            "nvlink_links": [True] * 18,
            "nvlink_errors": {"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0},
            "pcie_replays": 0,
            "pcie_link": {"gen": 5, "max_gen": 5, "width": 16, "max_width": 16},
            # nanoseconds a policy held clocks down, by NVML_PERF_POLICY_<NAME> in lower case
            "violation_ns": dict.fromkeys(VIOLATION_POLICIES, 0),
            "mem_temp": 48,  # Celsius (HBM)
            "power_limit_mw": 700_000,
            "power_default_limit_mw": 700_000,
            "mig": {"mode": 0, "devices": 0},  # null: not MIG-capable
            "field_values": {},  # other NVML_FI_DEV_* ids (as strings) -> value
            "processes": [],  # [{"pid": ..., "used_memory": bytes}]
            "lost": False,
        }
        gpu.update(overrides)
        gpus.append(gpu)
    return {"driver": "550.54.15", "unavailable": None, "gpus": gpus, "xid_events": [], **top}


def write_state(path: str | os.PathLike, state: dict) -> None:
    """Write a double's state file atomically, with an mtime strictly newer than the
    file it replaces (so a reader comparing mtimes sees every write)."""
    path = Path(path)
    try:
        old_ns = path.stat().st_mtime_ns
    except FileNotFoundError:
        old_ns = 0
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(state, indent=1))
    stamp = max(time.time_ns(), old_ns + 1)
    os.utime(tmp, ns=(stamp, stamp))
    os.replace(tmp, path)


def load_nvml(double_path: str | None = None) -> Any:
    """The NVML module to use: the double when a path is given or `RANKGUARD_NVML_DOUBLE`
    names one, else the real `pynvml` (whose nvmlInit fails cleanly without a GPU)."""
    path = double_path or os.environ.get(ENV_VAR) or None
    if path:
        return NvmlDouble.from_file(path)
    return pynvml


def _sub(*keys: str) -> Callable[[dict], Any]:
    def get(gpu: dict) -> Any:
        value: Any = gpu
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    return get


def _retired(key: str) -> Callable[[dict], Any]:
    def get(gpu: dict) -> Any:
        pages = gpu.get("retired_pages")
        if pages is None:
            return None  # a GPU that remaps rows instead
        if key == "pending":
            return int(bool(gpu.get("retired_pages_pending")))
        if not isinstance(pages, dict):  # a bare count means double-bit retirements
            pages = {"double_bit": pages}
        return int(pages.get(key, 0))

    return get


def _remapped(key: str) -> Callable[[dict], Any]:
    def get(gpu: dict) -> Any:
        rows = gpu.get("remapped_rows")
        return None if rows is None else int(rows.get(key, 0))

    return get


# NVML field id -> the GPU state value it reads (None: NOT_SUPPORTED in that entry).
FIELDS: dict[int, Callable[[dict], Any]] = {
    pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: _sub("energy_mj"),
    pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: _sub("ecc", "corrected"),
    pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: _sub("ecc", "uncorrected"),
    pynvml.NVML_FI_DEV_RETIRED_SBE: _retired("single_bit"),
    pynvml.NVML_FI_DEV_RETIRED_DBE: _retired("double_bit"),
    pynvml.NVML_FI_DEV_RETIRED_PENDING: _retired("pending"),
    pynvml.NVML_FI_DEV_REMAPPED_COR: _remapped("correctable"),
    pynvml.NVML_FI_DEV_REMAPPED_UNC: _remapped("uncorrectable"),
    pynvml.NVML_FI_DEV_REMAPPED_PENDING: _remapped("pending"),
    pynvml.NVML_FI_DEV_REMAPPED_FAILURE: _remapped("failure"),
    pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: _sub("nvlink_errors", "crc_flit"),
    pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: _sub("nvlink_errors", "crc_data"),
    pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: _sub("nvlink_errors", "replay"),
    pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: _sub("nvlink_errors", "recovery"),
    pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT: lambda g: (
        None if g.get("nvlink_links") is None else len(g["nvlink_links"])
    ),
    pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER: _sub("pcie_replays"),
    pynvml.NVML_FI_DEV_MEMORY_TEMP: _sub("mem_temp"),
    pynvml.NVML_FI_DEV_POWER_CURRENT_LIMIT: _sub("power_limit_mw"),
    pynvml.NVML_FI_DEV_POWER_DEFAULT_LIMIT: _sub("power_default_limit_mw"),
    **{
        getattr(pynvml, f"NVML_FI_DEV_PERF_POLICY_{name.upper()}"): _sub("violation_ns", name)
        for name in VIOLATION_POLICIES
    },
}


def _address(ptr: Any) -> int | None:
    """The address a ctypes pointer holds: how handles and samples are told apart."""
    return ctypes.cast(ptr, ctypes.c_void_p).value


# The calls that pick up changes to the state file: init, the device count (the first call
# of every collection) and the event wait (the XID thread). A stat per call (about 90 a
# collection at 8 GPUs) was most of the double's cost, which the agent's overhead
# benchmark then counted as the agent's; a collection reads one consistent snapshot.
_RELOAD_ON = frozenset({"nvmlInit", "nvmlInitWithFlags", "nvmlDeviceGetCount",
                        "nvmlEventSetWait", "nvmlEventSetWait_v2"})  # fmt: skip


# The calls on no GPU that `driver_delay_s` holds: a hung driver blocks them all.
_DRIVER_CALLS = frozenset({"nvmlInit", "nvmlInitWithFlags", "nvmlDeviceGetCount"})


def _api(fn: Callable) -> Callable:
    """Wrap an NVML entry point: count the call, pick up file changes, require init."""
    name = fn.__name__
    needs_init = name not in ("nvmlInit", "nvmlInitWithFlags")
    reloads = name in _RELOAD_ON

    @wraps(fn)
    def wrapper(self: NvmlDouble, *args: Any, **kwargs: Any) -> Any:
        if args:  # a call on a GPU whose state says it answers slowly, or hangs
            self._answer_late(args[0], name)
        elif name in _DRIVER_CALLS:  # a driver that answers slowly, or hangs
            self._driver_late()
        with self._lock:
            self.calls[name] += 1
            if reloads:
                self._maybe_reload()
            if needs_init:
                if self._init_count == 0:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
                if self._state.get("unavailable"):
                    raise pynvml.NVMLError(self._unavailable_error())
            return fn(self, *args, **kwargs)

    return wrapper


class NvmlDouble:
    """See the module docstring. Thread-safe: the collector's event thread blocks in
    `nvmlEventSetWait_v2` while the collector reads devices."""

    def __init__(self, state: dict | None = None, *, path: str | os.PathLike | None = None):
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self.calls: Counter[str] = Counter()  # NVML calls by function name
        self._path = Path(path) if path is not None else None
        self._file_sig: tuple[int, int, int] | None = None
        self._state: dict = {"gpus": []}
        self._xid_seen = 0  # how many of state["xid_events"] have been queued
        self._pending_xids: list[tuple[int, int]] = []  # (gpu, xid) not yet delivered
        self._init_count = 0
        # ctypes buffers behind the handles we give out, by address.
        self._buffers: dict[int, ctypes.Array] = {}
        self._handles: dict[int, Any] = {}  # gpu index -> c_nvmlDevice_t
        self._handle_index: dict[int, int] = {}  # handle address -> gpu index
        self._event_sets: dict[int, set[int]] = {}  # set address -> registered gpu indexes
        self._samples: dict[int, dict | None] = {}  # GPM sample address -> snapshot
        self._sample_seq = 0
        with self._lock:
            if state is not None:
                self._set_state(state)
            if self._path is not None:
                self._maybe_reload()
                if self._file_sig is None:
                    raise FileNotFoundError(f"NVML double state file unreadable: {self._path}")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> NvmlDouble:
        return cls(path=path)

    # --- state -----------------------------------------------------------------------

    def _set_state(self, state: dict) -> None:
        self._state = json.loads(json.dumps(state))  # a private, JSON-clean copy
        events = self._state.setdefault("xid_events", [])
        # Entries beyond those already queued are new; a shortened list starts over.
        self._xid_seen = min(self._xid_seen, len(events))
        for ev in events[self._xid_seen :]:
            self._pending_xids.append((int(ev["gpu"]), int(ev["xid"])))
        self._xid_seen = len(events)
        self._wake.notify_all()

    def _maybe_reload(self) -> None:
        if self._path is None:
            return
        try:
            st = self._path.stat()
        except OSError:
            return  # keep the last good state; the writer may be mid-rename
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig == self._file_sig:
            return
        try:
            state = json.loads(self._path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("NVML double: cannot read %s: %s (keeping last state)", self._path, exc)
            return
        self._file_sig = sig
        self._set_state(state)

    def state(self) -> dict:
        """A copy of the current state."""
        with self._lock:
            self._maybe_reload()
            return json.loads(json.dumps(self._state))

    def inject_xid(self, gpu: int, xid: int) -> None:
        """Queue one XID event on `gpu`, delivered once through nvmlEventSetWait_v2."""
        with self._lock:
            self._pending_xids.append((gpu, xid))
            self._wake.notify_all()

    def set_lost(self, gpu: int, lost: bool = True) -> None:
        """Make every call on `gpu` answer NVML_ERROR_GPU_IS_LOST (or stop doing so)."""
        self.update_gpu(gpu, lost=lost)

    def update_gpu(self, gpu: int, **fields: Any) -> None:
        with self._lock:
            self._state["gpus"][gpu].update(fields)

    def set_unavailable(self, reason: str | None) -> None:
        with self._lock:
            self._state["unavailable"] = reason

    def _unavailable_error(self) -> int:
        reason = str(self._state.get("unavailable"))
        return UNAVAILABLE_ERRORS.get(reason, pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    def _answer_late(self, handle: Any, name: str = "") -> None:
        """A GPU's `delay_s` (seconds each call on it takes) before the call, outside the
        lock as a real driver's slow call would block only its caller: a failing GPU whose
        NVML calls block for seconds, or forever while `delay_s` is -1. Without one, the
        GPU's `latency_s` ({function name or "default": seconds}) gives each call its
        ordinary latency (bench/agent_overhead.py: a healthy GPU's measured figures)."""
        try:
            index = self._handle_index.get(_address(handle) or 0)
        except (TypeError, ctypes.ArgumentError):
            return  # not a handle (a count, an event set)
        if index is None:
            return
        start = time.monotonic()
        while True:
            with self._lock:
                gpu = self._state["gpus"][index]
                delay = float(gpu.get("delay_s") or 0)
                if not delay and gpu.get("latency_s"):
                    latency = gpu["latency_s"]
                    delay = float(latency.get(name, latency.get("default", 0)) or 0)
            if delay >= 0:
                left = start + delay - time.monotonic()
                if left <= 0:
                    return
                time.sleep(min(left, 0.05))  # re-read: a delay may be changed meanwhile
            else:
                time.sleep(0.05)

    def _driver_late(self) -> None:
        """The state's `driver_delay_s` before init and the device count (-1: hang until
        it is changed): a driver stuck as a whole, not one GPU."""
        start = time.monotonic()
        while True:
            with self._lock:
                delay = float(self._state.get("driver_delay_s") or 0)
            if delay >= 0 and time.monotonic() >= start + delay:
                return
            time.sleep(0.05)

    def set_driver_delay(self, seconds: float) -> None:
        with self._lock:
            self._state["driver_delay_s"] = seconds

    def _gpu(self, handle: Any) -> dict:
        index = self._handle_index.get(_address(handle) or 0)
        if index is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpus = self._state["gpus"]
        if index >= len(gpus) or gpus[index].get("lost"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpus[index]

    def _field(self, handle: Any, key: str) -> Any:
        """A GPU field; absent or null means the GPU does not support the query."""
        value = self._gpu(handle).get(key)
        if value is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def _new_pointer(self, ptr_type: Any) -> Any:
        buf = ctypes.create_string_buffer(8)
        ptr = ctypes.cast(buf, ptr_type)
        self._buffers[_address(ptr)] = buf
        return ptr

    # --- module-like fallthrough -----------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)  # AttributeError for names pynvml lacks too
        if name.startswith("nvml") and isinstance(value, types.FunctionType):

            def not_found(*args: Any, **kwargs: Any) -> Any:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

            not_found.__name__ = name
            return not_found
        return value

    # --- init --------------------------------------------------------------------------

    @_api
    def nvmlInit(self) -> None:
        if self._state.get("unavailable"):
            raise pynvml.NVMLError(self._unavailable_error())
        self._init_count += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.nvmlInit()

    @_api
    def nvmlShutdown(self) -> None:
        self._init_count -= 1

    @_api
    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self._state.get("driver", ""))

    # --- devices -----------------------------------------------------------------------

    @_api
    def nvmlDeviceGetCount(self) -> int:
        return len(self._state["gpus"])

    @_api
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        gpus = self._state["gpus"]
        if not 0 <= index < len(gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if gpus[index].get("lost"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if index not in self._handles:  # NVML hands out the same handle every time
            handle = self._new_pointer(pynvml.c_nvmlDevice_t)
            self._handles[index] = handle
            self._handle_index[_address(handle)] = index
        return self._handles[index]

    @_api
    def nvmlDeviceGetName(self, handle: Any) -> str:
        return str(self._field(handle, "name"))

    @_api
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return str(self._field(handle, "uuid"))

    @_api
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._gpu(handle)
        return pynvml.c_nvmlUtilization_t(
            gpu=int(self._field(handle, "util")), memory=int(gpu.get("mem_util") or 0)
        )

    @_api
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        total = int(self._field(handle, "mem_total"))
        used = int(self._field(handle, "mem_used"))
        return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    @_api
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(self._field(handle, "temp"))

    @_api
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return int(self._field(handle, "power_mw"))

    @_api
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return int(self._field(handle, "energy_mj"))

    @_api
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:  # noqa: A002 - pynvml's name
        if type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            return int(self._field(handle, "sm_clock_mhz"))
        if type == pynvml.NVML_CLOCK_MEM:
            return int(self._field(handle, "mem_clock_mhz"))
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    @_api
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return int(self._field(handle, "clock_event_reasons"))

    @_api
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return int(self._field(handle, "clock_event_reasons"))

    @_api
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        # Volatile and aggregate counters read the same unless "ecc_aggregate" is given.
        key = "ecc_aggregate" if counterType == pynvml.NVML_AGGREGATE_ECC else "ecc"
        ecc = self._gpu(handle).get(key) or self._field(handle, "ecc")
        kind = (
            "uncorrected" if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "corrected"
        )
        return int(ecc.get(kind, 0))

    @_api
    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]:
        pages = self._field(device, "retired_pages")
        if not isinstance(pages, dict):  # a bare count means double-bit retirements
            pages = {"double_bit": pages}
        key = (
            "double_bit"
            if sourceFilter == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            else "single_bit"
        )
        base = 0x1000_0000 * (1 + sourceFilter)
        return [base + 0x1000 * i for i in range(int(pages.get(key, 0)))]

    @_api
    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        self._field(device, "retired_pages")  # unsupported together with page retirement
        return int(bool(self._gpu(device).get("retired_pages_pending")))

    @_api
    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        rows = self._field(device, "remapped_rows")
        return (
            int(rows.get("correctable", 0)),
            int(rows.get("uncorrectable", 0)),
            int(bool(rows.get("pending"))),
            int(bool(rows.get("failure"))),
        )

    @_api
    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        key = "pcie_tx_kbps" if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else "pcie_rx_kbps"
        return int(self._field(device, key))

    @_api
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return [
            pynvml.nvmlFriendlyObject(
                {
                    "pid": int(p["pid"]),
                    "usedGpuMemory": p.get("used_memory"),
                    "gpuInstanceId": 0xFFFFFFFF,
                    "computeInstanceId": 0xFFFFFFFF,
                }
            )
            for p in self._gpu(handle).get("processes") or []
        ]

    # --- batched fields, links, limits, MIG ----------------------------------------------

    @_api
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list) -> Any:
        gpu = self._gpu(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        extra = gpu.get("field_values") or {}
        now_us = int(time.time() * 1e6)
        for i, field_id in enumerate(fieldIds):
            fid, scope = field_id if isinstance(field_id, tuple) else (field_id, 0)
            entry = values[i]
            entry.fieldId, entry.scopeId, entry.timestamp = fid, scope, now_us
            value = extra.get(str(fid), FIELDS[fid](gpu) if fid in FIELDS else None)
            if value is None:
                entry.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            entry.nvmlReturn = pynvml.NVML_SUCCESS
            if isinstance(value, float):
                entry.valueType, entry.value.dVal = pynvml.NVML_VALUE_TYPE_DOUBLE, value
            else:
                entry.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                entry.value.ullVal = int(value)
        return values

    @_api
    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        links = self._field(device, "nvlink_links")
        if not 0 <= link < len(links):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if links[link] else pynvml.NVML_FEATURE_DISABLED

    def _pcie(self, handle: Any, key: str) -> int:
        value = self._field(handle, "pcie_link").get(key)
        if value is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(value)

    @_api
    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return self._pcie(handle, "gen")

    @_api
    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        return self._pcie(handle, "max_gen")

    @_api
    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self._pcie(handle, "width")

    @_api
    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return self._pcie(handle, "max_width")

    @_api
    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return int(self._field(handle, "pcie_replays"))

    @_api
    def nvmlDeviceGetViolationStatus(self, device: Any, perfPolicyType: int) -> Any:
        names = {getattr(pynvml, f"NVML_PERF_POLICY_{k.upper()}"): k for k in VIOLATION_POLICIES}
        ns = (self._field(device, "violation_ns") or {}).get(names.get(perfPolicyType, ""))
        if ns is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlViolationTime_t(referenceTime=int(time.time() * 1e6),
                                            violationTime=int(ns))  # fmt: skip

    @_api
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return int(self._field(handle, "power_limit_mw"))

    @_api
    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: Any) -> int:
        return int(self._field(handle, "power_default_limit_mw"))

    @_api
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        mode = int(self._field(device, "mig").get("mode") or 0)
        return [mode, mode]

    @_api
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        self._field(device, "mig")
        return 7  # an H100's most

    @_api
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        mig = self._field(device, "mig")
        if not mig.get("mode") or not 0 <= index < int(mig.get("devices") or 0):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return self._new_pointer(pynvml.c_nvmlDevice_t)

    # --- GPM: two samples, metrics computed between them ----------------------------------

    @_api
    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(bool(self._gpu(device).get("gpm")))
        return support

    @_api
    def nvmlGpmSampleAlloc(self) -> Any:
        sample = self._new_pointer(pynvml.c_nvmlGpmSample_t)
        self._samples[_address(sample)] = None
        return sample

    @_api
    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        addr = _address(gpmSample)
        if addr not in self._samples:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        del self._samples[addr]
        del self._buffers[addr]

    @_api
    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        addr = _address(gpmSample)
        if addr not in self._samples:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpu(device)
        if not gpu.get("gpm"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._sample_seq += 1
        values = {}
        for name, value in (gpu.get("gpm_metrics") or {}).items():
            metric_id = getattr(pynvml, f"NVML_GPM_METRIC_{name.upper()}", None)
            if metric_id is not None:
                values[metric_id] = float(value)
        self._samples[addr] = {
            "seq": self._sample_seq,
            "gpu": self._handle_index[_address(device)],
            "values": values,
        }
        return gpmSample

    @_api
    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first = self._samples.get(_address(metricsGet.sample1) or 0)
        second = self._samples.get(_address(metricsGet.sample2) or 0)
        # Both samples taken, on the same GPU, the second after the first.
        if not first or not second or first["gpu"] != second["gpu"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if second["seq"] <= first["seq"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            value = second["values"].get(metric.metricId)
            metric.nvmlReturn = (
                pynvml.NVML_SUCCESS if value is not None else pynvml.NVML_ERROR_NOT_SUPPORTED
            )
            metric.value = value or 0.0
        return metricsGet

    # --- events --------------------------------------------------------------------------

    @_api
    def nvmlEventSetCreate(self) -> Any:
        event_set = self._new_pointer(pynvml.c_nvmlEventSet_t)
        self._event_sets[_address(event_set)] = set()
        return event_set

    @_api
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        registered = self._event_sets.get(_address(eventSet) or 0)
        if registered is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpu(handle)
        if eventTypes & pynvml.nvmlEventTypeXidCriticalError:
            if not gpu.get("xid_supported", True):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            registered.add(self._handle_index[_address(handle)])

    @_api
    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        registered = self._event_sets.get(_address(eventSet) or 0)
        if registered is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        deadline = time.monotonic() + timeoutms / 1000
        while True:
            self._maybe_reload()
            for pos, (gpu, xid) in enumerate(self._pending_xids):
                if gpu in registered:
                    del self._pending_xids[pos]
                    data = pynvml.c_nvmlEventData_t()
                    data.device = self._handles[gpu]
                    data.eventType = pynvml.nvmlEventTypeXidCriticalError
                    data.eventData = xid
                    return data
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            # Waiting releases the lock, so the collector keeps reading meanwhile.
            self._wake.wait(min(remaining, _EVENT_POLL_S) if self._path else remaining)

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    @_api
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        addr = _address(eventSet)
        if self._event_sets.pop(addr, None) is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        del self._buffers[addr]
