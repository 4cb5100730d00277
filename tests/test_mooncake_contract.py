"""Contract details of Mooncake's store API that callers rely on (issue 17, item 1), each
as Mooncake 0.3.13 behaves: ReplicateConfig.soft_pin_ttl_ms (None default, TypeError
outside [0, 2**64)), a TTL without SoftPinAction.ENABLE refused (-600), get_into_ranges
answering one list per key when a key's lists disagree, and the module functions
(bind_to_numa_node, the tensor helpers). Real hixl-master process, real store client."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from test_mooncake_store import master, new_store  # noqa: F401  (fixture)

from hixl.client.mooncake import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
from hixl.client.mooncake import store as store_module
from hixl.store_codes import ErrorCode
from hixl.tools.daemons import MasterProcess

INVALID = int(ErrorCode.INVALID_PARAMS)


@pytest.fixture
def store(master: MasterProcess) -> Iterator[MooncakeDistributedStore]:  # noqa: F811
    store = new_store(master)
    yield store
    store.close()


def test_soft_pin_ttl_is_optional_and_typed() -> None:
    config = ReplicateConfig()
    assert config.soft_pin_ttl_ms is None
    for good in (None, 0, 1, 2**64 - 1):
        config.soft_pin_ttl_ms = good
        assert config.soft_pin_ttl_ms == good
    for bad in (-1, 2**64, 1.5, "10", True):
        with pytest.raises(TypeError, match="soft_pin_ttl_ms"):
            config.soft_pin_ttl_ms = bad
        with pytest.raises(TypeError, match="soft_pin_ttl_ms"):
            ReplicateConfig(soft_pin_ttl_ms=bad)
    assert config.soft_pin_ttl_ms == 2**64 - 1  # a refused value changes nothing


def test_a_ttl_without_soft_pin_enable_is_invalid(store: MooncakeDistributedStore) -> None:
    for action in (SoftPinAction.PRESERVE, SoftPinAction.DISABLE):
        config = ReplicateConfig(soft_pin_action=action, soft_pin_ttl_ms=60_000)
        assert store.put("k", b"v" * 100, config) == INVALID
        assert "ENABLE" in store.get_last_error()
        assert store.upsert("k", b"v" * 100, config) == INVALID
        assert store.is_exist("k") == 0  # nothing stored
    enabled = ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=60_000)
    assert store.put("k", b"v" * 100, enabled) == 0
    assert store.get("k") == b"v" * 100
    assert store.put("k2", b"w" * 10, ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE)) == 0


def test_get_into_ranges_keeps_one_list_per_key(store: MooncakeDistributedStore) -> None:
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(8192, np.uint8)
    assert store.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    assert store.put("a", src.tobytes()) == 0
    assert store.put("b", src[::-1].tobytes()) == 0
    d = dst.ctypes.data
    result = store.get_into_ranges(
        [d, d + 4096],
        [["a", "b", "a"], ["b"]],
        [[[0, 100], [200], []], [[0]]],            # dst offsets
        [[[10, 20], [0, 1], []], [[5]]],           # src offsets: "b" of buffer 0 has two
        [[[5, 6], [7], []], [[8]]])                # sizes
    assert result == [[[5, 6], [INVALID], []], [[8]]]
    assert bytes(dst[:5]) == src[10:15].tobytes() and bytes(dst[100:106]) == src[20:26].tobytes()
    assert bytes(dst[4096:4104]) == src[::-1][5:13].tobytes()
    assert bytes(dst[200:207]) == bytes(7)  # the malformed key wrote nothing


def test_module_functions() -> None:
    before = os.sched_getaffinity(0)
    try:
        store_module.bind_to_numa_node(0)  # every Linux machine has node 0
        assert os.sched_getaffinity(0) <= set(range(os.cpu_count() or 1))
    finally:
        os.sched_setaffinity(0, before)
    with pytest.raises(ValueError, match="NUMA node 4095 does not exist"):
        store_module.bind_to_numa_node(4095)
    with pytest.raises(TypeError):
        store_module.bind_to_numa_node("0")  # type: ignore[arg-type]
    torch = pytest.importorskip("torch")
    t = torch.arange(10, dtype=torch.int32)
    metadata, ptr, nbytes, flat = store_module._serialize_tensor(t)
    assert len(metadata) == store_module._tensor_metadata_size() == 304
    assert nbytes == 40 and ptr == flat.data_ptr()
    back = store_module._deserialize_tensor(metadata + t.numpy().tobytes())
    assert torch.equal(back, t)


def test_setup_again_after_close_is_a_new_client(master: MasterProcess) -> None:  # noqa: F811
    """setup() after close() on the same object works (Mooncake allows it): a new client
    whose earlier objects went with its unmounted segment, while replicas on other
    clients stay readable."""
    first, other = new_store(master), new_store(master)
    try:
        assert first.put("mine", b"m" * 1000,
                         ReplicateConfig(preferred_segment=first.get_hostname())) == 0
        assert other.put("theirs", b"t" * 1000,
                         ReplicateConfig(preferred_segment=other.get_hostname())) == 0
        assert first.close() == 0
        assert first.put("k", b"v") < 0  # closed
        assert first.setup("127.0.0.1", "P2PHANDSHAKE", 4 << 20, 1 << 20, "tcp", "",
                           master.target) == 0, first.get_last_error()
        assert first.setup("127.0.0.1", "P2PHANDSHAKE", 4 << 20, 1 << 20, "tcp", "",
                           master.target) == INVALID  # already set up
        assert "already set up" in first.get_last_error()
        assert first.get("theirs") == b"t" * 1000
        assert first.is_exist("mine") == 0 and other.is_exist("mine") == 0
        assert first.put("again", b"a" * 5000) == 0
        assert other.get("again") == b"a" * 5000
    finally:
        first.close()
        other.close()


def test_unregistered_buffers_move_bytes_and_unmapped_ones_are_refused(
        store: MooncakeDistributedStore) -> None:
    """put_from / get_into and their batch forms take memory never registered, as
    Mooncake's TCP transport does (LMCache's P2P mode registers nothing); a range with
    unmapped pages is INVALID_PARAMS, not a crash, and stores nothing."""
    src = (np.arange(16384) % 251).astype(np.uint8)
    dst = np.zeros(16384, np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    assert store.put_from("one", s, 4096) == 0
    assert store.get_into("one", d, 16384) == 4096
    assert bytes(dst[:4096]) == bytes(src[:4096])
    assert store.batch_put_from(["a", "b"], [s + 4096, s + 8192], [4096, 8192]) == [0, 0]
    dst[:] = 0
    assert store.batch_get_into(["a", "b"], [d, d + 4096], [4096, 8192]) == [4096, 8192]
    assert bytes(dst[:12288]) == bytes(src[4096:16384])
    # registered buffers still work, and unregistering leaves plain memory usable
    assert store.register_buffer(s, src.nbytes) == 0
    assert store.put_from("reg", s, 100) == 0
    assert store.unregister_buffer(s) == 0
    assert store.unregister_buffer(s) == INVALID
    assert store.put_from("after", s, 100) == 0 and store.get("after") == bytes(src[:100])
    # unmapped memory: refused before anything moves
    import mmap
    hole = mmap.mmap(-1, 1 << 16)
    addr = ctypes_address(hole)
    hole.close()  # now unmapped
    assert store.put_from("hole", addr, 4096) == INVALID
    assert "unmapped" in store.get_last_error()
    assert store.get_into("one", addr, 4096) == INVALID
    assert store.batch_put_from(["x", "y"], [s, addr], [10, 10]) == [0, INVALID]
    assert store.is_exist("hole") == 0 and store.is_exist("y") == 0


def ctypes_address(buffer: object) -> int:
    import ctypes
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def test_zero_local_buffer_fails_value_calls_as_mooncake(master: MasterProcess) -> None:  # noqa: F811
    store = new_store(master, buffer=0)
    try:
        assert store.put("v", b"x" * 1000) == INVALID
        assert "local_buffer_size is 0" in store.get_last_error()
        assert store.is_exist("v") == 0
        assert store.put_batch(["v1", "v2"], [b"a", b"b"]) == INVALID
        data = (np.arange(4096) % 7).astype(np.uint8)
        assert store.register_buffer(data.ctypes.data, data.nbytes) == 0
        assert store.put_from("f", data.ctypes.data, 4096) == 0  # own buffers still work
        assert store.get("f") == b"" and store.last_error_code == INVALID
        assert store.get_buffer("f") is None
        out = np.zeros(4096, np.uint8)
        assert store.get_into("f", out.ctypes.data, 4096) == 4096
        assert bytes(out) == bytes(data)
    finally:
        store.close()
