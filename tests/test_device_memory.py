"""Device memory as the local side (issue 21, item 1): local memory is placed before it is
used, and device memory is refused with a typed error naming it — never copied as host
memory (a crash). Objects say where they live (torch, DLPack, __cuda_array_interface__);
raw addresses are asked of the CUDA driver when it is loaded in this process.

The first group runs everywhere. The second needs a CUDA device and is skipped, visibly,
without one (scripts/gpu_check.sh runs it on a GPU machine).
"""

from __future__ import annotations

import numpy as np
import pytest

from hixl import device
from hixl.client.engine import Engine
from hixl.client.mooncake import TransferEngine
from hixl.errors import Unsupported

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
    assert device.locate_object(obj).device == name
    with Engine("127.0.0.1") as engine, pytest.raises(Unsupported, match=f"{name} device memory"):
        engine.register(obj)


# ---------------------------------------------------------------- on a CUDA device

cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA device (scripts/gpu_check.sh on a GPU machine)")


@cuda
def test_cuda_tensors_and_their_raw_pointers_are_refused_not_copied() -> None:
    tensor = torch.arange(4096, dtype=torch.uint8, device="cuda")
    addr, nbytes = tensor.data_ptr(), tensor.numel()
    assert device.locate_address(addr).device == f"cuda:{tensor.device.index}"
    assert device.locate_address(torch.zeros(16).data_ptr()).is_host
    pinned = torch.zeros(4096, dtype=torch.uint8).pin_memory()
    assert device.locate_address(pinned.data_ptr()).is_host
    with Engine("127.0.0.1") as engine:
        with pytest.raises(Unsupported, match="cuda:"):
            engine.register(tensor)
        with pytest.raises(Unsupported, match=f"{addr:#x}.*cuda:"):
            engine.register(addr, nbytes)  # as vLLM's Mooncake connector registers it
        engine.register(pinned)  # pinned host memory is host memory
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        assert te.register_memory(addr, nbytes) < 0
        assert "cuda" in te.get_last_error()
    finally:
        te.close()


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
