"""Recovery timings: SIGKILL and hang, supervised by rankguard vs plain torchrun.

    python bench/recovery.py [--steps 300] [--hang-wait 60] [--warm] [--out FILE]

Same trainer (tiny preset, 2 ranks, gloo, checkpoints every 10 steps), same faults:

- kill: rank 1 SIGKILLs itself at step 150 (the trainer's `crash` fault);
- hang: rank 1 stops progressing at step 150 (`hang`: alive, asleep, never reaching the
  all-reduce its peer waits in).

"rankguard" runs an agent and the supervisor beside torchrun and reads the incident's
timings (fault -> detected -> acted -> restarted -> first step). "plain" is
`torchrun --max-restarts 3` alone, timed from a telemetry sink: the fault time is the
last record before the gap, recovery is the first step record of the next incarnation.
Plain torchrun does not notice a hang before the collective timeout (30 min by default),
so that run is cut off after --hang-wait seconds and reported as not recovered.
"rankguard, warm start" (--warm) is rankguard with workers forked from a process that
imported torch once (trainer/warm.py) instead of started cold.
"+ tier 0" rows (--snapshot-every N, default 2; 0 leaves them out) add in-memory snapshots
every N steps: two `rankguard snapshot-holder` processes (A, the node's, replicating to B,
as a second node's would), so the restart resumes from the holder instead of the disk.

Each worker writes its startup milestones (RANKGUARD_STARTUP_TRACE), which split the
restart into teardown + respawn, imports, rendezvous (process-group init), model build +
checkpoint load, and the first step; each is the slowest rank's, as the group waits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rankguard.cli.local_stack import TelemetrySink, http_json, start_agent, start_supervisor
from rankguard.trainer.warm import start_server

FAULT_STEP = 150


def trainer_cmd(
    tmp: Path, steps: int, fault: str, warm: bool = False, extra: list[str] = ()
) -> list[str]:
    entry = ["rankguard.trainer.warm", "run"] if warm else ["rankguard.trainer"]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=3", "-m", *entry, "--preset", "tiny", "--steps", str(steps),
        "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", "10", "--log-every", "0", "--job", "bench",
        "--fault", f"{fault}:step={FAULT_STEP}:rank=1", *extra,
    ]  # fmt: skip


def _holder_up(path: Path) -> bool:
    from rankguard.contract.snapshots import request

    try:
        request(str(path), {"op": "status"}, timeout=1)
        return True
    except (OSError, EOFError):
        return False


@contextlib.contextmanager
def snapshot_holders(tmp: Path, every: int):
    """Holder A replicating to holder B (processes), when `every` > 0: the trainer's
    arguments for them, else []."""
    if not every:
        yield []
        return
    a, b = tmp / "holder-a.sock", tmp / "holder-b.sock"
    procs = []
    try:
        for path, peer in ((b, []), (a, ["--peer", str(b)])):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "rankguard.cli.main", "snapshot-holder", "run",
                 "--socket", str(path), *peer], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
            deadline = time.monotonic() + 30
            while not _holder_up(path):
                if time.monotonic() > deadline or procs[-1].poll() is not None:
                    raise RuntimeError(f"snapshot holder {path} did not start")
                time.sleep(0.05)
        yield ["--snapshot-every", str(every), "--snapshot-holder", str(a),
               "--snapshot-peers", str(b)]  # fmt: skip
    finally:
        for p in procs:
            p.terminate()
            p.wait()


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
            ):
                env = env_for(tmp, agent.socket)
                if warm_socket:
                    env["RANKGUARD_WARM_SOCKET"] = str(warm_socket)
                kind = "crash" if fault == "kill" else "hang"
                cmd = trainer_cmd(tmp, steps, kind, warm, extra)
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
                os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: our group only
                proc.wait()
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
           "lost_steps"]  # fmt: skip
HEADER = ("| fault | stack | detect s | act s | teardown + respawn s | imports s | rendezvous s "
          "| model + checkpoint load s | first step s | fault -> first new step s | lost steps |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--hang-wait", type=float, default=60)
    p.add_argument("--faults", default="kill,hang", help="comma-separated: kill, hang")
    p.add_argument("--warm", action="store_true", help="also run with trainer/warm.py")
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=2,
        help="the '+ tier 0' rows: in-memory snapshots every N steps (0: leave them out)",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = []
    for fault in args.faults.split(","):
        print(f"{fault}: rankguard ...", file=sys.stderr, flush=True)
        rows.append((fault, "rankguard", supervised(fault, args.steps)))
        print(f"{fault}: plain torchrun ...", file=sys.stderr, flush=True)
        rows.append((fault, "plain torchrun", plain(fault, args.steps, args.hang_wait)))
        if args.warm:
            print(f"{fault}: rankguard, warm start ...", file=sys.stderr, flush=True)
            rows.append((fault, "rankguard, warm start", supervised(fault, args.steps, True)))
        n = args.snapshot_every
        if n:
            t0 = f" + tier 0 (every {n})"
            print(f"{fault}: tier 0 rows ...", file=sys.stderr, flush=True)
            rows.append((fault, "rankguard" + t0, supervised(fault, args.steps, False, n)))
            if fault == "kill":  # plain torchrun never notices a hang: nothing to compare
                rows.append(
                    (fault, "plain torchrun" + t0, plain(fault, args.steps, args.hang_wait, n))
                )
            if args.warm:
                rows.append(
                    (fault, "rankguard, warm start" + t0, supervised(fault, args.steps, True, n))
                )
    lines = [HEADER, "|" + "---|" * (len(COLUMNS) + 2)]
    for fault, stack, r in rows:
        if not r["ok"]:
            lines.append(
                f"| {fault} | {stack} | {r.get('note', 'failed')} |" + " |" * (len(COLUMNS) - 1)
            )
            continue
        lines.append(f"| {fault} | {stack} | " + " | ".join(fmt(r.get(c)) for c in COLUMNS) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(
            f"Command: `python bench/recovery.py {' '.join(sys.argv[1:])}`\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
