"""Predictive drain against a crash: a GPU that degrades, then fails, under a 3-node job.

    python bench/predictive_drain.py [--repeats N] [--out bench/results/predictive_drain.md]

Three "nodes" on this machine (an agent each, on its own NVML double and telemetry socket,
one torchrun each with one rank, c10d rendezvous with 2 to 3 nodes) and one supervisor.
The bundled trainer saves every `--ckpt-every` steps. Once the job is past its first
checkpoint, node 2's GPU is replayed degrading: correctable ECC errors piling up with a row
remap pending (the agent's trend: `gpu_failing`), then `--xid-after` seconds later XID 48
(a double-bit ECC error: drain the node). Each repeat runs twice, side by side:

- **on**: `predictive_drain = true`. The supervisor asks the job to save about ten seconds
  ahead, waits for that checkpoint, and excludes the node: the job goes on with two nodes
  from the state saved at the drain.
- **off**: the prediction is only reported; XID 48 excludes the node as a critical
  hardware fault, and the job goes on from its newest scheduled checkpoint.

Per run: the step the old incarnation reached, the step the new one resumed from, their
difference (steps trained again), and the wall time of the job. Same-host "nodes" share
the host's cores and network, which the real thing does not; the exclusion, the save and
the re-rendezvous are the real code paths (`tests/system/test_multinode.py` runs the
same drain in network namespaces). The trend's false drains on clean fleets are not
measured here: the NVML double's clean GPU is static, and measuring them needs recorded
telemetry of real GPUs.
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

from rankguard.agent.nvml_double import make_double, write_state
from rankguard.cli.local_stack import (
    end_launcher,
    free_port,
    http_json,
    start_agent,
    start_supervisor,
    wait_until,
)

NODES = 3
VICTIM = 2
RDZV = "last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3"
# global batch 12 = 3 nodes x 2 micro x 2 accumulation = 2 nodes x 2 micro x 3 accumulation
TRAIN = ["--preset", "tiny", "--log-every", "0", "--global-batch", "12", "--micro-batch", "2",
         "--keep", "0"]  # fmt: skip


def degrading() -> dict:
    rows = {"correctable": 3, "uncorrectable": 0, "pending": True, "failure": False}
    return make_double(n_gpus=1, ecc={"corrected": 400, "uncorrected": 0}, remapped_rows=rows)


def failed() -> dict:
    state = degrading()
    state["xid_events"] = [{"gpu": 0, "xid": 48}]
    return state


def run_once(tmp: Path, drain: bool, args) -> dict:
    """One job under the replay; what it lost and how long it took."""
    agents, launchers, states = [], [], []
    config = tmp / "supervisor.toml"
    config.write_text(f"[policy]\npredictive_drain = {str(drain).lower()}\n")
    sup = None
    try:
        for i in range(NODES):
            state = tmp / f"node{i}-nvml.json"
            write_state(state, make_double(n_gpus=1))
            states.append(state)
            agents.append(start_agent(tmp, f"node{i}", extra=[
                "--nvml-double", str(state), "--expected-gpus", "1"]))  # fmt: skip
        for a in agents:
            wait_until(lambda a=a: http_json(a.url + "/healthz")["ok"], 60, "agent")
        sup = start_supervisor(tmp, [a.url for a in agents], extra=["--config", str(config)])
        port = free_port()
        start = time.monotonic()
        for i in [*range(1, NODES), 0]:  # the rendezvous host last: the others wait for it
            conf = f"is_host={int(i == 0)},{RDZV}"
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", f"2:{NODES}",
                "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
                "--rdzv-conf", conf, "--monitor-interval", "0.1",
                "-m", "rankguard.trainer", *TRAIN, "--job", "job", "--steps", str(args.steps),
                "--ckpt-every", str(args.ckpt_every), "--ckpt-dir", str(tmp / "ckpt"),
                "--summary", str(tmp / "summary.json"),
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1",
                   "RANKGUARD_TELEMETRY_SOCKET": str(agents[i].socket),
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
            with open(tmp / f"torchrun-{i}.log", "w") as log:
                launchers.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log,
                                                  start_new_session=True))  # fmt: skip
        reached: dict[int, int] = {}  # restart -> newest step seen

        def look() -> dict:
            ranks = http_json(agents[0].url + "/v1/ranks", timeout=5)["ranks"]
            for r in ranks:
                if r["step"]:
                    reached[r["restart"]] = max(reached.get(r["restart"], 0), r["step"])
            return next((r for r in ranks if r["state"] == "alive"), {})

        try:
            wait_until(lambda: (look().get("checkpoint_step") or 0) >= args.ckpt_every, 300,
                       "the first checkpoint")  # fmt: skip
        except AssertionError:
            tail = (tmp / "torchrun-0.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"no checkpoint; steps seen {reached}; node0:\n{tail}") from None
        write_state(states[VICTIM], degrading())
        degraded_at = time.time()
        failed_at = time.monotonic() + args.xid_after
        while any(p.poll() is None for p in launchers[:VICTIM]):
            if failed_at and time.monotonic() >= failed_at:
                write_state(states[VICTIM], failed())
                failed_at = 0
            with contextlib.suppress(Exception):
                look()
            if time.monotonic() - start > args.timeout:
                raise RuntimeError(f"the job did not end within {args.timeout}s")
            time.sleep(0.2)
        wall = time.monotonic() - start
        codes = [p.returncode for p in launchers[:VICTIM]]
        for i, code in enumerate(codes):
            if code:
                tail = (tmp / f"torchrun-{i}.log").read_text(errors="replace")[-3000:]
                print(f"node{i}'s torchrun exited {code}:\n{tail}", file=sys.stderr)
        summary = json.loads((tmp / "summary.json").read_text())
        incidents = http_json(sup.url + "/v1/incidents")["incidents"]
        faults = [i for i in incidents if i["kind"] == "node_fault" and i["actions"]]
        faults.sort(key=lambda i: i["actions"][0]["requested_at"])
        asked = [e["detail"].get("job", {}).get("step") for i in incidents
                 for e in i["events"] if e["what"] == "save requested"]  # fmt: skip
        old = reached.get(0, 0)
        resumed = summary.get("resumed_from")
        return {
            "drain": drain, "exit_codes": codes, "wall_seconds": round(wall, 1),
            "final_step": summary.get("final_step"), "world_size": summary.get("world_size"),
            "old_reached": old, "resumed_from": resumed,
            "steps_again": None if resumed is None else max(0, old - resumed),
            "excluded_by": [i["key"].rsplit(":", 1)[-1] for i in faults],
            "excluded_after_s": [round(i["actions"][0]["requested_at"] - degraded_at, 1)
                                 for i in faults],
            "save_asked_at_step": asked[0] if asked else None,
            "action_reason": [i["action_reason"] for i in faults],
        }  # fmt: skip
    finally:
        for p in launchers:
            with contextlib.suppress(Exception):
                end_launcher(p, grace=10)
        for d in [*agents, *([sup] if sup else [])]:
            with contextlib.suppress(Exception):
                d.stop()


def report(rows: list[dict], command: str) -> str:
    lines = [
        "# Predictive drain against a crash (3 same-host nodes, node 2's GPU degrading)",
        "",
        f"    {command}",
        "",
        "| run | drain | excluded by (s after the degradation) | save asked at step | resumed "
        "from | old incarnation reached | steps trained again | job wall (s) | final step, "
        "world |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, r in enumerate(rows):
        excluded = ", ".join(f"{why} ({t:g})" for why, t in
                             zip(r["excluded_by"], r["excluded_after_s"], strict=True))  # fmt: skip
        lines.append(
            f"| {k // 2 + 1} | {'on' if r['drain'] else 'off'} | {excluded} "
            f"| {r['save_asked_at_step']} | {r['resumed_from']} | {r['old_reached']} "
            f"| {r['steps_again']} | {r['wall_seconds']} | {r['final_step']}, {r['world_size']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs (on, off)")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--ckpt-every", type=int, default=400, help="the job's scheduled saves")
    p.add_argument("--xid-after", type=float, default=25.0,
                   help="seconds from the degradation to XID 48")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--drain", choices=["both", "on", "off"], default="both",
                   help="run both ways (default) or one")  # fmt: skip
    p.add_argument("--keep", type=Path, help="run in this folder and keep it (logs, database)")
    p.add_argument("--out", type=Path, help="write the table here (markdown)")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    args = p.parse_args()
    rows = []
    for _ in range(args.repeats):
        for drain in {"both": (True, False), "on": (True,), "off": (False,)}[args.drain]:
            if args.keep:
                tmp = args.keep / f"run{len(rows)}"
                tmp.mkdir(parents=True)
                row = run_once(tmp, drain, args)
            else:
                with tempfile.TemporaryDirectory(prefix="rg-drain-") as tmp:
                    row = run_once(Path(tmp), drain, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    command = "python bench/predictive_drain.py " + " ".join(sys.argv[1:])
    text = report(rows, command.strip())
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
