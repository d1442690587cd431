"""Storage and network: block devices, checkpoint writes and the time training blocks on
them, free space of the checkpoint and data filesystems, NIC and InfiniBand throughput."""

from __future__ import annotations

from .common import JOB, Query, dashboard, stat, timeseries, with_node

UID = "rankguard-storage-network"
RATE = "$__rate_interval"


def _rate(name: str, labels: str = "") -> str:
    return with_node(f"rate({name}{labels}[{RATE}])")


def build():
    top = [
        stat("Checkpoint filesystem free",
             [Query(with_node('rankguard_filesystem_free_ratio{role="checkpoint"}'), "{{node}}")],
             "percentunit", decimals=1, width=6,
             thresholds=(("red", None), ("orange", 0.05), ("green", 0.10)),
             description="Free share of the filesystem holding the checkpoint directory; the "
                         "node is degraded under 10%, unhealthy under 5%."),
        stat("Checkpoint blocking (max, last step)",
             [Query(f'max by (training_job) (rankguard_rank_phase_seconds{{{JOB}, phase="checkpoint_block"}})',
                    "{{training_job}}")],
             "s", width=6, description="Time the training loop waited for checkpoint staging."),
        stat("Disk busy (max)", [Query(f"max({_rate('rankguard_disk_io_time_seconds_total')})", "busy")],
             "percentunit", decimals=1, width=6),
        stat("InfiniBand ports down",
             [Query(f"count({with_node('rankguard_infiniband_port_up == 0')}) or vector(0)", "down")],
             "none", width=6, thresholds=(("green", None), ("red", 1)),
             description="Ports not ACTIVE (0 on nodes without InfiniBand)."),
    ]  # fmt: skip
    disks = [
        timeseries("Device throughput",
                   [Query(_rate("rankguard_disk_read_bytes_total"), "{{node}} {{device}} read"),
                    Query(_rate("rankguard_disk_written_bytes_total"), "{{node}} {{device}} write")],
                   "Bps"),
        timeseries("Device busy", [Query(_rate("rankguard_disk_io_time_seconds_total"), "{{node}} {{device}}")],
                   "percentunit", max_value=1,
                   description="Share of time the device had I/O in flight."),
        timeseries("Checkpoint write throughput per rank",
                   [Query(_rate("rankguard_rank_written_bytes_total", f"{{{JOB}}}"), "{{node}} rank {{rank}}"),
                    Query(_rate("rankguard_rank_storage_written_bytes_total", f"{{{JOB}}}"),
                          "{{node}} rank {{rank}} (to the block layer)")],
                   "Bps",
                   description="What each rank's process writes: checkpoint shards, mostly. The "
                               "first series counts write() calls (network filesystems included), "
                               "the second what reached local block devices."),
        timeseries("Checkpoint blocking time per rank",
                   [Query(with_node(f'rankguard_rank_phase_seconds{{{JOB}, phase="checkpoint_block"}}'),
                          "{{node}} rank {{rank}}")],
                   "s", description="Training blocks only to stage tensors; the write is async."),
    ]  # fmt: skip
    space = [
        timeseries("Filesystem free space",
                   [Query(with_node("rankguard_filesystem_free_bytes"), "{{node}} {{role}}")], "bytes"),
        timeseries("Filesystem free share",
                   [Query(with_node("rankguard_filesystem_free_ratio"), "{{node}} {{role}}")],
                   "percentunit", max_value=1, thresholds=(("red", None), ("orange", 0.05), ("green", 0.10))),
    ]  # fmt: skip
    network = [
        timeseries("NIC throughput",
                   [Query(_rate("rankguard_network_receive_bytes_total"), "{{node}} {{device}} rx"),
                    Query(_rate("rankguard_network_transmit_bytes_total"), "{{node}} {{device}} tx")],
                   "Bps"),
        timeseries("NIC errors and drops",
                   [Query(_rate("rankguard_network_receive_errors_total"), "{{node}} {{device}} rx errors"),
                    Query(_rate("rankguard_network_transmit_errors_total"), "{{node}} {{device}} tx errors"),
                    Query(_rate("rankguard_network_receive_drops_total"), "{{node}} {{device}} rx drops"),
                    Query(_rate("rankguard_network_transmit_drops_total"), "{{node}} {{device}} tx drops")],
                   "pps"),
        timeseries("InfiniBand throughput",
                   [Query(_rate("rankguard_infiniband_receive_bytes_total"), "{{node}} {{device}}:{{port}} rx"),
                    Query(_rate("rankguard_infiniband_transmit_bytes_total"), "{{node}} {{device}}:{{port}} tx")],
                   "Bps", description="The fabric NCCL uses between nodes."),
        timeseries("InfiniBand link rate",
                   [Query(with_node("rankguard_infiniband_rate_bytes_per_second"), "{{node}} {{device}}:{{port}}")],
                   "Bps"),
    ]  # fmt: skip
    return dashboard(
        UID,
        "rankguard / Storage and network",
        "Block devices, checkpoint writes and blocking, filesystem space, NIC and InfiniBand.",
        [top, disks, space, network],
    )
