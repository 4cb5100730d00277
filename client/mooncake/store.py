"""`MooncakeDistributedStore`: Mooncake Store's Python client on top of hixl.

Code written for `mooncake.store.MooncakeDistributedStore` runs by changing the import to
`hixl.client.mooncake`: same method names, argument order, defaults and return values
(0, a byte count, or a negative Mooncake `ErrorCode` from hixl.store_codes; `get` returns
b"" when it cannot return the value; no exceptions). Every negative return is logged
once (logger "hixl.mooncake.store") with the real reason and kept in `last_error` /
`last_error_code`, where Mooncake often gives a bare code.

How it works (see docs/mooncake.md §2):

- the client contributes `global_segment_size` bytes of host DRAM to the pool. By
  default an agent embedded in this process serves it (`Engine("host:port")`, an shm
  segment from `Engine.malloc`, so same-node peers map it); with `agent=` (or
  $HIXL_AGENT) the segment is allocated in that running hixl-agent instead. The segment
  is mounted at hixl-master, kept alive by a heartbeat thread and remounted when the
  master asks (it expired us, or restarted); `close()` unmounts it.
- put: PutStart (one RPC for a whole batch) -> write the bytes into every replica with
  the hixl Engine (memmove for this client's own segment, mapped memory for same-node
  peers, TCP across nodes) -> PutEnd. A failed transfer revokes the put and retries it
  once on other segments, so a dead client's segment does not fail other clients' puts.
- get: GetReplicas (grants a read lease) -> read from the nearest replica, falling back
  to the next one on failure.
- Bytes move once: `put` sends a value straight from the caller's object and `get`
  reads straight into the new `bytes` it returns (no staging buffer, so
  `local_buffer_size` reserves nothing; with 0 those value calls fail, as in Mooncake);
  `put_from` / `get_into` move bytes straight from / into caller memory, registered with
  `register_buffer` or not (as Mooncake's tcp transport; a range with unmapped pages is
  refused). Large copies on this node run on several threads (`hixl.memory.copy_moves`).

Deliberate differences from Mooncake: setup() with no master fails within its timeout
(default 5 s) instead of blocking 90 s; a master restart loses no committed key (the
master journals) and this client remounts its segment by itself; unregistered buffers
are refused with INVALID_PARAMS (Mooncake does not check over tcp); a destination
smaller than the value is BUFFER_OVERFLOW; keys and values are checked before anything
is sent. Outcomes: OBJECT_NOT_FOUND (-704) for a missing key, RPC_FAIL (-900) when the
master cannot be asked -- never confused.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import add
from typing import Any

from hixl import device
from hixl.client.engine import Engine, MemHandle, parse_engine_name
from hixl.client.mooncake import tensors
from hixl.client.store_client import LocationCache, MasterClient, ReadGate, ReservedSpace
from hixl.control import node_identity
from hixl.errors import (
    HixlError,
    NotConnected,
    ParamInvalid,
    PeerUnavailable,
    StaleEpoch,
    Unsupported,
)
from hixl.failover import parse_addresses
from hixl.logs import log_failure
from hixl.memory import ShmSegment, buffer_range, copy_moves, keep_freed_memory, new_bytes
from hixl.options import OPTION_ENABLE_USE_FABRIC_MEM
from hixl.sizes import parse_size, split_size
from hixl.store_codes import MAX_REPLICAS, ErrorCode, code_name, hint_for_code
from hixl.store_types import (
    ClientStatus,
    GetReplicasResult,
    MasterRpcError,
    MasterUnavailable,
    MasterWrongServer,
    PutStartResult,
    Replica,
    ReplicaConfig,
    SoftPinAction,
    StoreSegment,
)
from hixl.table import AddressTable, check_range
from hixl.transports.fabric import read_all
from hixl.types import Perm, TransferOp, TransferOpDesc

log = logging.getLogger("hixl.mooncake.store")

OK = int(ErrorCode.OK)
#: what Mooncake returns from a call on a client that is not set up (or closed)
NOT_SET_UP = int(ErrorCode.INTERNAL_ERROR)

DEFAULT_SIZE = 16 << 20                      # setup(dict) defaults, as Mooncake's
DEFAULT_MASTER = "127.0.0.1:50051"
DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200     # MooncakeConfig defaults (3.125 GiB, 1 GiB)
DEFAULT_LOCAL_BUFFER_SIZE = 1073741824
P2P_HANDSHAKE = "P2PHANDSHAKE"
REGISTRY_SCHEME = "hixl://"
PROTOCOLS = ("tcp", "rdma")
STORE_PORTS = (12300, 14300)                 # Mooncake's store picks its port here
PORT_ATTEMPTS = 16
MAX_KEY_BYTES = 4096

AGENT_ENV = "HIXL_AGENT"
MASTER_TIMEOUT_ENV, DEFAULT_MASTER_TIMEOUT_S = "HIXL_STORE_MASTER_TIMEOUT", 5.0
SETUP_TIMEOUT_ENV = "HIXL_STORE_SETUP_TIMEOUT"     # default: the master timeout
TRANSFER_TIMEOUT_ENV, DEFAULT_TRANSFER_TIMEOUT_S = "MC_TRANSFER_TIMEOUT", 30.0
CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S = "MC_HANDSHAKE_CONNECT_TIMEOUT", 5.0

SEGMENT_NAME = "mooncake:store"
SETUP_RETRY_S = 0.1                          # between mount attempts while setup waits
LOST_MASTER_POLL_S = 0.2                     # heartbeat period while the master is away
MAX_HEARTBEAT_S = 1.0                        # a restarted master is noticed within this
DEFAULT_CLIENT_TTL_MS = 10_000
MAX_LOGGED_KEYS = 3
OTHERS_TTL_S = 1.0                           # how long a list of live segments is reused

_REMOVE_REASONS = {
    ErrorCode.OBJECT_HAS_LEASE: "read-leased (a get or is_exist holds it); remove(key, "
                                "force=True) removes it anyway",
    ErrorCode.OBJECT_NOT_FOUND: "not found",
    ErrorCode.INVALID_KEY: "keys must be non-empty str of at most 4096 bytes",
}
# Mooncake's size units are all binary: its "MB" is hixl's "MiB" (hixl.sizes)
_MOONCAKE_BINARY_UNITS = {"kb": "kib", "mb": "mib", "gb": "gib", "tb": "tib"}


# ---------------------------------------------------------------------------- config


def mooncake_size(value: Any) -> int:
    """Bytes from a size in Mooncake's configuration: an int (a whole float too) or a text
    like "16MB", "4gb", "1.5k", "64MiB"; zero is allowed (a pure client's
    global_segment_size). Mooncake reads every unit as binary ("16MB" = 16 MiB), so
    KB/MB/GB/TB become KiB/MiB/GiB/TiB here, at the boundary, and the rest is hixl's one
    size parser (`hixl.sizes.parse_size`). ConfigError (a ValueError) when not a size."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        parts = split_size(value)
        if parts is not None and parts[1] in _MOONCAKE_BINARY_UNITS:
            value = parts[0] + _MOONCAKE_BINARY_UNITS[parts[1]]
    return parse_size(value, allow_zero=True)


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool | int):
        return bool(value)
    text = str(value or "").strip().lower()
    if text in ("", "0", "false", "no", "off", "disable"):
        return False
    if text in ("1", "true", "yes", "on", "enable"):
        return True
    raise ValueError(f"invalid boolean {value!r}")


@dataclass
class MooncakeConfig:
    """Mooncake's client configuration (`mooncake.mooncake_config.MooncakeConfig`).

    `load_from_env()` reads the JSON file $MOONCAKE_CONFIG_PATH names, else the
    MOONCAKE_* variables (MOONCAKE_MASTER required); `setup()` with no arguments uses it.
    """

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str | None
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = 9300

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError(f"invalid protocol {self.protocol!r}: use 'tcp' or 'rdma'")
        self.protocol = self.protocol.strip().lower()
        for name in ("global_segment_size", "local_buffer_size"):
            setattr(self, name, mooncake_size(getattr(self, name)))
        for name in ("local_hostname", "metadata_server", "master_server_address"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"config field {name!r} must be a non-empty string, got {value!r}")

    @staticmethod
    def from_file(file_path: str) -> MooncakeConfig:
        """Load a JSON config file (required: local_hostname, metadata_server,
        master_server_address)."""
        with open(file_path, encoding="utf-8") as f:
            config = json.load(f)
        for name in ("local_hostname", "metadata_server", "master_server_address"):
            if name not in config:
                raise ValueError(f"{file_path}: missing required config field {name!r}")
        return MooncakeConfig(
            local_hostname=config["local_hostname"],
            metadata_server=config["metadata_server"],
            global_segment_size=config.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE),
            local_buffer_size=config.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE),
            protocol=config.get("protocol", "tcp"),
            device_name=config.get("device_name", ""),
            master_server_address=config["master_server_address"],
            enable_ssd_offload=_parse_bool(config.get("enable_ssd_offload", False)),
            ssd_offload_path=str(config.get("ssd_offload_path") or ""),
            tenant_id=str(config.get("tenant_id") or "default"),
            enable_client_http_server=_parse_bool(config.get("enable_client_http_server", False)),
            client_http_port=int(config.get("client_http_port", 9300)))

    @staticmethod
    def load_from_env() -> MooncakeConfig:
        """From $MOONCAKE_CONFIG_PATH, else MOONCAKE_MASTER, MOONCAKE_LOCAL_HOSTNAME,
        MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_GLOBAL_SEGMENT_SIZE,
        MOONCAKE_LOCAL_BUFFER_SIZE, MOONCAKE_PROTOCOL, MOONCAKE_DEVICE."""
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path is not None:
            return MooncakeConfig.from_file(path)
        if not os.getenv("MOONCAKE_MASTER"):
            raise ValueError("neither MOONCAKE_CONFIG_PATH nor MOONCAKE_MASTER is set")
        return MooncakeConfig(
            local_hostname=os.getenv("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=os.getenv("MOONCAKE_TE_META_DATA_SERVER", P2P_HANDSHAKE),
            global_segment_size=os.getenv("MOONCAKE_GLOBAL_SEGMENT_SIZE",
                                          DEFAULT_GLOBAL_SEGMENT_SIZE),
            local_buffer_size=os.getenv("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER_SIZE),
            protocol=os.getenv("MOONCAKE_PROTOCOL", "tcp"),
            device_name=os.getenv("MOONCAKE_DEVICE", ""),
            master_server_address=os.environ["MOONCAKE_MASTER"],
            enable_ssd_offload=_parse_bool(os.getenv("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=os.getenv("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=os.getenv("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=_parse_bool(
                os.getenv("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "false")),
            client_http_port=int(os.getenv("MOONCAKE_CLIENT_HTTP_PORT", "9300")))

    def setup_dict(self) -> dict[str, Any]:
        """This config as the dict `MooncakeDistributedStore.setup(config)` takes."""
        return {"local_hostname": self.local_hostname, "metadata_server": self.metadata_server,
                "global_segment_size": self.global_segment_size,
                "local_buffer_size": self.local_buffer_size, "protocol": self.protocol,
                "rdma_devices": self.device_name or "",
                "master_server_addr": self.master_server_address,
                "enable_ssd_offload": self.enable_ssd_offload,
                "ssd_offload_path": self.ssd_offload_path, "tenant_id": self.tenant_id,
                "enable_client_http_server": self.enable_client_http_server,
                "client_http_port": self.client_http_port}


class ObjectDataType(enum.IntEnum):
    """Mooncake's ObjectDataType (what a value holds), for `ReplicateConfig.data_type`:
    accepted and not used (no tier here decides by it)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


@dataclass
class ReplicateConfig:
    """Mooncake's ReplicateConfig: how many copies, where, and pinning.

    `preferred_segment` / `preferred_segments` are segment names ("host:port", as
    `get_hostname()` returns) tried first. nof/dfs replicas, preferred_nof_segments,
    group_ids and data_type are accepted and not used (no SSD or DFS tier here).
    """

    replica_num: int = 1
    nof_replica_num: int = 0
    dfs_replica_num: int = 0
    with_hard_pin: bool = False
    soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
    #: None (the master's --default_kv_soft_pin_ttl) or an int in [0, 2**64), as Mooncake's
    #: optional<uint64_t>: anything else raises TypeError when assigned
    soft_pin_ttl_ms: int | None = None
    preferred_segment: str = ""
    preferred_segments: list[str] = field(default_factory=list)
    prefer_alloc_in_same_node: bool = False
    group_ids: list[str] = field(default_factory=list)
    preferred_nof_segments: list[str] = field(default_factory=list)
    data_type: ObjectDataType = ObjectDataType.UNKNOWN

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "soft_pin_ttl_ms" and value is not None and (
                type(value) is not int or not 0 <= value < 1 << 64):
            raise TypeError(f"soft_pin_ttl_ms must be None or an int in [0, 2**64), "
                            f"got {value!r}")
        super().__setattr__(name, value)

    def to_master(self, avoid: Sequence[str] = (), others: Sequence[str] = ()) -> ReplicaConfig:
        """The master's ReplicaConfig; segments in `avoid` are not preferred, and
        `others` (live segments) are preferred after the caller's own choices. A TTL
        without SoftPinAction.ENABLE is refused (ValueError), as Mooncake refuses it."""
        if not 1 <= int(self.replica_num) <= MAX_REPLICAS:
            raise ValueError(f"replica_num must be in [1, {MAX_REPLICAS}], got {self.replica_num}")
        if self.soft_pin_ttl_ms is not None and \
                SoftPinAction(int(self.soft_pin_action)) != SoftPinAction.ENABLE:
            raise ValueError(f"soft_pin_ttl_ms={self.soft_pin_ttl_ms} needs soft_pin_action="
                             "SoftPinAction.ENABLE (a TTL means nothing without a soft pin)")
        preferred = [self.preferred_segment] if self.preferred_segment else []
        preferred += [s for s in self.preferred_segments if s not in preferred]
        preferred += [s for s in others if s not in preferred]
        return ReplicaConfig(
            replica_num=int(self.replica_num), with_hard_pin=bool(self.with_hard_pin),
            soft_pin_action=SoftPinAction(int(self.soft_pin_action)),
            soft_pin_ttl_ms=self.soft_pin_ttl_ms or 0,  # 0: the master's default
            preferred_segments=tuple(s for s in preferred if s not in avoid),
            prefer_alloc_in_same_node=bool(self.prefer_alloc_in_same_node))


#: the config of a put given none (never handed out, never changed) and what the master
#: is sent for it while no segment is suspect: built once, not per put
_DEFAULT_CONFIG = ReplicateConfig()
_DEFAULT_MASTER_CONFIG = _DEFAULT_CONFIG.to_master()


class BufferHandle(bytearray):
    """A value read by get_buffer(): buffer protocol, plus Mooncake's `.ptr()` / `.size()`.

    It owns its memory (nothing in the store can reuse it while a view is alive).
    """

    def ptr(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self)) if len(self) else 0

    def size(self) -> int:
        return len(self)


# ---------------------------------------------------------------------------- internals


class StoreError(HixlError):
    """A refusal with the Mooncake ErrorCode it returns as (not raised to callers)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = int(code)


@dataclass
class _Settings:
    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    master: str
    engine: Any = None


@dataclass
class _Item:
    """One key of a call: its pieces of local memory (addr, value offset, length)."""

    index: int
    key: str
    size: int
    pieces: list[tuple[int, int, int]]
    keepalive: Any = None


@dataclass
class _Batch:
    """The ops of one call for one target engine, and which item each op belongs to."""

    descs: list[TransferOpDesc] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    replicas: dict[tuple[int, int], Replica] = field(default_factory=dict)


def _pieces(parts: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(addr, length) parts laid end to end -> (addr, value offset, length) pieces."""
    pieces, offset = [], 0
    for addr, length in parts:
        if length:
            pieces.append((addr, offset, length))
            offset += length
    return pieces


def _show(key: Any) -> str:
    """A key for a log line (long keys cut short)."""
    text = repr(key)
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} chars)"


def _key_problem(key: Any) -> str:
    if not isinstance(key, str):
        return f"key must be a str, got {type(key).__name__}"
    if not key:
        return "key must not be empty"
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return f"key is longer than {MAX_KEY_BYTES} bytes"
    return ""


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            return int(value.__index__())
        except (AttributeError, TypeError):
            raise StoreError(ErrorCode.INVALID_PARAMS,
                             f"{what} must be an int, got {value!r}") from None
    return value


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise StoreError(ErrorCode.INVALID_PARAMS, f"${name}={raw!r} is not a number") from None
    if not value > 0:
        raise StoreError(ErrorCode.INVALID_PARAMS, f"${name}={raw!r} must be positive")
    return value


_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def _mapped(addr: int, size: int) -> bool:
    """Whether every page of [addr, addr+size) is mapped in this process: mincore(2)
    fails with ENOMEM on any unmapped page (one system call; nothing is touched)."""
    start = addr - addr % _PAGE
    length = addr + size - start
    if start + length > 1 << 47:  # beyond user space: never mapped
        return False
    vec = ctypes.create_string_buffer((length + _PAGE - 1) // _PAGE)
    return _libc.mincore(start, length, vec) == 0


_NO_LOCAL_BUFFER = ("local_buffer_size is 0: put() / get() of values go through the local "
                    "buffer in Mooncake's API, so they fail here as there; use put_from / "
                    "get_into with your own buffer, or set up with a local_buffer_size")


def _engine_name(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------------------- the store


class MooncakeDistributedStore:
    """Mooncake Store client. Call setup() first; close() unmounts and stops.

    hixl extras (keyword-only, all optional): `agent` -- a running hixl-agent ("host:port")
    to hold this client's segment (default $HIXL_AGENT, else an agent embedded here);
    `master_timeout` -- deadline of each master call in s (default
    $HIXL_STORE_MASTER_TIMEOUT or 5); `setup_timeout` -- how long setup() waits for the
    master (default $HIXL_STORE_SETUP_TIMEOUT, else the master timeout);
    `transfer_timeout` -- deadline of each transfer (default $MC_TRANSFER_TIMEOUT or 30).
    """

    def __init__(self, *, agent: str | None = None, master_timeout: float | None = None,
                 setup_timeout: float | None = None,
                 transfer_timeout: float | None = None) -> None:
        self._agent = agent
        self._master_timeout_arg = master_timeout
        self._setup_timeout_arg = setup_timeout
        self._transfer_timeout_arg = transfer_timeout
        self._lock = threading.RLock()
        self._checkin_lock = threading.Lock()
        self._stop = threading.Event()
        self._node_id = node_identity()
        self._new_life()
        #: why the last call failed, and the code it returned (0 / "" before any failure)
        self.last_error = ""
        self.last_error_code = 0

    def _new_life(self) -> None:
        """The state of one setup() .. close(): set here before the first setup, and again
        when setup() follows close() (Mooncake allows it: a new client, whose earlier
        objects are gone with its unmounted segment)."""
        self._engine: Engine | None = None
        self._own_engine = False
        self._master: MasterClient | None = None
        self._space: ReservedSpace | None = None  # for puts in one round trip
        self._locations = LocationCache()            # for gets without the master
        self._reads = ReadGate()                     # our reads in flight, for our removals
        self._segment: StoreSegment | None = None
        self._segment_local = False           # the segment is memory of this process
        self._segment_shm: ShmSegment | None = None
        self._segment_handle: MemHandle | None = None
        self._buffers: AddressTable[MemHandle] = AddressTable()
        self._verified: set[tuple[str, int, int]] = set()
        self._suspects: dict[str, float] = {}    # engine -> monotonic time to forget it
        self._others: tuple[set[str], float, list[str]] = (set(), 0.0, [])
        self._pool: ThreadPoolExecutor | None = None
        self._heartbeat: threading.Thread | None = None  # stopped by _stop (setup clears it)
        self._client_ttl_s = DEFAULT_CLIENT_TTL_MS / 1000
        self._master_lost = False
        self._hostname = ""
        self._transfer_timeout = DEFAULT_TRANSFER_TIMEOUT_S
        self._master_timeout = DEFAULT_MASTER_TIMEOUT_S
        self._remote_info: Any = None          # SegmentInfo of a segment held by an agent
        self._connect_timeout = DEFAULT_CONNECT_TIMEOUT_S
        # Mooncake stages put() / get() values through a buffer of this size; hixl stages
        # nothing, but with 0 those calls fail as they do in Mooncake (the contract)
        self._local_buffer_size = DEFAULT_SIZE
        self._closed = False

    # ------------------------------------------------------------ errors become codes

    def _fail(self, what: str, code: int, reason: str) -> int:
        """Record and log one failure (once); returns `code`."""
        code = int(code)
        self.last_error, self.last_error_code = f"{what}: {reason}", code
        level = logging.INFO if code == ErrorCode.OBJECT_NOT_FOUND else logging.WARNING
        log_failure(log, level, f"{what} returned {code}: {reason}", code=code_name(code),
                    number=code, hint=hint_for_code(code))
        return code

    def _guard(self, what: str, fn: Callable[[], Any], failure: Any = None) -> Any:
        """fn(); any error becomes its code (or `failure`), logged once."""
        try:
            return fn()
        except StoreError as exc:
            code, reason = exc.code, str(exc.args[0])
        except MasterRpcError as exc:
            code, reason = int(ErrorCode.RPC_FAIL), str(exc)
        except HixlError as exc:
            code, reason = int(ErrorCode.INTERNAL_ERROR), str(exc)
        except Exception as exc:  # a bug must still come back as a code, not a crash
            log.exception("%s: internal error", what)
            code, reason = int(ErrorCode.INTERNAL_ERROR), f"internal error: {exc!r}"
        self._fail(what, code, reason)
        return code if failure is None else failure

    def _report(self, what: str, keys: Sequence[Any], codes: Sequence[int],
                reasons: dict[int, str]) -> None:
        """Log a batch's negative results in one line (the first few keys named)."""
        bad = [i for i, c in enumerate(codes) if c < 0]
        if not bad:
            return
        if len(codes) == 1:
            self._fail(what, codes[0], f"{_show(keys[0])}: {reasons.get(0, code_name(codes[0]))}")
            return
        named = "; ".join(f"{_show(keys[i])}: {codes[i]} {code_name(codes[i])} "
                          f"({reasons.get(i, 'no detail')})" for i in bad[:MAX_LOGGED_KEYS])
        more = f"; and {len(bad) - MAX_LOGGED_KEYS} more" if len(bad) > MAX_LOGGED_KEYS else ""
        self._fail(what, codes[bad[0]], f"{len(bad)} of {len(codes)} keys failed: {named}{more}")

    def get_last_error(self) -> str:
        """The reason behind the last negative return ("" if none yet)."""
        return self.last_error

    def _require(self) -> tuple[Engine, MasterClient]:
        if self._engine is None or self._master is None:
            raise StoreError(NOT_SET_UP, "the store is closed" if self._closed
                             else "the store is not set up; call setup() first")
        return self._engine, self._master

    # ------------------------------------------------------------ setup

    def setup(self, local_hostname: Any = None, metadata_server: str | None = None,
              global_segment_size: int | str = DEFAULT_SIZE,
              local_buffer_size: int | str = DEFAULT_SIZE, protocol: str = "tcp",
              rdma_devices: str = "", master_server_addr: str | Sequence[str] = DEFAULT_MASTER,
              engine: Any = None, enable_ssd_offload: bool = False, ssd_offload_path: str = "",
              tenant_id: str = "default", enable_client_http_server: bool = False,
              client_http_port: int = 9300) -> int:
        """Start the client: positional form (as Mooncake), `setup(config_dict)`, or
        `setup()` (MooncakeConfig.load_from_env()). 0, or a negative code: INVALID_PARAMS
        for bad arguments, RPC_FAIL when no master answered within the setup timeout."""
        def run() -> int:
            if isinstance(local_hostname, dict):
                settings = self._settings_from_dict(local_hostname)
            elif local_hostname is None and metadata_server is None:
                try:
                    config = MooncakeConfig.load_from_env()
                except (ValueError, OSError) as exc:
                    raise StoreError(ErrorCode.INVALID_PARAMS,
                                     f"setup() without arguments reads the config from "
                                     f"the environment: {exc}") from None
                settings = self._settings_from_dict(config.setup_dict())
            else:
                settings = self._settings(local_hostname, metadata_server, global_segment_size,
                                          local_buffer_size, protocol, master_server_addr,
                                          engine)
            extras = {"enable_ssd_offload": enable_ssd_offload,
                      "enable_client_http_server": enable_client_http_server}
            for name, value in extras.items():
                if value:
                    log.warning("setup: %s is not supported by hixl's store; ignored", name)
            return self._setup(settings)
        return self._guard("setup", run)

    def _settings_from_dict(self, config: dict[str, Any]) -> _Settings:
        known = {"local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
                 "protocol", "rdma_devices", "device_name", "master_server_addr",
                 "master_server_address", "ipc_socket_path", "enable_ssd_offload",
                 "ssd_offload_path", "tenant_id", "enable_client_http_server",
                 "client_http_port", "engine"}
        unknown = sorted(set(config) - known)
        if unknown:
            log.warning("setup: config keys %s are not used by hixl's store", unknown)
        for name in ("local_hostname", "metadata_server"):
            if name not in config:
                raise StoreError(ErrorCode.INVALID_PARAMS, f"setup(config): {name!r} is required")
        master = config.get("master_server_addr", config.get("master_server_address",
                                                             DEFAULT_MASTER))
        return self._settings(config["local_hostname"], config["metadata_server"],
                              config.get("global_segment_size", DEFAULT_SIZE),
                              config.get("local_buffer_size", DEFAULT_SIZE),
                              config.get("protocol", "tcp"), master, config.get("engine"))

    @staticmethod
    def _settings(local_hostname: Any, metadata_server: Any, global_segment_size: Any,
                  local_buffer_size: Any, protocol: Any, master: Any, engine: Any) -> _Settings:
        def bad(message: str) -> StoreError:
            return StoreError(ErrorCode.INVALID_PARAMS, f"setup: {message}")
        if not isinstance(local_hostname, str) or not local_hostname:
            raise bad(f"local_hostname must be 'host' or 'host:port', got {local_hostname!r}")
        try:
            parse_engine_name(local_hostname)
        except ParamInvalid as exc:
            raise bad(str(exc)) from None
        if not isinstance(metadata_server, str) or not metadata_server:
            raise bad(f"metadata_server must be {P2P_HANDSHAKE!r} or a URL, got {metadata_server!r}")
        if not isinstance(protocol, str) or protocol.lower() not in PROTOCOLS:
            raise bad(f"protocol {protocol!r} is not supported: use one of {PROTOCOLS}")
        try:
            sizes = mooncake_size(global_segment_size), mooncake_size(local_buffer_size)
        except ValueError as exc:
            raise bad(str(exc)) from None
        if isinstance(master, str) and "://" in master:
            raise bad(f"master_server_addr {master!r}: give the masters' 'host:port' (every "
                      "hixl-master, comma-separated; etcd/redis URLs are not spoken)")
        if not master or not isinstance(master, (str, list, tuple)):
            raise bad(f"master_server_addr must be 'host:port' (or several, comma-separated), "
                      f"got {master!r}")
        try:
            masters = parse_addresses(master, "master_server_addr")
        except ParamInvalid as exc:
            raise bad(f"{exc.args[0]} (hixl-master's default port is 50051)") from None
        return _Settings(local_hostname, metadata_server, sizes[0], sizes[1],
                         protocol.lower(), ",".join(masters), engine)

    def _setup(self, settings: _Settings) -> int:
        with self._lock:
            if self._engine is not None and not self._closed:
                raise StoreError(ErrorCode.INVALID_PARAMS, "setup: this store is already set "
                                 "up (close() it first to set it up again)")
            if self._closed:  # setup after close: a new client on this object
                self._new_life()
            self._master_timeout = self._seconds(self._master_timeout_arg, MASTER_TIMEOUT_ENV,
                                                 DEFAULT_MASTER_TIMEOUT_S)
            setup_timeout = self._seconds(self._setup_timeout_arg, SETUP_TIMEOUT_ENV,
                                          self._master_timeout)
            self._transfer_timeout = self._seconds(self._transfer_timeout_arg,
                                                   TRANSFER_TIMEOUT_ENV, DEFAULT_TRANSFER_TIMEOUT_S)
            self._connect_timeout = self._seconds(None, CONNECT_TIMEOUT_ENV,
                                                  DEFAULT_CONNECT_TIMEOUT_S)
            log.info("%s", keep_freed_memory())  # get()'s new bytes land in warm pages
            deadline = time.monotonic() + setup_timeout
            self._stop.clear()
            if settings.protocol == "rdma":
                log.info("protocol 'rdma': hixl moves bytes over its own paths (mapped shared "
                         "memory on the same node, TCP across nodes)")
            agent = self._agent if self._agent is not None else os.environ.get(AGENT_ENV) or None
            self._local_buffer_size = settings.local_buffer_size
            try:
                self._start_engine(settings, agent)
                self._start_memory(settings, agent)
                self._master = MasterClient(settings.master, timeout=self._master_timeout,
                                            node_id=self._node_id)
                self._space = ReservedSpace(self._master)
                self._first_mount(settings.master, deadline, setup_timeout)
            except BaseException:
                self._teardown(unmount=False)
                raise
            if self._segment is not None:
                self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                                   name="hixl-store-heartbeat")
                self._heartbeat.start()
            log.info("Mooncake store client %s: segment %s, master %s",
                     self._hostname, f"{self._segment.length} bytes" if self._segment
                     else "none (pure client)", settings.master)
            return OK

    @staticmethod
    def _seconds(given: float | None, env: str, default: float) -> float:
        if given is not None:
            if not given > 0:
                raise StoreError(ErrorCode.INVALID_PARAMS, f"timeout must be positive, got {given}")
            return float(given)
        return _env_seconds(env, default)

    def _start_engine(self, settings: _Settings, agent: str | None) -> None:
        registry = ""
        server = settings.metadata_server
        if server.startswith(REGISTRY_SCHEME):
            registry = server[len(REGISTRY_SCHEME):].rstrip("/")
        elif server != P2P_HANDSHAKE:
            log.info("metadata server %r is not needed: the master names every segment's "
                     "engine and peers handshake directly (P2P)", server)
        given = settings.engine
        if given is not None:
            engine = given.get_engine() if callable(getattr(given, "get_engine", None)) else given
            if not isinstance(engine, Engine):
                raise StoreError(ErrorCode.INVALID_PARAMS,
                                 f"engine= must be an initialized hixl.client.mooncake."
                                 f"TransferEngine or an hixl Engine, got {type(given).__name__}")
            self._engine, self._own_engine = engine, False
            return
        options = {OPTION_ENABLE_USE_FABRIC_MEM: "1"}
        host, port = parse_engine_name(settings.local_hostname)
        if agent is not None or settings.global_segment_size == 0:
            # the segment lives elsewhere (or nowhere): this process serves nothing
            self._engine = Engine(host if ":" not in host else f"[{host}]", options,
                                  registry=registry or None)
        elif port:
            self._engine = Engine(_engine_name(host, port), options, registry=registry or None)
        else:
            self._engine = _engine_in_port_range(host, options, registry)
        self._own_engine = True

    def _start_memory(self, settings: _Settings, agent: str | None) -> None:
        engine = self._engine
        assert engine is not None
        self._hostname = engine.name
        size = settings.global_segment_size
        if not size:
            return
        if agent is not None:
            self._connect(agent)
            info = self._remote_info = engine.allocate(agent, size, Perm.RW, name=SEGMENT_NAME)
            self._hostname = agent
        else:
            if engine.agent is None:
                raise StoreError(ErrorCode.INVALID_PARAMS, f"engine {engine.name} has no "
                                 "embedded agent to serve the global segment: give it a port, "
                                 f"or name a running agent (agent= / ${AGENT_ENV})")
            self._segment_shm = engine.malloc(size)
            self._segment_handle = engine.register(self._segment_shm, name=SEGMENT_NAME)
            info = self._segment_handle.segment
            assert info is not None
            self._segment_local = True
        self._segment = StoreSegment(info.engine, info.segment_id, info.epoch, info.base,
                                     info.length, info.node_id, name=self._hostname)

    def _first_mount(self, master: str, deadline: float, setup_timeout: float) -> None:
        """Mount (or, for a pure client, reach) the master, retrying until the deadline."""
        assert self._master is not None
        while True:
            left = deadline - time.monotonic()
            try:
                if self._segment is None:
                    self._master.heartbeat(timeout=max(0.05, min(left, self._master_timeout)))
                    return
                result = self._master.mount_segment(
                    self._segment, timeout=max(0.05, min(left, self._master_timeout)))
                if result.code != OK:
                    raise StoreError(result.code, f"master {master} refused segment "
                                     f"{self._segment.engine}/{self._segment.segment_id}: "
                                     f"{result.message or code_name(result.code)}")
                return
            except MasterWrongServer as exc:  # it will answer the same way: no retry
                raise StoreError(ErrorCode.RPC_FAIL, f"master_server_addr {master} is not a "
                                 f"hixl-master: {exc.args[0]}") from None
            except MasterRpcError as exc:
                if time.monotonic() + SETUP_RETRY_S >= deadline:
                    raise StoreError(ErrorCode.RPC_FAIL, (
                        f"no hixl-master answered at {master} within {setup_timeout:g} s "
                        f"(is it running? `hixl-master --port {master.rpartition(':')[2]}`"
                        f"{'' if ',' not in master else ' at one of them'}): {exc}")) from None
                time.sleep(SETUP_RETRY_S)

    # ------------------------------------------------------------ liveness

    def _heartbeat_loop(self) -> None:
        """Beat often enough to keep the ttl and to notice a restarted master soon (it
        answers NEED_REMOUNT); poll faster while the master is away."""
        while not self._stop.wait(LOST_MASTER_POLL_S if self._master_lost else
                                  min(self._client_ttl_s / 3, MAX_HEARTBEAT_S)):
            self._check_in()

    def _check_in(self) -> bool:
        """Heartbeat now; remount if the master asks. True if the segment was remounted."""
        master, segment = self._master, self._segment
        if master is None or segment is None:
            return False
        with self._checkin_lock:
            try:
                beat = master.heartbeat()
                if beat.client_ttl_ms > 0:
                    self._client_ttl_s = beat.client_ttl_ms / 1000
                if beat.status != ClientStatus.NEED_REMOUNT:
                    if self._master_lost:
                        log.info("master %s is back", master.target)
                    self._master_lost = False
                    return False
                result = master.mount_segment(segment)
            except MasterRpcError as exc:
                if not self._master_lost:
                    log.warning("master %s unreachable (%s); retrying every %g s",
                                master.target, exc, LOST_MASTER_POLL_S)
                self._master_lost = True
                return False
            self._master_lost = False
            if result.code != OK:
                log.error("remount of segment %s/%d at master %s refused: %d %s %s",
                          segment.engine, segment.segment_id, master.target, result.code,
                          code_name(result.code), result.message)
                return False
            log.info("remounted segment %s/%d at master %s (%d objects served again)",
                     segment.engine, segment.segment_id, master.target, result.objects)
            return True

    def get_offload_rpc_read_count(self) -> int:
        """Reads served from an SSD offload tier by RPC: always 0 (there is none here)."""
        return 0

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 master unreachable."""
        if self._master is None:
            return 1
        try:
            self._master.heartbeat()
        except MasterRpcError as exc:
            self._fail("health_check", ErrorCode.RPC_FAIL, str(exc))
            return 2
        return 0

    def get_hostname(self) -> str:
        """The name of this client's segment ("host:port"); "" before setup."""
        return self._hostname

    # ------------------------------------------------------------ close

    def close(self) -> int:
        """Unmount the segment, stop the heartbeat and the engine; idempotent, returns 0."""
        with self._lock:
            if self._closed or self._engine is None:
                self._closed = True
                return OK
            self._closed = True
            self._teardown(unmount=True)
        return OK

    def _teardown(self, *, unmount: bool) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self._master_timeout + 1)
        engine, master, segment = self._engine, self._master, self._segment
        if unmount and master is not None and segment is not None:
            try:
                master.unmount_segment(segment.engine, segment.segment_id,
                                       timeout=min(self._master_timeout, 2.0))
            except MasterRpcError as exc:
                log.warning("close: unmount of %s/%d failed (%s); the master drops it when "
                            "this client's ttl ends", segment.engine, segment.segment_id, exc)
        if self._space is not None:
            self._space.close()
        if master is not None:
            master.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if engine is not None:
            if self._remote_info is not None:
                with contextlib.suppress(HixlError):
                    engine.release(self._remote_info.engine, self._remote_info)
            if self._own_engine:
                engine.close()
            else:
                for handle in (self._segment_handle, *(h for _, _, h in self._buffers)):
                    if handle is not None and handle.registered:
                        with contextlib.suppress(HixlError):
                            engine.deregister(handle)
                if self._segment_shm is not None:
                    with contextlib.suppress(HixlError):
                        engine.free(self._segment_shm)
        self._engine = self._master = self._segment = self._space = None
        self._buffers = AddressTable()

    def __enter__(self) -> MooncakeDistributedStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------ buffers

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register [buffer_ptr, +size) for put_from / get_into (0, or INVALID_PARAMS)."""
        def run() -> int:
            engine, _ = self._require()
            addr, length = _int(buffer_ptr, "buffer_ptr"), _int(size, "size")
            try:
                check_range(addr, length, "register_buffer")
                # The engine serves device memory (issue 21), but put_from / get_into copy
                # registered buffers on the host: a device buffer here would be a crash
                device.require_host(device.locate_address(addr),
                                    f"register_buffer: [{addr:#x}, +{length})")
                with self._lock:
                    existing = self._buffers.get(addr)
                    if existing is not None and existing.length == length:
                        return OK
                    handle = engine.register(addr, length, name="mooncake:buffer")
                    try:
                        self._buffers.insert(addr, length, handle)
                    except ParamInvalid:
                        engine.deregister(handle)
                        raise
            except (ParamInvalid, Unsupported) as exc:  # a bad range, or device memory
                raise StoreError(ErrorCode.INVALID_PARAMS, str(exc.args[0])) from None
            return OK
        return self._guard("register_buffer", run)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Withdraw a registration made by register_buffer (INVALID_PARAMS if none)."""
        def run() -> int:
            engine, _ = self._require()
            addr = _int(buffer_ptr, "buffer_ptr")
            with self._lock:
                handle = self._buffers.get(addr)
                if handle is None:
                    raise StoreError(ErrorCode.INVALID_PARAMS,
                                     f"no buffer registered at {addr:#x} (already unregistered?)")
                self._buffers.remove(addr)
                engine.deregister(handle)
            return OK
        return self._guard("unregister_buffer", run)

    def _registered(self, addr: Any, size: Any, what: str) -> tuple[int, int]:
        """(addr, size) of caller memory for a *_from / *_into call.

        Registered buffers are what Mooncake's API expects, but its TCP transport also
        moves bytes from and into memory never registered, and callers rely on it
        (LMCache's P2P mode registers nothing). So any range mapped in this process is
        taken (the bytes move the same way: the store copies straight from or into caller
        memory either way); a range with unmapped pages is INVALID_PARAMS instead of the
        crash it would be in Mooncake.
        """
        addr, size = _int(addr, f"{what} buffer_ptr"), _int(size, f"{what} size")
        if size < 0 or addr < 0:
            raise StoreError(ErrorCode.INVALID_PARAMS, f"{what}: negative address or size")
        if size and not self._inside_buffer(addr, size):
            if not _mapped(addr, size):
                raise StoreError(ErrorCode.INVALID_PARAMS, (
                    f"{what}: [{addr:#x}, +{size}) is not memory of this process (unmapped "
                    "pages): a wrong buffer_ptr or size?"))
            try:  # device memory is mapped too, but a host copy of it is a crash
                device.require_host(device.locate_address(addr), f"{what}: [{addr:#x}, +{size})")
            except Unsupported as exc:
                raise StoreError(ErrorCode.INVALID_PARAMS, str(exc.args[0])) from None
        return addr, size

    def _staging(self, what: str) -> None:
        """Refuse a call that Mooncake stages through the local buffer when it is 0."""
        if self._engine is not None and not self._local_buffer_size:
            raise StoreError(ErrorCode.INVALID_PARAMS, f"{what}: {_NO_LOCAL_BUFFER}")

    def _inside_buffer(self, addr: int, size: int) -> bool:
        hit = self._buffers.lookup(addr)
        return hit is not None and addr + size <= hit[1]   # (base, end, handle)

    def _inside_buffers(self, addrs: Sequence[int], sizes: Sequence[int]) -> bool:
        """`_inside_buffer` of every (addr, size): one lookup when they all lie in one
        registered buffer (a batch's destinations, as a rule)."""
        low = min(addrs)
        hit = self._buffers.lookup(low)
        if hit is not None and max(map(add, addrs, sizes)) <= hit[1]:
            return True
        return all(map(self._inside_buffer, addrs, sizes))

    # ------------------------------------------------------------ targets and transfers

    def _connect(self, target: str) -> Engine:
        engine = self._engine
        if engine is None:
            raise NotConnected("the store is closed")
        engine.ensure_connected(target, self._connect_timeout)
        return engine

    def _drop(self, target: str) -> None:
        with self._lock:
            self._verified = {v for v in self._verified if v[0] != target}
        engine = self._engine
        if engine is not None:
            with contextlib.suppress(HixlError):
                engine.disconnect(target)

    def _verify(self, engine: Engine, target: str, replicas: Sequence[Replica]) -> None:
        """Each replica's segment (id and epoch) is one `target` serves now: a restarted
        peer may have other memory at the same addresses."""
        for replica in replicas:
            ident = (target, replica.segment_id, replica.epoch)
            if ident in self._verified:
                continue
            for refresh in (False, True):
                if any(s.segment_id == replica.segment_id and s.epoch == replica.epoch
                       and s.base <= replica.addr and replica.addr + replica.length <= s.end
                       for s in engine.segments(target, refresh=refresh)):
                    with self._lock:
                        self._verified.add(ident)
                    break
            else:
                raise StaleEpoch(f"{target} no longer serves segment {replica.segment_id} "
                                 f"epoch {replica.epoch} (it restarted or dropped it)")

    def _transfer(self, target: str, op: TransferOp, batch: _Batch) -> None:
        """Move one target's ops; a cached connection found dead or stale is reopened once."""
        cached = self._engine is not None and self._engine.is_connected(target)
        for attempt in (0, 1):
            try:
                engine = self._connect(target)
                self._verify(engine, target, list(batch.replicas.values()))
                # local memory is checked here (register_buffer) or is a Python object
                # this call holds: the engine need not look it up again
                engine.transfer(target, op, batch.descs, self._transfer_timeout,
                                local_registered=False)
                return
            except (PeerUnavailable, StaleEpoch, NotConnected) as exc:
                self._drop(target)
                if attempt or not cached or self._engine is None:
                    raise
                log.info("%s: cached connection failed (%s); reconnecting", target, exc)
            except HixlError:
                self._drop(target)
                raise

    def _run(self, op: TransferOp, batches: dict[str, _Batch]) -> dict[int, tuple[str, str]]:
        """Run every target's batch (targets in parallel); item index -> (target, why it
        failed)."""
        def one(target: str, batch: _Batch) -> HixlError | None:
            try:
                self._transfer(target, op, batch)
            except HixlError as exc:
                return exc
            return None
        items = list(batches.items())
        if len(items) > 1:
            if self._pool is None:
                with self._lock:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(4, thread_name_prefix="hixl-store")
            futures = [self._pool.submit(one, t, b) for t, b in items[1:]]
            errors = [one(*items[0]), *(f.result() for f in futures)]
        else:
            errors = [one(*item) for item in items]
        failed: dict[int, tuple[str, str]] = {}
        for (target, batch), exc in zip(items, errors, strict=True):
            if exc is None:
                continue
            ops = exc.failed or range(len(batch.descs))
            for op_index in ops:
                if 0 <= op_index < len(batch.owners):
                    failed.setdefault(batch.owners[op_index], (target, str(exc)))
        return failed

    def _is_local(self, replica: Replica) -> bool:
        segment = self._segment
        return (self._segment_local and segment is not None
                and replica.engine == segment.engine and replica.segment_id == segment.segment_id
                and replica.epoch == segment.epoch and segment.base <= replica.addr
                and replica.addr + replica.length <= segment.base + segment.length)

    def _ordered(self, replicas: Sequence[Replica]) -> list[Replica]:
        """This process's segment first, then same-node peers, then the rest."""
        return sorted(replicas, key=self._nearness)

    def _nearness(self, replica: Replica) -> tuple[bool, bool]:
        return not self._is_local(replica), replica.node_id != self._node_id

    # ------------------------------------------------------------ put

    def _put(self, what: str, keys: Sequence[Any], items: list[_Item | int], config: Any, *,
             upsert: bool, reasons: dict[int, str]) -> list[int]:
        """Store items (an int is an outcome already decided, `reasons` says why); one
        code per item. An upsert replaces values this client may have read: as for a
        removal, once its own reads of them are over (none starts meanwhile) and its
        cached locations are gone, the master need not wait for them (docs/store.md §4)."""
        if not upsert:
            return self._put_now(what, keys, items, config, upsert=False, reasons=reasons,
                                 reads_done=False)
        names = [item.key for item in items if isinstance(item, _Item)]
        with self._reads.removing(names, self._master_timeout) as idle:
            self._locations.drop(names)
            return self._put_now(what, keys, items, config, upsert=True, reasons=reasons,
                                 reads_done=idle)

    def _put_now(self, what: str, keys: Sequence[Any], items: list[_Item | int], config: Any,
                 *, upsert: bool, reasons: dict[int, str], reads_done: bool) -> list[int]:
        _, master = self._require()
        config = self._config(config)
        codes = [item if isinstance(item, int) else OK for item in items]
        pending = [item for item in items if isinstance(item, _Item)]
        for item in pending:
            if item.size == 0:
                log.warning("%s: %r has an empty value; nothing stored (as Mooncake)",
                            what, item.key)
        pending = [item for item in pending if item.size]
        space = self._space
        if pending and space is not None:
            pending = self._put_reserved(space, what, pending, config, upsert, codes, reasons,
                                         reads_done)
        cut_off: set[int] = set()  # items whose PutStart a leader switch cut off
        for attempt in (0, 1):
            if not pending:
                break
            try:
                started = master.batch_put_start([(i.key, i.size) for i in pending],
                                                 self._master_config(config, attempt > 0),
                                                 upsert=upsert)
            except MasterRpcError as exc:
                for item in pending:
                    codes[item.index], reasons[item.index] = ErrorCode.RPC_FAIL, str(exc)
                if attempt == 0 and self._switching(master, exc):
                    cut_off.update(item.index for item in pending)
                    continue  # once more, through the next leader
                break
            jobs: list[tuple[_Item, PutStartResult]] = []
            no_room: list[_Item] = []
            unsure: list[_Item] = []
            for item, result in zip(pending, started, strict=True):
                if result.code == OK:
                    jobs.append((item, result))
                elif result.code == ErrorCode.OBJECT_ALREADY_EXISTS and not upsert:
                    if item.index in cut_off:  # stored, or our cut-off PutStart's?
                        unsure.append(item)
                        continue
                    log.debug("%s: %r is already stored; kept (upsert replaces)", what, item.key)
                    codes[item.index] = OK
                else:
                    codes[item.index] = result.code
                    reasons[item.index] = f"master: {code_name(result.code)}"
                    # no room, or held at the master until its hold ran out because the
                    # room is on segments awaiting their remount (REPLICA_IS_NOT_READY)
                    if result.code in (ErrorCode.NO_AVAILABLE_HANDLE,
                                       ErrorCode.REPLICA_IS_NOT_READY):
                        no_room.append(item)
            if unsure:
                self._stored_after_all(master, unsure, codes, reasons)
            failed = self._write(jobs)
            self._finish(jobs, failed, codes, reasons, reads_done)
            retry = [item for item, _ in jobs if item.index in failed]
            for target in {failed[i.index][0] for i in retry}:
                self._suspect(target)
            if no_room and attempt == 0:
                # segments may be awaiting their remount (a restarted master): check in
                # (remounting ours if still needed) and try once more -- also when the
                # heartbeat thread remounted it meanwhile and the check-in had nothing to do
                self._check_in()
                retry += no_room
            if attempt == 0 and retry:
                log.info("%s: %d key(s) failed (%s); retrying on other segments", what,
                         len(retry), next(iter(reasons.get(i.index, "") for i in retry)))
            pending = retry
        self._report(what, keys, codes, reasons)
        return [int(c) for c in codes]

    @staticmethod
    def _switching(master: MasterClient, exc: MasterRpcError) -> bool:
        """Whether a put whose Commit or PutStart `exc` cut off is tried once more
        (two-phase): when the call found no master or lost its connection and other
        masters are configured (a leader switch, issue 20). With one master address a
        dead master is not waited for twice. A cut-off Commit is all or nothing: the key
        is then stored with these bytes, or nothing of it is. A cut-off PutStart may have
        left an unfinished put of the key at a master still alive (one that was only
        slow): the retry is then answered OBJECT_ALREADY_EXISTS, which for such a key
        counts as stored only once the master says it is (`_stored_after_all`)."""
        return isinstance(exc, MasterUnavailable) and len(master.endpoints.addresses) > 1

    @staticmethod
    def _stored_after_all(master: MasterClient, items: list[_Item], codes: list[int],
                          reasons: dict[int, str]) -> None:
        """Retried after a cut-off PutStart and answered OBJECT_ALREADY_EXISTS: 0 where
        the key is stored (readable, or awaiting its holder's remount), else the cut-off
        call's RPC_FAIL stands (an unfinished put, ours perhaps, holds the key)."""
        try:
            found = master.batch_exist_key([item.key for item in items])
        except MasterRpcError as exc:
            for item in items:
                reasons[item.index] += f"; then the key's state is unknown: {exc}"
            return
        for item, code in zip(items, found, strict=True):
            if code in (OK, ErrorCode.REPLICA_IS_NOT_READY):
                codes[item.index] = OK
            else:
                reasons[item.index] += ("; retried through the next master: an unfinished "
                                        "put holds the key")

    def _put_reserved(self, space: ReservedSpace, what: str, items: list[_Item],
                      config: ReplicateConfig, upsert: bool, codes: list[int],
                      reasons: dict[int, str], reads_done: bool) -> list[_Item]:
        """Put what fits this client's reservations in one master round trip (write, then
        Commit: docs/store.md §2); returns the items left for the two-phase put."""
        master_config = self._master_config(config, False)
        master = space.master
        placed = space.place(master_config, [item.size for item in items])
        rest = [item for item, placement in zip(items, placed, strict=True) if placement is None]
        jobs = [(item, placement) for item, placement in zip(items, placed, strict=True)
                if placement is not None]
        # checked right before writing: a reservation past its lease is never written
        fresh = [space.fresh(p) for _, p in jobs]
        if not all(fresh):
            space.abandon([p for (_, p), ok in zip(jobs, fresh, strict=True) if not ok])
            rest += [item for (item, _), ok in zip(jobs, fresh, strict=True) if not ok]
            jobs = [job for job, ok in zip(jobs, fresh, strict=True) if ok]
        failed = self._write([(item, PutStartResult(OK, 0, p.replicas)) for item, p in jobs])
        if failed:
            space.abandon([p for item, p in jobs if item.index in failed])
            rest += [item for item, _ in jobs if item.index in failed]
            for target in {where for where, _ in failed.values()}:
                self._suspect(target)
            jobs = [(item, p) for item, p in jobs if item.index not in failed]
        if not jobs:
            return rest
        try:
            results = space.commit([(item.key, item.size, p) for item, p in jobs],
                                   master_config, upsert=upsert, reads_done=reads_done)
        except MasterRpcError as exc:
            for item, _ in jobs:
                codes[item.index], reasons[item.index] = ErrorCode.RPC_FAIL, str(exc)
            if self._switching(master, exc):  # put anew through the next leader
                return rest + [item for item, _ in jobs]
            return rest
        for (item, _), code in zip(jobs, results, strict=True):
            if code in (ErrorCode.OBJECT_NOT_FOUND, ErrorCode.LEASE_EXPIRED):
                rest.append(item)  # the master no longer knows the reservation: put anew
            elif code == ErrorCode.OBJECT_ALREADY_EXISTS and not upsert:
                log.debug("%s: %r is already stored; kept (upsert replaces)", what, item.key)
                codes[item.index] = OK
            else:
                codes[item.index] = code
                if code != OK:
                    reasons[item.index] = f"commit: {code_name(code)}"
        return rest

    def _finish(self, jobs: list[tuple[_Item, PutStartResult]],
                failed: dict[int, tuple[str, str]],
                codes: list[int], reasons: dict[int, str], reads_done: bool) -> None:
        """PutEnd what landed (`reads_done`: as MasterClient.batch_put_end's), PutRevoke
        what did not."""
        master = self._master
        assert master is not None
        done = [(item, result) for item, result in jobs if item.index not in failed]
        undone = [(item, result) for item, result in jobs if item.index in failed]
        for item, _ in undone:
            codes[item.index] = ErrorCode.TRANSFER_FAIL
            reasons[item.index] = "transfer to {}: {}".format(*failed[item.index])
        if done:
            try:
                ends = master.batch_put_end([(i.key, r.put_id) for i, r in done],
                                            reads_done=reads_done)
            except MasterRpcError as exc:
                ends = [int(ErrorCode.RPC_FAIL)] * len(done)
                for item, _ in done:
                    reasons[item.index] = str(exc)
            for (item, _), code in zip(done, ends, strict=True):
                codes[item.index] = code
                if code != OK and item.index not in reasons:
                    reasons[item.index] = f"put end: {code_name(code)}"
        if undone:
            try:
                master.batch_put_revoke([(i.key, r.put_id) for i, r in undone])
            except MasterRpcError as exc:
                log.warning("put revoke failed (%s); the master reclaims the space later", exc)

    def _write(self, jobs: list[tuple[_Item, PutStartResult]],
               ) -> dict[int, tuple[str, str]]:
        """Copy each item's bytes into all its replicas, straight from the caller's
        memory (a registered buffer or the value object itself); item index -> (target,
        why)."""
        copy_moves([(replica.addr + offset, addr, length)
                    for item, result in jobs for replica in result.replicas
                    if self._is_local(replica) for addr, offset, length in item.pieces],
                   stream=True)
        remote = [(item, result) for item, result in jobs
                  if any(not self._is_local(r) for r in result.replicas)]
        return self._write_remote(remote) if remote else {}

    def _write_remote(self, jobs: list[tuple[_Item, PutStartResult]],
                      ) -> dict[int, tuple[str, str]]:
        batches: dict[str, _Batch] = {}
        for item, result in jobs:
            for replica in result.replicas:
                if self._is_local(replica):
                    continue
                batch = batches.setdefault(replica.engine, _Batch())
                batch.replicas[(replica.segment_id, replica.epoch)] = replica
                for addr, offset, length in item.pieces:
                    batch.descs.append(TransferOpDesc(addr, replica.addr + offset, length))
                    batch.owners.append(item.index)
        return self._run(TransferOp.WRITE, batches)

    def _config(self, config: Any) -> ReplicateConfig:
        if config is None:
            return _DEFAULT_CONFIG
        if isinstance(config, ReplicateConfig):
            return config
        try:  # Mooncake's own ReplicateConfig, or anything shaped like it
            return ReplicateConfig(**{name: getattr(config, name) for name in (
                "replica_num", "with_hard_pin", "soft_pin_action", "soft_pin_ttl_ms",
                "preferred_segment", "preferred_segments", "prefer_alloc_in_same_node")
                if hasattr(config, name)})
        except (TypeError, ValueError) as exc:
            raise StoreError(ErrorCode.INVALID_PARAMS, f"config must be a ReplicateConfig, "
                             f"got {type(config).__name__}: {exc}") from None

    def _master_config(self, config: ReplicateConfig, retry: bool) -> ReplicaConfig:
        """With suspects (segments whose transfers just failed), prefer everyone else."""
        if config is _DEFAULT_CONFIG and not self._suspects:  # the usual put: made once
            return _DEFAULT_MASTER_CONFIG
        now = time.monotonic()
        with self._lock:
            for engine, until in list(self._suspects.items()):
                if until < now:
                    del self._suspects[engine]
            avoid = list(self._suspects)
        others: list[str] = []
        if avoid and self._master is not None:
            cached_avoid, cached_at, others = self._others
            if cached_avoid != set(avoid) or now - cached_at > OTHERS_TTL_S:
                try:
                    others = [m.segment.engine for m in self._master.list_segments()
                              if m.live and m.segment.engine not in avoid]
                except MasterRpcError:
                    others = []
                self._others = (set(avoid), now, others)
            others = random.sample(others, len(others))
        try:
            return config.to_master(avoid, others)
        except (TypeError, ValueError) as exc:
            raise StoreError(ErrorCode.INVALID_PARAMS, f"bad ReplicateConfig: {exc}") from None

    def _suspect(self, engine: str) -> None:
        """Steer allocations away from `engine` until the master must have expired it."""
        if engine:
            with self._lock:
                self._suspects[engine] = time.monotonic() + self._client_ttl_s + 1.0

    # ------------------------------------------------------------ get

    def _locate(self, keys: Sequence[Any]) -> list[GetReplicasResult | tuple[int, str]]:
        """Each key's replicas (a read lease), or (negative code, reason)."""
        _, master = self._require()
        out: list[GetReplicasResult | tuple[int, str]] = []
        asking: list[int] = []
        for index, key in enumerate(keys):
            problem = _key_problem(key)
            out.append((int(ErrorCode.INVALID_KEY), problem) if problem else (0, ""))
            if not problem:
                asking.append(index)
        cache = self._locations
        for i in list(asking):
            cached = cache.get(keys[i])
            if cached is not None:
                out[i] = cached
                asking.remove(i)
        for attempt in (0, 1):
            if not asking:
                break
            sent = time.monotonic()
            try:
                found = master.batch_get_replicas([keys[i] for i in asking], cache=True)
            except MasterRpcError as exc:
                for i in asking:
                    out[i] = (int(ErrorCode.RPC_FAIL), str(exc))
                break
            again = []
            for i, result in zip(asking, found, strict=True):
                if result.code == OK and result.replicas:
                    out[i] = result
                    cache.put(keys[i], result, sent)
                elif result.code == OK:
                    out[i] = (int(ErrorCode.REPLICA_IS_NOT_READY), "no readable replica")
                else:
                    out[i] = (result.code, "not found" if result.code == ErrorCode.OBJECT_NOT_FOUND
                              else f"master: {code_name(result.code)}")
                    if result.code == ErrorCode.REPLICA_IS_NOT_READY:
                        again.append(i)
            if attempt == 0 and again:
                # our segment may await its remount (a restarted master): check in, then
                # ask again -- also when the heartbeat thread remounted it meanwhile
                self._check_in()
                asking = again
            else:
                asking = []
        return out

    def _read(self, jobs: list[tuple[int, GetReplicasResult, list[tuple[int, int, int]]]],
              ) -> dict[int, str]:
        """_read_from, and for a job that failed on locations from the cache (its holder
        went away), the master's answer now and one more read; job id -> why it failed."""
        failed = self._read_from(jobs)
        cache = self._locations
        stale = [(job, result, pieces, key) for job, result, pieces in jobs
                 if job in failed and (key := cache.key_of(result)) is not None]
        master = self._master
        if not stale or master is None:
            return failed
        keys = [key for *_, key in stale]
        cache.drop(keys)
        sent = time.monotonic()
        try:
            fresh = master.batch_get_replicas(keys, cache=True)
        except MasterRpcError:
            return failed
        again = []
        for (job, result, pieces, key), now in zip(stale, fresh, strict=True):
            if now.code == OK and now.replicas and now.size == result.size:
                cache.put(key, now, sent)
                again.append((job, now, pieces))
            else:
                failed[job] += f"; the master now says {code_name(now.code)}"
        for job, _, _ in again:
            failed.pop(job)
        failed.update(self._read_from(again) if again else {})
        return failed

    def _read_from(self, jobs: list[tuple[int, GetReplicasResult, list[tuple[int, int, int]]]],
                   ) -> dict[int, str]:
        """Read each job's pieces (local addr, value offset, length) from its replicas,
        nearest first, the next replica after a failure; job id -> why it failed."""
        failed: dict[int, str] = {}
        order = {job: self._ordered(result.replicas) for job, result, _ in jobs}
        todo = list(jobs)
        round_ = 0
        while todo:
            batches: dict[str, _Batch] = {}
            local: list[tuple[int, int, int]] = []
            for job, _, pieces in todo:
                replica = order[job][round_]
                if self._is_local(replica):
                    local.extend((addr, replica.addr + offset, length)
                                 for addr, offset, length in pieces)
                    continue
                batch = batches.setdefault(replica.engine, _Batch())
                batch.replicas[(replica.segment_id, replica.epoch)] = replica
                for addr, offset, length in pieces:
                    batch.descs.append(TransferOpDesc(addr, replica.addr + offset, length))
                    batch.owners.append(job)
            copy_moves(local)
            errors = self._run(TransferOp.READ, batches)
            round_ += 1
            retry = []
            for job in todo:
                if job[0] not in errors:
                    failed.pop(job[0], None)
                    continue
                failed[job[0]] = "read from {}: {}".format(*errors[job[0]])
                if round_ < len(order[job[0]]):
                    retry.append(job)
            todo = retry
        return failed

    def _get_objects(self, what: str, keys: Sequence[Any],
                     make: Callable[[int], tuple[Any, int]], empty: Any) -> list[Any]:
        """Values for Python: `make(size)` returns a new object and the address of its
        memory, and the value is read straight into it from the nearest replica (one
        copy); failures give `empty`, logged once."""
        with self._reads.reading(keys):
            found = self._locate(keys)
            out: list[Any] = [empty] * len(keys)
            codes = [0] * len(keys)
            reasons: dict[int, str] = {}
            made: dict[int, Any] = {}
            jobs = []
            for index, result in enumerate(found):
                if isinstance(result, tuple):
                    codes[index], reasons[index] = result
                    continue
                made[index], addr = make(result.size)
                if result.size:
                    jobs.append((index, result, [(addr, 0, result.size)]))
            failed = self._read(jobs) if jobs else {}
        for index, value in made.items():
            if index in failed:
                codes[index], reasons[index] = ErrorCode.TRANSFER_FAIL, failed[index]
            else:
                out[index] = value
        self._report(what, keys, codes, reasons)
        return out

    def _get_into(self, what: str, keys: Sequence[Any],
                  dests: Sequence[list[tuple[int, int]] | int], reasons: dict[int, str],
                  ) -> list[int]:
        """Read each key into registered parts [(addr, length)] (an int: a decided code);
        per key the value's size or a negative code."""
        asked = [i for i, d in enumerate(dests) if not isinstance(d, int)]
        codes = [d if isinstance(d, int) else 0 for d in dests]
        with self._reads.reading([keys[i] for i in asked]):
            found = self._locate([keys[i] for i in asked]) if asked else []
            jobs = []
            for index, result in zip(asked, found, strict=True):
                if isinstance(result, tuple):
                    codes[index], reasons[index] = result
                    continue
                parts = dests[index]
                assert not isinstance(parts, int)
                room = sum(length for _, length in parts)
                if room < result.size:
                    codes[index] = ErrorCode.BUFFER_OVERFLOW
                    reasons[index] = f"the value has {result.size} bytes; the buffer holds {room}"
                    continue
                pieces, left = [], result.size
                for addr, offset, length in _pieces(parts):
                    if left <= 0:
                        break
                    pieces.append((addr, offset, min(length, left)))
                    left -= length
                jobs.append((index, result, pieces))
                codes[index] = result.size
            failed = self._read(jobs)
        for index, reason in failed.items():
            codes[index], reasons[index] = ErrorCode.TRANSFER_FAIL, reason
        self._report(what, keys, codes, reasons)
        return [int(c) for c in codes]

    # ------------------------------------------------------------ items from arguments

    def _bytes_item(self, index: int, key: Any, value: Any) -> _Item | tuple[int, str]:
        problem = _key_problem(key)
        if problem:
            return int(ErrorCode.INVALID_KEY), problem
        parts: list[tuple[int, int]] = []
        keep: list[Any] = []
        for part in (value if isinstance(value, list | tuple) else [value]):
            if isinstance(part, str):
                return int(ErrorCode.INVALID_PARAMS), "value must be bytes-like, not str"
            try:
                buf = buffer_range(part)
            except ParamInvalid as exc:
                return int(ErrorCode.INVALID_PARAMS), str(exc.args[0])
            parts.append((buf.addr, buf.length))
            keep.append(buf.keepalive)
        pieces = _pieces(parts)
        return _Item(index, key, sum(p[2] for p in pieces), pieces, keep)

    def _registered_item(self, index: int, key: Any, ptrs: Sequence[Any],
                         sizes: Sequence[Any], what: str) -> _Item | tuple[int, str]:
        problem = _key_problem(key)
        if problem:
            return int(ErrorCode.INVALID_KEY), problem
        try:
            parts = self._registered_parts(ptrs, sizes, what)
        except StoreError as exc:
            return exc.code, str(exc.args[0])
        pieces = _pieces(parts)
        return _Item(index, key, sum(p[2] for p in pieces), pieces)

    def _registered_parts(self, ptrs: Sequence[Any], sizes: Sequence[Any],
                          what: str) -> list[tuple[int, int]]:
        if len(ptrs) != len(sizes):
            raise StoreError(ErrorCode.INVALID_PARAMS,
                             f"{what}: {len(ptrs)} buffers but {len(sizes)} sizes")
        return [self._registered(p, s, what) for p, s in zip(ptrs, sizes, strict=True)]

    def _batch_call(self, what: str, keys: Any, build: Callable[[int, Any], Any],
                    run: Callable[[list[Any], dict[int, str]], list[int]]) -> list[int]:
        """`build(index, key)` per key -- a (code, reason) tuple refuses that key before
        anything is sent -- then `run(items, reasons)`; always one code per key."""
        def call() -> list[int]:
            self._require()
            built = [build(index, key) for index, key in enumerate(keys)]
            reasons = {i: b[1] for i, b in enumerate(built) if isinstance(b, tuple)}
            return run([b[0] if isinstance(b, tuple) else b for b in built], reasons)
        return self._guard_list(what, call, len(keys))

    def _guard_list(self, what: str, call: Callable[[], list[int]], count: int) -> list[int]:
        """`call()`, or its failure code for each of `count` keys."""
        result = self._guard(what, call, failure=False)
        return [self.last_error_code] * count if result is False else result

    # ------------------------------------------------------------ put API

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store bytes (any buffer-protocol object): 0 or a negative code. An existing key
        keeps its value and returns 0, as in Mooncake (upsert replaces it)."""
        return self._single(self._put_bytes("put", [key], [value], config, upsert=False))

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Insert or replace: 0 or a negative code."""
        return self._single(self._put_bytes("upsert", [key], [value], config, upsert=True))

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of `parts` as one value."""
        return self._single(self._put_bytes("put_parts", [key], [list(parts)], config,
                                                 upsert=False))

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self._single(self._put_bytes("upsert_parts", [key], [list(parts)], config,
                                                 upsert=True))

    def put_batch(self, keys: list[str], values: list[Any],
                  config: ReplicateConfig | None = None) -> int:
        """Store several values: 0 if all were stored, else the first negative code."""
        return self._first(self._put_bytes("put_batch", keys, values, config, upsert=False))

    def upsert_batch(self, keys: list[str], values: list[Any],
                     config: ReplicateConfig | None = None) -> int:
        return self._first(self._put_bytes("upsert_batch", keys, values, config,
                                                upsert=True))

    def _put_bytes(self, what: str, keys: Any, values: Any, config: Any, *,
                   upsert: bool) -> list[int]:
        """The per-key codes behind put / put_batch / upsert*."""
        if not isinstance(values, list | tuple) or not isinstance(keys, list | tuple) or \
                len(keys) != len(values):
            return [self._fail(what, ErrorCode.INVALID_PARAMS,
                               "keys and values must be lists of the same length")]
        if self._engine is not None and not self._local_buffer_size:
            return [self._fail(what, ErrorCode.INVALID_PARAMS, _NO_LOCAL_BUFFER)] * len(keys)
        return self._batch_call(what, keys, lambda i, k: self._bytes_item(i, k, values[i]),
                                lambda items, reasons: self._put(what, keys, items, config,
                                                                  upsert=upsert, reasons=reasons))

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        """Store `size` bytes of a registered buffer (zero-copy): 0 or a negative code."""
        return self._single(self._put_from("put_from", [key], [[buffer_ptr]], [[size]], config,
                                           upsert=False))

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        return self._single(self._put_from("upsert_from", [key], [[buffer_ptr]], [[size]],
                                           config, upsert=True))

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """put_from per key, one PutStart/PutEnd for all: a code per key."""
        return self._put_from("batch_put_from", keys, *self._one_part(keys, buffer_ptrs, sizes),
                              config, upsert=False)

    def batch_upsert_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        return self._put_from("batch_upsert_from", keys,
                              *self._one_part(keys, buffer_ptrs, sizes), config, upsert=True)

    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int,
                               size: int, metadata_size: int,
                               config: ReplicateConfig | None = None) -> int:
        """One value of `metadata_size` bytes at `metadata_buffer_ptr` followed by `size`
        bytes at `buffer_ptr` (Mooncake's order: metadata first), gathered zero-copy."""
        return self._single(self._put_from(
            "put_from_with_metadata", [key], [[metadata_buffer_ptr, buffer_ptr]],
            [[metadata_size, size]], config, upsert=False))

    def batch_put_from_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """Each value is the concatenation of its buffers (gathered, zero-copy)."""
        return self._put_from("batch_put_from_multi_buffers", keys, all_buffer_ptrs, all_sizes,
                              config, upsert=False)

    @staticmethod
    def _one_part(keys: Any, ptrs: Any, sizes: Any) -> tuple[Any, Any]:
        if not all(isinstance(x, list | tuple) for x in (keys, ptrs, sizes)) or not (
                len(keys) == len(ptrs) == len(sizes)):
            return None, None
        return [[p] for p in ptrs], [[s] for s in sizes]

    def _put_from(self, what: str, keys: Any, all_ptrs: Any, all_sizes: Any, config: Any, *,
                  upsert: bool) -> list[int]:
        if not all(isinstance(x, list | tuple) for x in (keys, all_ptrs, all_sizes)) or not (
                len(keys) == len(all_ptrs) == len(all_sizes)):
            count = len(keys) if isinstance(keys, list | tuple) else 1
            return [self._fail(what, ErrorCode.INVALID_PARAMS, "keys, buffers and sizes must "
                               "be lists of the same length")] * count
        return self._batch_call(
            what, keys,
            lambda i, k: self._registered_item(i, k, all_ptrs[i], all_sizes[i], what),
            lambda items, reasons: self._put(what, keys, items, config,
                                                                  upsert=upsert, reasons=reasons))

    # ------------------------------------------------------------ get API

    def get(self, key: str) -> bytes:
        """The value, or b"" when missing or unreadable (last_error_code says which)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """Values in order; b"" for each key that could not be read."""
        def run() -> list[bytes]:
            self._staging("get_batch" if len(keys) != 1 else "get")
            return self._get_objects("get_batch" if len(keys) != 1 else "get", keys,
                                     new_bytes, b"")
        result = self._guard("get_batch", run, failure=False)
        return [b""] * len(keys) if result is False else result

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value in a BufferHandle (`.ptr()`, `.size()`, buffer protocol), or None."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        def handle(size: int) -> tuple[BufferHandle, int]:
            out = BufferHandle(size)
            return out, out.ptr()

        def run() -> list[BufferHandle | None]:
            self._staging("get_buffer" if len(keys) == 1 else "batch_get_buffer")
            return self._get_objects("get_buffer" if len(keys) == 1 else "batch_get_buffer",
                                     keys, handle, None)
        result = self._guard("batch_get_buffer", run, failure=False)
        return [None] * len(keys) if result is False else result

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read into a registered buffer: bytes read, or a negative code."""
        if type(key) is str and type(buffer_ptr) is int and type(size) is int:
            done = self._read_kept(key, buffer_ptr, size)
            if done:
                return done
        done = self._read_cached((key,), (buffer_ptr,), (size,))
        if done is not None:
            return done[0]
        return self._single(self._dests_call("get_into", [key], [[buffer_ptr]], [[size]]))

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int],
                       sizes: list[int]) -> list[int]:
        """get_into per key, one GetReplicas for all: bytes or a negative code per key."""
        if type(keys) is list and type(buffer_ptrs) is list and type(sizes) is list \
                and len(keys) == len(buffer_ptrs) == len(sizes):
            done = self._read_kept_all(keys, buffer_ptrs, sizes) or \
                self._read_cached(keys, buffer_ptrs, sizes)
            if done is not None:
                return done
        return self._dests_call("batch_get_into", keys, *self._one_part(keys, buffer_ptrs, sizes))

    def _read_kept(self, key: str, ptr: int, size: int) -> int:
        """A repeated get_into of a key this client read from a peer's mapped segment
        before: the cache kept where its bytes are mapped (`_read_cached` keeps it), so
        this is one memmove, the segment's liveness word, and two dict reads (~1.5 µs
        over the copy). Bytes read, or 0 when it does not apply (the entry expired or was
        dropped, the buffer does not fit, the segment went): the caller then takes the
        general path, which decides and reports everything.

        It does not enter the ReadGate; it validates after the copy instead, as a seqlock
        reader does: the source must still be kept for the key (LocationCache.still_kept).
        This client's removal or replacement of the key drops it before asking the master
        to free its space, so a copy followed by that check read live bytes; another
        client's removal is held back by the master past the entry's lifetime."""
        locations = self._locations
        source = locations.source(key)
        if source is None or not 0 < source.length <= size or ptr < 0 \
                or not self._inside_buffer(ptr, source.length):
            return 0
        if source.read_into(ptr) and locations.still_kept(key, source):
            return source.length
        return 0

    def _read_kept_all(self, keys: list[Any], ptrs: list[Any], sizes: list[Any]
                       ) -> list[int] | None:
        """batch_get_into as `_read_kept`, when every key has a kept mapping: the copies
        in one C loop, each segment's and owner's checks once (fabric.read_all), the same
        validation after. None when any key does not qualify (the caller then reads them
        all anew: a buffer this wrote to is written again)."""
        if not keys or not all(type(key) is str for key in keys):
            return None
        locations = self._locations
        sources = locations.sources(keys)
        if sources is None:
            return None
        lengths = [source.length for source in sources]
        for ptr, size, length in zip(ptrs, sizes, lengths, strict=True):
            if type(ptr) is not int or type(size) is not int or not 0 < length <= size \
                    or ptr < 0:
                return None
        if self._inside_buffers(ptrs, lengths) and read_all(sources, ptrs) \
                and locations.all_still_kept(keys, sources):
            return lengths
        return None

    def _read_cached(self, keys: Sequence[Any], ptrs: Sequence[Any], sizes: Sequence[Any],
                     ) -> list[int] | None:
        """get_into of keys whose locations are all in the cache (a repeated read of
        unchanged values: no master call), into registered buffers, each key's nearest
        replica in this process's segment or on one peer this client already reads from:
        one copy per key, without the general path's per-call bookkeeping (a 64 KiB
        read: ~12 µs instead of ~44). None when any key does not qualify or the
        transfer fails: the caller then takes the general path, which decides and
        reports everything (a failed read changes nothing but the caller's buffer)."""
        engine = self._engine
        if engine is None or self._master is None or not keys:
            return None
        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            if type(key) is not str or type(ptr) is not int or type(size) is not int \
                    or size <= 0 or ptr < 0 or _key_problem(key):
                return None
        if not self._inside_buffers(ptrs, sizes):
            return None
        local: list[tuple[int, int, int]] = []
        remote: list[tuple[int, int, int]] = []
        fetched: list[tuple[str, GetReplicasResult]] = []  # the keys `remote` reads, in order
        target = ""
        names = list(keys)
        self._reads.enter(names)
        try:
            found = [self._locations.get(key) for key in names]
            for key, result, ptr, size in zip(names, found, ptrs, sizes, strict=True):
                if result is None or not 0 < result.size <= size:
                    return None
                replicas = result.replicas
                replica = replicas[0] if len(replicas) == 1 else min(replicas,
                                                                     key=self._nearness)
                if self._is_local(replica):
                    local.append((ptr, replica.addr, result.size))
                    continue
                if target and replica.engine != target or (
                        replica.engine, replica.segment_id, replica.epoch) not in self._verified:
                    return None
                target = replica.engine
                remote.append((ptr, replica.addr, result.size))
                fetched.append((key, result))
            if target and not engine.is_connected(target):
                return None
            copy_moves(local)
            if remote:
                try:
                    engine.transfer(target, TransferOp.READ, remote, self._transfer_timeout,
                                    local_registered=False)
                except HixlError:
                    return None
                for (key, result), (_, addr, length) in zip(fetched, remote, strict=True):
                    source = engine.mapped_range(target, addr, length)  # next time: _read_kept
                    if source is None:
                        break
                    self._locations.keep_source(key, result, source)
        finally:
            self._reads.leave(names)
        return [result.size for result in found]  # type: ignore[union-attr]

    def batch_get_into_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Each value scattered over its buffers in order: bytes or a negative code."""
        return self._dests_call("batch_get_into_multi_buffers", keys, all_buffer_ptrs, all_sizes)

    def _dests_call(self, what: str, keys: Any, all_ptrs: Any, all_sizes: Any) -> list[int]:
        if not all(isinstance(x, list | tuple) for x in (keys, all_ptrs, all_sizes)) or not (
                len(keys) == len(all_ptrs) == len(all_sizes)):
            count = len(keys) if isinstance(keys, list | tuple) else 1
            return [self._fail(what, ErrorCode.INVALID_PARAMS, "keys, buffers and sizes must "
                               "be lists of the same length")] * count

        def dest(index: int, key: Any) -> list[tuple[int, int]] | tuple[int, str]:
            problem = _key_problem(key)
            if problem:
                return int(ErrorCode.INVALID_KEY), problem
            try:
                return self._registered_parts(all_ptrs[index], all_sizes[index], what)
            except StoreError as exc:
                return exc.code, str(exc.args[0])
        return self._batch_call(what, keys, dest,
                                lambda dests, reasons: self._get_into(what, keys, dests, reasons))

    def get_into_ranges(self, buffer_ptrs: list[int], all_keys: list[list[str]],
                        all_dst_offsets: list[list[list[int]]],
                        all_src_offsets: list[list[list[int]]],
                        all_sizes: list[list[list[int]]]) -> list[list[list[int]]]:
        """Byte ranges of objects into registered buffers: for buffer i, key j, range k,
        `all_sizes[i][j][k]` bytes from offset `all_src_offsets[i][j][k]` of the value to
        `buffer_ptrs[i] + all_dst_offsets[i][j][k]`. Bytes read or a negative code each."""
        def shape_error() -> list[list[list[int]]]:
            code = self._fail("get_into_ranges", ErrorCode.INVALID_PARAMS,
                              "buffer_ptrs, all_keys and the offset/size lists must nest alike")
            return [[[code]] for _ in (buffer_ptrs if isinstance(buffer_ptrs, list) else [])]

        def ranges_of(i: int, j: int) -> int | None:
            """How many ranges key j of buffer i asks for; None if its lists disagree."""
            try:
                count = len(all_sizes[i][j])
                if len(all_dst_offsets[i][j]) == count == len(all_src_offsets[i][j]):
                    return count
            except (TypeError, IndexError):
                pass
            return None

        def run() -> list[list[list[int]]]:
            self._require()
            try:
                if len(all_keys) != len(buffer_ptrs):
                    return shape_error()
                shape = [[ranges_of(i, j) for j in range(len(all_keys[i]))]
                         for i in range(len(buffer_ptrs))]
            except TypeError:
                return shape_error()
            # a key whose lists disagree gets [INVALID_PARAMS] alone: every key keeps its
            # place in the result, as Mooncake answers
            malformed = [(i, j) for i, per_key in enumerate(shape)
                         for j, count in enumerate(per_key) if count is None]
            for i, j in malformed:
                self._fail("get_into_ranges", ErrorCode.INVALID_PARAMS,
                           f"buffer {i}, key {_show(all_keys[i][j])}: its offset and size "
                           "lists differ in length")
            out = [[[0] * count if count is not None else [int(ErrorCode.INVALID_PARAMS)]
                    for count in per_key] for per_key in shape]
            shape = [[count or 0 for count in per_key] for per_key in shape]
            keys = sorted({k for per_buffer in all_keys for k in per_buffer}, key=str)
            with self._reads.reading(keys):
                found = dict(zip(keys, self._locate(keys), strict=True))
                jobs: list[tuple[int, GetReplicasResult, list[tuple[int, int, int]]]] = []
                where: list[tuple[int, int, int]] = []
                reasons: dict[int, str] = {}
                flat: list[int] = []
                names: list[str] = []
                for i, per_key in enumerate(shape):
                    for j, count in enumerate(per_key):
                        key = all_keys[i][j]
                        for k in range(count):
                            slot = len(flat)
                            names.append(key)
                            where.append((i, j, k))
                            result = found[key]
                            if isinstance(result, tuple):
                                flat.append(result[0])
                                reasons[slot] = result[1]
                                continue
                            try:
                                dst = _int(buffer_ptrs[i], "buffer_ptr") + _int(
                                    all_dst_offsets[i][j][k], "dst offset")
                                src = _int(all_src_offsets[i][j][k], "src offset")
                                size = _int(all_sizes[i][j][k], "size")
                                if src < 0 or size < 0 or src + size > result.size:
                                    raise StoreError(ErrorCode.INVALID_PARAMS, (
                                        f"range [{src}, +{size}) is outside the {result.size}-byte "
                                        "value"))
                                self._registered(dst, size, "get_into_ranges")
                            except StoreError as exc:
                                flat.append(exc.code)
                                reasons[slot] = str(exc.args[0])
                                continue
                            flat.append(size)
                            if size:
                                jobs.append((slot, result, [(dst, src, size)]))
                for slot, reason in self._read(jobs).items():
                    flat[slot], reasons[slot] = ErrorCode.TRANSFER_FAIL, reason
            for slot, (i, j, k) in enumerate(where):
                out[i][j][k] = int(flat[slot])
            self._report("get_into_ranges", names, flat, reasons)
            return out
        result = self._guard("get_into_ranges", run, failure=False)
        return shape_error() if result is False else result

    # ------------------------------------------------------------ queries and removal

    def is_exist(self, key: str) -> int:
        """1 stored, 0 missing, -1 error (the master unreachable: last_error_code -900)."""
        return self._single(self.batch_is_exist([key]))

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        def run() -> list[int]:
            _, master = self._require()
            codes = [int(ErrorCode.INVALID_KEY) if _key_problem(k) else OK for k in keys]
            ask = [i for i, c in enumerate(codes) if c == OK]
            for i, code in zip(ask, master.batch_exist_key([keys[i] for i in ask]) if ask
                               else [], strict=True):
                codes[i] = code
            out = []
            for key, code in zip(keys, codes, strict=True):
                if code in (OK, ErrorCode.REPLICA_IS_NOT_READY):
                    out.append(1)
                elif code == ErrorCode.OBJECT_NOT_FOUND:
                    out.append(0)
                else:
                    self._fail("is_exist", code, f"{key!r}: master: {code_name(code)}")
                    out.append(-1)
            return out
        result = self._guard("is_exist" if len(keys) == 1 else "batch_is_exist", run,
                             failure=False)
        return [-1] * len(keys) if result is False else result

    def get_size(self, key: str) -> int:
        """The value's size, or a negative code (OBJECT_NOT_FOUND, RPC_FAIL, ...)."""
        def run() -> int:
            _, master = self._require()
            problem = _key_problem(key)
            if problem:
                raise StoreError(ErrorCode.INVALID_KEY, problem)
            size = master.get_size(key)
            if size < 0:
                raise StoreError(size, f"{key!r}: "
                                 + ("not found" if size == ErrorCode.OBJECT_NOT_FOUND
                                    else f"master: {code_name(size)}"))
            return size
        return self._guard("get_size", run)

    def remove(self, key: str, force: bool = False) -> int:
        """0, or a negative code (OBJECT_HAS_LEASE while read-leased, unless force)."""
        return self._single(self._remove("remove", [key], force))

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        return self._remove("batch_remove", keys, force)

    def _remove(self, what: str, keys: Any, force: bool) -> list[int]:
        def run() -> list[int]:
            _, master = self._require()
            if not isinstance(keys, list | tuple):
                raise StoreError(ErrorCode.INVALID_PARAMS, "keys must be a list")
            codes = [int(ErrorCode.INVALID_KEY) if _key_problem(k) else OK for k in keys]
            ask = [i for i, c in enumerate(codes) if c == OK]
            if ask:
                names = [keys[i] for i in ask]
                # once our own reads of them are over (and none starts meanwhile) and our
                # cached locations are gone, the master need not wait for us: the space
                # is free again at once unless another client reads it (docs/store.md §4)
                with self._reads.removing(names, self._master_timeout) as idle:
                    self._locations.drop(names)
                    found = master.batch_remove(names, bool(force), reads_done=idle)
                for i, code in zip(ask, found, strict=True):
                    codes[i] = code
            self._report(what, keys, codes, {i: _REMOVE_REASONS.get(c, f"master: {code_name(c)}")
                                             for i, c in enumerate(codes)})
            return codes
        return self._guard_list(what, run, len(keys) if isinstance(keys, list | tuple) else 1)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """How many keys `regex_pattern` matched and were removed, or a negative code."""
        def run() -> int:
            _, master = self._require()
            result = master.remove_by_regex(regex_pattern, bool(force))
            if result.code != OK:
                raise StoreError(result.code, result.message or code_name(result.code))
            return result.count
        return self._guard("remove_by_regex", run)

    def remove_all(self, force: bool = False) -> int:
        """How many keys were removed (leased ones stay unless force), or a negative code."""
        def run() -> int:
            _, master = self._require()
            result = master.remove_all(bool(force))
            if result.code != OK:
                raise StoreError(result.code, result.message or code_name(result.code))
            return result.count
        return self._guard("remove_all", run)

    # ------------------------------------------------------------ tensor API
    # Mooncake's torch helpers on CPU tensors, in its byte layout (client/mooncake/tensors.py)
    # over the byte API above: a put sends the metadata and the tensor's own bytes as two
    # parts (no staging copy), a get decodes into a new tensor, a get_*_into returns a
    # tensor sharing the caller's buffer. A refused tensor is INVALID_PARAMS for its key.

    def put_tensor(self, key: str, tensor: Any) -> int:
        return self._single(self._put_tensors("put_tensor", [key], [tensor], None, upsert=False))

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._single(self._put_tensors("upsert_tensor", [key], [tensor], None, upsert=True))

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        return self._single(self._put_tensors("pub_tensor", [key], [tensor], config, upsert=False))

    def upsert_pub_tensor(self, key: str, tensor: Any,
                          config: ReplicateConfig | None = None) -> int:
        return self._single(self._put_tensors("upsert_pub_tensor", [key], [tensor], config,
                                              upsert=True))

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self._put_tensors("batch_put_tensor", keys, tensors_list, None, upsert=False)

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self._put_tensors("batch_upsert_tensor", keys, tensors_list, None, upsert=True)

    def batch_pub_tensor(self, keys: list[str], tensors_list: list[Any],
                         config: ReplicateConfig | None = None) -> list[int]:
        return self._put_tensors("batch_pub_tensor", keys, tensors_list, config, upsert=False)

    def batch_upsert_pub_tensor(self, keys: list[str], tensors_list: list[Any],
                                config: ReplicateConfig | None = None) -> list[int]:
        return self._put_tensors("batch_upsert_pub_tensor", keys, tensors_list, config,
                                 upsert=True)

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        """Every one of `tp_size` equal shards along `split_dim`, each under
        `{key}_tp_{rank}` (as Mooncake: all ranks, whatever `tp_rank` is)."""
        return self._first(self._put_tensor_shards("put_tensor_with_tp", [key], [tensor],
                                                   tp_size, split_dim, None)[0])

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: ReplicateConfig | None = None,
                           tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        return self._first(self._put_tensor_shards("pub_tensor_with_tp", [key], [tensor],
                                                   tp_size, split_dim, config)[0])

    def batch_put_tensor_with_tp(self, base_keys: list[str], tensors_list: list[Any],
                                 tp_rank: int = 0, tp_size: int = 1,
                                 split_dim: int = 0) -> list[int]:
        return [self._first(codes) for codes in self._put_tensor_shards(
            "batch_put_tensor_with_tp", base_keys, tensors_list, tp_size, split_dim, None)]

    def batch_pub_tensor_with_tp(self, base_keys: list[str], tensors_list: list[Any],
                                 config: ReplicateConfig | None = None, tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list[int]:
        return [self._first(codes) for codes in self._put_tensor_shards(
            "batch_pub_tensor_with_tp", base_keys, tensors_list, tp_size, split_dim, config)]

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """A value already in the layout ([metadata][data]) in a registered buffer."""
        return self._single(self._put_tensors_from("put_tensor_from", [key], [buffer_ptr],
                                                   [size], upsert=False))

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._single(self._put_tensors_from("upsert_tensor_from", [key], [buffer_ptr],
                                                   [size], upsert=True))

    def batch_put_tensor_from(self, keys: list[str], buffer_ptrs: list[int],
                              sizes: list[int]) -> list[int]:
        return self._put_tensors_from("batch_put_tensor_from", keys, buffer_ptrs, sizes,
                                      upsert=False)

    def batch_upsert_tensor_from(self, keys: list[str], buffer_ptrs: list[int],
                                 sizes: list[int]) -> list[int]:
        return self._put_tensors_from("batch_upsert_tensor_from", keys, buffer_ptrs, sizes,
                                      upsert=True)

    def get_tensor(self, key: str) -> Any:
        """A new tensor, or None (missing key, or a value that is not a tensor: logged)."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        values = self.get_batch(keys) if isinstance(keys, list | tuple) else None
        if values is None or len(values) != len(keys):
            return [None] * (len(keys) if isinstance(keys, list | tuple) else 1)
        return [self._decoded("get_tensor", key, value) for key, value in zip(keys, values, strict=True)]

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> Any:
        """This rank's shard (`{key}_tp_{tp_rank}`), or None."""
        return self.batch_get_tensor_with_tp([key], tp_rank, tp_size)[0]

    def batch_get_tensor_with_tp(self, base_keys: list[str], tp_rank: int = 0,
                                 tp_size: int = 1) -> list[Any]:
        if not isinstance(tp_size, int) or not 0 <= tp_rank < tp_size:
            self._fail("get_tensor_with_tp", ErrorCode.INVALID_PARAMS,
                       f"tp_rank {tp_rank!r} must be in [0, tp_size={tp_size!r})")
            return [None] * len(base_keys)
        return self.batch_get_tensor([tensors.tp_key(k, tp_rank) if tp_size > 1 else k
                                      for k in base_keys])

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """A tensor sharing the registered buffer the value was read into, or None."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: list[str], buffer_ptrs: list[int],
                              sizes: list[int]) -> list[Any]:
        codes = self.batch_get_into(keys, buffer_ptrs, sizes)
        out: list[Any] = []
        for key, ptr, code in zip(keys, buffer_ptrs, codes, strict=False):
            if code < 0:
                out.append(None)
                continue
            try:
                out.append(tensors.view(ptr, code))
            except tensors.TensorFormatError as exc:
                self._fail("get_tensor_into", ErrorCode.INVALID_PARAMS, f"{_show(key)}: {exc}")
                out.append(None)
        return out + [None] * (len(keys) - len(out))

    def _decoded(self, what: str, key: Any, value: Any) -> Any:
        if not value:  # missing (the byte API logged why) or empty: no tensor
            return None
        try:
            return tensors.decode(value)
        except tensors.TensorFormatError as exc:
            self._fail(what, ErrorCode.INVALID_PARAMS, f"{_show(key)}: {exc}")
            return None

    def _put_tensors(self, what: str, keys: Any, tensors_list: Any, config: Any, *,
                     upsert: bool) -> list[int]:
        """Encode each tensor (a refused one is INVALID_PARAMS for its key alone) and put
        the rest through the byte API, as [metadata, data] parts."""
        if not isinstance(tensors_list, list | tuple) or not isinstance(keys, list | tuple) \
                or len(keys) != len(tensors_list):
            return [self._fail(what, ErrorCode.INVALID_PARAMS,
                               "keys and tensors must be lists of the same length")]
        codes: list[int] = [OK] * len(keys)
        good: list[int] = []
        parts: list[list[Any]] = []
        for index, tensor in enumerate(tensors_list):
            try:
                parts.append(list(tensors.encode(tensor)))
                good.append(index)
            except tensors.TensorFormatError as exc:
                codes[index] = self._fail(what, ErrorCode.INVALID_PARAMS,
                                          f"{_show(keys[index])}: {exc}")
        if good:
            stored = self._put_bytes(what, [keys[i] for i in good], parts, config, upsert=upsert)
            for index, code in zip(good, stored, strict=True):
                codes[index] = code
        return codes

    def _put_tensor_shards(self, what: str, base_keys: Any, tensors_list: Any, tp_size: Any,
                           split_dim: Any, config: Any) -> list[list[int]]:
        """Per base key, the codes of its tp_size shard puts (one batch for all)."""
        if not isinstance(base_keys, list | tuple) or not isinstance(tensors_list, list | tuple) \
                or len(base_keys) != len(tensors_list) or not isinstance(tp_size, int) \
                or isinstance(tp_size, bool) or tp_size < 1:
            code = self._fail(what, ErrorCode.INVALID_PARAMS, "base_keys and tensors must be "
                              f"lists of the same length and tp_size >= 1 (got {tp_size!r})")
            return [[code]] * max(1, len(base_keys) if isinstance(base_keys, list | tuple) else 1)
        keys: list[str] = []
        shards: list[Any] = []
        refused: dict[int, int] = {}
        for index, (base, tensor) in enumerate(zip(base_keys, tensors_list, strict=True)):
            try:
                pieces = tensors.split(tensor, tp_size, split_dim) if tp_size > 1 else [tensor]
            except (tensors.TensorFormatError, AttributeError, TypeError) as exc:
                refused[index] = self._fail(what, ErrorCode.INVALID_PARAMS, f"{_show(base)}: {exc}")
                continue
            keys += [tensors.tp_key(base, rank) if tp_size > 1 else base
                     for rank in range(len(pieces))]
            shards += pieces
        codes = iter(self._put_tensors(what, keys, shards, config, upsert=False))
        return [[refused[i]] if i in refused else [next(codes) for _ in range(tp_size)]
                for i in range(len(base_keys))]

    def _put_tensors_from(self, what: str, keys: Any, buffer_ptrs: Any, sizes: Any, *,
                          upsert: bool) -> list[int]:
        """put_from for buffers whose bytes are checked to be one tensor in the layout."""
        if not all(isinstance(x, list | tuple) for x in (keys, buffer_ptrs, sizes)) or \
                not len(keys) == len(buffer_ptrs) == len(sizes):
            return [self._fail(what, ErrorCode.INVALID_PARAMS,
                               "keys, buffer_ptrs and sizes must be lists of the same length")]
        codes: list[int] = [OK] * len(keys)
        good: list[int] = []
        for index, (key, ptr, size) in enumerate(zip(keys, buffer_ptrs, sizes, strict=True)):
            try:
                self._registered(ptr, size, what)
                header = ctypes.string_at(ptr, min(int(size), tensors.METADATA_SIZE))
                tensors.parse(header, int(size))
                good.append(index)
            except (StoreError, tensors.TensorFormatError) as exc:
                code = exc.code if isinstance(exc, StoreError) else ErrorCode.INVALID_PARAMS
                codes[index] = self._fail(what, code, f"{_show(key)}: {exc}")
        if good:
            stored = self._put_from(what, [keys[i] for i in good],
                                    *self._one_part([keys[i] for i in good],
                                                    [buffer_ptrs[i] for i in good],
                                                    [sizes[i] for i in good]),
                                    None, upsert=upsert)
            for index, code in zip(good, stored, strict=True):
                codes[index] = code
        return codes

    # ------------------------------------------------------------ small helpers

    @staticmethod
    def _single(codes: list[int]) -> int:
        return int(codes[0])

    @staticmethod
    def _first(codes: list[int]) -> int:
        return next((int(c) for c in codes if c < 0), OK)


def bind_to_numa_node(node: int) -> None:
    """Run this process on the CPUs of NUMA node `node` (Mooncake's module function).

    CPUs only: memory placement follows first touch on those CPUs (Mooncake also sets a
    preferred memory node through libnuma, which hixl does not depend on). A node this
    machine does not have raises ValueError naming the ones it has.
    """
    if type(node) is not int:
        raise TypeError(f"node must be an int, got {type(node).__name__}")
    nodes = "/sys/devices/system/node"
    try:
        with open(f"{nodes}/node{node}/cpulist", encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        have = sorted(n[4:] for n in os.listdir(nodes) if n[4:].isdigit()) \
            if os.path.isdir(nodes) else ["0"]
        raise ValueError(f"NUMA node {node} does not exist here (nodes: "
                         f"{', '.join(have)})") from None
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    os.sched_setaffinity(0, cpus)


def _serialize_tensor(tensor: Any) -> tuple[bytes, int, int, Any]:
    """Mooncake's helper: (metadata, data address, data bytes, the contiguous tensor)."""
    metadata, data = tensors.encode(tensor)
    flat = tensor.detach().contiguous()
    return metadata, (flat.data_ptr() if len(data) else 0), len(data), flat


def _deserialize_tensor(value: bytes) -> Any:
    """Mooncake's helper: the tensor in a [metadata][data] value."""
    return tensors.decode(value)


def _tensor_metadata_size() -> int:
    return tensors.METADATA_SIZE


def _engine_in_port_range(host: str, options: dict[str, str], registry: str) -> Engine:
    """An Engine with its agent on a free port in 12300-14300, as Mooncake's store picks."""
    low, high = STORE_PORTS
    tried: list[str] = []
    for port in random.sample(range(low, high + 1), PORT_ATTEMPTS):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                tried.append(f"{port} busy")
                continue
        try:
            return Engine(_engine_name(host, port), options, registry=registry or None)
        except HixlError as exc:  # lost a race for the port, most likely
            tried.append(f"{port}: {exc}")
    raise StoreError(ErrorCode.INTERNAL_ERROR, f"no free port for {host} in [{low}, {high}]; "
                     f"tried {'; '.join(tried)}")


__all__ = ["BufferHandle", "MooncakeConfig", "MooncakeDistributedStore", "ObjectDataType",
           "ReplicateConfig", "SoftPinAction", "StoreError", "bind_to_numa_node", "mooncake_size"]
