"""CRC-32 of a large buffer on several cores, the same value as `zlib.crc32` (stdlib only).

`zlib.crc32` runs at about 4 GB/s on one core, so a GPU rank's 1.4 GiB snapshot took some
370 ms of its sender's time before the send could start, and as long again when a resume
verified it. A buffer of at least `PARALLEL_MIN` bytes is cut into one piece per core (at
most `MAX_THREADS`), each piece's CRC is computed on a pool thread (zlib releases the GIL),
and the pieces' CRCs are joined into the whole buffer's with `crc32_combine`, zlib's
algorithm written out here because Python's zlib does not expose it. A file (`crc32_fd`)
is cut the same way, each thread reading its part through a buffer of its own, small
enough to stay in the cache between the read and the checksum (one 64 MiB read, then its
checksum, ran 2-3x slower than 8 MiB at a time).
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable
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
    for piece, crc in zip(pieces, _executor(threads).map(zlib.crc32, pieces), strict=True):
        value = crc32_combine(value, crc, len(piece))
    return value


def crc32_fd(
    fd: int, chunk: int, on_bytes: Callable[[int], None] | None = None, threads: int | None = None
) -> tuple[int, int]:
    """(bytes read, CRC-32) of the file open as `fd`, read with pread in `chunk`-sized
    pieces; a file of at least PARALLEL_MIN bytes in one part per thread. The last part
    reads to the end of the file, as one pass would. `on_bytes(n)` after every read (from
    the pool's threads, one call at a time)."""
    size = os.fstat(fd).st_size
    threads = _threads() if threads is None else threads
    parts = threads if size >= PARALLEL_MIN and threads > 1 else 1
    length = -(-size // parts) if size else 0
    starts = [i * length for i in range(parts)]
    lock = threading.Lock()

    def part(i: int) -> tuple[int, int]:
        start, value, done = starts[i], 0, 0
        limit = length if i < parts - 1 else None  # the last part: to the end of the file
        buf = memoryview(bytearray(max(1, min(chunk, length + 1))))
        while limit is None or done < limit:
            want = len(buf) if limit is None else min(len(buf), limit - done)
            n = os.preadv(fd, [buf[:want]], start + done)
            if not n:
                break
            value = zlib.crc32(buf[:n], value)
            done += n
            if on_bytes is not None:
                with lock:
                    on_bytes(n)
        return done, value

    if parts == 1:
        return part(0)
    total, value = 0, 0
    for done, crc in _executor(threads).map(part, range(parts)):
        total, value = total + done, crc32_combine(value, crc, done)
    return total, value
