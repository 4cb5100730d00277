"""An idle data connection pins no segment memory (issue 15, item 9, the data server half).

Against a real hixl-agent: a client allocates a segment, writes into it over the socket
path (a lone op, and a pipelined batch that takes the run path), and keeps its data
connection open and idle; the segment is then deregistered. Before the fix, the
connection's thread kept views of the segment it last served (the last action and window
it handled) while it waited for its next header, so the agent could not unmap the memory
and counted a deferred unmap (`deferred_unmaps` in the agent's Stats) that nothing ever
cleared. Now every view is dropped before the connection blocks: the unmap is immediate.
The connection stays usable, and the other segment's bytes are intact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial

import pytest
import waiting
from conftest import AgentProcess

from hixl.client.agent_client import AgentClient
from hixl.memory import ShmSegment
from hixl.transports.base import Item
from hixl.transports.tcp import SocketTransport
from hixl.types import TransferOp

SEG = 1 << 20
DEADLINE_S = 30.0
StartAgent = Callable[..., AgentProcess]
wait_for = partial(waiting.wait_until, timeout=DEADLINE_S)


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_a_deregistered_segment_is_unmapped_while_a_connection_idles(
        agent_process: StartAgent, kind: str) -> None:
    agent = agent_process(config={"pool": [{"name": "pool", "size": "1MiB"}]})
    address = (f"unix://{agent.info.data_unix}" if kind == "unix"
               else f"tcp://{agent.info.data_tcp}")
    pool = next(s for s in agent.info.segments if s.name == "pool")
    local, back = ShmSegment(SEG), ShmSegment(SEG)
    local.view()[:] = os.urandom(SEG)
    transport = SocketTransport(address, identity="idler", max_connections=1)
    with AgentClient(agent.engine, timeout=DEADLINE_S) as client:
        try:
            transport.transfer(TransferOp.WRITE, [Item(0, local.addr, pool, pool.base, SEG)],
                               time.monotonic() + DEADLINE_S)
            for items in ([(0, 4096)],  # a lone op: answered at once
                          [(i * 8192, 4096) for i in range(64)]):  # a batch: a run reply
                seg = client.allocate(SEG, name="doomed")
                transport.transfer(TransferOp.WRITE, [
                    Item(n, local.addr + off, seg, seg.base + off, length)
                    for n, (off, length) in enumerate(items)], time.monotonic() + DEADLINE_S)
                # the connection is open and idle; its thread waits for the next header
                client.deregister(seg.segment_id, seg.epoch)
                wait_for(lambda: client.stats()["deferred_unmaps"] == 0,
                         "the deregistered segment is unmapped")
                stats = client.stats()
                assert stats["pool_bytes_charged"] == 0  # the budget got its bytes back
            transport.transfer(TransferOp.READ, [Item(0, back.addr, pool, pool.base, SEG)],
                               time.monotonic() + DEADLINE_S)
        finally:
            transport.close()
    assert bytes(back.view()) == bytes(local.view())
