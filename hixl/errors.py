"""HIXL status codes and the typed exceptions that carry them.

Every failure in hixl is one of these exceptions. Each names the problem in its message
and carries the HIXL status code, so the `Hixl` facade can return the integer HIXL
callers expect while `Engine` users get a precise exception type.
"""

from __future__ import annotations

SUCCESS = 0
PARAM_INVALID = 103900
TIMEOUT = 103901
NOT_CONNECTED = 103902
ALREADY_CONNECTED = 103903
NOTIFY_FAILED = 103904
UNSUPPORTED = 103905
RESOURCE_EXHAUSTED = 203900
FAILED = 503900

STATUS_NAMES: dict[int, str] = {
    SUCCESS: "SUCCESS",
    PARAM_INVALID: "PARAM_INVALID",
    TIMEOUT: "TIMEOUT",
    NOT_CONNECTED: "NOT_CONNECTED",
    ALREADY_CONNECTED: "ALREADY_CONNECTED",
    NOTIFY_FAILED: "NOTIFY_FAILED",
    UNSUPPORTED: "UNSUPPORTED",
    RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
    FAILED: "FAILED",
}


class HixlError(Exception):
    """Base of every hixl error; `status` is the HIXL status code."""

    status: int = FAILED

    def __init__(self, message: str, *, status: int | None = None,
                 failed: list[int] | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        #: indexes of the batch's op descriptors that did not complete (transfers only)
        self.failed: list[int] = list(failed or [])

    @property
    def status_name(self) -> str:
        return STATUS_NAMES.get(self.status, str(self.status))

    def __str__(self) -> str:
        return f"[{self.status_name} {self.status}] {self.args[0]}"


class ParamInvalid(HixlError, ValueError):
    """Bad input: unknown address, bad length, malformed option or config."""

    status = PARAM_INVALID


class OutOfRange(ParamInvalid):
    """An address range that is not wholly inside one registered segment."""


class PermissionDenied(ParamInvalid):
    """The segment does not allow this access (e.g. a write to a read-only segment)."""


class ConfigError(ParamInvalid):
    """A config file, flag or environment value that cannot be used."""


class TransferTimeout(HixlError, TimeoutError):
    """A deadline passed before the operation finished."""

    status = TIMEOUT


class NotConnected(HixlError):
    """No connection to that remote engine (never connected, or disconnected)."""

    status = NOT_CONNECTED


class AlreadyConnected(HixlError):
    status = ALREADY_CONNECTED


class Unsupported(HixlError):
    status = UNSUPPORTED


class WrongServer(Unsupported):
    """The address answered, but is not the server the call is for: an agent's data port
    or a hixl-master's port dialled as an agent's gRPC port, and the like."""


class ResourceExhausted(HixlError):
    """Out of pool memory, queue slots or similar capacity."""

    status = RESOURCE_EXHAUSTED


class TransferFailed(HixlError):
    """The transfer did not complete; `failed` lists the indexes of unfinished descriptors."""

    status = FAILED


class PeerUnavailable(TransferFailed):
    """The remote agent is unreachable or died mid-operation."""


class StaleEpoch(TransferFailed):
    """The remote agent restarted: handles from before the restart are refused."""


class AuthenticationFailed(TransferFailed):
    """The peer refused our cluster token (wrong or missing), or failed to prove its own."""


_BY_STATUS: dict[int, type[HixlError]] = {
    PARAM_INVALID: ParamInvalid,
    TIMEOUT: TransferTimeout,
    NOT_CONNECTED: NotConnected,
    ALREADY_CONNECTED: AlreadyConnected,
    UNSUPPORTED: Unsupported,
    RESOURCE_EXHAUSTED: ResourceExhausted,
    FAILED: TransferFailed,
}


#: What to do about each error, by class (the most specific class wins). The one table of
#: fix hints: agents and hixl-master log it with every failed request, and
#: docs/errors.md quotes every entry (tests/test_docs.py checks).
HINTS: dict[type[HixlError], str] = {
    HixlError: "an internal failure: find the request id in the agent or master log "
               "and report the lines around it",
    ParamInvalid: "fix the argument the message names (address, length, size, option or "
                  "request field) and retry; nothing was changed",
    OutOfRange: "keep [addr, addr+length) inside one segment: check the peer's segments "
                "(Engine.segments) and register local buffers first (Engine.register)",
    PermissionDenied: "the segment's perms forbid this access: allocate or register it "
                      "with perms rw, or only read from a read-only segment",
    ConfigError: "correct the key, environment variable or flag the message names "
                 "(hixl-agent --describe-config lists every key)",
    TransferTimeout: "the deadline passed: check the peer agent is alive and reachable, "
                     "then retry or raise the timeout",
    NotConnected: "call connect(remote) first (again after disconnect); the engine must "
                  "not be closed",
    AlreadyConnected: "already connected to that engine: reuse the connection, or "
                      "disconnect() first",
    Unsupported: "device memory needs a device copier: CUDA memory is served when the CUDA "
                 "driver is loaded in this process; other accelerators and the store's "
                 "put_from / get_into buffers take host memory only: use MEM_HOST (e.g. "
                 "pinned host) buffers there",
    WrongServer: "dial the server the call is for: an engine name is its agent's "
                 "host:grpc_port (engine= on the 'hixl-agent serving' line, default port "
                 "50161), not its data port (data=) nor a hixl-master's port (give that to "
                 "Engine(registry=...) or the agent's --master)",
    ResourceExhausted: "release segments no longer needed (Engine.release) or raise the "
                       "agent's pool_max_bytes (docs/operations.md, sizing)",
    TransferFailed: "the ops in .failed did not complete: retry them; the agent log "
                    "says why under the request id",
    PeerUnavailable: "the remote agent is down or unreachable: check that it runs "
                     "(hixl-agent), its host:port and the firewall, then retry",
    StaleEpoch: "the remote agent restarted: disconnect() and connect() again, then "
                "allocate or look up its segments anew",
    AuthenticationFailed: "give agents, hixl-master and clients the same cluster token "
                          "(cluster_token_file, HIXL_CLUSTER_TOKEN) and keep clocks within "
                          "120 s",
}


def hint_for(error: HixlError | type[HixlError]) -> str:
    """The fix hint of `error`'s class, or of its nearest base class that has one."""
    cls = error if isinstance(error, type) else type(error)
    for base in cls.__mro__:
        hint = HINTS.get(base)  # type: ignore[call-overload]
        if hint is not None:
            return hint
    return ""


def is_internal(error: HixlError) -> bool:
    """True for failures of hixl itself (logged at ERROR), False for ones the caller can
    fix or that the situation explains (bad input, a dead peer: logged at WARNING)."""
    return type(error) in (HixlError, TransferFailed)


def error_for_status(status: int, message: str) -> HixlError:
    """Build the exception class that matches a HIXL status code (e.g. from the wire)."""
    cls = _BY_STATUS.get(status, HixlError)
    return cls(message, status=status)
