"""Agent overhead: its own CPU use, /metrics scrape latency, and training speed with and
without an agent listening, side by side in one run.

    python bench/agent_overhead.py [--seconds 30] [--repeats 3] [--out FILE]

Part 1 starts `rankguard agent` (1 s interval, an NVML double with 8 GPUs) and 8 fake
rank processes that each send a valid telemetry record 10 times a second, then measures
the agent's CPU time over a window and the latency of repeated /metrics scrapes.
Part 2 runs the real trainer under torchrun (2 ranks) alternately with an agent
receiving its telemetry and with no listener at all, and compares throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from rankguard.agent.nvml_double import make_double

SENDER = """
import os, sys, time
from rankguard.client import TelemetrySender
from rankguard.contract.telemetry import SCHEMA_VERSION
sender, rank, step = TelemetrySender(sys.argv[1]), int(sys.argv[2]), 0
while True:
    step += 1
    sender.send(dict(v=SCHEMA_VERSION, job="bench", rank=rank, local_rank=rank, world_size=8,
        pid=os.getpid(), restart=0, step=step, phase="train", time=time.time(),
        step_seconds=0.1, data_wait_seconds=0.001, compute_seconds=0.07, comm_seconds=0.02,
        comm_exposed_seconds=0.01, optimizer_seconds=0.01, checkpoint_block_seconds=0.0,
        tokens_per_second=50000.0, mfu=0.45, peak_memory_bytes=70 * 2**30, loss=2.0,
        checkpoint_step=None))
    time.sleep(0.1)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agent(tmp: Path, gpus: int | None) -> tuple[subprocess.Popen, str, Path]:
    """An agent with an NVML double of `gpus` GPUs, or real NVML when `gpus` is None."""
    port, sock, double = free_port(), tmp / "telemetry.sock", tmp / "nvml.json"
    nvml_args = []
    if gpus is not None:
        double.write_text(json.dumps(make_double(n_gpus=gpus)))
        nvml_args = ["--nvml-double", str(double)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankguard.cli.main", "agent", "--bind", f"127.0.0.1:{port}",
         "--interval", "1", "--telemetry-socket", str(sock), *nvml_args,
         "--ckpt-dir", str(tmp), "--log-level", "warning"],
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(base + "/healthz", timeout=1).read()
            break
        except OSError:
            time.sleep(0.1)
    return proc, base, sock


def agent_cost(seconds: float, real_nvml: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="rg-agent-bench-") as tmp:
        agent, base, sock = start_agent(Path(tmp), gpus=None if real_nvml else 8)
        senders = [
            subprocess.Popen([sys.executable, "-c", SENDER, str(sock), str(r)]) for r in range(8)
        ]
        try:
            time.sleep(3)  # let the ranks register and the collectors warm up
            p = psutil.Process(agent.pid)
            before, t0 = p.cpu_times(), time.monotonic()
            time.sleep(seconds)
            after, elapsed = p.cpu_times(), time.monotonic() - t0
            cpu = (after.user + after.system - before.user - before.system) / elapsed
            latencies = []
            for _ in range(200):
                start = time.perf_counter()
                body = urllib.request.urlopen(base + "/metrics", timeout=5).read()
                latencies.append(time.perf_counter() - start)
            ranks = json.loads(urllib.request.urlopen(base + "/v1/ranks").read())["ranks"]
            gpus = json.loads(urllib.request.urlopen(base + "/v1/node").read())
            gpus = gpus.get("facts", {}).get("gpu", {}).get("count")
        finally:
            for s in senders:
                s.kill()
            agent.terminate()
            agent.wait()
    latencies.sort()
    return {
        "cpu_fraction_of_one_core": cpu,
        "scrape_p50_ms": 1e3 * latencies[len(latencies) // 2],
        "scrape_p99_ms": 1e3 * latencies[int(len(latencies) * 0.99)],
        "metrics_bytes": len(body),
        "ranks_seen": len(ranks),
        "gpus": gpus,
        "window_seconds": seconds,
    }


def train(with_agent: bool, tmp: Path, steps: int) -> float:
    summary = tmp / "s.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = None
    if with_agent:
        agent, _, sock = start_agent(tmp, gpus=0)
        env["RANKGUARD_TELEMETRY_SOCKET"] = str(sock)
    else:
        env["RANKGUARD_TELEMETRY_SOCKET"] = str(tmp / "nobody-listens.sock")
    try:
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             "-m", "rankguard.trainer", "--preset", "tiny", "--steps", str(steps),
             "--log-every", "0", "--summary", str(summary)],
            env=env, check=True, capture_output=True,
        )  # fmt: skip
    finally:
        if agent:
            agent.terminate()
            agent.wait()
    s = json.loads(summary.read_text())
    assert (s["telemetry_sent"] > 0) == with_agent, s
    return s["tokens_per_second"]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--real-nvml", action="store_true", help="the node's real GPUs instead of 8 doubled ones"
    )
    args = p.parse_args()

    print("part 1: agent cost ...", file=sys.stderr, flush=True)
    cost = agent_cost(args.seconds, args.real_nvml)
    runs: dict[str, list[float]] = {"without agent": [], "with agent": []}
    with tempfile.TemporaryDirectory(prefix="rg-agent-bench-") as tmp:
        for i in range(args.repeats):
            for label in runs:
                print(f"part 2 [{i + 1}/{args.repeats}] {label} ...", file=sys.stderr, flush=True)
                runs[label].append(train(label == "with agent", Path(tmp), args.steps))
    gpu_desc = f"{cost['gpus']} GPU(s), real NVML" if args.real_nvml else "8 GPUs (NVML double)"
    lines = [
        f"Agent cost: 1 s interval, {gpu_desc}, 8 ranks x 10 records/s, {args.seconds:.0f} s window",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| agent CPU, fraction of one core | {cost['cpu_fraction_of_one_core']:.4f} | < 0.01 |",
        f"| /metrics scrape p50 | {cost['scrape_p50_ms']:.2f} ms | < 10 ms |",
        f"| /metrics scrape p99 | {cost['scrape_p99_ms']:.2f} ms | |",
        f"| /metrics size | {cost['metrics_bytes']:,} bytes | |",
    ]
    if args.repeats:
        lines += [
            "",
            f"Training throughput (tiny preset, 2 ranks, {args.steps} steps; median of {args.repeats} alternated runs)",
            "",
            "| configuration | tokens/s (runs) | ratio to no agent |",
            "|---|---|---|",
        ]
    for label, values in runs.items():
        if not values:
            continue
        base = statistics.median(runs["without agent"])
        shown = ", ".join(f"{v:,.0f}" for v in values)
        lines.append(
            f"| {label} | {statistics.median(values):,.0f} ({shown}) | {statistics.median(values) / base:.4f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(
            f"Command: `python bench/agent_overhead.py {' '.join(sys.argv[1:])}`\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
