"""Control-plane glue shared by agents and clients: protobuf <-> SegmentInfo, errors <-> gRPC.

A HixlError raised inside an agent crosses gRPC as a status code plus two trailing
metadata entries ("hixl-status", "hixl-error"), so the client can raise the very same
exception class with the same HIXL status, instead of a generic RPC failure.

Cluster-token authentication of gRPC (hixl.auth) lives here too: `TokenInterceptor`
makes a server refuse, with UNAUTHENTICATED, every call that does not prove the token for
this server and this request; `open_channel` (`authenticated_channel`) makes a client
channel prove it on every call.

So do request ids (hixl.logs): every client call sends `x-request-id` (the current
request's id, or a fresh one), `RequestIdInterceptor` makes it current for the server's
handler, `abort_with` logs each failed call once (code, request id, fix hint) and returns
the id in trailing metadata, and `error_from_rpc` puts it in the client's exception.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
import logging
import operator
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Literal

import grpc

from hixl import auth, errors, logs
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
from hixl.tls import ENV_CA_FILE as ENV_TLS_CA_FILE
from hixl.tls import ENV_CERT_FILE as ENV_TLS_CERT_FILE
from hixl.tls import ENV_KEY_FILE as ENV_TLS_KEY_FILE
from hixl.tls import ENV_SERVER_NAME as ENV_TLS_SERVER_NAME
from hixl.tls import ClientTLS, ServerTLS, TlsSetting, client_tls
from hixl.types import MemType, Perm, SegmentInfo, check_allowed_engines
from hixl.v1 import agent_pb2

log = logging.getLogger("hixl.auth")
rpc_log = logging.getLogger("hixl.rpc")

STATUS_KEY = "hixl-status"
ERROR_KEY = "hixl-error"
#: an agent's gRPC port when its configuration names none (what `hixl` tools dial too)
DEFAULT_GRPC_PORT = 50161

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
        epoch=info.epoch, shareable=info.shareable, name=info.name,
        allowed_engines=info.allowed_engines)


#: Wire value -> enum member, for every valid value: decoding is one dict read (calling
#: the enum costs ~0.3 us), and a value outside the enums is refused by name, not guessed.
_MEM_TYPES: dict[int, MemType] = {int(member): member for member in MemType}
_PERMS: dict[int, Perm] = {bits: Perm(bits) for bits in range(int(Perm.RW) + 1)}

if [f.name for f in dataclasses.fields(SegmentInfo)] != [
        "segment_id", "engine", "node_id", "base", "length", "mem_type", "perms", "epoch",
        "shareable", "name", "allowed_engines"] or hasattr(SegmentInfo, "__post_init__"):
    raise TypeError("SegmentInfo changed shape: update hixl.control._segment_info")

_new_object = object.__new__
_set = object.__setattr__


def _segment_info(segment_id: int, engine: str, node_id: str, base: int, length: int,
                  mem_type: MemType, perms: Perm, epoch: int, shareable: bool,
                  name: str, allowed_engines: tuple[str, ...] = ()) -> SegmentInfo:
    """SegmentInfo(...) for decoders, with checked fields: the very same immutable, equal,
    hashable value for ~60% of the cost (the frozen dataclass's __init__ looks up
    object.__setattr__ anew for each field), which 100k-segment snapshots feel."""
    segment = _new_object(SegmentInfo)
    _set(segment, "segment_id", segment_id)
    _set(segment, "engine", engine)
    _set(segment, "node_id", node_id)
    _set(segment, "base", base)
    _set(segment, "length", length)
    _set(segment, "mem_type", mem_type)
    _set(segment, "perms", perms)
    _set(segment, "epoch", epoch)
    _set(segment, "shareable", shareable)
    _set(segment, "name", name)
    _set(segment, "allowed_engines", allowed_engines)
    return segment


def add_segments(field: Any, segments: Iterable[SegmentInfo]) -> None:
    """Append `segments` to a `repeated Segment` field, each built in place: about half the
    cost of segment_to_pb's, whose message is then copied into the field."""
    add = field.add
    for info in segments:
        pb = add(segment_id=info.segment_id, engine=info.engine, node_id=info.node_id,
                 base=info.base, length=info.length, mem_type=info.mem_type,
                 perms=info.perms, epoch=info.epoch, shareable=info.shareable,
                 name=info.name)
        if info.allowed_engines:  # rare: most segments have no allow-list
            pb.allowed_engines.extend(info.allowed_engines)


def segment_from_pb(pb: agent_pb2.Segment) -> SegmentInfo:
    """Decode a Segment; values outside the enums are refused by name, not guessed."""
    mem_type = _MEM_TYPES.get(pb.mem_type)
    if mem_type is None:
        raise ParamInvalid(f"segment {pb.segment_id}: unknown mem_type {pb.mem_type}")
    perms = _PERMS.get(pb.perms)
    if perms is None:
        raise ParamInvalid(f"segment {pb.segment_id}: unknown permission bits {pb.perms:#x}")
    return _segment_info(pb.segment_id, pb.engine, pb.node_id, pb.base, pb.length, mem_type,
                         perms, pb.epoch, pb.shareable, pb.name,
                         _allowed(pb.segment_id, pb.allowed_engines))


def _allowed(segment_id: int, names: Iterable[str]) -> tuple[str, ...]:
    """A decoded allow-list, checked and canonical (sorted, no duplicates): a peer's
    published list must not differ in meaning from what its agent enforces."""
    if not names:
        return ()
    return check_allowed_engines(names, f"segment {segment_id}: allowed_engines")


_owner = operator.attrgetter("engine", "node_id", "epoch")


def segments_to_columns(segments: Iterable[SegmentInfo], chunk: int = 0,
                        ) -> list[agent_pb2.SegmentColumns]:
    """`segments` in compact form, in order: one SegmentColumns per run of segments sharing
    engine, node and epoch, split every `chunk` segments (0: never)."""
    blocks: list[agent_pb2.SegmentColumns] = []
    for (engine, node_id, epoch), run in itertools.groupby(segments, key=_owner):
        owned = list(run)
        step = chunk or len(owned)
        for start in range(0, len(owned), step):
            part = owned[start:start + step]
            blocks.append(agent_pb2.SegmentColumns(
                engine=engine, node_id=node_id, epoch=epoch,
                segment_id=[s.segment_id for s in part], base=[s.base for s in part],
                length=[s.length for s in part], mem_type=[s.mem_type for s in part],
                perms=[s.perms for s in part], shareable=[s.shareable for s in part],
                name=[s.name for s in part],
                allowed_engines=[agent_pb2.AllowList(index=i, engines=s.allowed_engines)
                                 for i, s in enumerate(part) if s.allowed_engines]))
    return blocks


def segments_from_columns(pb: agent_pb2.SegmentColumns) -> list[SegmentInfo]:
    """Decode a SegmentColumns block in bulk, checked as segment_from_pb checks a Segment;
    columns of unequal lengths (a malformed block) are refused, never cut short."""
    ids = pb.segment_id
    columns = (pb.base, pb.length, pb.mem_type, pb.perms, pb.shareable, pb.name)
    if any(len(column) != len(ids) for column in columns):
        raise ParamInvalid(f"segment columns of engine {pb.engine!r}: columns of unequal "
                           f"lengths {[len(ids), *map(len, columns)]}")
    mem_types = [_MEM_TYPES.get(value) for value in pb.mem_type]
    perms = [_PERMS.get(value) for value in pb.perms]
    if None in mem_types:
        index = mem_types.index(None)
        raise ParamInvalid(f"segment {ids[index]}: unknown mem_type {pb.mem_type[index]}")
    if None in perms:
        index = perms.index(None)
        raise ParamInvalid(f"segment {ids[index]}: unknown permission bits "
                           f"{pb.perms[index]:#x}")
    engine, node_id, epoch = pb.engine, pb.node_id, pb.epoch
    segments = [_segment_info(segment_id, engine, node_id, base, length, mem_type, perm,
                              epoch, shareable, name)
                for segment_id, base, length, mem_type, perm, shareable, name
                in zip(ids, pb.base, pb.length, mem_types, perms, pb.shareable, pb.name,
                       strict=True)]
    for acl in pb.allowed_engines:  # sparse: only segments with an allow-list
        if acl.index >= len(segments):
            raise ParamInvalid(f"segment columns of engine {pb.engine!r}: an allow-list for "
                               f"segment #{acl.index} of {len(segments)}")
        _set(segments[acl.index], "allowed_engines",
             _allowed(ids[acl.index], acl.engines))
    return segments


# ---------------------------------------------------------------- errors

def grpc_code_for(exc: HixlError) -> grpc.StatusCode:
    for cls, code in _CODE_BY_TYPE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: HixlError) -> None:
    """End the RPC with `exc`: its gRPC code, message and (in metadata) its exact type and
    the request id. The one place a failed call is logged: once, with its code and hint."""
    message = str(exc.args[0]) if exc.args else type(exc).__name__
    log_rpc_failure(exc, context)
    metadata = [(STATUS_KEY, str(exc.status)), (ERROR_KEY, type(exc).__name__)]
    request_id = logs.current_request_id()
    if request_id:
        metadata.append((logs.REQUEST_ID_KEY, request_id))
    await context.abort(grpc_code_for(exc), message, trailing_metadata=tuple(metadata))


def log_rpc_failure(exc: HixlError, context: grpc.aio.ServicerContext | None = None) -> None:
    """One line for a failed call: WARNING when the caller can fix it, ERROR when hixl
    failed; with the method, the caller, the HIXL code and the fix hint (errors.HINTS)."""
    level = logging.ERROR if errors.is_internal(exc) else logging.WARNING
    if not rpc_log.isEnabledFor(level):
        return
    method = _RPC_METHOD.get() or "call"
    peer = ""
    if context is not None:
        with contextlib.suppress(Exception):  # a context without a peer must not matter
            peer = str(context.peer())
    message = str(exc.args[0]) if exc.args else type(exc).__name__
    logs.log_failure(rpc_log, level, f"{method} from {peer or '?'} failed: "
                     f"{type(exc).__name__}: {message}", code=exc.status_name,
                     number=exc.status, hint=errors.hint_for(exc), error=type(exc).__name__,
                     rpc=method)


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
    request_id = logs.valid_request_id(meta.get(logs.REQUEST_ID_KEY))
    if request_id:  # the server logged this failure under that id
        details = f"{details} (request {request_id})"
    cls = error_class(meta.get(ERROR_KEY, ""))
    if cls is not None:
        status: int | None = None
        with contextlib.suppress(KeyError, ValueError):
            status = int(meta[STATUS_KEY])
        return cls(f"{what}: {details}", status=status)
    if code == grpc.StatusCode.UNAVAILABLE:
        return PeerUnavailable(f"{what}: {_why_unavailable(details, exc)} ({details})")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransferTimeout(f"{what}: no answer before the deadline ({details})")
    if code == grpc.StatusCode.CANCELLED:
        return PeerUnavailable(f"{what}: call cancelled ({details})")
    cls = _TYPE_BY_CODE.get(code, HixlError)
    return cls(f"{what}: {code.name if code else 'UNKNOWN'}: {details}")


# ---------------------------------------------------------------- cluster token

class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Server side: every call must carry a valid `hixl-auth` proof, else UNAUTHENTICATED.

    A proof is valid for one call (nonce), of its method, to this server (`names`: the
    addresses it listens on, which `add_port` tells it, and an allow-list), with the very
    request it was made for (the SHA-256 of the request's bytes, checked before they are
    deserialized). The refusal happens before the method's handler runs (nothing is
    executed; nothing is deserialized unless the header was valid) and says why
    (missing, wrong token, clock skew, replay, another server, another request) but never
    which bytes of a proof differ. Health and watch streams are no exception.
    """

    def __init__(self, token: bytes, verifier: auth.GrpcVerifier | None = None,
                 names: auth.ServerNames | None = None) -> None:
        self.verifier = verifier or auth.GrpcVerifier(token)
        self.names = names if names is not None else auth.ServerNames()

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
        why, claim = self.verifier.check(method, presented)
        if claim is not None:
            ours = self.names.match_literal(claim.server)  # no coroutine for the usual case
            if ours is None:
                ours = await self.names.accepts(claim.server)
            why = self.verifier.remember(claim) if ours else self.names.mismatch(claim.server)
        handler = await continuation(handler_call_details)
        if why is not None:
            return _refusal(handler, method, why)
        if handler is None:
            return None
        assert claim is not None
        return _bound_to_request(handler, claim.digest)


class _Mismatch:
    """What a request whose bytes do not match its proof deserializes to: never a message."""


_MISMATCH = _Mismatch()


def _bound_to_request(handler: grpc.RpcMethodHandler,
                      digest: bytes) -> grpc.RpcMethodHandler:
    """`handler`, serving only a request whose serialized bytes have SHA-256 `digest`.

    hixl's methods take one request (unary, or unary-stream: the reply streams, the
    request does not); a client-streaming method, whose later messages no proof covers,
    is refused outright.
    """
    if handler.unary_unary is None and handler.unary_stream is None:
        return _refusal(handler, "", "client-streaming calls cannot be authenticated "
                                     "(the hixl-auth proof binds one request)")
    deserialize = handler.request_deserializer

    def checked(raw: bytes) -> Any:
        if auth.request_digest(raw) != digest:  # both public: no timing to hide
            return _MISMATCH
        return deserialize(raw) if deserialize is not None else raw

    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def serve_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request is _MISMATCH:
                await abort_with(context, AuthenticationFailed(auth.BODY_MISMATCH))
            result = unary(request, context)
            return await result if inspect.isawaitable(result) else result

        return handler._replace(  # type: ignore[attr-defined]
            request_deserializer=checked, unary_unary=serve_unary)
    stream = handler.unary_stream

    async def serve_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request is _MISMATCH:
            await abort_with(context, AuthenticationFailed(auth.BODY_MISMATCH))
        async for item in _items_of(stream(request, context)):
            yield item

    return handler._replace(  # type: ignore[attr-defined]
        request_deserializer=checked, unary_stream=serve_stream)


def _refusal(handler: grpc.RpcMethodHandler | None, method: str,
             why: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await abort_with(context, AuthenticationFailed(why))

    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


# ---------------------------------------------------------------- request ids

#: the method of the call being served ("/hixl.v1.Agent/AllocateSegment"), for log lines
_RPC_METHOD: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "hixl_rpc_method", default=None)


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    """Server side: the handler of each call runs with the caller's `x-request-id` (or a
    new id) as the current request id (hixl.logs), so its log lines, the error it returns
    and the calls it makes on the caller's behalf all carry it.

    A HixlError that escapes a handler is returned like `abort_with` does; any other
    exception is logged once at ERROR with its traceback and returned as an internal
    error, so every failed call leaves exactly one log line.
    """

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = _text(handler_call_details.method)
        request_id = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == logs.REQUEST_ID_KEY:
                request_id = logs.valid_request_id(_text(value))
                break
        return _with_request_id(handler, method, request_id or logs.new_request_id())


def _with_request_id(handler: grpc.RpcMethodHandler, method: str,
                     request_id: str) -> grpc.RpcMethodHandler:
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def serve_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            rid, rpc = logs.set_request_id(request_id), _RPC_METHOD.set(method)
            try:
                rpc_log.debug("%s from %s", method, context.peer())
                result = unary(request, context)
                return await result if inspect.isawaitable(result) else result
            except Exception as exc:  # noqa: BLE001 - every failure leaves one way
                await _abort_unexpected(context, exc)
            finally:
                _RPC_METHOD.reset(rpc)
                logs.reset_request_id(rid)

        return handler._replace(unary_unary=serve_unary)  # type: ignore[attr-defined]
    if handler.unary_stream is not None:
        stream = handler.unary_stream

        async def serve_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            # a stream runs in its own task: nothing to restore when it ends
            logs.set_request_id(request_id)
            _RPC_METHOD.set(method)
            rpc_log.debug("%s from %s", method, context.peer())
            try:
                async for item in _items_of(stream(request, context)):
                    yield item
            except Exception as exc:  # noqa: BLE001 - every failure leaves one way
                await _abort_unexpected(context, exc)

        return handler._replace(unary_stream=serve_stream)  # type: ignore[attr-defined]
    return handler  # client-streaming methods: hixl has none


async def _abort_unexpected(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError):  # abort_with already logged and answered
        raise exc
    if isinstance(exc, HixlError):
        await abort_with(context, exc)
    rpc_log.error("%s failed: internal error: %r", _RPC_METHOD.get(), exc, exc_info=exc,
                  extra={"code": errors.STATUS_NAMES[errors.FAILED], "status": errors.FAILED,
                         "hint": errors.hint_for(HixlError)})
    metadata = [(STATUS_KEY, str(errors.FAILED)), (ERROR_KEY, HixlError.__name__)]
    request_id = logs.current_request_id()
    if request_id:
        metadata.append((logs.REQUEST_ID_KEY, request_id))
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}",
                        trailing_metadata=tuple(metadata))


async def _items_of(items: Any) -> AsyncIterator[Any]:
    """What a gRPC stream handler returned, as one async iterator: an awaitable (a
    handler that writes with context.write) yields nothing, an async or plain iterator
    its items."""
    if inspect.isawaitable(items):
        await items
    elif hasattr(items, "__aiter__"):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


def server_interceptors(token: bytes | None, names: Iterable[str] = (),
                        ) -> list[grpc.aio.ServerInterceptor]:
    """What every hixl gRPC server installs: request ids first (so a refusal is logged
    under one too), then, with a cluster token, its check.

    The check must know the addresses its server listens on (a proof binds the server
    the client dialled): bind them with `add_port(server, address, tls, interceptors)`,
    which tells it each one. `names`: more "host:port" names the server is reached by
    (auth.ServerNames).
    """
    interceptors: list[grpc.aio.ServerInterceptor] = [RequestIdInterceptor()]
    if token is not None:
        interceptors.append(TokenInterceptor(token, names=auth.ServerNames(names)))
    return interceptors


def add_port(server: grpc.aio.Server, address: str, tls: ServerTLS | None,
             interceptors: Iterable[Any] = ()) -> int:
    """Bind `address` ("host:port", only that host) on `server`, with TLS when `tls` is
    given; returns the port bound (0 when gRPC could not bind it). What every hixl gRPC
    server binds with; `interceptors` are the server's (server_interceptors): its token
    check is told the address it now serves, the one proofs must be bound to."""
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, tls.credentials)
    if port:
        for check in interceptors:
            if isinstance(check, TokenInterceptor):
                check.names.listen(address, port)
    return port


class _CallDetails(
        collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class _ClientInterceptor(grpc.UnaryUnaryClientInterceptor,
                         grpc.UnaryStreamClientInterceptor):
    """Client side: adds `x-request-id` (the current request's, else a fresh one) and,
    with a token, a fresh `hixl-auth` proof (new nonce, current time) to each call; tags
    each call (which is also the error it raises) with the channel's TLS settings, so
    `error_from_rpc` can tell why a connection failed."""

    def __init__(self, token: bytes | None, tls: ClientTLS | Literal[False] | None = None,
                 server: str = "") -> None:
        self._token = token
        self._tls = tls
        self._server = server  # what the proofs bind: the target dialled (grpc_authority)

    def _tagged(self, call: Any) -> Any:
        with contextlib.suppress(Exception):  # a call object that takes no tag: no hint
            setattr(call, _TLS_TAG, self._tls)
            if call.done():  # a blocking call's outcome: the error it raises may differ
                error = call.exception()
                if error is not None:
                    setattr(error, _TLS_TAG, self._tls)
        return call

    def _with_metadata(self, details: grpc.ClientCallDetails, request: Any) -> _CallDetails:
        request_id = logs.current_request_id() or logs.new_request_id()
        metadata = [*(details.metadata or ()), (logs.REQUEST_ID_KEY, request_id)]
        if self._token is not None:
            # the bytes the channel will send: the stubs serialize with SerializeToString
            body = request if isinstance(request, bytes) else request.SerializeToString()
            metadata.append((auth.METADATA_KEY, auth.make_grpc_proof(
                self._token, _text(details.method), self._server,
                auth.request_digest(body))))
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                              request: Any) -> Any:
        return self._tagged(continuation(self._with_metadata(client_call_details, request),
                                         request))

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                               request: Any) -> Any:
        return self._tagged(continuation(self._with_metadata(client_call_details, request),
                                         request))


def authenticated_channel(channel: grpc.Channel, token: bytes | None,
                          target: str = "") -> grpc.Channel:
    """`channel`, sending a request id on every call and, with a `token`, proving it for
    the server at `target` (what the channel dials: each proof is bound to it).

    Close the original channel, not this wrapper's result, to release it.
    """
    if token is not None and not target:
        raise ParamInvalid("authenticated_channel: with a cluster token, give the target the "
                           "channel dials (each proof is bound to that server)")
    return grpc.intercept_channel(channel, _ClientInterceptor(token, None,
                                                              auth.grpc_authority(target)))


def open_channel(target: str, *, token: bytes | None = None, tls: TlsSetting = None,
                 options: Sequence[tuple[str, Any]] = ()) -> tuple[grpc.Channel, grpc.Channel]:
    """(the channel, to close; the same channel for stubs, proving `token` on every call).

    The one place the SDK opens gRPC channels. `tls`: ClientTLS dials with TLS, False in
    plaintext, None as the HIXL_TLS_* environment says (a CA there: TLS; hixl.tls). A TLS
    mismatch with the server fails the first call at once with PeerUnavailable saying
    which side lacks what, never a hang. Unusable TLS files: ConfigError naming the file.
    """
    settings = client_tls(tls)
    if settings is None:
        channel = grpc.insecure_channel(target, options=list(options))
    else:
        channel = grpc.secure_channel(target, settings.credentials,
                                      options=[*options, *settings.channel_options()])
    interceptor = _ClientInterceptor(token, settings if settings is not None else False,
                                     auth.grpc_authority(target))
    return channel, grpc.intercept_channel(channel, interceptor)


#: attribute of a failed call: the ClientTLS its channel used, or False for plaintext
_TLS_TAG = "hixl_tls"


def _why_unavailable(details: str, exc: object) -> str:
    """Why a connection failed, in words, when gRPC's details point at TLS (handshake
    errors, or a server that hangs up at once on a mismatched client)."""
    text = details.lower()
    tls = getattr(exc, _TLS_TAG, None)
    ca = f" ({tls.ca_file})" if isinstance(tls, ClientTLS) else ""
    if "wrong_version_number" in text:
        return ("TLS handshake failed: the server does not speak TLS (a plaintext server?); "
                "dial it without a CA, or give the server tls_cert_file and tls_key_file")
    if "certificate_verify_failed" in text:
        return (f"TLS handshake failed: the server's certificate is not signed by the CA "
                f"this client trusts{ca}")
    if "hostname verification" in text or "peer name" in text:
        return ("TLS handshake failed: the server's certificate does not name the address "
                "dialled; give it that address as a subjectAltName, or set "
                f"{ENV_TLS_SERVER_NAME} to a name it carries")
    if "stream removed" in text:  # the connection was up: it broke during this call
        return "the connection broke during the call (the server stopped or was cut off)"
    if "socket closed" in text or "connection reset" in text:
        if tls is False:
            return ("the server closed the connection at once: it may require TLS; give "
                    f"this client the CA that signed its certificate ({ENV_TLS_CA_FILE})")
        if isinstance(tls, ClientTLS):
            presented = (f"refused the client certificate {tls.cert_file}"
                         if tls.cert_file else "requires a client certificate")
            return (f"the server ended the TLS handshake: it {presented} (mutual TLS: "
                    f"{ENV_TLS_CERT_FILE} and {ENV_TLS_KEY_FILE}, a certificate signed by "
                    "the CA it trusts)")
    if "tls" in text or "ssl" in text:
        return "TLS handshake failed"
    return "unreachable"


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
