"""Cluster overview: is the job training, how well, what went wrong and how fast we
recovered, how old the newest validated checkpoint is, and whether the fleet is whole."""

from __future__ import annotations

from .common import (
    AGENT_JOB,
    JOB,
    NODE_INFO,
    SUPERVISOR_JOB,
    TOKENS_PER_SECOND,
    Query,
    dashboard,
    stat,
    table,
    timeseries,
    with_node,
)

UID = "rankguard-overview"


def _over_range(name: str) -> str:
    """A by-cause counter's increase over the dashboard's range, largest first."""
    return f"sort_desc(sum by (cause) (increase({name}[$__range])))"


def _mean_time(name: str) -> str:
    """Mean of a supervisor time histogram per incident kind over the last hour (kinds with
    no incident in it are dropped, not shown as NaN): a recent regression shows, where a
    mean since the supervisor started would bury it."""
    return (f"sum by (kind) (increase({name}_sum[1h])) "
            f"/ (sum by (kind) (increase({name}_count[1h])) > 0)")  # fmt: skip


def _agents(up: str) -> str:
    """Agent targets on the nodes $node selects, each named by its last known node (an
    agent down now still counts under the node it last reported)."""
    return (f'{up} * on (instance) group_left (node) '
            f"topk by (instance) (1, last_over_time({NODE_INFO}[1d]))")  # fmt: skip


AGENTS_UP = f'up{{job="{AGENT_JOB}"}}'


def build():
    job_rows = [
        stat("Job state", [Query(f"max by (training_job, state) (rankguard_supervisor_job_state{{{JOB}}}) == 1",
                                 "{{training_job}}: {{state}}", instant=True)],
             "none", text_mode="name", width=5,
             description="The supervisor's view: running, recovering, finished or stopped "
                         "(stopped = it ended a crash loop; see `rankguard incidents`)."),
        stat("Goodput", [Query(f"rankguard_supervisor_goodput_ratio{{{JOB}}}", "{{training_job}}")],
             "percentunit", width=4, decimals=1,
             thresholds=(("red", None), ("orange", 0.8), ("green", 0.9)),
             description="Productive step time over wall time since the supervisor first saw "
                         "the job (replayed steps after a restart do not count)."),
        stat("Tokens/s per GPU", [Query(f"rankguard:job_tokens_per_second_per_gpu:avg{{{JOB}}}",
                                        "{{training_job}}")],
             TOKENS_PER_SECOND, width=5,
             description="rate() of the token counters over 1m, mean over live ranks (one per GPU)."),
        stat("MFU", [Query(f"rankguard:job_mfu:ratio{{{JOB}}}", "{{training_job}}")],
             "percentunit", width=4, decimals=1,
             description="FLOPs the live ranks did over 1m over their devices' peak FLOP/s."),
        stat("Newest validated checkpoint", [Query(f"rankguard_supervisor_checkpoint_step{{{JOB}}}",
                                                   "{{training_job}}")],
             "none", width=3, description="Step of the newest checkpoint whose manifest validated."),
        stat("Checkpoint age", [Query(f"time() - rankguard_supervisor_checkpoint_timestamp_seconds{{{JOB}}}",
                                      "{{training_job}}")],
             "s", width=3, thresholds=(("green", None), ("orange", 1800), ("red", 3600)),
             description="Since the supervisor saw the newest validated checkpoint appear (or the "
                         "job start, while it has none)."),
    ]  # fmt: skip
    fleet_rows = [
        stat("Nodes healthy", [Query(f"sum(rankguard_node_health{{status=\"healthy\"}} * on (instance) group_left {NODE_INFO})",
                                     "healthy")],
             "none", width=4, description="Agents whose node verdict is healthy."),
        stat("Nodes expected", [Query(f"count({_agents(AGENTS_UP)})", "agents")],
             "none", width=4,
             description="Agent targets Prometheus discovers (file_sd) on the selected nodes."),
        stat("GPUs healthy", [Query(f"count({with_node('rankguard_gpu_lost == 0')})", "healthy")],
             "none", width=4, description="GPUs NVML reports and that answer (not lost)."),
        stat("GPUs expected", [Query(f"sum({with_node('rankguard_gpus_expected')}) or sum({with_node('rankguard_gpus')})",
                                     "expected")],
             "none", width=4,
             description="Sum of the agents' --expected-gpus; where no agent sets it, the GPUs "
                         "NVML reports."),
        stat("Agents up", [Query(f"sum({_agents(AGENTS_UP)})", "up")], "none", width=4,
             thresholds=(("red", None), ("green", 1))),
        stat("Supervisor up", [Query(f'sum(up{{job="{SUPERVISOR_JOB}"}})', "up")], "none",
             width=4, thresholds=(("red", None), ("green", 1))),
    ]  # fmt: skip
    perf_rows = [
        timeseries("Tokens/s per GPU", [Query(f"rankguard:job_tokens_per_second_per_gpu:avg{{{JOB}}}",
                                              "{{training_job}}")], TOKENS_PER_SECOND,
                   description="Mean over live ranks."),
        timeseries("MFU", [Query(f"rankguard:job_mfu:ratio{{{JOB}}}", "{{training_job}}")],
                   "percentunit", max_value=1),
        timeseries("Step time per rank", [Query(with_node(f"rankguard:rank_step_seconds:mean1m{{{JOB}}}"),
                                                "{{node}} rank {{rank}}")], "s",
                   description="Mean step time over 1m: rate() of the step-time histogram's "
                               "sum over its count."),
        timeseries("Goodput", [Query(f"rankguard_supervisor_goodput_ratio{{{JOB}}}", "{{training_job}}")],
                   "percentunit", max_value=1, thresholds=(("red", None), ("green", 0.9))),
    ]  # fmt: skip
    incident_rows = [
        timeseries("Incidents", [Query("sum by (kind) (increase(rankguard_supervisor_incidents_total[5m]))",
                                       "{{kind}}")], "short", bars=True, width=8,
                   description="Incidents recorded in the last 5 minutes, by kind (also marked "
                               "on every graph as annotations)."),
        timeseries("Restarts", [Query("sum by (kind) (increase(rankguard_supervisor_restarts_total[5m]))",
                                      "after {{kind}}")], "short", bars=True, width=8,
                   description="Job restarts in the last 5 minutes, by the incident that caused them."),
        # both: a warm restart closes a death's incident before most scrapes see it open
        table("Open and recent incidents", [
                  Query(f"sum by (kind, training_job, node, rank) (rankguard_supervisor_incident_open{{{JOB}}}) > 0",
                        instant=True, table=True),
                  Query(f"round(time() - max by (kind, training_job, node, rank) "
                        f"(rankguard_supervisor_incident_detected_timestamp_seconds{{{JOB}}}))",
                        instant=True, table=True)],
              "none", width=8, hide_columns=("Time",),
              rename={"Value #A": "open", "Value #B": "detected s ago"},
              description="Open (under recovery) or detected in the last 15 minutes; details "
                          "with `rankguard incidents`."),
        # the published interruption tables' view: what the fleet loses to each cause
        table("Interruptions by cause", [
                  Query(_over_range("rankguard_supervisor_incidents_by_cause_total"),
                        instant=True, table=True),
                  Query(_over_range("rankguard_supervisor_lost_seconds_by_cause_total"),
                        instant=True, table=True)],
              "none", width=8, hide_columns=("Time",),
              rename={"Value #A": "incidents", "Value #B": "seconds lost"},
              description="Incidents over the dashboard's time range by cause (GPU, GPU memory, "
                          "NVLink, network, storage, host, collective, data, user code, "
                          "rankguard, unknown), and the seconds from each fault to the first "
                          "step after its restart; the whole history with "
                          "`rankguard incidents --by-cause`."),
        timeseries("Time to detect (mean, last hour)", [Query(_mean_time("rankguard_supervisor_time_to_detect_seconds"),
                                                   "{{kind}}")], "s",
                   description="From the fault (exit, last heartbeat) to the supervisor's finding."),
        timeseries("Time to recover (mean, last hour)", [Query(_mean_time("rankguard_supervisor_time_to_recover_seconds"),
                                                    "{{kind}}")], "s",
                   description="From the fault to the first training step after the restart."),
    ]  # fmt: skip
    return dashboard(
        UID,
        "rankguard / Cluster overview",
        "Job state, goodput, throughput, incidents and recovery, checkpoints and fleet health.",
        [job_rows, fleet_rows, perf_rows, incident_rows],
    )
