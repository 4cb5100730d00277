"""The one transport interface every data path implements (Mooncake's Transport shape)."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

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
