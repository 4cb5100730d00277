#!/usr/bin/env python3
"""Where one small op on the unix socket path spends its time, and what C buys.

    .venv/bin/python scripts/socket_floor.py [--ops 3000] [--rounds 5] [--size 4096]

Issue 14 asked, before any compiled code is added: if pure Python cannot get near the raw
stream, what would a small compiled piece buy, measured on a prototype? This script is
that measurement. It builds `socket_floor/fastwire.c` (a CPython extension: hixl's frame
for one WRITE or READ sent and answered in C, and a C server loop speaking the same wire)
with the system's `gcc` into a temporary directory, starts a private `hixl-agent`, and
runs, in one process and in rounds interleaved so the machine's load hits all alike:

- raw python:        the raw Python socket stream (8-byte header, the payload, an 8-byte ack)
- Engine->agent:     what users run: `Engine.transfer` of one op to the agent, with
                     hixl._fastwire (hixl/_fastwire.c: the lone op in C on both sides)
- Engine[py]->agent[py]: the same with HIXL_FASTWIRE=0 on both sides (pure Python)
- SocketTransport->agent: the transport alone (no engine resolve or accounting), C both
                     sides; [py] marks a side in pure Python (a second agent runs with
                     HIXL_FASTWIRE=0, a transport is made with it off)
- py+C single->agent[py]: the prototype: one C function per op against the Python agent
- C loop->agent / C loop->agent[py]: the whole client loop in C: the agent's cost alone
- ...->C srv:        the same clients against the prototype's C server: the client's cost

For each: the median over rounds of the p50 wall time per op, and the CPU per op of the
calling thread and of the whole server process (all its threads, from schedstat): CPU
figures hold up on a loaded machine where wall times do not. The results and what they
mean are in docs/benchmarks.md ("The socket path's floor"). Needs Linux, root not
required; exits 2 without gcc or the Python headers.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hixl import wire
from hixl.client.engine import Engine
from hixl.tools.daemons import AgentProcess
from hixl.transports import tcp
from hixl.transports.base import Item
from hixl.transports.tcp import SocketTransport
from hixl.types import MemType, Perm, SegmentInfo, TransferOp, TransferOpDesc

HERE = os.path.dirname(os.path.abspath(__file__))
WRITE, READ = int(wire.Op.WRITE), int(wire.Op.READ)


def build_extension(workdir: str) -> Any:
    """Compile fastwire.c into `workdir` and import it."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    target = os.path.join(workdir, f"fastwire{suffix}")
    include = sysconfig.get_paths()["include"]
    if shutil.which("gcc") is None or not os.path.exists(os.path.join(include, "Python.h")):
        print("socket_floor: needs gcc and the interpreter's headers (Python.h)", file=sys.stderr)
        raise SystemExit(2)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", f"-I{include}",
                    os.path.join(HERE, "socket_floor", "fastwire.c"), "-o", target], check=True)
    spec = importlib.util.spec_from_file_location("fastwire", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def process_cpu(pid: int) -> float:
    """CPU seconds of every thread of `pid` and of its children (ns resolution)."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        except OSError:  # the thread ended
            pass
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                total += sum(process_cpu(int(kid)) for kid in f.read().split())
        except OSError:
            pass
    return total


def fork_server(path: str, serve: Callable[[socket.socket], None]) -> int:
    """A forked server on unix socket `path`: one forked child per connection."""
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(4)
    pid = os.fork()
    if pid == 0:
        while True:
            conn, _ = listener.accept()
            if os.fork() == 0:
                serve(conn)
                os._exit(0)
            conn.close()
    listener.close()
    return pid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=3000, help="ops per case and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=4096, help="bytes per op (<= 16 KiB)")
    args = parser.parse_args()
    size = args.size
    if tcp.FASTWIRE is None:
        print("socket_floor: hixl._fastwire is not built (no compiler at install time) or "
              "HIXL_FASTWIRE=0: nothing to compare", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hixl-floor-") as workdir:
        fastwire = build_extension(workdir)
        server_buffer = np.zeros(1 << 20, np.uint8)

        def raw_serve(conn: socket.socket) -> None:
            scratch = memoryview(bytearray(size + 8))
            data = bytes(size)
            while conn.recv_into(scratch, 8, socket.MSG_WAITALL) == 8:
                if scratch[0] == 1:
                    conn.recv_into(scratch, size, socket.MSG_WAITALL)
                    conn.sendall(b"OKOKOKOK")
                else:
                    conn.sendmsg([b"OKOKOKOK", data])

        def c_serve(conn: socket.socket) -> None:
            fastwire.serve(conn.fileno(), server_buffer.ctypes.data, server_buffer.nbytes)

        agent = AgentProcess(pool_bytes=64 << 20)
        os.environ["HIXL_FASTWIRE"] = "0"  # the second agent answers in pure Python
        try:
            agent_py = AgentProcess(pool_bytes=64 << 20)
        finally:
            del os.environ["HIXL_FASTWIRE"]
        children: list[int] = []
        try:
            agents = (agent.proc.pid, agent.wait_ready(), agent_py.proc.pid,
                      agent_py.wait_ready())
            raw_path, c_path = os.path.join(workdir, "raw.sock"), os.path.join(workdir, "c.sock")
            children += [fork_server(raw_path, raw_serve), fork_server(c_path, c_serve)]
            return run(args, fastwire, agents, raw_path, c_path, *children, server_buffer)
        finally:
            for pid in children:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            agent.stop()
            agent_py.stop()


def engine_to(name: str, size: int, local: np.ndarray) -> tuple[Engine, SegmentInfo, str]:
    """An engine connected to agent `name` (the unix socket path: checked), one segment
    there, `local` registered, one op done; and the agent's socket address."""
    engine = Engine("127.0.0.1", {"EnableUseFabricMem": "0"})
    engine.connect(name)
    segment = engine.allocate(name, 1 << 20, "rw", "socket-floor")
    engine.register(local)
    engine.transfer(name, TransferOp.WRITE, [TransferOpDesc(local.ctypes.data, segment.base,
                                                            size)], 5)
    data_address = engine.route(name, segment.base)
    assert str(data_address) == "unix", data_address
    return engine, segment, engine._peers[name].socket_address


def transport_to(address: str, item: Item, fast: bool) -> SocketTransport:
    """A transport of our own (lone ops in C or in Python), its pooled connection open."""
    saved = tcp.FASTWIRE
    if not fast:
        tcp.FASTWIRE = None
    try:
        transport = SocketTransport(address, identity="socket-floor")
    finally:
        tcp.FASTWIRE = saved
    transport.transfer(TransferOp.WRITE, [item], time.monotonic() + 5)
    return transport


def run(args: argparse.Namespace, fastwire: Any, agents: tuple[int, str, int, str],
        raw_path: str, c_path: str, raw_pid: int, c_pid: int, server_buffer: np.ndarray) -> int:
    size = args.size
    agent_pid, name, agent_py_pid, name_py = agents
    local = np.zeros(1 << 20, np.uint8)
    local_addr = local.ctypes.data
    engine, segment, address = engine_to(name, size, local)
    saved, tcp.FASTWIRE = tcp.FASTWIRE, None  # a pure-Python engine: its transports too
    try:
        engine_py, segment_py, address_py = engine_to(name_py, size, local)
    finally:
        tcp.FASTWIRE = saved
    descs = [TransferOpDesc(local_addr, segment.base, size)]
    descs_py = [TransferOpDesc(local_addr, segment_py.base, size)]
    item = Item(0, local_addr, segment, segment.base, size)
    item_py = Item(0, local_addr, segment_py, segment_py.base, size)
    to_agent = transport_to(address, item, True)
    py_to_agent = transport_to(address, item, False)
    to_agent_py = transport_to(address_py, item_py, True)
    py_to_agent_py = transport_to(address_py, item_py, False)
    # pooled connections of our own transports: the ones the prototype's C drives
    agent_fd = to_agent._idle[0].sock.fileno()
    agent_py_fd = to_agent_py._idle[0].sock.fileno()
    c_segment = SegmentInfo(1, "c", "n", server_buffer.ctypes.data, server_buffer.nbytes,
                            MemType.MEM_HOST, Perm.RW, 1, False)
    c_item = Item(0, local_addr, c_segment, c_segment.base, size)
    to_c = transport_to(f"unix://{c_path}", c_item, True)
    py_to_c = transport_to(f"unix://{c_path}", c_item, False)
    c_conn = socket.socket(socket.AF_UNIX)
    c_conn.connect(c_path)
    c_conn.sendall(wire.hello(0))
    c_conn.recv(wire.HEADER_SIZE, socket.MSG_WAITALL)
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(raw_path)
    payload, scratch = bytes(size), memoryview(bytearray(size + 8))
    request_id = [1 << 32]  # far above what the Python transports use on their connections

    def raw_op(opcode: int) -> Callable[[], None]:
        if opcode == WRITE:
            return lambda: (raw.sendmsg([b"\x01" * 8, payload]),
                            raw.recv_into(scratch, 8, socket.MSG_WAITALL))
        return lambda: (raw.sendall(b"\x02" * 8), raw.recv_into(scratch, size + 8, socket.MSG_WAITALL))

    def c_single(opcode: int, fd: int, seg: SegmentInfo) -> Callable[[], None]:
        def call() -> None:
            request_id[0] += 1
            if fastwire.single(fd, opcode, seg.epoch, request_id[0], seg.segment_id, seg.base,
                               local_addr, size):
                raise RuntimeError("C single op refused")
        return call

    def c_loop(opcode: int, fd: int, seg: SegmentInfo) -> Callable[[int], list[int]]:
        def loop(n: int) -> list[int]:
            out = np.zeros(n, np.int64)
            request_id[0] += n
            if fastwire.client_loop(fd, opcode, seg.epoch, request_id[0], seg.segment_id,
                                    seg.base, local_addr, size, n, out):
                raise RuntimeError("C loop refused")
            return out.tolist()
        return loop

    def timed(fn: Callable[[], Any]) -> Callable[[int], list[int]]:
        def loop(n: int) -> list[int]:
            times = []
            for _ in range(n):
                start = time.perf_counter_ns()
                fn()
                times.append(time.perf_counter_ns() - start)
            return times
        return loop

    results: dict[str, list[tuple[float, float, float]]] = {}
    for _ in range(args.rounds):
        for opname, op, opcode in (("write", TransferOp.WRITE, WRITE), ("read", TransferOp.READ, READ)):
            cases: list[tuple[str, Callable[[int], list[int]], int]] = [
                ("raw python", timed(raw_op(opcode)), raw_pid),
                ("Engine->agent", timed(lambda op=op: engine.transfer(name, op, descs, 5)), agent_pid),
                ("Engine[py]->agent[py]", timed(
                    lambda op=op: engine_py.transfer(name_py, op, descs_py, 5)), agent_py_pid),
                ("SocketTransport->agent", timed(
                    lambda op=op: to_agent.transfer(op, [item], time.monotonic() + 5)), agent_pid),
                ("SocketTransport[py]->agent[py]", timed(
                    lambda op=op: py_to_agent_py.transfer(op, [item_py], time.monotonic() + 5)),
                 agent_py_pid),
                ("SocketTransport->agent[py]", timed(
                    lambda op=op: to_agent_py.transfer(op, [item_py], time.monotonic() + 5)),
                 agent_py_pid),
                ("SocketTransport[py]->agent", timed(
                    lambda op=op: py_to_agent.transfer(op, [item], time.monotonic() + 5)),
                 agent_pid),
                ("py+C single->agent[py]", timed(c_single(opcode, agent_py_fd, segment_py)),
                 agent_py_pid),
                ("C loop->agent[py]", c_loop(opcode, agent_py_fd, segment_py), agent_py_pid),
                ("C loop->agent", c_loop(opcode, agent_fd, segment), agent_pid),
                ("SocketTransport->C srv", timed(
                    lambda op=op: to_c.transfer(op, [c_item], time.monotonic() + 5)), c_pid),
                ("SocketTransport[py]->C srv", timed(
                    lambda op=op: py_to_c.transfer(op, [c_item], time.monotonic() + 5)), c_pid),
                ("py+C single->C srv", timed(c_single(opcode, c_conn.fileno(), c_segment)), c_pid),
                ("C loop->C srv", c_loop(opcode, c_conn.fileno(), c_segment), c_pid),
            ]
            for label, loop, server_pid in cases:
                loop(300)  # warm-up
                client0, server0 = time.thread_time(), process_cpu(server_pid)
                times = sorted(loop(args.ops))
                client1, server1 = time.thread_time(), process_cpu(server_pid)
                results.setdefault(f"{label} {opname}", []).append((
                    times[len(times) // 2] / 1e3, 1e6 * (client1 - client0) / args.ops,
                    1e6 * (server1 - server0) / args.ops))
    print(f"one {size}-byte op on a unix socket, median of {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs")
    print(f"{'case':34s} {'p50 us':>7s} {'client CPU us':>14s} {'server CPU us':>14s}")
    for label, rounds in results.items():
        columns = [statistics.median(r[i] for r in rounds) for i in range(3)]
        print(f"{label:34s} {columns[0]:7.1f} {columns[1]:14.1f} {columns[2]:14.1f}")
    for transport in (to_agent, py_to_agent, to_agent_py, py_to_agent_py, to_c, py_to_c):
        transport.close()
    engine.close()
    engine_py.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
