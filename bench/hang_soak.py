"""Hang soak: each kind of hang, many times, in both wait modes; is the right rank named,
and how fast?

    python bench/hang_soak.py [--kinds hang,native-stall,data-stall,stop]
        [--modes block,spin] [--runs 10] [--fault-step 30] [--out bench/results/hang_soak.md]

Each run: a real agent and supervisor beside torchrun (2 ranks, gloo, the bundled
trainer's tiny preset), rank 1 made to hang at --fault-step:

- hang: stuck in Python before its collective (asleep);
- native-stall: stuck in native code, spinning (as a rank whose CUDA sync waits on a stuck
  kernel);
- data-stall: stuck waiting for its data (a loader that never delivers);
- stop: SIGSTOPped from outside;
- clean (not in the default --kinds): no fault, CLEAN_STEPS steps to the end; right when
  the supervisor raised no incident at all.

Modes (the trainer's `--wait-mode`): block, the peer waits asleep in gloo; spin, the peer
busy-polls its collectives as an NCCL rank spins in a CUDA sync.

A run is right when the first incident names rank 1; its time to detect is the incident's
(detected - the last progress the detector saw). The bound is the issue's: max(2 s, 3x the
step time). The run is ended after its incident (or after --wait seconds without one).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rankguard.cli.local_stack import end_launcher, http_json, start_agent, start_supervisor

KINDS = ("hang", "native-stall", "data-stall", "stop")
CLEAN_STEPS = 500
MODES = ("block", "spin")
HANG_KINDS = ("rank_hung", "data_stall")


def trainer_cmd(tmp: Path, kind: str, mode: str, step: int) -> list[str]:
    fault, steps = [], "100000"
    if kind == "clean":
        steps = str(CLEAN_STEPS)
    elif kind != "stop":
        seconds = ":seconds=600" if kind == "data-stall" else ""
        fault = ["--fault", f"{kind}:step={step}:rank=1{seconds}"]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=0", "-m", "rankguard.trainer", "--preset", "tiny", "--steps", steps,
        "--log-every", "0", "--job", "soak", "--wait-mode", mode, *fault,
    ]  # fmt: skip


def one_run(kind: str, mode: str, step: int, wait: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="rg-hang-soak-") as d:
        tmp = Path(d)
        agent = start_agent(tmp)
        sup = start_supervisor(tmp, [agent.url])
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RANKGUARD_TELEMETRY_SOCKET": str(agent.socket),
        }
        proc = subprocess.Popen(trainer_cmd(tmp, kind, mode, step), env=env,
                                start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            return _watch(kind, step, wait, agent.url, sup.url, proc)
        finally:
            end_launcher(proc, grace=5)
            sup.stop()
            agent.stop()


def _clean(sup_url: str, proc) -> dict:
    """A run without a fault, to its end: right when nothing was raised."""
    started = time.monotonic()
    code = proc.wait(timeout=900)
    time.sleep(1.0)  # one more pass after the end
    incs = http_json(sup_url + "/v1/incidents")["incidents"]
    return {"ok": code == 0 and not incs, "rank": None, "detect": None,
            "note": f"exit {code} after {time.monotonic() - started:.0f} s, "
                    f"incidents {[i['kind'] for i in incs]}"}  # fmt: skip


def _watch(kind: str, step: int, wait: float, agent_url: str, sup_url: str, proc) -> dict:
    if kind == "clean":
        return _clean(sup_url, proc)
    deadline = time.monotonic() + wait + 120  # start-up and the steps before the fault
    stopped = False
    while time.monotonic() < deadline and proc.poll() is None:
        if kind == "stop" and not stopped:
            ranks = _ranks(agent_url)
            victim = next((r for r in ranks if r["rank"] == 1 and (r["step"] or 0) >= step), None)
            if victim is not None:
                os.kill(victim["pid"], signal.SIGSTOP)
                stopped, deadline = True, time.monotonic() + wait
        incs = [i for i in http_json(sup_url + "/v1/incidents")["incidents"]
                if i["kind"] in HANG_KINDS]  # fmt: skip
        named = next((i for i in incs if i.get("rank") is not None), None)
        if named is not None:
            ev = named.get("evidence") or {}
            return {
                "ok": named["rank"] == 1,
                "kind": named["kind"],
                "rank": named["rank"],
                "detect": named.get("time_to_detect"),
                "step_seconds": ev.get("p99_step_seconds"),
                "decided_by": ev.get("decided_by"),
                "culprit_reason": ev.get("culprit_reason"),
                "wavefront": (ev.get("wavefront") or {}).get("verdict"),
            }
        time.sleep(0.2)
    return {"ok": False, "rank": None, "detect": None, "note": "no culprit named in time"}


def _ranks(url: str) -> list[dict]:
    try:
        return http_json(url + "/v1/ranks", timeout=2)["ranks"]
    except OSError:
        return []


def summarise(kind: str, mode: str, runs: list[dict]) -> dict:
    right = [r for r in runs if r["ok"]]
    detect = [r["detect"] for r in right if r["detect"] is not None]
    steps = [r["step_seconds"] for r in right if r.get("step_seconds")]
    bound = max(2.0, 3 * statistics.median(steps)) if steps else 2.0
    return {
        "kind": kind, "mode": mode, "runs": len(runs), "right": len(right),
        "within_bound": sum(1 for t in detect if t <= bound), "bound": bound,
        "wavefront": sum(1 for r in right if r.get("wavefront")),
        "median_detect": statistics.median(detect) if detect else None,
        "max_detect": max(detect) if detect else None,
        "how": sorted({str(r.get("culprit_reason", ""))[:60] for r in right}),
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    out = ["| hang | wait mode | right rank | within bound | bound s | median detect s "
           "| max detect s | with a wavefront |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        med = "-" if r["median_detect"] is None else f"{r['median_detect']:.2f}"
        top = "-" if r["max_detect"] is None else f"{r['max_detect']:.2f}"
        out.append(f"| {r['kind']} | {r['mode']} | {r['right']} of {r['runs']} "
                   f"| {r['within_bound']} of {r['runs']} | {r['bound']:.1f} | {med} | {top} "
                   f"| {r.get('wavefront', 0)} of {r['runs']} |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--fault-step", type=int, default=30)
    p.add_argument("--wait", type=float, default=60.0, help="seconds after the fault")
    p.add_argument("--out", type=Path, default=None, help="write the table (and .json) here")
    args = p.parse_args()
    rows, raw = [], {}
    for kind in args.kinds.split(","):
        for mode in args.modes.split(","):
            runs = []
            for n in range(args.runs):
                runs.append(one_run(kind, mode, args.fault_step, args.wait))
                r = runs[-1]
                print(f"{kind} {mode} run {n + 1}: rank {r['rank']} in {r['detect']} s "
                      f"({r.get('culprit_reason') or r.get('note')})", file=sys.stderr, flush=True)  # fmt: skip
            rows.append(summarise(kind, mode, runs))
            raw[f"{kind}/{mode}"] = runs
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "runs": raw}, indent=1))


if __name__ == "__main__":
    main()
