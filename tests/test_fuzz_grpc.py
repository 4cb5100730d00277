"""The gRPC services under random field values: a real hixl-agent (Agent and its embedded
Registry service) and a real hixl-master (Master store service and Registry).

Requests are built from the services' own descriptors, so every field of every request
message gets random values: integers at and beyond their edges, any enum number,
unicode, empty and over-long strings, nested messages set or not, repeated fields. Each
call must return OK or a *typed* error: a gRPC code other than UNKNOWN (an unhandled
exception in a servicer), INTERNAL only with the hixl error type in its metadata, and
never UNAVAILABLE or DEADLINE_EXCEEDED (a dead or stuck server). After each example the
server still answers, and its log holds no traceback.

Found this way (each has its regression test at the end): an AllocateSegment name with a
NUL byte failed as an internal error, and one over 249 bytes as RESOURCE_EXHAUSTED (both
from memfd_create, which took the segment name as its label); a RemoveByRegex / ListKeys
regex with a huge repeat count or deep nesting failed as an internal error (re.compile
raises OverflowError / RecursionError, not only re.error).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import yaml
from conftest import parse_ready, start_agent
from fuzzing import fuzz_settings
from google.protobuf import descriptor, message_factory
from hypothesis import given
from hypothesis import strategies as st

from hixl.control import ERROR_KEY
from hixl.store_codes import ErrorCode
from hixl.tools.daemons import MasterProcess
from hixl.v1 import agent_pb2, agent_pb2_grpc, store_pb2, store_pb2_grpc

CALL_TIMEOUT_S = 20.0  # proves "does not hang"; nothing is timed
F = descriptor.FieldDescriptor

_INT_RANGES = {
    F.TYPE_UINT64: (0, (1 << 64) - 1), F.TYPE_FIXED64: (0, (1 << 64) - 1),
    F.TYPE_UINT32: (0, (1 << 32) - 1), F.TYPE_FIXED32: (0, (1 << 32) - 1),
    F.TYPE_INT64: (-(1 << 63), (1 << 63) - 1), F.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), F.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    F.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1), F.TYPE_ENUM: (-(1 << 31), (1 << 31) - 1),
}
_TEXT = st.one_of(
    st.sampled_from(["", "a", "k", "key-1", "127.0.0.1:1", "x" * 4097, "\x00", "a\x00b",
                     "ключ", "🙂" * 3, ".*", "(", "[a-", "*", "\\", "a{99999999999}",
                     "(?P<x>", "/", "..", "\n", " "]),
    st.text(st.characters(exclude_categories=["Cs"]), max_size=24))


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [v for v in (low, low + 1, -1, 0, 1, 2, 63, 64, 4096, 1 << 20, 1 << 30,
                         (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1,
                         high - 1, high) if low <= v <= high]
    return st.one_of(st.sampled_from(edges), st.integers(0, 4096).filter(lambda v: v <= high),
                     st.integers(low, high))


def _field(field: F, depth: int) -> st.SearchStrategy[Any]:
    if field.type == F.TYPE_MESSAGE:
        if field.message_type.GetOptions().map_entry or depth >= 3:
            return st.none()
        value: st.SearchStrategy[Any] = messages(field.message_type, depth + 1)
    elif field.type == F.TYPE_ENUM:
        value = st.one_of(st.sampled_from([v.number for v in field.enum_type.values]),
                          _integers(*_INT_RANGES[F.TYPE_ENUM]))
    elif field.type in _INT_RANGES:
        value = _integers(*_INT_RANGES[field.type])
    elif field.type == F.TYPE_STRING:
        value = _TEXT
    elif field.type == F.TYPE_BYTES:
        value = st.binary(max_size=24)
    elif field.type == F.TYPE_BOOL:
        value = st.booleans()
    else:  # double, float
        value = st.floats(width=32 if field.type == F.TYPE_FLOAT else 64)
    if field.is_repeated:
        return st.one_of(st.none(), st.lists(value, max_size=4))
    return st.one_of(st.none(), value)  # None: left unset


_MESSAGES: dict[tuple[str, int], st.SearchStrategy[Any]] = {}


def messages(desc: descriptor.Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Any message of type `desc`: every field unset or random, nested ones too."""
    key = (desc.full_name, depth)
    if key not in _MESSAGES:
        cls = message_factory.GetMessageClass(desc)
        _MESSAGES[key] = st.deferred(lambda: st.fixed_dictionaries(
            {f.name: _field(f, depth) for f in desc.fields}).map(
            lambda values: cls(**{k: v for k, v in values.items() if v is not None})))
    return _MESSAGES[key]


def calls(service: descriptor.ServiceDescriptor,
          skip: frozenset[str] = frozenset()) -> st.SearchStrategy[tuple[Any, Any]]:
    """(method, request) for any unary method of `service`."""
    methods = [m for m in service.methods
               if not m.server_streaming and not m.client_streaming and m.name not in skip]
    return st.sampled_from(methods).flatmap(
        lambda m: messages(m.input_type).map(lambda request: (m, request)))


def invoke(channel: grpc.Channel, method: descriptor.MethodDescriptor, request: Any) -> None:
    """Call; OK or a typed error, else fail naming the call."""
    response_cls = message_factory.GetMessageClass(method.output_type)
    call = channel.unary_unary(f"/{method.containing_service.full_name}/{method.name}",
                               request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=response_cls.FromString)
    try:
        call(request, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        code = exc.code()
        typed = ERROR_KEY in dict(exc.trailing_metadata() or ())
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
                            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), (
            f"{method.name}({request!r:.500}) failed untyped: {code} {exc.details()}")
        # an exception the servicer did not expect leaves as INTERNAL "internal error: ..."
        # (hixl.control's last resort), or as UNKNOWN without it
        assert code != grpc.StatusCode.INTERNAL or (
            typed and not (exc.details() or "").startswith("internal error:")), (
            f"{method.name}({request!r:.500}) failed unhandled: {exc.details()}")
        assert exc.details(), f"{method.name}: {code} without a message"


_LOG_SEEN: dict[int, int] = {}  # process -> how much of its log was checked already


def assert_still_serving(channel: grpc.Channel, probe: descriptor.MethodDescriptor,
                         process: Any) -> None:
    """The process is alive, answers `probe`, and logged no traceback since last time."""
    assert process.proc.poll() is None, process.log()
    request = message_factory.GetMessageClass(probe.input_type)()
    invoke(channel, probe, request)
    log = process.log()
    new, _LOG_SEEN[id(process)] = log[_LOG_SEEN.get(id(process), 0):], len(log)
    assert not re.search(r"Traceback|internal error|Exception calling application", new), (
        new[-3000:])


# ---------------------------------------------------------------- the agent

AGENT = agent_pb2.DESCRIPTOR.services_by_name["Agent"]
REGISTRY = agent_pb2.DESCRIPTOR.services_by_name["Registry"]
MASTER = store_pb2.DESCRIPTOR.services_by_name["Master"]


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, grpc.Channel]]:
    """One hixl-agent for the module; a small pool budget, so big allocations are refused
    rather than made."""
    workdir = tmp_path_factory.mktemp("agent")
    config = workdir / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "host": "127.0.0.1", "grpc_port": 0, "data_port": 0, "log_level": "INFO",
        "runtime_dir": tempfile.mkdtemp(prefix="hxg-"), "pool": [{"size": "1MiB"}],
        "pool_max_bytes": "4MiB"}))
    log_path = str(workdir / "agent.log")
    agent, line = start_agent(str(config), log_path=log_path)
    try:
        engine = parse_ready(line)["engine"]
        process = SimpleNamespace(proc=agent.proc, log=lambda: Path(log_path).read_text())
        with grpc.insecure_channel(engine) as channel:
            yield process, channel
    finally:
        agent.kill()


# ---------------------------------------------------------------- the master

@pytest.fixture(scope="module")
def master() -> Iterator[tuple[MasterProcess, grpc.Channel]]:
    with MasterProcess() as process, grpc.insecure_channel(process.target) as channel:
        # one real segment, so puts allocate and keys exist for the other calls
        mount = store_pb2.MountSegmentRequest(client_id="fuzz", segment=store_pb2.StoreSegment(
            engine="127.0.0.1:1", segment_id=1, epoch=1, base=1 << 20, length=1 << 20,
            node_id="n"))
        invoke(channel, MASTER.methods_by_name["MountSegment"], mount)
        yield process, channel


# ---------------------------------------------------------------- random calls

#: (server fixture, service fuzzed, its call that proves the server still serves,
#:  examples, the most calls in one batch)
FUZZED = [
    pytest.param("agent", AGENT, "Health", 150, 4, id="agent"),
    pytest.param("agent", REGISTRY, "QuerySegments", 100, 4, id="embedded-registry"),
    pytest.param("master", MASTER, "Stats", 200, 5, id="master"),
    pytest.param("master", REGISTRY, "QuerySegments", 60, 4, id="master-registry"),
]


@pytest.mark.parametrize(("server", "service", "probe", "examples", "most"), FUZZED)
def test_calls_return_ok_or_typed_errors(request: pytest.FixtureRequest, server: str,
                                         service: descriptor.ServiceDescriptor, probe: str,
                                         examples: int, most: int) -> None:
    """Batches of random calls to `service` on the module's `server`: each call OK or a
    typed error, and after each batch the server still answers `probe`, log clean."""
    process, channel = request.getfixturevalue(server)

    @fuzz_settings(examples)
    @given(batch=st.lists(calls(service), min_size=1, max_size=most))
    def batches(batch: list[tuple[Any, Any]]) -> None:
        for method, message in batch:
            invoke(channel, method, message)
        assert_still_serving(channel, service.methods_by_name[probe], process)

    batches()


# ---------------------------------------------------------------- regressions found by fuzzing

@pytest.mark.parametrize("name", ["a\x00b", "x" * 5000, "ключ" * 100, "\x00"])
def test_allocate_takes_any_segment_name(agent: tuple[Any, grpc.Channel], name: str) -> None:
    """The name is the client's label for the segment; the memfd's own label is only a
    kernel debugging aid (no NUL, at most 249 bytes), so no name fails an allocation."""
    process, channel = agent
    stub = agent_pb2_grpc.AgentStub(channel)
    reply = stub.AllocateSegment(agent_pb2.AllocateSegmentRequest(size=4096, name=name),
                                 timeout=CALL_TIMEOUT_S)
    assert reply.segment.name == name and reply.segment.length == 4096
    stub.DeregisterSegment(agent_pb2.DeregisterSegmentRequest(
        segment_id=reply.segment.segment_id, epoch=reply.segment.epoch,
        release_key=reply.release_key), timeout=CALL_TIMEOUT_S)
    assert_still_serving(channel, AGENT.methods_by_name["Health"], process)


@pytest.mark.parametrize("regex", ["a{99999999999}", "x{4294967296}", "(" * 5000, "[a-"])
def test_a_bad_regex_is_invalid_params(master: tuple[MasterProcess, grpc.Channel],
                                       regex: str) -> None:
    """re.compile raises more than re.error: OverflowError for a repeat count past its
    limit, RecursionError for deep nesting; each is the caller's INVALID_PARAMS."""
    process, channel = master
    stub = store_pb2_grpc.MasterStub(channel)
    removed = stub.RemoveByRegex(store_pb2.RemoveByRegexRequest(regex=regex),
                                 timeout=CALL_TIMEOUT_S)
    listed = stub.ListKeys(store_pb2.ListKeysRequest(regex=regex), timeout=CALL_TIMEOUT_S)
    for reply in (removed, listed):
        # refused by the compiler ("bad regex") or, before it, by the pattern bounds
        assert reply.code == ErrorCode.INVALID_PARAMS and (
            "bad regex" in reply.message or "a pattern may have" in reply.message), reply
    assert_still_serving(channel, MASTER.methods_by_name["Stats"], process)
