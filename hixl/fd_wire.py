"""The fd socket's protocol, sans-IO: named messages and their pure encode/decode.

The agent's fd socket (`hixl.server.agent.fd_server.FdServer`) and its client
(`hixl.client.agent_client.FdClient`) exchange one JSON object per SOCK_SEQPACKET message,
a request and then its reply; fds ride along as SCM_RIGHTS. Nothing here touches a
socket or an fd: the codec sees how many fds came with a message, the I/O drivers send,
receive and close them.

    GetFd(segment_id, epoch, write, engine)  {"op": "get_fd", "segment_id": N, "epoch": E,
                                              "write": bool, "engine": "host:port"}
        -> FdGranted(length, offset, slot)   {"ok": true, "length": L, "offset": O,
                                              "slot": S} + the segment's fd
    GetStates()                              {"op": "get_states"}
        -> StatesGranted(capacity)           {"ok": true, "capacity": C} + fd (read-only)
    Deposit(length) + one fd                 {"op": "deposit", "length": L}
        -> Deposited(ticket)                 {"ok": true, "ticket": "..."}
    Ping()                                   {"op": "ping"}
        -> Pong(epoch, engine)               {"ok": true, "epoch": E, "engine": "host:port"}
    any failure -> Refused(status, error, kind)
                                             {"ok": false, "status": <HIXL code>,
                                              "error": "...", "kind": "<HixlError class>"}

`decode_request` raises ParamInvalid (what the server answers a malformed request with,
the connection kept); `decode_reply` raises MalformedReply (the client's driver reports
the agent as unavailable). Both take only bytes and a count of fds, so they are tested
without sockets (tests/test_fd_wire.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hixl.errors import HixlError, ParamInvalid

MAX_REQUEST = 4096  # bytes of one request message (a longer one is truncated: refused)
MAX_REPLY = 8192  # bytes a client reads of one reply message
MAX_FDS_PER_MESSAGE = 4

GET_FD, GET_STATES, DEPOSIT, PING = "get_fd", "get_states", "deposit", "ping"
OPS = (GET_FD, GET_STATES, DEPOSIT, PING)


# ------------------------------------------------------------------ requests


@dataclass(frozen=True, slots=True)
class GetFd:
    """The fd of a segment to map (`write`: read-write, else O_RDONLY), asked by `engine`
    (checked against the segment's allow-list; "" is unnamed)."""

    segment_id: int
    epoch: int
    write: bool = False
    engine: str = ""
    op = GET_FD
    fds = 0  # fds the request carries


@dataclass(frozen=True, slots=True)
class GetStates:
    """The agent's segment liveness words (hixl.segment_states), as a read-only fd."""

    op = GET_STATES
    fds = 0


@dataclass(frozen=True, slots=True)
class Deposit:
    """Hand the agent one sealed memfd of at least `length` bytes, for RegisterSegment."""

    length: int
    op = DEPOSIT
    fds = 1


@dataclass(frozen=True, slots=True)
class Ping:
    """Which agent serves this socket (its engine name and epoch)."""

    op = PING
    fds = 0


Request = GetFd | GetStates | Deposit | Ping


# ------------------------------------------------------------------ replies


@dataclass(frozen=True, slots=True)
class FdGranted:
    """A GetFd's answer, with the fd of the file the segment lies in: the segment is
    `length` bytes at `offset` in it, its liveness word `slot` in the states file."""

    length: int
    offset: int = 0
    slot: int = 0
    fds = 1


@dataclass(frozen=True, slots=True)
class StatesGranted:
    """A GetStates's answer, with the states file's fd: `capacity` liveness words."""

    capacity: int
    fds = 1


@dataclass(frozen=True, slots=True)
class Deposited:
    """A Deposit's answer: the single-use ticket RegisterSegment redeems."""

    ticket: str
    fds = 0


@dataclass(frozen=True, slots=True)
class Pong:
    epoch: int
    engine: str
    fds = 0


@dataclass(frozen=True, slots=True)
class Refused:
    """Any request's failure: the HIXL status code, the message and the HixlError class
    name the client raises again (`status` None, `kind` "" when the agent gave none)."""

    status: int | None
    error: str
    kind: str = ""
    fds = 0

    @classmethod
    def of(cls, exc: HixlError) -> Refused:
        return cls(exc.status, exc.args[0], type(exc).__name__)


Reply = FdGranted | StatesGranted | Deposited | Pong | Refused
_REPLY_TO: dict[str, type[Reply]] = {GET_FD: FdGranted, GET_STATES: StatesGranted,
                                     DEPOSIT: Deposited, PING: Pong}


NOT_JSON = "a malformed reply"  # a MalformedReply's text when the reply is no JSON object


class MalformedReply(ValueError):
    """A reply that is not what the protocol answers the request sent (the text says
    what was wrong, without the socket's name: the driver adds it)."""


# ------------------------------------------------------------------ encoding


def _dumps(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields).encode()


def encode_request(request: Request) -> bytes:
    """The message of `request` (the driver attaches a Deposit's fd)."""
    if isinstance(request, GetFd):
        return _dumps({"op": GET_FD, "segment_id": request.segment_id, "epoch": request.epoch,
                       "write": bool(request.write), "engine": request.engine})
    if isinstance(request, Deposit):
        return _dumps({"op": DEPOSIT, "length": request.length})
    return _dumps({"op": request.op})


def encode_reply(reply: Reply) -> bytes:
    """The message of `reply` (the driver attaches the fd of a granted one)."""
    if isinstance(reply, Refused):
        return _dumps({"ok": False, "status": reply.status, "error": reply.error,
                       "kind": reply.kind})
    if isinstance(reply, FdGranted):
        return _dumps({"ok": True, "length": reply.length, "offset": reply.offset,
                       "slot": reply.slot})
    if isinstance(reply, StatesGranted):
        return _dumps({"ok": True, "capacity": reply.capacity})
    if isinstance(reply, Deposited):
        return _dumps({"ok": True, "ticket": reply.ticket})
    return _dumps({"ok": True, "epoch": reply.epoch, "engine": reply.engine})


# ------------------------------------------------------------------ decoding


def decode_request(data: bytes, fds: int = 0) -> Request:
    """The request in one message that came with `fds` fds; ParamInvalid saying what is
    wrong (the server answers it as a Refused and keeps the connection)."""
    try:
        fields = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ParamInvalid(f"request is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ParamInvalid("request must be a JSON object with an 'op'")
    op = fields.get("op")
    if op == DEPOSIT:
        if fds != 1:
            raise ParamInvalid(f"deposit needs exactly one fd attached, got {fds}")
        length = _int_field(fields, "length")
        if length <= 0:
            raise ParamInvalid(f"deposit: length must be positive, got {length}")
        return Deposit(length)
    if op not in OPS:
        raise ParamInvalid(f"unknown op {op!r}; use get_fd, get_states, deposit or ping")
    if fds:
        raise ParamInvalid(f"{op} takes no fds, got {fds}")
    if op == PING:
        return Ping()
    if op == GET_STATES:
        return GetStates()
    segment_id = _int_field(fields, "segment_id")
    epoch = _int_field(fields, "epoch")
    write = fields.get("write", False)
    if not isinstance(write, bool):
        raise ParamInvalid(f"get_fd: 'write' must be true or false, got {write!r}")
    engine = fields.get("engine", "")
    if not isinstance(engine, str):
        raise ParamInvalid(f"get_fd: 'engine' must be an engine name, got {engine!r}")
    return GetFd(segment_id, epoch, write, engine)


def decode_reply(data: bytes, request: Request | str, fds: int = 0) -> Reply:
    """The reply to `request` (or its op) in one message that came with `fds` fds: the
    granted message, or Refused; MalformedReply when it is neither."""
    try:
        fields = json.loads(data)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
        raise MalformedReply(NOT_JSON) from None
    if not isinstance(fields, dict):
        raise MalformedReply(NOT_JSON)
    if not fields.get("ok"):
        status = fields.get("status")
        kind = fields.get("kind", "")
        return Refused(status if isinstance(status, int) and not isinstance(status, bool)
                       else None, str(fields.get("error", "refused")),
                       kind if isinstance(kind, str) else str(kind))
    op = request if isinstance(request, str) else request.op
    kind_of = _REPLY_TO.get(op)
    if kind_of is None:
        raise ValueError(f"no reply is defined for op {op!r}")
    if kind_of is FdGranted:
        values = [fields.get(name, 0) for name in ("length", "offset", "slot")]
        if fds != 1 or "length" not in fields or not all(
                type(value) is int and value >= 0 for value in values):
            raise MalformedReply(f"malformed get_fd reply {fields!r} with {fds} fds")
        return FdGranted(*values)
    if kind_of is StatesGranted:
        capacity = fields.get("capacity")
        if fds != 1 or type(capacity) is not int or capacity <= 0:
            raise MalformedReply(f"malformed get_states reply {fields!r} with {fds} fds")
        return StatesGranted(capacity)
    if kind_of is Deposited:
        ticket = fields.get("ticket")
        if not isinstance(ticket, str):
            raise MalformedReply(f"no ticket in {fields!r}")
        return Deposited(ticket)
    epoch, engine = fields.get("epoch"), fields.get("engine")
    if type(epoch) is not int or not isinstance(engine, str):
        raise MalformedReply(f"malformed ping reply {fields!r}")
    return Pong(epoch, engine)


def _int_field(fields: dict[str, object], name: str) -> int:
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ParamInvalid(f"'{name}' must be a non-negative integer, got {value!r}")
    return value


__all__ = ["DEPOSIT", "Deposit", "Deposited", "FdGranted", "GET_FD", "GET_STATES", "GetFd",
           "GetStates", "MAX_FDS_PER_MESSAGE", "MAX_REPLY", "MAX_REQUEST", "MalformedReply",
           "NOT_JSON", "OPS", "PING", "Ping", "Pong", "Refused", "Reply", "Request",
           "StatesGranted", "decode_reply", "decode_request", "encode_reply",
           "encode_request"]
