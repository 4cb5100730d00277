"""Mooncake-compatible APIs on top of hixl: change the import, keep the code.

`from hixl.client.mooncake import TransferEngine` stands in for
`from mooncake.engine import TransferEngine` (see transfer_engine.py for the mapping).
"""

from hixl.client.mooncake.transfer_engine import TransferEngine, TransferNotify, TransferOpcode

# Mooncake Store (mooncake.store): MooncakeDistributedStore, ReplicateConfig and
# SoftPinAction will be exported here from hixl.client.mooncake.store.

__all__ = [
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
]
