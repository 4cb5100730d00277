"""A PE for tests/test_shmem_run.py, started by `hixl shmem-run` (init takes no arguments).

Every PE puts a block derived from its number into the next PE's inbox, signals it, and
checks the block it received from the previous PE. argv[1] (optional): "fail-after-init"
makes PE 1 exit at once with status 3 (os._exit: no clean goodbye, so its peers learn of
it only when its lease expires) while the others wait for a signal that never comes;
"hang" makes every PE sleep (the launcher's timeout must stop it).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import hixl.shmem as shmem

BLOCK = 1 << 20


def block_of(pe: int) -> np.ndarray:
    return np.random.default_rng(1000 + pe).integers(0, 256, BLOCK, dtype=np.uint8)


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "hang":
        time.sleep(600)
    ctx = shmem.init(heap_size="8MiB", timeout=20, lease_ttl_ms=1000)
    me, n = shmem.my_pe(), shmem.n_pes()
    inbox = shmem.malloc(BLOCK)
    arrived = shmem.create_signal()
    if mode == "fail-after-init":
        if me == 1:
            os._exit(3)
        shmem.wait_until(arrived, shmem.GE, 1, timeout=20)  # PE 1 never signals
    shmem.put(inbox, block_of(me), (me + 1) % n)
    shmem.signal(arrived, 1, (me + 1) % n)
    shmem.wait_until(arrived, shmem.GE, 1, timeout=20)
    ok = bool(np.array_equal(inbox.local, block_of((me - 1) % n)))
    shmem.barrier_all()
    print(f"ok={ok} pe={me} n={n} job={ctx.job} route={ctx.route((me + 1) % n) if n > 1 else '-'}",
          flush=True)
    shmem.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
