"""Blocking client of the Registry service (hixl-master, or a registry embedded in an agent).

Every unary call has a deadline, so a dead or wedged master turns into a typed error
instead of a hang; the watch stream pings the server so a vanished master ends it too.
Given several master addresses, calls fail over between them (hixl.failover).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import hmac
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from hixl.auth import as_token
from hixl.control import (
    add_segments,
    error_from_rpc,
    open_channel,
    segment_from_pb,
    segments_from_columns,
)
from hixl.errors import ConfigError, HixlError, NotConnected, ParamInvalid, WrongServer
from hixl.failover import Endpoints, TryNext, rpc_failure
from hixl.tls import TlsSetting, client_tls
from hixl.types import SegmentInfo
from hixl.v1 import agent_pb2, agent_pb2_grpc
from hixl.wrong_server import Expected, wrong_server

#: Ping an open watch stream every 10 s and give up 5 s after an unanswered ping, so a
#: master that disappears without closing its sockets still ends the stream.
CLIENT_KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted master is found within 0.5 s, not after gRPC's default 1 s to 2-minute
    # back-off: until then every call fails at once, so a store client could neither
    # heartbeat nor remount while its puts, over the store call endpoint, were answered
    # NO_AVAILABLE_HANDLE (its segment awaiting the remount; seen by `hixl soak`).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    # A whole-cluster QuerySegments reply outgrows gRPC's default 4 MiB limit.
    ("grpc.max_receive_message_length", 256 << 20),
]

#: leases whose granting address a client remembers (an agent holds one at a time)
MAX_LEASES_KEPT = 64

#: bytes of an engine's owner key, and of the per-engine secret it is derived from
OWNER_KEY_SIZE = 32
_OWNER_KEY_LABEL = b"hixl-owner-key-v1\0"
_OWNER_VERIFIER_LABEL = b"hixl-owner-verifier-v1\0"

_KIND_NAMES = {value: name for name, value in agent_pb2.SegmentEvent.Kind.items()}

_collector_lock = threading.Lock()
_collector_pauses = 0          # bulk decodes in progress, all threads together
_collector_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Hold Python's cyclic garbage collector off during a bulk decode (CPU work only).

    Why: decoding a 100k-segment snapshot allocates 100k+ objects, which triggers several
    full collections, each walking every object in the process: measured in a process
    holding 230k objects, a new GlobalTable synced in 520 ms with the collector running
    and 210 ms without. The pause is process-wide, so callers never wait on the network
    inside it; pauses nest across threads, and a collector someone else turned off stays
    off. Cyclic garbage made meanwhile is collected once the pause ends.
    """
    global _collector_pauses, _collector_was_enabled
    with _collector_lock:
        if _collector_pauses == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _collector_pauses += 1
    try:
        yield
    finally:
        with _collector_lock:
            _collector_pauses -= 1
            if _collector_pauses == 0 and _collector_was_enabled:
                gc.enable()


@dataclass(frozen=True)
class EngineEndpoints:
    """Where an engine's agent serves, published with its segments so peers need no handshake.

    All empty means "not published": the engine must be reached by a Handshake RPC.
    """

    fabric_domain: str = ""
    data_tcp: str = ""
    data_unix: str = ""
    fd_socket: str = ""


NO_ENDPOINTS = EngineEndpoints()


@dataclass(frozen=True)
class EngineInfo:
    """One engine as the registry knows it: identity, epoch (changes on restart), endpoints."""

    engine: str
    node_id: str
    epoch: int
    endpoints: EngineEndpoints = NO_ENDPOINTS


@dataclass(frozen=True)
class WatchEvent:
    """One event of a registry watch.

    kind: "SNAPSHOT" (the whole table: `segments`, and `engines` on a membership watch),
    "ADDED"/"REMOVED" (segments of one engine), "ENGINE_UP"/"ENGINE_DOWN" (`engines[0]`).
    """

    kind: str
    epoch: int
    segments: list[SegmentInfo]
    engines: list[EngineInfo]


def endpoints_to_pb(endpoints: EngineEndpoints) -> agent_pb2.Endpoints:
    return agent_pb2.Endpoints(
        fabric_domain=endpoints.fabric_domain, data_tcp=endpoints.data_tcp,
        data_unix=endpoints.data_unix, fd_socket=endpoints.fd_socket)


def endpoints_from_pb(pb: agent_pb2.Endpoints) -> EngineEndpoints:
    return EngineEndpoints(fabric_domain=pb.fabric_domain, data_tcp=pb.data_tcp,
                           data_unix=pb.data_unix, fd_socket=pb.fd_socket)


def engine_info_to_pb(info: EngineInfo) -> agent_pb2.EngineInfo:
    return agent_pb2.EngineInfo(engine=info.engine, node_id=info.node_id, epoch=info.epoch,
                                endpoints=endpoints_to_pb(info.endpoints))


def engine_info_from_pb(pb: agent_pb2.EngineInfo) -> EngineInfo:
    return EngineInfo(engine=pb.engine, node_id=pb.node_id, epoch=pb.epoch,
                      endpoints=endpoints_from_pb(pb.endpoints))


# ------------------------------------------------------------------ engine ownership
#
# An engine name belongs to whoever first published it with an owner key: the registry
# keeps SHA-256 of the key (`owner_verifier`) and takes later publishes, keepalives and
# unpublishes of that name only with the same key. An agent derives its key from a random
# per-engine secret kept in its state dir (mode 0600), so a restarted agent proves it at
# once; the secret itself never leaves the node.


def owner_key_from_secret(secret: bytes, engine: str) -> bytes:
    """The owner key `engine` publishes with: HMAC-SHA256(secret, label | engine)."""
    return hmac.new(secret, _OWNER_KEY_LABEL + engine.encode(), hashlib.sha256).digest()


def owner_verifier(owner_key: bytes) -> bytes:
    """What a registry stores of an owner key (SHA-256): it checks a key, cannot be one."""
    return hashlib.sha256(_OWNER_VERIFIER_LABEL + owner_key).digest()


def owner_secret_path(state_dir: str, engine: str) -> str:
    """The file of `engine`'s secret in `state_dir`: the name made file-safe, plus a
    digest of the exact name (names differing only in odd characters never share one)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", engine)[:100]
    digest = hashlib.sha256(engine.encode()).hexdigest()[:12]
    return os.path.join(state_dir, f"owner-{safe}-{digest}.key")


def _check_state_dir(state_dir: str) -> None:
    """Make `state_dir` (0700) if missing; refuse one another user owns or others may write."""
    try:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        info = os.stat(state_dir)
    except OSError as exc:
        raise ConfigError(f"state dir {state_dir}: cannot create or read it: "
                          f"{exc.strerror or exc} (key 'state_dir')") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"state dir {state_dir} is not a directory (key 'state_dir')")
    if info.st_uid != os.geteuid():
        raise ConfigError(f"state dir {state_dir} belongs to uid {info.st_uid}, not to this "
                          f"process (uid {os.geteuid()}): refusing to keep engine secrets "
                          "there (key 'state_dir')")
    if info.st_mode & 0o022:
        raise ConfigError(f"state dir {state_dir} is writable by group or others (mode "
                          f"{oct(stat.S_IMODE(info.st_mode))}): chmod go-w it (key "
                          "'state_dir')")


def _read_secret(path: str) -> bytes:
    """The secret in `path`; ConfigError for a link, another owner, a loose mode or a bad size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ConfigError(f"engine secret {path}: cannot open it: {exc.strerror or exc} "
                          "(a symlink is refused)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"engine secret {path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise ConfigError(f"engine secret {path} belongs to uid {info.st_uid}, not to this "
                              f"process (uid {os.geteuid()}); refusing it")
        if info.st_mode & 0o077:
            raise ConfigError(f"engine secret {path} is accessible by group or others (mode "
                              f"{oct(stat.S_IMODE(info.st_mode))}); refusing it: chmod 600 "
                              "it if it is yours")
        data = os.read(fd, OWNER_KEY_SIZE + 1)
    finally:
        os.close(fd)
    if len(data) != OWNER_KEY_SIZE:
        raise ConfigError(f"engine secret {path} holds {len(data)} bytes, not "
                          f"{OWNER_KEY_SIZE}: not written by hixl (or truncated)")
    return data


def load_owner_secret(state_dir: str, engine: str) -> bytes:
    """`engine`'s random secret from `state_dir`, made on first use: written to a private
    temporary file (0600, fsynced) and hard-linked into place, so a reader never sees a
    partial file and two agents racing for it end up with the same one."""
    _check_state_dir(state_dir)
    path = owner_secret_path(state_dir, engine)
    with contextlib.suppress(FileNotFoundError):
        return _read_secret(path)
    temporary = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secrets.token_bytes(OWNER_KEY_SIZE))
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another process made it first: theirs
            os.link(temporary, path)
        dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise ConfigError(f"engine secret {path}: cannot create it: "
                          f"{exc.strerror or exc} (key 'state_dir')") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
    return _read_secret(path)


def agent_owner_key(state_dir: str, engine: str) -> bytes:
    """The owner key an agent named `engine` publishes with (its secret from `state_dir`)."""
    return owner_key_from_secret(load_owner_secret(state_dir, engine), engine)


def _converter(address: str, expect: Expected | None,
               ) -> Callable[[grpc.RpcError, str], HixlError]:
    """How a failed registry call at `address` becomes a HixlError (hixl.failover's
    `convert`): error_from_rpc, or WrongServer when `expect` is given and the address is
    another kind of server."""
    if expect is None:
        return error_from_rpc
    return lambda exc, what: wrong_server(exc, error_from_rpc(exc, what), address, expect,
                                          what)


class RegistryWatch:
    """A registry watch stream: iterate WatchEvents; `close()` from any thread ends it.

    A SNAPSHOT split over several messages (`more`) is joined here, so callers always
    see one whole snapshot. Errors leave as typed HixlErrors (PeerUnavailable when the
    registry goes away, NotLeader from a standby master, ResourceExhausted when it
    dropped this watcher for lagging); a registry gone or not leading is also reported to
    `endpoints`, so the next watch opens at the next address (or the leader named).
    With `expect`, an address that is not a registry raises WrongServer saying what it is.
    """

    def __init__(self, call: Any, what: str, endpoints: Endpoints | None = None,
                 address: str = "", expect: Expected | None = None) -> None:
        self._call = call
        self._what = what
        self._endpoints = endpoints
        self._address = address
        self._expect = expect
        self._closed = False

    def __iter__(self) -> RegistryWatch:
        return self

    def __next__(self) -> WatchEvent:
        segments: list[SegmentInfo] = []
        engines: list[EngineInfo] = []
        while True:
            if self._closed:
                raise StopIteration
            try:
                pb = next(self._call)
            except grpc.RpcError as exc:
                if self._closed:
                    raise StopIteration from None
                raise self._failure(exc) from None
            with collector_paused():
                segments.extend(segment_from_pb(s) for s in pb.segments)
                for block in pb.columns:
                    segments.extend(segments_from_columns(block))
            engines.extend(engine_info_from_pb(e) for e in pb.engines)
            if not pb.more:
                return WatchEvent(_KIND_NAMES.get(pb.kind, str(pb.kind)), pb.epoch,
                                  segments, engines)

    def _failure(self, exc: grpc.RpcError) -> HixlError:
        outcome = rpc_failure(exc, self._what, _converter(self._address, self._expect))
        if isinstance(outcome, WrongServer):  # not a registry: open the next one next
            outcome = TryNext(outcome, sent=False)
        if not isinstance(outcome, TryNext):
            return outcome
        if self._endpoints is not None:
            self._endpoints.failed(self._address, outcome.leader)
        return outcome.error

    def close(self) -> None:
        self._closed = True
        self._call.cancel()

    def __enter__(self) -> RegistryWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RegistryClient:
    """publish / keepalive / unpublish / query / watch against one registry service.

    `target`: its "host:port", or every master of the cluster ("h1:p1,h2:p2", a list, or
    an `Endpoints` shared with other clients): calls go to one at a time and fail over
    as hixl.failover says; every call here is safe to repeat. A lease belongs to the
    master that granted it, unless its PublishReply named a `lease_scope` the cluster's
    masters share (masters on etcd): once calls have moved to another master, `keepalive`
    of a master's own lease raises NotConnected at once (publish again, as after a master
    restart) rather than renewing whatever lease the other master has under the same
    number; a shared lease is renewed wherever calls go.

    With a `cluster_token`, every call proves it (hixl.auth), as a registry with a token
    requires. `tls`: a hixl.tls.ClientTLS to dial with TLS, False for plaintext, None as
    HIXL_TLS_CA_FILE (and friends) say.

    `expect`: what to say when an address answers but serves no registry (an agent that
    has a master of its own, an agent's data port): hixl.wrong_server.REGISTRY for an
    engine's registry= (WrongServer naming the fix); None leaves gRPC's own error (the
    agent's publisher explains it in terms of its key 'master').
    """

    def __init__(self, target: str | Sequence[str] | Endpoints, *, timeout: float = 5.0,
                 cluster_token: str | bytes | None = None, tls: TlsSetting = None,
                 expect: Expected | None = None) -> None:
        if timeout <= 0:
            raise ParamInvalid(f"registry client timeout must be positive, got {timeout}")
        self.endpoints = target if isinstance(target, Endpoints) else Endpoints(
            target, "registry address")
        #: every address, as given ("h1:p1,h2:p2"); `current` is the one in use
        self.target = self.endpoints.describe()
        self.timeout = timeout
        self._expect = expect
        self._token = as_token(cluster_token)
        self._tls = client_tls(tls) or False  # resolved once: every address dials alike
        self._channels: dict[str, tuple[grpc.Channel, agent_pb2_grpc.RegistryStub]] = {}
        self._lock = threading.Lock()
        self._closed = False
        #: lease id -> the address that granted it ("": any master, a shared scope)
        self._leases: dict[int, str] = {}
        #: lease id -> the owner key it was published with (its keepalives prove it)
        self._lease_keys: dict[int, bytes] = {}
        #: engine -> the owner key this client made for it (publish without `owner_key`)
        self._owner_keys: dict[str, bytes] = {}
        self._stub(self.endpoints.current())  # a bad first address fails here, not later

    @property
    def current(self) -> str:
        """The registry address calls go to now."""
        return self.endpoints.current()

    def _stub(self, address: str) -> agent_pb2_grpc.RegistryStub:
        held = self._channels.get(address)
        if held is not None:
            return held[1]
        with self._lock:
            held = self._channels.get(address)
            if held is None:
                if self._closed:
                    raise ParamInvalid(f"registry client for {self.target} is closed")
                channel, intercepted = open_channel(address, token=self._token, tls=self._tls,
                                                    options=CLIENT_KEEPALIVE_OPTIONS)
                held = self._channels[address] = (channel,
                                                  agent_pb2_grpc.RegistryStub(intercepted))
        return held[1]

    def _call(self, method: str, request: Any, what: Callable[[str], str],
              timeout: float | None, lease: int | None = None) -> Any:
        """`method` at the current registry, failing over within one deadline; with a
        `lease`, only at the address that granted it (NotConnected elsewhere)."""
        def attempt(address: str, deadline: float) -> Any:
            held_at = self._leases.get(lease) if lease is not None else None
            if held_at and held_at != address:
                raise NotConnected(f"{what(address)}: the lease was granted by registry "
                                   f"{held_at}, and calls now go to {address}: publish again")
            return self._call_at(address, method, request, what, deadline)
        limit = self.timeout if timeout is None else timeout
        return self.endpoints.call(attempt, timeout=limit, idempotent=True)

    def publish(self, engine: str, node_id: str, epoch: int, segments: Sequence[SegmentInfo],
                ttl_ms: int, timeout: float | None = None, *,
                endpoints: EngineEndpoints | None = None,
                owner_key: bytes | None = None) -> int:
        """Publish `engine`'s whole table (and where it serves) under a lease; returns the lease id.

        `owner_key` proves the name is ours (agents pass the key of their state dir's
        secret); None: a random key this client makes for `engine` on first use and keeps
        (so this client, and only it, may publish the name again); b"": an unowned publish.
        Keepalives and unpublishes of the lease prove the same key by themselves.
        """
        if owner_key is None:
            with self._lock:
                owner_key = self._owner_keys.setdefault(
                    engine, secrets.token_bytes(OWNER_KEY_SIZE))
        request = agent_pb2.PublishRequest(engine=engine, node_id=node_id, epoch=epoch,
                                           ttl_ms=ttl_ms, owner_key=owner_key)
        add_segments(request.segments, segments)
        if endpoints is not None:
            request.endpoints.CopyFrom(endpoints_to_pb(endpoints))
        granted: list[str] = []

        def attempt(address: str, deadline: float) -> Any:
            reply = self._call_at(address, "Publish", request,
                                  lambda at: f"publish {engine!r} to registry {at}", deadline)
            granted.append(address)
            return reply
        limit = self.timeout if timeout is None else timeout
        reply = self.endpoints.call(attempt, timeout=limit, idempotent=True)
        with self._lock:
            self._leases.pop(reply.lease_id, None)
            self._leases[reply.lease_id] = "" if reply.lease_scope else granted[-1]
            self._lease_keys[reply.lease_id] = owner_key
            while len(self._leases) > MAX_LEASES_KEPT:
                oldest = next(iter(self._leases))
                del self._leases[oldest]
                self._lease_keys.pop(oldest, None)
        return reply.lease_id

    def _call_at(self, address: str, method: str, request: Any,
                 what: Callable[[str], str], deadline: float) -> Any:
        try:
            return getattr(self._stub(address), method)(
                request, timeout=max(0.001, deadline - time.monotonic()))
        except grpc.RpcError as exc:
            failure = rpc_failure(exc, what(address), _converter(address, self._expect))
            if isinstance(failure, WrongServer):  # not a registry: the next address may be
                raise TryNext(failure, sent=False) from None
            raise failure from None

    def _lease_key(self, lease_id: int, owner_key: bytes | None) -> bytes:
        if owner_key is not None:
            return owner_key
        with self._lock:
            return self._lease_keys.get(lease_id, b"")

    def keepalive(self, lease_id: int, timeout: float | None = None, *,
                  owner_key: bytes | None = None) -> int:
        """Extend the lease; returns its ttl in ms. NotConnected once it has expired (or
        once calls moved to a master other than the one that granted it);
        PermissionDenied for a lease published with another owner key. `owner_key` None:
        the key this client published the lease with."""
        request = agent_pb2.KeepAliveRequest(lease_id=lease_id,
                                             owner_key=self._lease_key(lease_id, owner_key))
        reply = self._call("KeepAlive", request,
                           lambda at: f"keepalive of lease {lease_id} at registry {at}",
                           timeout, lease=lease_id)
        return reply.ttl_ms

    def unpublish(self, lease_id: int, timeout: float | None = None, *,
                  owner_key: bytes | None = None) -> None:
        """Withdraw the lease now (same proof as keepalive)."""
        request = agent_pb2.UnpublishRequest(lease_id=lease_id,
                                             owner_key=self._lease_key(lease_id, owner_key))
        self._call("Unpublish", request,
                   lambda at: f"unpublish of lease {lease_id} at registry {at}", timeout,
                   lease=lease_id)
        with self._lock:
            self._leases.pop(lease_id, None)
            self._lease_keys.pop(lease_id, None)

    def query(self, engine: str = "", timeout: float | None = None) -> list[SegmentInfo]:
        """Segments of one engine ("" = every engine)."""
        return [segment_from_pb(pb) for pb in self._query(engine, timeout).segments]

    def query_engines(self, engine: str = "", timeout: float | None = None,
                      ) -> list[EngineInfo]:
        """Live engines with their epochs and endpoints (one engine, or "" = all)."""
        return [engine_info_from_pb(pb) for pb in self._query(engine, timeout).engines]

    def _query(self, engine: str, timeout: float | None) -> agent_pb2.QuerySegmentsReply:
        return self._call("QuerySegments", agent_pb2.QuerySegmentsRequest(engine=engine),
                          lambda at: f"query of registry {at}", timeout)

    def watch(self, timeout: float | None = None,
              ) -> Iterator[tuple[str, int, list[SegmentInfo]]]:
        """Yield (kind name, epoch, segments): "SNAPSHOT" first, then "ADDED"/"REMOVED".

        The stream has no deadline unless `timeout` is given (it is meant to stay open);
        a dead master still ends it through the channel's keepalive pings. Closing the
        iterator (or the client) cancels the stream.
        """
        with self.open_watch(engines=False, timeout=timeout) as stream:
            for event in stream:
                yield event.kind, event.epoch, event.segments

    def open_watch(self, *, engines: bool = True, timeout: float | None = None,
                   columns: bool = True) -> RegistryWatch:
        """A watch stream of WatchEvents at the current address: SNAPSHOT first, then
        changes as they happen.

        `engines` asks for membership too (engines in the SNAPSHOT, ENGINE_UP/ENGINE_DOWN
        events). `columns` asks for segments in compact form (SegmentColumns: a third of
        the bytes, decoded in bulk; a registry that predates it sends Segments, which are
        read just the same). No deadline unless `timeout` is given; keepalive pings end
        the stream when the registry vanishes, and the next `open_watch` goes to the next
        address (or the leader a standby named). `close()` on the result cancels it from
        any thread.
        """
        address = self.endpoints.current()
        call = self._stub(address).Watch(
            agent_pb2.WatchRegistryRequest(engines=engines, columns=columns), timeout=timeout)
        return RegistryWatch(call, f"watch of registry {address}", self.endpoints, address,
                             self._expect)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        for channel, _ in channels:
            channel.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
