"""`GlobalTable`: one engine's live copy of the cluster's address table, kept by a watch.

One daemon thread holds one registry watch stream (hixl-master, or any agent's embedded
registry): a SNAPSHOT, then ADDED/REMOVED and ENGINE_UP/ENGINE_DOWN as they happen. So an
engine knows every peer's segments, epoch and endpoints without an RPC per operation or
per connect. When the stream breaks (registry restarted, network cut) the thread
reconnects with back-off (to the next master address, given several, when the one it
followed is gone or not the leader) and resyncs from a fresh SNAPSHOT; meanwhile the
last view stays readable (`synced` is False), since the data path itself reports dead
peers.

Until the first snapshot, though, the table knows nothing, and an empty table must not
pass for an empty cluster: `require` (what `Engine.engines()` calls) waits a bounded time
for that first snapshot and then raises, naming the registry and why it has not answered
(PeerUnavailable for a registry that is down or silent; WrongServer, at once, for an
address that is not a registry; AuthenticationFailed, at once, for a refused token). The
first failure is logged as a WARNING with the same reason.

Readers never wait for the thread: each engine's view is copy-on-write (the thread
builds a new `EngineView` per change and swaps it in), so a lookup is a dict read plus a
bisect on an immutable table, with no lock. `wait_for` is the one call that blocks, and
it has a deadline.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from hixl.errors import (
    AuthenticationFailed,
    HixlError,
    NotConnected,
    OutOfRange,
    ParamInvalid,
    PeerUnavailable,
    WrongServer,
)
from hixl.failover import Endpoints
from hixl.registry_client import (
    EngineEndpoints,
    EngineInfo,
    RegistryClient,
    WatchEvent,
    collector_paused,
)
from hixl.table import AddressTable
from hixl.tls import TlsSetting, client_tls
from hixl.types import SegmentInfo
from hixl.wrong_server import REGISTRY

log = logging.getLogger("hixl.global_table")

BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 1.0
#: failures whose own class and text name the fix: `require` raises them as they are
#: (anything else as PeerUnavailable)
FINAL_FAILURES: tuple[type[HixlError], ...] = (WrongServer, AuthenticationFailed)


@dataclass(frozen=True)
class EngineView:
    """One engine as the table sees it now. Never changed once published: a change makes
    a new view, so a reader holding one sees a consistent table."""

    info: EngineInfo
    table: AddressTable[SegmentInfo]

    @property
    def epoch(self) -> int:
        return self.info.epoch

    def segments(self) -> list[SegmentInfo]:
        """Its segments in address order."""
        return [segment for _, _, segment in self.table]


#: a table's calls to the registry, and the longest wait for its first answer
#: (GlobalTable.require), when the caller names none
DEFAULT_TIMEOUT_S = 5.0


class GlobalTable:
    """The registry's table, mirrored in this process by a watch stream."""

    def __init__(self, registry: str | Sequence[str], *, timeout: float | None = None,
                 backoff_max: float = BACKOFF_MAX_S,
                 cluster_token: str | bytes | None = None, tls: TlsSetting = None) -> None:
        """`registry`: "host:port", or every master of the cluster ("h1:p1,h2:p2" or a
        list): the watch follows one, and moves to the next (or the leader a standby
        names) when its stream breaks. `cluster_token`: proves this watcher to a registry
        that requires one; `tls`: how to dial it (hixl.tls: ClientTLS, False for
        plaintext, None: HIXL_TLS_*)."""
        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        if not timeout > 0 or not backoff_max > 0:
            raise ParamInvalid(f"timeout and backoff_max must be positive, got {timeout}, "
                               f"{backoff_max}")
        self._endpoints = Endpoints(registry, "registry address")
        #: every registry address, as given ("h1:p1,h2:p2")
        self.registry = self._endpoints.describe()
        self._token = cluster_token
        self._tls = client_tls(tls) or False  # resolved once: every reconnect dials alike
        self._timeout = timeout
        self._backoff_max = backoff_max
        self._views: dict[str, EngineView] = {}   # replaced, never mutated: copy-on-write
        self._changed = threading.Condition()
        self._version = 0
        self._resyncs = 0
        self._synced = False
        self._last_error: HixlError | None = None  # why the watch failed last (None: never)
        self._stop = threading.Event()
        self._watch_lock = threading.Lock()
        self._watch: object | None = None           # the open RegistryWatch, for close()
        self._thread = threading.Thread(target=self._run, name="hixl-global-table",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ reading

    @property
    def version(self) -> int:
        """Bumped once per change applied (each event, each snapshot)."""
        return self._version

    @property
    def resyncs(self) -> int:
        """How many SNAPSHOTs were applied (1 after the first sync, +1 per reconnect)."""
        return self._resyncs

    @property
    def synced(self) -> bool:
        """True while the watch stream is up and its snapshot applied."""
        return self._synced

    @property
    def last_error(self) -> HixlError | None:
        """Why the watch failed last (None if it never did); kept after a later success."""
        return self._last_error

    def require(self, timeout: float | None = None) -> None:
        """Return once the table holds the registry's view; raise while it never has.

        After a first snapshot this returns at once, whatever happens later (an outage
        keeps the last view readable). Before it, wait at most `timeout` seconds (default:
        the table's timeout) for that snapshot, then raise naming the registry and the
        last failure: PeerUnavailable (down, unreachable or silent), WrongServer (not a
        registry) or AuthenticationFailed; at once for the last two when waiting cannot
        mend them (a refused token; a wrong address that is the only one).
        """
        if self._resyncs:
            return
        limit = self._timeout if timeout is None else timeout
        self.wait_for(lambda table: bool(table.resyncs) or table._final(), limit)
        if self._resyncs:
            return
        error = self._last_error
        cls: type[HixlError] = type(error) if isinstance(error, FINAL_FAILURES) else \
            PeerUnavailable
        if error is None:
            why = (f"no snapshot within {limit:g} s" if not self._stop.is_set()
                   else "the table was closed first")
        else:
            why = str(error.args[0]) if error.args else str(error)
        fix = ("" if isinstance(error, FINAL_FAILURES) else
               f"; is hixl-master running at {self.registry} (engines follow the address "
               "the agents' --master names)? ")
        raise cls(f"registry {self.registry} has not answered since this engine started, so "
                  f"nothing is known of the cluster yet: {why}{fix}".rstrip())

    def _final(self) -> bool:
        """The last failure is one waiting does not mend: a refused token, or an address
        that is no registry when it is the only one (given several, the watch moves on)."""
        error = self._last_error
        return isinstance(error, AuthenticationFailed) or (
            isinstance(error, WrongServer) and len(self._endpoints.addresses) == 1)

    def engines(self) -> dict[str, EngineInfo]:
        """Engine name -> identity, epoch and endpoints, for every engine with a live lease
        (empty before the first snapshot: `require` tells the two apart)."""
        return {name: view.info for name, view in self._views.items()}

    def view(self, engine: str) -> EngineView | None:
        """The engine's current view (None when the registry does not list it)."""
        return self._views.get(engine)

    def segments(self, engine: str = "") -> list[SegmentInfo]:
        """One engine's segments in address order ("" = every engine's, by engine name)."""
        views = self._views
        if engine:
            view = views.get(engine)
            return view.segments() if view is not None else []
        return [segment for name in sorted(views) for segment in views[name].segments()]

    def __len__(self) -> int:
        """Segments in the table, all engines together."""
        return sum(len(view.table) for view in self._views.values())

    def find(self, engine: str, addr: int, length: int) -> SegmentInfo:
        """The segment of `engine` wholly holding [addr, addr+length): O(log n), no RPC.

        NotConnected when the registry does not list the engine; OutOfRange on a miss.
        """
        view = self._views.get(engine)
        if view is None:
            raise NotConnected(f"engine {engine!r} is not in the registry {self.registry} "
                               "(never published, or its lease expired)")
        try:
            return view.table.find(addr, length)[1]
        except OutOfRange:  # only now pay for naming the engine: hits are the hot path
            try:
                view.table.find(addr, length, f"engine {engine!r} address")
            except OutOfRange as exc:
                raise OutOfRange(f"{exc.args[0]} (registry {self.registry})") from None
            raise

    def wait_for(self, predicate: Callable[[GlobalTable], bool], timeout: float) -> bool:
        """Wait until `predicate(table)` holds (True) or `timeout` seconds pass (False).

        Checked now and after every change; for tests and for "this change has reached
        this engine" (e.g. a registration is visible before telling a peer about it).
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                if predicate(self):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    return False
                self._changed.wait(remaining)

    def wait_synced(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until a snapshot is applied and the stream is up.
        False at once, before any snapshot, on a failure waiting does not mend (a refused
        token, an only address that is no registry: `require` raises it)."""
        return self.wait_for(lambda table: table.synced or (
            not table.resyncs and table._final()), timeout) and self._synced

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop watching (cancels the stream); the last view stays readable. Idempotent."""
        self._stop.set()
        with self._watch_lock:
            watch = self._watch
        if watch is not None:
            watch.close()  # type: ignore[attr-defined]
        with self._changed:
            self._changed.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(self._timeout)

    def __enter__(self) -> GlobalTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the watch thread

    @property
    def current(self) -> str:
        """The registry address the watch follows now (or reconnects to next)."""
        return self._endpoints.current()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            # a new client (fresh channel) per reconnect, sharing the address rotation: a
            # watch that broke because its master is gone moved it to the next address
            address = self._endpoints.current()
            client = RegistryClient(self._endpoints, timeout=self._timeout,
                                    cluster_token=self._token, tls=self._tls, expect=REGISTRY)
            try:
                watch = client.open_watch(engines=True)
                with self._watch_lock:
                    self._watch = watch
                if self._stop.is_set():
                    break
                for event in watch:
                    self._apply(event)
                    failures = 0
                if not self._stop.is_set():
                    log.info("registry %s ended the watch; resyncing", address)
            except HixlError as exc:
                if not self._resyncs and failures == 0:
                    log.warning("registry %s has not answered: %s (retrying; until it does, "
                                "this engine knows no peers, and engines() raises this)",
                                address, exc)
                else:
                    level = logging.INFO if failures == 0 else logging.DEBUG
                    log.log(level, "registry %s watch lost: %s (resyncing from %s)", address,
                            exc, self._endpoints.current())
                self._failed(exc)  # after the log: a waiter woken by it finds the line
            except Exception:  # a bug in applying must not silently freeze the table
                log.exception("registry %s watch failed; resyncing", address)
            finally:
                with self._watch_lock:
                    self._watch = None
                client.close()
                self._mark(synced=False)
            failures += 1
            self._stop.wait(min(self._backoff_max, BACKOFF_FIRST_S * 2 ** min(failures, 10)))

    def _failed(self, error: HixlError) -> None:
        with self._changed:
            self._last_error = error
            self._changed.notify_all()

    def _mark(self, *, synced: bool) -> None:
        with self._changed:
            if self._synced != synced:
                self._synced = synced
                self._version += 1
                self._changed.notify_all()

    def _apply(self, event: WatchEvent) -> None:
        """Build the changed views, swap them in, then bump the version and wake waiters."""
        if event.kind == "SNAPSHOT":
            with collector_paused():  # a whole table of new objects: see collector_paused
                self._views = self._snapshot_views(event.engines, event.segments)
        else:
            views = dict(self._views)
            if event.kind == "ENGINE_UP":
                for info in event.engines:
                    held = views.get(info.engine)
                    same = held is not None and held.epoch == info.epoch
                    views[info.engine] = EngineView(info, held.table if same else AddressTable())
            elif event.kind == "ENGINE_DOWN":
                for info in event.engines:
                    held = views.get(info.engine)
                    if held is not None and held.epoch == info.epoch:
                        del views[info.engine]
            elif event.kind in ("ADDED", "REMOVED"):
                for engine, segments in _by_engine(event.segments).items():
                    views[engine] = _changed_view(views.get(engine), engine, segments,
                                                  added=event.kind == "ADDED")
            else:
                log.debug("registry %s: ignoring unknown event kind %s", self.registry,
                          event.kind)
                return
            self._views = views
        with self._changed:
            if event.kind == "SNAPSHOT":
                self._resyncs += 1
                self._synced = True
            self._version += 1
            self._changed.notify_all()

    @staticmethod
    def _snapshot_views(engines: Iterable[EngineInfo], segments: Iterable[SegmentInfo],
                        ) -> dict[str, EngineView]:
        infos = {info.engine: info for info in engines}
        views: dict[str, EngineView] = {}
        for engine, owned in _by_engine(segments).items():
            views[engine] = _changed_view(None, engine, owned, added=True,
                                          info=infos.get(engine))
        for engine, info in infos.items():
            if engine not in views:
                views[engine] = EngineView(info, AddressTable())
        return views


def _by_engine(segments: Iterable[SegmentInfo]) -> dict[str, list[SegmentInfo]]:
    grouped: dict[str, list[SegmentInfo]] = {}
    for segment in segments:
        grouped.setdefault(segment.engine, []).append(segment)
    return grouped


def _changed_view(held: EngineView | None, engine: str, segments: list[SegmentInfo], *,
                  added: bool, info: EngineInfo | None = None) -> EngineView:
    """A new view: `held`'s table (copied) with `segments` added or removed."""
    if info is None:
        info = held.info if held is not None else EngineInfo(
            engine, segments[0].node_id, segments[0].epoch, EngineEndpoints())
    if added and (held is None or not held.table):
        # A whole table (a snapshot, a new engine): one bulk load, not a bisect insert each.
        with contextlib.suppress(ParamInvalid):  # an overlap: the loop below names it
            return EngineView(info, AddressTable.bulk((s.base, s.length, s) for s in segments))
    table = held.table.copy() if held is not None else AddressTable()
    for segment in sorted(segments, key=lambda s: s.base) if added else segments:
        if added:
            try:
                table.insert(segment.base, segment.length, segment)
            except ParamInvalid as exc:  # the registry refuses overlaps; never expected
                log.warning("engine %s: segment %d not added: %s", engine,
                            segment.segment_id, exc)
        elif table.get(segment.base) == segment:
            table.remove(segment.base)
    return EngineView(info, table)


__all__ = ["EngineView", "GlobalTable"]
