"""etcd v3 as hixl's shared metadata store: one client seam that everything else uses.

hixl-master keeps its registry and object index in a metadata backend; with etcd
configured, several masters share one etcd cluster (high availability, issue 8). This
module is that seam, and nothing here knows about registries or stores:

- `EtcdConfig`: endpoints, the cluster's key prefix, optional TLS and user/password, the
  per-call deadline; parsed and checked up front (ConfigError naming the key).
- `EtcdClient`: get / get_prefix / put / delete / delete_prefix / txn / commit, leases with
  a background keeper that reports a lost lease, prefix watches that survive a member dying,
  and `Election` (etcd's election recipe: the candidate key with the lowest create revision
  under `election/<name>/` leads).

Every key is namespaced by the prefix: callers pass and receive keys relative to it, so
clusters with different prefixes on one etcd never see each other. Every call has a
deadline (`EtcdConfig.timeout`, or the call's `timeout=`) and fails with a typed hixl
error naming the endpoints: `PeerUnavailable` when no member could be reached,
`TransferTimeout` when members answered but could not serve the call in time (no quorum,
leader election); `UNAVAILABLE_ERRORS` catches both.

Design choices, and why:

- aetcd's `Client` talks to one endpoint, over plaintext only, and its watcher drops the
  stream on any error without resuming. So hixl uses aetcd for the etcd v3 protocol (its
  generated stubs and messages, `aetcd.rpc`) and does endpoint fail-over, TLS, auth,
  deadlines and watch resumption here.
- The facade is synchronous (the master's store calls are blocking code on threads), over
  grpc.aio running on the client's own event-loop thread: all watches and lease keepers
  are tasks on that one thread instead of a thread each, and the channels stay bound to
  one loop whatever thread or loop calls. Async callers wrap calls in
  `asyncio.to_thread`; watch and lease callbacks run on the client's callback thread (in
  order, one at a time), where they may call the client again.
- Fail-over: one channel per endpoint; a call starts on the member in use and, when that
  member is unreachable or cannot serve it (UNAVAILABLE, or no answer within its share of
  the deadline), moves on to the next endpoint, round after round with a short pause,
  until the deadline. A call cut off mid-flight may have been applied: a retried `put` is
  harmless; a retried `txn` then finds its compare false (callers re-read, as optimistic
  concurrency does anyway).
- Watches and lease keepalives carry etcd's `hasleader` requirement, so a member cut off
  from the quorum closes them instead of going silent, and they move to another member.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import queue
import string
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import grpc

from hixl.addresses import join_host_port, split_host_port
from hixl.errors import (
    AuthenticationFailed,
    ConfigError,
    HixlError,
    NotConnected,
    ParamInvalid,
    PeerUnavailable,
    ResourceExhausted,
    TransferFailed,
    TransferTimeout,
)
from hixl.tls import ClientTLS

log = logging.getLogger("hixl.etcd")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_PREFIX = "/hixl/default/"
#: what a caller catches for "etcd cannot serve this now" (down, no quorum, too slow)
UNAVAILABLE_ERRORS: tuple[type[HixlError], ...] = (PeerUnavailable, TransferTimeout)

#: etcd's default --max-txn-ops: operations one txn may carry
MAX_TXN_OPS = 128
#: bytes of keys and values one txn may carry (etcd's default request limit is 1.5 MiB)
MAX_TXN_BYTES = 1 << 20
_MIN_ATTEMPT_S = 0.5  # a member gets at least this much of a deadline before the next one
_MAX_PAUSE_S = 0.5  # between rounds over all endpoints
_PAGE = 1000  # keys per Range page in get_prefix
_CONFIG_KEYS = ("endpoints", "prefix", "ca_file", "cert_file", "key_file", "server_name",
                "user", "password", "timeout")
_HAS_LEADER = ("hasleader", "true")  # etcd: close this stream if the member loses its leader
_CHANNEL_OPTIONS = [
    # a restarted member is used again within a second, not after gRPC's 2-minute backoff
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # a silently dead member (host gone, no RST) is noticed on idle watch streams;
    # etcd refuses pings more often than every 5 s
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.enable_retries", 0),  # retries are ours: across members, within the deadline
]

T = TypeVar("T")
_KEY_SAFE = "".join(sorted(set(string.ascii_letters + string.digits
                                + string.punctuation) - {"%"}))


def _rpc() -> Any:
    """aetcd's etcd v3 protocol module; the extra is optional, so imported on first use."""
    try:
        from aetcd import rpc
    except ImportError:
        raise ConfigError("the etcd metadata backend needs the aetcd package: "
                          "pip install 'hixl[etcd]'") from None
    return rpc


# --------------------------------------------------------------------------- config


def _setting(key: str) -> str:
    return f"etcd_{key}"


def _parse_endpoint(text: str) -> tuple[str, str]:
    """(host:port, scheme or "") from "host:port", "[v6]:port" or "http(s)://host:port"."""
    raw = text.strip()
    scheme = ""
    if "://" in raw:
        scheme, _, raw = raw.partition("://")
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise ConfigError(f"{_setting('endpoints')}: {text!r}: scheme must be http:// "
                              "or https:// (or none)")
        raw = raw.rstrip("/")
    host, port = split_host_port(raw, f"{_setting('endpoints')}:", error=ConfigError,
                                 no_port=f"{_setting('endpoints')}: {text!r} is not "
                                         "host:port (e.g. 10.0.0.1:2379)")
    return join_host_port(host, port), scheme


def _parse_timeout(value: object) -> float:
    text = value.strip().removesuffix("s").strip() if isinstance(value, str) else value
    if isinstance(text, bool) or not isinstance(text, (int, float, str)):
        raise ConfigError(f"{_setting('timeout')}: must be a number of seconds, got "
                          f"{value!r}")
    try:
        seconds = float(text)
    except ValueError:
        raise ConfigError(f"{_setting('timeout')}: must be a number of seconds, got "
                          f"{value!r}") from None
    if not math.isfinite(seconds) or not 0 < seconds <= 3600:
        raise ConfigError(f"{_setting('timeout')}: must be more than 0 and at most 3600 "
                          f"seconds, got {value!r}")
    return seconds


def normalize_prefix(prefix: object) -> str:
    """A cluster's key namespace, ending with "/" (so "/hixl/a" and "/hixl/ab" cannot
    overlap); ConfigError unless it is an absolute path-like text with a name in it."""
    setting = _setting("prefix")
    if not isinstance(prefix, str):
        raise ConfigError(f"{setting}: must be a text like '/hixl/<cluster>/', got "
                          f"{type(prefix).__name__}")
    if not prefix.startswith("/") or not prefix.strip("/"):
        raise ConfigError(f"{setting}: {prefix!r} must start with '/' and name the cluster, "
                          "e.g. '/hixl/<cluster>/'")
    if any(not c.isprintable() or c.isspace() for c in prefix) or "//" in prefix:
        raise ConfigError(f"{setting}: {prefix!r} may hold no spaces, control characters "
                          "or empty path parts ('//')")
    return prefix if prefix.endswith("/") else prefix + "/"


@dataclass(frozen=True)
class EtcdConfig:
    """Where etcd is and which part of it is ours.

    `endpoints`: the members' client addresses ("host:port", optionally http:// or
    https://), as a sequence or one comma-separated text. `prefix`: the cluster's key
    namespace ("/hixl/<cluster>/"; several hixl clusters share one etcd under different
    prefixes). TLS is on when `ca_file` is given (the CA of the members' certificates;
    `cert_file`/`key_file` for client certificates, `server_name` when the certificates do
    not carry the address dialled). `user`/`password`: etcd authentication. `timeout`:
    the deadline of every call, in seconds. Bad values raise ConfigError naming the key
    (`etcd_<key>`), never at the first call.
    """

    endpoints: tuple[str, ...]
    prefix: str = DEFAULT_PREFIX
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    user: str = ""
    password: str = field(default="", repr=False)
    timeout: float = DEFAULT_TIMEOUT_S
    tls: ClientTLS | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        raw = self.endpoints
        if isinstance(raw, str):
            raw = tuple(part for part in raw.split(","))
        if not isinstance(raw, (list, tuple)) or not all(isinstance(e, str) for e in raw):
            raise ConfigError(f"{_setting('endpoints')}: must be host:port texts (a list or "
                              f"one comma-separated text), got {self.endpoints!r}")
        parsed = [_parse_endpoint(e) for e in raw if e.strip()]
        if not parsed:
            raise ConfigError(f"{_setting('endpoints')}: give at least one etcd member "
                              "address (host:port)")
        endpoints = tuple(dict.fromkeys(address for address, _ in parsed))
        for key in ("ca_file", "cert_file", "key_file", "server_name", "user", "password"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"{_setting(key)}: must be a text, got "
                                  f"{type(getattr(self, key)).__name__}")
        schemes = {scheme for _, scheme in parsed}
        if "https" in schemes and not self.ca_file:
            raise ConfigError(f"{_setting('endpoints')}: https:// endpoints need "
                              f"{_setting('ca_file')} (the CA of the members' certificates)")
        if "http" in schemes and self.ca_file:
            raise ConfigError(f"{_setting('endpoints')}: http:// endpoints with "
                              f"{_setting('ca_file')} set: use https:// (or no scheme)")
        if (self.cert_file or self.key_file or self.server_name) and not self.ca_file:
            raise ConfigError(f"{_setting('cert_file')}, {_setting('key_file')} and "
                              f"{_setting('server_name')} need {_setting('ca_file')} "
                              "(TLS is on when a CA is given)")
        if bool(self.user) != bool(self.password):
            raise ConfigError(f"{_setting('user')} and {_setting('password')} go together: "
                              "set both (etcd authentication) or neither")
        tls = None
        if self.ca_file:
            tls = ClientTLS(self.ca_file, self.cert_file, self.key_file, self.server_name,
                            settings=(_setting("ca_file"), _setting("cert_file"),
                                      _setting("key_file")))
        object.__setattr__(self, "endpoints", endpoints)
        object.__setattr__(self, "prefix", normalize_prefix(self.prefix))
        object.__setattr__(self, "timeout", _parse_timeout(self.timeout))
        object.__setattr__(self, "tls", tls)

    @classmethod
    def parse(cls, value: EtcdConfig | Mapping[str, object] | str) -> EtcdConfig:
        """From a mapping (keys as in the class, with or without `etcd_` in front:
        a config file section or flags), or a comma-separated endpoints text."""
        if isinstance(value, EtcdConfig):
            return value
        if isinstance(value, str):
            return cls(endpoints=value)  # type: ignore[arg-type]
        if not isinstance(value, Mapping):
            raise ConfigError(f"etcd settings must be a mapping or an endpoints text, got "
                              f"{type(value).__name__}")
        values: dict[str, Any] = {}
        for raw_key, item in value.items():
            key = str(raw_key).removeprefix("etcd_")
            if key not in _CONFIG_KEYS:
                raise ConfigError(f"unknown etcd setting {raw_key!r}; known: "
                                  + ", ".join(_setting(k) for k in _CONFIG_KEYS))
            if key in values:
                raise ConfigError(f"etcd setting {key!r} given twice (as {key} and "
                                  f"{_setting(key)})")
            values[key] = item
        if "endpoints" not in values:
            raise ConfigError(f"{_setting('endpoints')} is required (the etcd members' "
                              "host:port addresses)")
        return cls(**values)

    def describe(self) -> str:
        """For messages: 'etcd at a:1,b:2' (the endpoints, as configured)."""
        return "etcd at " + ",".join(self.endpoints)


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class KeyValue:
    """One key as stored: `key` relative to the prefix; revisions as etcd counts them."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class Snapshot:
    """Keys read at one store `revision` (watch from `revision + 1` to miss nothing)."""

    items: tuple[KeyValue, ...]
    revision: int

    def as_dict(self) -> dict[str, bytes]:
        return {kv.key: kv.value for kv in self.items}


@dataclass(frozen=True)
class Compare:
    """A txn condition on `key` (every key under it with `prefix`): `target` `op` `operand`.
    A key that does not exist has version, create and mod revision 0."""

    key: str
    target: Literal["value", "version", "create", "mod", "lease"]
    op: Literal["==", "!=", "<", ">"]
    operand: int | bytes
    prefix: bool = False

    @classmethod
    def absent(cls, key: str) -> Compare:
        return cls(key, "create", "==", 0)

    @classmethod
    def mod_revision_is(cls, key: str, revision: int) -> Compare:
        """`key` was last written at `revision` (0: it does not exist)."""
        return cls(key, "mod", "==", revision)

    @classmethod
    def value_is(cls, key: str, value: bytes | str) -> Compare:
        return cls(key, "value", "==", _as_bytes(value, "value"))


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True)
class Get:
    key: str
    prefix: bool = False


TxnOp = Put | Delete | Get


@dataclass(frozen=True)
class TxnResult:
    """Whether the compares held (the success ops ran) or not (the failure ops ran), the
    store revision after it, and what each Get op of the branch that ran read."""

    succeeded: bool
    revision: int
    gets: tuple[tuple[KeyValue, ...], ...] = ()


@dataclass(frozen=True)
class WatchEvent:
    """A change under a watched prefix; `revision` is the change's (mod) revision."""

    kind: Literal["PUT", "DELETE"]
    key: str
    value: bytes
    revision: int
    create_revision: int = 0
    lease: int = 0


@dataclass(frozen=True)
class WatchCompacted:
    """The watch could not resume: etcd compacted the history below `compact_revision`.
    The watch has ended; the caller resyncs (get_prefix) and watches from its revision+1."""

    compact_revision: int


def key_part(text: str, *, slash: bool = False) -> str:
    """`text` (any name) as part of a key: printable ASCII kept ("/" only if `slash`),
    the rest (and "%") percent-quoted, lone surrogates included, so any two names give
    two keys and a name never adds a level of its own."""
    safe = _KEY_SAFE if slash else _KEY_SAFE.replace("/", "")
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe=safe)


def _as_bytes(value: bytes | bytearray | memoryview | str, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise ParamInvalid(f"etcd {what} must be bytes or str, got {type(value).__name__}")


def _range_end(key: bytes) -> bytes:
    """The end of the range of every key starting with `key` (etcd's prefix recipe)."""
    end = bytearray(key)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[:i + 1])
    return b"\0"


# --------------------------------------------------------------------------- threads


class _LoopThread:
    """An asyncio loop running on its own daemon thread; `run` blocks a caller on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def stop(self, timeout: float) -> None:
        with contextlib.suppress(RuntimeError):  # already closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)


class _Dispatcher:
    """One thread that runs callbacks in submission order (watch events stay ordered) and
    off the loop thread (so a callback may call the client again)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., object], tuple[Any, ...]] | None]
        self._queue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        while (item := self._queue.get()) is not None:
            callback, args = item
            try:
                callback(*args)
            except Exception:
                log.exception("etcd callback %r failed", callback)

    def submit(self, callback: Callable[..., object], *args: Any) -> None:
        self._queue.put((callback, args))

    def stop(self, timeout: float) -> None:
        self._queue.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)


# --------------------------------------------------------------------------- client


class _Retry(Exception):
    """An attempt on one member that did not get an answer (another member may)."""

    def __init__(self, description: str, *, answered: bool) -> None:
        super().__init__(description)
        self.answered = answered


@dataclass
class _Member:
    """One endpoint's channel and stubs (made on the loop thread, on first use)."""

    endpoint: str
    channel: grpc.aio.Channel | None = None
    kv: Any = None
    lease: Any = None
    watch: Any = None
    auth: Any = None
    token: str | None = None


class Lease:
    """An etcd lease: keys put with it vanish when it expires or is revoked.

    With keepalive (the default) the client refreshes it every third of its TTL; when the
    refreshes fail for a whole TTL (counted from the last refresh that etcd confirmed) or
    etcd says the lease is gone, it is lost: `lost` turns True, `lost_reason` says why and
    `on_lost(lease)` runs on the client's callback thread. Lost is final: grant a new one.
    """

    def __init__(self, client: EtcdClient, lease_id: int, ttl: int,
                 on_lost: Callable[[Lease], object] | None) -> None:
        self._client = client
        self.id = lease_id
        self.ttl = ttl
        self._on_lost = on_lost
        self.lost_reason = ""
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    @property
    def lost(self) -> bool:
        return bool(self.lost_reason)

    def revoke(self, *, timeout: float | None = None) -> None:
        """Revoke it now: its keys vanish at once (a lease already gone is fine)."""
        self._client.revoke(self, timeout=timeout)

    def stop_keepalive(self) -> None:
        """Stop refreshing it, so it expires after its TTL (hand-over, tests)."""
        self._client._sync(self._client._stop_keeper(self), None)

    def __repr__(self) -> str:
        state = f", lost: {self.lost_reason}" if self.lost else ""
        return f"Lease({self.id:x}, ttl={self.ttl}{state})"


class Watch:
    """Changes under a prefix, in revision order, from a start revision on.

    Events go to the callback given to `watch_prefix` (on the client's callback thread) or,
    without one, into a queue that `get(timeout)` reads. A member dying does not end the
    watch: it resumes on another member from the revision after the last event delivered.
    If etcd compacted that history meanwhile, a `WatchCompacted` is delivered and the watch
    ends (`done`): resync with get_prefix and watch again.
    """

    def __init__(self, client: EtcdClient, prefix: str,
                 callback: Callable[[WatchEvent | WatchCompacted], object] | None) -> None:
        self._client = client
        self.prefix = prefix
        self._callback = callback
        self._queue: queue.SimpleQueue[WatchEvent | WatchCompacted] = queue.SimpleQueue()
        #: the first revision not delivered yet (where a resumed watch starts)
        self.next_revision = 0
        #: the member whose stream delivers the events now
        self.endpoint = ""
        self.done = False
        self._task: asyncio.Task[None] | None = None

    def get(self, timeout: float) -> WatchEvent | WatchCompacted | None:
        """The next event, or None when none came within `timeout` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def cancel(self) -> None:
        """Stop watching (events already queued stay readable)."""
        if not self.done:
            self._client._sync(self._client._cancel_watch(self), None)

    def _deliver(self, item: WatchEvent | WatchCompacted) -> None:
        if self._callback is not None:
            self._client._dispatcher.submit(self._callback, item)
        else:
            self._queue.put(item)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class EtcdClient:
    """A synchronous etcd v3 client confined to one key prefix (see the module docstring).

    Thread-safe; close() (or `with`) stops its watches and keepers and revokes its leases,
    so an election it takes part in moves on at once instead of after the lease's TTL.
    """

    def __init__(self, config: EtcdConfig | Mapping[str, object] | str, *,
                 name: str = "hixl-etcd") -> None:
        self.config = EtcdConfig.parse(config)
        self._rpc = _rpc()
        self._prefix = self.config.prefix.encode()
        self._members = [_Member(endpoint) for endpoint in self.config.endpoints]
        self._current = 0
        self._closed = False
        self._closing = False
        self._leases: dict[int, Lease] = {}
        self._watches: set[Watch] = set()
        self._warned_no_auth = False
        self._loop = _LoopThread(f"{name}-loop")
        self._dispatcher = _Dispatcher(f"{name}-callbacks")

    # -- public API -----------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The member calls go to first now (it changes on fail-over)."""
        return self._members[self._current].endpoint

    @property
    def prefix(self) -> str:
        return self.config.prefix

    def get(self, key: str, *, timeout: float | None = None) -> KeyValue | None:
        """The key, or None when it does not exist."""
        full = self._key(key, allow_empty=False)
        reply = self._sync(self._unary(f"get {key!r}", "kv", "Range",
                                       self._rpc.RangeRequest(key=full), timeout), timeout)
        return self._kv(reply.kvs[0]) if reply.kvs else None

    def get_prefix(self, prefix: str = "", *, timeout: float | None = None) -> Snapshot:
        """Every key starting with `prefix` (all of ours for ""), in key order, as of one
        revision (read in pages at that revision)."""
        return self._sync(self._get_prefix(prefix, timeout), timeout)

    def revision(self, *, timeout: float | None = None) -> int:
        """The store's current revision (a quorum read: also a health check)."""
        request = self._rpc.RangeRequest(key=self._prefix, range_end=_range_end(self._prefix),
                                         count_only=True)
        reply = self._sync(self._unary("read the revision", "kv", "Range", request, timeout),
                           timeout)
        return int(reply.header.revision)

    def put(self, key: str, value: bytes | str, *, lease: Lease | int | None = None,
            timeout: float | None = None) -> int:
        """Write `key`; returns the new store revision."""
        request = self._rpc.PutRequest(key=self._key(key, allow_empty=False),
                                       value=_as_bytes(value, "value"),
                                       lease=_lease_id(lease))
        reply = self._sync(self._unary(f"put {key!r}", "kv", "Put", request, timeout),
                           timeout)
        return int(reply.header.revision)

    def delete(self, key: str, *, timeout: float | None = None) -> bool:
        """Delete `key`; True if it existed."""
        request = self._rpc.DeleteRangeRequest(key=self._key(key, allow_empty=False))
        reply = self._sync(self._unary(f"delete {key!r}", "kv", "DeleteRange", request,
                                       timeout), timeout)
        return reply.deleted > 0

    def delete_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        """Delete every key starting with `prefix` ("" = all of this prefix's keys);
        returns how many there were."""
        full = self._key(prefix, allow_empty=True)
        request = self._rpc.DeleteRangeRequest(key=full, range_end=_range_end(full))
        reply = self._sync(self._unary(f"delete prefix {prefix!r}", "kv", "DeleteRange",
                                       request, timeout), timeout)
        return int(reply.deleted)

    def txn(self, compare: Sequence[Compare], success: Sequence[TxnOp],
            failure: Sequence[TxnOp] = (), *, timeout: float | None = None) -> TxnResult:
        """One atomic transaction: if every compare holds, run `success`, else `failure`.
        All of a branch applies or none of it (etcd allows 128 ops per txn by default)."""
        request = self._rpc.TxnRequest(compare=[self._compare(c) for c in compare],
                                       success=[self._op(op) for op in success],
                                       failure=[self._op(op) for op in failure])
        reply = self._sync(self._unary(f"txn of {len(success)}/{len(failure)} ops", "kv",
                                       "Txn", request, timeout), timeout)
        gets = tuple(tuple(self._kv(kv) for kv in r.response_range.kvs)
                     for r in reply.responses if r.WhichOneof("response") == "response_range")
        return TxnResult(bool(reply.succeeded), int(reply.header.revision), gets)

    def commit(self, puts: Mapping[str, bytes | str], deletes: Iterable[str] = (), *,
               expect: Mapping[str, int] | None = None, compare: Sequence[Compare] = (),
               lease: Lease | int | None = None, timeout: float | None = None) -> TxnResult:
        """Write `puts` and delete `deletes` as one transaction that cannot half-apply.

        `expect` maps keys to the mod revision they must still have (0: must not exist),
        optimistic concurrency for what the caller read; `compare` adds any other
        conditions (e.g. `Election.fence()`: only while still the leader). When a condition
        fails nothing is written and `succeeded` is False.
        """
        deletes = list(deletes)
        both = set(puts) & set(deletes)
        if both:
            raise ParamInvalid(f"etcd commit: keys both put and deleted: {sorted(both)!r}")
        lease_id = _lease_id(lease)
        conditions = [Compare.mod_revision_is(k, r) for k, r in (expect or {}).items()]
        ops: list[TxnOp] = [Put(k, _as_bytes(v, f"value of {k!r}"), lease_id)
                            for k, v in puts.items()]
        ops += [Delete(k) for k in deletes]
        return self.txn([*conditions, *compare], ops, timeout=timeout)

    def grant(self, ttl: int, *, keepalive: bool = True, owned: bool = True,
              on_lost: Callable[[Lease], object] | None = None,
              timeout: float | None = None) -> Lease:
        """A new lease of `ttl` seconds (etcd may raise it to its minimum), kept alive in
        the background unless `keepalive` is False; see `Lease`. `owned` False: a lease
        held for somebody else (kept alive by `refresh` calls on their behalf), which
        this client leaves alone when it closes."""
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
            raise ParamInvalid(f"etcd lease ttl must be a whole number of seconds >= 1, "
                               f"got {ttl!r}")
        if keepalive and not owned:
            raise ParamInvalid("etcd lease: a lease this client keeps alive is its own "
                               "(keepalive=True needs owned=True)")
        return self._sync(self._grant(ttl, keepalive, owned, on_lost, timeout), timeout)

    def refresh(self, lease: Lease | int, *, timeout: float | None = None) -> int:
        """One keepalive of a lease (this client's or, by id, anyone's): its TTL starts
        again. Returns the TTL in seconds, 0 when the lease is gone (expired, revoked)."""
        lease_id = _lease_id(lease)
        return self._sync(self._attempts(f"keep lease {lease_id:x} alive",
                                         functools.partial(self._refresh_at, lease_id),
                                         timeout), timeout)

    def revoke(self, lease: Lease | int, *, timeout: float | None = None) -> None:
        """Revoke a lease (this client's or, by id, anyone's): its keys vanish at once; a
        lease already gone is fine."""
        if isinstance(lease, Lease):
            self._sync(self._revoke(lease, timeout), timeout)
        else:
            self._sync(self._revoke_id(_lease_id(lease), timeout), timeout)

    def watch_prefix(self, prefix: str = "",
                     callback: Callable[[WatchEvent | WatchCompacted], object] | None = None,
                     *, start_revision: int | None = None,
                     timeout: float | None = None) -> Watch:
        """Watch every key starting with `prefix`, from `start_revision` (default: changes
        after now). Returns once etcd has registered the watch (within the deadline), so
        no change made after this call returns is missed. See `Watch`."""
        if start_revision is not None and (isinstance(start_revision, bool)
                                           or not isinstance(start_revision, int)
                                           or start_revision < 1):
            raise ParamInvalid(f"etcd watch start_revision must be an int >= 1, got "
                               f"{start_revision!r}")
        self._key(prefix, allow_empty=True)
        watch = Watch(self, prefix, callback)
        watch.next_revision = start_revision or 0
        return self._sync(self._start_watch(watch, timeout), timeout)

    def compact(self, revision: int, *, timeout: float | None = None) -> None:
        """Drop the history below `revision`, in the WHOLE etcd (every prefix): for
        maintenance and tests; watches resuming from below it get WatchCompacted."""
        request = self._rpc.CompactionRequest(revision=revision, physical=True)
        self._sync(self._unary(f"compact at {revision}", "kv", "Compact", request, timeout),
                   timeout)

    def election(self, name: str, *, ttl: int = 10,
                 on_lost: Callable[[Election], object] | None = None) -> Election:
        return Election(self, name, ttl=ttl, on_lost=on_lost)

    def close(self, *, revoke_leases: bool = True) -> None:
        """Stop watches and keepers, revoke this client's leases (best effort, within the
        deadline), close the channels. Idempotent."""
        if self._closed:
            return
        self._closing = True
        with contextlib.suppress(HixlError):
            self._sync(self._aclose(revoke_leases), None)
        self._closed = True
        self._loop.stop(self.config.timeout)
        self._dispatcher.stop(self.config.timeout)

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdClient({self.config.describe()}, prefix={self.prefix!r})"

    # -- plumbing: keys and messages ------------------------------------------------

    def _key(self, key: str, *, allow_empty: bool) -> bytes:
        if not isinstance(key, str):
            raise ParamInvalid(f"etcd key must be a str (relative to the prefix), got "
                               f"{type(key).__name__}")
        if not key and not allow_empty:
            raise ParamInvalid("etcd key must not be empty")
        return self._prefix + key.encode()

    def _kv(self, kv: Any) -> KeyValue:
        return KeyValue(kv.key[len(self._prefix):].decode(errors="replace"), bytes(kv.value),
                        int(kv.create_revision), int(kv.mod_revision), int(kv.version),
                        int(kv.lease))

    def _compare(self, c: Compare) -> Any:
        rpc = self._rpc
        targets = {"value": rpc.Compare.VALUE, "version": rpc.Compare.VERSION,
                   "create": rpc.Compare.CREATE, "mod": rpc.Compare.MOD,
                   "lease": rpc.Compare.LEASE}
        ops = {"==": rpc.Compare.EQUAL, "!=": rpc.Compare.NOT_EQUAL,
               "<": rpc.Compare.LESS, ">": rpc.Compare.GREATER}
        if c.target not in targets or c.op not in ops:
            raise ParamInvalid(f"etcd compare {c!r}: target must be one of "
                               f"{sorted(targets)} and op one of {sorted(ops)}")
        key = self._key(c.key, allow_empty=c.prefix)
        message = rpc.Compare(key=key, target=targets[c.target], result=ops[c.op])
        if c.prefix:
            message.range_end = _range_end(key)
        if c.target == "value":
            message.value = _as_bytes(c.operand, "compare value")  # type: ignore[arg-type]
        else:
            if isinstance(c.operand, bool) or not isinstance(c.operand, int):
                raise ParamInvalid(f"etcd compare {c!r}: {c.target} compares with an int")
            field_name = {"version": "version", "create": "create_revision",
                          "mod": "mod_revision", "lease": "lease"}[c.target]
            setattr(message, field_name, c.operand)
        return message

    def _op(self, op: TxnOp) -> Any:
        rpc = self._rpc
        if isinstance(op, Put):
            return rpc.RequestOp(request_put=rpc.PutRequest(
                key=self._key(op.key, allow_empty=False), value=_as_bytes(op.value, "value"),
                lease=_lease_id(op.lease)))
        if isinstance(op, (Delete, Get)):
            key = self._key(op.key, allow_empty=op.prefix)
            end = _range_end(key) if op.prefix else b""
            if isinstance(op, Delete):
                return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                    key=key, range_end=end))
            return rpc.RequestOp(request_range=rpc.RangeRequest(key=key, range_end=end))
        raise ParamInvalid(f"etcd txn op must be Put, Delete or Get, got {op!r}")

    # -- plumbing: calls, deadlines, fail-over --------------------------------------

    def _sync(self, coro: Awaitable[T], timeout: float | None) -> T:
        """Run `coro` on the loop thread and wait for it; the coroutine keeps its own
        deadline, this wait is only a backstop against a stuck loop."""
        if self._closed:
            if asyncio.iscoroutine(coro):
                coro.close()
            raise NotConnected(f"{self.config.describe()}: the etcd client is closed")
        if threading.current_thread() is self._loop.thread:
            if asyncio.iscoroutine(coro):
                coro.close()
            raise RuntimeError("EtcdClient's blocking API called on its own loop thread")
        limit = self.config.timeout if timeout is None else timeout
        future = self._loop.submit(coro)
        done, _ = concurrent.futures.wait([future], limit + 5.0)
        if not done:
            future.cancel()
            raise TransferTimeout(f"{self.config.describe()}: the call did not return "
                                  f"within {limit + 5.0:g} s")
        return future.result()

    async def _stub(self, member: _Member, service: str) -> Any:
        if member.channel is None:
            rpc = self._rpc
            tls = self.config.tls
            if tls is None:
                channel = grpc.aio.insecure_channel(member.endpoint, options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(member.endpoint, tls.credentials,
                                                  options=_CHANNEL_OPTIONS
                                                  + tls.channel_options())
            member.channel = channel
            member.kv, member.lease = rpc.KVStub(channel), rpc.LeaseStub(channel)
            member.watch, member.auth = rpc.WatchStub(channel), rpc.AuthStub(channel)
        return getattr(member, service)

    async def _metadata(self, member: _Member, timeout: float) -> tuple[tuple[str, str], ...]:
        """The call metadata: the member's auth token when a user is configured."""
        if not self.config.user:
            return ()
        if member.token is None:
            auth = await self._stub(member, "auth")
            request = self._rpc.AuthenticateRequest(name=self.config.user,
                                                    password=self.config.password)
            try:
                reply = await auth.Authenticate(request, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if "authentication is not enabled" not in (exc.details() or ""):
                    raise
                if not self._warned_no_auth:
                    log.warning("%s: etcd_user is set but authentication is not enabled "
                                "on etcd; calling without a token", self.config.describe())
                    self._warned_no_auth = True
                member.token = ""
            else:
                member.token = reply.token
        return (("token", member.token),) if member.token else ()

    def _failed(self, index: int) -> None:
        """Move on from member `index` (unless another call already did)."""
        if self._current == index:
            self._current = (index + 1) % len(self._members)
            if len(self._members) > 1:
                log.debug("%s: member %s failed; trying %s next", self.config.describe(),
                         self._members[index].endpoint, self.endpoint)

    async def _attempts(self, what: str,
                        invoke: Callable[[_Member, float, tuple[tuple[str, str], ...]],
                                         Awaitable[T]],
                        timeout: float | None) -> T:
        """`invoke(member, attempt_timeout, metadata)` on the member in use, then on the
        next ones, until it succeeds or the deadline passes (the typed error then)."""
        loop = asyncio.get_running_loop()
        limit = self.config.timeout if timeout is None else timeout
        deadline = loop.time() + limit
        count = len(self._members)
        last, said, answered, tried, pause = "", "", False, 0, 0.05
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._gave_up(what, limit, said or last, answered)
            index = self._current
            member = self._members[index]
            share = min(remaining, max(_MIN_ATTEMPT_S, limit / count))
            try:
                return await invoke(member, share, await self._metadata(member, share))
            except grpc.aio.AioRpcError as exc:
                details = exc.details() or ""
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED and member.token \
                        and "invalid auth token" in details:
                    member.token = None  # expired: authenticate again, same member
                    continue
                if not _retryable(exc):
                    raise self._error(what, member, exc) from None
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    last = f"{member.endpoint}: no answer within {share:.3g} s"
                    answered = answered or self._ready(member)
                else:
                    last = f"{member.endpoint}: {details}"
                    answered = answered or details.startswith("etcdserver")
                if details.startswith("etcdserver"):
                    said = last  # what a member said beats "no answer" in the message
            except (_Retry, asyncio.TimeoutError) as exc:
                reason = str(exc) or f"no answer within {share:.3g} s"
                last = f"{member.endpoint}: {reason}"
                answered = answered or (exc.answered if isinstance(exc, _Retry)
                                        else self._ready(member))
            self._failed(index)
            tried += 1
            if tried % count == 0:
                await asyncio.sleep(max(0.0, min(pause, deadline - loop.time())))
                pause = min(pause * 2, _MAX_PAUSE_S)

    @staticmethod
    def _ready(member: _Member) -> bool:
        return member.channel is not None and \
            member.channel.get_state() == grpc.ChannelConnectivity.READY

    def _gave_up(self, what: str, limit: float, last: str, answered: bool) -> HixlError:
        where = self.config.describe()
        if answered:
            return TransferTimeout(f"{where}: {what} did not complete within {limit:g} s: "
                                   "members answered but could not serve it (no quorum or "
                                   f"no leader: are most members down?); last error: {last}")
        return PeerUnavailable(f"{where}: no member reachable within {limit:g} s ({what}; "
                               f"last error: {last or 'none'})")

    def _error(self, what: str, member: _Member, exc: grpc.aio.AioRpcError) -> HixlError:
        code, details = exc.code(), exc.details() or ""
        text = f"{self.config.describe()}: {what} refused by {member.endpoint}: {details}"
        if "user name is empty" in details:
            return AuthenticationFailed(text + " (etcd has authentication on: set etcd_user "
                                        "and etcd_password)")
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
                "authentication failed" in details):
            return AuthenticationFailed(text + f" (etcd_user {self.config.user!r})"
                                        if self.config.user else text)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ResourceExhausted(text)
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.OUT_OF_RANGE):
            return ParamInvalid(text)
        if code == grpc.StatusCode.CANCELLED and self._closing:
            return NotConnected(f"{self.config.describe()}: the etcd client is closed")
        return TransferFailed(f"{text} ({code.name})")

    async def _unary(self, what: str, service: str, method: str, request: Any,
                     timeout: float | None) -> Any:
        async def invoke(member: _Member, share: float,
                         metadata: tuple[tuple[str, str], ...]) -> Any:
            stub = await self._stub(member, service)
            return await getattr(stub, method)(request, timeout=share, metadata=metadata)
        return await self._attempts(what, invoke, timeout)

    async def _get_prefix(self, prefix: str, timeout: float | None) -> Snapshot:
        loop = asyncio.get_running_loop()
        limit = self.config.timeout if timeout is None else timeout
        deadline = loop.time() + limit
        start = self._key(prefix, allow_empty=True)
        end = _range_end(start)
        items: list[KeyValue] = []
        revision = 0
        while True:
            request = self._rpc.RangeRequest(key=start, range_end=end, limit=_PAGE,
                                             revision=revision)
            try:
                reply = await self._unary(f"get prefix {prefix!r}", "kv", "Range", request,
                                          max(0.0, deadline - loop.time()) or 1e-3)
            except ParamInvalid as exc:
                if not revision or "compacted" not in str(exc):
                    raise
                # the revision of the first pages was compacted meanwhile: read it all anew
                start, items, revision = self._key(prefix, allow_empty=True), [], 0
                continue
            revision = revision or int(reply.header.revision)
            items.extend(self._kv(kv) for kv in reply.kvs)
            if not reply.more or not reply.kvs:
                return Snapshot(tuple(items), revision)
            start = bytes(reply.kvs[-1].key) + b"\0"

    # -- leases ---------------------------------------------------------------------

    async def _grant(self, ttl: int, keepalive: bool, owned: bool,
                     on_lost: Callable[[Lease], object] | None,
                     timeout: float | None) -> Lease:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        reply = await self._unary(f"grant a {ttl} s lease", "lease", "LeaseGrant",
                                  self._rpc.LeaseGrantRequest(TTL=ttl), timeout)
        if reply.error:
            raise TransferFailed(f"{self.config.describe()}: grant a {ttl} s lease: "
                                 f"{reply.error}")
        lease = Lease(self, int(reply.ID), int(reply.TTL), on_lost)
        if owned:
            self._leases[lease.id] = lease
        if keepalive:
            lease._wake = asyncio.Event()
            lease._task = loop.create_task(self._keep(lease, sent),
                                           name=f"etcd-lease-{lease.id:x}")
        return lease

    async def _keep(self, lease: Lease, confirmed_at: float) -> None:
        """Refresh `lease` every third of its TTL; declare it lost once a whole TTL has
        passed since the send time of the last refresh etcd confirmed (etcd expires it no
        sooner than that, so the holder learns first)."""
        loop = asyncio.get_running_loop()
        assert lease._wake is not None
        interval = max(lease.ttl / 3, 0.2)
        refresh = functools.partial(self._refresh_at, lease.id)

        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(lease._wake.wait(), interval)
            if lease._wake.is_set():
                return  # stopped
            sent = loop.time()
            left = confirmed_at + lease.ttl - sent
            try:
                ttl = await self._attempts(f"keep lease {lease.id:x} alive", refresh,
                                           max(left, 1e-3))
            except HixlError as exc:
                self._lease_lost(lease, f"no keepalive confirmed for its TTL ({lease.ttl} s):"
                                        f" {exc.args[0]}")
                return
            if ttl <= 0:
                self._lease_lost(lease, "etcd says it expired or was revoked")
                return
            confirmed_at = sent

    async def _refresh_at(self, lease_id: int, member: _Member, share: float,
                          metadata: tuple[tuple[str, str], ...]) -> int:
        """One keepalive of `lease_id` on `member`: the TTL etcd granted (0: gone)."""
        stub = await self._stub(member, "lease")
        call = stub.LeaseKeepAlive(timeout=share, metadata=(*metadata, _HAS_LEADER))
        try:
            await call.write(self._rpc.LeaseKeepAliveRequest(ID=lease_id))
            reply = await call.read()
        finally:
            call.cancel()
        if reply is grpc.aio.EOF:
            raise _Retry("keepalive stream closed", answered=True)
        return int(reply.TTL)

    def _lease_lost(self, lease: Lease, reason: str) -> None:
        if lease.lost:
            return
        lease.lost_reason = reason
        self._leases.pop(lease.id, None)
        log.warning("%s: lease %x lost: %s", self.config.describe(), lease.id, reason)
        if lease._on_lost is not None:
            self._dispatcher.submit(lease._on_lost, lease)

    async def _stop_keeper(self, lease: Lease) -> None:
        if lease._wake is not None:
            lease._wake.set()
        if lease._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await lease._task

    async def _revoke(self, lease: Lease, timeout: float | None = None) -> None:
        await self._stop_keeper(lease)
        self._leases.pop(lease.id, None)
        await self._revoke_id(lease.id, timeout)
        if not lease.lost:
            lease.lost_reason = "revoked"

    async def _revoke_id(self, lease_id: int, timeout: float | None) -> None:
        try:
            await self._unary(f"revoke lease {lease_id:x}", "lease", "LeaseRevoke",
                              self._rpc.LeaseRevokeRequest(ID=lease_id), timeout)
        except ParamInvalid as exc:  # NOT_FOUND: already expired or revoked
            if "not found" not in str(exc):
                raise

    # -- watches --------------------------------------------------------------------

    async def _open_watch(self, watch: Watch, timeout: float | None) -> Any:
        """A Watch stream registered on some member (fail-over like any call)."""
        key = self._key(watch.prefix, allow_empty=True)

        async def open_stream(member: _Member, share: float,
                              metadata: tuple[tuple[str, str], ...]) -> Any:
            stub = await self._stub(member, "watch")
            call = stub.Watch(metadata=(*metadata, _HAS_LEADER))
            try:
                create = self._rpc.WatchCreateRequest(
                    key=key, range_end=_range_end(key), start_revision=watch.next_revision,
                    progress_notify=True)
                await asyncio.wait_for(call.write(self._rpc.WatchRequest(
                    create_request=create)), share)
                reply = await asyncio.wait_for(call.read(), share)
                if reply is grpc.aio.EOF:
                    raise _Retry("watch stream closed before the watch was created",
                                 answered=True)
                if reply.canceled and not reply.compact_revision:
                    raise _Retry(f"watch refused: {reply.cancel_reason}", answered=True)
            except BaseException:
                call.cancel()
                raise
            watch.endpoint = member.endpoint
            return call, reply

        return await self._attempts(f"watch prefix {watch.prefix!r}", open_stream, timeout)

    async def _start_watch(self, watch: Watch, timeout: float | None) -> Watch:
        call, created = await self._open_watch(watch, timeout)
        self._watches.add(watch)
        watch._task = asyncio.get_running_loop().create_task(
            self._follow(watch, call, created), name=f"etcd-watch-{watch.prefix}")
        return watch

    async def _follow(self, watch: Watch, call: Any, reply: Any) -> None:
        """Deliver the stream's events; when it breaks, reopen it on a member that can
        serve it, from the first revision not delivered yet. Runs until cancelled."""
        pause = 0.05
        try:
            while True:
                try:
                    while reply is not grpc.aio.EOF:
                        if self._handle_watch_reply(watch, reply):
                            return
                        reply = await call.read()
                    reason = "the stream ended"
                except grpc.aio.AioRpcError as exc:
                    reason = f"{exc.code().name}: {exc.details()}"
                except _Retry as exc:
                    reason = str(exc)
                finally:
                    call.cancel()
                log.info("%s: watch of %r broke on %s (%s); resuming from revision %d",
                         self.config.describe(), watch.prefix, watch.endpoint, reason,
                         watch.next_revision)
                self._failed(self.config.endpoints.index(watch.endpoint))
                while True:
                    try:
                        call, reply = await self._open_watch(watch, None)
                        pause = 0.05
                        break
                    except HixlError as exc:
                        log.warning("watch of %r cannot resume yet: %s", watch.prefix, exc)
                        await asyncio.sleep(pause)
                        pause = min(pause * 2, 1.0)
        finally:
            watch.done = True
            self._watches.discard(watch)

    def _handle_watch_reply(self, watch: Watch, reply: Any) -> bool:
        """Deliver one WatchResponse; True when the watch has ended (compacted)."""
        if reply.compact_revision:
            watch._deliver(WatchCompacted(int(reply.compact_revision)))
            return True
        if reply.canceled:
            raise _Retry(f"watch canceled: {reply.cancel_reason}", answered=True)
        if not reply.events:
            if not reply.created:
                # progress: every change up to header.revision has been sent
                watch.next_revision = max(watch.next_revision, int(reply.header.revision) + 1)
            elif not watch.next_revision:
                # created without a start revision: changes after the current one
                watch.next_revision = int(reply.header.revision) + 1
            return False
        put = self._rpc.Event.PUT
        for event in reply.events:
            kv = event.kv
            watch._deliver(WatchEvent("PUT" if event.type == put else "DELETE",
                                      kv.key[len(self._prefix):].decode(errors="replace"),
                                      bytes(kv.value), int(kv.mod_revision),
                                      int(kv.create_revision), int(kv.lease)))
        watch.next_revision = int(reply.events[-1].kv.mod_revision) + 1
        return False

    async def _cancel_watch(self, watch: Watch) -> None:
        if watch._task is not None:
            watch._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch._task
        watch.done = True

    async def _aclose(self, revoke_leases: bool) -> None:
        for watch in list(self._watches):
            await self._cancel_watch(watch)
        leases = list(self._leases.values())
        for lease in leases:
            await self._stop_keeper(lease)
        if revoke_leases and leases:
            share = min(self.config.timeout, 2.0)
            results = await asyncio.gather(*(self._revoke(lease, share) for lease in leases),
                                           return_exceptions=True)
            for lease, result in zip(leases, results, strict=True):
                if isinstance(result, BaseException):
                    log.info("lease %x not revoked on close (it expires after its TTL): %s",
                             lease.id, result)
        for member in self._members:
            if member.channel is not None:
                await member.channel.close()
                member.channel = None


def _retryable(exc: grpc.aio.AioRpcError) -> bool:
    """A failure another member (or this one, later) may not have: unreachable, no leader,
    or out of time -- including the member giving up when our deadline, which gRPC passes
    on to it, ran out first (UNKNOWN "context deadline exceeded"), and a stream the member
    closed as we wrote to it (grpc reports INTERNAL "Internal error from Core" and drops
    the member's status; a member without a leader closes `hasleader` streams so)."""
    code, details = exc.code(), exc.details() or ""
    return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or (
        code == grpc.StatusCode.UNKNOWN and "deadline exceeded" in details) or (
        code == grpc.StatusCode.INTERNAL and details == "Internal error from Core")


def _lease_id(lease: Lease | int | None) -> int:
    if lease is None:
        return 0
    if isinstance(lease, Lease):
        if lease.lost:
            raise ParamInvalid(f"etcd lease {lease.id:x} is lost ({lease.lost_reason}); "
                               "grant a new one")
        return lease.id
    if isinstance(lease, bool) or not isinstance(lease, int) or lease < 0:
        raise ParamInvalid(f"etcd lease must be a Lease or a lease id, got {lease!r}")
    return lease


# --------------------------------------------------------------------------- election


@dataclass(frozen=True)
class Leader:
    """The current leader of an election: its candidate key, value and lease."""

    key: str
    value: bytes
    create_revision: int
    lease: int


class Election:
    """Leader election under `<prefix>election/<name>/` (etcd's concurrency recipe).

    Each candidate puts a key named after its lease; the key with the lowest create
    revision is the leader. A candidate whose lease ends (revoked, client closed, or
    keepalives failed for a TTL) drops out and the next one leads. `fence()` is a compare
    that makes a commit apply only while this candidate still leads.
    """

    def __init__(self, client: EtcdClient, name: str, *, ttl: int = 10,
                 on_lost: Callable[[Election], object] | None = None) -> None:
        if not isinstance(name, str) or not name or "/" in name or name.strip() != name:
            raise ParamInvalid(f"election name must be a non-empty text without '/' or "
                               f"surrounding spaces, got {name!r}")
        self._client = client
        self.name = name
        self.ttl = ttl
        self._on_lost = on_lost
        self._dir = f"election/{name}/"
        self._lease: Lease | None = None
        self.key = ""
        self.create_revision = 0

    def campaign(self, value: bytes | str, *, timeout: float) -> bool:
        """Stand as a candidate with `value` (again: update the value), then wait up to
        `timeout` seconds to lead. True if leading; False if not yet (still a candidate:
        `wait`, `is_leader` or `observe` tell when)."""
        data = _as_bytes(value, "election value")
        if self._lease is None or self._lease.lost:
            self._lease = self._client.grant(self.ttl, on_lost=self._lease_lost)
            self.key = f"{self._dir}{self._lease.id:016x}"
            self.create_revision = 0
        result = self._client.txn([Compare.absent(self.key)],
                                  [Put(self.key, data, self._lease.id)], [Get(self.key)])
        if result.succeeded:
            self.create_revision = result.revision
        else:
            self.create_revision = result.gets[0][0].create_revision
            self._client.put(self.key, data, lease=self._lease)
        return self.wait(timeout)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for this candidate to lead; True if it does."""
        deadline = time.monotonic() + timeout
        watch: Watch | None = None
        try:
            while True:
                snapshot = self._client.get_prefix(self._dir)
                if self._lease is None or self._lease.lost or not any(
                        kv.key == self.key for kv in snapshot.items):
                    return False
                if _first(snapshot).key == self.key:
                    return True
                if watch is None:
                    watch = self._client.watch_prefix(self._dir,
                                                      start_revision=snapshot.revision + 1)
                # any change re-checks (a predecessor gone); a lost lease is seen by polling
                while watch.get(min(0.25, max(0.0, deadline - time.monotonic()))) is None:
                    if self._lease.lost or time.monotonic() >= deadline:
                        return False
        finally:
            if watch is not None:
                watch.cancel()

    def leader(self) -> Leader | None:
        """The leader now, or None when there is no candidate."""
        return _leader(self._client.get_prefix(self._dir))

    def is_leader(self) -> bool:
        if self._lease is None or self._lease.lost:
            return False
        leader = self.leader()
        return leader is not None and leader.key == self.key

    def fence(self) -> Compare:
        """A txn compare that holds only while this candidacy exists (commits made with
        it cannot land after the leadership passed on)."""
        if not self.key or self.create_revision == 0:
            raise ParamInvalid(f"election {self.name!r}: campaign first")
        return Compare(self.key, "create", "==", self.create_revision)

    def resign(self) -> None:
        """Stop being a candidate (the next one leads at once)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease._on_lost = None
            lease.revoke()
        self.key, self.create_revision = "", 0

    def observe(self, callback: Callable[[Leader | None], object]) -> Watch:
        """Call `callback(leader)` with the current leader now and whenever it changes
        (on the client's callback thread); cancel the returned Watch to stop."""
        snapshot = self._client.get_prefix(self._dir)
        last = [_leader(snapshot)]
        self._client._dispatcher.submit(callback, last[0])

        def changed(_event: WatchEvent | WatchCompacted) -> None:
            leader = self.leader()
            if leader != last[0]:
                last[0] = leader
                callback(leader)

        return self._client.watch_prefix(self._dir, changed,
                                         start_revision=snapshot.revision + 1)

    def _lease_lost(self, lease: Lease) -> None:
        if lease is self._lease and self._on_lost is not None:
            self._on_lost(self)


def _first(snapshot: Snapshot) -> KeyValue:
    return min(snapshot.items, key=lambda kv: kv.create_revision)


def _leader(snapshot: Snapshot) -> Leader | None:
    if not snapshot.items:
        return None
    kv = _first(snapshot)
    return Leader(kv.key, kv.value, kv.create_revision, kv.lease)
