"""Memory that cannot shrink under the agent (issue 15, item 3), attacked on a real agent.

A peer granted a writable fd on a segment could once `ftruncate` it to 0, and the agent's
next write into it (a PUT over the socket path) died of SIGBUS, with every tenant. Now
every memfd hixl creates is sealed against shrinking, growing and further seals before an
fd leaves the process, and a deposited fd without the size seals is refused.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable

import numpy as np
import pytest
from conftest import AgentProcess

from hixl import Engine
from hixl.client.agent_client import AgentClient, FdClient
from hixl.errors import ParamInvalid
from hixl.memory import PAGE_SIZE, SIZE_SEALS, ShmSegment, size_sealed
from hixl.types import Perm

StartAgent = Callable[..., AgentProcess]


def test_a_peer_cannot_shrink_grow_or_reseal_a_segment_and_the_agent_keeps_serving(
        agent_process: StartAgent) -> None:
    agent = agent_process()
    with AgentClient(agent.engine) as client:
        segment = client.allocate(4 * PAGE_SIZE, Perm.RW, "victim")
    with FdClient(agent.info.fd_socket) as fdc:
        grant = fdc.grant(segment.segment_id, segment.epoch, True)
        states = fdc.states()  # the liveness words come read-only
    try:
        assert size_sealed(grant.fd)
        for attack in (lambda: os.ftruncate(grant.fd, 0),
                       lambda: os.ftruncate(grant.fd, 1 << 30),
                       lambda: fcntl.fcntl(grant.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE),
                       lambda: os.posix_fallocate(grant.fd, 0, 1 << 30)):
            with pytest.raises(OSError) as exc:
                attack()
            assert exc.value.errno in (errno.EPERM, errno.EBUSY), exc.value
        assert os.fstat(grant.fd).st_size == 4 * PAGE_SIZE
    finally:
        os.close(grant.fd)
    assert states.capacity > 0
    # the agent writes into the segment itself (socket path) and reads it back: alive
    data = np.random.default_rng(1).integers(0, 256, 4 * PAGE_SIZE, dtype=np.uint8)
    back = np.zeros_like(data)
    with Engine("127.0.0.1", {"EnableUseFabricMem": "0"}) as engine:
        engine.connect(agent.engine, 10)
        engine.register(data)
        engine.register(back)
        engine.write(agent.engine, data, segment.base)
        engine.read(agent.engine, back, segment.base)
    assert (back == data).all()
    assert agent.proc.poll() is None


def test_unsealed_fds_are_refused_sealed_ones_served(agent_process: StartAgent) -> None:
    agent = agent_process()
    raw = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(raw, 2 * PAGE_SIZE)
        with AgentClient(agent.engine) as client:
            with pytest.raises(ParamInvalid, match="not sealed against shrinking.*F_SEAL_SHRINK"):
                client.register_fd(raw, 2 * PAGE_SIZE, agent.info.fd_socket)
            # sealed by the caller: accepted
            sealable = os.memfd_create("sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(sealable, 2 * PAGE_SIZE)
                fcntl.fcntl(sealable, fcntl.F_ADD_SEALS, SIZE_SEALS)
                served = client.register_fd(sealable, 2 * PAGE_SIZE, agent.info.fd_socket)
                assert served.shareable
            finally:
                os.close(sealable)
            mine = ShmSegment(PAGE_SIZE)  # hixl's own memory is sealed already
            try:
                assert client.register_fd(mine.fd, PAGE_SIZE, agent.info.fd_socket).shareable
            finally:
                mine.close()
    finally:
        os.close(raw)
    assert agent.proc.poll() is None
