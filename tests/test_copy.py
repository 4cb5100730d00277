"""hixl.memory: copy_moves (large copies split across threads, every byte exactly once) and new_bytes."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from hixl import memory
from hixl.errors import ParamInvalid
from hixl.memory import (
    PARALLEL_COPY_MIN,
    ShmSegment,
    copy_arrays,
    copy_moves,
    new_bytes,
    split_moves,
)
from hixl.segment_states import FUTEX_OWNER_DIED


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
@pytest.mark.parametrize("stream", [False, True])
def test_copy_moves_copies_every_byte(sizes: list[int], stream: bool) -> None:
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
        copy_moves(moves, stream=stream)
        assert np.array_equal(dst[4097:4097 + total], src)
        assert (dst[:4097] == 0xAB).all() and (dst[4097 + total:] == 0xAB).all()
        del dst
    finally:
        segment.close()


def test_streamed_copies_stay_on_one_thread_below_their_own_threshold() -> None:
    """A hand-off costs more than a second thread gains for streamed copies under
    PARALLEL_STREAM_MIN (docs/benchmarks.md §9); plain memmoves split from
    PARALLEL_COPY_MIN."""
    assert memory._shares(PARALLEL_COPY_MIN - 1, stream=False) == 1
    assert memory._shares(memory.PARALLEL_STREAM_MIN - 1, stream=True) == 1
    if memory.COPY_THREADS > 1:
        assert memory._shares(PARALLEL_COPY_MIN, stream=False) > 1
        assert memory._shares(memory.PARALLEL_STREAM_MIN, stream=True) > 1


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


COPY_PATHS = ["c", "python"]


@pytest.fixture(params=COPY_PATHS)
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """copy_arrays through hixl._fastwire.copy_runs ("c", where built) or numpy/ctypes."""
    if request.param == "c":
        if memory._FAST_COPY is None:
            pytest.skip("hixl._fastwire is not built here (no compiler) or HIXL_FASTWIRE=0")
    else:
        monkeypatch.setattr(memory, "_FAST_COPY", None)
    return request.param


@pytest.mark.parametrize(("count", "size"), [
    (537, 4096),                      # one layer of 4 KiB pages: numpy's small-page path
    (7, 4096),                        # too few for it
    (3, PARALLEL_COPY_MIN),           # split over threads, few moves
    (260, 64 << 10),                  # split over threads (up to 4), cut at move boundaries
])
@pytest.mark.parametrize("stream", [False, True])
def test_copy_arrays_copies_every_byte(copy_path: str, count: int, size: int,
                                       stream: bool) -> None:
    """Scattered pages (shuffled order, unaligned destination) land where they belong and
    nothing else is written, on either path."""
    rng = np.random.default_rng(count)
    src = rng.integers(0, 256, count * size, dtype=np.uint8)
    segment = ShmSegment(count * size + 2 * 4096, name="test-copy-arrays")
    try:
        dst = np.frombuffer(segment.view(), dtype=np.uint8)
        dst[:] = 0xAB
        order = rng.permutation(count)
        dsts = _addr(dst) + 4097 + order.astype(np.int64) * size
        srcs = _addr(src) + np.arange(count, dtype=np.int64) * size
        lengths = np.full(count, size, dtype=np.int64)
        copy_arrays(dsts, srcs, lengths, stream=stream)
        for page, slot in enumerate(order.tolist()):  # every page, where it belongs
            at = 4097 + slot * size
            assert np.array_equal(dst[at:at + size], src[page * size:(page + 1) * size]), page
        assert (dst[:4097] == 0xAB).all() and (dst[4097 + count * size:] == 0xAB).all()
        del dst
    finally:
        segment.close()


def test_copy_runs_refuses_what_it_cannot_copy_before_moving_a_byte() -> None:
    fast = memory._FAST_COPY
    if fast is None:
        pytest.skip("hixl._fastwire is not built here (no compiler) or HIXL_FASTWIRE=0")
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    d = np.array([_addr(dst), _addr(dst) + 32], dtype=np.int64)
    s = np.array([_addr(src), _addr(src) + 32], dtype=np.int64)
    with pytest.raises(ValueError, match=r"lengths\[1\] is negative"):
        fast(d, s, np.array([8, -1], dtype=np.int64))
    with pytest.raises(TypeError, match="lengths must be an int64 array"):
        fast(d, s, np.array([8.0, 8.0]))
    with pytest.raises(TypeError, match="dst must be an int64 array"):
        fast(d.astype(np.int32), s, np.array([8, 8], dtype=np.int64))
    with pytest.raises(ValueError, match="differ in length"):
        fast(d, s[:1], np.array([8, 8], dtype=np.int64))
    assert not dst.any()  # nothing moved by a refused call
    fast(d, s, np.array([8, 8], dtype=np.int64))
    assert dst[:8].tolist() == list(range(8)) and dst[32:40].tolist() == list(range(32, 40))


def _fast_stream() -> object:
    stream = getattr(memory._FASTWIRE, "copy_stream", None)
    if stream is None:
        pytest.skip("hixl._fastwire is not built here (no compiler) or HIXL_FASTWIRE=0")
    return stream


@pytest.mark.parametrize("length", [0, 1, 63, 4095, 4096, 4097, 4096 + 63, 65536 + 17,
                                    (1 << 20) + 5])
@pytest.mark.parametrize(("dst_shift", "src_shift"), [(0, 0), (1, 0), (15, 7), (4097, 3)])
def test_copy_stream_copies_exactly_its_bytes(length: int, dst_shift: int,
                                              src_shift: int) -> None:
    """Streamed stores (x86-64) cover the unaligned head and the tail under 64 bytes: every
    byte lands, none outside the range; short copies take memmove."""
    copy_stream = _fast_stream()
    rng = np.random.default_rng(length + dst_shift)
    src = rng.integers(0, 256, length + 64, dtype=np.uint8)
    segment = ShmSegment(length + 2 * 8192, name="test-copy-stream")
    try:
        dst = np.frombuffer(segment.view(), dtype=np.uint8)
        dst[:] = 0xAB
        copy_stream(_addr(dst) + dst_shift, _addr(src) + src_shift, length)  # type: ignore[operator]
        assert np.array_equal(dst[dst_shift:dst_shift + length],
                              src[src_shift:src_shift + length])
        assert (dst[:dst_shift] == 0xAB).all() and (dst[dst_shift + length:] == 0xAB).all()
        del dst
    finally:
        segment.close()


@pytest.mark.parametrize("shift", [-100, 100, 0])
def test_copy_stream_of_overlapping_ranges_is_a_memmove(shift: int) -> None:
    copy_stream = _fast_stream()
    data = np.arange(3 * 8192, dtype=np.uint32).view(np.uint8)
    expected = data.copy()
    start, length = 8192, 8192
    expected[start + shift:start + shift + length] = data[start:start + length].copy()
    copy_stream(_addr(data) + start + shift, _addr(data) + start, length)  # type: ignore[operator]
    assert np.array_equal(data, expected)


def test_copy_stream_refuses_a_negative_length() -> None:
    copy_stream = _fast_stream()
    dst = np.zeros(16, dtype=np.uint8)
    with pytest.raises(ValueError, match="length is negative"):
        copy_stream(_addr(dst), _addr(dst), -1)  # type: ignore[operator]


def test_read_checked_copies_then_reports_the_segment_and_life_words() -> None:
    """hixl._fastwire.read_checked (the store's repeated cached gets): every move's bytes
    land; True only while each liveness word still reads its expected id and each owner's
    life word names a thread the kernel has not marked dead."""
    read_checked = getattr(memory._FASTWIRE, "read_checked", None)
    if read_checked is None:
        pytest.skip("hixl._fastwire is not built here (no compiler) or HIXL_FASTWIRE=0")
    src = np.random.default_rng(5).integers(0, 256, 65536 + 3, dtype=np.uint8)
    words = np.zeros(4, np.uint64)
    words[1], words[2] = 2**63 + 5, 77          # a segment id above 2^63 reads unsigned
    word = _addr(words) + 2 * 8
    lives = np.array([4242, 0, FUTEX_OWNER_DIED, FUTEX_OWNER_DIED | 4242], np.uint32)
    life, never, died, died_owned = (_addr(lives) + 4 * i for i in range(4))

    def read(expect: int, *more: tuple[int, int, int], owner: int = life) -> tuple[bool, bool]:
        dst = np.zeros(2 * src.nbytes, np.uint8)
        half = src.nbytes
        ok = read_checked([(_addr(dst), _addr(src), half),
                           (_addr(dst) + half, _addr(src), half)],
                          [(word, expect, owner), *more])
        return ok, bool(np.array_equal(dst[:half], src) and np.array_equal(dst[half:], src))

    assert read(77) == (True, True)
    assert read(78) == (False, True)        # the segment is not (or no longer) served
    assert read(77, (word - 8, 2**63 + 5, life)) == (True, True)
    assert read(77, (word - 8, 5, life)) == (False, True)       # the second one
    assert read(77, (word - 8, 2**63 + 5, died)) == (False, True)  # the second one's owner
    assert read(77, owner=never) == (False, True)      # closed, or never owned
    assert read(77, owner=died) == (False, True)       # the kernel marked its death
    assert read(77, owner=died_owned) == (False, True)
    dst = np.zeros(8, np.uint8)
    with pytest.raises(ValueError, match=r"moves\[1\] has a negative length"):
        read_checked([(_addr(dst), _addr(src), 8), (_addr(src), _addr(src), -1)], [])
    assert not dst.any()                     # refused before any byte moved
    with pytest.raises(TypeError, match=r"checks\[0\] is not a 3-tuple"):
        read_checked([], [(word, 77)])
