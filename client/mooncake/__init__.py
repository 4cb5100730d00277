"""Mooncake-compatible APIs on top of hixl: change the import, keep the code.

`from hixl.client.mooncake import TransferEngine` stands in for
`from mooncake.engine import TransferEngine` (see transfer_engine.py for the mapping), and
`from hixl.client.mooncake import MooncakeDistributedStore, ReplicateConfig` for
`mooncake.store` (store.py; `MooncakeConfig` is `mooncake.mooncake_config`'s).
"""

from hixl.client.mooncake.store import (
    BufferHandle,
    MooncakeConfig,
    MooncakeDistributedStore,
    ReplicateConfig,
    SoftPinAction,
)
from hixl.client.mooncake.transfer_engine import TransferEngine, TransferNotify, TransferOpcode

__all__ = [
    "BufferHandle",
    "MooncakeConfig",
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
]
