"""Fail-over across several hixl-master addresses: the one policy every master client uses.

Several `hixl-master` processes may serve one cluster (one leader, the others standby;
issue 8). Agents, engines and store clients are given every address ("h1:p1,h2:p2", or a
list) and talk to one at a time, the *current* one (`Endpoints`). A call moves on to the
next address, and tries again within the SAME deadline, when the current one

- cannot be reached: connection refused or reset, gRPC UNAVAILABLE, no answer within
  the attempt's share of the deadline; or
- answers that it is not the leader. Over gRPC: status UNAVAILABLE (FAILED_PRECONDITION
  is accepted too) with trailing metadata `hixl-leader: <host:port>` (empty when the
  standby does not know the leader); over the store call endpoint: a reply with reason
  `hixl.wire.Reason.NOT_LEADER`, whose error text is that address. Either way the
  request was NOT applied, so any call may be sent again; the client switches to the
  named leader (added to its list if it was not there), else to the next address.

Only calls that are safe to repeat are repeated after an ambiguous failure: reads and
idempotent calls always; a non-idempotent call (a put's start or end, a removal) only
when its request provably never left (connection refused, nothing sent). Otherwise it
fails with the error in hand (the store's RPC_FAIL, retryable), so no put is reported
done and then missing, and none is applied twice behind the caller's back.

A round in which every address was unreachable ends the call at once (a retryable
error, as with one master that is down); once a master said "not the leader", a switch
is under way, and the call goes on round after round (short pauses) until its deadline.
With one address a call makes one attempt with the whole deadline, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import grpc

from hixl.addresses import normalize_host_port
from hixl.errors import HixlError, ParamInvalid, PeerUnavailable

T = TypeVar("T")

#: trailing metadata key of a "not the leader" gRPC status: the leader's address or ""
LEADER_METADATA_KEY = "hixl-leader"
#: the status a standby master answers with (clients accept FAILED_PRECONDITION too)
NOT_LEADER_CODE = grpc.StatusCode.UNAVAILABLE
_NOT_LEADER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION})
#: an idempotent call's attempt at one address gets at least this much of the deadline
MIN_ATTEMPT_S = 0.5
#: pause between rounds over every address while waiting for a leader (doubling to the max)
PAUSE_FIRST_S, PAUSE_MAX_S = 0.05, 0.5
#: at most this many addresses, leader hints included (a list is a cluster's masters)
MAX_ADDRESSES = 32


class NotLeader(PeerUnavailable):
    """A master answered that it is not the leader; the request was not applied there.

    `leader`: the address it named ("" when it does not know)."""

    def __init__(self, message: str, *, leader: str = "", status: int | None = None) -> None:
        super().__init__(message, status=status)
        self.leader = leader


class TryNext(Exception):
    """Raised by an attempt inside `Endpoints.call`: this address could not serve the call.

    `error`: what the caller gets if the call gives up here. `sent`: the request may have
    reached the master (False only when it provably did not). `leader`: not None for a
    "not the leader" answer (the request was not applied), the address it named or "".
    """

    def __init__(self, error: HixlError, *, sent: bool = True, leader: str | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.sent = sent
        self.leader = leader


# ---------------------------------------------------------------------------- addresses


def parse_address(text: str, what: str = "master address") -> str:
    """One "host:port" / "[v6]:port", stripped; ParamInvalid naming it when it is not
    (`hixl.addresses.normalize_host_port`)."""
    return normalize_host_port(text, what)


def parse_addresses(value: str | Iterable[str], what: str = "master address",
                    ) -> tuple[str, ...]:
    """Every address of "h1:p1,h2:p2" (or a list of "host:port"), in order, duplicates
    dropped. ParamInvalid naming the bad entry; an empty list is refused too."""
    if isinstance(value, str):
        entries = value.split(",")
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray)):
        entries = list(value)
    else:
        raise ParamInvalid(f"{what} must be 'host:port[,host:port...]' or a list of them, "
                           f"got {value!r}")
    addresses: list[str] = []
    for position, entry in enumerate(entries, 1):
        if isinstance(entry, str) and not entry.strip():
            raise ParamInvalid(f"{what} list {value!r}: entry {position} is empty")
        address = parse_address(entry, what)
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise ParamInvalid(f"{what}: give at least one 'host:port', got {value!r}")
    if len(addresses) > MAX_ADDRESSES:
        raise ParamInvalid(f"{what}: at most {MAX_ADDRESSES} addresses, got {len(addresses)}")
    return tuple(addresses)


# ---------------------------------------------------------------------------- policy


class Endpoints:
    """The addresses of one service and the one in use now; the retry loop over them.

    Thread-safe; shared by every call of a client (and, for GlobalTable, by each client
    it makes while reconnecting), so one caller's discovery that a master is gone moves
    them all.
    """

    def __init__(self, addresses: str | Iterable[str], what: str = "master address") -> None:
        self._addresses = list(parse_addresses(addresses, what))
        self._what = what
        self._index = 0
        self._lock = threading.Lock()

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(self._addresses)

    def describe(self) -> str:
        """The addresses as configured: "h1:p1,h2:p2"."""
        return ",".join(self._addresses)

    def current(self) -> str:
        """The address calls go to now."""
        return self._addresses[self._index]

    def failed(self, address: str, leader: str | None = None) -> None:
        """`address` could not serve a call: move to `leader` when one was named (a valid
        address other than `address`), else to the next address. Nothing moves when
        another caller already moved on from `address`."""
        hint = None
        if leader:
            try:
                hint = parse_address(leader, "leader hint")
            except ParamInvalid:
                hint = None
        with self._lock:
            if self._addresses[self._index] != address:
                return
            if hint is not None and hint != address:
                if hint not in self._addresses and len(self._addresses) < MAX_ADDRESSES:
                    self._addresses.append(hint)
                if hint in self._addresses:
                    self._index = self._addresses.index(hint)
                    return
            self._index = (self._index + 1) % len(self._addresses)

    def call(self, attempt: Callable[[str, float], T], *, timeout: float,
             idempotent: bool) -> T:
        """`attempt(address, deadline)` at the current address, then at the next ones, as
        the module docstring says, within `timeout` seconds in all. An attempt signals
        "try elsewhere" by raising TryNext; anything else it raises ends the call."""
        deadline = time.monotonic() + timeout
        count = len(self._addresses)
        # one attempt may not eat the whole deadline when another address could answer;
        # a non-idempotent call cannot be repeated once sent, so its attempt gets it all
        share = timeout if count == 1 or not idempotent else max(MIN_ATTEMPT_S,
                                                                  timeout / count)
        tried, leader_pending, pause = 0, False, PAUSE_FIRST_S
        said: HixlError | None = None  # the last "not the leader": beats a timeout, said
        while True:
            address = self.current()
            try:
                return attempt(address, min(deadline, time.monotonic() + share))
            except TryNext as signal:
                self.failed(address, signal.leader)
                if signal.leader is None and signal.sent and not idempotent:
                    raise signal.error from None
                last = signal.error
                if signal.leader is not None:
                    leader_pending, said = True, signal.error
            tried += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise (said or last) from None
            if tried % count == 0:  # a whole round failed
                if not leader_pending:
                    raise last from None  # every master unreachable: fail now, retryable
                time.sleep(min(pause, left))
                pause = min(pause * 2, PAUSE_MAX_S)
                leader_pending = False


# ---------------------------------------------------------------------------- gRPC


def leader_hint(exc: grpc.RpcError) -> str | None:
    """The leader a "not the leader" gRPC status names ("" if unknown), or None when
    `exc` is no such status."""
    code_fn = getattr(exc, "code", None)
    if not callable(code_fn) or code_fn() not in _NOT_LEADER_CODES:
        return None
    trailing = getattr(exc, "trailing_metadata", None)
    metadata: Sequence[tuple[str, str | bytes]] = (trailing() if callable(trailing) else ()) or ()
    for key, value in metadata:
        if key == LEADER_METADATA_KEY:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return None


def not_leader_metadata(leader: str) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a standby master sets before answering NOT_LEADER_CODE."""
    return ((LEADER_METADATA_KEY, leader),)


def _never_sent(exc: grpc.RpcError) -> bool:
    """True when gRPC failed the call before any byte of it left: no connection could be
    made (its "failed to connect" / "Connection refused" wording)."""
    details_fn = getattr(exc, "details", None)
    details = (details_fn() if callable(details_fn) else "") or ""
    return details.startswith("failed to connect to all addresses") or (
        "Connection refused" in details)


def rpc_failure(exc: grpc.RpcError, what: str,
                convert: Callable[[grpc.RpcError, str], HixlError],
                not_leader: type[NotLeader] = NotLeader) -> TryNext | HixlError:
    """What a failed gRPC attempt raises inside `Endpoints.call`: TryNext for an
    unreachable or not-leading master, else the typed error `convert(exc, what)` makes."""
    hint = leader_hint(exc)
    if hint is not None:
        details = exc.details() if callable(getattr(exc, "details", None)) else ""
        return TryNext(not_leader(f"{what}: not the leader (leader: {hint or 'unknown'}; "
                                  f"{details})", leader=hint), sent=False, leader=hint)
    error = convert(exc, what)
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    if code == grpc.StatusCode.UNAVAILABLE:
        return TryNext(error, sent=not _never_sent(exc))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TryNext(error, sent=True)
    return error


__all__ = ["LEADER_METADATA_KEY", "MAX_ADDRESSES", "MIN_ATTEMPT_S", "NOT_LEADER_CODE",
           "Endpoints", "NotLeader", "TryNext", "leader_hint", "not_leader_metadata",
           "parse_address", "parse_addresses", "rpc_failure"]
