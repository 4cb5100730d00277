"""Device memory as the local side, without a GPU (issue 21, items 2-4): the mapped path
(one device copy per op into the peer's mapping, host-registered once) and the socket
path (device -> bounded, reused staging ring -> socket, pipelined), both driven through
`hixl.staging.HostStandIn`: host memory standing in for the device, every copy a real
memmove on a copy thread of its own, like a stream. The peers are real agent processes;
every byte is checked where it landed.

Overlap is shown by the order of events, never by timing: the stand-in holds the copy of
chunk i+1 until the send of chunk i has begun (PUT), or the copy of chunk i to the device
until the receive of chunk i+1 has begun (GET). A pipeline that did one thing at a time
could not finish: its copier would wait for the deadline, and the test would fail.

What this cannot show: that CUDA's copies, streams, events, pinned staging and
cuMemHostRegister behave as the stand-in does. tests/test_device_memory.py's GPU tests
(scripts/gpu_check.sh) run the same paths on a CUDA device.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hixl import Engine, HixlError, TransferOp, TransferOpDesc, TransferStatus, device
from hixl.errors import NotConnected, ParamInvalid, TransferFailed, TransferTimeout
from hixl.staging import HostStandIn, StagingConfig, plan_chunks
from hixl.transports.base import Item
from hixl.types import MemType, SegmentInfo

KiB, MiB = 1 << 10, 1 << 20
POOL = 16 * MiB
SLOT = 64 * KiB
SOCKET = {"EnableUseFabricMem": "0"}  # the socket path (TCP or the unix socket)
GIVE_UP_S = 20.0  # guards against a hang only: no assertion depends on timing


def kv_segment(engine: Engine, agent: str) -> SegmentInfo:
    (segment,) = [s for s in engine.segments(agent) if s.name == "kv"]
    return segment


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def remote_bytes(engine: Engine, agent: str, addr: int, nbytes: int) -> np.ndarray:
    """What the remote segment holds, read over the host path into host memory."""
    out = np.zeros(nbytes, np.uint8)
    engine.register(out)
    engine.read(agent, out, addr, timeout=GIVE_UP_S)
    return out


class Trace:
    """The pipeline's events in order, and waits for one of them (copy-thread side)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self._cond = threading.Condition()
        self.gave_up: list[str] = []

    def __call__(self, event: str, chunk: int) -> None:
        with self._cond:
            self.events.append((event, chunk))
            self._cond.notify_all()

    def wait_for(self, event: str, chunk: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: (event, chunk) in self.events, GIVE_UP_S):
                self.gave_up.append(f"{event} {chunk}")

    def at(self, event: str, chunk: int) -> int:
        return self.events.index((event, chunk))


@pytest.fixture
def agent(agent_process):
    return agent_process(config={"pool": [{"name": "kv", "size": POOL}]})


def standin_engine(copier: HostStandIn, options: dict[str, str] | None = None,
                   slots: int = 2) -> Engine:
    return Engine("127.0.0.1", options if options is not None else SOCKET, device_copier=copier,
                  staging=StagingConfig(slot_bytes=SLOT, slots=slots))


# ---------------------------------------------------------------- the plan


def test_ops_are_cut_and_packed_into_slot_sized_chunks() -> None:
    seg: Any = object()  # carried through, never read by the plan
    items = [Item(0, 0x1000, seg, 0x10000, 100), Item(1, 0x9000, seg, 0x20000, 250),
             Item(2, 0x5000, seg, 0x30000, 10)]
    chunks = plan_chunks(items, 128)
    assert [[(p.index, p.device_addr, p.remote_addr, p.length, p.offset) for p in c]
            for c in chunks] == [
        [(0, 0x1000, 0x10000, 100, 0), (1, 0x9000, 0x20000, 28, 100)],
        [(1, 0x9000 + 28, 0x20000 + 28, 128, 0)],
        [(1, 0x9000 + 156, 0x20000 + 156, 94, 0), (2, 0x5000, 0x30000, 10, 94)]]
    with pytest.raises(ParamInvalid, match="slots"):
        StagingConfig(slots=1)


# ---------------------------------------------------------------- the socket path


def test_put_and_get_through_a_bounded_ring_reused_across_transfers(agent) -> None:
    copier = HostStandIn()
    nbytes = 1 * MiB + 4 * KiB + 17  # 17 chunks of 64 KiB, the last one partial
    with standin_engine(copier) as engine:
        engine.connect(agent.engine, timeout=10)
        kv = kv_segment(engine, agent.engine)
        assert engine.route(agent.engine, kv.base) in ("tcp", "unix")
        src, back = pattern(nbytes, 1), np.zeros(nbytes, np.uint8)
        handle = engine.register(src, mem_type=MemType.MEM_DEVICE)
        assert handle.mem_type == MemType.MEM_DEVICE and handle.copier is copier
        engine.register(back, mem_type=MemType.MEM_DEVICE)
        ring = engine._device.ring(copier)
        for round_ in range(3):
            src[:] = pattern(nbytes, 10 + round_)
            engine.write(agent.engine, src, kv.base + 4096, timeout=GIVE_UP_S)
            assert np.array_equal(remote_bytes(engine, agent.engine, kv.base + 4096, nbytes), src)
            back[:] = 0
            engine.read(agent.engine, back, kv.base + 4096, timeout=GIVE_UP_S)
            assert np.array_equal(back, src)
        # 6 transfers, one ring: allocated once, 2 x 64 KiB and nothing more, not busy
        assert (ring.transfers, ring.allocations, copier.host_allocs) == (6, 1, 1)
        assert [len(buf) for buf in copier.host_buffers.values()] == [2 * SLOT]
        assert not ring.busy
    assert copier.host_buffers == {}  # freed with the engine
    assert ring.closed
    copier.close()


def test_put_copies_chunk_i_plus_1_while_chunk_i_is_sent(agent) -> None:
    trace = Trace()
    chunks = 6

    def before_copy(seq: int, direction: str) -> None:
        assert direction == "to_host"
        if seq >= 1:  # chunk `seq` may be copied only once chunk seq-1's send has begun
            trace.wait_for("send", seq - 1)

    copier = HostStandIn(before_copy=before_copy)
    copier.trace = trace
    with standin_engine(copier) as engine:
        engine.connect(agent.engine, timeout=10)
        kv = kv_segment(engine, agent.engine)
        src = pattern(chunks * SLOT, 2)
        engine.register(src, mem_type=MemType.MEM_DEVICE)
        engine.write(agent.engine, src, kv.base, timeout=GIVE_UP_S)
        assert trace.gave_up == []
        assert np.array_equal(remote_bytes(engine, agent.engine, kv.base, src.size), src)
    for k in range(chunks - 1):
        # copy k+1 queued before send k began, and done only after: it ran during send k
        assert trace.at("stage", k + 1) < trace.at("send", k) < trace.at("staged", k + 1)
        # a slot is refilled only after its chunk was sent (2 slots: chunk k+2 into k's)
        if k + 2 < chunks:
            assert trace.at("sent", k) < trace.at("stage", k + 2)
    copier.close()


def test_get_receives_chunk_i_plus_1_while_chunk_i_is_copied_to_the_device(agent) -> None:
    trace = Trace()
    chunks = 6

    def before_copy(seq: int, direction: str) -> None:
        assert direction == "to_device"
        if seq + 1 < chunks:  # chunk `seq` reaches the device only once seq+1's receive began
            trace.wait_for("recv", seq + 1)

    copier = HostStandIn(before_copy=before_copy)
    copier.trace = trace
    with standin_engine(copier) as engine:
        engine.connect(agent.engine, timeout=10)
        kv = kv_segment(engine, agent.engine)
        data = pattern(chunks * SLOT, 3)
        engine.register(data)  # host memory: seeds the segment over the host path
        engine.write(agent.engine, data, kv.base, timeout=GIVE_UP_S)
        back = np.zeros_like(data)
        engine.register(back, mem_type=MemType.MEM_DEVICE)
        engine.read(agent.engine, back, kv.base, timeout=GIVE_UP_S)
        assert trace.gave_up == []
        assert np.array_equal(back, data)
    for k in range(chunks - 1):
        assert trace.at("unstage", k) < trace.at("recv", k + 1) < trace.at("unstaged", k)
    copier.close()


def test_many_small_ops_share_slots_arrays_and_async_too(agent) -> None:
    copier = HostStandIn()
    with standin_engine(copier) as engine:
        engine.connect(agent.engine, timeout=10)
        kv = kv_segment(engine, agent.engine)
        src, host = pattern(256 * 4 * KiB, 4), pattern(64 * KiB, 5)
        engine.register(src, mem_type=MemType.MEM_DEVICE)
        engine.register(host)
        # 256 scattered 4 KiB device ops (reversed order remotely) and one host op, one call
        descs = [TransferOpDesc(src.ctypes.data + i * 4 * KiB, kv.base + (255 - i) * 4 * KiB,
                                4 * KiB) for i in range(256)]
        descs.append(TransferOpDesc(host.ctypes.data, kv.base + 2 * MiB, host.size))
        engine.transfer(agent.engine, TransferOp.WRITE, descs, timeout=GIVE_UP_S)
        landed = remote_bytes(engine, agent.engine, kv.base, 256 * 4 * KiB)
        assert np.array_equal(landed.reshape(256, -1)[::-1].reshape(-1), src)
        assert np.array_equal(remote_bytes(engine, agent.engine, kv.base + 2 * MiB, host.size),
                              host)
        back = np.zeros_like(src)
        engine.register(back, mem_type=MemType.MEM_DEVICE)
        offsets = np.arange(256, dtype=np.int64) * 4 * KiB
        engine.transfer_arrays(agent.engine, TransferOp.READ, back.ctypes.data + offsets,
                               kv.base + offsets[::-1], 4 * KiB, timeout=GIVE_UP_S)
        assert np.array_equal(back, src)
        back[:] = 0
        request = engine.transfer_async(agent.engine, TransferOp.READ,
                                        [TransferOpDesc(back.ctypes.data, kv.base, back.size)],
                                        timeout=GIVE_UP_S)
        request.wait()
        assert request.status == TransferStatus.COMPLETED
        assert np.array_equal(back, landed)
    copier.close()


def test_one_transfer_at_a_time_through_the_ring_others_wait_or_time_out(agent) -> None:
    held, release = threading.Event(), threading.Event()

    def before_copy(seq: int, direction: str) -> None:
        if seq == 0:  # the first transfer holds the ring until the test lets it go
            held.set()
            release.wait(GIVE_UP_S)

    copier = HostStandIn(before_copy=before_copy)
    with standin_engine(copier) as engine:
        engine.connect(agent.engine, timeout=10)
        kv = kv_segment(engine, agent.engine)
        first, second = pattern(4 * SLOT, 11), pattern(4 * SLOT, 12)
        engine.register(first, mem_type=MemType.MEM_DEVICE)
        engine.register(second, mem_type=MemType.MEM_DEVICE)
        request = engine.transfer_async(agent.engine, TransferOp.WRITE,
                                        [TransferOpDesc(first.ctypes.data, kv.base, first.size)],
                                        timeout=GIVE_UP_S)
        assert held.wait(GIVE_UP_S)
        ring = engine._device.ring(copier)
        assert ring.busy
        with pytest.raises(TransferTimeout, match="busy") as info:  # its deadline passes first
            engine.write(agent.engine, second, kv.base + first.size, timeout=0.2)
        assert info.value.failed == [0]
        waiting = engine.transfer_async(
            agent.engine, TransferOp.WRITE,
            [TransferOpDesc(second.ctypes.data, kv.base + first.size, second.size)],
            timeout=GIVE_UP_S)
        release.set()
        request.wait()
        waiting.wait()
        assert np.array_equal(remote_bytes(engine, agent.engine, kv.base, 2 * first.size),
                              np.concatenate([first, second]))
        assert (ring.transfers, ring.allocations) == (2, 1)
    copier.close()


def test_peer_killed_mid_pipeline_fails_typed_and_the_ring_is_given_back(agent_process) -> None:
    victim = agent_process(config={"pool": [{"name": "kv", "size": POOL}]})
    survivor = agent_process(config={"pool": [{"name": "kv", "size": POOL}]})
    trace = Trace()
    killed = threading.Event()

    def before_copy(seq: int, direction: str) -> None:
        if seq == 3 and not killed.is_set():  # chunks 0-1 sent, the agent dies now
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(GIVE_UP_S)
            killed.set()

    copier = HostStandIn(before_copy=before_copy)
    copier.trace = trace
    with standin_engine(copier) as engine:
        engine.connect(victim.engine, timeout=10)
        engine.connect(survivor.engine, timeout=10)
        src = pattern(16 * SLOT, 6)
        engine.register(src, mem_type=MemType.MEM_DEVICE)
        ring = engine._device.ring(copier)
        with pytest.raises((TransferFailed, TransferTimeout)) as info:
            engine.write(victim.engine, src, kv_segment(engine, victim.engine).base,
                         timeout=GIVE_UP_S)
        assert killed.is_set() and ("sent", 0) in trace.events
        assert ("sent", 15) not in trace.events
        assert info.value.failed == [0]
        assert not ring.busy  # given back, its copies drained
        # the same ring carries the next transfer, to a live agent
        kv = kv_segment(engine, survivor.engine)
        engine.write(survivor.engine, src, kv.base, timeout=GIVE_UP_S)
        assert np.array_equal(remote_bytes(engine, survivor.engine, kv.base, src.size), src)
        assert (ring.allocations, copier.host_allocs) == (1, 1)
    assert copier.host_buffers == {}
    copier.close()


def test_a_get_whose_copy_to_the_device_fails_drains_every_queued_copy_first(agent) -> None:
    def before_copy(seq: int, direction: str) -> None:
        if seq == 1:
            raise OSError("the device refused the copy")

    copier = HostStandIn(before_copy=before_copy)
    with standin_engine(copier, slots=4) as engine:
        engine.connect(agent.engine, timeout=10)
        kv = kv_segment(engine, agent.engine)
        data = pattern(8 * SLOT, 13)
        engine.register(data)
        engine.write(agent.engine, data, kv.base, timeout=GIVE_UP_S)
        back = np.zeros_like(data)
        engine.register(back, mem_type=MemType.MEM_DEVICE)
        with pytest.raises(TransferFailed, match="refused the copy") as info:
            engine.read(agent.engine, back, kv.base, timeout=GIVE_UP_S)
        assert info.value.failed == [0]
        # given back only once no copy of the call could still touch a slot
        assert copier.settled == copier.queued and not engine._device.ring(copier).busy
        engine.read(agent.engine, back, kv.base, timeout=GIVE_UP_S)
        assert np.array_equal(back, data)
    copier.close()


def test_a_failed_device_copy_fails_the_call_typed_and_frees_the_ring(agent) -> None:
    fail = threading.Event()

    def before_copy(seq: int, direction: str) -> None:
        if fail.is_set():
            raise OSError("the device refused the copy")

    copier = HostStandIn(before_copy=before_copy)
    with standin_engine(copier) as engine:
        engine.connect(agent.engine, timeout=10)
        kv = kv_segment(engine, agent.engine)
        src = pattern(4 * SLOT, 7)
        engine.register(src, mem_type=MemType.MEM_DEVICE)
        fail.set()
        with pytest.raises(TransferFailed, match="refused the copy") as info:
            engine.write(agent.engine, src, kv.base, timeout=GIVE_UP_S)
        assert info.value.failed == [0]
        fail.clear()
        engine.write(agent.engine, src, kv.base, timeout=GIVE_UP_S)
        assert np.array_equal(remote_bytes(engine, agent.engine, kv.base, src.size), src)
        assert not engine._device.ring(copier).busy
    copier.close()


# ---------------------------------------------------------------- the mapped path


def test_mapped_path_copies_each_op_once_with_the_mapping_registered_once(agent) -> None:
    copier = HostStandIn()
    with standin_engine(copier, options={"EnableUseFabricMem": "1"}) as engine:
        engine.connect(agent.engine, timeout=10)
        kv = kv_segment(engine, agent.engine)
        assert engine.route(agent.engine, kv.base) == "fabric"
        src, back = pattern(8784 * KiB, 8), np.zeros(8784 * KiB, np.uint8)
        engine.register(src, mem_type=MemType.MEM_DEVICE)
        engine.register(back, mem_type=MemType.MEM_DEVICE)
        engine.write(agent.engine, src, kv.base, timeout=GIVE_UP_S)  # D2rH
        assert np.array_equal(remote_bytes(engine, agent.engine, kv.base, src.size), src)
        engine.read(agent.engine, back, kv.base, timeout=GIVE_UP_S)  # rH2D
        assert np.array_equal(back, src)
        request = engine.transfer_async(agent.engine, TransferOp.WRITE,
                                        [TransferOpDesc(back.ctypes.data + 4096, kv.base, 4096)],
                                        timeout=GIVE_UP_S)
        request.wait()
        assert request.status == TransferStatus.COMPLETED
        # one copy per op, no staging: the ring was never allocated
        assert copier.copies == 3 and copier.host_allocs == 0
        assert copier.registrations == 1 and len(copier.registered) == 1
        engine.disconnect(agent.engine)
        assert copier.registered == {}  # unregistered with the mapping, before its unmap
        with pytest.raises(NotConnected):
            engine.write(agent.engine, src, kv.base, timeout=GIVE_UP_S)
    copier.close()


# ---------------------------------------------------------------- bad input


def test_a_tensor_resized_after_registration_is_refused_before_any_byte_moves(agent) -> None:
    torch = pytest.importorskip("torch")
    copier = HostStandIn()
    with standin_engine(copier) as engine:
        engine.connect(agent.engine, timeout=10)
        kv = kv_segment(engine, agent.engine)
        tensor = torch.arange(4 * SLOT, dtype=torch.uint8)
        handle = engine.register(tensor, mem_type=MemType.MEM_DEVICE)
        addr = handle.addr
        tensor.resize_(64 * SLOT)  # a new, bigger storage: the registered one is gone
        with pytest.raises(ParamInvalid, match="resized or moved") as info:
            engine.transfer(agent.engine, TransferOp.WRITE,
                            [TransferOpDesc(addr, kv.base, 4 * SLOT)], timeout=GIVE_UP_S)
        assert info.value.failed == [0] and copier.copies == 0
        with pytest.raises(ParamInvalid, match="not contiguous"):
            engine.register(torch.zeros(64, 64)[:, ::2], mem_type=MemType.MEM_DEVICE)
    copier.close()


class OnDevice:
    """An object that says it lives on a CUDA device (DLPack device type 2)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.index)


class StridedCudaArray:
    __cuda_array_interface__ = {"shape": (4, 4), "typestr": "<f4", "strides": (32, 8),
                                "data": (0x7F0000000000, False), "version": 3}


@pytest.mark.parametrize("make, error, match", [
    (lambda: OnDevice(1), ParamInvalid, "cuda:1, but this engine's device copier streams on cuda:0"),
    (lambda: StridedCudaArray(), ParamInvalid, "not C-contiguous"),
    (lambda: OnDevice(0), HixlError, "exposes no device pointer"),
])
def test_device_objects_the_copier_cannot_serve_are_typed_errors(
        make: Callable[[], object], error: type[Exception], match: str) -> None:
    copier = HostStandIn(device="cuda:0")  # standing in for device 0
    with Engine("127.0.0.1", device_copier=copier) as engine, pytest.raises(error, match=match):
        engine.register(make())
    copier.close()


def test_without_a_device_copier_device_memory_is_refused_and_host_paths_unchanged() -> None:
    from hixl.errors import Unsupported

    with Engine("127.0.0.1") as engine:
        with pytest.raises(Unsupported, match="MEM_DEVICE"):
            engine.register(np.zeros(64, np.uint8), mem_type=MemType.MEM_DEVICE)
        # no copier without the driver; with it (a GPU machine) one of device 0, which
        # finds no device pointer in the object
        with pytest.raises(Unsupported, match="cuda:0 device memory" if
                           device._loaded_cuda_driver() is None else "no device pointer"):
            engine.register(OnDevice(0))
        assert engine._device_count == 0


# ---------------------------------------------------------------- CudaCopier's bindings

# The CUDA driver entry points CudaCopier calls, implemented over host memory: "device"
# memory comes from cuMemAlloc_v2 (malloc'd; cuPointerGetAttribute calls it device memory
# of device 0, or 1 after fake_set_device(1)), copies are memcpy, and every handle, context push, event, pinned buffer and
# host registration is counted, so the test can see each one balanced. It checks hixl's
# ctypes bindings (symbols, argument types, pointer passing, the context pushed on each
# calling thread, lifetimes), not CUDA: no copy here is asynchronous, no memory pinned.
FAKE_DRIVER_C = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
#define SLOTS 256
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct { uintptr_t base; size_t size; int dev; } allocs[SLOTS], regs[SLOTS];
static __thread int depth;  /* contexts pushed on this thread */
static int marker[2], initialized, alloc_dev;  /* devices 0 and 1 */
static long counts[8];  /* pushes-pops, retained, streams, events, host allocs, registered */
#define LOCKED(body) do { pthread_mutex_lock(&mu); body; pthread_mutex_unlock(&mu); } while (0)
static int find(uintptr_t p, size_t n) {
    for (int i = 0; i < SLOTS; i++)
        if (allocs[i].size && p >= allocs[i].base && p + n <= allocs[i].base + allocs[i].size)
            return i;
    return -1;
}
CUresult cuInit(unsigned f) { initialized = 1; return 0; }
CUresult cuDeviceGet(int *d, int ordinal) {
    if (!initialized) return 3;
    if (ordinal != 0 && ordinal != 1) return 101;
    *d = ordinal; return 0;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = &marker[dev]; LOCKED(counts[1]++); return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { LOCKED(counts[1]--); return 0; }
CUresult cuCtxPushCurrent_v2(void *ctx) {
    if (ctx != &marker[0] && ctx != &marker[1]) return 201;
    depth++; LOCKED(counts[0]++); return 0;
}
CUresult cuCtxPopCurrent_v2(void **ctx) {
    if (depth <= 0) return 201;
    depth--; LOCKED(counts[0]--); if (ctx) *ctx = &marker[0]; return 0;
}
#define IN_CTX if (depth <= 0) return 201
CUresult cuStreamCreate(void **s, unsigned f) { IN_CTX; *s = malloc(8); LOCKED(counts[2]++); return 0; }
CUresult cuStreamDestroy_v2(void *s) { IN_CTX; free(s); LOCKED(counts[2]--); return 0; }
CUresult cuStreamSynchronize(void *s) { IN_CTX; return 0; }
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *s) {
    IN_CTX; int ok; LOCKED(ok = find(src, n) >= 0); if (!ok || !s) return 1;
    memcpy(dst, (void *)src, n); return 0;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) {
    IN_CTX; int ok; LOCKED(ok = find(dst, n) >= 0); if (!ok || !s) return 1;
    memcpy((void *)dst, src, n); return 0;
}
CUresult cuEventCreate(void **e, unsigned f) { IN_CTX; *e = malloc(8); LOCKED(counts[3]++); return 0; }
CUresult cuEventRecord(void *e, void *s) { IN_CTX; return e && s ? 0 : 1; }
CUresult cuEventSynchronize(void *e) { IN_CTX; return e ? 0 : 1; }
CUresult cuEventDestroy_v2(void *e) { free(e); LOCKED(counts[3]--); return 0; }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned f) {
    IN_CTX; *p = malloc(n); LOCKED(counts[4]++); return *p ? 0 : 2;
}
CUresult cuMemFreeHost(void *p) { IN_CTX; free(p); LOCKED(counts[4]--); return 0; }
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned f) {
    IN_CTX; if ((uintptr_t)p % 4096 || n % 4096) return 1;
    CUresult r = 2;
    LOCKED(for (int i = 0; i < SLOTS; i++) {
        if (regs[i].size && regs[i].base == (uintptr_t)p) { r = 712; break; }
        if (!regs[i].size) { regs[i].base = (uintptr_t)p; regs[i].size = n; counts[5]++; r = 0; break; }
    });
    return r;
}
CUresult cuMemHostUnregister(void *p) {
    IN_CTX; CUresult r = 713;
    LOCKED(for (int i = 0; i < SLOTS; i++)
        if (regs[i].size && regs[i].base == (uintptr_t)p) { regs[i].size = 0; counts[5]--; r = 0; break; });
    return r;
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    IN_CTX; int i; LOCKED(i = find(p, 1); if (i >= 0) { *base = allocs[i].base; *size = allocs[i].size; });
    return i >= 0 ? 0 : 1;
}
CUresult cuGetErrorString(CUresult r, const char **s) { *s = "fake driver error"; return 0; }
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    int i; LOCKED(i = find(p, 1));
    if (i < 0) return 1;
    if (attr == 2) *(unsigned *)data = 2;       /* CU_MEMORYTYPE_DEVICE */
    else if (attr == 9) *(int *)data = allocs[i].dev;  /* device ordinal */
    else return 1;
    return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    void *m = malloc(n); CUresult r = 2;
    LOCKED(for (int i = 0; i < SLOTS; i++)
        if (!allocs[i].size) { allocs[i].base = (uintptr_t)m; allocs[i].size = n; allocs[i].dev = alloc_dev; r = 0; break; });
    *p = (CUdeviceptr)m; return r;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    CUresult r = 1;
    LOCKED(for (int i = 0; i < SLOTS; i++)
        if (allocs[i].size && allocs[i].base == p) { allocs[i].size = 0; r = 0; break; });
    if (!r) free((void *)p);
    return r;
}
void fake_counts(long *out) { LOCKED(memcpy(out, counts, sizeof counts)); }
void fake_set_device(int dev) { alloc_dev = dev; }  /* where cuMemAlloc_v2 allocates */
"""

FAKE_DRIVER_RUN = r"""
import ctypes, json, os, sys
lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
import numpy as np
from hixl import Engine, device
from hixl.errors import HixlError

lib.cuMemAlloc_v2.argtypes = (ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)
lib.cuMemFree_v2.argtypes = (ctypes.c_uint64,)

def dev_alloc(n):
    p = ctypes.c_uint64()
    assert lib.cuMemAlloc_v2(ctypes.byref(p), n) == 0
    return p.value

def counts():
    out = (ctypes.c_long * 8)()
    lib.fake_counts(out)
    return dict(zip(["ctx_pushed", "retained", "streams", "events", "host_allocs",
                     "registered"], out[:6]))

agent, fabric = sys.argv[2], sys.argv[3]
n = (12 << 20) + 123  # four chunks of the default 4 x 4 MiB staging ring
src, back = dev_alloc(n), dev_alloc(n)
data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
ctypes.memmove(src, data.ctypes.data, n)
out = {"placement": device.locate_address(src).device}
import hixl
from hixl.client.mooncake import TransferEngine
facade, te, extra = hixl.Hixl(), TransferEngine(), dev_alloc(1 << 20)
assert facade.initialize("127.0.0.1") == hixl.SUCCESS
status, handle = facade.register_mem(hixl.MemDesc(extra, 4096), hixl.MemType.MEM_DEVICE)
out["hixl"] = [int(status), handle.copier.device if handle is not None else None]
facade.finalize()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
out["mooncake_te"] = [te.register_memory(extra + 4096, 4096), te.get_last_error()]
te.close()
with Engine("127.0.0.1", {"EnableUseFabricMem": fabric}) as engine:
    engine.connect(agent, timeout=10)
    (seg,) = [s for s in engine.segments(agent) if s.name == "kv"]
    out["route"] = str(engine.route(agent, seg.base))
    handle = engine.register(src, n)  # by pointer, as vLLM's Mooncake connector does
    engine.register(back, n)
    out["copier"] = f"{type(handle.copier).__name__} {handle.copier.device}"
    engine.write(agent, src, seg.base, n, timeout=20)
    host = np.zeros(n, np.uint8)
    engine.register(host)
    engine.read(agent, host, seg.base, timeout=20)
    out["d2rh"] = bool(np.array_equal(host, data))
    engine.read(agent, back, seg.base, n, timeout=20)
    out["rh2d"] = ctypes.string_at(back, n) == data.tobytes()
    request = engine.transfer_async(agent, 1, [(back, seg.base, 4096)], timeout=20)
    request.wait()
    out["async"] = request.status.name
    freed = dev_alloc(1 << 20)
    engine.register(freed, 1 << 20)
    lib.cuMemFree_v2(freed)
    try:
        engine.write(agent, freed, seg.base, 1 << 20, timeout=5)
        out["freed"] = "moved"
    except HixlError as exc:
        out["freed"] = f"{type(exc).__name__}: {exc}"
    out["during"] = counts()
    lib.fake_set_device(1)
    other = dev_alloc(4096)  # memory of device 1: its own copier; a given one of 0 refuses it
    out["other_device"] = engine.register(other, 4096).copier.device
    from hixl.staging import CudaCopier
    copier0 = CudaCopier(0)
    try:
        with Engine("127.0.0.1", device_copier=copier0) as pinned_to_0:
            pinned_to_0.register(other, 4096)
        out["mismatch"] = "accepted"
    except HixlError as exc:
        out["mismatch"] = f"{type(exc).__name__}: {exc}"
    finally:
        copier0.close()
out["after"] = counts()
print(json.dumps(out))
"""


CC = shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(CC is None, reason="needs a C compiler (cc or gcc) for the driver stand-in")
@pytest.mark.parametrize("fabric", ["1", "0"], ids=["mapped", "socket"])
def test_cuda_copier_bindings_against_a_host_memory_driver(agent, fabric: str,
                                                           tmp_path: Path) -> None:
    source = tmp_path / "fake_cuda.c"
    source.write_text(FAKE_DRIVER_C)
    library = tmp_path / "libcuda.so.1"  # found by hixl.device's RTLD_NOLOAD probe by soname
    subprocess.run([str(CC), "-shared", "-fPIC", "-O1", "-pthread", "-Wl,-soname,libcuda.so.1",
                    "-o", str(library), str(source)], check=True)
    run = subprocess.run([sys.executable, "-c", FAKE_DRIVER_RUN, str(library), agent.engine,
                          fabric], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["placement"] == "cuda:0" and out["copier"] == "CudaCopier cuda:0"
    assert out["hixl"] == [0, "cuda:0"] and out["mooncake_te"][0] == 0, out
    assert (out["route"] == "fabric") == (fabric == "1")
    assert out["d2rh"] and out["rh2d"] and out["async"] == "COMPLETED"
    assert out["freed"].startswith("ParamInvalid") and "no longer cuda:0" in out["freed"]
    assert out["other_device"] == "cuda:1"
    assert out["mismatch"].startswith("ParamInvalid") and \
        "is on cuda:1, but this engine's device copier streams on cuda:0" in out["mismatch"]
    during, after = out["during"], out["after"]
    assert during["ctx_pushed"] == 0 and during["events"] == 0  # every push popped, event freed
    assert during["retained"] == 1 and during["streams"] == 1  # one copier: one context, stream
    # the mapped path registers the peer's mapping once and stages nothing; the socket
    # path allocates one staging ring
    assert (during["registered"], during["host_allocs"]) == ((1, 0) if fabric == "1" else (0, 1))
    assert after == {"ctx_pushed": 0, "retained": 0, "streams": 0, "events": 0,
                     "host_allocs": 0, "registered": 0}  # all given back by Engine.close


STORE_WITH_DRIVER_RUN = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
from hixl.client.mooncake import MooncakeDistributedStore

lib.cuMemAlloc_v2.argtypes = (ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)
pointer = ctypes.c_uint64()
assert lib.cuMemAlloc_v2(ctypes.byref(pointer), 4096) == 0
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", sys.argv[2]) == 0
out = {"register_buffer": store.register_buffer(pointer.value, 4096),
       "register_error": store.get_last_error(),
       "put_from": store.put_from("k", pointer.value, 4096),
       "is_exist": store.is_exist("k")}
store.close()
print(json.dumps(out))
"""


@pytest.mark.skipif(CC is None, reason="needs a C compiler (cc or gcc) for the driver stand-in")
def test_the_store_refuses_a_device_buffer_even_where_the_engine_serves_device_memory(
        tmp_path: Path) -> None:
    """The engine takes device memory once a copier serves it; the store's put_from /
    get_into copy registered buffers on the host, so its register_buffer must still
    refuse one (INVALID_PARAMS naming the device), and nothing is stored."""
    from hixl.tools.daemons import MasterProcess

    source = tmp_path / "fake_cuda.c"
    source.write_text(FAKE_DRIVER_C)
    library = tmp_path / "libcuda.so.1"
    subprocess.run([str(CC), "-shared", "-fPIC", "-O1", "-pthread", "-Wl,-soname,libcuda.so.1",
                    "-o", str(library), str(source)], check=True)
    with MasterProcess() as master:
        run = subprocess.run([sys.executable, "-c", STORE_WITH_DRIVER_RUN, str(library),
                              master.target], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["register_buffer"] == -600 and "cuda:0" in out["register_error"], out
    assert out["put_from"] == -600 and out["is_exist"] == 0, out
