#!/usr/bin/env python3
"""Coverage-guided fuzzing of the data-path codec (hixl/wire.py) with atheris, on demand.

    pip install atheris        # a binary wheel for CPython 3.11 on x86-64 Linux
    python scripts/fuzz_wire.py -max_total_time=300            # or -runs=N, corpus dirs...

Each input is one connection's bytes (raw, or frames built field by field from the input,
since coverage alone finds the magic slowly), driven through `ServerProtocol` as the data
server drives it (header, action, payload), plus, from the same bytes, a reply stream for a
`ClientProtocol` with requests outstanding. A crash is any exception the codec does not
document (the server side raises nothing; the client side only ProtocolError or a
HixlError), a WRITE window that is not exactly the bytes its header names inside a
segment that allows writes, or a changed canary byte around the segments. libFuzzer
flags follow the script's own (`-help=1` lists them). The property tests in
tests/test_fuzz_wire.py check the same things under hypothesis in CI.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["hixl"]):  # coverage for hixl's code only
    from hixl import errors, wire
    from hixl.types import Perm

EPOCH = 7
CANARY = 32
#: (segment id, owner base, length, perms); the last one ends exactly at 2**64
SEGMENTS = [(1, 0x7F00_0000_0000, 512, Perm.RW), (2, 0x7F00_0001_0000, 100, Perm.READ),
            (3, 0x7F00_0002_0000, 64, Perm.WRITE), (4, (1 << 64) - 128, 128, Perm.RW)]


class Backing:
    """Segments in one buffer with CANARY bytes around each; a model of what it holds."""

    def __init__(self) -> None:
        size = sum(length + CANARY for _, _, length, _ in SEGMENTS) + CANARY
        self.buffer = bytearray(b"\xa5" * size)
        self.expected = bytearray(self.buffer)
        view = memoryview(self.buffer)
        self.offset: dict[int, int] = {}
        self.table: dict[int, wire.ServedSegment] = {}
        at = CANARY
        for segment_id, base, length, perms in SEGMENTS:
            self.offset[segment_id] = at
            self.table[segment_id] = wire.ServedSegment(segment_id, EPOCH, base, length, perms,
                                                        view[at:at + length])
            at += length + CANARY


def drive_server(data: bytes, runs: bool) -> None:
    backing = Backing()
    proto = wire.ServerProtocol(backing.table.get, 3)
    hello = bytearray(wire.hello(1, b"fuzz"))
    if runs:
        hello[4:6] = wire.FLAG_RUN.to_bytes(2, "big")
    stream = bytes(hello) + data
    at = 0
    while len(stream) - at >= wire.HEADER_SIZE:
        fields = wire.HEADER.unpack_from(stream, at)
        action = proto.on_header_at(stream, at)
        at += wire.HEADER_SIZE
        kind = type(action)
        if kind is wire.ReceiveInto:
            _, _, op, _, _, _, epoch, _, segment_id, addr, length = fields
            seg = backing.table[segment_id]
            if not (op == wire.Op.WRITE and seg.writable and seg.epoch == epoch
                    and seg.base <= addr and addr + length <= seg.end
                    and len(action.target) == length):
                raise AssertionError(f"WRITE outside its segment accepted: {fields}")
            payload = stream[at:at + length]
            action.target[:len(payload)] = payload
            start = backing.offset[segment_id] + addr - seg.base
            backing.expected[start:start + len(payload)] = payload
            at += length
        elif kind is wire.Discard:
            at += action.count
        elif kind is wire.ReadHello:
            answer = proto.on_hello(action.request_id, stream[at:at + action.count])
            at += action.count
            if type(answer) is wire.Close:
                break
        elif kind is wire.Close:
            break
        elif kind is wire.Send and action.payload is not None and (
                not proto.authenticated or len(action.payload) != fields[10]):
            raise AssertionError(f"READ served wrongly: {fields}")
    if backing.buffer != backing.expected:
        raise AssertionError("a byte outside every accepted WRITE window changed")


def drive_client(data: bytes, runs: bool) -> None:
    client = wire.ClientProtocol()
    client.hello(b"fuzz", runs=runs)
    client.requests(wire.Op.WRITE, [(1, EPOCH, 0, 8)] * 3)
    client.requests(wire.Op.READ, [(1, EPOCH, 0, 16)] * 3)
    client.ping()
    at = 0
    try:
        while len(data) - at >= wire.HEADER_SIZE:
            header = client.on_reply_header(data[at:at + wire.HEADER_SIZE])
            at += wire.HEADER_SIZE + wire.payload_length(header)
    except (wire.ProtocolError, errors.HixlError):
        pass


def frames(provider: atheris.FuzzedDataProvider) -> bytes:
    """Frames built field by field from the input: mostly-valid magic and version (which
    coverage alone finds slowly), any opcode, flags, epoch, segment, address, length."""
    out = []
    while provider.remaining_bytes() > 8:
        choice = provider.ConsumeIntInRange(0, 15)
        magic = wire.MAGIC if choice else provider.ConsumeIntInRange(0, 0xFFFF)
        version = wire.VERSION if choice != 1 else provider.ConsumeIntInRange(0, 0xFF)
        opcode = provider.ConsumeIntInRange(0, 9)
        flags = provider.ConsumeIntInRange(0, 7) if choice > 2 else provider.ConsumeIntInRange(
            0, 0xFFFF)
        segment_id, base, length_max, _ = SEGMENTS[provider.ConsumeIntInRange(0, 3)]
        if choice == 3:
            segment_id = provider.ConsumeIntInRange(0, (1 << 64) - 1)
        epoch = EPOCH if choice != 4 else provider.ConsumeIntInRange(0, (1 << 32) - 1)
        addr = min(base + provider.ConsumeIntInRange(-8, length_max + 8), (1 << 64) - 1)
        length = provider.ConsumeIntInRange(0, length_max + 8) if choice != 5 else (
            provider.ConsumeIntInRange(0, (1 << 64) - 1))
        header = wire.HEADER.pack(magic, version, opcode, flags, 0, 0, epoch,
                                  provider.ConsumeIntInRange(0, 1 << 20), segment_id,
                                  max(addr, 0), length)
        carried = length if opcode in (wire.Op.WRITE, wire.Op.HELLO, wire.Op.AUTH,
                                       wire.Op.REPLY, wire.Op.CALL) else 0
        out.append(header + provider.ConsumeBytes(min(carried, 1024)))
    return b"".join(out)


def test_one_input(raw: bytes) -> None:
    provider = atheris.FuzzedDataProvider(raw)
    runs = provider.ConsumeBool()
    structured = provider.ConsumeBool()
    data = frames(provider) if structured else provider.ConsumeBytes(
        provider.remaining_bytes())
    drive_server(data, runs)
    drive_client(data, runs)


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
