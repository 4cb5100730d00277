"""Operator queries behind `hixl status`, `hixl segments` and `hixl keys`.

The query functions return plain, JSON-ready data (dicts, lists, numbers, strings) and
the `format_*` functions turn it into aligned text; the CLI only chooses between the
two. Every RPC has a deadline (`timeout`), so a dead or black-holed endpoint is reported,
never waited on. A failure names the endpoint and why, in one line: `EndpointError`
(unreachable within the timeout, authentication refused, wrong kind of server).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from hixl.client.agent_client import AgentClient
from hixl.client.store_client import MasterClient
from hixl.control import DEFAULT_GRPC_PORT, error_from_rpc, open_channel
from hixl.errors import (
    AuthenticationFailed,
    HixlError,
    ParamInvalid,
    PeerUnavailable,
    TransferTimeout,
    Unsupported,
)
from hixl.failover import leader_hint, parse_addresses
from hixl.registry_client import EngineInfo, RegistryClient
from hixl.sizes import format_size
from hixl.store_codes import ErrorCode
from hixl.store_types import KeyInfo, MasterRpcError
from hixl.tls import TlsSetting
from hixl.tools.bench import format_table
from hixl.types import Perm, SegmentInfo
from hixl.v1 import agent_pb2, agent_pb2_grpc

DEFAULT_AGENT = f"127.0.0.1:{DEFAULT_GRPC_PORT}"
DEFAULT_TIMEOUT_S = 3.0
DEFAULT_KEY_LIMIT = 1000
#: the engine `master_roles` asks a master's registry for: any answer at all will do
ROLE_PROBE_ENGINE = "hixl-status:role-probe"


class EndpointError(HixlError):
    """An endpoint could not be asked: its one-line message names it and says why."""


def explain(exc: BaseException, role: str, target: str, timeout: float) -> str:
    """One line: which endpoint (`role` `target`) failed and why, with gRPC's detail."""
    if isinstance(exc, AuthenticationFailed):
        reason = "authentication refused (wrong or missing cluster token)"
    elif isinstance(exc, TransferTimeout) or "deadline" in str(exc).lower():
        reason = f"no answer within {timeout:g} s"
    elif isinstance(exc, PeerUnavailable) and "TLS" in str(exc):
        reason = "connection failed (TLS)"  # the detail says which side lacks what
    elif isinstance(exc, PeerUnavailable):
        reason = "unreachable (nothing serving there?)"
    elif isinstance(exc, Unsupported) or "UNIMPLEMENTED" in str(exc):
        reason = "does not serve this service (wrong port, or not that kind of server?)"
    else:
        reason = type(exc).__name__
    detail = " ".join(str(exc.args[0] if exc.args else exc).split())
    # the client's message starts with "<call> at agent <target>: "; the line names it already
    detail = detail.split(f"{target}: ", 1)[-1]
    # "unreachable (<why>)" after the reason "unreachable (...)": say the word once
    word = reason.split(" ", 1)[0]
    if detail.startswith(f"{word} (") and detail.endswith(")"):
        detail = detail[len(word) + 2:-1]
    return f"{role} {target}: {reason}: {detail}"


def _failure(exc: HixlError, role: str, target: str, timeout: float) -> EndpointError:
    return EndpointError(explain(exc, role, target, timeout))


def perms_text(perms: int) -> str:
    """Perm bits as 'rw', 'r-', '-w'."""
    return ("r" if perms & Perm.READ else "-") + ("w" if perms & Perm.WRITE else "-")


def _segment_row(seg: SegmentInfo, data: str) -> dict[str, Any]:
    return {"engine": seg.engine, "node_id": seg.node_id, "segment_id": seg.segment_id,
            "name": seg.name, "base": seg.base, "length": seg.length,
            "perms": perms_text(seg.perms), "epoch": seg.epoch, "shareable": seg.shareable,
            "allowed_engines": list(seg.allowed_engines), "data": data}


# ---------------------------------------------------------------- status


def agent_status(target: str, *, token: bytes | None, timeout: float,
                 tls: TlsSetting = None) -> dict[str, Any]:
    """Health and counters of one agent: {"endpoint", "ok", "problems", "health", "counters"}.

    `ok` is False (with `problems`) when it cannot be asked, or cannot publish its table.
    """
    report: dict[str, Any] = {"endpoint": target, "ok": False, "problems": []}
    try:
        with AgentClient(target, timeout=timeout, cluster_token=token, tls=tls) as client:
            report["health"] = client.health()
            report["counters"] = client.stats()
    except HixlError as exc:
        report["problems"].append(explain(exc, "agent", target, timeout))
        return report
    health = report["health"]
    registry = health["registry"]
    if health["status"] != "SERVING":
        report["problems"].append(f"agent {target}: status {health['status']}")
    if registry["mode"] == "master" and not registry["published"]:
        report["problems"].append(
            f"agent {target}: not published to master {registry['target']}: "
            f"{registry['last_error'] or '?'} ({registry['failures']} failed attempts; peers "
            "that look it up in the registry cannot find it)")
    report["ok"] = not report["problems"]
    return report


def master_roles(target: str, *, token: bytes | None, timeout: float,
                 tls: TlsSetting = None) -> list[dict[str, str]]:
    """Each master address in `target` ("h1:p1,h2:p2") asked on its own, with no
    fail-over: {"address", "role", "leader", "detail"}, role "serving" (it answers: the
    leader, or a master without etcd), "standby" (it answered "not the leader", naming
    `leader`, "" while none is known) or "down" (`detail` says why)."""
    roles: list[dict[str, str]] = []
    for address in parse_addresses(target, "master address"):
        channel, stub = open_channel(address, token=token, tls=tls)
        try:
            agent_pb2_grpc.RegistryStub(stub).QuerySegments(
                agent_pb2.QuerySegmentsRequest(engine=ROLE_PROBE_ENGINE), timeout=timeout)
            roles.append({"address": address, "role": "serving", "leader": address,
                          "detail": ""})
        except grpc.RpcError as exc:
            hint = leader_hint(exc)
            if hint is not None:
                roles.append({"address": address, "role": "standby", "leader": hint,
                              "detail": exc.details() or ""})
            else:
                error = error_from_rpc(exc, f"registry query at master {address}")
                roles.append({"address": address, "role": "down", "leader": "",
                              "detail": explain(error, "master", address, timeout)})
        finally:
            channel.close()
    return roles


def master_status(target: str, *, token: bytes | None, timeout: float,
                  tls: TlsSetting = None) -> dict[str, Any]:
    """The master's registry (engines, segments) and store (mounted segments, capacity,
    used, objects, clients), and, when several master addresses are given, the role of
    each (`master_roles`): {"endpoint", "ok", "problems", "masters", "registry", "store"}.
    One of them down, or none serving, is a problem (fail-over degraded or impossible)."""
    report: dict[str, Any] = {"endpoint": target, "ok": False, "problems": [],
                              "masters": [], "registry": None, "store": None}
    try:
        several = len(parse_addresses(target, "master address")) > 1
    except HixlError as exc:  # a bad address list: nothing can be asked
        report["problems"].append(explain(exc, "master", target, timeout))
        return report
    if several:  # (one address: the calls below say what is wrong with it)
        masters = report["masters"] = master_roles(target, token=token, timeout=timeout,
                                                   tls=tls)
        report["problems"] += [m["detail"] for m in masters if m["role"] == "down"]
        if not any(m["role"] == "serving" for m in masters):
            report["problems"].append(f"master {target}: no master serves: " + "; ".join(
                f"{m['address']} {m['role']}" for m in masters))
    try:
        engines, segments = _registry_table(target, token, timeout, tls)
    except HixlError as exc:
        report["problems"].append(explain(exc, "master", target, timeout))
        if isinstance(exc, PeerUnavailable | TransferTimeout | AuthenticationFailed):
            return report  # the store would fail the same way, after another deadline
    else:
        per_engine: dict[str, list[SegmentInfo]] = {}
        for seg in segments:
            per_engine.setdefault(seg.engine, []).append(seg)
        report["registry"] = {
            "engines": [{"engine": e.engine, "node_id": e.node_id, "epoch": e.epoch,
                         "data": e.endpoints.data_tcp,
                         "segments": len(per_engine.get(e.engine, [])),
                         "bytes": sum(s.length for s in per_engine.get(e.engine, []))}
                        for e in engines],
            "segments": len(segments), "bytes": sum(s.length for s in segments)}
    try:
        with MasterClient(target, timeout=timeout, cluster_token=token, tls=tls) as master:
            stats = master.stats()
            mounted = master.list_segments()
    except MasterRpcError as exc:
        report["problems"].append(explain(exc, "master (store)", target, timeout))
    else:
        report["store"] = {
            "segments": [{"engine": m.segment.engine, "segment_id": m.segment.segment_id,
                          "name": m.segment.name, "node_id": m.segment.node_id,
                          "length": m.segment.length, "used": m.used, "live": m.live,
                          "client_id": m.client_id} for m in mounted],
            "keys": int(stats.get("keys", 0)), "capacity": int(stats.get("capacity", 0)),
            "used": int(stats.get("used", 0)), "clients": int(stats.get("clients", 0)),
            "puts_in_progress": int(stats.get("puts_in_progress", 0)),
            "awaiting_remount": int(stats.get("segments_awaiting_remount", 0)),
            "stats": stats}
    report["ok"] = not report["problems"]
    return report


def status(agent: str | None, master: str | None, *, token: bytes | None,
           timeout: float = DEFAULT_TIMEOUT_S, tls: TlsSetting = None) -> dict[str, Any]:
    """{"ok", "agent", "master"}: each endpoint asked, or None.

    With `master` None, an agent that publishes to a master leads to that master too.
    """
    agent_report = agent_status(agent, token=token, timeout=timeout, tls=tls) if agent else None
    if master is None and agent_report is not None and agent_report.get("health"):
        registry = agent_report["health"]["registry"]
        if registry["mode"] == "master" and registry["target"]:
            master = registry["target"]
    master_report = (master_status(master, token=token, timeout=timeout, tls=tls)
                     if master else None)
    reports = [r for r in (agent_report, master_report) if r is not None]
    return {"ok": all(r["ok"] for r in reports), "agent": agent_report,
            "master": master_report}


def _registry_table(target: str, token: bytes | None, timeout: float, tls: TlsSetting = None,
                    ) -> tuple[list[EngineInfo], list[SegmentInfo]]:
    with RegistryClient(target, timeout=timeout, cluster_token=token, tls=tls) as registry:
        return registry.query_engines(), registry.query()


# ---------------------------------------------------------------- segments


def segments(*, master: str | None = None, agent: str | None = None,
             node: str | None = None, token: bytes | None,
             timeout: float = DEFAULT_TIMEOUT_S, tls: TlsSetting = None) -> dict[str, Any]:
    """The global table, from `master`'s registry or `agent`'s embedded one (an agent that
    publishes to a master gives its own segments): {"source", "segments": [...]}, sorted
    by engine and base, only node `node`'s when given."""
    if master:
        source, rows = f"registry of master {master}", _registry_rows("master", master, token,
                                                                      timeout, tls)
    else:
        target = agent or DEFAULT_AGENT
        try:
            with AgentClient(target, timeout=timeout, cluster_token=token, tls=tls) as client:
                mode = client.health()["registry"]["mode"]
                if mode == "embedded":
                    rows = None
                else:
                    info = client.handshake("hixl-cli")
                    rows = [_segment_row(s, info.data_tcp) for s in info.segments]
        except HixlError as exc:
            raise _failure(exc, "agent", target, timeout) from None
        if rows is None:
            source, rows = (f"embedded registry of agent {target}",
                            _registry_rows("agent", target, token, timeout, tls))
        else:
            source = f"agent {target} (its own segments; it publishes to a master)"
    if node is not None:
        rows = [r for r in rows if r["node_id"] == node]
    rows.sort(key=lambda r: (r["engine"], r["base"]))
    return {"source": source, "node": node, "segments": rows}


def _registry_rows(role: str, target: str, token: bytes | None, timeout: float,
                   tls: TlsSetting = None) -> list[dict[str, Any]]:
    try:
        engines, table = _registry_table(target, token, timeout, tls)
    except HixlError as exc:
        raise _failure(exc, role, target, timeout) from None
    data = {e.engine: e.endpoints.data_tcp for e in engines}
    return [_segment_row(s, data.get(s.engine, "")) for s in table]


# ---------------------------------------------------------------- keys


def keys(master: str, pattern: str = "", *, limit: int = DEFAULT_KEY_LIMIT,
         token: bytes | None, timeout: float = DEFAULT_TIMEOUT_S,
         tls: TlsSetting = None) -> dict[str, Any]:
    """Store objects whose key `pattern` (a Python regex, searched anywhere) matches:
    {"pattern", "total", "truncated", "keys": [...]}. The master checks the pattern: a bad
    one is ParamInvalid, with the master's reason."""
    try:
        with MasterClient(master, timeout=timeout, cluster_token=token, tls=tls) as client:
            listing = client.list_keys(pattern, limit, timeout=timeout)
    except MasterRpcError as exc:
        raise _failure(exc, "master", master, timeout) from None
    if listing.code != ErrorCode.OK:
        try:
            code = ErrorCode(listing.code).name
        except ValueError:
            code = str(listing.code)
        raise ParamInvalid(f"master {master} refused the listing: {listing.message} ({code})")
    return {"pattern": pattern, "total": listing.total, "truncated": listing.truncated,
            "keys": [_key_row(k) for k in listing.keys]}


def segment_label(engine: str, segment_id: int, name: str = "") -> str:
    """'engine/id', with the segment's name when it says more than the engine's."""
    label = f"{engine}/{segment_id}"
    return f"{label} ({name})" if name and name != engine else label


def _key_row(info: KeyInfo) -> dict[str, Any]:
    return {"key": info.key, "size": info.size, "state": info.state.name,
            "replicas": [{"segment": segment_label(r.replica.engine, r.replica.segment_id,
                                                   r.segment_name),
                          "segment_name": r.segment_name, "engine": r.replica.engine,
                          "segment_id": r.replica.segment_id, "addr": r.replica.addr,
                          "live": r.live} for r in info.replicas],
            "lease_ms": info.lease_ms, "hard_pin": info.hard_pin,
            "soft_pin_ms": info.soft_pin_ms}


# ---------------------------------------------------------------- formatting


def _size(n: int) -> str:
    return format_size(n, approximate=True)


def _age(seconds: float) -> str:
    if seconds < 0:
        return "never"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def format_status(report: dict[str, Any]) -> str:
    """`hixl status` as text: a block per endpoint, then OK or DOWN (the reasons are in
    each endpoint's `problems`; the CLI prints them as error lines)."""
    out: list[str] = []
    agent, master = report["agent"], report["master"]
    if agent is not None:
        out += _format_agent(agent)
    if master is not None:
        out += ([""] if out else []) + _format_master(master)
    out += ["", "OK" if report["ok"] else "DOWN"]
    return "\n".join(out)


def _format_agent(agent: dict[str, Any]) -> list[str]:
    health = agent.get("health")
    if health is None:
        return [f"agent {agent['endpoint']}: DOWN"]
    registry, counters = health["registry"], agent.get("counters", {})
    if registry["mode"] == "embedded":
        reg = (f"embedded ({registry['engines']} engines, {registry['segments']} segments; "
               f"own table {'published' if registry['published'] else 'NOT published'})")
    elif registry["mode"] == "master":
        reg = (f"master {registry['target']}: "
               + (f"published, lease {registry['lease_id']}, last renewed "
                  f"{_age(registry['last_success_age_s'])} ago" if registry["published"]
                  else f"not published: {registry['last_error'] or '?'} "
                       f"({registry['failures']} failed attempts)"))
    else:
        reg = "none"
    lines = [
        f"agent {agent['endpoint']}: {health['status']}",
        f"  engine    {health['engine']}  node {health['node_id']}  epoch {health['epoch']}"
        f"  up {_age(health['uptime_s'])}",
        f"  segments  {health['segments']} ({_size(health['segment_bytes'])}); pool "
        f"{_size(counters.get('pool_bytes_charged', 0))} of "
        f"{_size(counters.get('pool_bytes_max', 0))} allocated by clients",
        f"  registry  {reg}",
        f"  data      {_size(counters.get('data_bytes_written', 0))} written, "
        f"{_size(counters.get('data_bytes_read', 0))} read, "
        f"{counters.get('data_connections', 0)} connections so far, "
        f"{counters.get('data_auth_failures', 0)} refused for the token",
    ]
    peers = health["peers"]
    lines.append(f"  peers     {len(peers)} connected" + (":" if peers else ""))
    if peers:
        table = format_table(
            ["kind", "address", "engine", "for"],
            [[p["kind"], p["address"], p["identity"] or "-", _age(p["connected_s"])]
             for p in peers])
        lines += ["    " + line for line in table.splitlines()]
    return lines


def _format_master(master: dict[str, Any]) -> list[str]:
    registry, store = master["registry"], master["store"]
    down = registry is None and store is None
    lines = [f"master {master['endpoint']}: "
             + ("DOWN" if down else "SERVING" if master["ok"] else "DEGRADED")]
    masters = master.get("masters") or []
    if masters:
        lines.append("  masters   " + ", ".join(_role_text(m) for m in masters))
    if down:
        return lines
    if registry is not None:
        lines.append(f"  registry  {len(registry['engines'])} engines, "
                     f"{registry['segments']} segments ({_size(registry['bytes'])})")
        if registry["engines"]:
            table = format_table(
                ["engine", "node", "epoch", "segments", "bytes", "data"],
                [[e["engine"], e["node_id"], str(e["epoch"]), str(e["segments"]),
                  _size(e["bytes"]), e["data"] or "-"] for e in registry["engines"]],
                left=(0, 1, 5))
            lines += ["    " + line for line in table.splitlines()]
    if store is not None:
        usage = f" ({store['used'] / store['capacity']:.0%})" if store["capacity"] else ""
        lines.append(
            f"  store     {len(store['segments'])} segments mounted"
            + (f" ({store['awaiting_remount']} awaiting remount)"
               if store["awaiting_remount"] else "")
            + f", {_size(store['used'])} used of {_size(store['capacity'])}{usage}, "
            f"{store['keys']} objects, {store['clients']} clients alive"
            + (f", {store['puts_in_progress']} puts in progress"
               if store["puts_in_progress"] else ""))
        if store["segments"]:
            table = format_table(
                ["segment", "node", "size", "used", "state", "client"],
                [[segment_label(s["engine"], s["segment_id"], s["name"]), s["node_id"],
                  _size(s["length"]), _size(s["used"]),
                  "live" if s["live"] else "awaiting remount", s["client_id"]]
                 for s in store["segments"]], left=(0, 1, 4, 5))
            lines += ["    " + line for line in table.splitlines()]
    return lines


def _role_text(master: dict[str, str]) -> str:
    if master["role"] == "serving":
        return f"{master['address']} leader"
    if master["role"] == "standby":
        return f"{master['address']} standby (leader: {master['leader'] or 'none yet'})"
    return f"{master['address']} DOWN"


def format_segments(listing: dict[str, Any]) -> str:
    """`hixl segments` as an aligned table, with where it came from."""
    rows = listing["segments"]
    header = f"{len(rows)} segments from the {listing['source']}"
    if listing.get("node") is not None:
        header += f", node {listing['node']}"
    if not rows:
        return header
    table = format_table(
        ["engine", "node", "id", "name", "base", "length", "perms", "allowed", "epoch",
         "data"],
        [[r["engine"], r["node_id"], str(r["segment_id"]), r["name"] or "-",
          f"{r['base']:#x}", _size(r["length"]), r["perms"],
          ",".join(r["allowed_engines"]) or "all", str(r["epoch"]), r["data"] or "-"]
         for r in rows],
        left=(0, 1, 3, 6, 7, 9))
    return f"{header}\n{table}"


def format_keys(listing: dict[str, Any]) -> str:
    """`hixl keys` as an aligned table; says when the limit cut the list."""
    rows = listing["keys"]
    shown = f"{len(rows)} of {listing['total']}" if listing["truncated"] else str(len(rows))
    header = f"{shown} keys" + (f" matching {listing['pattern']!r}" if listing["pattern"]
                                else "")
    lines = [header]
    if rows:
        lines.append(format_table(
            ["key", "size", "state", "replicas", "lease", "pin"],
            [[r["key"], _size(r["size"]), r["state"],
              ", ".join(p["segment"] + ("" if p["live"] else " (awaiting remount)")
                        for p in r["replicas"]) or "-",
              f"{r['lease_ms'] / 1000:.1f}s" if r["lease_ms"] else "-",
              _pin(r)] for r in rows],
            left=(0, 2, 3, 5)))
    if listing["truncated"]:
        lines.append(f"(truncated: {listing['total'] - len(rows)} more match; raise --limit "
                     "or narrow the pattern)")
    return "\n".join(lines)


def _pin(row: dict[str, Any]) -> str:
    pins: Sequence[str] = (["hard"] if row["hard_pin"] else []) + (
        [f"soft {row['soft_pin_ms'] / 1000:.0f}s"] if row["soft_pin_ms"] else [])
    return ", ".join(pins) or "-"


__all__ = ["DEFAULT_AGENT", "DEFAULT_KEY_LIMIT", "DEFAULT_TIMEOUT_S", "EndpointError",
           "agent_status", "explain", "format_keys", "format_segments",
           "format_status", "keys", "master_status", "perms_text", "segment_label", "segments",
           "status"]
