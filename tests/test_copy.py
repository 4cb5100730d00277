"""hixl.memory: copy_moves (large copies split across threads, every byte exactly once) and new_bytes."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from hixl.errors import ParamInvalid
from hixl.memory import PARALLEL_COPY_MIN, ShmSegment, copy_moves, new_bytes, split_moves


def _addr(array: np.ndarray) -> int:
    return int(array.ctypes.data)


@pytest.mark.parametrize("shares", [1, 2, 3, 4, 7])
def test_split_covers_every_byte_once_in_order(shares: int) -> None:
    moves = [(1000, 5000, 10), (2000, 6000, 1), (3000, 7000, 33), (4000, 8000, 0)]
    parts = split_moves(moves, shares)
    assert 1 <= len(parts) <= shares
    flat = [m for part in parts for m in part]
    # the pieces of each move are contiguous and in order, and nothing else appears
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for dst, src, length in flat:
        assert length > 0
        owner = next(i for i, (d, _, n) in enumerate(moves) if d <= dst < d + max(n, 1))
        seen.setdefault(owner, []).append((dst, src, length))
    for owner, pieces in seen.items():
        dst, src, length = moves[owner]
        for piece_dst, piece_src, _ in pieces:
            assert piece_dst - dst == piece_src - src  # source and destination move together
        assert pieces[0][0] == dst
        assert sum(p[2] for p in pieces) == length
        for before, after in zip(pieces, pieces[1:], strict=False):
            assert before[0] + before[2] == after[0]
    sizes = [sum(m[2] for m in part) for part in parts]
    assert sum(sizes) == 44
    assert max(sizes) - min(sizes) <= -(-44 // shares)


@pytest.mark.parametrize("sizes", [
    [PARALLEL_COPY_MIN * 4 + 12345],                       # one large move, split
    [PARALLEL_COPY_MIN - 1],                               # just below: one thread
    [777, PARALLEL_COPY_MIN + 4096, 3, 1 << 20, 65536],    # mixed sizes, uneven cuts
])
def test_copy_moves_copies_every_byte(sizes: list[int]) -> None:
    rng = np.random.default_rng(7)
    total = sum(sizes)
    src = rng.integers(0, 256, total, dtype=np.uint8)
    segment = ShmSegment(total + 2 * 4096, name="test-copy")  # a mapped memfd, as the fabric path
    try:
        dst = np.frombuffer(segment.view(), dtype=np.uint8)
        dst[:] = 0xAB
        moves, offset = [], 0
        for size in sizes:  # destination shifted by 4096 + 1: unaligned on purpose
            moves.append((_addr(dst) + 4097 + offset, _addr(src) + offset, size))
            offset += size
        copy_moves(moves)
        assert np.array_equal(dst[4097:4097 + total], src)
        assert (dst[:4097] == 0xAB).all() and (dst[4097 + total:] == 0xAB).all()
        del dst
    finally:
        segment.close()


def test_copy_moves_in_a_forked_child() -> None:
    """The worker pool does not survive fork: a child must start its own, not wait forever."""
    size = PARALLEL_COPY_MIN * 2
    src = np.arange(size, dtype=np.uint64).view(np.uint8)[:size]
    dst = np.zeros(size, dtype=np.uint8)
    copy_moves([(_addr(dst), _addr(src), size)])  # the parent's pool now exists
    assert np.array_equal(dst, src)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        try:
            out = np.zeros(size, dtype=np.uint8)
            copy_moves([(_addr(out), _addr(src), size)])
            os._exit(0 if np.array_equal(out, src) else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("size", [0, 1, 2, 4096 + 3])
def test_new_bytes_is_a_fresh_object_to_fill(size: int) -> None:
    value, addr = new_bytes(size)
    assert type(value) is bytes and len(value) == size
    if size:
        data = bytes(range(256)) * (size // 256 + 1)
        ctypes.memmove(addr, data, size)
        assert value == data[:size]
        assert value is not bytes([data[0]])  # not CPython's cached 1-byte object
    else:
        assert addr == 0 and value == b""
    with pytest.raises(ParamInvalid, match="size must be >= 0"):
        new_bytes(-1)
