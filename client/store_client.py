"""Blocking client of the KV store's `Master` service (hixl-master); the store's types are
in hixl.store_types.

The master holds metadata only: which key lives where (replicas: engine, segment, owner
address, length). Bytes move between clients over the transfer engine, never through
the master. A store client (e.g. the Mooncake-compatible `MooncakeDistributedStore`)
uses `MasterClient` like this:

Contributing memory (a client that is also a storage server):

    master = MasterClient("10.0.0.1:50051")          # client_id: a fresh uuid4 per process
    master.mount_segment(StoreSegment(engine, segment_id, epoch, base, length, node_id))
    # every client_ttl/3 (the reply says the ttl):
    if master.heartbeat().status == ClientStatus.NEED_REMOUNT:
        ...mount every segment again (the master expired us, or restarted; a remount of
        the same engine/segment_id/epoch/base/length after a master restart brings the
        objects stored in it back)...

Writing (two-phase: nothing is visible before PutEnd, a crash leaves no partial value):

    [started] = master.batch_put_start([(key, len(value))], ReplicaConfig(replica_num=2))
    if started.code == ErrorCode.OK:
        for replica in started.replicas:   # engine, segment_id, epoch, addr, length
            ...write the value to (replica.engine, replica.addr) over the transfer engine...
        master.put_end(key, started.put_id)         # or put_revoke(key, put_id) on failure
    # OBJECT_ALREADY_EXISTS: the key is stored (or being stored); upsert=True replaces it
    # at PutEnd. NO_AVAILABLE_HANDLE: no space even after eviction.

Reading (under a lease: no removal or eviction frees the replicas for lease_ttl_ms):

    [got] = master.batch_get_replicas([key])
    if got.code == ErrorCode.OK:
        ...read got.size bytes from any of got.replicas, within got.lease_ttl_ms...

Every per-key outcome is a Mooncake `ErrorCode` (hixl.store_codes), returned, not
raised. Only a failed *call* raises: `MasterUnavailable` when the master cannot be
reached or does not answer within the deadline, `MasterWrongServer` when the address
answered but is no hixl-master (an agent's gRPC or data port: the message says which, and
what to give instead), `MasterRpcError` (base class) for any other RPC failure, e.g. a
wrong cluster token.
All of them carry `.code == ErrorCode.RPC_FAIL`, which is what the store returns for
them; a missing key is OBJECT_NOT_FOUND, never an exception. Every call has a deadline
(`timeout`, default 5 s), so a dead master never hangs a caller; while the master is
down, calls fail at once (the channel retries the connection in the background within
2 s of the master's return).

Several masters (one leader, standbys): `MasterClient("h1:p1,h2:p2")`. Calls go to one
at a time and move on, within their deadline, when it is unreachable or not the leader
(`hixl.failover`); a put or removal whose request may have reached a master that died is
not repeated elsewhere: it fails with RPC_FAIL, as with one master.

Batch forms (`batch_*`) take lists and cost one RPC whatever their length; the single
forms are batches of one. Engine endpoints (data addresses) of the segments' owners:
`list_segments()`.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from hixl import wire
from hixl.auth import as_token
from hixl.control import node_identity, open_channel
from hixl.errors import (
    AuthenticationFailed,
    ParamInvalid,
)
from hixl.failover import Endpoints, NotLeader, TryNext, rpc_failure
from hixl.registry_client import (
    CLIENT_KEEPALIVE_OPTIONS,
)
from hixl.store_codes import ErrorCode
from hixl.store_rpc import MESSAGES, CallFailed, FastPath, target_host
from hixl.store_types import (
    ClientStatus,
    CountResult,
    GetReplicasResult,
    HeartbeatResult,
    KeyInfo,
    KeyListing,
    KeyReplica,
    KeyState,
    MasterAuthenticationFailed,
    MasterNotLeader,
    MasterRpcError,
    MasterUnavailable,
    MasterWrongServer,
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
    key_info_from_pb,
    key_info_to_pb,
    master_error,
    replica_config_from_pb,
    replica_config_to_pb,
    replica_from_pb,
    replica_to_pb,
    store_segment_from_pb,
    store_segment_to_pb,
)
from hixl.tls import TlsSetting, client_tls
from hixl.v1 import store_pb2, store_pb2_grpc

log = logging.getLogger("hixl.store.client")

# ---------------------------------------------------------------------------- client

#: calls that must not run twice: repeated at another master only when the request
#: provably never left (a repeated PutEnd / Remove would report a done thing as failed,
#: a repeated PutStart would leave a second put in progress)
NOT_IDEMPOTENT = frozenset({"PutStart", "PutEnd", "PutRevoke", "Remove", "RemoveByRegex",
                            "RemoveAll", "UnmountSegment", "Reserve", "Commit"})
#: replies that name the master's store call endpoint port (`fast_port`)
ADVERTISING = frozenset({"Heartbeat", "MountSegment"})


@dataclass
class _MasterLink:
    """One master address's gRPC channel (to close), stub, and call endpoint use."""

    channel: grpc.Channel
    stub: Any
    fast: FastPath | None



class MasterClient:
    """One method per Master RPC; per-key outcomes are ErrorCodes, failed calls raise.

    `target`: the master's "host:port", or every master of the cluster ("h1:p1,h2:p2" or
    a list): calls go to one at a time and fail over to the next as hixl.failover says
    (idempotent calls are retried there within their deadline; a put or removal only
    when its request provably never left, else it fails with RPC_FAIL).

    `client_id` names this client to the master (its mounts, heartbeats and puts); the
    default is a fresh uuid4, i.e. one identity per process. `node_id` is this client's
    node for prefer_alloc_in_same_node (default: this host's node identity, the one
    agents publish by default).

    The hot calls (puts, reads, exists, sizes, removals) go to the master's store call
    endpoint (hixl.store_rpc) once a Heartbeat or MountSegment reply named its port (a
    client that has seen neither asks with a Heartbeat that registers nothing), and over
    gRPC when the master has none or it cannot be reached; `fast=False` keeps every call
    on gRPC. Either way a call has the same deadline, errors and request id.
    """

    def __init__(self, target: str | Sequence[str], *, timeout: float = 5.0,
                 cluster_token: str | bytes | None = None, client_id: str | None = None,
                 node_id: str | None = None, fast: bool = True,
                 tls: TlsSetting = None) -> None:
        if not timeout > 0:
            raise ParamInvalid(f"master client timeout must be positive, got {timeout}")
        self.endpoints = Endpoints(target, "master address")
        #: every master address, as given ("h1:p1,h2:p2"); `current` is the one in use
        self.target = self.endpoints.describe()
        self.timeout = timeout
        self.client_id = client_id or uuid.uuid4().hex
        self.node_id = node_identity() if node_id is None else node_id
        self._token = as_token(cluster_token)
        self._tls = client_tls(tls)
        # the store call endpoint is a plain socket: a client dialling with TLS keeps every
        # call inside TLS
        self._use_fast = fast and self._tls is None
        self._links: dict[str, _MasterLink] = {}
        self._links_lock = threading.Lock()
        self._closed = False
        self._link(self.endpoints.current())  # a bad first address fails here, not later

    @property
    def current(self) -> str:
        """The master address calls go to now."""
        return self.endpoints.current()

    @property
    def fast_calls(self) -> int:
        """Calls answered over the store call endpoint so far (the rest went over gRPC)."""
        return sum(link.fast.calls for link in list(self._links.values())
                   if link.fast is not None)

    @property
    def fast_port(self) -> int | None:
        """The current master's store call endpoint port as last advertised (None: not
        known, or none)."""
        link = self._links.get(self.current)
        return (link.fast.port or None) if link is not None and link.fast is not None else None

    def _advertised(self, port: int) -> None:
        """As if the current master had advertised its call endpoint at `port`."""
        fast = self._link(self.current).fast
        if fast is not None:
            fast.advertised(port)

    def _link(self, address: str) -> _MasterLink:
        """The channel, stub and call endpoint of one master, made on first use."""
        link = self._links.get(address)
        if link is not None:
            return link
        with self._links_lock:
            link = self._links.get(address)
            if link is None:
                if self._closed:
                    raise MasterRpcError(f"master client for {self.target} is closed")
                channel, intercepted = open_channel(address, token=self._token,
                                                    tls=self._tls or False,
                                                    options=CLIENT_KEEPALIVE_OPTIONS)
                host = target_host(address) if self._use_fast else None
                fast = FastPath(host, self._token, self.client_id) if host else None
                link = _MasterLink(channel, store_pb2_grpc.MasterStub(intercepted), fast)
                self._links[address] = link
        return link

    def _call(self, method: str, request: Any, what: str, timeout: float | None) -> Any:
        """Call `method` (a Master RPC's name) at the current master, failing over to the
        next ones (hixl.failover) within one deadline."""
        limit = self.timeout if timeout is None else timeout
        return self.endpoints.call(
            lambda address, deadline: self._attempt(address, method, request, what, deadline),
            timeout=limit, idempotent=method not in NOT_IDEMPOTENT)

    def _attempt(self, address: str, method: str, request: Any, what: str,
                 deadline: float) -> Any:
        """One master's answer: over its call endpoint when it is one of its methods and
        the endpoint is known and reachable, else over gRPC. TryNext when this master
        cannot serve the call (unreachable, not the leader)."""
        link = self._link(address)
        where = f"{what} at master {address}"
        fast = link.fast
        if fast is not None and method in MESSAGES:
            if fast.should_probe():
                self._probe(link, deadline)
            reply = self._fast_call(fast, method, request, where, deadline)
            if reply is not None:
                return reply
        limit = deadline - time.monotonic()
        if limit <= 0:  # the endpoint's attempt left no time: nothing went over gRPC
            raise TryNext(MasterUnavailable(f"{where}: no answer before the deadline"),
                          sent=False)
        try:
            reply = getattr(link.stub, method)(request, timeout=limit)
        except grpc.RpcError as exc:
            failure = rpc_failure(exc, where,
                                  lambda rpc, said: master_error(rpc, said, address),
                                  MasterNotLeader)
            if isinstance(failure, MasterWrongServer):  # not a master: none applied it
                raise TryNext(failure, sent=False) from None
            raise failure from None
        if method in ADVERTISING and fast is not None:
            fast.advertised(reply.fast_port)
        return reply

    @staticmethod
    def _fast_call(fast: FastPath, method: str, request: Any, where: str,
                   deadline: float) -> Any:
        """The reply over the call endpoint, or None when it is not available now."""
        try:
            reply = fast.call(method, request.SerializeToString(), deadline)
        except NotLeader as exc:
            raise TryNext(MasterNotLeader(f"{where}: {exc.args[0]}", leader=exc.leader),
                          sent=False, leader=exc.leader) from None
        except CallFailed as exc:
            raise MasterRpcError(f"{where}: {exc.args[0]}", status=exc.status) from None
        except AuthenticationFailed as exc:
            raise MasterAuthenticationFailed(f"{where}: {exc.args[0]}") from None
        except TimeoutError:
            raise TryNext(MasterUnavailable(f"{where}: no answer before the deadline")) \
                from None
        except OSError as exc:
            raise TryNext(MasterUnavailable(
                f"{where}: the connection to its store call endpoint broke after the "
                f"request was sent ({exc})")) from None
        except wire.ProtocolError as exc:
            raise MasterRpcError(f"{where}: bad reply from its store call endpoint: "
                                 f"{exc}") from None
        return None if reply is None else MESSAGES[method][1].FromString(reply)

    @staticmethod
    def _probe(link: _MasterLink, deadline: float) -> None:
        """Ask the master for its call endpoint's port: a Heartbeat without client id
        registers nothing. A failure is left to the call itself (over gRPC)."""
        assert link.fast is not None
        try:
            reply = link.stub.Heartbeat(store_pb2.HeartbeatRequest(client_id=""),
                                        timeout=max(0.001, deadline - time.monotonic()))
        except grpc.RpcError:
            link.fast.unreachable()
            return
        link.fast.advertised(reply.fast_port)

    # -- segments and liveness -------------------------------------------------------

    def mount_segment(self, segment: StoreSegment, timeout: float | None = None,
                      ) -> SegmentResult:
        """Contribute `segment`; remounting the same one is idempotent (and, after a
        master restart, serves its objects again: `objects` says how many)."""
        reply = self._call("MountSegment", store_pb2.MountSegmentRequest(
            client_id=self.client_id, segment=store_segment_to_pb(segment)),
            f"mount of segment {segment.engine}/{segment.segment_id}", timeout)
        return SegmentResult(reply.code, reply.message, reply.restored_objects)

    def unmount_segment(self, engine: str, segment_id: int, timeout: float | None = None,
                        ) -> SegmentResult:
        """Withdraw a segment: its replicas go, objects left with none are removed."""
        reply = self._call("UnmountSegment", store_pb2.UnmountSegmentRequest(
            client_id=self.client_id, engine=engine, segment_id=segment_id),
            f"unmount of segment {engine}/{segment_id}", timeout)
        return SegmentResult(reply.code, reply.message, reply.dropped_objects)

    def heartbeat(self, timeout: float | None = None) -> HeartbeatResult:
        """Keep this client (and its segments) alive; NEED_REMOUNT: mount everything again."""
        reply = self._call("Heartbeat",
                           store_pb2.HeartbeatRequest(client_id=self.client_id),
                           "heartbeat", timeout)
        return HeartbeatResult(ClientStatus(reply.status) if reply.status in (0, 1, 2)
                               else ClientStatus.UNDEFINED, reply.client_ttl_ms)

    def list_segments(self, timeout: float | None = None) -> list[MountedSegment]:
        reply = self._call("ListSegments", store_pb2.ListStoreSegmentsRequest(),
                           "list of segments", timeout)
        return [MountedSegment(store_segment_from_pb(pb.segment), pb.client_id, pb.live,
                               pb.used) for pb in reply.segments]

    def stats(self, timeout: float | None = None) -> dict[str, float]:
        reply = self._call("Stats", store_pb2.StoreStatsRequest(), "stats", timeout)
        return dict(reply.stats)

    # -- puts ------------------------------------------------------------------------

    def batch_put_start(self, items: Sequence[tuple[str, int]],
                        config: ReplicaConfig | None = None, *, upsert: bool = False,
                        timeout: float | None = None) -> list[PutStartResult]:
        """Allocate replicas for each (key, value_length); one result per item, in order."""
        request = store_pb2.PutStartRequest(
            client_id=self.client_id, node_id=self.node_id, upsert=upsert,
            config=replica_config_to_pb(config or ReplicaConfig()),
            items=[store_pb2.PutStartItem(key=key, value_length=length)
                   for key, length in items])
        reply = self._call("PutStart", request,
                           f"put start of {len(items)} key(s)", timeout)
        return [PutStartResult(r.code, r.put_id, tuple(replica_from_pb(p) for p in r.replicas))
                for r in reply.results]

    def put_start(self, key: str, value_length: int, config: ReplicaConfig | None = None,
                  *, upsert: bool = False, timeout: float | None = None) -> PutStartResult:
        return self.batch_put_start([(key, value_length)], config, upsert=upsert,
                                    timeout=timeout)[0]

    def batch_put_end(self, puts: Sequence[tuple[str, int]],
                      timeout: float | None = None, *, reads_done: bool = False) -> list[int]:
        """Commit each (key, put_id): the value becomes visible (replacing it, for upserts).
        `reads_done`: as `batch_remove`'s, for the values an upsert replaces."""
        return self._put_refs("PutEnd", puts, "put end", timeout, reads_done)

    def put_end(self, key: str, put_id: int, timeout: float | None = None) -> int:
        return self.batch_put_end([(key, put_id)], timeout)[0]

    def batch_put_revoke(self, puts: Sequence[tuple[str, int]],
                         timeout: float | None = None) -> list[int]:
        """Abandon each (key, put_id): its space is freed, a committed value stays."""
        return self._put_refs("PutRevoke", puts, "put revoke", timeout)

    def put_revoke(self, key: str, put_id: int, timeout: float | None = None) -> int:
        return self.batch_put_revoke([(key, put_id)], timeout)[0]

    def _put_refs(self, method: str, puts: Sequence[tuple[str, int]], what: str,
                  timeout: float | None, reads_done: bool = False) -> list[int]:
        request = store_pb2.PutEndRequest(
            client_id=self.client_id, reads_done=reads_done,
            puts=[store_pb2.PutRef(key=key, put_id=put_id) for key, put_id in puts])
        reply = self._call(method, request, f"{what} of {len(puts)} key(s)", timeout)
        return list(reply.codes)

    # -- one-round-trip puts (docs/store.md §2) ---------------------------------------

    def reserve(self, config: ReplicaConfig | None = None, want_bytes: int = 0, *,
                release: Sequence[int] = (), timeout: float | None = None) -> ReserveResult:
        """Space set aside for this client's puts, one reservation per replica (ending
        the reservations in `release` first). Write into one only before the lease
        (`lease_ttl_ms`) counted from *before* this call, less a margin."""
        request = store_pb2.ReserveRequest(
            client_id=self.client_id, node_id=self.node_id, bytes=want_bytes,
            config=replica_config_to_pb(config or ReplicaConfig()), release=list(release))
        reply = self._call("Reserve", request, "reserve", timeout)
        return ReserveResult(reply.code, tuple(
            Reservation(r.reservation_id, replica_from_pb(r.space)) for r in reply.reservations),
            reply.lease_ttl_ms, reply.message)

    def batch_commit(self, items: Sequence[tuple[str, int, Sequence[ReservedRange]]],
                     config: ReplicaConfig | None = None, *, upsert: bool = False,
                     timeout: float | None = None, reads_done: bool = False) -> list[int]:
        """Make each (key, size, [(reservation id, addr, length)] per replica), written
        before this call, visible; one code per item. OK renews the reservations used.
        `reads_done`: as `batch_put_end`'s."""
        request = store_pb2.CommitRequest(
            client_id=self.client_id, upsert=upsert, reads_done=reads_done,
            config=replica_config_to_pb(config or ReplicaConfig()))
        add_item = request.items.add  # filled in place: half the time of nested messages
        for key, size, ranges in items:
            add_range = add_item(key=key, value_length=size).ranges.add
            for rid, addr, length in ranges:
                add_range(reservation_id=rid, addr=addr, length=length)
        reply = self._call("Commit", request, f"commit of {len(items)} key(s)", timeout)
        return list(reply.codes)

    def release(self, reservation_ids: Sequence[int], timeout: float | None = None,
                ) -> list[int]:
        """End reservations of this client: what they still hold is free again."""
        reply = self._call("Release", store_pb2.ReleaseRequest(
            client_id=self.client_id, reservation_ids=list(reservation_ids)),
            f"release of {len(reservation_ids)} reservation(s)", timeout)
        return list(reply.codes)

    # -- reads -----------------------------------------------------------------------

    def batch_get_replicas(self, keys: Sequence[str], timeout: float | None = None, *,
                           cache: bool = False) -> list[GetReplicasResult]:
        """Where each key's value is; grants a read lease on each one found, and holds
        its space for this client's read (see `batch_remove`'s `reads_done`). `cache`:
        also a cache lease (`cache_ttl_ms`, counted from before this call: see
        LocationCache)."""
        reply = self._call("GetReplicas", store_pb2.KeysRequest(keys=list(keys), cache=cache,
                                                                client_id=self.client_id),
                           f"get replicas of {len(keys)} key(s)", timeout)
        return [GetReplicasResult(r.code, r.size, tuple(replica_from_pb(p) for p in r.replicas),
                                  r.lease_ttl_ms, r.cache_ttl_ms) for r in reply.results]

    def get_replicas(self, key: str, timeout: float | None = None) -> GetReplicasResult:
        return self.batch_get_replicas([key], timeout)[0]

    def batch_exist_key(self, keys: Sequence[str], timeout: float | None = None,
                        ) -> list[int]:
        """OK: stored and readable; OBJECT_NOT_FOUND; REPLICA_IS_NOT_READY: stored, but
        every replica is in a segment awaiting its remount."""
        reply = self._call("ExistKey", store_pb2.KeysRequest(keys=list(keys)),
                           f"exist of {len(keys)} key(s)", timeout)
        return list(reply.codes)

    def exist_key(self, key: str, timeout: float | None = None) -> int:
        return self.batch_exist_key([key], timeout)[0]

    def batch_get_size(self, keys: Sequence[str], timeout: float | None = None) -> list[int]:
        """Each value's size in bytes, or a negative ErrorCode (Mooncake's get_size)."""
        reply = self._call("GetSize", store_pb2.KeysRequest(keys=list(keys)),
                           f"get size of {len(keys)} key(s)", timeout)
        return list(reply.sizes)

    def get_size(self, key: str, timeout: float | None = None) -> int:
        return self.batch_get_size([key], timeout)[0]

    # -- removal ---------------------------------------------------------------------

    def batch_remove(self, keys: Sequence[str], force: bool = False,
                     timeout: float | None = None, *, reads_done: bool = False) -> list[int]:
        """Remove each key: OBJECT_HAS_LEASE while read-leased, unless `force` (then the
        key goes at once and its space is reused once no read of it may be in flight).
        `reads_done`: this client has no read of these keys in flight and no cached
        locations of them (it promises so), so its own reads hold nothing back
        (docs/store.md §4)."""
        reply = self._call("Remove",
                           store_pb2.RemoveRequest(keys=list(keys), force=force,
                                                   client_id=self.client_id if reads_done
                                                   else ""),
                           f"remove of {len(keys)} key(s)", timeout)
        return list(reply.codes)

    def remove(self, key: str, force: bool = False, timeout: float | None = None) -> int:
        return self.batch_remove([key], force, timeout)[0]

    def remove_by_regex(self, regex: str, force: bool = False,
                        timeout: float | None = None) -> CountResult:
        """Remove every key `regex` matches (Python `re.search`); leased ones stay unless force."""
        reply = self._call("RemoveByRegex",
                           store_pb2.RemoveByRegexRequest(regex=regex, force=force),
                           f"remove by regex {regex!r}", timeout)
        return CountResult(reply.code, reply.count, reply.message)

    def remove_all(self, force: bool = False, timeout: float | None = None) -> CountResult:
        """Remove every committed key (leased ones stay unless force); puts in progress stay."""
        reply = self._call("RemoveAll", store_pb2.RemoveAllRequest(force=force),
                           "remove all", timeout)
        return CountResult(reply.code, reply.count, reply.message)

    # -- listing (operators) -----------------------------------------------------------

    def list_keys(self, regex: str = "", limit: int = 0,
                  timeout: float | None = None) -> KeyListing:
        """Objects whose key `regex` matches (`re.search`; "" = all), sorted, at most
        `limit` (0: the master's cap); a bad regex is code INVALID_PARAMS, not raised.
        Takes no lease and counts as no access."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit < 1 << 32:
            raise ParamInvalid(f"list_keys: limit must be an integer >= 0, got {limit!r}")
        reply = self._call("ListKeys",
                           store_pb2.ListKeysRequest(regex=regex, limit=limit),
                           f"list of keys matching {regex!r}", timeout)
        return KeyListing(reply.code, tuple(key_info_from_pb(k) for k in reply.keys),
                          reply.total, reply.truncated, reply.message)

    # -- lifetime --------------------------------------------------------------------

    def close(self) -> None:
        with self._links_lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            if link.fast is not None:
                link.fast.close()
            link.channel.close()

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- location cache

#: most locations a LocationCache keeps (the oldest go first)
CACHE_ENTRIES = 65_536


class LocationCache:
    """Where values are, as the master said, for gets that skip the master (docs/store.md
    §3). Thread-safe.

    An entry is used only before `sent + cache_ttl * (1 - RESERVATION_MARGIN)`, `sent`
    being when its GetReplicas was *sent*: the master returns a removal or replacement
    of the value only after `cache_ttl` from when it answered, which is later, so no
    client reads a cached location of a value once its removal has returned. The
    client's own puts and removals drop their keys at once.

    A reader may also keep, beside an entry, where its bytes are mapped (`keep_source`):
    the next read of the key then takes it from `source` -- one dict read, no lock -- for
    exactly as long as the entry itself is fresh.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = CACHE_ENTRIES) -> None:
        self._clock = clock
        self._max = max_entries
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[GetReplicasResult, float]] = {}
        #: key -> (the entry's result, a source kept for it); valid while that result is
        #: the key's fresh entry
        self._sources: dict[str, tuple[GetReplicasResult, Any]] = {}
        #: gets answered from the cache, for tests and operators
        self.hits = 0

    def get(self, key: str) -> GetReplicasResult | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if self._clock() >= entry[1]:
                del self._entries[key]
                self._sources.pop(key, None)
                return None
            self.hits += 1
            return entry[0]

    def source(self, key: str) -> Any | None:
        """The source kept for `key`'s entry while that entry is fresh; else None. No lock:
        entries and sources are replaced whole, and a source counts only beside the very
        result it was kept for."""
        source = self._fresh_source(key, self._clock())
        if source is not None:
            self.hits += 1
        return source

    def sources(self, keys: Sequence[str]) -> list[Any] | None:
        """`source` of every key (one clock read), or None unless each has one."""
        now = self._clock()
        found = []
        for key in keys:
            source = self._fresh_source(key, now)
            if source is None:
                return None
            found.append(source)
        self.hits += len(found)
        return found

    def _fresh_source(self, key: str, now: float) -> Any | None:
        kept = self._sources.get(key)
        if kept is None:
            return None
        entry = self._entries.get(key)
        if entry is None or entry[0] is not kept[0] or now >= entry[1]:
            return None
        return kept[1]

    def still_kept(self, key: str, source: Any) -> bool:
        """`source` is still kept for `key`: its entry was neither dropped nor replaced since
        `source(key)` returned it. A removal drops the key before it asks the master, so a
        copy made before this answers True read bytes the master had not freed yet."""
        kept = self._sources.get(key)
        return kept is not None and kept[1] is source

    def all_still_kept(self, keys: Sequence[str], sources: Sequence[Any]) -> bool:
        """`still_kept` of every (key, source)."""
        kept = map(self._sources.get, keys)
        return len(keys) == len(sources) and all(
            entry is not None and entry[1] is source for entry, source in zip(kept, sources, strict=True))

    def keep_source(self, key: str, result: GetReplicasResult, source: Any) -> None:
        """Keep `source` for `key` if `result` is still its entry."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is result:
                self._sources[key] = (result, source)

    def put(self, key: str, result: GetReplicasResult, sent: float) -> None:
        """Keep `result` (of a GetReplicas sent at `sent`) if the master let us."""
        if result.code != ErrorCode.OK or not result.cache_ttl_ms or not result.replicas:
            return
        until = sent + result.cache_ttl_ms / 1000 * (1 - RESERVATION_MARGIN)
        with self._lock:
            entries = self._entries
            entries.pop(key, None)
            self._sources.pop(key, None)
            entries[key] = (result, until)
            while len(entries) > self._max:
                oldest = next(iter(entries))
                del entries[oldest]
                self._sources.pop(oldest, None)

    def key_of(self, result: GetReplicasResult) -> str | None:
        """The key `result` is cached under, if it came from this cache."""
        with self._lock:
            for key, (held, _) in self._entries.items():
                if held is result:
                    return key
        return None

    def drop(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._entries.pop(key, None)
                self._sources.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sources.clear()


class ReadGate:
    """Which keys this client is reading now, so that its own removal may tell the master
    that no read of them is in flight (`MasterClient.batch_remove(reads_done=True)`;
    docs/store.md §4). Thread-safe.

    A read enters before it asks anyone (master or LocationCache) where its keys are and
    leaves once their bytes arrived. A removal waits, at most `wait_s`, until none of its
    keys is being read, and keeps new reads of them out until its call returned: a read
    that entered later asks the master, which answers after the removal. Keys that are
    not strings (refused anyway) are not tracked."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: key -> reads (removals) of it in progress; a key with none is absent
        self._reading: dict[str, int] = {}
        self._removing: dict[str, int] = {}
        self._waiting = 0  # removals waiting for reads to leave (only they need a notify)

    def enter(self, names: list[str]) -> None:
        """A read of `names` (str keys only) begins: after any removal of them in
        progress. Pair with `leave` (reading() does both)."""
        with self._cond:
            if self._removing:
                self._cond.wait_for(lambda: not any(k in self._removing for k in names))
            _count_in(self._reading, names)

    def leave(self, names: list[str]) -> None:
        with self._cond:
            _count_out(self._reading, names)
            if self._waiting:
                self._cond.notify_all()

    @contextlib.contextmanager
    def reading(self, keys: Iterable[Any]) -> Iterator[None]:
        names = [k for k in keys if isinstance(k, str)]
        self.enter(names)
        try:
            yield
        finally:
            self.leave(names)

    @contextlib.contextmanager
    def removing(self, keys: Iterable[Any], wait_s: float) -> Iterator[bool]:
        """Yields True when no read of `keys` is in flight (none starts until the block
        ends); False when reads were still running after `wait_s`."""
        names = [k for k in keys if isinstance(k, str)]
        with self._cond:
            self._waiting += 1
            try:
                idle = self._cond.wait_for(lambda: not any(k in self._reading for k in names),
                                           timeout=wait_s)
            finally:
                self._waiting -= 1
            _count_in(self._removing, names)
        try:
            yield idle
        finally:
            with self._cond:
                _count_out(self._removing, names)
                self._cond.notify_all()


def _count_in(counts: dict[str, int], names: list[str]) -> None:
    for name in names:
        counts[name] = counts.get(name, 0) + 1


def _count_out(counts: dict[str, int], names: list[str]) -> None:
    for name in names:
        left = counts[name] - 1
        if left:
            counts[name] = left
        else:
            del counts[name]


# ---------------------------------------------------------------------------- reservations

#: a reservation is written only while this share of its lease is left (docs/store.md §2)
RESERVATION_MARGIN = 0.25
#: values up to this share of a reservation are placed in one (larger ones: two-phase put)
PLACE_AT_MOST = 0.25
#: after the master could not grant a reservation: none asked for during this long
RESERVE_BACKOFF_S = 1.0
_ALIGN = 64


@dataclass(eq=False)
class _Held:
    """One reservation as its client uses it."""

    reservation: Reservation
    ttl_s: float
    fresh_until: float           # monotonic: no write into it from then on
    cursor: int = 0              # next free byte, from space.addr
    in_flight: int = 0           # placements neither committed nor given up
    retired: bool = False        # no new placements (spent, or unknown to the master)

    def room(self) -> int:
        return self.reservation.space.length - self.cursor


@dataclass(frozen=True, eq=False)
class Placement:
    """Where one value goes: the replicas to write and, per replica, the claim to commit."""

    replicas: tuple[Replica, ...]
    ranges: tuple[ReservedRange, ...]
    held: tuple[_Held, ...]


def _placement_key(config: ReplicaConfig) -> tuple[Any, ...]:
    """What decides where a put's replicas go (pins do not)."""
    return (config.replica_num, config.preferred_segments, config.prefer_alloc_in_same_node)


class _SharedCall:
    """One caller's items in a `_SharedCalls` queue, and what came back for them."""

    __slots__ = ("items", "keys", "options", "batch", "done", "codes", "error")

    def __init__(self, items: list[tuple[str, int, Any]], options: tuple[Any, ...]) -> None:
        self.items, self.options = items, options
        self.keys = {item[0] for item in items}
        self.done = False
        self.batch: list[_SharedCall] | None = None  # set: this caller sends that batch
        self.codes: list[int] = []
        self.error: BaseException | None = None


class _SharedCalls:
    """Concurrent batch calls of one kind share one call to the master.

    One call is in flight at a time. A caller that finds none sends its own at once;
    one that finds one queues. When a call returns, the queue's first caller is given
    the next batch to send: its own items, then those of every caller queued after it
    with the same options (and none of their keys: the master applies a batch in order,
    so two puts of one key stay two calls), up to MAX_ITEMS. Each caller gets its own
    codes, or the call's error. Why: many threads putting through one client otherwise
    make one round trip each, and on a persistent master one sync each, where the
    master's group commit saw few of them together (docs/store.md, seventh session).
    """

    MAX_ITEMS = 64

    def __init__(self, send: Callable[[list[tuple[str, int, Any]], tuple[Any, ...]],
                                      list[int]]) -> None:
        self._send = send
        self._state = threading.Condition(threading.Lock())
        self._queue: list[_SharedCall] = []
        self._in_flight = False

    def call(self, items: list[tuple[str, int, Any]], options: tuple[Any, ...]) -> list[int]:
        mine = _SharedCall(items, options)
        interrupted: BaseException | None = None
        with self._state:
            self._queue.append(mine)
            if self._in_flight:
                try:
                    while not mine.done and mine.batch is None:
                        self._state.wait()
                except BaseException as exc:  # an interrupt (KeyboardInterrupt, ...)
                    if mine.batch is None:  # not ours to send: give up waiting
                        if mine in self._queue:  # not taken: nothing of it is sent
                            self._queue.remove(mine)
                        raise
                    interrupted = exc  # ours to send: the threads in it wait on it
            else:
                self._in_flight = True
                self._take_locked()
        leading = mine.batch is not None
        if leading:
            self._run(mine.batch)
        if interrupted is not None:
            raise interrupted
        if mine.error is not None:
            raise mine.error if leading else _same_error(mine.error)
        return mine.codes

    def _take_locked(self) -> None:
        """Make the next batch from the queue's head and give it to the head's caller."""
        first = self._queue[0]
        batch, keys, count = [first], set(first.keys), len(first.items)
        for other in self._queue[1:]:
            if other.options != first.options or keys & other.keys \
                    or count + len(other.items) > self.MAX_ITEMS:
                continue
            batch.append(other)
            keys |= other.keys
            count += len(other.items)
        self._queue = [call for call in self._queue if call not in batch]
        first.batch = batch

    def _run(self, batch: list[_SharedCall]) -> None:
        """Send `batch`, then hand the next one on, whatever happened (else every queued
        thread would wait for good)."""
        try:
            codes = self._send([item for call in batch for item in call.items],
                               batch[0].options)
            at = 0
            for call in batch:
                call.codes, at = codes[at:at + len(call.items)], at + len(call.items)
        except BaseException as exc:  # every caller of the batch gets it
            for call in batch:
                call.error = exc
        finally:
            with self._state:
                for call in batch:
                    call.done = True
                if self._queue:
                    self._take_locked()
                else:
                    self._in_flight = False
                self._state.notify_all()


def _same_error(error: BaseException) -> BaseException:
    """`error` again for another thread: a fresh one of its type and message where it
    can be made (a shared instance would collect every thread's traceback)."""
    try:
        return type(error)(*error.args)
    except Exception:  # noqa: BLE001 - a type we cannot rebuild: the instance itself
        return error


class ReservedSpace:
    """A client's reservations at its master, for puts in one round trip (docs/store.md
    §2): place values, check a placement is still safe to write, commit. Thread-safe.

    The one rule that keeps a restarted master's space safe: a reservation is written
    only before `sent + ttl * (1 - RESERVATION_MARGIN)`, `sent` being when the Reserve,
    or the last Commit that used it and was answered OK, was *sent*.
    """

    def __init__(self, master: MasterClient, want_bytes: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.master = master
        self.want_bytes = want_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._sets: dict[tuple[Any, ...], list[_Held]] = {}
        self._spent: list[_Held] = []        # retired, to release once nothing is in flight
        self._off_until = 0.0
        self._disabled = False
        #: values committed, and master calls made (Reserve, Commit, Release), for tests
        #: and operators
        self.commits = 0
        self.calls = 0
        self._commits = _SharedCalls(self._commit_now)

    def place(self, config: ReplicaConfig, sizes: Sequence[int]) -> list[Placement | None]:
        """A placement per size (None: use the two-phase put), reserving at most once."""
        out: list[Placement | None] = [None] * len(sizes)
        with self._lock:
            now = self._clock()
            if self._disabled or now < self._off_until:
                return out
            key = _placement_key(config)
            reserved = False
            held = self._sets.get(key)
            limit = self._limit(held)
            for index, size in enumerate(sizes):
                need = (size + _ALIGN - 1) // _ALIGN * _ALIGN
                if need > limit:
                    continue  # the two-phase put's, whatever the room left
                chosen = self._choose(held, need, config, now) if held is not None else None
                if chosen is None:
                    if held is not None:
                        self._retire(key)
                    if reserved:
                        break
                    reserved = True
                    held = self._reserve_locked(key, config)
                    limit = self._limit(held)
                    now = self._clock()
                    if held is None or need > limit:
                        continue
                    chosen = self._choose(held, need, config, now)
                    if chosen is None:
                        continue
                out[index] = self._take(chosen, size, need)
        return out

    def fresh(self, placement: Placement) -> bool:
        """True while every reservation of `placement` may still be written: check it
        right before writing."""
        now = self._clock()
        return all(not held.retired and now < held.fresh_until for held in placement.held)

    def abandon(self, placements: Sequence[Placement]) -> None:
        """These placements will not be committed (their write failed or was skipped):
        their ranges stay unused until the reservation ends."""
        with self._lock:
            for placement in placements:
                for held in placement.held:
                    held.in_flight -= 1

    def commit(self, items: Sequence[tuple[str, int, Placement]], config: ReplicaConfig, *,
               upsert: bool = False, reads_done: bool = False) -> list[int]:
        """Commit written values: one code per item (raises MasterRpcError as the master
        client does; the reservations involved are then retired). OK renews the
        reservations used; OBJECT_NOT_FOUND / LEASE_EXPIRED mean the master no longer
        knows them (it restarted, or the lease ended): they are dropped.

        Commits of other threads that wait meanwhile go with it as one call
        (`_SharedCalls`): one round trip and, on a persistent master, one journal record
        and one sync for all of them."""
        return self._commits.call(list(items), (config, upsert, reads_done))

    def _commit_now(self, items: list[tuple[str, int, Placement]],
                    options: tuple[ReplicaConfig, bool, bool]) -> list[int]:
        config, upsert, reads_done = options
        sent = self._clock()
        self.calls += 1
        try:
            codes = self.master.batch_commit(
                [(key, size, placement.ranges) for key, size, placement in items], config,
                upsert=upsert, reads_done=reads_done)
        except MasterRpcError:
            with self._lock:
                for _, _, placement in items:
                    for held in placement.held:
                        held.in_flight -= 1
                        held.retired = True
                self._drop_retired_sets()
            raise
        with self._lock:
            for (_, _, placement), code in zip(items, codes, strict=True):
                for held in placement.held:
                    held.in_flight -= 1
                    if code == ErrorCode.OK:
                        held.fresh_until = max(held.fresh_until, self._fresh_from(held, sent))
                    elif code in (ErrorCode.OBJECT_NOT_FOUND, ErrorCode.LEASE_EXPIRED):
                        held.retired = True
            self._drop_retired_sets()
            self.commits += len(items)
        return codes

    def close(self) -> None:
        """Release every reservation that has nothing in flight (best effort)."""
        with self._lock:
            ids = [h.reservation.reservation_id for held in self._sets.values() for h in held
                   if not h.in_flight]
            ids += [h.reservation.reservation_id for h in self._spent if not h.in_flight]
            self._sets.clear()
            self._spent.clear()
            self._disabled = True
        if ids:
            self.calls += 1
            with contextlib.suppress(MasterRpcError):
                self.master.release(ids, timeout=min(self.master.timeout, 2.0))

    # -- internals (under the lock) ------------------------------------------------------

    @staticmethod
    def _fresh_from(held: _Held, sent: float) -> float:
        return sent + held.ttl_s * (1 - RESERVATION_MARGIN)

    @staticmethod
    def _limit(held: list[_Held] | None) -> float:
        """The largest value placed in `held` (larger ones take the two-phase put)."""
        if not held:
            return float("inf")
        return min(h.reservation.space.length for h in held) * PLACE_AT_MOST

    @staticmethod
    def _choose(held: list[_Held], need: int, config: ReplicaConfig, now: float,
                ) -> list[_Held] | None:
        """The reservations one value of `need` bytes goes to: replica_num of them (fewer
        when the master found fewer segments), the first ones when the config prefers
        segments (the master returned them in its order), else at random, as the random
        strategy spreads values; None when they lack room or are no longer fresh."""
        count = min(config.replica_num, len(held))
        ordered = bool(config.preferred_segments or config.prefer_alloc_in_same_node)
        candidates = [h for h in (held[:count] if ordered else held)
                      if not h.retired and now < h.fresh_until and h.room() >= need]
        if len(candidates) < count:
            return None
        if ordered:
            return candidates
        return [random.choice(candidates)] if count == 1 else random.sample(candidates, count)

    def _take(self, held: list[_Held], size: int, need: int) -> Placement:
        replicas, ranges = [], []
        for h in held:
            space = h.reservation.space
            addr = space.addr + h.cursor
            h.cursor += need
            h.in_flight += 1
            replicas.append(Replica(0, space.engine, space.segment_id, space.epoch, addr,
                                    size, space.node_id, ReplicaState.INIT))
            ranges.append((h.reservation.reservation_id, addr, need))
        return Placement(tuple(replicas), tuple(ranges), tuple(held))

    def _retire(self, key: tuple[Any, ...]) -> None:
        for held in self._sets.pop(key, []):
            held.retired = True
            self._spent.append(held)

    def _drop_retired_sets(self) -> None:
        for key in [k for k, held in self._sets.items() if any(h.retired for h in held)]:
            self._retire(key)

    def _reserve_locked(self, key: tuple[Any, ...], config: ReplicaConfig) -> list[_Held] | None:
        """A new set of reservations for `config` (releasing spent ones), or None."""
        # spent ones with nothing in flight are released; those whose lease the master
        # must have ended by now are forgotten (a placement never given back included)
        now = self._clock()
        alive = [h for h in self._spent if now < h.fresh_until + h.ttl_s]
        release = [h for h in alive if not h.in_flight]
        self._spent = [h for h in alive if h.in_flight]
        sent = self._clock()
        self.calls += 1
        try:
            result = self.master.reserve(config, self.want_bytes,
                                         release=[h.reservation.reservation_id for h in release])
        except MasterUnavailable:
            self._off_until = self._clock() + RESERVE_BACKOFF_S
            return None
        except MasterRpcError as exc:  # e.g. a master without Reserve: two-phase puts only
            log.info("reservations off for this client: %s", exc)
            self._disabled = True
            return None
        if result.code != ErrorCode.OK or not result.reservations:
            self._off_until = self._clock() + RESERVE_BACKOFF_S
            return None
        ttl = result.lease_ttl_ms / 1000
        held = [_Held(r, ttl, sent + ttl * (1 - RESERVATION_MARGIN))
                for r in result.reservations]
        self._sets[key] = held
        return held


__all__ = [
    "ClientStatus", "CountResult", "GetReplicasResult", "HeartbeatResult", "KeyInfo",
    "KeyListing", "KeyReplica", "KeyState", "LocationCache", "MasterClient", "MasterNotLeader",
    "MasterAuthenticationFailed", "MasterRpcError", "MasterUnavailable", "MasterWrongServer",
    "MountedSegment",
    "NOT_IDEMPOTENT",
    "PutStartResult", "ReadGate", "Replica", "ReplicaConfig", "ReplicaState", "Reservation",
    "Placement", "ReserveResult", "ReservedRange", "ReservedSpace", "SegmentResult",
    "SoftPinAction", "StoreSegment", "key_info_from_pb", "key_info_to_pb", "master_error",
    "replica_config_from_pb",
    "replica_config_to_pb", "replica_from_pb", "replica_to_pb", "store_segment_from_pb",
    "store_segment_to_pb",
]
