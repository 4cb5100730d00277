"""Device memory as the local side (issue 21): local memory is placed before it is used;
device memory is moved by its device's copier (hixl.staging), and refused with a typed
error naming it where there is none — never copied as host memory (a crash). Objects say where they live (torch, DLPack, __cuda_array_interface__);
raw addresses are asked of the CUDA driver when it is loaded in this process.

The first group runs everywhere. The second needs a CUDA device and is skipped, visibly,
without one (scripts/gpu_check.sh runs it on a GPU machine): D2rH / rH2D on the mapped
and socket paths with every byte checked, and the bad input of issue 21 on a device.
tests/test_device_staging.py runs the same paths with host memory standing in.
"""

from __future__ import annotations

import numpy as np
import pytest

from hixl import device
from hixl.client.engine import Engine
from hixl.client.mooncake import TransferEngine
from hixl.errors import HixlError, ParamInvalid, Unsupported
from hixl.types import MemType, TransferOp, TransferOpDesc

torch = pytest.importorskip("torch")


class DLPackOnDevice:
    """What a framework's device array looks like through DLPack (device type, index)."""

    def __init__(self, kind: int, index: int) -> None:
        self._device = (kind, index)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


class CudaArrayInterface:
    """What CuPy / Numba device arrays expose (the pointer is never touched)."""

    __cuda_array_interface__ = {"shape": (16,), "typestr": "|u1", "data": (0x7F0000000000, False),
                                "version": 3}


def test_host_memory_is_host() -> None:
    array = np.zeros(4096, np.uint8)
    assert device.locate_address(array.ctypes.data).is_host
    for obj in (array, torch.zeros(8), memoryview(bytearray(8))):
        placement = device.locate_object(obj)
        assert placement is None or placement.is_host
    for kind in (1, 3, 13):  # CPU, CUDA pinned host, CUDA managed: the CPU copies them
        assert device.locate_object(DLPackOnDevice(kind, 0)).is_host


@pytest.mark.parametrize("obj, name", [(DLPackOnDevice(2, 1), "cuda:1"),
                                       (DLPackOnDevice(10, 0), "rocm:0"),
                                       (CudaArrayInterface(), "cuda")])
def test_device_objects_are_refused_by_name(obj: object, name: str) -> None:
    """Without the CUDA driver loaded, no copier serves them: Unsupported, naming the
    device. With it (a GPU machine), a CUDA copier is set up and then refuses them for
    what they are: no such device, or a pointer the driver does not know."""
    assert device.locate_object(obj).device == name
    with Engine("127.0.0.1") as engine, pytest.raises(HixlError) as info:
        engine.register(obj)
    if device._loaded_cuda_driver() is None or name.startswith("rocm"):
        assert isinstance(info.value, Unsupported) and f"{name} device memory" in str(info.value)


# ---------------------------------------------------------------- on a CUDA device

cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA device (scripts/gpu_check.sh on a GPU machine)")


def kv_base(engine: Engine, agent: str) -> int:
    (segment,) = [s for s in engine.segments(agent) if s.name == "kv"]
    return segment.base


def remote_bytes(engine: Engine, agent: str, addr: int, nbytes: int) -> np.ndarray:
    out = np.zeros(nbytes, np.uint8)
    engine.register(out)
    engine.read(agent, out, addr, timeout=20)
    return out


@cuda
def test_cuda_tensors_and_their_raw_pointers_get_their_devices_copier() -> None:
    tensor = torch.arange(4096, dtype=torch.uint8, device="cuda")
    addr, nbytes = tensor.data_ptr(), tensor.numel()
    assert device.locate_address(addr).device == f"cuda:{tensor.device.index}"
    assert device.locate_address(torch.zeros(16).data_ptr()).is_host
    pinned = torch.zeros(4096, dtype=torch.uint8).pin_memory()
    assert device.locate_address(pinned.data_ptr()).is_host
    with Engine("127.0.0.1") as engine:
        handle = engine.register(tensor)
        assert handle.mem_type == MemType.MEM_DEVICE
        assert handle.copier.device == f"cuda:{tensor.device.index}"
        engine.deregister(handle)
        raw = engine.register(addr, nbytes)  # as vLLM's Mooncake connector registers it
        assert raw.copier is handle.copier  # one copier (stream) per device
        assert engine.register(pinned).copier is None  # pinned host memory is host memory
        with pytest.raises(ParamInvalid, match="not contiguous"):
            engine.register(torch.zeros(64, 64, device="cuda")[:, ::2])
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        assert te.register_memory(addr, nbytes) == 0, te.get_last_error()
    finally:
        te.close()


@cuda
@pytest.mark.parametrize("fabric", ["1", "0"], ids=["mapped", "socket"])
def test_d2rh_and_rh2d_move_every_byte(agent_process, fabric: str) -> None:
    agent = agent_process(config={"pool": [{"name": "kv", "size": 64 << 20}]})
    nbytes = 8784 << 10
    with Engine("127.0.0.1", {"EnableUseFabricMem": fabric}) as engine:
        engine.connect(agent.engine, timeout=10)
        base = kv_base(engine, agent.engine)
        assert (engine.route(agent.engine, base) == "fabric") == (fabric == "1")
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        back = torch.zeros_like(src)
        engine.register(src)
        engine.register(back)
        engine.write(agent.engine, src.data_ptr(), base, nbytes, timeout=20)  # D2rH
        assert np.array_equal(remote_bytes(engine, agent.engine, base, nbytes), src.cpu().numpy())
        engine.read(agent.engine, back.data_ptr(), base, nbytes, timeout=20)  # rH2D
        assert torch.equal(back, src)
        # 4 KiB ops, scattered: each its own device copy (mapped) or packed in slots (socket)
        descs = [TransferOpDesc(src.data_ptr() + i * 4096, base + (63 - i) * 4096, 4096)
                 for i in range(64)]
        engine.transfer(agent.engine, TransferOp.WRITE, descs, timeout=20)
        landed = remote_bytes(engine, agent.engine, base, 64 * 4096).reshape(64, 4096)
        assert np.array_equal(landed[::-1].reshape(-1), src[:64 * 4096].cpu().numpy())


@cuda
def test_device_memory_freed_or_resized_after_registration_is_a_typed_error(agent_process
                                                                            ) -> None:
    agent = agent_process(config={"pool": [{"name": "kv", "size": 64 << 20}]})
    with Engine("127.0.0.1", {"EnableUseFabricMem": "0"}) as engine:
        engine.connect(agent.engine, timeout=10)
        base = kv_base(engine, agent.engine)
        resized = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        engine.register(resized)
        addr = resized.data_ptr()
        resized.resize_(64 << 20)  # a new storage; the registered one went back to torch
        with pytest.raises(ParamInvalid, match="resized or moved"):
            engine.write(agent.engine, addr, base, 1 << 20, timeout=20)
        freed = torch.zeros(32 << 20, dtype=torch.uint8, device="cuda")
        addr = freed.data_ptr()
        engine.register(addr, 32 << 20)  # by pointer: nothing keeps the tensor alive
        del freed
        torch.cuda.empty_cache()  # its block goes back to the driver
        with pytest.raises(ParamInvalid, match="no longer|runs past"):
            engine.write(agent.engine, addr, base, 1 << 20, timeout=20)


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (memory on one, the copier's stream on the other)")
def test_a_registration_on_another_device_than_the_stream_is_refused() -> None:
    from hixl.staging import CudaCopier

    copier = CudaCopier(0)
    try:
        with Engine("127.0.0.1", device_copier=copier) as engine, \
                pytest.raises(ParamInvalid, match="cuda:1, but .* cuda:0"):
            engine.register(torch.zeros(4096, dtype=torch.uint8, device="cuda:1"))
    finally:
        copier.close()


@cuda
def test_store_refuses_device_pointers_without_crashing() -> None:
    from test_mooncake_store import MasterProcess, new_store

    from hixl.client.mooncake import MooncakeDistributedStore

    tensor = torch.arange(4096, dtype=torch.uint8, device="cuda")
    with MasterProcess() as master:
        store: MooncakeDistributedStore = new_store(master)
        try:
            assert store.put_from("k", tensor.data_ptr(), 4096) == -600
            assert "cuda" in store.get_last_error()
            assert store.register_buffer(tensor.data_ptr(), 4096) < 0
            assert store.put_tensor("t", tensor) == -600  # device tensors: not yet
            assert store.is_exist("k") == 0 and store.is_exist("t") == 0
        finally:
            store.close()
