"""Where local memory lives: host DRAM, or an accelerator's memory (CUDA today).

Why: frameworks register their GPU KV cache by raw pointer (vLLM's and SGLang's Mooncake
connectors call `register_memory(tensor.data_ptr(), nbytes)`). A device address copied as
if it were host memory is a crash in the copy, not an error, so every address that
reaches hixl as local memory is placed first, and device memory is refused with a typed
error until a device path serves it (issue 21).

Asking costs nothing in a host-only process: the CUDA driver is consulted only when it is
already loaded in this process (`dlopen` with RTLD_NOLOAD). No driver loaded means no
CUDA allocation can exist here. Objects say where they live themselves: torch tensors
(`.device`), `__cuda_array_interface__` (CuPy, Numba), `__dlpack_device__` (DLPack). Other
accelerators fit the same shape: a driver probe for raw addresses and a device type for
objects.

Device memory that a device copier serves (hixl.staging: CUDA, or the host stand-in of the
tests) is registered by its range (`device_range`) and moved only through that copier.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

from hixl.errors import ParamInvalid, Unsupported

_CUDA_DRIVER = "libcuda.so.1"
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_DEVICE, _CU_MEMORYTYPE_ARRAY = 2, 3  # HOST (pinned) 1 and UNIFIED 4 are host-readable
# DLPack device types (dlpack.h): which ones the CPU can read directly
_DLPACK_HOST = {1: "cpu", 3: "cuda_host", 11: "rocm_host", 13: "cuda_managed"}
_DLPACK_DEVICE = {2: "cuda", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi", 10: "rocm",
                  12: "ext_dev", 14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia"}


@dataclass(frozen=True, slots=True)
class Placement:
    """`device` is "cpu" for host memory the CPU can copy (pageable, pinned, managed),
    else the accelerator and its index, e.g. "cuda:0"."""

    device: str = "cpu"

    @property
    def is_host(self) -> bool:
        return self.device == "cpu"


HOST = Placement()
_driver: Any = None  # the CUDA driver once found loaded (it is never unloaded)


def _loaded_cuda_driver() -> Any:
    global _driver
    if _driver is None:
        try:
            driver = ctypes.CDLL(_CUDA_DRIVER, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            return None  # not loaded in this process: it holds no CUDA memory
        driver.cuPointerGetAttribute.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
        driver.cuPointerGetAttribute.restype = ctypes.c_int
        _driver = driver
    return _driver


def locate_address(addr: int) -> Placement:
    """Where the memory at `addr` lives (the CUDA driver's view when it is loaded)."""
    driver = _loaded_cuda_driver()
    if driver is None:
        return HOST
    memory_type = ctypes.c_uint(0)
    if driver.cuPointerGetAttribute(ctypes.byref(memory_type), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                    ctypes.c_void_p(addr)) != 0:
        return HOST  # not a CUDA pointer (or the driver was never initialized)
    if memory_type.value not in (_CU_MEMORYTYPE_DEVICE, _CU_MEMORYTYPE_ARRAY):
        return HOST
    ordinal = ctypes.c_int(-1)
    driver.cuPointerGetAttribute(ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                 ctypes.c_void_p(addr))
    return Placement(f"cuda:{ordinal.value}" if ordinal.value >= 0 else "cuda")


def locate_object(obj: Any) -> Placement | None:
    """Where an object's memory lives, if the object says (None: it does not)."""
    device = getattr(obj, "device", None)
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size") and device is not None:
        kind = getattr(device, "type", str(device))  # a torch tensor
        if kind == "cpu":
            return HOST
        index = getattr(device, "index", None)
        return Placement(f"{kind}:{index}" if index is not None else str(kind))
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None:  # its device: the driver's answer for its pointer, if loaded
        try:
            placement = locate_address(int(interface["data"][0])) if _driver is not None \
                else HOST
        except (KeyError, TypeError, ValueError, IndexError):
            placement = HOST
        return placement if not placement.is_host else Placement("cuda")
    dlpack_device = getattr(obj, "__dlpack_device__", None)
    if callable(dlpack_device):
        try:
            kind, index = dlpack_device()
        except (TypeError, ValueError):
            return None
        if int(kind) in _DLPACK_HOST:
            return HOST
        return Placement(f"{_DLPACK_DEVICE.get(int(kind), f'dlpack device type {int(kind)}')}:"
                         f"{int(index)}")
    return None


def device_range(obj: Any) -> tuple[int, int]:
    """(address, bytes) of a device array object: a torch tensor, or an object with
    `__cuda_array_interface__` (CuPy, Numba). A non-contiguous one is refused
    (ParamInvalid): its bytes are not one range. Other DLPack device objects are refused
    (Unsupported) with the way round: torch.from_dlpack(obj), or (address, length)."""
    if callable(getattr(obj, "data_ptr", None)) and hasattr(obj, "element_size"):
        if not obj.is_contiguous():
            raise ParamInvalid(f"the {obj.device} tensor is not contiguous (shape "
                               f"{tuple(obj.shape)}, strides {tuple(obj.stride())}): its bytes "
                               "are not one range; register tensor.contiguous() instead")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    interface = getattr(obj, "__cuda_array_interface__", None)
    if isinstance(interface, dict):
        shape = tuple(interface.get("shape", ()))
        itemsize = int(str(interface.get("typestr", "|u1"))[2:] or 1)
        count = 1
        for extent in shape:
            count *= int(extent)
        strides = interface.get("strides")
        if strides is not None:
            expected, contiguous = itemsize, True
            for extent, stride in zip(reversed(shape), reversed(tuple(strides)), strict=True):
                if extent > 1 and stride != expected:
                    contiguous = False
                expected *= extent
            if not contiguous:
                raise ParamInvalid(f"the {type(obj).__name__} is not C-contiguous (strides "
                                   f"{tuple(strides)}): its bytes are not one range")
        return int(interface["data"][0]), count * itemsize
    raise Unsupported(f"the {type(obj).__name__} says it lives on a device but exposes no "
                      "device pointer hixl reads (torch tensor, __cuda_array_interface__); "
                      "register torch.from_dlpack(obj), or its (address, length)")


def same_device(placement: Placement, device: str) -> bool:
    """Whether memory at `placement` is on `device` ("cuda" without an index: any CUDA
    device, its index unknown)."""
    return placement.device == device or (
        ":" not in placement.device and device.startswith(placement.device + ":"))


def require_host(placement: Placement, what: str) -> None:
    """Raise Unsupported, naming `what` and the device, for memory the CPU cannot copy."""
    if not placement.is_host:
        raise Unsupported(
            f"{what} is {placement.device} device memory, and no device copier serves it "
            "here (CUDA memory needs the CUDA driver loaded in this process; other "
            "accelerators have no device path yet); register host memory (e.g. a pinned "
            "host buffer, tensor.cpu()) instead")
