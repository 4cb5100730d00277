from hixl.v1 import agent_pb2 as _agent_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StoreSegment(_message.Message):
    __slots__ = ("engine", "segment_id", "epoch", "base", "length", "node_id", "endpoints", "name")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    engine: str
    segment_id: int
    epoch: int
    base: int
    length: int
    node_id: str
    endpoints: _agent_pb2.Endpoints
    name: str
    def __init__(self, engine: _Optional[str] = ..., segment_id: _Optional[int] = ..., epoch: _Optional[int] = ..., base: _Optional[int] = ..., length: _Optional[int] = ..., node_id: _Optional[str] = ..., endpoints: _Optional[_Union[_agent_pb2.Endpoints, _Mapping]] = ..., name: _Optional[str] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("replica_id", "engine", "segment_id", "epoch", "addr", "length", "node_id", "state")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        INIT: _ClassVar[Replica.State]
        COMPLETE: _ClassVar[Replica.State]
    INIT: Replica.State
    COMPLETE: Replica.State
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    engine: str
    segment_id: int
    epoch: int
    addr: int
    length: int
    node_id: str
    state: Replica.State
    def __init__(self, replica_id: _Optional[int] = ..., engine: _Optional[str] = ..., segment_id: _Optional[int] = ..., epoch: _Optional[int] = ..., addr: _Optional[int] = ..., length: _Optional[int] = ..., node_id: _Optional[str] = ..., state: _Optional[_Union[Replica.State, str]] = ...) -> None: ...

class MountSegmentRequest(_message.Message):
    __slots__ = ("client_id", "segment")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    segment: StoreSegment
    def __init__(self, client_id: _Optional[str] = ..., segment: _Optional[_Union[StoreSegment, _Mapping]] = ...) -> None: ...

class MountSegmentReply(_message.Message):
    __slots__ = ("code", "message", "restored_objects", "fast_port")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESTORED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    FAST_PORT_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    restored_objects: int
    fast_port: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., restored_objects: _Optional[int] = ..., fast_port: _Optional[int] = ...) -> None: ...

class UnmountSegmentRequest(_message.Message):
    __slots__ = ("client_id", "engine", "segment_id")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    engine: str
    segment_id: int
    def __init__(self, client_id: _Optional[str] = ..., engine: _Optional[str] = ..., segment_id: _Optional[int] = ...) -> None: ...

class UnmountSegmentReply(_message.Message):
    __slots__ = ("code", "message", "dropped_objects")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    dropped_objects: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., dropped_objects: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("status", "client_ttl_ms", "fast_port")
    class ClientStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNDEFINED: _ClassVar[HeartbeatReply.ClientStatus]
        OK: _ClassVar[HeartbeatReply.ClientStatus]
        NEED_REMOUNT: _ClassVar[HeartbeatReply.ClientStatus]
    UNDEFINED: HeartbeatReply.ClientStatus
    OK: HeartbeatReply.ClientStatus
    NEED_REMOUNT: HeartbeatReply.ClientStatus
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    FAST_PORT_FIELD_NUMBER: _ClassVar[int]
    status: HeartbeatReply.ClientStatus
    client_ttl_ms: int
    fast_port: int
    def __init__(self, status: _Optional[_Union[HeartbeatReply.ClientStatus, str]] = ..., client_ttl_ms: _Optional[int] = ..., fast_port: _Optional[int] = ...) -> None: ...

class SoftPin(_message.Message):
    __slots__ = ()
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PRESERVE: _ClassVar[SoftPin.Action]
        ENABLE: _ClassVar[SoftPin.Action]
        DISABLE: _ClassVar[SoftPin.Action]
    PRESERVE: SoftPin.Action
    ENABLE: SoftPin.Action
    DISABLE: SoftPin.Action
    def __init__(self) -> None: ...

class ReplicaConfig(_message.Message):
    __slots__ = ("replica_num", "with_hard_pin", "soft_pin_action", "soft_pin_ttl_ms", "preferred_segments", "prefer_alloc_in_same_node")
    REPLICA_NUM_FIELD_NUMBER: _ClassVar[int]
    WITH_HARD_PIN_FIELD_NUMBER: _ClassVar[int]
    SOFT_PIN_ACTION_FIELD_NUMBER: _ClassVar[int]
    SOFT_PIN_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    PREFER_ALLOC_IN_SAME_NODE_FIELD_NUMBER: _ClassVar[int]
    replica_num: int
    with_hard_pin: bool
    soft_pin_action: SoftPin.Action
    soft_pin_ttl_ms: int
    preferred_segments: _containers.RepeatedScalarFieldContainer[str]
    prefer_alloc_in_same_node: bool
    def __init__(self, replica_num: _Optional[int] = ..., with_hard_pin: _Optional[bool] = ..., soft_pin_action: _Optional[_Union[SoftPin.Action, str]] = ..., soft_pin_ttl_ms: _Optional[int] = ..., preferred_segments: _Optional[_Iterable[str]] = ..., prefer_alloc_in_same_node: _Optional[bool] = ...) -> None: ...

class PutStartItem(_message.Message):
    __slots__ = ("key", "value_length")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    key: str
    value_length: int
    def __init__(self, key: _Optional[str] = ..., value_length: _Optional[int] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("client_id", "node_id", "config", "upsert", "items")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    UPSERT_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    node_id: str
    config: ReplicaConfig
    upsert: bool
    items: _containers.RepeatedCompositeFieldContainer[PutStartItem]
    def __init__(self, client_id: _Optional[str] = ..., node_id: _Optional[str] = ..., config: _Optional[_Union[ReplicaConfig, _Mapping]] = ..., upsert: _Optional[bool] = ..., items: _Optional[_Iterable[_Union[PutStartItem, _Mapping]]] = ...) -> None: ...

class PutStartResult(_message.Message):
    __slots__ = ("code", "put_id", "replicas")
    CODE_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    code: int
    put_id: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, code: _Optional[int] = ..., put_id: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class PutStartReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutStartResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PutStartResult, _Mapping]]] = ...) -> None: ...

class PutRef(_message.Message):
    __slots__ = ("key", "put_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    put_id: int
    def __init__(self, key: _Optional[str] = ..., put_id: _Optional[int] = ...) -> None: ...

class PutEndRequest(_message.Message):
    __slots__ = ("client_id", "puts", "reads_done")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    READS_DONE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    puts: _containers.RepeatedCompositeFieldContainer[PutRef]
    reads_done: bool
    def __init__(self, client_id: _Optional[str] = ..., puts: _Optional[_Iterable[_Union[PutRef, _Mapping]]] = ..., reads_done: _Optional[bool] = ...) -> None: ...

class CodesReply(_message.Message):
    __slots__ = ("codes",)
    CODES_FIELD_NUMBER: _ClassVar[int]
    codes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, codes: _Optional[_Iterable[int]] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys", "cache", "client_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    cache: bool
    client_id: str
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., cache: _Optional[bool] = ..., client_id: _Optional[str] = ...) -> None: ...

class GetReplicasResult(_message.Message):
    __slots__ = ("code", "size", "replicas", "lease_ttl_ms", "cache_ttl_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    code: int
    size: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    lease_ttl_ms: int
    cache_ttl_ms: int
    def __init__(self, code: _Optional[int] = ..., size: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., lease_ttl_ms: _Optional[int] = ..., cache_ttl_ms: _Optional[int] = ...) -> None: ...

class GetReplicasReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GetReplicasResult]
    def __init__(self, results: _Optional[_Iterable[_Union[GetReplicasResult, _Mapping]]] = ...) -> None: ...

class GetSizeReply(_message.Message):
    __slots__ = ("sizes",)
    SIZES_FIELD_NUMBER: _ClassVar[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("keys", "force", "client_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    force: bool
    client_id: str
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., force: _Optional[bool] = ..., client_id: _Optional[str] = ...) -> None: ...

class RemoveByRegexRequest(_message.Message):
    __slots__ = ("regex", "force")
    REGEX_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    regex: str
    force: bool
    def __init__(self, regex: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class RemoveAllRequest(_message.Message):
    __slots__ = ("force",)
    FORCE_FIELD_NUMBER: _ClassVar[int]
    force: bool
    def __init__(self, force: _Optional[bool] = ...) -> None: ...

class CountReply(_message.Message):
    __slots__ = ("code", "count", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    count: int
    message: str
    def __init__(self, code: _Optional[int] = ..., count: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ListStoreSegmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MountedSegment(_message.Message):
    __slots__ = ("segment", "client_id", "live", "used")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    segment: StoreSegment
    client_id: str
    live: bool
    used: int
    def __init__(self, segment: _Optional[_Union[StoreSegment, _Mapping]] = ..., client_id: _Optional[str] = ..., live: _Optional[bool] = ..., used: _Optional[int] = ...) -> None: ...

class ListStoreSegmentsReply(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[MountedSegment]
    def __init__(self, segments: _Optional[_Iterable[_Union[MountedSegment, _Mapping]]] = ...) -> None: ...

class StoreStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreStatsReply(_message.Message):
    __slots__ = ("stats",)
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _containers.ScalarMap[str, float]
    def __init__(self, stats: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ("regex", "limit")
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    regex: str
    limit: int
    def __init__(self, regex: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class KeyReplica(_message.Message):
    __slots__ = ("replica", "segment_name", "live")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    replica: Replica
    segment_name: str
    live: bool
    def __init__(self, replica: _Optional[_Union[Replica, _Mapping]] = ..., segment_name: _Optional[str] = ..., live: _Optional[bool] = ...) -> None: ...

class KeyInfo(_message.Message):
    __slots__ = ("key", "size", "state", "replicas", "lease_ms", "hard_pin", "soft_pin_ms")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        COMPLETE: _ClassVar[KeyInfo.State]
        NOT_READY: _ClassVar[KeyInfo.State]
        PUTTING: _ClassVar[KeyInfo.State]
    COMPLETE: KeyInfo.State
    NOT_READY: KeyInfo.State
    PUTTING: KeyInfo.State
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    HARD_PIN_FIELD_NUMBER: _ClassVar[int]
    SOFT_PIN_MS_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    state: KeyInfo.State
    replicas: _containers.RepeatedCompositeFieldContainer[KeyReplica]
    lease_ms: int
    hard_pin: bool
    soft_pin_ms: int
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., state: _Optional[_Union[KeyInfo.State, str]] = ..., replicas: _Optional[_Iterable[_Union[KeyReplica, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., hard_pin: _Optional[bool] = ..., soft_pin_ms: _Optional[int] = ...) -> None: ...

class ListKeysReply(_message.Message):
    __slots__ = ("code", "message", "keys", "total", "truncated")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    keys: _containers.RepeatedCompositeFieldContainer[KeyInfo]
    total: int
    truncated: bool
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[KeyInfo, _Mapping]]] = ..., total: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("client_id", "node_id", "config", "bytes", "release")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    node_id: str
    config: ReplicaConfig
    bytes: int
    release: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, client_id: _Optional[str] = ..., node_id: _Optional[str] = ..., config: _Optional[_Union[ReplicaConfig, _Mapping]] = ..., bytes: _Optional[int] = ..., release: _Optional[_Iterable[int]] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("reservation_id", "space")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    SPACE_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    space: Replica
    def __init__(self, reservation_id: _Optional[int] = ..., space: _Optional[_Union[Replica, _Mapping]] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("code", "message", "reservations", "lease_ttl_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reservations: _containers.RepeatedCompositeFieldContainer[Reservation]
    lease_ttl_ms: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reservations: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class ReservedRange(_message.Message):
    __slots__ = ("reservation_id", "addr", "length")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    addr: int
    length: int
    def __init__(self, reservation_id: _Optional[int] = ..., addr: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class CommitItem(_message.Message):
    __slots__ = ("key", "value_length", "ranges")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    key: str
    value_length: int
    ranges: _containers.RepeatedCompositeFieldContainer[ReservedRange]
    def __init__(self, key: _Optional[str] = ..., value_length: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[ReservedRange, _Mapping]]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("client_id", "config", "upsert", "items", "reads_done")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    UPSERT_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    READS_DONE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    config: ReplicaConfig
    upsert: bool
    items: _containers.RepeatedCompositeFieldContainer[CommitItem]
    reads_done: bool
    def __init__(self, client_id: _Optional[str] = ..., config: _Optional[_Union[ReplicaConfig, _Mapping]] = ..., upsert: _Optional[bool] = ..., items: _Optional[_Iterable[_Union[CommitItem, _Mapping]]] = ..., reads_done: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("client_id", "reservation_ids")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_IDS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    reservation_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, client_id: _Optional[str] = ..., reservation_ids: _Optional[_Iterable[int]] = ...) -> None: ...
