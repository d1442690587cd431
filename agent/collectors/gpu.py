"""GPU collector: NVML readings, GPM activity, XID events and rank GPU memory.

Works the same against the real `pynvml` and the `NvmlDouble` (same calls, same
structures, same `NVMLError`s). What it reads, and how often:

- every collect: utilisation, memory, temperature, power, energy, SM clock, clock event
  reasons, ECC, retired pages / remapped rows, and (when ranks run here) per-process
  memory;
- every `gpm_interval` s: GPM (Hopper+) SM, tensor and DRAM activity, computed by NVML
  between this GPM sample and the previous one;
- every `pcie_interval` s: PCIe throughput (each read blocks ~20 ms inside NVML);
- continuously: a thread waits on an NVML event set for XID critical errors and counts
  them by code.

NVML is `ctx.nvml` when set, else `load_nvml(None)`: the NVML double when the
`RANKGUARD_NVML_DOUBLE` environment variable names a state file, else the real pynvml.

Failure model: if NVML cannot start (no library, no driver, no GPU) `collect()` does not
raise; it reports `rankguard_gpu_nvml_up 0` and the reason, and retries at most every
`init_retry_interval` s. A GPU answering GPU_IS_LOST (or RESET_REQUIRED) is reported as
`rankguard_gpu_lost 1` with its info and XID counters; its measurements are omitted and
the other GPUs are unaffected. A query a GPU does not support is left out.

ECC counts are NVML's *volatile* counters (since the last driver load): they are the
errors of the node as it runs now, so a repaired and rebooted node starts clean, and a
driver reload looks to Prometheus like any counter reset. Lifetime history is kept by
retired pages / remapped rows, which are exported as gauges.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from ...contract.answers import XID_RECENT_SECONDS
from ...contract.xids import WATCH, meaning
from ..gpu_trends import Trends, describe
from ..nvml_double import load_nvml
from . import (
    JOB_LABEL,
    Collector,
    CollectorContext,
    CollectorResult,
    Metric,
    counter,
    gauge,
    info,
    register,
)
from .gpu_samplers import SAMPLERS, GpuSampler, Samplers, SamplerState

log = logging.getLogger("rankguard.agent.collectors.gpu")

# --- pure helpers: names, units, ids (no NVML calls) -------------------------------------

# Clock event ("throttle") reasons by the name we export.
CLOCK_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "applications_clocks": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
}

# GPM metrics we export (values are percent) by the metric name's stem.
GPM_METRICS: dict[str, int] = {
    "sm_activity": pynvml.NVML_GPM_METRIC_SM_UTIL,  # share of SMs busy (DCGM SM_ACTIVE)
    "tensor_activity": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,  # any tensor pipe busy
    "dram_bandwidth_utilization": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
}

# XIDs pre-created at zero on every GPU, so that the first occurrence is an increase
# Prometheus can see (a series born at 1 has no increase). Others appear when seen.
KNOWN_XIDS: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after previous errors",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

# Errors that mean the GPU itself is gone or unusable until reset.
LOST_ERRORS = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED})

KIB = 1024  # NVML's PCIe throughput is in KB/s, and NVML's KB is 1024 bytes


def clock_event_names(mask: int) -> list[str]:
    """Names of the active reasons in an nvmlClocksEventReason* bitmask."""
    return [name for name, bit in CLOCK_EVENT_REASONS.items() if mask & bit]


def percent_to_ratio(percent: float) -> float:
    return min(max(float(percent) / 100.0, 0.0), 1.0)


def mw_to_watts(mw: float) -> float:
    return mw / 1000.0


def mj_to_joules(mj: float) -> float:
    return mj / 1000.0


def mhz_to_hertz(mhz: float) -> float:
    return mhz * 1e6


def kbps_to_bytes_per_second(kbps: float) -> float:
    return kbps * KIB


def handle_key(handle: Any) -> int | None:
    """An NVML device handle is a pointer that stays the same for the session: its
    address identifies the GPU in event data."""
    return ctypes.cast(handle, ctypes.c_void_p).value


# --- configuration -----------------------------------------------------------------------


@dataclass(frozen=True)
class GpuConfig:
    """[collectors.gpu]"""

    enabled: bool = True
    gpm_interval: float = 1.0  # seconds between GPM samples (values cached meanwhile)
    pcie_interval: float = 10.0  # seconds between PCIe throughput reads
    init_retry_interval: float = 60.0  # seconds between nvmlInit attempts while down
    event_timeout_ms: int = 500  # XID wait; bounds how long close() waits for the thread
    # a GPU whose NVML reads take longer is unresponsive: the collection goes on without
    # it, and it is not called again until its call returns
    read_deadline_seconds: float = 2.0
    # seconds between slow samples (gpu_samplers.py: NVLink link state, PCIe link
    # generation and width, power limits, MIG)
    slow_interval: float = 30.0

    def __post_init__(self) -> None:
        if not self.read_deadline_seconds > 0:
            raise ValueError("GpuConfig.read_deadline_seconds must be > 0")
        for name in ("gpm_interval", "pcie_interval", "init_retry_interval", "slow_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"GpuConfig.{name} must be >= 0")
        if self.event_timeout_ms <= 0:
            raise ValueError("GpuConfig.event_timeout_ms must be > 0")


# --- per-GPU state and one reading ---------------------------------------------------------


@dataclass
class _Gpu:
    """What we keep about one GPU between collections."""

    index: int
    handle: Any = None
    uuid: str = ""
    name: str = ""
    lost: bool = False
    error: str | None = None
    gpm_supported: bool | None = None  # None: not asked yet
    gpm_samples: list[Any] = field(default_factory=list)  # [previous, spare]
    gpm_has_previous: bool = False
    gpm_values: dict[str, float] = field(default_factory=dict)  # stem -> ratio
    pcie: tuple[float, float] | None = None  # (tx, rx) bytes/s
    samples: SamplerState = field(default_factory=SamplerState)  # the samplers' slow state


@dataclass
class GpuReading:
    """One collection's measurements of one GPU; None where unsupported."""

    index: int
    uuid: str
    name: str
    lost: bool = False
    error: str | None = None
    utilization: float | None = None  # ratio
    memory_used: int | None = None
    memory_total: int | None = None
    temperature: float | None = None
    power_watts: float | None = None
    energy_joules: float | None = None
    sm_clock_hertz: float | None = None
    clock_event_mask: int | None = None
    ecc: dict[str, int] | None = None  # corrected / uncorrected
    retired_pages: dict[str, int] | None = None  # single_bit_ecc / double_bit_ecc
    retired_pages_pending: int | None = None
    remapped_rows: dict[str, int] | None = None  # correctable, uncorrectable, pending, failure
    gpm: dict[str, float] = field(default_factory=dict)
    gpm_supported: bool | None = None
    pcie: tuple[float, float] | None = None
    processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes
    unresponsive_seconds: float | None = None  # its NVML read has not returned for this long
    samples: dict[str, Any] = field(default_factory=dict)  # gpu_samplers.py, by sampler


# The reading's counters, read in the samplers' one batched nvmlDeviceGetFieldValues per
# GPU (not one call each: 14 NVML calls per GPU and collection became 8).
CORE_FIELDS = {
    "energy_mj": pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
    "ecc_corrected": pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL,  # volatile, since driver load
    "ecc_uncorrected": pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
    "retired_single_bit_ecc": pynvml.NVML_FI_DEV_RETIRED_SBE,  # pages; before Ampere
    "retired_double_bit_ecc": pynvml.NVML_FI_DEV_RETIRED_DBE,
    "retired_pending": pynvml.NVML_FI_DEV_RETIRED_PENDING,
    "remapped_correctable": pynvml.NVML_FI_DEV_REMAPPED_COR,  # rows; Ampere on
    "remapped_uncorrectable": pynvml.NVML_FI_DEV_REMAPPED_UNC,
    "remapped_pending": pynvml.NVML_FI_DEV_REMAPPED_PENDING,
    "remapped_failure": pynvml.NVML_FI_DEV_REMAPPED_FAILURE,
}


def _group(values: dict[str, float | None], prefix: str, keys: tuple[str, ...]) -> dict | None:
    """{key: int} of the fields `prefix + key`; None when the GPU supports none of them
    (ECC off, page retirement on a GPU that remaps rows)."""
    got = {k: values.get(prefix + k) for k in keys}
    if all(v is None for v in got.values()):
        return None
    return {k: int(v or 0) for k, v in got.items()}


def apply_core_fields(reading: GpuReading, values: dict[str, float | None]) -> None:
    energy = values.get("energy_mj")
    reading.energy_joules = None if energy is None else mj_to_joules(energy)
    reading.ecc = _group(values, "ecc_", ("corrected", "uncorrected"))
    reading.retired_pages = _group(values, "retired_", ("single_bit_ecc", "double_bit_ecc"))
    pending = values.get("retired_pending")
    if reading.retired_pages is not None and pending is not None:
        reading.retired_pages_pending = int(pending)
    reading.remapped_rows = _group(
        values, "remapped_", ("correctable", "uncorrectable", "pending", "failure")
    )


class _GpuLost(Exception):
    pass


class DriverHung(Exception):
    """A call on no GPU (init, the device count) did not return within the deadline."""


class _Call:
    """One call's outcome, filled in by the worker that runs it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._result = fn(*args)
        except BaseException as exc:  # handed to the collection, as a direct call would
            self._error = exc
        finally:
            self.done.set()

    def get(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result


class _Worker:
    """A standing daemon thread for one GPU's reads (or one driver call), a call at a
    time: a collection wakes it rather than starting a thread per GPU. A call that never
    returns holds this worker only, not the collection nor the agent's exit; the
    collector gives a busy worker nothing more until that call has returned."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Call:
        call = _Call()
        self._jobs.put((call, fn, args))
        return call

    def stop(self) -> None:
        """Ends the thread once its current call (if any) returns."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, fn, args = job
            call.run(fn, args)


# --- XID events --------------------------------------------------------------------------


class XidCounts:
    """Thread-safe XID counts by (gpu index, code); they outlive NVML re-inits. The newest
    events are kept with their time too, for what happened recently (`recent`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, keep: int = 4096) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, int], int] = {}
        self._clock = clock
        self._events: deque[tuple[float, int, int]] = deque(maxlen=keep)

    def add(self, gpu: int, xid: int) -> None:
        with self._lock:
            self._counts[(gpu, xid)] = self._counts.get((gpu, xid), 0) + 1
            self._events.append((self._clock(), gpu, xid))

    def snapshot(self) -> dict[tuple[int, int], int]:
        with self._lock:
            return dict(self._counts)

    def recent(self, seconds: float) -> dict[tuple[int, int], int]:
        """Counts by (gpu index, code) of the events of the last `seconds`."""
        since = self._clock() - seconds
        with self._lock:
            return dict(Counter((g, x) for t, g, x in self._events if t >= since))


class XidWatcher:
    """Registers XID critical errors on every GPU and counts them from a thread that
    waits on the NVML event set (NVML_ERROR_TIMEOUT just means nothing happened)."""

    def __init__(self, nvml: Any, counts: XidCounts, timeout_ms: int):
        self.nvml = nvml
        self.counts = counts
        self.timeout_ms = timeout_ms
        self.event_set: Any = None
        self.gpu_by_key: dict[int | None, int] = {}
        self.unsupported: list[str] = []
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def supported(self) -> bool:
        return self.event_set is not None and not self.unsupported

    def register(self, gpu: _Gpu) -> None:
        nvml = self.nvml
        try:
            if self.event_set is None:
                self.event_set = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(
                gpu.handle, nvml.nvmlEventTypeXidCriticalError, self.event_set
            )
        except pynvml.NVMLError as exc:
            self.unsupported.append(f"gpu {gpu.index}: {exc}")
            return
        self.gpu_by_key[handle_key(gpu.handle)] = gpu.index
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="rankguard-gpu-xid", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        nvml = self.nvml
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait_v2(self.event_set, self.timeout_ms)
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_TIMEOUT:
                    log.warning("XID event wait failed: %s", exc)
                    self._stop.wait(1.0)  # a persistent error must not spin
                continue
            except Exception:  # the thread must outlive anything NVML throws at it
                log.exception("XID event wait raised")
                self._stop.wait(1.0)
                continue
            if data.eventType & nvml.nvmlEventTypeXidCriticalError:
                gpu = self.gpu_by_key.get(handle_key(data.device), -1)
                self.counts.add(gpu, int(data.eventData))

    def stop_soon(self) -> None:
        """Ask the thread to end once its NVML call returns, without waiting (a hung
        driver): its event set is left allocated, as freeing it under the call is unsafe."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(self.timeout_ms / 1000 + 2.0)
            if self.thread.is_alive():  # still inside NVML: freeing the set would be unsafe
                log.warning("XID thread did not stop; leaving its event set allocated")
                return
        if self.event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(self.event_set)
            except pynvml.NVMLError as exc:
                log.debug("nvmlEventSetFree: %s", exc)
        self.event_set = None


# --- the collector -------------------------------------------------------------------------


@register
class GpuCollector(Collector):
    """NVML GPU metrics. Cadences come from `config` ([collectors.gpu]), else defaults."""

    name = "gpu"
    Config = GpuConfig

    def __init__(self, ctx: CollectorContext, config: GpuConfig | None = None):
        super().__init__(ctx, config)
        self.nvml: Any = ctx.nvml
        self.up = False
        self.reason: str | None = "not initialised yet"
        self.driver = ""
        self.gpus: list[_Gpu] = []
        self.xids = XidCounts()
        self.trends = Trends()  # a GPU failing before it crashes the job (gpu_trends.py)
        self.watcher: XidWatcher | None = None
        self._next_init = float("-inf")
        self._next_gpm = float("-inf")
        self._next_pcie = float("-inf")
        self._clock_reasons_fn = "nvmlDeviceGetCurrentClocksEventReasons"
        # Each GPU is read in a thread of its own, waited for up to read_deadline_seconds:
        # a hung NVML call (a failing GPU, a stuck driver) must not stop the agent's loop,
        # its /metrics and its watchdog ping. index -> (its read still running, since when)
        self._stuck: dict[int, tuple[_Call, float]] = {}
        self._driver_calls: dict[str, _Call] = {}  # init and count, by name (_driver)
        self._workers: dict[int | str, _Worker] = {}  # by GPU index or driver call name
        self._samplers = Samplers(  # run inside each GPU's read
            self.config.slow_interval, load_samplers(), core_fields=CORE_FIELDS
        )

    # --- lifecycle ---

    def _driver(self, fn: Callable[..., Any]) -> Any:
        """A call on no GPU (init, the device count), under the read deadline: one that does
        not return is left running in its thread (DriverHung), and is not made again until
        it has returned, so a hung driver never holds the agent's loop."""
        name = fn.__name__
        pending = self._driver_calls.get(name)
        if pending is None or pending.done.is_set():
            pending = self._driver_calls[name] = self._worker(name).submit(fn)
        if not pending.done.wait(self.config.read_deadline_seconds):
            raise DriverHung(f"{name} has not returned for "
                             f"{self.config.read_deadline_seconds:g}s (a hung driver)")  # fmt: skip
        del self._driver_calls[name]
        return pending.get()

    def _worker(self, key: int | str) -> _Worker:
        worker = self._workers.get(key)
        if worker is None:
            worker = self._workers[key] = _Worker(f"rankguard-nvml-{key}")
        return worker

    def _stop_workers(self, keep: Callable[[int | str], bool] = lambda key: False) -> None:
        for key in [k for k in self._workers if not keep(k)]:
            self._workers.pop(key).stop()

    def _try_init(self, now: float) -> None:
        if now < self._next_init:
            return
        self._next_init = now + self.config.init_retry_interval
        try:
            if self.nvml is None:
                self.nvml = load_nvml(None)
            self._driver(self.nvml.nvmlInit)
        except DriverHung as exc:
            self.reason = str(exc)
            return
        except pynvml.NVMLError as exc:
            self.reason = f"nvmlInit: {exc}"
            return
        except Exception as exc:  # no pynvml, unreadable double: still "NVML down"
            self.reason = f"cannot load NVML: {exc!r}"
            return
        try:
            self.driver = str(self.nvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            self.driver = ""
        self.up, self.reason = True, None
        self.watcher = XidWatcher(self.nvml, self.xids, self.config.event_timeout_ms)
        log.info("NVML up, driver %s", self.driver)

    def _shutdown(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        if self.up:
            for gpu in self.gpus:
                self._free_gpm(gpu)
            try:
                self.nvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)
        self.up = False
        self.gpus = []  # handles die with the NVML session

    def _mark_down(self, now: float, reason: str) -> None:
        log.warning("NVML down: %s", reason)
        self._shutdown()
        self.reason = reason
        self._next_init = now + self.config.init_retry_interval

    def close(self) -> None:
        self._shutdown()
        self._stop_workers()
        self.reason = "closed"
        self._next_init = float("-inf")  # a collect after close starts afresh

    # --- devices ---

    def _sync_devices(self, count: int) -> None:
        """Give every index a slot; resolve handles (and static facts) not yet known."""
        while len(self.gpus) < count:
            self.gpus.append(_Gpu(len(self.gpus)))
        for gone in self.gpus[count:]:
            self._free_gpm(gone)
        del self.gpus[count:]
        self._stop_workers(keep=lambda key: isinstance(key, str) or key < count)
        for gpu in self.gpus:
            if gpu.handle is not None:
                continue
            try:
                gpu.handle = self.nvml.nvmlDeviceGetHandleByIndex(gpu.index)
                gpu.uuid = str(self.nvml.nvmlDeviceGetUUID(gpu.handle))
                gpu.name = str(self.nvml.nvmlDeviceGetName(gpu.handle))
            except pynvml.NVMLError as exc:  # resolved again next time
                gpu.handle, gpu.lost, gpu.error = None, exc.value in LOST_ERRORS, str(exc)
                continue
            if self.watcher is not None:
                self.watcher.register(gpu)

    def _optional(self, fn_name: str, *args: Any) -> Any:
        """One NVML query a GPU may not support: None then. A lost GPU aborts the GPU."""
        try:
            return getattr(self.nvml, fn_name)(*args)
        except pynvml.NVMLError as exc:
            if exc.value in LOST_ERRORS:
                raise _GpuLost(str(exc)) from exc
            return None

    def _clock_event_mask(self, handle: Any) -> int | None:
        # Drivers before r535 only have the older "ThrottleReasons" name.
        try:
            return getattr(self.nvml, self._clock_reasons_fn)(handle)
        except (pynvml.NVMLError_FunctionNotFound, AttributeError):
            if self._clock_reasons_fn == "nvmlDeviceGetCurrentClocksThrottleReasons":
                return None
            self._clock_reasons_fn = "nvmlDeviceGetCurrentClocksThrottleReasons"
            return self._clock_event_mask(handle)
        except pynvml.NVMLError as exc:
            if exc.value in LOST_ERRORS:
                raise _GpuLost(str(exc)) from exc
            return None

    def _processes(self, handle: Any) -> dict[int, int]:
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except pynvml.NVMLLibraryMismatchError:  # driver without the _v3 call
            procs = self._optional("nvmlDeviceGetComputeRunningProcesses_v2", handle)
        except pynvml.NVMLError as exc:
            if exc.value in LOST_ERRORS:
                raise _GpuLost(str(exc)) from exc
            procs = None
        out: dict[int, int] = {}
        for p in procs or []:
            out[int(p.pid)] = out.get(int(p.pid), 0) + int(p.usedGpuMemory or 0)
        return out

    # --- GPM ---

    def _free_gpm(self, gpu: _Gpu) -> None:
        for sample in gpu.gpm_samples:
            with contextlib.suppress(pynvml.NVMLError):
                self.nvml.nvmlGpmSampleFree(sample)
        gpu.gpm_samples, gpu.gpm_has_previous, gpu.gpm_values = [], False, {}

    def _read_gpm(self, gpu: _Gpu) -> None:
        """Take a GPM sample; with a previous one, let NVML compute the metrics between
        them. The newest sample becomes the previous one for next time."""
        nvml = self.nvml
        if gpu.gpm_supported is None:
            support = self._optional("nvmlGpmQueryDeviceSupport", gpu.handle)
            gpu.gpm_supported = bool(support is not None and support.isSupportedDevice)
        if not gpu.gpm_supported:
            return
        try:
            if not gpu.gpm_samples:
                gpu.gpm_samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
            previous, current = gpu.gpm_samples
            nvml.nvmlGpmSampleGet(gpu.handle, current)
            if gpu.gpm_has_previous:
                gpu.gpm_values = self._gpm_between(previous, current)
            gpu.gpm_samples = [current, previous]
            gpu.gpm_has_previous = True
        except pynvml.NVMLError as exc:
            if exc.value in LOST_ERRORS:
                raise _GpuLost(str(exc)) from exc
            log.debug("GPM on gpu %d: %s", gpu.index, exc)
            gpu.gpm_has_previous, gpu.gpm_values = False, {}

    def _gpm_between(self, sample1: Any, sample2: Any) -> dict[str, float]:
        nvml = self.nvml
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = sample1, sample2
        for i, metric_id in enumerate(GPM_METRICS.values()):
            request.metrics[i].metricId = metric_id
        nvml.nvmlGpmMetricsGet(request)
        values = {}
        for i, stem in enumerate(GPM_METRICS):
            metric = request.metrics[i]
            if metric.nvmlReturn == pynvml.NVML_SUCCESS:
                values[stem] = percent_to_ratio(metric.value)
        return values

    # --- one GPU ---

    def _read(self, gpu: _Gpu, do_gpm: bool, do_pcie: bool, want_procs: bool) -> GpuReading:
        reading = GpuReading(gpu.index, gpu.uuid, gpu.name)
        if gpu.handle is None:
            reading.lost, reading.error = gpu.lost, gpu.error
            return reading
        nvml, h, opt = self.nvml, gpu.handle, self._optional
        try:
            util = opt("nvmlDeviceGetUtilizationRates", h)
            reading.utilization = percent_to_ratio(util.gpu) if util is not None else None
            mem = opt("nvmlDeviceGetMemoryInfo", h)
            if mem is not None:
                reading.memory_used, reading.memory_total = int(mem.used), int(mem.total)
            reading.temperature = opt("nvmlDeviceGetTemperature", h, nvml.NVML_TEMPERATURE_GPU)
            power = opt("nvmlDeviceGetPowerUsage", h)
            reading.power_watts = mw_to_watts(power) if power is not None else None
            clock = opt("nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_SM)
            reading.sm_clock_hertz = mhz_to_hertz(clock) if clock is not None else None
            reading.clock_event_mask = self._clock_event_mask(h)
            reading.samples, core = self._sample(gpu)
            apply_core_fields(reading, core)
            if do_gpm:
                self._read_gpm(gpu)
            if do_pcie:
                tx = opt("nvmlDeviceGetPcieThroughput", h, nvml.NVML_PCIE_UTIL_TX_BYTES)
                rx = opt("nvmlDeviceGetPcieThroughput", h, nvml.NVML_PCIE_UTIL_RX_BYTES)
                gpu.pcie = None
                if tx is not None and rx is not None:
                    gpu.pcie = (kbps_to_bytes_per_second(tx), kbps_to_bytes_per_second(rx))
            if want_procs:
                reading.processes = self._processes(h)
        except _GpuLost as exc:
            if not gpu.lost:
                log.warning("gpu %d (%s) lost: %s", gpu.index, gpu.uuid, exc)
            gpu.lost, gpu.error = True, str(exc)
            gpu.gpm_has_previous, gpu.gpm_values, gpu.pcie = False, {}, None
            gpu.samples = SamplerState()
            return GpuReading(gpu.index, gpu.uuid, gpu.name, lost=True, error=str(exc))
        gpu.lost, gpu.error = False, None
        # GPM and PCIe come from the cache: refreshed only on their own cadence.
        reading.gpm = gpu.gpm_values
        reading.gpm_supported = gpu.gpm_supported
        reading.pcie = gpu.pcie
        return reading

    def _sample(self, gpu: _Gpu) -> tuple[dict[str, Any], dict[str, float | None]]:
        try:
            return self._samplers.read(self.nvml, gpu.handle, gpu.samples, self.ctx.clock())
        except pynvml.NVMLError as exc:  # only a lost GPU's error gets out of the samplers
            raise _GpuLost(str(exc)) from exc

    # --- collect ---

    def collect(self) -> CollectorResult:
        now = self.ctx.clock()
        if not self.up:
            self._try_init(now)
        if self.up:
            try:
                count = int(self._driver(self.nvml.nvmlDeviceGetCount))
            except DriverHung as exc:  # not shut down: that call would hang as well
                if self.watcher is not None:
                    self.watcher.stop_soon()
                    self.watcher = None
                self.up, self.reason, self.gpus = False, str(exc), []
                self._next_init = now + self.config.init_retry_interval
            except pynvml.NVMLError as exc:
                self._mark_down(now, f"nvmlDeviceGetCount: {exc}")
        if not self.up:
            return self._down_result()

        self._sync_devices(count)
        do_gpm = now >= self._next_gpm
        if do_gpm:
            self._next_gpm = now + self.config.gpm_interval
        do_pcie = now >= self._next_pcie
        if do_pcie:
            self._next_pcie = now + self.config.pcie_interval
        ranks = self._rank_pids()
        readings = self._read_all(do_gpm, do_pcie, bool(ranks), now)
        xids = self.xids.snapshot()
        rank_gpus = self._tie_ranks(readings)
        metrics = build_metrics(readings, self.driver, count, self.ctx.expected_gpus, xids, ranks,
                                rank_gpus)  # fmt: skip
        metrics += self._samplers.metrics(readings)
        return CollectorResult(metrics, self._facts(readings, count, xids))

    def _read_all(self, do_gpm: bool, do_pcie: bool, want_procs: bool, now: float) -> list:
        """Every GPU's reading, each read in the pool and waited for up to the deadline; a
        GPU whose read has not returned is reported unresponsive (and not read again
        until it returns)."""
        for index, (call, _) in list(self._stuck.items()):
            if call.done.is_set():
                del self._stuck[index]
                log.warning("gpu %d answers again", index)
        started = {
            gpu.index: self._worker(gpu.index).submit(self._read, gpu, do_gpm, do_pcie, want_procs)
            for gpu in self.gpus
            if gpu.index not in self._stuck
        }
        deadline = time.monotonic() + self.config.read_deadline_seconds
        for call in started.values():
            call.done.wait(max(0.0, deadline - time.monotonic()))
        readings = []
        for gpu in self.gpus:
            call = started.get(gpu.index)
            if call is not None and call.done.is_set():
                readings.append(call.get())
                continue
            if call is not None:
                self._stuck[gpu.index] = (call, now)
                log.warning("gpu %d (%s): NVML read past %gs: unresponsive", gpu.index, gpu.uuid,
                            self.config.read_deadline_seconds)  # fmt: skip
            since = self._stuck[gpu.index][1]
            waited = self.ctx.clock() - since + self.config.read_deadline_seconds
            readings.append(GpuReading(gpu.index, gpu.uuid, gpu.name, unresponsive_seconds=waited,
                                       error=f"NVML read not returned for {waited:.0f}s"))  # fmt: skip
        return readings

    def _tie_ranks(self, readings: list[GpuReading]) -> list[tuple[str, int, str]]:
        """Tell the rank table which GPU each process is on and each GPU's faults; the
        (job, rank, GPU UUID) of its ranks back."""
        table = self.ctx.rank_table
        if table is None:
            return []
        recent = self.xids.recent(XID_RECENT_SECONDS)
        table.note_gpus(pid_gpus(readings), rank_gpu_faults(readings, recent))
        return table.rank_gpus()

    def _rank_pids(self) -> dict[int, tuple[str, int]]:
        try:
            return {pid: (job, rank) for job, rank, pid in self.ctx.rank_processes()}
        except Exception as exc:  # the rank table's trouble must not blind GPU monitoring
            log.warning("rank_processes failed: %s", exc)
            return {}

    def _down_result(self) -> CollectorResult:
        metrics = [gauge("rankguard_gpu_nvml_up", "1 if NVML answers on this node").add((), 0)]
        if self.ctx.expected_gpus is not None:
            metrics.append(_expected(self.ctx.expected_gpus))
        facts = {
            "available": False,
            "reason": self.reason,
            "driver": None,
            "count": 0,
            "expected": self.ctx.expected_gpus,
            "gpus": [],
            "xid_supported": False,
        }
        return CollectorResult(metrics, facts)

    def _facts(
        self, readings: list[GpuReading], count: int, xids: dict[tuple[int, int], int]
    ) -> dict[str, Any]:
        watcher = self.watcher
        recent = self.xids.recent(XID_RECENT_SECONDS)  # what health is judged on
        now = self.ctx.clock()
        gpus = []
        for r in readings:
            ecc = r.ecc or {}
            if not r.lost:
                self.trends.observe(r.uuid, now, trend_values(r, recent))
            gpus.append(
                {
                    "index": r.index,
                    "uuid": r.uuid,
                    "name": r.name,
                    "lost": r.lost,
                    "error": r.error,
                    "unresponsive_seconds": r.unresponsive_seconds,
                    "utilization": r.utilization,
                    "memory_used": r.memory_used,
                    "memory_total": r.memory_total,
                    "temperature": r.temperature,
                    "power_watts": r.power_watts,
                    "ecc_uncorrected": ecc.get("uncorrected"),
                    "retired_pages": sum(r.retired_pages.values()) if r.retired_pages else None,
                    "remapped_rows": r.remapped_rows,
                    "gpm_supported": r.gpm_supported,
                    "xid": {str(code): n for (g, code), n in sorted(xids.items()) if g == r.index},
                    "xid_recent": {
                        str(code): n for (g, code), n in sorted(recent.items()) if g == r.index
                    },  # fmt: skip
                    "clock_events": clock_event_names(r.clock_event_mask or 0),
                    **self._samplers.facts(r.samples),
                }
            )
        self.trends.forget({r.uuid for r in readings if not r.lost})
        failing = self.trends.failing()
        for g in gpus:
            g["failing"] = describe(failing[g["uuid"]]) if g["uuid"] in failing else None
        return {
            "available": True,
            "reason": None,
            "driver": self.driver,
            "count": count,
            "expected": self.ctx.expected_gpus,
            "gpus": gpus,
            "xid_supported": bool(watcher and watcher.supported),
            "xid_unsupported": list(watcher.unsupported) if watcher else [],
        }


def load_samplers() -> dict[str, type[GpuSampler]]:
    """Import every sampler module so it registers itself (gpu_samplers.py)."""
    from . import gpu_memory, gpu_mig, gpu_nvlink, gpu_pcie, gpu_power, gpu_violation  # noqa: F401

    return SAMPLERS


def trend_values(r: GpuReading, recent: dict[tuple[int, int], int]) -> dict[str, float | None]:
    """One reading's values of the failure signals (agent/gpu_trends.py); None: not read."""
    rows = r.remapped_rows
    nvlink = r.samples.get("nvlink") or {}
    violation = r.samples.get("violation") or {}
    return {
        "ecc_corrected": (r.ecc or {}).get("corrected"),
        "remap_pending": None if rows is None else float(bool(rows.get("pending"))),
        "xid_watch": sum(
            n for (g, code), n in recent.items() if g == r.index and meaning(code).action == WATCH
        ),  # fmt: skip
        "nvlink_replay": (nvlink.get("errors") or {}).get("replay"),
        "pcie_replay": (r.samples.get("pcie") or {}).get("replays"),
        "thermal_violation": (violation.get("seconds") or {}).get("thermal"),
    }


# --- ranks and their GPUs (pure) ----------------------------------------------------------

# Clock events that slow a GPU down for a fault's reason, not for the work it is given
# (a power cap, idling or application clocks are the usual state of a busy GPU).
ADVERSE_CLOCK_EVENTS = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                        "hw_power_brake")  # fmt: skip


def pid_gpus(readings: list[GpuReading]) -> dict[int, str]:
    """pid -> the UUID of the GPU NVML lists it on (a process on several: its last)."""
    return {pid: r.uuid for r in readings if r.uuid for pid in r.processes}


def rank_gpu_faults(
    readings: list[GpuReading], recent_xids: dict[tuple[int, int], int]
) -> dict[str, dict[str, Any]]:
    """Each GPU's faults by UUID, as a rank on it carries them (RankGpuAnswer's fields)."""
    out = {}
    for r in readings:
        if not r.uuid:
            continue
        events = clock_event_names(r.clock_event_mask or 0)
        out[r.uuid] = {
            "index": r.index,
            "lost": r.lost,
            "xid_recent": {str(x): n for (g, x), n in sorted(recent_xids.items()) if g == r.index},
            "ecc_uncorrected": (r.ecc or {}).get("uncorrected"),
            "throttle": tuple(e for e in events if e in ADVERSE_CLOCK_EVENTS),
        }
    return out


# --- metrics from readings (pure) -----------------------------------------------------------


def _expected(n: int) -> Metric:
    return gauge("rankguard_gpus_expected", "GPUs this node should have").add((), n)


def build_metrics(
    readings: list[GpuReading],
    driver: str,
    count: int,
    expected: int | None,
    xids: dict[tuple[int, int], int],
    ranks: dict[int, tuple[str, int]],
    rank_gpus: list[tuple[str, int, str]] = (),
) -> list[Metric]:
    """Metric families for one collection. Lost GPUs keep info, lost and XID series.
    `rank_gpus`: (job, rank, UUID) of the ranks whose GPU is known, joined on
    `rankguard_rank_gpu_info` (a rank's series join a GPU's through it)."""
    g = ("gpu", "uuid")
    up = gauge("rankguard_gpu_nvml_up", "1 if NVML answers on this node").add((), 1)
    count_m = gauge("rankguard_gpus", "GPUs NVML reports").add((), count)
    info_m = info("rankguard_gpu_info", "GPU identity", (*g, "name", "driver"))
    lost = gauge("rankguard_gpu_lost", "1 if the GPU answers GPU_IS_LOST / RESET_REQUIRED", g)
    util = gauge("rankguard_gpu_utilization_ratio", "Time a kernel ran, 0..1 (NVML)", g)
    mem_used = gauge("rankguard_gpu_memory_used_bytes", "GPU memory used", g)
    mem_total = gauge("rankguard_gpu_memory_total_bytes", "GPU memory in total", g)
    temp = gauge("rankguard_gpu_temperature_celsius", "GPU core temperature", g)
    power = gauge("rankguard_gpu_power_watts", "Power draw", g)
    energy = counter("rankguard_gpu_energy_joules_total", "Energy since driver load", g)
    clock = gauge("rankguard_gpu_sm_clock_hertz", "SM clock", g)
    events = gauge(
        "rankguard_gpu_clock_event_active", "1 if this reason holds clocks down", (*g, "reason")
    )
    ecc = counter(
        "rankguard_gpu_ecc_errors_total",
        "ECC errors since driver load (volatile)",
        (*g, "type"),
    )
    retired = gauge("rankguard_gpu_retired_pages", "Retired memory pages", (*g, "cause"))
    retired_pending = gauge(
        "rankguard_gpu_retired_pages_pending", "1 if a page retirement awaits reboot", g
    )
    rows = gauge("rankguard_gpu_remapped_rows", "Remapped memory rows", (*g, "type"))
    rows_pending = gauge(
        "rankguard_gpu_remapped_rows_pending", "1 if a row remap awaits GPU reset", g
    )
    rows_failure = gauge("rankguard_gpu_remapped_rows_failure", "1 if a row remap failed", g)
    gpm = {
        stem: gauge(f"rankguard_gpu_{stem}_ratio", f"GPM {stem.replace('_', ' ')}, 0..1", g)
        for stem in GPM_METRICS
    }
    pcie_tx = gauge("rankguard_gpu_pcie_transmit_bytes_per_second", "PCIe TX throughput", g)
    pcie_rx = gauge("rankguard_gpu_pcie_receive_bytes_per_second", "PCIe RX throughput", g)
    xid = counter("rankguard_gpu_xid_errors_total", "XID critical errors by code", (*g, "xid"))
    rank_mem = gauge(
        "rankguard_rank_gpu_memory_bytes",
        "GPU memory used by a training rank",
        (JOB_LABEL, "rank", "gpu"),
    )

    uuids = {r.index: r.uuid for r in readings}
    index_of = {r.uuid: r.index for r in readings}
    rank_gpu = info("rankguard_rank_gpu_info", "The GPU a training rank computes on",
                    (JOB_LABEL, "rank", *g))  # fmt: skip
    for job, rank, uuid in rank_gpus:
        rank_gpu.add((job, rank, index_of.get(uuid, "unknown"), uuid))
    for r in readings:
        labels = (r.index, r.uuid)
        info_m.add((*labels, r.name, driver))
        lost.add(labels, int(r.lost))
        if r.lost:
            continue
        _add(util, labels, r.utilization)
        _add(mem_used, labels, r.memory_used)
        _add(mem_total, labels, r.memory_total)
        _add(temp, labels, r.temperature)
        _add(power, labels, r.power_watts)
        _add(energy, labels, r.energy_joules)
        _add(clock, labels, r.sm_clock_hertz)
        if r.clock_event_mask is not None:
            for reason, bit in CLOCK_EVENT_REASONS.items():
                events.add((*labels, reason), int(bool(r.clock_event_mask & bit)))
        for kind, n in (r.ecc or {}).items():
            ecc.add((*labels, kind), n)
        for cause, n in (r.retired_pages or {}).items():
            retired.add((*labels, cause), n)
        _add(retired_pending, labels, r.retired_pages_pending)
        if r.remapped_rows is not None:
            rows.add((*labels, "correctable"), r.remapped_rows["correctable"])
            rows.add((*labels, "uncorrectable"), r.remapped_rows["uncorrectable"])
            rows_pending.add(labels, r.remapped_rows["pending"])
            rows_failure.add(labels, r.remapped_rows["failure"])
        for stem, value in r.gpm.items():
            gpm[stem].add(labels, value)
        if r.pcie is not None:
            pcie_tx.add(labels, r.pcie[0])
            pcie_rx.add(labels, r.pcie[1])
        for pid, used in sorted(r.processes.items()):
            if pid in ranks:
                job, rank = ranks[pid]
                rank_mem.add((job, rank, r.index), used)

    # XID counters: known codes at zero on every GPU, plus every code seen.
    counts = {(r.index, code): 0 for r in readings for code in KNOWN_XIDS}
    counts.update(xids)
    for (index, code), n in sorted(counts.items()):
        xid.add((index if index >= 0 else "unknown", uuids.get(index, ""), code), n)

    families = [up, count_m]
    if expected is not None:
        families.append(_expected(expected))
    families += [info_m, lost, util, mem_used, mem_total, temp, power, energy, clock, events]
    families += [ecc, retired, retired_pending, rows, rows_pending, rows_failure]
    families += [*gpm.values(), pcie_tx, pcie_rx, xid, rank_mem, rank_gpu]
    return families


def _add(metric: Metric, labels: tuple, value: float | None) -> None:
    if value is not None:
        metric.add(labels, value)
