"""`hixl.shmem`: an OpenSHMEM-like symmetric-memory API on the hixl engine.

A job is `n_pes` processing elements (PEs, numbered 0..n_pes-1), each a process with its
own `Engine` (embedded agent) in registry mode against one `hixl-master` (the
*bootstrap*). Each PE allocates one *symmetric heap* with `Engine.malloc` (a shareable
memfd), registers it, and publishes it under the segment name
``hixl-shmem/<job>/<pe>/<n_pes>``; every PE finds every other PE's heap in the registry's
global table, so init needs no other rendezvous. Peers on the same node map each other's
heaps (the fabric path: one memmove per op), others stream over TCP.

Heap layout (offsets from the heap's base, the same on every PE):

    [0, control)               control words, written only by this module, one per
                               PE each: barrier epoch, allocation digest (two
                               parities), departure word, pad (lead writes); then this
                               PE's scratch words (8-byte values staged for transfers)
    [control, control + heap_size)   symmetric objects, bump-allocated

**Symmetric allocation.** `malloc` / `create_tensor` / `create_signal` are collective:
every PE must make the same calls, with the same sizes, in the same order. The
allocator is a deterministic bump pointer (64-byte alignment, 4 KiB for objects of
1 MiB and more), so the same sequence gives the same offsets everywhere, with no
communication. The contract is checked cheaply: every PE folds each allocation
(offset, size) into a digest, and every `barrier_all` compares all PEs' digests — a
disagreement raises `SymmetryError` naming the PEs, at the first barrier after it.

**Signals** are symmetric int64 arrays of one slot per *sender* PE. There is no atomic
read-modify-write on shared memory from Python, and funnelling signals through an agent
would serialise them, so no two PEs ever write the same 8 bytes: sender j only writes
slot j, and the signal's value is the sum of the slots, computed by the waiter.
ADD reads the sender's own slot at the target and writes back slot + value (single
writer, so nothing is lost between senders; reading the slot back, one round trip on
TCP, rather than keeping a running total in the sender is what lets the owner `clear` a
signal without telling its senders); SET writes value into the sender's slot.
So SET sets *this sender's contribution*: with one sender (the usual flag) the signal
then reads exactly `value`; SETs from two PEs to one signal are both kept (the signal
reads their sum, never a torn or lost value) — unlike OpenSHMEM's last-writer-wins,
which needs an atomic. `clear(sig)` on the owner zeroes all slots; it must not race
with signals being sent to it (order it with a barrier or a handshake, as in OpenSHMEM).

**Torn values.** Signal slots and control words change by one aligned 8-byte copy,
and the waiter reads each with one 8-byte load. On the fabric path the copy is a memmove
of 8 aligned bytes: one 8-byte store (glibc's small-copy path), single-copy atomic on
x86-64 and arm64. On the socket path the agent applies a small WRITE payload either by
one memmove from its receive ring (when it came in with its header) or by receiving it
straight into the segment (after a large payload the agent reads the next header alone)
— a kernel copy that may be `rep movsb`, which promises no 8-byte store. So each word
write over a socket is preceded, in the same batch, by a *lead* write of 8 bytes into a
pad word (`_word_ops`): the agent receives the lead's payload with a greedy read that
brings the word's whole frame (they left in one sendmsg, one TCP segment) into its
ring, and the word lands by one memmove from there.

**Ordering.** A signal sent after puts is never seen before their bytes landed, on
either path: `signal` first completes (`quiet`s) every outstanding operation to that PE
— a completed WRITE is acknowledged only once every byte is in the target's memory,
however many connections a large transfer was striped over — and only then writes the
slot. Stream order is never relied on. A lock round trip on both sides (`_fence`) keeps
weakly-ordered CPUs from reordering the payload and signal accesses.

**Barrier.** `barrier_all` quiets, then each PE writes its allocation digest and then
its barrier epoch (a counter bumped per barrier) into its own slot on every PE, and
waits until every slot holds at least that epoch: correct under repeated use, since
epochs only grow, and a PE can be at most one barrier ahead of a waiter. Digests
alternate between two slots by epoch parity, so a PE already in the next barrier
cannot overwrite the digest a slower PE is about to compare.

**The last barrier.** A PE gets through barrier N once every epoch in *its own* slots
is at least N, and may then finalize while a slower PE, still in barrier N, has yet to
see some epoch (the writes go out concurrently) or read this PE's epoch just before it
landed. So the departure word carries 1 + the last barrier its PE got through, and a
departed PE counts as in every barrier up to that one: "finalized before barrier N"
only when that is below N and the PE's epoch, read *after* the departure word, is too
(it wrote its epoch before its departure, so nothing of it is still on its way). And a
write that fails to a PE which has since finalized is no error (it will never read it;
often it did, and its heap went away right after): the wait judges whether it got there.

**Failure.** Every wait has a deadline (init's `timeout`, 30 s by default) and raises a
typed error naming the problem; `.failed` lists the PE numbers concerned. A waiter
checks the registry's global table while it sleeps: a PE whose engine left the table
(killed: its lease expired, `lease_ttl_ms`) raises `PeerUnavailable` naming it. A PE
that left cleanly (`finalize`) first writes its *departure word* on every PE, so peers
still finishing the last barrier do not mistake it for a death; a PE that finalized
before a barrier the others are in is PeerUnavailable to them at once.

**Local buffers.** put/get take a symmetric object (or a numpy view inside the heap)
on the remote side and any contiguous buffer on the local side. A local buffer inside
the heap is used in place; any other is registered with the engine on first use and the
registration cached by address range (at most `MAX_CACHED_REGISTRATIONS`, least recently
used evicted when no non-blocking op is outstanding; all dropped at finalize). Why not a
bounce buffer: non-blocking ops would need staging slots held until `quiet` and an
extra copy of every byte; a cached registration costs one registration per buffer and
then nothing per op. The cache keeps the buffer object alive while it is cached. A numpy
view is registered as the whole (contiguous) array it views, so the blocks of one KV
cache, each passed as a view, share a single registration.

**Batches.** `put_batch(pairs, pe)` / `get_batch(pairs, pe)` move many (dst, src) pairs,
each what put/get takes, to or from one PE in *one* engine call (one `transfer`, or one
`transfer_async` with `nbi=True`, completed by `quiet`): the engine then resolves, routes
and stripes them together, instead of paying a call (and on a socket a round trip) per
pair. Every pair is checked first, so a bad pair raises naming its index with nothing
moved; pairs to this PE are local copies. The PE-level ordering (signal after quiet) is
unchanged: a batch is one outstanding op to its PE. An `ArrayBatch` (offset arrays into
one dst and one src) replaces the pairs where there are hundreds of moves (the pages of a
KV cache, the rows of a MoE dispatch): it is checked with a few array operations and sent
as one `Engine.transfer_arrays` call, with no Python work per move.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import math
import operator
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hixl.errors import (
    ConfigError,
    HixlError,
    NotConnected,
    OutOfRange,
    ParamInvalid,
    PeerUnavailable,
    ResourceExhausted,
    TransferFailed,
    TransferTimeout,
)
from hixl.memory import BufferRange, buffer_range, copy_arrays, copy_moves, round_up
from hixl.types import TransferOp, TransferOpDesc

log = logging.getLogger("hixl.shmem")

# set by `hixl shmem-run` (hixl.tools.shmem_run) for every PE it starts
PE_ENV, N_PES_ENV, BOOTSTRAP_ENV = "HIXL_SHMEM_PE", "HIXL_SHMEM_N_PES", "HIXL_SHMEM_BOOTSTRAP"
JOB_ENV = "HIXL_SHMEM_JOB"  # the job id when init() gets none and bootstrap names none
DEFAULT_JOB = "default"
SEGMENT_PREFIX = "hixl-shmem"
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_LEASE_TTL_MS = 3000  # a killed PE leaves the global table within this
ALIGN = 64  # one cache line: no two objects share one, and int64 slots stay aligned
LARGE_OBJECT = 1 << 20  # objects this big start on a page
LARGE_ALIGN = 4096
MAX_CACHED_REGISTRATIONS = 32
SPIN_POLLS = 64  # polls before a waiter starts sleeping
SLEEP_FIRST_S = 10e-6
SLEEP_MAX_S = 1e-3
_WORD = 8
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class SymmetryError(ParamInvalid):
    """PEs disagreed on a collective call (different allocations before a barrier)."""


class Cmp(enum.Enum):
    """Comparisons for `wait_until` (OpenSHMEM's SHMEM_CMP_*)."""

    EQ = "=="
    NE = "!="
    GT = ">"
    GE = ">="
    LT = "<"
    LE = "<="


class SignalOp(enum.Enum):
    """How `signal` updates a signal (OpenSHMEM's SHMEM_SIGNAL_SET / _ADD)."""

    SET = "set"
    ADD = "add"


EQ, NE, GT, GE, LT, LE = Cmp.EQ, Cmp.NE, Cmp.GT, Cmp.GE, Cmp.LT, Cmp.LE
SET, ADD = SignalOp.SET, SignalOp.ADD

_TESTS: dict[Cmp, Callable[[int, int], bool]] = {
    Cmp.EQ: operator.eq, Cmp.NE: operator.ne, Cmp.GT: operator.gt,
    Cmp.GE: operator.ge, Cmp.LT: operator.lt, Cmp.LE: operator.le,
}


def _check_cmp(cmp: Any) -> Cmp:
    if isinstance(cmp, Cmp):
        return cmp
    if isinstance(cmp, str):
        for member in Cmp:
            if cmp.upper() == member.name or cmp == member.value:
                return member
    raise ParamInvalid(f"cmp must be one of {', '.join(m.name for m in Cmp)} (hixl.shmem.Cmp), "
                       f"got {cmp!r}")


def _check_op(op: Any) -> SignalOp:
    if isinstance(op, SignalOp):
        return op
    if isinstance(op, str) and op.lower() in ("set", "add"):
        return SignalOp(op.lower())
    raise ParamInvalid(f"signal op must be SET or ADD (hixl.shmem.SignalOp), got {op!r}")


def _check_int64(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ParamInvalid(f"{what} must be an integer, got {value!r}")
    value = int(value)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ParamInvalid(f"{what} {value} does not fit a signed 64-bit signal")
    return value


def _wrap64(value: int) -> int:
    """Two's-complement int64 wrap-around, as a C int64 signal would."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ParamInvalid(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier from Python: a lock's release and the next acquire are a
    release-store then an acquire-load, which no CPU reorders around other accesses.
    Free on x86-64 (TSO); keeps arm64 from letting a payload read overtake a signal read."""
    with _FENCE:
        pass
    with _FENCE:
        pass


def parse_bootstrap(bootstrap: Any) -> tuple[str, str]:
    """("host:port" of the registry, job named after a '/' or ""), from "host:port[/job]"."""
    from hixl.client.engine import parse_engine_name

    if not isinstance(bootstrap, str) or not bootstrap:
        raise ParamInvalid(f"bootstrap must be the registry address 'host:port[/job]' (a "
                           f"running hixl-master), got {bootstrap!r}")
    registry, _, job = bootstrap.partition("/")
    _, port = parse_engine_name(registry)
    if port <= 0:
        raise ParamInvalid(f"bootstrap {bootstrap!r} needs the registry's port: 'host:port'")
    return registry, job


def _local_host_toward(registry: str) -> str:
    """The address this host uses to reach the registry (a UDP connect sends nothing):
    the interface peers on other hosts can reach this PE on."""
    from hixl.client.engine import parse_engine_name

    host, port = parse_engine_name(registry)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            address = probe.getsockname()[0]
    except OSError as exc:
        raise ParamInvalid(f"cannot find a local address toward the bootstrap {registry}: "
                           f"{exc}; pass host=") from None
    return f"[{address}]" if family == socket.AF_INET6 else address


def segment_name(job: str, pe: int, n_pes: int) -> str:
    """The published name of a PE's heap: job, PE number and job size."""
    return f"{SEGMENT_PREFIX}/{job}/{pe}/{n_pes}"


class SymmetricObject:
    """A symmetric allocation: the same `offset` and size in every PE's heap.

    `local` is a numpy view of this PE's copy (shape, dtype). Indexing along the first
    axis (`obj[i]`, `obj[a:b]`, step 1) gives the symmetric sub-object, usable wherever
    the whole one is. `SymmetricTensor` is the same class (create_tensor's name for it).
    """

    __slots__ = ("ctx", "offset", "nbytes", "shape", "dtype", "name")

    def __init__(self, ctx: ShmemContext, offset: int, shape: tuple[int, ...],
                 dtype: np.dtype, name: str = "") -> None:
        self.ctx = ctx
        self.offset = offset
        self.shape = shape
        self.dtype = dtype
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.name = name

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return (f"{type(self).__name__}{label}(offset={self.offset}, nbytes={self.nbytes}, "
                f"shape={self.shape}, dtype={self.dtype})")

    @property
    def local(self) -> np.ndarray:
        """This PE's copy, as a numpy array viewing the heap (no copy)."""
        heap = self.ctx._heap_view()
        return heap[self.offset:self.offset + self.nbytes].view(self.dtype).reshape(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d symmetric object")
        return self.shape[0]

    def __getitem__(self, index: int | slice) -> SymmetricObject:
        if not self.shape:
            raise ParamInvalid(f"{self!r} is 0-d: it cannot be indexed")
        rows, rest = self.shape[0], self.shape[1:]
        row_bytes = math.prod(rest) * self.dtype.itemsize
        if isinstance(index, slice):
            start, stop, step = index.indices(rows)
            if step != 1:
                raise ParamInvalid("symmetric objects slice with step 1 only (contiguous ranges)")
            stop = max(start, stop)
            shape = (stop - start, *rest)
        elif isinstance(index, int | np.integer) and not isinstance(index, bool):
            start = int(index) + rows if index < 0 else int(index)
            if not 0 <= start < rows:
                raise OutOfRange(f"index {index} is out of range for {rows} rows of {self!r}")
            shape = rest
        else:
            raise ParamInvalid(f"symmetric objects index by int or slice along the first axis, "
                               f"got {index!r}")
        return SymmetricObject(self.ctx, self.offset + start * row_bytes, shape, self.dtype,
                               self.name)


SymmetricTensor = SymmetricObject


@dataclass(frozen=True)
class ArrayBatch:
    """Many moves between one `dst` and one `src`, as arrays: move i copies `lengths[i]`
    bytes from byte `src_offsets[i]` of `src` to byte `dst_offsets[i]` of `dst`.

    `dst` and `src` are what put/get take (for put_batch: `dst` symmetric, `src` any
    contiguous local buffer; for get_batch the other way round); offsets and lengths are
    integer arrays (numpy or sequences) of one length, `lengths` may be one int. Why:
    the pages of a KV cache, a batch of hundreds of moves, are then checked with a few
    numpy operations (one registration, one bounds check per array), not one Python call
    per page; zero-length moves are skipped, as empty pairs are.
    """

    dst: Any
    src: Any
    dst_offsets: Any
    src_offsets: Any
    lengths: Any


def _registration_of(obj: Any, buf: BufferRange) -> tuple[Any, BufferRange]:
    """What to register for local buffer `obj`: the outermost numpy array it is a view
    of, when that is contiguous, contains it and is writable wherever `obj` is — so a
    block view and its neighbours share one registration — else `obj` itself."""
    root = obj
    while isinstance(root, np.ndarray) and isinstance(root.base, np.ndarray):
        root = root.base
    if root is obj or not isinstance(root, np.ndarray) or not root.flags.c_contiguous:
        return obj, buf
    whole = buffer_range(root)
    if whole.addr <= buf.addr and buf.addr + buf.length <= whole.addr + whole.length and \
            (buf.readonly or not whole.readonly):
        return root, whole
    return obj, buf


class SymmetricSignal(SymmetricObject):
    """A signal: int64[n_pes], slot j written only by PE j; its value is their sum."""

    __slots__ = ()

    def value(self) -> int:
        """This PE's current value of the signal (the sum of the senders' slots)."""
        return int(self.local.sum())


class ShmemContext:
    """One PE of a job: its engine, its symmetric heap, and the peers' heaps.

    Collective calls (the constructor, malloc, create_tensor, create_signal,
    barrier_all, finalize) must be made by every PE in the same order.
    """

    def __init__(self, my_pe: int, n_pes: int, bootstrap: str,
                 heap_size: int | str = "64MiB", *, job: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, host: str | None = None,
                 lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS, local_paths: bool = True) -> None:
        """Start this PE: engine, heap, find every peer's heap, then a first barrier.

        `bootstrap`: the hixl-master "host:port", optionally "/job". The job id keeps
        parallel jobs on one master apart: `job`, else the bootstrap's "/job", else
        $HIXL_SHMEM_JOB, else "default". `heap_size`: usable symmetric bytes (an int or
        a text like "64MiB"). `timeout`: every wait's default deadline, init's too; a PE
        not seen by then raises TransferTimeout whose `.failed` lists the missing PEs.
        `host`: the address this PE serves on (default: the one that reaches the
        bootstrap). `lease_ttl_ms`: how soon a killed PE leaves the global table.
        `local_paths=False` reaches same-node PEs over TCP too (tests, benchmarks).
        """
        from hixl.sizes import parse_size

        if isinstance(n_pes, bool) or not isinstance(n_pes, int) or n_pes < 1:
            raise ParamInvalid(f"n_pes must be an integer >= 1, got {n_pes!r}")
        if isinstance(my_pe, bool) or not isinstance(my_pe, int) or not 0 <= my_pe < n_pes:
            raise ParamInvalid(f"my_pe must be an integer in 0..{n_pes - 1} (n_pes={n_pes}), "
                               f"got {my_pe!r}")
        try:
            heap = parse_size(heap_size)
        except ConfigError as exc:
            raise ParamInvalid(f"heap_size: {exc.args[0]}") from None
        self.timeout = _positive(timeout, "timeout")
        if isinstance(lease_ttl_ms, bool) or not isinstance(lease_ttl_ms, int) or lease_ttl_ms <= 0:
            raise ParamInvalid(f"lease_ttl_ms must be a positive integer, got {lease_ttl_ms!r}")
        registry, boot_job = parse_bootstrap(bootstrap)
        job = job if job is not None else boot_job or os.environ.get(JOB_ENV) or DEFAULT_JOB
        if not isinstance(job, str) or not job or "/" in job:
            raise ParamInvalid(f"job must be a non-empty name without '/', got {job!r}")
        self.my_pe, self.n_pes, self.job, self.heap_size = my_pe, n_pes, job, heap
        self.bootstrap = registry
        # control words: barrier epochs, digests (2 parities), departed flags: n each
        self._barrier_at = 0
        self._digest_at = n_pes * _WORD
        self._departed_at = 3 * n_pes * _WORD
        self._pad_at = 4 * n_pes * _WORD  # lead writes land here (see _word_ops)
        self._scratch_at = 5 * n_pes * _WORD  # 8 words this PE stages 8-byte values in
        self._heap_start = round_up(self._scratch_at + 8 * _WORD, LARGE_ALIGN)
        self._heap_end = self._heap_start + heap
        self._top = self._heap_start
        self._allocations = 0
        self._crc = 0
        self._epoch = 0
        self._passed = 0  # the last barrier whose wait this PE got through
        self._lock = threading.RLock()
        self._outstanding: dict[int, list[tuple[Any, str]]] = {}
        self._cache: dict[tuple[int, int], Any] = {}  # (addr, length) -> MemHandle, LRU order
        self._busy = 0  # put/get calls between registration and done: no eviction meanwhile
        self._finalized = False
        self._peers: dict[int, tuple[str, int, int]] = {}  # pe -> (engine, heap base, epoch)
        self._socket_path: dict[int, bool] = {}  # pe -> reached through the agent's socket
        self._engine = self._start_engine(registry, host, lease_ttl_ms, local_paths)
        try:
            self._heap = self._engine.malloc(self._heap_end)
            self._heap_array = np.frombuffer(self._heap.view(), dtype=np.uint8)
            self._heap_addr = self._heap.addr
            self._heap_handle = self._engine.register(
                self._heap, name=segment_name(job, my_pe, n_pes))
            self._find_peers()
            for pe, (engine, base, _) in sorted(self._peers.items()):
                if pe != my_pe:
                    self._engine.connect(engine, timeout=self.timeout)
                    self._socket_path[pe] = self._engine.route(engine, base) != "fabric"
            self.barrier_all()
        except BaseException:
            self._finalized = True
            self._engine.close()
            raise

    # ------------------------------------------------------------------ setup

    def _start_engine(self, registry: str, host: str | None, lease_ttl_ms: int,
                      local_paths: bool) -> Any:
        """An engine whose embedded agent (a free port) serves the heap and publishes it
        to the registry it also follows; fabric and unix-socket paths unless told not to."""
        from hixl.client.engine import Engine, embedded_agent_config

        host = host or _local_host_toward(registry)
        config = embedded_agent_config(host=host.strip("[]"), grpc_port=0, data_port=0,
                                       data_unix=local_paths, master=registry,
                                       lease_ttl_ms=lease_ttl_ms)
        return Engine(host, {"EnableUseFabricMem": "1" if local_paths else "0"},
                      agent_config=config, registry=registry)

    def _scan(self) -> tuple[dict[int, list[tuple[str, Any, int]]], list[str]]:
        """PE -> [(engine, segment, epoch)] claiming it in this job, and mismatches."""
        table = self._engine.global_table
        prefix = f"{SEGMENT_PREFIX}/{self.job}/"
        found: dict[int, list[tuple[str, Any, int]]] = {}
        problems: list[str] = []
        for engine, info in table.engines().items():
            view = table.view(engine)
            if view is None:
                continue
            for segment in view.segments():
                if not segment.name.startswith(prefix):
                    continue
                pe_text, _, n_text = segment.name[len(prefix):].partition("/")
                if not (pe_text.isdigit() and n_text.isdigit()):
                    continue
                pe, n_pes = int(pe_text), int(n_text)
                if n_pes != self.n_pes or pe >= n_pes:
                    problems.append(f"PE {pe} ({engine}) was started with n_pes={n_pes}, this "
                                    f"PE with n_pes={self.n_pes}")
                elif segment.length != self._heap_handle.length:
                    problems.append(f"PE {pe} ({engine}) has a {segment.length}-byte heap, "
                                    f"this PE {self._heap_handle.length} (heap_size must agree)")
                else:
                    found.setdefault(pe, []).append((engine, segment, info.epoch))
        return found, problems

    def _find_peers(self) -> None:
        """Wait (init's timeout) until each PE of the job shows its heap exactly once."""
        table = self._engine.global_table
        state: dict[str, Any] = {"seen": set(), "problems": {}}  # over the whole wait

        def complete(_: Any) -> bool:
            found, problems = self._scan()
            state["found"] = found
            state["seen"].update(found)
            state["problems"].update(dict.fromkeys(problems))
            return not problems and all(len(found.get(pe, ())) == 1 for pe in range(self.n_pes))

        if not table.wait_for(complete, self.timeout):
            found, problems = state.get("found", {}), list(state["problems"])
            if problems:
                raise ParamInvalid(f"job {self.job!r}: PEs disagree: {'; '.join(problems)}")
            # a PE seen and gone again most likely gave up its own init first: the
            # ones never seen are the ones to name
            never = [pe for pe in range(self.n_pes) if pe not in state["seen"]]
            left = [pe for pe in range(self.n_pes) if pe in state["seen"] and pe not in found]
            doubled = {pe: [e for e, _, _ in hits] for pe, hits in found.items() if len(hits) > 1}
            if never or left:
                also = f"; PE(s) {left} showed up and left again" if left else ""
                raise TransferTimeout(
                    f"job {self.job!r}: PE(s) {never} of {self.n_pes} did not show up in the "
                    f"registry {self.bootstrap} within {self.timeout:g} s (not started, wrong "
                    f"bootstrap/job, or crashed){also}", failed=never or left)
            raise ParamInvalid(
                f"job {self.job!r}: PE number(s) claimed by several engines: {doubled} (two PEs "
                "started with the same my_pe, or a crashed run's lease has not expired yet: "
                "use another job id)", failed=sorted(doubled))
        for pe, ((engine, segment, epoch),) in state["found"].items():
            self._peers[pe] = (engine, segment.base, epoch)

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._finalized:
            raise NotConnected(f"PE {getattr(self, 'my_pe', '?')} of job "
                               f"{getattr(self, 'job', '?')!r} is finalized")

    def _heap_view(self) -> np.ndarray:
        return self._heap_array

    def _check_pe(self, pe: Any) -> int:
        if isinstance(pe, bool) or not isinstance(pe, int | np.integer) or \
                not 0 <= int(pe) < self.n_pes:
            raise ParamInvalid(f"pe {pe!r} is out of range: job {self.job!r} has {self.n_pes} "
                               f"PEs (0..{self.n_pes - 1})")
        return int(pe)

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else _positive(timeout, "timeout")

    def _symmetric(self, obj: Any, what: str) -> tuple[int, int]:
        """(offset, nbytes) of a symmetric object, or of a numpy view inside the heap."""
        if isinstance(obj, SymmetricObject):
            if obj.ctx is not self:
                raise ParamInvalid(f"{what} {obj!r} belongs to another shmem context")
            return obj.offset, obj.nbytes
        try:
            buf = buffer_range(obj)
        except ParamInvalid as exc:
            raise ParamInvalid(f"{what} must be a symmetric object or a view of the "
                               f"symmetric heap: {exc.args[0]}") from None
        offset = buf.addr - self._heap_addr
        if not (self._heap_start <= offset and offset + buf.length <= self._heap_end):
            raise ParamInvalid(f"{what} is not symmetric: its {buf.length} bytes at "
                               f"{buf.addr:#x} are not inside the symmetric heap; allocate "
                               "it with malloc/create_tensor")
        return offset, buf.length

    def _local(self, obj: Any, what: str, *, writable: bool,
               evict: bool = True) -> tuple[int, int]:
        """(address, length) of local memory, registered with the engine if needed
        (`evict=False`: a batch still resolving its pairs; see _register)."""
        if isinstance(obj, SymmetricObject):
            offset, nbytes = self._symmetric(obj, what)
            return self._heap_addr + offset, nbytes
        try:
            buf = buffer_range(obj)
        except ParamInvalid as exc:
            raise ParamInvalid(f"{what}: {exc.args[0]}") from None
        if writable and buf.readonly:
            raise ParamInvalid(f"{what} is read-only: a get cannot land in it")
        if not buf.length:
            return buf.addr, 0
        offset = buf.addr - self._heap_addr
        if offset >= 0 and offset + buf.length <= self._heap_end:
            return buf.addr, buf.length  # in the heap: registered already
        self._register(obj, buf, evict=evict)
        return buf.addr, buf.length

    def _register(self, obj: Any, buf: BufferRange, *, evict: bool = True) -> None:
        """Register local memory once (cached by range; LRU-evicted when idle).

        A numpy view is registered as the whole array it views (see _registration_of), so
        the views of one buffer (a KV cache's blocks) share one registration. A batch
        resolves with `evict=False`: evicting could drop a registration an earlier pair of
        the same batch needs; the cache shrinks back at a later call.
        """
        addr, length = buf.addr, buf.length
        with self._lock:
            end = addr + length
            for key in list(self._cache):
                base, size = key
                if base <= addr and end <= base + size:
                    self._cache[key] = self._cache.pop(key)  # most recently used
                    return
            obj, buf = _registration_of(obj, buf)
            addr, length = buf.addr, buf.length
            end = addr + length
            overlapping = [k for k in self._cache if k[0] < end and addr < k[0] + k[1]]
            if overlapping:  # a registration may not overlap another: replace them
                if any(self._outstanding.values()):
                    self.quiet()
                for key in overlapping:
                    self._engine.deregister(self._cache.pop(key))
            self._cache[(addr, length)] = self._engine.register(
                obj, allowed_engines=[self._engine.name])
            if evict:
                self._trim_cache()

    def _trim_cache(self) -> None:
        """Evict least recently used registrations beyond the cap, only while no other
        put/get (the caller is one) and no nbi op runs."""
        with self._lock:
            if len(self._cache) > MAX_CACHED_REGISTRATIONS and self._busy <= 1 and \
                    not any(self._outstanding.values()):
                for key in list(self._cache)[:len(self._cache) - MAX_CACHED_REGISTRATIONS]:
                    self._engine.deregister(self._cache.pop(key))

    def _named(self, exc: HixlError, pe: int, what: str) -> HixlError:
        """The same error class, saying which PE it concerned (.failed = [pe]); any
        error to a PE whose heap left the global table is PeerUnavailable (the engine may
        first see the heap go, a miss: OutOfRange, then the engine)."""
        engine = self._peers.get(pe, ("?",))[0]
        cls = PeerUnavailable if self._gone(pe) else type(exc)
        try:
            named = cls(f"{what} PE {pe} ({engine}): {exc.args[0]}", failed=[pe])
        except TypeError:  # pragma: no cover - every HixlError takes (message, failed=)
            named = TransferFailed(f"{what} PE {pe} ({engine}): {exc}", failed=[pe])
        named.__cause__ = exc
        return named

    def _descs(self, pe: int, moves: Sequence[tuple[int, int, int]]) -> list[TransferOpDesc]:
        """(local address, symmetric offset, length) moves as the engine's ops on `pe`."""
        base = self._peers[pe][1]
        return [TransferOpDesc(local, base + offset, nbytes) for local, offset, nbytes in moves]

    def _transfer(self, pe: int, op: TransferOp, moves: Any, timeout: float,
                  what: str) -> None:
        """One engine call for every move to `pe` (a list of (local address, symmetric
        offset, length), or those three as arrays); returns when all bytes moved."""
        engine, base, _ = self._peers[pe]
        try:
            if isinstance(moves, _ArrayMoves):
                self._engine._transfer_ops(engine, op, _op_arrays(moves, base), timeout)
            else:
                self._engine.transfer(engine, op, self._descs(pe, moves), timeout)
        except HixlError as exc:
            raise self._named(exc, pe, what) from exc

    def _start(self, pe: int, op: TransferOp, moves: Any, timeout: float, what: str) -> Any:
        """One engine request for every move to `pe` (as in `_transfer`), tracked until
        `quiet`."""
        engine, base, _ = self._peers[pe]
        try:
            if isinstance(moves, _ArrayMoves):
                request = self._engine._transfer_ops(engine, op, _op_arrays(moves, base),
                                                     timeout, wait=False)
            else:
                request = self._engine.transfer_async(engine, op, self._descs(pe, moves),
                                                      timeout)
        except HixlError as exc:
            raise self._named(exc, pe, what) from exc
        with self._lock:
            self._outstanding.setdefault(pe, []).append((request, what))
        return request

    def _words(self, offset: int, count: int) -> np.ndarray:
        return self._heap_array[offset:offset + count * _WORD].view(np.int64)

    # ------------------------------------------------------------------ allocation

    def _allocate(self, nbytes: int, what: str) -> int:
        """Next offset for `nbytes` (deterministic: the same calls give the same offsets)."""
        align = LARGE_ALIGN if nbytes >= LARGE_OBJECT else ALIGN
        with self._lock:
            self._check_open()
            offset = round_up(self._top, align)
            if offset + nbytes > self._heap_end:
                left = max(0, self._heap_end - offset)
                raise ResourceExhausted(
                    f"symmetric heap exhausted: {what} needs {nbytes} bytes, {left} of "
                    f"{self.heap_size} left on PE {self.my_pe} (raise init's heap_size)")
            self._top = offset + nbytes
            self._allocations += 1
            self._crc = zlib.crc32(struct.pack("<QQ", offset, nbytes), self._crc)
        return offset

    def _digest(self) -> int:
        """This PE's allocation history as one int64: (count << 32) | crc32."""
        return _wrap64(((self._allocations & 0x7FFFFFFF) << 32) | self._crc)

    def malloc(self, nbytes: int, name: str = "") -> SymmetricObject:
        """Collective: `nbytes` of symmetric memory (uint8[nbytes]) at the same offset on
        every PE; initially zero (fresh memfd memory: the bump allocator never reuses)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int | np.integer) or nbytes <= 0:
            raise ParamInvalid(f"malloc needs a positive number of bytes, got {nbytes!r}")
        nbytes = int(nbytes)
        offset = self._allocate(nbytes, f"malloc({nbytes})")
        return SymmetricObject(self, offset, (nbytes,), np.dtype(np.uint8), name)

    def create_tensor(self, shape: int | Sequence[int], dtype: Any = np.float32,
                      name: str = "") -> SymmetricObject:
        """Collective: a symmetric array of `shape` and `dtype`; `.local` is its numpy view."""
        dims = _shape(shape)
        try:
            kind = np.dtype(dtype)
        except TypeError as exc:
            raise ParamInvalid(f"create_tensor: dtype {dtype!r} is not a numpy dtype: {exc}") \
                from None
        if kind.hasobject or kind.itemsize == 0:
            raise ParamInvalid(f"create_tensor needs a fixed-size plain dtype, got {kind}")
        nbytes = math.prod(dims) * kind.itemsize
        offset = self._allocate(nbytes, f"create_tensor({dims}, {kind})")
        return SymmetricObject(self, offset, dims, kind, name)

    def create_signal(self, name: str = "") -> SymmetricSignal:
        """Collective: a signal (int64[n_pes], one slot per sender), initially 0."""
        offset = self._allocate(self.n_pes * _WORD, "create_signal()")
        return SymmetricSignal(self, offset, (self.n_pes,), np.dtype(np.int64), name)

    def clear(self, sym: Any) -> None:
        """Zero this PE's copy of a symmetric object (or of a view of the heap)."""
        self._check_open()
        offset, nbytes = self._symmetric(sym, "clear's object")
        self._heap_array[offset:offset + nbytes] = 0

    # ------------------------------------------------------------------ put / get

    def put(self, dst: Any, src: Any, pe: int, *, timeout: float | None = None) -> None:
        """Copy local `src` (any contiguous buffer, or a symmetric object's local copy)
        into symmetric `dst` on PE `pe`; returns once the bytes are there."""
        self._put(dst, src, pe, timeout, blocking=True)

    def put_nbi(self, dst: Any, src: Any, pe: int, *, timeout: float | None = None) -> None:
        """`put` that returns at once; complete with `quiet` (src must not change until then)."""
        self._put(dst, src, pe, timeout, blocking=False)

    def get(self, dst: Any, src: Any, pe: int, *, timeout: float | None = None) -> None:
        """Copy symmetric `src` on PE `pe` into local `dst` (its size sets the length)."""
        self._get(dst, src, pe, timeout, blocking=True)

    def get_nbi(self, dst: Any, src: Any, pe: int, *, timeout: float | None = None) -> None:
        """`get` that returns at once; `dst` holds the data after `quiet`."""
        self._get(dst, src, pe, timeout, blocking=False)

    def put_batch(self, pairs: Sequence[tuple[Any, Any]] | ArrayBatch, pe: int, *,
                  nbi: bool = False, timeout: float | None = None) -> None:
        """Many puts to PE `pe` in one engine call: `pairs` is [(dst, src), ...], each as
        in `put`, or an `ArrayBatch` (offset arrays into one dst and one src). Every move
        is checked before any byte moves (a bad one raises, naming its index, with nothing
        moved). `nbi=True` returns at once, as put_nbi (complete with `quiet`). Moves whose
        destinations overlap land in no defined order."""
        self._batch("put_batch", pairs, pe, timeout, nbi)

    def get_batch(self, pairs: Sequence[tuple[Any, Any]] | ArrayBatch, pe: int, *,
                  nbi: bool = False, timeout: float | None = None) -> None:
        """Many gets from PE `pe` in one engine call: `pairs` is [(dst, src), ...], each as
        in `get`, or an `ArrayBatch`; checked, and `nbi`, as in put_batch."""
        self._batch("get_batch", pairs, pe, timeout, nbi)

    def _batch(self, what: str, pairs: Any, pe: int, timeout: float | None,
               nbi: bool) -> None:
        writing = what == "put_batch"
        with self._using_registrations():
            self._check_open()
            pe = self._check_pe(pe)
            wait = self._timeout(timeout)
            if isinstance(pairs, ArrayBatch):
                moves: Any = self._array_moves(what, pairs, pe, writing)
                empty = not moves.sizes.size
            else:
                moves = self._batch_moves(what, pairs, pe, writing)
                empty = not moves
            if empty:
                return
            if pe == self.my_pe:
                self._copy_here(moves, writing)
            else:
                op = TransferOp.WRITE if writing else TransferOp.READ
                where = f"{what}{' (nbi)' if nbi else ''} {'to' if writing else 'from'}"
                if nbi:
                    self._start(pe, op, moves, wait, where)
                else:
                    self._transfer(pe, op, moves, wait, where)
            self._trim_cache()  # the batch resolved without evicting (see _register)

    def _copy_here(self, moves: Any, writing: bool) -> None:
        """A batch to this PE: local copies (list moves, or the arrays of an ArrayBatch)."""
        heap = self._heap_addr
        if isinstance(moves, _ArrayMoves):
            local, sizes = moves.local, moves.sizes
            heap_at = moves.offsets + heap
            copy_arrays(heap_at, local, sizes) if writing else copy_arrays(local, heap_at, sizes)
            return
        copy_moves([(heap + offset, local, n) if writing else (local, heap + offset, n)
                    for local, offset, n in moves])

    def _array_moves(self, what: str, batch: ArrayBatch, pe: int, writing: bool
                     ) -> _ArrayMoves:
        """An ArrayBatch's non-empty moves and their spans, every one checked first with a
        few array operations: one registration of the local buffer, one bounds check per
        side. A bad move raises naming its index."""
        from hixl.client.engine import op_array

        remote, local = (batch.dst, batch.src) if writing else (batch.src, batch.dst)
        remote_name, local_name = ("dst", "src") if writing else ("src", "dst")
        try:
            offset, room = self._symmetric(remote, remote_name)
            addr, nbytes = self._local(local, local_name, writable=not writing, evict=False)
            remote_at = op_array(batch.dst_offsets if writing else batch.src_offsets,
                                 f"{remote_name}_offsets")
            local_at = op_array(batch.src_offsets if writing else batch.dst_offsets,
                                f"{local_name}_offsets")
            lengths = batch.lengths
            if isinstance(lengths, int | np.integer) and not isinstance(lengths, bool):
                smallest = largest = int(lengths)  # one length: no reductions over copies
                sizes = np.full(remote_at.size, smallest, np.int64)
            else:
                sizes = op_array(lengths, "lengths")
                smallest, largest = (int(sizes.min()), int(sizes.max())) if sizes.size \
                    else (0, 0)
            if not remote_at.size == local_at.size == sizes.size:
                raise ParamInvalid(f"offset and length arrays differ in length: "
                                   f"{remote_at.size} {remote_name}_offsets, {local_at.size} "
                                   f"{local_name}_offsets, {sizes.size} lengths")
            spans = [_span(at, sizes, smallest, largest, name, limit, pe)
                     for at, name, limit in ((remote_at, remote_name, room),
                                             (local_at, local_name, nbytes))]
        except HixlError as exc:
            raise type(exc)(f"{what}: {exc.args[0]} (nothing moved)",
                            failed=[pe]) from None
        if smallest <= 0:
            keep = sizes > 0
            local_at, remote_at, sizes = local_at[keep], remote_at[keep], sizes[keep]
        (remote_lo, remote_hi), (local_lo, local_hi) = spans
        return _ArrayMoves(local_at + addr, remote_at + offset, sizes,
                           (addr + local_lo, addr + local_hi),
                           (offset + remote_lo, offset + remote_hi))

    def _batch_moves(self, what: str, pairs: Any, pe: int,
                     writing: bool) -> list[tuple[int, int, int]]:
        """(local address, symmetric offset, length) of every non-empty pair, all checked
        first; a bad pair raises its error's class with the pair's index in the message."""
        if isinstance(pairs, str | bytes) or not isinstance(pairs, Sequence):
            raise ParamInvalid(f"{what} needs a sequence of (dst, src) pairs, got "
                               f"{type(pairs).__name__}")
        moves: list[tuple[int, int, int]] = []
        for index, pair in enumerate(pairs):
            try:
                if not isinstance(pair, tuple | list) or len(pair) != 2:
                    raise ParamInvalid(f"expected a (dst, src) pair, got {pair!r:.80}")
                dst, src = pair
                remote, local = (dst, src) if writing else (src, dst)
                offset, room = self._symmetric(remote, "dst" if writing else "src")
                addr, nbytes = self._local(local, "src" if writing else "dst",
                                           writable=not writing, evict=False)
                if nbytes > room:
                    verb = "overflows its dst" if writing else "overruns its src"
                    raise OutOfRange(f"{nbytes} bytes {verb}: {room} bytes at symmetric "
                                     f"offset {offset}", failed=[pe])
            except HixlError as exc:
                raise type(exc)(f"{what} pair {index}: {exc.args[0]} (nothing moved)",
                                failed=list(exc.failed)) from None
            if nbytes:
                moves.append((addr, offset, nbytes))
        return moves

    @contextlib.contextmanager
    def _using_registrations(self) -> Iterator[None]:
        """Marks a put/get in progress (from its registration lookup until it is done or
        outstanding), so another thread's call does not evict what it uses."""
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    def _put(self, dst: Any, src: Any, pe: int, timeout: float | None, *,
             blocking: bool) -> None:
        with self._using_registrations():
            self._move_one(TransferOp.WRITE, dst, src, pe, timeout, blocking)

    def _get(self, dst: Any, src: Any, pe: int, timeout: float | None, *,
             blocking: bool) -> None:
        with self._using_registrations():
            self._move_one(TransferOp.READ, src, dst, pe, timeout, blocking)

    def _move_one(self, op: TransferOp, remote: Any, local: Any, pe: int,
                  timeout: float | None, blocking: bool) -> None:
        """One put (WRITE: local -> symmetric `remote` on `pe`) or get (READ: the other
        way), checked in full first."""
        self._check_open()
        pe = self._check_pe(pe)
        wait = self._timeout(timeout)
        writing = op is TransferOp.WRITE
        offset, room = self._symmetric(remote, "put's dst" if writing else "get's src")
        addr, nbytes = self._local(local, "put's src" if writing else "get's dst",
                                   writable=not writing)
        if nbytes > room:
            what = "put of {} bytes overflows its dst" if writing \
                else "get of {} bytes overruns its src"
            raise OutOfRange(f"{what.format(nbytes)}: {room} bytes at symmetric offset "
                             f"{offset}", failed=[pe])
        if not nbytes:
            return
        if pe == self.my_pe:
            heap = self._heap_addr + offset
            if writing:
                ctypes.memmove(heap, addr, nbytes)
            else:
                ctypes.memmove(addr, heap, nbytes)
        elif blocking:
            self._transfer(pe, op, [(addr, offset, nbytes)], wait,
                           "put to" if writing else "get from")
        else:
            self._start(pe, op, [(addr, offset, nbytes)], wait,
                        "put_nbi to" if writing else "get_nbi from")

    def quiet(self, timeout: float | None = None) -> None:
        """Wait for every outstanding put_nbi/get_nbi; raise the first error, naming its PE."""
        self._quiet(None, self._timeout(timeout))

    def _quiet(self, only: int | None, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            if only is None:
                pending = [(pe, item) for pe, items in self._outstanding.items() for item in items]
                self._outstanding.clear()
            else:
                pending = [(only, item) for item in self._outstanding.pop(only, [])]
        first: HixlError | None = None
        for pe, (request, what) in pending:
            try:
                request.wait(max(0.0, deadline - time.monotonic()))
            except HixlError as exc:
                if first is None:
                    first = self._named(exc, pe, what)
            except Exception as exc:  # noqa: BLE001 - reported as the PE's failure
                if first is None:
                    first = TransferFailed(f"{what} PE {pe}: {exc!r}", failed=[pe])
        if first is not None:
            raise first

    # ------------------------------------------------------------------ signals

    def _signal_of(self, sig: Any) -> SymmetricSignal:
        if not isinstance(sig, SymmetricSignal):
            raise ParamInvalid(f"expected a signal from create_signal(), got {sig!r}")
        if sig.ctx is not self:
            raise ParamInvalid(f"signal {sig!r} belongs to another shmem context")
        return sig

    def _describe(self, sig: SymmetricSignal) -> str:
        label = f"{sig.name!r} " if sig.name else ""
        return f"signal {label}at offset {sig.offset}"

    def _read_word(self, pe: int, offset: int, timeout: float) -> int:
        if pe == self.my_pe:
            return int(self._words(offset, 1)[0])
        scratch = self._scratch_at + _WORD
        self._transfer(pe, TransferOp.READ, [(self._heap_addr + scratch, offset, _WORD)],
                       timeout, "signal read from")
        _fence()
        return int(self._words(scratch, 1)[0])

    def _word_ops(self, pe: int, scratch: int, offset: int) -> list[TransferOpDesc]:
        """The ops that store the word staged at `scratch` into `offset` on `pe`, untorn.

        Fabric path: one 8-byte memmove, i.e. one aligned 8-byte store. Socket path: a
        *lead* 8-byte write into this PE's pad word on `pe` goes first, in the same batch
        (one sendmsg: 112 bytes, one TCP segment on the idle connection). However the
        agent's connection reads (it reads a header alone after a large payload), it
        receives the lead payload with a greedy read that brings the word's whole frame
        into its ring, and applies the word from there with one memmove — never by a
        kernel copy straight into the slot (rep movsb, not one 8-byte store).
        """
        _, base, _ = self._peers[pe]
        word = TransferOpDesc(self._heap_addr + scratch, base + offset, _WORD)
        if not self._socket_path[pe]:
            return [word]
        pad = base + self._pad_at + self.my_pe * _WORD
        return [TransferOpDesc(self._heap_addr + scratch, pad, _WORD), word]

    def _write_word(self, pe: int, offset: int, value: int, timeout: float, what: str) -> None:
        _fence()
        if pe == self.my_pe:
            self._words(offset, 1)[0] = value  # one aligned 8-byte store
            return
        scratch = self._scratch_at
        self._words(scratch, 1)[0] = value
        try:
            self._engine.transfer(self._peers[pe][0], TransferOp.WRITE,
                                  self._word_ops(pe, scratch, offset), timeout)
        except HixlError as exc:
            raise self._named(exc, pe, what) from exc

    def signal(self, sig: Any, value: int, pe: int, op: SignalOp | str = SignalOp.SET, *,
               timeout: float | None = None) -> None:
        """Update `sig` on PE `pe` after every earlier put/get to `pe` has completed.

        SET makes this PE's contribution `value`; ADD adds `value` to it (int64,
        wrapping). The signal's value on `pe` is the sum of all senders' contributions.
        """
        self._check_open()
        sig = self._signal_of(sig)
        pe = self._check_pe(pe)
        op = _check_op(op)
        value = _check_int64(value, "signal value")
        wait = self._timeout(timeout)
        self._quiet(pe, wait)  # the ordering guarantee: earlier ops to pe have landed
        slot = sig.offset + self.my_pe * _WORD
        with self._lock:
            if op is SignalOp.ADD:
                value = _wrap64(self._read_word(pe, slot, wait) + value)
            self._write_word(pe, slot, value, wait, "signal to")

    def put_signal(self, dst: Any, src: Any, sig: Any, value: int, pe: int,
                   op: SignalOp | str = SignalOp.SET, *, timeout: float | None = None) -> None:
        """put, then signal: the signal is never seen before the put's bytes."""
        self._signal_of(sig)
        _check_op(op)
        self.put(dst, src, pe, timeout=timeout)
        self.signal(sig, value, pe, op, timeout=timeout)

    def signal_fetch(self, sig: Any) -> int:
        """The local value of a signal (the sum of its senders' slots)."""
        self._check_open()
        return self._signal_of(sig).value()

    def wait_until(self, sig: Any, cmp: Cmp | str, value: int,
                   timeout: float | None = None) -> int:
        """Wait until `sig`'s local value `cmp` `value` holds; returns the value seen.

        Polls local memory: a short spin, then sleeps growing to 1 ms. Raises
        TransferTimeout (naming the signal, expected and last value) at the deadline,
        PeerUnavailable as soon as a PE is seen gone from the registry.
        """
        self._check_open()
        sig = self._signal_of(sig)
        cmp = _check_cmp(cmp)
        test = _TESTS[cmp]
        value = _check_int64(value, "wait_until value")
        slots = sig.local
        seen = self._poll(lambda: int(slots.sum()), lambda v: test(v, value),
                          self._timeout(timeout),
                          lambda v: f"wait_until({self._describe(sig)} {cmp.value} {value})"
                                    f" on PE {self.my_pe}: the signal is still {v}")
        return seen

    def _poll(self, read: Callable[[], int], done: Callable[[int], bool], timeout: float,
              describe: Callable[[int], str], check: Callable[[], None] | None = None) -> int:
        """Read until done(value); dead PEs and the deadline end the wait with an error."""
        deadline = time.monotonic() + timeout
        polls = 0
        nap = SLEEP_FIRST_S
        while True:
            current = read()
            if done(current):
                _fence()  # the payload a signal announces is read after the signal
                return current
            polls += 1
            if polls <= SPIN_POLLS:
                continue
            now = time.monotonic()
            if now >= deadline:
                raise TransferTimeout(f"{describe(current)} after {timeout:g} s")
            self._check_alive(lambda seen=current: describe(seen))
            if check is not None:
                check()
            time.sleep(min(nap, deadline - now))
            nap = min(nap * 2, SLEEP_MAX_S)

    def _gone(self, pe: int) -> bool:
        """True when PE `pe`'s engine left the global table, restarted, or lost its heap."""
        engine, base, epoch = self._peers.get(pe, ("", 0, 0))
        if not engine or pe == self.my_pe:
            return False
        view = self._engine.global_table.view(engine)
        return view is None or view.epoch != epoch or view.table.lookup(base) is None

    def _left_after(self, pe: int) -> int | None:
        """The last barrier PE `pe` got through before it finalized, from its departure
        word here (one 8-byte load: a word it wrote once, last); None while it is in."""
        word = int(self._words(self._departed_at + pe * _WORD, 1)[0])
        return word - 1 if word else None

    def _check_alive(self, waiting: Callable[[], str]) -> None:
        """PeerUnavailable if a PE's engine or heap left the global table (or the engine
        restarted) without finalize: one dict read and one bisect per PE.

        Its departure word is read only after it is seen gone: a PE writes the word before
        it leaves, so a PE that finalized is never taken for dead. (Read before, the word
        could still be 0 while the PE then finalized and left before the table was read.)"""
        for pe, (engine, _, _) in self._peers.items():
            if pe == self.my_pe or not self._gone(pe):
                continue
            _fence()
            if self._left_after(pe) is None:
                raise PeerUnavailable(
                    f"PE {pe} ({engine}) is gone: the registry {self.bootstrap} no longer lists "
                    f"it or its heap (it died or lost its lease) while {waiting()}",
                    failed=[pe])

    # ------------------------------------------------------------------ barrier

    def _broadcast(self, offset: int, value: int, timeout: float, what: str) -> None:
        """Write one word at `offset` on every PE (this one by a store), concurrently.

        A write that failed to a PE which has since finalized is no error: it will never
        read the word (often it did: it got through the barrier and left, its heap going
        away between the copy and fabric's liveness check, or before a socket's ack).
        Whether it reached the barrier is the wait's to judge, by its epoch and its
        departure word, which it wrote here before its heap went away.
        """
        _fence()  # every earlier write of this PE lands before the word does
        self._words(offset, 1)[0] = value
        scratch = self._scratch_at + 2 * _WORD
        self._words(scratch, 1)[0] = value
        requests: list[tuple[int, Any]] = []
        failures: list[tuple[int, HixlError]] = []
        for pe in range(self.n_pes):
            if pe != self.my_pe:
                try:
                    requests.append((pe, self._start_control(pe, scratch, offset, timeout)))
                except HixlError as exc:
                    failures.append((pe, exc))
        for pe, request in requests:
            try:
                request.wait(timeout)
            except HixlError as exc:
                failures.append((pe, exc))
        if failures:
            _fence()  # the departure word is read after the failure was seen
            failures = [(pe, exc) for pe, exc in failures if self._left_after(pe) is None]
        if failures:
            pe, exc = min(failures, key=lambda failure: failure[0])
            raise self._named(exc, pe, what)

    def _start_control(self, pe: int, scratch: int, offset: int, timeout: float) -> Any:
        return self._engine.transfer_async(self._peers[pe][0], TransferOp.WRITE,
                                           self._word_ops(pe, scratch, offset), timeout)

    def barrier_all(self, timeout: float | None = None) -> None:
        """Collective: complete outstanding ops, then wait until every PE got here."""
        self._check_open()
        wait = self._timeout(timeout)
        self.quiet(wait)
        with self._lock:
            self._epoch += 1
            epoch = self._epoch
            digest_at = self._digest_at + (epoch % 2) * self.n_pes * _WORD
            _fence()
            self._broadcast(digest_at + self.my_pe * _WORD, self._digest(), wait,
                            "barrier write to")
            self._broadcast(self._barrier_at + self.my_pe * _WORD, epoch, wait,
                            "barrier write to")
            epochs = self._words(self._barrier_at, self.n_pes)

            def behind() -> list[int]:
                """PEs not known to be in this barrier: an older epoch here, and no
                departure word saying they got through it (a PE may get through and
                finalize while this one has yet to see a third PE's epoch)."""
                return [pe for pe in range(self.n_pes) if epochs[pe] < epoch and
                        (self._left_after(pe) or 0) < epoch]

            def finalized_early() -> None:
                """PeerUnavailable for PEs that finalized before this barrier. Judged by
                the departure word, then the epoch read after it: a PE writes its epoch
                before its departure, so an epoch older than this barrier read after a
                departure word from before it is final, never a write still on its way."""
                left = {pe: self._left_after(pe) for pe in behind()}
                gone = [pe for pe, after in left.items() if after is not None and after < epoch]
                if gone:
                    _fence()
                    gone = [pe for pe in gone if epochs[pe] < epoch]
                if gone:
                    raise PeerUnavailable(f"PE(s) {gone} finalized before barrier {epoch}: "
                                          "barrier_all is collective", failed=gone)

            self._poll(lambda: len(behind()), lambda n: n == 0, wait,
                       lambda n: f"barrier {epoch} on PE {self.my_pe}: still waiting for "
                                 f"PE(s) {behind()}", finalized_early)
            self._passed = epoch
            digests = self._words(digest_at, self.n_pes)
            mine = int(digests[self.my_pe])
            differ = [pe for pe in range(self.n_pes) if int(digests[pe]) != mine]
            if differ:
                counts = {pe: (int(digests[pe]) & ((1 << 64) - 1)) >> 32 for pe in
                          [self.my_pe, *differ]}
                raise SymmetryError(
                    f"collective allocations disagree at barrier {epoch}: PE(s) {differ} made "
                    f"a different sequence of malloc/create_tensor/create_signal calls than PE "
                    f"{self.my_pe} (allocations so far by PE: {counts})", failed=differ)

    # ------------------------------------------------------------------ lifecycle

    def finalize(self, *, barrier: bool = True, timeout: float | None = None) -> None:
        """Collective: quiet, barrier, tell the peers this PE left (and the last barrier
        it got through), close the engine.

        Idempotent. `barrier=False` (what leaving a `with` block on an exception does)
        skips the barrier: a failing PE does not wait for the others.
        """
        if self._finalized:
            return
        wait = self._timeout(timeout)
        try:
            if barrier:
                self.quiet(wait)
                self.barrier_all(wait)
        finally:
            with self._lock:
                self._finalized = True
            self._outstanding.clear()
            try:  # the barrier it got through goes with the notice (see _left_after)
                self._broadcast(self._departed_at + self.my_pe * _WORD, self._passed + 1,
                                min(wait, 2.0), "departure notice to")
            except HixlError as exc:  # a dead peer needs no notice
                log.debug("PE %d finalize: %s", self.my_pe, exc)
            self._engine.close()  # deregisters the heap and the cached registrations
            self._cache.clear()

    def __enter__(self) -> ShmemContext:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.finalize(barrier=exc_type is None)

    @property
    def engine(self) -> Any:
        """The hixl Engine this PE runs on (its name, routes, metrics)."""
        return self._engine

    def engine_of(self, pe: int) -> str:
        """The engine name of PE `pe`."""
        return self._peers[self._check_pe(pe)][0]

    def route(self, pe: int) -> str:
        """The data path to PE `pe`: "self", "fabric", "unix" or "tcp"."""
        pe = self._check_pe(pe)
        if pe == self.my_pe:
            return "self"
        engine, base, _ = self._peers[pe]
        return self._engine.route(engine, base)

    @property
    def finalized(self) -> bool:
        return self._finalized


class _ArrayMoves(NamedTuple):
    """An ArrayBatch's checked moves (every length positive, every range inside its
    object), with the spans `_array_moves` found checking them: each side's [lowest
    start, an end no move passes), inside its object."""

    local: np.ndarray  # local addresses
    offsets: np.ndarray  # symmetric offsets
    sizes: np.ndarray
    local_span: tuple[int, int]
    offset_span: tuple[int, int]


def _span(at: np.ndarray, sizes: np.ndarray, smallest: int, largest: int, name: str,
          limit: int, pe: int) -> tuple[int, int]:
    """[lowest start, an end no move passes) of one side's moves (starts `at`), checked
    inside its `limit`-byte object; a move outside raises naming its index. The usual
    batch costs two reductions: the lowest start, and the highest plus the longest move."""
    if not at.size:
        return 0, 0
    low, high = int(at.min()), int(at.max()) + largest
    if smallest >= 0 and low >= 0 and high <= limit:
        return low, high
    bad = (sizes < 0) | (at < 0) | (at > limit - np.maximum(sizes, 0))
    if bad.any():
        index = int(np.argmax(bad))
        start, size = int(at[index]), int(sizes[index])
        cls = ParamInvalid if size < 0 or start < 0 else OutOfRange
        raise cls(f"move {index}: {name} range [{start}, +{size}) is not inside its "
                  f"{limit}-byte {name}", failed=[pe])
    return low, int((at + sizes).max())  # exact: the highest start + the longest passes


def _op_arrays(moves: _ArrayMoves, base: int) -> Any:
    """An ArrayBatch's checked moves as the engine's OpArrays toward a heap at `base`,
    with their spans as bounds (the engine checks them against its tables)."""
    from hixl.client.engine import OpArrays

    return OpArrays(moves.local, moves.offsets + base, moves.sizes, *moves.local_span,
                    base + moves.offset_span[0], base + moves.offset_span[1])


def _shape(shape: Any) -> tuple[int, ...]:
    """A tensor shape of positive ints (an int is a 1-d shape)."""
    dims = (shape,) if isinstance(shape, int | np.integer) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        dims = ()
    if not dims or any(isinstance(d, bool) or not isinstance(d, int | np.integer) or d <= 0
                       for d in dims):
        raise ParamInvalid(f"create_tensor needs a shape of positive integers, got {shape!r}")
    return tuple(int(d) for d in dims)


# ---------------------------------------------------------------- the default context

_default: ShmemContext | None = None
_default_lock = threading.Lock()


def _ctx() -> ShmemContext:
    ctx = _default
    if ctx is None:
        raise NotConnected("hixl.shmem is not initialised in this process: call "
                           "hixl.shmem.init(my_pe, n_pes, bootstrap) first")
    return ctx


def _from_env(given: Any, name: str, kind: type) -> Any:
    """`given`, else the environment variable `name` (set by `hixl shmem-run`) as `kind`."""
    if given is not None:
        return given
    text = os.environ.get(name)
    if text is None:
        raise ParamInvalid(f"hixl.shmem.init: give the argument or set ${name} (hixl "
                           "shmem-run sets it for every PE it starts)")
    try:
        return kind(text)
    except ValueError:
        raise ParamInvalid(f"${name} must be {kind.__name__}, got {text!r}") from None


def init(my_pe: int | None = None, n_pes: int | None = None, bootstrap: str | None = None,
         heap_size: int | str = "64MiB", **options: Any) -> ShmemContext:
    """Start this process's PE (see ShmemContext) and make it the module's default.

    `my_pe`, `n_pes` and `bootstrap` default to $HIXL_SHMEM_PE, $HIXL_SHMEM_N_PES and
    $HIXL_SHMEM_BOOTSTRAP, which `hixl shmem-run` sets for every PE it starts.
    """
    global _default
    my_pe = _from_env(my_pe, PE_ENV, int)
    n_pes = _from_env(n_pes, N_PES_ENV, int)
    bootstrap = _from_env(bootstrap, BOOTSTRAP_ENV, str)
    with _default_lock:
        if _default is not None and not _default.finalized:
            raise ParamInvalid(f"hixl.shmem is already initialised (PE {_default.my_pe} of "
                               f"job {_default.job!r}); finalize() first")
        _default = ShmemContext(my_pe, n_pes, bootstrap, heap_size, **options)
        return _default


def finalize() -> None:
    """Finalize the default context (idempotent; a no-op when never initialised)."""
    global _default
    with _default_lock:
        ctx, _default = _default, None
    if ctx is not None:
        ctx.finalize()


def my_pe() -> int:
    return _ctx().my_pe


def n_pes() -> int:
    return _ctx().n_pes


def malloc(nbytes: int, name: str = "") -> SymmetricObject:
    return _ctx().malloc(nbytes, name)


def create_tensor(shape: int | Sequence[int], dtype: Any = np.float32,
                  name: str = "") -> SymmetricObject:
    return _ctx().create_tensor(shape, dtype, name)


def create_signal(name: str = "") -> SymmetricSignal:
    return _ctx().create_signal(name)


def put(dst: Any, src: Any, pe: int, *, timeout: float | None = None) -> None:
    _ctx().put(dst, src, pe, timeout=timeout)


def get(dst: Any, src: Any, pe: int, *, timeout: float | None = None) -> None:
    _ctx().get(dst, src, pe, timeout=timeout)


def put_nbi(dst: Any, src: Any, pe: int, *, timeout: float | None = None) -> None:
    _ctx().put_nbi(dst, src, pe, timeout=timeout)


def get_nbi(dst: Any, src: Any, pe: int, *, timeout: float | None = None) -> None:
    _ctx().get_nbi(dst, src, pe, timeout=timeout)


def put_batch(pairs: Sequence[tuple[Any, Any]] | ArrayBatch, pe: int, *, nbi: bool = False,
              timeout: float | None = None) -> None:
    _ctx().put_batch(pairs, pe, nbi=nbi, timeout=timeout)


def get_batch(pairs: Sequence[tuple[Any, Any]] | ArrayBatch, pe: int, *, nbi: bool = False,
              timeout: float | None = None) -> None:
    _ctx().get_batch(pairs, pe, nbi=nbi, timeout=timeout)


def quiet(timeout: float | None = None) -> None:
    _ctx().quiet(timeout)


def signal(sig: Any, value: int, pe: int, op: SignalOp | str = SignalOp.SET, *,
           timeout: float | None = None) -> None:
    _ctx().signal(sig, value, pe, op, timeout=timeout)


def put_signal(dst: Any, src: Any, sig: Any, value: int, pe: int,
               op: SignalOp | str = SignalOp.SET, *, timeout: float | None = None) -> None:
    _ctx().put_signal(dst, src, sig, value, pe, op, timeout=timeout)


def signal_fetch(sig: Any) -> int:
    return _ctx().signal_fetch(sig)


def wait_until(sig: Any, cmp: Cmp | str, value: int, timeout: float | None = None) -> int:
    return _ctx().wait_until(sig, cmp, value, timeout)


def barrier_all(timeout: float | None = None) -> None:
    _ctx().barrier_all(timeout)


def clear(sym: Any) -> None:
    _ctx().clear(sym)


__all__ = [
    "ADD", "EQ", "GE", "GT", "LE", "LT", "NE", "SET",
    "ArrayBatch", "Cmp", "ShmemContext", "SignalOp", "SymmetricObject", "SymmetricSignal",
    "SymmetricTensor", "SymmetryError",
    "barrier_all", "clear", "create_signal", "create_tensor", "finalize", "get", "get_batch",
    "get_nbi", "init", "malloc", "my_pe", "n_pes", "put", "put_batch", "put_nbi", "put_signal",
    "quiet", "signal", "signal_fetch", "wait_until",
]
