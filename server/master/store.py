"""The KV store's object index: what hixl-master's `Master` service serves.

`ObjectStore` is a plain thread-safe object (no gRPC inside; tests drive it with an
injected clock). It maps key -> object {size, replicas on mounted segments, read lease,
pins} and hands out space in the segments clients contribute. It holds metadata only:
the bytes move client to client over the transfer engine.

Semantics (Mooncake Store's master, plus persistence):

- **Two-phase put.** `put_start` allocates replicas (state INIT) on distinct segments;
  the value becomes visible only at `put_end`; `put_revoke` frees it. An upsert replaces
  the committed value only at its `put_end`. A put left unfinished for
  `put_start_discard_timeout_s` may be pre-empted by a new put of the key; its space is
  reclaimed only after `put_start_release_timeout_s` (a stale writer may still write).
- **Allocation.** One offset allocator per mounted segment (first fit, 64-byte aligned,
  coalescing frees). Strategies: `random` (Mooncake's default) and `free_ratio_first`,
  after preferred segments and, if asked, the caller's node. Replicas land on distinct
  segments; fewer segments with room than `replica_num` gives fewer replicas (at least
  one), as in Mooncake.
- **Leases.** `get_replicas`, `exist_keys` and a client's `get_sizes` lease the object
  for `default_kv_lease_ttl_ms`: until then it is neither evicted nor removed (unless
  forced). A forced removal or an upsert keeps the space while a read of the value may
  be in flight: until each reading client's lease ends, or that client's own removal
  says its read is over (docs/store.md §4), so a read under lease is never torn.
- **Eviction.** When usage crosses `eviction_high_watermark_ratio`, or a put finds no
  space, about `eviction_ratio` of the capacity is evicted, least recently used first,
  soft-pinned objects last, never leased, hard-pinned or in-progress ones, nor one whose
  put was acknowledged less than `eviction_grace_ms` ago.
- **Clients.** Mounting registers a client; heartbeats keep it for `client_ttl_s`. An
  expired client's segments are unmounted at once (they stop receiving allocations;
  replicas on them go; objects left with none are removed); an unknown client's
  heartbeat is answered NEED_REMOUNT.
- **Persistence** (Mooncake loses every key on restart; this does not): with a metadata
  backend (server/master/metadata.py; a data dir is `LocalJournalBackend`), every committed
  change (mount, unmount, put end, removal, eviction) is appended to it and durable
  before the call returns (group commit: one fsync serves every caller waiting at the
  time), with periodic snapshots that supersede the journal. Space is
  handed out again only once its release is durable, so a restart never resurrects a key
  over memory already given to another. On start, snapshot + journal are replayed (a
  torn last record is ignored with a warning); segments come back *awaiting remount*:
  their objects are served again once the owner remounts the same engine, segment id,
  epoch, base and length; a newer epoch means the memory was lost, and its objects are
  dropped. Puts in progress were never committed and are gone; leases are not kept, but
  every restored object starts with a fresh one.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import itertools
import logging
import os
import random
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import regex
from regex import _regex_core

from hixl.errors import ConfigError
from hixl.registry_client import EngineEndpoints
from hixl.server.master.metadata import LocalJournalBackend, MetadataBackend
from hixl.store_codes import MAX_REPLICAS, ErrorCode
from hixl.store_types import (
    ClientStatus,
    CountResult,
    GetReplicasResult,
    HeartbeatResult,
    KeyInfo,
    KeyListing,
    KeyReplica,
    KeyState,
    MountedSegment,
    PutStartResult,
    Replica,
    ReplicaConfig,
    ReplicaState,
    Reservation,
    ReservedRange,
    ReserveResult,
    SegmentResult,
    SoftPinAction,
    StoreSegment,
)

log = logging.getLogger("hixl.store")

_T = TypeVar("_T")

ALIGNMENT = 64
MAX_KEY_BYTES = 4096
MAX_SOFT_PIN_TTL_MS = 24 * 3600 * 1000       # Mooncake's cap
MAX_U64 = (1 << 64) - 1
ALLOCATION_STRATEGIES = ("random", "free_ratio_first")
MAX_LIST_KEYS = 10_000                        # keys one list_keys reply carries at most
#: what compiling a client's pattern raises: regex.error, and for a repeat count past the
#: engine's limit, conflicting flags, a named list (none is given) or deep nesting, the others
_BAD_REGEX = (regex.error, TypeError, ValueError, OverflowError, RecursionError, KeyError)
#: how long one remove_by_regex / list_keys may spend matching keys, in all. Patterns
#: come from clients: `regex` (unlike `re`) takes a timeout and releases the GIL while
#: matching, so a catastrophically backtracking pattern ("(\\w*)*\\d$") fails the call
#: with INVALID_PARAMS instead of freezing every thread of the master.
REGEX_BUDGET_S = 1.0
#: the longest pattern a client may send (characters): as long as the longest key.
MAX_REGEX_CHARS = MAX_KEY_BYTES
#: the most pattern items compiling a client's pattern may unroll. The timeout above does
#: not cover compiling: `regex` unrolls counted repeats, so `(?:a{1000}){3000}` (18
#: bytes) is 3 million items, ~800 MiB of the master's memory for seconds. The weight
#: of a pattern is its parsed items, each counted repeat multiplying what it repeats by
#: its largest finite count; at this bound compiling peaks at ~2-12 MiB and a pattern
#: for three 64-hex-digit path parts weighs under a thousand.
MAX_REGEX_WEIGHT = 10_000


class _RegexTooSlow(Exception):
    """A client's pattern used up REGEX_BUDGET_S."""


class _RegexRefused(Exception):
    """A client's pattern that must not be compiled; the message names it and why."""


def _shown(pattern: str) -> str:
    """The pattern for a message: its repr, cut (it may be MAX_REGEX_CHARS long)."""
    return repr(pattern) if len(pattern) <= 80 else repr(pattern[:80]) + "..."


def _regex_weight(pattern: str) -> int:
    """The pattern's weight (see MAX_REGEX_WEIGHT), from `regex`'s own parser, which
    costs memory in proportion to the pattern's length, not to its repeats. The parser
    is the package's internal one, as `regex.compile` drives it: reading the syntax with
    any other parser could disagree with it about what a repeat applies to."""
    global_flags = 0
    while True:
        source = _regex_core.Source(pattern)
        info = _regex_core.Info(global_flags, source.char_type, {})
        info.guess_encoding = _regex_core.UNICODE
        try:
            return _node_weight(_regex_core._parse_pattern(source, info))
        except _regex_core._UnscopedFlagSet:   # a global flag: parsed again with it
            global_flags = info.global_flags


def _node_weight(node: object) -> int:
    """1 per parsed item and what it holds; a repeat multiplies its body by its largest
    finite count (`regex` unrolls the minimum; the maximum bounds that safely)."""
    if isinstance(node, (list, tuple)):
        return sum(_node_weight(item) for item in node)
    if isinstance(node, dict):                  # a fuzzy constraint's test item
        return sum(_node_weight(item) for item in node.values())
    if not isinstance(node, _regex_core.RegexBase):
        return 0
    inner = sum(_node_weight(value) for name, value in vars(node).items() if name != "info")
    if isinstance(node, (_regex_core.GreedyRepeat, _regex_core.LazyRepeat,
                         _regex_core.PossessiveRepeat)):
        inner *= max(node.min_count, node.max_count or 0, 1)
    return 1 + inner


def _compile_regex(pattern: str) -> Any:
    """Compile a client's pattern within MAX_REGEX_CHARS and MAX_REGEX_WEIGHT, or raise
    _RegexRefused (a bad pattern: one of _BAD_REGEX). Never cached: a compiled pattern
    can hold megabytes, and `regex` keeps up to 500 of them, so distinct client
    patterns would pin gigabytes; regex.purge() also drops the per-pattern entry
    `regex` records even for patterns it does not cache."""
    if len(pattern) > MAX_REGEX_CHARS:
        raise _RegexRefused(f"regex {_shown(pattern)} is {len(pattern)} characters, more than "
                            f"the {MAX_REGEX_CHARS} a pattern may have: shorten it")
    weight = _regex_weight(pattern)
    if weight > MAX_REGEX_WEIGHT:
        raise _RegexRefused(
            f"regex {_shown(pattern)} would unroll to {weight} items, more than the "
            f"{MAX_REGEX_WEIGHT} a pattern may (counted repeats multiply what they repeat): "
            "use fewer or smaller counted repeats, e.g. * or + for long runs")
    try:
        return regex.compile(pattern, cache_pattern=False)
    finally:
        regex.purge()


def _refusal(pattern: str, exc: Exception) -> str:
    """The INVALID_PARAMS message for a pattern _compile_regex did not compile."""
    return str(exc) if isinstance(exc, _RegexRefused) else f"bad regex {_shown(pattern)}: {exc}"


def _matching(pattern: Any, keys: Iterable[str]) -> list[str]:
    """The keys `pattern` finds a match in (`search`), within REGEX_BUDGET_S in all (read
    at the call)."""
    deadline = time.monotonic() + REGEX_BUDGET_S
    found = []
    for key in keys:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _RegexTooSlow
        try:
            if pattern.search(key, timeout=left, concurrent=True):
                found.append(key)
        except TimeoutError:
            raise _RegexTooSlow from None
    return found


def _too_slow(pattern: str, keys: int) -> str:
    return (f"regex {_shown(pattern)} took more than {REGEX_BUDGET_S:g} s to match {keys} keys "
            "(nested repeats backtrack exponentially): simplify it")


class AllocationStrategy(str, enum.Enum):
    RANDOM = "random"
    FREE_RATIO_FIRST = "free_ratio_first"


@dataclass(frozen=True)
class StoreOptions:
    """Settings of an ObjectStore (mooncake_master's, in its units where it has them)."""

    default_kv_lease_ttl_ms: int = 5_000
    default_kv_soft_pin_ttl_ms: int = 30 * 60 * 1000
    eviction_high_watermark_ratio: float = 0.95
    eviction_ratio: float = 0.05
    client_ttl_s: float = 10.0
    allocation_strategy: str = "random"
    put_start_discard_timeout_s: float = 30.0
    put_start_release_timeout_s: float = 600.0
    #: how long segments restored after a restart wait for their owner to remount them
    remount_grace_s: float = 60.0
    #: journal records between snapshots (a snapshot truncates the journal)
    snapshot_every_records: int = 100_000
    fsync: bool = True
    #: lease of a one-round-trip put's reservation (docs/store.md §2), renewed by each
    #: commit that uses it; also how long a store that may have had a predecessor
    #: allocates nothing after it starts (a stale reservation's writes end by then)
    reservation_ttl_ms: int = 1_000
    #: space one reservation sets aside per segment (at most an eighth of the segment);
    #: values up to a quarter of it take the one-round-trip put, so 64 MiB covers a
    #: DeepSeek-R1 KV block (8784 KiB) with room
    reservation_bytes: int = 64 << 20
    #: how long a client may read a value's locations from its cache (docs/store.md §3),
    #: at most the read lease; removing or replacing a cached value waits it out
    location_cache_ttl_ms: int = 500
    #: an acknowledged put is not evicted for this long (a get right after it finds the
    #: value; docs/store.md §4); puts that find no other room get NO_AVAILABLE_HANDLE
    eviction_grace_ms: int = 1_000

    def check(self) -> None:
        """ConfigError naming the first unusable setting."""
        positive = ("default_kv_lease_ttl_ms", "default_kv_soft_pin_ttl_ms", "client_ttl_s",
                    "put_start_discard_timeout_s", "put_start_release_timeout_s",
                    "remount_grace_s", "snapshot_every_records", "reservation_ttl_ms",
                    "reservation_bytes", "location_cache_ttl_ms", "eviction_grace_ms")
        for name in positive:
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"store option {name} must be positive, got {value!r}")
        for name in ("eviction_high_watermark_ratio", "eviction_ratio"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"store option {name} must be in [0, 1], got {value!r}")
        if self.allocation_strategy not in ALLOCATION_STRATEGIES:
            raise ConfigError(f"store option allocation_strategy must be one of "
                              f"{', '.join(ALLOCATION_STRATEGIES)}, got "
                              f"{self.allocation_strategy!r}")
        if self.put_start_release_timeout_s < self.put_start_discard_timeout_s:
            raise ConfigError("store option put_start_release_timeout_s must be at least "
                              "put_start_discard_timeout_s")


# ---------------------------------------------------------------------------- allocator


def _align(size: int, alignment: int) -> int:
    return (size + alignment - 1) // alignment * alignment


class OffsetAllocator:
    """First-fit allocator of [0, capacity): aligned blocks, frees coalesce with neighbours.

    Free blocks are kept sorted by offset (bisect), so a free merges with the blocks on
    either side in O(log n); an allocation scans for the first block that fits.
    """

    def __init__(self, capacity: int, alignment: int = ALIGNMENT) -> None:
        self.capacity = capacity
        self.alignment = alignment
        self._starts: list[int] = [0] if capacity else []
        self._free: dict[int, int] = {0: capacity} if capacity else {}
        self._used: dict[int, int] = {}
        self.used = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return max(self._free.values(), default=0)

    def fragmentation(self) -> float:
        """1 - largest free block / free bytes: 0 when all free space is one block."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free() / free

    def allocate(self, size: int) -> int | None:
        """Offset of a new block of at least `size` bytes, or None when none fits."""
        need = _align(max(size, 1), self.alignment)
        if need > self.free_bytes:
            return None
        for index, start in enumerate(self._starts):
            length = self._free[start]
            if length < need:
                continue
            del self._free[start]
            if length == need:
                del self._starts[index]
            else:
                self._starts[index] = start + need
                self._free[start + need] = length - need
            self._used[start] = need
            self.used += need
            return start
        return None

    def reserve(self, offset: int, size: int) -> bool:
        """Mark [offset, offset+aligned size) allocated (replay); False if it is not free."""
        need = _align(max(size, 1), self.alignment)
        index = bisect.bisect_right(self._starts, offset) - 1
        if index < 0:
            return False
        start = self._starts[index]
        length = self._free[start]
        if offset + need > start + length:
            return False
        del self._free[start]
        del self._starts[index]
        if offset > start:
            self._insert_free(start, offset - start)
        end = offset + need
        if end < start + length:
            self._insert_free(end, start + length - end)
        self._used[offset] = need
        self.used += need
        return True

    def free(self, offset: int) -> int:
        """Release the block at `offset`; returns its size (KeyError if not allocated)."""
        size = self._used.pop(offset)
        self.used -= size
        start, length = offset, size
        index = bisect.bisect_left(self._starts, start)
        if index < len(self._starts) and self._starts[index] == start + length:
            length += self._free.pop(self._starts[index])
            del self._starts[index]
        if index > 0:
            prev = self._starts[index - 1]
            if prev + self._free[prev] == start:
                self._free[prev] += length
                return size
        self._insert_free(start, length)
        return size

    def block_size(self, offset: int) -> int:
        return self._used[offset]

    def carve(self, block: int, offset: int, size: int) -> bool:
        """Split the allocated block at `block` so that [offset, offset + aligned size)
        becomes a block of its own (the rest stay allocated blocks too); False, changing
        nothing, when that range is not inside the block or `offset` is not aligned."""
        need = _align(max(size, 1), self.alignment)
        length = self._used.get(block)
        if (length is None or offset % self.alignment or offset < block
                or offset + need > block + length):
            return False
        if offset > block:
            self._used[block] = offset - block
        self._used[offset] = need
        if offset + need < block + length:
            self._used[offset + need] = block + length - offset - need
        return True

    def _insert_free(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._free[start] = length


# ---------------------------------------------------------------------------- index


@dataclass(eq=False)
class _Segment:
    info: StoreSegment
    client_id: str
    live: bool
    allocator: OffsetAllocator
    keys: set[str] = field(default_factory=set)         # committed objects with a replica here
    puts: set[int] = field(default_factory=set)         # pending puts with a replica here
    reservations: set[int] = field(default_factory=set)  # reservations with pieces here

    @property
    def ident(self) -> tuple[str, int]:
        return self.info.engine, self.info.segment_id

    def same_memory(self, info: StoreSegment) -> bool:
        mine = self.info
        return (mine.epoch, mine.base, mine.length) == (info.epoch, info.base, info.length)


@dataclass(eq=False)
class _Replica:
    replica_id: int
    segment: _Segment
    offset: int
    length: int

    def describe(self, state: ReplicaState) -> Replica:
        info = self.segment.info
        return Replica(self.replica_id, info.engine, info.segment_id, info.epoch,
                       info.base + self.offset, self.length, info.node_id, state)

    def record(self) -> list[Any]:
        info = self.segment.info
        return [self.replica_id, info.engine, info.segment_id, info.epoch, self.offset,
                self.length]


@dataclass(eq=False)
class _Object:
    size: int
    replicas: list[_Replica]
    hard_pin: bool = False
    soft_pin_until: float = 0.0
    lease_until: float = 0.0     # Mooncake's read lease: no plain removal or eviction before
    #: reader client -> when a read it started may still be in flight (its read lease's
    #: end, or until its own Remove says the read is over): a removed or replaced value's
    #: space is reused only after the last (docs/store.md §4)
    reads: dict[str, float] = field(default_factory=dict)
    #: client -> end of its cache lease: it may read the value's locations from its
    #: cache until then; whatever removes or replaces the value returns after the last
    caches: dict[str, float] = field(default_factory=dict)
    installed: float = 0.0       # when its put was acknowledged (eviction spares it a while)

    def read_until(self) -> float:
        return max(self.reads.values(), default=0.0)

    def cache_until(self) -> float:
        return max(self.caches.values(), default=0.0)

    def hold(self, holds: dict[str, float], client_id: str, until: float, now: float) -> None:
        """Extend `client_id`'s entry in `holds` (reads or caches) to `until`, dropping
        entries that ended (a dict per object stays as small as its current readers)."""
        for ended in [c for c, t in holds.items() if t <= now]:
            del holds[ended]
        holds[client_id] = max(holds.get(client_id, 0.0), until)

    def record(self, key: str) -> list[Any]:
        return [key, self.size, self.hard_pin, [r.record() for r in self.replicas]]


@dataclass(eq=False)
class _Put:
    put_id: int
    key: str
    client_id: str
    size: int
    replicas: list[_Replica]
    started: float
    config: ReplicaConfig


@dataclass(eq=False)
class _Reservation:
    """Space set aside for one client's one-round-trip puts (docs/store.md §2): the
    allocator blocks (`pieces`: start -> length) it still holds in `segment`."""

    reservation_id: int
    client_id: str
    segment: _Segment
    pieces: dict[int, int]
    lease_until: float

    def piece_holding(self, offset: int, need: int) -> int | None:
        """The start of the piece that holds [offset, offset + need), if any."""
        for start, length in self.pieces.items():
            if start <= offset and offset + need <= start + length:
                return start
        return None


#: segments one Reserve sets space aside on (at least replica_num): a client spreads its
#: values over them at random, as the `random` allocation strategy would
RESERVE_SPREAD = 8
#: a smaller reservation is not worth a round trip: none is granted then
MIN_RESERVATION = 256 << 10
#: reservations remembered after they end, to answer LEASE_EXPIRED rather than not found
_ENDED_KEPT = 4096


#: (backend, its mark after a record), or None without persistence.
_Mark = tuple[MetadataBackend, object] | None


def _segment_record(segment: _Segment) -> dict[str, Any]:
    info = segment.info
    ep = info.endpoints
    return {"c": segment.client_id, "e": info.engine, "i": info.segment_id, "p": info.epoch,
            "b": info.base, "l": info.length, "n": info.node_id, "m": info.name,
            "x": [ep.fabric_domain, ep.data_tcp, ep.data_unix, ep.fd_socket]}


def _segment_from_record(record: dict[str, Any]) -> tuple[str, StoreSegment]:
    endpoints = EngineEndpoints(*record.get("x", ("", "", "", "")))
    return record["c"], StoreSegment(record["e"], record["i"], record["p"], record["b"],
                                     record["l"], record.get("n", ""), endpoints,
                                     record.get("m", ""))


class ObjectStore:
    """Thread-safe object index over mounted segments; see the module docstring.

    Per-key outcomes are ErrorCode values (returned, never raised). With a `backend`
    (which the store then owns and closes), or a `data_dir` (short for
    `LocalJournalBackend(data_dir)`), committed metadata survives restarts; with
    neither, the store lives in memory only.
    """

    def __init__(self, options: StoreOptions | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 data_dir: str | os.PathLike[str] | None = None,
                 backend: MetadataBackend | None = None,
                 rng: random.Random | None = None) -> None:
        self.options = options or StoreOptions()
        self.options.check()
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.RLock()
        self._objects: OrderedDict[str, _Object] = OrderedDict()   # LRU order, oldest first
        self._puts: dict[int, _Put] = {}
        self._puts_by_key: dict[str, _Put] = {}
        self._segments: dict[tuple[str, int], _Segment] = {}
        self._clients: dict[str, float] = {}                       # client id -> deadline
        # Every timed event (client expiry, stale put release, deferred free, remount
        # grace) as (when, seq, kind, subject); entries made stale by later changes are
        # recognised and skipped when they come up, so no operation scans everything.
        self._deadlines: list[tuple[float, int, str, Any]] = []
        self._deadline_seq = itertools.count()
        self._replica_ids = itertools.count(1)
        self._put_ids = itertools.count(secrets.randbits(40) << 16 | 1)
        self._reservations: dict[int, _Reservation] = {}
        self._ended_reservations: OrderedDict[int, str] = OrderedDict()  # id -> client
        # random start: a restarted master never answers to an old reservation id
        self._reservation_ids = itertools.count(secrets.randbits(40) << 16 | 1)
        #: False only for a persistent store that loaded nothing (its first start)
        self._may_have_predecessor = True
        #: the latest cache lease of an object removed or replaced since a call took it
        #: (_take_cache_wait_locked): that call returns only after it (docs/store.md §3)
        self._cache_wait_until = 0.0
        #: unmounted segments (engine, id) -> when the last cache lease of a value in
        #: them ends: mounted again before then, they lend nothing out until then
        self._quarantine: dict[tuple[str, int], float] = {}
        self._counters: dict[str, int] = dict.fromkeys(
            ("puts", "evicted", "evictions", "expired_clients", "preempted_puts",
             "released_puts", "commits", "reservations_granted", "reservations_expired",
             "cache_waits", "remount_holds", "remount_hold_timeouts"), 0)
        #: bumped whenever the mounted segments change (a mount, a remount, an unmount, a
        #: restored segment given up); calls held for a remount wait for it
        #: (`wait_segments_changed`), each through a listener in `_segment_listeners`
        self._segments_version = 0
        self._segment_listeners: set[Callable[[], None]] = set()
        self._listeners_lock = threading.Lock()
        self._snapshot_lock = threading.Lock()
        if data_dir is not None and backend is not None:
            raise TypeError("ObjectStore takes data_dir or backend, not both")
        if backend is not None and not isinstance(backend, MetadataBackend):
            raise TypeError(f"ObjectStore backend must be a MetadataBackend, "
                            f"got {type(backend).__name__}")
        if data_dir is not None:
            backend = LocalJournalBackend(data_dir, fsync=self.options.fsync)
        self._backend = backend
        if backend is not None:
            try:
                self._recover(backend)
            except BaseException:
                self._backend = None
                backend.close()
                raise

    @property
    def persistent(self) -> bool:
        """True when committed changes go to a backend (calls may wait for it)."""
        backend = self._backend
        return backend is not None and backend.persistent

    def describe_persistence(self) -> str:
        """Where committed metadata is kept, for logs and Health."""
        backend = self._backend
        return backend.describe() if backend is not None else "in memory only"

    # -- clients and segments ------------------------------------------------------------

    def heartbeat(self, client_id: str) -> HeartbeatResult:
        """Keep `client_id` alive; an unknown one is registered and told to remount."""
        ttl_ms = int(self.options.client_ttl_s * 1000)
        with self._lock:
            now = self._sweep_locked()
            known = client_id in self._clients
            if client_id:
                self._touch_client_locked(client_id, now)
        return HeartbeatResult(ClientStatus.OK if known else ClientStatus.NEED_REMOUNT, ttl_ms)

    def mount_segment(self, client_id: str, segment: StoreSegment) -> SegmentResult:
        """Add `segment` (owned by `client_id`) to the space puts allocate from.

        Remounting the same memory (engine, segment id, epoch, base, length) is
        idempotent, moves ownership to the caller, and brings back the objects of a
        segment restored after a restart. A newer epoch replaces the segment (its objects
        are dropped: the memory was lost); an older one is refused (INVALID_VERSION).
        """
        problem = self._check_segment(client_id, segment)
        if problem:
            return SegmentResult(ErrorCode.INVALID_PARAMS, problem)
        with self._lock:
            now = self._sweep_locked()
            self._touch_client_locked(client_id, now)
            result = self._mount_locked(client_id, segment)
            mark = self._mark_locked() if result.code == ErrorCode.OK else None
        return self._after_commit(result, mark)

    def _mount_locked(self, client_id: str, segment: StoreSegment) -> SegmentResult:
        held = self._segments.get((segment.engine, segment.segment_id))
        name = f"segment {segment.engine}/{segment.segment_id}"
        if held is not None:
            if segment.epoch < held.info.epoch:
                return SegmentResult(ErrorCode.INVALID_VERSION,
                                     f"{name}: epoch {segment.epoch} is older than the "
                                     f"mounted epoch {held.info.epoch}")
            if held.same_memory(segment):
                restored = 0 if held.live else len(held.keys)
                held.client_id, held.live, held.info = client_id, True, segment
                self._journal_locked({"t": "mount", **_segment_record(held)})
                self._segments_changed_locked()
                log.info("%s %s by client %s (%d objects)", name,
                         "remounted" if restored else "mounted again", client_id, restored)
                return SegmentResult(ErrorCode.OK, "", restored)
            if segment.epoch == held.info.epoch and held.live:
                return SegmentResult(ErrorCode.SEGMENT_ALREADY_EXISTS,
                                     f"{name} epoch {segment.epoch} is mounted with base "
                                     f"{held.info.base:#x} length {held.info.length}; "
                                     "unmount it first")
            dropped = self._unmount_locked(held, "replaced by a new epoch")
            log.info("%s: epoch %d replaces %d; %d objects dropped", name, segment.epoch,
                     held.info.epoch, dropped)
        mounted = _Segment(segment, client_id, True, OffsetAllocator(segment.length))
        self._segments[mounted.ident] = mounted
        until = self._quarantine.pop(mounted.ident, 0.0)
        if until > self._clock():  # cached replicas of its last mount may still be read
            mounted.allocator.reserve(0, segment.length)
            self._at_locked(until, "free", _Replica(0, mounted, 0, segment.length))
        self._journal_locked({"t": "mount", **_segment_record(mounted)})
        self._segments_changed_locked()
        return SegmentResult(ErrorCode.OK)

    def unmount_segment(self, client_id: str, engine: str, segment_id: int) -> SegmentResult:
        """Withdraw a segment: its replicas go; objects left with none are removed."""
        with self._lock:
            self._sweep_locked()
            held = self._segments.get((engine, segment_id))
            if held is None:
                return SegmentResult(ErrorCode.SEGMENT_NOT_FOUND,
                                     f"segment {engine}/{segment_id} is not mounted")
            if held.client_id != client_id:
                return SegmentResult(ErrorCode.INVALID_PARAMS,
                                     f"segment {engine}/{segment_id} belongs to client "
                                     f"{held.client_id}, not {client_id}")
            dropped = self._unmount_locked(held, "unmounted")
            mark = self._journal_locked({"t": "unmount", "e": engine, "i": segment_id})
            wait_s = self._take_cache_wait_locked()
        return self._after_caches(SegmentResult(ErrorCode.OK, "", dropped), mark, wait_s)

    # -- calls held for a remount (docs/store.md, "A master switch") --------------------

    def segments_version(self) -> int:
        """A number that changes whenever the mounted segments change (read it before a
        call whose outcome depends on them, then `wait_segments_changed` from it)."""
        return self._segments_version

    def remount_pending(self) -> tuple[int, int]:
        """(segments awaiting their owner's remount, segments known): restored after a
        restart or a master switch, their space lends nothing until remounted."""
        with self._lock:
            segments = list(self._segments.values())
        return sum(1 for s in segments if not s.live), len(segments)

    def add_segment_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` (from the changing thread, under the store's lock: it must
        only signal) at every change of the mounted segments, until removed. Each listener
        is a call held for a remount: `stats()["puts_held_for_remount"]` counts them."""
        with self._listeners_lock:
            self._segment_listeners.add(listener)

    def remove_segment_listener(self, listener: Callable[[], None]) -> None:
        with self._listeners_lock:
            self._segment_listeners.discard(listener)

    def wait_segments_changed(self, version: int, timeout: float) -> bool:
        """Block until the mounted segments changed since `version` (True) or `timeout`
        seconds passed (False)."""
        changed = threading.Event()
        self.add_segment_listener(changed.set)
        try:
            return self._segments_version != version or changed.wait(max(0.0, timeout))
        finally:
            self.remove_segment_listener(changed.set)

    def count_remount_hold(self, *, timed_out: bool) -> None:
        """Count a call held for a remount (stats `remount_holds`), and one answered
        before the remount came (`remount_hold_timeouts`)."""
        with self._lock:
            self._counters["remount_hold_timeouts" if timed_out else "remount_holds"] += 1

    def _segments_changed_locked(self) -> None:
        self._segments_version += 1
        with self._listeners_lock:
            listeners = list(self._segment_listeners)
        for listener in listeners:
            listener()

    def list_segments(self) -> list[MountedSegment]:
        with self._lock:
            self._sweep_locked()
            return [MountedSegment(s.info, s.client_id, s.live, s.allocator.used)
                    for s in self._segments.values()]

    # -- puts ----------------------------------------------------------------------------

    def put_start(self, client_id: str, items: Sequence[tuple[str, int]],
                  config: ReplicaConfig | None = None, *, node_id: str = "",
                  upsert: bool = False) -> list[PutStartResult]:
        """Allocate replicas for each (key, value length); the value is invisible until put_end."""
        config = config or ReplicaConfig()
        problem = self._check_config(config)
        if problem or not client_id:
            code = ErrorCode.INVALID_PARAMS
            log.debug("put_start refused: %s", problem or "no client id")
            return [PutStartResult(code) for _ in items]
        results: list[PutStartResult] = []
        with self._lock:
            now = self._sweep_locked()
            self._evict_above_watermark_locked(now)
            for key, size in items:
                results.append(self._put_start_one_locked(client_id, key, size, config,
                                                          node_id, upsert, now))
            mark = self._mark_locked()
        # Space freed by removals/evictions is handed out only once the release is durable.
        return self._after_commit(results, mark)

    def _put_start_one_locked(self, client_id: str, key: str, size: int,
                              config: ReplicaConfig, node_id: str, upsert: bool,
                              now: float) -> PutStartResult:
        if not self._valid_key(key):
            return PutStartResult(ErrorCode.INVALID_KEY)
        if not isinstance(size, int) or not 0 < size <= MAX_U64:
            return PutStartResult(ErrorCode.INVALID_PARAMS)
        if key in self._objects and not upsert:
            return PutStartResult(ErrorCode.OBJECT_ALREADY_EXISTS)
        pending = self._puts_by_key.get(key)
        if pending is not None:
            if now - pending.started < self.options.put_start_discard_timeout_s:
                return PutStartResult(ErrorCode.OBJECT_ALREADY_EXISTS)
            log.info("put of %r by client %s unfinished for %.0f s: pre-empted", key,
                     pending.client_id, now - pending.started)
            self._counters["preempted_puts"] += 1
            self._drop_put_locked(pending, pending.started
                                  + self.options.put_start_release_timeout_s)
        replicas = self._allocate_locked(size, config, node_id)
        if not replicas and self._could_ever_fit_locked(size):
            # One replica is enough (best effort), so free room for one.
            target = max(int(self._capacity_locked() * self.options.eviction_ratio), size)
            if self._evict_locked(target, now):
                replicas = self._allocate_locked(size, config, node_id)
        if not replicas:
            return PutStartResult(ErrorCode.NO_AVAILABLE_HANDLE)
        put = _Put(next(self._put_ids), key, client_id, size, replicas, now, config)
        self._puts[put.put_id] = put
        self._puts_by_key[key] = put
        self._at_locked(now + self.options.put_start_release_timeout_s, "put", put)
        for replica in replicas:
            replica.segment.puts.add(put.put_id)
        return PutStartResult(ErrorCode.OK, put.put_id,
                              tuple(r.describe(ReplicaState.INIT) for r in replicas))

    def put_end(self, client_id: str, puts: Sequence[tuple[str, int]], *,
                reads_done: bool = False) -> list[int]:
        """Commit each (key, put_id): visible from now on, replacing an upserted value.
        `reads_done`: the caller has no read of the replaced values in flight and no cached
        locations of them (docs/store.md §4): its own holds on them end here."""
        codes: list[int] = []
        committed: list[list[Any]] = []
        with self._lock:
            now = self._sweep_locked()
            for key, put_id in puts:
                put = self._find_put_locked(client_id, key, put_id)
                if isinstance(put, int):
                    codes.append(put)
                    continue
                self._forget_put_locked(put)
                committed.append(self._install_value_locked(
                    key, put.size, put.replicas, put.config, now,
                    client_id if reads_done else ""))
                codes.append(ErrorCode.OK)
            mark = self._journal_locked({"t": "put", "o": committed}) if committed else None
            wait_s = self._take_cache_wait_locked()
        return self._after_caches(codes, mark, wait_s)

    def _install_value_locked(self, key: str, size: int, replicas: list[_Replica],
                              config: ReplicaConfig, now: float, reader: str = "",
                              ) -> list[Any]:
        """Make a written value visible (replacing the key's value, whose space waits
        for the reads that may be in flight: not `reader`'s), as PutEnd and Commit do;
        returns its journal record."""
        old = self._objects.pop(key, None)
        soft_until = 0.0
        if old is not None:
            soft_until = old.soft_pin_until
            if reader:
                old.reads.pop(reader, None)
                old.caches.pop(reader, None)
            self._release_object_locked(key, old, now)
        action = config.soft_pin_action
        if action == SoftPinAction.ENABLE:
            ttl_ms = config.soft_pin_ttl_ms or self.options.default_kv_soft_pin_ttl_ms
            soft_until = now + ttl_ms / 1000
        elif action == SoftPinAction.DISABLE:
            soft_until = 0.0
        obj = _Object(size, replicas, config.with_hard_pin, soft_until, installed=now)
        self._install_locked(key, obj)
        self._counters["puts"] += 1
        return obj.record(key)

    # -- one-round-trip puts (docs/store.md §2) -------------------------------------------

    def start_fence_s(self) -> float:
        """How long a front end that starts serving this store must allocate nothing: a
        predecessor's reservations may be written until then (docs/store.md §2)."""
        return self.options.reservation_ttl_ms / 1000 if self._may_have_predecessor else 0.0

    def reserve(self, client_id: str, config: ReplicaConfig | None = None, *,
                node_id: str = "", want_bytes: int = 0,
                release: Sequence[int] = ()) -> ReserveResult:
        """Set space aside for `client_id`'s one-round-trip puts: reservations on up to
        max(replica_num, RESERVE_SPREAD) distinct segments, in the order a put's replicas
        would try them (the client spreads values over them as the strategy would), each
        of at most `want_bytes` (0: reservation_bytes) and what _reservable_locked allows.
        Ends the client's reservations in `release` first. No eviction is done for it:
        NO_AVAILABLE_HANDLE when nothing fits."""
        config = config or ReplicaConfig()
        problem = self._check_config(config) or ("" if client_id else "no client id")
        if problem:
            return ReserveResult(ErrorCode.INVALID_PARAMS, message=problem)
        ttl_ms = self.options.reservation_ttl_ms
        want = min(want_bytes or self.options.reservation_bytes,
                   self.options.reservation_bytes)
        granted: list[Reservation] = []
        with self._lock:
            now = self._sweep_locked()
            self._release_locked(client_id, release)
            for segment in self._candidates_locked(config, node_id):
                if len(granted) == max(config.replica_num, RESERVE_SPREAD):
                    break
                size = self._reservable_locked(segment, want)
                offset = segment.allocator.allocate(size) if size > 0 else None
                if offset is None:
                    continue
                held = _Reservation(next(self._reservation_ids), client_id, segment,
                                    {offset: segment.allocator.block_size(offset)},
                                    now + ttl_ms / 1000)
                self._reservations[held.reservation_id] = held
                segment.reservations.add(held.reservation_id)
                self._at_locked(held.lease_until, "reservation", held)
                self._counters["reservations_granted"] += 1
                granted.append(Reservation(held.reservation_id, _Replica(
                    0, segment, offset, held.pieces[offset]).describe(ReplicaState.INIT)))
            # space freed by removals is handed out only once the release is durable
            mark = self._mark_locked() if granted else None
        if not granted:
            return ReserveResult(ErrorCode.NO_AVAILABLE_HANDLE,
                                 message="no mounted segment has room for a reservation")
        return self._after_commit(ReserveResult(ErrorCode.OK, tuple(granted), ttl_ms), mark)

    def _reservable_locked(self, segment: _Segment, want: int) -> int:
        """How much one more reservation may take in `segment` (0: none): at most an
        eighth of it, a quarter of its free space, and all reservations there together
        at most a quarter of it, so that reserved space, which eviction cannot take
        back, never starves two-phase puts."""
        allocator = segment.allocator
        reserved = sum(sum(self._reservations[rid].pieces.values())
                       for rid in segment.reservations)
        size = min(want, allocator.capacity // 8, allocator.free_bytes // 4,
                   allocator.capacity // 4 - reserved)
        size = size // ALIGNMENT * ALIGNMENT
        return size if size >= MIN_RESERVATION else 0

    def release(self, client_id: str, reservation_ids: Sequence[int]) -> list[int]:
        """End `client_id`'s reservations: what they still hold is free again. Per id OK,
        OBJECT_NOT_FOUND (unknown or ended), or INVALID_PARAMS (another client's)."""
        with self._lock:
            self._sweep_locked()
            return self._release_locked(client_id, reservation_ids)

    def _release_locked(self, client_id: str, reservation_ids: Iterable[int]) -> list[int]:
        codes: list[int] = []
        for reservation_id in reservation_ids:
            held = self._reservations.get(reservation_id)
            if held is None:
                codes.append(ErrorCode.OBJECT_NOT_FOUND)
            elif held.client_id != client_id:
                codes.append(ErrorCode.INVALID_PARAMS)
            else:
                self._end_reservation_locked(held)
                codes.append(ErrorCode.OK)
        return codes

    def _end_reservation_locked(self, held: _Reservation) -> None:
        del self._reservations[held.reservation_id]
        held.segment.reservations.discard(held.reservation_id)
        if self._owns_segment(held.segment):
            for start in held.pieces:
                held.segment.allocator.free(start)
        held.pieces = {}
        ended = self._ended_reservations
        ended[held.reservation_id] = held.client_id
        while len(ended) > _ENDED_KEPT:
            ended.popitem(last=False)

    def commit(self, client_id: str, items: Sequence[tuple[str, int, Sequence[ReservedRange]]],
               config: ReplicaConfig | None = None, *, upsert: bool = False,
               reads_done: bool = False) -> list[int]:
        """Make values the client wrote into its reservations visible, one code per
        (key, size, [(reservation id, addr, length)] per replica). A range must lie in a
        piece its reservation still holds; it becomes the object's own block. Durable
        before it returns, as PutEnd (`reads_done` as there)."""
        config = config or ReplicaConfig()
        problem = self._check_config(config) or ("" if client_id else "no client id")
        if problem:
            log.debug("commit refused: %s", problem)
            return [ErrorCode.INVALID_PARAMS for _ in items]
        ttl = self.options.reservation_ttl_ms / 1000
        codes: list[int] = []
        committed: list[list[Any]] = []
        with self._lock:
            now = self._sweep_locked()
            for key, size, ranges in items:
                code, claims = self._check_commit_locked(client_id, key, size, ranges,
                                                         upsert, now)
                codes.append(code)
                if code != ErrorCode.OK:
                    continue
                replicas = []
                for held, piece, offset, length in claims:
                    segment = held.segment
                    segment.allocator.carve(piece, offset, length)
                    whole = held.pieces.pop(piece)
                    if offset > piece:
                        held.pieces[piece] = offset - piece
                    end = offset + segment.allocator.block_size(offset)
                    if end < piece + whole:
                        held.pieces[end] = piece + whole - end
                    replicas.append(_Replica(next(self._replica_ids), segment, offset, size))
                    held.lease_until = now + ttl
                    self._at_locked(held.lease_until, "reservation", held)
                committed.append(self._install_value_locked(
                    key, size, replicas, config, now, client_id if reads_done else ""))
                self._counters["commits"] += 1
            mark = self._journal_locked({"t": "put", "o": committed}) if committed else None
            wait_s = self._take_cache_wait_locked()
        return self._after_caches(codes, mark, wait_s)

    def _check_commit_locked(self, client_id: str, key: str, size: int,
                             ranges: Sequence[ReservedRange], upsert: bool, now: float,
                             ) -> tuple[int, list[tuple[_Reservation, int, int, int]]]:
        """ErrorCode for one commit item, and its claims (reservation, piece, offset,
        length) when OK; changes nothing."""
        if not self._valid_key(key):
            return ErrorCode.INVALID_KEY, []
        if not isinstance(size, int) or not 0 < size <= MAX_U64 or not 0 < len(ranges) <= MAX_REPLICAS:
            return ErrorCode.INVALID_PARAMS, []
        claims: list[tuple[_Reservation, int, int, int]] = []
        segments: set[int] = set()
        for reservation_id, addr, length in ranges:
            held = self._reservations.get(reservation_id)
            if held is None:
                ended = self._ended_reservations.get(reservation_id)
                return (ErrorCode.LEASE_EXPIRED if ended == client_id
                        else ErrorCode.OBJECT_NOT_FOUND), []
            if held.client_id != client_id:
                return ErrorCode.INVALID_PARAMS, []
            if held.lease_until <= now:
                return ErrorCode.LEASE_EXPIRED, []
            offset = addr - held.segment.info.base
            need = _align(max(length, 1), ALIGNMENT)
            piece = held.piece_holding(offset, need)
            if (length < size or offset % ALIGNMENT or piece is None
                    or id(held.segment) in segments):
                return ErrorCode.INVALID_PARAMS, []
            segments.add(id(held.segment))
            claims.append((held, piece, offset, length))
        if key in self._puts_by_key or (key in self._objects and not upsert):
            return ErrorCode.OBJECT_ALREADY_EXISTS, []
        return ErrorCode.OK, claims

    def put_revoke(self, client_id: str, puts: Sequence[tuple[str, int]]) -> list[int]:
        """Abandon each (key, put_id): its space is freed; a committed value is untouched."""
        codes: list[int] = []
        with self._lock:
            self._sweep_locked()
            for key, put_id in puts:
                put = self._find_put_locked(client_id, key, put_id)
                if isinstance(put, int):
                    codes.append(put)
                    continue
                self._drop_put_locked(put, 0.0)  # the writer itself gave up: free now
                codes.append(ErrorCode.OK)
        return codes

    def _find_put_locked(self, client_id: str, key: str, put_id: int) -> _Put | int:
        put = self._puts.get(put_id)
        if put is None or put.key != key:
            return ErrorCode.OBJECT_NOT_FOUND
        if put.client_id != client_id:
            return ErrorCode.INVALID_PARAMS
        return put

    # -- reads ---------------------------------------------------------------------------

    def get_replicas(self, keys: Sequence[str], *, cache: bool = False,
                     client_id: str = "") -> list[GetReplicasResult]:
        """Readable replicas of each key, leasing each object found and holding its
        space for `client_id`'s read until the lease ends (or that client's own removal
        says the read is over: `remove(..., reader=)`). `cache`: the caller may read from
        them without asking again for `cache_ttl_ms` (at most the lease), and whatever
        removes or replaces the value returns only after that."""
        ttl_ms = self.options.default_kv_lease_ttl_ms
        cache_ms = min(self.options.location_cache_ttl_ms, ttl_ms) if cache else 0
        results = []
        with self._lock:
            now = self._sweep_locked()
            for key in keys:
                code, obj, live = self._readable_locked(key, now, lease=True)
                if obj is None or code != ErrorCode.OK:
                    results.append(GetReplicasResult(code))
                    continue
                obj.hold(obj.reads, client_id, obj.lease_until, now)
                if cache_ms:
                    obj.hold(obj.caches, client_id, now + cache_ms / 1000, now)
                results.append(GetReplicasResult(
                    ErrorCode.OK, obj.size,
                    tuple(r.describe(ReplicaState.COMPLETE) for r in live), ttl_ms, cache_ms))
        return results

    def exist_keys(self, keys: Sequence[str]) -> list[int]:
        """OK (stored and readable; leased, as in Mooncake), OBJECT_NOT_FOUND, or
        REPLICA_IS_NOT_READY (stored, but awaiting its segment's remount)."""
        with self._lock:
            now = self._sweep_locked()
            return [self._readable_locked(key, now, lease=True)[0] for key in keys]

    def get_sizes(self, keys: Sequence[str], *, lease: bool = False) -> list[int]:
        """Each value's size, or a negative ErrorCode. `lease`: a client's read (the
        GetSize call), leased and an access like every other, as in Mooncake (a plain
        remove right after it is OBJECT_HAS_LEASE); without it a look that holds nothing."""
        with self._lock:
            now = self._sweep_locked()
            sizes = []
            for key in keys:
                code, obj, _ = self._readable_locked(key, now, lease=lease)
                sizes.append(obj.size if obj is not None and code == ErrorCode.OK else code)
            return sizes

    def _readable_locked(self, key: str, now: float, *, lease: bool,
                         ) -> tuple[int, _Object | None, list[_Replica]]:
        obj = self._objects.get(key)
        if obj is None:
            return ErrorCode.OBJECT_NOT_FOUND, None, []
        live = [r for r in obj.replicas if r.segment.live]
        if not live:
            return ErrorCode.REPLICA_IS_NOT_READY, obj, []
        if lease:  # a read (or exist): an access for LRU, and a lease
            self._objects.move_to_end(key)
            obj.lease_until = max(obj.lease_until,
                                  now + self.options.default_kv_lease_ttl_ms / 1000)
        return ErrorCode.OK, obj, live

    # -- removal -------------------------------------------------------------------------

    def remove(self, keys: Sequence[str], *, force: bool = False,
               reader: str = "") -> list[int]:
        """Remove each key; OBJECT_HAS_LEASE while leased unless `force`. `reader`: the
        calling client, which has no read of these keys in flight and dropped its cached
        locations of them, so its own read and cache holds end here; the space of a
        removed value is reused once no other client's read may be in flight, and the call
        returns once no other client may read it from a cache (docs/store.md §4)."""
        codes: list[int] = []
        removed: list[str] = []
        with self._lock:
            now = self._sweep_locked()
            for key in keys:
                obj = self._objects.get(key)
                if obj is not None and reader:
                    obj.reads.pop(reader, None)
                    obj.caches.pop(reader, None)
                if obj is None:
                    codes.append(ErrorCode.OBJECT_NOT_FOUND)
                elif obj.lease_until > now and not force:
                    codes.append(ErrorCode.OBJECT_HAS_LEASE)
                else:
                    self._remove_locked(key, now)
                    removed.append(key)
                    codes.append(ErrorCode.OK)
            mark = self._journal_locked({"t": "rm", "k": removed}) if removed else None
            wait_s = self._take_cache_wait_locked()
        return self._after_caches(codes, mark, wait_s)

    def remove_by_regex(self, pattern: str, *, force: bool = False) -> CountResult:
        """Remove the committed objects whose key `pattern` matches (`search`; leased
        ones stay unless force). The keys are matched outside the lock, within
        REGEX_BUDGET_S."""
        try:
            compiled = _compile_regex(pattern)
        except (_RegexRefused, *_BAD_REGEX) as exc:
            return CountResult(ErrorCode.INVALID_PARAMS, 0, _refusal(pattern, exc))
        with self._lock:
            keys = list(self._objects)
        try:
            chosen = set(_matching(compiled, keys))
        except _RegexTooSlow:
            return CountResult(ErrorCode.INVALID_PARAMS, 0, _too_slow(pattern, len(keys)))
        return self._remove_matching(chosen, force)

    def remove_all(self, *, force: bool = False) -> CountResult:
        """Remove every committed object (leased ones stay unless force)."""
        return self._remove_matching(None, force)

    def _remove_matching(self, chosen: set[str] | None, force: bool) -> CountResult:
        """Remove the keys in `chosen` (None: every key) that are not leased, or all of
        them with force."""
        with self._lock:
            now = self._sweep_locked()
            doomed = [key for key, obj in self._objects.items()
                      if (chosen is None or key in chosen) and (force or obj.lease_until <= now)]
            for key in doomed:
                self._remove_locked(key, now)
            mark = self._journal_locked({"t": "rm", "k": doomed}) if doomed else None
            wait_s = self._take_cache_wait_locked()
        return self._after_caches(CountResult(ErrorCode.OK, len(doomed)), mark, wait_s)

    # -- listing -------------------------------------------------------------------------

    def list_keys(self, pattern: str = "", limit: int = 0) -> KeyListing:
        """Committed objects and puts in progress whose key `pattern` matches (`search`),
        sorted by key, at most `limit` (0, or above MAX_LIST_KEYS: MAX_LIST_KEYS).

        For operators: takes no lease and counts as no access. The keys are matched
        outside the lock, so a large store is not stalled by the regex.
        """
        try:
            compiled = _compile_regex(pattern)
        except (_RegexRefused, *_BAD_REGEX) as exc:
            return KeyListing(ErrorCode.INVALID_PARAMS, message=_refusal(pattern, exc))
        cap = MAX_LIST_KEYS if limit <= 0 else min(limit, MAX_LIST_KEYS)
        with self._lock:
            self._sweep_locked()
            keys = set(self._objects)
            keys.update(self._puts_by_key)
        try:
            matching = _matching(compiled, keys)
        except _RegexTooSlow:
            return KeyListing(ErrorCode.INVALID_PARAMS, message=_too_slow(pattern, len(keys)))
        chosen = heapq.nsmallest(cap, matching)
        with self._lock:
            now = self._clock()
            infos = [info for info in (self._key_info_locked(key, now) for key in chosen)
                     if info is not None]  # a key removed meanwhile is left out
        return KeyListing(ErrorCode.OK, tuple(infos), len(matching),
                          len(matching) > len(chosen))

    def _key_info_locked(self, key: str, now: float) -> KeyInfo | None:
        def left_ms(until: float) -> int:
            return max(0, int((until - now) * 1000))

        def replicas(held: list[_Replica], state: ReplicaState) -> tuple[KeyReplica, ...]:
            return tuple(KeyReplica(r.describe(state), r.segment.info.name, r.segment.live)
                         for r in held)

        obj = self._objects.get(key)
        if obj is not None:
            ready = any(r.segment.live for r in obj.replicas)
            return KeyInfo(key, obj.size, KeyState.COMPLETE if ready else KeyState.NOT_READY,
                           replicas(obj.replicas, ReplicaState.COMPLETE),
                           left_ms(obj.lease_until), obj.hard_pin, left_ms(obj.soft_pin_until))
        put = self._puts_by_key.get(key)
        if put is not None:
            return KeyInfo(key, put.size, KeyState.PUTTING,
                           replicas(put.replicas, ReplicaState.INIT),
                           hard_pin=put.config.with_hard_pin)
        return None

    # -- upkeep --------------------------------------------------------------------------

    def tick(self) -> None:
        """Periodic upkeep: expiries, stale puts, deferred frees, watermark eviction,
        snapshot when the journal has grown. Call it every ~100 ms."""
        with self._lock:
            now = self._sweep_locked()
            self._evict_above_watermark_locked(now)
            backend = self._backend
            due = (backend is not None
                   and backend.records_since_snapshot >= self.options.snapshot_every_records)
        if backend is not None:
            backend.wait_durable()
        if due:
            self.snapshot()

    def snapshot(self) -> None:
        """Write a snapshot of the committed state to the backend, superseding the
        records before it (a new, empty journal for the local one)."""
        with self._snapshot_lock:
            with self._lock:
                backend = self._backend
                cut = backend.begin_snapshot() if backend is not None else None
                if backend is None or cut is None:
                    return
                state = self._state_locked()
            backend.write_snapshot(cut, state)

    def stats(self) -> dict[str, float]:
        with self._lock:
            self._sweep_locked()
            live = [s for s in self._segments.values() if s.live]
            capacity = sum(s.allocator.capacity for s in live)
            used = sum(s.allocator.used for s in live)
            free = capacity - used
            # per segment: an allocation never spans segments
            largest = sum(s.allocator.largest_free() for s in live)
            return {
                "keys": float(len(self._objects)),
                "puts_in_progress": float(len(self._puts)),
                "reservations": float(len(self._reservations)),
                "reserved_bytes": float(sum(sum(r.pieces.values())
                                            for r in self._reservations.values())),
                "segments": float(len(live)),
                "segments_awaiting_remount": float(len(self._segments) - len(live)),
                "puts_held_for_remount": float(len(self._segment_listeners)),
                "clients": float(len(self._clients)),
                "capacity": float(capacity),
                "used": float(used),
                "usage": used / capacity if capacity else 0.0,
                "fragmentation": 0.0 if free == 0 else 1.0 - largest / free,
                "retired_bytes": float(sum(
                    r.segment.allocator.block_size(r.offset)
                    for _, _, kind, r in self._deadlines if kind == "free" and self._owns(r))),
                **{name: float(value) for name, value in self._counters.items()},
            }

    def holds(self) -> dict[str, int]:
        """Objects under a read lease, hard-pinned and soft-pinned now (for metrics).

        The lock is held only to copy the object list; the O(objects) count runs
        outside it, so a scrape of a large store does not stall store calls.
        """
        with self._lock:
            now = self._clock()
            objects = list(self._objects.values())
        return {"leased": sum(1 for o in objects if o.lease_until > now),
                "hard_pinned": sum(1 for o in objects if o.hard_pin),
                "soft_pinned": sum(1 for o in objects if o.soft_pin_until > now)}

    def close(self, *, snapshot: bool = True) -> None:
        """Close the backend, after a snapshot so the next start replays little; the
        store goes on in memory only.

        snapshot=False leaves the backend as a crash would (the journal as written).
        """
        if self._backend is None:
            return
        if snapshot:
            self.snapshot()
        with self._snapshot_lock, self._lock:
            backend, self._backend = self._backend, None
            if backend is not None:
                backend.close()

    # -- internals: checks -------------------------------------------------------------

    @staticmethod
    def _valid_key(key: object) -> bool:
        return (isinstance(key, str) and bool(key)
                and len(key.encode("utf-8", "surrogatepass")) <= MAX_KEY_BYTES)

    @staticmethod
    def _check_segment(client_id: str, segment: StoreSegment) -> str:
        if not client_id:
            return "client id must not be empty"
        if not segment.engine:
            return "segment engine name must not be empty"
        if segment.length <= 0 or segment.base + segment.length > MAX_U64 + 1:
            return (f"segment {segment.engine}/{segment.segment_id}: bad range base "
                    f"{segment.base:#x} length {segment.length}")
        return ""

    @staticmethod
    def _check_config(config: ReplicaConfig) -> str:
        if not 1 <= config.replica_num <= MAX_REPLICAS:
            return f"replica_num must be in [1, {MAX_REPLICAS}], got {config.replica_num}"
        if not 0 <= config.soft_pin_ttl_ms <= MAX_SOFT_PIN_TTL_MS:
            return f"soft_pin_ttl_ms must be in [0, {MAX_SOFT_PIN_TTL_MS}]"
        return ""

    # -- internals: allocation ---------------------------------------------------------

    def _capacity_locked(self) -> int:
        return sum(s.allocator.capacity for s in self._segments.values() if s.live)

    def _used_locked(self) -> int:
        return sum(s.allocator.used for s in self._segments.values() if s.live)

    def _could_ever_fit_locked(self, size: int) -> bool:
        """Some live segment is big enough (else eviction would free room for nothing)."""
        need = _align(size, ALIGNMENT)
        return any(s.live and s.allocator.capacity >= need for s in self._segments.values())

    def _candidates_locked(self, config: ReplicaConfig, node_id: str) -> list[_Segment]:
        """Live segments in the order replicas should try them."""
        live = [s for s in self._segments.values() if s.live]
        by_engine: dict[str, list[_Segment]] = {}
        for segment in live:
            by_engine.setdefault(segment.info.engine, []).append(segment)
            if segment.info.name:
                by_engine.setdefault(segment.info.name, []).append(segment)
        ordered: list[_Segment] = []
        seen: set[int] = set()

        def take(segments: Iterable[_Segment]) -> None:
            for segment in segments:
                if id(segment) not in seen:
                    seen.add(id(segment))
                    ordered.append(segment)

        for name in config.preferred_segments:
            take(self._by_strategy(by_engine.get(name, [])))
        if config.prefer_alloc_in_same_node and node_id:
            take(self._by_strategy([s for s in live if s.info.node_id == node_id]))
        take(self._by_strategy(live))
        return ordered

    def _by_strategy(self, segments: list[_Segment]) -> list[_Segment]:
        shuffled = list(segments)
        self._rng.shuffle(shuffled)
        if self.options.allocation_strategy == AllocationStrategy.FREE_RATIO_FIRST:
            shuffled.sort(key=lambda s: s.allocator.free_bytes / s.allocator.capacity,
                          reverse=True)  # stable: equal ratios stay in random order
        return shuffled

    def _allocate_locked(self, size: int, config: ReplicaConfig,
                         node_id: str) -> list[_Replica]:
        replicas: list[_Replica] = []
        for segment in self._candidates_locked(config, node_id):
            if len(replicas) == config.replica_num:
                break
            offset = segment.allocator.allocate(size)
            if offset is not None:
                replicas.append(_Replica(next(self._replica_ids), segment, offset, size))
        return replicas

    # -- internals: eviction -----------------------------------------------------------

    def _evict_above_watermark_locked(self, now: float) -> None:
        capacity = self._capacity_locked()
        if capacity and self._used_locked() > capacity * self.options.eviction_high_watermark_ratio:
            self._evict_locked(int(capacity * self.options.eviction_ratio), now)

    def _evict_locked(self, target: int, now: float) -> int:
        """Evict least recently used objects until `target` bytes of live space are freed:
        soft-pinned ones only if the others are not enough; never leased, hard-pinned or
        in-progress ones. Returns the bytes freed."""
        if target <= 0:
            return 0
        plain: list[str] = []
        pinned: list[str] = []
        fresh = now - self.options.eviction_grace_ms / 1000
        for key, obj in self._objects.items():
            if (obj.hard_pin or obj.lease_until > now or key in self._puts_by_key
                    or obj.installed > fresh):
                continue
            if not any(r.segment.live for r in obj.replicas):
                continue  # frees nothing allocations could use
            (pinned if obj.soft_pin_until > now else plain).append(key)
        freed = 0
        victims: list[str] = []
        for key in itertools.chain(plain, pinned):
            if freed >= target:
                break
            obj = self._objects[key]
            freed += sum(r.segment.allocator.block_size(r.offset)
                         for r in obj.replicas if r.segment.live)
            self._remove_locked(key, now)
            victims.append(key)
        if victims:
            self._counters["evictions"] += 1
            self._counters["evicted"] += len(victims)
            log.info("evicted %d objects (%d bytes)", len(victims), freed)
            self._journal_locked({"t": "rm", "k": victims})
        return freed

    # -- internals: index changes ------------------------------------------------------

    def _owns(self, replica: _Replica) -> bool:
        """The replica's segment is still the mounted one (its allocator still counts)."""
        return self._owns_segment(replica.segment)

    def _owns_segment(self, segment: _Segment) -> bool:
        return self._segments.get(segment.ident) is segment

    def _free_replica_locked(self, replica: _Replica, until: float, now: float) -> None:
        if not self._owns(replica):
            return
        if until > now:
            self._at_locked(until, "free", replica)
        else:
            replica.segment.allocator.free(replica.offset)

    def _install_locked(self, key: str, obj: _Object) -> None:
        self._objects[key] = obj
        self._objects.move_to_end(key)
        for replica in obj.replicas:
            replica.segment.keys.add(key)

    def _release_object_locked(self, key: str, obj: _Object, now: float) -> None:
        """Detach a removed/replaced object; its space waits for the reads that may
        still be in flight, and the call that removed it returns only once no client may
        read it from a cache (docs/store.md §4)."""
        self._cache_wait_until = max(self._cache_wait_until, obj.cache_until())
        for replica in obj.replicas:
            replica.segment.keys.discard(key)
            self._free_replica_locked(replica, obj.read_until(), now)

    def _remove_locked(self, key: str, now: float) -> None:
        self._release_object_locked(key, self._objects.pop(key), now)

    def _forget_put_locked(self, put: _Put) -> None:
        del self._puts[put.put_id]
        if self._puts_by_key.get(put.key) is put:
            del self._puts_by_key[put.key]
        for replica in put.replicas:
            replica.segment.puts.discard(put.put_id)

    def _drop_put_locked(self, put: _Put, release_at: float) -> None:
        self._forget_put_locked(put)
        now = self._clock()
        for replica in put.replicas:
            self._free_replica_locked(replica, release_at, now)

    def _unmount_locked(self, segment: _Segment, why: str) -> int:
        """Remove a segment: replicas on it go; objects left with none are removed.
        Returns how many objects were removed."""
        dropped = 0
        # clients may read replicas here from their caches until then: the caller waits
        # for it, and the same memory mounted again lends nothing out before it
        cached = max((self._objects[key].cache_until() for key in segment.keys), default=0.0)
        self._cache_wait_until = max(self._cache_wait_until, cached)
        if cached > self._clock():
            self._quarantine[segment.ident] = cached
        for key in list(segment.keys):
            obj = self._objects[key]
            obj.replicas = [r for r in obj.replicas if r.segment is not segment]
            if not obj.replicas:
                del self._objects[key]
                dropped += 1
        for put_id in list(segment.puts):
            put = self._puts[put_id]
            put.replicas = [r for r in put.replicas if r.segment is not segment]
            if not put.replicas:
                self._forget_put_locked(put)
        for reservation_id in list(segment.reservations):
            self._end_reservation_locked(self._reservations[reservation_id])
        del self._segments[segment.ident]
        self._segments_changed_locked()
        log.info("segment %s/%s of client %s %s: %d objects dropped", segment.info.engine,
                 segment.info.segment_id, segment.client_id, why, dropped)
        return dropped

    def _at_locked(self, when: float, kind: str, subject: Any) -> None:
        heapq.heappush(self._deadlines, (when, next(self._deadline_seq), kind, subject))

    def _touch_client_locked(self, client_id: str, now: float) -> None:
        deadline = now + self.options.client_ttl_s
        self._clients[client_id] = deadline
        self._at_locked(deadline, "client", client_id)

    def _sweep_locked(self) -> float:
        """Apply every deadline that has passed (O(log n) each); returns now."""
        now = self._clock()
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            when, _, kind, subject = heapq.heappop(deadlines)
            if kind == "client":
                if self._clients.get(subject) == when:  # not extended since
                    self._expire_client_locked(subject)
            elif kind == "free":
                if self._owns(subject):
                    subject.segment.allocator.free(subject.offset)
            elif kind == "reservation":
                if (self._reservations.get(subject.reservation_id) is subject
                        and subject.lease_until <= now):
                    self._counters["reservations_expired"] += 1
                    self._end_reservation_locked(subject)
            elif kind == "put":
                if self._puts.get(subject.put_id) is subject:
                    log.info("put of %r by client %s unfinished for %.0f s: released",
                             subject.key, subject.client_id, now - subject.started)
                    self._counters["released_puts"] += 1
                    self._drop_put_locked(subject, 0.0)
            elif (kind == "await" and self._segments.get(subject.ident) is subject
                  and not subject.live):
                self._unmount_locked(subject, "never remounted after the restart")
                self._journal_locked({"t": "unmount", "e": subject.info.engine,
                                      "i": subject.info.segment_id})
        return now

    def _expire_client_locked(self, client_id: str) -> None:
        """Drop a client whose heartbeats stopped, and unmount its segments now."""
        del self._clients[client_id]
        self._counters["expired_clients"] += 1
        for segment in [s for s in self._segments.values()
                        if s.client_id == client_id and s.live]:
            self._unmount_locked(segment, "lost: its client's heartbeats stopped")
            self._journal_locked({"t": "unmount", "e": segment.info.engine,
                                  "i": segment.info.segment_id})

    # -- internals: persistence --------------------------------------------------------

    def _journal_locked(self, record: dict[str, Any]) -> _Mark:
        """Append a record to the backend; the mark says where it ends, for _after_commit."""
        backend = self._backend
        return (backend, backend.append(record)) if backend is not None else None

    def _mark_locked(self) -> _Mark:
        """Where the backend's records end now (everything before must be durable)."""
        backend = self._backend
        return (backend, backend.mark()) if backend is not None else None

    @staticmethod
    def _after_commit(result: _T, mark: _Mark) -> _T:
        """Return `result` once the records up to `mark` are durable; called without the
        lock, so other calls go on while this one waits for the disk."""
        if mark is not None:
            backend, position = mark
            backend.wait_durable(position)
        return result

    def _take_cache_wait_locked(self) -> float:
        """Seconds the calling removal / replacement must wait before it returns: until
        no client may still read what it removed from a location cache."""
        until, self._cache_wait_until = self._cache_wait_until, 0.0
        return max(0.0, until - self._clock())

    def _after_caches(self, result: _T, mark: _Mark, wait_s: float) -> _T:
        """_after_commit, then the wait _take_cache_wait_locked gave (without the lock)."""
        self._after_commit(result, mark)
        if wait_s > 0:
            self._counters["cache_waits"] += 1
            time.sleep(wait_s)
        return result

    def _state_locked(self) -> dict[str, Any]:
        return {
            "version": 1,
            "next_replica_id": next(self._replica_ids),
            "segments": [_segment_record(s) for s in self._segments.values()],
            "objects": [obj.record(key) for key, obj in self._objects.items()],
        }

    def _recover(self, backend: MetadataBackend) -> None:
        loaded = backend.load()
        snapshot, records = loaded.snapshot, loaded.records
        now = self._clock()
        max_replica = 0
        if snapshot is not None:
            for record in snapshot.get("segments", ()):
                self._replay_mount(record, now)
            for obj in snapshot.get("objects", ()):
                max_replica = max(max_replica, self._replay_put(obj, now))
            max_replica = max(max_replica, snapshot.get("next_replica_id", 1) - 1)
        for record in records:
            kind = record.get("t")
            if kind == "mount":
                self._replay_mount(record, now)
            elif kind == "unmount":
                held = self._segments.get((record["e"], record["i"]))
                if held is not None:
                    self._unmount_locked(held, "unmounted (journal)")
            elif kind == "put":
                for obj in record["o"]:
                    max_replica = max(max_replica, self._replay_put(obj, now))
            elif kind == "rm":
                for key in record["k"]:
                    if key in self._objects:
                        self._remove_locked(key, now)
            else:
                log.warning("store journal: unknown record kind %r ignored", kind)
        # A reader may have held a lease when the old master died: start a new one for
        # every object (granted only now: during replay, replaced space is freed at once).
        lease = now + self.options.default_kv_lease_ttl_ms / 1000
        for obj in self._objects.values():
            obj.lease_until = lease
            obj.reads[""] = lease
        self._replica_ids = itertools.count(max_replica + 1)
        log.info("store recovered from %s: %d objects in %d segments awaiting remount",
                 backend.describe(), len(self._objects), len(self._segments))
        self._may_have_predecessor = not loaded.empty
        if not loaded.empty:
            self.snapshot()  # start from one compact file; also drops a cut-off tail's file

    def _replay_mount(self, record: dict[str, Any], now: float) -> None:
        client_id, info = _segment_from_record(record)
        held = self._segments.get((info.engine, info.segment_id))
        if held is not None:
            if held.same_memory(info):
                held.client_id, held.info = client_id, info
                return
            self._unmount_locked(held, "replaced (journal)")
        segment = _Segment(info, client_id, False, OffsetAllocator(info.length))
        self._segments[segment.ident] = segment
        self._at_locked(now + self.options.remount_grace_s, "await", segment)

    def _replay_put(self, record: list[Any], now: float) -> int:
        """Install one committed object (replacing any older value); returns its max
        replica id. Replicas on unknown segments or overlapping ranges are skipped."""
        key, size, hard_pin, replica_records = record
        if key in self._objects:
            self._remove_locked(key, now)
        replicas: list[_Replica] = []
        top = 0
        for replica_id, engine, segment_id, epoch, offset, length in replica_records:
            top = max(top, replica_id)
            segment = self._segments.get((engine, segment_id))
            if segment is None or segment.info.epoch != epoch:
                continue
            if not segment.allocator.reserve(offset, length):
                log.warning("store journal: replica %d of %r overlaps another; skipped",
                            replica_id, key)
                continue
            replicas.append(_Replica(replica_id, segment, offset, length))
        if replicas:
            self._install_locked(key, _Object(size, replicas, hard_pin))
        return top


__all__ = [
    "ALIGNMENT", "ALLOCATION_STRATEGIES", "AllocationStrategy", "ObjectStore",
    "OffsetAllocator", "StoreOptions",
]
