"""The data server end to end under malformed input: a real agent process, real sockets.

The agent (its own process: an AgentServer, the same runtime hixl-agent uses) serves
sub-ranges of one shm buffer as segments: read-write, read-only, write-only, odd sizes,
and one deregistered; every byte between and around them is a canary. The test maps the
same memfd (through /proc/<pid>/fd), so it sees every byte the agent could touch.
Hypothesis throws connections at the TCP and unix data ports: WRITE/READ frames whose
segment, epoch, address and length are hostile, pipelined mixes, then at most one frame
that breaks the stream (garbage, bad magic/version/opcode, a second HELLO, AUTH, REPLY,
CALL, a truncated or oversized payload), half-handshakes. After each connection: it
ended (no hang), the replies were well-formed frames, the agent is alive and logged no
unexpected exception, every canary byte is intact, segment bytes changed only where a
WRITE header in the stream pointed, and a legitimate client still gets a PUT/GET round
trip byte for byte. The same checks hold for frames sent one at a time, each waiting for
its reply (`lone_agent`): there the agent answers lone WRITE/READ frames in C
(hixl._fastwire) and hands everything else to Python; run with it and with HIXL_FASTWIRE=0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import mmap
import os
import random
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from hixl import wire
from hixl.types import Perm
from hixl.wire import HEADER, HEADER_SIZE, MAGIC, MAX_PAYLOAD, VERSION, Op

U64 = (1 << 64) - 1
TOKEN = b"fuzz-data-server-token"
DEADLINE_S = 20.0  # a connection must end within this: proves "no hang", never timed
CANARY_SEED = 7

#: The agent's buffer: (offset, length, perms) of each segment; the last is deregistered
#: before the test starts. Gaps of 64..4096 bytes between them are canaries.
BUFFER_SIZE = 64 << 10
SEGMENTS = [(4096, 16384, Perm.RW), (20544, 100, Perm.READ), (20708, 4000, Perm.WRITE),
            (24772, 8199, Perm.RW), (40000, 256, Perm.RW)]

AGENT_SCRIPT = r"""
import json, logging, random, sys
from hixl.memory import ShmSegment
from hixl.server.agent.config import AgentConfig
from hixl.server.agent.runtime import AgentServer
from hixl.types import Perm

runtime_dir, token, size, seed, layout = sys.argv[1:6]
handler = logging.StreamHandler(sys.stderr)
handler.setLevel(logging.WARNING)
logging.basicConfig(level=logging.WARNING, handlers=[handler])


class Unexpected(logging.Handler):
    # the data server logs an exception it did not expect (a bug) with its traceback
    def emit(self, record):
        if record.exc_info:
            sys.stderr.write("UNEXPECTED " + self.format(record) + "\n")
            sys.stderr.flush()


data_log = logging.getLogger("hixl.data")
data_log.setLevel(logging.DEBUG)
data_log.addHandler(Unexpected())
server = AgentServer(AgentConfig(host="127.0.0.1", grpc_port=0, runtime_dir=runtime_dir,
                                 node_id="fuzz"), cluster_token=token.encode() or None)
server.start()
shm = ShmSegment(int(size))
shm.view()[:] = random.Random(int(seed)).randbytes(shm.length)
served = []
for offset, length, perms in json.loads(layout):
    info = server.agent.register_memory(shm.addr + offset, length, Perm(perms),
                                        name=f"fuzz@{offset}", owner="fuzz", keepalive=shm)
    served.append({"segment_id": info.segment_id, "base": info.base, "length": length,
                   "perms": perms, "offset": offset})
server.agent.deregister(served[-1]["segment_id"])
print(json.dumps({"memfd": f"/proc/{__import__('os').getpid()}/fd/{shm.fd}",
                  "epoch": server.agent.epoch, "segments": served,
                  "tcp": server.endpoints.data_tcp, "unix": server.endpoints.data_unix}),
      flush=True)
sys.stdin.read()  # serve until the test closes our stdin
server.stop()
"""


@dataclass(frozen=True)
class Segment:
    segment_id: int
    base: int
    length: int
    perms: Perm
    offset: int  # in the shared buffer

    @property
    def end(self) -> int:
        return self.base + self.length


class FuzzAgent:
    """The agent process, its segments, and the test's own view of their memory."""

    def __init__(self, token: bytes | None, fastwire: str | None = None) -> None:
        """`fastwire`: HIXL_FASTWIRE for the agent ("0": lone ops in Python); None: as here."""
        self.token = token
        self.workdir = tempfile.mkdtemp(prefix="hxf-")
        self.stderr_path = os.path.join(self.workdir, "agent.err")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("HIXL_AGENT_", "HIXL_CLUSTER_TOKEN"))}
        if fastwire is not None:
            env["HIXL_FASTWIRE"] = fastwire
        layout = json.dumps([(off, length, int(perms)) for off, length, perms in SEGMENTS])
        with open(self.stderr_path, "w", encoding="utf-8") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", AGENT_SCRIPT, os.path.join(self.workdir, "run"),
                 (token or b"").decode(), str(BUFFER_SIZE), str(CANARY_SEED), layout],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(DEADLINE_S):
                self.close()
                pytest.fail(f"fuzz agent did not start; its log:\n{self.log()}")
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            pytest.fail(f"fuzz agent exited; its log:\n{self.log()}")
        info = json.loads(line)
        self.epoch: int = info["epoch"]
        self.tcp: str = info["tcp"]
        self.unix: str = info["unix"]
        all_segments = [Segment(s["segment_id"], s["base"], s["length"], Perm(s["perms"]),
                                s["offset"]) for s in info["segments"]]
        self.served, self.gone = all_segments[:-1], all_segments[-1]
        fd = os.open(info["memfd"], os.O_RDONLY)
        try:
            self.memory = mmap.mmap(fd, BUFFER_SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.canary_bytes = self._outside_segments(
            random.Random(CANARY_SEED).randbytes(BUFFER_SIZE))
        self.log_size = 0

    def _outside_segments(self, data: bytes) -> bytes:
        """The bytes of `data` that are no served segment's (canaries and the
        deregistered segment): they must never change."""
        keep, at = [], 0
        for seg in self.served:
            keep.append(data[at:seg.offset])
            at = seg.offset + seg.length
        keep.append(data[at:])
        return b"".join(keep)

    def snapshot(self) -> bytes:
        return bytes(self.memory[:BUFFER_SIZE])

    def log(self) -> str:
        with open(self.stderr_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def assert_healthy(self) -> None:
        """Alive, and nothing unexpected logged since the last check."""
        assert self.proc.poll() is None, f"the agent died:\n{self.log()}"
        text = self.log()
        new, self.log_size = text[self.log_size:], len(text)
        assert "UNEXPECTED" not in new and "Traceback" not in new, new

    def connect(self, transport: str) -> socket.socket:
        if transport == "tcp":
            host, port = self.tcp.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=DEADLINE_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(DEADLINE_S)
            sock.connect(self.unix)
        return sock

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.memory.close()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def open_agent() -> Iterator[FuzzAgent]:
    agent = FuzzAgent(None)
    yield agent
    agent.close()


@pytest.fixture(scope="module")
def token_agent() -> Iterator[FuzzAgent]:
    agent = FuzzAgent(TOKEN)
    yield agent
    agent.close()


@pytest.fixture(scope="module", params=["1", "0"], ids=["fastwire", "python"])
def lone_agent(request: pytest.FixtureRequest) -> Iterator[FuzzAgent]:
    """An open agent answering lone ops in C ("1", when hixl._fastwire is built) or in
    Python ("0")."""
    agent = FuzzAgent(None, request.param)
    yield agent
    agent.close()


# ---------------------------------------------------------------- the hostile stream

@dataclass(frozen=True)
class Spec:
    """One frame, relative to the agent's table (its addresses are known only at run time)."""

    kind: str       # write/read/ping/zero, or a poison: see POISONS
    target: int     # index into the served segments; -1 the deregistered one, -2 unknown
    epoch: str      # "ok", "older", "newer", "any"
    place: str      # "inside", "before", "across-end", "top", "any"
    offset: int
    length: int
    noise: int      # random id / epoch / address bits, and the payload's seed


CLEAN = ["write"] * 4 + ["read"] * 3 + ["ping", "zero"]
POISONS = ["garbage", "magic", "version", "opcode", "hello", "auth", "reply", "call",
           "truncated", "oversized", "nopayload"]

specs = st.builds(
    Spec, kind=st.sampled_from(CLEAN),
    target=st.sampled_from([0, 0, 1, 2, 3, 3, -1, -2]),
    epoch=st.sampled_from(["ok"] * 8 + ["older", "newer", "any"]),
    place=st.sampled_from(["inside"] * 8 + ["before", "across-end", "top", "any"]),
    offset=st.integers(0, 1 << 20), length=st.integers(1, 1 << 14),
    noise=st.integers(0, U64))
poison_specs = specs.flatmap(lambda spec: st.sampled_from(POISONS).map(
    lambda kind: Spec(kind, spec.target, spec.epoch, spec.place, spec.offset, spec.length,
                      spec.noise)))


@dataclass(frozen=True)
class Stream:
    start: str  # "hello", "hello-runs", "none", "half-hello", "garbage"
    frames: list[Spec]
    cuts: list[int]  # sizes of the pieces it is sent in


streams = st.builds(
    Stream, start=st.sampled_from(["hello-runs", "hello", "hello-runs", "hello", "none",
                                   "half-hello", "garbage"]),
    frames=st.tuples(st.lists(specs, max_size=12),
                     st.one_of(st.none(), poison_specs), st.integers(0, 12)).map(
        lambda parts: parts[0] if parts[1] is None else
        parts[0][:parts[2]] + [parts[1]] + parts[0][parts[2]:]),
    cuts=st.lists(st.integers(1, 512), max_size=12))


def materialize(spec: Spec, agent: FuzzAgent) -> bytes:
    """The bytes of one frame against this agent's real table."""
    rng = random.Random(spec.noise)
    seg = (agent.served[spec.target] if spec.target >= 0 else
           agent.gone if spec.target == -1 else None)
    segment_id = seg.segment_id if seg else rng.choice([0, 999_999, U64, rng.getrandbits(64)])
    epoch = {"ok": agent.epoch, "older": agent.epoch - 1, "newer": agent.epoch + 1}.get(
        spec.epoch, rng.getrandbits(32)) & 0xFFFF_FFFF
    base, size = (seg.base, seg.length) if seg else (rng.getrandbits(48), 4096)
    if spec.place == "inside":
        addr = base + spec.offset % size
        length = 1 + spec.length % (base + size - addr)
    elif spec.place == "before":
        addr = max(0, base - 1 - spec.offset % 64)
        length = spec.length
    elif spec.place == "across-end":
        addr = base + size - 1 - spec.offset % min(size, 64)
        length = base + size - addr + 1 + spec.length % 64
    elif spec.place == "top":  # addr + length reaches or passes 2**64
        addr = U64 - spec.offset % 4096
        length = (1 << 64) - addr + spec.length % 2
    else:
        addr, length = rng.getrandbits(64), rng.choice([spec.length, rng.getrandbits(64)])
    length = min(length, U64)
    opcode = {"write": Op.WRITE, "read": Op.READ, "ping": Op.PING, "zero": Op.WRITE,
              "truncated": Op.WRITE, "oversized": Op.WRITE, "nopayload": Op.WRITE,
              "hello": Op.HELLO, "auth": Op.AUTH, "reply": Op.REPLY, "call": Op.CALL,
              }.get(spec.kind, Op.READ)
    if spec.kind == "zero":
        length = 0
    elif spec.kind == "oversized":
        length = MAX_PAYLOAD + 1 + spec.length
    elif spec.kind in ("hello", "auth", "reply", "call"):
        length = spec.length % 64
    magic, version = MAGIC, VERSION
    if spec.kind == "magic":
        magic = rng.choice([0, 0x5848, rng.getrandbits(16)])
    elif spec.kind == "version":
        version = rng.choice([0, 2, 255])
    elif spec.kind == "opcode":
        opcode = rng.choice([0, 8, 255, rng.randrange(8, 256)])
    if spec.kind == "garbage":
        return rng.randbytes(1 + spec.length % 200)
    header = HEADER.pack(magic, version, opcode, rng.choice([0, 0, 1, 4, 0xFFFF]), 0, 0, epoch,
                         rng.getrandbits(64), segment_id, addr, length)
    carried = length if opcode in (Op.WRITE, Op.HELLO, Op.AUTH, Op.REPLY, Op.CALL) else 0
    if spec.kind == "truncated":
        carried //= 2
    elif spec.kind in ("nopayload", "oversized"):
        carried = 0
    return header + rng.randbytes(min(carried, 1 << 16))


def stream_bytes(stream: Stream, agent: FuzzAgent) -> bytes:
    rng = random.Random(len(stream.frames))
    start = b""
    if stream.start.startswith("hello"):
        start = bytearray(wire.hello(1, b"fuzzer"))
        if stream.start == "hello-runs":
            start[4:6] = wire.FLAG_RUN.to_bytes(2, "big")
    elif stream.start == "half-hello":  # announces a name longer than what follows
        start = HEADER.pack(MAGIC, VERSION, Op.HELLO, 0, 0, 0, 0, 1, 0, 0, 200) + b"half"
    elif stream.start == "garbage":
        start = rng.randbytes(1 + len(stream.cuts) * 7)
    return bytes(start) + b"".join(materialize(spec, agent) for spec in stream.frames)


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    out, at = [], 0
    for size in cuts:
        if at < len(data):
            out.append(data[at:at + size])
            at += size
    if at < len(data):
        out.append(data[at:])
    return out


def exchange(sock: socket.socket, chunks: list[bytes]) -> tuple[bytes, bool]:
    """Send every chunk (one send each) while reading replies, half-close, read to EOF.

    Returns what came back and whether the agent reset the connection. Fails the test if
    the connection has not ended by the deadline: the agent hung on it.
    """
    deadline = time.monotonic() + DEADLINE_S
    sock.setblocking(False)
    received = bytearray()
    queue = [memoryview(chunk) for chunk in chunks if chunk]
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if queue else 0))
        if not queue:
            sock.shutdown(socket.SHUT_WR)
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "the agent neither answered nor closed: it hung"
            for _key, mask in sel.select(left):
                if mask & selectors.EVENT_READ:
                    try:
                        chunk = sock.recv(1 << 16)
                    except BlockingIOError:
                        chunk = None
                    except ConnectionResetError:
                        return bytes(received), True
                    if chunk == b"":
                        return bytes(received), False
                    if chunk:
                        received += chunk
                if mask & selectors.EVENT_WRITE and queue:
                    try:
                        sent = sock.send(queue[0])
                    except BlockingIOError:
                        sent = 0
                    except (BrokenPipeError, ConnectionResetError):
                        queue.clear()  # the agent closed: it reads no more
                        sent = 0
                    if queue:
                        queue[0] = queue[0][sent:]
                        if not len(queue[0]):
                            queue.pop(0)
                    if not queue:
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_WR)
                        sel.modify(sock, selectors.EVENT_READ)


def assert_replies_well_formed(data: bytes, reset: bool) -> int:
    """Every reply the agent sent is a whole REPLY frame (a reset may cut the last one)."""
    at = count = 0
    while len(data) - at >= HEADER_SIZE:
        header = wire.decode_header(data[at:at + HEADER_SIZE])
        assert header.opcode == Op.REPLY
        at += HEADER_SIZE + wire.payload_length(header)
        count += 1
    assert at == len(data) or (reset and at > len(data) - HEADER_SIZE), "a torn reply"
    return count


def writable_mask(data: bytes, agent: FuzzAgent) -> bytearray:
    """1 for every buffer byte a WRITE header anywhere in `data` (at any offset: a stream
    out of step reads headers from payloads) could let the agent change."""
    mask = bytearray(BUFFER_SIZE)
    prefix = HEADER.pack(MAGIC, VERSION, Op.WRITE, 0, 0, 0, 0, 0, 0, 0, 0)[:4]
    by_id = {seg.segment_id: seg for seg in agent.served if seg.perms & Perm.WRITE}
    at = data.find(prefix)
    while 0 <= at <= len(data) - HEADER_SIZE:
        fields = HEADER.unpack_from(data, at)
        seg = by_id.get(fields[8])
        addr, length = fields[9], fields[10]
        if (seg is not None and fields[6] == agent.epoch and seg.base <= addr
                and addr + length <= seg.end):
            start = seg.offset + addr - seg.base
            mask[start:start + length] = b"\1" * length
        at = data.find(prefix, at + 1)
    return mask


def assert_memory_intact(agent: FuzzAgent, before: bytes, mask: bytearray) -> None:
    after = agent.snapshot()
    assert agent._outside_segments(after) == agent.canary_bytes, "a canary byte changed"
    if after != before:
        changed = [i for i in range(BUFFER_SIZE) if after[i] != before[i] and not mask[i]]
        assert not changed, (f"{len(changed)} segment bytes changed outside every addressed "
                             f"range, first at buffer offset {changed[0]}")


# ---------------------------------------------------------------- a legitimate client

def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the agent closed a legitimate connection"
        data += chunk
    return bytes(data)


def legit_round_trip(agent: FuzzAgent, transport: str, seed: int) -> None:
    """A well-behaved client still gets a PUT then GET back byte for byte, and the bytes
    are in the agent's memory where they should be."""
    rng = random.Random(seed)
    seg = agent.served[3 if seed % 2 else 0]  # the two read-write segments
    client = wire.ClientProtocol()
    with agent.connect(transport) as sock:
        sock.sendall(client.hello(b"legit", runs=True))
        header = client.on_reply_header(recv_exact(sock, HEADER_SIZE))
        payload = recv_exact(sock, wire.payload_length(header))
        if client.challenged:
            assert agent.token is not None
            sock.sendall(client.auth(agent.token, payload))
            header = client.on_reply_header(recv_exact(sock, HEADER_SIZE))
            client.check_server_proof(agent.token, recv_exact(sock,
                                                              wire.payload_length(header)))
        assert header.epoch == agent.epoch
        length = rng.randint(1, seg.length)
        addr = seg.base + rng.randint(0, seg.length - length)
        data = rng.randbytes(length)
        sock.sendall(client.write(seg.segment_id, agent.epoch, addr, length) + data
                     + client.read(seg.segment_id, agent.epoch, addr, length))
        ack = client.on_reply_header(recv_exact(sock, HEADER_SIZE))
        assert not ack.flags & wire.FLAG_ERROR_TEXT, recv_exact(sock, ack.length)
        reply = client.on_reply_header(recv_exact(sock, HEADER_SIZE))
        assert not reply.flags & wire.FLAG_ERROR_TEXT, recv_exact(sock, reply.length)
        assert recv_exact(sock, reply.length) == data
    start = seg.offset + addr - seg.base
    assert agent.memory[start:start + length] == data


def check_one_connection(agent: FuzzAgent, stream: Stream, transport: str) -> bytes:
    """Throw `stream` at the agent; check everything listed in the module docstring."""
    before = agent.snapshot()
    data = stream_bytes(stream, agent)
    with agent.connect(transport) as sock:
        replies, reset = exchange(sock, pieces(data, stream.cuts))
    assert_replies_well_formed(replies, reset)
    agent.assert_healthy()
    assert_memory_intact(agent, before, writable_mask(data, agent))
    legit_round_trip(agent, transport, len(data))
    agent.assert_healthy()
    return replies


TRANSPORTS = st.sampled_from(["tcp", "unix"])


def answered_alone(frame: bytes) -> bool:
    """Whether the agent answers `frame`, sent alone after a handshake, with one reply (or
    by closing) without waiting for more bytes: False for a payload announced longer than
    what came (the agent waits for the rest, or for the next frames as its payload)."""
    if len(frame) < HEADER_SIZE:
        return False
    fields = HEADER.unpack_from(frame)
    opcode, length = fields[2], fields[10]
    if fields[0] != MAGIC or fields[1] != VERSION:
        return True  # closed with a BAD_FRAME reply
    if opcode in (Op.WRITE, Op.HELLO, Op.AUTH, Op.REPLY, Op.CALL) and length <= MAX_PAYLOAD:
        return len(frame) - HEADER_SIZE >= length
    return True


def lock_step(sock: socket.socket, frames: list[bytes]) -> tuple[bytes, bool]:
    """Send each frame alone and read its one reply before the next (so the agent finds it
    alone on the stream: the path answered in C); from the first frame the agent cannot
    answer alone, or once it closed, the rest goes as one stream. Returns what came back
    and whether the agent reset the connection; the agent must never hang."""
    sock.settimeout(DEADLINE_S)
    received = bytearray()
    at = 0
    try:
        while at < len(frames) and answered_alone(frames[at]):
            sock.sendall(frames[at])
            at += 1
            header = recv_exact_or_eof(sock, HEADER_SIZE)
            received += header
            if len(header) < HEADER_SIZE:
                return bytes(received), False
            payload = recv_exact_or_eof(sock, wire.payload_length(wire.decode_header(header)))
            received += payload
    except (ConnectionResetError, BrokenPipeError):
        return bytes(received), True
    except TimeoutError:
        pytest.fail("the agent neither answered a lone frame nor closed: it hung")
    rest, reset = exchange(sock, [b"".join(frames[at:])])
    return bytes(received) + rest, reset


def recv_exact_or_eof(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


@fuzz_settings(150)
@given(stream=streams, transport=TRANSPORTS)
def test_hostile_connections_never_hurt_the_agent(open_agent: FuzzAgent, stream: Stream,
                                                  transport: str) -> None:
    check_one_connection(open_agent, stream, transport)


@fuzz_settings(40)
@given(stream=streams, transport=TRANSPORTS)
def test_without_the_token_nothing_is_written(token_agent: FuzzAgent, stream: Stream,
                                              transport: str) -> None:
    """With a cluster token, the same streams (no valid AUTH in them) write nothing."""
    before = token_agent.snapshot()
    data = stream_bytes(stream, token_agent)
    with token_agent.connect(transport) as sock:
        replies, reset = exchange(sock, pieces(data, stream.cuts))
    assert_replies_well_formed(replies, reset)
    token_agent.assert_healthy()
    assert_memory_intact(token_agent, before, bytearray(BUFFER_SIZE))  # not one byte
    legit_round_trip(token_agent, transport, len(data))
    token_agent.assert_healthy()


@fuzz_settings(100)
@given(frames=streams.map(lambda stream: stream.frames), transport=TRANSPORTS)
def test_lone_hostile_frames_never_hurt_the_agent(lone_agent: FuzzAgent, frames: list[Spec],
                                                  transport: str) -> None:
    """The hostile frames one at a time after a handshake, each alone on the stream: the
    agent's lone-op path (C with hixl._fastwire) serves or refuses each, or hands it to
    Python, with the same guarantees as for pipelined streams."""
    before = lone_agent.snapshot()
    hello = bytearray(wire.hello(1, b"fuzzer"))
    hello[4:6] = wire.FLAG_RUN.to_bytes(2, "big")
    data = [bytes(hello)] + [materialize(spec, lone_agent) for spec in frames]
    with lone_agent.connect(transport) as sock:
        replies, reset = lock_step(sock, data)
    assert assert_replies_well_formed(replies, reset) >= 1
    lone_agent.assert_healthy()
    assert_memory_intact(lone_agent, before, writable_mask(b"".join(data), lone_agent))
    legit_round_trip(lone_agent, transport, len(frames))
    lone_agent.assert_healthy()


def test_many_hostile_connections_at_once(open_agent: FuzzAgent) -> None:
    """Pipelined hostile streams on several connections at the same time."""
    rng = random.Random(5)
    before = open_agent.snapshot()
    frames = [Spec(rng.choice(CLEAN), rng.choice([0, 1, 2, 3, -1, -2]),
                   rng.choice(["ok", "ok", "newer"]), rng.choice(["inside", "across-end"]),
                   rng.getrandbits(20), rng.getrandbits(14), rng.getrandbits(64))
              for _ in range(200)]
    streams_ = [Stream("hello-runs", frames[i::4], []) for i in range(4)]
    data = [stream_bytes(s, open_agent) for s in streams_]
    socks = [open_agent.connect(t) for t in ("tcp", "unix", "tcp", "unix")]
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda pair: exchange(pair[0], [pair[1]]),
                                    zip(socks, data, strict=True)))
    finally:
        for sock in socks:
            sock.close()
    for replies, reset in results:
        assert assert_replies_well_formed(replies, reset) > 0
    mask = bytearray(BUFFER_SIZE)
    for one in data:
        mask = bytearray(a | b for a, b in zip(mask, writable_mask(one, open_agent),
                                               strict=True))
    open_agent.assert_healthy()
    assert_memory_intact(open_agent, before, mask)
    legit_round_trip(open_agent, "tcp", 1)


def test_the_layout_really_has_canaries(open_agent: FuzzAgent) -> None:
    """The canaries are checkable: the test's view is the agent's memory (a legit WRITE
    shows up in it), and the bytes right before and after each segment are canaries."""
    legit_round_trip(open_agent, "unix", 2)

    def in_a_segment(at: int) -> bool:
        return any(s.offset <= at < s.offset + s.length for s in open_agent.served)

    for seg in [*open_agent.served, open_agent.gone]:
        assert not in_a_segment(seg.offset - 1) and not in_a_segment(seg.offset + seg.length)
    assert len(open_agent.canary_bytes) == BUFFER_SIZE - sum(s.length for s in open_agent.served)
