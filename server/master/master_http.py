"""hixl-master's HTTP side, as mooncake_master serves it (issue 17, item 4).

Two servers, each off unless asked, each bound like the rest of the master (`--host`):

- the admin server (`--metrics_port`): Prometheus `/metrics` and mooncake_master's admin
  pages, answered in Mooncake's formats (recorded from mooncake_master itself):
  `/health`, `/metrics/summary`, `/get_all_segments`, `/query_segment?segment=`,
  `/query_key?key=`, `/batch_query_keys?keys=a,b`, `/get_all_keys`. SGLang's HiCache polls
  `/get_all_segments` to decide the store is up.
- the HTTP metadata server (`--enable_http_metadata_server`): Mooncake's
  `GET|PUT|DELETE /metadata?key=K` key-value protocol, which TransferEngines given
  `http://host:port/metadata` as their metadata server publish their segments on.

Both are the standard library's ThreadingHTTPServer on a daemon thread: the pages are
small and rare, and the store they read is thread-safe. Neither authenticates (nor do
Mooncake's); the metadata server bounds what clients can make it hold.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily

from hixl.errors import ConfigError
from hixl.metrics import CollectorRegistry, FunctionCollector
from hixl.server.master.store import ObjectStore
from hixl.store_codes import ErrorCode, code_name

log = logging.getLogger("hixl.master.http")

#: mooncake_master's content types: its text pages claim Prometheus' text format
TEXT = "text/plain; version=0.0.4"
JSON = "application/json; charset=utf-8"
#: what a metadata value and all of them together may take (Mooncake's TE metadata is a
#: JSON segment description, MC_HANDSHAKE_MAX_LENGTH 1 MB by default)
MAX_METADATA_VALUE_BYTES = 16 << 20
MAX_METADATA_TOTAL_BYTES = 256 << 20
#: an idle or stalled HTTP connection is closed after this many seconds
SOCKET_TIMEOUT_S = 30.0
#: connections one server serves at once (a thread each); more are closed on accept
MAX_CONNECTIONS = 64
STOP_TIMEOUT_S = 5.0
#: the protocol a replica is reported under in /query_key (hixl's clients are set up as
#: Mooncake's "tcp"; the bytes take hixl's own paths)
REPORTED_PROTOCOL = "tcp"


@dataclass(frozen=True)
class Request:
    """What a route sees: the method, the query's first value per name, the body."""

    method: str
    query: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = TEXT


Route = Callable[[Request], Reply]
NOT_FOUND = Reply(404, b"404 Not Found", "")


def _text(status: int, text: str, content_type: str = TEXT) -> Reply:
    return Reply(status, text.encode(), content_type)


def _json(status: int, value: Any) -> Reply:
    return Reply(status, json.dumps(value, separators=(",", ":")).encode(), JSON)


class HttpServer:
    """`routes` ({(method, path): route}) served on host:port from a daemon thread;
    close() stops it (idempotent). A port in use or a bad address is a ConfigError naming
    `key`, the setting that chose it."""

    def __init__(self, routes: dict[tuple[str, str], Route], host: str, port: int,
                 key: str, max_connections: int = MAX_CONNECTIONS) -> None:
        handler = type("Handler", (_Handler,), {"routes": routes})
        bare = host.strip("[]")
        server = type("Server", (_BoundedServer,), {
            "address_family": socket.AF_INET6 if ":" in bare else socket.AF_INET,
            "slots": threading.BoundedSemaphore(max_connections)})
        try:
            self._httpd = server((bare, port), handler)
        except OSError as exc:
            raise ConfigError(f"{key}: cannot serve HTTP on {host}:{port}: "
                              f"{exc.strerror or exc}") from None
        self._httpd.daemon_threads = True
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name=f"hixl-http-{self.port}")
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        with contextlib.suppress(OSError):
            self._httpd.server_close()
        self._thread.join(STOP_TIMEOUT_S)


class _BoundedServer(ThreadingHTTPServer):
    """At most `slots` connections served at once: one more is closed at accept,
    so idle or slow clients cannot make the master start threads without bound."""

    slots: threading.BoundedSemaphore

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            log.warning("HTTP: the most connections it serves at once are open; closing "
                        "one from %s", client_address[0])
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Handler(BaseHTTPRequestHandler):
    routes: dict[tuple[str, str], Route] = {}
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S
    server_version = "hixl-master"

    def _serve(self) -> None:
        url = urlsplit(self.path)
        route = self.routes.get((self.command, url.path))
        body = self._body()  # read even when refused: the connection stays in step
        reply = NOT_FOUND
        if isinstance(body, Reply):
            reply = body
        elif route is not None:
            query = {name: values[0] for name, values in
                     parse_qs(url.query, keep_blank_values=True).items()}
            try:
                reply = route(Request(self.command, query, body))
            except Exception:  # a page must answer, not drop the connection
                log.exception("HTTP %s %s failed", self.command, url.path)
                reply = _text(500, "internal error (see the master's log)")
        self.send_response(reply.status)
        if reply.content_type:
            self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply.body)

    def _body(self) -> bytes | Reply:
        """The request body by its Content-Length (none: empty), or the refusal."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            return _text(411, "send the body with a Content-Length")
        raw = self.headers.get("Content-Length", "0") or "0"
        if not raw.isdigit():
            self.close_connection = True
            return _text(400, f"bad Content-Length {raw!r}")
        length = int(raw)
        if length > MAX_METADATA_VALUE_BYTES:
            self.close_connection = True
            return _text(413, f"body of {length} bytes: at most {MAX_METADATA_VALUE_BYTES}")
        return self.rfile.read(length) if length else b""

    do_GET = do_PUT = do_DELETE = do_POST = do_HEAD = _serve

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("%s %s", self.address_string(), format % args)


# ------------------------------------------------------------------ the admin server


def admin_routes(store: Callable[[], ObjectStore], metrics: CollectorRegistry,
                 health: Callable[[], tuple[bool, dict[str, Any]]]) -> dict[tuple[str, str],
                                                                              Route]:
    """mooncake_master's admin pages over `store()` (the store served now), Prometheus
    text of `metrics`, and `health()` -> (ready, mooncake_master's /health fields)."""

    def prometheus(_: Request) -> Reply:
        return Reply(200, generate_latest(metrics), CONTENT_TYPE_LATEST)

    def healthy(_: Request) -> Reply:
        ready, fields = health()
        return _json(200 if ready else 503, fields)

    def summary(_: Request) -> Reply:
        stats = store().stats()
        return _text(200, f"{fields_line(stats)}\n")

    def all_segments(_: Request) -> Reply:
        names = [m.segment.name or m.segment.engine for m in store().list_segments() if m.live]
        return _text(200, _lines(dict.fromkeys(names)))

    def query_segment(request: Request) -> Reply:
        wanted = request.query.get("segment", "")
        mounted = [m for m in store().list_segments()
                   if m.live and wanted in (m.segment.name, m.segment.engine)]
        if not wanted or not mounted:
            return _text(500, "Failed to query segment")  # mooncake_master's answer
        used = sum(m.used for m in mounted)
        capacity = sum(m.segment.length for m in mounted)
        return _text(200, f"{wanted}\nUsed(bytes): {used}\nCapacity(bytes) : {capacity}\n")

    def query_key(request: Request) -> Reply:
        [result] = store().get_replicas([request.query.get("key", "")])
        if result.code != ErrorCode.OK:
            return _json(404, {"success": False, "error_code": int(result.code),
                               "error_message": code_name(result.code)})
        return _json(200, {"success": True, "data": _descriptors(result.replicas)})

    def batch_query_keys(request: Request) -> Reply:
        keys = [k for k in request.query.get("keys", "").split(",") if k]
        if not keys:
            return _json(400, {"success": False,
                               "error": "No keys provided. Use ?keys=key1,key2,..."})
        data = {}
        for key, result in zip(keys, store().get_replicas(keys), strict=True):
            ok = result.code == ErrorCode.OK
            data[key] = {"ok": ok, "error": None if ok else code_name(result.code),
                         "values": _descriptors(result.replicas) if ok else None,
                         "disk_values": None, "local_disk_values": None, "nof_values": None}
        return _json(200, {"success": True, "data": data})

    def all_keys(_: Request) -> Reply:
        from hixl.store_types import KeyState

        listing = store().list_keys()
        keys = [info.key for info in listing.keys if info.state != KeyState.PUTTING]
        return _text(200, _lines(keys))

    pages: dict[str, Route] = {
        "/metrics": prometheus, "/health": healthy, "/metrics/summary": summary,
        "/get_all_segments": all_segments, "/query_segment": query_segment,
        "/query_key": query_key, "/batch_query_keys": batch_query_keys,
        "/get_all_keys": all_keys}
    return {(method, path): page for path, page in pages.items()
            for method in ("GET", "HEAD")}


def _lines(items: Iterable[str]) -> str:
    return "".join(f"{item}\n" for item in items)


def _descriptors(replicas: Iterable[Any]) -> list[dict[str, Any]]:
    """Replicas as Mooncake's buffer descriptors (size_, buffer_address_, protocol_,
    transport_endpoint_: the engine serving the bytes)."""
    return [{"size_": r.length, "buffer_address_": r.addr, "protocol_": REPORTED_PROTOCOL,
             "transport_endpoint_": r.engine} for r in replicas]


def fields_line(stats: dict[str, float]) -> str:
    """The store in one line, as --enable_metric_reporting logs it and /metrics/summary
    shows it (mooncake_master's summary carries the same first fields)."""
    return (f"Mem Storage: {_size(stats.get('used', 0))} / {_size(stats.get('capacity', 0))}"
            f" | Keys: {int(stats.get('keys', 0))} | Clients: {int(stats.get('clients', 0))}"
            f" | Segments: {int(stats.get('segments', 0))} | Puts in progress: "
            f"{int(stats.get('puts_in_progress', 0))}")


def _size(value: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1024 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TB"


def mooncake_metric_families(store: ObjectStore) -> list[Any]:
    """mooncake_master's own gauges (its names), so dashboards built on them keep working
    next to hixl's `hixl_store_*` families."""
    stats = store.stats()
    mounted = [m for m in store.list_segments() if m.live]
    families: list[Any] = []
    for name, doc, value in (
            ("master_allocated_bytes",
             "Total memory bytes currently allocated across all segments", stats.get("used", 0)),
            ("master_total_capacity_bytes", "Total memory capacity across all mounted segments",
             stats.get("capacity", 0)),
            ("master_key_count", "Total number of keys managed by the master",
             stats.get("keys", 0)),
            ("master_active_clients", "Number of clients the master considers alive",
             stats.get("clients", 0))):
        families.append(GaugeMetricFamily(name, doc, value=value))
    for name, doc, attr in (
            ("segment_allocated_bytes", "Total memory bytes currently allocated of the segment",
             "used"),
            ("segment_total_capacity_bytes", "Total memory capacity of the mounted segment",
             "length")):
        family = GaugeMetricFamily(name, doc, labels=["segment"])
        for m in mounted:
            value = m.used if attr == "used" else m.segment.length
            family.add_metric([m.segment.name or m.segment.engine], value)
        families.append(family)
    return families


def add_mooncake_metrics(metrics: CollectorRegistry, store: Callable[[], ObjectStore]) -> None:
    metrics.register(FunctionCollector(lambda: mooncake_metric_families(store()),
                                       "mooncake_master"))


# ------------------------------------------------------------------ the metadata server


class MetadataStore:
    """Mooncake's HTTP metadata protocol: a key-value map in memory (as mooncake_master's
    embedded one: a restart empties it, and TransferEngines publish again).

    Like Mooncake's, an `rpc_meta` key is not overwritten (400 "Duplicate rpc_meta key not
    allowed": a second engine under a taken name must fail, not hijack it). Values over
    MAX_METADATA_VALUE_BYTES, and puts that would take all values over
    MAX_METADATA_TOTAL_BYTES, are refused (413), naming the bound."""

    def __init__(self, max_total_bytes: int = MAX_METADATA_TOTAL_BYTES) -> None:
        self._values: dict[str, bytes] = {}
        self._total = 0
        self._max_total = max_total_bytes
        self._lock = threading.Lock()

    def routes(self) -> dict[tuple[str, str], Route]:
        return {(method, "/metadata"): self.serve for method in ("GET", "PUT", "DELETE")}

    def serve(self, request: Request) -> Reply:
        key = request.query.get("key", "").strip()
        if not key:
            return _text(400, "Missing key parameter", "")
        with self._lock:
            if request.method == "GET":
                value = self._values.get(key)
                if value is None:
                    return _text(404, "metadata not found", "")
                return Reply(200, value, "application/json")
            if request.method == "DELETE":
                old = self._values.pop(key, None)
                if old is None:
                    return _text(404, "metadata not found", "")
                self._total -= len(key) + len(old)
                return _text(200, "metadata deleted", "")
            old = self._values.get(key)
            if old is not None and "rpc_meta" in key:
                return _text(400, "Duplicate rpc_meta key not allowed", "")
            grown = self._total + len(request.body) + len(key) - (
                len(key) + len(old) if old is not None else 0)
            if grown > self._max_total:
                return _text(413, f"metadata server full: its values may take at most "
                                  f"{self._max_total} bytes in all", "")
            self._values[key] = request.body
            self._total = grown
            return _text(200, "metadata updated", "")


__all__ = ["HttpServer", "MetadataStore", "Reply", "Request", "add_mooncake_metrics",
           "admin_routes", "fields_line", "mooncake_metric_families"]
