"""`hixl soak`: a bounded run under faults that checks every byte and every deadline.

The parent starts a `hixl-master` (persistence on, in a temporary data dir, so a restart
keeps committed keys), K `hixl-agent`s publishing to it, and N client processes. Each
client loops over random calls:

- engine PUT/GET (`Engine.transfer`, batches of 1-3 ops) into a segment it allocated in a
  random agent, with content it can verify: value bytes derive from (client, slot,
  version), a fresh segment is all zeros, and a slot whose write failed is unknown until
  written again. Client i uses the fabric path when i is even, the socket path (forced by
  `EnableUseFabricMem=0`) when odd; clients 1 and 2 (mod 4) find agents through the
  registry (`Engine(registry=master)`), the others handshake peer to peer; odd agents
  serve no unix data socket, so socket clients reach them over TCP.
- store put/get/remove (`MooncakeDistributedStore`: bytes, zero-copy and batch forms)
  on its own keys, tracking for each key the versions it may hold: a put that returned 0
  makes it exactly that version, a failed one adds a possibility, a removal that returned
  0 (or OBJECT_NOT_FOUND) makes it absent. A read must return one of the possible versions
  byte for byte (else a *corrupt read*), and a key that must be present must not be
  missing (else a *lost key*).

Every call runs under a deadline derived from the call timeouts; a watchdog thread in each
client reports a call still running past its deadline plus a grace as a *hung call*, with
its stack, to the parent at once. A chaos thread in the parent SIGKILLs an agent or the
master (alternating, the agent picked at random) at random intervals and restarts it on
the same ports and config, so the clients recover by themselves.

The rule for lost keys: store values live in the clients' own segments (each client
mounts one), and clients are never killed -- Mooncake semantics lose a value when its only
holder dies, so holders are kept alive -- while the master's restarts must lose nothing
committed (its journal). Engine slots in an agent that restarted are void (an agent's
memory is not durable): they are reset to "fresh segment" and never counted as lost.

At the end the chaos stops, the cluster is brought back whole, the clients run quietly
for a while (so their keys' last puts are definite), stop, the master is restarted once
more while nobody writes, and every client verifies everything it believes committed. The report gives operations done per kind, failures by
code (HIXL status and exception for the engine, Mooncake ErrorCode for the store), faults
injected, corrupt reads, hung calls and lost keys; the run fails (exit 1) if any of the
last three is non-zero, or a client process died.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import queue
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import numpy as np

from hixl.errors import HixlError, ParamInvalid
from hixl.processes import DaemonProcess, ProcessNotReady, free_port, free_ports

log = logging.getLogger("hixl.soak")

MiB = 1 << 20
AGENT_READY = "hixl-agent serving "
START_TIMEOUT_S = 30.0
MAX_DETAILS = 20                 # corrupt reads, lost keys, hung calls listed in full
OP_KINDS = ("engine_put", "engine_get", "store_put", "store_get", "store_remove")
#: how often each kind of call is picked
OP_WEIGHTS = (3, 3, 2, 2, 1)
#: store codes that say "try again later" during the final verification
TRANSIENT_STORE_CODES = (-900, -703, -800, -1)   # RPC_FAIL, NOT_READY, TRANSFER_FAIL, INTERNAL
MASK64 = (1 << 64) - 1
LEASE_TTL_MS = 500               # the private master's read lease
STORE_STATS = ("keys", "puts_in_progress", "used", "capacity", "retired_bytes",
               "segments", "segments_awaiting_remount")
QUIET_S = 5.0                    # calls go on without faults this long before the check


@dataclass(frozen=True)
class SoakConfig:
    """One soak run. `kill_every` 0 injects no faults; `master`/`agents` soak a running
    cluster (no faults allowed then)."""

    clients: int = 2
    seconds: float = 10.0
    agents: int = 2
    kill_every: float = 2.0          # mean seconds between faults (uniform 0.5x-1.5x)
    seed: int = 1
    value_sizes: tuple[int, ...] = (1024, 64 << 10, 1 << 20)
    master: str = ""                 # a running hixl-master instead of a private one
    agent_targets: tuple[str, ...] = ()   # running agents instead of private ones
    slots: int = 8                   # engine slots per client in each agent
    keys: int = 16                   # store keys per client
    call_timeout: float = 2.0        # deadline of each transfer, master call, connect
    grace: float = 10.0              # beyond a call's deadline before it counts as hung
    max_downtime: float = 0.5        # a killed process stays down up to this long
    settle: float = 60.0             # final verification: how long the cluster may take
    keep_logs: bool = False          # keep the work dir (logs, master data) even on success

    def check(self) -> None:
        for name in ("clients", "agents", "slots", "keys"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ParamInvalid(f"soak: {name} must be a positive integer, got {value!r}")
        for name in ("seconds", "call_timeout", "grace", "settle"):
            if not getattr(self, name) > 0:
                raise ParamInvalid(f"soak: {name} must be positive, got {getattr(self, name)}")
        if not self.kill_every >= 0 or not self.max_downtime >= 0:
            raise ParamInvalid("soak: kill_every and max_downtime must not be negative")
        if not self.value_sizes or min(self.value_sizes) <= 0:
            raise ParamInvalid("soak: value sizes must be positive")
        if (self.master or self.agent_targets) and self.kill_every:
            raise ParamInvalid("soak: a running cluster (--master/--agent) is soaked without "
                               "faults: give --kill-every 0")
        if bool(self.master) != bool(self.agent_targets):
            raise ParamInvalid("soak: give both --master and --agent to soak a running cluster")

    @property
    def slot_size(self) -> int:
        return max(self.value_sizes)

    @property
    def engine_budget(self) -> float:
        """Deadline of one engine transfer call."""
        return self.call_timeout

    @property
    def connect_budget(self) -> float:
        """Connect (handshake or registry view) + segment lookup + allocate (its RPC and
        the wait for the registry to show it)."""
        return 4 * self.call_timeout

    @property
    def store_budget(self) -> float:
        """A store call's worst case, from its parts (client/mooncake/store.py): two put
        attempts, each ListSegments + PutStart + PutEnd + PutRevoke and per target a
        connect, a segment check and a transfer, retried once on a stale connection; plus
        a heartbeat and remount, possibly behind the heartbeat thread's own."""
        return 24 * self.call_timeout


# ---------------------------------------------------------------- verifiable content


def value_seed(*parts: Any) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def pattern(seed: int, size: int) -> np.ndarray:
    """`size` bytes that depend on `seed` and on every position (a misplaced or stale
    block never matches)."""
    words = np.arange((size + 7) // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64(seed & MASK64)
    return words.view(np.uint8)[:size]


def _page_aligned(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + 4096, np.uint8)
    offset = (-raw.ctypes.data) % 4096
    return raw[offset:offset + nbytes]


# ---------------------------------------------------------------- processes


def _agent_env() -> dict[str, str]:
    """Our environment without HIXL_AGENT_* (they would override the agent's file)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIXL_AGENT_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Managed:
    """A daemon the soak starts again and again: `process` is its current life (a
    DaemonProcess or MasterProcess), None before the first."""

    process: Any = None

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


class ManagedAgent(_Managed):
    """A hixl-agent on fixed ports and a fixed runtime dir, so a restart looks the same
    to its peers (only its epoch changes)."""

    def __init__(self, index: int, workdir: str, master: str, pool_max_bytes: int) -> None:
        self.index = index
        self.dir = os.path.join(workdir, f"a{index}")
        os.makedirs(self.dir, exist_ok=True)
        self.config_path = os.path.join(self.dir, "agent.yaml")
        self.log_path = os.path.join(self.dir, "agent.log")
        grpc_port, data_port = free_ports(2)
        settings = {"host": "127.0.0.1", "grpc_port": grpc_port, "data_port": data_port,
                    "runtime_dir": os.path.join(self.dir, "run"), "master": master,
                    "pool_max_bytes": pool_max_bytes, "lease_ttl_ms": 5000,
                    "log_level": "WARNING",
                    # odd agents: no unix data socket, so socket clients go over TCP
                    "data_unix": index % 2 == 0}
        with open(self.config_path, "w", encoding="utf-8") as f:
            json.dump(settings, f)          # JSON is YAML
        self.engine = f"127.0.0.1:{grpc_port}"
        self.process: DaemonProcess | None = None
        self.start()

    def start(self) -> None:
        self.process = DaemonProcess(
            [sys.executable, "-m", "hixl.server.main", "--config", self.config_path],
            name=f"hixl-agent {self.engine}", ready=AGENT_READY, env=_agent_env(),
            log_path=self.log_path)
        try:
            self.process.wait_ready(START_TIMEOUT_S)
        except ProcessNotReady:
            raise HixlError(f"hixl-agent {self.engine} did not start; see {self.log_path}") \
                from None


class ManagedMaster(_Managed):
    """A hixl-master with a data dir, restarted on the same port(s) and config."""

    def __init__(self, workdir: str) -> None:
        self.data_dir = os.path.join(workdir, "master-data")
        self.log_path = os.path.join(workdir, "master.log")
        # reads lease values for 0.5 s (Mooncake: 5 s), so the space of replaced and
        # removed values comes back soon: the pool is sized never to evict (an eviction
        # drops keys by design, which the soak could not tell from a lost key)
        self.extra = ["--data-dir", self.data_dir, f"--default_kv_lease_ttl={LEASE_TTL_MS}"]
        # pin the store call endpoint too: same ports on restart
        self.extra += ["--fast-port", str(free_port())]
        self.process: Any = None
        self.port = 0
        self.start()
        self.target = f"127.0.0.1:{self.port}"

    def start(self) -> None:
        from hixl.tools.daemons import MasterProcess

        # INFO: its log records every eviction, across restarts (see evictions())
        self.process = MasterProcess(self.port, extra=self.extra, log_path=self.log_path)
        self.port = self.process.port

    def evictions(self) -> int:
        """Objects evicted in all of this master's lives (its log says each time)."""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return sum(int(m.group(1)) for m in re.finditer(r"evicted (\d+) objects", f.read()))


class Chaos(threading.Thread):
    """Kills an agent or the master (alternately; which agent at random) every
    uniform(0.5, 1.5) x `every` seconds and restarts it after up to `max_downtime` s."""

    def __init__(self, rng: random.Random, every: float, max_downtime: float,
                 master: ManagedMaster, agents: list[ManagedAgent]) -> None:
        super().__init__(daemon=True, name="hixl-soak-chaos")
        self.rng, self.every, self.max_downtime = rng, every, max_downtime
        self.master, self.agents = master, agents
        self.halt = threading.Event()
        self.counts: Counter[str] = Counter()
        self.events: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._master_next = rng.random() < 0.5
        self.started_at = time.monotonic()

    def run(self) -> None:
        while not self.halt.wait(self.rng.uniform(0.5, 1.5) * self.every):
            if self._master_next:
                victim: ManagedMaster | ManagedAgent = self.master
                kind, name = "master", self.master.target
            else:
                victim = self.rng.choice(self.agents)
                kind, name = "agent", victim.engine
            self._master_next = not self._master_next
            victim.kill()
            self.counts[f"{kind}_kills"] += 1
            at = round(time.monotonic() - self.started_at, 3)
            time.sleep(self.rng.uniform(0, self.max_downtime))
            self.events.append({"t": at, "killed": kind, "target": name,
                                "restarted": self.restart(victim, kind, name)})

    def restart(self, victim: ManagedMaster | ManagedAgent, kind: str, name: str) -> bool:
        """Start it again (three tries); False, and an error noted, if it would not."""
        for attempt in range(3):
            try:
                victim.start()
            except (HixlError, OSError) as exc:
                self.errors.append(f"restart of {kind} {name} (try {attempt + 1}): {exc}")
                time.sleep(0.5)
                continue
            self.counts["restarts"] += 1
            return True
        self.counts["restart_failures"] += 1
        return False

    def heal(self) -> None:
        """After the chaos: everything runs again."""
        for victim, kind, name in [(self.master, "master", self.master.target),
                                   *((a, "agent", a.engine) for a in self.agents)]:
            if not victim.alive():
                victim.kill()
                self.restart(victim, kind, name)


# ---------------------------------------------------------------- the client process


class Watchdog(threading.Thread):
    """Reports the client's current call when it runs past its deadline + grace."""

    def __init__(self, grace: float, emit: Callable[[dict[str, Any]], None],
                 client: int) -> None:
        super().__init__(daemon=True, name="hixl-soak-watchdog")
        self.grace, self.emit, self.client = grace, emit, client
        self.main_ident = threading.get_ident()
        self._lock = threading.Lock()
        self._call: list[Any] | None = None    # [id, kind, form, start, budget, reported]
        self._ids = 0
        self.hung: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def call(self, kind: str, form: str, budget: float) -> Iterator[None]:
        with self._lock:
            self._ids += 1
            call = [self._ids, kind, form, time.monotonic(), budget, False]
            self._call = call
        try:
            yield
        finally:
            with self._lock:
                self._call = None
            if call[5]:
                self.hung.append({"client": self.client, "call": call[0], "kind": kind,
                                  "form": form, "budget_s": budget,
                                  "returned_after_s": round(time.monotonic() - call[3], 3)})

    def run(self) -> None:
        while True:
            time.sleep(0.2)
            with self._lock:
                call = self._call
                if call is None or call[5]:
                    continue
                elapsed = time.monotonic() - call[3]
                if elapsed <= call[4] + self.grace:
                    continue
                call[5] = True
            frame = sys._current_frames().get(self.main_ident)
            stack = "".join(traceback.format_stack(frame)[-12:]) if frame else ""
            self.emit({"event": "hung", "client": self.client, "call": call[0],
                       "kind": call[1], "form": call[2], "budget_s": call[4],
                       "elapsed_s": round(elapsed, 3), "stack": stack})


@dataclass
class SlotState:
    """What an engine slot holds: "zero" (fresh segment), "known" (version, size), or
    "unknown" (a write to it failed)."""

    kind: str = "zero"
    version: int = 0
    size: int = 0


@dataclass
class AgentSide:
    """One client's segment in one agent and what its slots hold."""

    segment: Any = None            # SegmentInfo in use (None: look it up before the next op)
    identity: tuple[int, int] = (0, 0)   # (segment_id, epoch) the slot states belong to
    slots: list[SlotState] = field(default_factory=list)


@dataclass
class KeyState:
    """The versions a store key may hold now (None: absent) and their sizes."""

    possible: set[int | None] = field(default_factory=lambda: {None})
    sizes: dict[int, int] = field(default_factory=dict)

    @property
    def definite(self) -> int | None:
        """The one version it must hold (None if absent or uncertain)."""
        if len(self.possible) == 1:
            return next(iter(self.possible))
        return None


class SoakClient:
    """One client process: engine and store calls in a loop, every result checked."""

    def __init__(self, job: dict[str, Any], out: IO[str]) -> None:
        self.job = job
        self.config = SoakConfig(**{**job["config"], "value_sizes": tuple(
            job["config"]["value_sizes"]), "agent_targets": tuple(job["config"]["agent_targets"])})
        self.index = int(job["index"])
        self.master: str = job["master"]
        self.agents: list[str] = job["agents"]
        self.rng = random.Random(f"{self.config.seed}/{self.index}")
        self.fabric = self.index % 2 == 0
        self.registry = self.index % 4 in (1, 2)
        self._out, self._out_lock = out, threading.Lock()
        self.watchdog = Watchdog(self.config.grace, self.emit, self.index)
        self.calls: dict[str, Counter[str]] = {k: Counter() for k in OP_KINDS}
        self.failures: dict[str, Counter[str]] = {k: Counter() for k in OP_KINDS}
        self.outcomes: dict[str, Counter[str]] = {k: Counter() for k in OP_KINDS}
        self.corrupt: list[dict[str, Any]] = []
        self.lost: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.examples: dict[str, str] = {}     # "kind label" -> the first such failure
        self.version = 0
        self.slot_name = f"soak-{job['run']}-c{self.index}"
        self.sides = {agent: AgentSide() for agent in self.agents}
        self.keys = {f"soak-{job['run']}/c{self.index}/k{j}": KeyState()
                     for j in range(self.config.keys)}
        self.engine: Any = None
        self.store: Any = None

    # ------------------------------------------------------------ plumbing

    def emit(self, event: dict[str, Any]) -> None:
        with self._out_lock:
            self._out.write(json.dumps(event) + "\n")
            self._out.flush()

    def setup(self) -> None:
        from hixl.client.engine import Engine
        from hixl.client.mooncake import MooncakeDistributedStore

        config = self.config
        slot = config.slot_size
        self.engine = Engine("127.0.0.1", {"EnableUseFabricMem": "1" if self.fabric else "0"},
                             registry=self.master if self.registry else "")
        self.src, self.dst = _page_aligned(3 * slot), _page_aligned(3 * slot)
        self.engine.register(self.src)
        self.engine.register(self.dst)
        self.store = MooncakeDistributedStore(master_timeout=config.call_timeout,
                                              setup_timeout=config.settle,
                                              transfer_timeout=config.call_timeout)
        segment = max(32 * MiB, 8 * config.keys * slot)   # live values take <= 1/8
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 4 * slot, "tcp", "",
                              self.master)
        if rc != 0:
            raise HixlError(f"store setup returned {rc}: {self.store.last_error}")
        self.put_buf, self.get_buf = _page_aligned(3 * slot), _page_aligned(3 * slot)
        for buf in (self.put_buf, self.get_buf):
            rc = self.store.register_buffer(buf.ctypes.data, buf.nbytes)
            if rc != 0:
                raise HixlError(f"register_buffer returned {rc}: {self.store.last_error}")
        self.watchdog.start()

    def close(self) -> None:
        """Give back what this client took: its segments in the agents, its store segment
        (unmounting it drops the keys it holds)."""
        if self.store is not None:
            self.store.close()
        if self.engine is not None:
            for agent, side in self.sides.items():
                if side.segment is not None:
                    with contextlib.suppress(HixlError):
                        self.engine.release(agent, side.segment)
            self.engine.close()

    def next_version(self) -> int:
        self.version += 1
        return self.version

    def size(self) -> int:
        return self.rng.choice(self.config.value_sizes)

    def _fail(self, kind: str, label: str, why: str) -> None:
        self.failures[kind][label] += 1
        self.examples.setdefault(f"{kind} {label}", why[:400])

    # ------------------------------------------------------------ engine calls

    def _side(self, agent: str, kind: str) -> AgentSide:
        """This client's segment in `agent`: connect, find it by name or allocate it; a
        segment not seen before is fresh (zeros)."""
        from hixl.types import Perm

        side = self.sides[agent]
        if side.segment is not None:
            return side
        engine, config = self.engine, self.config
        with self.watchdog.call(kind, "connect", config.connect_budget):
            engine.ensure_connected(agent, config.call_timeout)
            mine = [s for s in engine.segments(agent) if s.name == self.slot_name]
            known = [s for s in mine if (s.segment_id, s.epoch) == side.identity]
            segment = (known or mine or [None])[0]
            if segment is None:
                segment = engine.allocate(agent, config.slots * config.slot_size, Perm.RW,
                                          name=self.slot_name)
        identity = (segment.segment_id, segment.epoch)
        if identity != side.identity:   # a new segment: all zeros
            side.identity = identity
            side.slots = [SlotState() for _ in range(config.slots)]
        side.segment = segment
        return side

    def _drop(self, agent: str) -> None:
        """After a failure: reconnect and look the segment up again before the next op."""
        self.sides[agent].segment = None
        with contextlib.suppress(HixlError):
            self.engine.disconnect(agent)

    @staticmethod
    def _label(exc: BaseException) -> str:
        status = getattr(exc, "status", None)
        return f"{status} {type(exc).__name__}" if status is not None else type(exc).__name__

    def engine_op(self, kind: str) -> None:
        from hixl.types import TransferOp, TransferOpDesc

        agent = self.rng.choice(self.agents)
        self.calls[kind]["calls"] += 1
        try:
            side = self._side(agent, kind)
        except HixlError as exc:
            self._fail(kind, self._label(exc), str(exc))
            log.warning("%s: connect to %s failed: %r", kind, agent, exc)
            self._drop(agent)
            return
        config, slot_size = self.config, self.config.slot_size
        chosen = self.rng.sample(range(config.slots), self.rng.randint(1, min(3, config.slots)))
        writing = kind == "engine_put"
        plan: list[tuple[int, SlotState, int]] = []   # (slot, state to expect/set, length)
        for slot in chosen:
            state = side.slots[slot]
            if writing:
                version, size = self.next_version(), self.size()
                plan.append((slot, SlotState("known", version, size), size))
            else:
                plan.append((slot, state, state.size if state.kind == "known" else self.size()))
        buf = self.src if writing else self.dst
        descs = []
        for j, (slot, state, length) in enumerate(plan):
            if writing:
                seed = value_seed(self.index, agent, slot, state.version)
                buf[j * slot_size:j * slot_size + length] = pattern(seed, length)
            descs.append(TransferOpDesc(buf.ctypes.data + j * slot_size,
                                        side.segment.base + slot * slot_size, length))
        op = TransferOp.WRITE if writing else TransferOp.READ
        try:
            with self.watchdog.call(kind, f"transfer x{len(descs)}", config.engine_budget):
                self.engine.transfer(agent, op, descs, config.call_timeout)
        except HixlError as exc:
            self._fail(kind, self._label(exc), str(exc))
            log.warning("%s to %s (our segment %s) failed: %r", kind, agent, side.identity, exc)
            if isinstance(exc, ParamInvalid):   # bad input? say what the engine knew
                with contextlib.suppress(HixlError):
                    log.warning("segments of %s now: %s", agent, [
                        (s.segment_id, s.epoch, s.name, hex(s.base), s.length)
                        for s in self.engine.segments(agent, refresh=False)])
            if writing:
                for slot, _, _ in plan:
                    side.slots[slot] = SlotState("unknown")
            self._drop(agent)
            return
        self.calls[kind]["items"] += len(plan)
        self.calls[kind]["ok"] += len(plan)
        if writing:
            for slot, state, _ in plan:
                side.slots[slot] = state
            return
        for j, (slot, state, length) in enumerate(plan):
            self._check_slot(agent, slot, state, buf[j * slot_size:j * slot_size + length],
                             side.identity)

    def _check_slot(self, agent: str, slot: int, state: SlotState, got: np.ndarray,
                    identity: tuple[int, int]) -> bool:
        if state.kind == "unknown":
            return True
        if state.kind == "zero":
            bad = np.flatnonzero(got)
        else:
            expected = pattern(value_seed(self.index, agent, slot, state.version), state.size)
            bad = np.flatnonzero(got != expected)
        if not bad.size:
            return True
        self.corrupt.append({"client": self.index, "where": "engine", "agent": agent,
                             "segment": list(identity), "slot": slot, "expected": state.kind,
                             "version": state.version, "length": len(got),
                             "first_bad_byte": int(bad[0]), "bad_bytes": int(bad.size)})
        return False

    # ------------------------------------------------------------ store calls

    def _expect(self, key: str, state: KeyState, got: np.ndarray) -> int | None:
        """The possible version `got` is (None if none: a corrupt read, recorded)."""
        for version in state.possible:
            if version is not None and state.sizes.get(version) == len(got) and np.array_equal(
                    got, pattern(value_seed(self.index, key, version), len(got))):
                return version
        self.corrupt.append({"client": self.index, "where": "store", "key": key,
                             "possible": sorted(v for v in state.possible if v is not None),
                             "absent_possible": None in state.possible, "length": len(got)})
        return None

    def _missing(self, key: str, state: KeyState, when: str) -> None:
        """The store says `key` is absent: a lost key unless it may be."""
        if None not in state.possible:
            self.lost.append({"client": self.index, "key": key, "when": when,
                              "possible": sorted(state.possible)})  # type: ignore[type-var]

    def _code(self, kind: str, code: int) -> None:
        from hixl.store_codes import code_name

        if code < 0:
            self._fail(kind, f"{code} {code_name(code)}", self.store.last_error)

    def store_put(self) -> None:
        kind, config, slot = "store_put", self.config, self.config.slot_size
        count = self.rng.choice((1, 1, 2, 3))
        keys = self.rng.sample(sorted(self.keys), count)
        versions = [self.next_version() for _ in keys]
        sizes = [self.size() for _ in keys]
        values = [pattern(value_seed(self.index, k, v), s)
                  for k, v, s in zip(keys, versions, sizes, strict=True)]
        fresh = all(self.keys[k].possible == {None} for k in keys)
        store = self.store
        self.calls[kind]["calls"] += 1
        self.calls[kind]["items"] += count
        if count > 1:
            form = "batch_put_from" if fresh else "batch_upsert_from"
            for j, value in enumerate(values):
                self.put_buf[j * slot:j * slot + len(value)] = value
            ptrs = [self.put_buf.ctypes.data + j * slot for j in range(count)]
            with self.watchdog.call(kind, form, config.store_budget):
                codes = getattr(store, form)(keys, ptrs, sizes)
        elif self.rng.random() < 0.5:
            form = "put" if fresh else "upsert"
            with self.watchdog.call(kind, form, config.store_budget):
                codes = [getattr(store, form)(keys[0], values[0].tobytes())]
        else:
            form = "put_from" if fresh else "upsert_from"
            self.put_buf[:sizes[0]] = values[0]
            with self.watchdog.call(kind, form, config.store_budget):
                codes = [getattr(store, form)(keys[0], self.put_buf.ctypes.data, sizes[0])]
        self.outcomes[kind][form] += 1
        for key, version, size, code in zip(keys, versions, sizes, codes, strict=True):
            state = self.keys[key]
            state.sizes[version] = size
            if code == 0:
                state.possible = {version}
                self.calls[kind]["ok"] += 1
            else:
                state.possible.add(version)   # it may have been committed all the same
                self._code(kind, code)
            self._prune(state)

    @staticmethod
    def _prune(state: KeyState) -> None:
        state.sizes = {v: s for v, s in state.sizes.items() if v in state.possible}

    def store_get(self) -> None:
        kind, config, slot = "store_get", self.config, self.config.slot_size
        count = self.rng.choice((1, 1, 2, 3))
        keys = self.rng.sample(sorted(self.keys), count)
        store = self.store
        self.calls[kind]["calls"] += 1
        self.calls[kind]["items"] += count
        results: list[tuple[int, np.ndarray | None]] = []
        if count == 1 and self.rng.random() < 0.5:
            form = "get"
            with self.watchdog.call(kind, form, config.store_budget):
                value = store.get(keys[0])
            if value:
                results.append((len(value), np.frombuffer(value, np.uint8)))
            else:
                results.append((store.last_error_code or -1, None))
        else:
            form = "get_into" if count == 1 else "batch_get_into"
            ptrs = [self.get_buf.ctypes.data + j * slot for j in range(count)]
            with self.watchdog.call(kind, form, config.store_budget):
                if count == 1:
                    codes = [store.get_into(keys[0], ptrs[0], slot)]
                else:
                    codes = store.batch_get_into(keys, ptrs, [slot] * count)
            for j, code in enumerate(codes):
                results.append((code, self.get_buf[j * slot:j * slot + code].copy()
                                if code > 0 else None))
        self.outcomes[kind][form] += 1
        for key, (code, got) in zip(keys, results, strict=True):
            state = self.keys[key]
            if got is not None:
                version = self._expect(key, state, got)
                if version is not None:
                    state.possible = {version}
                    self._prune(state)
                self.calls[kind]["ok"] += 1
            elif code == -704:   # OBJECT_NOT_FOUND
                self._missing(key, state, "get")
                self.outcomes[kind]["not found"] += 1
            else:
                self._code(kind, code)

    def store_remove(self) -> None:
        kind = "store_remove"
        key = self.rng.choice(sorted(self.keys))
        force = self.rng.random() < 0.5
        self.calls[kind]["calls"] += 1
        self.calls[kind]["items"] += 1
        with self.watchdog.call(kind, "remove", self.config.store_budget):
            code = self.store.remove(key, force=force)
        state = self.keys[key]
        self.outcomes[kind]["forced" if force else "plain"] += 1
        if code == 0:
            state.possible = {None}
            self.calls[kind]["ok"] += 1
        elif code == -704:
            self._missing(key, state, "remove")
            state.possible = {None}
            self.outcomes[kind]["not found"] += 1
        elif code == -706:   # OBJECT_HAS_LEASE: a recent read leased it; it stays
            self.outcomes[kind]["has lease"] += 1
        else:
            state.possible.add(None)
            self._code(kind, code)
        self._prune(state)

    # ------------------------------------------------------------ the loop and the check

    def loop(self, stop: threading.Event) -> None:
        ops: dict[str, Callable[[], None]] = {
            "engine_put": lambda: self.engine_op("engine_put"),
            "engine_get": lambda: self.engine_op("engine_get"),
            "store_put": self.store_put, "store_get": self.store_get,
            "store_remove": self.store_remove}
        while not stop.is_set():
            kind = self.rng.choices(OP_KINDS, OP_WEIGHTS)[0]
            ops[kind]()

    def verify(self) -> dict[str, int]:
        """Everything this client believes is there must be, byte for byte; waits (up to
        `settle`) for the cluster to serve again."""
        deadline = time.monotonic() + self.config.settle
        counts: Counter[str] = Counter()
        for agent, side in self.sides.items():
            if not side.slots:
                continue
            checked: set[int] = set()      # slots read already (a retry skips them)
            identity = side.identity
            while True:
                try:
                    current = self._side(agent, "engine_get")   # restarted since: zeros
                    if current.identity != identity:
                        checked, identity = set(), current.identity
                    slot_size = self.config.slot_size
                    for slot, state in enumerate(list(current.slots)):
                        if state.kind == "unknown" or slot in checked:
                            continue
                        length = state.size if state.kind == "known" else slot_size
                        with self.watchdog.call("engine_get", "verify", self.config.engine_budget):
                            self.engine.read(agent, self.dst.ctypes.data,
                                             current.segment.base + slot * slot_size, length,
                                             timeout=self.config.call_timeout)
                        self._check_slot(agent, slot, state, self.dst[:length],
                                         current.identity)
                        checked.add(slot)
                    break
                except HixlError as exc:
                    self._drop(agent)
                    if time.monotonic() > deadline:
                        self.errors.append(f"verify engine slots in {agent}: {exc}")
                        break
                    time.sleep(0.2)
            counts["engine_slots"] += len(checked)
        for key, state in sorted(self.keys.items()):
            while True:
                with self.watchdog.call("store_get", "verify", self.config.store_budget):
                    value = self.store.get(key)
                code = self.store.last_error_code if not value else 0
                if value:
                    self._expect(key, state, np.frombuffer(value, np.uint8))
                elif code == -704:
                    self._missing(key, state, "final check")
                elif code in TRANSIENT_STORE_CODES and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                else:
                    if None not in state.possible:
                        self.lost.append({"client": self.index, "key": key,
                                          "when": "final check",
                                          "unreadable": f"{code} {self.store.last_error}"})
                counts["store_keys" if state.definite is not None else
                       "store_keys_absent" if state.possible == {None} else
                       "store_keys_uncertain"] += 1
                break
        return dict(counts)

    def report(self, verified: dict[str, int]) -> dict[str, Any]:
        return {"event": "report", "client": self.index, "fabric": self.fabric,
                "registry": self.registry,
                "calls": {k: dict(v) for k, v in self.calls.items()},
                "failures": {k: dict(v) for k, v in self.failures.items()},
                "outcomes": {k: dict(v) for k, v in self.outcomes.items()},
                "corrupt": self.corrupt, "lost": self.lost, "hung": self.watchdog.hung,
                "verified": verified, "errors": self.errors, "examples": self.examples}


def client_main(job_text: str) -> int:
    """A client process: setup, 'ready'; loop until 'stop'; 'verify'; report; 'exit'."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    client = SoakClient(json.loads(job_text), sys.stdout)
    commands: queue.Queue[str] = queue.Queue()
    stop = threading.Event()

    def read_commands() -> None:
        for line in sys.stdin:
            command = line.strip()
            if command == "stop":
                stop.set()
            commands.put(command)
        stop.set()
        commands.put("exit")

    threading.Thread(target=read_commands, daemon=True, name="hixl-soak-commands").start()
    try:
        client.setup()
        client.emit({"event": "ready", "client": client.index})
        while commands.get() != "go":
            pass
        client.loop(stop)
        client.emit({"event": "stopped", "client": client.index})
        while commands.get() != "verify":
            pass
        verified = client.verify()
        client.emit(client.report(verified))
        while commands.get() != "exit":
            pass
    except Exception as exc:   # reported to the parent, which fails the run
        client.emit({"event": "error", "client": client.index,
                     "error": f"{exc!r}\n{traceback.format_exc()}"})
        return 1
    finally:
        client.close()
    return 0


# ---------------------------------------------------------------- the parent


class ClientProcess:
    """A soak client process and the events it reports (read by the launcher's thread)."""

    def __init__(self, index: int, job: dict[str, Any], workdir: str) -> None:
        self.index = index
        self.log_path = os.path.join(workdir, f"client-{index}.log")
        env = {k: v for k, v in os.environ.items()
               if k not in ("HIXL_AGENT", "HIXL_REGISTRY") and not k.startswith("MOONCAKE_")}
        env.update(PYTHONUNBUFFERED="1",
                   MC_HANDSHAKE_CONNECT_TIMEOUT=str(job["config"]["call_timeout"]))
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.hung: dict[int, dict[str, Any]] = {}
        self.process = DaemonProcess(
            [sys.executable, "-m", "hixl.tools.soak", "--client", json.dumps(job)],
            name=f"soak client {index}", env=env, log_path=self.log_path,
            stdin=subprocess.PIPE, on_line=self._event)
        self.proc = self.process.proc

    def _event(self, line: str) -> None:
        if not line:  # EOF: it exited
            self.events.put({"event": "exited", "client": self.index})
            return
        try:
            event = json.loads(line)
        except ValueError:
            return
        if event.get("event") == "hung":     # kept even if the client never returns
            self.hung[event["call"]] = event
        self.events.put(event)

    def send(self, command: str) -> None:
        self.process.send(command + "\n")

    def wait_for(self, name: str, timeout: float) -> dict[str, Any]:
        """The next `name` event; an "error"/"exited" event or the deadline raises."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise HixlError(f"client {self.index} sent no {name!r} within {timeout:g} s "
                                f"(see {self.log_path})") from None
            if event["event"] == name:
                return event
            if event["event"] in ("error", "exited"):
                raise HixlError(f"client {self.index} failed before {name!r}: "
                                f"{event.get('error', 'it exited')} (see {self.log_path})")

    def kill(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.kill()


def _merge(into: dict[str, Counter[str]], part: dict[str, dict[str, int]]) -> None:
    for kind, counts in part.items():
        into.setdefault(kind, Counter()).update(counts)


def run_soak(config: SoakConfig, progress: IO[str] | None = None) -> dict[str, Any]:
    """Run one soak; the report (see format_soak_report). Never raises for what the
    clients found: it is in the report, with "ok" False."""
    config.check()
    say: Callable[[str], None] = (lambda text: print(f"soak: {text}", file=progress,
                                                     flush=True)) if progress else (
        lambda text: None)
    workdir = tempfile.mkdtemp(prefix="hixl-soak-")
    master: ManagedMaster | None = None
    agents: list[ManagedAgent] = []
    clients: list[ClientProcess] = []
    chaos: Chaos | None = None
    errors: list[str] = []
    reports: list[dict[str, Any]] = []
    started = time.monotonic()
    run_seconds, evictions, store_at_end = 0.0, None, {}
    faults_wanted = config.kill_every > 0
    try:
        if config.master:
            target, agent_names = config.master, list(config.agent_targets)
        else:
            master = ManagedMaster(workdir)
            target = master.target
            pool = max(64 * MiB, 4 * config.clients * config.slots * config.slot_size)
            agents = [ManagedAgent(k, workdir, target, pool) for k in range(config.agents)]
            agent_names = [a.engine for a in agents]
        say(f"master {target}, agents {', '.join(agent_names)}; workdir {workdir}")
        run = os.urandom(4).hex()   # names this run's keys and segments
        for index in range(config.clients):
            job = {"index": index, "run": run, "master": target, "agents": agent_names,
                   "config": {**asdict(config), "value_sizes": list(config.value_sizes),
                              "agent_targets": list(config.agent_targets)}}
            clients.append(ClientProcess(index, job, workdir))
        for client in clients:
            client.wait_for("ready", config.settle + START_TIMEOUT_S)
        say(f"{len(clients)} clients ready; running {config.seconds:g} s"
            + (f", a fault every ~{config.kill_every:g} s" if faults_wanted else ", no faults"))
        run_start = time.monotonic()
        if faults_wanted and master is not None:
            chaos = Chaos(random.Random(config.seed), config.kill_every, config.max_downtime,
                          master, agents)
            chaos.start()
        for client in clients:
            client.send("go")
        # the run lasts `seconds`, and with faults until both an agent and the master
        # were killed at least once (at most 3x as long)
        while True:
            elapsed = time.monotonic() - run_start
            both = chaos is None or (chaos.counts["agent_kills"] and chaos.counts["master_kills"])
            if (elapsed >= config.seconds and both) or elapsed >= 3 * config.seconds:
                break
            if any(c.proc.poll() is not None for c in clients):
                break
            time.sleep(0.1)
        run_seconds = time.monotonic() - run_start
        if chaos is not None:
            chaos.halt.set()
            chaos.join()
            say(f"chaos stopped: {dict(chaos.counts)}; healing the cluster")
            chaos.heal()
            # a quiet while, so the keys' last puts are definite again before the check
            time.sleep(min(QUIET_S, config.seconds / 2))
        for client in clients:
            client.send("stop")
        stop_wait = config.store_budget + config.grace + config.connect_budget
        for client in clients:
            try:
                client.wait_for("stopped", stop_wait)
            except HixlError as exc:
                errors.append(str(exc))
        # what the store holds once the calls stopped: space, puts left unfinished
        at_end = _store_stats(target, config.call_timeout * 5) or {}
        store_at_end = {k: at_end[k] for k in STORE_STATS if k in at_end}
        if chaos is not None:
            # one last master restart while nobody writes: every key whose put returned
            # 0 must come back from the journal
            say("clients stopped; a last master restart, then the check")
            master.kill()   # type: ignore[union-attr]
            chaos.counts["final_master_restarts"] += 1
            chaos.events.append({"t": round(time.monotonic() - chaos.started_at, 3),
                                 "killed": "master", "target": target, "final": True,
                                 "restarted": chaos.restart(master, "master", target)})
        say("verifying what each client believes is stored")
        for client in clients:
            client.send("verify")
        for client in clients:
            try:
                reports.append(client.wait_for("report", config.settle + 4 * stop_wait))
            except HixlError as exc:
                errors.append(str(exc))
        for client in clients:
            client.send("exit")
        for client in clients:
            try:
                client.proc.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                errors.append(f"client {client.index} did not exit; killed")
        evictions = master.evictions() if master is not None else \
            _evictions(target, config.call_timeout * 5)
    finally:
        if chaos is not None:
            chaos.halt.set()
            chaos.join()
        for client in clients:
            client.kill()
        for agent in agents:
            agent.stop()
        if master is not None:
            master.stop()
    report = _report(config, reports, clients, chaos, errors, run_seconds,
                     time.monotonic() - started, evictions)
    report["store_at_end"] = store_at_end
    if report["ok"] and not config.keep_logs:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        report["workdir"] = workdir       # logs kept for a look
    return report


def _store_stats(master: str, timeout: float) -> dict[str, float] | None:
    """The master's store Stats (None if it does not answer)."""
    from hixl.client.store_client import MasterClient
    from hixl.store_types import MasterRpcError

    try:
        with MasterClient(master, timeout=timeout) as client:
            return client.stats()
    except MasterRpcError:
        return None


def _evictions(master: str, timeout: float) -> int | None:
    """How many objects a running master evicted since it started (an eviction drops
    keys by design)."""
    stats = _store_stats(master, timeout)
    return None if stats is None else int(stats.get("evicted", 0))


def _report(config: SoakConfig, reports: list[dict[str, Any]], clients: list[ClientProcess],
            chaos: Chaos | None, errors: list[str], run_seconds: float, total_seconds: float,
            evictions: int | None) -> dict[str, Any]:
    calls: dict[str, Counter[str]] = {k: Counter() for k in OP_KINDS}
    failures: dict[str, Counter[str]] = {k: Counter() for k in OP_KINDS}
    outcomes: dict[str, Counter[str]] = {k: Counter() for k in OP_KINDS}
    verified: Counter[str] = Counter()
    examples: dict[str, str] = {}
    corrupt: list[dict[str, Any]] = []
    lost: list[dict[str, Any]] = []
    for part in reports:
        _merge(calls, part["calls"])
        _merge(failures, part["failures"])
        _merge(outcomes, part["outcomes"])
        for label, text in part["examples"].items():
            examples.setdefault(label, f"client {part['client']}: {text}")
        verified.update(part["verified"])
        corrupt += part["corrupt"]
        lost += part["lost"]
        errors += [f"client {part['client']}: {e}" for e in part["errors"]]
    hung = [event for client in clients for event in client.hung.values()]
    missing = sorted({c.index for c in clients} - {r["client"] for r in reports})
    if missing:
        errors.append(f"no report from client(s) {missing}")
    faults = dict(chaos.counts) if chaos is not None else {}
    for name in ("agent_kills", "master_kills", "final_master_restarts", "restarts",
                 "restart_failures"):
        faults.setdefault(name, 0)
    if chaos is not None:
        errors += chaos.errors if faults["restart_failures"] else []
    if evictions:
        errors.append(f"the store evicted {evictions} objects: keys lost cannot be told from "
                      "evictions; give the clients more segment (fewer --keys or smaller "
                      "--value-sizes)")
    ok = not corrupt and not hung and not lost and not errors
    return {
        "config": {**asdict(config), "value_sizes": list(config.value_sizes),
                   "agent_targets": list(config.agent_targets)},
        "run_seconds": round(run_seconds, 3), "total_seconds": round(total_seconds, 3),
        "clients": [{"client": r["client"], "path": "fabric" if r["fabric"] else "socket",
                     "tables": "registry" if r["registry"] else "p2p"} for r in reports],
        "ops": {kind: dict(calls[kind]) for kind in OP_KINDS},
        "failures": {kind: dict(failures[kind]) for kind in OP_KINDS},
        "outcomes": {kind: dict(outcomes[kind]) for kind in OP_KINDS},
        "faults": faults, "fault_log": chaos.events if chaos is not None else [],
        "corrupt_reads": len(corrupt), "hung_calls": len(hung), "keys_lost": len(lost),
        "verified": dict(verified), "store_evictions": evictions,
        "details": {"corrupt": corrupt[:MAX_DETAILS], "lost": lost[:MAX_DETAILS],
                    "hung": hung[:MAX_DETAILS]},
        "failure_examples": dict(sorted(examples.items())),
        "errors": errors, "ok": ok,
        "rule": LOST_RULE,
    }


LOST_RULE = ("keys lost counts store keys whose last put returned 0 (and no removal since) "
             "that were missing or unreadable later; store values live in the clients' own "
             "segments, which are never killed (Mooncake semantics lose a value when its only "
             "holder dies), so only the master's restarts could lose one -- and must not (its "
             "journal). Engine slots in an agent that restarted are void (agent memory is "
             "not durable) and are not counted; every other slot must read back exactly.")


def format_soak_report(report: dict[str, Any]) -> str:
    """The report as a text table."""
    lines = [f"hixl soak: {report['config']['clients']} clients, "
             f"{len(report['config']['agent_targets']) or report['config']['agents']} agents, "
             f"{report['run_seconds']:.1f} s under load ({report['total_seconds']:.1f} s in "
             f"all), seed {report['config']['seed']}"]
    paths = ", ".join(f"c{c['client']} {c['path']}/{c['tables']}" for c in report["clients"])
    if paths:
        lines.append(f"clients: {paths}")
    faults = report["faults"]
    lines.append(f"faults: {faults['agent_kills']} agent kills, {faults['master_kills']} "
                 f"master kills (+{faults['final_master_restarts']} before the check), "
                 f"{faults['restarts']} restarts, {faults['restart_failures']} failed restarts")
    lines.append("")
    lines.append(f"{'operation':<14} {'calls':>8} {'ops/keys':>9} {'ok':>8}  failures by code")
    for kind in OP_KINDS:
        ops = report["ops"][kind]
        fails = report["failures"][kind]
        text = ", ".join(f"{label}: {n}" for label, n in sorted(fails.items(),
                                                                  key=lambda x: -x[1])) or "-"
        lines.append(f"{kind:<14} {ops.get('calls', 0):>8} {ops.get('items', 0):>9} "
                     f"{ops.get('ok', 0):>8}  {text}")
    for kind in OP_KINDS:
        outcome = report["outcomes"][kind]
        if outcome:
            lines.append(f"  {kind} forms/outcomes: "
                         + ", ".join(f"{k} {v}" for k, v in sorted(outcome.items())))
    verified = report["verified"]
    lines.append("")
    lines.append(f"verified at the end: {verified.get('store_keys', 0)} store keys (exact "
                 f"value), {verified.get('store_keys_absent', 0)} absent, "
                 f"{verified.get('store_keys_uncertain', 0)} uncertain (a failed call), "
                 f"{verified.get('engine_slots', 0)} engine slots; store evictions: "
                 f"{report['store_evictions']}")
    at_end = report.get("store_at_end") or {}
    if at_end:
        lines.append("store when the calls stopped: " + ", ".join(
            f"{k} {int(v)}" for k, v in at_end.items()))
    for name, label in (("corrupt_reads", "corrupt reads"), ("hung_calls", "hung calls"),
                        ("keys_lost", "keys lost")):
        value = report[name]
        lines.append(f"{label:<14} {value:>8}  (must be 0){'  <-- FAILED' if value else ''}")
    lines.append(f"rule: {report['rule']}")
    for kind in ("corrupt", "lost", "hung"):
        for item in report["details"][kind]:
            lines.append(f"  {kind}: {json.dumps(item)}")
    for error in report["errors"]:
        lines.append(f"error: {error}")
    if "workdir" in report:
        lines.append(f"logs kept in {report['workdir']}")
    lines.append("PASSED" if report["ok"] else "FAILED")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m hixl.tools.soak --client JOB`: one soak client process."""
    parser = argparse.ArgumentParser(prog="python -m hixl.tools.soak")
    parser.add_argument("--client", metavar="JOB", required=True,
                        help="run one client process of a soak (JSON job from the parent)")
    args = parser.parse_args(argv)
    return client_main(args.client)


if __name__ == "__main__":
    sys.exit(main())
