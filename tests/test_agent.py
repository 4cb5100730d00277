"""The Agent domain object: segments, budget, overlap, fds, epochs, change events."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from hixl.errors import OutOfRange, ParamInvalid, PermissionDenied, ResourceExhausted, StaleEpoch
from hixl.memory import PAGE_SIZE, Mapping, ShmSegment
from hixl.server.agent.agent import ADDED, REMOVED, Agent
from hixl.types import MemType, Perm, SegmentInfo


@pytest.fixture
def agent() -> Iterator[Agent]:
    a = Agent("127.0.0.1:1", "node-a", pool_max_bytes=16 * PAGE_SIZE, epoch=77)
    yield a
    a.close()


def test_epoch_is_a_nonzero_u32_that_grows_with_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    import hixl.server.agent.agent as agent_module

    now = [agent_module.EPOCH_ORIGIN_S + 1000.0]
    monkeypatch.setattr(agent_module.time, "time", lambda: now[0])
    first = Agent("e:1", "n").epoch
    now[0] += 0.5  # a restart half a second later
    second = Agent("e:1", "n").epoch
    assert 0 < first < second < 1 << 32


def test_allocate_serves_and_publishes_identity(agent: Agent) -> None:
    info = agent.allocate(5000, Perm.RW, name="kv", owner="client:1")
    assert info.engine == "127.0.0.1:1" and info.node_id == "node-a" and info.epoch == 77
    assert info.length == 2 * PAGE_SIZE and info.shareable and info.mem_type == MemType.MEM_HOST
    assert info.name == "kv" and info.perms == Perm.RW
    served = agent.resolve(info.segment_id)
    assert served is not None and served.base == info.base and served.epoch == 77
    served.memory[:4] = b"abcd"
    assert bytes(served.memory[:4]) == b"abcd"
    assert agent.segments() == [info]
    assert agent.resolve(info.segment_id + 1000) is None


def test_segment_ids_are_unique(agent: Agent) -> None:
    ids = [agent.allocate(PAGE_SIZE).segment_id for _ in range(4)]
    assert len(set(ids)) == 4


def test_budget_refuses_and_names_sizes(agent: Agent) -> None:
    first = agent.allocate(12 * PAGE_SIZE)
    with pytest.raises(ResourceExhausted) as info:
        agent.allocate(5 * PAGE_SIZE)
    text = str(info.value)
    assert str(5 * PAGE_SIZE) in text and str(4 * PAGE_SIZE) in text and "pool_max_bytes" in text
    assert len(agent.segments()) == 1  # nothing half-created
    agent.deregister(first.segment_id)
    agent.allocate(16 * PAGE_SIZE)  # budget released by deregister
    assert agent.counters()["pool_bytes_charged"] == 16 * PAGE_SIZE


def test_unbudgeted_pool_segments(agent: Agent) -> None:
    """The configured pool (budgeted=False) is charged neither to pool_max_bytes nor to the
    clients' segment count: all of the budget stays for client allocations."""
    pool = agent.allocate(64 * PAGE_SIZE, budgeted=False)  # 4x pool_max_bytes
    assert pool.length == 64 * PAGE_SIZE and pool.shareable
    assert agent.resolve(pool.segment_id) is not None
    counters = agent.counters()
    assert counters["pool_bytes_charged"] == 0 and counters["client_segments"] == 0
    assert counters["segment_bytes"] == 64 * PAGE_SIZE
    agent.allocate(16 * PAGE_SIZE)  # the whole budget: the pool itself is not charged
    counters = agent.counters()
    assert counters["pool_bytes_charged"] == 16 * PAGE_SIZE and counters["client_segments"] == 1
    with pytest.raises(ResourceExhausted, match="pool_max_bytes"):
        agent.allocate(PAGE_SIZE)  # the client allocation alone used the budget up
    agent.deregister(pool.segment_id)  # dropping the pool refunds nothing it was never charged
    assert agent.counters()["pool_bytes_charged"] == 16 * PAGE_SIZE


@pytest.mark.parametrize("size", [0, -1, 1.5, "4096", True])
def test_allocate_bad_size(agent: Agent, size: object) -> None:
    with pytest.raises(ParamInvalid):
        agent.allocate(size)  # type: ignore[arg-type]


@pytest.mark.parametrize("perms", [Perm.NONE, 4, -1, "rw"])
def test_bad_perms(agent: Agent, perms: object) -> None:
    with pytest.raises(ParamInvalid):
        agent.allocate(PAGE_SIZE, perms)  # type: ignore[arg-type]


def test_register_memory_serves_caller_bytes(agent: Agent) -> None:
    buf = np.zeros(8192, dtype=np.uint8)
    info = agent.register_memory(buf.ctypes.data, buf.nbytes, Perm.RW, "buf", keepalive=buf)
    assert not info.shareable and info.base == buf.ctypes.data
    served = agent.resolve(info.segment_id)
    served.memory[100:103] = b"xyz"
    assert bytes(buf[100:103]) == b"xyz"
    buf[0] = 9
    assert served.memory[0] == 9
    with pytest.raises(ParamInvalid, match="not shareable"):
        agent.export_fd(info.segment_id, 77, False)


def test_overlapping_registration_refused(agent: Agent) -> None:
    buf = bytearray(8192)
    addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    agent.register_memory(addr, 4096, keepalive=buf)
    with pytest.raises(ParamInvalid, match="overlaps"):
        agent.register_memory(addr + 4000, 1000, keepalive=buf)
    with pytest.raises(ParamInvalid, match="overlaps"):
        agent.register_memory(addr, 8192, keepalive=buf)
    agent.register_memory(addr + 4096, 4096, keepalive=buf)  # adjacent is fine
    assert len(agent.segments()) == 2


@pytest.mark.parametrize(("addr", "length"), [(0x1000, 0), (0x1000, -5), (-1, 10),
                                              ((1 << 64) - 4, 8)])
def test_register_memory_bad_range(agent: Agent, addr: int, length: int) -> None:
    with pytest.raises(ParamInvalid):
        agent.register_memory(addr, length)


def test_register_memory_with_shm_is_shareable(agent: Agent) -> None:
    shm = ShmSegment(8192)
    try:
        info = agent.register_memory(shm.addr, 8192, Perm.RW, shm=shm)
        assert info.shareable
        shm.view()[:3] = b"shm"
        fd = agent.export_fd(info.segment_id, 77, True)
        peer = Mapping(fd, 8192, writable=True)
        os.close(fd)
        assert bytes(peer.view()[:3]) == b"shm"
        peer.view()[8191] = 0x5A
        assert shm.view()[8191] == 0x5A
        peer.close()
        with pytest.raises(ParamInvalid, match="overlaps the registered range"):
            agent.register_memory(shm.addr + 4096, 4096, shm=shm)
        agent.deregister(info.segment_id)
        with pytest.raises(OutOfRange, match="does not fit in its shared allocation"):
            agent.register_memory(shm.addr + 4096, 8192, shm=shm)
        # a range inside the allocation: granted the allocation's fd and its offset in it
        inner = agent.register_memory(shm.addr + 4096 + 100, 200, Perm.READ, shm=shm)
        assert inner.shareable
        grant = agent.grant(inner.segment_id, 77, False)
        try:
            assert (grant.length, grant.offset) == (200, 4196) and grant.slot > 0
            peer = Mapping(grant.fd, 4096, writable=False, offset=4096)
        finally:
            os.close(grant.fd)
        shm.view()[4196:4199] = b"sub"
        assert bytes(peer.view()[100:103]) == b"sub"
        peer.close()
        agent.deregister(inner.segment_id)
    finally:
        shm.close()


def test_deregister_twice_and_unknown(agent: Agent) -> None:
    info = agent.allocate(PAGE_SIZE)
    agent.deregister(info.segment_id, 77)
    assert agent.resolve(info.segment_id) is None
    with pytest.raises(ParamInvalid, match="not registered \\(already deregistered\\?\\)"):
        agent.deregister(info.segment_id)
    with pytest.raises(ParamInvalid, match="segment 999 is not registered"):
        agent.deregister(999)


def test_stale_epoch_refused(agent: Agent) -> None:
    info = agent.allocate(PAGE_SIZE)
    with pytest.raises(StaleEpoch, match="epoch 5 is stale"):
        agent.deregister(info.segment_id, 5)
    with pytest.raises(StaleEpoch):
        agent.export_fd(info.segment_id, 5, False)
    assert agent.resolve(info.segment_id) is not None  # nothing changed


def test_export_fd_read_only_refuses_writable_mapping(agent: Agent) -> None:
    info = agent.allocate(PAGE_SIZE, Perm.READ, name="ro")
    agent.resolve(info.segment_id).memory[:5] = b"hello"  # the owner may write its memory
    with pytest.raises(PermissionDenied, match="read-only"):
        agent.export_fd(info.segment_id, 77, True)
    fd = agent.export_fd(info.segment_id, 77, False)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, PAGE_SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionDenied):
            Mapping(fd, PAGE_SIZE, writable=True)
        reader = Mapping(fd, PAGE_SIZE, writable=False)
        assert bytes(reader.view()[:5]) == b"hello"
        reader.close()
    finally:
        os.close(fd)


def test_write_only_segment_gives_no_read_fd(agent: Agent) -> None:
    info = agent.allocate(PAGE_SIZE, Perm.WRITE)
    with pytest.raises(PermissionDenied):
        agent.export_fd(info.segment_id, 77, False)


def test_register_fd_maps_client_memfd(agent: Agent) -> None:
    client = ShmSegment(3 * PAGE_SIZE)
    try:
        info = agent.register_fd(client.fd, 3 * PAGE_SIZE, Perm.RW, "deposited", "c:1")
        assert info.shareable and info.length == 3 * PAGE_SIZE
        agent.resolve(info.segment_id).memory[10:14] = b"from"
        assert bytes(client.view()[10:14]) == b"from"
        client.view()[20:22] = b"to"
        assert bytes(agent.resolve(info.segment_id).memory[20:22]) == b"to"
        fd = agent.export_fd(info.segment_id, 77, False)
        third = Mapping(fd, 3 * PAGE_SIZE, writable=False)
        os.close(fd)
        assert bytes(third.view()[10:14]) == b"from"
        third.close()
        agent.deregister(info.segment_id)
        assert agent.counters()["deferred_unmaps"] == 0
    finally:
        client.close()


def test_register_fd_refusals(agent: Agent) -> None:
    client = ShmSegment(PAGE_SIZE)
    try:
        with pytest.raises(ParamInvalid, match="fewer than length"):
            agent.register_fd(client.fd, 2 * PAGE_SIZE)
        ro_fd = client.export_fd(writable=False)
        try:
            with pytest.raises(PermissionDenied):
                agent.register_fd(ro_fd, PAGE_SIZE, Perm.RW)
            info = agent.register_fd(ro_fd, PAGE_SIZE, Perm.READ)
            assert info.perms == Perm.READ
        finally:
            os.close(ro_fd)
    finally:
        client.close()
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(ParamInvalid, match="not a memfd"):
            agent.register_fd(read_end, PAGE_SIZE)
    finally:
        os.close(read_end)
        os.close(write_end)
    with pytest.raises(ParamInvalid, match="not usable"):
        agent.register_fd(987654, PAGE_SIZE)
    assert len(agent.segments()) == 1


def test_subscribe_snapshot_then_events(agent: Agent) -> None:
    first = agent.allocate(PAGE_SIZE)
    events: list[tuple[str, list[SegmentInfo]]] = []
    snapshot = agent.subscribe(lambda kind, segs: events.append((kind, segs)))
    assert snapshot == [first]
    second = agent.allocate(PAGE_SIZE)
    agent.deregister(first.segment_id)
    assert events == [(ADDED, [second]), (REMOVED, [first])]


def test_broken_listener_does_not_break_agent(agent: Agent) -> None:
    def boom(kind: str, segs: list[SegmentInfo]) -> None:
        raise RuntimeError("listener bug")

    agent.subscribe(boom)
    info = agent.allocate(PAGE_SIZE)
    agent.unsubscribe(boom)
    agent.unsubscribe(boom)  # twice is harmless
    agent.deregister(info.segment_id)


def test_deregister_while_memory_viewed_defers_unmap(agent: Agent) -> None:
    info = agent.allocate(PAGE_SIZE)
    in_flight = agent.resolve(info.segment_id).memory[0:16]  # a data-path thread mid-transfer
    agent.deregister(info.segment_id)
    assert agent.counters()["deferred_unmaps"] == 1
    in_flight[0] = 1  # still valid memory: no crash
    del in_flight
    agent.allocate(PAGE_SIZE)  # later mutations retry the unmap
    assert agent.counters()["deferred_unmaps"] == 0


def test_concurrent_allocations_respect_budget(agent: Agent) -> None:
    errors: list[Exception] = []

    def worker() -> None:
        try:
            agent.allocate(PAGE_SIZE)
        except ResourceExhausted as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(agent.segments()) == 16 and len(errors) == 8
    assert agent.counters()["pool_bytes_charged"] == 16 * PAGE_SIZE


def test_close_releases_and_refuses(agent: Agent) -> None:
    agent.allocate(PAGE_SIZE)
    agent.close()
    assert agent.segments() == [] and agent.resolve(1) is None
    with pytest.raises(ParamInvalid, match="closed"):
        agent.allocate(PAGE_SIZE)
    agent.close()



def test_memory_still_viewed_stays_charged_until_its_pages_are_gone(agent: Agent) -> None:
    """allocate -> a data connection views it -> deregister: the pages stay mapped while
    viewed, so they stay charged to pool_max_bytes; a loop of these cannot pin more than
    the budget. Once the view is dropped, the next allocation finds the bytes free."""
    info = agent.allocate(12 * PAGE_SIZE)
    served = agent.resolve(info.segment_id)
    assert served is not None
    view = served.memory[:PAGE_SIZE]  # what a connection mid-transfer holds
    del served
    agent.deregister(info.segment_id)
    counters = agent.counters()
    assert counters["deferred_unmaps"] == 1
    assert counters["pool_bytes_charged"] == 12 * PAGE_SIZE  # not credited back yet
    with pytest.raises(ResourceExhausted, match="only 16384 of pool_max_bytes"):
        agent.allocate(8 * PAGE_SIZE)
    view.release()
    del view
    again = agent.allocate(8 * PAGE_SIZE)  # the retry found the old pages gone
    counters = agent.counters()
    assert counters["deferred_unmaps"] == 0 and counters["pool_bytes_charged"] == 8 * PAGE_SIZE
    agent.deregister(again.segment_id)
    assert agent.counters()["pool_bytes_charged"] == 0
