"""Control-plane glue shared by agents and clients: protobuf <-> SegmentInfo, errors <-> gRPC.

A HixlError raised inside an agent crosses gRPC as a status code plus two trailing
metadata entries ("hixl-status", "hixl-error"), so the client can raise the very same
exception class with the same HIXL status, instead of a generic RPC failure.
"""

from __future__ import annotations

import contextlib
import functools
import socket
from typing import Any

import grpc

from hixl import errors
from hixl.errors import (
    HixlError,
    NotConnected,
    ParamInvalid,
    PeerUnavailable,
    PermissionDenied,
    ResourceExhausted,
    TransferTimeout,
    Unsupported,
)
from hixl.types import MemType, Perm, SegmentInfo
from hixl.v1 import agent_pb2

STATUS_KEY = "hixl-status"
ERROR_KEY = "hixl-error"

# The most specific class wins: check subclasses before their bases.
_CODE_BY_TYPE: tuple[tuple[type[HixlError], grpc.StatusCode], ...] = (
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (ParamInvalid, grpc.StatusCode.INVALID_ARGUMENT),  # includes OutOfRange, ConfigError
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotConnected, grpc.StatusCode.FAILED_PRECONDITION),
    (TransferTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
)

# What a bare gRPC status means when no hixl metadata came with it (e.g. from a proxy).
_TYPE_BY_CODE: dict[grpc.StatusCode, type[HixlError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: ParamInvalid,
    grpc.StatusCode.OUT_OF_RANGE: ParamInvalid,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: NotConnected,
    grpc.StatusCode.DEADLINE_EXCEEDED: TransferTimeout,
    grpc.StatusCode.UNIMPLEMENTED: Unsupported,
}


@functools.cache
def _error_classes() -> dict[str, type[HixlError]]:
    """Every exception class in hixl.errors, by name (the vocabulary of "hixl-error")."""
    return {name: obj for name, obj in vars(errors).items()
            if isinstance(obj, type) and issubclass(obj, HixlError)}


def error_class(name: str) -> type[HixlError] | None:
    """The hixl.errors class called `name`, or None (used by the fd-socket client too)."""
    return _error_classes().get(name)


# ---------------------------------------------------------------- segments

def segment_to_pb(info: SegmentInfo) -> agent_pb2.Segment:
    return agent_pb2.Segment(
        segment_id=info.segment_id, engine=info.engine, node_id=info.node_id, base=info.base,
        length=info.length, mem_type=int(info.mem_type), perms=int(info.perms),
        epoch=info.epoch, shareable=info.shareable, name=info.name)


def segment_from_pb(pb: agent_pb2.Segment) -> SegmentInfo:
    """Decode a Segment; values outside the enums are refused by name, not guessed."""
    try:
        mem_type = MemType(pb.mem_type)
    except ValueError:
        raise ParamInvalid(f"segment {pb.segment_id}: unknown mem_type {pb.mem_type}") from None
    if pb.perms & ~int(Perm.RW):
        raise ParamInvalid(f"segment {pb.segment_id}: unknown permission bits {pb.perms:#x}")
    return SegmentInfo(
        segment_id=pb.segment_id, engine=pb.engine, node_id=pb.node_id, base=pb.base,
        length=pb.length, mem_type=mem_type, perms=Perm(pb.perms), epoch=pb.epoch,
        shareable=pb.shareable, name=pb.name)


# ---------------------------------------------------------------- errors

def grpc_code_for(exc: HixlError) -> grpc.StatusCode:
    for cls, code in _CODE_BY_TYPE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: HixlError) -> None:
    """End the RPC with `exc`: its gRPC code, message and (in metadata) its exact type."""
    message = str(exc.args[0]) if exc.args else type(exc).__name__
    await context.abort(
        grpc_code_for(exc), message,
        trailing_metadata=((STATUS_KEY, str(exc.status)), (ERROR_KEY, type(exc).__name__)))


def _metadata(exc: grpc.RpcError) -> dict[str, str]:
    trailing: Any = getattr(exc, "trailing_metadata", None)
    if not callable(trailing):
        return {}
    try:
        items = trailing() or ()
    except Exception:  # noqa: BLE001 - a broken call object must not hide the real error
        return {}
    return {str(key): str(value) for key, value in items}


def error_from_rpc(exc: grpc.RpcError, what: str) -> HixlError:
    """The typed HixlError a failed RPC stands for; `what` names the call and its target.

    Restores the server's exception class and HIXL status when the agent sent them;
    otherwise maps the gRPC code (UNAVAILABLE -> PeerUnavailable, DEADLINE_EXCEEDED ->
    TransferTimeout, ...).
    """
    code_fn: Any = getattr(exc, "code", None)
    details_fn: Any = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details = (details_fn() if callable(details_fn) else None) or str(exc)
    meta = _metadata(exc)
    cls = error_class(meta.get(ERROR_KEY, ""))
    if cls is not None:
        status: int | None = None
        with contextlib.suppress(KeyError, ValueError):
            status = int(meta[STATUS_KEY])
        return cls(f"{what}: {details}", status=status)
    if code == grpc.StatusCode.UNAVAILABLE:
        return PeerUnavailable(f"{what}: agent unavailable ({details})")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransferTimeout(f"{what}: no answer before the deadline ({details})")
    if code == grpc.StatusCode.CANCELLED:
        return PeerUnavailable(f"{what}: call cancelled ({details})")
    cls = _TYPE_BY_CODE.get(code, HixlError)
    return cls(f"{what}: {code.name if code else 'UNKNOWN'}: {details}")


# ---------------------------------------------------------------- identity

def node_identity() -> str:
    """hostname + ":" + the first 8 chars of the kernel boot id: the default node_id.

    Two processes see the same value iff they run on the same booted kernel and UTS
    namespace, i.e. iff they can share memfd segments (the default fabric domain).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip().replace("-", "")[:8]
    except OSError:
        boot = "noboot00"
    return f"{socket.gethostname()}:{boot}"
