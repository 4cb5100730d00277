"""The KV store's types, shared by hixl-master and its clients: what a `Master` RPC
takes and returns (`StoreSegment`, `Replica`, `ReplicaConfig`, the per-call results),
the errors a failed call raises (`MasterRpcError` and its kinds), and their protobuf
conversions. `MasterClient` (hixl.client.store_client) speaks with these; the master's
services (hixl.server.master) answer with them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from hixl.control import error_from_rpc
from hixl.errors import (
    AuthenticationFailed,
    HixlError,
    ParamInvalid,
    PeerUnavailable,
    WrongServer,
)
from hixl.failover import NotLeader
from hixl.registry_client import (
    NO_ENDPOINTS,
    EngineEndpoints,
    endpoints_from_pb,
    endpoints_to_pb,
)
from hixl.store_codes import ErrorCode
from hixl.v1 import store_pb2
from hixl.wrong_server import MASTER, wrong_server

# ---------------------------------------------------------------------------- types


class ReplicaState(enum.IntEnum):
    """Same numbering as `Replica.State` in store.proto."""

    INIT = 0          # allocated by PutStart; the writer is filling it
    COMPLETE = 1      # committed by PutEnd


class SoftPinAction(enum.IntEnum):
    """Mooncake's soft_pin_action; same numbering as `SoftPin.Action` in store.proto."""

    PRESERVE = 0      # keep the object's current soft pin (none for a new key)
    ENABLE = 1
    DISABLE = 2


class ClientStatus(enum.IntEnum):
    """Heartbeat answer (Mooncake's ClientStatus)."""

    UNDEFINED = 0
    OK = 1
    NEED_REMOUNT = 2  # unknown client (expired, or the master restarted): mount again


@dataclass(frozen=True)
class StoreSegment:
    """A segment a client contributes: memory served by `engine`'s agent at owner addresses.

    (engine, segment_id) names it; epoch, base and length describe the memory. After a
    master restart, a remount with all five equal brings its objects back; a newer epoch
    means the memory was lost (its objects are dropped).
    """

    engine: str
    segment_id: int
    epoch: int
    base: int
    length: int
    node_id: str = ""
    endpoints: EngineEndpoints = NO_ENDPOINTS
    name: str = ""


@dataclass(frozen=True)
class Replica:
    """One copy of a value: `length` bytes at owner address `addr` of a segment."""

    replica_id: int
    engine: str
    segment_id: int
    epoch: int
    addr: int
    length: int
    node_id: str = ""
    state: ReplicaState = ReplicaState.COMPLETE


@dataclass(frozen=True)
class ReplicaConfig:
    """Mooncake's ReplicateConfig, as far as the master uses it.

    replica_num copies on distinct segments (best effort: fewer when fewer segments have
    room, at least one); preferred_segments (engine names, "host:port") are tried first,
    then, with prefer_alloc_in_same_node, segments on the caller's node. soft_pin_ttl_ms
    0 means the master's default.
    """

    replica_num: int = 1
    with_hard_pin: bool = False
    soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
    soft_pin_ttl_ms: int = 0
    preferred_segments: tuple[str, ...] = ()
    prefer_alloc_in_same_node: bool = False


@dataclass(frozen=True)
class PutStartResult:
    """code OK: write every replica, then put_end(key, put_id) (or put_revoke)."""

    code: int
    put_id: int = 0
    replicas: tuple[Replica, ...] = ()


@dataclass(frozen=True)
class Reservation:
    """Space the master set aside for this client (docs/store.md §2): `space` is the span
    (engine, segment, epoch, addr, length) it may place values in and commit."""

    reservation_id: int
    space: Replica


@dataclass(frozen=True)
class ReserveResult:
    """code OK: one reservation per replica (distinct segments), usable within
    `lease_ttl_ms` of sending the request."""

    code: int
    reservations: tuple[Reservation, ...] = ()
    lease_ttl_ms: int = 0
    message: str = ""


#: one replica's claim in a Commit: (reservation id, owner address, length)
ReservedRange = tuple[int, int, int]


@dataclass(frozen=True)
class GetReplicasResult:
    """code OK: `size` bytes readable from any replica within `lease_ttl_ms`."""

    code: int
    size: int = 0
    replicas: tuple[Replica, ...] = ()
    lease_ttl_ms: int = 0
    cache_ttl_ms: int = 0     # asked to cache: usable without the master for this long


@dataclass(frozen=True)
class SegmentResult:
    """Outcome of mount (`objects` served again) or unmount (`objects` dropped)."""

    code: int
    message: str = ""
    objects: int = 0


@dataclass(frozen=True)
class CountResult:
    """Outcome of remove_by_regex / remove_all: how many objects went."""

    code: int
    count: int = 0
    message: str = ""


@dataclass(frozen=True)
class HeartbeatResult:
    status: ClientStatus
    client_ttl_ms: int


@dataclass(frozen=True)
class MountedSegment:
    """A segment as the master sees it; `live` False: restored, awaiting its remount."""

    segment: StoreSegment
    client_id: str
    live: bool
    used: int


class KeyState(enum.IntEnum):
    """A listed key's state; same numbering as `KeyInfo.State` in store.proto."""

    COMPLETE = 0      # committed and readable
    NOT_READY = 1     # committed; every replica awaits its segment's remount
    PUTTING = 2       # put started, not yet ended (invisible to reads)


@dataclass(frozen=True)
class KeyReplica:
    """One replica of a listed key and the segment it lives in (`live` False: awaiting remount)."""

    replica: Replica
    segment_name: str = ""
    live: bool = True


@dataclass(frozen=True)
class KeyInfo:
    """One object as `list_keys` shows it: size, state, replicas, lease and pins left."""

    key: str
    size: int
    state: KeyState
    replicas: tuple[KeyReplica, ...] = ()
    lease_ms: int = 0
    hard_pin: bool = False
    soft_pin_ms: int = 0


@dataclass(frozen=True)
class KeyListing:
    """Outcome of list_keys: the first keys (sorted) of `total` that match.

    code INVALID_PARAMS (with `message`) for a bad regex; `truncated` when the limit
    left some matching keys out.
    """

    code: int
    keys: tuple[KeyInfo, ...] = ()
    total: int = 0
    truncated: bool = False
    message: str = ""


# ---------------------------------------------------------------------------- errors


class MasterRpcError(HixlError):
    """A call to the master failed as a call (the store reports RPC_FAIL for it)."""

    code: int = ErrorCode.RPC_FAIL


class MasterUnavailable(MasterRpcError, PeerUnavailable):
    """The master is unreachable, or did not answer within the call's deadline."""


class MasterAuthenticationFailed(MasterRpcError, AuthenticationFailed):
    """The master refused our cluster token (or asked for one we do not have)."""


class MasterNotLeader(MasterUnavailable, NotLeader):
    """The master answered that it is not the leader (and no leader answered in time)."""


class MasterWrongServer(MasterRpcError, WrongServer):
    """The master address answered, but is no hixl-master: an agent's gRPC or data port,
    say (hixl.wrong_server). Final: the same address answers the same way, so store setup
    does not retry it until its deadline."""


_UNAVAILABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.CANCELLED})


def master_error(exc: grpc.RpcError, what: str, target: str = "") -> MasterRpcError:
    """The typed MasterRpcError a failed call to the master stands for; with the master
    address `target`, MasterWrongServer when it turned out to be another kind of server."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    base = error_from_rpc(exc, what)
    if target:
        wrong = wrong_server(exc, base, target, MASTER, what, MasterWrongServer)
        if isinstance(wrong, MasterWrongServer):
            return wrong
    message = str(base.args[0]) if base.args else what
    if code in _UNAVAILABLE_CODES:
        return MasterUnavailable(message)
    if isinstance(base, AuthenticationFailed):
        return MasterAuthenticationFailed(message)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return MasterRpcError(f"{message} (this server has no Master service: the store "
                              "needs hixl-master; an agent's embedded registry has none)")
    return MasterRpcError(message, status=base.status)


# ---------------------------------------------------------------------------- protobuf


def store_segment_to_pb(segment: StoreSegment) -> store_pb2.StoreSegment:
    return store_pb2.StoreSegment(
        engine=segment.engine, segment_id=segment.segment_id, epoch=segment.epoch,
        base=segment.base, length=segment.length, node_id=segment.node_id,
        endpoints=endpoints_to_pb(segment.endpoints), name=segment.name)


def store_segment_from_pb(pb: store_pb2.StoreSegment) -> StoreSegment:
    return StoreSegment(engine=pb.engine, segment_id=pb.segment_id, epoch=pb.epoch,
                        base=pb.base, length=pb.length, node_id=pb.node_id,
                        endpoints=endpoints_from_pb(pb.endpoints), name=pb.name)


def replica_to_pb(replica: Replica) -> store_pb2.Replica:
    return store_pb2.Replica(
        replica_id=replica.replica_id, engine=replica.engine, segment_id=replica.segment_id,
        epoch=replica.epoch, addr=replica.addr, length=replica.length,
        node_id=replica.node_id, state=int(replica.state))


def replica_from_pb(pb: store_pb2.Replica) -> Replica:
    return Replica(replica_id=pb.replica_id, engine=pb.engine, segment_id=pb.segment_id,
                   epoch=pb.epoch, addr=pb.addr, length=pb.length, node_id=pb.node_id,
                   state=ReplicaState(pb.state) if pb.state in (0, 1) else ReplicaState.INIT)


_ENCODED_CONFIGS: dict[ReplicaConfig, store_pb2.ReplicaConfig] = {}
_CONFIGS_MAX = 256  # distinct configs remembered each way (a client uses a handful)


def replica_config_to_pb(config: ReplicaConfig) -> store_pb2.ReplicaConfig:
    """The message for `config`; callers pass it into a request (which copies it) and
    never change it, so one made per config serves every put (bounded: cleared when full)."""
    pb = _ENCODED_CONFIGS.get(config)
    if pb is None:
        pb = store_pb2.ReplicaConfig(
            replica_num=config.replica_num, with_hard_pin=config.with_hard_pin,
            soft_pin_action=int(config.soft_pin_action),
            soft_pin_ttl_ms=config.soft_pin_ttl_ms,
            preferred_segments=list(config.preferred_segments),
            prefer_alloc_in_same_node=config.prefer_alloc_in_same_node)
        if len(_ENCODED_CONFIGS) >= _CONFIGS_MAX:
            _ENCODED_CONFIGS.clear()
        _ENCODED_CONFIGS[config] = pb
    return pb


#: decoded configs by their serialized form: every put a client makes carries the same
#: one, and decoding it costs ten times its lookup here (bounded: cleared when full)
_DECODED_CONFIGS: dict[bytes, ReplicaConfig] = {}


def replica_config_from_pb(pb: store_pb2.ReplicaConfig) -> ReplicaConfig:
    """Decode; an unknown soft pin action is refused (ParamInvalid), not guessed."""
    key = pb.SerializeToString(deterministic=True)
    config = _DECODED_CONFIGS.get(key)
    if config is None:
        config = _decode_replica_config(pb)
        if len(_DECODED_CONFIGS) >= _CONFIGS_MAX:
            _DECODED_CONFIGS.clear()
        _DECODED_CONFIGS[key] = config
    return config


def _decode_replica_config(pb: store_pb2.ReplicaConfig) -> ReplicaConfig:
    try:
        action = SoftPinAction(pb.soft_pin_action)
    except ValueError:
        raise ParamInvalid(f"unknown soft_pin_action {pb.soft_pin_action}") from None
    return ReplicaConfig(
        replica_num=pb.replica_num or 1, with_hard_pin=pb.with_hard_pin,
        soft_pin_action=action, soft_pin_ttl_ms=pb.soft_pin_ttl_ms,
        preferred_segments=tuple(pb.preferred_segments),
        prefer_alloc_in_same_node=pb.prefer_alloc_in_same_node)


def key_info_to_pb(info: KeyInfo) -> store_pb2.KeyInfo:
    return store_pb2.KeyInfo(
        key=info.key, size=info.size, state=int(info.state), lease_ms=info.lease_ms,
        hard_pin=info.hard_pin, soft_pin_ms=info.soft_pin_ms,
        replicas=[store_pb2.KeyReplica(replica=replica_to_pb(r.replica),
                                       segment_name=r.segment_name, live=r.live)
                  for r in info.replicas])


def key_info_from_pb(pb: store_pb2.KeyInfo) -> KeyInfo:
    return KeyInfo(
        key=pb.key, size=pb.size,
        state=KeyState(pb.state) if pb.state in (0, 1, 2) else KeyState.NOT_READY,
        replicas=tuple(KeyReplica(replica_from_pb(r.replica), r.segment_name, r.live)
                       for r in pb.replicas),
        lease_ms=pb.lease_ms, hard_pin=pb.hard_pin, soft_pin_ms=pb.soft_pin_ms)
