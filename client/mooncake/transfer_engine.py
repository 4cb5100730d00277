"""`TransferEngine`: Mooncake Transfer Engine's Python API on top of hixl's `Engine`.

Code written for `mooncake.engine.TransferEngine` runs by changing the import to
`hixl.client.mooncake`: same method names, argument order, defaults and return
conventions (0 or a negative Mooncake error code; transfers return -1 on any failure;
methods returning an address or a batch id return 0 for failure; no exceptions).
Mooncake's bare -1 is a known pain point, so every failure is also logged once (logger
"hixl.mooncake") with hixl's typed error text, and kept: `get_last_error()` returns the
text, `last_error_code` the int.

How Mooncake's model maps onto hixl:

- a segment ("ip:port", metadata "P2PHANDSHAKE") is an hixl `Engine("ip:port")` with an
  embedded agent listening on that port; a hostname without a port picks a free port in
  [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT] (15000-17000). `hixl://host:port` as the metadata
  server uses an hixl registry (hixl-master or any agent) instead of peer handshakes.
- with a Mooncake metadata server (`http://host:port/metadata`, `etcd://host:port`; see
  metadata.py) a segment keeps the name it was given ("10.0.0.5" or "10.0.0.5:17001"):
  the engine publishes Mooncake's rpc_meta and ram records under it, and peers resolve a
  name to the engine's "ip:port" there before connecting (a name another live engine
  holds is refused; a dead one's record is taken over).
- protocol "tcp" and "rdma" both move bytes over hixl's own paths: mapped shared memory
  for shareable segments on the same node, a unix socket or TCP otherwise.
- targets are connected lazily on first use (Mooncake's openSegment) and cached; a
  failure other than bad input drops the cached connection, and a call that finds its
  cached connection dead or stale reconnects once within its deadline.
- managed buffers come from shm chunks (`Engine.malloc`) registered whole, so same-node
  peers reach them on the fabric path.
- notifications (`notify=`) ride the control plane: the initiator asks the target's agent
  for a one-page segment whose name carries the message; the target's `get_notifies()`
  collects and frees them in arrival order. Each undelivered notify holds a page and an fd
  of the target's pool, so targets should drain them.

Differences from Mooncake, all deliberate: local memory must be registered before it is
transferred (Mooncake's TCP transport does not check); `write_bytes_to_buffer` and
`read_bytes_from_buffer` refuse ranges outside memory this engine registered or
allocated (Mooncake memcpys to any address); unknown protocols are refused (Mooncake
accepts any string); bad input found when an async batch is submitted returns batch id 0
(Mooncake finds a bad remote address later and fails the batch); a batch id is freed once its final status has been reported, and
asking again returns -1 (Mooncake's returns 0, "in progress", forever).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import itertools
import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hixl.client.engine import Engine, MemHandle, TransferRequest, parse_engine_name
from hixl.client.mooncake.metadata import (
    P2P_HANDSHAKE,
    RAM,
    RPC_META,
    Directory,
    address_of,
    answers,
    parse_metadata_server,
    ram_segment,
    rpc_meta,
)
from hixl.errors import (
    ConfigError,
    HixlError,
    NotConnected,
    ParamInvalid,
    PeerUnavailable,
    ResourceExhausted,
    StaleEpoch,
    TransferTimeout,
)
from hixl.memory import PAGE_SIZE, ShmSegment, round_up
from hixl.options import OPTION_ENABLE_USE_FABRIC_MEM
from hixl.table import AddressTable, check_range
from hixl.types import Perm, TransferOp, TransferOpDesc, TransferStatus

log = logging.getLogger("hixl.mooncake")

T = TypeVar("T")

# Mooncake's error codes (mooncake-transfer-engine/include/error.h) that this adapter returns
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_SOCKET = -102
# transfer_check_status results
STATUS_DONE, STATUS_IN_PROGRESS, STATUS_FAILED, STATUS_TIMEOUT = 1, 0, -1, -2

PROTOCOLS = ("tcp", "rdma")
MIN_RPC_PORT_ENV, MAX_RPC_PORT_ENV = "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"
DEFAULT_RPC_PORTS = (15000, 17000)
PORT_ATTEMPTS = 16
TRANSFER_TIMEOUT_ENV, DEFAULT_TRANSFER_TIMEOUT_S = "MC_TRANSFER_TIMEOUT", 30.0
HANDSHAKE_TIMEOUT_ENV, DEFAULT_HANDSHAKE_TIMEOUT_S = "MC_HANDSHAKE_CONNECT_TIMEOUT", 5.0
MANAGED_POOL_ENV, DEFAULT_MANAGED_POOL_BYTES = "HIXL_MC_MANAGED_POOL_BYTES", 64 << 20
MANAGED_MAX_ENV = "HIXL_MC_MANAGED_MAX_BYTES"
MANAGED_ALIGN = 64
BUFFER_NAME, MANAGED_NAME = "mooncake:buffer", "mooncake:managed"
NOTIFY_PREFIX = "mooncake:notify:"
MAX_NOTIFY_BYTES = 64 << 10


class TransferOpcode(enum.IntEnum):
    """Mooncake's enum: `Read` / `Write` as pybind spells them, READ / WRITE as aliases."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


@dataclass
class TransferNotify:
    """A notification sent with a transfer and returned by the target's get_notifies()."""

    name: str = ""
    msg: str = ""


class MooncakeError(HixlError):
    """A refusal that maps to a specific Mooncake error code (not raised to callers)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Batch:
    target: str   # the segment name
    address: str  # the engine serving it
    request: TransferRequest | None  # None: nothing to move (every length was 0)


@dataclass
class _Chunk:
    """One shm chunk of the managed pool: free ranges (addr, size), address-ordered."""

    segment: ShmSegment
    handle: MemHandle
    free: list[list[int]] = field(default_factory=list)


class _ManagedPool:
    """First-fit allocator over shm chunks from `Engine.malloc`, each registered whole so
    same-node peers map it (fabric path). Chunks live until the engine closes."""

    def __init__(self, chunk_bytes: int, max_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.max_bytes = max_bytes
        self.total = 0
        self.chunks: list[_Chunk] = []
        self.allocated: dict[int, tuple[_Chunk, int]] = {}  # addr -> (chunk, rounded size)

    def allocate(self, engine: Engine, regions: AddressTable[Any], length: int) -> int:
        size = round_up(length, MANAGED_ALIGN)
        for chunk in self.chunks:
            addr = self._take(chunk, size)
            if addr:
                return addr
        chunk = self._grow(engine, regions, size)
        return self._take(chunk, size)

    def _take(self, chunk: _Chunk, size: int) -> int:
        for index, (addr, room) in enumerate(chunk.free):
            if room >= size:
                if room == size:
                    del chunk.free[index]
                else:
                    chunk.free[index] = [addr + size, room - size]
                self.allocated[addr] = (chunk, size)
                return addr
        return 0

    def _grow(self, engine: Engine, regions: AddressTable[Any], size: int) -> _Chunk:
        length = max(self.chunk_bytes, round_up(size, PAGE_SIZE))
        if self.total + length > self.max_bytes:
            raise ResourceExhausted(
                f"managed buffers: {size} more bytes need a new {length}-byte chunk, but "
                f"{self.total} of {self.max_bytes} ({MANAGED_MAX_ENV}) are in use")
        segment = engine.malloc(length)
        try:
            handle = engine.register(segment, name=MANAGED_NAME)
        except BaseException:
            engine.free(segment)
            raise
        chunk = _Chunk(segment, handle, [[segment.addr, segment.length]])
        regions.insert(segment.addr, segment.length, chunk)
        self.chunks.append(chunk)
        self.total += segment.length
        return chunk

    def free(self, addr: int, length: int) -> None:
        hit = self.allocated.get(addr)
        if hit is None:
            raise ParamInvalid(f"{addr:#x} is not a managed buffer (already freed?)")
        chunk, size = hit
        if round_up(length, MANAGED_ALIGN) != size:
            raise ParamInvalid(f"managed buffer {addr:#x} has {size} bytes (rounded); "
                               f"free_managed_buffer was given length {length}")
        del self.allocated[addr]
        free = chunk.free
        index = next((i for i, (start, _) in enumerate(free) if start > addr), len(free))
        free.insert(index, [addr, size])
        if index + 1 < len(free) and addr + size == free[index + 1][0]:  # merge with next
            free[index][1] += free.pop(index + 1)[1]
        if index > 0 and free[index - 1][0] + free[index - 1][1] == addr:  # and previous
            free[index - 1][1] += free.pop(index)[1]


class TransferEngine:
    """Mooncake-shaped transfer engine. Call initialize() first; close() (an hixl extra)
    stops its agent, as does process exit."""

    TransferOpcode = TransferOpcode

    def __init__(self, *, managed_pool_bytes: int | None = None,
                 managed_max_bytes: int | None = None, fabric: bool = True) -> None:
        """`managed_pool_bytes`: size of each managed-buffer chunk (default
        $HIXL_MC_MANAGED_POOL_BYTES or 64 MiB); `managed_max_bytes`: cap on all chunks
        (default $HIXL_MC_MANAGED_MAX_BYTES or half the RAM); `fabric`: let same-node
        peers map shareable memory (EnableUseFabricMem)."""
        self._engine: Engine | None = None
        self._lock = threading.RLock()
        self._notify_lock = threading.Lock()
        self._regions: AddressTable[Any] = AddressTable()  # MemHandle or managed _Chunk
        self._managed: _ManagedPool | None = None
        self._managed_pool_bytes = managed_pool_bytes
        self._managed_max_bytes = managed_max_bytes
        self._fabric = fabric
        self._batches: dict[int, _Batch] = {}
        self._batch_ids = itertools.count(1)
        self._rpc_port = -1
        #: with a Mooncake metadata server: where segments are published, this engine's
        #: segment name there, and names already resolved to "ip:port"
        self._directory: Directory | None = None
        self._segment_name = ""
        self._claimed = False  # this engine's records are on the metadata server
        self._resolved: dict[str, str] = {}
        self._transfer_timeout = DEFAULT_TRANSFER_TIMEOUT_S
        self._handshake_timeout = DEFAULT_HANDSHAKE_TIMEOUT_S
        #: why the last call failed (hixl's typed error text), and the int it returned
        self.last_error = ""
        self.last_error_code = 0

    # ------------------------------------------------------------ errors become ints here

    def _guard(self, what: str, fn: Callable[[], T], code: int = ERR_INVALID_ARGUMENT,
               failure: Any = None) -> T:
        """fn(), or -- on any error -- `failure` (default: the error code), logged once."""
        try:
            return fn()
        except MooncakeError as exc:
            code, reason = exc.code, str(exc.args[0])
        except HixlError as exc:
            reason = str(exc)
        except Exception as exc:  # a bug must still come back as a code, not a crash
            log.exception("hixl.mooncake %s: internal error", what)
            reason = f"internal error: {exc!r}"
        result = code if failure is None else failure
        self.last_error, self.last_error_code = f"{what}: {reason}", code
        log.warning("%s returned %r: %s", what, result, reason)
        return result

    def get_last_error(self) -> str:
        """The reason behind the last failed call ("" if none failed yet)."""
        return self.last_error

    def _require(self) -> Engine:
        if self._engine is None:
            raise NotConnected("TransferEngine is not initialized; call initialize() first")
        return self._engine

    # ------------------------------------------------------------ initialization

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        """Start this engine's segment: "ip" (free port in the RPC range) or "ip:port"."""
        return self._guard("initialize", lambda: self._initialize(
            local_hostname, metadata_server, protocol, device_name))

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        """As initialize(); `metadata_type` is implied by `metadata_server` here."""
        log.debug("initialize_ext: metadata_type %r ignored", metadata_type)
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    def _initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                    device_name: str) -> int:
        if self._engine is not None:
            raise ParamInvalid(f"already initialized as {self._engine.name}")
        if not isinstance(protocol, str) or protocol.lower() not in PROTOCOLS:
            raise ParamInvalid(f"protocol {protocol!r} is not supported: use one of {PROTOCOLS}")
        if protocol.lower() == "rdma":
            log.info("protocol 'rdma': hixl moves bytes over its own paths (mapped shared "
                     "memory on the same node, TCP across nodes); device %r is not used",
                     device_name)
        server = parse_metadata_server(metadata_server)
        registry = server.registry
        self._transfer_timeout = _env_number(TRANSFER_TIMEOUT_ENV, DEFAULT_TRANSFER_TIMEOUT_S)
        self._handshake_timeout = _env_number(HANDSHAKE_TIMEOUT_ENV, DEFAULT_HANDSHAKE_TIMEOUT_S)
        host, port = parse_engine_name(local_hostname)
        options = {OPTION_ENABLE_USE_FABRIC_MEM: "1" if self._fabric else "0"}
        if port:
            engine = Engine(_engine_name(host, port), options, registry=registry)
        else:
            engine, port = _start_in_rpc_range(host, options, registry)
        self._engine, self._rpc_port = engine, port
        self._segment_name = engine.name
        if server.is_directory:
            try:
                self._directory = server.open(self._handshake_timeout)
                self._segment_name = local_hostname
                self._claim(host, port)
            except BaseException:
                self.close()
                raise
        log.info("Mooncake TE adapter serving segment %s at %s (metadata %s)",
                 self._segment_name, engine.name, f"registry {registry}" if registry
                 else self._directory.describe() if self._directory else P2P_HANDSHAKE)
        return 0

    # ------------------------------------------------------------ metadata server

    def _claim(self, host: str, port: int) -> None:
        """Publish this segment's name on the metadata server: refused while another
        engine that still answers holds it; a dead engine's record is replaced."""
        directory, name = self._directory, self._segment_name
        assert directory is not None and self._engine is not None
        key = RPC_META + name
        held = directory.get(key)
        if held is not None:
            address = address_of(held, name, directory.describe())
            if address != self._engine.name and answers(address, self._handshake_timeout):
                raise ParamInvalid(
                    f"segment name {name!r} is taken on {directory.describe()} by the "
                    f"engine at {address}, which still answers: give this engine another "
                    "local_hostname")
            log.info("segment %s: taking over the record of %s (not answering)", name,
                     address)
            directory.delete(key)
        if not directory.create(key, rpc_meta(host, port)):
            raise ParamInvalid(f"segment name {name!r} was just taken on "
                               f"{directory.describe()} by another engine starting under it: "
                               "give this engine another local_hostname")
        self._claimed = True
        self._publish_buffers()

    def _publish_buffers(self) -> None:
        """Mooncake's ram record of this segment: every registered or managed range. For
        Mooncake's tools only (hixl peers find buffers in the handshake), so a failure to
        write it is logged, and the registration stands."""
        directory = self._directory
        if directory is None:
            return
        with self._lock:
            buffers = [(base, length) for base, length, _ in self._regions]
        try:
            directory.put(RAM + self._segment_name,
                          ram_segment(self._segment_name, self._rpc_port, buffers))
        except HixlError as exc:
            log.warning("segment %s: could not update its ram record on %s: %s",
                        self._segment_name, directory.describe(), exc)

    def _address(self, target: str) -> str:
        """The hixl engine ("ip:port") serving segment `target`: itself without a
        metadata server, else as its rpc_meta record says (cached until it fails)."""
        directory = self._directory
        if directory is None or not isinstance(target, str):
            return target
        if target == self._segment_name and self._engine is not None:
            return self._engine.name
        address = self._resolved.get(target)
        if address is None:
            record = directory.get(RPC_META + target)
            if record is None:
                raise PeerUnavailable(f"segment {target!r} is not published on "
                                      f"{directory.describe()} (is its engine up, with the "
                                      "same metadata server?)")
            address = self._resolved[target] = address_of(record, target,
                                                          directory.describe())
        return address

    def close(self) -> None:
        """Stop the engine: withdraw its metadata records, disconnect, deregister, stop
        its agent (idempotent)."""
        with self._lock:
            engine, self._engine = self._engine, None
            directory, self._directory = self._directory, None
            claimed, self._claimed = self._claimed, False
            self._batches.clear()
            self._regions = AddressTable()
            self._managed = None
            self._resolved.clear()
        if directory is not None and claimed:  # never another engine's records
            for key in (RAM + self._segment_name, RPC_META + self._segment_name):
                try:
                    directory.delete(key)
                except HixlError as exc:
                    log.warning("close: could not withdraw %s from %s: %s", key,
                                directory.describe(), exc)
        if directory is not None:
            directory.close()
        if engine is not None:
            engine.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_rpc_port(self) -> int:
        """The port of this engine's segment name (-1 before initialize)."""
        return self._rpc_port

    def get_engine(self) -> Engine | None:
        """The hixl Engine underneath (None before initialize)."""
        return self._engine

    # ------------------------------------------------------------ memory

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Serve [buffer_addr, +capacity) to peers; overlapping a registration is -7."""
        return self._guard("register_memory", lambda: self._register(buffer_addr, capacity))

    def _register(self, addr: Any, length: Any, publish: bool = True) -> int:
        engine = self._require()
        addr, length = _as_int(addr, "buffer_addr"), _as_int(length, "capacity")
        check_range(addr, length, "register_memory")
        with self._lock:
            try:
                self._regions.insert(addr, length, None)
            except ParamInvalid as exc:  # the range itself was checked: this is an overlap
                raise MooncakeError(ERR_ADDRESS_OVERLAPPED, str(exc.args[0])) from None
            try:
                handle = engine.register(addr, length, name=BUFFER_NAME)
            except BaseException:
                self._regions.remove(addr)
                raise
            self._regions.remove(addr)
            self._regions.insert(addr, length, handle)
        if publish:
            self._publish_buffers()
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        """Withdraw a registration made by register_memory; unknown addresses are -3."""
        return self._guard("unregister_memory", lambda: self._unregister(buffer_addr))

    def _unregister(self, addr: Any, publish: bool = True) -> int:
        engine = self._require()
        addr = _as_int(addr, "buffer_addr")
        with self._lock:
            handle = self._regions.get(addr)
            if not isinstance(handle, MemHandle):
                raise MooncakeError(ERR_ADDRESS_NOT_REGISTERED,
                                    f"no buffer registered at {addr:#x} (already unregistered?)")
            engine.deregister(handle)
            self._regions.remove(addr)
        if publish:
            self._publish_buffers()
        return 0

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        """register_memory for each pair; stops at (and returns) the first failure. The
        metadata server's record is rewritten once, after the batch."""
        if len(buffer_addresses) != len(capacities):
            return self._guard("batch_register_memory", lambda: _raise(ParamInvalid(
                f"{len(buffer_addresses)} addresses but {len(capacities)} capacities")))
        rc = 0
        for addr, length in zip(buffer_addresses, capacities, strict=True):
            rc = self._guard("register_memory",
                             lambda a=addr, n=length: self._register(a, n, publish=False))
            if rc != 0:
                break
        self._publish_buffers()
        return rc

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """unregister_memory for each; returns the first failure, still tries the rest."""
        first = 0
        for addr in buffer_addresses:
            rc = self._guard("unregister_memory",
                             lambda a=addr: self._unregister(a, publish=False))
            first = first or rc
        self._publish_buffers()
        return first

    def allocate_managed_buffer(self, length: int) -> int:
        """An address in shm that this engine serves and same-node peers map; 0 on failure."""
        return self._guard("allocate_managed_buffer", lambda: self._allocate(length), failure=0)

    def _allocate(self, length: Any) -> int:
        engine = self._require()
        length = _as_int(length, "length")
        if length <= 0:
            raise ParamInvalid(f"allocate_managed_buffer: length must be positive, got {length}")
        with self._lock:
            if self._managed is None:
                self._managed = _ManagedPool(
                    self._managed_pool_bytes or _env_bytes(MANAGED_POOL_ENV, DEFAULT_MANAGED_POOL_BYTES),
                    self._managed_max_bytes or _env_bytes(MANAGED_MAX_ENV, _half_ram()))
            return self._managed.allocate(engine, self._regions, length)

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Give a managed buffer back (its length as allocated)."""
        def free() -> int:
            self._require()
            with self._lock:
                if self._managed is None:
                    raise ParamInvalid(f"{buffer_addr!r} is not a managed buffer (none allocated)")
                self._managed.free(_as_int(buffer_addr, "buffer_addr"), _as_int(length, "length"))
            return 0
        return self._guard("free_managed_buffer", free)

    def write_bytes_to_buffer(self, dest_address: int, src_bytes: bytes | str, length: int) -> int:
        """Copy `length` bytes of `src_bytes` into registered or managed memory here."""
        def write() -> int:
            data = src_bytes.encode() if isinstance(src_bytes, str) else bytes(src_bytes)
            addr, size = self._local_range(dest_address, length, "write_bytes_to_buffer")
            if size > len(data):
                raise ParamInvalid(f"write_bytes_to_buffer: length {size} > {len(data)} source bytes")
            ctypes.memmove(addr, data, size)
            return 0
        return self._guard("write_bytes_to_buffer", write)

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """`length` bytes of registered or managed memory here (b"" on failure)."""
        def read() -> bytes:
            addr, size = self._local_range(source_address, length, "read_bytes_from_buffer")
            return ctypes.string_at(addr, size)
        return self._guard("read_bytes_from_buffer", read, failure=b"")

    def _local_range(self, addr: Any, length: Any, what: str) -> tuple[int, int]:
        self._require()
        addr, length = _as_int(addr, "address"), _as_int(length, "length")
        check_range(addr, length, what)
        with self._lock:
            self._regions.find(addr, length, f"{what}: local address (register it first)")
        return addr, length

    def get_first_buffer_address(self, segment_name: str) -> int:
        """Base of the first buffer `segment_name` registered (0 if none or unreachable)."""
        def first() -> int:
            engine = self._require()
            if segment_name in (engine.name, self._segment_name):
                segments = engine.agent.segments() if engine.agent is not None else []
            else:
                segments = self._with_target(segment_name,
                                             lambda e, address, _t: e.segments(address))
            buffers = [s for s in segments if not s.name.startswith(NOTIFY_PREFIX)]
            if not buffers:
                raise ParamInvalid(f"{segment_name} has no registered buffer")
            return min(buffers, key=lambda s: s.segment_id).base
        return self._guard("get_first_buffer_address", first, failure=0)

    # ------------------------------------------------------------ targets

    def _connect(self, target: str) -> Engine:
        engine = self._require()
        if not isinstance(target, str):
            raise ParamInvalid(f"target must be a segment name 'ip:port', got {target!r}")
        engine.ensure_connected(target, self._handshake_timeout)
        return engine

    def _drop(self, target: str, address: str) -> None:
        """Forget segment `target`'s connection (to `address`) and where it was."""
        self._resolved.pop(target, None)
        engine = self._engine
        if engine is not None:
            with contextlib.suppress(HixlError):
                engine.disconnect(address)

    def _with_target(self, target: str, action: Callable[[Engine, str, float], T]) -> T:
        """action(engine, address, timeout) on the connected engine serving segment
        `target` (`_address`). Anything but bad input drops the connection (and the
        resolved address); a cached one found dead or stale is reopened once, its name
        resolved again, within the deadline."""
        deadline = time.monotonic() + self._transfer_timeout
        address = self._address(target)
        cached = self._engine is not None and self._engine.is_connected(address)
        try:
            return action(self._connect(address), address, self._transfer_timeout)
        except ParamInvalid:
            raise
        except (PeerUnavailable, StaleEpoch, NotConnected) as exc:
            self._drop(target, address)
            if not cached or self._engine is None:
                raise
            first = exc
            log.info("%s: cached connection failed (%s); reconnecting", target, exc)
        except HixlError:
            self._drop(target, address)
            raise
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TransferTimeout(f"{target}: no time left to reconnect")
            address = self._address(target)
            return action(self._connect(address), address, left)
        except ParamInvalid:
            raise
        except HixlError as exc:
            self._drop(target, address)
            exc.args = (f"{exc.args[0]} (reconnecting after: {first.args[0]})", *exc.args[1:])
            raise

    def send_probe(self, peer_server_name: str) -> int:
        """0 if the peer's agent answers (one control-plane round trip), else -102."""
        def probe() -> int:
            self._with_target(peer_server_name,
                              lambda e, address, _t: e.segments(address, refresh=True))
            return 0
        return self._guard("send_probe", probe, code=ERR_SOCKET)

    # ------------------------------------------------------------ transfers

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                            length: int, transport_hint: str = "") -> int:
        return self.transfer_sync(target_hostname, buffer, peer_buffer_address, length,
                                  TransferOpcode.Write)

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                           length: int, transport_hint: str = "") -> int:
        return self.transfer_sync(target_hostname, buffer, peer_buffer_address, length,
                                  TransferOpcode.Read)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode: Any, notify: TransferNotify | None = None,
                      transport_hint: str = "") -> int:
        """One op; returns once every byte moved (0) or it failed (-1)."""
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address],
                                        [length], opcode, notify)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses,
                                        lengths, TransferOpcode.Write)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses,
                                        lengths, TransferOpcode.Read)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                            opcode: Any, notify: TransferNotify | None = None,
                            transport_hint: str = "") -> int:
        """A batch in one direction; every op is checked before any byte moves."""
        def run() -> int:
            op = _op(opcode)
            descs = _descs(buffers, peer_buffer_addresses, lengths)
            if descs:
                self._with_target(target_hostname, lambda e, address, timeout: e.transfer(
                    address, op, descs, timeout))
            if notify is not None:
                self._with_target(target_hostname, lambda e, address, _t: self._send_notify(
                    e, address, notify))
            return 0
        return self._guard("batch_transfer_sync", run)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                              length: int, transport_hint: str = "") -> int:
        """Start one WRITE; returns a batch id for transfer_check_status (0 on failure)."""
        return self.batch_transfer_async(target_hostname, [buffer], [peer_buffer_address],
                                         [length], TransferOpcode.Write)

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses,
                                         lengths, TransferOpcode.Write)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses,
                                         lengths, TransferOpcode.Read)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                             opcode: Any, transport_hint: str = "") -> int:
        """Start a batch; returns its id (> 0), or 0 when it could not start (checked now:
        bad input, unknown target). Bytes move in the background, by MC_TRANSFER_TIMEOUT."""
        def submit() -> int:
            op = _op(opcode)
            descs = _descs(buffers, peer_buffer_addresses, lengths)
            request, address = None, target_hostname
            if descs:
                def start(e: Engine, at: str, timeout: float) -> TransferRequest:
                    nonlocal address
                    address = at
                    return e.transfer_async(at, op, descs, timeout)
                request = self._with_target(target_hostname, start)
            with self._lock:
                batch_id = next(self._batch_ids)
                self._batches[batch_id] = _Batch(target_hostname, address, request)
            return batch_id
        return self._guard("batch_transfer_async", submit, failure=0)

    def _take_batch(self, batch_id: Any) -> _Batch:
        with self._lock:
            batch = self._batches.pop(batch_id, None) if isinstance(batch_id, int) else None
        if batch is None:
            raise ParamInvalid(f"unknown batch id {batch_id!r} (failed to start, or its final "
                               "status was already reported)")
        return batch

    def _failed(self, batch: _Batch, error: HixlError | None) -> HixlError:
        error = error or HixlError(f"transfer to {batch.target} failed")
        if not isinstance(error, ParamInvalid):
            self._drop(batch.target, batch.address)
        return error

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done, 0 in progress, -1 failed, -2 timed out; a final answer frees the id."""
        def check() -> int:
            with self._lock:
                batch = self._batches.get(batch_id) if isinstance(batch_id, int) else None
                request = batch.request if batch is not None else None
                if batch is not None and request is not None and \
                        request.status == TransferStatus.WAITING:
                    return STATUS_IN_PROGRESS
            batch = self._take_batch(batch_id)
            if batch.request is None or batch.request.status == TransferStatus.COMPLETED:
                return STATUS_DONE
            error = self._failed(batch, batch.request.error)
            code = STATUS_TIMEOUT if isinstance(error, TransferTimeout) else STATUS_FAILED
            raise MooncakeError(code, str(error))
        return self._guard("transfer_check_status", check, code=STATUS_FAILED)

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Wait for every batch (each within its deadline): 0 if all succeeded, else -1."""
        def wait_all() -> int:
            errors: list[HixlError] = []
            for batch_id in list(batch_ids):
                try:
                    batch = self._take_batch(batch_id)
                except ParamInvalid as exc:
                    errors.append(exc)
                    continue
                if batch.request is None:
                    continue
                try:
                    batch.request.wait()
                except HixlError as exc:
                    errors.append(self._failed(batch, exc))
            if errors:
                more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
                raise MooncakeError(STATUS_FAILED, f"{errors[0]}{more}")
            return 0
        return self._guard("get_batch_transfer_status", wait_all)

    # ------------------------------------------------------------ notifications

    def _send_notify(self, engine: Engine, target: str, notify: Any) -> None:
        name, msg = getattr(notify, "name", None), getattr(notify, "msg", None)
        if not isinstance(name, str) or not isinstance(msg, str):
            raise ParamInvalid(f"notify must be a TransferNotify(name: str, msg: str), got {notify!r}")
        text = NOTIFY_PREFIX + json.dumps([engine.name, name, msg])
        if len(text) > MAX_NOTIFY_BYTES:
            raise ParamInvalid(f"notify is {len(text)} bytes encoded; at most {MAX_NOTIFY_BYTES}")
        engine.allocate(target, 1, Perm.READ, name=text, wait=False)  # the target's agent reads it

    def get_notifies(self) -> list[TransferNotify]:
        """Notifications peers sent with their transfers, oldest first; each once."""
        def collect() -> list[TransferNotify]:
            agent = self._require().agent
            out: list[TransferNotify] = []
            with self._notify_lock:
                pending = sorted((s for s in agent.segments() if s.name.startswith(NOTIFY_PREFIX)),
                                 key=lambda s: s.segment_id)
                for segment in pending:
                    try:
                        agent.deregister(segment.segment_id)
                        _sender, name, msg = json.loads(segment.name[len(NOTIFY_PREFIX):])
                    except (HixlError, ValueError) as exc:
                        log.warning("dropping notify segment %d: %s", segment.segment_id, exc)
                        continue
                    out.append(TransferNotify(name, msg))
            return out
        return self._guard("get_notifies", collect, failure=[])


# ------------------------------------------------------------ helpers


def _raise(exc: BaseException) -> Any:
    raise exc


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ParamInvalid(f"{what} must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ParamInvalid(f"{what} must be an integer, got {value!r}") from None


def _op(opcode: Any) -> TransferOp:
    """Our TransferOpcode, Mooncake's pybind enum, or 0/1 -> hixl's TransferOp."""
    try:
        value = int(opcode)
    except (TypeError, ValueError):
        value = -1
    if value == TransferOpcode.Read:
        return TransferOp.READ
    if value == TransferOpcode.Write:
        return TransferOp.WRITE
    raise ParamInvalid(f"opcode must be TransferOpcode.Read or TransferOpcode.Write, got {opcode!r}")


def _descs(buffers: Sequence[Any], peers: Sequence[Any], lengths: Sequence[Any]) -> list[TransferOpDesc]:
    """Ops as TransferOpDescs; zero-length ops are dropped (Mooncake treats them as done)."""
    try:
        counts = (len(buffers), len(peers), len(lengths))
    except TypeError:
        raise ParamInvalid("buffers, peer_buffer_addresses and lengths must be lists") from None
    if len(set(counts)) != 1:
        raise ParamInvalid(f"{counts[0]} buffers, {counts[1]} peer addresses and {counts[2]} "
                           "lengths: the lists must have the same length")
    return [TransferOpDesc(_as_int(local, "buffer"), _as_int(remote, "peer_buffer_address"), n)
            for local, remote, length in zip(buffers, peers, lengths, strict=True)
            if (n := _as_int(length, "length"))]


def _engine_name(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not a number") from None
    if value <= 0:
        raise ConfigError(f"environment variable {name}={raw!r} must be positive")
    return value


def _env_bytes(name: str, default: int) -> int:
    return int(_env_number(name, default))


def _half_ram() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 8 << 30


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _start_in_rpc_range(host: str, options: dict[str, str], registry: str) -> tuple[Engine, int]:
    """An Engine on a free port in [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT], as Mooncake picks."""
    low = int(_env_number(MIN_RPC_PORT_ENV, DEFAULT_RPC_PORTS[0]))
    high = int(_env_number(MAX_RPC_PORT_ENV, DEFAULT_RPC_PORTS[1]))
    if not 0 < low <= high <= 65535:
        raise ConfigError(f"{MIN_RPC_PORT_ENV}={low} and {MAX_RPC_PORT_ENV}={high}: "
                          "need 0 < min <= max <= 65535")
    tried: list[str] = []
    for port in random.sample(range(low, high + 1), min(PORT_ATTEMPTS, high - low + 1)):
        if not _bindable(host, port):
            tried.append(f"{port} busy")
            continue
        try:
            return Engine(_engine_name(host, port), options, registry=registry), port
        except HixlError as exc:  # lost a race for the port, most likely
            tried.append(f"{port}: {exc}")
    raise ResourceExhausted(f"no free port for {host} in [{low}, {high}] "
                            f"({MIN_RPC_PORT_ENV}/{MAX_RPC_PORT_ENV}); tried {'; '.join(tried)}")
