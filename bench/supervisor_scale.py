"""The supervisor against many simulated agents: loop time, CPU, memory, time to detect.

For each cluster size, starts bench/agent_sim.py (every node's /v1/node and /v1/ranks, 8
ranks per node, 64 recent steps per rank, as the real agent serves them, incremental
`?after=` reads included) and a real
`rankguard supervisor --agents-file ... --db ... --token-file ... --interval 1` process,
injects faults into random ranks, and measures over the run:

- loop time: the supervisor's own `loop_seconds` of each pass (read from /v1/cluster
  twice a second, each pass counted once);
- CPU: the supervisor process's user+system time over the measured window / wall time;
- RSS: the largest VmRSS seen;
- time to detect: the incident's `detected_at` (supervisor's SQLite) minus the
  simulator's injection time, matched by kind and incarnation. `detected_at` is the start
  of the pass that saw the fault; the incident is written within that pass's loop time;
- bytes per /v1/ranks answer (counted by the simulator) and the machine's 1-minute load
  average over the run (the machine is shared: a loaded one slows everything).

The simulated agents announce deaths on `/v1/rank-events` at once, as a real agent does,
and the supervisor long-polls it; `--no-events` serves them without it (deaths seen by the
sample polls only, as before). `--full-reads` has the simulated agents ignore `after` (agents from before incremental
reads: every rank's whole window on every poll); `--both` runs each size both ways, one
after the other, and adds a table of ratios (full reads / incremental).

Usage: python bench/supervisor_scale.py --nodes 64 256 1024 --duration 60 [--both]
Writes a markdown table to bench/results/supervisor_scale.md (--out) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rankguard.cli.local_stack import free_port, http_json, wait_until
from rankguard.contract.secrets import write_secret_file

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-token-0123456789abcdef"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def spawn(args: list[str], log: Path, cpus: set[int] | None = None) -> subprocess.Popen:
    with open(log, "w") as out:  # the child keeps its own copy of the fd
        proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT)
    if cpus:  # pinned before it starts threads: they inherit the mask
        os.sched_setaffinity(proc.pid, cpus)
    return proc


def cpu_set(text: str | None) -> set[int] | None:
    return None if not text else {int(c) for c in text.split(",")}


def written_at(log: Path) -> dict[int, float]:
    """Incident id -> when the supervisor logged it (written to SQLite just before)."""
    out = {}
    for line in log.read_text().splitlines():
        m = re.match(r"(\S+ \S+),(\d{3}) \S+ WARNING: incident (\d+): ", line)
        if m and int(m.group(3)) not in out:
            t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
            out[int(m.group(3))] = t + int(m.group(2)) / 1000
    return out


def passes_run(base: str) -> int:
    """The supervisor's own count of reconcile passes (its /metrics)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("rankguard_supervisor_passes_total "):
                return int(float(line.split()[1]))
    raise RuntimeError("no rankguard_supervisor_passes_total on /metrics")


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def summary(v: list[float]) -> dict:
    return {"n": len(v), "p50": quantile(v, 0.5), "p99": quantile(v, 0.99), "max": max(v),
            "mean": statistics.fmean(v)}  # fmt: skip


def profile(args, work: Path, pids: dict[str, int], nodes: int) -> list[subprocess.Popen]:
    """`--profile S`: py-spy records each process for S seconds from the start of the
    measurement (flame graphs in --profile-dir), so the supervisor's and the simulator's
    shares of a slow detection are told apart."""
    if not args.profile:
        return []
    spy = Path(sys.executable).with_name("py-spy")
    out = args.profile_dir or work
    out.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen([str(spy), "record", "--pid", str(pid), "-d", str(int(args.profile)),
                          "-r", "50", "--nonblocking", "-f", "raw",
                          "-o", str(out / f"{name}-{nodes}.txt")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name, pid in pids.items()
    ]  # fmt: skip


def run_one(nodes: int, args, work: Path, full_reads: bool) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    token = work / "token"
    write_secret_file(token, TOKEN)
    agents, faults, ready = work / "agents", work / "faults.jsonl", work / "ready.json"
    sim = spawn(
        [str(ROOT / "bench/agent_sim.py"), "--nodes", str(nodes),
         "--agents-file", str(agents), "--ready-file", str(ready), "--fault-log", str(faults),
         "--faults", args.faults, "--fault-every", str(args.fault_every),
         "--step-seconds", str(args.step_seconds), "--ckpt-every", str(args.ckpt_every),
         "--seed", str(args.seed),
         "--restart-delay", str(args.restart_delay),
         "--stats-file", str(work / "sim-stats.json"), *(["--full-reads"] if full_reads else []),
         *(["--no-events"] if args.no_events else [])],
        work / "sim.log", cpu_set(args.sim_cpus),
    )  # fmt: skip
    port = free_port()
    sup = None
    try:
        while not ready.exists():
            if sim.poll() is not None:
                raise RuntimeError(f"simulator exited: {(work / 'sim.log').read_text()[-2000:]}")
            time.sleep(0.1)
        sup = spawn(
            ["-m", "rankguard.cli.main", "supervisor", "--agents-file",
             str(agents), "--db", str(work / "rankguard.db"), "--token-file", str(token),
             "--bind", f"127.0.0.1:{port}", "--interval", str(args.interval),
             "--log-level", "warning"],
            work / "supervisor.log", cpu_set(args.supervisor_cpus),
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"

        def every_node_seen() -> bool:  # serving, and every node seen once
            if sup.poll() is not None:
                raise RuntimeError(
                    f"supervisor exited: {(work / 'supervisor.log').read_text()[-2000:]}"
                )
            view = http_json(base + "/v1/cluster", timeout=10)
            return sum(n["reachable"] for n in view["nodes"]) == nodes

        wait_until(every_node_seen, 60, "the supervisor to see every node", interval=0.2)
        time.sleep(args.warmup)
        spies = profile(args, work, {"supervisor": sup.pid, "simulator": sim.pid}, nodes)
        wall0 = time.time()
        t0, c0 = time.monotonic(), cpu_seconds(sup.pid)
        sim_c0 = cpu_seconds(sim.pid)
        passes0 = passes_run(base)
        loops: dict[float, float] = {}  # pass time -> loop seconds
        rss, load = 0, []

        def more() -> bool:  # --duration, then on until --min-faults (at most 5x longer)
            elapsed = time.monotonic() - t0
            if elapsed < args.duration:
                return True
            if args.min_faults <= 0 or elapsed > 5 * args.duration or not faults.exists():
                return False
            seen = sum(json.loads(x)["at"] >= wall0 for x in faults.read_text().splitlines() if x)
            return seen < args.min_faults

        while more():
            load.append(os.getloadavg()[0])
            try:
                view = http_json(base + "/v1/cluster", timeout=10)
                loops[view["time"]] = view["loop_seconds"]
            except (OSError, KeyError):
                pass
            rss = max(rss, rss_bytes(sup.pid))
            time.sleep(0.5)
        wall = time.monotonic() - t0
        cpu = (cpu_seconds(sup.pid) - c0) / wall
        sim_cpu = (cpu_seconds(sim.pid) - sim_c0) / wall
        passes = passes_run(base) - passes0
        for spy in spies:
            spy.wait(timeout=args.profile + 30)
        time.sleep(args.settle)  # let the last faults be seen before stopping
    finally:
        for p in (sup, sim):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (sup, sim):
            if p is not None:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
    sim_stats = json.loads((work / "sim-stats.json").read_text())
    injected = [json.loads(line) for line in faults.read_text().splitlines() if line.strip()]
    injected = [f for f in injected if wall0 <= f["at"] <= wall0 + wall]  # the measured window
    written = written_at(work / "supervisor.log")
    db = sqlite3.connect(f"file:{work / 'rankguard.db'}?mode=ro", uri=True)
    incidents = db.execute(
        "SELECT id, kind, restart_before, rank, node, detected_at FROM incidents"
    ).fetchall()
    by_key = {(k, r): (i, rank, node, at) for i, k, r, rank, node, at in incidents}
    kinds = {"dead": "rank_dead", "hang": "rank_hung"}
    detect: dict[str, list[float]] = {}
    logged: dict[str, list[float]] = {}
    missed = wrong = 0
    for f in injected:
        hit = by_key.get((kinds[f["kind"]], f["restart"]))
        if hit is None:
            missed += 1
            continue
        if (hit[1], hit[2]) != (f["rank"], f["node"]):
            wrong += 1
        detect.setdefault(f["kind"], []).append(hit[3] - f["at"])
        if hit[0] in written:
            logged.setdefault(f["kind"], []).append(written[hit[0]] - f["at"])
    loop_values = list(loops.values())
    return {
        "reads": ("full" if full_reads else "incremental")
        + ("" if args.no_events else " + events"),
        "nodes": nodes,
        "ranks": nodes * 8,
        "load1_mean": statistics.fmean(load),
        "load1_max": max(load),
        "ranks_kib": sim_stats["ranks_bytes"] / max(1, sim_stats["ranks_requests"]) / 1024,
        "measured_s": wall,
        "passes": passes,
        "cpu_per_pass_ms": 1000 * cpu * wall / max(1, passes),
        "loop_p50": quantile(loop_values, 0.5),
        "loop_p99": quantile(loop_values, 0.99),
        "loop_max": max(loop_values, default=None),
        "cpu": cpu,
        "sim_cpu": sim_cpu,
        "rss_mib": rss / 2**20,
        "faults": len(injected),
        "injected": {k: sum(f["kind"] == k for f in injected) for k in kinds},
        "missed": missed,
        "wrong_culprit": wrong,
        "detect": {k: summary(v) for k, v in detect.items()},
        "written": {k: summary(v) for k, v in logged.items()},
        "written_each": {k: sorted(round(x, 3) for x in v) for k, v in logged.items()},
    }


def fmt(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(results: list[dict]) -> str:
    kinds = sorted({k for r in results for k in r["detect"]})
    head = ["reads", "nodes", "ranks", "load avg (1 min) mean / max", "KiB per /v1/ranks",
            "measured s", "passes", "CPU ms per pass", "loop p50 s", "loop p99 s", "supervisor CPU (cores)",
            "simulator CPU (cores)", "RSS MiB"]  # fmt: skip
    for k in kinds:
        head += [f"{k}: detected/injected", f"{k}: to detected_at p50 / p99 s",
                 f"{k}: to incident written p50 / p99 / max s"]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["reads"], str(r["nodes"]), str(r["ranks"]),
                 f"{fmt(r['load1_mean'], 1)} / {fmt(r['load1_max'], 1)}", fmt(r["ranks_kib"], 1),
                 fmt(r["measured_s"], 0), str(r["passes"]), fmt(r["cpu_per_pass_ms"], 1), fmt(r["loop_p50"], 3),
                 fmt(r["loop_p99"], 3), fmt(r["cpu"]), fmt(r["sim_cpu"]), fmt(r["rss_mib"], 0)]  # fmt: skip
        for k in kinds:
            d = r["detect"].get(k, {"n": 0, "p50": None, "p99": None})
            w = r["written"].get(k, {"p50": None, "p99": None, "max": None})
            cells += [f"{d['n']}/{r['injected'].get(k, 0)}", f"{fmt(d['p50'])} / {fmt(d['p99'])}",
                      f"{fmt(w['p50'])} / {fmt(w['p99'])} / {fmt(w['max'])}"]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _ratio(a, b) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.1f}x"


def ratios(results: list[dict], args) -> str:
    """Full reads / incremental, per size, for the figures that incremental reads move."""
    head = ["nodes", "KiB per /v1/ranks", "supervisor CPU", "loop p50", "loop p99",
            "dead: to incident written p50", "dead: to incident written max"]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["reads"], r["nodes"]): r for r in results}
    for n in sorted({r["nodes"] for r in results}):
        ev = "" if args.no_events else " + events"
        f, i = by.get(("full" + ev, n)), by.get(("incremental" + ev, n))
        if f is None or i is None:
            continue
        fw, iw = f["written"].get("dead", {}), i["written"].get("dead", {})
        cells = [str(n), _ratio(f["ranks_kib"], i["ranks_kib"]), _ratio(f["cpu"], i["cpu"]),
                 _ratio(f["loop_p50"], i["loop_p50"]), _ratio(f["loop_p99"], i["loop_p99"]),
                 _ratio(fw.get("p50"), iw.get("p50")), _ratio(fw.get("max"), iw.get("max"))]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024, 4096])
    p.add_argument("--duration", type=float, default=60, help="measured seconds per size")
    p.add_argument("--warmup", type=float, default=5)
    p.add_argument("--interval", type=float, default=0.25, help="supervisor --interval")
    p.add_argument(
        "--restart-delay",
        type=float,
        default=3.0,
        help="simulated torchrun's pause before a new incarnation",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="seconds after the measured window for its last faults to be seen",
    )
    p.add_argument("--faults", default="dead")
    p.add_argument(
        "--min-faults",
        type=int,
        default=0,
        help="measure past --duration until this many faults (at most 5x longer)",
    )
    p.add_argument("--fault-every", type=float, default=6.0)
    p.add_argument("--step-seconds", type=float, default=0.25)
    p.add_argument("--ckpt-every", type=int, default=10, help="the simulated job's checkpoint "
                   "interval in steps: keep it shorter than the faults' spacing, or the "
                   "supervisor stops the job as a crash loop")  # fmt: skip
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sim-cpus", help="pin the simulator to these CPUs (e.g. 1)")
    p.add_argument("--supervisor-cpus", help="pin the supervisor to these CPUs (e.g. 0)")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/supervisor_scale.md")
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--profile", type=float, default=0, help="py-spy both processes for S s")
    p.add_argument("--profile-dir", type=Path, help="where --profile writes (the work dir)")
    p.add_argument(
        "--no-events",
        action="store_true",
        help="simulated agents without /v1/rank-events (deaths seen by polls only)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--full-reads",
        action="store_true",
        help="agents ignore ?after= (every rank's whole window on every poll)",
    )
    mode.add_argument("--both", action="store_true",
                      help="each size with full reads, then incremental; ratios table")  # fmt: skip
    args = p.parse_args(argv)
    modes = [True, False] if args.both else [args.full_reads]
    results = []
    with tempfile.TemporaryDirectory(prefix="rankguard-scale-") as tmp:
        for n in args.nodes:
            for full in modes:
                r = run_one(n, args, Path(tmp) / f"n{n}-{'full' if full else 'inc'}", full)
                print(json.dumps(r), file=sys.stderr, flush=True)
                results.append(r)
    cmd = "python bench/supervisor_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    text = "\n".join([
        "# Supervisor scale",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {os.cpu_count()} CPUs ({cpu}), shared with other engineers' work; "
        + (f"the simulator pinned to CPU {args.sim_cpus}, the supervisor to CPU "
           f"{args.supervisor_cpus} (each measured on its own process). "
           if args.sim_cpus or args.supervisor_cpus else
           "the simulator of all agents runs on the same cores as the supervisor. ")
        + "Python "
        f"{platform.python_version()}. Supervisor --interval {args.interval} s; simulated step "
        f"{args.step_seconds} s, a checkpoint every {args.ckpt_every} steps; faults ({args.faults}) every ~{args.fault_every} s "
        f"(0.5x to 1.5x), simulated restart after {args.restart_delay} s; {args.duration:.0f} s "
        f"measured per size (longer until {args.min_faults} faults) after {args.warmup:.0f} s "
        "warm-up.",
        "",
        table(results),
        "",
        *(["Full reads / incremental:", "", ratios(results, args), ""] if args.both else []),
    ])  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
