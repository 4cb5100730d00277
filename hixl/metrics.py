"""Prometheus metrics: plain counters where the work happens, read when scraped.

Why not prometheus_client's `Counter.inc()` / `Histogram.observe()` on the data paths: a
4 KiB fabric op costs ~3 µs and each of those calls takes a lock and walks the bucket
list. So hot paths bump plain integers in objects they already hold (a `Traffic` per data
path and direction, one histogram bucket per transfer call or reply batch, not per op),
and collectors (`prometheus_client.registry.Collector`) build the metric families from
them at scrape time. Each process, and each agent when several run in one process, gets
its own `CollectorRegistry` (never the global default); `serve` exposes one over HTTP with
prometheus_client's own server.

Increments take no lock: under CPython's GIL an augmented assignment to an int attribute
is not interrupted by another thread, so counters shared by a few threads stay exact in
practice (a free-threaded interpreter would need per-thread counters).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from hixl.errors import ConfigError, HixlError

log = logging.getLogger("hixl.metrics")

#: histogram bucket k counts durations under 2**k µs: 1 µs, 2 µs, ... 2**26 µs (67 s), +Inf
LATENCY_BOUNDS_S: tuple[float, ...] = tuple(2.0 ** k / 1e6 for k in range(27))
_SLOTS = 64  # int(µs).bit_length() < 64 for any duration under 292,000 years: no clamp
#: the directions of traffic, indexed like TransferOp (READ = 0, WRITE = 1)
DIRECTIONS: tuple[str, str] = ("read", "write")
STOP_TIMEOUT_S = 5.0


class Latency:
    """Durations in power-of-two microsecond buckets (`LATENCY_BOUNDS_S`) and their sum.

    `observe` is three integer/float operations and one list store; the bucket index is
    the bit length of the whole microseconds, so no search and no lock.
    """

    __slots__ = ("buckets", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * _SLOTS
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[int(seconds * 1e6).bit_length()] += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, cumulative count) pairs for HistogramMetricFamily, ending with +Inf."""
        counts = list(self.buckets)  # one copy, so le rows and +Inf agree
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(LATENCY_BOUNDS_S, counts, strict=False):
            running += count
            out.append((repr(bound), float(running)))
        out.append(("+Inf", float(sum(counts))))
        return out


class Traffic:
    """What moved over one data path in one direction: ops, bytes, call latency, errors.

    `add` is called once per transfer call (a batch), never per op.
    """

    __slots__ = ("ops", "bytes", "latency", "errors")

    def __init__(self) -> None:
        self.ops = 0
        self.bytes = 0
        self.latency = Latency()
        self.errors: dict[str, int] = {}  # HIXL status name -> failed calls

    def add(self, ops: int, nbytes: int, seconds: float) -> None:
        self.ops += ops
        self.bytes += nbytes
        latency = self.latency
        latency.buckets[int(seconds * 1e6).bit_length()] += 1
        latency.sum += seconds

    def failed(self, error: BaseException) -> None:
        """Count a failed call by its HIXL status name (rare path)."""
        code = error.status_name if isinstance(error, HixlError) else type(error).__name__
        self.errors[code] = self.errors.get(code, 0) + 1


class TrafficTable:
    """A `Traffic` for each (path, direction); `pair(path)` is indexed by TransferOp."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = tuple(paths)
        self._pairs = {path: (Traffic(), Traffic()) for path in self.paths}

    def pair(self, path: str) -> tuple[Traffic, Traffic]:
        """(read, write) of `path`; an unknown path is a KeyError (a programming error)."""
        return self._pairs[path]

    def rows(self) -> list[tuple[str, str, Traffic]]:
        return [(path, direction, traffic) for path, pair in self._pairs.items()
                for direction, traffic in zip(DIRECTIONS, pair, strict=True)]


# ---------------------------------------------------------------- metric families

Labels = Sequence[str]


def counter(name: str, doc: str, labels: Labels, rows: Iterable[tuple[Labels, float]]
            ) -> CounterMetricFamily:
    """A counter family (`name` without `_total`: the exposition adds it)."""
    family = CounterMetricFamily(name, doc, labels=list(labels))
    for values, value in rows:
        family.add_metric(list(values), value)
    return family


def gauge(name: str, doc: str, labels: Labels, rows: Iterable[tuple[Labels, float]]
          ) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    for values, value in rows:
        family.add_metric(list(values), value)
    return family


def histogram(name: str, doc: str, labels: Labels, rows: Iterable[tuple[Labels, Latency]]
              ) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=list(labels), unit="")
    for values, latency in rows:
        family.add_metric(list(values), latency.cumulative(), latency.sum)
    return family


def traffic_families(prefix: str, what: str, label: str, rows: Iterable[tuple[str, str, Traffic]],
                     timed: str, errors: str) -> list[Metric]:
    """`<prefix>_bytes_total`, `_ops_total`, `_seconds` (histogram) and `_errors_total`
    for rows of (path, direction, Traffic); `what` says whose traffic it is, `timed` what
    one latency observation is, `errors` what an error count is."""
    rows = list(rows)
    keys = (label, "direction")
    return [
        counter(f"{prefix}_bytes", f"Bytes {what}, by {label} and direction.", keys,
                (((p, d), t.bytes) for p, d, t in rows)),
        counter(f"{prefix}_ops", f"Ops {what}, by {label} and direction.", keys,
                (((p, d), t.ops) for p, d, t in rows)),
        histogram(f"{prefix}_seconds", f"Latency of {timed}, by {label} and direction.", keys,
                  (((p, d), t.latency) for p, d, t in rows)),
        counter(f"{prefix}_errors", f"{errors}, by {label}, direction and code.",
                (*keys, "code"), (((p, d, code), n) for p, d, t in rows
                                  for code, n in sorted(t.errors.items()))),
    ]


class FunctionCollector(Collector):
    """A collector whose `collect()` calls a function that builds the families from live
    state; a failure is logged and yields nothing, so one broken part never fails a scrape."""

    def __init__(self, build: Callable[[], Iterable[Metric]], what: str) -> None:
        self._build = build
        self._what = what

    def collect(self) -> Iterable[Metric]:
        try:
            families = list(self._build())
        except Exception:  # noqa: BLE001 - a scrape must not take the process down
            log.exception("collecting %s metrics failed", self._what)
            return []
        return families


# ---------------------------------------------------------------- the HTTP endpoint

class MetricsServer:
    """prometheus_client's HTTP server for one registry, on a daemon thread; `close()`
    stops it (idempotent)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, key: str) -> None:
        """Bind `host:port` (0: a free port); a port in use or a bad address raises
        ConfigError naming `key`, the setting that chose it."""
        if not 0 <= port <= 65535:
            raise ConfigError(f"{key}: must be a TCP port in [0, 65535], got {port}")
        self.registry = registry
        try:
            self._httpd, self._thread = start_http_server(port, host, registry=registry)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ConfigError(f"{key}: cannot serve metrics on {host}:{port}: {reason}") from None
        self.host = host
        self.port: int = self._httpd.server_port
        self._lock = threading.Lock()
        self._closed = False
        log.info("metrics on http://%s/metrics", self.address)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._httpd.shutdown()
        with contextlib.suppress(OSError):
            self._httpd.server_close()
        self._thread.join(STOP_TIMEOUT_S)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DIRECTIONS", "LATENCY_BOUNDS_S", "CollectorRegistry", "FunctionCollector",
           "Latency", "MetricsServer", "Traffic", "TrafficTable", "counter", "gauge",
           "histogram", "traffic_families"]
