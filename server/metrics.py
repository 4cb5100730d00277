"""Prometheus metric families of hixl's servers: the agent, the registry, the KV store.

Each function reads state the server keeps anyway (counters, tables) and builds metric
families when a scrape asks (wrapped in `hixl.metrics.FunctionCollector`); nothing here
runs on a data path. Metric names are listed in docs/metrics.md.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics_core import Metric

from hixl.metrics import counter, gauge, traffic_families
from hixl.store_codes import ErrorCode

if TYPE_CHECKING:
    from hixl.server.master.store import ObjectStore
    from hixl.server.master.store_rpc_server import StoreCallServer
    from hixl.server.registry import Registry

_CODES = {int(code): code.name for code in ErrorCode}


def agent_families(server: Any) -> list[Metric]:
    """One agent (a running `AgentServer`): identity, data-path traffic, connections, the
    fd socket, segments and pool, and how publishing to the registry goes."""
    agent, data, fd = server.agent, server._data, server._fd
    families: list[Metric] = []
    if agent is None:
        return families
    families.append(gauge("hixl_agent_info", "This agent (value 1): engine name and node.",
                          ("engine", "node_id"), [((agent.engine_name, agent.node_id), 1)]))
    families.append(gauge("hixl_agent_epoch", "This agent's epoch (new at every start).", (),
                          [((), agent.epoch)]))
    if data is not None:
        families += traffic_families(
            "hixl_agent_data",
            "served on the socket data path (write: PUT into this agent, read: GET from it)",
            "transport", data.traffic.rows(),
            timed="each batch of replies sent together, from its first request bytes",
            errors="Requests refused, by wire reason")
        live = Counter(peer.kind for peer in data.peers())
        families.append(gauge("hixl_agent_data_connections", "Open data connections.",
                              ("transport",), [((t,), live[t]) for t in data.accepted]))
        with data._lock:
            accepted = dict(data.accepted)
            totals = dict(data.counters)
        families.append(counter("hixl_agent_data_connections_accepted",
                                "Data connections accepted.", ("transport",),
                                [((t,), n) for t, n in accepted.items()]))
        families.append(counter(
            "hixl_agent_data_connection_errors",
            "Data connections ended by the agent: " + _CONNECTION_ERRORS, ("kind",),
            _connection_errors(totals)))
    if fd is not None:
        families.append(gauge("hixl_agent_fd_clients",
                              "Processes connected to the fd socket (same-node peers).", (),
                              [((), len(fd.peers()))]))
        fd_counts = dict(fd.counters)
        families.append(counter(
            "hixl_agent_fd_events",
            "fd-socket events: connections, requests, errors (failed requests), "
            "refused_peers (uid not allowed), deposits (fds handed in).", ("event",),
            [((name.removeprefix("fd_"),), n) for name, n in sorted(fd_counts.items())]))
    counts = agent.counters()
    families.append(counter(
        "hixl_agent_segment_changes",
        "Segments allocated, registered (memory or fd) and deregistered; fds exported to "
        "fabric peers and exports refused.", ("change",),
        [((name,), counts[name]) for name in ("allocations", "registrations",
                                              "deregistrations", "fds_exported",
                                              "export_refusals")]))
    totals_by_kind = agent.segment_totals()
    kinds = ("pool", "allocated", "fd", "memory")
    families.append(gauge("hixl_agent_segments", "Segments served, by kind.", ("kind",),
                          [((k,), totals_by_kind.get(k, (0, 0))[0]) for k in kinds]))
    families.append(gauge("hixl_agent_segment_bytes",
                          "Capacity of the segments served, by kind (bytes).", ("kind",),
                          [((k,), totals_by_kind.get(k, (0, 0))[1]) for k in kinds]))
    families.append(gauge("hixl_agent_pool_charged_bytes",
                          "Bytes of client-allocated segments charged to pool_max_bytes.", (),
                          [((), counts["pool_bytes_charged"])]))
    families.append(gauge("hixl_agent_pool_max_bytes", "pool_max_bytes: the budget for "
                          "client-allocated segments.", (), [((), counts["pool_bytes_max"])]))
    servicer = server._servicer
    if servicer is not None:
        families.append(gauge("hixl_agent_watchers", "Open WatchSegments streams.", (),
                              [((), servicer.watchers)]))
    families += _publishing_families(server)
    if server.registry is not None:  # no master configured: the embedded registry
        families += registry_families(server.registry)
    return families


_CONNECTION_ERRORS = (
    "rejected (over the connection limit, or no thread could start: includes "
    "thread_start_failure), protocol (a bad frame, a stall mid-frame or an internal error; "
    "includes auth), auth (a wrong or missing cluster token), preauth_evicted (closed in "
    "its handshake to make room for a newer one: the listener's pre-auth slots were all "
    "taken), handshake_timeout (did not authenticate in time), thread_start_failure (the "
    "process could not start its thread).")


def _connection_errors(totals: dict[str, int]) -> list[tuple[tuple[str], int]]:
    """The `kind` rows of a connection errors family, from a ThreadPerConnection's counters
    (hixl.server.connections): the data server's and the store call endpoint's alike."""
    return [(("rejected",), totals["connections_rejected"]),
            (("protocol",), totals["protocol_errors"]),
            (("auth",), totals["auth_failures"]),
            (("preauth_evicted",), totals["preauth_evicted"]),
            (("handshake_timeout",), totals["handshake_timeouts"]),
            (("thread_start_failure",), totals["thread_start_failures"])]


def store_call_families(server: StoreCallServer) -> list[Metric]:
    """The master's store call endpoint (`--fast-port`): connections and how they ended,
    calls served or refused over the call bytes budget, and the body bytes held now."""
    with server._lock:
        totals = dict(server.counters)
    in_flight = server.bytes_in_flight
    return [
        counter("hixl_store_call_connections_accepted",
                "Connections accepted by the store call endpoint.", (),
                [((), totals["connections"])]),
        counter("hixl_store_call_connection_errors",
                "Store call connections ended by the master: " + _CONNECTION_ERRORS[:-1]
                + ", body_timeout (a call body did not arrive within --call-body-timeout-s; "
                "a stall, so counted in protocol too).",
                ("kind",),
                [*_connection_errors(totals), (("body_timeout",), totals["body_timeouts"])]),
        counter("hixl_store_call_calls",
                "Store calls on the call endpoint: served (answered by the store, errors "
                "included), over_budget (refused unapplied: --call-bytes-budget stayed "
                "exhausted), polled (served calls a connection took while polling for "
                "them, --call-spin-us).", ("outcome",),
                [(("served",), totals["calls"]), (("over_budget",), totals["calls_over_budget"]),
                 (("polled",), totals["calls_polled"])]),
        gauge("hixl_store_call_body_bytes", "Bytes of large call bodies held now, against "
              "--call-bytes-budget.", (), [((), in_flight)]),
        gauge("hixl_store_call_body_bytes_budget", "--call-bytes-budget: the most bytes of "
              "large call bodies held at once.", (), [((), server._budget)]),
    ]


def _publishing_families(server: Any) -> list[Metric]:
    state = server._registry_state()
    publisher = server.publisher
    families = [
        gauge("hixl_agent_registry_published",
              "1 while this agent's table is published under a live lease.", ("mode",),
              [((state.mode,), int(state.published))]),
        gauge("hixl_agent_registry_last_success_age_seconds",
              "Seconds since the last successful publish or keepalive (-1: never).", (),
              [((), state.last_success_age_s)]),
        gauge("hixl_agent_registry_consecutive_failures",
              "Failed publish/keepalive attempts since the last success.", (),
              [((), state.failures)]),
    ]
    if publisher is not None:
        calls = dict(publisher.counters)
        families.append(counter(
            "hixl_agent_registry_calls",
            "Calls to the registry: publishes, keepalives, failures.", ("call",),
            [((name.removeprefix("registry_"),), n) for name, n in sorted(calls.items())]))
    return families


def registry_families(registry: Registry) -> list[Metric]:
    """The global address table: engines and segments held, watchers, lease churn."""
    stats = registry.stats()
    return [
        gauge("hixl_registry_engines", "Engines published under a live lease.", (),
              [((), stats["engines"])]),
        gauge("hixl_registry_segments", "Segments published.", (), [((), stats["segments"])]),
        gauge("hixl_registry_segment_bytes", "Bytes of the segments published.", (),
              [((), stats["segment_bytes"])]),
        gauge("hixl_registry_watchers", "Open watch streams.", (), [((), stats["watchers"])]),
        counter("hixl_registry_lease_events",
                "Lease events: granted (a new engine or a restart), republishes (a table "
                "replaced), keepalives, unpublishes, expiries (the agent died or was cut "
                "off), watchers_dropped (fell behind).", ("event",),
                [((name,), stats[name]) for name in ("leases_granted", "republishes",
                                                     "keepalives", "unpublishes", "expiries",
                                                     "watchers_dropped")]),
    ]


_STORE_GAUGES = (  # stats() key, metric name, help
    ("keys", "hixl_store_objects", "Committed objects."),
    ("puts_in_progress", "hixl_store_puts_in_progress", "Puts started and not yet ended."),
    ("clients", "hixl_store_clients", "Clients alive (heartbeating)."),
    ("capacity", "hixl_store_capacity_bytes", "Capacity of the live mounted segments."),
    ("used", "hixl_store_used_bytes", "Bytes allocated in the live mounted segments."),
    ("fragmentation", "hixl_store_fragmentation_ratio",
     "1 - largest free block / free bytes, over the live segments."),
    ("retired_bytes", "hixl_store_retired_bytes",
     "Bytes freed but held until a read lease ends."),
    ("puts_held_for_remount", "hixl_store_puts_held_for_remount",
     "PutStart calls waiting now for segments awaiting their remount (a master "
     "switch or restart) because nothing else has room."),
)
_STORE_COUNTERS = (  # stats() key, metric name, help
    ("puts", "hixl_store_puts_committed", "Values committed (PutEnd)."),
    ("evictions", "hixl_store_evictions", "Eviction passes."),
    ("evicted", "hixl_store_evicted_objects", "Objects evicted."),
    ("expired_clients", "hixl_store_client_expiries", "Clients expired (missed heartbeats)."),
    ("preempted_puts", "hixl_store_preempted_puts", "Unfinished puts pre-empted by a new put."),
    ("released_puts", "hixl_store_released_puts",
     "Unfinished puts whose space was reclaimed."),
    ("remount_holds", "hixl_store_remount_holds",
     "PutStart calls held for segments awaiting their remount."),
    ("remount_hold_timeouts", "hixl_store_remount_hold_timeouts",
     "Held calls whose hold ran out before the remount (answered REPLICA_IS_NOT_READY)."),
)


def master_families(leading: bool) -> list[Metric]:
    """The master's role: 1 while it leads and serves (a single master without etcd
    always does), 0 while it stands by, is elected but still loading, or was deposed."""
    return [gauge("hixl_master_is_leader",
                  "1 while this hixl-master leads and serves the store and registry, 0 "
                  "while it stands by (or was deposed): no master at 1 means no leader.",
                  (), [((), 1.0 if leading else 0.0)])]


def store_families(store: ObjectStore, results: dict[tuple[str, int], int] | None = None,
                   ) -> list[Metric]:
    """The KV store: objects, space per segment and in all, holds, evictions, clients, and
    (`results`, from the Master servicer) every RPC's outcomes by ErrorCode."""
    stats = store.stats()
    mounted = store.list_segments()
    holds = store.holds()
    families = [gauge(name, doc, (), [((), stats[key])]) for key, name, doc in _STORE_GAUGES]
    families.append(gauge("hixl_store_segments",
                          "Mounted segments: live, or restored and awaiting their remount.",
                          ("state",), [(("live",), stats["segments"]),
                                       (("awaiting_remount",),
                                        stats["segments_awaiting_remount"])]))
    rows = [((m.segment.engine, str(m.segment.segment_id), m.client_id), m)
            for m in mounted]
    segment_labels = ("engine", "segment", "client")
    families.append(gauge("hixl_store_segment_capacity_bytes", "Each mounted segment's size.",
                          segment_labels, [(labels, m.segment.length) for labels, m in rows]))
    families.append(gauge("hixl_store_segment_used_bytes",
                          "Bytes allocated in each mounted segment.", segment_labels,
                          [(labels, m.used) for labels, m in rows]))
    families.append(gauge("hixl_store_objects_held",
                          "Objects held from eviction now: leased (read lease), hard_pinned, "
                          "soft_pinned.", ("hold",),
                          [((name,), n) for name, n in holds.items()]))
    families += [counter(name, doc, (), [((), stats[key])])
                 for key, name, doc in _STORE_COUNTERS]
    if results is not None:
        families.append(counter(
            "hixl_store_results",
            "Outcomes of store RPCs by ErrorCode name: per key for batch calls, per call "
            "for mount, unmount and removal by regex or all.", ("method", "code"),
            [((method, _CODES.get(code, str(code))), n)
             for (method, code), n in sorted(dict(results).items())]))
    return families


__all__ = ["agent_families", "master_families", "registry_families", "store_call_families",
           "store_families"]
