"""`import hixl.shmem`: the OpenSHMEM-like API, a facade over `hixl.client.shmem`.

The implementation needs the client `Engine`, so it lives in hixl.client; this module
only re-exports its public names, exactly those of its `__all__` (as the package root
does for `Engine`), so the two lists cannot drift apart.
"""

from __future__ import annotations

from hixl.client.shmem import *  # noqa: F403
from hixl.client.shmem import __all__  # noqa: F401
