"""Prometheus recording and alerting rules, as data.

The alert thresholds default to the operating targets of large training runs (GPU
utilization above 90% while training, communication under 20% of step time, data wait
near zero); `Targets` changes them. Pure: `rule_file()` returns the structure that
`yamlout.dump` writes as `rankguard-rules.yml`.

Who names what: agent series name the node through `rankguard:agent_node:info` (joined on
`instance`), and the rank through their `training_job`/`rank` labels; the supervisor's
`rankguard_supervisor_incident_open` names the job, node and rank of each open incident
(and `..._incident_detected_timestamp_seconds` of each recent one, for incidents a restart
closes before a scrape sees them open), so alerts about dead, hung or straggling ranks
follow the supervisor's detectors (adaptive, one incident per fault: torchrun tearing the
other ranks down is not an alert storm).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..contract.xids import hardware_codes
from .common import AGENT_JOB, SUPERVISOR_JOB, live

NODE_INFO = "rankguard:agent_node:info"
# XIDs that make the agent call a node unhealthy (their meaning takes the node out of the
# job: contract/xids.py); others are warnings.
CRITICAL_XIDS = hardware_codes()
THROTTLE_REASONS = "sw_power_cap|hw_slowdown|sw_thermal_slowdown|hw_thermal_slowdown|hw_power_brake"
RUNNING = 'rankguard_supervisor_job_state{state=~"running|recovering"} == 1'
# Every alert links its runbook: the alert's own section of docs/operations.md, whose
# heading is the alert's name (so its anchor is the name in lower case). Serving the docs
# site elsewhere: point this at the site's operations page.
RUNBOOK_BASE = "docs/operations.md"


def runbook_url(alert: str, base: str = RUNBOOK_BASE) -> str:
    return f"{base}#{alert.lower()}"


@dataclass(frozen=True)
class Targets:
    """Alert thresholds. Ratios are 0..1."""

    gpu_utilization_min: float = 0.90
    comm_step_ratio_max: float = 0.20  # of exposed communication (the step blocked on it)
    comm_window: str = "10m"  # averaged over; a live test shortens both
    comm_for: str = "15m"
    data_wait_ratio_max: float = 0.05  # "near zero"
    goodput_min: float = 0.90
    checkpoint_max_age_seconds: int = 3600
    crash_loop_restarts: int = 3
    crash_loop_window: str = "30m"
    heartbeat_max_seconds: int = 600  # a backstop: the supervisor judges hangs in seconds
    filesystem_free_warning: float = 0.10  # the agent's degraded / unhealthy thresholds
    filesystem_free_critical: float = 0.05
    throttled_share: float = 0.5  # of the last 10 minutes
    # a restart-resolved incident (death, hang, bad numerics) alerts this long after its
    # detection even when it closed before any scrape saw it open (at most the 900 s for
    # which the supervisor exports detection times: supervisor/views.py)
    incident_recent_seconds: int = 300


@dataclass(frozen=True)
class Record:
    name: str
    expr: str


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    severity: str  # warning | critical
    summary: str  # a template naming the node, GPU or rank
    description: str  # static text: what it means and what to do
    for_: str = "0m"


def named_node(expr: str) -> str:
    """Give agent series a `node` label (the recording rule below)."""
    return f"({expr}) * on (instance) group_left (node) {NODE_INFO}"


FS_INFO = "rankguard_filesystem_info"
MOUNT = "{{ with $labels.mountpoint }}{{ . }} {{ end }}"  # "" when the mount is unknown


def named_mount(expr: str) -> str:
    """Give filesystem series the `mountpoint`, `fstype` and `path` of the agent's
    `rankguard_filesystem_info`, so an alert names the filesystem to free; without that
    series (an agent that could not read its mounts) the alert still fires, unnamed."""
    named = f"({expr}) * on (instance, role) group_left (mountpoint, fstype, path) {FS_INFO}"
    return f"{named} or on (instance, role) {expr}"


# -- counters for rates (issue 16): the agent counts every timed step, and these rules
# turn the counters into means over RATE_WINDOW. A last-step gauge sampled every 15 s
# saw one step in hundreds.
RATE_WINDOW = "1m"


def rate(counter: str, window: str = RATE_WINDOW) -> str:
    return f"rate({counter}[{window}])"


def rank_rate_rules() -> list[Record]:
    """Per-rank and per-job throughput, step time and MFU from the agent's counters."""
    tokens = live(rate("rankguard_rank_tokens_total"))
    flops = live(rate("rankguard_rank_flops_total"))
    peak = live("rankguard_rank_peak_flops")
    return [
        Record("rankguard:rank_tokens_per_second:rate1m", tokens),
        Record("rankguard:rank_step_seconds:mean1m",
               live(f"{rate('rankguard_rank_step_seconds_sum')} / "
                    f"{rate('rankguard_rank_step_seconds_count')}")),
        # FLOPs done over the device's peak: the MFU of the whole window, idle time included
        Record("rankguard:rank_mfu:ratio1m", f"{flops} / {peak}"),
        Record("rankguard:job_tokens_per_second:sum", f"sum by (training_job) ({tokens})"),
        Record("rankguard:job_tokens_per_second_per_gpu:avg", f"avg by (training_job) ({tokens})"),
        Record("rankguard:job_mfu:ratio",
               f"sum by (training_job) ({flops}) / sum by (training_job) ({peak})"),
    ]  # fmt: skip


def recording_rules() -> list[Record]:
    # mean compute time per step over 2 minutes, from the counters
    compute = (
        'sum without (phase) (rate(rankguard_rank_step_phase_seconds_total{phase="compute"}[2m]))'
        " / rate(rankguard_rank_steps_total[2m])"
    )
    return [
        # One series per agent naming its node: every per-node panel and alert joins on it.
        Record(NODE_INFO, "max by (instance, node) (rankguard_agent_info)"),
        *rank_rate_rules(),
        Record("rankguard:job_comm_step_ratio:max",
               f"max by (training_job) ({live('rankguard_rank_comm_step_ratio')})"),
        Record("rankguard:job_data_wait_ratio:max",
               f"max by (training_job) ({live('rankguard_rank_data_wait_ratio')})"),
        # A rank's mean compute time against its job's median rank: 1 is typical, a
        # straggler is above (its peers wait for it in communication instead).
        Record("rankguard:rank_straggler_score:ratio",
               f"{live(compute)} / on (training_job) group_left () "
               f"quantile by (training_job) (0.5, {live(compute)})"),
    ]  # fmt: skip


def incident(kind: str, by: str = "training_job, node, rank", recent_seconds: int = 0) -> str:
    """An open supervisor incident of `kind`, one series per what it names; with
    `recent_seconds`, also one detected that recently: a restart closes a death's or a
    hang's incident within about a second, mostly between two scrapes."""
    open_ = f'max by ({by}) (rankguard_supervisor_incident_open{{kind="{kind}"}}) > 0'
    if not recent_seconds:
        return open_
    detected = f'rankguard_supervisor_incident_detected_timestamp_seconds{{kind="{kind}"}}'
    return f"{open_} or min by ({by}) (time() - {detected}) < {recent_seconds}"


def alerting_rules(t: Targets | None = None) -> list[Alert]:
    t = t or Targets()
    xids = "|".join(str(x) for x in CRITICAL_XIDS)
    pct = lambda x: f"{x * 100:g}%"  # noqa: E731
    return [
        Alert("RankDead",
              incident("rank_dead", recent_seconds=t.incident_recent_seconds),
              "critical", "Rank {{ $labels.rank }} of job {{ $labels.training_job }} died on node {{ $labels.node }}",
              "A training rank's process exited. torchrun restarts the worker group from the "
              "newest validated checkpoint; the incident closes at the first step after the "
              "restart. Details: `rankguard incidents`."),
        Alert("RankHung",
              incident("rank_hung", recent_seconds=t.incident_recent_seconds),
              "critical", "Job {{ $labels.training_job }} hung; culprit rank {{ $labels.rank }} on node {{ $labels.node }}",
              "Every live rank is past its phase budget. The supervisor captures the culprit's "
              "stacks and ends it so the job restarts; see `rankguard incidents` for the stacks."),
        Alert("RankHeartbeatMissing",
              named_node(f"rankguard_rank_heartbeat_age_seconds > {t.heartbeat_max_seconds} "
                         "and on (instance, training_job, rank) rankguard_rank_up == 1"),
              "warning", "Rank {{ $labels.rank }} of job {{ $labels.training_job }} on node {{ $labels.node }} "
                         "has sent no telemetry for {{ $value | humanizeDuration }}",
              f"The rank's process lives but has been silent for over {t.heartbeat_max_seconds} s: "
              "hung, or its telemetry is lost. The supervisor judges hangs faster; this is the "
              "backstop for when it is not running.", "2m"),
        Alert("GpuUnderutilized",
              named_node(f"avg_over_time(rankguard_gpu_utilization_ratio[10m]) < {t.gpu_utilization_min} "
                         'and on (instance) (max by (instance) (rankguard_rank_phase{phase="train"}) == 1)'),
              "warning", "GPU {{ $labels.gpu }} on node {{ $labels.node }} is {{ $value | humanizePercentage }} "
                         "utilized while training",
              f"Mean GPU utilization over 10 minutes is under the {pct(t.gpu_utilization_min)} target "
              "while ranks on the node train: input pipeline, communication or a too-small batch.",
              "15m"),
        # Exposed communication (the step blocked on it), not communication in flight: a
        # well-overlapped job keeps its all-reduces busy behind backward and loses nothing.
        Alert("CommunicationOverheadHigh",
              named_node(live(f"avg_over_time(rankguard_rank_comm_exposed_step_ratio[{t.comm_window}]) > {t.comm_step_ratio_max}")),
              "warning", "Rank {{ $labels.rank }} of job {{ $labels.training_job }} on node {{ $labels.node }} "
                         "waits {{ $value | humanizePercentage }} of its step for communication",
              f"Exposed communication (time the step blocked on it, not hidden behind compute) over "
              f"{pct(t.comm_step_ratio_max)} of step time for {t.comm_window}: a straggler its peers "
              "wait for, a slow link, or too little overlap.", t.comm_for),
        Alert("DataLoadingStall",
              named_node(live(f"avg_over_time(rankguard_rank_data_wait_ratio[10m]) > {t.data_wait_ratio_max}")),
              "warning", "Rank {{ $labels.rank }} of job {{ $labels.training_job }} on node {{ $labels.node }} "
                         "waits for data {{ $value | humanizePercentage }} of its step",
              f"Data wait over {pct(t.data_wait_ratio_max)} of step time (target: near zero): the "
              "loader or its storage cannot keep up.", "10m"),
        Alert("RankStraggler",
              incident("straggler"),
              "warning", "Rank {{ $labels.rank }} of job {{ $labels.training_job }} on node {{ $labels.node }} "
                         "is a straggler",
              "Its compute time stands out from its peers' and they wait for it in communication. "
              "Look at its GPU (clocks, temperature) and node."),
        # -- data stalls (issue 20): the supervisor's data_stall detector names the rank
        Alert("RankDataStall",
              incident("data_stall"),
              "warning", "Rank {{ $labels.rank }} of job {{ $labels.training_job }} on node {{ $labels.node }} "
                         "stalls on data loading",
              "Its data wait stands out from its own history and from its peers': its GPU waits "
              "for batches (a slow filesystem, a starved DataLoader worker pool). The incident "
              "names the phase and the wait; see `rankguard incidents`."),
        Alert("BadNumerics",
              incident("bad_numerics", recent_seconds=t.incident_recent_seconds),
              "critical", "Job {{ $labels.training_job }}: non-finite or spiking loss on rank {{ $labels.rank }}",
              "A NaN, an infinity or a loss spike. The supervisor restarts the job from the newest "
              "checkpoint validated before the anomaly; `rankguard incidents` names the step, the "
              "value and the checkpoint chosen. A recurrence at the same step points at the data."),
        Alert("NodeFault",
              incident("node_fault", by="training_job, node"),
              "critical", "Node {{ $labels.node }} has a hardware fault; job {{ $labels.training_job }} goes on without it",
              "An XID, a lost GPU, double-bit ECC errors or missing GPUs made the agent call the node "
              "unhealthy. The supervisor stops the job's processes there (elastic jobs go on with "
              "the rest); repair the node before it rejoins."),
        Alert("CheckpointsNotProgressing",
              incident("checkpoint_stale", by="training_job"),
              "warning", "Job {{ $labels.training_job }} trains far past its newest validated checkpoint",
              "The job's steps advanced several checkpoint intervals beyond its newest validated "
              "checkpoint: saves fail or do not validate. A crash now loses all of that work. "
              "`rankguard checkpoints verify` and the trainer's log say why."),
        Alert("SupervisorLostAgent",
              incident("agent_unreachable", by="node"),
              "warning", "The supervisor cannot reach the agent of node {{ $labels.node }}",
              "A monitoring fault, not a training fault: the supervisor cannot see or act on "
              "that node's ranks (training there goes on). Check the agent and the network "
              "between the control node and the node."),
        Alert("JobCrashLooping",
              f"max by (training_job) (max_over_time(rankguard_rank_restarts[{t.crash_loop_window}]) "
              f"- min_over_time(rankguard_rank_restarts[{t.crash_loop_window}])) >= {t.crash_loop_restarts}",
              "critical", "Job {{ $labels.training_job }} restarted {{ $value }} times in "
                          f"{t.crash_loop_window}",
              "Repeated restarts; the supervisor stops a job whose restarts make no checkpoint "
              "progress. Find the cause with `rankguard incidents`."),
        Alert("JobStoppedBySupervisor",
              'max by (training_job) (rankguard_supervisor_job_state{state="stopped"}) == 1',
              "critical", "The supervisor stopped job {{ $labels.training_job }}",
              "A crash loop or an exhausted restart budget: the verdict is in `rankguard health` "
              "and `rankguard incidents`."),
        Alert("GoodputLow",
              f"max by (training_job) (rankguard_supervisor_goodput_ratio) < {t.goodput_min} "
              f"and on (training_job) ({RUNNING})",
              "warning", "Job {{ $labels.training_job }} goodput is {{ $value | humanizePercentage }}",
              f"Productive step time is under {pct(t.goodput_min)} of wall time: restarts, "
              "replayed steps and hangs are eating the run.", "30m"),
        Alert("GpuLost",
              named_node("rankguard_gpu_lost == 1"),
              "critical", "GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on node {{ $labels.node }} is lost",
              "NVML answers GPU_IS_LOST or RESET_REQUIRED: the GPU needs a reset or the node a "
              "repair; the supervisor excludes the node."),
        Alert("GpuXidCritical",
              named_node(f'increase(rankguard_gpu_xid_errors_total{{xid=~"{xids}"}}[10m]) > 0'),
              "critical", "XID {{ $labels.xid }} on GPU {{ $labels.gpu }} of node {{ $labels.node }}",
              "An XID that takes the node out of the job: the GPU must be reset (double-bit or "
              "uncontained ECC, NVLink, GSP, a failed row remap) or the node drained (fallen "
              "off the bus)."),
        Alert("GpuXid",
              named_node(f'increase(rankguard_gpu_xid_errors_total{{xid!~"{xids}"}}[10m]) > 0'),
              "warning", "XID {{ $labels.xid }} on GPU {{ $labels.gpu }} of node {{ $labels.node }}",
              "An XID that leaves the node in the job: an application's fault (it restarts), or "
              "one to watch (a row remap recorded, a high single-bit ECC rate); repeated ones "
              "point at the GPU."),
        Alert("GpuEccDoubleBit",
              named_node('increase(rankguard_gpu_ecc_errors_total{type="uncorrected"}[10m]) > 0'),
              "critical", "Uncorrected (double-bit) ECC errors on GPU {{ $labels.gpu }} of node {{ $labels.node }}",
              "Memory returned data it could not correct: the job's results on this GPU are suspect."),
        Alert("GpuThrottled",
              named_node(f'avg_over_time(rankguard_gpu_clock_event_active{{reason=~"{THROTTLE_REASONS}"}}[10m]) '
                         f"> {t.throttled_share}"),
              "warning", "GPU {{ $labels.gpu }} on node {{ $labels.node }} is throttled: {{ $labels.reason }}",
              f"A thermal or power reason held the clocks down over {pct(t.throttled_share)} of the "
              "last 10 minutes: check cooling and power capping.", "5m"),
        Alert("GpuNvlinkDown",
              # a link down where the node's GPUs use NVLink (a PCIe card's links are all off)
              named_node("rankguard_gpu_nvlink_links_down > 0 and on (instance) "
                         "(max by (instance) (rankguard_gpu_nvlink_links_up) > 0)"),
              "critical", "{{ $value }} NVLink link(s) of GPU {{ $labels.gpu }} on node {{ $labels.node }} down",
              "An NVLink link of a GPU whose node uses NVLink is down: collectives over it "
              "fail or fall back to slower paths. The agent calls the node unhealthy; the GPU "
              "needs a reset or the node a repair.", "2m"),
        Alert("GpuNvlinkErrors",
              named_node('increase(rankguard_gpu_nvlink_errors_total{type="recovery"}[10m]) > 0'),
              "warning", "NVLink recoveries on GPU {{ $labels.gpu }} of node {{ $labels.node }}",
              "An NVLink link of this GPU retrained after repeated errors in the last 10 "
              "minutes: a failing link, cable or NVSwitch port, often before XID 74."),
        Alert("GpuPcieDowntrained",
              named_node('rankguard_gpu_pcie_link_width_lanes{type="current"} '
                         '< ignoring (type) rankguard_gpu_pcie_link_width_lanes{type="max"}'),
              "warning", "PCIe link of GPU {{ $labels.gpu }} on node {{ $labels.node }} runs at x{{ $value }}",
              "The GPU's PCIe link trained to fewer lanes than it has: host-GPU copies, "
              "checkpoints and GPUDirect traffic run slower. Reseat or repair at the next "
              "maintenance.", "10m"),
        Alert("GpuRowRemapFailed",
              named_node("rankguard_gpu_remapped_rows_failure == 1"),
              "critical", "A memory row remap failed on GPU {{ $labels.gpu }} of node {{ $labels.node }}",
              "The GPU had no spare row left for a failing memory row: its memory cannot be "
              "repaired and the GPU must be replaced. The agent calls the node unhealthy."),
        Alert("GpuRowRemapPending",
              named_node("rankguard_gpu_remapped_rows_pending == 1"),
              "warning", "A memory row remap awaits a reset of GPU {{ $labels.gpu }} on node {{ $labels.node }}",
              "A failing memory row was marked for remapping, which takes effect at the next "
              "GPU reset: drain the node at a checkpoint boundary and reset the GPU.", "10m"),
        Alert("InfinibandPortDown",
              # a port that was ACTIVE in the last hour: an unused, uncabled port never fires
              named_node("rankguard_infiniband_port_up == 0 and on (instance, device, port) "
                         "max_over_time(rankguard_infiniband_port_up[1h]) == 1"),
              "critical", "InfiniBand port {{ $labels.device }}/{{ $labels.port }} on node {{ $labels.node }} is down",
              "A port that was ACTIVE is not: NCCL's inter-node traffic over it fails. Check "
              "the cable, the switch port and `ibstat`; the agent calls the node unhealthy.", "1m"),
        Alert("InfinibandPortErrors",
              named_node('increase(rankguard_infiniband_errors_total{type=~"symbol_error|link_downed|'
                         'link_error_recovery"}[10m]) > 0'),
              "warning", "InfiniBand port {{ $labels.device }}/{{ $labels.port }} on node "
                         "{{ $labels.node }}: {{ $labels.type }} errors",
              "Physical-layer errors or link drops on the port in the last 10 minutes: a "
              "failing cable, transceiver or switch port. Repeated ones slow or break NCCL."),
        Alert("CheckpointStale",
              f"time() - max by (training_job) (rankguard_supervisor_checkpoint_timestamp_seconds) "
              f"> {t.checkpoint_max_age_seconds} "
              f"and on (training_job) ({RUNNING})",
              "warning", "Job {{ $labels.training_job }} has no new validated checkpoint for "
                         "{{ $value | humanizeDuration }}",
              f"No newer validated checkpoint for over {t.checkpoint_max_age_seconds} s: a crash now "
              "loses that much work. Check the trainer's checkpoint log and storage."),
        Alert("CheckpointFilesystemNearlyFull",
              named_mount(named_node(f'rankguard_filesystem_free_ratio{{role="checkpoint"}} < {t.filesystem_free_warning}')),
              "warning", f"Checkpoint filesystem {MOUNT}on node {{{{ $labels.node }}}} is "
                         "{{ $value | humanizePercentage }} free",
              f"Under {pct(t.filesystem_free_warning)} free: saves will fail soon. Retention keeps "
              "the newest validated checkpoint; free space or move older ones.", "5m"),
        Alert("CheckpointFilesystemFull",
              named_mount(named_node(f'rankguard_filesystem_free_ratio{{role="checkpoint"}} < {t.filesystem_free_critical}')),
              "critical", f"Checkpoint filesystem {MOUNT}on node {{{{ $labels.node }}}} is "
                          "{{ $value | humanizePercentage }} free",
              f"Under {pct(t.filesystem_free_critical)} free: checkpoint saves are failing or about to "
              "(training goes on; the failed saves stay .partial and are quarantined later). Free "
              "space on this filesystem: saves validate again by themselves.", "1m"),
        Alert("CheckpointBackupFailing",
              named_node("rankguard_checkpoint_backup_failing == 1"),
              "warning", "Checkpoint backups from node {{ $labels.node }} are failing",
              "The trainer's copies of validated checkpoints to the backup tier (--ckpt-backup) "
              "fail: the target is full, unreachable or returns bad data. Training and the disk "
              "tier are unaffected, but a lost checkpoint filesystem would now lose the run. "
              "`rankguard checkpoints list CKPT_DIR` shows the last error.", "5m"),
        Alert("NvmlDown",
              # one alert for the fleet: a driver upgrade or a sandboxed agent blinds many
              # nodes at once, and the cause is the agents', not the GPUs' (never a drain)
              "count(rankguard_gpu_nvml_up == 0) > 0",
              "warning", "NVML does not answer on {{ $value }} node(s): their GPUs are not watched",
              "The agents cannot read the GPUs (driver not loaded, NVML library missing or a "
              "driver/library mismatch): the agents' fault, not the GPUs', so no node is "
              "excluded for it. They retry by themselves; `rankguard health` names the nodes "
              "and the reason. On a node without GPUs, turn the gpu collector off in the "
              "agent's config.", "5m"),
        Alert("GpusMissing",
              named_node("rankguard_gpus_expected - on (instance) count by (instance) (rankguard_gpu_info) > 0 "
                         "or on (instance) (rankguard_gpus_expected > 0 unless on (instance) rankguard_gpu_info)"),
              "critical", "Node {{ $labels.node }} shows {{ $value }} fewer GPUs than expected",
              "Fewer GPUs answer than the agent's `expected_gpus`: a GPU fell off the bus or "
              "the driver lost it. The agent calls the node unhealthy.", "2m"),
        Alert("CollectorFailing",
              named_node("rankguard_collector_success == 0"),
              "warning", "The {{ $labels.collector }} collector fails on node {{ $labels.node }}",
              "One of the agent's collectors has failed for 10 minutes: its figures are missing "
              "from the dashboards and the node verdict. The agent's log (journalctl -u "
              "rankguard-agent -p warning) says why.", "10m"),
        Alert("AgentDown",
              f'(up{{job="{AGENT_JOB}"}} == 0) * on (instance) group_left (node) '
              f"topk by (instance) (1, last_over_time({NODE_INFO}[1d])) "
              f'or on (instance) up{{job="{AGENT_JOB}"}} == 0',
              "warning", "rankguard agent {{ $labels.instance }}{{ with $labels.node }} (node {{ . }}){{ end }} is down",
              "Prometheus cannot scrape the node's agent: no GPU, rank or storage data from it. "
              "A monitoring fault: training goes on. `systemctl status rankguard-agent`.", "1m"),
        Alert("SupervisorDown",
              f'up{{job="{SUPERVISOR_JOB}"}} == 0 or absent(up{{job="{SUPERVISOR_JOB}"}})',
              "warning", "rankguard supervisor {{ with $labels.instance }}{{ . }} {{ end }}is down",
              "No supervisor: dead, hung and slow ranks are not detected or recovered by rankguard "
              "(torchrun still restarts dead workers).", "1m"),
    ]  # fmt: skip


def rule_file(t: Targets | None = None) -> dict:
    """The rule file's structure (groups of rules) for `yamlout.dump`."""
    return {
        "groups": [
            {
                "name": "rankguard.records",
                "rules": [{"record": r.name, "expr": r.expr} for r in recording_rules()],
            },
            {
                "name": "rankguard.alerts",
                "rules": [
                    {
                        "alert": a.name,
                        "expr": a.expr,
                        "for": a.for_,
                        "labels": {"severity": a.severity},
                        "annotations": {
                            "summary": a.summary,
                            "description": a.description,
                            "runbook_url": runbook_url(a.name),
                        },
                    }
                    for a in alerting_rules(t)
                ],
            },
        ]
    }
