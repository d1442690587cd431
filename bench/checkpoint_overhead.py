"""Checkpoint cost: throughput with disk checkpoints (asynchronous or synchronous) and
tier-0 snapshots, against no checkpoints, side by side in one run.

    python bench/checkpoint_overhead.py [--repeats 5] [--steps 60] [--every 10]
        [--snapshot-every 2,5] [--keyed] [--backup] [--process] [--out FILE]

Each configuration is the real trainer under torchrun (2 ranks, gloo on CPU, NCCL where
a GPU is), its workers forked from one warm server (trainer/warm.py; `--cold` starts them
as new interpreters), which only shortens each run's start. A repeat runs every configuration once, in an order rotated from repeat to
repeat, so drift on a shared machine and the position in the round hit all of them alike.
Throughput is the steady state: tokens per step over the *mean* step time after the
first 3 steps (warm-up left out; a mean, so the steps that save count), rank 0's, read
from the trainer's summary. Each configuration's ratio is paired: against the
no-checkpoint run of the same repeat; the table gives the median ratio and its min-max
over the repeats, so a difference inside that spread is noise.

Rows: "async" and "sync" disk checkpoints every --every steps; "async + tier 0 every N"
adds in-memory snapshots every N steps (two `rankguard snapshot-holder` processes, A
replicating to B, as two nodes' holders). ``--keyed`` adds async saves with a manifest key
(SHA-256 instead of CRC-32); ``--backup`` async saves with the backup tier on;
``--process`` async saves through DCP's writer process. A second table splits a disk
save's time (rank 0, ms per save) into staging wait, DCP write, fsync + checksum and the
commit exchange. "holders' CPU per snapshot" is the CPU time both holder processes used
over the run (receiving, replicating, keeping) divided by the snapshot steps: a cost that
the machine's noise does not move.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rankguard.cli.local_stack import SnapshotHolders, end_launcher
from rankguard.contract.secrets import new_secret_file
from rankguard.trainer.warm import start_server


def run(mode: str, args, workdir: Path) -> dict:
    summary = workdir / f"{mode}.json"
    ckpt = workdir / "ckpt"
    backup = workdir / "backup"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.nproc}", "-m", *args.entry,
        "--preset", args.preset, "--steps", str(args.steps), "--log-every", "0",
        "--summary", str(summary), "--no-resume", *args.model_args,
    ]  # fmt: skip
    disk, _, tier0 = mode.partition(" + tier 0 every ")
    if disk != "none":
        cmd += ["--ckpt-dir", str(ckpt), "--ckpt-every", str(args.every),
                "--ckpt-mode", disk.split("-")[0], "--keep", "1"]  # fmt: skip
    if disk == "async-keyed":
        key = workdir / "key"
        new_secret_file(key)
        cmd += ["--ckpt-key-file", str(key)]
    if disk == "async-process":
        cmd += ["--ckpt-writer", "process"]
    if disk == "async-backup":
        cmd += ["--ckpt-backup", str(backup), "--backup-keep", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKGUARD_TELEMETRY_SOCKET": "off",
           **args.entry_env}  # fmt: skip
    holders = SnapshotHolders(workdir, int(tier0)) if tier0 else None
    # its own session: a bench stopped mid-run (SIGTERM) takes torchrun's workers with it
    proc = subprocess.Popen(cmd + (holders.args if holders else []), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    holder_cpu = 0.0
    try:
        _, proc.stderr_text = proc.communicate()
    finally:
        end_launcher(proc, grace=10)
        if holders:
            holder_cpu = holders.cpu_seconds()
            holders.close()
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed:\n{proc.stderr_text[-3000:]}")
    s = json.loads(summary.read_text())
    s["holder_cpu_seconds"] = holder_cpu
    subprocess.run(["rm", "-rf", str(ckpt), str(backup)])
    return s


def tokens_per_second(r: dict) -> float:
    """Steady-state tokens/s of the whole job, from rank 0's mean step time."""
    return r["steady_tokens_per_second"]


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model-args", default="--d-model 384 --n-layer 6 --n-head 6 --seq-len 128",
                   help="extra trainer flags that size the model")  # fmt: skip
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--snapshot-every", default="2,5",
                   help="comma-separated N: rows with async saves + tier-0 snapshots every N ('' none)")  # fmt: skip
    p.add_argument("--no-sync", action="store_true", help="leave the synchronous row out")
    p.add_argument("--keyed", action="store_true", help="add async saves with a manifest key")
    p.add_argument("--backup", action="store_true", help="add async saves with a backup tier")
    p.add_argument("--process", action="store_true", help="add async saves by DCP's writer process")
    p.add_argument("--cold", action="store_true",
                   help="start every worker cold (default: forked from a warm server, "
                   "trainer/warm.py: the runs skip `import torch`; training is the same)")  # fmt: skip
    p.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on the way out
    args.model_args = args.model_args.split()
    try:
        tier0 = [int(n) for n in args.snapshot_every.split(",") if n.strip()]
    except ValueError:
        p.error(f"--snapshot-every: comma-separated integers, not {args.snapshot_every!r}")
    if (
        args.repeats < 1
        or args.steps < 5
        or args.every < 1
        or args.nproc < 1
        or any(n < 1 for n in tier0)
    ):
        p.error("--repeats, --every, --nproc, --snapshot-every must be >= 1, --steps >= 5")

    modes = ["none", "async"] + ([] if args.no_sync else ["sync"])
    modes += [f"async + tier 0 every {n}" for n in tier0]
    modes += [m for m, on in (("async-keyed", args.keyed), ("async-backup", args.backup),
                              ("async-process", args.process)) if on]  # fmt: skip
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="rg-bench-", dir=os.environ.get("BENCH_DIR"))
        )
        args.entry, args.entry_env = ["rankguard.trainer"], {}
        if not args.cold:  # one torch import for all runs, not one per worker per run
            sock = Path(tmp) / "warm.sock"
            server = start_server(sock, {**os.environ, "OMP_NUM_THREADS": "1"}, subprocess.DEVNULL)
            stack.callback(lambda: (server.terminate(), server.wait()))
            args.entry, args.entry_env = (
                ["rankguard.trainer.warm", "run"],
                {"RANKGUARD_WARM_SOCKET": str(sock)},
            )
        for i in range(args.repeats):
            order = modes[i % len(modes) :] + modes[: i % len(modes)]
            for mode in order:
                print(f"[{i + 1}/{args.repeats}] {mode} ...", file=sys.stderr, flush=True)
                results[mode].append(run(mode, args, Path(tmp)))
            # after every repeat: a run cut short still leaves the repeats it finished
            table = render(results, modes, args, i + 1)
            if args.out:
                args.out.write_text(
                    f"Command: `python bench/checkpoint_overhead.py {' '.join(sys.argv[1:])}`"
                    f"\n\n{table}\n"
                )
    print(table)


def render(results: dict[str, list[dict]], modes: list[str], args, repeats: int) -> str:
    base = results["none"]
    first = base[0]
    lines = [
        f"model: {first['num_params'] / 1e6:.1f}M parameters, {args.nproc} ranks, {args.steps} "
        f"steps ({first['steady_steps']} timed after warm-up), disk checkpoint every {args.every}; "
        f"{repeats} repeats, order rotated per repeat; median (min-max) over the repeats",
        "",
        "| configuration | tokens/s | throughput vs no checkpoints (paired) | blocking per step (ms) | blocking per disk save (ms) | holders' CPU per snapshot (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for mode in modes:
        runs = results[mode]
        ratios = [
            tokens_per_second(r) / tokens_per_second(b) for r, b in zip(runs, base, strict=True)
        ]
        per_step = [1e3 * r["checkpoint_block_seconds"] / r["steps_trained"] for r in runs]
        per_save = [
            1e3 * r["checkpoint_block_seconds"] / r["checkpoint_saves"]
            for r in runs
            if r["checkpoint_saves"] and not r["snapshot_saves"]
        ]
        name = (
            "no checkpoints"
            if mode == "none"
            else mode.replace("async + ", f"async every {args.every} + ")
        )
        if mode in ("async", "sync") or mode.startswith("async-"):
            name = f"{mode} every {args.every}"
        # both holders (the node's and its peer's replica), all ranks' snapshots of a step
        holder_cpu = [1e3 * r["holder_cpu_seconds"] / r["snapshot_saves"]
                      for r in runs if r["snapshot_saves"]]  # fmt: skip
        lines.append(
            f"| {name} | {spread([tokens_per_second(r) for r in runs], ',.0f')} | "
            f"{spread(ratios, '.3f')} | {spread(per_step, '.1f')} | "
            f"{spread(per_save, '.1f') if per_save else '-'} | "
            f"{spread(holder_cpu, '.0f') if holder_cpu else '-'} |"
        )

    def part(mode, name):  # rank 0's save thread, ms per save
        return statistics.median(
            1e3 * r.get(f"checkpoint_{name}_seconds", float("nan")) / r["checkpoint_saves"]
            for r in results[mode]
        )

    lines += [
        "",
        "Where a disk save's time goes (rank 0, ms per save, median; async: in the save thread,"
        " beside training; sync: blocking training):",
        "",
        "| configuration | checksum | staging wait | DCP write | fsync + checksum | commit exchange |",
        "|---|---|---|---|---|---|",
    ]
    for mode in [m for m in modes if m != "none"]:
        algo = results[mode][0].get("checkpoint_checksum", "?")
        lines.append(
            f"| {mode} | {algo} | {part(mode, 'stage'):.1f} | {part(mode, 'write'):.1f} | "
            f"{part(mode, 'hash'):.1f} | {part(mode, 'commit'):.1f} |"
        )
    tier0 = [m for m in modes if any(r["snapshot_saves"] for r in results[m])]
    if tier0:
        lines += [
            "",
            "Where a snapshot's blocking goes (rank 0, ms per snapshot, median over the repeats):"
            " the copy into a new buffer (the first save), the copy into a spare buffer (the"
            " later saves' median), and the wait for the previous snapshot's send:",
            "",
            "| configuration | staging | first copy | copy | wait for the previous send |",
            "|---|---|---|---|---|",
        ]
        for mode in tier0:
            runs = [r for r in results[mode] if r["snapshot_saves"]]

            def ms(key, runs=runs):
                values = [r.get(key) for r in runs]
                return "-" if None in values else f"{1e3 * statistics.median(values):.1f}"

            wait = statistics.median(r["snapshot_wait_seconds"] / r["snapshot_saves"] for r in runs)
            lines.append(
                f"| {mode} | {runs[0].get('snapshot_staging')} | "
                f"{ms('snapshot_first_serialize_seconds')} | "
                f"{ms('snapshot_steady_serialize_seconds')} | {1e3 * wait:.1f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
