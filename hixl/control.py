"""Control-plane glue shared by agents and clients: protobuf <-> SegmentInfo, errors <-> gRPC.

A HixlError raised inside an agent crosses gRPC as a status code plus two trailing
metadata entries ("hixl-status", "hixl-error"), so the client can raise the very same
exception class with the same HIXL status, instead of a generic RPC failure.

Cluster-token authentication of gRPC (hixl.auth) lives here too: `TokenInterceptor`
makes a server refuse, with UNAUTHENTICATED, every call that does not prove the token;
`authenticated_channel` makes a client channel prove it on every call.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from hixl import auth, errors
from hixl.errors import (
    AuthenticationFailed,
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

log = logging.getLogger("hixl.auth")

STATUS_KEY = "hixl-status"
ERROR_KEY = "hixl-error"

# The most specific class wins: check subclasses before their bases.
_CODE_BY_TYPE: tuple[tuple[type[HixlError], grpc.StatusCode], ...] = (
    (AuthenticationFailed, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (ParamInvalid, grpc.StatusCode.INVALID_ARGUMENT),  # includes OutOfRange, ConfigError
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotConnected, grpc.StatusCode.FAILED_PRECONDITION),
    (TransferTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
)

# What a bare gRPC status means when no hixl metadata came with it (e.g. from a proxy).
_TYPE_BY_CODE: dict[grpc.StatusCode, type[HixlError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationFailed,
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


# ---------------------------------------------------------------- cluster token

class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Server side: every call must carry a valid `hixl-auth` proof, else UNAUTHENTICATED.

    The refusal happens before the method's handler runs (nothing is deserialized or
    executed) and says why (missing, wrong token, clock skew, replay) but never which
    bytes of a proof differ. Health and watch streams are no exception.
    """

    def __init__(self, token: bytes, verifier: auth.GrpcVerifier | None = None) -> None:
        self.verifier = verifier or auth.GrpcVerifier(token)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = _text(handler_call_details.method)
        presented = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == auth.METADATA_KEY:
                presented = value
                break
        why = self.verifier.verify(method, presented)
        handler = await continuation(handler_call_details)
        if why is None:
            return handler
        return _refusal(handler, method, why)


def _refusal(handler: grpc.RpcMethodHandler | None, method: str,
             why: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        log.warning("refused %s from %s: %s", method, context.peer(), why)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why, trailing_metadata=(
            (STATUS_KEY, str(AuthenticationFailed.status)),
            (ERROR_KEY, AuthenticationFailed.__name__)))

    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class _CallDetails(
        collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class _TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor,
                              grpc.UnaryStreamClientInterceptor):
    """Client side: adds a fresh `hixl-auth` proof (new nonce, current time) to each call."""

    def __init__(self, token: bytes) -> None:
        self._token = token

    def _with_proof(self, details: grpc.ClientCallDetails) -> _CallDetails:
        proof = auth.make_grpc_proof(self._token, _text(details.method))
        metadata = [*(details.metadata or ()), (auth.METADATA_KEY, proof)]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                              request: Any) -> Any:
        return continuation(self._with_proof(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                               request: Any) -> Any:
        return continuation(self._with_proof(client_call_details), request)


def authenticated_channel(channel: grpc.Channel, token: bytes | None) -> grpc.Channel:
    """`channel`, proving `token` on every call; unchanged when there is no token.

    Close the original channel, not this wrapper's result, to release it.
    """
    if token is None:
        return channel
    return grpc.intercept_channel(channel, _TokenClientInterceptor(token))


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
