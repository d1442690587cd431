"""GPUs: activity per node and GPU (heatmaps, readable for hundreds of GPUs), memory,
temperature, power, clock throttling, XID and ECC errors, lost GPUs.

GPU series carry no job label (a GPU is hardware; jobs are joined through info metrics):
these panels follow $node.
"""

from __future__ import annotations

from .common import Query, dashboard, heatmap, stat, timeseries, with_node

UID = "rankguard-gpus"
GPU = "{{node}} gpu {{gpu}}"

# Reasons that mean the GPU is slowed against its will (idle, app clocks and sync boost
# are normal operation).
THROTTLE_REASONS = "sw_power_cap|hw_slowdown|sw_thermal_slowdown|hw_thermal_slowdown|hw_power_brake"
THROTTLED = f'rankguard_gpu_clock_event_active{{reason=~"{THROTTLE_REASONS}"}}'


def build():
    top = [
        stat("GPUs", [Query(f"sum({with_node('rankguard_gpus')})", "reported")], "none",
             description="GPUs NVML reports on the selected nodes."),
        stat("Lost GPUs", [Query(f"sum({with_node('rankguard_gpu_lost')})", "lost")], "none",
             thresholds=(("green", None), ("red", 1)),
             description="GPUs answering GPU_IS_LOST or RESET_REQUIRED: drained until reset."),
        stat("Mean utilization", [Query(f"avg({with_node('rankguard_gpu_utilization_ratio')})", "mean")],
             "percentunit", decimals=1, thresholds=(("red", None), ("orange", 0.8), ("green", 0.9)),
             description="Target while training: above 90%."),
        stat("Mean SM activity", [Query(f"avg({with_node('rankguard_gpu_sm_activity_ratio')})", "mean")],
             "percentunit", decimals=1, description="GPM: share of SMs busy (Hopper and newer)."),
        stat("XIDs (1h)", [Query(f"sum({with_node('increase(rankguard_gpu_xid_errors_total[1h])')})", "xids")],
             "none", thresholds=(("green", None), ("red", 1))),
        stat("Uncorrected ECC (1h)",
             [Query(with_node("sum by (instance) (increase(rankguard_gpu_ecc_errors_total{type=\"uncorrected\"}[1h]))"),
                    "{{node}}")],
             "none", thresholds=(("green", None), ("red", 1))),
    ]  # fmt: skip
    activity = [
        heatmap("GPU utilization", Query(with_node("rankguard_gpu_utilization_ratio"), GPU),
                "percentunit", description="NVML: share of time a kernel ran. One row per GPU."),
        heatmap("SM activity (GPM)", Query(with_node("rankguard_gpu_sm_activity_ratio"), GPU),
                "percentunit", description="Share of SMs busy: what utilization hides (a "
                                           "kernel on one SM reads as 100% utilization)."),
        heatmap("Tensor core activity (GPM)", Query(with_node("rankguard_gpu_tensor_activity_ratio"), GPU),
                "percentunit", description="Share of time any tensor pipe was busy."),
        timeseries("DRAM bandwidth utilization (GPM)",
                   [Query(with_node("rankguard_gpu_dram_bandwidth_utilization_ratio"), GPU)],
                   "percentunit", max_value=1),
    ]  # fmt: skip
    memory = [
        timeseries("Memory used", [Query(with_node("rankguard_gpu_memory_used_bytes"), GPU)], "bytes"),
        timeseries("Memory used (share)",
                   [Query(with_node("rankguard_gpu_memory_used_bytes / rankguard_gpu_memory_total_bytes"), GPU)],
                   "percentunit", max_value=1),
        timeseries("Temperature", [Query(with_node("rankguard_gpu_temperature_celsius"), GPU)], "celsius",
                   thresholds=(("green", None), ("orange", 80), ("red", 87))),
        timeseries("Power", [Query(with_node("rankguard_gpu_power_watts"), GPU)], "watt"),
        timeseries("SM clock", [Query(with_node("rankguard_gpu_sm_clock_hertz"), GPU)], "hertz"),
        timeseries("PCIe throughput",
                   [Query(with_node("rankguard_gpu_pcie_transmit_bytes_per_second"), GPU + " tx"),
                    Query(with_node("rankguard_gpu_pcie_receive_bytes_per_second"), GPU + " rx")],
                   "Bps"),
    ]  # fmt: skip
    errors = [
        timeseries("GPUs held down, by throttle reason",
                   [Query(f"sum by (reason) ({with_node(THROTTLED)})", "{{reason}}")],
                   "none", width=8, stacked=True,
                   description="GPUs whose clocks a power or thermal reason holds down."),
        timeseries("XID errors (5m)",
                   [Query(with_node("sum by (instance, gpu, xid) (increase(rankguard_gpu_xid_errors_total[5m]))"),
                          "{{node}} gpu {{gpu}} xid {{xid}}")],
                   "none", width=8, bars=True,
                   description="Critical errors by XID code; 48, 63, 64, 74, 79, 92, 94, 95, 119, "
                               "120 make the node unhealthy."),
        timeseries("ECC errors (5m)",
                   [Query(with_node("sum by (instance, gpu, type) (increase(rankguard_gpu_ecc_errors_total[5m]))"),
                          "{{node}} gpu {{gpu}} {{type}}")],
                   "none", width=8, bars=True,
                   description="Volatile ECC counts (since driver load); uncorrected (double-bit) "
                               "errors are critical."),
    ]  # fmt: skip
    return dashboard(
        UID,
        "rankguard / GPUs",
        "Per node and GPU: activity, memory, temperature, power, throttling and errors.",
        [top, activity, memory, errors],
    )
