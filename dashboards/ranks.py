"""Ranks and communication: where each rank's step time goes (compute, communication,
data wait, optimizer, checkpoint blocking), stragglers, throughput and memory per rank."""

from __future__ import annotations

from .common import (
    JOB,
    TOKENS_PER_SECOND,
    Query,
    dashboard,
    live,
    stat,
    table,
    timeseries,
    with_node,
)

UID = "rankguard-ranks"
RANK = "{{node}} rank {{rank}}"
# The parts that add up to the step time: `comm` overlaps compute, `comm_exposed` does not.
STEP_PARTS = f'rankguard_rank_phase_seconds{{{JOB}, phase!="comm"}}'


def _per_rank(name: str) -> str:
    return with_node(live(f"{name}{{{JOB}}}"))


def build():
    top = [
        stat("Live ranks", [Query(f"sum by (training_job) (rankguard_rank_up{{{JOB}}})", "{{training_job}}")],
             "none", description="Rank processes alive (or stopped) on the agents' nodes."),
        stat("Max communication share", [Query(f"rankguard:job_comm_step_ratio:max{{{JOB}}}", "{{training_job}}")],
             "percentunit", decimals=1, thresholds=(("green", None), ("orange", 0.2), ("red", 0.4)),
             description="Communication's share of step time, worst rank. Target: under 20%."),
        stat("Max data wait", [Query(f"rankguard:job_data_wait_ratio:max{{{JOB}}}", "{{training_job}}")],
             "percentunit", decimals=1, thresholds=(("green", None), ("orange", 0.02), ("red", 0.05)),
             description="Data-loading stall's share of step time, worst rank. Target: near zero."),
        stat("Max straggler score", [Query(f"max by (training_job) (rankguard:rank_straggler_score:ratio{{{JOB}}})",
                                           "{{training_job}}")],
             "none", decimals=2, thresholds=(("green", None), ("orange", 1.1), ("red", 1.2)),
             description="A rank's compute time over its job's median (1 = typical)."),
        stat("Step (max)", [Query(f"max by (training_job) (rankguard_rank_step{{{JOB}}})", "{{training_job}}")],
             "none"),
        stat("Restarts", [Query(f"max by (training_job) (rankguard_rank_restarts{{{JOB}}})", "{{training_job}}")],
             "none", thresholds=(("green", None), ("orange", 1), ("red", 3)),
             description="Restart count of the worker group, as the ranks report it."),
    ]  # fmt: skip
    comm = [
        timeseries("Communication share of step time",
                   [Query(_per_rank("rankguard_rank_comm_step_ratio"), RANK)], "percentunit",
                   max_value=1, thresholds=(("green", None), ("red", 0.2)),
                   description="All-reduce time in flight (overlapped or not) over step time. "
                               "Peers of a straggler wait more: their share rises."),
        timeseries("Data wait share of step time",
                   [Query(_per_rank("rankguard_rank_data_wait_ratio"), RANK)], "percentunit",
                   max_value=1, thresholds=(("green", None), ("red", 0.05)),
                   description="Time the loop waited for the next batch: should be near zero."),
        timeseries("Straggler score",
                   [Query(with_node(f"rankguard:rank_straggler_score:ratio{{{JOB}}}"), RANK)], "none",
                   thresholds=(("green", None), ("red", 1.2)),
                   description="Mean compute time over 2 minutes against the job's median rank."),
        timeseries("Comm/compute ratio",
                   [Query(_per_rank("rankguard_rank_comm_compute_ratio"), RANK)], "none",
                   description="Communication time over compute time (may exceed 1)."),
    ]  # fmt: skip
    split = [
        timeseries("Step time split (mean over ranks)",
                   [Query(f"avg by (training_job, phase) ({live(STEP_PARTS)})", "{{training_job}} {{phase}}")],
                   "s", stacked=True,
                   description="Data wait + compute + exposed communication + optimizer + "
                               "checkpoint blocking = step time (overlapped communication is "
                               "inside compute)."),
        table("Step time split per rank (mean, 5m)",
              [Query(with_node(f"rate(rankguard_rank_step_phase_seconds_total{{{JOB}}}[5m]) / ignoring (phase) "
                               f"group_left rate(rankguard_rank_steps_total{{{JOB}}}[5m])"),
                     instant=True, table=True)],
              "s", hide_columns=("Time", "instance", "job", "__name__"),
              description="One row per rank and phase: compare a rank with its peers."),
        # counters for rates (issue 16): the recording rules' rate() over every step
        timeseries("Tokens/s per rank",
                   [Query(with_node(f"rankguard:rank_tokens_per_second:rate1m{{{JOB}}}"), RANK)],
                   TOKENS_PER_SECOND, description="rate() of the rank's token counter over 1m."),
        timeseries("MFU per rank", [Query(with_node(f"rankguard:rank_mfu:ratio1m{{{JOB}}}"), RANK)],
                   "percentunit", max_value=1,
                   description="FLOPs done over 1m (a counter) over the device's peak FLOP/s."),
    ]  # fmt: skip
    # What each rank's GPU waited for (issue 20): its batches, and communication the step
    # blocked on (exposed: not hidden behind backward; what the 20% alert judges).
    waits = [
        timeseries("Exposed communication share of step time",
                   [Query(_per_rank("rankguard_rank_comm_exposed_step_ratio"), RANK)], "percentunit",
                   max_value=1, thresholds=(("green", None), ("red", 0.2)),
                   description="Communication the step waited for (not overlapped with compute) "
                               "over step time. Target: under 20%."),
        timeseries("Data wait per rank",
                   [Query(with_node(live(f'rankguard_rank_phase_seconds{{{JOB}, phase="data_wait"}}')), RANK)],
                   "s",
                   description="Seconds of the last step the rank waited for its next batch "
                               "(DataLoader workers with nothing ready included). One rank far "
                               "above its peers is a data stall."),
    ]  # fmt: skip
    memory = [
        timeseries("Peak GPU memory per rank",
                   [Query(with_node(f"rankguard_rank_peak_memory_bytes{{{JOB}}}"), RANK)], "bytes",
                   description="Peak accelerator memory the rank reports (allocator high-water mark)."),
        timeseries("Average GPU memory per rank (5m)",
                   [Query(with_node(f"avg_over_time(rankguard_rank_gpu_memory_bytes{{{JOB}}}[5m])"),
                          RANK + " gpu {{gpu}}")], "bytes",
                   description="Memory NVML attributes to the rank's process, averaged."),
        timeseries("Heartbeat age", [Query(with_node(f"rankguard_rank_heartbeat_age_seconds{{{JOB}}}"), RANK)], "s",
                   description="Since the agent last heard from the rank."),
        timeseries("Loss", [Query(_per_rank("rankguard_rank_loss"), RANK)], "none"),
    ]  # fmt: skip
    return dashboard(
        UID,
        "rankguard / Ranks and communication",
        "Per rank: communication and data-wait shares, stragglers, step split, memory.",
        [top, comm, waits, split, memory],
    )
