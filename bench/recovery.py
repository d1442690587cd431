"""Recovery timings: SIGKILL and hang, supervised by rankguard vs plain torchrun.

    python bench/recovery.py [--stacks plain,rankguard,warm+t0] [--faults kill,hang]
        [--steps 200] [--fault-step 120] [--snapshot-every 2] [--hang-wait 30] [--out FILE]

Same trainer (tiny preset, 2 ranks, gloo, disk checkpoints every 10 steps), same faults:

- kill: rank 1 SIGKILLs itself at --fault-step (the trainer's `crash` fault);
- hang: rank 1 stops progressing at --fault-step (`hang`: alive, asleep, never reaching the
  all-reduce its peer waits in).

Stacks (`--stacks`, comma-separated, run in this order for each fault):

- plain: `torchrun --max-restarts 3` alone, timed from a telemetry sink: the fault time is
  the last record before the gap, recovery is the first step record of the next
  incarnation. Plain torchrun does not notice a hang before the collective timeout (30 min
  by default), so that run is cut off after --hang-wait seconds and reported as not
  recovered. Its cold restart after a kill is the reference of the ratio column.
- rankguard: an agent and the supervisor beside torchrun; timings from the incident
  (fault -> detected -> acted -> restarted -> first step); workers started cold; torchrun
  on `--rdzv-backend rankguard` against a `rankguard rendezvous` store, as `rankguard up`
  runs it.
- warm: rankguard with workers forked from a process that imported torch once
  (trainer/warm.py), as `rankguard up` does by default.
- "+t0" on any of them (plain+t0, rankguard+t0, warm+t0): in-memory snapshots every
  --snapshot-every steps into two `rankguard snapshot-holder` processes (A, the node's,
  replicating to B, as a second node's would), so the restart resumes from the holder.

Each worker writes its startup milestones (RANKGUARD_STARTUP_TRACE), which split the
restart into teardown + respawn, imports, rendezvous (process-group init), model build +
state load, and the first step; each is the slowest rank's, as the group waits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rankguard.cli.local_stack import (
    SnapshotHolders,
    TelemetrySink,
    end_launcher,
    http_json,
    rendezvous_store,
    start_agent,
    start_supervisor,
)
from rankguard.trainer.warm import start_server

FAULT_STEP = 120  # --fault-step's default


def trainer_cmd(
    tmp: Path,
    steps: int,
    fault: str,
    warm: bool = False,
    extra: list[str] = (),
    rendezvous: list[str] | None = None,
) -> list[str]:
    """`rendezvous`: torchrun's flags for `rankguard rendezvous` (`--rdzv-backend
    rankguard`), as `rankguard up` runs it; plain torchrun's own `--standalone` without."""
    entry = ["rankguard.trainer.warm", "run"] if warm else ["rankguard.trainer"]
    rdzv = ["--nnodes=1", *rendezvous] if rendezvous else ["--standalone"]
    return [
        sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node=2",
        "--max-restarts=3", "-m", *entry, "--preset", "tiny", "--steps", str(steps),
        "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", "10", "--log-every", "0", "--job", "bench",
        "--fault", f"{fault}:step={FAULT_STEP}:rank=1", *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def snapshot_holders(tmp: Path, every: int):
    """The trainer's flags for holder A replicating to holder B when `every` > 0, else []."""
    if not every:
        yield []
        return
    with SnapshotHolders(tmp, every) as holders:
        yield holders.args


def trace_milestones(path: Path, restart: int) -> dict[str, float]:
    """Per startup milestone of one incarnation, the time the slowest rank reached it:
    the group goes on only when every rank has."""
    out: dict[str, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        m = json.loads(line)
        if m["restart"] == restart:
            out[m["event"]] = max(out.get(m["event"], 0.0), m["time"])
    return out


def breakdown(since: float, m: dict[str, float]) -> dict:
    """The restart's phases from `since` (the moment the old workers were doomed: detection
    or our kill; the fault itself for plain torchrun) to the first new step."""
    order = ["process_start", "imported", "process_group", "resumed", "first_step"]
    if any(e not in m for e in order):
        return {}
    return {
        "teardown": m["process_start"] - since,  # notice, stop the old group, spawn
        "imports": m["imported"] - m["process_start"],  # interpreter + torch import
        "rendezvous": m["process_group"] - m["imported"],  # c10d store + gloo init
        "load": m["resumed"] - m["process_group"],  # model build + checkpoint load
        "first_step": m["first_step"] - m["resumed"],
    }


def env_for(tmp: Path, socket_path: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "RANKGUARD_TELEMETRY_SOCKET": str(socket_path),
            "RANKGUARD_STARTUP_TRACE": str(tmp / "trace.jsonl")}  # fmt: skip


@contextlib.contextmanager
def warm_server(tmp: Path, enabled: bool):
    """The warm-start server (trainer/warm.py), when asked for: its socket, else None."""
    if not enabled:
        yield None
        return
    path = tmp / "warm.sock"
    server = start_server(path, {**os.environ, "OMP_NUM_THREADS": "1"}, subprocess.DEVNULL)
    try:
        yield path
    finally:
        server.terminate()
        server.wait()


def supervised(fault: str, steps: int, warm: bool = False, snapshot_every: int = 0) -> dict:
    with tempfile.TemporaryDirectory(prefix="rg-recovery-") as d:
        tmp = Path(d)
        agent = start_agent(tmp)
        sup = start_supervisor(tmp, [agent.url])
        try:
            with (
                warm_server(tmp, warm) as warm_socket,
                snapshot_holders(tmp, snapshot_every) as extra,
                rendezvous_store(tmp, "bench") as rendezvous,
            ):
                env = env_for(tmp, agent.socket)
                if warm_socket:
                    env["RANKGUARD_WARM_SOCKET"] = str(warm_socket)
                kind = "crash" if fault == "kill" else "hang"
                cmd = trainer_cmd(tmp, steps, kind, warm, extra, rendezvous)
                proc = subprocess.run(cmd, env=env, capture_output=True, timeout=600)
            time.sleep(0.5)
            kind = "rank_dead" if fault == "kill" else "rank_hung"
            incs = [
                i for i in http_json(sup.url + "/v1/incidents")["incidents"] if i["kind"] == kind
            ]
            milestones = trace_milestones(tmp / "trace.jsonl", 1)
        finally:
            sup.stop()
            agent.stop()
    if proc.returncode != 0 or not incs:
        return {"ok": False}
    i = incs[-1]
    doomed = i["acted_at"] or i["detected_at"]
    return {
        "ok": True,
        "detect": i["phases"].get("detect"),
        "act": i["phases"].get("act"),
        **breakdown(doomed, milestones),
        "recover": i["time_to_recover"],
        "lost_steps": i["lost_steps"],
    }


def plain(fault: str, steps: int, hang_wait: float, snapshot_every: int = 0) -> dict:
    with tempfile.TemporaryDirectory(prefix="rg-recovery-") as d:
        tmp = Path(d)
        sock = tmp / "t.sock"
        with TelemetrySink(sock) as sink, snapshot_holders(tmp, snapshot_every) as extra:
            kind = "crash" if fault == "kill" else "hang"
            proc = subprocess.Popen(trainer_cmd(tmp, steps, kind, extra=extra),
                                    env=env_for(tmp, sock), start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            try:
                proc.wait(timeout=hang_wait + 60 if fault == "kill" else hang_wait + 20)
            except subprocess.TimeoutExpired:
                end_launcher(proc)  # torchrun and its workers, by PID
                return {"ok": False, "note": f"not recovered within {hang_wait:.0f} s"}
            records = list(sink.records)
        milestones = trace_milestones(tmp / "trace.jsonl", 1)
    first = [r for r in records if r.restart == 0 and r.step_seconds > 0]
    second = [r for r in records if r.restart == 1 and r.step_seconds > 0]
    if not first or not second:
        return {"ok": False}
    fault_at = max(r.time for r in first if r.rank == 1)
    return {"ok": True, **breakdown(fault_at, milestones),
            "recover": min(r.time for r in second) - fault_at,
            "lost_steps": max(r.step for r in first) - (min(r.step for r in second) - 1)}  # fmt: skip


def fmt(v) -> str:
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


COLUMNS = ["detect", "act", "teardown", "imports", "rendezvous", "load", "first_step", "recover",
           "ratio", "lost_steps"]  # fmt: skip
HEADER = ("| fault | stack | detect s | act s | teardown + respawn s | imports s | rendezvous s "
          "| model build + state load s | first step s | fault -> first new step s "
          "| vs plain torchrun's cold restart | lost steps |")  # fmt: skip
STACKS = {"plain": ("plain torchrun", False), "rankguard": ("rankguard", False),
          "warm": ("rankguard, warm start", True)}  # fmt: skip


def run_stack(stack: str, fault: str, args) -> dict:
    base, _, t0 = stack.partition("+")
    n = args.snapshot_every if t0 == "t0" else 0
    if base == "plain":
        return plain(fault, args.steps, args.hang_wait, n)
    return supervised(fault, args.steps, STACKS[base][1], n)


def stack_name(stack: str, every: int) -> str:
    base, _, t0 = stack.partition("+")
    return STACKS[base][0] + (f" + tier 0 (every {every})" if t0 else "")


def main() -> None:
    global FAULT_STEP
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--fault-step", type=int, default=FAULT_STEP)
    p.add_argument("--hang-wait", type=float, default=30)
    p.add_argument("--faults", default="kill,hang", help="comma-separated: kill, hang")
    p.add_argument("--stacks", default="plain,rankguard,warm+t0",
                   help="comma-separated: plain, rankguard, warm, each optionally +t0")  # fmt: skip
    p.add_argument("--snapshot-every", type=int, default=2,
                   help="the +t0 stacks: in-memory snapshots every N steps")  # fmt: skip
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    stacks = [x.strip() for x in args.stacks.split(",") if x.strip()]
    bad = [
        x
        for x in stacks
        if x.partition("+")[0] not in STACKS or x.partition("+")[2] not in ("", "t0")
    ]
    faults = args.faults.split(",")
    if bad or not stacks or any(f not in ("kill", "hang") for f in faults):
        p.error("--stacks: plain, rankguard, warm (each optionally +t0); --faults: kill, hang")
    if not 10 < args.fault_step < args.steps or args.snapshot_every < 1:
        p.error("--fault-step must be in (10, --steps); --snapshot-every >= 1")
    FAULT_STEP = args.fault_step
    rows = []
    for fault in faults:
        for stack in stacks:
            name = stack_name(stack, args.snapshot_every)
            print(f"{fault}: {name} ...", file=sys.stderr, flush=True)
            rows.append((fault, stack, name, run_stack(stack, fault, args)))
    # the reference: plain torchrun's cold restart after a kill, in this same run
    ref = next(
        (r["recover"] for f, st, _, r in rows if f == "kill" and st == "plain" and r["ok"]), None
    )
    lines = [HEADER, "|" + "---|" * (len(COLUMNS) + 2)]
    for fault, _, name, r in rows:
        if not r["ok"]:
            lines.append(
                f"| {fault} | {name} | {r.get('note', 'failed')} |" + " |" * (len(COLUMNS) - 1)
            )
            continue
        r["ratio"] = f"{r['recover'] / ref:.2f}x" if ref else None
        lines.append(f"| {fault} | {name} | " + " | ".join(fmt(r.get(c)) for c in COLUMNS) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(
            f"Command: `python bench/recovery.py {' '.join(sys.argv[1:])}`\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
