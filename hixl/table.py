"""The address table: non-overlapping [base, base+length) ranges with O(log n) lookup.

Used for local registrations and for the cached view of remote segments. Lookups are a
bisect over the sorted bases (plus a one-entry cache, since batches hit the same segment
over and over); overlapping inserts are refused, never merged.
"""

from __future__ import annotations

import bisect
import contextlib
import operator
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

import numpy as np

from hixl.errors import OutOfRange, ParamInvalid

T = TypeVar("T")

MAX_ADDRESS = 1 << 64


def check_range(addr: object, length: object, what: str = "range") -> None:
    """Refuse non-integer, negative, zero or overflowing (addr, length) pairs by name."""
    if not (isinstance(addr, int) and isinstance(length, int)) or isinstance(
            addr, bool) or isinstance(length, bool):
        raise ParamInvalid(f"{what}: address and length must be integers, got "
                           f"{type(addr).__name__} and {type(length).__name__}")
    if length <= 0:
        raise ParamInvalid(f"{what}: length must be positive, got {length}")
    if addr < 0:
        raise ParamInvalid(f"{what}: address must not be negative, got {addr}")
    if addr + length > MAX_ADDRESS:
        raise ParamInvalid(f"{what}: {addr:#x} + {length} overflows the 64-bit address space")


def _base_of(entry: tuple[int, int, object]) -> int:
    return entry[0]


def _plain_ints(values: list[int]) -> bool:
    """Every value is exactly an int (no bool, no float): the common case, checked in C."""
    return set(map(type, values)) <= {int}


class AddressTable(Generic[T]):
    """Sorted, non-overlapping address ranges mapping to values."""

    __slots__ = ("_bases", "_ends", "_values", "_last", "_arrays", "_changes")

    def __init__(self) -> None:
        self._bases: list[int] = []
        self._ends: list[int] = []
        self._values: list[T] = []
        self._last: tuple[int, int, T] | None = None
        self._arrays: tuple[np.ndarray, np.ndarray, list[T]] | None = None
        self._changes = 0  # bumped by every insert/remove/clear: a stale `arrays` is not kept

    def arrays(self) -> tuple[np.ndarray, np.ndarray, list[T]]:
        """(bases, ends, values): the table as int64 arrays, for vectorised lookups of a
        whole batch (np.searchsorted); built once per change of the table. A copy built
        while another thread was half-way through an insert or remove (the three lists
        of different lengths) is built again, never kept."""
        cached = self._arrays
        while cached is None:
            changes = self._changes
            bases, ends, values = self._bases[:], self._ends[:], self._values[:]
            try:
                built = (np.array(bases, np.int64), np.array(ends, np.int64), values)
            except OverflowError:  # a raw range past 2**63 (no user-space address is)
                top = (1 << 63) - 1
                built = (np.array([min(b, top) for b in bases], np.int64),
                         np.array([min(e, top) for e in ends], np.int64), values)
            if len(bases) == len(ends) == len(values):
                cached = built
                if changes == self._changes:  # no change began meanwhile: keep it
                    self._arrays = built
        return cached

    @classmethod
    def bulk(cls, entries: Iterable[tuple[int, int, T]]) -> AddressTable[T]:
        """A table holding every (base, length, value) of `entries`, built in one pass.

        Why: filling a table with n ranges one `insert` at a time costs n bisects, n range
        checks and list inserts; a whole table (a registry snapshot) is sorted once
        (linear when it arrives sorted) and checked with a few passes over plain lists.
        The rules are `insert`'s: a bad range or an overlap raises the same ParamInvalid
        (then found by replaying the inserts, so the message names the same ranges), and
        nothing is half-built: the caller gets a whole table or an error.
        """
        ordered = list(entries)
        with contextlib.suppress(TypeError):  # a base that is no number: insert names it
            ordered.sort(key=_base_of)
        bases = [base for base, _, _ in ordered]
        lengths = [length for _, length, _ in ordered]
        table: AddressTable[T] = cls()
        if (ordered and _plain_ints(bases) and _plain_ints(lengths) and bases[0] >= 0
                and min(lengths) > 0):
            ends = list(map(operator.add, bases, lengths))
            if max(ends) <= MAX_ADDRESS and not any(map(operator.gt, ends, bases[1:])):
                table._bases, table._ends = bases, ends
                table._values = [value for _, _, value in ordered]
                return table
        for base, length, value in ordered:  # empty, int subclasses, or an error to name
            table.insert(base, length, value)
        return table

    def __len__(self) -> int:
        return len(self._bases)

    def __iter__(self) -> Iterator[tuple[int, int, T]]:
        """Yield (base, length, value) in address order."""
        for base, end, value in zip(self._bases, self._ends, self._values, strict=True):
            yield base, end - base, value

    def insert(self, base: int, length: int, value: T) -> None:
        check_range(base, length, "registration")
        i = bisect.bisect_right(self._bases, base)
        end = base + length
        if i > 0 and self._ends[i - 1] > base:
            raise ParamInvalid(
                f"range [{base:#x}, {end:#x}) overlaps the registered range "
                f"[{self._bases[i - 1]:#x}, {self._ends[i - 1]:#x})")
        if i < len(self._bases) and self._bases[i] < end:
            raise ParamInvalid(
                f"range [{base:#x}, {end:#x}) overlaps the registered range "
                f"[{self._bases[i]:#x}, {self._ends[i]:#x})")
        self._changes += 1
        self._bases.insert(i, base)
        self._ends.insert(i, end)
        self._values.insert(i, value)
        self._arrays = None

    def remove(self, base: int) -> T:
        i = bisect.bisect_left(self._bases, base)
        if i == len(self._bases) or self._bases[i] != base:
            raise ParamInvalid(f"no range registered at {base:#x}")
        self._changes += 1
        del self._bases[i], self._ends[i]
        value = self._values.pop(i)
        self._last = None
        self._arrays = None
        return value

    def copy(self) -> AddressTable[T]:
        """An independent table with the same ranges, in O(n) (no re-validation).

        Lets a writer change a copy and publish it while readers keep using the old one
        without a lock (the global table's copy-on-write views).
        """
        twin: AddressTable[T] = AddressTable()
        twin._bases, twin._ends, twin._values = self._bases[:], self._ends[:], self._values[:]
        return twin

    def clear(self) -> None:
        self._changes += 1
        self._bases.clear()
        self._ends.clear()
        self._values.clear()
        self._last = None
        self._arrays = None

    def get(self, base: int) -> T | None:
        """The value registered with exactly this base, or None."""
        i = bisect.bisect_left(self._bases, base)
        if i < len(self._bases) and self._bases[i] == base:
            return self._values[i]
        return None

    def lookup(self, addr: int) -> tuple[int, int, T] | None:
        """(base, end, value) of the range containing addr, or None."""
        last = self._last
        if last is not None and last[0] <= addr < last[1]:
            return last
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0 or addr >= self._ends[i]:
            return None
        hit = (self._bases[i], self._ends[i], self._values[i])
        self._last = hit
        return hit

    def overlapping(self, addr: int, length: int) -> list[tuple[int, int, T]]:
        """(base, length, value) of every range sharing a byte with [addr, addr+length)."""
        end = addr + length
        i = max(bisect.bisect_right(self._bases, addr) - 1, 0)
        out = []
        while i < len(self._bases) and self._bases[i] < end:
            if self._ends[i] > addr:
                out.append((self._bases[i], self._ends[i] - self._bases[i], self._values[i]))
            i += 1
        return out

    def find(self, addr: int, length: int, what: str = "address") -> tuple[int, T]:
        """(base, value) of the one range wholly containing [addr, addr+length).

        Raises OutOfRange naming the address when no range holds it, or when the range
        runs past the end of the range that holds its start.
        """
        last = self._last
        if last is not None and last[0] <= addr and addr + length <= last[1]:
            return last[0], last[2]
        hit = self.lookup(addr)
        if hit is None:
            raise OutOfRange(f"{what} {addr:#x} is not inside any registered segment")
        base, end, value = hit
        if addr + length > end:
            raise OutOfRange(
                f"{what} range [{addr:#x}, {addr + length:#x}) crosses the end of its "
                f"segment [{base:#x}, {end:#x}) by {addr + length - end} bytes")
        return base, value
