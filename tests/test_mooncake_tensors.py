"""Mooncake's tensor API on hixl's store (issue 17, item 6): CPU tensors round-trip with
dtype, shape and every byte; the byte layout is Mooncake's own ([304-byte metadata][data],
checked against the installed Mooncake's serializer); bad tensors and bad buffers get
INVALID_PARAMS for their key alone. Real hixl-master process, real store client."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np
import pytest
from test_mooncake_store import master, new_store  # noqa: F401  (fixture)

from hixl.client.mooncake import MooncakeDistributedStore, ReplicateConfig
from hixl.client.mooncake import tensors as layout
from hixl.store_codes import ErrorCode
from hixl.tools.daemons import MasterProcess

torch = pytest.importorskip("torch")

INVALID = int(ErrorCode.INVALID_PARAMS)
DTYPES = [torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
          torch.int64, torch.bool, torch.float16, torch.bfloat16, torch.uint16, torch.uint32,
          torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes reinterpreted as `dtype` (so every bit pattern is exercised)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = int(np.prod(shape)) if shape else 1
    if not count:
        return torch.empty(shape, dtype=dtype)
    raw = np.random.default_rng(seed).integers(0, 256, count * itemsize, dtype=np.uint8)
    if dtype == torch.bool:
        raw = raw & 1
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads included)."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.reshape(-1).view(torch.uint8)
            .numpy().tobytes() == b.reshape(-1).view(torch.uint8).numpy().tobytes()) \
        if a.numel() else (a.dtype == b.dtype and a.shape == b.shape)


@pytest.fixture
def store(master: MasterProcess) -> Iterator[MooncakeDistributedStore]:  # noqa: F811
    store = new_store(master)
    yield store
    store.close()


@pytest.mark.parametrize("shape", [(3, 5), (2, 1, 4, 1, 3), (7,), (0, 4)])
def test_layout_is_mooncakes_byte_for_byte(shape: tuple[int, ...]) -> None:
    mooncake_store = pytest.importorskip("mooncake.store")
    for dtype in DTYPES:
        tensor = sample(dtype, shape)
        metadata, data = layout.encode(tensor)
        theirs = mooncake_store._serialize_tensor(tensor)
        assert metadata == theirs[0], (dtype, shape)
        assert len(data) == theirs[2]
        assert mooncake_store._tensor_metadata_size() == layout.METADATA_SIZE
        back = layout.decode(metadata + bytes(data))
        assert same(back, tensor)
        if tensor.numel() and dtype not in (torch.bfloat16,):
            assert same(mooncake_store._deserialize_tensor(metadata + bytes(data)), tensor)


def test_every_dtype_and_shape_round_trips_through_the_store(
        store: MooncakeDistributedStore) -> None:
    shapes = [(), (1,), (4, 33), (2, 3, 4, 5, 1, 2, 1, 3), (0,), (5, 0, 2)]
    keys, values = [], []
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(shapes):
            keys.append(f"t-{i}-{j}")
            values.append(sample(dtype, shape, seed=i * 10 + j))
    assert store.batch_put_tensor(keys, values) == [0] * len(keys)
    got = store.batch_get_tensor(keys)
    for key, want, have in zip(keys, values, got, strict=True):
        assert have is not None and same(have, want), key
    # single forms, a non-contiguous tensor (stored as its contiguous copy), upsert, pub
    t = sample(torch.float32, (6, 4), seed=99).t()
    assert store.put_tensor("nc", t) == 0
    assert same(store.get_tensor("nc"), t.contiguous())
    assert store.upsert_tensor("nc", t + 1) == 0
    assert same(store.get_tensor("nc"), (t + 1).contiguous())
    assert store.pub_tensor("pub", t, ReplicateConfig()) == 0
    assert same(store.get_tensor("pub"), t.contiguous())
    assert store.get_size("nc") == layout.METADATA_SIZE + t.numel() * 4
    assert store.get_tensor("missing") is None
    assert store.batch_get_tensor(["nc", "missing"])[1] is None


def test_into_and_from_registered_buffers_share_memory(store: MooncakeDistributedStore) -> None:
    buffer = np.zeros(1 << 16, np.uint8)
    base = buffer.ctypes.data
    assert store.register_buffer(base, buffer.nbytes) == 0
    t = sample(torch.int16, (16, 8), seed=5)
    assert store.put_tensor("k", t) == 0
    view = store.get_tensor_into("k", base, buffer.nbytes)
    assert same(view, t)
    view[0, 0] = 1234  # it is the caller's buffer
    assert int(np.frombuffer(buffer[layout.METADATA_SIZE:layout.METADATA_SIZE + 2],
                             np.int16)[0]) == 1234
    # the buffer now holds [metadata][data]: put it back from there under another key
    size = layout.METADATA_SIZE + t.numel() * 2
    assert store.put_tensor_from("k2", base, size) == 0
    expected = t.clone()
    expected[0, 0] = 1234
    assert same(store.get_tensor("k2"), expected)
    assert store.batch_put_tensor_from(["k3", "k4"], [base, base], [size, size]) == [0, 0]
    second = base + 32768
    views = store.batch_get_tensor_into(["k3", "missing", "k4"], [base, base + 16384, second],
                                        [16384, 16384, 16384])
    assert same(views[0], expected) and views[1] is None and same(views[2], expected)
    # too small a buffer: no tensor, and nothing written past it
    assert store.get_tensor_into("k", base, 100) is None


def test_tensor_parallel_shards(store: MooncakeDistributedStore) -> None:
    t = sample(torch.float32, (3, 4), seed=1)
    assert store.put_tensor_with_tp("w", t, tp_rank=0, tp_size=2, split_dim=1) == 0
    assert store.get_tensor("w") is None  # only the shards exist, as in Mooncake
    for rank, shard in enumerate(t.chunk(2, 1)):
        assert same(store.get_tensor(f"w_tp_{rank}"), shard.contiguous())
        assert same(store.get_tensor_with_tp("w", tp_rank=rank, tp_size=2), shard.contiguous())
    codes = store.batch_put_tensor_with_tp(["a", "b"], [t, t[:, :3]], tp_size=2, split_dim=1)
    assert codes == [0, INVALID]  # 3 columns do not split in two: that key alone refused
    got = store.batch_get_tensor_with_tp(["a", "b"], tp_rank=1, tp_size=2)
    assert same(got[0], t.chunk(2, 1)[1].contiguous()) and got[1] is None
    assert store.get_tensor_with_tp("a", tp_rank=2, tp_size=2) is None  # rank out of range


def test_bad_tensors_and_buffers_are_refused_per_key(store: MooncakeDistributedStore) -> None:
    good = sample(torch.int32, (4,))
    codes = store.batch_put_tensor(
        ["ok", "list", "complex", "nine-dims"],
        [good, [1, 2], torch.zeros(2, dtype=torch.complex64), torch.zeros([1] * 9)])
    assert codes == [0, INVALID, INVALID, INVALID]
    assert "9 dimensions" in store.last_error or "dimensions" in store.last_error
    assert store.is_exist("list") == 0 and store.is_exist("nine-dims") == 0
    assert store.batch_put_tensor(["a", "b"], [good]) == [INVALID]  # lengths differ
    # put_tensor_from: bytes that are not a tensor, a size that cuts the data, unregistered
    buffer = np.zeros(4096, np.uint8)
    assert store.register_buffer(buffer.ctypes.data, buffer.nbytes) == 0
    assert store.put_tensor_from("garbage", buffer.ctypes.data, 1000) == INVALID
    metadata, data = layout.encode(sample(torch.float64, (32,)))
    ctypes.memmove(buffer.ctypes.data, metadata, len(metadata))
    assert store.put_tensor_from("cut", buffer.ctypes.data, len(metadata) + 8) == INVALID
    loose = np.zeros(4096, np.uint8)
    assert store.put_tensor_from("loose", loose.ctypes.data, 400) == INVALID
    assert all(store.is_exist(k) == 0 for k in ("garbage", "cut", "loose"))
    # a value that is not a tensor reads as None, not as garbage
    assert store.put("bytes", b"x" * 400) == 0
    assert store.get_tensor("bytes") is None
