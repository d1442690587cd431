"""The GPU collector's per-GPU samplers (agent/collectors/gpu_*.py): NVLink, PCIe link and
replays, clock violation time, memory clock and temperature, power limits and MIG, read
through the NVML double, with their metrics, facts and health reasons."""

from __future__ import annotations

import time

import pynvml
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_gpu_collector import samples

from rankguard.agent.collectors import CollectorContext, CollectorResult
from rankguard.agent.collectors.gpu import GpuCollector, GpuConfig, load_samplers
from rankguard.agent.collectors.gpu_pcie import downtrained
from rankguard.agent.collectors.gpu_samplers import SAMPLERS, field_value
from rankguard.agent.exposition import make_registry
from rankguard.agent.health import gpu_reasons, node_verdict
from rankguard.agent.nvml_double import NvmlDouble, make_double

UUID0 = make_double(1)["gpus"][0]["uuid"]


def gpu0(result: CollectorResult) -> dict:
    return result.facts["gpus"][0]


# --- the double answers the new calls ------------------------------------------------------


def test_double_answers_field_values_with_per_field_errors():
    state = make_double(1)
    state["gpus"][0]["nvlink_errors"]["replay"] = 7
    state["gpus"][0]["mem_temp"] = None  # no HBM sensor: that one field NOT_SUPPORTED
    state["gpus"][0]["field_values"] = {str(pynvml.NVML_FI_DEV_PCIE_COUNT_LANE_ERROR): 3}
    nvml = NvmlDouble(state)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    ids = [pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, pynvml.NVML_FI_DEV_MEMORY_TEMP,
           pynvml.NVML_FI_DEV_PCIE_COUNT_LANE_ERROR, (pynvml.NVML_FI_DEV_ECC_CURRENT, 2)]  # fmt: skip
    out = nvml.nvmlDeviceGetFieldValues(h, ids)
    assert [field_value(v) for v in out] == [7.0, None, 3.0, None]
    assert out[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert out[3].scopeId == 2
    assert nvml.nvmlDeviceGetNvLinkState(h, 0) == pynvml.NVML_FEATURE_ENABLED
    with pytest.raises(pynvml.NVMLError) as exc:
        nvml.nvmlDeviceGetNvLinkState(h, 18)
    assert exc.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert nvml.nvmlDeviceGetCurrPcieLinkWidth(h) == 16
    assert nvml.nvmlDeviceGetPcieReplayCounter(h) == 0
    assert nvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_THERMAL).violationTime == 0
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000
    assert nvml.nvmlDeviceGetMigMode(h) == [0, 0]
    nvml.update_gpu(0, lost=True)
    with pytest.raises(pynvml.NVMLError) as exc:
        nvml.nvmlDeviceGetFieldValues(h, ids)
    assert exc.value.value == pynvml.NVML_ERROR_GPU_IS_LOST


def test_field_value_decodes_every_value_type():
    fv = pynvml.c_nvmlFieldValue_t()
    fv.nvmlReturn = pynvml.NVML_SUCCESS
    fv.valueType, fv.value.dVal = pynvml.NVML_VALUE_TYPE_DOUBLE, 1.5
    assert field_value(fv) == 1.5
    fv.valueType, fv.value.siVal = pynvml.NVML_VALUE_TYPE_SIGNED_INT, -4
    assert field_value(fv) == -4
    fv.valueType, fv.value.ullVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 2**40
    assert field_value(fv) == 2**40
    fv.valueType = 99  # a type this version does not know: no value, not garbage
    assert field_value(fv) is None
    fv.valueType, fv.nvmlReturn = pynvml.NVML_VALUE_TYPE_DOUBLE, pynvml.NVML_ERROR_NOT_SUPPORTED
    assert field_value(fv) is None


# --- every sampler, its metrics and facts --------------------------------------------------


def test_every_sampler_reads_into_metrics_and_facts(gpu_collector):
    state = make_double(2)
    g = state["gpus"][0]
    g["nvlink_errors"] = {"crc_flit": 5, "crc_data": 1, "replay": 12, "recovery": 2}
    g["nvlink_links"] = [True] * 16 + [False, True]
    g["pcie_replays"] = 40
    g["pcie_link"] = {"gen": 5, "max_gen": 5, "width": 8, "max_width": 16}
    g["violation_ns"]["thermal"] = 2_500_000_000
    g["mem_temp"] = 71
    g["mem_clock_mhz"] = 2619
    g["power_limit_mw"] = 500_000
    g["mig"] = {"mode": 1, "devices": 3}
    collector, nvml, _ = gpu_collector(state)
    r = collector.collect()
    lab = ("0", UUID0)
    assert samples(r, "rankguard_gpu_nvlink_errors_total")[(*lab, "replay")] == 12
    assert samples(r, "rankguard_gpu_nvlink_errors_total")[(*lab, "crc_flit")] == 5
    assert samples(r, "rankguard_gpu_nvlink_links_up")[lab] == 17
    assert samples(r, "rankguard_gpu_nvlink_links_down") == {
        lab: 1,
        ("1", r.facts["gpus"][1]["uuid"]): 0,
    }
    assert samples(r, "rankguard_gpu_pcie_replays_total")[lab] == 40
    assert samples(r, "rankguard_gpu_pcie_link_width_lanes")[(*lab, "current")] == 8
    assert samples(r, "rankguard_gpu_pcie_link_width_lanes")[(*lab, "max")] == 16
    assert samples(r, "rankguard_gpu_pcie_link_generation")[(*lab, "max")] == 5
    assert samples(r, "rankguard_gpu_clock_violation_seconds_total")[(*lab, "thermal")] == 2.5
    assert samples(r, "rankguard_gpu_memory_temperature_celsius")[lab] == 71
    assert samples(r, "rankguard_gpu_memory_clock_hertz")[lab] == 2619e6
    assert samples(r, "rankguard_gpu_power_limit_watts")[(*lab, "enforced")] == 500
    assert samples(r, "rankguard_gpu_power_limit_watts")[(*lab, "default")] == 700
    assert samples(r, "rankguard_gpu_mig_enabled")[lab] == 1
    assert samples(r, "rankguard_gpu_mig_devices")[lab] == 3
    f = gpu0(r)
    assert f["nvlink_links_down"] == [16] and f["pcie_link"]["width"] == 8
    assert f["nvlink_errors"]["replay"] == 12 and f["pcie_replays"] == 40
    assert "samplers_skipped" not in f
    # the per-GPU counters are one batched field read per GPU and collection (plus the
    # slow one at the first collection), not a call per counter
    assert nvml.calls["nvmlDeviceGetFieldValues"] == 2 * 2
    assert nvml.calls["nvmlDeviceGetViolationStatus"] == 0
    assert nvml.calls["nvmlDeviceGetPcieReplayCounter"] == 0


def test_slow_samplers_run_on_their_own_cadence(gpu_collector):
    collector, nvml, clock = gpu_collector(make_double(1), slow_interval=30)
    collector.collect()
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == 18
    assert nvml.calls["nvmlDeviceGetMigMode"] == 1
    nvml.update_gpu(0, nvlink_links=[False] + [True] * 17, pcie_replays=3)
    clock.t += 10
    r = collector.collect()
    # the replay counter is read every collection; link state, limits and MIG are not
    assert samples(r, "rankguard_gpu_pcie_replays_total")[("0", UUID0)] == 3
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == 18 and nvml.calls["nvmlDeviceGetMigMode"] == 1
    assert gpu0(r)["nvlink_links_down"] == []  # kept from its last sample
    assert nvml.calls["nvmlDeviceGetFieldValues"] == 3  # fast x2 + slow x1
    clock.t += 25
    r = collector.collect()
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == 36 and gpu0(r)["nvlink_links_down"] == [0]


def test_unsupported_and_garbage_answers_are_skipped_with_a_reason(gpu_collector):
    state = make_double(1)
    g = state["gpus"][0]
    g.update(nvlink_links=None, nvlink_errors=None, mig=None, mem_temp=None,
             power_limit_mw=None, power_default_limit_mw=None, violation_ns=None,
             pcie_replays=None, pcie_link=None, mem_clock_mhz=None)  # fmt: skip
    collector, _, _ = gpu_collector(state)
    r = collector.collect()
    skipped = gpu0(r)["samplers_skipped"]
    assert set(skipped) == set(load_samplers()), skipped
    assert all("not supported" in why for why in skipped.values())
    for family in ("rankguard_gpu_nvlink_errors_total", "rankguard_gpu_nvlink_links_up",
                   "rankguard_gpu_pcie_replays_total", "rankguard_gpu_mig_enabled",
                   "rankguard_gpu_memory_temperature_celsius", "rankguard_gpu_power_limit_watts"):  # fmt: skip
        assert samples(r, family) == {}, family
    # the GPU's other readings are unaffected
    assert gpu0(r)["utilization"] == 0.97 and gpu_reasons(r.facts, 1) == []


def test_garbage_link_count_and_a_failing_call_skip_that_sampler_only(gpu_collector):
    state = make_double(1)
    g = state["gpus"][0]
    g["field_values"] = {str(pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT): 4096}  # garbage
    g["mem_temp"] = 9999  # no sensor behind it: garbage
    collector, nvml, _ = gpu_collector(state)
    r = collector.collect()
    f = gpu0(r)
    assert "out of range" in f["samplers_skipped"]["nvlink"]
    assert f["memory_temperature"] is None
    assert samples(r, "rankguard_gpu_nvlink_links_down") == {}
    assert samples(r, "rankguard_gpu_nvlink_errors_total")  # the fast counters still read
    assert samples(r, "rankguard_gpu_pcie_replays_total")


def test_an_old_driver_without_field_values_reads_the_rest(gpu_collector):
    collector, nvml, _ = gpu_collector(make_double(1))

    def not_found(*args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    nvml.nvmlDeviceGetFieldValues = not_found
    r = collector.collect()
    assert samples(r, "rankguard_gpu_nvlink_errors_total") == {}
    assert samples(r, "rankguard_gpu_nvlink_links_up")  # per-call queries still answer
    assert samples(r, "rankguard_gpu_memory_clock_hertz")
    assert r.facts["gpus"][0]["lost"] is False


def test_a_gpu_lost_in_a_sampler_is_lost(gpu_collector):
    collector, nvml, _ = gpu_collector(make_double(2))
    collector.collect()
    real = nvml.nvmlDeviceGetFieldValues

    def lost_on_1(handle, ids):
        if handle is nvml._handles[1]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return real(handle, ids)

    nvml.nvmlDeviceGetFieldValues = lost_on_1
    r = collector.collect()
    assert r.facts["gpus"][1]["lost"] is True and r.facts["gpus"][0]["lost"] is False
    assert ("1", r.facts["gpus"][1]["uuid"]) not in samples(r, "rankguard_gpu_pcie_replays_total")


def test_a_hanging_sampler_call_is_held_by_the_gpu_read_deadline(gpu_collector):
    """The double's delay_s holds the new calls too; the samplers run inside the GPU's
    read, so a hung field read marks the GPU unresponsive and the collection returns."""
    collector, nvml, _ = gpu_collector(make_double(2), read_deadline_seconds=0.3)
    collector.collect()
    hold = {"on": True}
    real = nvml.nvmlDeviceGetFieldValues

    def hangs_on_1(handle, ids):
        if handle is nvml._handles[1]:
            while hold["on"]:
                time.sleep(0.02)
        return real(handle, ids)

    nvml.nvmlDeviceGetFieldValues = hangs_on_1
    started = time.monotonic()
    r = collector.collect()
    assert time.monotonic() - started < 1.5
    assert r.facts["gpus"][1]["unresponsive_seconds"] is not None
    assert r.facts["gpus"][0]["pcie_replays"] == 0
    hold["on"] = False
    # and the double's own delay applies to a new call
    nvml.nvmlDeviceGetFieldValues = real
    nvml.update_gpu(0, delay_s=0.2)
    h = nvml._handles[0]
    started = time.monotonic()
    nvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER])
    nvml.nvmlDeviceGetNvLinkState(h, 0)
    assert time.monotonic() - started >= 0.4


# --- health --------------------------------------------------------------------------------


def test_link_and_row_remap_health_reasons(gpu_collector):
    state = make_double(3)
    state["gpus"][0]["nvlink_links"] = [True] * 17 + [False]
    state["gpus"][1]["pcie_link"]["width"] = 8
    state["gpus"][2]["remapped_rows"]["pending"] = True
    collector, nvml, _ = gpu_collector(state)
    reasons = {(x.code, x.severity): x.message for x in gpu_reasons(collector.collect().facts, 3)}
    assert set(reasons) == {("nvlink_down", "unhealthy"), ("pcie_downtrained", "degraded"),
                            ("row_remap_pending", "degraded")}  # fmt: skip
    assert "link(s) 17 down" in reasons[("nvlink_down", "unhealthy")]
    assert "GPU 1" in reasons[("pcie_downtrained", "degraded")]
    nvml.update_gpu(2, remapped_rows={"correctable": 0, "uncorrectable": 1, "pending": True,
                                      "failure": True})  # fmt: skip
    verdict = node_verdict({"gpu": collector.collect().facts}, [], 3)
    assert "row_remap_failure" in [x.code for x in verdict.reasons]
    assert "row_remap_pending" not in [x.code for x in verdict.reasons]
    assert verdict.status == "unhealthy"


def test_nvlink_down_counts_only_where_the_node_uses_nvlink():
    facts = {"available": True, "gpus": [
        {"index": i, "uuid": f"u{i}", "nvlink_links_up": [], "nvlink_links_down": [0, 1]}
        for i in range(2)]}  # fmt: skip
    assert gpu_reasons(facts, 2) == []  # PCIe cards whose links are all off: no NVLink here
    facts["gpus"][1]["nvlink_links_up"] = [2, 3]
    assert [x.code for x in gpu_reasons(facts, 2)] == ["nvlink_down", "nvlink_down"]


def test_pcie_downtrained_judgement():
    full = {"generation": 5, "max_generation": 5, "width": 16, "max_width": 16}
    assert downtrained(full, 1.0) is None
    assert downtrained({**full, "width": 8}, 0.0) == "PCIe link x8 of x16"
    # an idle GPU lowers its link generation to save power: not a fault
    assert downtrained({**full, "generation": 1}, 0.0) is None
    assert downtrained({**full, "generation": 4}, 0.9) == "PCIe link gen 4 of gen 5 while busy"
    assert downtrained({"width": 16}, 1.0) is None and downtrained(None, 1.0) is None


# --- exposition ------------------------------------------------------------------------------


def test_exposition_of_the_sampler_families(gpu_collector):
    state = make_double(1)
    state["gpus"][0]["nvlink_errors"]["recovery"] = 3
    collector, _, _ = gpu_collector(state)
    r = collector.collect()
    text = generate_latest(make_registry(lambda: r.metrics)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # counters are typed as counters (the parser drops the _total suffix from the name)
    for name in ("rankguard_gpu_nvlink_errors", "rankguard_gpu_pcie_replays",
                 "rankguard_gpu_clock_violation_seconds"):  # fmt: skip
        assert families[name].type == "counter", name
    for name in ("rankguard_gpu_nvlink_links_down", "rankguard_gpu_pcie_link_width_lanes",
                 "rankguard_gpu_memory_temperature_celsius", "rankguard_gpu_power_limit_watts",
                 "rankguard_gpu_mig_devices"):  # fmt: skip
        assert families[name].type == "gauge", name
    assert (f'rankguard_gpu_nvlink_errors_total{{gpu="0",type="recovery",uuid="{UUID0}"}} 3.0'
            in text)  # fmt: skip
    assert "# HELP rankguard_gpu_pcie_replays_total PCIe replays" in text


def test_samplers_are_registered_by_name():
    names = set(load_samplers())
    assert names == {"nvlink", "pcie", "violation", "memory", "power_limit", "mig"}
    assert all(SAMPLERS[n].name == n for n in names)


def test_double_per_call_latency_and_a_hang_override_it():
    """`latency_s` gives each call its ordinary latency (by name, else "default"); the
    GPU's delay_s (a failing GPU) takes precedence."""
    nvml = NvmlDouble(make_double(1, latency_s={"default": 0.0,
                                                "nvmlDeviceGetFieldValues": 0.5}))  # fmt: skip
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    started = time.monotonic()
    nvml.nvmlDeviceGetUtilizationRates(h)
    assert time.monotonic() - started < 0.5  # not the field read's latency
    started = time.monotonic()
    nvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    assert time.monotonic() - started >= 0.5
    nvml.update_gpu(0, delay_s=0.3)
    started = time.monotonic()
    nvml.nvmlDeviceGetUtilizationRates(h)
    assert time.monotonic() - started >= 0.3


@pytest.mark.gpu
def test_samplers_on_the_real_device():
    """Every sampler reads on a real GPU or is skipped for NVML's own answer (never a
    decoding error of ours); every GPU has a PCIe link and a memory clock."""
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        pytest.skip(f"NVML unavailable: {exc}")
    collector = GpuCollector(CollectorContext(nvml=pynvml), GpuConfig())
    try:
        r = collector.collect()
    finally:
        collector.close()
    for gpu in r.facts["gpus"]:
        skipped = gpu.get("samplers_skipped") or {}
        assert all(why.startswith(("NVML:", "not supported")) for why in skipped.values()), skipped
        assert gpu["pcie_link"] and gpu["pcie_link"]["max_width"] >= gpu["pcie_link"]["width"] > 0
        print(f"GPU {gpu['index']}: skipped {skipped or 'none'}; links up "
              f"{len(gpu.get('nvlink_links_up') or [])}, HBM {gpu.get('memory_temperature')} C")  # fmt: skip
    assert samples(r, "rankguard_gpu_memory_clock_hertz")
