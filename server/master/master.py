"""hixl-master: the process that serves the global address-table registry and the KV
store's `Master` service (the object index, server/master/store.py).

It accepts mooncake_master's flag spellings (`-rpc_port=50051` as well as
`--rpc_port 50051`) so existing launch scripts work unchanged; the store flags
(`--default_kv_lease_ttl`, `--eviction_high_watermark_ratio`, `--eviction_ratio`,
`--client_ttl`, `--allocation_strategy`, ...) configure the store. Unlike
mooncake_master, committed store metadata survives a restart: it is kept in a data dir
(`--data-dir`), or on etcd (`--etcd-endpoints`, under `--etcd-prefix`); `--no-persist`
keeps it in memory only.

Every flag is also a key of a YAML file (`--config master.yaml`, keys named like the
flags' dests: `port`, `client_ttl_s`, `data_dir`, ...) and an environment variable
`HIXL_MASTER_<KEY>`; precedence, as for the agent: defaults < YAML < environment < flags
(server/config.py's layering). The key schema is derived from the flags
(`MasterConfig.keys()`), so the two cannot drift; `--describe-config` prints it.

With etcd, several masters may serve one cluster (one prefix): they campaign in an etcd
election (server/master/leadership.py); the leader loads the registry (server/master/etcd_registry.py:
its leases are etcd leases, so they outlive any one master) and the store from etcd and
serves, the others are standbys answering "not the leader" with the leader's address. A
leader that loses the leadership exits with status `EXIT_DEPOSED` (3): its supervisor
restarts it, and it comes back as a standby.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import uvloop

from hixl import __version__
from hixl.auth import ENV_TOKEN, ENV_TOKEN_FILE, load_token
from hixl.control import add_port, server_interceptors
from hixl.errors import ConfigError, HixlError
from hixl.etcd import DEFAULT_PREFIX as DEFAULT_ETCD_PREFIX
from hixl.etcd import DEFAULT_TIMEOUT_S as DEFAULT_ETCD_TIMEOUT_S
from hixl.etcd import UNAVAILABLE_ERRORS, Compare, Election, EtcdClient, EtcdConfig
from hixl.failover import parse_address
from hixl.logs import setup_logging
from hixl.metrics import CollectorRegistry, FunctionCollector
from hixl.server.config import (
    bind_failure,
    describe_keys,
    keys_from_parser,
    layer_values,
    probe_bind,
)
from hixl.server.master.leadership import Candidate, LeaderGate, Leadership
from hixl.server.master.master_http import (
    HttpServer,
    MetadataStore,
    add_mooncake_metrics,
    admin_routes,
    fields_line,
)
from hixl.server.master.metadata import LocalJournalBackend, MetadataBackend
from hixl.server.master.store import ALLOCATION_STRATEGIES, ObjectStore, StoreOptions
from hixl.server.master.store_rpc_server import (
    BODY_TIMEOUT_S,
    CALL_BYTES_BUDGET,
    CALL_SPIN_US,
    StoreCallServer,
)
from hixl.server.master.store_service import StoreCalls, add_store_service, upkeep_forever
from hixl.server.mooncake_flags import BoolFlag, FlagError, duration_ms, translate
from hixl.server.registry import (
    DEFAULT_MAX_TTL_MS,
    SERVER_KEEPALIVE_OPTIONS,
    Registry,
    add_registry_service,
    start_expiry,
)
from hixl.sizes import parse_size
from hixl.tls import ENV_CA_FILE, ENV_CERT_FILE, ENV_KEY_FILE, ServerTLS

log = logging.getLogger("hixl.master")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051          # mooncake_master's default rpc_port
ENV_PREFIX = "HIXL_MASTER_"
#: parser dests that are not settings
COMMAND_ONLY_DESTS = ("help", "version", "config", "describe_config")
STOP_GRACE_S = 1.0
#: keys given in bytes or with a unit ("256MiB"), like the agent's sizes
SIZE_KEYS = ("call_bytes_budget",)
#: the smallest call_bytes_budget: a large call body grows 1 MiB at a time
MIN_CALL_BYTES_BUDGET = 1 << 20
#: the exit status of a leader that lost the leadership (its supervisor restarts it)
EXIT_DEPOSED = 3
#: the election lease's default TTL in s: a dead leader is replaced within about this
DEFAULT_ETCD_LEASE_TTL_S = 5
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: mooncake_master's --http_metadata_server_port default
DEFAULT_HTTP_METADATA_PORT = 8080
#: seconds between two --enable-metric-reporting summaries (mooncake_master's period)
METRIC_REPORT_INTERVAL_S = 10


@dataclass(frozen=True)
class StoreConfig:
    """The KV store's settings (units as mooncake: ms for kv lease, s for clients).

    data_dir "" means the default (`default_data_dir`); persist False keeps the store in
    memory only; etcd_endpoints puts the metadata on etcd instead (`etcd_settings`).
    """

    default_kv_lease_ttl_ms: int = 5_000
    eviction_high_watermark_ratio: float = 0.95
    eviction_ratio: float = 0.05
    client_ttl_s: int = 10
    allocation_strategy: str = "random"
    default_kv_soft_pin_ttl_ms: int = 30 * 60 * 1000
    put_start_discard_timeout_s: int = 30
    put_start_release_timeout_s: int = 600
    remount_grace_s: int = 60
    eviction_grace_ms: int = 1_000
    data_dir: str = ""
    persist: bool = True
    etcd_endpoints: str = ""
    etcd_prefix: str = DEFAULT_ETCD_PREFIX
    etcd_ca_file: str = ""
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    etcd_user: str = ""
    etcd_password_file: str = ""
    etcd_timeout: float = DEFAULT_ETCD_TIMEOUT_S
    etcd_lease_ttl: int = DEFAULT_ETCD_LEASE_TTL_S
    enable_ha: bool = False
    cluster_id: str = ""

    def options(self) -> StoreOptions:
        return StoreOptions(
            default_kv_lease_ttl_ms=self.default_kv_lease_ttl_ms,
            default_kv_soft_pin_ttl_ms=self.default_kv_soft_pin_ttl_ms,
            eviction_high_watermark_ratio=self.eviction_high_watermark_ratio,
            eviction_ratio=self.eviction_ratio, client_ttl_s=self.client_ttl_s,
            allocation_strategy=self.allocation_strategy,
            put_start_discard_timeout_s=self.put_start_discard_timeout_s,
            put_start_release_timeout_s=self.put_start_release_timeout_s,
            remount_grace_s=self.remount_grace_s, eviction_grace_ms=self.eviction_grace_ms)


def default_data_dir(port: int, environ: dict[str, str] | None = None) -> str | None:
    """Where a master on `port` keeps its store: $XDG_STATE_HOME (or ~/.local/state)
    /hixl/master-<port>, one directory per port, so a restart on the same port finds it.

    None for port 0: a master on a random port cannot be found again after a restart,
    so there is nothing to come back to (give --data-dir to persist anyway).
    """
    if port == 0:
        return None
    env = os.environ if environ is None else environ
    state = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                      "state")
    return os.path.join(state, "hixl", f"master-{port}")


@dataclass(frozen=True)
class MasterConfig:
    """hixl-master's settings. The store's settings are grouped in `store`; as config keys
    all are flat, named like the flags' dests (`port`, `client_ttl_s`, `data_dir`)."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_lease_ttl_ms: int = DEFAULT_MAX_TTL_MS
    log_level: str = "INFO"
    log_json: bool = False
    store: StoreConfig = field(default_factory=StoreConfig)
    cluster_token_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    tls_client_auth: bool = False
    metrics_port: int = 0
    fast_port: int = 0
    call_bytes_budget: int = CALL_BYTES_BUDGET
    call_body_timeout_s: float = BODY_TIMEOUT_S
    call_spin_us: int = CALL_SPIN_US
    advertise_address: str = ""
    enable_metric_reporting: bool = False
    metrics_host: str = ""
    rpc_interface: str = ""
    enable_http_metadata_server: bool = False
    http_metadata_server_port: int = DEFAULT_HTTP_METADATA_PORT
    http_metadata_server_host: str = ""

    @classmethod
    def keys(cls) -> dict[str, dict[str, Any]]:
        """The config schema, derived from hixl-master's flags: every flag's dest is a key."""
        return keys_from_parser(build_parser(), _field_types(), COMMAND_ONLY_DESTS)

    @classmethod
    def describe(cls) -> dict[str, dict[str, str]]:
        """Every key with its type, default, meaning and environment variable."""
        return describe_keys(cls.keys(), cls().values(), ENV_PREFIX)

    @classmethod
    def load(cls, path: str | None = None, overrides: Mapping[str, Any] | None = None,
             env: Mapping[str, str] | None = None) -> MasterConfig:
        """Defaults, then the YAML file at `path`, then HIXL_MASTER_* in `env` (default
        os.environ; {} ignores it), then `overrides` (flags by dest; None = not given).
        ConfigError names the key and source of an unknown key or unusable value."""
        return cls.from_values(layer_values(cls.keys(), ENV_PREFIX, path, overrides, env))

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> MasterConfig:
        """A config from flat key -> typed value (missing keys keep their defaults)."""
        store_names = {f.name for f in dataclasses.fields(StoreConfig)}
        store = {k: v for k, v in values.items() if k in store_names}
        rest = {k: v for k, v in values.items() if k not in store_names}
        return cls(**rest, store=StoreConfig(**store))

    def values(self) -> dict[str, Any]:
        """The flat key -> value view of this config (the inverse of `from_values`)."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "store"}
        flat.update(dataclasses.asdict(self.store))
        return flat


def _field_types() -> dict[str, str]:
    """Each flat key's annotation ("int", "float", "str", "bool", ...), for YAML type checks."""
    types = {f.name: str(f.type) for f in dataclasses.fields(MasterConfig) if f.name != "store"}
    types.update({f.name: str(f.type) for f in dataclasses.fields(StoreConfig)})
    for name in SIZE_KEYS:  # an int, or a text like "256MiB" (checked by the flag's type)
        types[name] = "size"
    return types


def _int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"ratio must be in [0, 1], got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0.0 < value <= 3600.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be in (0, 3600] seconds, got {text}")
    return value


def _call_budget(text: str) -> int:
    try:
        value = parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.args[0]) from None
    if value < MIN_CALL_BYTES_BUDGET:
        raise argparse.ArgumentTypeError(
            f"must be at least 1MiB (a large call body grows 1 MiB at a time), got {text}")
    return value


def _strategy(text: str) -> str:
    if text not in ALLOCATION_STRATEGIES:
        raise argparse.ArgumentTypeError(f"use one of {', '.join(ALLOCATION_STRATEGIES)}; "
                                         f"got {text!r}")
    return text


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"use one of {', '.join(LOG_LEVELS)}; got {text!r}")
    return level


def _mooncake(name: str) -> tuple[str]:
    """A mooncake_master flag name; its other spellings (-name, dashes for underscores,
    gflags' booleans) are `translate`'s."""
    return (f"--{name}",)


def _duration(text: str) -> int:
    """Milliseconds, raw or as a duration (500ms, 10s, 5m, 1h), above 0."""
    value = duration_ms(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0 ms, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hixl-master", allow_abbrev=False,
        description="Serve the hixl address-table registry (and accept mooncake_master flags). "
                    "Settings come from --config FILE, then HIXL_MASTER_<KEY> environment "
                    "variables, then flags; every flag's dest is a config key.",
        epilog="Flags take mooncake_master's spellings too: -flag=value, --flag value, "
               "booleans as --flag, --flag=false or --noflag, --flagfile=FILE, underscores "
               "for dashes. mooncake_master's RDMA/SSD/CXL flags are accepted and warned "
               "about; --config_path reads its master config file.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--config", metavar="FILE",
                        help="YAML file of settings keyed like the flags' dests "
                             "(--describe-config lists them)")
    parser.add_argument("--describe-config", action=BoolFlag,
                        help="print every config key (type, default, meaning) as JSON and exit")
    parser.add_argument("--host", *_mooncake("rpc_address"), dest="host", default=DEFAULT_HOST,
                        help="address to bind (default %(default)s: bind only what is asked)")
    parser.add_argument("--port", *_mooncake("rpc_port"), dest="port", type=_int_in(0, 65535),
                        default=DEFAULT_PORT, help="port to bind; 0 picks a free one "
                        "(default %(default)s)")
    parser.add_argument("--max-lease-ttl-ms", dest="max_lease_ttl_ms", type=_int_in(1),
                        default=DEFAULT_MAX_TTL_MS, metavar="MS",
                        help="longest lease a publisher may ask for (default %(default)s)")
    parser.add_argument("--log-level", dest="log_level", type=_log_level, default="INFO",
                        metavar="LEVEL", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    parser.add_argument("--log-json", dest="log_json", action=BoolFlag,
                        help="log one JSON object per line (with request_id, and code, "
                             "status and hint on failures) instead of text")
    parser.add_argument("--cluster-token-file", dest="cluster_token_file", default="",
                        metavar="FILE",
                        help="file holding the cluster token: every call must prove it. "
                             f"Default: ${ENV_TOKEN} (the token) or ${ENV_TOKEN_FILE} (a "
                             "file); with neither, calls are not authenticated")
    parser.add_argument("--tls-cert-file", dest="tls_cert_file", default="", metavar="FILE",
                        help="PEM certificate (chain) to serve gRPC over TLS with (with "
                             "--tls-key-file); give it the address clients dial as a "
                             "subjectAltName. The store call endpoint (--fast-port) is not "
                             "encrypted; TLS clients keep every call on gRPC. Default: "
                             f"${ENV_CERT_FILE}, else plaintext")
    parser.add_argument("--tls-key-file", dest="tls_key_file", default="", metavar="FILE",
                        help="PEM private key of --tls-cert-file (unencrypted, mode 0600). "
                             f"Default: ${ENV_KEY_FILE}")
    parser.add_argument("--tls-ca-file", dest="tls_ca_file", default="", metavar="FILE",
                        help="PEM CA certificate(s) that must sign client certificates, with "
                             f"--tls-client-auth. Default: ${ENV_CA_FILE}")
    parser.add_argument("--tls-client-auth", dest="tls_client_auth", action=BoolFlag,
                        help="mutual TLS: serve only clients presenting a certificate signed "
                             "by --tls-ca-file (the cluster token still authenticates calls)")
    parser.add_argument("--metrics-port", *_mooncake("metrics_port"), dest="metrics_port",
                        type=_int_in(0, 65535), default=0, metavar="PORT",
                        help="serve mooncake_master's HTTP side on --host:PORT: Prometheus "
                             "metrics (registry, store: objects, space, evictions, results "
                             "by code) on /metrics, and /health, /get_all_segments, "
                             "/query_segment, /query_key, /batch_query_keys, /get_all_keys; "
                             "0 (default): none")
    parser.add_argument("--enable-metric-reporting", *_mooncake("enable_metric_reporting"),
                        dest="enable_metric_reporting", action=BoolFlag, default=False,
                        help="log a one-line summary of the store (keys, space, clients) "
                             f"every {METRIC_REPORT_INTERVAL_S} s (mooncake_master's "
                             "default is on; hixl's off)")
    parser.add_argument("--metrics-host", *_mooncake("metrics_host"), dest="metrics_host",
                        default="", metavar="HOST",
                        help="address the HTTP side (--metrics-port) binds (default: --host, "
                             "where mooncake_master's is 0.0.0.0)")
    parser.add_argument("--rpc-interface", *_mooncake("rpc_interface"), dest="rpc_interface",
                        default="", metavar="NAME",
                        help="network interface whose IPv4 address is bound instead of "
                             "--host (mooncake_master's --rpc_interface)")
    parser.add_argument("--enable-http-metadata-server",
                        *_mooncake("enable_http_metadata_server"),
                        dest="enable_http_metadata_server", action=BoolFlag, default=False,
                        help="serve Mooncake's HTTP metadata protocol (GET/PUT/DELETE "
                             "/metadata?key=K) for TransferEngines and stores given "
                             "http://HOST:PORT/metadata as their metadata server")
    parser.add_argument("--http-metadata-server-port", *_mooncake("http_metadata_server_port"),
                        dest="http_metadata_server_port", type=_int_in(0, 65535),
                        default=DEFAULT_HTTP_METADATA_PORT, metavar="PORT",
                        help="port of the HTTP metadata server (default %(default)s; 0 picks "
                             "a free one)")
    parser.add_argument("--http-metadata-server-host", *_mooncake("http_metadata_server_host"),
                        dest="http_metadata_server_host", default="", metavar="HOST",
                        help="address the HTTP metadata server binds (default: --host, "
                             "where mooncake_master's is 0.0.0.0)")
    parser.add_argument("--fast-port", dest="fast_port", type=_int_in(-1, 65535), default=0,
                        metavar="PORT",
                        help="port of the store call endpoint on --host: the hot store calls "
                             "(puts, reads, exists, removals) framed over a plain socket, "
                             "several times cheaper than gRPC; advertised to clients in "
                             "Heartbeat and MountSegment replies. 0 (default): a free port, "
                             "or none when gRPC is served over TLS (the endpoint is "
                             "plaintext); -1: none (every call over gRPC)")
    parser.add_argument("--call-bytes-budget", dest="call_bytes_budget", type=_call_budget,
                        default=CALL_BYTES_BUDGET, metavar="SIZE",
                        help="bytes of large store call bodies (over 64 KiB) the store call "
                             "endpoint holds at once, over all connections (bytes or a "
                             "unit: 256MiB, the default; at least 1MiB): a body is read "
                             "1 MiB at a time as it arrives, each step reserved against "
                             "it; a step it cannot cover within 1 s refuses the call, "
                             "unapplied, and the connection goes on. Bounds the master's "
                             "memory under floods of large or stalled calls")
    parser.add_argument("--call-body-timeout-s", dest="call_body_timeout_s", type=_seconds,
                        default=BODY_TIMEOUT_S, metavar="S",
                        help="seconds a store call body has, from its header, to arrive "
                             "whole on the store call endpoint; a slower one closes the "
                             "connection and frees what it held (default %(default)s; "
                             "(0, 3600])")
    parser.add_argument("--call-spin-us", dest="call_spin_us", type=_int_in(0, 10_000),
                        default=CALL_SPIN_US, metavar="US",
                        help="microseconds a store call connection polls for its client's "
                             "next call after answering, before it blocks (one connection "
                             "at a time, only for clients calling back to back): a blocked "
                             "thread wakes on a cold CPU, which costs a small call more "
                             "than its work. 0: never poll; at most 10000 (default "
                             "%(default)s)")
    parser.add_argument("--advertise-address", dest="advertise_address", default="",
                        metavar="HOST:PORT",
                        help="the gRPC address clients and agents reach this master at; with "
                             "etcd, the other masters name it as the leader. Default: --host "
                             "and the port bound (this host's name when --host is 0.0.0.0 "
                             "or ::)")
    store = parser.add_argument_group("KV store (mooncake_master flags)")
    defaults = StoreConfig()
    store.add_argument(*_mooncake("default_kv_lease_ttl"), dest="default_kv_lease_ttl_ms",
                       type=_duration, default=defaults.default_kv_lease_ttl_ms, metavar="MS",
                       help="kv read lease: ms, or a duration like 10s (> 0; default "
                            "%(default)s ms)")
    store.add_argument(*_mooncake("eviction_high_watermark_ratio"),
                       dest="eviction_high_watermark_ratio", type=_ratio, metavar="RATIO",
                       default=defaults.eviction_high_watermark_ratio,
                       help="evict once this fraction of the pool is used, in [0, 1] "
                            "(default %(default)s)")
    store.add_argument(*_mooncake("eviction_ratio"), dest="eviction_ratio", type=_ratio, metavar="RATIO",
                       default=defaults.eviction_ratio,
                       help="fraction of the pool one eviction frees, in [0, 1] "
                            "(default %(default)s)")
    store.add_argument(*_mooncake("client_ttl"), dest="client_ttl_s", type=_int_in(1),
                       default=defaults.client_ttl_s, metavar="S", help="client liveness ttl in s (> 0)")
    store.add_argument(*_mooncake("allocation_strategy"), dest="allocation_strategy",
                       type=_strategy, default=defaults.allocation_strategy,
                       metavar="STRATEGY", help="random (default) or free_ratio_first")
    store.add_argument(*_mooncake("default_kv_soft_pin_ttl"),
                       dest="default_kv_soft_pin_ttl_ms", type=_duration, metavar="MS",
                       default=defaults.default_kv_soft_pin_ttl_ms,
                       help="soft pin ttl when a put asks for none: ms, or a duration like "
                            "30m (default %(default)s ms)")
    store.add_argument(*_mooncake("put_start_discard_timeout_sec"),
                       dest="put_start_discard_timeout_s", type=_int_in(1), metavar="S",
                       default=defaults.put_start_discard_timeout_s,
                       help="an unfinished put may be pre-empted after this (s)")
    store.add_argument(*_mooncake("put_start_release_timeout_sec"),
                       dest="put_start_release_timeout_s", type=_int_in(1), metavar="S",
                       default=defaults.put_start_release_timeout_s,
                       help="the space of an unfinished put is reclaimed after this (s)")
    store.add_argument("--remount-grace-s", dest="remount_grace_s", type=_int_in(1),
                       metavar="S", default=defaults.remount_grace_s,
                       help="after a restart, how long restored segments wait for their "
                            "owners to remount them (default %(default)s)")
    store.add_argument("--eviction-grace-ms", dest="eviction_grace_ms", type=_int_in(1),
                       metavar="MS", default=defaults.eviction_grace_ms,
                       help="an acknowledged put is not evicted for this long, so a get "
                            "right after it finds the value; a put that finds no other room "
                            "meanwhile gets NO_AVAILABLE_HANDLE (ms > 0; default "
                            "%(default)s)")
    store.add_argument("--data-dir", dest="data_dir", default="", metavar="DIR",
                       help="where committed store metadata is kept across restarts "
                            "(default: $XDG_STATE_HOME/hixl/master-<port>; none with "
                            "--port 0)")
    store.add_argument("--persist", dest="persist", action=BoolFlag, default=True,
                       help="keep committed store metadata across restarts (default true); "
                            "--no-persist (--persist=false): in memory only, every key is "
                            "lost on restart")
    etcd = parser.add_argument_group(
        "store metadata on etcd (instead of --data-dir; several masters share one etcd)")
    etcd.add_argument("--etcd-endpoints", dest="etcd_endpoints", default="",
                      metavar="HOST:PORT,...",
                      help="etcd members (comma-separated host:port, http:// or https://): "
                           "when set, the store's committed metadata lives on etcd under "
                           "--etcd-prefix instead of a data dir (not with --data-dir or "
                           "--no-persist). Default: none (local data dir)")
    etcd.add_argument("--etcd-prefix", dest="etcd_prefix", default=defaults.etcd_prefix,
                      metavar="PREFIX",
                      help="this cluster's key prefix on etcd, '/hixl/<cluster>/': clusters "
                           "sharing one etcd each take their own (default %(default)s)")
    etcd.add_argument("--etcd-ca-file", dest="etcd_ca_file", default="", metavar="FILE",
                      help="PEM CA of the etcd members' certificates: TLS to etcd is on "
                           "when given")
    etcd.add_argument("--etcd-cert-file", dest="etcd_cert_file", default="", metavar="FILE",
                      help="PEM client certificate for etcd (with --etcd-key-file), when "
                           "etcd asks for one")
    etcd.add_argument("--etcd-key-file", dest="etcd_key_file", default="", metavar="FILE",
                      help="PEM private key of --etcd-cert-file")
    etcd.add_argument("--etcd-user", dest="etcd_user", default="", metavar="USER",
                      help="etcd user, when etcd has authentication on (with "
                           "--etcd-password-file)")
    etcd.add_argument("--etcd-password-file", dest="etcd_password_file", default="",
                      metavar="FILE",
                      help="file holding --etcd-user's password (never a command-line "
                           "value: argv is world-readable)")
    etcd.add_argument("--etcd-timeout", dest="etcd_timeout", type=_seconds,
                      default=defaults.etcd_timeout, metavar="S",
                      help="deadline of each etcd call in seconds: a change etcd cannot "
                           "commit within it fails the store call (default %(default)s)")
    etcd.add_argument("--enable-ha", *_mooncake("enable_ha"), dest="enable_ha",
                      action=BoolFlag, default=False,
                      help="mooncake_master's high availability: several masters on one "
                           "etcd, a leader elected (needs --etcd-endpoints; hixl-master "
                           "does this whenever etcd endpoints are given)")
    etcd.add_argument("--cluster-id", *_mooncake("cluster_id"), dest="cluster_id", default="",
                      metavar="ID",
                      help="the cluster's name on etcd: its prefix becomes /hixl/<ID>/ "
                           "(instead of --etcd-prefix; give one of the two)")
    etcd.add_argument("--etcd-lease-ttl", dest="etcd_lease_ttl", type=_int_in(1, 600),
                      default=defaults.etcd_lease_ttl, metavar="S",
                      help="TTL in whole seconds of the leases holding this master's "
                           "candidacy in the leader election and its writer claim: a dead "
                           "leader is replaced by a standby after about this long, and a "
                           "leader cut off from etcd for this long stops (default "
                           "%(default)s)")
    return parser


def hixl_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """`argv` in hixl-master's own spelling (any gflags or mooncake_master spelling
    translated, server/mooncake_flags.py), and a line per accepted flag that is not
    used. A flag that cannot be taken exits(2), naming it, as argparse does."""
    parser = build_parser()
    try:
        translation = translate(parser, argv)
    except FlagError as exc:
        parser.error(str(exc))
    return translation.argv, translation.unused


def given_flags(argv: list[str]) -> dict[str, Any]:
    """dest -> value of the flags `argv` sets, leaving out those it does not: only given
    flags may override the file and the environment."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given = vars(parser.parse_args(hixl_argv(argv)[0]))
    for dest in COMMAND_ONLY_DESTS:
        given.pop(dest, None)
    return given


def parse_config(argv: list[str], env: Mapping[str, str] | None = None) -> MasterConfig:
    """Defaults < `--config` YAML < HIXL_MASTER_* in `env` (default os.environ) < flags
    (in any spelling `hixl_argv` takes).

    Bad flags exit(2) with argparse's message naming the flag; a bad key or value in the
    file or the environment raises ConfigError naming the key and its source.
    """
    args = build_parser().parse_args(hixl_argv(argv)[0])
    return MasterConfig.load(args.config, given_flags(argv), env)


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` (mooncake_master's --rpc_interface);
    ConfigError naming it and the interfaces there are when it has none."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), siocgifaddr,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:
            names = ", ".join(n for _, n in socket.if_nameindex())
            raise ConfigError(f"rpc_interface {name!r}: no IPv4 address on such an interface "
                              f"(interfaces here: {names})") from None
    return socket.inet_ntoa(packed[20:24])


def _bind_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def etcd_settings(config: StoreConfig) -> EtcdConfig | None:
    """The etcd the store's metadata goes to (None: no etcd_endpoints, a local data dir).

    ConfigError naming the key: a bad value (EtcdConfig's checks), an unreadable or empty
    password file, a user without a password file or the other way round, and the
    contradictions: etcd_endpoints with data_dir (two homes for one store's metadata) or
    with persist false (in memory only)."""
    endpoints = config.etcd_endpoints.replace(";", ",")  # mooncake_master separates by ";"
    if not endpoints.strip():
        if config.enable_ha:
            raise ConfigError("enable_ha: hixl-master's high availability runs on etcd: give "
                              "etcd_endpoints (--etcd_endpoints=host:2379)")
        return None
    prefix = config.etcd_prefix
    if config.cluster_id:
        if prefix != DEFAULT_ETCD_PREFIX:
            raise ConfigError(f"cluster_id {config.cluster_id!r} and etcd_prefix {prefix!r} "
                              "both name the cluster's place on etcd: give one")
        prefix = f"/hixl/{config.cluster_id}/"
    if config.data_dir:
        raise ConfigError("data_dir and etcd_endpoints both say where the store's metadata "
                          "lives: give one (with etcd, leave data_dir empty)")
    if not config.persist:
        raise ConfigError("persist is false (--no-persist: in memory only) but "
                          "etcd_endpoints puts the store's metadata on etcd: give one")
    if bool(config.etcd_user) != bool(config.etcd_password_file):
        raise ConfigError("etcd_user and etcd_password_file go together: set both (etcd "
                          "authentication) or neither")
    password = ""
    if config.etcd_password_file:
        try:
            with open(config.etcd_password_file, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"etcd_password_file {config.etcd_password_file}: cannot read "
                              f"it: {getattr(exc, 'strerror', None) or exc}") from None
        if not password:
            raise ConfigError(f"etcd_password_file {config.etcd_password_file} is empty")
    return EtcdConfig(endpoints=endpoints, prefix=prefix,  # type: ignore[arg-type]
                      ca_file=config.etcd_ca_file, cert_file=config.etcd_cert_file,
                      key_file=config.etcd_key_file, user=config.etcd_user,
                      password=password, timeout=config.etcd_timeout)


def open_backend(config: StoreConfig, port: int) -> MetadataBackend | None:
    """Where the store's committed metadata lives, as the settings say (None: in memory
    only): etcd when etcd_endpoints is set, else a local data dir. ConfigError (naming
    the directory or the etcd prefix) when it cannot be used or another master holds it,
    or when etcd cannot be reached."""
    etcd = etcd_settings(config)
    if etcd is not None:
        from hixl.server.master.etcd_metadata import DEFAULT_WRITER_TTL_S, EtcdMetadataBackend
        try:
            # a master killed a moment ago still holds the claim until its lease ends
            return EtcdMetadataBackend(etcd, wait_for_writer_s=DEFAULT_WRITER_TTL_S
                                       + etcd.timeout)
        except UNAVAILABLE_ERRORS as exc:
            raise ConfigError(f"store metadata on {etcd.describe()}: cannot start: {exc} "
                              "(check etcd_endpoints and that etcd is up)") from None
        except HixlError as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"store metadata on {etcd.describe()}: {exc}") from None
    if not config.persist:
        return None
    data_dir = config.data_dir or default_data_dir(port)
    if data_dir is None:
        log.info("store: in memory only (--port 0 and no --data-dir)")
        return None
    return LocalJournalBackend(data_dir, fsync=config.options().fsync)


def open_store(config: StoreConfig, port: int) -> ObjectStore:
    """The ObjectStore the flags describe, its committed state replayed from its backend
    (`open_backend`); ConfigError naming what cannot be used."""
    backend = open_backend(config, port)
    store = ObjectStore(config.options(), backend=backend)
    if backend is not None:
        log.info("store: committed metadata kept in %s", backend.describe())
    return store


def server_tls(config: MasterConfig) -> ServerTLS | None:
    """How gRPC is served: TLS per the tls_* settings (each empty one from its HIXL_TLS_*
    variable), or None for plaintext; ConfigError naming an unusable file."""
    return ServerTLS.from_settings(config.tls_cert_file, config.tls_key_file,
                                   config.tls_ca_file, config.tls_client_auth)


def advertised_address(config: MasterConfig, port: int) -> str:
    """The gRPC "host:port" this master is reached at (`advertise_address`, else --host
    and the bound `port`; this host's name for a wildcard --host)."""
    if config.advertise_address:
        return config.advertise_address
    host = config.host
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return _bind_address(host, port)


def check_advertise_address(config: MasterConfig) -> None:
    """ConfigError naming advertise_address when it is set and not "host:port"."""
    if config.advertise_address:
        try:
            parse_address(config.advertise_address, "advertise_address")
        except HixlError as exc:
            raise ConfigError(str(exc.args[0])) from None


class _Takeover:
    """What serve() swaps when this master wins the election (etcd only): the store the
    front ends use, its upkeep task, and the backend whose fencing deposes it."""

    def __init__(self, config: MasterConfig, calls: StoreCalls, registry: Registry,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.calls = calls
        self.registry = registry
        self.loop = loop
        self.backend: Any = None
        self.upkeep: asyncio.Task[None] | None = None
        self.exit_code = 0

    def take_over(self, election: Election, client: EtcdClient) -> None:
        """(The candidate's thread.) Load the registry and the store's metadata from
        etcd, writes fenced on this leadership, and make them what the front ends serve."""
        from hixl.server.master.etcd_metadata import EtcdMetadataBackend
        from hixl.server.master.etcd_registry import EtcdRegistry

        def fence() -> list[Compare]:  # every write lands only while this master leads
            return [election.fence()]

        assert isinstance(self.registry, EtcdRegistry)
        self.registry.attach(client, fence=fence)
        backend = EtcdMetadataBackend(client, writer_ttl=self.config.store.etcd_lease_ttl,
                                      take_over=True, fence=fence)
        store = ObjectStore(self.config.store.options(), backend=backend)  # loads
        self.backend = backend
        placeholder, self.calls.store = self.calls.store, store
        self.loop.call_soon_threadsafe(self._start_upkeep, placeholder)
        log.info("store: committed metadata kept in %s (%d objects loaded)",
                 backend.describe(), store.stats().get("keys", 0))

    def _start_upkeep(self, placeholder: ObjectStore) -> None:
        if self.upkeep is not None:
            self.upkeep.cancel()
        self.upkeep = self.loop.create_task(upkeep_forever(self.calls.store),
                                            name="hixl-store-upkeep")
        placeholder.close()

    def fenced(self) -> str:
        backend = self.backend
        return backend.fenced if backend is not None else ""

    def deposed(self, stop: asyncio.Event) -> Callable[[str], None]:
        def on_deposed(why: str) -> None:
            self.exit_code = EXIT_DEPOSED
            log.error("exiting with status %d: this master lost the leadership (%s); its "
                      "supervisor restarts it, and it comes back as a standby",
                      EXIT_DEPOSED, why)
            self.loop.call_soon_threadsafe(stop.set)
        return on_deposed


async def serve(config: MasterConfig, stop: asyncio.Event,
                cluster_token: bytes | None = None) -> int:
    """Serve until `stop` is set; returns the process exit code.

    With a `cluster_token`, every call must prove it (hixl.auth), else UNAUTHENTICATED;
    with TLS settings (`server_tls`), gRPC is served over TLS only. With etcd settings
    this master campaigns for the leadership (module docstring) and serves only while it
    leads; it returns EXIT_DEPOSED once it lost it.
    """
    try:
        if config.rpc_interface:  # its address is what every port binds
            config = dataclasses.replace(config, host=interface_address(config.rpc_interface))
        tls = server_tls(config)
        etcd = etcd_settings(config.store)
        check_advertise_address(config)
    except ConfigError as exc:
        print(f"hixl-master: {exc}", file=sys.stderr, flush=True)
        return 2
    if etcd is None:
        registry = Registry(max_ttl_ms=config.max_lease_ttl_ms)
    else:
        from hixl.server.master.etcd_registry import EtcdRegistry
        registry = EtcdRegistry(max_ttl_ms=config.max_lease_ttl_ms,
                                switch_s=config.store.etcd_lease_ttl)
    leadership = Leadership() if etcd is not None else None
    interceptors = server_interceptors(cluster_token)
    if leadership is not None:
        interceptors.append(LeaderGate(leadership))  # after the token check
    # No SO_REUSEPORT: a second master on a taken port must fail, not share it silently.
    server = grpc.aio.server(
        options=[*SERVER_KEEPALIVE_OPTIONS, ("grpc.so_reuseport", 0),
                 # batch store calls of many keys outgrow gRPC's default 4 MiB
                 ("grpc.max_receive_message_length", 64 << 20)],
        interceptors=interceptors)
    add_registry_service(server, registry, expire_every_s=None)
    address = _bind_address(config.host, config.port)
    port_setting = "--port (--rpc_port, key 'port', HIXL_MASTER_PORT)"
    host_setting = "--host (--rpc_address, key 'host', HIXL_MASTER_HOST)"
    # asked of the kernel first: gRPC's own refusal is a C-core log line saying no why
    refusal: OSError | str | None = probe_bind(config.host, config.port)
    port = 0
    try:
        port = 0 if refusal else add_port(server, address, tls, interceptors)
    except RuntimeError as exc:
        refusal = str(exc)
    if not port:
        refusal = refusal or probe_bind(config.host, config.port) or "gRPC could not bind it"
        said = bind_failure("gRPC", config.host, config.port, port_setting, refusal,
                            host_setting)
        print(f"hixl-master: {said}", file=sys.stderr, flush=True)
        return 1
    said = _other_port_refusal(config)  # before the store opens: a taken port fails fast
    if said:
        print(f"hixl-master: {said}", file=sys.stderr, flush=True)
        return 1
    loop = asyncio.get_running_loop()
    candidate: Candidate | None = None
    if etcd is None:
        try:
            # Port first: a second master on a taken port says so, not "data dir in use".
            store = await asyncio.to_thread(open_store, config.store, config.port)
        except ConfigError as exc:
            print(f"hixl-master: {exc}", file=sys.stderr, flush=True)
            return 1
    else:
        assert leadership is not None
        leadership.address = advertised_address(config, port)
        # never served: the gate refuses every call until the real one is loaded
        store = ObjectStore(config.store.options())
    calls = StoreCalls(store)
    standby = _Takeover(config, calls, registry, loop)
    if etcd is not None:
        assert leadership is not None
        candidate = Candidate(etcd, leadership, ttl=config.store.etcd_lease_ttl,
                              on_elected=standby.take_over,
                              on_deposed=standby.deposed(stop), fenced=standby.fenced)
        try:
            await asyncio.to_thread(candidate.enter)
        except HixlError as exc:
            why = f"cannot start: {exc} (check etcd_endpoints and that etcd is up)" \
                if isinstance(exc, UNAVAILABLE_ERRORS) else str(exc)
            print(f"hixl-master: store metadata on {etcd.describe()}: {why}",
                  file=sys.stderr, flush=True)
            return 1
    fast = None
    fast_port = config.fast_port
    if tls is not None and fast_port == 0:
        log.info("store call endpoint off: gRPC is served over TLS and the endpoint is "
                 "plaintext (give --fast-port PORT to open it anyway)")
        fast_port = -1
    elif tls is not None and fast_port > 0:
        log.warning("store call endpoint on port %d is plaintext although gRPC uses TLS: "
                    "keys and replica addresses cross the network unencrypted", fast_port)

    async def close_store() -> None:
        if candidate is not None:
            await asyncio.to_thread(candidate.halt)  # no takeover while closing
        await asyncio.to_thread(registry.close)  # the leases stay on etcd for the next one
        await asyncio.to_thread(calls.store.close)
        if candidate is not None:
            await asyncio.to_thread(candidate.close)  # resign: a standby leads at once

    if fast_port >= 0:
        fast = StoreCallServer(calls, config.host, fast_port,
                               cluster_token=cluster_token, leadership=leadership,
                               call_bytes_budget=config.call_bytes_budget,
                               body_timeout=config.call_body_timeout_s,
                               spin_us=config.call_spin_us)
        try:
            fast.start()
        except ConfigError as exc:
            print(f"hixl-master: {exc} (--fast-port)", file=sys.stderr, flush=True)
            await close_store()
            return 1
        calls.fast_port = fast.port
    servicer = add_store_service(server, store, calls)
    try:
        http = start_http(config, registry, lambda: calls.store, servicer.results, fast,
                          leadership)
    except ConfigError as exc:
        print(f"hixl-master: {exc}", file=sys.stderr, flush=True)
        if fast is not None:
            await asyncio.to_thread(fast.stop)
        await close_store()
        return 1
    if config.enable_metric_reporting:
        http.append(loop.create_task(report_metrics(lambda: calls.store),
                                     name="hixl-metric-reporting"))
    expiry = start_expiry(registry)
    if etcd is None:
        standby.upkeep = loop.create_task(upkeep_forever(store), name="hixl-store-upkeep")
    try:
        await server.start()
        print(f"hixl-master serving {_bind_address(config.host, port)}", flush=True)
        log.info("cluster token: %s", "required" if cluster_token is not None else
                 "none (calls are not authenticated)")
        log.info("gRPC: %s", tls.describe() if tls is not None else "plaintext")
        log.info("store settings: %s", config.store)
        log.info("store call endpoint: %s", f"port {fast.port}" if fast is not None else
                 "none (--fast-port -1: every store call over gRPC)")
        if candidate is not None and etcd is not None:
            log.info("standby: campaigning for the leadership of %s on %s as %s (lease "
                     "%d s); every call is answered 'not the leader' until elected",
                     etcd.prefix, etcd.describe(), advertised_address(config, port),
                     config.store.etcd_lease_ttl)
            candidate.start()
        await stop.wait()
    finally:
        expiry.cancel()
        if standby.upkeep is not None:
            standby.upkeep.cancel()
        await server.stop(STOP_GRACE_S)
        if fast is not None:
            await asyncio.to_thread(fast.stop)
        for part in http:
            if isinstance(part, asyncio.Task):
                part.cancel()
            else:
                await asyncio.to_thread(part.close)
        await close_store()
    return standby.exit_code


def _other_port_refusal(config: MasterConfig) -> str:
    """The first of the other ports asked for (store call endpoint, HTTP side, HTTP
    metadata server) that cannot be bound, in bind_failure's words; "" when all can."""
    ports = []
    if config.fast_port > 0:
        ports.append(("the store call endpoint", config.host, config.fast_port,
                      "--fast-port (key 'fast_port', HIXL_MASTER_FAST_PORT)"))
    if config.metrics_port:
        ports.append(("the HTTP side (metrics)", config.metrics_host or config.host,
                      config.metrics_port,
                      "--metrics-port (--metrics_port, key 'metrics_port', "
                      "HIXL_MASTER_METRICS_PORT)"))
    if config.enable_http_metadata_server:
        ports.append(("the HTTP metadata server",
                      config.http_metadata_server_host or config.host,
                      config.http_metadata_server_port,
                      "--http-metadata-server-port (--http_metadata_server_port, key "
                      "'http_metadata_server_port', HIXL_MASTER_HTTP_METADATA_SERVER_PORT)"))
    for what, host, port, setting in ports:
        refusal = probe_bind(host, port)
        if refusal is not None:
            zero = "0 for none" if "metrics" in what else "0 for any free one"
            return bind_failure(what, host, port, setting, refusal, zero=zero)
    return ""


def start_http(config: MasterConfig, registry: Registry, store: Callable[[], ObjectStore],
               results: dict[tuple[str, int], int], fast: StoreCallServer | None,
               leadership: Leadership | None) -> list[Any]:
    """The HTTP side the settings ask for (server/master/master_http.py): the admin server on
    metrics_port, the metadata server with enable_http_metadata_server; what was started
    (to close), or ConfigError naming the setting whose port cannot be bound."""
    def health() -> tuple[bool, dict[str, Any]]:
        leading = leadership is None or leadership.leading
        leader = None if leadership is None else (leadership.leader or None)
        return leading, {"status": "ok", "role": "leader" if leading else "standby",
                         "ha_state": "serving" if leading else "standby",
                         "service_ready": leading, "leader_address": leader,
                         "view_version": None}

    started: list[Any] = []
    try:
        if config.metrics_port:
            metrics = metrics_registry(registry, store, results, fast, leadership)
            add_mooncake_metrics(metrics, store)
            admin = HttpServer(admin_routes(store, metrics, health),
                               config.metrics_host or config.host,
                               config.metrics_port, "metrics_port (--metrics-port / --metrics_port)")
            started.append(admin)
            log.info("HTTP side (metrics, health, segments, keys) on %s", admin.url)
        if config.enable_http_metadata_server:
            host = config.http_metadata_server_host or config.host
            metadata = HttpServer(MetadataStore().routes(), host,
                                  config.http_metadata_server_port,
                                  "http_metadata_server_port (--http-metadata-server-port / "
                                  "--http_metadata_server_port)")
            started.append(metadata)
            log.info("HTTP metadata server on %s/metadata", metadata.url)
    except ConfigError:
        for server in started:
            server.close()
        raise
    return started


async def report_metrics(store: Callable[[], ObjectStore]) -> None:
    """--enable_metric_reporting: the store in one log line, every METRIC_REPORT_INTERVAL_S."""
    while True:
        await asyncio.sleep(METRIC_REPORT_INTERVAL_S)
        stats = await asyncio.to_thread(lambda: store().stats())
        log.info("Master Metrics: %s", fields_line(stats))


def metrics_registry(registry: Registry, store: Callable[[], ObjectStore],
                     results: dict[tuple[str, int], int] | None = None,
                     calls_server: StoreCallServer | None = None,
                     leadership: Leadership | None = None) -> CollectorRegistry:
    """The master's own CollectorRegistry: its role (`leadership`; None: a single master,
    always the leader), the registry's table, the store (`store()`: the one served now; a
    standby swaps it when it takes over) and its call endpoint."""
    from hixl.server.metrics import (
        master_families,
        registry_families,
        store_call_families,
        store_families,
    )

    def families() -> list[Any]:
        leading = leadership is None or leadership.leading
        found = [*master_families(leading), *registry_families(registry),
                 *store_families(store(), results)]
        if calls_server is not None:
            found += store_call_families(calls_server)
        return found

    metrics = CollectorRegistry()
    metrics.register(FunctionCollector(families, "master"))
    return metrics


async def _main(config: MasterConfig, cluster_token: bytes | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return await serve(config, stop, cluster_token)


def run_master(argv: list[str] | None = None) -> int:
    """Process entry: parse flags, serve on uvloop until SIGTERM/SIGINT, return the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        argv, unused = hixl_argv(argv)
        if build_parser().parse_args(argv).describe_config:
            print(json.dumps(MasterConfig.describe(), indent=2))
            return 0
        config = parse_config(argv)
    except SystemExit as exc:  # argparse already printed the message naming the flag
        return exc.code if isinstance(exc.code, int) else 2
    except ConfigError as exc:  # names the key and the file or variable it came from
        print(f"hixl-master: {exc}", file=sys.stderr, flush=True)
        return 2
    setup_logging(config.log_level, config.log_json)
    for line in unused:
        log.warning("%s", line)
    try:
        token = load_token(config.cluster_token_file or None)
        server_tls(config)  # an unusable TLS file is a configuration error too (exit 2)
        etcd_settings(config.store)  # and so are unusable or contradictory etcd settings
        check_advertise_address(config)
    except ConfigError as exc:
        print(f"hixl-master: {exc}", file=sys.stderr, flush=True)
        return 2
    return uvloop.run(_main(config, token))


def _check_flags_match_fields() -> None:
    """Every flag is a config field with the same default, and every field has a flag."""
    defaults = MasterConfig().values()
    flags = {action.dest: action.default for action in build_parser()._actions
             if action.option_strings and action.dest not in COMMAND_ONLY_DESTS}
    if flags != defaults:
        differ = sorted(k for k in flags.keys() | defaults.keys()
                        if flags.get(k, "<no flag>") != defaults.get(k, "<no field>"))
        raise AssertionError(f"hixl-master flags and MasterConfig fields differ at {differ}")


_check_flags_match_fields()


if __name__ == "__main__":
    sys.exit(run_master())
