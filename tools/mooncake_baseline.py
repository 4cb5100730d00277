"""Mooncake Transfer Engine as a same-run baseline for `hixl bench` (optional).

Used only when `mooncake.engine` imports (the optional extra `hixl[mooncake]`, the pip
package `mooncake-transfer-engine-non-cuda`, which needs the system's `libibverbs1`); the
bench imports this module lazily and, without Mooncake, reports why it was not measured.

Mooncake runs exactly as its users run it between two hosts: protocol "tcp", metadata
"P2PHANDSHAKE". The *target* is a separate process (`python -m hixl.tools.mooncake_baseline
--host IP --buffer N`) that registers one pre-faulted buffer and prints
`HIXL-MOONCAKE-READY <segment> <addr> <length>`; the *initiator* lives in the bench process,
registers the bench's own local buffer, and moves blocks with `transfer_sync_write/read`
(one op) or `batch_transfer_sync_write/read` (a batch). Return code 0 is success; anything
else aborts the cell.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hixl.processes import DaemonProcess, ProcessNotReady
from hixl.tools.daemons import MOONCAKE_QUIET

READY = "HIXL-MOONCAKE-READY"
PROTOCOL = "tcp"
METADATA = "P2PHANDSHAKE"
START_TIMEOUT_S = 60.0
# Mooncake logs every connection at INFO through glog; errors are all we want to see.


class MooncakeError(RuntimeError):
    """Mooncake could not be set up, or one of its calls returned an error code."""


def unavailable_reason() -> str | None:
    """Why Mooncake cannot be measured here, or None when `mooncake.engine` imports."""
    for key, value in MOONCAKE_QUIET.items():
        os.environ.setdefault(key, value)
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:  # also a missing libibverbs.so: an ImportError from the .so
        return (f"mooncake.engine does not import ({exc}); install the optional extra "
                "`pip install hixl[mooncake]` (needs libibverbs1)")
    except OSError as exc:
        return f"mooncake.engine does not load: {exc}"
    return None


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("mooncake-transfer-engine-non-cuda")
    except metadata.PackageNotFoundError:
        return "unknown"


def _engine(host: str) -> Any:
    """A TransferEngine initialised for tcp + P2PHANDSHAKE on `host` (its own free ports)."""
    reason = unavailable_reason()
    if reason is not None:
        raise MooncakeError(reason)
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(f"{host}:0", METADATA, PROTOCOL, "")
    if rc != 0:
        raise MooncakeError(f"TransferEngine.initialize({host!r}, {METADATA}, {PROTOCOL}) "
                            f"returned {rc}")
    return engine


def _register(engine: Any, addr: int, length: int) -> None:
    rc = engine.register_memory(addr, length)
    if rc != 0:
        raise MooncakeError(f"register_memory({length} bytes) returned {rc}")


# ---------------------------------------------------------------- target (a process)


def target_main(argv: Sequence[str] | None = None) -> int:
    """The target: registers `--buffer` bytes and serves until stdin closes (or forever)."""
    parser = argparse.ArgumentParser(prog="python -m hixl.tools.mooncake_baseline")
    parser.add_argument("--host", default="127.0.0.1", help="the IP peers reach it at")
    parser.add_argument("--buffer", type=int, required=True, help="bytes to register")
    parser.add_argument("--forever", action="store_true",
                        help="serve until killed instead of until stdin closes")
    args = parser.parse_args(argv)
    try:
        engine = _engine(args.host)
        buffer = np.ones(args.buffer, dtype=np.uint8)  # written once: pre-faulted
        addr = int(buffer.ctypes.data)
        _register(engine, addr, buffer.nbytes)
    except MooncakeError as exc:
        print(f"mooncake target: {exc}", flush=True)
        return 1
    print(f"{READY} {args.host}:{engine.get_rpc_port()} {addr} {buffer.nbytes}", flush=True)
    if args.forever:
        threading.Event().wait()
    while sys.stdin.readline():
        pass
    return 0


def parse_ready(line: str) -> tuple[str, int, int]:
    """The target's ready line -> (segment name "ip:rpc_port", buffer address, length)."""
    parts = line.split()
    if len(parts) != 4 or parts[0] != READY:
        raise MooncakeError(f"Mooncake target failed: {line.strip() or '(no output)'}")
    return parts[1], int(parts[2]), int(parts[3])


def target_command(host: str, buffer_bytes: int) -> list[str]:
    return [sys.executable, "-m", "hixl.tools.mooncake_baseline", "--host", host,
            "--buffer", str(buffer_bytes)]


class TargetProcess:
    """A Mooncake target on this host, stopped by stop() (closing its stdin)."""

    def __init__(self, host: str, buffer_bytes: int) -> None:
        env = {**os.environ, **MOONCAKE_QUIET, "PYTHONUNBUFFERED": "1"}
        self.process = DaemonProcess(target_command(host, buffer_bytes), name="Mooncake target",
                                     ready=READY, env=env, stop_by="stdin")
        self.proc = self.process.proc
        try:
            self.segment, self.addr, self.length = parse_ready(
                self.process.wait_ready(START_TIMEOUT_S))
        except ProcessNotReady as exc:
            raise MooncakeError(str(exc)) from None
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.process.stop()


# ---------------------------------------------------------------- initiator (in the bench)


class Initiator:
    """The bench's side: one TransferEngine with the bench's local buffer registered."""

    def __init__(self, host: str, segment: str, local_addr: int, local_length: int,
                 remote_addr: int | None = None) -> None:
        self.engine = _engine(host)
        self.segment = segment
        _register(self.engine, local_addr, local_length)
        if remote_addr is None:
            remote_addr = int(self.engine.get_first_buffer_address(segment))
            if remote_addr <= 0:
                raise MooncakeError(f"no buffer registered at Mooncake segment {segment}")
        self.remote_addr = remote_addr

    def call(self, op: str, local_addr: int, block: int, batch: int) -> Callable[[], None]:
        """A zero-argument call moving `batch` blocks of `block` bytes (op: write/read)."""
        engine, segment, remote = self.engine, self.segment, self.remote_addr
        if batch == 1:
            single = engine.transfer_sync_write if op == "write" else engine.transfer_sync_read

            def one() -> None:
                rc = single(segment, local_addr, remote, block)
                if rc != 0:
                    raise MooncakeError(f"transfer_sync_{op}({block} bytes) returned {rc}")

            return one
        many = (engine.batch_transfer_sync_write if op == "write"
                else engine.batch_transfer_sync_read)
        locals_ = [local_addr + i * block for i in range(batch)]
        remotes = [remote + i * block for i in range(batch)]
        lengths = [block] * batch

        def several() -> None:
            rc = many(segment, locals_, remotes, lengths)
            if rc != 0:
                raise MooncakeError(f"batch_transfer_sync_{op}({batch} x {block} bytes) "
                                    f"returned {rc}")

        return several

    def close(self) -> None:
        """Mooncake frees its engine when the object goes; drop our reference."""
        self.engine = None


if __name__ == "__main__":
    sys.exit(target_main())
