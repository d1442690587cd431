"""rankguard.client overhead: step time of a small DDP script with and without the library,
alternated side by side in one run.

    python bench/client_overhead.py [--rounds 100] [--steps 10] [--width 512] [--out FILE]
    python bench/client_overhead.py --cuda [--nproc 1] --width 4096 --batch 2048 ...

Starts `torchrun --standalone --nproc-per-node=2` (gloo, CPU; with --cuda NCCL, one GPU
per rank, each step ended by a device synchronisation outside the library) of this file's
worker, with
a real Unix datagram listener (drained by a thread of this process) at
$RANKGUARD_TELEMETRY_SOCKET. The worker holds three identical DDP models: "plain" (DDP's
own all-reduce, no library), "client" (a `Reporter` attached: the timed comm hook,
phases, loss, tokens, one telemetry record per step) and "hook" (the timed comm hook
alone, no step calls: which part of the cost is the hook's). Each round runs `--steps`
steps of each, the order rotated every round, and the step time is taken around the
whole step from outside the library. The ratio is client/plain per round (median step
time of each; and, less sensitive to other processes on a shared machine, the fastest
step of each), and its median over the rounds. A micro-benchmark of the library alone
(empty steps with every call of a step, real socket) gives its host cost per step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rankguard.client import Reporter, StepTimer, timed_allreduce_hook

    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    # A GPU's step ends when its kernels do: wait for them outside the library, in each variant.
    sync = torch.cuda.synchronize if args.cuda else (lambda: None)

    def build():
        torch.manual_seed(0)
        w = args.width
        net = nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w)).to(device)
        return DDP(net, device_ids=[device.index] if device is not None else None)

    plain, client, hooked = build(), build(), build()
    rg = Reporter(client, job="bench")
    # The timed comm hook alone (no step calls): which part of the cost is the hook's.
    hooked.register_comm_hook(StepTimer(), timed_allreduce_hook)
    opts = {m: torch.optim.SGD(m.parameters(), lr=1e-3) for m in (plain, client, hooked)}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g).to(device)
    y = torch.randn(args.batch, args.width, generator=g).to(device)

    def plain_step(_n: int) -> None:
        loss = nn.functional.mse_loss(plain(x), y)
        loss.backward()
        opts[plain].step()
        opts[plain].zero_grad(set_to_none=True)

    def client_step(n: int) -> None:
        s = rg.step(n, tokens=args.batch)
        s.phase("compute")
        loss = nn.functional.mse_loss(client(x), y)
        loss.backward()
        s.phase("optimizer")
        opts[client].step()
        opts[client].zero_grad(set_to_none=True)
        s.loss(loss)
        s.end()

    def hook_step(_n: int) -> None:
        loss = nn.functional.mse_loss(hooked(x), y)
        loss.backward()
        opts[hooked].step()
        opts[hooked].zero_grad(set_to_none=True)

    steps = {"plain": plain_step, "client": client_step, "hook": hook_step}
    times: dict[str, list[list[float]]] = {name: [] for name in steps}
    n = 0
    for _ in range(3):  # warm-up of all
        for name in steps:
            n += 1
            steps[name](n)
    sync()
    names = list(steps)
    for r in range(args.rounds):
        order = names[r % 3 :] + names[: r % 3]  # each variant first, middle, last in turn
        if r % 2:
            order.reverse()
        for name in order:
            block = []
            for _ in range(args.steps):
                n += 1
                t0 = time.perf_counter()
                steps[name](n)
                sync()
                block.append(time.perf_counter() - t0)
            times[name].append(block)
    rg.close()

    # The library alone: every call of a step, nothing else (host cost per step).
    micro = Reporter(socket_path=os.environ.get("RANKGUARD_TELEMETRY_SOCKET"), job="bench")
    count = 2000
    t0 = time.perf_counter()
    for i in range(1, count + 1):
        s = micro.step(i, tokens=args.batch)
        s.phase("compute")
        s.phase("optimizer")
        s.loss(1.0)
        s.end()
    micro_us = (time.perf_counter() - t0) / count * 1e6
    micro.close()

    result = {
        "rank": rank,
        "times": times,
        "micro_us_per_step": micro_us,
        "sent": rg.sent,
        "dropped": rg.dropped,
        "errors": rg.errors,
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.json).write_text(json.dumps(gathered))
    # a rank tearing gloo down alone, its peer still connected, can abort at exit (std::terminate)
    dist.barrier()
    dist.destroy_process_group()


def drain(sock: socket.socket, stop: threading.Event, counter: list[int]) -> None:
    while not stop.is_set():
        try:
            sock.recv(65536)
            counter[0] += 1
        except TimeoutError:
            continue
        except OSError:
            return


def summarize(results: list[dict], args: argparse.Namespace, received: int) -> str:
    rows = []
    ratios_all: list[float] = []
    fastest_all: list[float] = []
    hook_all: list[float] = []
    for r in results:
        plain = [statistics.median(b) for b in r["times"]["plain"]]
        client = [statistics.median(b) for b in r["times"]["client"]]
        ratios = [c / p for c, p in zip(client, plain, strict=True)]
        ratios_all += ratios
        fastest = [
            min(c) / min(p) for c, p in zip(r["times"]["client"], r["times"]["plain"], strict=True)
        ]
        fastest_all += fastest
        hook = [
            min(h) / min(p) for h, p in zip(r["times"]["hook"], r["times"]["plain"], strict=True)
        ]
        hook_all += hook
        q = statistics.quantiles(ratios, n=4)
        host_share = r["micro_us_per_step"] * 1e-6 / statistics.median(plain)
        rows.append(
            f"| {r['rank']} | {statistics.median(plain) * 1e3:.2f} | "
            f"{statistics.median(client) * 1e3:.2f} | {statistics.median(ratios):.4f} | "
            f"{q[0]:.4f} .. {q[2]:.4f} | {statistics.median(fastest):.4f} | "
            f"{statistics.median(hook):.4f} | "
            f"{r['micro_us_per_step']:.1f} | "
            f"{host_share * 100:.2f}% | {r['sent']} / {r['dropped']} |"
        )
    overall = statistics.median(ratios_all)
    fast = statistics.median(fastest_all)
    hook_only = statistics.median(hook_all)
    head = [
        f"{args.nproc} rank(s), {args.where}; model Linear({args.width}, {4 * args.width}) + GELU + "
        f"Linear({4 * args.width}, {args.width}), batch {args.batch}; {args.rounds} rounds "
        f"x {args.steps} steps of each, variants rotated.",
        "",
        "| rank | plain step ms | client step ms | client/plain (median of rounds) "
        "| interquartile | client/plain, fastest step of each block "
        "| hook only/plain, fastest step | library alone, us/step | library alone / plain step "
        "| records sent / dropped |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
        *rows,
        "",
        f"**Overall: client/plain = {overall:.4f} ({(overall - 1) * 100:+.2f}%) by the "
        f"median step of each block, {fast:.4f} ({(fast - 1) * 100:+.2f}%) by the fastest "
        f"step of each block**; the timed DDP comm hook alone: {hook_only:.4f} "
        f"({(hook_only - 1) * 100:+.2f}%); the listener received {received} datagrams.",
    ]
    return "\n".join(head)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--cuda", action="store_true", help="NCCL, one GPU per rank")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--out", type=Path, help="also write the markdown table here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.where = "NCCL, one GPU each" if args.cuda else "gloo on CPU"
    if args.worker:
        worker(args)
        return 0

    with tempfile.TemporaryDirectory(prefix="rgco") as tmp:
        path = Path(tmp) / "agent.sock"
        rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        rx.bind(str(path))
        rx.settimeout(0.1)
        stop, counter = threading.Event(), [0]
        thread = threading.Thread(target=drain, args=(rx, stop, counter), daemon=True)
        thread.start()
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={args.nproc}", __file__, "--worker", "--json", str(out),
            "--rounds", str(args.rounds), "--steps", str(args.steps),
            "--width", str(args.width), "--batch", str(args.batch),
            *(["--cuda"] if args.cuda else []),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKGUARD_TELEMETRY_SOCKET": str(path)}
        start = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        time.sleep(0.2)
        stop.set()
        thread.join()
        rx.close()
        table = summarize(json.loads(out.read_text()), args, counter[0])
    print(table)
    print(f"\n(ran {time.monotonic() - start:.0f} s)")
    if args.out:
        command = "flock /tmp/rankguard-cpu.lock python bench/client_overhead.py " + " ".join(
            sys.argv[1:]
        )
        args.out.write_text(
            "# rankguard.client overhead\n\n"
            f"Command: `{command}`\n\n{table}\n\n"
            '"plain" is the script without the library (DDP\'s own all-reduce); "client" '
            "is the same script with `Reporter(model)` and `rg.step` / `s.phase` / `s.loss` "
            "per step (timed comm hook, one telemetry record per step to a real listener). "
            "The step time is measured around the whole step, outside the library. "
            '"library alone" is the host cost of a step\'s calls with nothing else in it.\n'
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
