"""Record straggler runs, then replay them through the straggler detector with other settings.

    python bench/straggler_replay.py record /tmp/st/slow1.json --fault slow:step=60:rank=1:factor=1.2
    python bench/straggler_replay.py record /tmp/st/clean1.json --steps 500
    python bench/straggler_replay.py record /tmp/st/noisy1.json --steps 500 --noise 0.08
    python bench/straggler_replay.py replay /tmp/st/*.json --set excess_limit=2.5 --set window=16

`record` runs what the end-to-end straggler tests run (the bundled trainer under real
torchrun, 2 gloo ranks on CPU, a real agent and a real supervisor) and keeps every step
sample the agent held (`/v1/ranks`, polled every 0.5 s) with the time it was first seen,
and the supervisor's incidents. `--noise S` stops a random rank for S of every 100 ms in
bursts of 2-4 s, 2-6 s apart (SIGSTOP/SIGCONT by PID): slowness the run-queue wait does
not see, like a VM's steal time.

`replay` rebuilds the supervisor's observation every 0.25 s (its default interval) from
those samples, advances the history and runs the detector, as the supervisor does, once
with the default settings and once with the `--set` ones; it prints, per run, the step of
the first straggler finding (and its rank), the ranks named, and the highest accumulated
excess over steps that took `persist_seconds`. Sample times are estimated back from the
poll that first saw them by their step times, so a replay names the step the supervisor
named to within a step or two (checked on 3 runs: the same step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rankguard.cli.local_stack import end_launcher, http_json, start_agent, start_supervisor
from rankguard.supervisor.detectors import DetectorConfig, straggler
from rankguard.supervisor.history import History, advance
from rankguard.supervisor.state import ClusterObs, NodeObs, RankObs, StepSample

# the end-to-end straggler tests' model (tests/supervisor/test_supervisor_faults.py)
MODEL = ["--preset", "tiny", "--d-model", "192", "--n-layer", "4", "--n-head", "4"]
POLL, PASS = 0.5, 0.25


def record(out: Path, steps: int, fault: str | None, noise: float, seed: int) -> None:
    with tempfile.TemporaryDirectory(prefix="straggler-") as tmp:
        agent = start_agent(Path(tmp))
        supervisor = start_supervisor(Path(tmp), [agent.url])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "-m", "rankguard.trainer", *MODEL, "--log-every", "0",
               "--deterministic", "--steps", str(steps), "--job", "job",
               *(["--fault", fault] if fault else [])]  # fmt: skip
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RANKGUARD_TELEMETRY_SOCKET": str(agent.socket),
        }
        job = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        pids: list[int] = []
        bursts: list[tuple[float, int, float]] = []
        if noise:
            threading.Thread(
                target=_noise, args=(job, pids, noise, seed, bursts), daemon=True
            ).start()
        samples: dict[str, dict] = {}
        try:
            while job.poll() is None:
                now = time.time()
                try:
                    ranks = http_json(agent.url + "/v1/ranks")["ranks"]
                except OSError as e:
                    print(f"poll failed: {e}", file=sys.stderr)
                    ranks = []
                for r in ranks:
                    if r.get("pid") and r["pid"] not in pids:
                        pids.append(r["pid"])
                    for s in r.get("recent") or []:
                        samples.setdefault(f"{r['rank']}:{s['restart']}:{s['step']}",
                                           dict(s, rank=r["rank"], seen=now))  # fmt: skip
                print(f"\rstep {max((r.get('step') or 0 for r in ranks), default=0)}/{steps}",
                      end="", file=sys.stderr, flush=True)  # fmt: skip
                time.sleep(POLL)
            print(file=sys.stderr)
            incidents = http_json(supervisor.url + "/v1/incidents")["incidents"]
        finally:
            end_launcher(job, grace=10)  # torchrun and its workers, by PID
            supervisor.stop()
            agent.stop()
    found = [(i["kind"], i["rank"], i["step_at_detect"]) for i in incidents]
    out.write_text(json.dumps({"steps": steps, "fault": fault, "noise": noise, "rc": job.returncode,
                               "samples": list(samples.values()), "incidents": incidents,
                               "bursts": bursts}))  # fmt: skip
    print(f"{out}: {len(samples)} samples, exit {job.returncode}, incidents {found}")


def _noise(job, pids, share, seed, bursts) -> None:
    rng = random.Random(seed)
    while job.poll() is None:
        time.sleep(rng.uniform(2, 6))
        if not pids:
            continue
        victim, length = rng.choice(pids), rng.uniform(2, 4)
        bursts.append((time.time(), victim, length))
        end = time.time() + length
        while time.time() < end and job.poll() is None:
            try:
                os.kill(victim, signal.SIGSTOP)
                time.sleep(0.1 * share)
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                break
            time.sleep(0.1 * (1 - share))


def replay(path: Path, cfg: DetectorConfig) -> tuple[list[tuple[int, int]], float]:
    """(the findings' (step, rank), first first; the highest excess over persist_seconds)."""
    per: dict[int, list[dict]] = {}
    for s in sorted(json.loads(path.read_text())["samples"], key=lambda s: s["step"]):
        per.setdefault(s["rank"], []).append(s)
    for series in per.values():  # a poll's batch: back from the poll by the step times
        for i in range(len(series) - 1, -1, -1):
            later = series[i + 1] if i + 1 < len(series) else None
            same = later is not None and later["seen"] == series[i]["seen"]
            series[i]["t"] = (
                later["t"] - later["step_seconds"] if same else series[i]["seen"] - 0.05
            )
    start = min(s["t"] for v in per.values() for s in v)
    end = max(s["seen"] for v in per.values() for s in v)
    peak, found, history = 0.0, [], History()
    judge = straggler._stands_out

    def watched(v, *args):
        nonlocal peak
        out = judge(v, *args)
        if v.excess_seconds >= cfg.straggler.persist_seconds:
            peak = max(peak, v.excess)
        return out

    straggler._stands_out = watched
    try:
        t = start
        while t <= end:
            ranks = tuple(_rank(r, [s for s in v if s["t"] <= t][-64:]) for r, v in per.items())
            node = NodeObs("node-a", "http://node-a", True, t, ranks=tuple(r for r in ranks if r))
            obs = ClusterObs(time=t, nodes=(node,))
            history = advance(history, obs, cfg)
            found += [(f.evidence["step"], f.rank) for f in straggler.detect(obs, history, cfg)]
            t += PASS
    finally:
        straggler._stands_out = judge
    return found, peak


def _rank(r: int, held: list[dict]) -> RankObs | None:
    if not held:
        return None
    recent = tuple(StepSample(s["step"], s["phase"], s["restart"], s["step_seconds"],
                              s["compute_seconds"], s["comm_seconds"], s["data_wait_seconds"],
                              s.get("loss"), s.get("compute_wait_seconds")) for s in held)  # fmt: skip
    last = held[-1]
    return RankObs(node="node-a", job="job", rank=r, world_size=2, pid=last.get("pid") or r,
                   restart=last["restart"], state="alive", step=last["step"], phase=last["phase"],
                   heartbeat_age_seconds=0.05, exited_at=None, step_seconds=last["step_seconds"],
                   compute_seconds=last["compute_seconds"], comm_seconds=last["comm_seconds"],
                   comm_compute_ratio=None, loss=last.get("loss"), checkpoint_step=None,
                   cpu_utilization=None, recent=recent)  # fmt: skip


def _settings(pairs: list[str]) -> DetectorConfig:
    base = DetectorConfig()
    fields = {f.name: f.type for f in dataclasses.fields(base.straggler)}
    changes = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in fields or not value:
            raise SystemExit(f"--set {pair!r}: expected key=value, key one of {sorted(fields)}")
        changes[key] = int(value) if fields[key] in (int, "int") else float(value)
    return dataclasses.replace(base, straggler=dataclasses.replace(base.straggler, **changes))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run the trainer supervised and keep its step samples")
    rec.add_argument("out", type=Path)
    rec.add_argument("--steps", type=int, default=120)
    rec.add_argument("--fault", help="a trainer fault, e.g. slow:step=60:rank=1:factor=1.2")
    rec.add_argument(
        "--noise", type=float, default=0.0, help="share of 100 ms a rank is stopped in a burst"
    )
    rec.add_argument("--seed", type=int, default=1)
    rep = sub.add_parser("replay", help="replay recorded runs through the detector")
    rep.add_argument("runs", type=Path, nargs="+")
    rep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="a [detectors.straggler] setting for the second column")  # fmt: skip
    args = ap.parse_args()
    if args.cmd == "record":
        if not 0 <= args.noise < 1:
            raise SystemExit("--noise must be in [0, 1)")
        record(args.out, args.steps, args.fault, args.noise, args.seed)
        return
    configs = {
        "defaults": DetectorConfig(),
        " ".join(args.set) or "defaults (again)": _settings(args.set),
    }
    print(
        "| run | recorded incidents | "
        + " | ".join(f"{k}: first (step, rank), ranks, peak excess" for k in configs)
        + " |"
    )
    print("|---|---|" + "---|" * len(configs))
    for path in args.runs:
        data = json.loads(path.read_text())
        recorded = (
            ", ".join(f"{i['kind']} r{i['rank']} @{i['step_at_detect']}" for i in data["incidents"])
            or "none"
        )
        cells = []
        for cfg in configs.values():
            found, peak = replay(path, cfg)
            first = f"{found[0]}" if found else "none"
            cells.append(f"{first}, {sorted({r for _, r in found})}, {peak:.2f}")
        print(f"| {path.name} | {recorded} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
