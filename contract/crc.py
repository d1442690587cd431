"""CRC-32 of a large buffer on several cores, the same value as `zlib.crc32` (stdlib only).

`zlib.crc32` runs at about 4 GB/s on one core, so a GPU rank's 1.4 GiB snapshot took some
370 ms of its sender's time before the send could start, and as long again when a resume
verified it. A buffer of at least `PARALLEL_MIN` bytes is cut into one piece per core (at
most `MAX_THREADS`), each piece's CRC is computed on a pool thread (zlib releases the GIL),
and the pieces' CRCs are joined into the whole buffer's with `crc32_combine`, zlib's
algorithm written out here because Python's zlib does not expose it.
"""

from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

PARALLEL_MIN = 64 * 1024 * 1024
MAX_THREADS = 4
_POLY = 0xEDB88320  # CRC-32's polynomial, reflected

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
# _append_zeros[k]: the linear operator (32 columns over GF(2)) that appends 2**k zero
# bytes to a CRC-32's message; built as far as a length needs, then kept
_append_zeros: list[list[int]] = []


def _times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, column) for column in matrix]


def _operator(k: int) -> list[int]:
    with _lock:
        if not _append_zeros:
            one_bit = [_POLY] + [1 << n for n in range(31)]
            _append_zeros.append(_square(_square(_square(one_bit))))  # 8 bits: one byte
        while len(_append_zeros) <= k:
            _append_zeros.append(_square(_append_zeros[-1]))
        return _append_zeros[k]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len(B)."""
    k = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _times(_operator(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def _threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def _executor(threads: int) -> ThreadPoolExecutor:
    """The pool, made again in a forked child (the parent's threads are not there)."""
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rankguard-crc")
            _pool_pid = os.getpid()
        return _pool


def crc32(data, value: int = 0, threads: int | None = None) -> int:
    """`zlib.crc32(data, value)`, computed on up to `threads` cores (default: one per core
    this process may run on, at most MAX_THREADS) when `data` is large enough to gain."""
    view = memoryview(data).cast("B")
    threads = _threads() if threads is None else threads
    if len(view) < PARALLEL_MIN or threads < 2:
        return zlib.crc32(view, value)
    size = -(-len(view) // threads)
    pieces = [view[i : i + size] for i in range(0, len(view), size)]
    crcs = list(_executor(threads).map(zlib.crc32, pieces))
    out = crc32_combine(value, crcs[0], len(pieces[0]))
    for piece, crc in zip(pieces[1:], crcs[1:], strict=True):
        out = crc32_combine(out, crc, len(piece))
    return out
