"""`promtool test rules` unit tests: every alert seen not firing and firing.

Each case feeds series into the rules and checks, at one time, that the alert is silent
(the condition does not hold yet, or not for long enough) and, later, that it fires for
exactly the bad series (a healthy peer in the same case must not fire) with the labels
and the summary an operator reads. The expectations are written out by hand here, not
derived from the rules, so a changed rule that breaks its meaning fails the test.
`test_file()` is written next to the rules as `rankguard-rules.test.yml`.
"""

from __future__ import annotations

from .rules import Targets, alerting_rules, runbook_url

AGENT = {"job": "rankguard-agent", "instance": "n1:9407"}
AGENT2 = {"job": "rankguard-agent", "instance": "n2:9407"}
SUP = {"job": "rankguard-supervisor", "instance": "head:9408"}
SUP2 = {"job": "rankguard-supervisor", "instance": "head2:9408"}  # the pair's standby
GPU0 = {"gpu": "0", "uuid": "GPU-0"}
GPU1 = {"gpu": "1", "uuid": "GPU-1"}
CKPT_FS = {"role": "checkpoint", "path": "/ckfs/ckpt", "mountpoint": "/ckfs", "fstype": "tmpfs"}


def s(name: str, labels: dict, values: str) -> dict:
    body = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{body}}}", "values": values}


def node_info(agent: dict = AGENT, node: str = "node-1", values: str = "1x120") -> dict:
    return s("rankguard_agent_info", {**agent, "node": node, "version": "0.1.0"}, values)


def alert(severity: str, summary: str, **labels: str) -> dict:
    return {"labels": {"severity": severity, **labels}, "summary": summary}


def _cases(t: Targets) -> list[dict]:
    """name, series, and per alert name a list of (eval time, [expected alerts])."""
    rank0 = {**AGENT, "training_job": "llm", "rank": "0"}
    rank1 = {**AGENT, "training_job": "llm", "rank": "1"}
    agent_rank0 = {**rank0, "node": "node-1"}
    gpu0 = {**AGENT, **GPU0, "node": "node-1"}
    gpu1 = {**AGENT, **GPU1, "node": "node-1"}

    def incident(kind: str, rank: str, values: str) -> dict:
        return s("rankguard_supervisor_incident_open",
                 {**SUP, "kind": kind, "training_job": "llm", "node": "node-1", "rank": rank}, values)  # fmt: skip

    def detected(kind: str, rank: str, values: str) -> dict:
        return s("rankguard_supervisor_incident_detected_timestamp_seconds",
                 {**SUP, "kind": kind, "training_job": "llm", "node": "node-1", "rank": rank}, values)  # fmt: skip

    return [
        {"name": "a dead rank, named by the supervisor's open incident",
         "series": [incident("rank_dead", "1", "_ _ 1 1 1"), incident("straggler", "0", "1x4")],
         "expect": {"RankDead": [("1m", []), ("3m", [alert(
             "critical", "Rank 1 of job llm died on node node-1",
             training_job="llm", node="node-1", rank="1")])]}},
        {"name": "a death whose incident closed between two scrapes, then grew old",
         # detected at 120 s, never scraped open (a warm restart resolved it first); the
         # alert holds for Targets.incident_recent_seconds after the detection
         "series": [detected("rank_dead", "1", "_ _ 120x8"), detected("rank_hung", "0", "_ _ 120x8")],
         "expect": {"RankDead": [("1m", []), ("3m", [alert(
             "critical", "Rank 1 of job llm died on node node-1",
             training_job="llm", node="node-1", rank="1")]), ("8m", [])]}},
        {"name": "a hung job, with its culprit rank",
         "series": [incident("rank_hung", "0", "_ _ 1 1 1"), incident("rank_dead", "1", "1x4")],
         "expect": {"RankHung": [("1m", []), ("3m", [alert(
             "critical", "Job llm hung; culprit rank 0 on node node-1",
             training_job="llm", node="node-1", rank="0")])]}},
        {"name": "a straggler, named by the supervisor",
         "series": [incident("straggler", "1", "_ _ 1 1 1"), incident("rank_hung", "0", "1x4")],
         "expect": {"RankStraggler": [("1m", []), ("3m", [alert(
             "warning", "Rank 1 of job llm on node node-1 is a straggler",
             training_job="llm", node="node-1", rank="1")])]}},
        {"name": "a live rank gone silent; its peer still sends",
         "series": [node_info(), s("rankguard_rank_up", rank0, "1x20"), s("rankguard_rank_up", rank1, "1x20"),
                    s("rankguard_rank_heartbeat_age_seconds", rank0, "0+60x20"),
                    s("rankguard_rank_heartbeat_age_seconds", rank1, "1x20")],
         "expect": {"RankHeartbeatMissing": [("12m", []), ("14m", [alert(
             "warning", "Rank 0 of job llm on node node-1 has sent no telemetry for 14m 0s",
             **agent_rank0)])]}},
        {"name": "one GPU underutilized while its node trains",
         "series": [node_info(), s("rankguard_rank_phase", {**rank0, "phase": "train"}, "1x60"),
                    s("rankguard_gpu_utilization_ratio", {**AGENT, **GPU0}, "0.5x60"),
                    s("rankguard_gpu_utilization_ratio", {**AGENT, **GPU1}, "0.97x60")],
         "expect": {"GpuUnderutilized": [("10m", []), ("30m", [alert(
             "warning", "GPU 0 on node node-1 is 50% utilized while training", **gpu0)])]}},
        {"name": "an idle node's GPUs are not underutilized",
         "series": [node_info(), s("rankguard_rank_phase", {**rank0, "phase": "checkpoint_save"}, "1x60"),
                    s("rankguard_gpu_utilization_ratio", {**AGENT, **GPU0}, "0x60")],
         "expect": {"GpuUnderutilized": [("30m", [])]}},
        {"name": "exposed communication over 20% of one rank's step",
         "series": [node_info(), s("rankguard_rank_up", rank0, "1x60"), s("rankguard_rank_up", rank1, "1x60"),
                    s("rankguard_rank_comm_exposed_step_ratio", rank0, "0.35x60"),
                    s("rankguard_rank_comm_exposed_step_ratio", rank1, "0.1x60")],
         "expect": {"CommunicationOverheadHigh": [("10m", []), ("30m", [alert(
             "warning", "Rank 0 of job llm on node node-1 waits 35% of its step for communication",
             **agent_rank0)])]}},
        {"name": "a well-overlapped job: much communication in flight, little exposed",
         "series": [node_info(), s("rankguard_rank_up", rank0, "1x60"),
                    s("rankguard_rank_comm_step_ratio", rank0, "0.6x60"),
                    s("rankguard_rank_comm_exposed_step_ratio", rank0, "0.03x60")],
         "expect": {"CommunicationOverheadHigh": [("30m", [])]}},
        {"name": "a data stall on one rank, named by the supervisor",
         "series": [incident("data_stall", "1", "_ _ 1 1 1"), incident("straggler", "0", "1x4")],
         "expect": {"RankDataStall": [("1m", []), ("3m", [alert(
             "warning", "Rank 1 of job llm on node node-1 stalls on data loading",
             training_job="llm", node="node-1", rank="1")])]}},
        {"name": "no data-stall incident, no data-stall alert",
         "series": [incident("straggler", "0", "1x4"), incident("rank_dead", "1", "1x4")],
         "expect": {"RankDataStall": [("3m", [])]}},
        {"name": "a data-loading stall on one rank",
         "series": [node_info(), s("rankguard_rank_up", rank0, "1x60"), s("rankguard_rank_up", rank1, "1x60"),
                    s("rankguard_rank_data_wait_ratio", rank0, "0.2x60"),
                    s("rankguard_rank_data_wait_ratio", rank1, "0x60")],
         "expect": {"DataLoadingStall": [("5m", []), ("30m", [alert(
             "warning", "Rank 0 of job llm on node node-1 waits for data 20% of its step",
             **agent_rank0)])]}},
        {"name": "a dead rank's last comm share is not an alert",
         "series": [node_info(), s("rankguard_rank_up", rank0, "0x60"),
                    s("rankguard_rank_comm_exposed_step_ratio", rank0, "0.9x60"),
                    s("rankguard_rank_data_wait_ratio", rank0, "0.9x60")],
         "expect": {"CommunicationOverheadHigh": [("30m", [])], "DataLoadingStall": [("30m", [])]}},
        {"name": "bad numerics on one rank",
         "series": [incident("bad_numerics", "1", "_ _ 1 1 1"), incident("rank_dead", "0", "1x4")],
         "expect": {"BadNumerics": [("1m", []), ("3m", [alert(
             "critical", "Job llm: non-finite or spiking loss on rank 1",
             training_job="llm", node="node-1", rank="1")])]}},
        {"name": "a node fault, named by node (not by rank)",
         "series": [incident("node_fault", "", "_ _ 1 1 1"), incident("straggler", "0", "1x4")],
         "expect": {"NodeFault": [("1m", []), ("3m", [alert(
             "critical", "Node node-1 has a hardware fault; job llm goes on without it",
             training_job="llm", node="node-1")])]}},
        {"name": "checkpoints not progressing",
         "series": [incident("checkpoint_stale", "", "_ _ 1 1 1"), incident("rank_hung", "0", "1x4")],
         "expect": {"CheckpointsNotProgressing": [("1m", []), ("3m", [alert(
             "warning", "Job llm trains far past its newest validated checkpoint", training_job="llm")])]}},
        {"name": "the supervisor lost an agent",
         "series": [s("rankguard_supervisor_incident_open",
                      {**SUP, "kind": "agent_unreachable", "training_job": "", "node": "node-2", "rank": ""},
                      "_ _ 1 1 1"),
                    incident("rank_dead", "0", "1x4")],
         "expect": {"SupervisorLostAgent": [("1m", []), ("3m", [alert(
             "warning", "The supervisor cannot reach the agent of node node-2", node="node-2")])]}},
        {"name": "NVML down on two nodes: one alert for the fleet; a healthy node is silent",
         "series": [node_info(), node_info(AGENT2, "node-2", "1x30"),
                    s("rankguard_gpu_nvml_up", AGENT, "1 1 0x28"), s("rankguard_gpu_nvml_up", AGENT2, "1x30"),
                    s("rankguard_gpu_nvml_up", {"job": "rankguard-agent", "instance": "n3:9407"}, "1 1 0x28")],
         "expect": {"NvmlDown": [("4m", []), ("10m", [alert(
             "warning", "NVML does not answer on 2 node(s): their GPUs are not watched")])]}},
        {"name": "GPUs missing: one of two on a node, all on another; a full node is silent",
         "series": [node_info(values="1x10"), node_info(AGENT2, "node-2", "1x10"),
                    node_info({"job": "rankguard-agent", "instance": "n3:9407"}, "node-3", "1x10"),
                    s("rankguard_gpus_expected", AGENT, "2x10"),
                    s("rankguard_gpu_info", {**AGENT, **GPU0, "name": "H100", "driver": "550"}, "1x10"),
                    s("rankguard_gpu_info", {**AGENT, **GPU1, "name": "H100", "driver": "550"}, "1 1 stale"),
                    s("rankguard_gpus_expected", AGENT2, "1x10"),
                    s("rankguard_gpus_expected", {"job": "rankguard-agent", "instance": "n3:9407"}, "1x10"),
                    s("rankguard_gpu_info", {"job": "rankguard-agent", "instance": "n3:9407", **GPU0,
                                             "name": "H100", "driver": "550"}, "1x10")],
         "expect": {"GpusMissing": [("1m", []), ("6m", [
             alert("critical", "Node node-1 shows 1 fewer GPUs than expected", instance="n1:9407", node="node-1"),
             alert("critical", "Node node-2 shows 1 fewer GPUs than expected", **AGENT2, node="node-2")])]}},
        {"name": "a collector failing for ten minutes; a passing one is silent",
         "series": [node_info(values="1x30"),
                    s("rankguard_collector_success", {**AGENT, "collector": "storage"}, "1 1 0x28"),
                    s("rankguard_collector_success", {**AGENT, "collector": "host"}, "1x30")],
         "expect": {"CollectorFailing": [("8m", []), ("20m", [alert(
             "warning", "The storage collector fails on node node-1", **AGENT, node="node-1", collector="storage")])]}},
        {"name": "three restarts within the window",
         "series": [s("rankguard_rank_restarts", rank0, "0 0 1 2 3 3"),
                    s("rankguard_rank_restarts", rank1, "0 0 1 2 3 3"),
                    s("rankguard_rank_restarts", {**AGENT, "training_job": "calm", "rank": "0"}, "1x5")],
         "expect": {"JobCrashLooping": [("3m", []), ("5m", [alert(
             "critical", f"Job llm restarted 3 times in {t.crash_loop_window}", training_job="llm")])]}},
        {"name": "the supervisor stopped a job (one alert from a pair)",
         "series": [s("rankguard_supervisor_job_state", {**SUP, "training_job": "llm", "state": "stopped"}, "0 0 1 1"),
                    s("rankguard_supervisor_job_state", {**SUP2, "training_job": "llm", "state": "stopped"}, "0 0 1 1"),
                    s("rankguard_supervisor_job_state", {**SUP, "training_job": "ok", "state": "stopped"}, "0x3")],
         "expect": {"JobStoppedBySupervisor": [("1m", []), ("3m", [alert(
             "critical", "The supervisor stopped job llm", training_job="llm")])]}},
        {"name": "low goodput while running (one alert from a pair); a finished job is left alone",
         "series": [s("rankguard_supervisor_goodput_ratio", {**SUP, "training_job": "llm"}, "0.5x60"),
                    s("rankguard_supervisor_goodput_ratio", {**SUP2, "training_job": "llm"}, "0.5x60"),
                    s("rankguard_supervisor_job_state", {**SUP, "training_job": "llm", "state": "running"}, "1x60"),
                    s("rankguard_supervisor_goodput_ratio", {**SUP, "training_job": "done"}, "0.5x60"),
                    s("rankguard_supervisor_job_state", {**SUP, "training_job": "done", "state": "running"}, "0x60")],
         "expect": {"GoodputLow": [("20m", []), ("40m", [alert(
             "warning", "Job llm goodput is 50%", training_job="llm")])]}},
        {"name": "a lost GPU",
         "series": [node_info(), s("rankguard_gpu_lost", {**AGENT, **GPU0}, "0x4"),
                    s("rankguard_gpu_lost", {**AGENT, **GPU1}, "0 0 1 1 1")],
         "expect": {"GpuLost": [("1m", []), ("3m", [alert(
             "critical", "GPU 1 (GPU-1) on node node-1 is lost", **gpu1)])]}},
        {"name": "XIDs: 79 is critical, 13 a warning",
         "series": [node_info(), s("rankguard_gpu_xid_errors_total", {**AGENT, **GPU0, "xid": "79"}, "0 0 1 1 1"),
                    s("rankguard_gpu_xid_errors_total", {**AGENT, **GPU1, "xid": "79"}, "0x4"),
                    s("rankguard_gpu_xid_errors_total", {**AGENT, **GPU1, "xid": "13"}, "0 0 2 2 2")],
         "expect": {
             "GpuXidCritical": [("1m", []), ("3m", [alert(
                 "critical", "XID 79 on GPU 0 of node node-1", **gpu0, xid="79")])],
             "GpuXid": [("1m", []), ("3m", [alert(
                 "warning", "XID 13 on GPU 1 of node node-1", **gpu1, xid="13")])]}},
        {"name": "double-bit ECC errors; corrected ones are not an alert",
         "series": [node_info(), s("rankguard_gpu_ecc_errors_total", {**AGENT, **GPU0, "type": "uncorrected"}, "0 0 1 1"),
                    s("rankguard_gpu_ecc_errors_total", {**AGENT, **GPU1, "type": "corrected"}, "0 0 50 90")],
         "expect": {"GpuEccDoubleBit": [("1m", []), ("3m", [alert(
             "critical", "Uncorrected (double-bit) ECC errors on GPU 0 of node node-1", **gpu0, type="uncorrected")])]}},
        {"name": "thermal throttling; an idle GPU's clocks are not throttling",
         "series": [node_info(),
                    s("rankguard_gpu_clock_event_active", {**AGENT, **GPU0, "reason": "hw_thermal_slowdown"}, "1x30"),
                    s("rankguard_gpu_clock_event_active", {**AGENT, **GPU1, "reason": "gpu_idle"}, "1x30")],
         "expect": {"GpuThrottled": [("3m", []), ("20m", [alert(
             "warning", "GPU 0 on node node-1 is throttled: hw_thermal_slowdown", **gpu0,
             reason="hw_thermal_slowdown")])]}},
        {"name": "an NVLink link down; a node whose GPUs have no NVLink in use is not alerted",
         "series": [node_info(), node_info(AGENT2, "node-2"),
                    s("rankguard_gpu_nvlink_links_up", {**AGENT, **GPU0}, "18 18 16 16 16 16 16"),
                    s("rankguard_gpu_nvlink_links_down", {**AGENT, **GPU0}, "0 0 2 2 2 2 2"),
                    s("rankguard_gpu_nvlink_links_up", {**AGENT, **GPU1}, "18x6"),
                    s("rankguard_gpu_nvlink_links_down", {**AGENT, **GPU1}, "0x6"),
                    s("rankguard_gpu_nvlink_links_up", {**AGENT2, **GPU0}, "0x6"),
                    s("rankguard_gpu_nvlink_links_down", {**AGENT2, **GPU0}, "4x6")],
         "expect": {"GpuNvlinkDown": [("2m", []), ("5m", [alert(
             "critical", "2 NVLink link(s) of GPU 0 on node node-1 down", **gpu0)])]}},
        {"name": "NVLink recoveries alert; CRC flit errors alone do not",
         "series": [node_info(),
                    s("rankguard_gpu_nvlink_errors_total", {**AGENT, **GPU0, "type": "recovery"}, "0 0 1 1 1"),
                    s("rankguard_gpu_nvlink_errors_total", {**AGENT, **GPU1, "type": "crc_flit"}, "0 0 5 5 5")],
         "expect": {"GpuNvlinkErrors": [("1m", []), ("3m", [alert(
             "warning", "NVLink recoveries on GPU 0 of node node-1", **gpu0, type="recovery")])]}},
        {"name": "a PCIe link trained to x8 of x16; a full-width peer is not alerted",
         "series": [node_info(),
                    s("rankguard_gpu_pcie_link_width_lanes", {**AGENT, **GPU0, "type": "current"}, "8x20"),
                    s("rankguard_gpu_pcie_link_width_lanes", {**AGENT, **GPU0, "type": "max"}, "16x20"),
                    s("rankguard_gpu_pcie_link_width_lanes", {**AGENT, **GPU1, "type": "current"}, "16x20"),
                    s("rankguard_gpu_pcie_link_width_lanes", {**AGENT, **GPU1, "type": "max"}, "16x20")],
         "expect": {"GpuPcieDowntrained": [("5m", []), ("15m", [alert(
             "warning", "PCIe link of GPU 0 on node node-1 runs at x8", **gpu0)])]}},
        {"name": "row remaps: one failed (critical), one pending (warning, after 10 minutes)",
         "series": [node_info(),
                    s("rankguard_gpu_remapped_rows_failure", {**AGENT, **GPU0}, "0 0 1 1 1"),
                    s("rankguard_gpu_remapped_rows_failure", {**AGENT, **GPU1}, "0x20"),
                    s("rankguard_gpu_remapped_rows_pending", {**AGENT, **GPU0}, "0x20"),
                    s("rankguard_gpu_remapped_rows_pending", {**AGENT, **GPU1}, "1x20")],
         "expect": {
             "GpuRowRemapFailed": [("1m", []), ("3m", [alert(
                 "critical", "A memory row remap failed on GPU 0 of node node-1", **gpu0)])],
             "GpuRowRemapPending": [("5m", []), ("15m", [alert(
                 "warning", "A memory row remap awaits a reset of GPU 1 on node node-1", **gpu1)])]}},
        {"name": "an InfiniBand port that was ACTIVE goes down; an unused port is not alerted",
         "series": [node_info(),
                    s("rankguard_infiniband_port_up", {**AGENT, "device": "mlx5_0", "port": "1"}, "1 1 0 0 0 0"),
                    s("rankguard_infiniband_port_up", {**AGENT, "device": "mlx5_1", "port": "1"}, "0x5")],
         "expect": {"InfinibandPortDown": [("1m", []), ("5m", [alert(
             "critical", "InfiniBand port mlx5_0/1 on node node-1 is down",
             **AGENT, node="node-1", device="mlx5_0", port="1")])]}},
        {"name": "InfiniBand symbol errors alert; receive errors alone do not",
         "series": [node_info(),
                    s("rankguard_infiniband_errors_total", {**AGENT, "device": "mlx5_0", "port": "1", "type": "symbol_error"}, "0 0 3 3 3"),
                    s("rankguard_infiniband_errors_total", {**AGENT, "device": "mlx5_0", "port": "1", "type": "receive_errors"}, "0 0 4 4 4")],
         "expect": {"InfinibandPortErrors": [("1m", []), ("3m", [alert(
             "warning", "InfiniBand port mlx5_0/1 on node node-1: symbol_error errors",
             **AGENT, node="node-1", device="mlx5_0", port="1", type="symbol_error")])]}},
        {"name": "no new validated checkpoint for over an hour",
         "series": [s("rankguard_supervisor_checkpoint_timestamp_seconds", {**SUP, "training_job": "llm"}, "0x80"),
                    s("rankguard_supervisor_checkpoint_timestamp_seconds", {**SUP2, "training_job": "llm"}, "0x80"),
                    s("rankguard_supervisor_job_state", {**SUP, "training_job": "llm", "state": "running"}, "1x80"),
                    s("rankguard_supervisor_checkpoint_timestamp_seconds", {**SUP, "training_job": "fresh"}, "0+60x80"),
                    s("rankguard_supervisor_job_state", {**SUP, "training_job": "fresh", "state": "running"}, "1x80")],
         "expect": {"CheckpointStale": [("30m", []), ("70m", [alert(
             "warning", "Job llm has no new validated checkpoint for 1h 10m 0s", training_job="llm")])]}},
        {"name": "checkpoint filesystem nearly full (one node) and full (another, mount unknown)",
         "series": [node_info(), node_info(AGENT2, "node-2"),
                    s("rankguard_filesystem_free_ratio", {**AGENT, "role": "checkpoint"}, "0.08x20"),
                    s("rankguard_filesystem_info", {**AGENT, **CKPT_FS}, "1x20"),
                    s("rankguard_filesystem_free_ratio", {**AGENT, "role": "data"}, "0.01x20"),
                    s("rankguard_filesystem_free_ratio", {**AGENT2, "role": "checkpoint"}, "0.5 0.5 0.5 0.03x20")],
         "expect": {
             "CheckpointFilesystemNearlyFull": [("3m", []), ("10m", [
                 alert("warning", "Checkpoint filesystem /ckfs on node node-1 is 8% free", **AGENT,
                       node="node-1", **CKPT_FS),
                 alert("warning", "Checkpoint filesystem on node node-2 is 3% free", **AGENT2, node="node-2", role="checkpoint")])],
             "CheckpointFilesystemFull": [("3m", []), ("10m", [
                 alert("critical", "Checkpoint filesystem on node node-2 is 3% free", **AGENT2, node="node-2", role="checkpoint")])]}},
        {"name": "a full checkpoint filesystem, named by its mount point",
         "series": [node_info(), s("rankguard_filesystem_free_ratio", {**AGENT, "role": "checkpoint"}, "0.5 0x10"),
                    s("rankguard_filesystem_info", {**AGENT, **CKPT_FS}, "1x10")],
         "expect": {"CheckpointFilesystemFull": [("1m", []), ("3m", [alert(
             "critical", "Checkpoint filesystem /ckfs on node node-1 is 0% free", **AGENT,
             node="node-1", **CKPT_FS)])]}},
        {"name": "checkpoint backups failing for over 5 minutes; a single failed copy is not",
         "series": [node_info(), node_info(AGENT2, "node-2"),
                    s("rankguard_checkpoint_backup_failing", AGENT, "0 0 1x12"),
                    s("rankguard_checkpoint_backup_failing", AGENT2, "0 1 1 0x10")],
         "expect": {"CheckpointBackupFailing": [("4m", []), ("10m", [alert(
             "warning", "Checkpoint backups from node node-1 are failing", **AGENT, node="node-1")])]}},
        {"name": "an agent down (named by its last node info) and one never seen",
         "series": [node_info(values="1 1 _ _ _ _ _"), s("up", AGENT, "1 1 0 0 0 0 0"),
                    node_info(AGENT2, "node-2", "1x6"), s("up", AGENT2, "1x6"),
                    s("up", {"job": "rankguard-agent", "instance": "n3:9407"}, "_ _ 0 0 0 0 0")],
         "expect": {"AgentDown": [("2m", []), ("5m", [
             alert("warning", "rankguard agent n1:9407 (node node-1) is down", **AGENT, node="node-1"),
             alert("warning", "rankguard agent n3:9407 is down", job="rankguard-agent", instance="n3:9407")])]}},
        {"name": "the supervisor down",
         "series": [s("up", SUP, "1 1 0 0 0")],
         "expect": {"SupervisorDown": [("2m", []), ("4m", [alert(
             "warning", "rankguard supervisor head:9408 is down", **SUP)])]}},
        {"name": "no supervisor scraped at all",
         "series": [s("up", AGENT, "1x4")],
         "expect": {"SupervisorDown": [("0m", []), ("3m", [alert(
             "warning", "rankguard supervisor is down", job="rankguard-supervisor")])]}},
    ]  # fmt: skip


# Recording rules checked with literal inputs and outputs.
def _record_cases() -> list[dict]:
    r = {**AGENT, "training_job": "llm"}
    compute = "rankguard_rank_step_phase_seconds_total"
    return [
        {"name": "straggler score: compute per step over the job's median; dead ranks left out",
         "interval": "15s",
         "series": [s("rankguard_rank_up", {**r, "rank": str(i)}, "1x12" if i < 3 else "0x12") for i in range(4)]
                   + [s("rankguard_rank_steps_total", {**r, "rank": str(i)}, "0+10x12") for i in range(4)]
                   + [s(compute, {**r, "rank": "0", "phase": "compute"}, "0+5x12"),
                      s(compute, {**r, "rank": "1", "phase": "compute"}, "0+5x12"),
                      s(compute, {**r, "rank": "2", "phase": "compute"}, "0+7.5x12"),
                      s(compute, {**r, "rank": "3", "phase": "compute"}, "0+90x12")],
         "promql": [("2m", "rankguard:rank_straggler_score:ratio",
                     [({**r, "rank": "0"}, 1), ({**r, "rank": "1"}, 1), ({**r, "rank": "2"}, 1.5)])]},
        # Counters for rates: rank 0 runs at 1,000 tokens/s and restarts at 75 s (its
        # counters reset: rate() carries on), rank 1 is dead (left out), rank 2 is alive
        # but stalled (flat counters: 0, silent rather than its last step's rate).
        {"name": "tokens/s, step time and MFU from counters; a reset, a dead and a stalled rank",
         "interval": "15s",
         "series": [node_info(values="1x12"),
                    s("rankguard_rank_up", {**r, "rank": "0"}, "1x12"),
                    s("rankguard_rank_up", {**r, "rank": "1"}, "0x12"),
                    s("rankguard_rank_up", {**r, "rank": "2"}, "1x12"),
                    s("rankguard_rank_tokens_total", {**r, "rank": "0"}, "0+15000x4 15000+15000x6"),
                    s("rankguard_rank_tokens_total", {**r, "rank": "1"}, "0+75x10"),
                    s("rankguard_rank_tokens_total", {**r, "rank": "2"}, "5000x10"),
                    s("rankguard_rank_step_seconds_sum", {**r, "rank": "0"}, "0+15x10"),
                    s("rankguard_rank_step_seconds_count", {**r, "rank": "0"}, "0+10x10"),
                    s("rankguard_rank_flops_total", {**r, "rank": "0"}, "0+6e12x10"),
                    s("rankguard_rank_flops_total", {**r, "rank": "2"}, "6e12x10"),
                    s("rankguard_rank_peak_flops", {**r, "rank": "0"}, "1e12x10"),
                    s("rankguard_rank_peak_flops", {**r, "rank": "2"}, "1e12x10")],
         "promql": [("2m", "rankguard:rank_tokens_per_second:rate1m",
                     [({**r, "rank": "0"}, 1000), ({**r, "rank": "2"}, 0)]),
                    ("2m", "rankguard:job_tokens_per_second:sum", [({"training_job": "llm"}, 1000)]),
                    ("2m", "rankguard:job_tokens_per_second_per_gpu:avg", [({"training_job": "llm"}, 500)]),
                    ("2m", "rankguard:rank_step_seconds:mean1m", [({**r, "rank": "0"}, 1.5)]),
                    ("2m", "rankguard:rank_mfu:ratio1m", [({**r, "rank": "0"}, 0.4), ({**r, "rank": "2"}, 0)]),
                    ("2m", "rankguard:job_mfu:ratio", [({"training_job": "llm"}, 0.2)]),
                    ("2m", "rankguard:agent_node:info", [({"instance": "n1:9407", "node": "node-1"}, 1)])]},
        # Silent: before two samples there is no rate, so no series at all (not a 0).
        {"name": "rates are silent until a counter has two samples",
         "interval": "15s",
         "series": [s("rankguard_rank_up", {**r, "rank": "0"}, "1x4"),
                    s("rankguard_rank_tokens_total", {**r, "rank": "0"}, "_x2 100 200")],
         "promql": [("15s", "rankguard:rank_tokens_per_second:rate1m", []),
                    ("15s", "rankguard:job_tokens_per_second:sum", [])]},
    ]  # fmt: skip


def covered_alerts(targets: Targets | None = None) -> dict[str, dict[str, int]]:
    """Per alert name: how many evaluations expect it silent and how many expect it firing."""
    out: dict[str, dict[str, int]] = {}
    for case in _cases(targets or Targets()):
        for name, evals in case["expect"].items():
            seen = out.setdefault(name, {"silent": 0, "firing": 0})
            for _, alerts in evals:
                seen["firing" if alerts else "silent"] += 1
    return out


def promtool_tests(rules_file: str, targets: Targets | None = None) -> dict:
    t = targets or Targets()
    descriptions = {a.name: a.description for a in alerting_rules(t)}
    tests = []
    for case in _cases(t):
        tests.append({
            "name": case["name"],
            "interval": "1m",
            "input_series": case["series"],
            "alert_rule_test": [
                {"eval_time": at, "alertname": name, "exp_alerts": [
                    {"exp_labels": a["labels"],
                     "exp_annotations": {"summary": a["summary"], "description": descriptions[name],
                                         "runbook_url": runbook_url(name)}}
                    for a in alerts]}
                for name, evals in case["expect"].items() for at, alerts in evals
            ],
        })  # fmt: skip
    for case in _record_cases():
        tests.append({
            "name": case["name"],
            "interval": case.get("interval", "1m"),
            "input_series": case["series"],
            "promql_expr_test": [
                {"expr": expr, "eval_time": at, "exp_samples": [
                    {"labels": _selector(expr, labels), "value": value} for labels, value in samples]}
                for at, expr, samples in case["promql"]
            ],
        })  # fmt: skip
    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}


def _selector(name: str, labels: dict) -> str:
    body = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{body}}}"
