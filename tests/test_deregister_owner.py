"""Only a segment's creator may withdraw it (issue 15, item 8), attacked on a real agent.

Before, DeregisterSegment took any segment id: any caller (any token holder) deleted the
agent's pool or another client's allow-listed segments. Now AllocateSegment /
RegisterSegment hand their caller a release key that DeregisterSegment must present, and
the pool has none a remote caller could present.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest
from conftest import AgentProcess

from hixl import Engine
from hixl.client.agent_client import AgentClient
from hixl.errors import PermissionDenied
from hixl.types import Perm
from hixl.v1 import agent_pb2, agent_pb2_grpc

StartAgent = Callable[..., AgentProcess]


def test_only_the_creator_deregisters_a_segment(agent_process: StartAgent) -> None:
    agent = agent_process(config={"pool": [{"name": "kv", "size": "1MiB"}]})
    [pool] = agent.info.segments
    with AgentClient(agent.engine) as owner, AgentClient(agent.engine) as attacker:
        mine = owner.allocate(1 << 16, Perm.RW, "victim", allowed_engines=["10.9.9.9:1"])
        for target in (mine, pool):
            with pytest.raises(PermissionDenied, match="may be deregistered only by"):
                attacker.deregister(target.segment_id, target.epoch)
        # a raw caller guessing keys fares no better
        with grpc.insecure_channel(agent.engine) as channel:
            stub = agent_pb2_grpc.AgentStub(channel)
            for guess in (b"", b"\0" * 16, b"x" * 16):
                with pytest.raises(grpc.RpcError) as err:
                    stub.DeregisterSegment(agent_pb2.DeregisterSegmentRequest(
                        segment_id=mine.segment_id, epoch=mine.epoch, release_key=guess),
                        timeout=5)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        segments = {s.segment_id for s in attacker.list_segments()[1]}
        assert {mine.segment_id, pool.segment_id} <= segments  # both still served
        owner.deregister(mine.segment_id, mine.epoch)  # its creator may
        assert mine.segment_id not in {s.segment_id for s in owner.list_segments()[1]}
    # the pool still serves, byte for byte
    data = np.random.default_rng(8).integers(0, 256, 4096, dtype=np.uint8)
    back = np.zeros_like(data)
    with Engine("127.0.0.1", {"EnableUseFabricMem": "0"}) as engine:
        engine.connect(agent.engine, 10)
        engine.register(data)
        engine.register(back)
        engine.write(agent.engine, data, pool.base)
        engine.read(agent.engine, back, pool.base)
        # Engine.allocate / release go through one client: release proves the key itself
        seg = engine.allocate(agent.engine, 4096)
        engine.release(agent.engine, seg)
    assert (back == data).all()
