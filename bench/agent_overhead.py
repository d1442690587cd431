"""Agent overhead: its own CPU use, /metrics scrape latency, and training speed with and
without an agent listening, side by side in one run.

    python bench/agent_overhead.py [--seconds 30] [--rates 10 100] [--repeats 3] [--out FILE]
                                   [--baseline-python OTHER_VENV/bin/python] [--qlen 512]

Part 1 starts `rankguard agent` (1 s interval, an NVML double with 8 GPUs) and 8 fake
rank processes that each send a valid telemetry record RATE times a second, then measures
the agent's CPU time over a window, split by thread (where the time goes: the telemetry
receiver, the collectors on the main thread, HTTP), the receiver thread's wake-ups
(voluntary context switches), and the latency of repeated /metrics scrapes as text,
gzipped text and OpenMetrics. One column per rate, side by side. With
`--baseline-python`, the agent of another installation (an older commit in its own venv)
is measured too, alternating with this one, rate by rate: columns "before" and "after".
With `--qlen N` (root), the same agent is measured with the kernel's queue for Unix
datagram sockets as it is ("before") and raised to N ("after", deploy/sysctl.d): the
sysctl is set only while the agent creates its socket (the length is taken then) and put
back at once. With both, the two installations are compared, each with the raised queue.
"records dropped" are the senders' own counts of full-queue drops.
With `--latency8`, one more column per rate: the same 8 doubled GPUs with every NVML call
taking a healthy H100's per-call latency (`--nvml-latency FILE`: the JSON that
`bench/nvml_latency.py` measures on a GPU machine; without it the assumed figures of
`ASSUMED_H100_LATENCY_S`), so the GPU collector's samplers and reads cost what they
would at 8 GPUs.
Part 2 runs the real trainer under torchrun (2 ranks) alternately with an agent
receiving its telemetry and with no listener at all, and compares throughput.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from rankguard.agent.nvml_double import make_double
from rankguard.cli.local_stack import Daemon, free_port, http_json

SENDER = """
import os, sys, time
from rankguard.client import TelemetrySender
from rankguard.contract.telemetry import SCHEMA_VERSION
sender, rank, step = TelemetrySender(sys.argv[1]), int(sys.argv[2]), 0
period, next_at = 1.0 / float(sys.argv[3]), time.monotonic()
while True:
    step += 1
    sender.send(dict(v=SCHEMA_VERSION, job="bench", rank=rank, local_rank=rank, world_size=8,
        pid=os.getpid(), restart=0, step=step, phase="train", time=time.time(),
        step_seconds=0.1, data_wait_seconds=0.001, compute_seconds=0.07, comm_seconds=0.02,
        comm_exposed_seconds=0.01, optimizer_seconds=0.01, checkpoint_block_seconds=0.0,
        tokens_per_second=50000.0, mfu=0.45, peak_memory_bytes=70 * 2**30, loss=2.0,
        checkpoint_step=None, flops=5e12, peak_flops=1e15))
    next_at += period
    time.sleep(max(0.0, next_at - time.monotonic()))
"""
SCRAPES = {  # label -> request headers
    "text": {},
    "text, gzip": {"Accept-Encoding": "gzip"},
    "OpenMetrics": {"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"},
}
TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each of the process's threads, by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def thread_switches(pid: int, tid: int) -> int:
    """Voluntary context switches of one thread: how often it went to sleep (wake-ups)."""
    try:
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    except OSError:
        return 0
    return int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M)[1])


def thread_names(pid: int) -> dict[int, str]:
    """Python thread names by thread id, from `py-spy dump` (empty without py-spy)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    try:
        dump = subprocess.run([spy, "dump", "-p", str(pid)], capture_output=True, text=True,
                              timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(m[1]): m[2] for m in re.finditer(r'Thread (\d+) \(\w+\): "([^"]+)"', dump)}


def thread_group(name: str) -> str:
    if "receiver" in name:
        return "telemetry receiver"
    if name == "MainThread":
        return "collectors (main thread)"
    if "http" in name or name.startswith("Thread-"):
        return "HTTP"
    if name.startswith("rankguard-nvml"):
        return "GPU reads (a thread per GPU)"
    return "other (watchers, XID events)"


QLEN_FILE = Path("/proc/sys/net/unix/max_dgram_qlen")

# Per-call NVML latency (seconds) of a healthy H100, by function name ("default": any other
# call), for the --latency8 column. bench/results/gpu/ holds the agent's CPU with real NVML
# on one H100 but no per-call figures yet: until `bench/nvml_latency.py` has been run there
# (pass its output as --nvml-latency), these are assumptions, not measurements: 100 us a
# call, and nvmlDeviceGetPcieThroughput's 20 ms sampling window (NVIDIA's documentation).
LATENCY_LABEL = "8 GPUs at H100 NVML latencies"
ASSUMED_H100_LATENCY_S = {"default": 100e-6, "nvmlDeviceGetPcieThroughput": 20e-3}


def start_agent(
    tmp: Path,
    gpus: int | None,
    python: str = sys.executable,
    qlen: int | None = None,
    latency: dict | None = None,
) -> tuple[subprocess.Popen, str, Path]:
    """An agent with an NVML double of `gpus` GPUs (each call taking `latency`: see
    ASSUMED_H100_LATENCY_S), or real NVML when `gpus` is None,
    run by `python` (another venv's interpreter: another installed version), its telemetry
    socket created with a kernel queue of `qlen` datagrams (None: the sysctl as it is)."""
    if qlen is None:
        return _start_agent(tmp, gpus, python, latency)
    old = QLEN_FILE.read_text()
    QLEN_FILE.write_text(str(qlen))
    try:  # the agent is serving /healthz, so its socket exists, with this queue length
        return _start_agent(tmp, gpus, python, latency)
    finally:
        QLEN_FILE.write_text(old)


def _start_agent(
    tmp: Path, gpus: int | None, python: str, latency: dict | None = None
) -> tuple[subprocess.Popen, str, Path]:
    port, sock, double = free_port(), tmp / "telemetry.sock", tmp / "nvml.json"
    nvml_args = []
    if gpus is not None:
        extra = {"latency_s": latency} if latency else {}
        double.write_text(json.dumps(make_double(n_gpus=gpus, **extra)))
        nvml_args = ["--nvml-double", str(double)]
    agent = Daemon(  # serving /healthz when it returns
        ["agent", "--bind", f"127.0.0.1:{port}", "--interval", "1", "--telemetry-socket",
         str(sock), *nvml_args, "--ckpt-dir", str(tmp), "--log-level", "warning"],
        tmp / "agent.log", f"http://127.0.0.1:{port}", command=[python, "-m", "rankguard.cli.main"],
    )  # fmt: skip
    return agent.proc, agent.url, sock


def queue_drops(ranks: dict) -> int:
    """Records the senders dropped on a full queue, by their own counts (`client_errors`)."""
    return sum(r.get("client_errors", {}).get("dropped_queue_full", 0) for r in ranks["ranks"])


def agent_cost(
    seconds: float,
    real_nvml: bool,
    rate: float,
    scrapes: int = 200,
    python: str = sys.executable,
    qlen: int | None = None,
    latency: dict | None = None,
) -> dict:
    with tempfile.TemporaryDirectory(prefix="rg-agent-bench-") as tmp:
        gpus = None if real_nvml else 8
        agent, base, sock = start_agent(Path(tmp), gpus=gpus, python=python, qlen=qlen,
                                        latency=latency)  # fmt: skip
        senders = [
            subprocess.Popen([sys.executable, "-c", SENDER, str(sock), str(r), str(rate)])
            for r in range(8)
        ]
        try:
            time.sleep(3)  # let the ranks register and the collectors warm up
            names = thread_names(agent.pid)
            receiver = next((t for t, n in names.items() if "receiver" in n), None)
            p = psutil.Process(agent.pid)
            ranks_url = base + "/v1/ranks"
            ranks0 = http_json(ranks_url, timeout=60)
            accepted0 = ranks0["telemetry"]["accepted"]
            switches0 = thread_switches(agent.pid, receiver) if receiver else 0
            before, threads0, t0 = p.cpu_times(), thread_cpu(agent.pid), time.monotonic()
            time.sleep(seconds)
            after, threads1 = p.cpu_times(), thread_cpu(agent.pid)
            switches1 = thread_switches(agent.pid, receiver) if receiver else 0
            elapsed = time.monotonic() - t0
            ranks = http_json(ranks_url, timeout=60)
            cpu = (after.user + after.system - before.user - before.system) / elapsed
            by_group: dict[str, float] = {}
            for tid, spent in threads1.items():
                group = thread_group(names.get(tid, ""))
                by_group[group] = (
                    by_group.get(group, 0.0) + (spent - threads0.get(tid, 0.0)) / elapsed
                )
            # short-lived threads (the storage collector's statvfs guards) end inside the
            # window: their time is in the process's total only
            by_group["threads that ended in the window"] = max(0.0, cpu - sum(by_group.values()))
            records = (ranks["telemetry"]["accepted"] - accepted0) / elapsed
            dropped = (queue_drops(ranks) - queue_drops(ranks0)) / elapsed
            latencies, sizes, served = {}, {}, {}
            for label, headers in SCRAPES.items():
                request = urllib.request.Request(base + "/metrics", headers=headers)
                times = []
                for _ in range(scrapes):
                    start = time.perf_counter()
                    with urllib.request.urlopen(request, timeout=5) as resp:
                        body = resp.read()
                        encoded = resp.headers.get("Content-Encoding")
                    times.append(time.perf_counter() - start)
                served[label] = resp.headers.get("Content-Type", "").split(";")[0] + (
                    " gzip" if encoded == "gzip" else ""
                )
                times.sort()
                latencies[label] = (times[len(times) // 2], times[int(len(times) * 0.99)])
                sizes[label] = len(body)
            text = gzip.decompress(body) if encoded == "gzip" else body
            # the GPU collection's wall time (every GPU read in parallel, up to the deadline)
            gpu_ms = re.search(rb'^rankguard_collector_duration_seconds\{collector="gpu"\} (\S+)',
                               text, re.M)  # fmt: skip
            gpus = http_json(base + "/v1/node", timeout=60)
            gpus = gpus.get("facts", {}).get("gpu", {}).get("count")
        finally:
            for s in senders:
                s.kill()
            agent.terminate()
            agent.wait()
    return {
        "rate": rate,
        "cpu_fraction_of_one_core": cpu,
        "by_thread": by_group,
        "records_per_second": records,
        "dropped_per_second": dropped,
        "receiver_wakeups_per_second": (switches1 - switches0) / elapsed,
        "scrape_ms": {k: (1e3 * a, 1e3 * b) for k, (a, b) in latencies.items()},
        "metrics_bytes": sizes,
        "served": served,
        "series": sum(1 for ln in text.splitlines() if ln and not ln.startswith(b"#")),
        "gpu_collection_ms": 1e3 * float(gpu_ms[1]) if gpu_ms else float("nan"),
        "ranks_seen": len(ranks["ranks"]),
        "gpus": gpus,
        "window_seconds": seconds,
    }


def cost_table(columns: list[tuple[str, dict]], gpu_desc: str, seconds: float) -> list[str]:
    """The cost measures with one column per (label, measurement); a ratio column after
    each "after" column (after / before at the same rate) and after each --latency8 column
    (against the column before it: the same agent at the same rate, NVML answering at
    once), or, with neither, one ratio of the last column to the first."""
    ratio_head = {"after": "after / before", LATENCY_LABEL: "with latencies / without"}
    paired = [next((h for k, h in ratio_head.items() if label.startswith(k)), None)
              for label, _ in columns]  # fmt: skip
    compare = any(paired)
    head = ["measure"]
    for (label, _), pair in zip(columns, paired, strict=True):
        head.append(label)
        if pair:
            head.append(pair)
    if not compare:
        head.append("ratio")
    head.append("target")
    lines = [
        f"Agent cost: 1 s interval, {gpu_desc}, 8 ranks, {seconds:.0f} s window per column",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]

    def ratio(a: float, b: float) -> str:
        return f"{b / a:.2f}x" if a else ""

    def row(name: str, values: list[float], fmt: str, target: str = "", cells=None) -> None:
        shown = cells or [format(v, fmt) for v in values]
        out = []
        for i, cell in enumerate(shown):
            out.append(cell)
            if paired[i]:
                out.append(ratio(values[i - 1], values[i]))
        if not compare:
            out.append(ratio(values[0], values[-1]))
        lines.append(f"| {name} | " + " | ".join(out) + f" | {target} |")

    costs = [c for _, c in columns]
    row("records received per second", [c["records_per_second"] for c in costs], ",.0f")
    row("records dropped per second (queue full)", [c["dropped_per_second"] for c in costs], ",.1f")
    targets = {10: "< 0.01", 100: "< 0.05"}
    cpu = [c["cpu_fraction_of_one_core"] for c in costs]
    row("agent CPU, fraction of one core", cpu, ".4f", "< 0.01 at 10, < 0.05 at 100", [
        f"{c['cpu_fraction_of_one_core']:.4f} (target {targets.get(int(c['rate']), '-')})"
        for c in costs
    ])  # fmt: skip
    groups = sorted({g for c in costs for g in c["by_thread"]})
    for g in groups:
        row(f"&nbsp;&nbsp;{g}", [c["by_thread"].get(g, 0.0) for c in costs], ".4f")
    row("receiver wake-ups per second", [c["receiver_wakeups_per_second"] for c in costs], ",.0f")
    row(
        "CPU per record (µs), whole agent",
        [1e6 * c["cpu_fraction_of_one_core"] / max(1.0, c["records_per_second"]) for c in costs],
        ".0f",
    )
    row(
        "CPU per record (µs), receiver thread",
        [1e6 * c["by_thread"].get("telemetry receiver", 0.0) / max(1.0, c["records_per_second"])
         for c in costs],
        ".0f",
    )  # fmt: skip
    for label in SCRAPES:
        row(f"/metrics {label} p50 (ms)", [c["scrape_ms"][label][0] for c in costs], ".2f")
        row(f"/metrics {label} p99 (ms)", [c["scrape_ms"][label][1] for c in costs], ".2f", "< 10")
        row(f"/metrics {label} size (bytes)", [c["metrics_bytes"][label] for c in costs], ",.0f")
    row("/metrics series", [c["series"] for c in costs], ",.0f")
    row("GPU collection wall time, last one (ms)", [c["gpu_collection_ms"] for c in costs], ".1f")
    lines.append("")
    lines.append("Served as: " + "; ".join(f"{k}: {v}" for k, v in costs[-1]["served"].items()))
    return lines


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


def gpu_collection_split(latency: dict | None, collections: int = 60) -> dict[str, float]:
    """CPU per GPU collection at 8 doubled GPUs, in this process: all of it, and the part
    spent inside the NVML double (its Python emulation of the driver and of the latency),
    timed per call on the calling thread. Real NVML does the double's work in C and in
    the driver, so "the collector" is the agent's own part."""
    from rankguard.agent.collectors import CollectorContext
    from rankguard.agent.collectors.gpu import GpuCollector
    from rankguard.agent.nvml_double import NvmlDouble, make_double

    nvml = NvmlDouble(make_double(n_gpus=8, **({"latency_s": latency} if latency else {})))
    inside, lock = [0.0], threading.Lock()

    def timed(fn):
        def call(*args, **kwargs):
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    inside[0] += time.thread_time() - t

        return call

    for name in dir(NvmlDouble):
        if name.startswith("nvml") and callable(getattr(nvml, name)):
            setattr(nvml, name, timed(getattr(nvml, name)))
    ranks = [("bench", r, os.getpid()) for r in range(8)]  # the processes' read as well
    collector = GpuCollector(CollectorContext(nvml=nvml, rank_processes=lambda: ranks))
    try:
        for _ in range(3):
            collector.collect()
        inside[0], before = 0.0, resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(collections):
            collector.collect()
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        collector.close()
    total = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / collections
    return {"all": total * 1e3, "inside the double": inside[0] / collections * 1e3,
            "the collector": (total - inside[0] / collections) * 1e3}  # fmt: skip


def split_table(latency: dict) -> list[str]:
    rows = {"no latency": gpu_collection_split(None), LATENCY_LABEL: gpu_collection_split(latency)}
    lines = ["", "GPU collection, in process (8 doubled GPUs, 8 ranks' processes, 60 "
             "collections): CPU ms per collection", "",
             "| NVML | all | inside the NVML double | the collector |", "|---|---|---|---|"]  # fmt: skip
    for label, r in rows.items():
        lines.append(f"| {label} | {r['all']:.2f} | {r['inside the double']:.2f} | "
                     f"{r['the collector']:.2f} |")  # fmt: skip
    return lines


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--rates", type=float, nargs="+", default=[10.0, 100.0],
                   help="records per second per rank, one column each")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--real-nvml", action="store_true", help="the node's real GPUs instead of 8 doubled ones"
    )
    p.add_argument("--baseline-python", help="measure this interpreter's installed agent too "
                   "(another venv's python: the code before a change), as 'before'")  # fmt: skip
    p.add_argument("--qlen", type=int, help="measure with the kernel's Unix datagram queue "
                   "as it is ('before') and raised to this length ('after'); with "
                   "--baseline-python, both with it raised; needs root")  # fmt: skip
    p.add_argument("--latency8", action="store_true", help="add a column per rate: 8 doubled "
                   "GPUs answering at a healthy H100's per-call NVML latencies")  # fmt: skip
    p.add_argument("--nvml-latency", type=Path, help="JSON {function: seconds, 'default': "
                   "seconds} from bench/nvml_latency.py (default: ASSUMED_H100_LATENCY_S)")  # fmt: skip
    args = p.parse_args()
    latency = ASSUMED_H100_LATENCY_S
    if args.nvml_latency:
        latency = json.loads(args.nvml_latency.read_text())
    if args.baseline_python and not Path(args.baseline_python).is_file():
        p.error(f"--baseline-python: no such interpreter: {args.baseline_python}")
    if args.qlen and not os.access(QLEN_FILE, os.W_OK):
        p.error(f"--qlen: {QLEN_FILE} is not writable (run as root)")

    columns: list[tuple[str, dict]] = []
    # (label, interpreter, queue length) of each column at a rate
    versions = [("", sys.executable, None)]
    if args.baseline_python:  # with --qlen, both agents get the raised queue
        versions = [
            ("before", args.baseline_python, args.qlen),
            ("after", sys.executable, args.qlen),
        ]
    elif args.qlen:
        versions = [("before", sys.executable, None), ("after", sys.executable, args.qlen)]
    for rate in args.rates:
        for version, python, qlen in versions:
            label = f"{version} {rate:g} records/s/rank".strip()
            print(f"part 1: agent cost, {label} ...", file=sys.stderr, flush=True)
            cost = agent_cost(args.seconds, args.real_nvml, rate, python=python, qlen=qlen)
            columns.append((label, cost))
        if args.latency8:
            label = f"{LATENCY_LABEL}, {rate:g} records/s/rank"
            print(f"part 1: agent cost, {label} ...", file=sys.stderr, flush=True)
            cost = agent_cost(args.seconds, False, rate, qlen=versions[-1][2], latency=latency)
            columns.append((label, cost))
    costs = [c for _, c in columns]
    runs: dict[str, list[float]] = {"without agent": [], "with agent": []}
    with tempfile.TemporaryDirectory(prefix="rg-agent-bench-") as tmp:
        for i in range(args.repeats):
            for label in runs:
                print(f"part 2 [{i + 1}/{args.repeats}] {label} ...", file=sys.stderr, flush=True)
                runs[label].append(train(label == "with agent", Path(tmp), args.steps))
    gpu_desc = f"{costs[0]['gpus']} GPU(s), real NVML" if args.real_nvml else "8 GPUs (NVML double)"
    lines = cost_table(columns, gpu_desc, args.seconds)
    if args.latency8:
        lines += split_table(latency)
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
