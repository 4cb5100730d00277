"""`Hixl`: HIXL's Python API (hixl_py) on top of `Engine`, returning status codes.

Methods keep HIXL's names, argument order, defaults and return conventions: an int
status (SUCCESS 0, PARAM_INVALID 103900, ...) or a `(status, value)` pair, never an
exception. The reason behind a non-zero status is logged once (logger "hixl") and kept
in `last_error` for callers that want the text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from hixl.client.engine import Engine, MemHandle, TransferRequest
from hixl.errors import (
    FAILED,
    SUCCESS,
    HixlError,
    NotConnected,
    ParamInvalid,
)
from hixl.memory import ShmSegment
from hixl.types import MemDesc, MemType, TransferOp, TransferOpDesc, TransferStatus

log = logging.getLogger("hixl")

T = TypeVar("T")


class Hixl:
    """HIXL-shaped engine. Call initialize() first and finalize() last."""

    def __init__(self) -> None:
        self._engine: Engine | None = None
        self._requests: set[TransferRequest] = set()
        self.last_error: HixlError | None = None

    # errors become status codes here, and only here
    def _call(self, fn: Callable[[], T], default: T) -> tuple[int, T]:
        try:
            return SUCCESS, fn()
        except HixlError as exc:
            self.last_error = exc
            log.warning("%s", exc)
            return exc.status, default
        except Exception as exc:  # a bug must still come back as a status, not a crash
            self.last_error = HixlError(f"internal error: {exc!r}")
            log.exception("hixl internal error")
            return FAILED, default

    def _engine_or_raise(self) -> Engine:
        if self._engine is None:
            raise NotConnected("Hixl is not initialized; call initialize(local_engine, options) first")
        return self._engine

    def initialize(self, local_engine: str, options: Mapping[str, str] | None = None) -> int:
        """"ip:port" (port > 0) makes this engine a server for its registered memory."""
        def init() -> None:
            if self._engine is not None:
                raise ParamInvalid("already initialized; call finalize() first")
            self._engine = Engine(local_engine, options)
        return self._call(init, None)[0]

    def finalize(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
        self._requests.clear()

    def register_mem(self, mem_desc: MemDesc, mem_type: MemType) -> tuple[int, MemHandle | None]:
        def register() -> MemHandle:
            if not isinstance(mem_desc, MemDesc):
                raise ParamInvalid(f"register_mem needs a MemDesc, got {type(mem_desc).__name__}")
            return self._engine_or_raise().register(mem_desc.addr, mem_desc.len, mem_type=mem_type)
        return self._call(register, None)

    def deregister_mem(self, mem_handle: MemHandle | None) -> int:
        """As in HIXL: None is PARAM_INVALID; deregistering twice is a no-op returning SUCCESS."""
        def deregister() -> None:
            if mem_handle is None:
                raise ParamInvalid("deregister_mem: handle is None")
            if isinstance(mem_handle, MemHandle) and not mem_handle.registered:
                log.info("deregister_mem: handle [%#x, +%d) was already deregistered",
                         mem_handle.addr, mem_handle.length)
                return
            self._engine_or_raise().deregister(mem_handle)
        return self._call(deregister, None)[0]

    def connect(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        return self._call(lambda: self._engine_or_raise().connect(
            remote_engine, _seconds(timeout_in_millis)), None)[0]

    def disconnect(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        return self._call(lambda: self._engine_or_raise().disconnect(
            remote_engine, _seconds(timeout_in_millis)), None)[0]

    def transfer_sync(self, remote_engine: str, operation: TransferOp,
                      op_descs: Sequence[TransferOpDesc], timeout_in_millis: int = 1000) -> int:
        return self._call(lambda: self._engine_or_raise().transfer(
            remote_engine, operation, op_descs, _seconds(timeout_in_millis)), None)[0]

    def transfer_async(self, remote_engine: str, operation: TransferOp,
                       op_descs: Sequence[TransferOpDesc], optional_args: Any = None,
                       timeout_in_millis: int = 30_000) -> tuple[int, TransferRequest | None]:
        """Returns (status, req); poll with get_transfer_status(req).

        HIXL leaves the deadline to the caller; hixl also fails the request by itself
        after `timeout_in_millis`, so a forgotten request cannot wait forever.
        """
        def submit() -> TransferRequest:
            req = self._engine_or_raise().transfer_async(
                remote_engine, operation, op_descs, _seconds(timeout_in_millis))
            self._requests.add(req)
            return req
        return self._call(submit, None)

    def get_transfer_status(self, req: TransferRequest) -> tuple[int, TransferStatus]:
        """(SUCCESS, status); a finished request is freed, so asking again is PARAM_INVALID."""
        def status() -> TransferStatus:
            if req not in self._requests:
                raise ParamInvalid("unknown transfer request (already completed/failed and freed?)")
            state = req.status
            if state != TransferStatus.WAITING:
                self._requests.discard(req)
                if state == TransferStatus.FAILED:
                    self.last_error = req.error
                    log.warning("transfer to %s failed: %s", req.remote, req.error)
            return state
        return self._call(status, TransferStatus.FAILED)

    def malloc_mem(self, mem_type: MemType, size: int) -> tuple[int, int]:
        """AdxlEngine::MallocMem: host memory peers on this node can map directly."""
        def malloc() -> int:
            segment: ShmSegment = self._engine_or_raise().malloc(size, mem_type)
            return segment.addr
        return self._call(malloc, 0)

    def free_mem(self, addr: int) -> int:
        return self._call(lambda: self._engine_or_raise().free(addr), None)[0]


def _seconds(timeout_in_millis: int) -> float:
    if not isinstance(timeout_in_millis, int) or isinstance(timeout_in_millis, bool) or timeout_in_millis <= 0:
        raise ParamInvalid(f"timeout_in_millis must be a positive integer, got {timeout_in_millis!r}")
    return timeout_in_millis / 1000.0


__all__ = ["Hixl"]
