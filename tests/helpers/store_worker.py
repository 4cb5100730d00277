"""A Mooncake-compatible store client in its own process, driven by the tests.

    python store_worker.py '{"master": "127.0.0.1:50051", "segment": 16777216,
                             "buffer": 4194304, "hostname": "127.0.0.1",
                             "setup_timeout": 10}'

Sets up `hixl.client.mooncake.MooncakeDistributedStore` (its own embedded agent holds
`segment` bytes of the pool), prints one JSON line {"rc": setup's return, "hostname"},
then answers one JSON step per stdin line with one JSON line:

    {"do": "put", "key": K, "seed": 7, "size": N, "replica_num": 1}  -> {"rc": ...}
    {"do": "puts", "prefix": P, "count": C, "seed": 7, "size": N}    -> {"codes": [...]}
    {"do": "get", "key": K}            -> {"len": n, "sha256": hex, "code": last_error_code}
    {"do": "get_batch", "keys": [K, ...]}   (twice: what the second call costs)
        -> {"sha256": [hex, ...], "page_faults": n}  (n: minor page faults of the second
           call: pages of its new values that were fresh from the kernel)
    {"do": "call", "method": M, "args": [...]}   -> {"result": ...}   (JSON-able calls)
    {"do": "close"}                    -> {"rc": ...}

Values are pattern(seed, size) (tests/helpers: same bytes in every process), so only
digests cross the pipe.
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
from typing import Any

import numpy as np

from hixl.client.mooncake import MooncakeDistributedStore, ReplicateConfig


def pattern(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def answer(store: MooncakeDistributedStore, step: dict[str, Any]) -> dict[str, Any]:
    do = step["do"]
    if do == "put":
        config = ReplicateConfig(replica_num=int(step.get("replica_num", 1)))
        return {"rc": store.put(step["key"], pattern(step["seed"], step["size"]), config)}
    if do == "puts":
        return {"codes": [store.put(f"{step['prefix']}{i}", pattern(step["seed"] + i, step["size"]))
                          for i in range(step["count"])]}
    if do == "get":
        value = store.get(step["key"])
        return {"len": len(value), "sha256": digest(value), "code": store.last_error_code}
    if do == "get_batch":
        del store.get_batch(step["keys"])[:]  # the first call's values come and go
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        values = store.get_batch(step["keys"])
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        return {"page_faults": faults, "sha256": [digest(value) for value in values]}
    if do == "call":
        return {"result": getattr(store, step["method"])(*step.get("args", []))}
    if do == "close":
        return {"rc": store.close()}
    return {"error": f"unknown step {do!r}"}


def main() -> None:
    job = json.loads(sys.argv[1])
    store = MooncakeDistributedStore(setup_timeout=float(job.get("setup_timeout", 10)))
    rc = store.setup(job.get("hostname", "127.0.0.1"), "P2PHANDSHAKE", job["segment"],
                     job.get("buffer", 4 << 20), "tcp", "", job["master"])
    print(json.dumps({"rc": rc, "hostname": store.get_hostname(), "error": store.last_error}),
          flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(answer(store, json.loads(line))), flush=True)
    store.close()


if __name__ == "__main__":
    main()
