"""Mooncake's tensor layout, byte for byte: a 304-byte `TensorMetadata`, then the data.

Why byte for byte: callers build `put_tensor_from` buffers and read `get_tensor_into`
buffers themselves (the layout is part of Mooncake's API: "[TensorMetadata][tensor
data]"), so the header must be the one Mooncake 0.3.13 writes (checked against its
`_serialize_tensor` in tests/test_mooncake_tensors.py). torch is imported only when a
tensor is encoded or decoded: the store never needs it otherwise (extra `torch`).

Layout (little-endian): magic "NOOM", version 1 (u16), header size 304 (u16), dtype code
(u32), ndim (u32), 8 reserved bytes, data offset 304 (u64), data bytes (u64), the shape
as 8 int64 slots (-1 past ndim), the same shape again, 136 zero bytes.
"""

from __future__ import annotations

import ctypes
import math
import struct
from typing import Any

METADATA = struct.Struct("<4sHHII8xQQ8q8q136x")
METADATA_SIZE = METADATA.size  # 304
MAGIC = b"NOOM"
VERSION = 1
MAX_DIMS = 8
# Mooncake's dtype codes (torch dtype attribute names); complex and others are refused
DTYPE_CODES = {"float32": 0, "float64": 1, "int8": 2, "uint8": 3, "int16": 4, "uint16": 5,
               "int32": 6, "uint32": 7, "int64": 8, "uint64": 9, "bool": 10, "float16": 11,
               "bfloat16": 12, "float8_e4m3fn": 13, "float8_e5m2": 14}
DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


class TensorFormatError(ValueError):
    """Not a tensor this layout can carry, or bytes that are not one."""


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is the `torch` extra
        raise TensorFormatError("the tensor API needs torch: pip install 'hixl[torch]'") from exc
    return torch


def encode(tensor: Any) -> tuple[bytes, memoryview]:
    """(metadata, data) of a CPU tensor: data is a view of the tensor's bytes (of a
    contiguous copy when the tensor is not contiguous), so a put sends it without a copy."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise TensorFormatError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise TensorFormatError(f"tensor on {tensor.device}: this store moves CPU tensors "
                                "(copy it with .cpu() first)")
    name = str(tensor.dtype).removeprefix("torch.")
    code = DTYPE_CODES.get(name)
    if code is None:
        raise TensorFormatError(f"dtype {tensor.dtype} is not one Mooncake's tensor format "
                                f"carries ({', '.join(DTYPE_CODES)})")
    shape = tuple(tensor.shape)
    if len(shape) > MAX_DIMS:
        raise TensorFormatError(f"{len(shape)} dimensions; the format carries at most {MAX_DIMS}")
    flat = tensor.detach().contiguous().reshape(-1)
    data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
    slots = shape + (-1,) * (MAX_DIMS - len(shape))
    metadata = METADATA.pack(MAGIC, VERSION, METADATA_SIZE, code, len(shape), METADATA_SIZE,
                             len(data), *slots, *slots)
    return metadata, data.cast("B")


def parse(header: bytes | bytearray | memoryview, available: int) -> tuple[str, tuple[int, ...], int]:
    """(dtype name, shape, data bytes) of the metadata at the start of `header`; the value
    holds `available` bytes in all. Raises TensorFormatError naming what is wrong."""
    if available < METADATA_SIZE:
        raise TensorFormatError(f"{available} bytes cannot hold the {METADATA_SIZE}-byte "
                                "tensor metadata")
    magic, version, size, code, ndim, offset, nbytes, *slots = METADATA.unpack_from(header)
    if magic != MAGIC or version != VERSION or size != METADATA_SIZE or offset != METADATA_SIZE:
        raise TensorFormatError("no tensor metadata here (magic, version or size differ)")
    name = DTYPE_NAMES.get(code)
    if name is None or ndim > MAX_DIMS:
        raise TensorFormatError(f"tensor metadata with dtype code {code} and {ndim} dimensions")
    shape = tuple(slots[:ndim])
    itemsize = _torch().empty(0, dtype=getattr(_torch(), name)).element_size()
    if any(d < 0 for d in shape) or math.prod(shape) * itemsize != nbytes:
        raise TensorFormatError(f"tensor metadata: shape {shape} of {name} is not {nbytes} bytes")
    if METADATA_SIZE + nbytes > available:
        raise TensorFormatError(f"tensor of {nbytes} bytes, but the value holds "
                                f"{available - METADATA_SIZE} after its metadata")
    return name, shape, nbytes


def decode(value: bytes | bytearray | memoryview) -> Any:
    """A new tensor (its own memory) from a value in the layout."""
    torch = _torch()
    name, shape, nbytes = parse(value, len(value))
    dtype = getattr(torch, name)
    out = torch.empty(shape, dtype=dtype)
    if nbytes:
        out.reshape(-1).view(torch.uint8).numpy()[:] = memoryview(value)[
            METADATA_SIZE:METADATA_SIZE + nbytes]
    return out


def view(address: int, size: int) -> Any:
    """A tensor over the data of the value at `address` (`size` bytes): it shares that
    memory, as Mooncake's get_tensor_into returns."""
    torch = _torch()
    raw = (ctypes.c_ubyte * size).from_address(address)
    name, shape, nbytes = parse(memoryview(raw), size)
    dtype = getattr(torch, name)
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    data = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes, offset=METADATA_SIZE)
    return data.view(dtype).reshape(shape)


def split(tensor: Any, parts: int, dim: int) -> list[Any]:
    """`tensor` cut into `parts` equal shards along `dim` (tensor-parallel puts)."""
    if tensor.dim() == 0 or not -tensor.dim() <= dim < tensor.dim():
        raise TensorFormatError(f"split_dim {dim} is not a dimension of shape {tuple(tensor.shape)}")
    if tensor.shape[dim] % parts:
        raise TensorFormatError(f"dimension {dim} of size {tensor.shape[dim]} does not split "
                                f"into {parts} equal shards")
    return list(tensor.chunk(parts, dim))


def tp_key(base_key: str, rank: int) -> str:
    """The key of one tensor-parallel shard, as Mooncake names it."""
    return f"{base_key}_tp_{rank}"
