"""`import hixl.shmem`: the OpenSHMEM-like API, a facade over `hixl.client.shmem`.

The implementation needs the client `Engine`, so it lives in hixl.client; this module
only re-exports its public names (as the package root does for `Engine`).
"""

from __future__ import annotations

from hixl.client.shmem import (
    ADD,
    EQ,
    GE,
    GT,
    LE,
    LT,
    NE,
    SET,
    Cmp,
    ShmemContext,
    SignalOp,
    SymmetricObject,
    SymmetricSignal,
    SymmetricTensor,
    SymmetryError,
    barrier_all,
    clear,
    create_signal,
    create_tensor,
    finalize,
    get,
    get_batch,
    get_nbi,
    init,
    malloc,
    my_pe,
    n_pes,
    put,
    put_batch,
    put_nbi,
    put_signal,
    quiet,
    signal,
    signal_fetch,
    wait_until,
)

__all__ = [
    "ADD", "EQ", "GE", "GT", "LE", "LT", "NE", "SET",
    "Cmp", "ShmemContext", "SignalOp", "SymmetricObject", "SymmetricSignal",
    "SymmetricTensor", "SymmetryError",
    "barrier_all", "clear", "create_signal", "create_tensor", "finalize", "get", "get_batch",
    "get_nbi", "init", "malloc", "my_pe", "n_pes", "put", "put_batch", "put_nbi", "put_signal",
    "quiet", "signal", "signal_fetch", "wait_until",
]
