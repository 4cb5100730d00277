"""`hixl.Hixl`: HIXL's names, argument order and integer status codes, end to end.

The server side is a real Hixl engine initialised with "ip:port" (an embedded agent
serving its registered memory) in a separate process; the client is this process.
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
import textwrap
import time

import numpy as np
import pytest

import hixl
from hixl import Hixl, MemDesc, MemType, TransferOp, TransferOpDesc, TransferStatus
from hixl.processes import DaemonProcess, free_port

SERVER_BYTES = 1 << 20


SERVER = textwrap.dedent("""
    import ctypes, json, sys
    import hixl
    from hixl import Hixl, MemDesc, MemType
    name = sys.argv[1]
    engine = Hixl()
    assert engine.initialize(name, {hixl.OPTION_ENABLE_USE_FABRIC_MEM: "1"}) == hixl.SUCCESS
    ret, shm = engine.malloc_mem(MemType.MEM_HOST, %(size)d)      # mappable by peers
    assert ret == hixl.SUCCESS
    plain = bytearray(%(size)d)                                   # not shareable: socket path
    plain_addr = ctypes.addressof(ctypes.c_char.from_buffer(plain))
    ctypes.memset(shm, 0x5A, %(size)d)
    plain[:] = b"\\x33" * %(size)d
    for addr in (shm, plain_addr):
        ret, handle = engine.register_mem(MemDesc(addr, %(size)d), MemType.MEM_HOST)
        assert ret == hixl.SUCCESS
    print(json.dumps({"shm": shm, "plain": plain_addr}), flush=True)
    sys.stdin.read()          # serve until the test closes our stdin
    engine.finalize()
""") % {"size": SERVER_BYTES}


@pytest.fixture
def server_engine():
    name = f"127.0.0.1:{free_port()}"
    server = DaemonProcess([sys.executable, "-c", SERVER, name], name="server engine",
                           ready=re.compile(r"^\{"), stop_by="stdin", grace_s=20.0)
    try:
        yield name, json.loads(server.wait_ready())
    finally:
        returncode = server.stop()
        server.close()
    assert returncode == 0, server.tail()


def test_module_exports_hixl_names() -> None:
    assert (hixl.SUCCESS, hixl.PARAM_INVALID, hixl.TIMEOUT, hixl.NOT_CONNECTED,
            hixl.ALREADY_CONNECTED, hixl.UNSUPPORTED, hixl.RESOURCE_EXHAUSTED, hixl.FAILED) == (
        0, 103900, 103901, 103902, 103903, 103905, 203900, 503900)
    assert hixl.OPTION_ENABLE_USE_FABRIC_MEM == "EnableUseFabricMem"
    assert hixl.OPTION_BUFFER_POOL == "BufferPool"
    assert {MemType.MEM_DEVICE, MemType.MEM_HOST} and {TransferOp.READ, TransferOp.WRITE}
    assert TransferStatus.WAITING != TransferStatus.COMPLETED
    desc = TransferOpDesc(1, 2, 3)
    assert (desc.local_addr, desc.remote_addr, desc.len) == (1, 2, 3)
    assert (MemDesc(4, 5).addr, MemDesc(4, 5).len) == (4, 5)


@pytest.mark.parametrize("fabric", ["1", "0"], ids=["fabric", "socket"])
def test_client_puts_and_gets_into_a_server_engines_memory(server_engine, fabric: str) -> None:
    name, addrs = server_engine
    client = Hixl()
    assert client.initialize("127.0.0.1", {hixl.OPTION_ENABLE_USE_FABRIC_MEM: fabric}) == hixl.SUCCESS
    try:
        local = np.zeros(SERVER_BYTES, np.uint8)
        ret, handle = client.register_mem(MemDesc(local.ctypes.data, local.nbytes), MemType.MEM_HOST)
        assert ret == hixl.SUCCESS and handle is not None
        assert client.transfer_sync(name, TransferOp.READ,
                                    [TransferOpDesc(local.ctypes.data, addrs["shm"], 64)]) == hixl.NOT_CONNECTED
        assert client.connect(name, timeout_in_millis=5000) == hixl.SUCCESS
        assert client.connect(name, timeout_in_millis=5000) == hixl.ALREADY_CONNECTED

        # malloc_mem memory is mapped directly when the option is on; plain memory is streamed
        engine = client._engine
        assert engine.route(name, addrs["shm"]) == ("fabric" if fabric == "1" else "unix")
        assert engine.route(name, addrs["plain"]) == "unix"
        for target, fill in ((addrs["shm"], 0x5A), (addrs["plain"], 0x33)):
            assert client.transfer_sync(name, TransferOp.READ,
                                        [TransferOpDesc(local.ctypes.data, target, SERVER_BYTES)],
                                        timeout_in_millis=5000) == hixl.SUCCESS
            assert set(local.tobytes()) == {fill}
            payload = np.random.default_rng(fill).integers(0, 256, SERVER_BYTES, dtype=np.uint8)
            local[:] = payload
            # a batch of subsets of the registered region (allowed, as in HIXL)
            descs = [TransferOpDesc(local.ctypes.data + off, target + off, 4096)
                     for off in range(0, SERVER_BYTES, 4096)]
            assert client.transfer_sync(name, TransferOp.WRITE, descs, 5000) == hixl.SUCCESS
            local[:] = 0
            ret, req = client.transfer_async(name, TransferOp.READ,
                                             [TransferOpDesc(local.ctypes.data, target, SERVER_BYTES)])
            assert ret == hixl.SUCCESS
            status = TransferStatus.WAITING
            give_up = time.monotonic() + 30
            while status == TransferStatus.WAITING and time.monotonic() < give_up:
                ret, status = client.get_transfer_status(req)
                assert ret == hixl.SUCCESS
            assert status == TransferStatus.COMPLETED
            assert client.get_transfer_status(req)[0] == hixl.PARAM_INVALID  # freed once done
            assert local.tobytes() == payload.tobytes()
            # write back the fill so the other parametrisation sees it
            local[:] = fill
            assert client.transfer_sync(name, TransferOp.WRITE,
                                        [TransferOpDesc(local.ctypes.data, target, SERVER_BYTES)],
                                        5000) == hixl.SUCCESS

        # errors come back as codes, with the reason kept in last_error
        assert client.transfer_sync(name, TransferOp.WRITE,
                                    [TransferOpDesc(local.ctypes.data, addrs["shm"] + SERVER_BYTES - 1, 2)]
                                    ) == hixl.PARAM_INVALID
        assert "crosses the end" in str(client.last_error)
        assert client.transfer_sync(name, TransferOp.WRITE,
                                    [TransferOpDesc(12345, addrs["shm"], 2)]) == hixl.PARAM_INVALID
        assert client.transfer_sync(name, TransferOp.WRITE,
                                    [TransferOpDesc(local.ctypes.data, addrs["shm"], 0)]) == hixl.PARAM_INVALID
        assert client.transfer_sync(name, TransferOp.WRITE, [TransferOpDesc(local.ctypes.data, addrs["shm"], 8)],
                                    timeout_in_millis=0) == hixl.PARAM_INVALID

        assert client.disconnect(name) == hixl.SUCCESS
        assert client.disconnect(name) == hixl.NOT_CONNECTED
        assert client.transfer_sync(name, TransferOp.READ,
                                    [TransferOpDesc(local.ctypes.data, addrs["shm"], 8)]) == hixl.NOT_CONNECTED
        assert client.deregister_mem(handle) == hixl.SUCCESS
        # HIXL's DeregisterMem is idempotent: a second call is a no-op returning SUCCESS
        assert client.deregister_mem(handle) == hixl.SUCCESS
        assert client.deregister_mem(None) == hixl.PARAM_INVALID
    finally:
        client.finalize()


def test_calls_before_initialize_and_bad_arguments() -> None:
    engine = Hixl()
    assert engine.connect("127.0.0.1:1") == hixl.NOT_CONNECTED
    assert engine.register_mem(MemDesc(1, 1), MemType.MEM_HOST)[0] == hixl.NOT_CONNECTED
    assert engine.initialize("127.0.0.1", {"NoSuchOption": "1"}) == hixl.PARAM_INVALID
    assert "NoSuchOption" in str(engine.last_error)
    assert engine.initialize("127.0.0.1", {hixl.OPTION_ENABLE_USE_FABRIC_MEM: "yes"}) == hixl.PARAM_INVALID
    assert engine.initialize("127.0.0.1:notaport") == hixl.PARAM_INVALID
    assert engine.initialize("127.0.0.1") == hixl.SUCCESS
    try:
        assert engine.initialize("127.0.0.1") == hixl.PARAM_INVALID  # twice
        assert engine.register_mem("not a MemDesc", MemType.MEM_HOST)[0] == hixl.PARAM_INVALID
        assert engine.register_mem(MemDesc(4096, 0), MemType.MEM_HOST)[0] == hixl.PARAM_INVALID
        assert engine.register_mem(MemDesc(4096, 64), MemType.MEM_DEVICE)[0] == hixl.UNSUPPORTED
        ret, addr = engine.malloc_mem(MemType.MEM_HOST, 1 << 16)
        assert ret == hixl.SUCCESS and addr
        ctypes.memset(addr, 1, 1 << 16)  # the memory is usable
        ret, handle = engine.register_mem(MemDesc(addr, 1 << 16), MemType.MEM_HOST)
        assert ret == hixl.SUCCESS
        assert engine.free_mem(addr) == hixl.PARAM_INVALID  # still registered
        assert engine.deregister_mem(handle) == hixl.SUCCESS
        assert engine.free_mem(addr) == hixl.SUCCESS
        assert engine.free_mem(addr) == hixl.PARAM_INVALID
        assert engine.malloc_mem(MemType.MEM_HOST, 0)[0] == hixl.PARAM_INVALID
        assert engine.connect("127.0.0.1:1", timeout_in_millis=500) != hixl.SUCCESS
    finally:
        engine.finalize()
