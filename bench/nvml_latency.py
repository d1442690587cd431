"""Per-call NVML latency on this machine's GPUs, call by call, as the GPU collector makes
the calls (its samplers included): the figures `bench/agent_overhead.py --latency8
--nvml-latency FILE` gives the NVML double, so its 8-GPU column costs what real GPUs would.

    python bench/nvml_latency.py [--collections 50] [--out latency.json]

Runs the real GPU collector over real pynvml (every cadence at 0, so every sampler runs each
time), times every NVML call, and prints a table (calls, median and p99 in microseconds,
and the call's CPU time: the part a busy driver spends on the caller's core) and the JSON
{function: median seconds, "default": median of all calls}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import pynvml

from rankguard.agent.collectors import CollectorContext
from rankguard.agent.collectors.gpu import GpuCollector, GpuConfig


class TimedNvml:
    """pynvml with every nvml* function timed (wall and the calling thread's CPU)."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if not (name.startswith("nvml") and isinstance(value, types.FunctionType)):
            return value
        if name.startswith("nvmlEventSetWait"):
            return value  # waits for events by design: not a latency

        def timed(*args: Any, **kwargs: Any) -> Any:
            w, c = time.perf_counter(), time.thread_time()
            try:
                return value(*args, **kwargs)
            finally:
                self.wall.setdefault(name, []).append(time.perf_counter() - w)
                self.cpu.setdefault(name, []).append(time.thread_time() - c)

        return timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--collections", type=int, default=50)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    nvml = TimedNvml()
    config = GpuConfig(gpm_interval=0, pcie_interval=0, slow_interval=0, read_deadline_seconds=10)
    collector = GpuCollector(CollectorContext(nvml=nvml), config)
    try:
        for _ in range(args.collections):
            collector.collect()
            if not collector.up:
                sys.exit(f"NVML is down here: {collector.reason}")
            time.sleep(0.05)
    finally:
        collector.close()
    if not nvml.wall:
        sys.exit("no NVML call answered: no GPU here?")
    print("| call | calls | median (us) | p99 (us) | CPU median (us) |")
    print("|---|---|---|---|---|")
    out: dict[str, float] = {}
    for name, times in sorted(nvml.wall.items()):
        times = sorted(times)
        out[name] = statistics.median(times)
        print(f"| {name} | {len(times)} | {1e6 * out[name]:.0f} | "
              f"{1e6 * times[int(len(times) * 0.99)]:.0f} | "
              f"{1e6 * statistics.median(nvml.cpu[name]):.0f} |")  # fmt: skip
    out["default"] = statistics.median(t for ts in nvml.wall.values() for t in ts)
    text = json.dumps(out, indent=1, sort_keys=True)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
