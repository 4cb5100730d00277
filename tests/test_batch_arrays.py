"""Array batches (`Engine.transfer_arrays`, issue 18): a batch given as address and length
arrays, checked and resolved vectorised, coalesced, copied by one C-level loop on the
mapped path; the socket path gets the same ops as Items.

A real hixl-agent process owns the segments; every byte is checked, and bad input must
raise a typed error naming the first bad op and leave every segment unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from hixl import Engine, OutOfRange, ParamInvalid, PermissionDenied, SegmentInfo, TransferOp
from hixl.client.engine import _runs
from hixl.types import MemType, Perm

POOL_RW = 4 << 20
POOL_RO = 1 << 20
PAGE = 4096
FABRIC = pytest.mark.parametrize("client", ["1", "0"], ids=["fabric", "socket"], indirect=True)


def pattern(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture
def node(agent_process):
    return agent_process(config={"pool": [{"name": "kv", "size": POOL_RW, "perms": "rw"},
                                          {"name": "ro", "size": POOL_RO, "perms": "r"}]})


@pytest.fixture
def client(node, request) -> Iterator[tuple[Engine, str]]:
    with Engine("127.0.0.1", {"EnableUseFabricMem": getattr(request, "param", "1")}) as engine:
        engine.connect(node.engine, timeout=10)
        yield engine, node.engine


def segment(engine: Engine, agent: str, name: str) -> SegmentInfo:
    (found,) = [s for s in engine.segments(agent) if s.name == name]
    return found


def snapshot(engine: Engine, agent: str, seg: SegmentInfo) -> bytes:
    buf = np.zeros(seg.length, np.uint8)
    handle = engine.register(buf)
    try:
        engine.read(agent, buf, seg.base, timeout=10)
    finally:
        engine.deregister(handle)
    return buf.tobytes()


@FABRIC
def test_array_batch_scatters_and_gathers_every_page(client) -> None:
    """300 pages to a random permutation of places and back, uint64 and int64 arrays, a
    scalar length, runs of neighbouring pages (coalesced) among scattered ones."""
    engine, agent = client
    kv = segment(engine, agent, "kv")
    pages = 300
    src = pattern(1, pages * PAGE)
    back = np.zeros_like(src)
    engine.register(src)
    engine.register(back)
    rng = np.random.default_rng(7)
    run = np.arange(900, 940)  # 40 neighbouring pages, neighbours on both sides
    places = rng.permutation(np.setdiff1d(np.arange(POOL_RW // PAGE), run))[:pages]
    places[100:140] = run
    local = src.ctypes.data + np.arange(pages, dtype=np.uint64) * PAGE
    remote = (kv.base + places * PAGE).astype(np.uint64)
    engine.transfer_arrays(agent, TransferOp.WRITE, local, remote, PAGE, timeout=10)
    pool = np.frombuffer(snapshot(engine, agent, kv), np.uint8).reshape(-1, PAGE)
    assert np.array_equal(pool[places], src.reshape(-1, PAGE))
    order = rng.permutation(pages)  # read back in another order, lengths as an array
    engine.transfer_arrays(agent, TransferOp.READ, back.ctypes.data + order * PAGE,
                           kv.base + places[order] * PAGE, np.full(pages, PAGE), timeout=10)
    assert np.array_equal(back, src)
    # async form, uneven lengths
    lengths = rng.integers(1, PAGE, pages)
    back[:] = 0
    engine.transfer_arrays_async(agent, TransferOp.READ, back.ctypes.data + order * PAGE,
                                 kv.base + places[order] * PAGE, lengths[order]).wait()
    for page, length in enumerate(lengths.tolist()):
        got = back[page * PAGE:(page + 1) * PAGE]
        assert np.array_equal(got[:length], src[page * PAGE:page * PAGE + length])
        assert not got[length:].any()


def test_neighbouring_ops_coalesce_into_one_run() -> None:
    """Ops that continue each other on both sides and in one segment are one copy; a gap
    on either side, or a segment change, starts a new run; ops keep their indexes."""
    a, b = (SegmentInfo(segment_id=i, engine="e", node_id="n", base=i << 16, length=1 << 16,
                        mem_type=MemType.MEM_HOST, perms=Perm.RW, epoch=1, shareable=True)
            for i in (1, 2))
    local = np.array([0x1000, 0x1100, 0x1200, 0x1300, 0x5000, 0x5100], np.int64)
    remote = np.array([0x1F000, 0x1F100, 0x1F300, 0x1F400, 0x20000, 0x20100], np.int64)
    sizes = np.full(6, 0x100, np.int64)
    where = np.array([0, 0, 0, 0, 1, 1])
    runs = _runs([a, b], where, local, remote, sizes, np.arange(6))
    # op 2 continues op 1 locally but not remotely
    assert runs.local.tolist() == [0x1000, 0x1200, 0x5000]
    assert runs.remote.tolist() == [0x1F000, 0x1F300, 0x20000]
    assert runs.lengths.tolist() == [0x200, 0x200, 0x200]
    assert [runs.segments[i].segment_id for i in runs.seg.tolist()] == [1, 1, 2]
    assert len(runs) == 6 and runs.nbytes == 0x600 and runs.failed() == list(range(6))


@FABRIC
def test_long_list_batches_take_the_array_resolver_with_the_same_errors(client) -> None:
    """A list of TransferOpDesc long enough to be resolved as arrays behaves as before:
    bytes land, and the first bad op raises what the scalar checks say, by index."""
    engine, agent = client
    kv = segment(engine, agent, "kv")
    src = pattern(3, 64 * PAGE)
    engine.register(src)
    descs = [(src.ctypes.data + i * PAGE, kv.base + (63 - i) * PAGE, PAGE) for i in range(64)]
    engine.transfer(agent, TransferOp.WRITE, descs, timeout=10)
    pool = np.frombuffer(snapshot(engine, agent, kv), np.uint8)[:64 * PAGE].reshape(64, PAGE)
    assert np.array_equal(pool[::-1], src.reshape(64, PAGE))
    before = snapshot(engine, agent, kv)
    crossing = [*descs[:40], (src.ctypes.data, kv.base + kv.length - 10, 11), *descs[40:]]
    with pytest.raises(OutOfRange, match="op 40 remote address.*crosses the end") as err:
        engine.transfer(agent, TransferOp.WRITE, crossing, timeout=10)
    assert err.value.failed == [40]
    assert snapshot(engine, agent, kv) == before


@FABRIC
def test_bad_arrays_raise_by_first_bad_index_and_move_nothing(client) -> None:
    engine, agent = client
    kv, ro = segment(engine, agent, "kv"), segment(engine, agent, "ro")
    src = pattern(5, 64 * PAGE)
    readonly = pattern(6, 64 * PAGE)
    readonly.flags.writeable = False
    engine.register(src)
    engine.register(readonly)
    before = snapshot(engine, agent, kv)
    local = src.ctypes.data + np.arange(64) * PAGE
    remote = kv.base + np.arange(64) * PAGE

    def refused(error: type, match: str, index: int | None, *arrays: object,
                op: TransferOp = TransferOp.WRITE) -> None:
        with pytest.raises(error, match=match) as err:
            engine.transfer_arrays(agent, op, *arrays, timeout=10)
        if index is not None:
            assert err.value.failed == [index]
        assert snapshot(engine, agent, kv) == before

    def with_at(array: np.ndarray, index: int, value: int) -> np.ndarray:
        changed = array.copy()
        changed[index] = value
        return changed

    refused(ParamInvalid, "differ in length: 64 local_addrs, 63 remote_addrs", None,
            local, remote[:63], PAGE)
    refused(ParamInvalid, "integer array.*float64", None, local.astype(float), remote, PAGE)
    refused(ParamInvalid, "integer array.*bool", None, local, remote, np.ones(64, bool))
    refused(ParamInvalid, "1-d array", None, local.reshape(8, 8), remote, PAGE)
    refused(ParamInvalid, "empty", None, local[:0], remote[:0], PAGE)
    refused(ParamInvalid, "op 9 local: length must be positive", 9, local, remote,
            with_at(np.full(64, PAGE), 9, -1))
    refused(ParamInvalid, "op 12 remote: address must not be negative", 12, local,
            with_at(remote, 12, -5), PAGE)
    huge = with_at(remote.astype(np.uint64), 20, (1 << 64) - 1)
    refused(ParamInvalid, "op 20: .*overflows", 20, local, huge, PAGE)
    refused(OutOfRange, "op 33 remote address.*crosses the end", 33, local,
            with_at(remote, 33, kv.base + kv.length - 100), PAGE)
    refused(OutOfRange, "op 2 local address.*must be registered", 2,
            with_at(local, 2, 4096), remote, PAGE)
    # a read-only segment, from op 17 on: refused once for the segment, naming op 17
    to_ro = remote.copy()
    to_ro[17:] = ro.base + np.arange(47) * PAGE
    refused(PermissionDenied, "op 17: segment .* is read-only", 17, local, to_ro, PAGE)
    # a READ landing in read-only local memory
    into_ro = with_at(local, 30, readonly.ctypes.data)
    refused(PermissionDenied, "op 30: local memory .* is read-only", 30, into_ro, remote, PAGE,
            op=TransferOp.READ)
    # the earliest bad op wins, whichever check finds it
    both = with_at(remote, 40, kv.base + kv.length)
    refused(OutOfRange, "op 5 local address", 5, with_at(local, 5, 4096), both, PAGE)


@pytest.mark.parametrize(("moves", "size"), [(300, 4096), (200, 64 << 10), (20, 300 << 10)],
                         ids=["small-one-thread", "many-large-cut-at-moves", "few-large-split"])
def test_copy_arrays_copies_every_byte_exactly_once(moves: int, size: int) -> None:
    """hixl.memory.copy_arrays: one thread for small moves; shares cut at move boundaries
    for many large ones, by bytes for a few; every move to a shuffled place, gaps kept."""
    from hixl.memory import copy_arrays

    src = pattern(11, moves * size)
    dst = np.zeros(moves * (size + 64), np.uint8)  # a 64-byte gap after every slot
    places = np.random.default_rng(3).permutation(moves)
    lengths = np.full(moves, size, np.int64)
    lengths[::7] -= 5  # uneven moves
    copy_arrays(dst.ctypes.data + places * (size + 64), src.ctypes.data + np.arange(moves) * size,
                lengths)
    slots = dst.reshape(moves, size + 64)
    for move, place in enumerate(places.tolist()):
        n = int(lengths[move])
        assert np.array_equal(slots[place, :n], src[move * size:move * size + n])
        assert not slots[place, n:].any()


@pytest.mark.parametrize("size", [8, 4096, 8192], ids=["8B", "4K", "8K"])
def test_small_uniform_moves_are_copied_by_numpy_views_byte_exactly(size: int) -> None:
    """copy_arrays' numpy path (moves of one small size): scattered, unaligned and
    interleaved addresses on both sides; bytes between the moves stay untouched."""
    from hixl.memory import copy_arrays

    moves = 101
    src = pattern(12, moves * size * 3)
    dst = np.zeros(moves * size * 3 + 17, np.uint8)
    rng = np.random.default_rng(size)
    src_at = rng.permutation(moves * 3)[:moves] * size + 0  # some neighbours, some gaps
    dst_at = rng.permutation(moves * 3)[:moves] * size + 17  # unaligned
    copy_arrays(dst.ctypes.data + dst_at, src.ctypes.data + src_at, np.full(moves, size))
    expected = np.zeros_like(dst)
    for d, s in zip(dst_at.tolist(), src_at.tolist(), strict=True):
        expected[d:d + size] = src[s:s + size]
    assert np.array_equal(dst, expected)


def test_table_arrays_follow_every_change() -> None:
    """AddressTable.arrays (what array batches search) is rebuilt after each insert,
    remove and clear, never served stale."""
    from hixl.table import AddressTable

    table: AddressTable[str] = AddressTable()
    assert [a.tolist() if hasattr(a, "tolist") else a for a in table.arrays()] == [[], [], []]
    table.insert(0x2000, 0x100, "b")
    table.insert(0x1000, 0x100, "a")
    bases, ends, values = table.arrays()
    assert (bases.tolist(), ends.tolist(), values) == ([0x1000, 0x2000], [0x1100, 0x2100],
                                                       ["a", "b"])
    assert table.arrays()[0] is bases  # cached while unchanged
    table.remove(0x1000)
    assert (table.arrays()[0].tolist(), table.arrays()[2]) == ([0x2000], ["b"])
    table.clear()
    assert table.arrays()[0].tolist() == []


@pytest.mark.parametrize("client", ["0"], ids=["socket"], indirect=True)
def test_a_socket_array_batch_over_two_segments_and_many_vectors(client) -> None:
    """1100 scattered pages read from two segments, switching every 50 ops: framed from
    the arrays as vector requests (a new one at each switch and every 512 ranges), every
    page back in its place."""
    engine, agent = client
    kv, ro = segment(engine, agent, "kv"), segment(engine, agent, "ro")
    fill = pattern(3, POOL_RW)
    engine.register(fill)
    engine.write(agent, fill, kv.base, timeout=10)
    ops = 1100
    rng = np.random.default_rng(11)
    size = 512  # small ranges: 1100 of them fit both pools
    on_ro = (np.arange(ops) // 50) % 2 == 1
    slots = rng.permutation(POOL_RO // size)[:ops]
    remote = np.where(on_ro, ro.base, kv.base) + slots * size
    back = np.zeros(ops * size, np.uint8)
    engine.register(back)
    engine.transfer_arrays(agent, TransferOp.READ, back.ctypes.data + np.arange(ops) * size,
                           remote, size, timeout=10)
    pools = {False: np.frombuffer(snapshot(engine, agent, kv), np.uint8),
             True: np.frombuffer(snapshot(engine, agent, ro), np.uint8)}
    for op in range(ops):
        start = int(slots[op]) * size
        expected = pools[bool(on_ro[op])][start:start + size]
        assert np.array_equal(back[op * size:(op + 1) * size], expected), op
