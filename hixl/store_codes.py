"""Mooncake Store's ErrorCode values, the outcome codes of the KV store.

The master puts one of these in every reply (one per key in batch calls), and the
Mooncake-compatible client returns them unchanged, so code written against
`mooncake.store` compares against the very numbers it expects. Values follow Mooncake's
`error-code.md`; `RPC_FAIL` is what a client reports when the master could not be asked
at all (unreachable, deadline), which is never confused with OBJECT_NOT_FOUND.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    OK = 0

    # internal / buffer
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10

    # segment
    SHARD_INDEX_OUT_OF_RANGE = -100
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102

    # allocation
    NO_AVAILABLE_HANDLE = -200          # out of space, even after eviction

    # version / key / write / params
    INVALID_VERSION = -300              # here: a segment epoch older than the one mounted
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600

    # read / write / replica
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703         # the object exists but no replica can be read now

    # object
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707

    # transfer / RPC
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900

    # etcd / HA
    ETCD_OPERATION_ERROR = -1000
    ETCD_KEY_NOT_EXIST = -1001
    ETCD_TRANSACTION_FAIL = -1002
    ETCD_CTX_CANCELLED = -1003
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    UNAVAILABLE_IN_CURRENT_MODE = -1011

    # file
    FILE_NOT_FOUND = -1100
    FILE_OPEN_FAIL = -1101
    FILE_READ_FAIL = -1102
    FILE_WRITE_FAIL = -1103
    FILE_INVALID_BUFFER = -1104
    FILE_LOCK_FAIL = -1105
    FILE_INVALID_HANDLE = -1106

    # tasks
    TASK_NOT_FOUND = -1400


#: What a client reports when the master could not be asked at all.
RPC_FAIL = ErrorCode.RPC_FAIL

#: The most replicas one value may have (a ReplicateConfig's replica_num, a Commit's
#: ranges): the master refuses more, and the store client checks it before asking.
MAX_REPLICAS = 64


#: The codes hixl's store returns, each with what to do about it: the store client logs
#: the hint with each failure, and docs/errors.md quotes every entry (tests/test_docs.py).
#: Codes not listed here are Mooncake's, kept for compatibility, never returned by hixl.
HINTS: dict[ErrorCode, str] = {
    ErrorCode.INTERNAL_ERROR: "call setup() before other calls; otherwise the log line "
                              "names the failure (e.g. no free port in the range)",
    ErrorCode.BUFFER_OVERFLOW: "pass a buffer at least get_size(key) bytes long",
    ErrorCode.SEGMENT_NOT_FOUND: "the segment is not mounted (unmounted already, or its "
                                 "client expired): mount it again",
    ErrorCode.SEGMENT_ALREADY_EXISTS: "that engine, segment id and epoch is mounted with "
                                      "other memory: unmount it first",
    ErrorCode.NO_AVAILABLE_HANDLE: "the pool is full even after eviction: add clients with "
                                   "global_segment_size > 0, make it larger, or remove keys",
    ErrorCode.INVALID_VERSION: "a newer epoch of this segment is mounted (its agent "
                               "restarted): set the client up again",
    ErrorCode.INVALID_KEY: "use a non-empty str key of at most 4096 bytes",
    ErrorCode.INVALID_PARAMS: "check the arguments: buffers inside one register_buffer "
                              "range, replica_num >= 1, positive sizes",
    ErrorCode.REPLICA_IS_NOT_READY: "the key's segments await a remount after a master "
                                    "restart: retry within --remount-grace-s",
    ErrorCode.OBJECT_NOT_FOUND: "the key is not stored (never put, removed or evicted): "
                                "put it first",
    ErrorCode.OBJECT_ALREADY_EXISTS: "the key is stored already: put with upsert to "
                                     "replace it, or remove it first",
    ErrorCode.OBJECT_HAS_LEASE: "a reader holds a lease on the key: retry after "
                                "--default_kv_lease_ttl, or remove(key, force=True)",
    ErrorCode.TRANSFER_FAIL: "bytes could not reach a replica's holder: check that "
                             "client's agent runs; other replicas were tried already",
    ErrorCode.RPC_FAIL: "hixl-master is unreachable or too slow: check it runs at the "
                        "address given to setup() and that the cluster tokens match",
}


def hint_for_code(code: int) -> str:
    """What to do about store code `code` ("" for OK and codes hixl never returns)."""
    try:
        return HINTS.get(ErrorCode(code), "")
    except ValueError:
        return ""


def code_name(code: int) -> str:
    """The ErrorCode name of `code`, or the number itself when it is not one."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


__all__ = ["HINTS", "RPC_FAIL", "ErrorCode", "code_name", "hint_for_code"]
