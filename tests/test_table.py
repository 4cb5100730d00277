"""AddressTable: the one-pass bulk load follows the very rules of one insert at a time.

A registry snapshot builds each engine's table with `AddressTable.bulk`; it must hold the
same ranges as inserting them one by one, and refuse what `insert` refuses (overlaps, bad
ranges) with the same message, never a half-built table.
"""

from __future__ import annotations

import enum
import random

import pytest

from hixl.errors import OutOfRange, ParamInvalid
from hixl.table import MAX_ADDRESS, AddressTable


def by_inserts(entries: list[tuple[int, int, str]]) -> AddressTable[str]:
    table: AddressTable[str] = AddressTable()
    for base, length, value in entries:
        table.insert(base, length, value)
    return table


def insert_error(entries: list[tuple[object, object, str]]) -> str:
    """The message of the ParamInvalid that inserting `entries` in base order raises."""
    with pytest.raises(ParamInvalid) as caught:
        by_inserts(sorted(entries, key=lambda e: e[0]))  # type: ignore[arg-type, return-value]
    return str(caught.value)


def test_bulk_holds_what_inserts_hold_in_any_input_order() -> None:
    rng = random.Random(7)
    entries, base = [], 0
    for number in range(2_000):
        base += rng.randrange(0, 1 << 16)           # gaps, and ranges that touch
        length = rng.randrange(1, 1 << 16)
        entries.append((base, length, f"r{number}"))
        base += length
    shuffled = entries[:]
    rng.shuffle(shuffled)
    bulk = AddressTable.bulk(shuffled)
    assert list(bulk) == list(by_inserts(entries)) == entries
    assert len(bulk) == len(entries)
    for base, length, value in rng.sample(entries, 200):
        assert bulk.find(base, length) == (base, value)
        assert bulk.find(base + length - 1, 1) == (base, value)
        assert bulk.get(base) == value
    with pytest.raises(OutOfRange):
        bulk.find(entries[-1][0] + entries[-1][1], 1)
    # the bulk table is an ordinary table: it takes inserts and removals afterwards
    bulk.remove(entries[0][0])
    bulk.insert(entries[0][0], entries[0][1], "again")
    assert bulk.get(entries[0][0]) == "again"


def test_bulk_of_nothing_is_an_empty_table() -> None:
    table: AddressTable[str] = AddressTable.bulk([])
    assert len(table) == 0 and list(table) == [] and table.lookup(0) is None


@pytest.mark.parametrize("entries", [
    [(0x1000, 0x1000, "a"), (0x1800, 0x1000, "b")],                     # overlaps the end
    [(0x1000, 0x1000, "a"), (0x1000, 0x10, "b")],                       # same base
    [(0x1000, 0x4000, "a"), (0x2000, 0x10, "b")],                       # inside another
    [(0x9000, 0x10, "c"), (0x1000, 0x1000, "a"), (0x1fff, 0x2, "b")],   # unsorted input
], ids=["end", "same-base", "inside", "unsorted"])
def test_bulk_refuses_overlaps_as_insert_does(entries: list[tuple[int, int, str]]) -> None:
    with pytest.raises(ParamInvalid, match="overlaps the registered range") as caught:
        AddressTable.bulk(entries)
    assert str(caught.value) == insert_error(entries)


class Page(enum.IntEnum):
    SIZE = 4096


@pytest.mark.parametrize("entries, problem", [
    ([(0x1000, 0, "a")], "length must be positive"),
    ([(0x1000, -5, "a")], "length must be positive"),
    ([(-0x1000, 0x10, "a")], "address must not be negative"),
    ([(MAX_ADDRESS - 16, 32, "a")], "overflows the 64-bit address space"),
    ([(0x1000, 0x10, "a"), (0x2000, 1.5, "b")], "must be integers, got int and float"),
    ([(True, 0x10, "a")], "must be integers, got bool and int"),
    ([(None, 0x10, "a"), (0x1000, 0x10, "b")], "must be integers, got NoneType and int"),
])
def test_bulk_refuses_bad_ranges_as_insert_does(entries: list[tuple[object, object, str]],
                                                problem: str) -> None:
    with pytest.raises(ParamInvalid, match=problem):
        AddressTable.bulk(entries)  # type: ignore[arg-type]


def test_bulk_takes_int_subclasses_as_insert_does() -> None:
    table = AddressTable.bulk([(Page.SIZE, Page.SIZE, "a"), (0, 4096, "b")])
    assert list(table) == [(0, 4096, "b"), (4096, 4096, "a")]
