"""Tier-0 snapshot serialization: the flat format (client/snapshots.py) against torch.save.

    python bench/snapshot_serialize.py [--preset tiny] [--repeats 50] [--model-args '...']

One rank's state (model + AdamW after one step + RNG), one torch thread; milliseconds per
call. `--device cuda`: the state on the GPU, copied into page-locked memory (and, in a last
row, into pageable memory as before session 17). The checksum's rows: zlib's CRC-32 on one core, and as a snapshot is sent (on
several cores from 64 MiB, contract/crc.py).
The second flat row refills a buffer of the same size, as the trainer does in turn with two
(a new buffer is zero-filled and faulted in page by page first).
"""

from __future__ import annotations

import argparse
import io
import time

import torch

from rankguard.client import snapshots
from rankguard.client.snapshots import deserialize, serialize
from rankguard.contract import crc
from rankguard.contract.snapshots import checksum
from rankguard.trainer.config import config_from_args
from rankguard.trainer.model import GPT


def per_call_ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument(
        "--model-args", default="", help="trainer model flags, e.g. '--d-model 384 --n-layer 6'"
    )
    p.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = config_from_args(["--preset", args.preset, *args.model_args.split()], environ={})
    device = torch.device(args.device)
    model = GPT(cfg.model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.zeros((1, cfg.model.seq_len), dtype=torch.long, device=device)
    model(x, x).backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(),
             "trainer": {"rng_cpu": torch.get_rng_state()}}  # fmt: skip

    def torch_save() -> bytes:
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    old, new = torch_save(), serialize(state)
    spare = serialize(state)  # what the trainer refills (the send of the other one is done)
    rows = [
        ("torch.save", per_call_ms(torch_save, args.repeats), len(old)),
        (
            "torch.load",
            per_call_ms(lambda: torch.load(io.BytesIO(old), weights_only=True), args.repeats),
            len(old),
        ),  # fmt: skip
        ("flat serialize", per_call_ms(lambda: serialize(state), args.repeats), len(new)),
        (
            "flat serialize into a spare buffer",
            per_call_ms(lambda: serialize(state, reuse=spare), args.repeats),
            len(new),
        ),  # fmt: skip
        ("flat deserialize", per_call_ms(lambda: deserialize(new), args.repeats), len(new)),
        (
            "checksum (crc32, one core)",
            per_call_ms(lambda: crc.crc32(new, threads=1), args.repeats),
            len(new),
        ),  # fmt: skip
        (
            f"checksum (crc32, as sent: {crc._threads()} threads from {crc.PARALLEL_MIN >> 20} MiB)",
            per_call_ms(lambda: checksum(new), args.repeats),
            len(new),
        ),  # fmt: skip
    ]
    if device.type == "cuda":  # the same copy into pageable memory, as before pinned staging
        pinned = snapshots._pinned_staging
        snapshots._pinned_staging = lambda devices: False
        pageable = serialize(state)
        rows.append((
            "flat serialize into a spare buffer, pageable (not pinned)",
            per_call_ms(lambda: serialize(state, reuse=pageable), args.repeats),
            len(pageable),
        ))  # fmt: skip
        snapshots._pinned_staging = pinned
    print(f"| {args.preset} on {device.type} | ms per call | bytes |\n|---|---|---|")
    for name, ms, size in rows:
        print(f"| {name} | {ms:.2f} | {size} |")


if __name__ == "__main__":
    main()
