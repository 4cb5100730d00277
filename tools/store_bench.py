"""`hixl bench store`: the Mooncake-compatible KV store, side by side with Mooncake Store.

What a store user sees, per value size (64 KiB, 1 MiB, 8784 KiB by default) and call:
put, get, put_from, get_into and the batch forms put_batch, get_batch, batch_put_from,
batch_get_into (a batch of `batch` keys per call). The arrangement is the one Mooncake's
"segment in another process" figures use (docs REFERENCE §7): a master; a *segment
holder*, a separate store client process that contributes `global_segment_size` and
does nothing else; and the bench client in this process, which contributes nothing
(global_segment_size=0), so every byte it puts lands in the other process's memory and
every byte it gets comes from there. On one node hixl's client then writes the holder's
segment through the fabric path (mapped shared memory); across nodes it streams over TCP.

When `mooncake.store` imports (the optional extra `hixl[mooncake]`), Mooncake Store runs
in the same run with the same arrangement: its own `mooncake_master` (metadata
P2PHANDSHAKE, protocol tcp), its own holder process, its client in this process, the same
buffers, keys and calls; runs alternate between the two systems so machine noise hits both
alike, and every cell gets the ratio hixl/Mooncake. A Mooncake cell that fails is skipped
with its reason; without Mooncake our figures come alone, with a note.

Every cell is `runs` runs of one warm-up call plus `calls_for(bytes per call)` timed calls;
a cell reports the median over its runs of GB/s, keys/s and per-call p50/p99 latency. A
call's time is the store call alone: checking its bytes happens between calls, untimed.
Every byte is checked: each get's result against what was put (destinations zeroed before
the call), and after each put run every key of the run is read back and compared. A wrong
byte from hixl aborts the run (`StoreBenchFailure`). Keys are removed (force) after every
run, and each run waits until the pool has room for it below MAX_USAGE (a forced removal
frees space once no read of it may be in flight: at once for this client's own reads), so
the pool never fills.

**The caller-shaped workload** (`workload="lmcache"`): the calls LMCache's Mooncake
connector makes per request of `batch` KV chunks (256 KiB, 1 MiB, 2 MiB by default) on
its registered pinned buffer, with `ReplicateConfig(replica_num=1)`. *store*:
`batch_is_exist(keys)`, then `batch_put_from` of the keys it says are missing (all of
them: fresh keys). *retrieve*: `batch_is_exist(keys)` (all must be there), then
`batch_get_into(keys)` of chunks stored once before and never read since (no location
cache hit: each chunk is retrieved once, as a new request reusing a stored prefix reads
it). A request's time is both calls; every chunk is checked byte for byte.

`concurrency` > 1 runs each cell's calls on that many threads sharing the one client
(each thread reads into its own region of the destination buffer); a run's GB/s is then
all threads' bytes over its wall time. `journal` adds a side, hixl on a second master that
journals every put (fsync'd) with its own holder, and each put form's p50 there is set
against the in-memory master's (TARGET_JOURNAL).

`python -m hixl.tools.store_bench --holder hixl|mooncake --master HOST:PORT --host IP
--segment BYTES [--forever]` runs a segment holder (scripts/bench_multinode.py --store
starts the masters and holders on another simulated host this way);
`python -m hixl.tools.store_bench --workload lmcache [--sizes 256K,1M] [--batch N]
[--runs N] [--no-mooncake] [--json PATH]` runs the bench itself.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import IO, Any

import numpy as np

from hixl.processes import DaemonProcess, free_ports
from hixl.tools.bench import (
    KIB,
    MIB,
    BenchFailure,
    BenchRun,
    Progress,
    Timing,
    format_rate,
    format_table,
    human_size,
    local_address_towards,
    page_aligned,
)
from hixl.tools.daemons import HOLDER_READY, MOONCAKE_QUIET, HolderProcess

DEFAULT_SIZES = (64 * KIB, 1 * MIB, 8784 * KIB)
OPS = ("put", "get", "put_from", "get_into", "put_batch", "get_batch", "batch_put_from",
       "batch_get_into")
PUT_OPS = frozenset({"put", "put_from", "put_batch", "batch_put_from"})
BATCH_OPS = frozenset({"put_batch", "get_batch", "batch_put_from", "batch_get_into"})
INTO_OPS = frozenset({"get_into", "batch_get_into"})   # read into registered memory
SYSTEMS = ("hixl", "mooncake")
#: hixl on a master that journals every put (fsync'd, group commit), with --journal
JOURNAL_SYSTEM = "hixl-journal"
#: --journal's target: a journaled put's p50 at most this many times the in-memory one
TARGET_JOURNAL = 1.3
#: a repeated get_into of an unchanged key (its location cached: no master call) at most
#: this many times a raw copy of the same bytes in this process (memmove, same run)
TARGET_CACHED_GET = 1.5
#: the caller-shaped workload: LMCache's per-request calls (see the module docstring)
LMCACHE_OPS = ("lmcache_store", "lmcache_retrieve")
LMCACHE_SIZES = (256 * KIB, 1 * MIB, 2 * MIB)
WORKLOADS = {"calls": OPS, "lmcache": LMCACHE_OPS}

RUN_BYTES = 64 * MIB          # a run moves about this much ...
MIN_CALLS, MAX_CALLS = 5, 200  # ... in this many timed calls
#: a get run reads each stored key at least this often (the single forms take 8 keys in
#: turn): at every size, most of its reads are then repeated gets of a cached key, which
#: the cached-get target is about (8784 KiB values: 7 calls a run read no key twice)
REREADS = 3
WARMUP_CALLS = 1              # per run, not timed
LEASE_TTL_MS = 1000           # read lease of the masters the bench starts (both systems)
MAX_USAGE = 0.7               # keep the pool below this (both masters evict at 0.9)
ROOM_WAIT_S = 30.0            # longest wait for removed values' space to come back
HOLDER_BUFFER = 1 * MIB       # a holder's local_buffer_size: it moves no bytes itself
SHIFT_STEP, SHIFTS = 4160, 61  # where each call's values start in the source buffer
REMOVE_CHUNK = 512
START_TIMEOUT_S = 60.0
METADATA, PROTOCOL = "P2PHANDSHAKE", "tcp"
TARGET_ONE_NODE, TARGET_ACROSS_NODES = 5.0, 2.0
OBJECT_NOT_FOUND = -704


class StoreBenchFailure(BenchFailure):
    """hixl's store moved wrong bytes or failed a call: the run is aborted."""


class CellFailure(RuntimeError):
    """One system's call failed in a cell (a one-line reason)."""


# ---------------------------------------------------------------- configuration


@dataclass
class StoreBenchConfig:
    """What to measure; the defaults take 30-60 s on 2 cores (both systems)."""

    sizes: tuple[int, ...] = ()     # () : the workload's (DEFAULT_SIZES, LMCACHE_SIZES)
    batch: int = 8                  # keys per call of the batch forms
    runs: int = 3                   # the median over runs is reported
    run_bytes: int = RUN_BYTES      # bytes a run moves (calls: MIN_CALLS..MAX_CALLS)
    master: str | None = None       # a running hixl-master; None starts one here
    mooncake: bool = True           # measure Mooncake Store when it imports
    mooncake_master: str | None = None  # a running mooncake_master; None starts one here
    holders: bool = True            # start the segment holders here; False: already mounted
    local: str | None = None        # this side's IP; None: the one routing to the master
    workload: str = "calls"         # a key of WORKLOADS: every call form, or LMCache's calls
    concurrency: int = 1            # threads calling the one client at once (calls workload)
    journal: bool = False           # also hixl on a journaled master of its own

    def __post_init__(self) -> None:
        if not self.sizes:
            self.sizes = LMCACHE_SIZES if self.workload == "lmcache" else DEFAULT_SIZES

    @property
    def ops(self) -> tuple[str, ...]:
        return WORKLOADS[self.workload]

    def keys_per_call(self, op: str) -> int:
        return self.batch if op in BATCH_OPS or op in LMCACHE_OPS else 1

    def calls_for(self, call_bytes: int) -> int:
        """Timed calls per run: about run_bytes in all, within [MIN_CALLS, MAX_CALLS]."""
        return max(MIN_CALLS, min(MAX_CALLS, self.run_bytes // max(1, call_bytes)))

    def run_footprint(self, op: str, size: int) -> int:
        """Pool bytes one run of a cell holds at once."""
        call_bytes = self.keys_per_call(op) * size
        if op in PUT_OPS or op in LMCACHE_OPS:   # fresh keys every call
            return (WARMUP_CALLS + self.calls_for(call_bytes)) * call_bytes
        return self.batch * size  # a get cell reads `batch` stored keys over and over

    def segment_bytes(self) -> int:
        """The holder's global_segment_size: room for the largest run below MAX_USAGE."""
        largest = max(self.run_footprint(op, size) for op in self.ops for size in self.sizes)
        return math.ceil(largest / MAX_USAGE / MIB) * MIB + 16 * MIB

    def buffer_bytes(self) -> int:
        """The bench client's local_buffer_size: a batch of the largest values per calling
        thread and one more (Mooncake's put_batch of 8 x 8784 KiB fails with -600 in
        exactly one batch)."""
        return (self.concurrency + 1) * self.batch * max(self.sizes) + 16 * MIB

    def check(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, "
                             f"got {self.workload!r}")
        if not self.sizes or min(self.sizes) <= 0:
            raise ValueError("sizes must be positive")
        if self.batch <= 0 or self.runs <= 0 or self.run_bytes <= 0 or self.concurrency <= 0:
            raise ValueError("batch, runs, run_bytes and concurrency must be positive")
        if self.concurrency > 1 and self.workload != "calls":
            raise ValueError("--concurrency applies to the calls workload only")
        if self.journal and (self.master or not self.holders):
            raise ValueError("--journal starts a journaled hixl-master and its holder here: "
                             "it cannot be combined with --master or --no-holder")


# ---------------------------------------------------------------- verification


def verify(label: str, expected: np.ndarray, got: Any) -> None:
    """Raise StoreBenchFailure naming the first wrong byte unless `got` (bytes, a
    buffer or an array) holds exactly `expected`."""
    have = got if isinstance(got, np.ndarray) else np.frombuffer(got, dtype=np.uint8)
    if have.size != expected.size:
        raise StoreBenchFailure(f"{label}: WRONG LENGTH: expected {expected.size} bytes, "
                                f"got {have.size}")
    if not np.array_equal(have, expected):
        bad = int(np.flatnonzero(have != expected)[0])
        raise StoreBenchFailure(f"{label}: WRONG BYTES at offset {bad} of {expected.size}: "
                                f"expected {int(expected[bad])}, found {int(have[bad])}")


# ---------------------------------------------------------------- processes






def mooncake_store_unavailable() -> str | None:
    """Why Mooncake Store cannot be measured here, or None when `mooncake.store` imports."""
    for key, value in MOONCAKE_QUIET.items():
        os.environ.setdefault(key, value)
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:  # a missing libibverbs.so is an ImportError too
        return (f"mooncake.store does not import ({exc}); install the optional extra "
                "`pip install hixl[mooncake]`")
    except OSError as exc:
        return f"mooncake.store does not load: {exc}"
    return None


def mooncake_master_binary() -> str | None:
    """The `mooncake_master` executable the wheel ships (its package dir), else on PATH."""
    with contextlib.suppress(ImportError):
        import mooncake

        path = os.path.join(os.path.dirname(os.path.abspath(mooncake.__file__)),
                            "mooncake_master")
        if os.path.isfile(path):
            return path
    return shutil.which("mooncake_master")


def mooncake_master_command(binary: str, host: str, port: int, metrics_port: int) -> list[str]:
    """argv of a `mooncake_master` with the read lease the bench gives hixl-master too."""
    return [binary, f"-rpc_address={host}", f"-rpc_port={port}",
            f"-metrics_port={metrics_port}", "-enable_metric_reporting=false",
            f"-default_kv_lease_ttl={LEASE_TTL_MS}"]


def wait_port(host: str, port: int, timeout: float,
              alive: Callable[[], bool] = lambda: True) -> bool:
    """True once (host, port) accepts a connection; False after `timeout` or once `alive()`
    says the server process is gone. (mooncake_master prints no ready line of its own.)"""
    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.5):
            return True
        time.sleep(0.05)
    return False


class MooncakeMasterProcess(DaemonProcess):
    """A private `mooncake_master` on `host` (free ports), ready once its port accepts;
    its log in a temporary file, removed by stop()."""

    def __init__(self, binary: str, host: str = "127.0.0.1") -> None:
        port, metrics_port = free_ports(2, host)
        self.target = f"{host}:{port}"
        fd, log_path = tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")
        os.close(fd)
        super().__init__(mooncake_master_command(binary, host, port, metrics_port),
                         name="mooncake_master", log_path=log_path)
        if not wait_port(host, port, START_TIMEOUT_S, alive=self.alive):
            tail = self.tail(2000)
            self.stop()
            raise RuntimeError(f"mooncake_master did not start (status "
                               f"{self.proc.returncode}): {tail}")

    def stop(self, grace_s: float | None = None) -> int:
        status = super().stop(grace_s)
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
        return status


def _store_class(system: str) -> type:
    if system == "hixl":
        from hixl.client.mooncake import MooncakeDistributedStore
    else:
        from mooncake.store import MooncakeDistributedStore
    return MooncakeDistributedStore


def _replicate_config(system: str, **fields: Any) -> Any:
    """The system's own ReplicateConfig with `fields` set (as a caller builds it)."""
    if system == "hixl":
        from hixl.client.mooncake import ReplicateConfig
    else:
        from mooncake.store import ReplicateConfig
    config = ReplicateConfig()
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def _last_error(store: Any) -> str:
    """hixl's store says why a call failed; Mooncake's does not."""
    text = getattr(store, "last_error", "")
    return f": {text}" if text else ""


def holder_main(argv: Sequence[str] | None = None) -> int:
    """A segment holder: a store client contributing `--segment` bytes, doing nothing else;
    serves until its stdin closes (or forever), then unmounts."""
    parser = argparse.ArgumentParser(prog="python -m hixl.tools.store_bench")
    parser.add_argument("--holder", choices=SYSTEMS, required=True)
    parser.add_argument("--master", required=True, metavar="HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="the IP peers reach it at")
    parser.add_argument("--segment", type=int, required=True, help="global_segment_size")
    parser.add_argument("--forever", action="store_true",
                        help="serve until killed instead of until stdin closes")
    args = parser.parse_args(argv)
    if args.holder == "mooncake":
        reason = mooncake_store_unavailable()
        if reason is not None:
            print(f"store holder: {reason}", flush=True)
            return 1
    store = _store_class(args.holder)()
    rc = store.setup(args.host, METADATA, args.segment, HOLDER_BUFFER, PROTOCOL, "",
                     args.master)
    if rc != 0:
        print(f"store holder: {args.holder} setup returned {rc}{_last_error(store)}",
              flush=True)
        return 1
    print(f"{HOLDER_READY} {args.holder} {store.get_hostname()}", flush=True)
    if args.forever:
        threading.Event().wait()
    while sys.stdin.readline():
        pass
    store.close()
    return 0


# ---------------------------------------------------------------- one system under test


@dataclass
class Side:
    """One store implementation: its client in this process and where its master is."""

    system: str
    store: Any
    master: str
    stats: Any = None   # hixl: a MasterClient, to wait for pool room between runs
    segment: str = ""   # the holder's segment name, when this run started it


class _MemmoveReads:
    """The get_into forms as plain memmoves of values from where they sit in a mapping
    (`at`: key -> address): what the store calls move, without the store."""

    def __init__(self, at: dict[str, int]) -> None:
        self.at = at

    def get_into(self, key: str, ptr: int, size: int) -> int:
        ctypes.memmove(ptr, self.at[key], size)
        return size

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            ctypes.memmove(ptr, self.at[key], size)
        return sizes


class StoreBench(BenchRun):
    """The whole run: masters, holders, both clients, the cells."""

    def __init__(self, config: StoreBenchConfig, progress: IO[str] | None = None) -> None:
        config.check()
        self.config = config
        self.progress = Progress("hixl bench store", progress)
        self._stack = contextlib.ExitStack()
        self.sides: list[Side] = []
        self.mooncake_info: dict[str, Any] = {"measured": False, "reason": ""}
        self.cells: list[dict[str, Any]] = []
        self.prefix = f"hixl-store-bench-{uuid.uuid4().hex[:8]}"
        self._mapped: Any = None  # a memfd mapping: the source of the memmove baseline
        self._mapped_holds: list[tuple[str, int]] = []  # the values it holds now
        self._serial = 0

    # ---- set-up and tear-down

    def _open(self) -> None:
        from hixl.tools.daemons import MasterProcess

        config = self.config
        if config.master:
            self.master = config.master
        else:
            self._note("starting hixl-master")
            master = MasterProcess(log_level="WARNING",
                                   extra=[f"-default_kv_lease_ttl={LEASE_TTL_MS}"])
            self._stack.callback(master.close)
            self.master = master.target
        self.local = config.local or local_address_towards(self.master)
        largest = max(config.sizes)
        # values are cut from one random source at a per-call shift, so keys differ
        self.src = page_aligned(config.batch * largest + SHIFTS * SHIFT_STEP)
        self.src[:] = np.random.default_rng(20240601).integers(0, 256, self.src.size,
                                                               dtype=np.uint8)
        # one destination region per calling thread
        self.dst = page_aligned(config.concurrency * config.batch * largest)
        self.sides.append(self._open_hixl("hixl", self.master))
        if config.journal:
            self._note("starting a journaled hixl-master")
            data = tempfile.mkdtemp(prefix="hixl-store-bench-journal-")
            self._stack.callback(shutil.rmtree, data, True)
            journaled = MasterProcess(log_level="WARNING", extra=[
                f"-default_kv_lease_ttl={LEASE_TTL_MS}", "--data-dir", data])
            self._stack.callback(journaled.close)
            self.sides.append(self._open_hixl(JOURNAL_SYSTEM, journaled.target))
        mooncake = self._open_mooncake()
        if mooncake is not None:
            self.sides.append(mooncake)

    def _open_client(self, system: str, master: str) -> Any:
        """This process's client: no segment of its own, room for one batch of values."""
        store = _store_class(system)()
        self._stack.callback(store.close)
        rc = store.setup(self.local, METADATA, 0, self.config.buffer_bytes(), PROTOCOL, "",
                         master)
        if rc != 0:
            raise CellFailure(f"{system} client setup at master {master} returned {rc}"
                              f"{_last_error(store)}")
        for buf in (self.src, self.dst):
            rc = store.register_buffer(int(buf.ctypes.data), buf.nbytes)
            if rc != 0:
                raise CellFailure(f"{system} register_buffer({buf.nbytes}) returned {rc}"
                                  f"{_last_error(store)}")
        return store

    def _open_holder(self, system: str, master: str) -> str:
        self._note(f"starting the {system} segment holder")
        holder = HolderProcess(system, master, self.local, self.config.segment_bytes())
        self._stack.callback(holder.stop)
        return holder.segment

    def _open_hixl(self, system: str, master: str) -> Side:
        from hixl.client.store_client import MasterClient
        from hixl.control import node_identity

        segment = self._open_holder("hixl", master) if self.config.holders else ""
        try:
            store = self._open_client("hixl", master)
        except CellFailure as exc:
            raise StoreBenchFailure(str(exc)) from None
        stats = MasterClient(master)
        self._stack.callback(stats.close)
        mounted = [m.segment for m in stats.list_segments() if m.live]
        if not mounted:
            raise StoreBenchFailure(
                f"no segment is mounted at hixl-master {master}: start a holder there "
                f"(`python -m hixl.tools.store_bench --holder hixl --master {master} "
                f"--host IP --segment {self.config.segment_bytes()}`) or drop --no-holder")
        if system == "hixl":
            here = node_identity()
            self.across_nodes = all(s.node_id != here for s in mounted)
            self.holder_segments = sorted({s.engine for s in mounted})
        return Side(system, store, master, stats, segment)

    def _open_mooncake(self) -> Side | None:
        """Mooncake Store in the same arrangement, or None with the reason noted."""
        config, info = self.config, self.mooncake_info
        reason = None if config.mooncake else "not asked for (--no-mooncake)"
        reason = reason or mooncake_store_unavailable()
        binary = mooncake_master_binary()
        if reason is None and not config.mooncake_master and binary is None:
            reason = "no mooncake_master executable (not in the mooncake package nor on PATH)"
        if reason is None and not config.holders and not config.mooncake_master:
            reason = ("--no-holder needs --mooncake-master: a Mooncake master whose holder is "
                      "mounted already")
        if reason is not None:
            info["reason"] = reason
            return None
        try:
            if config.mooncake_master:
                master = config.mooncake_master
            else:
                self._note("starting mooncake_master")
                assert binary is not None
                process = MooncakeMasterProcess(binary)
                self._stack.callback(process.stop)
                master = process.target
            segment = self._open_holder("mooncake", master) if config.holders else ""
            store = self._open_client("mooncake", master)
        except (CellFailure, RuntimeError, OSError) as exc:
            info["reason"] = f"set-up failed: {exc}"
            return None
        from hixl.tools.mooncake_baseline import version

        info.update(measured=True, version=version(), master=master, metadata=METADATA,
                    protocol=PROTOCOL, segment=segment)
        return Side("mooncake", store, master, None, segment)

    # ---- progress

    def _note(self, text: str) -> None:
        self.progress.note(text)

    # ---- the run

    def run(self) -> dict[str, Any]:
        config = self.config
        self.progress.start(len(config.sizes) * len(config.ops))
        for size in config.sizes:
            for op in config.ops:
                self.progress.advance(f"{op} {human_size(size)}")
                self._cell(op, size)
        self.progress.close()
        return {
            "version": 1,
            "kind": "store",
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                     "python": platform.python_version()},
            "config": {**asdict(config), "sizes": list(config.sizes)},
            "master": self.master,
            "local": self.local,
            "across_nodes": self.across_nodes,
            "holder_segments": self.holder_segments,
            "segment_bytes": config.segment_bytes(),
            "mooncake": self.mooncake_info,
            "cells": self.cells,
            # the targets are per call form; the caller-shaped workload reports ratios only
            "targets": (evaluate_store_targets(self.cells, across_nodes=self.across_nodes)
                        if config.workload == "calls" else []),
            "verified": all(c["verified"] for c in self.cells if c["system"] != "mooncake"),
        }

    def _cell(self, op: str, size: int) -> None:
        """Every system's runs of one cell, alternating run by run."""
        config = self.config
        keys = config.keys_per_call(op)
        timings: dict[str, list[Timing]] = {side.system: [] for side in self.sides}
        errors: dict[str, str] = {}
        stored: dict[str, list[tuple[str, int]]] = {}
        try:
            if op not in PUT_OPS and op not in LMCACHE_OPS:
                for side in self.sides:
                    with self._guard(side, errors):
                        stored[side.system] = self._store_values(side, size, config.batch)
            copies: list[Timing] = []
            for _ in range(config.runs):
                for side in self.sides:
                    if side.system in errors:
                        continue
                    with self._guard(side, errors):
                        timings[side.system].append(self._one_run(side, op, size, stored))
                if op in INTO_OPS and "hixl" in stored:
                    copies.append(self._copy_run(op, size, stored["hixl"]))
        finally:
            for side in self.sides:
                if side.system in stored:
                    with self._guard(side, errors):
                        self._remove(side, [k for k, _ in stored[side.system]])
        cells = {}
        for side in self.sides:
            cell: dict[str, Any] = {"system": side.system, "op": op, "size": size,
                                    "batch": keys}
            if side.system in errors:
                cell.update(skipped=errors[side.system], verified=False)
            else:
                cell.update(summarize(timings[side.system], size * keys, keys), verified=True)
            cells[side.system] = self._record(cell)
        ours, theirs = cells["hixl"], cells.get("mooncake")
        if theirs is not None and "skipped" not in theirs and theirs["gbps"] > 0:
            ours.update(mooncake_gbps=theirs["gbps"], mooncake_p50_us=theirs["p50_us"],
                        vs_mooncake=ours["gbps"] / theirs["gbps"],
                        vs_mooncake_p50=ours["p50_gbps"] / theirs["p50_gbps"])
        if copies and "skipped" not in ours:
            copy_p50 = summarize(copies, size * keys, keys)["p50_us"]
            ours.update(copy_p50_us=copy_p50, vs_copy_p50=ours["p50_us"] / copy_p50)
        journaled = cells.get(JOURNAL_SYSTEM)
        if journaled is not None:
            ours.update(journal_p50_us=journaled["p50_us"],
                        journal_vs_memory_p50=journaled["p50_us"] / ours["p50_us"])

    def _copy_run(self, op: str, size: int, stored: list[tuple[str, int]]) -> Timing:
        """The baseline of a get_into cell: its run (_get_run: the same keys in turn, the
        same zeroed destinations, the same check after each call) with the store call
        replaced by plain memmoves of the same values from a mapped memfd (the kind of
        memory a holder's segment is), one per key, from where they sit there; the memfd
        is written once per cell, as a put writes values (streamed, not left in cache).
        So both read their source from cache or from memory alike: a baseline timed in a
        tighter loop than the get's would keep its source in cache while the get's is
        evicted by the checks between calls."""
        from hixl.memory import ShmSegment, copy_moves

        if self._mapped is None:  # batch x the largest size: every cell's values
            self._mapped = ShmSegment(self.config.batch * max(self.config.sizes))
            self._stack.callback(self._mapped.close)
        at = {key: self._mapped.addr + slot * size for slot, (key, _) in enumerate(stored)}
        if self._mapped_holds != stored:
            base = int(self.src.ctypes.data)
            copy_moves([(at[key], base + offset, size) for key, offset in stored], stream=True)
            self._mapped_holds = stored
        return self._get_run(Side("memmove", _MemmoveReads(at), ""), op, size, stored)

    def _one_run(self, side: Side, op: str, size: int,
                 stored: dict[str, list[tuple[str, int]]]) -> Timing:
        if op in PUT_OPS:
            return self._put_run(side, op, size)
        if op in LMCACHE_OPS:
            return self._lmcache_run(side, op, size)
        return self._get_run(side, op, size, stored[side.system])

    @contextlib.contextmanager
    def _guard(self, side: Side, errors: dict[str, str]) -> Iterator[None]:
        """One step of a system's cell: hixl's failures abort the run; Mooncake's (any
        error, wrong bytes included) skip its cell, with a one-line reason."""
        try:
            yield
        except (CellFailure, StoreBenchFailure) as exc:
            if side.system != "mooncake":
                raise StoreBenchFailure(str(exc)) from None
            errors.setdefault(side.system, str(exc).splitlines()[0])
        except Exception as exc:
            if side.system != "mooncake":
                raise
            errors.setdefault(side.system, f"{type(exc).__name__}: {exc}".splitlines()[0])

    def _record(self, cell: dict[str, Any]) -> dict[str, Any]:
        self.cells.append(cell)
        return cell

    # ---- keys and values

    def _values(self, calls: int, keys: int, size: int) -> list[list[tuple[str, int]]]:
        """Fresh (key, source offset) pairs for `calls` calls of `keys` keys each."""
        out = []
        for _ in range(calls):
            self._serial += 1
            shift = (self._serial % SHIFTS) * SHIFT_STEP
            out.append([(f"{self.prefix}/{self._serial}/{j}", j * size + shift)
                        for j in range(keys)])
        return out

    def _expected(self, offset: int, size: int) -> np.ndarray:
        return self.src[offset:offset + size]

    def _store_values(self, side: Side, size: int, count: int) -> list[tuple[str, int]]:
        """`count` values stored for a get cell (one batch_put_from, untimed)."""
        [pairs] = self._values(1, count, size)
        self._make_room(side, count * size)
        self._call_put(side, "batch_put_from", pairs, size)
        return pairs

    def _remove(self, side: Side, keys: list[str]) -> None:
        for start in range(0, len(keys), REMOVE_CHUNK):
            chunk = keys[start:start + REMOVE_CHUNK]
            codes = side.store.batch_remove(chunk, True)
            bad = [c for c in codes if c not in (0, OBJECT_NOT_FOUND)]
            if bad:
                raise CellFailure(f"{side.system} batch_remove returned {bad[0]}"
                                  f"{_last_error(side.store)}")

    def _make_room(self, side: Side, need: int) -> None:
        """Wait until the pool can take `need` more bytes below MAX_USAGE (hixl frees a
        removed value's space once no read of it may be in flight: at once for values
        only this client read; Mooncake at once)."""
        if side.stats is None:
            return
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            stats = side.stats.stats()
            if stats["used"] + need <= MAX_USAGE * stats["capacity"]:
                return
            if time.monotonic() > deadline:
                raise CellFailure(
                    f"{side.system}: the pool ({stats['capacity']:.0f} bytes, "
                    f"{stats['used']:.0f} used) has no room for {need} bytes after "
                    f"{ROOM_WAIT_S:g} s; give the holder a larger segment (this run needs "
                    f"{self.config.segment_bytes()})")
            time.sleep(0.02)

    # ---- calls

    def _call_put(self, side: Side, op: str, pairs: list[tuple[str, int]], size: int) -> None:
        """One put-family call storing `pairs`; CellFailure unless every key returned 0."""
        store, src = side.store, self.src
        keys = [k for k, _ in pairs]
        if op == "put":
            codes = [store.put(keys[0], memoryview(src[pairs[0][1]:pairs[0][1] + size]))]
        elif op == "put_from":
            codes = [store.put_from(keys[0], int(src.ctypes.data) + pairs[0][1], size)]
        elif op == "put_batch":
            codes = [store.put_batch(keys, [memoryview(src[o:o + size]) for _, o in pairs])]
        else:
            base = int(src.ctypes.data)
            codes = list(store.batch_put_from(keys, [base + o for _, o in pairs],
                                              [size] * len(pairs)))
        if any(c != 0 for c in codes):
            raise CellFailure(f"{side.system} {op}({human_size(size)} x{len(pairs)}) returned "
                              f"{codes if len(codes) > 1 else codes[0]}{_last_error(store)}")

    def _call_get(self, side: Side, op: str, pairs: list[tuple[str, int]], size: int,
                  thread: int = 0) -> list[Any]:
        """One get-family call; per key what came back (bytes, or a view of the calling
        thread's region of dst)."""
        region = self._region(thread, size * len(pairs))
        keys, ptrs = self._get_args(pairs, region, size)
        return self._get_results(side, op, self._get_call(side, op, keys, ptrs, size),
                                 region, size)

    @staticmethod
    def _get_args(pairs: list[tuple[str, int]], region: np.ndarray, size: int
                  ) -> tuple[list[str], list[int]]:
        """The keys of a get call and where each lands in `region`."""
        base = int(region.ctypes.data)
        return [k for k, _ in pairs], [base + j * size for j in range(len(pairs))]

    @staticmethod
    def _get_call(side: Side, op: str, keys: list[str], ptrs: list[int], size: int
                  ) -> list[Any]:
        """The store call alone (what a get cell times): the values, or per key a code."""
        store = side.store
        if op == "get":
            return [store.get(keys[0])]
        if op == "get_batch":
            return list(store.get_batch(keys))
        if op == "get_into":
            return [store.get_into(keys[0], ptrs[0], size)]
        return list(store.batch_get_into(keys, ptrs, [size] * len(keys)))

    @staticmethod
    def _get_results(side: Side, op: str, got: list[Any], region: np.ndarray, size: int
                     ) -> list[Any]:
        """Per key what came back: the value, or the view of `region` it was read into
        (CellFailure unless every into-call read `size` bytes)."""
        if op not in INTO_OPS:
            return got
        if any(c != size for c in got):
            raise CellFailure(f"{side.system} {op}({human_size(size)} x{len(got)}) returned "
                              f"{got if len(got) > 1 else got[0]} (expected {size})"
                              f"{_last_error(side.store)}")
        return [region[j * size:(j + 1) * size] for j in range(len(got))]

    def _check(self, side: Side, op: str, pairs: list[tuple[str, int]], size: int,
               results: list[Any]) -> None:
        for (key, offset), got in zip(pairs, results, strict=True):
            verify(f"{side.system} {op} {human_size(size)} key {key}",
                   self._expected(offset, size), got)

    def _region(self, thread: int, length: int) -> np.ndarray:
        """The calling thread's part of dst (each thread reads into its own)."""
        start = thread * (self.dst.size // self.config.concurrency)
        return self.dst[start:start + length]

    def _timed(self, count: int, call: Callable[[int, int], Callable[[], None] | None],
               prepare: Callable[[int, int], None] | None = None) -> Timing:
        """`call(index, thread)` for each index: the first WARMUP_CALLS untimed, the rest
        timed, on `concurrency` threads taking indexes in turn (started together; a
        run's time is then the wall time until the last finished). `call` may return a
        check, run after its call's time was taken; `prepare(index, thread)` runs
        before it, untimed."""
        clock = time.perf_counter_ns

        def calls(thread: int, indexes: range, timed: list[int] | None) -> None:
            for index in indexes:
                if prepare is not None:
                    prepare(index, thread)
                began = clock()
                check = call(index, thread)
                if timed is not None:
                    timed.append(clock() - began)
                if check is not None:
                    check()
        calls(0, range(min(WARMUP_CALLS, count)), None)
        threads = self.config.concurrency
        latencies: list[list[int]] = [[] for _ in range(threads)]

        def work(thread: int) -> None:
            calls(thread, range(WARMUP_CALLS + thread, count, threads), latencies[thread])
        if threads == 1:
            work(0)
            return Timing(latencies[0], sum(latencies[0]) / 1e9)
        failures: list[BaseException] = []
        start = threading.Barrier(threads + 1)

        def thread_main(thread: int) -> None:
            start.wait()
            try:
                work(thread)
            except BaseException as exc:  # re-raised in the bench's own thread below
                failures.append(exc)
        workers = [threading.Thread(target=thread_main, args=(t,), daemon=True,
                                    name=f"store-bench-{t}") for t in range(threads)]
        for worker in workers:
            worker.start()
        start.wait()
        began = clock()
        for worker in workers:
            worker.join()
        wall = clock() - began
        if failures:
            raise failures[0]
        return Timing([ns for per_thread in latencies for ns in per_thread], wall / 1e9)

    def _put_run(self, side: Side, op: str, size: int) -> Timing:
        """WARMUP_CALLS + calls puts of fresh keys; then every key is read back, checked
        and removed."""
        keys = self.config.keys_per_call(op)
        calls = self.config.calls_for(keys * size)
        self._make_room(side, (WARMUP_CALLS + calls) * keys * size)
        plan = self._values(WARMUP_CALLS + calls, keys, size)
        try:
            timing = self._timed(len(plan), lambda index, _: self._call_put(
                side, op, plan[index], size))
            everything = [pair for pairs in plan for pair in pairs]
            for start in range(0, len(everything), self.config.batch):
                chunk = everything[start:start + self.config.batch]
                self.dst[:len(chunk) * size] = 0
                self._check(side, f"{op} (read back)", chunk,
                            size, self._call_get(side, "batch_get_into", chunk, size))
        finally:
            self._remove(side, [k for pairs in plan for k, _ in pairs])
        return timing

    def _lmcache_run(self, side: Side, op: str, size: int) -> Timing:
        """WARMUP_CALLS + calls requests of `batch` fresh chunks, the calls LMCache's
        connector makes (module docstring); every chunk checked, then removed."""
        keys = self.config.keys_per_call(op)
        calls = self.config.calls_for(keys * size)
        self._make_room(side, (WARMUP_CALLS + calls) * keys * size)
        plan = self._values(WARMUP_CALLS + calls, keys, size)
        store, config = side.store, _replicate_config(side.system, replica_num=1)
        src, dst = int(self.src.ctypes.data), int(self.dst.ctypes.data)
        latencies: list[int] = []
        clock = time.perf_counter_ns
        try:
            if op == "lmcache_retrieve":   # stored once before, untimed
                for pairs in plan:
                    self._call_put(side, "batch_put_from", pairs, size)
            for index, pairs in enumerate(plan):
                names = [k for k, _ in pairs]
                if op == "lmcache_retrieve":
                    self.dst[:keys * size] = 0
                began = clock()
                exist = list(store.batch_is_exist(names))
                if op == "lmcache_store":
                    missing = [j for j, found in enumerate(exist) if found == 0]
                    codes = list(store.batch_put_from(
                        [names[j] for j in missing], [src + pairs[j][1] for j in missing],
                        [size] * len(missing), config))
                    good = codes == [0] * len(missing) and len(missing) == keys
                else:
                    codes = list(store.batch_get_into(
                        names, [dst + j * size for j in range(keys)], [size] * keys))
                    good = exist == [1] * keys and codes == [size] * keys
                elapsed = clock() - began
                if not good:
                    raise CellFailure(f"{side.system} {op}({human_size(size)} x{keys}): "
                                      f"batch_is_exist {exist}, then {codes}"
                                      f"{_last_error(store)}")
                if index >= WARMUP_CALLS:
                    latencies.append(elapsed)
                if op == "lmcache_retrieve":
                    self._check(side, op, pairs, size,
                                [self.dst[j * size:(j + 1) * size] for j in range(keys)])
            if op == "lmcache_store":
                everything = [pair for pairs in plan for pair in pairs]
                for start in range(0, len(everything), self.config.batch):
                    chunk = everything[start:start + self.config.batch]
                    self.dst[:len(chunk) * size] = 0
                    self._check(side, f"{op} (read back)", chunk, size,
                                self._call_get(side, "batch_get_into", chunk, size))
        finally:
            self._remove(side, [k for pairs in plan for k, _ in pairs])
        return Timing(latencies, sum(latencies) / 1e9)

    def _get_run(self, side: Side, op: str, size: int, stored: list[tuple[str, int]]) -> Timing:
        """WARMUP_CALLS + calls gets of the stored keys (single forms take them in turn),
        each checked byte for byte after it returns."""
        keys = self.config.keys_per_call(op)
        calls = max(self.config.calls_for(keys * size), REREADS * (len(stored) // keys))

        prepared: dict[int, tuple[Any, ...]] = {}

        def prepare(index: int, thread: int) -> None:
            """Untimed: the call's keys and destinations (zeroed: a read that wrote
            nothing fails its check)."""
            pairs = stored if keys > 1 else [stored[index % len(stored)]]
            region = self._region(thread, keys * size)
            if op in INTO_OPS:
                region[:] = 0
            prepared[thread] = (pairs, region, *self._get_args(pairs, region, size))

        def call(_: int, thread: int) -> Callable[[], None]:
            pairs, region, names, ptrs = prepared[thread]
            got = self._get_call(side, op, names, ptrs, size)
            return lambda: self._check(side, op, pairs, size,
                                       self._get_results(side, op, got, region, size))
        return self._timed(WARMUP_CALLS + calls, call, prepare)


# ---------------------------------------------------------------- statistics and targets


_MEDIAN_KEYS = ("gbps", "ops_per_s", "calls_per_s", "mean_us", "p50_us", "p99_us", "p50_gbps")


def summarize(timings: list[Timing], call_bytes: int, keys: int) -> dict[str, Any]:
    """A cell's figures: the median over its runs of each run's summary."""
    runs = [t.summary(call_bytes, keys) for t in timings]
    out: dict[str, Any] = {key: statistics.median(r[key] for r in runs) for key in _MEDIAN_KEYS}
    out.update(runs=len(runs), calls=sum(r["calls"] for r in runs),
               runs_gbps=[r["gbps"] for r in runs])
    return out


def evaluate_store_targets(cells: list[dict[str, Any]], *, across_nodes: bool
                           ) -> list[dict[str, Any]]:
    """Every hixl cell measured against Mooncake in the same run: >= 5x its GB/s on one
    node (both with the segment in another process), >= 2x across nodes over TCP; with
    --journal, every put form's p50 on the journaled master <= 1.3x the in-memory one;
    get_into forms of cached keys <= 1.5x a memmove of the same bytes (p50)."""
    limit = TARGET_ACROSS_NODES if across_nodes else TARGET_ONE_NODE
    name = (f"across nodes (tcp): >= {limit:g}x Mooncake Store" if across_nodes
            else f"one node: >= {limit:g}x Mooncake Store")
    ours = [c for c in cells if c["system"] == "hixl"]
    journal = f"journal: put p50 <= {TARGET_JOURNAL:g}x in memory"
    cached = f"cached get: p50 <= {TARGET_CACHED_GET:g}x memmove"
    return [{"target": name, "op": c["op"], "size": c["size"], "batch": c["batch"],
             "metric": "vs_mooncake", "value": c["vs_mooncake"], "limit": limit,
             "met": c["vs_mooncake"] >= limit}
            for c in ours if "vs_mooncake" in c] + [
            {"target": journal, "op": c["op"], "size": c["size"], "batch": c["batch"],
             "metric": "journal_vs_memory_p50", "value": c["journal_vs_memory_p50"],
             "limit": TARGET_JOURNAL, "met": c["journal_vs_memory_p50"] <= TARGET_JOURNAL}
            for c in ours if "journal_vs_memory_p50" in c and c["op"] in PUT_OPS] + [
            {"target": cached, "op": c["op"], "size": c["size"], "batch": c["batch"],
             "metric": "vs_copy_p50", "value": c["vs_copy_p50"], "limit": TARGET_CACHED_GET,
             "met": c["vs_copy_p50"] <= TARGET_CACHED_GET}
            for c in ours if "vs_copy_p50" in c]


# ---------------------------------------------------------------- report


def format_store_report(report: dict[str, Any]) -> str:
    """The human-readable table: per cell hixl and Mooncake side by side, then targets."""
    where = "across nodes (tcp)" if report["across_nodes"] else "one node"
    mooncake = report["mooncake"]
    out = [f"hixl bench store  {where}: client {report['local']} (no segment of its own) -> "
           f"segment in another process ({', '.join(report['holder_segments'])}), hixl-master "
           f"{report['master']}  {report['host']['cpus']} CPUs"]
    if mooncake["measured"]:
        out.append(f"side by side: Mooncake Store {mooncake['version']} ({mooncake['protocol']},"
                   f" {mooncake['metadata']}, master {mooncake['master']}), same arrangement")
    else:
        out.append(f"Mooncake Store not measured: {mooncake['reason']}")
    config = report["config"]
    if config.get("concurrency", 1) > 1:
        out.append(f"{config['concurrency']} threads call the client at once: GB/s and "
                   f"keys/s are all threads' together, latencies per call")
    journal = config.get("journal", False)
    if journal:
        out.append("with a second hixl-master that journals every put (fsync'd; its own "
                   "holder): p50 and its ratio to the in-memory master's in the last columns")
    by_key = {(c["system"], c["op"], c["size"]): c for c in report["cells"]}
    rows, skipped = [], []
    for cell in report["cells"]:
        if cell["system"] != "hixl":
            continue
        theirs = by_key.get(("mooncake", cell["op"], cell["size"]))
        row = [cell["op"], human_size(cell["size"]), str(cell["batch"]), str(cell["calls"]),
               f"{cell['gbps']:.3f}", format_rate(cell["ops_per_s"]), f"{cell['p50_us']:.0f}",
               f"{cell['p99_us']:.0f}"]
        if theirs is not None and "skipped" not in theirs:
            row += [f"{theirs['gbps']:.3f}", format_rate(theirs["ops_per_s"]),
                    f"{theirs['p50_us']:.0f}", f"{theirs['p99_us']:.0f}",
                    f"{cell['vs_mooncake']:.2f}x"]
        else:
            row += ["-"] * 5
            if theirs is not None:
                skipped.append(f"mooncake {cell['op']} {human_size(cell['size'])}: skipped: "
                               f"{theirs['skipped']}")
        if journal:
            row += ([f"{cell['journal_p50_us']:.0f}", f"{cell['journal_vs_memory_p50']:.2f}x"]
                    if "journal_p50_us" in cell else ["-", "-"])
        rows.append(row)
    columns = ["op", "size", "batch", "calls", "GB/s", "keys/s", "p50 us", "p99 us", "MC GB/s",
               "MC keys/s", "MC p50", "MC p99", "ratio"]
    out += ["", format_table(columns + (["jrnl p50", "jrnl/mem"] if journal else []), rows),
            f"(medians over {report['config']['runs']} runs; "
            + ("a request's time is its batch_is_exist and its batch_put_from / batch_get_into"
               if report["config"].get("workload") == "lmcache"
               else "a call's time is the store call alone")
            + "; ratio: hixl / Mooncake GB/s)"]
    out += skipped
    targets = [[t["target"], t["op"], human_size(t["size"]), f"{t['value']:.2f}x",
                "met" if t["met"] else "MISSED"] for t in report["targets"]]
    if targets:
        out += ["", "targets", format_table(["target", "op", "size", "ratio", ""], targets)]
    out += ["", "correctness: every value read back and compared byte for byte"
            if report["verified"] else "correctness: FAILED"]
    return "\n".join(out)


def run_store_bench(config: StoreBenchConfig, progress: IO[str] | None = None
                    ) -> dict[str, Any]:
    """Run the store benchmark; raises StoreBenchFailure on wrong bytes or a failed call."""
    with StoreBench(config, progress) as bench:
        return bench.run()


def _sizes_flag(text: str) -> tuple[int, ...]:
    """argparse type of --sizes / --run-bytes: sizes like 256K,1M, refused by name."""
    from hixl.sizes import parse_size_list

    try:
        return parse_size_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count_flag(text: str) -> int:
    """argparse type of --batch / --runs: a positive integer, refused by name."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def bench_main(argv: Sequence[str]) -> int:
    """`python -m hixl.tools.store_bench --workload lmcache|calls ...`: the bench itself
    (as `hixl bench store`), the caller-shaped workload included."""
    from hixl.tools.cli import emit_report

    parser = argparse.ArgumentParser(prog="python -m hixl.tools.store_bench")
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="calls",
                        help="every call form (calls), or LMCache's calls per KV chunk "
                             "request (lmcache)")
    parser.add_argument("--sizes", type=_sizes_flag, default=(),
                        help="value sizes (default: 64K,1M,8784K; lmcache: 256K,1M,2M)")
    parser.add_argument("--batch", type=_count_flag, default=8, help="keys per call / request")
    parser.add_argument("--runs", type=_count_flag, default=3, help="runs per cell (medians)")
    parser.add_argument("--run-bytes", type=_sizes_flag, default=(RUN_BYTES,),
                        help="bytes one run moves")
    parser.add_argument("--no-mooncake", action="store_false", dest="mooncake")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    args = parser.parse_args(argv)
    config = StoreBenchConfig(sizes=args.sizes, batch=args.batch, runs=args.runs,
                              run_bytes=args.run_bytes[0], mooncake=args.mooncake,
                              workload=args.workload)
    try:
        config.check()
    except ValueError as exc:
        parser.error(str(exc))
    report = run_store_bench(config, sys.stderr if sys.stderr.isatty() else None)
    emit_report(format_store_report(report), report, args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """A segment holder with --holder, else the bench."""
    args = list(sys.argv[1:] if argv is None else argv)
    return holder_main(args) if "--holder" in args else bench_main(args)


if __name__ == "__main__":
    sys.exit(main())
