"""hixl: a one-sided, zero-copy transfer engine for LLM inference clusters.

The module exports HIXL's Python names (status codes, OPTION_* keys, MemType,
TransferOp, TransferStatus, MemDesc, TransferOpDesc), the HIXL-shaped `Hixl` facade
and the Pythonic `Engine`. The core modules (errors, options, types, memory, table,
wire, transports) import neither hixl.server nor hixl.client; `Hixl` and `Engine`
live in hixl.client and are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hixl.errors import (
    ALREADY_CONNECTED,
    FAILED,
    NOT_CONNECTED,
    NOTIFY_FAILED,
    PARAM_INVALID,
    RESOURCE_EXHAUSTED,
    SUCCESS,
    TIMEOUT,
    UNSUPPORTED,
    AlreadyConnected,
    AuthenticationFailed,
    HixlError,
    NotConnected,
    OutOfRange,
    ParamInvalid,
    PeerUnavailable,
    PermissionDenied,
    ResourceExhausted,
    StaleEpoch,
    TransferFailed,
    TransferTimeout,
    Unsupported,
)
from hixl.options import (
    OPTION_AUTO_CONNECT,
    OPTION_BUFFER_POOL,
    OPTION_ENABLE_USE_FABRIC_MEM,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_LOCAL_COMM_RES,
    OPTION_RDMA_SERVICE_LEVEL,
    OPTION_RDMA_TRAFFIC_CLASS,
)
from hixl.types import (
    MemDesc,
    MemType,
    Perm,
    SegmentInfo,
    TransferOp,
    TransferOpDesc,
    TransferStatus,
)

if TYPE_CHECKING:
    from hixl.client.engine import Engine, TransferRequest
    from hixl.client.facade import Hixl

__version__ = "0.1.0"

_LAZY = {
    "Engine": "hixl.client.engine",
    "TransferRequest": "hixl.client.engine",
    "Hixl": "hixl.client.facade",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hixl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ALREADY_CONNECTED", "FAILED", "NOT_CONNECTED", "NOTIFY_FAILED", "PARAM_INVALID",
    "RESOURCE_EXHAUSTED", "SUCCESS", "TIMEOUT", "UNSUPPORTED",
    "OPTION_AUTO_CONNECT", "OPTION_BUFFER_POOL", "OPTION_ENABLE_USE_FABRIC_MEM",
    "OPTION_GLOBAL_RESOURCE_CONFIG", "OPTION_LOCAL_COMM_RES", "OPTION_RDMA_SERVICE_LEVEL",
    "OPTION_RDMA_TRAFFIC_CLASS",
    "MemDesc", "MemType", "Perm", "SegmentInfo", "TransferOp", "TransferOpDesc", "TransferStatus",
    "Engine", "Hixl", "TransferRequest",
    "HixlError", "ParamInvalid", "OutOfRange", "PermissionDenied", "TransferTimeout",
    "NotConnected", "AlreadyConnected", "Unsupported", "ResourceExhausted", "TransferFailed",
    "PeerUnavailable", "StaleEpoch", "AuthenticationFailed",
]
