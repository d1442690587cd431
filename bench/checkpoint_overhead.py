"""Checkpoint cost: blocking time per save (async vs synchronous DCP save of the same
state) and throughput with checkpoints every N steps vs never, side by side in one run.

    python bench/checkpoint_overhead.py [--repeats 2] [--steps 60] [--every 10] [--keyed]
        [--backup] [--out bench/results/checkpoint_overhead.md]

Each configuration is the real trainer under torchrun (2 ranks, gloo on CPU, NCCL where
a GPU is), run in alternation (none, async, sync, none, async, sync, ...) so drift on a
shared machine hits all of them alike. Prints a markdown table of ratios, and where the
save thread's time goes (staging wait, DCP write, fsync + checksum, commit exchange), per
save and rank 0. ``--keyed`` adds async saves with a manifest key (SHA-256 file sums
instead of CRC-32); ``--backup`` adds async saves with the backup tier on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(mode: str, args, workdir: Path) -> dict:
    summary = workdir / f"{mode}.json"
    ckpt = workdir / f"ckpt-{mode}"
    backup = workdir / f"backup-{mode}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.nproc}", "-m", "rankguard.trainer",
        "--preset", args.preset, "--steps", str(args.steps), "--log-every", "0",
        "--summary", str(summary), "--no-resume", *args.model_args,
    ]  # fmt: skip
    if mode != "none":
        cmd += ["--ckpt-dir", str(ckpt), "--ckpt-every", str(args.every),
                "--ckpt-mode", mode.split("-")[0], "--keep", "1"]  # fmt: skip
    if mode == "async-keyed":
        key = workdir / "key"
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
        cmd += ["--ckpt-key-file", str(key)]
    if mode == "async-process":
        cmd += ["--ckpt-writer", "process"]
    if mode == "async-backup":
        cmd += ["--ckpt-backup", str(backup), "--backup-keep", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKGUARD_TELEMETRY_SOCKET": "off"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    s = json.loads(summary.read_text())
    subprocess.run(["rm", "-rf", str(ckpt), str(backup)])
    return s


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model-args", default="--d-model 384 --n-layer 6 --n-head 6 --seq-len 128",
                   help="extra trainer flags that size the model")  # fmt: skip
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--keyed", action="store_true", help="add async saves with a manifest key")
    p.add_argument("--backup", action="store_true", help="add async saves with a backup tier")
    p.add_argument("--process", action="store_true", help="add async saves by DCP's writer process")
    p.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = p.parse_args()
    args.model_args = args.model_args.split()
    if args.repeats < 1 or args.steps < 1 or args.every < 1 or args.nproc < 1:
        p.error("--repeats, --steps, --every and --nproc must be >= 1")

    results: dict[str, list[dict]] = {"none": [], "async": [], "sync": []}
    if args.keyed:
        results["async-keyed"] = []
    if args.backup:
        results["async-backup"] = []
    if args.process:
        results["async-process"] = []
    with tempfile.TemporaryDirectory(prefix="rg-bench-", dir=os.environ.get("BENCH_DIR")) as tmp:
        for i in range(args.repeats):
            for mode in results:
                print(f"[{i + 1}/{args.repeats}] {mode} ...", file=sys.stderr, flush=True)
                results[mode].append(run(mode, args, Path(tmp)))

    def tps(mode):
        return statistics.median(r["tokens_per_second"] for r in results[mode])

    def block_per_save(mode):
        return statistics.median(
            r["checkpoint_block_seconds"] / r["checkpoint_saves"] for r in results[mode]
        )

    first = results["none"][0]
    lines = [
        f"model: {first['num_params'] / 1e6:.1f}M parameters, {args.nproc} ranks, "
        f"{args.steps} steps, checkpoint every {args.every}; median of {args.repeats} alternated runs",
        "",
        "| configuration | tokens/s | throughput vs no checkpoints | blocking per save (ms) | blocking vs sync save |",
        "|---|---|---|---|---|",
        f"| no checkpoints | {tps('none'):,.0f} | 1.000 | - | - |",
    ]
    for mode in [m for m in results if m != "none"]:
        lines.append(
            f"| {mode} every {args.every} | {tps(mode):,.0f} | {tps(mode) / tps('none'):.3f} | "
            f"{1e3 * block_per_save(mode):.1f} | {block_per_save(mode) / block_per_save('sync'):.3f} |"
        )

    def part(mode, name):  # rank 0's save thread, ms per save
        return statistics.median(
            1e3 * r.get(f"checkpoint_{name}_seconds", float("nan")) / r["checkpoint_saves"]
            for r in results[mode]
        )

    lines += [
        "",
        "Where a save's time goes (rank 0, ms per save; async: in the low-priority save thread,"
        " sync: blocking training):",
        "",
        "| configuration | checksum | staging wait | DCP write | fsync + checksum | commit exchange |",
        "|---|---|---|---|---|---|",
    ]
    for mode in [m for m in results if m != "none"]:
        algo = results[mode][0].get("checkpoint_checksum", "?")
        lines.append(
            f"| {mode} | {algo} | {part(mode, 'stage'):.1f} | {part(mode, 'write'):.1f} | "
            f"{part(mode, 'hash'):.1f} | {part(mode, 'commit'):.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(
            f"Command: `python bench/checkpoint_overhead.py {' '.join(sys.argv[1:])}`\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
