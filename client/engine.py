"""`Engine`: a process's handle on hixl — register memory, connect to peers, PUT and GET.

An engine named "ip" is a client; "ip:port" also embeds an agent (hixl.server) that
serves this process's registered memory to peers. Every operation is checked in full
before any byte moves (registered local memory, remote segment bounds, permissions), so
bad input raises a typed HixlError and changes nothing. Per op, nothing goes through
gRPC: the fabric path memmoves into a mapping, the socket path streams to the peer agent.

With a registry (`registry="host:port"` or HIXL_REGISTRY) the engine keeps a `GlobalTable`
of the whole cluster: `connect` needs no handshake RPC (the registry already published the
peer's endpoints and segments), and a peer's segment table is the live registry view, so
segments allocated or dropped anywhere are seen without an RPC. Without one, `connect`
handshakes with the peer's agent (peer-to-peer) and refreshes its table on a miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping as MappingABC
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

from hixl import device
from hixl.addresses import split_host_port
from hixl.auth import as_token, load_token
from hixl.errors import (
    AlreadyConnected,
    HixlError,
    NotConnected,
    OutOfRange,
    ParamInvalid,
    PeerUnavailable,
    PermissionDenied,
    StaleEpoch,
    TransferFailed,
    TransferTimeout,
    Unsupported,
)
from hixl.memory import BufferRange, ShmSegment, buffer_range
from hixl.metrics import (
    CollectorRegistry,
    FunctionCollector,
    MetricsServer,
    Traffic,
    TrafficTable,
    gauge,
    traffic_families,
)
from hixl.options import OPTION_ENABLE_USE_FABRIC_MEM, EngineOptions
from hixl.staging import DeviceCopier, DevicePaths, StagingConfig
from hixl.table import MAX_ADDRESS, AddressTable, check_range
from hixl.tls import ClientTLS, TlsSetting, client_tls
from hixl.transports.base import Item, ItemArrays, Runs, Transport
from hixl.transports.fabric import FabricTransport, MappedRange
from hixl.transports.tcp import SocketTransport
from hixl.types import (
    MemType,
    Perm,
    SegmentInfo,
    TransferOp,
    TransferOpDesc,
    TransferStatus,
    check_allowed_engines,
)

log = logging.getLogger("hixl.engine")

DEFAULT_TIMEOUT_S = 1.0  # HIXL's default timeout_in_millis is 1000
REGISTRY_ENV = "HIXL_REGISTRY"  # registry address when Engine(registry=...) is not given
ASYNC_WORKERS = 4
INLINE_ASYNC_BYTES = 256 << 10  # async fabric transfers up to this size complete in the call
_NEED_WRITE, _NEED_READ = int(Perm.WRITE), int(Perm.READ)  # plain ints: IntFlag ops are slow
ARRAY_MIN_OPS = 32  # list batches this long are resolved as arrays (transfer_arrays)
_INT64_MAX = (1 << 63) - 1
PATHS = ("fabric", "tcp", "unix")  # the data paths an op can take (`Engine.route`)
_monotonic = time.monotonic
# module constants: `TransferOp.WRITE` is an enum class lookup, ~35 ns on the hot path
_WRITE, _READ = TransferOp.WRITE, TransferOp.READ


def parse_engine_name(name: str, *, remote: bool = False) -> tuple[str, int]:
    """Split "ip", "ip:port", "[v6]" or "[v6]:port" into (host, port); port 0 means none.

    A `remote` engine must name its port: without one gRPC would dial :443 and time out
    somewhere unrelated, so the name is refused saying what it should be."""
    if not isinstance(name, str) or not name:
        raise ParamInvalid(f"engine name must be a non-empty string like 'ip' or 'ip:port', got {name!r}")
    no_port = (f"engine name {name!r} has no port: a remote engine is its agent's "
               "host:grpc_port (engine= on the 'hixl-agent serving' line, default port "
               f"50161), e.g. '{name}:50161'")
    return split_host_port(name, "engine name", default_port=None if remote else 0,
                           min_port=0, no_port=no_port)


def _agent_info(view: Any) -> Any:
    """What a handshake would have said, from the registry's view of an engine."""
    from hixl.client.agent_client import AgentInfo

    info, ends = view.info, view.info.endpoints
    return AgentInfo(engine=info.engine, node_id=info.node_id,
                     fabric_domain=ends.fabric_domain, epoch=info.epoch,
                     data_tcp=ends.data_tcp, data_unix=ends.data_unix,
                     fd_socket=ends.fd_socket, segments=view.segments())


def _account(peer: _Peer, op: TransferOp, fabric_items: list[Item] | Runs,
             socket_items: list[Item], nbytes: int, start: float) -> None:
    """Count a finished call (once per call, not per op) in the traffic of the path it
    took; a call that took both paths counts its whole time in each."""
    seconds = _monotonic() - start
    if socket_items:
        if fabric_items:
            part = fabric_items.nbytes if type(fabric_items) is Runs \
                else sum(item.length for item in fabric_items)  # type: ignore[union-attr]
            peer.fabric_traffic[op].add(len(fabric_items), part, seconds)  # type: ignore[index]
            nbytes -= part
        peer.socket_traffic[op].add(len(socket_items), nbytes, seconds)  # type: ignore[index]
    else:
        peer.fabric_traffic[op].add(len(fabric_items), nbytes, seconds)  # type: ignore[index]


def _failed(peer: _Peer, traffic: Traffic, exc: Exception) -> None:
    """Count a failed call; a segment found deregistered (the only ParamInvalid a
    transport raises itself) makes the next call reload a cached peer table."""
    traffic.failed(exc)
    if type(exc) is ParamInvalid:
        peer.stale = True


def _unmappable(peer: _Peer, segment: SegmentInfo) -> str:
    """Why a same-node peer's segment cannot be mapped, and how to make it mappable."""
    name = f" {segment.name!r}" if segment.name else ""
    return (f"segment {segment.segment_id}{name} [{segment.base:#x}, "
            f"+{segment.length}) of {peer.name} is not shared memory (a bytearray, numpy "
            "array or other private memory of its process), so it cannot be mapped here; "
            "allocate it with malloc_mem / Engine.malloc (or from an agent's pool) and "
            "register ranges inside that to get the mapped path")


def _check_op(op: Any) -> TransferOp:
    if op is TransferOp.WRITE or op is TransferOp.READ:
        return op
    try:
        return TransferOp(op)
    except ValueError:
        raise ParamInvalid(f"operation must be TransferOp.READ or TransferOp.WRITE, got {op!r}") from None


def _unpack_desc(index: int, desc: Any) -> tuple[Any, Any, Any]:
    """(local_addr, remote_addr, len) from a TransferOpDesc-like triple."""
    try:
        local_addr, remote_addr, length = desc
    except (TypeError, ValueError):
        raise ParamInvalid(f"op {index}: expected TransferOpDesc(local_addr, remote_addr, len), "
                           f"got {desc!r}") from None
    return local_addr, remote_addr, length


def op_array(values: Any, name: str) -> np.ndarray:
    """One descriptor array as int64: 1-d, integer dtype, no value past 2**63 - 1."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ParamInvalid(f"{name} must be a 1-d array of integers, got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise ParamInvalid(f"{name} must be an integer array (int64 or uint64), got dtype "
                           f"{array.dtype}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and array.size and \
            int(array.max()) > _INT64_MAX:
        index = int(np.argmax(array > _INT64_MAX))
        raise ParamInvalid(f"op {index}: {name}[{index}] = {int(array[index])} overflows the "
                           "address space", failed=[index])
    return array.astype(np.int64, copy=False)


class OpArrays(NamedTuple):
    """A batch's ops as int64 arrays (op_arrays), with the bounds of each side: every op
    starts at or after `*_low` and ends by `*_high` (the largest start plus the largest
    length: a bound, not always reached)."""

    local: np.ndarray
    remote: np.ndarray
    sizes: np.ndarray
    local_low: int
    local_high: int
    remote_low: int
    remote_high: int


def op_arrays(local_addrs: Any, remote_addrs: Any, lengths: Any) -> OpArrays:
    """(local, remote, lengths) as int64 arrays of one length, every op checked at once:
    positive lengths, non-negative addresses, no range past the 64-bit address space.
    `lengths` may be one int for every op. The first bad op raises, by index."""
    local = op_array(local_addrs, "local_addrs")
    remote = op_array(remote_addrs, "remote_addrs")
    if isinstance(lengths, int | np.integer) and not isinstance(lengths, bool):
        if not 0 < lengths <= _INT64_MAX:
            raise ParamInvalid(f"length must be positive, got {lengths}", failed=[0])
        sizes = np.full(local.size, lengths, np.int64)
    else:
        sizes = op_array(lengths, "lengths")
    if not local.size == remote.size == sizes.size:
        raise ParamInvalid(f"descriptor arrays differ in length: {local.size} local_addrs, "
                           f"{remote.size} remote_addrs, {sizes.size} lengths")
    if not local.size:
        raise ParamInvalid("a batch needs at least one op (the arrays are empty)")
    smallest, largest = (int(lengths), int(lengths)) if sizes is not lengths and \
        not isinstance(lengths, np.ndarray) and np.ndim(lengths) == 0 \
        else (int(sizes.min()), int(sizes.max()))
    bounds = OpArrays(local, remote, sizes, int(local.min()), int(local.max()) + largest,
                      int(remote.min()), int(remote.max()) + largest)
    if smallest > 0 and min(bounds.local_low, bounds.remote_low) >= 0 and \
            max(bounds.local_high, bounds.remote_high) <= _INT64_MAX:
        return bounds  # the usual batch: its bounds say every op is fine
    positive = np.maximum(sizes, 1)  # keeps the sums below from overflowing
    bad = (sizes <= 0) | (local < 0) | (remote < 0) | (local > _INT64_MAX - positive) | \
        (remote > _INT64_MAX - positive)
    if bad.any():
        index = int(np.argmax(bad))
        for addr, side in ((int(local[index]), "local"), (int(remote[index]), "remote")):
            try:
                check_range(addr, int(sizes[index]), f"op {index} {side}")
            except ParamInvalid as exc:
                raise ParamInvalid(exc.args[0], failed=[index]) from None
        raise ParamInvalid(f"op {index}: a range ends past 2**63 ({int(local[index]):#x}, "
                           f"{int(remote[index]):#x} + {int(sizes[index])})", failed=[index])
    return bounds


def _containing(table: AddressTable[Any], addrs: np.ndarray, sizes: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """(index of the range of `table` holding each op's start, whether it holds the whole
    op), for every op at once."""
    bases, ends, _ = table.arrays()
    if not bases.size:
        return np.zeros(addrs.size, np.intp), np.zeros(addrs.size, bool)
    where = np.searchsorted(bases, addrs, side="right") - 1
    clipped = np.maximum(where, 0)
    return clipped, (where >= 0) & (addrs + sizes <= ends[clipped])


def _one_range(table: AddressTable[Any], low: int, high: int, addrs: np.ndarray,
               sizes: np.ndarray) -> Any | None:
    """The value of the one range of `table` holding every op (starting at or after
    `low`, ending by `high`), else None: the usual batch (pages of one KV cache, into
    one heap) found from its bounds alone."""
    hit = table.lookup(low)
    if hit is None:
        return None
    if high <= hit[1] or int((addrs + sizes).max()) <= hit[1]:
        return hit[2]
    return None


def _plain_ints(values: Sequence[Any]) -> bool:
    return set(map(type, values)) <= {int}


def _desc_arrays(descs: Any) -> OpArrays | None:
    """A long list batch as op_arrays, or None when any field is not a plain int or any
    desc is malformed (the scalar resolver then names the op and what is wrong)."""
    if type(descs) is not list and type(descs) is not tuple:
        return None
    try:
        if all(type(desc) is TransferOpDesc for desc in descs):
            local = [desc.local_addr for desc in descs]
            remote = [desc.remote_addr for desc in descs]
            sizes = [desc.len for desc in descs]
        else:
            local, remote, sizes = (list(column) for column in zip(*descs, strict=True))
            if len(local) != len(descs):
                return None
    except (TypeError, ValueError):
        return None
    if not (_plain_ints(local) and _plain_ints(remote) and _plain_ints(sizes)):
        return None
    try:
        return op_arrays(np.array(local, np.int64), np.array(remote, np.int64),
                         np.array(sizes, np.int64))
    except (OverflowError, HixlError):
        return None


def _readonly_local(index: int, addr: int) -> PermissionDenied:
    return PermissionDenied(f"op {index}: local memory at {addr:#x} is read-only; "
                            "a READ cannot land in it", failed=[index])


def _runs(segments: list[SegmentInfo], where: np.ndarray | None, local: np.ndarray,
          remote: np.ndarray, sizes: np.ndarray, ops: np.ndarray | range) -> Runs:
    """Checked ops of the mapped path as Runs: consecutive ops that continue each other
    on both sides in one segment coalesced into one copy. `where`: each op's index in
    `segments`; None when all are in segments[0]."""
    nbytes = int(sizes.sum())
    if local.size > 1:
        ends = sizes[:-1]
        joined = (local[1:] == local[:-1] + ends) & (remote[1:] == remote[:-1] + ends)
        if where is not None:
            joined &= where[1:] == where[:-1]
        if joined.any():
            starts = np.flatnonzero(np.concatenate(([True], ~joined)))
            sizes = np.add.reduceat(sizes, starts)
            local, remote = local[starts], remote[starts]
            where = None if where is None else where[starts]
    if where is None:
        return Runs(segments[:1], np.zeros(local.size, np.intp), local, remote, sizes, ops,
                    nbytes)
    used, seg = np.unique(where, return_inverse=True)
    return Runs([segments[slot] for slot in used.tolist()], seg.reshape(-1), local, remote,
                sizes, ops, nbytes)


@dataclass(eq=False)
class MemHandle:
    """A registration of local memory (HIXL's MemHandle)."""

    addr: int
    length: int
    mem_type: MemType
    readonly: bool
    keepalive: Any = field(repr=False)
    segment: SegmentInfo | None = None  # set when this engine serves the memory to peers
    registered: bool = True
    copier: Any = field(default=None, repr=False)  # device memory: the DeviceCopier moving it


@dataclass
class _Peer:
    """What this engine knows of one connected remote engine."""

    name: str
    info: Any  # AgentInfo
    client: Any  # AgentClient
    table: AddressTable[SegmentInfo]
    epoch: int
    fabric: FabricTransport | None
    fd_client: Any | None
    socket_address: str
    socket: SocketTransport | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    hint: SegmentInfo | None = None  # the segment the last transfer ended in
    view: Any | None = None  # the GlobalTable EngineView `table` came from (registry mode)
    # the engine's traffic counters of each path to this peer, (read, write) by TransferOp
    fabric_traffic: tuple[Traffic, Traffic] | None = None
    socket_traffic: tuple[Traffic, Traffic] | None = None
    no_fabric: str = ""  # why no segment of this peer can be mapped ("" when some can)
    unmapped_told: set[int] = field(default_factory=set)  # segment ids logged as unmappable
    stale: bool = False  # a segment of the cached (P2P) table was found deregistered


class Route(str):
    """The data path an op takes: "fabric", "unix" or "tcp" (compares as that string).

    `reason` says why it is not the mapped path when it is not ("" on "fabric").
    """

    reason: str

    def __new__(cls, path: str, reason: str = "") -> Route:
        route = super().__new__(cls, path)
        route.reason = reason
        return route


class TransferRequest:
    """An asynchronous transfer; resolves to COMPLETED or FAILED, never WAITING past its deadline."""

    def __init__(self, future: Future[None], deadline: float, remote: str) -> None:
        self._future = future
        self.deadline = deadline
        self.remote = remote

    @property
    def status(self) -> TransferStatus:
        if self._future.done():
            return TransferStatus.FAILED if self._future.exception() else TransferStatus.COMPLETED
        if time.monotonic() > self.deadline:
            return TransferStatus.FAILED
        return TransferStatus.WAITING

    @property
    def error(self) -> HixlError | None:
        """Why it failed (None while waiting or when completed)."""
        if self._future.done():
            exc = self._future.exception()
            if exc is None or isinstance(exc, HixlError):
                return exc
            return TransferFailed(f"transfer to {self.remote} failed: {exc!r}")
        if time.monotonic() > self.deadline:
            return TransferTimeout(f"transfer to {self.remote} passed its deadline")
        return None

    def wait(self, timeout: float | None = None) -> None:
        """Block until done (or the request's deadline); raise its error if it failed."""
        limit = self.deadline - time.monotonic() + 0.05
        if timeout is not None:
            limit = min(limit, timeout)
        try:
            self._future.result(timeout=max(0.0, limit))
        except TimeoutError:
            raise TransferTimeout(f"transfer to {self.remote} passed its deadline") from None


def embedded_agent_config(**fields: Any) -> Any:
    """An agent configuration (hixl.server.agent.config.AgentConfig of `fields`) for an agent
    embedded in this process: `Engine(..., agent_config=...)`. With
    Engine._start_embedded_agent, the SDK's one way into hixl.server."""
    from hixl.server.agent.config import AgentConfig

    return AgentConfig(**fields)


class Engine:
    """Pythonic hixl engine: exceptions, context manager, buffers accepted for addresses."""

    def __init__(self, local_engine: str, options: MappingABC[str, str] | None = None, *,
                 agent_config: Any | None = None, registry: str | None = None,
                 cluster_token: str | bytes | None = None, tls: TlsSetting = None,
                 device_copier: DeviceCopier | None = None,
                 staging: StagingConfig | None = None) -> None:
        """`cluster_token`: proves this engine to agents that require one (and is required
        by its embedded agent); None takes agent_config.cluster_token_file, else
        $HIXL_CLUSTER_TOKEN or the file $HIXL_CLUSTER_TOKEN_FILE names, else none.

        `tls`: how this engine dials agents and the registry over gRPC (hixl.tls):
        a ClientTLS, False for plaintext, None for agent_config's tls_* keys, else the
        HIXL_TLS_* environment (a CA there: TLS). The embedded agent serves TLS per its
        config (tls_cert_file/tls_key_file, else $HIXL_TLS_CERT_FILE/$HIXL_TLS_KEY_FILE).
        The data path is not encrypted.

        `device_copier`: moves every device-memory registration (hixl.staging; the tests'
        HostStandIn, or one CudaCopier); None: CUDA memory gets its device's CudaCopier.
        `staging`: the staging ring of device memory on the socket path (slots x
        slot_bytes, 4 x 4 MiB by default), per device; freed by close."""
        self.options = EngineOptions.parse(options)
        self._cluster_token = as_token(cluster_token) if cluster_token is not None else \
            load_token(getattr(agent_config, "cluster_token_file", "") or None)
        if tls is None and agent_config is not None:
            self._tls: ClientTLS | Literal[False] = agent_config.client_tls() or False
        else:
            self._tls = client_tls(tls) or False  # resolved once: every peer dials alike
        self.host, self.port = parse_engine_name(local_engine)
        self.name = local_engine
        self.registry = registry if registry is not None else os.environ.get(REGISTRY_ENV) or None
        self._global: Any | None = None  # GlobalTable, with a registry
        self._local: AddressTable[MemHandle] = AddressTable()
        self._local_hint: tuple[int, int, bool] = (0, 0, False)  # region the last transfer used
        self._handles: dict[tuple[int, int], MemHandle] = {}
        self._malloced: AddressTable[ShmSegment] = AddressTable()  # by the range they span
        self._malloc_allowed: dict[int, tuple[str, ...]] = {}  # malloc(allowed_engines=)
        self._peers: dict[str, _Peer] = {}
        self._connect_locks: dict[str, threading.Lock] = {}
        self._lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._server: Any | None = None
        #: bytes, ops, call latency and failures of this engine's transfers, per path and
        #: direction (see metrics_collector); counted once per call, never per op
        self.traffic = TrafficTable(PATHS)
        self._metrics: Any | None = None  # the MetricsServer of start_metrics_server
        self._device = DevicePaths(staging, device_copier)  # device memory's copiers, rings
        self._device_count = 0  # device registrations now: their ops take _move_device
        if self.registry:
            from hixl.client.global_table import GlobalTable

            self._global = GlobalTable(self.registry, cluster_token=self._cluster_token,
                                       tls=self._tls)
        try:
            if self.port > 0 or agent_config is not None:
                self._server = self._start_embedded_agent(agent_config)
                self.name = self._server.engine_name
        except BaseException:
            if self._global is not None:
                self._global.close()
            raise

    # ------------------------------------------------------------------ lifecycle

    def _start_embedded_agent(self, agent_config: Any | None) -> Any:
        """The seam (with embedded_agent_config): the one place the SDK starts the agent
        implementation, hixl.server, in this process (tests/test_layout.py holds to it)."""
        from hixl.server.agent.runtime import AgentServer

        # with a registry, the embedded agent publishes there, so every engine sees it
        config = agent_config or embedded_agent_config(host=self.host, grpc_port=self.port,
                                                       master=self.registry or "")
        server = AgentServer(config, cluster_token=self._cluster_token)
        server.start()
        return server

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Disconnect every peer, deregister everything, stop the embedded agent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers)
        for name in peers:
            try:
                self.disconnect(name)
            except HixlError as exc:
                log.debug("disconnect %s during close: %s", name, exc)
        for handle in list(self._handles.values()):
            self._release(handle)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._device.close()
        if self._metrics is not None:
            self._metrics.close()
        if self._server is not None:
            self._server.stop()
        if self._global is not None:
            self._global.close()
        for _, _, segment in self._malloced:
            with contextlib.suppress(BufferError):  # still viewed: freed with its last view
                segment.close()
        self._malloced.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise NotConnected(f"engine {self.name} is closed")

    # ------------------------------------------------------------------ memory

    def malloc(self, size: int, mem_type: MemType = MemType.MEM_HOST, *,
               allowed_engines: Sequence[str] = ()) -> ShmSegment:
        """Host memory that same-node peers can map (shm-backed, pre-faulted).

        `allowed_engines`: the engines that may reach it once registered (what
        `register(segment)` applies unless given its own list); empty: every engine.
        """
        self._check_open()
        if MemType(mem_type) != MemType.MEM_HOST:
            raise Unsupported("malloc of MEM_DEVICE memory needs an accelerator backend; "
                              "this engine allocates host memory (MEM_HOST)")
        allowed = check_allowed_engines(allowed_engines)
        segment = ShmSegment(size, name=f"hixl-{os.getpid()}")
        with self._lock:
            self._malloced.insert(segment.addr, segment.length, segment)
            if allowed:
                self._malloc_allowed[segment.addr] = allowed
        return segment

    def free(self, addr: int | ShmSegment) -> None:
        """Free memory from malloc(); refused while any range inside it is registered."""
        key = addr.addr if isinstance(addr, ShmSegment) else addr
        with self._lock:
            segment = self._malloced.get(key) if isinstance(key, int) else None
            if segment is None:
                raise ParamInvalid(f"address {key!r} was not allocated by malloc_mem/malloc "
                                   "(free takes the address malloc returned)")
            inside = [(base, length) for base, length, _ in
                      self._local.overlapping(segment.addr, segment.length)]
            if inside:
                ranges = ", ".join(f"[{base:#x}, +{length})" for base, length in inside[:4])
                raise ParamInvalid(
                    f"memory at {key:#x} still has {len(inside)} registered range(s) inside "
                    f"it ({ranges}{', ...' if len(inside) > 4 else ''}); deregister them "
                    "first")
            self._malloced.remove(key)
            self._malloc_allowed.pop(key, None)
        try:
            segment.close()
        except BufferError:
            log.debug("memory at %#x still viewed by the caller; unmapped with its last view", key)

    def register(self, memory: Any, length: int | None = None, *,
                 mem_type: MemType = MemType.MEM_HOST, perms: Perm | str = Perm.RW,
                 name: str = "", allowed_engines: Sequence[str] | None = None) -> MemHandle:
        """Register local memory: a buffer object, or a raw address with `length`.

        Registering the same (addr, length) again returns the same handle (as in HIXL);
        a range overlapping another registration is refused. `allowed_engines`: the
        engines that may reach it through this engine's embedded agent, on every path
        (empty: every engine; None: malloc's list for its memory, else every engine).

        Device memory (a CUDA tensor or pointer, or MEM_DEVICE) is the local side of
        transfers only, moved by its device copier (`_register_device`); without one it
        is refused (Unsupported, naming it), never copied as host memory.
        """
        self._check_open()
        allowed = None if allowed_engines is None else check_allowed_engines(allowed_engines)
        try:
            mem_type = MemType(mem_type)
        except ValueError:
            raise ParamInvalid(f"mem_type must be MemType.MEM_HOST or MEM_DEVICE, got {mem_type!r}") from None
        perms = Perm.parse(perms) if isinstance(perms, str) else Perm(perms)
        if isinstance(memory, int) and not isinstance(memory, bool):
            if length is None:
                raise ParamInvalid("register(addr, length): a raw address needs a length")
            check_range(memory, length, "local memory")
            # a GPU KV cache registered by data_ptr(): its copier's, never a host memmove
            placement = device.locate_address(memory)
            if mem_type == MemType.MEM_DEVICE or not placement.is_host:
                return self._register_device(memory, length, placement,
                                             f"local memory [{memory:#x}, +{length})")
            buf = BufferRange(memory, length, False, None)
        else:
            found = device.locate_object(memory)
            if mem_type == MemType.MEM_DEVICE or (found is not None and not found.is_host):
                return self._register_device(memory, length, found,
                                             f"the {type(memory).__name__} to register")
            buf = buffer_range(memory)
            if length is not None and length != buf.length:
                raise ParamInvalid(f"length {length} does not match the buffer's {buf.length} bytes")
            check_range(buf.addr, buf.length, "local memory")
        with self._lock:
            shm = self._malloced_containing(buf.addr, buf.length)
            existing = self._handles.get((buf.addr, buf.length))
            if existing is not None:
                return existing
            handle = MemHandle(buf.addr, buf.length, mem_type, buf.readonly, buf.keepalive)
            self._local.insert(buf.addr, buf.length, handle)
            try:
                if self._server is not None:
                    if buf.readonly:
                        perms &= ~Perm.WRITE
                    if allowed is None:
                        allowed = self._malloc_allowed.get(shm.addr, ()) if shm else ()
                    handle.segment = self._server.agent.register_memory(
                        buf.addr, buf.length, perms, name, self.name, buf.keepalive, shm,
                        allowed_engines=allowed)
            except BaseException:
                self._local.remove(buf.addr)
                raise
            self._handles[(buf.addr, buf.length)] = handle
            return handle

    def _register_device(self, memory: Any, length: int | None,
                         placement: device.Placement | None, what: str) -> MemHandle:
        """Register device memory (or host memory standing in for it, with a given
        copier): its copier is chosen now (Unsupported without one; ParamInvalid for a
        device other than the copier's), its range checked live on the device. It is the
        local side of transfers only: peers cannot target it (agents serve host memory)."""
        copier = self._device.copier_for(placement, what)
        readonly = False
        if isinstance(memory, int) and not isinstance(memory, bool):
            addr, nbytes, keepalive = memory, int(length or 0), None
        elif placement is not None and not placement.is_host:
            addr, nbytes = device.device_range(memory)
            keepalive = memory
        else:
            buf = buffer_range(memory)
            addr, nbytes, keepalive, readonly = buf.addr, buf.length, buf.keepalive, buf.readonly
        if length is not None and length != nbytes:
            raise ParamInvalid(f"length {length} does not match the buffer's {nbytes} bytes")
        check_range(addr, nbytes, "local memory")
        copier.check_range(addr, nbytes, what)
        with self._lock:
            existing = self._handles.get((addr, nbytes))
            if existing is not None:
                return existing
            handle = MemHandle(addr, nbytes, MemType.MEM_DEVICE, readonly, keepalive,
                               copier=copier)
            self._local.insert(addr, nbytes, handle)
            self._handles[(addr, nbytes)] = handle
            self._device_count += 1
            return handle

    def _malloced_containing(self, addr: int, length: int) -> ShmSegment | None:
        """The malloc'd allocation holding [addr, addr+length), so same-node peers can map
        the range; None for other memory. A range that starts in one and runs past its
        end is refused: it would be half mappable, and likely a caller's size mistake."""
        hits = self._malloced.overlapping(addr, length)
        if not hits:
            return None
        base, size, segment = hits[0]
        if len(hits) > 1 or addr < base or addr + length > base + size:
            raise OutOfRange(
                f"range [{addr:#x}, +{length}) runs past its malloc_mem allocation "
                f"[{base:#x}, +{size}) (by {max(base - addr, 0) + max(addr + length - base - size, 0)}"
                " bytes); register ranges that lie inside one allocation")
        return segment

    def deregister(self, handle: MemHandle) -> None:
        """Withdraw a registration; a second deregister of the same handle raises ParamInvalid."""
        if not isinstance(handle, MemHandle):
            raise ParamInvalid(f"deregister needs a MemHandle from register(), got {type(handle).__name__}")
        with self._lock:
            if not handle.registered or self._handles.get((handle.addr, handle.length)) is not handle:
                raise ParamInvalid(
                    f"memory handle for [{handle.addr:#x}, +{handle.length}) is not registered "
                    "(already deregistered?)")
            self._release(handle)

    def _release(self, handle: MemHandle) -> None:
        with self._lock:
            self._handles.pop((handle.addr, handle.length), None)
            self._local_hint = (0, 0, False)
            if self._local.get(handle.addr) is handle:
                self._local.remove(handle.addr)
            if handle.registered and handle.copier is not None:
                self._device_count -= 1
            handle.registered = False
        if handle.segment is not None and self._server is not None:
            try:
                self._server.agent.deregister(handle.segment.segment_id)
            except HixlError as exc:
                log.debug("deregister served segment: %s", exc)

    # ------------------------------------------------------------------ peers

    def connect(self, remote: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Set up the data paths to a remote engine.

        With a registry that lists `remote`, its published endpoints and live segment
        table are used (no RPC); otherwise handshake with its agent and cache its table.
        """
        self._check_open()
        parse_engine_name(remote, remote=True)
        with self._lock:
            if remote in self._peers:
                raise AlreadyConnected(f"already connected to {remote}")
        peer = self._open_peer(remote, timeout)
        with self._lock:
            if remote in self._peers:
                self._close_peer(peer)
                raise AlreadyConnected(f"already connected to {remote}")
            self._peers[remote] = peer

    def _open_peer(self, remote: str, timeout: float) -> _Peer:
        from hixl.client.agent_client import AgentClient

        if timeout <= 0:
            raise ParamInvalid(f"timeout must be positive, got {timeout}")
        client = AgentClient(remote, timeout=timeout, cluster_token=self._cluster_token,
                             tls=self._tls)  # no RPC until used
        view = self._registry_view(remote, timeout)
        if view is not None:
            info = _agent_info(view)
            table = view.table  # the live view: replaced, never mutated, by the watch
        else:
            try:
                info = client.handshake(self.name, timeout=timeout)
            except BaseException:
                client.close()
                raise
            table = AddressTable()
            for segment in info.segments:
                table.insert(segment.base, segment.length, segment)
        fabric = None
        fd_client, why_not = self._same_node_fd_client(remote, info, timeout)
        same_node = fd_client is not None
        if fd_client is not None and self.options.fabric_mem:
            fabric = FabricTransport(remote, fd_client)
        elif fd_client is not None:
            fd_client.close()
            fd_client = None
            why_not = (f"{OPTION_ENABLE_USE_FABRIC_MEM} is '0' for this engine; set it to "
                       f"'1' to map {remote}'s shareable memory")
        socket_address = (f"unix://{info.data_unix}"
                          if same_node and info.data_unix and os.path.exists(info.data_unix)
                          else f"tcp://{info.data_tcp}")
        return _Peer(remote, info, client, table, info.epoch, fabric, fd_client, socket_address,
                     view=view, fabric_traffic=self.traffic.pair("fabric"),
                     socket_traffic=self.traffic.pair(socket_address.partition("://")[0]),
                     no_fabric=why_not)

    def _same_node_fd_client(self, remote: str, info: Any, timeout: float
                             ) -> tuple[Any | None, str]:
        """(the fd socket of `remote`'s agent, "") when that agent runs on this node, else
        (None, why not).

        The published socket paths exist here for *any* agent of this node with the same
        runtime dir and port -- every node runs its agent at /run/hixl/agent-50161.* -- so
        the agent answering at the path must say it is the one handshaken with (engine name
        and epoch); otherwise it is this node's own agent, and only TCP reaches `remote`.
        A same-node peer whose fd socket cannot be used is a slow path the caller did not
        ask for: logged as a warning when the mapped path is on.
        """
        from hixl.client.agent_client import FdClient

        local_node = self._server.agent.node_id if self._server is not None else None
        if local_node is not None and local_node != info.node_id:
            return None, f"{remote} is on node {info.node_id!r}, this engine on {local_node!r}"
        if not info.fd_socket or not os.path.exists(info.fd_socket):
            return None, (f"{remote} publishes no fd socket that exists here "
                          f"({info.fd_socket or 'none'}): it is on another node")
        try:
            fd_client = FdClient(info.fd_socket, timeout=timeout, engine=self.name)
        except HixlError as exc:
            why = f"the fd socket of {remote} refused this engine: {exc}"
            (log.warning if self.options.fabric_mem else log.info)(
                "%s; its memory is reached through its socket, not mapped", why)
            return None, why
        try:
            reply = fd_client.ping()
        except HixlError as exc:
            reply = {"error": str(exc)}
        if reply.get("engine") != info.engine or reply.get("epoch") != info.epoch:
            log.info("%s is another agent (%s), not %s epoch %s: %s is on another node; "
                     "using TCP", info.fd_socket, reply, info.engine, info.epoch, remote)
            fd_client.close()
            return None, (f"{info.fd_socket} here is another agent's: {remote} is on "
                          "another node")
        return fd_client, ""

    def _registry_view(self, remote: str, timeout: float) -> Any | None:
        """The registry's view of `remote` if it published its endpoints, else None (P2P).

        Waits (at most `timeout`) only for the first snapshot after the engine started.
        """
        if self._global is None:
            return None
        if self._global.resyncs == 0:  # later outages keep the last view: no waiting
            self._global.wait_synced(timeout)
        view = self._global.view(remote)
        if view is None or not view.info.endpoints.data_tcp:
            log.debug("registry %s does not list %s with endpoints; handshaking",
                      self.registry, remote)
            return None
        return view

    def _follow_view(self, peer: _Peer) -> None:
        """Registry mode: take the peer's current view (no RPC), or say why it is unusable."""
        assert self._global is not None
        view = self._global.view(peer.name)
        if view is peer.view:
            return
        if view is None:
            raise PeerUnavailable(
                f"{peer.name} is gone: the registry {self.registry} no longer lists it (its "
                "lease expired or it shut down); reconnect once it is back")
        if view.epoch != peer.epoch:
            raise StaleEpoch(f"{peer.name} restarted (epoch {peer.epoch} -> {view.epoch}); its "
                             "old addresses are void: disconnect() and connect() again")
        peer.view, peer.table, peer.hint = view, view.table, None

    def engines(self) -> dict[str, Any]:
        """Engine name -> EngineInfo (epoch, endpoints) of every engine the registry lists.

        Until the registry first answered, waits for it (bounded), then raises saying why
        (GlobalTable.require): an empty table is not an empty cluster."""
        if self._global is None:
            raise NotConnected(f"engine {self.name} has no registry: pass registry='host:port' "
                               f"or set {REGISTRY_ENV} to list the cluster's engines")
        self._global.require()
        return self._global.engines()

    @property
    def global_table(self) -> Any | None:
        """The GlobalTable this engine follows (None without a registry)."""
        return self._global

    @property
    def agent(self) -> Any | None:
        """The embedded agent (hixl.server.agent.agent.Agent) serving this engine's memory, or
        None for a client-only engine; adapters read the segments peers gave it."""
        return self._server.agent if self._server is not None else None

    def is_connected(self, remote: str) -> bool:
        return remote in self._peers

    def mapped_range(self, remote: str, remote_addr: int, length: int) -> MappedRange | None:
        """`remote`'s [remote_addr, +length) as mapped in this process, for a caller that
        reads it again and again itself (the store's repeated get of a cached key): None
        unless a connected peer serves it inside one readable segment on the fabric path.
        Its `read_into` checks after each copy what a READ transfer checks; such reads
        are not counted in `traffic`."""
        peer = self._peers.get(remote)
        if peer is None or peer.fabric is None:
            return None
        hit = peer.table.lookup(remote_addr)
        if hit is None or remote_addr + length > hit[1]:
            return None
        segment = hit[2]
        if not (segment.shareable and int(segment.perms) & _NEED_READ):
            return None
        try:
            return peer.fabric.mapped_range(segment, remote_addr, length)
        except HixlError:
            return None

    # ------------------------------------------------------------------ metrics

    def metrics_collector(self) -> FunctionCollector:
        """A Prometheus collector of this engine: bytes, ops, call latency and failures of
        its transfers per path (fabric, tcp, unix) and direction, peers, registered memory.

        Register it on your own CollectorRegistry. The counters are plain integers bumped
        once per transfer call (the fabric path runs in this process, so only the engine
        can count it); this reads them when scraped.
        """
        return FunctionCollector(self._metric_families, f"engine {self.name}")

    def start_metrics_server(self, port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
        """Serve this engine's metrics, and its embedded agent's, on
        http://host:port/metrics (port 0: a free one, see `.port`); stopped by close().
        A port in use raises ConfigError."""
        self._check_open()
        with self._lock:
            if self._metrics is not None:
                raise ParamInvalid(f"engine {self.name} already serves metrics on "
                                   f"{self._metrics.url}")
            registry = CollectorRegistry()
            registry.register(self.metrics_collector())
            if self._server is not None:
                registry.register(self._server.metrics_collector())
            self._metrics = MetricsServer(registry, host, port, "start_metrics_server(port)")
            return self._metrics

    def _metric_families(self) -> list[Any]:
        with self._lock:
            peers = len(self._peers)
            handles = [h for h in self._handles.values() if h.registered]
        return [
            *traffic_families("hixl_engine_transfer",
                              "moved by this engine's completed transfer calls (write: PUT "
                              "to a peer, read: GET from one)", "path", self.traffic.rows(),
                              timed="each completed transfer call (a batch)",
                              errors="Failed transfer calls, by HIXL status name"),
            gauge("hixl_engine_peers", "Engines this engine is connected to.", (),
                  [((), peers)]),
            gauge("hixl_engine_registered_bytes", "Local memory registered for transfers.",
                  (), [((), sum(h.length for h in handles))]),
            gauge("hixl_engine_registered_regions", "Local memory registrations.", (),
                  [((), len(handles))]),
        ]

    def ensure_connected(self, remote: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Connect to `remote` unless connected already: for adapters that connect lazily
        (Mooncake's openSegment style). One handshake per remote at a time; other remotes
        are not held up."""
        if remote in self._peers:
            return
        with self._lock:
            lock = self._connect_locks.setdefault(remote, threading.Lock())
        with lock:
            if remote not in self._peers:
                self.connect(remote, timeout)

    def disconnect(self, remote: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Drop the connection, its mappings and data channels."""
        with self._lock:
            peer = self._peers.pop(remote, None)
        if peer is None:
            raise NotConnected(f"not connected to {remote}")
        self._close_peer(peer)

    def _close_peer(self, peer: _Peer) -> None:
        for part in (peer.fabric, peer.socket, peer.fd_client, peer.client):
            if part is not None:
                try:
                    part.close()
                except Exception as exc:  # closing must not stop closing the rest
                    log.debug("closing %s of %s: %r", type(part).__name__, peer.name, exc)

    def _peer(self, remote: str) -> _Peer:
        peer = self._peers.get(remote)
        if peer is None:
            self._check_open()
            if self.options.auto_connect:
                with contextlib.suppress(AlreadyConnected):  # another thread won the race
                    self.connect(remote)
                return self._peers[remote]
            raise NotConnected(f"not connected to {remote}; call connect({remote!r}) first")
        return peer

    def segments(self, remote: str, refresh: bool = True) -> list[SegmentInfo]:
        """The remote engine's segments (base, length, perms, ...), current by default.

        With a registry this is its live view (no RPC, no connection needed); without one
        the table is fetched from the remote agent.
        """
        if self._global is not None and remote not in self._peers:
            view = self._global.view(remote)
            if view is not None:
                return view.segments()
        peer = self._peer(remote)
        if refresh:
            self._refresh(peer)
        return [segment for _, _, segment in peer.table]

    def _refresh(self, peer: _Peer) -> None:
        if peer.view is not None:
            self._follow_view(peer)  # the watch keeps the table current: no RPC
            return
        epoch, segments = peer.client.list_segments()
        if epoch != peer.epoch:
            raise StaleEpoch(f"{peer.name} restarted (epoch {peer.epoch} -> {epoch}); its old "
                             "addresses are void: disconnect() and connect() again")
        table: AddressTable[SegmentInfo] = AddressTable()
        for segment in segments:
            table.insert(segment.base, segment.length, segment)
        peer.table = table
        peer.hint = None

    def route(self, remote: str, remote_addr: int) -> Route:
        """The data path an op on `remote_addr` of `remote` takes: "fabric", "unix" or
        "tcp", with `.reason` saying why it is not "fabric" when it is not."""
        peer = self._peer(remote)
        if peer.view is not None:
            self._follow_view(peer)
        _, segment = peer.table.find(remote_addr, 1, "remote address")
        if peer.fabric is not None and segment.shareable:
            return Route("fabric")
        path = peer.socket_address.partition("://")[0]
        return Route(path, peer.no_fabric or _unmappable(peer, segment))

    def _tell_unmapped(self, peer: _Peer, segment: SegmentInfo) -> None:
        """Say once per (peer, segment) that ops on it take the socket path though the
        mapped one is on: the caller asked for mapping and would not know otherwise."""
        if segment.segment_id in peer.unmapped_told:
            return
        peer.unmapped_told.add(segment.segment_id)
        log.warning("%s: transfers take the %s socket path, not the mapped one",
                    _unmappable(peer, segment), peer.socket_address.partition("://")[0])

    def allocate(self, remote: str, size: int, perms: Perm | str = Perm.RW,
                 name: str = "", *, allowed_engines: Sequence[str] = (),
                 wait: bool = True) -> SegmentInfo:
        """Allocate a segment in a remote agent's pool (one RPC); it joins the cached table.

        `allowed_engines`: the engines that may reach it (empty: every engine); list this
        engine too if it is to use the segment itself. With a registry, it returns once
        the segment is in this engine's view, so it is usable at once; if the registry
        does not show it in time (master unreachable), it is released and TransferTimeout
        raised. `wait=False` returns at once (a segment only its agent reads: notifies).
        """
        peer = self._peer(remote)
        perms = Perm.parse(perms) if isinstance(perms, str) else Perm(perms)
        segment = peer.client.allocate(size, perms, name, self.name,
                                       allowed_engines=allowed_engines)
        if peer.view is not None:
            # read-your-writes: usable as soon as this returns, once the registry has it
            assert self._global is not None
            if wait and not self._global.wait_for(
                    lambda table: segment in table.segments(remote), peer.client.timeout):
                # unusable here (a lookup of it would miss): give it back, say why
                with contextlib.suppress(HixlError):
                    peer.client.deregister(segment.segment_id, segment.epoch)
                raise TransferTimeout(
                    f"segment {segment.segment_id} allocated in {remote} did not appear in "
                    f"the registry {self.registry} within {peer.client.timeout:g} s (is "
                    "hixl-master reachable?); it was released again")
            return segment
        with peer.lock:
            peer.table.insert(segment.base, segment.length, segment)
        return segment

    def release(self, remote: str, segment: SegmentInfo) -> None:
        """Give a segment from allocate() back to the remote pool."""
        peer = self._peer(remote)
        peer.client.deregister(segment.segment_id, segment.epoch)
        with peer.lock:
            if peer.view is None and peer.table.get(segment.base) is not None:
                peer.table.remove(segment.base)  # the registry view is the watch's to change
            peer.hint = None

    # ------------------------------------------------------------------ transfers

    def transfer(self, remote: str, op: TransferOp, descs: Sequence[TransferOpDesc | tuple[int, int, int]],
                 timeout: float = DEFAULT_TIMEOUT_S, *, local_registered: bool = True) -> None:
        """Run a batch of ops in one direction; returns when every byte has moved.

        READ copies remote memory into local memory, WRITE local into remote. Raises a
        HixlError subclass; `.failed` lists the indexes of ops that did not complete.
        A completed call counts its ops, bytes and time in `traffic` (its path and
        direction), a failed one its status in that path's errors.

        `local_registered=False`: the local side is memory the caller itself owns and
        keeps alive for the call (writable for a READ), so it need not be registered.
        For adapters moving Python objects (the store's put of a bytes value, its get
        into a new bytes object): without it they would stage every byte through
        registered memory, a second copy.
        """
        start = _monotonic()
        deadline = start + timeout if type(timeout) is float and timeout > 0 \
            else self._deadline(timeout)
        peer = self._peers.get(remote) or self._peer(remote)
        if op is not _WRITE and op is not _READ:
            op = _check_op(op)
        arrays = _desc_arrays(descs) if (type(descs) is list or type(descs) is tuple) and \
            len(descs) >= ARRAY_MIN_OPS and not self._device_count else None
        if arrays is not None:  # a long list: checked and copied as arrays (one mechanism)
            runs, socket_items, nbytes = self._resolve_arrays(peer, op, arrays, local_registered)
            self._move(peer, op, runs, socket_items, nbytes, start, deadline)
            return
        fabric_items, socket_items, nbytes = self._resolve(peer, op, descs, local_registered)
        if self._device_count:  # device memory registered: _move sends its ops its own way
            self._move(peer, op, fabric_items, socket_items, nbytes, start, deadline)
            return
        # _move, inlined: this is the per-call overhead a 1 MiB fabric copy (~23 µs) pays
        if fabric_items:
            try:
                peer.fabric.transfer(op, fabric_items, deadline)  # type: ignore[union-attr]
            except Exception as exc:
                _failed(peer, peer.fabric_traffic[op], exc)  # type: ignore[index]
                raise
            if not socket_items:  # the usual call, one path: _account's fabric-only case
                peer.fabric_traffic[op].add(  # type: ignore[index]
                    len(fabric_items), nbytes, _monotonic() - start)
                return
        if socket_items:
            try:
                self._socket(peer).transfer(op, socket_items, deadline)
            except Exception as exc:
                _failed(peer, peer.socket_traffic[op], exc)  # type: ignore[index]
                raise
        _account(peer, op, fabric_items, socket_items, nbytes, start)

    def transfer_arrays(self, remote: str, op: TransferOp, local_addrs: Any, remote_addrs: Any,
                        lengths: Any, timeout: float = DEFAULT_TIMEOUT_S, *,
                        local_registered: bool = True) -> None:
        """`transfer` of a batch given as arrays: op i moves `lengths[i]` bytes between
        `local_addrs[i]` and `remote_addrs[i]` (integer numpy arrays or sequences;
        `lengths` may be one int for all).

        Why: a batch of many pages is checked and resolved vectorised -- one table lookup
        (np.searchsorted) for all ops, one permission check per segment, not per op --
        and ops that continue each other on both sides are coalesced into one copy; on
        the mapped path the copies are issued by one C-level loop. Same checks and errors
        as `transfer` (the first bad op raises, by index, nothing moved); ops whose
        segment is not mapped take the socket path as Items, as in `transfer`.
        """
        self._transfer_ops(remote, op, op_arrays(local_addrs, remote_addrs, lengths),
                           timeout, local_registered=local_registered)

    def _transfer_ops(self, remote: str, op: TransferOp, ops: OpArrays, timeout: float, *,
                      wait: bool = True, local_registered: bool = True
                      ) -> TransferRequest | None:
        """transfer_arrays (`wait=False`: its async form) of arrays op_arrays checked, or
        that a caller in this package built with true bounds (hixl.shmem: offsets it
        checked against its objects): the table checks still run, on those bounds."""
        start = _monotonic()
        deadline = self._deadline(timeout)
        peer = self._peers.get(remote) or self._peer(remote)
        op = _check_op(op)
        runs: Runs | list[Item] | None
        if self._device_count and local_registered:  # device ops are resolved as items
            runs, socket_items, nbytes = self._resolve(
                peer, op, list(zip(ops.local.tolist(), ops.remote.tolist(), ops.sizes.tolist(),
                                   strict=True)))
        else:
            runs, socket_items, nbytes = self._resolve_arrays(peer, op, ops, local_registered)
        if not wait:
            return self._launch(peer, op, runs, socket_items, nbytes, start, deadline, remote)
        self._move(peer, op, runs, socket_items, nbytes, start, deadline)
        return None

    def transfer_arrays_async(self, remote: str, op: TransferOp, local_addrs: Any,
                              remote_addrs: Any, lengths: Any, timeout: float = 30.0
                              ) -> TransferRequest:
        """`transfer_arrays` in the background, as `transfer_async`: checked now."""
        request = self._transfer_ops(remote, op, op_arrays(local_addrs, remote_addrs, lengths),
                                     timeout, wait=False)
        assert request is not None
        return request

    def _move(self, peer: _Peer, op: TransferOp, fabric_items: list[Item] | Runs | None,
              socket_items: list[Item], nbytes: int, start: float, deadline: float) -> None:
        """Move the resolved items (`transfer`'s second half; async calls run it later).
        Ops on registered device memory are split off first (and their memory checked
        still as registered), then moved by `_move_device` after the host ops."""
        groups: dict[int, tuple[Any, list[Item], list[Item]]] = {}
        if self._device_count:
            fabric_items, socket_items, groups = self._device_split(fabric_items, socket_items)
        if fabric_items:
            assert peer.fabric is not None and peer.fabric_traffic is not None
            try:
                if type(fabric_items) is Runs:
                    peer.fabric.transfer_runs(op, fabric_items, deadline)
                else:
                    peer.fabric.transfer(op, fabric_items, deadline)  # type: ignore[arg-type]
            except Exception as exc:
                _failed(peer, peer.fabric_traffic[op], exc)
                raise
        if socket_items:
            assert peer.socket_traffic is not None
            try:
                self._socket(peer).transfer(op, socket_items, deadline)
            except Exception as exc:
                _failed(peer, peer.socket_traffic[op], exc)
                raise
        if groups:
            fabric_items, socket_items = self._move_device(peer, op, fabric_items, socket_items,
                                                           groups, deadline)
        _account(peer, op, fabric_items or [], socket_items, nbytes, start)

    def _device_split(self, fabric_items: list[Item] | Runs | None, socket_items: list[Item]
                      ) -> tuple[list[Item] | Runs | None, list[Item],
                                 dict[int, tuple[Any, list[Item], list[Item]]]]:
        """(host fabric items, host socket items, device ops by copier: (copier, mapped
        path items, socket path items)). Each device registration used is checked first:
        a tensor resized or moved since, or memory its device no longer holds, is a typed
        error before any byte of the call moves. A Runs batch is host memory only (device
        registrations send batches through `_resolve`)."""
        groups: dict[int, tuple[Any, list[Item], list[Item]]] = {}
        checked: set[int] = set()
        split: list[list[Item]] = []
        for which, items in enumerate((fabric_items, socket_items)):
            if not items or type(items) is Runs:
                split.append(items)  # type: ignore[arg-type]
                continue
            host: list[Item] = []
            for item in items:  # type: ignore[union-attr]
                hit = self._local.lookup(item.local_addr)
                handle = hit[2] if hit is not None else None
                if handle is None or handle.copier is None:
                    host.append(item)
                    continue
                if id(handle) not in checked:
                    self._check_device(handle, item.index)
                    checked.add(id(handle))
                group = groups.get(id(handle.copier))
                if group is None:
                    group = groups[id(handle.copier)] = (handle.copier, [], [])
                group[1 + which].append(item)
            split.append(host)
        return split[0], split[1], groups

    @staticmethod
    def _check_device(handle: MemHandle, index: int) -> None:
        """Device memory still as registered: a registered tensor still at the same
        address with at least its bytes (resize_ moves it), and the range still live on
        its device (the copier asks the driver)."""
        what = f"op {index}: the device memory registered at [{handle.addr:#x}, +{handle.length})"
        tensor = handle.keepalive
        if callable(getattr(tensor, "data_ptr", None)) and hasattr(tensor, "element_size"):
            addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
            if addr != handle.addr or nbytes < handle.length or not tensor.is_contiguous():
                raise ParamInvalid(
                    f"{what}: its tensor was resized or moved after registration (now "
                    f"[{addr:#x}, +{nbytes})); deregister it and register the tensor again",
                    failed=[index])
        try:
            handle.copier.check_range(handle.addr, handle.length, what)
        except HixlError as exc:
            exc.failed = [index]
            raise

    def _move_device(self, peer: _Peer, op: TransferOp, fabric_items: list[Item] | Runs | None,
                     socket_items: list[Item],
                     groups: dict[int, tuple[Any, list[Item], list[Item]]], deadline: float
                     ) -> tuple[list[Item] | Runs, list[Item]]:
        """Device ops: on the mapped path, one device copy per op into/out of the peer's
        mapping (FabricTransport.transfer_device); on the socket path, through the
        copier's staging ring (hixl.staging.staged_transfer). Returns every op of the
        call per path, for the traffic counters."""
        all_fabric: list[Item] | Runs = fabric_items or []
        all_socket = list(socket_items)
        for copier, mapped, streamed in groups.values():
            if mapped:
                assert peer.fabric is not None and peer.fabric_traffic is not None
                try:
                    peer.fabric.transfer_device(op, mapped, deadline, copier)
                except Exception as exc:
                    _failed(peer, peer.fabric_traffic[op], exc)
                    raise
                all_fabric = list(all_fabric) + mapped  # type: ignore[arg-type]
            if streamed:
                assert peer.socket_traffic is not None
                try:
                    self._device.staged(self._socket(peer), op, streamed, copier, deadline)
                except Exception as exc:
                    _failed(peer, peer.socket_traffic[op], exc)
                    raise
                all_socket += streamed
        return all_fabric, all_socket

    @staticmethod
    def _deadline(timeout: float) -> float:
        if (type(timeout) is not float and type(timeout) is not int and (
                not isinstance(timeout, int | float) or isinstance(timeout, bool))) or not timeout > 0:
            raise ParamInvalid(f"timeout must be a positive number of seconds, got {timeout!r}")
        return time.monotonic() + timeout

    def _socket(self, peer: _Peer) -> Transport:
        if peer.socket is None:
            with peer.lock:
                if peer.socket is None:
                    peer.socket = SocketTransport(peer.socket_address, identity=self.name,
                                                  cluster_token=self._cluster_token)
        return peer.socket

    def _resolve(self, peer: _Peer, op: TransferOp, descs: Sequence[Any],
                 local_registered: bool = True) -> tuple[list[Item], list[Item], int]:
        """Check every op against both tables before any byte moves; split by path.
        Returns (fabric items, socket items, bytes in all). `local_registered=False`
        skips the local table (see transfer).

        Hot path (300k+ ops/s): consecutive ops usually stay in one local region and one
        remote segment, so those ranges are kept in locals and looked up again only when
        an op leaves them; the full checks with their error messages run on a miss.
        """
        if type(descs) is not list and type(descs) is not tuple and (
                not isinstance(descs, Sequence) or isinstance(descs, str | bytes)) or not descs:
            raise ParamInvalid("op_descs must be a non-empty sequence of TransferOpDesc")
        if peer.view is not None:
            self._follow_view(peer)
        elif peer.stale:
            peer.stale = False
            self._refresh(peer)  # a segment it held was deregistered: reload the table
        fabric_items: list[Item] = []
        socket_items: list[Item] = []
        writing = op is _WRITE
        need = _NEED_WRITE if writing else _NEED_READ
        # ranges that the previous call resolved: checked again below, looked up only on a miss
        l_base, l_end, l_readonly = self._local_hint if local_registered \
            else (0, MAX_ADDRESS, False)
        segment = peer.hint
        r_base = r_end = 0
        if segment is not None and int(segment.perms) & need:
            r_base, r_end = segment.base, segment.end
        items = fabric_items if segment is not None and peer.fabric is not None and segment.shareable \
            else socket_items
        refreshed = False
        nbytes = 0
        for index, desc in enumerate(descs):
            if type(desc) is TransferOpDesc:
                local_addr, remote_addr, length = desc.local_addr, desc.remote_addr, desc.len
            else:
                local_addr, remote_addr, length = _unpack_desc(index, desc)
            if not (type(local_addr) is int and type(remote_addr) is int and type(length) is int
                    and length > 0 and local_addr >= 0 and remote_addr >= 0
                    and local_addr + length <= MAX_ADDRESS and remote_addr + length <= MAX_ADDRESS):
                check_range(local_addr, length, f"op {index} local")
                check_range(remote_addr, length, f"op {index} remote")
            if not (l_base <= local_addr and local_addr + length <= l_end):
                l_base, l_end, l_readonly = self._local_region(index, local_addr, length)
            if l_readonly and not writing:
                raise _readonly_local(index, local_addr)
            if not (r_base <= remote_addr and remote_addr + length <= r_end):
                if not refreshed and peer.table.lookup(remote_addr) is None:
                    self._refresh(peer)  # segments allocated since connect
                    refreshed = True
                segment = self._remote_segment(peer, index, remote_addr, length, need,
                                               self.name)
                r_base, r_end = segment.base, segment.end
                if peer.fabric is None:
                    items = socket_items
                elif segment.shareable:
                    items = fabric_items
                else:
                    items = socket_items
                    self._tell_unmapped(peer, segment)
            items.append(Item(index, local_addr, segment, remote_addr, length))  # type: ignore[arg-type]
            nbytes += length
        if local_registered:
            self._local_hint = (l_base, l_end, l_readonly)
        peer.hint = segment
        return fabric_items, socket_items, nbytes

    def _resolve_arrays(self, peer: _Peer, op: TransferOp, ops: OpArrays,
                        local_registered: bool = True
                        ) -> tuple[Runs | None, Sequence[Item], int]:
        """`_resolve` for arrays (from op_arrays): every op checked against both tables
        before any byte moves, all at once. Returns (the mapped path's runs or None, the
        socket path's items, bytes in all).

        Each check is a mask over the ops; the first op failing any of them is checked
        again by `_check_one`, the scalar resolver's checks in its order, so it raises
        exactly what `transfer` raises for it.
        """
        if peer.view is not None:
            self._follow_view(peer)
        elif peer.stale:
            peer.stale = False
            self._refresh(peer)
        writing = op is _WRITE
        need = _NEED_WRITE if writing else _NEED_READ
        local, remote, sizes = ops.local, ops.remote, ops.sizes
        handle = _one_range(self._local, ops.local_low, ops.local_high, local, sizes) \
            if local_registered else True
        segment = _one_range(peer.table, ops.remote_low, ops.remote_high, remote, sizes)
        if handle is not None and segment is not None and \
                (writing or handle is True or not handle.readonly) and int(segment.perms) & need \
                and (not segment.allowed_engines or self.name in segment.allowed_engines):
            # one local region, one segment, both allowed: checked by their bounds
            nbytes = int(sizes.sum())
            if peer.fabric is not None and segment.shareable:
                return _runs([segment], None, local, remote, sizes, range(local.size)), [], \
                    nbytes
            if peer.fabric is None:  # the socket path's, all of them (a KV layer over TCP)
                return None, ItemArrays([segment], np.zeros(local.size, np.intp), local,
                                        remote, sizes, np.arange(local.size)), nbytes
        return self._resolve_each(peer, writing, need, local, remote, sizes, local_registered)

    def _resolve_each(self, peer: _Peer, writing: bool, need: int, local: np.ndarray,
                      remote: np.ndarray, sizes: np.ndarray, local_registered: bool
                      ) -> tuple[Runs | None, Sequence[Item], int]:
        """`_resolve_arrays` op by op (still vectorised): several regions or segments, a
        socket path, or an op to refuse."""
        bad = np.zeros(local.size, bool)
        if local_registered:
            region, held = _containing(self._local, local, sizes)
            bad |= ~held
            if not writing:
                handles = self._local.arrays()[2]
                readonly = np.fromiter((h.readonly for h in handles), bool, len(handles))
                if readonly.any():
                    bad |= held & readonly[region]
        where, inside = _containing(peer.table, remote, sizes)
        if not inside.all():
            self._refresh(peer)  # segments allocated since connect (once per call)
            where, inside = _containing(peer.table, remote, sizes)
        bad |= ~inside
        segments = peer.table.arrays()[2]
        used = np.unique(where[inside]).tolist()  # one permission check per segment
        mapped = np.zeros(len(segments), bool)
        for slot in used:
            segment = segments[slot]
            if (segment.allowed_engines and self.name not in segment.allowed_engines) or \
                    not int(segment.perms) & need:
                bad |= where == slot
            elif peer.fabric is not None:
                mapped[slot] = segment.shareable
        if bad.any():
            index = int(np.argmax(bad))
            self._check_one(peer, index, int(local[index]), int(remote[index]),
                            int(sizes[index]), need, local_registered)
            raise TransferFailed(f"op {index}: refused by the batch checks (internal: the "
                                 "scalar checks accepted it)", failed=[index])
        nbytes = int(sizes.sum())
        on_fabric = mapped[where]
        if on_fabric.all():
            return _runs(segments, where, local, remote, sizes,
                         np.arange(local.size)), [], nbytes
        if peer.fabric is not None:
            for slot in used:
                if not mapped[slot]:
                    self._tell_unmapped(peer, segments[slot])
        fabric_ops = np.flatnonzero(on_fabric)
        runs = _runs(segments, where[fabric_ops], local[fabric_ops], remote[fabric_ops],
                     sizes[fabric_ops], fabric_ops) if fabric_ops.size else None
        socket_ops = np.flatnonzero(~on_fabric)
        # kept as arrays: the socket path frames them without an object per op
        socket_items = ItemArrays(segments, where[socket_ops], local[socket_ops],
                                  remote[socket_ops], sizes[socket_ops], socket_ops)
        return runs, socket_items, nbytes

    def _check_one(self, peer: _Peer, index: int, local_addr: int, remote_addr: int,
                   length: int, need: int, local_registered: bool) -> None:
        """The scalar checks of one op, in `_resolve`'s order: raise its error."""
        if local_registered:
            _, _, readonly = self._local_region(index, local_addr, length)
            if readonly and need == _NEED_READ:
                raise _readonly_local(index, local_addr)
        self._remote_segment(peer, index, remote_addr, length, need, self.name)

    def _local_region(self, index: int, addr: int, length: int) -> tuple[int, int, bool]:
        """(base, end, readonly) of the registered local region holding the op."""
        try:
            base, handle = self._local.find(addr, length, f"op {index} local address")
        except OutOfRange as exc:
            raise OutOfRange(f"{exc.args[0]} (local memory must be registered first)",
                             failed=[index]) from None
        return base, base + handle.length, handle.readonly

    @staticmethod
    def _remote_segment(peer: _Peer, index: int, addr: int, length: int, need: int,
                        engine: str) -> SegmentInfo:
        """The segment of `peer` holding the op, if `engine` may do `need` to it (its
        allow-list is checked here, once per segment change: the owner agent enforces
        it again, and this way a refused batch moves no byte at all)."""
        try:
            _, segment = peer.table.find(addr, length, f"op {index} remote address")
        except OutOfRange as exc:
            raise OutOfRange(f"{exc.args[0]} of {peer.name}", failed=[index]) from None
        if segment.allowed_engines and engine not in segment.allowed_engines:
            raise PermissionDenied(
                f"op {index}: engine {engine!r} may not reach segment {segment.segment_id} "
                f"of {peer.name}: it is not in the segment's allowed_engines", failed=[index])
        if not int(segment.perms) & need:
            raise PermissionDenied(
                f"op {index}: segment {segment.segment_id} of {peer.name} is "
                f"{'read-only' if need == Perm.WRITE else 'not readable'} (perms {segment.perms})",
                failed=[index])
        return segment

    def transfer_async(self, remote: str, op: TransferOp, descs: Sequence[Any],
                       timeout: float = 30.0) -> TransferRequest:
        """Start a transfer in the background; input is checked now, bytes move later."""
        start = _monotonic()
        deadline = self._deadline(timeout)
        peer = self._peer(remote)
        op = _check_op(op)
        fabric_items, socket_items, nbytes = self._resolve(peer, op, descs)
        return self._launch(peer, op, fabric_items, socket_items, nbytes, start, deadline,
                            remote)

    def _launch(self, peer: _Peer, op: TransferOp, fabric_items: list[Item] | Runs | None,
                socket_items: list[Item], nbytes: int, start: float, deadline: float,
                remote: str) -> TransferRequest:
        """Run resolved items as a request: small mapped batches at once, others on a
        worker thread."""
        if not socket_items and nbytes <= INLINE_ASYNC_BYTES:
            # a few µs of memmove: done here, cheaper than waking a worker thread
            done: Future[None] = Future()
            try:
                self._move(peer, op, fabric_items, socket_items, nbytes, start, deadline)
            except HixlError as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)
            return TransferRequest(done, deadline, remote)
        future = self._executor().submit(self._move, peer, op, fabric_items, socket_items,
                                         nbytes, start, deadline)
        return TransferRequest(future, deadline, remote)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(ASYNC_WORKERS, thread_name_prefix="hixl-xfer")
        return self._pool

    def write(self, remote: str, local: Any, remote_addr: int, length: int | None = None,
              timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """PUT: copy `local` (registered buffer or address) to `remote_addr` of `remote`."""
        addr, length = self._local_range(local, length)
        self.transfer(remote, TransferOp.WRITE, [TransferOpDesc(addr, remote_addr, length)], timeout)

    def read(self, remote: str, local: Any, remote_addr: int, length: int | None = None,
             timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """GET: copy `length` bytes at `remote_addr` of `remote` into `local`."""
        addr, length = self._local_range(local, length)
        self.transfer(remote, TransferOp.READ, [TransferOpDesc(addr, remote_addr, length)], timeout)

    @staticmethod
    def _local_range(local: Any, length: int | None) -> tuple[int, int]:
        if isinstance(local, int) and not isinstance(local, bool):
            if length is None:
                raise ParamInvalid("a raw local address needs a length")
            return local, length
        buf = buffer_range(local)
        return buf.addr, buf.length if length is None else length

    # ------------------------------------------------------------------ asyncio

    async def transfer_aio(self, remote: str, op: TransferOp, descs: Sequence[Any],
                           timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """`transfer` for asyncio code: runs on the engine's worker threads."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor(), self.transfer, remote, op, descs, timeout)

    async def write_aio(self, remote: str, local: Any, remote_addr: int, length: int | None = None,
                        timeout: float = DEFAULT_TIMEOUT_S) -> None:
        addr, length = self._local_range(local, length)
        await self.transfer_aio(remote, TransferOp.WRITE, [TransferOpDesc(addr, remote_addr, length)], timeout)

    async def read_aio(self, remote: str, local: Any, remote_addr: int, length: int | None = None,
                       timeout: float = DEFAULT_TIMEOUT_S) -> None:
        addr, length = self._local_range(local, length)
        await self.transfer_aio(remote, TransferOp.READ, [TransferOpDesc(addr, remote_addr, length)], timeout)

    async def connect_aio(self, remote: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor(), self.connect, remote, timeout)
