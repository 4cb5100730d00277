"""Mooncake-compatible APIs on top of hixl: change the import, keep the code.

`from hixl.client.mooncake import TransferEngine` stands in for
`from mooncake.engine import TransferEngine` (see transfer_engine.py for the mapping), and
`from hixl.client.mooncake import MooncakeDistributedStore, ReplicateConfig` for
`mooncake.store` (store.py; `MooncakeConfig` is `mooncake.mooncake_config`'s).
metadata.py is where TransferEngines publish and find segments (P2PHANDSHAKE, hixl://,
Mooncake's http:// metadata servers, etcd). Without changing the import at all,
`hixl-as-mooncake CMD` (hixl.client.as_mooncake) serves these modules under Mooncake's
own names to an unmodified program.
"""

from hixl.client.mooncake.store import (
    BufferHandle,
    MooncakeConfig,
    MooncakeDistributedStore,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
)
from hixl.client.mooncake.transfer_engine import TransferEngine, TransferNotify, TransferOpcode

__all__ = [
    "BufferHandle",
    "MooncakeConfig",
    "MooncakeDistributedStore",
    "ObjectDataType",
    "ReplicateConfig",
    "SoftPinAction",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
]
