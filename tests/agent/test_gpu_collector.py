"""GPU collector against the NVML double (everywhere) and real NVML (`gpu` marker)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pynvml
import pytest
from builders import FakeClock
from harness import wait_until

from rankguard.agent.collectors import CollectorContext, CollectorResult
from rankguard.agent.collectors.gpu import (
    GpuCollector,
    GpuConfig,
    XidCounts,
    clock_event_names,
    kbps_to_bytes_per_second,
    mhz_to_hertz,
    mj_to_joules,
    mw_to_watts,
    percent_to_ratio,
)
from rankguard.agent.health import gpu_reasons
from rankguard.agent.nvml_double import ENV_VAR, NvmlDouble, load_nvml, make_double, write_state
from rankguard.agent.ranks import RankTable
from rankguard.contract.telemetry import TelemetryRecord

GIB = 2**30


def samples(result: CollectorResult, name: str) -> dict[tuple, float]:
    """{label values: value} of one family (empty when absent)."""
    for metric in result.metrics:
        if metric.name == name:
            return dict(metric.samples)
    return {}


def value(result: CollectorResult, name: str, *labels) -> float:
    return samples(result, name)[tuple(str(v) for v in labels)]


def wait_for(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


# --- pure helpers --------------------------------------------------------------------------


def test_unit_helpers():
    assert percent_to_ratio(97) == 0.97
    assert percent_to_ratio(250) == 1.0
    assert mw_to_watts(512_000) == 512.0
    assert mj_to_joules(1_500) == 1.5
    assert mhz_to_hertz(1980) == 1.98e9
    assert kbps_to_bytes_per_second(1000) == 1_024_000


def test_clock_event_names_from_bitmask():
    mask = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    assert clock_event_names(mask) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert clock_event_names(0) == []
    assert clock_event_names(pynvml.nvmlClocksEventReasonDisplayClockSetting) == []


# --- the double ----------------------------------------------------------------------------


def test_double_raises_real_nvml_errors():
    nvml = NvmlDouble(make_double(1))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(handle, pynvml.c_nvmlDevice_t)
    nvml.set_lost(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetUtilizationRates(handle)
    event_set = nvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(event_set, 1)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):  # pynvml has it, the double not
        nvml.nvmlDeviceGetFanSpeed(handle)
    assert nvml.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM  # constants pass through
    unavailable = NvmlDouble(make_double(1, unavailable="library_not_found"))
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        unavailable.nvmlInit()


def test_load_nvml(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert load_nvml(None) is pynvml
    path = tmp_path / "nvml.json"
    write_state(path, make_double(3))
    assert isinstance(load_nvml(str(path)), NvmlDouble)
    monkeypatch.setenv(ENV_VAR, str(path))
    double = load_nvml(None)
    double.nvmlInit()
    assert double.nvmlDeviceGetCount() == 3


# --- the collector against the double ------------------------------------------------------


def test_all_metrics_with_base_units(gpu_collector):
    state = make_double(
        2,
        util=97,
        mem_used=70 * GIB,
        mem_total=80 * GIB,
        temp=63,
        power_mw=512_345,
        energy_mj=2_000_500,
        sm_clock_mhz=1980,
        clock_event_reasons=pynvml.nvmlClocksEventReasonSwPowerCap
        | pynvml.nvmlClocksEventReasonHwThermalSlowdown,
        ecc={"corrected": 5, "uncorrected": 1},
        retired_pages={"single_bit": 2, "double_bit": 1},
        retired_pages_pending=True,
        remapped_rows={"correctable": 3, "uncorrectable": 1, "pending": True, "failure": False},
        pcie_tx_kbps=1000,
        pcie_rx_kbps=2000,
    )
    collector, nvml, _ = gpu_collector(state, expected=2)
    r = collector.collect()
    uuid0 = state["gpus"][0]["uuid"]
    g0 = (0, uuid0)

    assert value(r, "rankguard_gpu_nvml_up") == 1
    assert value(r, "rankguard_gpus") == 2
    assert value(r, "rankguard_gpus_expected") == 2
    assert value(r, "rankguard_gpu_info", 0, uuid0, "NVIDIA H100 80GB HBM3", "550.54.15") == 1
    assert value(r, "rankguard_gpu_lost", *g0) == 0
    assert value(r, "rankguard_gpu_utilization_ratio", *g0) == pytest.approx(0.97)
    assert value(r, "rankguard_gpu_memory_used_bytes", *g0) == 70 * GIB
    assert value(r, "rankguard_gpu_memory_total_bytes", *g0) == 80 * GIB
    assert value(r, "rankguard_gpu_temperature_celsius", *g0) == 63
    assert value(r, "rankguard_gpu_power_watts", *g0) == pytest.approx(512.345)
    assert value(r, "rankguard_gpu_energy_joules_total", *g0) == pytest.approx(2000.5)
    assert value(r, "rankguard_gpu_sm_clock_hertz", *g0) == 1.98e9
    events = {
        k[2]: v for k, v in samples(r, "rankguard_gpu_clock_event_active").items() if k[0] == "0"
    }
    assert {k for k, v in events.items() if v == 1} == {"sw_power_cap", "hw_thermal_slowdown"}
    assert len(events) == 8
    assert value(r, "rankguard_gpu_ecc_errors_total", *g0, "corrected") == 5
    assert value(r, "rankguard_gpu_ecc_errors_total", *g0, "uncorrected") == 1
    assert value(r, "rankguard_gpu_retired_pages", *g0, "single_bit_ecc") == 2
    assert value(r, "rankguard_gpu_retired_pages", *g0, "double_bit_ecc") == 1
    assert value(r, "rankguard_gpu_retired_pages_pending", *g0) == 1
    assert value(r, "rankguard_gpu_remapped_rows", *g0, "correctable") == 3
    assert value(r, "rankguard_gpu_remapped_rows", *g0, "uncorrectable") == 1
    assert value(r, "rankguard_gpu_remapped_rows_pending", *g0) == 1
    assert value(r, "rankguard_gpu_remapped_rows_failure", *g0) == 0
    assert value(r, "rankguard_gpu_pcie_transmit_bytes_per_second", *g0) == 1_024_000
    assert value(r, "rankguard_gpu_pcie_receive_bytes_per_second", *g0) == 2_048_000
    assert value(r, "rankguard_gpu_xid_errors_total", *g0, 79) == 0  # pre-created

    facts = r.facts
    assert facts["available"] is True and facts["count"] == 2 and facts["expected"] == 2
    assert facts["driver"] == "550.54.15" and facts["xid_supported"] is True
    f0 = facts["gpus"][0]
    assert f0["uuid"] == uuid0 and f0["lost"] is False and f0["utilization"] == pytest.approx(0.97)
    assert f0["memory_total"] == 80 * GIB and f0["power_watts"] == pytest.approx(512.345)
    assert f0["ecc_uncorrected"] == 1 and f0["retired_pages"] == 3 and f0["xid"] == {}
    assert f0["clock_events"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert f0["remapped_rows"]["pending"] == 1


def test_unsupported_queries_are_left_out(gpu_collector):
    # Consumer-style GPU: ECC off, no page retirement, no row remapping, no GPM.
    state = make_double(1, ecc=None, retired_pages=None, remapped_rows=None, gpm=False)
    collector, _, clock = gpu_collector(state)
    collector.collect()
    clock.t += 2
    r = collector.collect()
    for name in (
        "rankguard_gpu_ecc_errors_total",
        "rankguard_gpu_retired_pages",
        "rankguard_gpu_remapped_rows",
        "rankguard_gpu_sm_activity_ratio",
    ):
        assert samples(r, name) == {}, name
    assert samples(r, "rankguard_gpu_utilization_ratio")
    gpu = r.facts["gpus"][0]
    assert gpu["ecc_uncorrected"] is None and gpu["retired_pages"] is None
    assert gpu["gpm_supported"] is False


def test_the_counters_come_in_one_batched_field_read_per_gpu(gpu_collector):
    # Each NVML call costs its latency (and a GIL hand-over): ECC, page retirement, row
    # remapping and energy are fields of the samplers' one nvmlDeviceGetFieldValues.
    collector, nvml, clock = gpu_collector(make_double(8))
    collector.collect()
    clock.t += 2
    nvml.calls.clear()
    collector.collect()
    per_gpu = {name: n / 8 for name, n in nvml.calls.items() if name.startswith("nvmlDevice")}
    assert per_gpu["nvmlDeviceGetFieldValues"] == 1
    for single in ("nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRetiredPages",
                   "nvmlDeviceGetRemappedRows", "nvmlDeviceGetTotalEnergyConsumption"):  # fmt: skip
        assert single not in per_gpu, per_gpu
    assert sum(n for name, n in per_gpu.items() if name != "nvmlDeviceGetCount") <= 9, per_gpu


def test_old_driver_clock_reasons_fallback(gpu_collector):
    class OldDriver(NvmlDouble):
        def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    double = OldDriver(make_double(1, clock_event_reasons=pynvml.nvmlClocksEventReasonGpuIdle))
    collector, _, _ = gpu_collector(double)
    r = collector.collect()
    assert r.facts["gpus"][0]["clock_events"] == ["gpu_idle"]
    assert double.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1


def test_nvml_unavailable_reports_down_and_retries_slowly(gpu_collector):
    collector, nvml, clock = gpu_collector(
        make_double(2, unavailable="driver_not_loaded"), expected=8
    )
    r = collector.collect()
    assert value(r, "rankguard_gpu_nvml_up") == 0
    assert value(r, "rankguard_gpus_expected") == 8
    assert r.facts["available"] is False and "Driver Not Loaded" in r.facts["reason"]
    assert nvml.calls["nvmlInit"] == 1
    nvml.set_unavailable(None)
    clock.t += 59
    assert value(collector.collect(), "rankguard_gpu_nvml_up") == 0
    assert nvml.calls["nvmlInit"] == 1  # not retried within the interval
    clock.t += 2
    r = collector.collect()
    assert value(r, "rankguard_gpu_nvml_up") == 1 and value(r, "rankguard_gpus") == 2
    assert nvml.calls["nvmlInit"] == 2

    # NVML failing mid-run: down, handles dropped, back after the retry interval.
    nvml.set_unavailable("driver_not_loaded")
    assert value(collector.collect(), "rankguard_gpu_nvml_up") == 0
    nvml.set_unavailable(None)
    clock.t += 61
    assert value(collector.collect(), "rankguard_gpu_nvml_up") == 1


def test_no_gpu_machine_real_pynvml_never_raises(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    collector = GpuCollector(CollectorContext(nvml=None))
    try:
        r = collector.collect()
        if value(r, "rankguard_gpu_nvml_up") == 1:
            pytest.skip("this machine has working NVML")
        assert r.facts["available"] is False and r.facts["reason"]
    finally:
        collector.close()


def test_gpu_lost_mid_run(gpu_collector):
    collector, nvml, _ = gpu_collector(make_double(3))
    collector.collect()
    nvml.set_lost(1)
    r = collector.collect()
    uuids = [g["uuid"] for g in nvml.state()["gpus"]]
    assert value(r, "rankguard_gpu_lost", 1, uuids[1]) == 1
    assert value(r, "rankguard_gpu_lost", 0, uuids[0]) == 0
    util = samples(r, "rankguard_gpu_utilization_ratio")
    assert set(util) == {("0", uuids[0]), ("2", uuids[2])}
    assert ("1", uuids[1], "79") in samples(r, "rankguard_gpu_xid_errors_total")
    assert r.facts["gpus"][1]["lost"] is True and "lost" in r.facts["gpus"][1]["error"]
    assert r.facts["gpus"][1]["utilization"] is None
    nvml.set_lost(1, False)  # e.g. after a reset
    r = collector.collect()
    assert value(r, "rankguard_gpu_lost", 1, uuids[1]) == 0
    assert len(samples(r, "rankguard_gpu_utilization_ratio")) == 3


def test_gpu_lost_before_start(gpu_collector):
    state = make_double(2)
    state["gpus"][1]["lost"] = True
    collector, _, _ = gpu_collector(state)
    r = collector.collect()
    assert value(r, "rankguard_gpu_lost", 1, "") == 1
    assert value(r, "rankguard_gpus") == 2
    assert len(samples(r, "rankguard_gpu_utilization_ratio")) == 1


def test_xid_counted_by_code_once_per_event_and_thread_stops(gpu_collector):
    collector, nvml, _ = gpu_collector(make_double(2))
    uuids = [g["uuid"] for g in nvml.state()["gpus"]]
    r = collector.collect()
    thread = collector.watcher.thread
    assert thread.is_alive()
    assert value(r, "rankguard_gpu_xid_errors_total", 0, uuids[0], 79) == 0

    def xid(gpu, code):
        r = collector.collect()
        return samples(r, "rankguard_gpu_xid_errors_total").get((str(gpu), uuids[gpu], str(code)))

    nvml.inject_xid(0, 79)
    wait_for(lambda: xid(0, 79) == 1)
    time.sleep(0.15)  # more wait cycles: the event is not counted again
    assert xid(0, 79) == 1 and xid(1, 79) == 0
    nvml.inject_xid(0, 79)
    nvml.inject_xid(1, 31)
    nvml.inject_xid(1, 150)  # a code outside the pre-created set
    wait_for(lambda: xid(0, 79) == 2 and xid(1, 31) == 1 and xid(1, 150) == 1)
    assert collector.collect().facts["gpus"][1]["xid"] == {"31": 1, "150": 1}

    collector.close()
    assert not thread.is_alive()
    assert nvml.calls["nvmlEventSetFree"] == 1 and nvml.calls["nvmlShutdown"] == 1
    assert not any(t.name == "rankguard-gpu-xid" and t.is_alive() for t in threading.enumerate())


def test_xid_registration_unsupported_is_a_fact_not_a_crash(gpu_collector):
    collector, _, _ = gpu_collector(make_double(2, xid_supported=False))
    r = collector.collect()
    assert r.facts["xid_supported"] is False and r.facts["xid_unsupported"]
    assert value(r, "rankguard_gpu_nvml_up") == 1


def test_gpm_between_two_collections_on_its_own_cadence(gpu_collector):
    collector, nvml, clock = gpu_collector(make_double(2), gpm_interval=1.0)
    uuid0 = nvml.state()["gpus"][0]["uuid"]
    r = collector.collect()
    assert samples(r, "rankguard_gpu_sm_activity_ratio") == {}  # one sample: nothing yet
    assert r.facts["gpus"][0]["gpm_supported"] is True
    clock.t += 1.0
    r = collector.collect()
    assert value(r, "rankguard_gpu_sm_activity_ratio", 0, uuid0) == pytest.approx(0.88)
    assert value(r, "rankguard_gpu_tensor_activity_ratio", 0, uuid0) == pytest.approx(0.615)
    assert value(r, "rankguard_gpu_dram_bandwidth_utilization_ratio", 0, uuid0) == pytest.approx(
        0.42
    )
    assert nvml.calls["nvmlGpmSampleGet"] == 4

    nvml.update_gpu(0, gpm_metrics={"sm_util": 10.0, "any_tensor_util": 5.0, "dram_bw_util": 1.0})
    clock.t += 0.5  # within the interval: cached values, no NVML calls
    r = collector.collect()
    assert value(r, "rankguard_gpu_sm_activity_ratio", 0, uuid0) == pytest.approx(0.88)
    assert nvml.calls["nvmlGpmSampleGet"] == 4
    clock.t += 0.5
    r = collector.collect()
    assert value(r, "rankguard_gpu_sm_activity_ratio", 0, uuid0) == pytest.approx(0.10)
    collector.close()
    assert nvml.calls["nvmlGpmSampleFree"] == 4  # two per GPU


def test_pcie_read_on_its_slower_cadence(gpu_collector):
    collector, nvml, clock = gpu_collector(make_double(2), pcie_interval=10.0)
    collector.collect()
    assert nvml.calls["nvmlDeviceGetPcieThroughput"] == 4  # tx + rx on 2 GPUs
    for _ in range(9):
        clock.t += 1
        r = collector.collect()
    assert nvml.calls["nvmlDeviceGetPcieThroughput"] == 4
    assert len(samples(r, "rankguard_gpu_pcie_transmit_bytes_per_second")) == 2  # cached
    assert nvml.calls["nvmlDeviceGetUtilizationRates"] == 20  # cheap reads every time
    clock.t += 1
    collector.collect()
    assert nvml.calls["nvmlDeviceGetPcieThroughput"] == 8


def test_double_rereads_its_file(gpu_collector, tmp_path):
    path = tmp_path / "nvml.json"
    state = make_double(2)
    write_state(path, state)
    collector, nvml, _ = gpu_collector(NvmlDouble.from_file(path))
    uuids = [g["uuid"] for g in state["gpus"]]
    r = collector.collect()
    assert value(r, "rankguard_gpu_utilization_ratio", 0, uuids[0]) == pytest.approx(0.97)

    state["gpus"][0]["util"] = 50
    state["gpus"][1]["lost"] = True
    state["xid_events"].append({"gpu": 0, "xid": 79})
    write_state(path, state)
    r = collector.collect()
    assert value(r, "rankguard_gpu_utilization_ratio", 0, uuids[0]) == pytest.approx(0.5)
    assert value(r, "rankguard_gpu_lost", 1, uuids[1]) == 1

    def xid79():
        return value(collector.collect(), "rankguard_gpu_xid_errors_total", 0, uuids[0], 79)

    wait_for(lambda: xid79() == 1)
    state["gpus"][0]["util"] = 40  # rewriting the file does not redeliver old events
    write_state(path, state)
    time.sleep(0.15)
    assert xid79() == 1
    state["xid_events"].append({"gpu": 0, "xid": 79})
    write_state(path, state)
    wait_for(lambda: xid79() == 2)


def test_rank_process_gpu_memory(gpu_collector):
    state = make_double(2)
    state["gpus"][0]["processes"] = [
        {"pid": 100, "used_memory": 10 * GIB},
        {"pid": 999, "used_memory": GIB},  # not a rank
    ]
    state["gpus"][1]["processes"] = [{"pid": 101, "used_memory": 20 * GIB}]
    ranks = [("job1", 0, 100), ("job1", 1, 101)]
    collector, nvml, _ = gpu_collector(state, ranks=lambda: ranks)
    r = collector.collect()
    assert samples(r, "rankguard_rank_gpu_memory_bytes") == {
        ("job1", "0", "0"): 10 * GIB,
        ("job1", "1", "1"): 20 * GIB,
    }
    ranks = []  # no ranks on the node: the process query is skipped
    calls = nvml.calls["nvmlDeviceGetComputeRunningProcesses"]
    assert samples(collector.collect(), "rankguard_rank_gpu_memory_bytes") == {}
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses"] == calls


NAME = re.compile(r"^rankguard_[a-z0-9_]+$")
ALLOWED_LABELS = {
    "gpu",
    "uuid",
    "training_job",
    "rank",
    "name",
    "driver",
    "reason",
    "type",
    "cause",
    "xid",
}


def a_rank(table: RankTable, rank: int = 0, **fields) -> None:
    """This process, registered as a rank of job j (the table checks the pid is live)."""
    record = dict(
        v=1, job="j", rank=rank, local_rank=rank, world_size=8, pid=os.getpid(), restart=0,
        step=3, phase="train", time=time.time(), step_seconds=1.0, data_wait_seconds=0.0,
        compute_seconds=1.0, comm_seconds=0.0, comm_exposed_seconds=0.0,
        optimizer_seconds=0.0, checkpoint_block_seconds=0.0, tokens_per_second=1.0,
        mfu=0.1, peak_memory_bytes=0, loss=1.0, checkpoint_step=None,
    )  # fmt: skip
    table.update(TelemetryRecord(**{**record, **fields}), os.getpid())


def test_metric_names_follow_the_conventions(gpu_collector):
    state = make_double(2, retired_pages={"single_bit": 1, "double_bit": 0})
    state["gpus"][0]["processes"] = [{"pid": os.getpid(), "used_memory": GIB}]
    table = RankTable()
    a_rank(table)
    collector, _, clock = gpu_collector(state, ranks=table.processes, expected=2, table=table)
    collector.collect()
    clock.t += 1
    r = collector.collect()
    names = [m.name for m in r.metrics]
    assert len(names) == len(set(names))
    for m in r.metrics:
        assert NAME.match(m.name), m.name
        assert (m.kind == "counter") == m.name.endswith("_total"), m.name
        assert set(m.labels) <= ALLOWED_LABELS, m.labels
        assert m.samples, f"{m.name} has no samples with every feature on"
        if m.name.endswith("_ratio"):
            assert all(0 <= v <= 1 for _, v in m.samples), m.name


# --- real NVML --------------------------------------------------------------------------------


MATMUL_LOOP = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
"""

HOLD_MEMORY = """
import sys, torch
x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
print("ready", flush=True)
sys.stdin.read()
"""


class RecordingNvml:
    """Real pynvml, every call recorded with its outcome: (name, None | NVML error code).
    `lose` makes one GPU's handle answer NVML_ERROR_GPU_IS_LOST, as a fallen-off GPU does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None]] = []
        self.lost_handles: list = []

    def __getattr__(self, name: str):
        real = getattr(pynvml, name)
        if not callable(real) or not name.startswith("nvml"):
            return real

        def call(*args, **kwargs):
            if any(a is h for a in args for h in self.lost_handles):
                self.calls.append((name, pynvml.NVML_ERROR_GPU_IS_LOST))
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            try:
                out = real(*args, **kwargs)
            except pynvml.NVMLError as exc:
                self.calls.append((name, exc.value))
                raise
            self.calls.append((name, None))
            return out

        return call


def spawn_gpu_child(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    return proc


def end_child(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.gpu
class TestRealNvml:
    @pytest.fixture
    def collector(self):
        try:
            pynvml.nvmlInit()
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            pytest.skip(f"NVML unavailable: {exc}")
        collector = GpuCollector(
            CollectorContext(nvml=pynvml), GpuConfig(gpm_interval=0.1, pcie_interval=0)
        )
        yield collector
        collector.close()

    def test_reads_real_gpus(self, collector):
        first = collector.collect()
        time.sleep(0.3)
        r = collector.collect()
        assert value(r, "rankguard_gpu_nvml_up") == 1
        count = value(r, "rankguard_gpus")
        assert count > 0 and r.facts["count"] == count
        for _, ratio in samples(r, "rankguard_gpu_utilization_ratio").items():
            assert 0 <= ratio <= 1
        assert all(v > 0 for v in samples(r, "rankguard_gpu_memory_total_bytes").values())
        for gpu in r.facts["gpus"]:
            assert gpu["name"] and gpu["uuid"].startswith(("GPU-", "MIG-"))
            assert gpu["lost"] is False
            # GPM works (values in 0..1) or the GPU says it is unsupported.
            sm = samples(r, "rankguard_gpu_sm_activity_ratio").get((str(gpu["index"]), gpu["uuid"]))
            if gpu["gpm_supported"]:
                assert sm is not None and 0 <= sm <= 1
            else:
                assert sm is None
        assert isinstance(r.facts["xid_supported"], bool)
        assert first.facts["driver"]

    def test_every_field_read_on_the_real_device(self):
        """Each NVML query the collector makes answers, or says NOT_SUPPORTED for this GPU
        (nothing else), and the fields every datacenter GPU has are filled in."""
        nvml = RecordingNvml()
        collector = GpuCollector(
            CollectorContext(nvml=nvml, rank_processes=lambda: [("job", 0, os.getpid())]),
            GpuConfig(gpm_interval=0, pcie_interval=0),
        )
        try:
            collector.collect()
            time.sleep(0.2)
            result = collector.collect()
            gpu = collector.gpus[0]
            reading = collector._read(gpu, do_gpm=True, do_pcie=True, want_procs=True)
        finally:
            collector.close()
        failures = {
            (n, c) for n, c in nvml.calls if c not in (None, pynvml.NVML_ERROR_NOT_SUPPORTED)
        }
        # The XID wait times out when nothing happened: that is its normal answer.
        failures.discard(("nvmlEventSetWait_v2", pynvml.NVML_ERROR_TIMEOUT))
        assert not failures, failures
        unsupported = sorted({n for n, c in nvml.calls if c == pynvml.NVML_ERROR_NOT_SUPPORTED})
        print("NOT_SUPPORTED on this GPU:", unsupported or "none")
        for field in ("utilization", "memory_used", "memory_total", "temperature",
                      "power_watts", "energy_joules", "sm_clock_hertz", "clock_event_mask",
                      "ecc", "pcie"):  # fmt: skip
            assert getattr(reading, field) is not None, field
        assert reading.memory_total > reading.memory_used >= 0
        assert 0 < reading.power_watts < 2000 and 0 < reading.temperature < 120
        assert reading.sm_clock_hertz > 1e8
        # Hopper and later report row remapping; older parts page retirement: one of them.
        assert reading.remapped_rows is not None or reading.retired_pages is not None
        assert value(result, "rankguard_gpu_nvml_up") == 1
        assert result.facts["gpus"][0]["ecc_uncorrected"] is not None

    def test_gpm_reads_high_under_a_matmul_loop_and_low_when_idle(self, collector):
        if not collector.collect().facts["gpus"][0]["gpm_supported"]:
            pytest.skip("GPM not supported on this GPU (Hopper or newer needed)")
        key = lambda r: (str(r.facts["gpus"][0]["index"]), r.facts["gpus"][0]["uuid"])  # noqa: E731

        def activity(result):
            sm = samples(result, "rankguard_gpu_sm_activity_ratio")[key(result)]
            tensor = samples(result, "rankguard_gpu_tensor_activity_ratio")[key(result)]
            return sm, tensor

        busy_child = spawn_gpu_child(MATMUL_LOOP, "6")
        try:
            time.sleep(1.0)
            collector.collect()
            time.sleep(1.0)
            busy = activity(collector.collect())
        finally:
            end_child(busy_child)
        time.sleep(1.0)
        collector.collect()
        time.sleep(1.0)
        idle = activity(collector.collect())
        print(
            f"GPM busy sm={busy[0]:.2f} tensor={busy[1]:.2f}; idle sm={idle[0]:.2f} tensor={idle[1]:.2f}"
        )
        assert busy[0] > 0.5 and busy[1] > 0.2, busy
        assert idle[0] < 0.1 and idle[1] < 0.1, idle

    def test_xid_event_set_is_registered_and_drained(self, collector):
        collector.collect()
        watcher = collector.watcher
        assert watcher is not None and watcher.supported, watcher and watcher.unsupported
        assert watcher.thread.is_alive()  # waiting on the event set: timeouts, no errors
        time.sleep(3 * collector.config.event_timeout_ms / 1000)
        assert watcher.thread.is_alive()
        assert collector.xids.snapshot() == {}  # no XID on a healthy GPU
        collector.close()
        assert not watcher.thread.is_alive() and watcher.event_set is None

    def test_per_rank_gpu_memory(self):
        child = spawn_gpu_child(HOLD_MEMORY, str(GIB))
        try:
            collector = GpuCollector(
                CollectorContext(nvml=pynvml, rank_processes=lambda: [("job", 3, child.pid)]),
                GpuConfig(gpm_interval=0, pcie_interval=0),
            )
            try:
                result = collector.collect()
            finally:
                collector.close()
        finally:
            end_child(child)
        per_rank = samples(result, "rankguard_rank_gpu_memory_bytes")
        assert per_rank, "the rank's process was not found on the GPU"
        (labels, used), *_ = per_rank.items()
        assert tuple(map(str, labels))[:2] == ("job", "3"), labels
        assert GIB <= used < 2 * GIB

    def test_a_gpu_that_falls_off_reads_lost_then_recovers(self):
        """A real GPU whose queries start answering GPU_IS_LOST (as one that fell off the
        bus does) reads lost with the error; when it answers again it is back."""
        nvml = RecordingNvml()
        collector = GpuCollector(CollectorContext(nvml=nvml), GpuConfig(gpm_interval=0))
        try:
            assert collector.collect().facts["gpus"][0]["lost"] is False
            nvml.lost_handles.append(collector.gpus[0].handle)
            gone = collector.collect().facts["gpus"][0]
            assert gone["lost"] is True and "lost" in gone["error"].lower(), gone
            nvml.lost_handles.clear()
            assert collector.collect().facts["gpus"][0]["lost"] is False
        finally:
            collector.close()


# --- a rank tied to its GPU ---------------------------------------------------------------


def rank_gpu(table: RankTable) -> dict | None:
    [row] = table.snapshot()
    return row.get("gpu")


def test_a_zero_code_rank_is_tied_to_its_gpu_by_nvmls_process_list(gpu_collector):
    state = make_double(2)
    uuid = state["gpus"][1]["uuid"]
    state["gpus"][1]["processes"] = [{"pid": os.getpid(), "used_memory": GIB}]
    table = RankTable()
    a_rank(table)  # its records name no GPU (an older client), so NVML's list decides
    collector, nvml, _ = gpu_collector(state, ranks=table.processes, table=table)
    r = collector.collect()
    assert samples(r, "rankguard_rank_gpu_info") == {("j", "0", "1", uuid): 1.0}
    gpu = rank_gpu(table)
    assert (gpu["uuid"], gpu["source"], gpu["index"], gpu["lost"]) == (uuid, "nvml", 1, False)
    assert gpu["xid_recent"] == {} and gpu["throttle"] == []
    # a new XID on that GPU, and only that GPU, is the rank's
    nvml.inject_xid(1, 79)
    nvml.inject_xid(0, 13)
    wait_for(lambda: (collector.collect(), rank_gpu(table)["xid_recent"])[1] == {"79": 1})


def test_a_gpu_the_rank_reports_wins_and_carries_that_gpus_faults(gpu_collector):
    state = make_double(2)
    reported = state["gpus"][0]["uuid"]
    state["gpus"][1]["processes"] = [{"pid": os.getpid(), "used_memory": GIB}]
    state["gpus"][0]["clock_event_reasons"] = int(pynvml.nvmlClocksEventReasonHwThermalSlowdown)
    table = RankTable()
    a_rank(table, gpu_uuid=reported)
    collector, nvml, _ = gpu_collector(state, ranks=table.processes, table=table)
    collector.collect()
    gpu = rank_gpu(table)
    assert (gpu["uuid"], gpu["source"], gpu["index"]) == (reported, "reported", 0)
    assert gpu["throttle"] == ["hw_thermal_slowdown"]
    nvml.set_lost(0)
    collector.collect()
    assert rank_gpu(table)["lost"] is True


def test_recent_xids_age_out():
    clock = FakeClock()
    counts = XidCounts(clock=clock)
    counts.add(0, 79)
    clock.t += 500
    counts.add(0, 48)
    assert counts.recent(600) == {(0, 79): 1, (0, 48): 1}
    clock.t += 200
    assert counts.recent(600) == {(0, 48): 1}
    assert counts.snapshot() == {(0, 79): 1, (0, 48): 1}  # the lifetime counters stay


def test_a_gpu_whose_nvml_calls_hang_is_unresponsive_and_the_collection_goes_on(gpu_collector):
    """GPU 1's calls block (the double's delay_s -1, as a failing GPU's driver calls do):
    each collection still returns by the deadline, GPU 0 is read as usual, GPU 1 is
    reported unresponsive and not called again until its call returns."""
    collector, nvml, clock = gpu_collector(make_double(2), read_deadline_seconds=0.3)
    collector.collect()  # handles resolved, both answer
    nvml.update_gpu(1, delay_s=-1)
    for _ in range(3):
        started = time.monotonic()
        r = collector.collect()
        assert time.monotonic() - started < 1.5
        gpu0, gpu1 = r.facts["gpus"]
        assert gpu0["utilization"] is not None and gpu0["unresponsive_seconds"] is None
        assert gpu1["unresponsive_seconds"] is not None and gpu1["utilization"] is None
    calls = sum(nvml.calls.values())
    collector.collect()
    assert sum(nvml.calls.values()) - calls < calls  # GPU 1 not called while its call hangs
    reasons = gpu_reasons(r.facts, 2)
    assert [x.code for x in reasons] == ["gpu_unresponsive"] and reasons[0].severity == "unhealthy"
    nvml.update_gpu(1, delay_s=0)  # the driver answers again
    wait_until(lambda: collector.collect().facts["gpus"][1]["utilization"] is not None, 10,
               "GPU 1 read again")  # fmt: skip


def test_the_agent_answers_and_feeds_its_watchdog_while_a_gpus_calls_hang(tmp_path):
    """The agent as systemd runs it, on the file-backed double: GPU 1's NVML calls start to
    hang. /metrics and /v1/node still answer at once, the watchdog pings keep their pace,
    and the node shows GPU 1 unresponsive within 10 s."""
    import socket

    from harness import http_json

    from rankguard.cli.local_stack import start_agent

    state = tmp_path / "nvml.json"
    write_state(state, make_double(2))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(1.0)
    env = {ENV_VAR: str(state), "NOTIFY_SOCKET": str(tmp_path / "notify.sock")}
    agent = start_agent(tmp_path, extra=["--expected-gpus", "2"], env=env)
    try:
        wait_until(lambda: http_json(agent.url + "/v1/node")["status"] == "healthy", 30, "healthy")
        hanging = make_double(2)
        hanging["gpus"][1]["delay_s"] = -1
        write_state(state, hanging)
        hung_at, pings = time.monotonic(), []
        while time.monotonic() - hung_at < 8:
            with contextlib.suppress(TimeoutError):
                if b"WATCHDOG=1" in notify.recv(4096):
                    pings.append(time.monotonic())
        # --interval 1 plus the 2 s read deadline: a ping every 3 s at the worst
        gaps = [b - a for a, b in zip(pings, pings[1:], strict=False)]
        assert len(pings) >= 2 and max(gaps) < 4.5, pings
        started = time.monotonic()
        node = http_json(agent.url + "/v1/node")
        metrics = urllib.request.urlopen(agent.url + "/metrics", timeout=5).read()
        assert time.monotonic() - started < 1.0 and b"rankguard_gpu_nvml_up" in metrics
        codes = [r["code"] for r in node["reasons"]]
        assert "gpu_unresponsive" in codes and node["status"] == "unhealthy", node["reasons"]
        assert time.monotonic() - hung_at < 10 + 1.0
    finally:
        write_state(state, make_double(2))  # the hung calls return
        agent.stop()
        notify.close()


def test_a_hung_driver_never_holds_a_collection(gpu_collector):
    """nvmlInit, then the device count, stop returning (the double's driver_delay_s: a
    driver stuck as a whole). Each collection ends within the read deadline with NVML down
    and why, makes no second call while the first is still inside the driver, and the
    collector comes back once the driver answers."""
    collector, nvml, clock = gpu_collector(read_deadline_seconds=0.3, init_retry_interval=0)
    nvml.set_driver_delay(-1)
    for _ in range(2):
        started = time.monotonic()
        facts = collector.collect().facts
        assert time.monotonic() - started < 5.0  # the deadline, not the hang
        assert not facts["available"] and "nvmlInit has not returned" in facts["reason"], facts
    assert nvml.calls["nvmlInit"] == 0  # the first is still inside; no second was made
    nvml.set_driver_delay(0)
    wait_until(lambda: collector.collect().facts["available"], 10, "NVML up again")
    assert nvml.calls["nvmlInit"] == 1
    nvml.set_driver_delay(-1)  # now the device count hangs
    facts = collector.collect().facts
    assert not facts["available"] and "nvmlDeviceGetCount has not returned" in facts["reason"]
    nvml.set_driver_delay(0)
    wait_until(lambda: collector.collect().facts["available"], 10, "NVML up after the count")
    assert [g["index"] for g in collector.collect().facts["gpus"]] == [0, 1]
    collector.close()
