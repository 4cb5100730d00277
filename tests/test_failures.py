"""The agent dies, hangs or restarts under a client: every call ends by its deadline with
a typed error, nothing hangs, and handles from before a restart are refused."""

from __future__ import annotations

import os
import signal
import socket
import time

import numpy as np
import pytest

from hixl import (
    Engine,
    HixlError,
    PeerUnavailable,
    StaleEpoch,
    TransferFailed,
    TransferOp,
    TransferOpDesc,
    TransferStatus,
    TransferTimeout,
)
from hixl.processes import free_port

POOL = 64 << 20
GIVE_UP_S = 20.0  # only a guard against a hang: the assertions never depend on timing


@pytest.fixture
def restartable(agent_process):
    """Start (and restart) an agent on fixed ports and a fixed runtime dir."""
    ports = {"grpc_port": free_port(), "data_port": free_port()}
    first = agent_process(config={**ports, "pool": [{"name": "kv", "size": POOL}]})

    def restart():
        return agent_process(config={**ports, "runtime_dir": first.runtime_dir,
                                     "pool": [{"name": "kv", "size": POOL}]})

    return first, restart


def kv_segment(engine: Engine, agent: str):
    (segment,) = [s for s in engine.segments(agent) if s.name == "kv"]
    return segment


def big_batch(buf: np.ndarray, base: int, total: int) -> list[TransferOpDesc]:
    """`total` bytes in 16 MiB ops, all landing inside the pool segment."""
    step = 16 << 20
    return [TransferOpDesc(buf.ctypes.data, base, step) for _ in range(total // step)]


def test_agent_killed_mid_transfer_fails_the_request_and_nothing_hangs(agent_process) -> None:
    node = agent_process(config={"pool": [{"name": "kv", "size": POOL}]})
    with Engine("127.0.0.1", {"EnableUseFabricMem": "0"}) as engine:
        engine.connect(node.engine, timeout=10)
        kv = kv_segment(engine, node.engine)
        buf = np.ones(16 << 20, np.uint8)
        engine.register(buf)
        # Freeze the agent so the 1 GiB batch is surely in flight, then kill it.
        node.proc.send_signal(signal.SIGSTOP)
        req = engine.transfer_async(node.engine, TransferOp.WRITE, big_batch(buf, kv.base, 1 << 30),
                                    timeout=10)
        assert req.status == TransferStatus.WAITING
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(GIVE_UP_S)
        with pytest.raises((PeerUnavailable, TransferTimeout)) as info:
            req.wait()
        assert req.status == TransferStatus.FAILED
        assert info.value.failed  # names the ops that did not complete
        # later calls fail at once with a typed error, by their deadline at worst
        with pytest.raises(HixlError):
            engine.write(node.engine, buf, kv.base, timeout=2)


def test_hung_agent_times_out_then_recovers_without_restart(agent_process) -> None:
    node = agent_process(config={"pool": [{"name": "kv", "size": POOL}]})
    with Engine("127.0.0.1", {"EnableUseFabricMem": "0"}) as engine:
        engine.connect(node.engine, timeout=10)
        kv = kv_segment(engine, node.engine)
        buf = np.arange(16 << 20, dtype=np.uint64).view(np.uint8)[: 16 << 20].copy()
        engine.register(buf)
        node.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(TransferTimeout) as info:
                engine.transfer(node.engine, TransferOp.WRITE, big_batch(buf, kv.base, 256 << 20),
                                timeout=1)
            assert info.value.status == 103901  # TIMEOUT
            assert info.value.failed
        finally:
            node.proc.send_signal(signal.SIGCONT)
        engine.write(node.engine, buf, kv.base, timeout=10)
        out = np.zeros_like(buf)
        engine.register(out)
        engine.read(node.engine, out, kv.base, timeout=10)
        assert out.tobytes() == buf.tobytes()


def test_fabric_write_to_a_dead_agent_is_reported_failed(agent_process) -> None:
    node = agent_process(config={"pool": [{"name": "kv", "size": POOL}]})
    with Engine("127.0.0.1", {"EnableUseFabricMem": "1"}) as engine:
        engine.connect(node.engine, timeout=10)
        kv = kv_segment(engine, node.engine)
        buf = np.ones(1 << 20, np.uint8)
        engine.register(buf)
        engine.write(node.engine, buf, kv.base)  # maps the segment
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(GIVE_UP_S)
        # reaped, so the kernel has marked its life word: the very next write fails
        with pytest.raises(PeerUnavailable, match="died"):
            engine.write(node.engine, buf, kv.base)


@pytest.mark.parametrize("fabric", ["1", "0"], ids=["fabric", "socket"])
def test_restarted_agent_refuses_stale_handles_and_clients_reconnect(restartable, fabric) -> None:
    first, restart = restartable
    with Engine("127.0.0.1", {"EnableUseFabricMem": fabric}) as engine:
        engine.connect(first.engine, timeout=10)
        old = kv_segment(engine, first.engine)
        data = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
        engine.register(data)
        engine.write(first.engine, data, old.base)

        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(GIVE_UP_S)
        second = restart()
        assert second.engine == first.engine
        assert second.info.epoch != old.epoch

        # the old view of the table is void: refused, never silently reused
        with pytest.raises(TransferFailed) as info:
            deadline = time.monotonic() + GIVE_UP_S
            while time.monotonic() < deadline:  # until the fd watcher has seen the old agent go
                engine.write(first.engine, data, old.base, timeout=5)
                time.sleep(0.01)
        assert isinstance(info.value, StaleEpoch | PeerUnavailable), info.value
        with pytest.raises(StaleEpoch, match="restarted"):
            engine.segments(first.engine)

        # reconnecting picks up the new epoch and works
        engine.disconnect(first.engine)
        engine.connect(first.engine, timeout=10)
        new = kv_segment(engine, first.engine)
        assert new.epoch == second.info.epoch
        engine.write(first.engine, data, new.base)
        out = np.zeros_like(data)
        engine.register(out)
        engine.read(first.engine, out, new.base)
        assert out.tobytes() == data.tobytes()


def test_stale_epoch_frame_is_refused_on_the_wire(restartable) -> None:
    """A handle (segment id + epoch) from the agent's previous life, sent raw."""
    from hixl import wire

    first, restart = restartable
    old = [s for s in first.info.segments if s.name == "kv"][0]
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(GIVE_UP_S)
    second = restart()
    host, port = second.info.data_tcp.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(wire.hello(1) + wire.read_request(2, old.segment_id, old.epoch, old.base, 64))
        raw = b""
        while len(raw) < 2 * wire.HEADER_SIZE:
            chunk = sock.recv(65536)
            assert chunk, "agent closed the connection instead of answering"
            raw += chunk
    reply = wire.decode_header(raw[wire.HEADER_SIZE:2 * wire.HEADER_SIZE])
    assert reply.reason == wire.Reason.STALE_EPOCH
    assert os.path.exists(second.info.fd_socket)
