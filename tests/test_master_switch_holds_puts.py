"""A master switch costs latency, not failed puts (issue 20 item 11), on real processes.

Three hixl-masters on a 3-member etcd (tests/etcd_cluster.py), a segment holder process
whose *remount* the test controls (it stays a normal holder otherwise: its agent serves
every read and write), and store clients putting continuously from threads. The leader is
SIGKILLed; the new leader loads the store with the holder's segment awaiting its remount,
so it has no room: the test waits until it holds a put for the remount (its stats say so),
then lets the holder remount. Every put that started after the kill returns 0, every
acknowledged key reads back byte for byte. A put held past its deadline fails with
AWAITING_REMOUNT and says why, never NO_AVAILABLE_HANDLE "the pool is full".

Nothing here measures time: deadlines only bound waits.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial

import grpc
import numpy as np
import waiting
from etcd_cluster import EtcdCluster
from test_master_ha import (
    Masters,
    no_token_from_the_host,  # noqa: F401 - autouse fixture, used here too
)

from hixl.client.mooncake import MooncakeDistributedStore
from hixl.client.store_client import MasterClient
from hixl.processes import DaemonProcess, ProcessNotReady
from hixl.server.master.store_service import AWAITING_REMOUNT
from hixl.store_codes import ErrorCode, code_name, hint_for_code
from hixl.v1 import store_pb2, store_pb2_grpc

MiB = 1 << 20
WAIT_S = 60.0
READY = "GATED-HOLDER-READY"

wait_until = partial(waiting.wait_until, timeout=WAIT_S)

#: a segment holder (a hixl store client contributing a segment) whose remounts, after
#: its first mount, wait for a line "remount" on its stdin; EOF ends it
HOLDER = r"""
import sys, threading
from hixl.client.mooncake import MooncakeDistributedStore

store = MooncakeDistributedStore(setup_timeout=60)
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "",
                 sys.argv[1])
if rc:
    print("setup failed", rc, store.last_error, flush=True)
    sys.exit(1)
gate = threading.Event()
mount = store._master.mount_segment

def gated(*args, **kwargs):
    gate.wait()
    return mount(*args, **kwargs)

store._master.mount_segment = gated
print("GATED-HOLDER-READY", flush=True)
for line in sys.stdin:
    if line.strip() == "remount":
        gate.set()
        print("GATE-OPEN", flush=True)
gate.set()
store.close()
"""


class GatedHolder:
    def __init__(self, targets: str, segment_bytes: int) -> None:
        # its output (its log included) stays drained, so it never blocks on a full pipe
        self.process = DaemonProcess([sys.executable, "-c", HOLDER, targets, str(segment_bytes)],
                                     name="the holder", ready=re.compile(re.escape(READY)),
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     stop_by="stdin", grace_s=WAIT_S)
        self.proc = self.process.proc
        try:
            self.process.wait_ready(2 * WAIT_S)  # its setup alone may take WAIT_S
        except ProcessNotReady as exc:
            raise AssertionError(f"the holder did not start: {exc}") from None

    def let_remount(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("remount\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        self.process.stop()


def pattern(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@dataclass
class Put:
    key: str
    seed: int
    size: int
    started: float
    code: int


class Putters:
    """Threads putting distinct keys back to back through one store client each."""

    def __init__(self, stores: list[MooncakeDistributedStore]) -> None:
        self.puts: list[Put] = []
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(n, s), daemon=True)
                         for n, s in enumerate(stores)]
        for thread in self._threads:
            thread.start()

    def _run(self, number: int, store: MooncakeDistributedStore) -> None:
        index = 0
        try:
            while not self._stop.is_set():
                seed = number * 1_000_000 + index
                size = 1000 + (index * 7919) % (32 << 10)
                key = f"p{number}-{index}"
                started = time.monotonic()
                code = store.put(key, pattern(seed, size))
                self.puts.append(Put(key, seed, size, started, code))
                index += 1
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self._errors.append(exc)

    def ok_since(self, moment: float) -> int:
        return sum(1 for p in list(self.puts) if p.code == 0 and p.started >= moment)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(WAIT_S)
            assert not thread.is_alive(), "a put hung"
        assert not self._errors, repr(self._errors)


def stats_of(target: str) -> dict[str, float]:
    with MasterClient(target, timeout=WAIT_S) as client:
        return client.stats()


def test_a_leader_kill_fails_no_put_the_new_leader_holds_them_for_the_remount(
        cluster: EtcdCluster) -> None:
    with Masters(cluster, 3) as masters:
        leader = masters.leader()
        targets = ",".join(masters.targets)
        holder = GatedHolder(targets, 64 * MiB)
        stores: list[MooncakeDistributedStore] = []
        putters: Putters | None = None
        try:
            for _ in range(2):
                store = MooncakeDistributedStore(setup_timeout=WAIT_S)
                stores.append(store)
                assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "",
                                   targets) == 0, store.last_error
            putters = Putters(stores)
            wait_until(lambda: putters.ok_since(0.0) >= 40, "puts before the kill")
            leader.kill()  # SIGKILL, mid-load; returns once the process is gone
            dead_at = time.monotonic()  # no request can reach it from now on
            new = masters.leader(exclude=(leader.target,))
            # the new leader has no room until the holder remounts: puts wait there
            wait_until(lambda: stats_of(new.target)["puts_held_for_remount"] >= 1,
                       "a put held for the remount at the new leader")
            assert stats_of(new.target)["segments_awaiting_remount"] == 1
            holder.let_remount()
            wait_until(lambda: stats_of(new.target)["segments_awaiting_remount"] == 0,
                       "the holder's remount")
            resumed = time.monotonic()
            wait_until(lambda: putters.ok_since(resumed) >= 40, "puts after the switch")
        finally:
            if putters is not None:
                putters.stop()
        try:
            stats = stats_of(new.target)
            assert stats["remount_holds"] >= 1, stats
            after = [p for p in putters.puts if p.started >= dead_at]
            failed = [(p.key, code_name(p.code)) for p in after if p.code != 0]
            assert not failed, f"puts started after the leader died failed: {failed}"
            # a put in flight when the leader died may fail RPC_FAIL (its request may have
            # been applied: the client does not repeat it), nothing else
            before = [p for p in putters.puts if p.started < dead_at and p.code != 0]
            assert all(p.code == ErrorCode.RPC_FAIL for p in before), before
            assert len(before) <= len(stores)
            acked = [p for p in putters.puts if p.code == 0]
            for put in acked:
                assert stores[0].get(put.key) == pattern(put.seed, put.size), put.key
        finally:
            for store in stores:
                store.close()
            holder.stop()


def test_a_put_held_past_its_deadline_says_segments_await_their_remount(
        cluster: EtcdCluster) -> None:
    """The holder never remounts: a PutStart with a 1 s deadline (gRPC carries it to the
    master) is held until just before it and answered AWAITING_REMOUNT; a Reserve (never
    held) says why in words. Not NO_AVAILABLE_HANDLE: the pool is not full."""
    with Masters(cluster, 2) as masters:
        leader = masters.leader()
        targets = ",".join(masters.targets)
        holder = GatedHolder(targets, 64 * MiB)
        try:
            leader.kill()
            new = masters.leader(exclude=(leader.target,))
            wait_until(lambda: stats_of(new.target)["segments_awaiting_remount"] == 1,
                       "the new leader with the holder's segment awaiting its remount")
            with grpc.insecure_channel(new.target) as channel:
                stub = store_pb2_grpc.MasterStub(channel)
                reply = stub.PutStart(store_pb2.PutStartRequest(client_id="late", items=[
                    store_pb2.PutStartItem(key="k", value_length=4096)]), timeout=1.0)
                assert [r.code for r in reply.results] == [AWAITING_REMOUNT]
                reserved = stub.Reserve(store_pb2.ReserveRequest(client_id="late",
                                                                 bytes=MiB), timeout=1.0)
            assert reserved.code == AWAITING_REMOUNT != ErrorCode.NO_AVAILABLE_HANDLE
            assert "awaiting remount after a master switch" in reserved.message
            assert "(1 of 1)" in reserved.message
            stats = stats_of(new.target)
            assert stats["remount_hold_timeouts"] >= 1 and stats["puts_in_progress"] == 0
            # the Mooncake client says it in its code and hint too
            store = MooncakeDistributedStore(setup_timeout=WAIT_S)
            try:
                assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "",
                                   targets) == 0, store.last_error
                code = store.put("k", b"v" * 4096)
                assert code == AWAITING_REMOUNT, code_name(code)
                assert AWAITING_REMOUNT.name in store.last_error
                assert "await a remount" in hint_for_code(code)  # logged with it
            finally:
                store.close()
        finally:
            holder.stop()
