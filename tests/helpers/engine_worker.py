"""A client engine in its own process, driven by the tests (a second real client).

    python engine_worker.py '{"agent": "127.0.0.1:5000", "fabric": "1", "op": "write",
                              "ranges": [[addr, len], ...], "seed": 7, "timeout": 10}'

"write" PUTs pattern(seed) into the ranges and prints "ok"; "read" GETs them and prints
the sha256 of their concatenation. Both go through hixl.Engine like any user process.

With "steps" instead of "op" it keeps one Engine (optional "local" name) and runs a
script of steps: a list in the job, or "stdin" for one JSON step per line, answered by
one JSON line each (so a test can act between steps, e.g. kill an agent mid-transfer):

    {"do": "connect", "agent": A, "timeout": 10}         -> {"segments": [...]}
    {"do": "disconnect" | "segments", "agent": A}         -> {} | {"segments": [...]}
    {"do": "allocate", "agent": A, "size": N, "name": S}  -> {"segment": {...}}
    {"do": "write", "agent": A, "ranges": [[addr, len]], "seed": 7, "repeat": 1, "timeout": 10}
                                                          -> {"sha256": digest of the source}
    {"do": "read", "agent": A, "ranges": [...], "timeout": 10}  -> {"sha256": ...}
    {"do": "write_async", ...same as write...}            -> {"status": "WAITING"}
    {"do": "wait"}                   -> {"status": "COMPLETED"} (waits the last write_async)
    {"do": "route", "agent": A, "addr": X}                -> {"route": "fabric"|"unix"|"tcp"}
    {"do": "sleep", "seconds": S}                         -> {}
    {"do": "engines"}          -> {"engines": {name: epoch}} (needs a "registry" in the job)
    {"do": "wait_table", "engine": E, "present": bool, "timeout": T}
        -> {"reached": bool, "engines": {...}}  (waits until E is / is not in the global table)
    {"do": "raw", "address": "ip:port", "send": HEX, "replies": N, "timeout": 5}
        -> {"replies": [{"opcode", "request_id", "status", "reason", "epoch", "payload": HEX}],
            "closed": bool}        (a raw data-port client: up to N reply frames, or until closed)

A step failing with a HixlError answers {"error": ClassName, "status", "failed",
"message"} (the request's "status" too, for "wait"); the engine stays usable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import sys
import time
from typing import Any

import numpy as np

from hixl import Engine, HixlError, TransferOp, TransferOpDesc, TransferRequest, wire
from hixl.client.engine import MemHandle


def pattern(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def plan(engine: Engine, job: dict[str, Any],
         op: str) -> tuple[np.ndarray, MemHandle, list[TransferOpDesc]]:
    """A registered local buffer for the job's ranges, its handle, and the descriptors.

    "repeat" > 1 sends the same source ranges that many times (a large batch from a small
    buffer).
    """
    ranges = [(int(a), int(n)) for a, n in job["ranges"]]
    total = sum(n for _, n in ranges)
    local = pattern(job["seed"], total) if op == "write" else np.zeros(total, np.uint8)
    handle = engine.register(local)
    descs, offset = [], 0
    for addr, length in ranges:
        descs.append(TransferOpDesc(local.ctypes.data + offset, addr, length))
        offset += length
    return local, handle, descs * int(job.get("repeat", 1))


def digest(buf: np.ndarray) -> str:
    return hashlib.sha256(buf.tobytes()).hexdigest()


def segment_dict(segment: Any) -> dict[str, Any]:
    fields = dataclasses.asdict(segment)
    return {k: (int(v) if k in ("mem_type", "perms") else v) for k, v in fields.items()}


def raw_exchange(address: str, payload: bytes, replies: int, timeout: float) -> dict[str, Any]:
    """Send raw bytes to an agent's data port and decode up to `replies` reply frames.

    Stops early when the agent closes the connection ("closed") or `timeout` passes.
    """
    host, port = address.rsplit(":", 1)
    stream = b""
    frames: list[dict[str, Any]] = []
    closed = False
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(payload)
        while len(frames) < replies and time.monotonic() < deadline:
            if len(stream) >= wire.HEADER_SIZE:
                header = wire.decode_header(stream[:wire.HEADER_SIZE])
                end = wire.HEADER_SIZE + wire.payload_length(header)
                if len(stream) >= end:
                    frames.append({"opcode": header.opcode, "request_id": header.request_id,
                                   "status": header.status, "reason": header.reason,
                                   "epoch": header.epoch, "payload": stream[wire.HEADER_SIZE:end].hex()})
                    stream = stream[end:]
                    continue
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(1 << 20)
            except TimeoutError:
                break
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                closed = True
                break
            stream += chunk
    return {"replies": frames, "closed": closed}


class Steps:
    """Runs script steps against one engine; keeps the last async request for "wait"."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pending: tuple[TransferRequest, np.ndarray] | None = None

    def run(self, step: dict[str, Any]) -> dict[str, Any]:
        try:
            return getattr(self, "do_" + step["do"])(step)
        except HixlError as exc:
            answer = {"error": type(exc).__name__, "status": exc.status,
                      "failed": sorted(exc.failed)[:16], "message": str(exc)}
            if step["do"] == "wait" and self.pending is not None:
                answer["request"] = self.pending[0].status.name
            return answer

    def do_connect(self, step: dict[str, Any]) -> dict[str, Any]:
        self.engine.connect(step["agent"], timeout=step.get("timeout", 10))
        return self.do_segments(step)

    def do_disconnect(self, step: dict[str, Any]) -> dict[str, Any]:
        self.engine.disconnect(step["agent"])
        return {}

    def do_segments(self, step: dict[str, Any]) -> dict[str, Any]:
        return {"segments": [segment_dict(s) for s in self.engine.segments(step["agent"])]}

    def do_allocate(self, step: dict[str, Any]) -> dict[str, Any]:
        segment = self.engine.allocate(step["agent"], int(step["size"]), name=step.get("name", ""))
        return {"segment": segment_dict(segment)}

    def do_write(self, step: dict[str, Any]) -> dict[str, Any]:
        return self.transfer(step, "write", TransferOp.WRITE)

    def do_read(self, step: dict[str, Any]) -> dict[str, Any]:
        return self.transfer(step, "read", TransferOp.READ)

    def transfer(self, step: dict[str, Any], kind: str, op: TransferOp) -> dict[str, Any]:
        local, handle, descs = plan(self.engine, step, kind)
        try:
            self.engine.transfer(step["agent"], op, descs, timeout=step.get("timeout", 10))
        finally:
            self.engine.deregister(handle)
        return {"sha256": digest(local)}

    def do_write_async(self, step: dict[str, Any]) -> dict[str, Any]:
        local, _, descs = plan(self.engine, step, "write")
        request = self.engine.transfer_async(step["agent"], TransferOp.WRITE, descs,
                                             timeout=step.get("timeout", 30))
        self.pending = (request, local)
        return {"status": request.status.name}

    def do_wait(self, step: dict[str, Any]) -> dict[str, Any]:
        assert self.pending is not None, "wait without write_async"
        request = self.pending[0]
        request.wait()
        return {"status": request.status.name}

    def do_route(self, step: dict[str, Any]) -> dict[str, Any]:
        return {"route": self.engine.route(step["agent"], int(step["addr"]))}

    def do_sleep(self, step: dict[str, Any]) -> dict[str, Any]:
        time.sleep(float(step["seconds"]))
        return {}

    def do_engines(self, step: dict[str, Any]) -> dict[str, Any]:
        return {"engines": {name: info.epoch for name, info in self.engine.engines().items()}}

    def do_wait_table(self, step: dict[str, Any]) -> dict[str, Any]:
        table = self.engine.global_table
        assert table is not None, "wait_table needs a registry"
        engine, present = step["engine"], bool(step["present"])
        reached = table.wait_for(lambda t: (engine in t.engines()) == present,
                                 float(step["timeout"]))
        return {"reached": reached, **self.do_engines(step)}

    def do_raw(self, step: dict[str, Any]) -> dict[str, Any]:
        return raw_exchange(step["address"], bytes.fromhex(step["send"]), int(step["replies"]),
                            float(step.get("timeout", 5)))


def run_steps(job: dict[str, Any]) -> int:
    with Engine(job.get("local", "127.0.0.1"), {"EnableUseFabricMem": job["fabric"]},
                registry=job.get("registry")) as engine:
        steps = Steps(engine)
        script = (json.loads(line) for line in sys.stdin if line.strip()) \
            if job["steps"] == "stdin" else iter(job["steps"])
        for step in script:
            print(json.dumps(steps.run(step)), flush=True)
    return 0


def main() -> int:
    job = json.loads(sys.argv[1])
    if "steps" in job:
        return run_steps(job)
    with Engine("127.0.0.1", {"EnableUseFabricMem": job["fabric"]}) as engine:
        engine.connect(job["agent"], timeout=job.get("timeout", 10))
        local, _, descs = plan(engine, job, job["op"])
        op = TransferOp.WRITE if job["op"] == "write" else TransferOp.READ
        engine.transfer(job["agent"], op, descs, timeout=job.get("timeout", 10))
        print("ok" if op == TransferOp.WRITE else digest(local))
    return 0


if __name__ == "__main__":
    sys.exit(main())
