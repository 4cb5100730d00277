"""HIXL's value types: memory types, operations, descriptors, segment descriptions."""

from __future__ import annotations

import enum
from dataclasses import dataclass


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

    @property
    def end(self) -> int:
        return self.base + self.length
