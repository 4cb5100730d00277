"""HIXL's value types: memory types, operations, descriptors, segment descriptions."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from hixl.errors import ParamInvalid

#: limits on a segment's allow-list: engine names are "host:port" (a HELLO may name at
#: most 4096 bytes), and the list travels with the segment in every table and snapshot
MAX_ALLOWED_ENGINES = 256
MAX_ENGINE_NAME = 255


class MemType(enum.IntEnum):
    MEM_DEVICE = 0
    MEM_HOST = 1


class TransferOp(enum.IntEnum):
    """READ copies remote memory into local memory; WRITE copies local to remote."""

    READ = 0
    WRITE = 1


class TransferStatus(enum.IntEnum):
    WAITING = 0
    COMPLETED = 1
    TIMEOUT = 2
    FAILED = 3


class Perm(enum.IntFlag):
    """What peers may do to a segment."""

    NONE = 0
    READ = 1
    WRITE = 2
    RW = 3

    @classmethod
    def parse(cls, text: str) -> Perm:
        """Parse "r", "w", "rw" (any order/case); the empty string means no access."""
        perm = cls.NONE
        for ch in text.lower():
            if ch == "r":
                perm |= cls.READ
            elif ch == "w":
                perm |= cls.WRITE
            else:
                raise ValueError(f"permission {text!r}: use 'r', 'w' or 'rw'")
        return perm

    def __str__(self) -> str:
        return ("r" if self & Perm.READ else "") + ("w" if self & Perm.WRITE else "") or "-"


class MemDesc:
    """A memory range (HIXL's MemDesc): start address and length in bytes."""

    __slots__ = ("addr", "len")

    def __init__(self, addr: int = 0, len: int = 0) -> None:  # noqa: A002 - HIXL's field name
        self.addr = addr
        self.len = len

    def __repr__(self) -> str:
        return f"MemDesc(addr={self.addr:#x}, len={self.len})"


class TransferOpDesc:
    """One op of a transfer (HIXL's TransferOpDesc): local address, remote address, length."""

    __slots__ = ("local_addr", "remote_addr", "len")

    def __init__(self, local_addr: int = 0, remote_addr: int = 0, len: int = 0) -> None:  # noqa: A002
        self.local_addr = local_addr
        self.remote_addr = remote_addr
        self.len = len

    def __repr__(self) -> str:
        return (f"TransferOpDesc(local_addr={self.local_addr:#x}, "
                f"remote_addr={self.remote_addr:#x}, len={self.len})")


@dataclass(frozen=True)
class SegmentInfo:
    """One published segment, as every engine sees it in the address table.

    `base` is the owner's virtual address: peers name remote memory by the owner's
    addresses (as in HIXL and Mooncake), and the table translates.
    """

    segment_id: int
    engine: str
    node_id: str
    base: int
    length: int
    mem_type: MemType
    perms: Perm
    epoch: int
    shareable: bool
    name: str = ""
    #: engines that may reach the segment (sorted, no duplicates); empty: every engine
    allowed_engines: tuple[str, ...] = ()

    @property
    def end(self) -> int:
        return self.base + self.length


def check_allowed_engines(value: object, what: str = "allowed_engines") -> tuple[str, ...]:
    """A segment's allow-list in canonical form (sorted, duplicates dropped); None or an
    empty list means every engine. ParamInvalid naming `what` for anything else: a
    lone string (a list of its characters is never meant), empty or overlong names,
    names with whitespace or control characters, or more than MAX_ALLOWED_ENGINES."""
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ParamInvalid(f"{what} must be a list of engine names, got "
                           f"{type(value).__name__} {value!r}")
    names = list(value)
    if len(names) > MAX_ALLOWED_ENGINES:
        raise ParamInvalid(f"{what} names {len(names)} engines; at most "
                           f"{MAX_ALLOWED_ENGINES} are allowed")
    for name in names:
        if not isinstance(name, str) or not name:
            raise ParamInvalid(f"{what}: every entry must be a non-empty engine name "
                               f"('host:port'), got {name!r}")
        if len(name.encode("utf-8", "surrogatepass")) > MAX_ENGINE_NAME:
            raise ParamInvalid(f"{what}: engine name {name[:40]!r}... is longer than "
                               f"{MAX_ENGINE_NAME} bytes")
        if not name.isprintable() or any(ch.isspace() for ch in name):
            raise ParamInvalid(f"{what}: engine name {name!r} contains whitespace or "
                               "control characters")
    return tuple(sorted(set(names)))
