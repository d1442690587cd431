"""Everything that needs an NVIDIA GPU, run and written up: `scripts/gpu-check` calls this.

    scripts/gpu-check [--part NAME]...      (default: every part, in the order below)

Parts, each written to bench/results/gpu/<part>.md and gathered into bench/results/gpu.md:

    env         device, driver, CUDA, torch, NCCL and Python versions
    tests       every test marked `gpu` (pytest -m gpu), one row per test
    peak        a synchronised bf16 matrix product against the datasheet's dense bf16 peak
    throughput  the `small` and `1b` presets: tokens/s, MFU against datasheet and measured peak
    comm        CUDA-event communication timing against torch.profiler (bench/comm_timing.py)
    checkpoint  async vs sync checkpoint blocking (bench/checkpoint_overhead.py) and the
                floor of async blocking: the device-to-host copy of the state into pinned memory
    agent       the agent's own cost with real NVML on every interval (bench/agent_overhead.py)
    recovery    SIGKILL and hang, rankguard vs plain torchrun, on the GPU (bench/recovery.py)

A part that fails is reported as failed in its section; the others still run. The exit code
is 1 if any part failed (a failed test included), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
PARTS = ["env", "tests", "peak", "throughput", "comm", "checkpoint", "agent", "recovery"]


class PartFailed(Exception):
    """A part that could not produce its figures; the message says why."""


def sh(cmd: list[str], timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    print(f"gpu-check: $ {' '.join(cmd)}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


def must(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        raise PartFailed(
            f"exit {proc.returncode}:\n```\n{(proc.stderr or proc.stdout)[-3000:]}\n```"
        )
    return proc


def torchrun(nproc: int, *args: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def shown(cmd: list[str]) -> str:
    """A command as a reader would type it."""
    text = " ".join(cmd).replace(PY + " -m torch.distributed.run", "torchrun")
    return text.replace(PY, "python").replace(str(ROOT) + "/", "")


# --- parts -------------------------------------------------------------------------------


def part_env(_: argparse.Namespace) -> str:
    import torch

    smi = must(sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pci.bus_id",
                   "--format=csv,noheader"])).stdout.strip()  # fmt: skip
    rows = [
        ("GPUs (nvidia-smi)", "<br>".join(smi.splitlines())),
        ("CUDA (torch build)", torch.version.cuda),
        ("torch", torch.__version__),
        ("NCCL", ".".join(map(str, torch.cuda.nccl.version()))),
        ("cuDNN", str(torch.backends.cudnn.version())),
        ("Python", platform.python_version()),
        ("host", f"{os.cpu_count()} CPUs, {platform.release()}"),
        ("date", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
    ]
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    return "\n".join(lines)


def part_tests(_: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests",
               f"--junitxml={junit}", "-o", "junit_logging=system-out"]  # fmt: skip
        proc = sh(cmd, timeout=1200, cwd=ROOT)
        if not junit.exists():
            raise PartFailed(f"pytest wrote no report:\n```\n{proc.stdout[-3000:]}\n```")
        cases = ET.parse(junit).getroot().iter("testcase")
        rows, failed = [], 0
        for case in cases:
            outcome, note = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                    note = (
                        (el.get("message") or "").splitlines()[0][:200] if el.get("message") else ""
                    )
            failed += outcome in ("FAILED", "ERROR")
            out = case.findtext("system-out") or ""
            note = "; ".join([note, *re.findall(r"^(?:GPM|NOT_SUPPORTED).*$", out, re.M)]).strip(
                "; "
            )
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            rows.append(f"| `{name}` | {outcome} | {float(case.get('time', 0)):.1f} | {note} |")
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    text = "\n".join([
        "Command: `python -m pytest -m gpu tests` (scripts/gpu-check --part tests)", "",
        f"Result: {summary}", "",
        "| test | outcome | seconds | notes |", "|---|---|---|---|", *rows,
    ])  # fmt: skip
    if failed:
        raise PartFailed(text)
    return text


def part_peak(_: argparse.Namespace) -> str:
    import torch

    from rankguard.trainer.mfu import datasheet_peak, measured_matmul_flops

    dev = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(dev)
    measured = max(measured_matmul_flops(dev, 8192, seconds=2.0) for _ in range(3))
    known = datasheet_peak(name)
    ratio = f"{measured / known:.3f}" if known else "-"
    return "\n".join([
        "Command: `scripts/gpu-check --part peak` (`rankguard.trainer.mfu.measured_matmul_flops`:"
        " 8192x8192x8192 bf16 products on random data, device synchronised, best of 3 windows of 2 s)",
        "",
        "| device | measured bf16 matmul TFLOP/s | datasheet dense bf16 TFLOP/s | measured / datasheet |",
        "|---|---|---|---|",
        f"| {name} | {measured / 1e12:.0f} | {known / 1e12 if known else 'unknown'} | {ratio} |",
    ])  # fmt: skip


THROUGHPUT_RUNS = [
    # (preset, steps, extra args): one optimizer step is one micro-batch, so the figure is
    # the model's speed rather than accumulation's.
    ("small", 40, ["--global-batch", "32", "--micro-batch", "32"]),
    ("1b", 20, ["--global-batch", "8", "--micro-batch", "8"]),
]


def part_throughput(_: argparse.Namespace) -> str:
    import torch

    from rankguard.trainer.config import PRESETS
    from rankguard.trainer.mfu import measured_matmul_flops

    measured = measured_matmul_flops(torch.device("cuda", 0), 8192, seconds=2.0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset, steps, extra in THROUGHPUT_RUNS:
            summary = Path(tmp) / f"{preset}.json"
            cmd = torchrun(1, "-m", "rankguard.trainer", "--preset", preset, "--steps",
                           str(steps), *extra, "--log-every", "0", "--telemetry-socket", "off",
                           "--summary", str(summary))  # fmt: skip
            must(sh(cmd, cwd=tmp))
            s = json.loads(summary.read_text())
            tps = s["steady_tokens_per_second_per_rank"]
            mfu_measured = s["flops_per_token"] * tps / measured
            rows.append(
                f"| {preset} | {s['num_params'] / 1e6:,.0f}M | {s['global_batch']} x "
                f"{PRESETS[preset].model.seq_len} | "
                f"{1e3 * s['median_step_seconds']:.1f} | "
                f"{1e3 * s['median_data_wait_seconds']:.1f} | {tps:,.0f} | "
                f"{s['mfu']:.3f} | {mfu_measured:.3f} | "
                f"{s['peak_memory_bytes'] / 2**30:.1f} | `{shown(cmd).replace(str(summary), 'S.json')}` |"
            )
    return "\n".join([
        f"One GPU, bf16 autocast, AdamW, median step after the first {3}; MFU = model FLOPs per"
        " token (6N + attention) x tokens/s over the peak: the datasheet's dense bf16 figure, and"
        f" the bf16 matmul measured on this device in the same run ({measured / 1e12:.0f} TFLOP/s).",
        "",
        "| preset | parameters | batch x seq | step ms | data wait ms | tokens/s | MFU (datasheet)"
        " | MFU (measured peak) | peak GPU memory GiB | command |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])  # fmt: skip


def part_comm(_: argparse.Namespace) -> str:
    bench = str(ROOT / "bench" / "comm_timing.py")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in (1, 2):
            out = Path(tmp) / f"comm{nproc}.json"
            cmd = torchrun(nproc, bench, "--steps", "20", "--delay", "0.02", "--json", str(out))
            must(sh(cmd, cwd=tmp))
            r = json.loads(out.read_text())
            base, delayed = r["rows"]
            rows.append(
                f"| {nproc} | {r['backend']} | {base['hook_comm_ms']:.3f} | "
                f"{base['profiler_comm_ms']:.3f} ({base['profiler_clock']}) | "
                f"{r['hook_over_profiler'] or 0:.2f} | "
                f"{r['added_ms_per_allreduce']:.2f} (injected 20.00) | "
                f"{base['comm_compute_ratio']:.3f} -> {delayed['comm_compute_ratio']:.3f} | "
                f"`{shown(cmd).replace(str(out), 'OUT.json')}` |"
            )
    return "\n".join([
        "The trainer's DDP comm hook times each all-reduce with CUDA events (launch to completion"
        " on the stream); torch.profiler sums the collective's events over the same 20 steps"
        " (NCCL: kernel time on the GPU, or the host's where no kernel ran; gloo: host time). One"
        " GPU: NCCL at world size 1, and two ranks sharing the GPU through gloo.",
        "",
        "| ranks | backend | hook ms/step | profiler ms/step | hook / profiler | added per all-reduce ms"
        " | comm/compute without -> with delay | command |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])  # fmt: skip


def part_checkpoint(_: argparse.Namespace) -> str:
    cmd = [PY, str(ROOT / "bench" / "checkpoint_overhead.py"), "--nproc", "1", "--preset",
           "small", "--model-args", "--global-batch 32 --micro-batch 32", "--steps", "40",
           "--every", "10", "--repeats", "1", "--snapshot-every", "10"]  # fmt: skip
    table = must(sh(cmd, cwd=ROOT, timeout=1200)).stdout.strip()
    ser = [PY, str(ROOT / "bench" / "snapshot_serialize.py"), "--preset", "small", "--device",
           "cuda", "--repeats", "5"]  # fmt: skip
    serialize = must(sh(ser, cwd=ROOT, timeout=600)).stdout.strip()
    floor = d2h_floor()
    return "\n".join([
        f"Command: `{shown(cmd)}`", "", table, "",
        "A tier-0 snapshot's copy of the same state, alone (pinned staging, and the pageable"
        f" copy of before session 17 in the last row): `{shown(ser)}`", "", serialize, "",
        "The floor of async blocking: copying the same state (parameters and AdamW moments,"
        f" {floor['bytes'] / 2**20:,.0f} MiB) from the GPU to host memory, measured by"
        " `scripts/gpu-check --part checkpoint` in the same run:", "",
        "| copy | ms | GB/s |", "|---|---|---|",
        f"| device -> pinned host | {floor['pinned_ms']:.1f} | {floor['pinned_gbps']:.1f} |",
        f"| device -> pageable host | {floor['pageable_ms']:.1f} | {floor['pageable_gbps']:.1f} |",
    ])  # fmt: skip


def d2h_floor() -> dict:
    """Copy time of the small preset's model and optimizer state to pinned and to pageable
    host memory (best of 5), the least any checkpoint's staging can block."""
    import torch

    from rankguard.trainer.config import PRESETS
    from rankguard.trainer.model import GPT

    dev = torch.device("cuda", 0)
    model = GPT(PRESETS["small"].model).to(dev)
    tensors = [p.detach() for p in model.parameters()]
    tensors += [torch.zeros_like(t) for t in tensors for _ in range(2)]  # AdamW's two moments
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out = {"bytes": nbytes}
    for kind, pin in (("pinned", True), ("pageable", False)):
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize(dev)
            start = time.perf_counter()
            for h, t in zip(hosts, tensors, strict=True):
                h.copy_(t, non_blocking=pin)
            torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - start)
        out[f"{kind}_ms"] = 1e3 * best
        out[f"{kind}_gbps"] = nbytes / best / 1e9
    return out


def part_agent(_: argparse.Namespace) -> str:
    cmd = [PY, str(ROOT / "bench" / "agent_overhead.py"), "--real-nvml", "--seconds", "20",
           "--repeats", "0"]  # fmt: skip
    table = must(sh(cmd, cwd=ROOT)).stdout.strip()
    return f"Command: `{shown(cmd)}`\n\n{table}"


def part_recovery(_: argparse.Namespace) -> str:
    cmd = [PY, str(ROOT / "bench" / "recovery.py"), "--steps", "200", "--hang-wait", "20",
           "--stacks", "plain,warm+t0"]  # fmt: skip
    table = must(sh(cmd, cwd=ROOT, timeout=1200)).stdout.strip()
    return "\n".join([
        f"Command: `{shown(cmd)}`", "",
        "The tiny preset on the GPU, 2 ranks sharing it through gloo (one GPU here), checkpoints"
        " every 10 steps, fault at step 150.", "", table,
    ])  # fmt: skip


# --- the report --------------------------------------------------------------------------

TITLES = {
    "env": "Machine",
    "tests": "GPU tests",
    "peak": "Matrix-product peak",
    "throughput": "Training throughput and MFU",
    "comm": "Communication timing",
    "checkpoint": "Checkpoint blocking",
    "agent": "Agent overhead with real NVML",
    "recovery": "Recovery on the GPU",
}


def assemble(parts_dir: Path, report: Path) -> None:
    sections = [
        "# GPU results",
        "",
        "Written by `scripts/gpu-check` (bench/gpu_check.py); each section says the command"
        " that measured it. Parts may come from separate invocations on the same machine kind;"
        " each section's first line names its run.",
    ]
    notes = parts_dir / "notes.md"  # hand-written: what the runs found, and what was fixed
    if notes.exists():
        sections += ["", notes.read_text().strip()]
    for part in PARTS:
        path = parts_dir / f"{part}.md"
        if path.exists():
            sections += ["", f"## {TITLES[part]}", "", path.read_text().strip()]
    report.write_text("\n".join(sections) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", action="append", choices=PARTS, help="run only these parts")
    p.add_argument("--parts-dir", type=Path, default=ROOT / "bench" / "results" / "gpu")
    p.add_argument("--report", type=Path, default=ROOT / "bench" / "results" / "gpu.md")
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device here; nothing checked")
        return 0
    args.parts_dir.mkdir(parents=True, exist_ok=True)
    stamp = (
        f"_{torch.cuda.get_device_name(0)}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}_"
    )
    failed = []
    for part in args.part or PARTS:
        start = time.monotonic()
        print(f"gpu-check: part {part} ...", file=sys.stderr, flush=True)
        try:
            body = globals()[f"part_{part}"](args)
        except PartFailed as exc:
            failed.append(part)
            body = f"**FAILED**\n\n{exc}"
        except Exception as exc:  # one part's trouble must not lose the others' figures
            failed.append(part)
            body = f"**FAILED**: {type(exc).__name__}: {exc}"
        took = time.monotonic() - start
        (args.parts_dir / f"{part}.md").write_text(f"{stamp} ({took:.0f} s)\n\n{body}\n")
        print(f"gpu-check: part {part}: {'FAILED' if part in failed else 'ok'} in {took:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    assemble(args.parts_dir, args.report)
    print(f"gpu-check: wrote {args.report}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
