"""AgentServer: everything one agent runs, brought up and torn down together.

    gRPC (Agent service, and the embedded Registry when no master is configured)
    data server (TCP on host:data_port, unix socket in runtime_dir)
    fd socket (SCM_RIGHTS fds for same-node peers)
    registry publisher (keeps this agent's segments published under a lease)
    pool segments from the config

Two shapes: `start()` runs the event loop (uvloop) in a daemon thread and returns once
everything serves — for an agent embedded in an engine, and for tests; `serve_forever()`
runs it in the calling (main) thread with SIGTERM/SIGINT handlers — the hixl-agent daemon.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import uvloop

from hixl import logs
from hixl.auth import load_token
from hixl.control import add_port, server_interceptors
from hixl.errors import HixlError, NotConnected, ParamInvalid, ResourceExhausted
from hixl.metrics import CollectorRegistry, FunctionCollector, MetricsServer
from hixl.registry_client import (
    OWNER_KEY_SIZE,
    EngineEndpoints,
    RegistryClient,
    agent_owner_key,
    load_owner_secret,
    owner_key_from_secret,
)
from hixl.server.agent.agent import Agent
from hixl.server.agent.config import AgentConfig, prepare_runtime_dir
from hixl.server.agent.data_server import Peer
from hixl.server.agent.fd_server import FdServer, TicketBook, prepare_socket_path
from hixl.server.agent.grpc_service import AgentServicer, Endpoints, RegistryState
from hixl.server.config import bind_failure, probe_bind
from hixl.types import SegmentInfo
from hixl.v1 import agent_pb2_grpc
from hixl.wrong_server import NOT_HTTP2

log = logging.getLogger("hixl.runtime")

# Agents serving from a background thread (embedded in a client process). Stopped at exit:
# a uvloop timer firing in a daemon thread after the interpreter is finalized segfaults,
# and client code (e.g. Mooncake-style scripts) rarely closes its engines.
_BACKGROUND: weakref.WeakSet[AgentServer] = weakref.WeakSet()
EXIT_GRACE_S = 0.2


@atexit.register
def _stop_background_agents() -> None:
    for server in list(_BACKGROUND):
        with contextlib.suppress(Exception):
            server.stop(EXIT_GRACE_S)


START_TIMEOUT_S = 60.0  # pool segments are pre-faulted at start: large pools take a while
#: while publishing fails, a WARNING this often (the first failure's at once): an agent
#: nobody can find must not look healthy in a log that only shows the start
UNPUBLISHED_WARN_EVERY_S = 30.0

#: let clients ping idle watch streams (a dead agent is noticed) without being penalised
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),  # a second agent on the same port must fail, not share it
]


# ---------------------------------------------------------------- pools that fit

#: a cgroup limit at or above this is no limit (v1 writes 2**63 rounded to a page)
_NO_LIMIT = 1 << 60
#: while a pool segment is pre-faulted, how often the log says how far it got
PREFAULT_PROGRESS_EVERY_S = 2.0


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return None


def _stat_field(text: str | None, name: str) -> int:
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return 0


def _cgroup_room(root: str) -> tuple[int, str] | None:
    """Bytes this process's memory cgroup still admits (its limit less its working set:
    usage without inactive file cache, which the kernel reclaims first), and the file of
    the limit; None without a limit. cgroup v2, else v1; the process's own cgroup, else
    the mount's root (a container sees its own cgroup there)."""
    own = _read(os.path.join(root, "proc/self/cgroup")) or ""
    paths = {"v2": "", "v1": ""}
    for line in own.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            paths["v2"] = path.lstrip("/")
        elif "memory" in controllers.split(","):
            paths["v1"] = path.lstrip("/")
    layouts = (("sys/fs/cgroup", paths["v2"], "memory.max", "memory.current", "inactive_file"),
               ("sys/fs/cgroup/memory", paths["v1"], "memory.limit_in_bytes",
                "memory.usage_in_bytes", "total_inactive_file"))
    for base, path, limit_name, usage_name, inactive in layouts:
        for directory in dict.fromkeys((os.path.join(root, base, path), os.path.join(root, base))):
            limit_text = _read(os.path.join(directory, limit_name))
            usage_text = _read(os.path.join(directory, usage_name))
            if limit_text is None or usage_text is None:
                continue
            if limit_text.strip() == "max" or int(limit_text) >= _NO_LIMIT:
                break  # no limit at this level: try the next layout
            used = int(usage_text) - _stat_field(
                _read(os.path.join(directory, "memory.stat")), inactive)
            return max(int(limit_text) - max(used, 0), 0), os.path.join(directory, limit_name)
    return None


def memory_room(root: str = "/") -> list[tuple[int, str]]:
    """Every bound on the memory a new pool may take, as (bytes, where it was read):
    MemAvailable of /proc/meminfo and, under a memory cgroup limit, what it still admits.
    `root` is "/" but for tests of the reading itself."""
    bounds = []
    meminfo = _read(os.path.join(root, "proc/meminfo")) or ""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            bounds.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    cgroup = _cgroup_room(root)
    if cgroup is not None:
        bounds.append((cgroup[0], f"the memory cgroup's limit less its use ({cgroup[1]})"))
    return bounds


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def check_pool_fits(config: AgentConfig, root: str = "/") -> None:
    """Refuse a pool the machine cannot hold, before any of it is mapped: pre-faulting
    more than there is meets the OOM killer (or, under a limit, ENOMEM with no hint).
    ResourceExhausted with the numbers, where they were read, and the setting to change."""
    wanted = sum(entry.size for entry in config.pool)
    if not wanted:
        return
    for room, where in memory_room(root):
        if wanted > room:
            setting = ("key 'pool_size' (--pool-size, HIXL_AGENT_POOL_SIZE)" if
                       config.pool_size else "key 'pool' (HIXL_AGENT_POOL, or --pool-size)")
            raise ResourceExhausted(
                f"the pool ({_gib(wanted)} in {len(config.pool)} segment(s)) does not fit "
                f"this machine: {_gib(room)} available ({where}); lower {setting}, or free "
                "memory (the pool is pre-faulted at start, all of it)")


@contextlib.contextmanager
def _prefault_progress(name: str, size: int) -> Iterator[None]:
    """Log that a pool segment is being pre-faulted, how far it got every
    PREFAULT_PROGRESS_EVERY_S (this process's shared memory grows as pages fault in), and
    how long it took: a large pool takes seconds per GiB, and silence looks like a hang."""
    log.info("pre-faulting pool segment %r (%s)", name, _gib(size))
    done = threading.Event()
    before = _stat_field((_read("/proc/self/status") or "").replace(":", ""), "RssShmem")

    def report() -> None:
        while not done.wait(PREFAULT_PROGRESS_EVERY_S):
            status = (_read("/proc/self/status") or "").replace(":", "")
            faulted = (_stat_field(status, "RssShmem") - before) * 1024
            log.info("pre-faulting pool segment %r: %s of %s", name,
                     _gib(min(max(faulted, 0), size)), _gib(size))

    ticker = threading.Thread(target=report, name="hixl-prefault-progress", daemon=True)
    started = time.monotonic()
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    log.info("pool segment %r: %s pre-faulted in %.1f s", name, _gib(size),
             time.monotonic() - started)


def _claim_socket_path(path: str, port: int) -> None:
    """prepare_socket_path, its refusal naming the settings that tell agents apart: two
    agents on one host share a socket path when they share runtime_dir and grpc_port
    (on different --host addresses, say)."""
    try:
        prepare_socket_path(path)
    except ResourceExhausted as exc:
        raise ResourceExhausted(
            f"{exc.args[0]}: another agent with grpc_port {port} uses this runtime_dir; "
            "give each agent on this host its own key 'runtime_dir' (--runtime-dir, "
            "HIXL_AGENT_RUNTIME_DIR) or its own grpc_port (--grpc-port)") from None


def _registry_failure(exc: Exception, where: str) -> str:
    """Why publishing failed, saying what key 'master' reached when it is not a registry:
    a port that does not speak gRPC (an agent's data port), or a gRPC server without the
    Registry service (an agent that publishes to a master of its own)."""
    text = str(exc)
    if any(marker in text for marker in NOT_HTTP2):
        return (f"{text}; {where} does not speak gRPC: key 'master' (--master) must be a "
                "hixl-master's host:port, not an agent's data port")
    if "UNIMPLEMENTED" in text:
        return (f"{text}; {where} serves gRPC but no registry: key 'master' (--master) must "
                "be a hixl-master's host:port (an agent serves a registry only when it has "
                "no master of its own)")
    return text


class Publisher:
    """Keeps this agent's table published in a registry under a lease, in its own thread.

    Works with the in-process `Registry` and with `RegistryClient` alike (same methods).
    Publishes the agent's endpoints with its segments, so peers reading the registry reach
    it without a handshake. Re-publishes on every change, renews the lease every ttl/3, re-publishes when the
    lease was lost (registry restarted, lease expired); failures are logged and retried,
    never raised: an unreachable master must not take the agent down.

    With several master addresses (`master: h1:p1,h2:p2`), the RegistryClient fails over
    by itself (hixl.failover): a renewal the lease's master cannot take (unreachable, not
    the leader) moves the client to the next master. Masters on etcd share the leases
    (server/master/etcd_registry.py), so the renewal simply succeeds there; a master of its own
    (no etcd) does not know the lease (NotConnected), so the segments are published there
    at once under a new lease, exactly as after a master restart: at most one renewal
    interval (ttl/3) plus the call's deadline after the old master went away.

    Every publish, keepalive and unpublish carries `owner_key` (the agent's, from the
    per-engine secret in its state dir): the registry binds the engine name to it, so
    nobody else can publish, renew or withdraw it, and a restarted agent (same secret)
    takes its name back at once with its newer epoch.
    """

    def __init__(self, agent: Agent, registry: Any, ttl_ms: int, where: str,
                 endpoints: EngineEndpoints | None = None,
                 owner_key: bytes | None = None) -> None:
        self._agent = agent
        self.registry = registry
        self._owner_key = owner_key
        self._endpoints = endpoints
        self._ttl_ms = ttl_ms
        self._where = where
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._dirty = True
        self._cause: str | None = None  # the request whose change the next publish sends
        self._lease: int | None = None
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name="hixl-publisher", daemon=True)
        self.published = threading.Event()  # set after the first successful publish
        self.attempted = threading.Event()  # set once the first publish succeeded or failed
        self._last_warning: float | None = None  # time.monotonic() of the last WARNING
        self._last_error = ""
        self._last_success: float | None = None  # time.monotonic() of the last success
        self.counters = {"registry_publishes": 0, "registry_keepalives": 0,
                         "registry_failures": 0}

    def start(self) -> None:
        self._agent.subscribe(self._on_change)
        self._thread.start()

    def _on_change(self, kind: str, segments: list[SegmentInfo]) -> None:
        # runs in the thread that changed the table, i.e. within the client's request:
        # the publish it causes goes to the master under that request's id
        self._cause = logs.current_request_id()
        self._dirty = True
        self._wake.set()

    def _run(self) -> None:
        interval = max(self._ttl_ms / 3000.0, 0.05)
        while not self._stop.is_set():
            try:
                self._step()
                if self._failures:
                    log.warning("registry %s: published again after %d failed attempts",
                                self._where, self._failures)
                self._failures = 0
                self._last_error = ""
                self._last_warning = None
                self._last_success = time.monotonic()
                wait = interval
            except Exception as exc:  # noqa: BLE001 - log, back off, retry
                self._failures += 1
                self._last_error = _registry_failure(exc, self._where)
                self.counters["registry_failures"] += 1
                self._log_failure()
                wait = min(interval, 0.2 * 2 ** min(self._failures, 5))
            self.attempted.set()
            self._wake.wait(wait)
            self._wake.clear()

    def _log_failure(self) -> None:
        """A WARNING on the first failure and every UNPUBLISHED_WARN_EVERY_S while it
        lasts (DEBUG between): the state stays visible without flooding the log."""
        now = time.monotonic()
        due = self._last_warning is None or now - self._last_warning >= UNPUBLISHED_WARN_EVERY_S
        if due:
            self._last_warning = now
        log.log(logging.WARNING if due else logging.DEBUG,
                "registry %s: not published: %s (attempt %d; retrying; peers that look "
                "this agent up in the registry cannot find it meanwhile)", self._where,
                self._last_error, self._failures)

    def _step(self) -> None:
        if self._lease is not None and not self._dirty:
            # only a lease the master does not know is published anew; any other failure
            # (no master reachable, no leader yet) propagates and keeps the lease: the
            # next renewal, sooner on a retry, may well work
            try:
                self.registry.keepalive(self._lease, owner_key=self._owner_key)
                self.counters["registry_keepalives"] += 1
                return
            except NotConnected as exc:
                log.info("registry %s: lease %d lost (%s); publishing again",
                         self._where, self._lease, exc)
                self._lease = None
        self._dirty = False
        cause, self._cause = self._cause, None
        try:
            with logs.request_context(cause):
                self._lease = self.registry.publish(
                    self._agent.engine_name, self._agent.node_id, self._agent.epoch,
                    self._agent.segments(), self._ttl_ms, endpoints=self._endpoints,
                    owner_key=self._owner_key)
        except BaseException:
            self._dirty = True
            raise
        self.counters["registry_publishes"] += 1
        self.published.set()

    def state(self, mode: str, target: str = "") -> RegistryState:
        """How publishing goes, for Health (read without a lock: a snapshot is enough)."""
        last = self._last_success
        lease = self._lease
        return RegistryState(
            mode=mode, target=target, published=lease is not None, lease_id=lease or 0,
            failures=self._failures, last_error=self._last_error,
            last_success_age_s=-1.0 if last is None else time.monotonic() - last)

    def stop(self, unpublish: bool = True) -> None:
        self._agent.unsubscribe(self._on_change)
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(10.0)
        if unpublish and self._lease is not None:
            try:
                self.registry.unpublish(self._lease, owner_key=self._owner_key)
            except Exception as exc:  # noqa: BLE001 - the lease expires by itself anyway
                log.info("registry %s: unpublish failed: %s", self._where, exc)
            self._lease = None


def _data_server_class() -> Any:
    from hixl.server.agent.data_server import DataServer  # written alongside; imported late

    return DataServer


class AgentServer:
    """One agent: gRPC + data server + fd socket + registry publishing + pool."""

    def __init__(self, config: AgentConfig, *, cluster_token: bytes | None = None) -> None:
        """`cluster_token` None: the token of config.cluster_token_file, else of the
        HIXL_CLUSTER_TOKEN[_FILE] environment, else none (authentication off)."""
        self.config = config
        self._cluster_token = cluster_token if cluster_token is not None else load_token(
            config.cluster_token_file or None)
        # read (and checked) here, like the token: a bad file fails the start, not a call
        self._tls = config.server_tls()
        self._master_tls = config.client_tls() if config.master else None
        self.engine_name = ""
        self.agent: Agent | None = None
        self.endpoints: Endpoints | None = None
        self.registry: Any = None           # the embedded Registry (no master configured)
        self.publisher: Publisher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._grpc: grpc.aio.Server | None = None
        self._servicer: AgentServicer | None = None
        self._data: Any = None
        self._fd: FdServer | None = None
        self._tickets = TicketBook()
        self._stop_event = asyncio.Event()  # not bound to a loop until first awaited
        self._stop_requested = False
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._sockets: list[str] = []
        self._grace = 1.0
        #: this agent's own metrics registry (several agents in one process never collide),
        #: served on config.metrics_port while the agent runs
        self.metrics_registry = CollectorRegistry()
        self.metrics_registry.register(self.metrics_collector())
        self.metrics: MetricsServer | None = None

    def metrics_collector(self) -> FunctionCollector:
        """A Prometheus collector of this agent (traffic, connections, segments, registry
        lease; the embedded registry's table too): reads its counters when scraped."""
        from hixl.server.metrics import agent_families

        return FunctionCollector(lambda: agent_families(self), "agent")

    # ------------------------------------------------------------ public shapes

    def start(self, timeout: float = START_TIMEOUT_S) -> AgentServer:
        """Serve from a background daemon thread; returns once everything accepts calls."""
        if self._thread is not None:
            raise ParamInvalid("this AgentServer was already started")
        self._thread = threading.Thread(target=self._run_loop, name="hixl-agent-loop",
                                        daemon=True)
        _BACKGROUND.add(self)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise HixlError(f"agent did not come up within {timeout:.0f} s")
        if self._error is not None:
            self._thread.join(5.0)
            raise self._error
        return self

    def serve_forever(self, on_ready: Callable[[AgentServer], None] | None = None) -> None:
        """Serve in this (main) thread until SIGTERM/SIGINT or stop(); then shut down cleanly."""
        def ready() -> None:
            assert self._loop is not None
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._stop_event.set)
            if on_ready is not None:
                # off the loop: it may wait for the first publish (AgentServer.publication)
                self._loop.run_in_executor(None, on_ready, self)

        def stop_early(signum: int, frame: object) -> None:
            # a Ctrl-C or SIGTERM while starting (pre-faulting a large pool, say): stop
            # once the start-up step running returns, with no traceback and no ready line
            self._stop_requested = True

        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, stop_early)
                        for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._run_loop(ready)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self._error is not None:
            raise self._error

    def stop(self, grace: float = 1.0) -> None:
        """Stop accepting, close everything, remove the socket files; idempotent."""
        self._grace = grace
        self._stop_requested = True  # seen by _main even before the loop exists
        _BACKGROUND.discard(self)
        loop = self._loop
        if loop is not None and not self._done.is_set():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._stop_event.set)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(grace + 15.0)

    def __enter__(self) -> AgentServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ loop

    def _run_loop(self, on_ready: Callable[[], None] | None = None) -> None:
        loop = uvloop.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main(on_ready))
        except BaseException as exc:  # noqa: BLE001 - reported to start()/serve_forever()
            if self._error is None:
                self._error = exc
        finally:
            with contextlib.suppress(Exception):
                _cancel_all(loop)
            loop.close()
            asyncio.set_event_loop(None)
            self._done.set()
            self._ready.set()

    async def _main(self, on_ready: Callable[[], None] | None) -> None:
        try:
            await self._astart()
        except BaseException as exc:
            # OS refusals (runtime_dir not writable, socket path taken...) become typed
            self._error = HixlError(f"cannot start agent: {exc}") if isinstance(
                exc, OSError) else exc
            await self._astop(0)
            return
        self._ready.set()
        if self._stop_requested:
            log.warning("start-up interrupted (SIGINT/SIGTERM): stopping")
            self._stop_event.set()
        elif on_ready is not None:
            on_ready()
        await self._stop_event.wait()
        await self._astop(self._grace)

    def _owner_key(self, cfg: AgentConfig) -> bytes:
        """The key this agent's name is owned by at the registry (hixl.registry_client).

        A fixed port: the name's own secret, read (or made) before serving, so a state
        dir that cannot hold it fails the start. An ephemeral port (grpc_port 0): one
        secret for every such engine of this host and state dir, from which each name's
        key is derived: a later engine that draws a port an earlier one used (it can only
        once that one is gone) proves the same name, as a restart does, instead of being
        refused forever by the key of a process that no longer exists. Without a usable
        state dir, a key of this process alone (and that port's name stays the first
        user's at a long-lived registry)."""
        if cfg.grpc_port:
            return agent_owner_key(cfg.state_dir, self.engine_name)
        try:
            secret = load_owner_secret(cfg.state_dir, f"{cfg.host}:ephemeral-ports")
        except HixlError as exc:
            log.warning("no state dir for this engine's owner key (%s): using one of this "
                        "process alone", exc)
            return secrets.token_bytes(OWNER_KEY_SIZE)
        return owner_key_from_secret(secret, self.engine_name)

    async def _astart(self) -> None:
        cfg = self.config
        # ours, not writable by others (whoever may write there could plant a fake fd
        # socket): for agents embedded in engines as for hixl-agent
        prepare_runtime_dir(cfg.runtime_dir, cfg.allowed_uids)
        check_pool_fits(cfg)  # before anything is bound or mapped
        token = self._cluster_token
        interceptors = server_interceptors(token)
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        self._grpc = server
        address = f"{cfg.host}:{cfg.grpc_port}"
        grpc_setting = "key 'grpc_port' (--grpc-port, HIXL_AGENT_GRPC_PORT)"
        refusal = probe_bind(cfg.host, cfg.grpc_port)
        if refusal is not None:
            raise HixlError(bind_failure("gRPC", cfg.host, cfg.grpc_port, grpc_setting,
                                         refusal))
        try:
            port = add_port(server, address, self._tls, interceptors)
        except RuntimeError as exc:
            raise HixlError(bind_failure("gRPC", cfg.host, cfg.grpc_port, grpc_setting,
                                         str(exc))) from None
        if not port:
            raise HixlError(bind_failure("gRPC", cfg.host, cfg.grpc_port, grpc_setting,
                                         probe_bind(cfg.host, cfg.grpc_port)
                                         or "gRPC could not bind it"))
        self.engine_name = f"{cfg.host}:{port}"
        if cfg.metrics_port:  # before the pool is pre-faulted: a taken port fails fast
            refusal = probe_bind(cfg.host, cfg.metrics_port)
            if refusal is not None:
                raise HixlError(bind_failure(
                    "metrics", cfg.host, cfg.metrics_port,
                    "key 'metrics_port' (--metrics-port, HIXL_AGENT_METRICS_PORT)", refusal,
                    zero="0 for no metrics endpoint"))
            self.metrics = MetricsServer(self.metrics_registry, cfg.host, cfg.metrics_port,
                                         "key 'metrics_port'")
        agent = Agent(self.engine_name, cfg.node_id, pool_max_bytes=cfg.pool_max_bytes,
                      max_segments=cfg.max_segments)
        self.agent = agent

        for entry in cfg.pool:
            with _prefault_progress(entry.name, entry.size):
                agent.allocate(entry.size, entry.perms, entry.name, owner="pool",
                               budgeted=False, allowed_engines=entry.allowed_engines)

        base = os.path.join(cfg.runtime_dir, f"agent-{port}")
        unix_data = f"{base}.data.sock" if cfg.data_unix else None
        for path in (unix_data, f"{base}.fd.sock"):
            if path:
                _claim_socket_path(path, port)
        data_server_cls = _data_server_class()
        self._data = data_server_cls(agent.resolve, agent.epoch, tcp_host=cfg.host,
                                     tcp_port=cfg.data_port, unix_path=unix_data,
                                     cluster_token=token, unix_mode=cfg.socket_mode,
                                     handshake_timeout=cfg.data_handshake_timeout_s,
                                     preauth_connections=cfg.data_preauth_connections)
        try:
            self._data.start()
        except OSError as exc:
            raise HixlError(bind_failure(
                "the data path", cfg.host, cfg.data_port,
                "key 'data_port' (--data-port, HIXL_AGENT_DATA_PORT)", exc)) from None
        if unix_data:
            self._sockets.append(unix_data)

        fd_path = f"{base}.fd.sock"
        self._fd = FdServer(fd_path, agent, self._tickets, mode=cfg.socket_mode,
                            allowed_uids=cfg.allowed_uids)
        self._fd.start()
        self._sockets.append(fd_path)

        self.endpoints = Endpoints(self.engine_name, self._data.tcp_address,
                                   self._data.unix_path or "", fd_path)
        self._servicer = AgentServicer(agent, self.endpoints, self._tickets,
                                       self._collect_counters, self._peers,
                                       self._registry_state)
        agent_pb2_grpc.add_AgentServicer_to_server(self._servicer, server)
        registry_target = self._wire_registry(server)
        await server.start()
        if registry_target is not None:
            owner_key = self._owner_key(cfg)
            published = EngineEndpoints(
                fabric_domain=agent.node_id, data_tcp=self.endpoints.data_tcp,
                data_unix=self.endpoints.data_unix, fd_socket=self.endpoints.fd_socket)
            self.publisher = Publisher(agent, registry_target[0], cfg.lease_ttl_ms,
                                       registry_target[1], published, owner_key)
            self.publisher.start()
        log.info("agent %s serving: data=%s unix=%s fd=%s epoch=%d node=%s registry=%s "
                 "grpc=%s cluster_token=%s handshake=%gs preauth=%d/listener "
                 "max_segments=%d",
                 self.engine_name, self.endpoints.data_tcp,
                 self.endpoints.data_unix or "-", fd_path, agent.epoch, agent.node_id,
                 cfg.master or "embedded",
                 self._tls.describe() if self._tls is not None else "plaintext",
                 "on" if token else "off (no authentication)",
                 cfg.data_handshake_timeout_s, cfg.data_preauth_connections,
                 agent.max_segments)

    def _wire_registry(self, server: grpc.aio.Server) -> tuple[Any, str] | None:
        """(registry-like object, description) to publish to, or None without a registry."""
        cfg = self.config
        if cfg.master:
            client = RegistryClient(cfg.master, cluster_token=self._cluster_token,
                                    tls=self._master_tls or False)
            return client, f"master {cfg.master}"
        try:
            from hixl.server.registry import Registry, add_registry_service
        except ImportError as exc:
            log.warning("embedded registry unavailable (%s); segments are not published", exc)
            return None
        self.registry = Registry()
        add_registry_service(server, self.registry)
        return self.registry, "embedded"

    def _collect_counters(self) -> dict[str, int]:
        counters: dict[str, int] = {}
        if self._data is not None:
            counters.update({f"data_{k}" if not k.startswith("data_") else k: v
                             for k, v in dict(self._data.counters).items()})
        if self._fd is not None:
            counters.update(self._fd.counters)
        if self.publisher is not None:
            counters.update(self.publisher.counters)
        return counters

    def publication(self, timeout: float) -> str:
        """How this agent's table stands at the registry, once the first publish to the
        master was tried (at most `timeout` s): "embedded", "none", "published",
        "pending" or "not published: <why>". Blocks: call it off the event loop."""
        publisher = self.publisher
        if not self.config.master:
            return "embedded" if self.registry is not None else "none"
        if publisher is None:
            return "none"
        publisher.attempted.wait(timeout)
        if publisher.published.is_set() and publisher.state("master").published:
            return "published"
        if not publisher.attempted.is_set():
            return "pending"
        return f"not published: {publisher.state('master').last_error or '?'}"

    def _peers(self) -> list[Peer]:
        peers: list[Peer] = []
        if self._data is not None:
            peers.extend(self._data.peers())
        if self._fd is not None:
            peers.extend(self._fd.peers())
        return peers

    def _registry_state(self) -> RegistryState:
        master = self.config.master
        mode = "master" if master else "embedded" if self.registry is not None else "none"
        publisher = self.publisher
        state = publisher.state(mode, master) if publisher is not None else RegistryState(mode)
        if self.registry is not None:
            infos = self.registry.engine_infos()
            state = dataclasses.replace(state, engines=len(infos),
                                        segments=len(self.registry.query()))
        return state

    async def _astop(self, grace: float) -> None:
        log.info("agent %s shutting down", self.engine_name or "(not started)")
        if self.metrics is not None:
            metrics, self.metrics = self.metrics, None
            await _off_loop(metrics.close)
        if self.publisher is not None:
            publisher, self.publisher = self.publisher, None
            await _off_loop(publisher.stop)
            close = getattr(publisher.registry, "close", None)
            if callable(close) and publisher.registry is not self.registry:
                with contextlib.suppress(Exception):
                    close()
        if self._servicer is not None:
            self._servicer.stop_watches()
        # The socket paths are named after the gRPC port: give them up while the port is
        # still ours. Released first, the port could go to a new agent (grpc_port 0) that
        # then found its paths served by us, or had its fresh socket files unlinked by us.
        if self._fd is not None:
            self._fd.stop()
            self._fd = None
        if self._data is not None:
            with contextlib.suppress(Exception):
                await _off_loop(self._data.stop)
            self._data = None
        for path in self._sockets:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._sockets.clear()
        if self._grpc is not None:
            with contextlib.suppress(Exception):
                await self._grpc.stop(grace)
            self._grpc = None
        self._tickets.close()
        if self.agent is not None:
            self.agent.close()


async def _off_loop(fn: Callable[[], object]) -> None:
    """Run a blocking stop step in a worker thread; inline once the interpreter is exiting
    (the atexit stop of background agents), when executors refuse new work."""
    try:
        await asyncio.to_thread(fn)
    except RuntimeError as exc:
        if "interpreter shutdown" not in str(exc):
            raise
        fn()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
