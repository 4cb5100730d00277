"""Device memory as the local side of a transfer (issue 21): PUT D2rH, GET rH2D.

Every byte of registered device memory moves through a `DeviceCopier`: a stream of
asynchronous copies between device memory and host memory, with events to wait on. Two
implementations:

- `CudaCopier`: the CUDA driver API through ctypes (cuMemcpyDtoHAsync / cuMemcpyHtoDAsync
  on a stream of the device's primary context, events, cuMemHostAlloc for
  pinned staging, cuMemHostRegister for a peer's mapped segment). Why the driver API and
  not torch's CUDA API or the cuda-bindings package: a process holding CUDA memory has the
  driver loaded already (hixl.device finds it with RTLD_NOLOAD), so the path needs no
  Python dependency and works for memory from any framework (torch, CuPy, JAX, a raw
  `data_ptr()`); the primary context is the one the CUDA runtime (and so torch) uses, so
  pointers and streams mix with theirs; and the dozen calls used have a stable C ABI.
- `HostStandIn`: host memory standing in for the device, copied with memmove on a copy
  thread of its own (so copies really run beside the caller, in order, like a stream).
  The tests drive the pipelines below with it; `before_copy` lets a test hold a copy until
  an event of its choosing, which proves overlap by the order of events, not by timing.

The two paths over a copier:

- mapped (same node; FabricTransport.transfer_device): the peer's mapped segment is
  host-registered with the copier once per mapping (unregistered before the mapping can be
  unmapped), and each op is one asynchronous copy between device memory and the mapping,
  completed when the copier's event is reached: no bounce buffer, no agent.
- socket (other nodes, or no mapping; `staged_transfer`): device -> staging ring -> socket,
  chunked and pipelined: while chunk i is sent, the copy of chunk i+1 into the next slot
  runs on the copier; GET receives chunk i+1 while chunk i is copied to the device. The
  ring (`StagingConfig`: slots x slot_bytes, 16 MiB by default) is allocated on the first
  staged transfer, reused by every later one (one transfer at a time per device), and
  freed when the engine closes.
"""

from __future__ import annotations

import abc
import ctypes
import logging
import queue
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hixl import device
from hixl.errors import (
    HixlError,
    NotConnected,
    OutOfRange,
    ParamInvalid,
    TransferFailed,
    TransferTimeout,
    Unsupported,
)
from hixl.transports.base import Item, Transport
from hixl.types import TransferOp

log = logging.getLogger("hixl.staging")

DEFAULT_SLOT_BYTES = 4 << 20
DEFAULT_SLOTS = 4
DRAIN_S = 60.0  # copies are bounded memory work; past this a copier is considered wedged
_PAGE = 4096


@dataclass(frozen=True, slots=True)
class StagingConfig:
    """The staging ring of the socket path for device memory: `slots` host buffers of
    `slot_bytes` each (a chunk of a transfer per slot; 2 slots are enough to overlap the
    copy of one chunk with the send of the previous one). Per device, per engine."""

    slot_bytes: int = DEFAULT_SLOT_BYTES
    slots: int = DEFAULT_SLOTS

    def __post_init__(self) -> None:
        if type(self.slots) is not int or self.slots < 2:
            raise ParamInvalid(f"staging slots must be an integer >= 2 (one copying while "
                               f"one is sent), got {self.slots!r}")
        if type(self.slot_bytes) is not int or self.slot_bytes < _PAGE:
            raise ParamInvalid(f"staging slot_bytes must be an integer >= {_PAGE}, got "
                               f"{self.slot_bytes!r}")

    @property
    def total_bytes(self) -> int:
        return self.slots * self.slot_bytes


def _no_trace(event: str, chunk: int) -> None:
    return None


class DeviceCopier(abc.ABC):
    """Asynchronous copies between one device's memory and host memory, in the order they
    were queued (one stream); `record` marks the copies queued so far, `wait` blocks until
    they are done. Host buffers for staging come from `host_alloc` (pinned on CUDA)."""

    device: str = "device"
    #: called by the pipelines with (event, chunk number): "stage"/"staged" (device ->
    #: staging queued / done), "send"/"sent", "recv"/"received", "unstage"/"unstaged"
    trace: Callable[[str, int], None] | None = None

    @abc.abstractmethod
    def to_host(self, host_addr: int, device_addr: int, nbytes: int) -> None:
        """Queue a copy of `nbytes` from device memory to host memory."""

    @abc.abstractmethod
    def to_device(self, device_addr: int, host_addr: int, nbytes: int) -> None:
        """Queue a copy of `nbytes` from host memory to device memory."""

    @abc.abstractmethod
    def record(self) -> Any:
        """An event reached once every copy queued so far is done."""

    @abc.abstractmethod
    def wait(self, event: Any, deadline: float) -> None:
        """Block until `event`; TransferTimeout past `deadline`, TransferFailed when a
        copy before it failed."""

    @abc.abstractmethod
    def host_alloc(self, nbytes: int) -> int:
        """Host memory for staging (page-locked where the device needs it to overlap)."""

    @abc.abstractmethod
    def host_free(self, addr: int) -> None:
        """Free memory from host_alloc."""

    @abc.abstractmethod
    def host_register(self, addr: int, nbytes: int, readonly: bool) -> bool:
        """Make existing host memory (a peer's mapped segment) a direct copy target; False
        when the device refuses (copies still work, through the driver's own staging)."""

    @abc.abstractmethod
    def host_unregister(self, addr: int) -> None:
        """Undo host_register; called before the memory can be unmapped."""

    @abc.abstractmethod
    def check_range(self, addr: int, nbytes: int, what: str) -> None:
        """Raise a typed error unless [addr, addr+nbytes) is live memory of this device."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release the stream and what the copier holds."""


# ------------------------------------------------------------------ the host stand-in


class _Mark:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


class HostStandIn(DeviceCopier):
    """Host memory standing in for device memory: every copy is a real memmove, run in
    queue order on a copy thread of its own (a stream), so the pipelines are exercised as
    they run on a device, with every byte checkable.

    `before_copy(seq, direction)` runs on the copy thread before copy number `seq`
    ("to_host" or "to_device"): a test can hold a copy until an event of its choosing,
    or raise to fail it. `device` names what it stands in for (checked against the
    placement of objects registered with it)."""

    def __init__(self, device: str = "host-standin",
                 before_copy: Callable[[int, str], None] | None = None) -> None:
        self.device = device
        self.before_copy = before_copy
        self.copies = 0  # copies run
        self.settled = 0  # copies run, failed or skipped after a failure (of `queued`)
        self.host_buffers: dict[int, Any] = {}  # live host_alloc buffers by address
        self.host_allocs = 0
        self.registered: dict[int, int] = {}  # host_register'ed ranges now
        self.registrations = 0  # host_register calls
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hixl-standin-copier",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            if type(entry) is _Mark:
                entry.error, self._error = self._error, None
                entry.done.set()
                continue
            seq, direction, dst, src, nbytes = entry
            if self._error is not None:
                self.settled += 1
                continue  # a stream stops at its first failure until the next event
            try:
                if self.before_copy is not None:
                    self.before_copy(seq, direction)
                ctypes.memmove(dst, src, nbytes)
                self.copies += 1
            except BaseException as exc:  # noqa: BLE001 - reported at the next event
                self._error = exc
            self.settled += 1

    def _queue_copy(self, direction: str, dst: int, src: int, nbytes: int) -> None:
        if self._closed:
            raise NotConnected(f"device copier {self.device} is closed")
        with self._seq_lock:
            seq, self._seq = self._seq, self._seq + 1
        self._queue.put((seq, direction, dst, src, nbytes))

    @property
    def queued(self) -> int:
        """Copies queued so far."""
        return self._seq

    def to_host(self, host_addr: int, device_addr: int, nbytes: int) -> None:
        self._queue_copy("to_host", host_addr, device_addr, nbytes)

    def to_device(self, device_addr: int, host_addr: int, nbytes: int) -> None:
        self._queue_copy("to_device", device_addr, host_addr, nbytes)

    def record(self) -> _Mark:
        mark = _Mark()
        self._queue.put(mark)
        return mark

    def wait(self, event: Any, deadline: float) -> None:
        if not event.done.wait(max(0.0, deadline - time.monotonic())):
            raise TransferTimeout(f"device copies on {self.device} not done by the deadline")
        if event.error is not None:
            raise TransferFailed(f"a device copy on {self.device} failed: {event.error!r}")

    def host_alloc(self, nbytes: int) -> int:
        buffer = (ctypes.c_ubyte * nbytes)()
        addr = ctypes.addressof(buffer)
        self.host_buffers[addr] = buffer
        self.host_allocs += 1
        return addr

    def host_free(self, addr: int) -> None:
        del self.host_buffers[addr]

    def host_register(self, addr: int, nbytes: int, readonly: bool) -> bool:
        if addr in self.registered:
            raise ParamInvalid(f"host range at {addr:#x} is registered twice")
        self.registered[addr] = nbytes
        self.registrations += 1
        return True

    def host_unregister(self, addr: int) -> None:
        del self.registered[addr]

    def check_range(self, addr: int, nbytes: int, what: str) -> None:
        return None  # host memory kept alive by its registration

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(DRAIN_S)


# ------------------------------------------------------------------ CUDA (driver API)

_CU_STREAM_DEFAULT = 0  # synchronizes with the legacy default stream (see CudaCopier)
_CU_EVENT_DISABLE_TIMING = 2
_CU_MEMHOSTALLOC_PORTABLE = 1
_CU_MEMHOSTREGISTER_PORTABLE = 1
_CU_MEMHOSTREGISTER_READ_ONLY = 8
_CUDA_ERROR_INVALID_VALUE = 1
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
_P = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuInit": (ctypes.c_uint,),
    "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(_P), ctypes.c_int),
    "cuDevicePrimaryCtxRelease_v2": (ctypes.c_int,),
    "cuCtxPushCurrent_v2": (_P,),
    "cuCtxPopCurrent_v2": (ctypes.POINTER(_P),),
    "cuStreamCreate": (ctypes.POINTER(_P), ctypes.c_uint),
    "cuStreamDestroy_v2": (_P,),
    "cuStreamSynchronize": (_P,),
    "cuMemcpyDtoHAsync_v2": (_P, ctypes.c_uint64, ctypes.c_size_t, _P),
    "cuMemcpyHtoDAsync_v2": (ctypes.c_uint64, _P, ctypes.c_size_t, _P),
    "cuEventCreate": (ctypes.POINTER(_P), ctypes.c_uint),
    "cuEventRecord": (_P, _P),
    "cuEventSynchronize": (_P,),
    "cuEventDestroy_v2": (_P,),
    "cuMemHostAlloc": (ctypes.POINTER(_P), ctypes.c_size_t, ctypes.c_uint),
    "cuMemFreeHost": (_P,),
    "cuMemHostRegister_v2": (_P, ctypes.c_size_t, ctypes.c_uint),
    "cuMemHostUnregister": (_P,),
    "cuMemGetAddressRange_v2": (ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                ctypes.c_uint64),
    "cuGetErrorString": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
}
_cuda_api: Any = None


def _cuda() -> Any:
    """The loaded CUDA driver's functions used here, with their signatures, by the names
    above (a `_v2` entry point falls back to the unversioned one where a driver lacks
    it); None when the driver is not loaded. Unsupported when it lacks one of them."""
    global _cuda_api
    if _cuda_api is None:
        driver = device._loaded_cuda_driver()
        if driver is None:
            return None
        functions: dict[str, Any] = {}
        for name, argtypes in _SIGNATURES.items():
            for symbol in dict.fromkeys((name, name.removesuffix("_v2"))):
                function = getattr(driver, symbol, None)
                if function is not None:
                    break
            else:
                raise Unsupported(f"the loaded CUDA driver has no {name}: too old for "
                                  "hixl's device path")
            function.argtypes = argtypes
            function.restype = ctypes.c_int
            functions[name] = function
        _cuda_api = types.SimpleNamespace(**functions)
    return _cuda_api


class CudaError(TransferFailed):
    """A CUDA driver call failed (`code` is its CUresult)."""


def _check(result: int, call: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _cuda_api.cuGetErrorString(result, ctypes.byref(text))
        reason = text.value.decode() if text.value else "unknown error"
        error = CudaError(f"{call} failed: CUDA error {result} ({reason})")
        error.code = result  # type: ignore[attr-defined]
        raise error


class CudaCopier(DeviceCopier):
    """Copies on one stream of device `ordinal`'s primary context (the CUDA runtime's, so
    torch's pointers and this stream agree). The stream is a blocking one (not
    CU_STREAM_NON_BLOCKING): it waits for work queued before on the legacy default stream,
    where torch writes a tensor unless told otherwise, so a PUT never reads bytes a kernel
    has yet to write there. Work the caller queued on streams of its own must be complete
    (synchronized) before the transfer. Every call pushes the context on the calling
    thread and pops it after, leaving the caller's current context as it was."""

    def __init__(self, ordinal: int) -> None:
        api = _cuda()
        if api is None:
            raise Unsupported("the CUDA driver is not loaded in this process: no CUDA "
                              "memory can exist here")
        self._api = api
        self.device = f"cuda:{ordinal}"
        _check(api.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        _check(api.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
        self._dev = dev.value
        ctx = _P()
        _check(api.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self._dev),
               "cuDevicePrimaryCtxRetain")
        self._ctx = ctx
        self._stream = _P()
        self._closed = False
        with self._current():
            _check(api.cuStreamCreate(ctypes.byref(self._stream), _CU_STREAM_DEFAULT),
                   "cuStreamCreate")

    def _current(self) -> Any:
        copier = self

        class _Push:
            def __enter__(self) -> None:
                _check(copier._api.cuCtxPushCurrent_v2(copier._ctx), "cuCtxPushCurrent")

            def __exit__(self, *exc: object) -> None:
                popped = _P()
                copier._api.cuCtxPopCurrent_v2(ctypes.byref(popped))

        return _Push()

    def to_host(self, host_addr: int, device_addr: int, nbytes: int) -> None:
        with self._current():
            _check(self._api.cuMemcpyDtoHAsync_v2(host_addr, device_addr, nbytes, self._stream),
                   f"cuMemcpyDtoHAsync({device_addr:#x} -> {host_addr:#x}, {nbytes})")

    def to_device(self, device_addr: int, host_addr: int, nbytes: int) -> None:
        with self._current():
            _check(self._api.cuMemcpyHtoDAsync_v2(device_addr, host_addr, nbytes, self._stream),
                   f"cuMemcpyHtoDAsync({host_addr:#x} -> {device_addr:#x}, {nbytes})")

    def record(self) -> Any:
        event = _P()
        with self._current():
            _check(self._api.cuEventCreate(ctypes.byref(event), _CU_EVENT_DISABLE_TIMING),
                   "cuEventCreate")
            _check(self._api.cuEventRecord(event, self._stream), "cuEventRecord")
        return event

    def wait(self, event: Any, deadline: float) -> None:
        """cuEventSynchronize (ctypes drops the GIL): copies are bounded DMA work, so the
        deadline is checked after, as on the mapped host path."""
        with self._current():
            try:
                _check(self._api.cuEventSynchronize(event), "cuEventSynchronize")
            finally:
                self._api.cuEventDestroy_v2(event)
        if time.monotonic() > deadline:
            raise TransferTimeout(f"device copies on {self.device} finished past the deadline")

    def host_alloc(self, nbytes: int) -> int:
        pointer = _P()
        with self._current():
            _check(self._api.cuMemHostAlloc(ctypes.byref(pointer), nbytes,
                                            _CU_MEMHOSTALLOC_PORTABLE), f"cuMemHostAlloc({nbytes})")
        return int(pointer.value or 0)

    def host_free(self, addr: int) -> None:
        with self._current():
            _check(self._api.cuMemFreeHost(addr), "cuMemFreeHost")

    def host_register(self, addr: int, nbytes: int, readonly: bool) -> bool:
        flags = _CU_MEMHOSTREGISTER_PORTABLE | (_CU_MEMHOSTREGISTER_READ_ONLY if readonly else 0)
        with self._current():
            result = self._api.cuMemHostRegister_v2(addr, nbytes, flags)
        if result != 0:
            log.warning("cuMemHostRegister of the mapped range [%#x, +%d) failed (CUDA error "
                        "%d): copies to it go through the driver's staging", addr, nbytes, result)
            return False
        return True

    def host_unregister(self, addr: int) -> None:
        with self._current():
            _check(self._api.cuMemHostUnregister(addr), "cuMemHostUnregister")

    def check_range(self, addr: int, nbytes: int, what: str) -> None:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        with self._current():
            result = self._api.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                       addr)
        if result != 0:
            raise ParamInvalid(f"{what} at {addr:#x} is no longer {self.device} memory (CUDA "
                               f"error {result}): freed after registration? Register it again")
        if addr + nbytes > base.value + size.value:
            raise OutOfRange(f"{what} [{addr:#x}, +{nbytes}) runs past its {self.device} "
                             f"allocation [{base.value:#x}, +{size.value}): freed or resized "
                             "after registration? Register it again")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._current():
            self._api.cuStreamSynchronize(self._stream)
            self._api.cuStreamDestroy_v2(self._stream)
        self._api.cuDevicePrimaryCtxRelease_v2(self._dev)


# ------------------------------------------------------------------ the staging ring


class StagingRing:
    """`config.slots` host buffers of `config.slot_bytes` (one host_alloc), allocated on
    first use, reused by every later transfer, one transfer at a time; freed by close."""

    def __init__(self, copier: DeviceCopier, config: StagingConfig) -> None:
        self.copier = copier
        self.config = config
        self._base: int | None = None
        self._lock = threading.Lock()
        self.allocations = 0  # host_alloc calls (1 while the ring is reused)
        self.transfers = 0  # transfers it served
        self.closed = False

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    @property
    def allocated(self) -> bool:
        return self._base is not None

    def acquire(self, deadline: float) -> list[int]:
        """The slots' addresses, once no other transfer holds the ring (TransferTimeout
        past `deadline`)."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeout(f"the staging ring of {self.copier.device} stayed busy "
                                  "with other transfers until the deadline")
        try:
            if self.closed:
                raise NotConnected("the engine is closed: its staging ring is freed")
            if self._base is None:
                self._base = self.copier.host_alloc(self.config.total_bytes)
                self.allocations += 1
        except BaseException:
            self._lock.release()
            raise
        self.transfers += 1
        step = self.config.slot_bytes
        return [self._base + i * step for i in range(self.config.slots)]

    def release(self, in_flight: Sequence[Any]) -> None:
        """Give the ring back once no copy uses it: the copies still queued (after an
        error) are waited for first. A copier that never finishes them (wedged) keeps the
        old buffer (never freed under a copy); a new one is allocated next time."""
        try:
            for event in in_flight:  # every one, also after one reports a failed copy
                try:
                    self.copier.wait(event, time.monotonic() + DRAIN_S)
                except HixlError as exc:
                    if not isinstance(exc, TransferFailed) or isinstance(exc, CudaError):
                        log.error("staging ring of %s: copies did not drain (%s); its "
                                  "buffer is abandoned", self.copier.device, exc)
                        self._base = None
                        break
        finally:
            self._lock.release()

    def close(self) -> None:
        if not self._lock.acquire(timeout=DRAIN_S):
            log.error("staging ring of %s still busy at close; its buffer is abandoned",
                      self.copier.device)
            self.closed = True
            return
        try:
            self.closed = True
            if self._base is not None:
                self.copier.host_free(self._base)
                self._base = None
        finally:
            self._lock.release()


@dataclass(slots=True)
class _Piece:
    """The part of an op that one slot carries: `length` bytes at `offset` in the slot,
    from/to `device_addr`, to/from `remote_addr` of `segment`."""

    index: int
    device_addr: int
    segment: Any
    remote_addr: int
    length: int
    offset: int


def plan_chunks(items: Sequence[Item], slot_bytes: int) -> list[list[_Piece]]:
    """The ops cut and packed into slot-sized chunks, in order (an op larger than a slot
    spans several chunks; small ops share one)."""
    chunks: list[list[_Piece]] = []
    current: list[_Piece] = []
    used = 0
    for item in items:
        done = 0
        while done < item.length:
            if used == slot_bytes:
                chunks.append(current)
                current, used = [], 0
            length = min(item.length - done, slot_bytes - used)
            current.append(_Piece(item.index, item.local_addr + done, item.segment,
                                  item.remote_addr + done, length, used))
            used += length
            done += length
    if current:
        chunks.append(current)
    return chunks


def staged_transfer(copier: DeviceCopier, ring: StagingRing, socket: Transport,
                    op: TransferOp, items: Sequence[Item], deadline: float) -> None:
    """Move device-side `items` over `socket` through `ring`, pipelined.

    PUT: the copies of the first `slots` chunks are queued at once; then for each chunk,
    wait for its copy, send it, and queue the copy of the chunk `slots` later into the slot
    just sent (so the copy of chunk i+1 runs while chunk i is sent). GET: receive chunk i
    into its slot (once that slot's previous copy to the device is done), queue its copy to
    the device, go on receiving chunk i+1 meanwhile. A failure fails every op of the call
    (`.failed`) and the ring is given back only once no copy uses it."""
    chunks = plan_chunks(items, ring.config.slot_bytes)
    trace = copier.trace or _no_trace
    try:
        slots = ring.acquire(deadline)
    except HixlError as exc:
        exc.failed = sorted({item.index for item in items})
        raise
    count = len(slots)
    pending: list[Any] = [None] * count  # the event of each slot's queued copies
    order: list[int] = []  # the chunks whose copies are pending, oldest first

    def socket_items(chunk: list[_Piece], base: int) -> list[Item]:
        return [Item(p.index, base + p.offset, p.segment, p.remote_addr, p.length)
                for p in chunk]

    try:
        if op is TransferOp.WRITE:
            def stage(k: int) -> None:
                base = slots[k % count]
                trace("stage", k)
                for piece in chunks[k]:
                    copier.to_host(base + piece.offset, piece.device_addr, piece.length)
                pending[k % count] = copier.record()

            for k in range(min(count, len(chunks))):
                stage(k)
            for k, chunk in enumerate(chunks):
                slot = k % count
                copier.wait(pending[slot], deadline)
                pending[slot] = None
                trace("staged", k)
                trace("send", k)
                socket.transfer(op, socket_items(chunk, slots[slot]), deadline)
                trace("sent", k)
                if k + count < len(chunks):
                    stage(k + count)
        else:
            for k, chunk in enumerate(chunks):
                slot = k % count
                if pending[slot] is not None:  # the slot's last chunk is on the device
                    copier.wait(pending[slot], deadline)
                    pending[slot] = None
                    trace("unstaged", order.pop(0))
                trace("recv", k)
                socket.transfer(op, socket_items(chunk, slots[slot]), deadline)
                trace("received", k)
                for piece in chunk:
                    copier.to_device(piece.device_addr, slots[slot] + piece.offset,
                                     piece.length)
                pending[slot] = copier.record()
                order.append(k)
                trace("unstage", k)
            for k in list(order):
                copier.wait(pending[k % count], deadline)
                pending[k % count] = None
                trace("unstaged", order.pop(0))
    except HixlError as exc:
        exc.failed = sorted({item.index for item in items})
        raise
    finally:
        ring.release([event for event in pending if event is not None])


# ------------------------------------------------------------------ an engine's device side


class DevicePaths:
    """What an Engine keeps for device memory: a copier per device, a staging ring per
    copier. `copier` (given): every device registration uses it (the tests' HostStandIn,
    or one chosen CudaCopier); else CUDA memory gets a CudaCopier of its device, made on
    first use, and other device memory is refused."""

    def __init__(self, config: StagingConfig | None = None,
                 copier: DeviceCopier | None = None) -> None:
        self.config = config or StagingConfig()
        self._given = copier
        self._copiers: dict[str, DeviceCopier] = {}
        self._rings: dict[int, StagingRing] = {}
        self._lock = threading.Lock()
        self._closed = False

    def copier_for(self, placement: device.Placement | None, what: str) -> DeviceCopier:
        """The copier serving device memory at `placement` (None: where the caller said
        MEM_DEVICE of memory that does not say where it lives). Raises Unsupported (no
        copier for it) or ParamInvalid (another device than the copier's stream)."""
        if self._given is not None:
            if placement is not None and not placement.is_host and \
                    not device.same_device(placement, self._given.device):
                raise ParamInvalid(
                    f"{what} is on {placement.device}, but this engine's device copier streams "
                    f"on {self._given.device}: register memory of that device, or give the "
                    "engine a copier of this one")
            return self._given
        if placement is None or placement.is_host:
            raise Unsupported(
                f"MEM_DEVICE registration of {what}: the CUDA driver does not place it on a "
                "device, and this engine has no device copier for it; register host memory "
                "with MemType.MEM_HOST, or a device tensor / pointer")
        kind, _, index = placement.device.partition(":")
        if kind != "cuda" or _cuda() is None:
            device.require_host(placement, what)
        with self._lock:
            if self._closed:
                raise NotConnected("the engine is closed")
            copier = self._copiers.get(placement.device)
            if copier is None:
                try:
                    copier = CudaCopier(int(index or 0))
                except CudaError as exc:
                    raise Unsupported(f"{what} is {placement.device} device memory, and its "
                                      f"copy stream could not be set up: {exc}") from None
                self._copiers[placement.device] = copier
            return copier

    def ring(self, copier: DeviceCopier) -> StagingRing:
        with self._lock:
            if self._closed:
                raise NotConnected("the engine is closed: its staging ring is freed")
            ring = self._rings.get(id(copier))
            if ring is None:
                ring = self._rings[id(copier)] = StagingRing(copier, self.config)
            return ring

    def staged(self, socket: Transport, op: TransferOp, items: Sequence[Item],
               copier: DeviceCopier, deadline: float) -> None:
        staged_transfer(copier, self.ring(copier), socket, op, items, deadline)

    def close(self) -> None:
        """Free every staging ring (once its transfer is over), then the copiers made here
        (a given copier belongs to its caller)."""
        with self._lock:
            self._closed = True
            rings, self._rings = list(self._rings.values()), {}
            copiers, self._copiers = list(self._copiers.values()), {}
        for ring in rings:
            ring.close()
        for copier in copiers:
            try:
                copier.close()
            except HixlError as exc:
                log.warning("closing device copier %s: %s", copier.device, exc)
