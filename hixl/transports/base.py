"""The one transport interface every data path implements (Mooncake's Transport shape)."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

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
