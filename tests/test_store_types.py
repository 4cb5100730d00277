"""The store's protobuf conversions of ReplicaConfig, which both sides remember per config
(hixl.store_types): every config round-trips exactly, distinct configs never share an
entry, a malformed one is refused every time, and the memory stays bounded."""

from __future__ import annotations

import pytest

from hixl import store_types
from hixl.errors import ParamInvalid
from hixl.store_types import (
    ReplicaConfig,
    SoftPinAction,
    replica_config_from_pb,
    replica_config_to_pb,
)
from hixl.v1 import store_pb2

CONFIGS = [
    ReplicaConfig(),
    ReplicaConfig(replica_num=2),
    ReplicaConfig(replica_num=2, with_hard_pin=True),
    ReplicaConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=1500),
    ReplicaConfig(preferred_segments=("10.0.0.1:5000",)),
    ReplicaConfig(preferred_segments=("10.0.0.1:5000", "10.0.0.2:5000")),
    ReplicaConfig(prefer_alloc_in_same_node=True),
]


def test_every_config_round_trips_and_none_shares_an_entry() -> None:
    for _ in range(2):  # the second round is served from both memos
        decoded = [replica_config_from_pb(replica_config_to_pb(c)) for c in CONFIGS]
        assert decoded == CONFIGS


def test_a_request_built_from_the_remembered_message_does_not_change_it() -> None:
    message = replica_config_to_pb(ReplicaConfig(replica_num=3))
    request = store_pb2.CommitRequest(client_id="c", config=message)
    request.config.replica_num = 7  # the request holds a copy
    assert replica_config_to_pb(ReplicaConfig(replica_num=3)).replica_num == 3
    assert replica_config_from_pb(message) == ReplicaConfig(replica_num=3)


def test_an_unknown_soft_pin_action_is_refused_each_time() -> None:
    bad = store_pb2.ReplicaConfig(replica_num=1, soft_pin_action=99)
    for _ in range(2):
        with pytest.raises(ParamInvalid, match="soft_pin_action 99"):
            replica_config_from_pb(bad)


def test_the_memos_stay_bounded() -> None:
    for ttl in range(store_types._CONFIGS_MAX * 3):
        config = ReplicaConfig(soft_pin_ttl_ms=ttl)
        assert replica_config_from_pb(replica_config_to_pb(config)) == config
    assert len(store_types._ENCODED_CONFIGS) <= store_types._CONFIGS_MAX
    assert len(store_types._DECODED_CONFIGS) <= store_types._CONFIGS_MAX
