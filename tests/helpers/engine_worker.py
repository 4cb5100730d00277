"""A client engine in its own process, driven by the tests (a second real client).

    python engine_worker.py '{"agent": "127.0.0.1:5000", "fabric": "1", "op": "write",
                              "ranges": [[addr, len], ...], "seed": 7, "timeout": 10}'

"write" PUTs pattern(seed) into the ranges and prints "ok"; "read" GETs them and prints
the sha256 of their concatenation. Both go through hixl.Engine like any user process.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from hixl import Engine, TransferOp, TransferOpDesc


def pattern(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def main() -> int:
    job = json.loads(sys.argv[1])
    ranges = [(int(a), int(n)) for a, n in job["ranges"]]
    total = sum(n for _, n in ranges)
    with Engine("127.0.0.1", {"EnableUseFabricMem": job["fabric"]}) as engine:
        engine.connect(job["agent"], timeout=job.get("timeout", 10))
        local = pattern(job["seed"], total) if job["op"] == "write" else np.zeros(total, np.uint8)
        engine.register(local)
        descs, offset = [], 0
        for addr, length in ranges:
            descs.append(TransferOpDesc(local.ctypes.data + offset, addr, length))
            offset += length
        op = TransferOp.WRITE if job["op"] == "write" else TransferOp.READ
        engine.transfer(job["agent"], op, descs, timeout=job.get("timeout", 10))
        print("ok" if op == TransferOp.WRITE else hashlib.sha256(local.tobytes()).hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
