"""Idle connections that never authenticate cannot stop traffic (issue 15, item 2).

The attack, against a real hixl-agent with a cluster token: FLOOD (300) TCP connections
to its data port that never send HELLO, held open. Before the fix they filled the
connection cap (256, shared with the unix data socket) and every honest client was turned
away for as long as they stayed open. Now they wait in a pre-auth budget of their own
(64 per listener; the oldest makes room for a newcomer) and each has a handshake
deadline (5 s), so: a client authenticated before the flood keeps working, a new honest
client on TCP or on the unix socket gets in while the flood holds every pre-auth slot,
what was stored before is intact, and the agent closes the idle sockets on its own.
Deadlines only prove "does not hang"; the honest client's wait is printed, not asserted.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import waiting
from conftest import AgentProcess

from hixl import auth
from hixl.client.agent_client import AgentClient
from hixl.memory import ShmSegment
from hixl.server.connections import HANDSHAKE_TIMEOUT_S, PREAUTH_CONNECTIONS
from hixl.transports.base import Item
from hixl.transports.tcp import SocketTransport
from hixl.types import SegmentInfo, TransferOp

TOKEN = b"preauth-flood-cluster-token"
FLOOD = 300
SEG = 1 << 20
DEADLINE_S = 60.0  # far beyond a healthy run: HANDSHAKE_TIMEOUT_S plus a loaded machine
StartAgent = Callable[..., AgentProcess]
wait_for = partial(waiting.wait_until, timeout=DEADLINE_S)


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.ENV_TOKEN, raising=False)
    monkeypatch.delenv(auth.ENV_TOKEN_FILE, raising=False)


def stats(agent: AgentProcess) -> dict[str, int]:
    with AgentClient(agent.engine, timeout=DEADLINE_S, cluster_token=TOKEN) as client:
        return client.stats()


def move(transport: SocketTransport, op: TransferOp, local: ShmSegment,
         seg: SegmentInfo, offset: int, length: int) -> None:
    transport.transfer(op, [Item(0, local.addr + offset, seg, seg.base + offset, length)],
                       time.monotonic() + DEADLINE_S)




def test_an_idle_flood_neither_blocks_honest_clients_nor_outlives_its_deadline(
        agent_process: StartAgent, tmp_path: Path) -> None:
    token_file = tmp_path / "cluster.token"
    token_file.write_bytes(TOKEN)
    token_file.chmod(0o600)
    agent = agent_process(config={"cluster_token_file": str(token_file),
                                  "pool": [{"name": "pool", "size": "1MiB"}]})
    seg = next(s for s in agent.info.segments if s.name == "pool")
    tcp, unix = f"tcp://{agent.info.data_tcp}", f"unix://{agent.info.data_unix}"
    host, port = agent.info.data_tcp.rsplit(":", 1)

    stored, back = ShmSegment(SEG), ShmSegment(SEG)
    stored.view()[:] = os.urandom(SEG)
    before = SocketTransport(tcp, identity="before", cluster_token=TOKEN, max_connections=1)
    move(before, TransferOp.WRITE, stored, seg, 0, SEG)  # authenticated before the flood
    started = time.monotonic()
    calm = SocketTransport(tcp, identity="calm", cluster_token=TOKEN)
    move(calm, TransferOp.WRITE, stored, seg, 0, 64 << 10)
    calm_s = time.monotonic() - started
    calm.close()
    base = stats(agent)

    flood: list[socket.socket] = []
    try:
        for _ in range(FLOOD):  # connect, never say HELLO, hold the socket open
            flood.append(socket.create_connection((host, int(port))))
        # the agent took every one of them: the newest hold every pre-auth slot, the rest
        # made room for them, none took an authenticated slot
        wait_for(lambda: stats(agent)["data_connections"] - base["data_connections"] >= FLOOD,
                 "the agent accepted the whole flood")
        during = stats(agent)
        assert during["data_preauth_evicted"] >= FLOOD - PREAUTH_CONNECTIONS
        assert during["data_connections_rejected"] == 0

        # the connection authenticated before the flood still works
        move(before, TransferOp.READ, back, seg, 0, SEG)
        assert bytes(back.view()) == bytes(stored.view())  # nothing stored was lost

        # new honest clients get in while the flood holds every pre-auth slot
        waited = {}
        fresh = os.urandom(64 << 10)
        for name, address, offset in (("tcp", tcp, 0), ("unix", unix, 128 << 10)):
            stored.view()[offset:offset + len(fresh)] = fresh
            started = time.monotonic()
            honest = SocketTransport(address, identity=f"honest-{name}", cluster_token=TOKEN)
            try:
                move(honest, TransferOp.WRITE, stored, seg, offset, len(fresh))
                waited[name] = time.monotonic() - started
                move(honest, TransferOp.READ, back, seg, offset, len(fresh))
            finally:
                honest.close()
            assert bytes(back.view()[offset:offset + len(fresh)]) == fresh
        print(f"honest client under a {FLOOD}-connection idle flood: connect+handshake+64 KiB "
              f"write took {waited['tcp'] * 1e3:.1f} ms (tcp), {waited['unix'] * 1e3:.1f} ms "
              f"(unix); {calm_s * 1e3:.1f} ms (tcp) with no flood")

        # the agent closes the idle sockets itself, at their handshake deadline
        wait_for(lambda: all(waiting.closed_by_peer(s) for s in flood),
                 f"the agent closed every idle socket ({HANDSHAKE_TIMEOUT_S:g} s deadline)")
        after = stats(agent)
        assert after["data_handshake_timeouts"] >= PREAUTH_CONNECTIONS - 1  # one made room
        assert after["data_connections_rejected"] == 0
    finally:
        for sock in flood:
            sock.close()

    move(before, TransferOp.READ, back, seg, 0, SEG)  # the old connection still serves
    assert bytes(back.view()) == bytes(stored.view())
    before.close()
