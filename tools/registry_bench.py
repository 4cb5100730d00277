"""`hixl bench-registry`: the control plane at cluster scale.

One real hixl-master; `publishers` simulated agents (threads, each with its own
RegistryClient and lease) publishing `segments` segments in all; `watchers` GlobalTables,
each in its own process. It measures:

- propagation: from publish() returning (and from its call) until the change is visible
  in *every* watcher (p50/p99/max over `changes` changes, one at a time, each one segment
  added to one publisher's table, which republishes its whole table as agents do);
- snapshot: how long a new watcher takes to sync at full size (alone, and the watcher
  processes starting all together);
- find(): cost of a lookup at `small_segments` and at `segments` (O(log n) per engine).

Clocks: CLOCK_MONOTONIC is one clock for every process on a machine, so a watcher's "seen"
time and the publisher's "returned" time compare directly.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import IO, Any

from hixl.auth import load_token
from hixl.client.global_table import GlobalTable
from hixl.errors import HixlError, ParamInvalid
from hixl.registry_client import EngineEndpoints, RegistryClient
from hixl.tools.daemons import MasterProcess
from hixl.types import MemType, Perm, SegmentInfo

LEASE_TTL_MS = 30_000
SEGMENT_STRIDE = 1 << 20  # simulated segments: 512 KiB every 1 MiB of a fake address space
SEGMENT_LENGTH = 1 << 19
BASE = 1 << 40


# ---------------------------------------------------------------- a hixl-master process




# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class RegistryBenchConfig:
    publishers: int = 64
    segments: int = 100_000         # total at full size (~1,560 per publisher)
    watchers: int = 8               # GlobalTables, one process each
    changes: int = 200              # propagation samples
    small_segments: int = 1_000     # the small table find() is compared against
    finds: int = 50_000             # lookups timed per table size
    master: str = ""                # use this running master instead of starting one
    etcd_endpoints: str = ""        # start the master on this etcd (its registry there)
    etcd_prefix: str = ""           # ... under this prefix ("": a fresh one per run)
    timeout: float = 60.0           # deadline of every wait

    def master_flags(self) -> list[str]:
        """The flags of the private master: its registry on etcd when etcd_endpoints is
        set (under etcd_prefix, else a fresh prefix), else in its memory."""
        if not self.etcd_endpoints:
            return []
        prefix = self.etcd_prefix or f"/hixl/bench-registry-{os.getpid()}-{time.time_ns()}/"
        return ["--etcd-endpoints", self.etcd_endpoints, "--etcd-prefix", prefix]

    def check(self) -> None:
        for key in ("publishers", "segments", "watchers", "changes", "small_segments",
                    "finds"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ParamInvalid(f"bench-registry: {key} must be a positive integer, "
                                   f"got {value!r}")
        if self.small_segments > self.segments:
            raise ParamInvalid("bench-registry: small_segments must not exceed segments")
        if self.segments < self.publishers or self.small_segments < self.publishers:
            raise ParamInvalid("bench-registry: every publisher needs at least one segment "
                               "in both the small and the full table")
        if not self.timeout > 0:
            raise ParamInvalid(f"bench-registry: timeout must be positive, got {self.timeout}")
        if self.master and self.etcd_endpoints:
            raise ParamInvalid("bench-registry: master names a running master and "
                               "etcd_endpoints asks for a private one on etcd: give one")
        if self.etcd_prefix and not self.etcd_endpoints:
            raise ParamInvalid("bench-registry: etcd_prefix needs etcd_endpoints")


# ---------------------------------------------------------------- simulated agents


class SimulatedAgent:
    """One publisher: a fake engine's table, published whole under a lease like an agent."""

    def __init__(self, index: int, target: str, timeout: float,
                 token: bytes | None = None) -> None:
        self.engine = f"10.0.{index // 250}.{index % 250 + 1}:50000"
        self.node_id = f"sim-node-{index}"
        self.epoch = 1
        self.client = RegistryClient(target, timeout=timeout, cluster_token=token)
        self.endpoints = EngineEndpoints(fabric_domain=self.node_id,
                                         data_tcp=f"{self.engine.split(':')[0]}:50001")
        self.table: list[SegmentInfo] = []
        self.lease = 0

    def segment(self, number: int) -> SegmentInfo:
        return SegmentInfo(segment_id=number + 1, engine=self.engine, node_id=self.node_id,
                           base=BASE + number * SEGMENT_STRIDE, length=SEGMENT_LENGTH,
                           mem_type=MemType.MEM_HOST, perms=Perm.RW, epoch=self.epoch,
                           shareable=True, name=f"seg-{number}")

    def grow_to(self, count: int) -> None:
        """Publish the first `count` segments (the whole table, as agents do)."""
        self.table.extend(self.segment(n) for n in range(len(self.table), count))
        self.publish()

    def publish(self) -> None:
        self.lease = self.client.publish(self.engine, self.node_id, self.epoch, self.table,
                                         LEASE_TTL_MS, endpoints=self.endpoints)

    def keepalive(self) -> None:
        if self.lease:
            self.client.keepalive(self.lease)

    def close(self) -> None:
        with contextlib.suppress(HixlError):
            if self.lease:
                self.client.unpublish(self.lease)
        self.client.close()


def _shares(total: int, parts: int) -> list[int]:
    """`total` split over `parts` as evenly as integers allow."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# ---------------------------------------------------------------- watcher processes


def _watcher_main(target: str, timeout: float, conn: Any) -> None:
    """A watcher process: sync, report, then for each armed change report when it is seen."""
    started = time.monotonic()
    table = GlobalTable(target, timeout=timeout, cluster_token=load_token())
    try:
        synced = table.wait_synced(timeout)
        conn.send(("ready", time.monotonic() - started, len(table) if synced else -1))
        while True:
            message = conn.recv()
            if message[0] != "arm":
                break
            _, engine, base = message
            conn.send(("armed",))
            seen = table.wait_for(lambda t, e=engine, b=base: _has(t, e, b), timeout)
            conn.send(("seen", time.monotonic() if seen else -1.0))
    finally:
        table.close()
        conn.close()


def _has(table: GlobalTable, engine: str, base: int) -> bool:
    view = table.view(engine)
    return view is not None and view.table.get(base) is not None


class _Watchers:
    """The watcher processes (spawned: a forked gRPC process is not safe)."""

    def __init__(self, count: int, target: str, timeout: float) -> None:
        self.timeout = timeout
        context = multiprocessing.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for _ in range(count):
            parent, child = context.Pipe()
            proc = context.Process(target=_watcher_main, args=(target, timeout, child),
                                   daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def receive(self, conn: Any, expected: str) -> tuple[Any, ...]:
        if not conn.poll(self.timeout):
            raise HixlError(f"bench-registry: a watcher sent no {expected!r} within "
                            f"{self.timeout} s")
        message = conn.recv()
        if message[0] != expected:
            raise HixlError(f"bench-registry: watcher sent {message!r}, expected {expected!r}")
        return message

    def gather(self, expected: str) -> list[tuple[Any, ...]]:
        return [self.receive(conn, expected) for conn in self.conns]

    def arm(self, engine: str, base: int) -> None:
        for conn in self.conns:
            conn.send(("arm", engine, base))
        self.gather("armed")

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(("stop",))
        for proc in self.procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()


# ---------------------------------------------------------------- measurements


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"samples": 0, "p50": 0.0, "p99": 0.0, "max": 0.0, "min": 0.0}

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"samples": len(ordered), "p50": pick(0.50), "p99": pick(0.99),
            "max": ordered[-1], "min": ordered[0]}


def _time_finds(table: GlobalTable, agents: Sequence[SimulatedAgent], count: int,
                rng: random.Random) -> float:
    """ns per find() at random segments of random engines (no cache hits to flatter it)."""
    probes = []
    for _ in range(count):
        agent = agents[rng.randrange(len(agents))]
        segment = agent.table[rng.randrange(len(agent.table))]
        probes.append((agent.engine, segment.base + rng.randrange(SEGMENT_LENGTH - 64)))
    find = table.find
    started = time.perf_counter()
    for engine, addr in probes:
        find(engine, addr, 64)
    return (time.perf_counter() - started) / count * 1e9


def _wait_size(table: GlobalTable, size: int, timeout: float, what: str) -> None:
    if not table.wait_for(lambda t: len(t) >= size, timeout):
        raise HixlError(f"bench-registry: {what}: the table holds {len(table)} of {size} "
                        f"segments after {timeout} s")


def run_registry_bench(config: RegistryBenchConfig,
                       progress: IO[str] | None = None) -> dict[str, Any]:
    """Run the whole measurement; returns the report (see format_registry_report)."""
    config.check()

    def say(text: str) -> None:
        if progress is not None:
            print(f"bench-registry: {text}", file=progress, flush=True)

    rng = random.Random(1)
    token = load_token()  # the cluster token of the environment, as the master has it
    master = None if config.master else MasterProcess(log_level="WARNING",
                                                      extra=config.master_flags())
    target = config.master or master.target  # type: ignore[union-attr]
    agents: list[SimulatedAgent] = []
    watchers: _Watchers | None = None
    local: GlobalTable | None = None
    stop_keepalive = threading.Event()
    try:
        agents = [SimulatedAgent(i, target, config.timeout, token)
                  for i in range(config.publishers)]
        keeper = threading.Thread(target=_keep_alive, args=(agents, stop_keepalive),
                                  daemon=True)
        keeper.start()
        pool = ThreadPoolExecutor(8, thread_name_prefix="bench-publish")
        local = GlobalTable(target, timeout=config.timeout, cluster_token=token)

        say(f"publishing {config.small_segments} segments from {config.publishers} publishers")
        list(pool.map(SimulatedAgent.grow_to, agents,
                      _shares(config.small_segments, config.publishers)))
        _wait_size(local, config.small_segments, config.timeout, "small table")
        find_small = _time_finds(local, agents, config.finds, rng)

        say(f"growing to {config.segments} segments")
        started = time.monotonic()
        list(pool.map(SimulatedAgent.grow_to, agents,
                      _shares(config.segments, config.publishers)))
        publish_s = time.monotonic() - started
        _wait_size(local, config.segments, config.timeout, "full table")
        visible_s = time.monotonic() - started
        find_full = _time_finds(local, agents, config.finds, rng)
        pool.shutdown()

        say(f"starting {config.watchers} watcher processes")
        watchers = _Watchers(config.watchers, target, config.timeout)
        ready = watchers.gather("ready")
        if any(size < config.segments for _, _, size in ready):
            raise HixlError(f"bench-registry: a watcher synced short: {ready!r}")
        watcher_sync = [seconds for _, seconds, _ in ready]

        say(f"timing {config.changes} changes")
        from_return: list[float] = []
        from_call: list[float] = []
        next_number = {agent.engine: len(agent.table) for agent in agents}
        for change in range(config.changes):
            agent = agents[change % len(agents)]
            number = next_number[agent.engine]
            next_number[agent.engine] += 1
            segment = agent.segment(number)
            watchers.arm(agent.engine, segment.base)
            called = time.monotonic()
            agent.table.append(segment)
            agent.publish()
            returned = time.monotonic()
            seen = [message[1] for message in watchers.gather("seen")]
            if min(seen) < 0:
                raise HixlError(f"bench-registry: change {change} was not seen by every "
                                f"watcher within {config.timeout} s")
            from_return.append((max(seen) - returned) * 1e3)
            from_call.append((max(seen) - called) * 1e3)

        say("timing a new watcher's snapshot")
        total = config.segments + config.changes
        started = time.monotonic()
        with GlobalTable(target, timeout=config.timeout, cluster_token=token) as fresh:
            if not fresh.wait_synced(config.timeout):
                raise HixlError("bench-registry: a new watcher did not sync")
            snapshot_s = time.monotonic() - started
            snapshot_size = len(fresh)
        if snapshot_size != total:
            raise HixlError(f"bench-registry: a new watcher's snapshot held {snapshot_size} "
                            f"segments, expected {total}")

        return {
            "config": asdict(config),
            "population": {"engines": config.publishers, "segments": config.segments,
                           "publish_s": publish_s, "visible_s": visible_s,
                           "segments_per_s": config.segments / visible_s if visible_s else 0.0},
            "propagation_ms": _percentiles(from_return),
            "propagation_from_call_ms": _percentiles(from_call),
            "snapshot": {"segments": snapshot_size, "total": total, "new_watcher_s": snapshot_s,
                         "watchers_together_s": _percentiles(watcher_sync)},
            "find_ns": {"small": {"segments": config.small_segments, "ns": find_small},
                        "full": {"segments": config.segments, "ns": find_full},
                        "ratio": find_full / find_small if find_small else 0.0},
        }
    finally:
        stop_keepalive.set()
        if watchers is not None:
            watchers.close()
        if local is not None:
            local.close()
        for agent in agents:
            agent.close()
        if master is not None:
            master.close()


def _keep_alive(agents: Sequence[SimulatedAgent], stop: threading.Event) -> None:
    """Renew every lease each ttl/3, as agents do (a failure is left to the next round)."""
    while not stop.wait(LEASE_TTL_MS / 3000):
        for agent in agents:
            with contextlib.suppress(HixlError):
                agent.keepalive()


# ---------------------------------------------------------------- report


def format_registry_report(report: dict[str, Any]) -> str:
    pop, snap, finds = report["population"], report["snapshot"], report["find_ns"]
    cfg = report["config"]
    where = ("a running master " + cfg["master"] if cfg["master"] else
             "private master, registry on etcd " + cfg["etcd_endpoints"]
             if cfg.get("etcd_endpoints") else "private master, registry in memory")
    rows: list[tuple[str, str]] = [
        ("registry", where),
        ("engines / segments", f"{pop['engines']} / {pop['segments']:,}"),
        ("watchers (processes)", str(cfg["watchers"])),
        ("populate: publish / visible", f"{pop['publish_s']:.2f} s / {pop['visible_s']:.2f} s "
                                        f"({pop['segments_per_s']:,.0f} segments/s)"),
    ]
    for key, label in (("propagation_ms", "publish() returned -> seen by all"),
                       ("propagation_from_call_ms", "publish() called -> seen by all")):
        stats = report[key]
        rows.append((label, f"p50 {stats['p50']:.2f} ms  p99 {stats['p99']:.2f} ms  "
                            f"max {stats['max']:.2f} ms  ({stats['samples']} changes)"))
    together = snap["watchers_together_s"]
    rows += [
        (f"snapshot, new watcher @ {snap['segments']:,}", f"{snap['new_watcher_s'] * 1e3:.0f} ms"),
        (f"snapshot, {cfg['watchers']} watchers at once",
         f"p50 {together['p50'] * 1e3:.0f} ms  max {together['max'] * 1e3:.0f} ms "
         "(syncing all at once)"),
        (f"find() @ {finds['small']['segments']:,} segments", f"{finds['small']['ns']:.0f} ns"),
        (f"find() @ {finds['full']['segments']:,} segments",
         f"{finds['full']['ns']:.0f} ns  (x{finds['ratio']:.2f})"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


__all__ = ["MasterProcess", "RegistryBenchConfig", "SimulatedAgent", "format_registry_report",
           "run_registry_bench"]
