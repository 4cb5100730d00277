"""hixl-master: the process that serves the global address-table registry.

It also accepts mooncake_master's flag spellings (`-rpc_port=50051` as well as
`--rpc_port 50051`) so existing launch scripts work unchanged; the KV-store flags are
validated now and kept in `StoreConfig` for the store that is built on top later.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import uvloop

from hixl.auth import ENV_TOKEN, ENV_TOKEN_FILE, load_token
from hixl.control import TokenInterceptor
from hixl.errors import ConfigError
from hixl.server.registry import (
    DEFAULT_MAX_TTL_MS,
    SERVER_KEEPALIVE_OPTIONS,
    Registry,
    add_registry_service,
    start_expiry,
)

log = logging.getLogger("hixl.master")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051          # mooncake_master's default rpc_port
STOP_GRACE_S = 1.0
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class StoreConfig:
    """mooncake_master's KV-store settings (units as mooncake: ms for kv lease, s for clients)."""

    default_kv_lease_ttl_ms: int = 5_000
    eviction_high_watermark_ratio: float = 0.95
    eviction_ratio: float = 0.05
    client_ttl_s: int = 10


@dataclass(frozen=True)
class MasterConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_lease_ttl_ms: int = DEFAULT_MAX_TTL_MS
    log_level: str = "INFO"
    store: StoreConfig = field(default_factory=StoreConfig)
    cluster_token_file: str = ""


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


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"use one of {', '.join(LOG_LEVELS)}; got {text!r}")
    return level


def _mooncake(name: str) -> tuple[str, str]:
    """gflags accepts both -name and --name."""
    return f"--{name}", f"-{name}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hixl-master", allow_abbrev=False,
        description="Serve the hixl address-table registry (and accept mooncake_master flags).")
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
    parser.add_argument("--cluster-token-file", dest="cluster_token_file", default="",
                        metavar="FILE",
                        help="file holding the cluster token: every call must prove it. "
                             f"Default: ${ENV_TOKEN} (the token) or ${ENV_TOKEN_FILE} (a "
                             "file); with neither, calls are not authenticated")
    store = parser.add_argument_group("mooncake store flags (recorded for the KV store)")
    defaults = StoreConfig()
    store.add_argument(*_mooncake("default_kv_lease_ttl"), dest="default_kv_lease_ttl_ms",
                       type=_int_in(1), default=defaults.default_kv_lease_ttl_ms, metavar="MS",
                       help="kv read lease in ms (> 0)")
    store.add_argument(*_mooncake("eviction_high_watermark_ratio"),
                       dest="eviction_high_watermark_ratio", type=_ratio, metavar="RATIO",
                       default=defaults.eviction_high_watermark_ratio)
    store.add_argument(*_mooncake("eviction_ratio"), dest="eviction_ratio", type=_ratio, metavar="RATIO",
                       default=defaults.eviction_ratio)
    store.add_argument(*_mooncake("client_ttl"), dest="client_ttl_s", type=_int_in(1),
                       default=defaults.client_ttl_s, metavar="S", help="client liveness ttl in s (> 0)")
    return parser


def parse_config(argv: list[str]) -> MasterConfig:
    """Parse flags; bad ones exit(2) with argparse's message naming the flag."""
    args = build_parser().parse_args(argv)
    return MasterConfig(
        host=args.host, port=args.port, max_lease_ttl_ms=args.max_lease_ttl_ms,
        log_level=args.log_level, cluster_token_file=args.cluster_token_file,
        store=StoreConfig(
            default_kv_lease_ttl_ms=args.default_kv_lease_ttl_ms,
            eviction_high_watermark_ratio=args.eviction_high_watermark_ratio,
            eviction_ratio=args.eviction_ratio, client_ttl_s=args.client_ttl_s))


def _bind_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


async def serve(config: MasterConfig, stop: asyncio.Event,
                cluster_token: bytes | None = None) -> int:
    """Serve until `stop` is set; returns the process exit code.

    With a `cluster_token`, every call must prove it (hixl.auth), else UNAUTHENTICATED.
    """
    registry = Registry(max_ttl_ms=config.max_lease_ttl_ms)
    # No SO_REUSEPORT: a second master on a taken port must fail, not share it silently.
    server = grpc.aio.server(
        options=[*SERVER_KEEPALIVE_OPTIONS, ("grpc.so_reuseport", 0)],
        interceptors=[TokenInterceptor(cluster_token)] if cluster_token is not None else None)
    add_registry_service(server, registry, expire_every_s=None)
    address = _bind_address(config.host, config.port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        print(f"hixl-master: cannot bind {address}: {exc}", file=sys.stderr, flush=True)
        return 1
    expiry = start_expiry(registry)
    await server.start()
    print(f"hixl-master serving {_bind_address(config.host, port)}", flush=True)
    log.info("cluster token: %s", "required" if cluster_token is not None else
             "none (calls are not authenticated)")
    log.info("store settings: %s", config.store)
    try:
        await stop.wait()
    finally:
        expiry.cancel()
        await server.stop(STOP_GRACE_S)
    return 0


async def _main(config: MasterConfig, cluster_token: bytes | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return await serve(config, stop, cluster_token)


def run_master(argv: list[str] | None = None) -> int:
    """Process entry: parse flags, serve on uvloop until SIGTERM/SIGINT, return the exit code."""
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse already printed the message naming the flag
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(level=config.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        token = load_token(config.cluster_token_file or None)
    except ConfigError as exc:
        print(f"hixl-master: {exc}", file=sys.stderr, flush=True)
        return 2
    return uvloop.run(_main(config, token))


if __name__ == "__main__":
    sys.exit(run_master())
