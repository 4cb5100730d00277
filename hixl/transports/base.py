"""The one transport interface every data path implements (Mooncake's Transport shape)."""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hixl.types import SegmentInfo, TransferOp


@dataclass(slots=True)
class Item:
    """One op of a batch, already checked and resolved against both tables.

    `index` is the op's position in the caller's batch, so failures can name it;
    `local_addr` lies in registered local memory, `[remote_addr, remote_addr+length)`
    lies inside `segment` (the owner's addresses).
    """

    index: int
    local_addr: int
    segment: SegmentInfo
    remote_addr: int
    length: int


class ItemArrays(Sequence[Item]):
    """The ops of an array batch for the socket path, kept as arrays: op `i` is
    Item(index[i], local[i], segments[seg[i]], remote[i], lengths[i]). A transport that
    can frame arrays reads the arrays (no Python object per op); anything else indexes
    it like a list of Items, made when asked for (an error path, a fallback)."""

    __slots__ = ("segments", "seg", "local", "remote", "lengths", "index")

    def __init__(self, segments: list[SegmentInfo], seg: np.ndarray, local: np.ndarray,
                 remote: np.ndarray, lengths: np.ndarray, index: np.ndarray) -> None:
        self.segments, self.seg, self.index = segments, seg, index
        self.local, self.remote, self.lengths = local, remote, lengths

    def __len__(self) -> int:
        return len(self.local)

    def __iter__(self) -> Iterator[Item]:
        segments = self.segments
        for index, local, slot, remote, length in zip(
                self.index.tolist(), self.local.tolist(), self.seg.tolist(),
                self.remote.tolist(), self.lengths.tolist(), strict=True):
            yield Item(index, local, segments[slot], remote, length)

    def __getitem__(self, at: Any) -> Any:
        if isinstance(at, slice):
            return [self[i] for i in range(*at.indices(len(self)))]
        return Item(int(self.index[at]), int(self.local[at]), self.segments[int(self.seg[at])],
                    int(self.remote[at]), int(self.lengths[at]))


@dataclass(slots=True, eq=False)
class Runs:
    """A batch given as arrays, already checked and resolved like Items, in one path.

    Parallel int64 arrays, one entry per *run*: consecutive ops of the batch that continue
    each other on both sides (and in one segment) are one run, so one copy. Run `i` moves
    `lengths[i]` bytes between `local[i]` and `remote[i]` (owner address) inside
    `segments[seg[i]]`. `ops` are the caller's op indexes the runs carry (for `.failed`),
    `nbytes` their bytes in all.
    """

    segments: list[SegmentInfo]
    seg: np.ndarray
    local: np.ndarray
    remote: np.ndarray
    lengths: np.ndarray
    ops: np.ndarray | range
    nbytes: int

    def __len__(self) -> int:
        """The caller's ops in it (what traffic counts), not the runs."""
        return len(self.ops)

    def failed(self) -> list[int]:
        return list(self.ops) if isinstance(self.ops, range) else self.ops.tolist()


class Transport(abc.ABC):
    """Moves bytes between this process's memory and one remote engine's segments."""

    name: str = "transport"

    @abc.abstractmethod
    def transfer(self, op: TransferOp, items: Sequence[Item], deadline: float) -> None:
        """Run every item in one direction before `deadline` (a time.monotonic() value).

        Returns when all bytes have moved (a WRITE is acknowledged by the target).
        Raises a HixlError subclass otherwise; a TransferFailed/TransferTimeout lists in
        `.failed` the indexes of items that did not complete.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections/mappings; later transfers raise NotConnected."""
