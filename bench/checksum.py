"""CRC-32 on one core against several (contract/crc.py), side by side in one run.

    python bench/checksum.py [--mib 200] [--repeats 7]

Rows: a buffer in memory (a snapshot's checksum) and a file in the page cache (a disk
checkpoint's file hash), each one pass on one core and as rankguard computes it (one part
per core, at most 4, from 64 MiB; the same value). Milliseconds per call, best of
--repeats, and the ratio to one core.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib

from rankguard.client.checkpoint_store import DEFAULT_CHUNK
from rankguard.contract import crc


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--mib", type=int, default=200, help="buffer and file size")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    if args.mib < 1 or args.repeats < 1:
        p.error("--mib and --repeats must be >= 1")
    data = os.urandom(1 << 20) * args.mib
    expected = zlib.crc32(data)
    with tempfile.NamedTemporaryFile(prefix="rg-crc-") as f:
        f.write(data)
        f.flush()
        fd = f.fileno()
        assert crc.crc32(data) == expected and crc.crc32_fd(fd, DEFAULT_CHUNK)[1] == expected
        rows = [
            ("buffer", "one core (zlib.crc32)", best_ms(lambda: zlib.crc32(data), args.repeats)),
            ("buffer", "as sent (crc.crc32)", best_ms(lambda: crc.crc32(data), args.repeats)),
            ("file", "one pass, 8 MiB reads",
             best_ms(lambda: crc.crc32_fd(fd, DEFAULT_CHUNK, threads=1), args.repeats)),
            ("file", "as hashed (crc.crc32_fd)",
             best_ms(lambda: crc.crc32_fd(fd, DEFAULT_CHUNK), args.repeats)),
        ]  # fmt: skip
    print(f"{args.mib} MiB, {crc._threads()} threads available to the parts\n")
    print("| what | how | ms | vs one core |\n|---|---|---|---|")
    for i, (what, how, ms) in enumerate(rows):
        print(f"| {what} | {how} | {ms:.1f} | {ms / rows[i - i % 2][2]:.2f} |")


if __name__ == "__main__":
    main()
