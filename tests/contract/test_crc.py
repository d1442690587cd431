"""contract/crc.py: the parallel CRC-32 is zlib's, bit for bit."""

from __future__ import annotations

import os
import signal
import zlib

from hypothesis import given
from hypothesis import strategies as st

from rankguard.contract import crc


@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_combine_joins_two_crcs_into_the_crc_of_both(a, b):
    assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@given(st.binary(min_size=1, max_size=5000), st.integers(2, 7))
def test_any_buffer_cut_in_pieces_gives_zlibs_value(data, threads):
    # PARALLEL_MIN lowered: every buffer takes the pool's path, pieces of any length
    original = crc.PARALLEL_MIN
    crc.PARALLEL_MIN = 1
    try:
        assert crc.crc32(data, threads=threads) == zlib.crc32(data)
    finally:
        crc.PARALLEL_MIN = original


def test_a_large_buffer_on_several_threads_and_through_its_views():
    data = bytearray(os.urandom(1 << 20)) * 65 + b"tail"  # above PARALLEL_MIN, odd length
    expected = zlib.crc32(data)
    for threads in (1, 2, 3, 4):
        assert crc.crc32(data, threads=threads) == expected
    assert crc.crc32(memoryview(data)[5:], threads=3) == zlib.crc32(memoryview(data)[5:])
    # a running value, as a file is hashed block by block
    head, rest = data[:1000], data[1000:]
    assert crc.crc32(rest, crc.crc32(head), threads=2) == expected
    assert crc.crc32(b"") == 0 and crc.crc32(b"x", threads=4) == zlib.crc32(b"x")


def test_a_forked_child_gets_a_pool_of_its_own():
    data = bytes(crc.PARALLEL_MIN + 1)
    expected = crc.crc32(data, threads=2)  # the parent's pool now exists
    pid = os.fork()
    if pid == 0:  # the parent's pool threads are not in the child: it must not wait on them
        signal.alarm(20)  # a wait for them would be forever
        os._exit(0 if crc.crc32(data, threads=2) == expected else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_file_in_parts_on_several_threads_is_one_pass(tmp_path, monkeypatch):
    data = os.urandom(1 << 20) * 3 + os.urandom(777)
    path = tmp_path / "f"
    path.write_bytes(data)
    monkeypatch.setattr(crc, "PARALLEL_MIN", 1)  # every size takes the parts' path
    fd = os.open(path, os.O_RDONLY)
    try:
        for threads in (1, 2, 3, 4):
            for chunk in (1000, 1 << 20):
                seen = []
                got = crc.crc32_fd(fd, chunk, seen.append, threads=threads)
                assert got == (len(data), zlib.crc32(data)), (threads, chunk)
                assert sum(seen) == len(data) and max(seen) <= chunk
    finally:
        os.close(fd)
    (tmp_path / "empty").write_bytes(b"")
    fd = os.open(tmp_path / "empty", os.O_RDONLY)
    try:
        assert crc.crc32_fd(fd, 1000, threads=4) == (0, 0)
    finally:
        os.close(fd)
