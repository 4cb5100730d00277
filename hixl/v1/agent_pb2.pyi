from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Segment(_message.Message):
    __slots__ = ("segment_id", "engine", "node_id", "base", "length", "mem_type", "perms", "epoch", "shareable", "name", "allowed_engines")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    PERMS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHAREABLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_ENGINES_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    engine: str
    node_id: str
    base: int
    length: int
    mem_type: int
    perms: int
    epoch: int
    shareable: bool
    name: str
    allowed_engines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, segment_id: _Optional[int] = ..., engine: _Optional[str] = ..., node_id: _Optional[str] = ..., base: _Optional[int] = ..., length: _Optional[int] = ..., mem_type: _Optional[int] = ..., perms: _Optional[int] = ..., epoch: _Optional[int] = ..., shareable: _Optional[bool] = ..., name: _Optional[str] = ..., allowed_engines: _Optional[_Iterable[str]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("version", "client_engine")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ENGINE_FIELD_NUMBER: _ClassVar[int]
    version: int
    client_engine: str
    def __init__(self, version: _Optional[int] = ..., client_engine: _Optional[str] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("version", "engine", "node_id", "fabric_domain", "epoch", "data_tcp", "data_unix", "fd_socket", "segments")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FABRIC_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DATA_TCP_FIELD_NUMBER: _ClassVar[int]
    DATA_UNIX_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    engine: str
    node_id: str
    fabric_domain: str
    epoch: int
    data_tcp: str
    data_unix: str
    fd_socket: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, version: _Optional[int] = ..., engine: _Optional[str] = ..., node_id: _Optional[str] = ..., fabric_domain: _Optional[str] = ..., epoch: _Optional[int] = ..., data_tcp: _Optional[str] = ..., data_unix: _Optional[str] = ..., fd_socket: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class ListSegmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSegmentsReply(_message.Message):
    __slots__ = ("epoch", "segments")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, epoch: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class WatchSegmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SegmentColumns(_message.Message):
    __slots__ = ("engine", "node_id", "epoch", "segment_id", "base", "length", "mem_type", "perms", "shareable", "name", "allowed_engines")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    PERMS_FIELD_NUMBER: _ClassVar[int]
    SHAREABLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_ENGINES_FIELD_NUMBER: _ClassVar[int]
    engine: str
    node_id: str
    epoch: int
    segment_id: _containers.RepeatedScalarFieldContainer[int]
    base: _containers.RepeatedScalarFieldContainer[int]
    length: _containers.RepeatedScalarFieldContainer[int]
    mem_type: _containers.RepeatedScalarFieldContainer[int]
    perms: _containers.RepeatedScalarFieldContainer[int]
    shareable: _containers.RepeatedScalarFieldContainer[bool]
    name: _containers.RepeatedScalarFieldContainer[str]
    allowed_engines: _containers.RepeatedCompositeFieldContainer[AllowList]
    def __init__(self, engine: _Optional[str] = ..., node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., segment_id: _Optional[_Iterable[int]] = ..., base: _Optional[_Iterable[int]] = ..., length: _Optional[_Iterable[int]] = ..., mem_type: _Optional[_Iterable[int]] = ..., perms: _Optional[_Iterable[int]] = ..., shareable: _Optional[_Iterable[bool]] = ..., name: _Optional[_Iterable[str]] = ..., allowed_engines: _Optional[_Iterable[_Union[AllowList, _Mapping]]] = ...) -> None: ...

class AllowList(_message.Message):
    __slots__ = ("index", "engines")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    index: int
    engines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, index: _Optional[int] = ..., engines: _Optional[_Iterable[str]] = ...) -> None: ...

class SegmentEvent(_message.Message):
    __slots__ = ("kind", "epoch", "segments", "engines", "more", "columns")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SNAPSHOT: _ClassVar[SegmentEvent.Kind]
        ADDED: _ClassVar[SegmentEvent.Kind]
        REMOVED: _ClassVar[SegmentEvent.Kind]
        ENGINE_UP: _ClassVar[SegmentEvent.Kind]
        ENGINE_DOWN: _ClassVar[SegmentEvent.Kind]
    SNAPSHOT: SegmentEvent.Kind
    ADDED: SegmentEvent.Kind
    REMOVED: SegmentEvent.Kind
    ENGINE_UP: SegmentEvent.Kind
    ENGINE_DOWN: SegmentEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    kind: SegmentEvent.Kind
    epoch: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    more: bool
    columns: _containers.RepeatedCompositeFieldContainer[SegmentColumns]
    def __init__(self, kind: _Optional[_Union[SegmentEvent.Kind, str]] = ..., epoch: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ..., more: _Optional[bool] = ..., columns: _Optional[_Iterable[_Union[SegmentColumns, _Mapping]]] = ...) -> None: ...

class AllocateSegmentRequest(_message.Message):
    __slots__ = ("size", "perms", "name", "owner", "allowed_engines")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PERMS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_ENGINES_FIELD_NUMBER: _ClassVar[int]
    size: int
    perms: int
    name: str
    owner: str
    allowed_engines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, size: _Optional[int] = ..., perms: _Optional[int] = ..., name: _Optional[str] = ..., owner: _Optional[str] = ..., allowed_engines: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterSegmentRequest(_message.Message):
    __slots__ = ("fd_ticket", "length", "perms", "name", "owner", "allowed_engines")
    FD_TICKET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PERMS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_ENGINES_FIELD_NUMBER: _ClassVar[int]
    fd_ticket: str
    length: int
    perms: int
    name: str
    owner: str
    allowed_engines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, fd_ticket: _Optional[str] = ..., length: _Optional[int] = ..., perms: _Optional[int] = ..., name: _Optional[str] = ..., owner: _Optional[str] = ..., allowed_engines: _Optional[_Iterable[str]] = ...) -> None: ...

class SegmentReply(_message.Message):
    __slots__ = ("segment", "release_key")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_KEY_FIELD_NUMBER: _ClassVar[int]
    segment: Segment
    release_key: bytes
    def __init__(self, segment: _Optional[_Union[Segment, _Mapping]] = ..., release_key: _Optional[bytes] = ...) -> None: ...

class DeregisterSegmentRequest(_message.Message):
    __slots__ = ("segment_id", "epoch", "release_key")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RELEASE_KEY_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    epoch: int
    release_key: bytes
    def __init__(self, segment_id: _Optional[int] = ..., epoch: _Optional[int] = ..., release_key: _Optional[bytes] = ...) -> None: ...

class DeregisterSegmentReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Peer(_message.Message):
    __slots__ = ("kind", "address", "identity", "connected_s")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_S_FIELD_NUMBER: _ClassVar[int]
    kind: str
    address: str
    identity: str
    connected_s: float
    def __init__(self, kind: _Optional[str] = ..., address: _Optional[str] = ..., identity: _Optional[str] = ..., connected_s: _Optional[float] = ...) -> None: ...

class RegistryState(_message.Message):
    __slots__ = ("mode", "target", "published", "lease_id", "failures", "last_error", "last_success_age_s", "engines", "segments")
    MODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_SUCCESS_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    target: str
    published: bool
    lease_id: int
    failures: int
    last_error: str
    last_success_age_s: float
    engines: int
    segments: int
    def __init__(self, mode: _Optional[str] = ..., target: _Optional[str] = ..., published: _Optional[bool] = ..., lease_id: _Optional[int] = ..., failures: _Optional[int] = ..., last_error: _Optional[str] = ..., last_success_age_s: _Optional[float] = ..., engines: _Optional[int] = ..., segments: _Optional[int] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("status", "engine", "node_id", "epoch", "uptime_s", "segments", "segment_bytes", "peers", "registry")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    status: str
    engine: str
    node_id: str
    epoch: int
    uptime_s: float
    segments: int
    segment_bytes: int
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    registry: RegistryState
    def __init__(self, status: _Optional[str] = ..., engine: _Optional[str] = ..., node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., uptime_s: _Optional[float] = ..., segments: _Optional[int] = ..., segment_bytes: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ..., registry: _Optional[_Union[RegistryState, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("counters",)
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.ScalarMap[str, int]
    def __init__(self, counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Endpoints(_message.Message):
    __slots__ = ("fabric_domain", "data_tcp", "data_unix", "fd_socket")
    FABRIC_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    DATA_TCP_FIELD_NUMBER: _ClassVar[int]
    DATA_UNIX_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_FIELD_NUMBER: _ClassVar[int]
    fabric_domain: str
    data_tcp: str
    data_unix: str
    fd_socket: str
    def __init__(self, fabric_domain: _Optional[str] = ..., data_tcp: _Optional[str] = ..., data_unix: _Optional[str] = ..., fd_socket: _Optional[str] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("engine", "node_id", "epoch", "endpoints")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    node_id: str
    epoch: int
    endpoints: Endpoints
    def __init__(self, engine: _Optional[str] = ..., node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., endpoints: _Optional[_Union[Endpoints, _Mapping]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("engine", "node_id", "epoch", "ttl_ms", "segments", "endpoints", "owner_key", "owner_verifier")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    OWNER_KEY_FIELD_NUMBER: _ClassVar[int]
    OWNER_VERIFIER_FIELD_NUMBER: _ClassVar[int]
    engine: str
    node_id: str
    epoch: int
    ttl_ms: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    endpoints: Endpoints
    owner_key: bytes
    owner_verifier: bytes
    def __init__(self, engine: _Optional[str] = ..., node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., endpoints: _Optional[_Union[Endpoints, _Mapping]] = ..., owner_key: _Optional[bytes] = ..., owner_verifier: _Optional[bytes] = ...) -> None: ...

class PublishReply(_message.Message):
    __slots__ = ("lease_id", "ttl_ms", "lease_scope")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    ttl_ms: int
    lease_scope: str
    def __init__(self, lease_id: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., lease_scope: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("lease_id", "owner_key")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_KEY_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    owner_key: bytes
    def __init__(self, lease_id: _Optional[int] = ..., owner_key: _Optional[bytes] = ...) -> None: ...

class KeepAliveReply(_message.Message):
    __slots__ = ("ttl_ms",)
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    def __init__(self, ttl_ms: _Optional[int] = ...) -> None: ...

class UnpublishRequest(_message.Message):
    __slots__ = ("lease_id", "owner_key")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_KEY_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    owner_key: bytes
    def __init__(self, lease_id: _Optional[int] = ..., owner_key: _Optional[bytes] = ...) -> None: ...

class UnpublishReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QuerySegmentsRequest(_message.Message):
    __slots__ = ("engine",)
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    engine: str
    def __init__(self, engine: _Optional[str] = ...) -> None: ...

class QuerySegmentsReply(_message.Message):
    __slots__ = ("segments", "engines")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    def __init__(self, segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ...) -> None: ...

class WatchRegistryRequest(_message.Message):
    __slots__ = ("engines", "columns")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    engines: bool
    columns: bool
    def __init__(self, engines: _Optional[bool] = ..., columns: _Optional[bool] = ...) -> None: ...
