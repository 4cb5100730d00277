"""Declared lengths do not become memory before the data arrives (issue 15, item 4).

The attack, against a real hixl-master (no cluster token, as it runs by default): FLOOD
(16) connections to its store call endpoint each send HELLO, then a CALL header declaring
a 64 MiB body, and nothing more. Before the fix each header allocated (and zeroed) 64 MiB
at once: the master grew by 1 GiB. Now a body's buffer grows only as bytes arrive, and a
body that does not arrive within its deadline (10 s) closes the connection. Meanwhile a
Mooncake store keeps putting and getting over the same endpoint, and what it stored
before the flood comes back byte for byte. The master's VmRSS / VmHWM (/proc) are printed
before and after; the peak may not grow by more than one call's worth.
"""

from __future__ import annotations

import os
import socket
from functools import partial

import waiting

from hixl import wire
from hixl.client.mooncake import MooncakeDistributedStore
from hixl.store_rpc import METHODS
from hixl.tools.daemons import HolderProcess, MasterProcess

MiB = 1 << 20
FLOOD = 16
DECLARED = wire.MAX_CALL  # 64 MiB
DEADLINE_S = 60.0
wait_for = partial(waiting.wait_until, timeout=DEADLINE_S)


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of `pid`, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(value.split()[0]) * 1024
    return out




def test_a_header_flood_costs_the_master_no_memory(tmp_path: object) -> None:
    put_start = next(number for number, name in METHODS.items() if name == "PutStart")
    with MasterProcess() as master:
        holder = HolderProcess("hixl", master.target, "127.0.0.1", 64 * MiB)
        store = MooncakeDistributedStore(master_timeout=DEADLINE_S)
        flood: list[socket.socket] = []
        try:
            assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "",
                               master.target) == 0
            before_values = {f"before-{n}": os.urandom(n) for n in (1, 4096, 3 * MiB)}
            for key, value in before_values.items():
                assert store.put(key, value) == 0
            client = store._master
            assert client is not None and client.fast_port is not None
            fast_calls = client.fast_calls
            before = memory(master.proc.pid)

            for _ in range(FLOOD):
                sock = socket.create_connection(("127.0.0.1", client.fast_port))
                sock.sendall(wire.ClientProtocol().hello(b"attacker"))
                reply = wire.decode_header(sock.recv(wire.HEADER_SIZE, socket.MSG_WAITALL))
                assert reply.status == 0  # no token here: the attacker is served
                sock.sendall(wire.Header(wire.Op.CALL, 1, segment_id=put_start,
                                         length=DECLARED).pack())
                flood.append(sock)

            # honest traffic goes on over the same endpoint while the flood is held
            during_values = {f"during-{n}": os.urandom(n) for n in (7, 1 * MiB)}
            for key, value in during_values.items():
                assert store.put(key, value) == 0
            for key, value in {**before_values, **during_values}.items():
                assert store.get(key) == value, key
            assert client.fast_calls > fast_calls  # over the call endpoint, not gRPC

            # each stalled body is timed out: the master took every header and waited
            wait_for(lambda: all(waiting.closed_by_peer(s) for s in flood),
                     "the master closed every connection whose body stalled")
            after = memory(master.proc.pid)
            print(f"master under {FLOOD} x {DECLARED >> 20} MiB CALL headers: VmRSS "
                  f"{before['VmRSS'] / MiB:.0f} -> {after['VmRSS'] / MiB:.0f} MiB, VmHWM "
                  f"{before['VmHWM'] / MiB:.0f} -> {after['VmHWM'] / MiB:.0f} MiB")
            assert after["VmHWM"] - before["VmHWM"] < DECLARED  # was FLOOD * DECLARED

            for key, value in {**before_values, **during_values}.items():
                assert store.get(key) == value, key  # nothing stored was lost
        finally:
            for sock in flood:
                sock.close()
            store.close()
            holder.stop()


def read_reply(sock: socket.socket) -> tuple[wire.Header, bytes]:
    header = wire.decode_header(sock.recv(wire.HEADER_SIZE, socket.MSG_WAITALL))
    payload = sock.recv(header.length, socket.MSG_WAITALL) if header.length else b""
    return header, payload


def test_the_call_bytes_budget_refuses_a_call_and_the_connection_goes_on() -> None:
    """In-process (a real server on real sockets): a body the total budget cannot hold is
    refused unapplied after a short wait, its bytes skipped, and its connection serves the
    next frame; the call holding the budget completes; a stalled body closes its
    connection and gives its bytes back."""
    from hixl.server.master.store import ObjectStore
    from hixl.server.master.store_rpc_server import StoreCallServer
    from hixl.server.master.store_service import StoreCalls

    put_start = next(number for number, name in METHODS.items() if name == "PutStart")
    server = StoreCallServer(StoreCalls(ObjectStore()), call_bytes_budget=4 * MiB,
                             body_timeout=DEADLINE_S)
    server.start()
    socks = []
    try:
        def connect() -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", server.port))
            socks.append(sock)
            sock.sendall(wire.ClientProtocol().hello(b"t"))
            assert read_reply(sock)[0].status == 0
            return sock

        holder, refused = connect(), connect()
        holder.sendall(wire.Header(wire.Op.CALL, 1, segment_id=put_start,
                                   length=3 * MiB).pack() + bytes(5 * MiB // 2))
        wait_for(lambda: server.bytes_in_flight == 3 * MiB, "the first body holds 3 MiB")
        refused.sendall(wire.Header(wire.Op.CALL, 2, segment_id=put_start,
                                    length=2 * MiB).pack() + bytes(2 * MiB))
        header, text = read_reply(refused)
        assert header.reason == wire.Reason.INTERNAL and b"not applied" in text, text
        refused.sendall(wire.Header(wire.Op.PING, 3).pack())  # still in step
        assert read_reply(refused)[0].request_id == 3
        assert server.counters["calls_over_budget"] == 1
        holder.sendall(bytes(MiB // 2))  # the rest: the whole body arrives, and is parsed
        header, text = read_reply(holder)
        assert header.request_id == 1 and b"does not parse" in text, text  # zeros: no message
        wait_for(lambda: server.bytes_in_flight == 0, "the budget is given back")
    finally:
        for sock in socks:
            sock.close()
        server.stop()
