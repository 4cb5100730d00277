"""Logs: one line per failed request, with its request id, code and fix hint; the id
travels client -> agent -> master and comes back in the client's exception.

Real processes: a hixl-master and hixl-agents (publishing to it), driven by real clients.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Callable, Iterator

import pytest
import waiting

from hixl import errors, logs
from hixl.client.agent_client import AgentClient
from hixl.errors import ParamInvalid, ResourceExhausted
from hixl.registry_client import RegistryClient
from hixl.tools.daemons import MasterProcess

DEADLINE_S = 10.0
REQUEST_RE = re.compile(r"\(request ([0-9a-f]{16})\)")


@pytest.fixture
def master() -> Iterator[MasterProcess]:
    with MasterProcess(log_level="DEBUG", extra=["--log-json"]) as process:
        yield process


def json_lines(text: str) -> list[dict[str, object]]:
    """Every log line of a --log-json log, parsed (gRPC's C core may add its own lines;
    every line hixl writes must parse)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def wait_for_lines(read: Callable[[], str], match: Callable[[dict[str, object]], bool],
                   ) -> list[dict[str, object]]:
    """The JSON lines of `read()` matching `match`, waiting (within a deadline) for the
    first: a process writes its log line just before the reply leaves, not after."""
    return waiting.wait_until(lambda: [entry for entry in json_lines(read()) if match(entry)],
                              "a matching JSON log line", DEADLINE_S)


def request_id_of(exc: pytest.ExceptionInfo[errors.HixlError]) -> str:
    match = REQUEST_RE.search(str(exc.value))
    assert match, f"no request id in {exc.value}"
    return match.group(1)


def test_failed_request_is_logged_once_with_its_id_code_and_hint(agent_process,
                                                                  master) -> None:
    node = agent_process(config={"master": master.target, "log_json": True,
                                 "pool_max_bytes": "1MiB"})
    with AgentClient(node.engine, timeout=DEADLINE_S) as client:
        with pytest.raises(ParamInvalid) as bad:
            client.deregister(987654, node.info.epoch)  # no such segment
        with pytest.raises(ResourceExhausted) as full:
            client.allocate(64 << 20)                   # over the 1 MiB budget
        segment = client.allocate(4096)                 # succeeds: logs no failure
        client.deregister(segment.segment_id, segment.epoch)

    for exc, cls, level in ((bad, ParamInvalid, "WARNING"),
                            (full, ResourceExhausted, "WARNING")):
        rid = request_id_of(exc)
        lines = wait_for_lines(node.log, lambda e, rid=rid: e.get("request_id") == rid)
        failures = [e for e in lines if "hint" in e]
        assert len(failures) == 1, lines                 # logged once, not per layer
        line = failures[0]
        assert line["level"] == level and line["logger"] == "hixl.rpc"
        assert line["code"] == errors.STATUS_NAMES[cls.status] and line["status"] == cls.status
        assert line["error"] == cls.__name__
        assert line["hint"] == errors.hint_for(cls) and line["hint"] in str(line["msg"])
        assert f"[{line['code']} {line['status']}]" in str(line["msg"])
        assert str(exc.value.args[0]).split(": ", 1)[1].split(" (request")[0] in str(line["msg"])

    every = json_lines(node.log())
    failures = [e for e in every if "hint" in e]
    assert len(failures) == 2, failures  # the successful allocate and deregister log none
    assert all(e["level"] in ("DEBUG", "INFO") for e in every if "hint" not in e)


def test_request_id_is_forwarded_from_agent_to_master(agent_process, master) -> None:
    node = agent_process(config={"master": master.target, "log_json": True})
    with AgentClient(node.engine, timeout=DEADLINE_S) as client:
        with logs.request_context() as rid:
            segment = client.allocate(4096)  # the agent republishes to the master for us
        # the agent's Publish to the master carries the client's request id
        published = wait_for_lines(master.log, lambda e: e.get("request_id") == rid)
        assert any("/hixl.v1.Registry/Publish" in str(e["msg"]) for e in published), published
        client.deregister(segment.segment_id, segment.epoch)  # its creator: holds the key


def test_master_logs_its_failures_with_the_request_id(master) -> None:
    with RegistryClient(master.target, timeout=DEADLINE_S) as registry, \
            pytest.raises(errors.HixlError) as lost:
        registry.keepalive(123456789)  # no such lease
    rid = request_id_of(lost)
    lines = wait_for_lines(master.log, lambda e: e.get("request_id") == rid and "hint" in e)
    assert len(lines) == 1
    assert lines[0]["code"] == lost.value.status_name and lines[0]["status"] == lost.value.status
    assert lines[0]["hint"] == errors.hint_for(lost.value)


def test_text_logs_carry_the_request_id(agent_process) -> None:
    node = agent_process(config={"log_json": False})
    with AgentClient(node.engine, timeout=DEADLINE_S) as client, \
            pytest.raises(ParamInvalid) as bad:
        client.deregister(987654, node.info.epoch)
    rid = request_id_of(bad)
    waiting.wait_until(lambda: rid in node.log(), f"request {rid} in the agent's log",
                       DEADLINE_S)
    lines = [line for line in node.log().splitlines() if rid in line]
    assert len(lines) == 1, lines
    assert f"[{rid}]" in lines[0] and " WARNING hixl.rpc " in lines[0]
    assert "[PARAM_INVALID 103900]" in lines[0] and errors.hint_for(ParamInvalid) in lines[0]


def test_formats_stamp_the_current_request_id() -> None:
    """Text and JSON formats, inside and outside a request (no process needed)."""
    for as_json in (False, True):
        out = io.StringIO()
        logger = logging.getLogger(f"hixl.test_logs.{as_json}")
        logger.propagate = False
        logger.addHandler(logs.make_handler(as_json, out))
        logger.setLevel(logging.INFO)
        try:
            logger.info("outside")
            with logs.request_context("abc123") as rid:
                logger.info("inside")
                logs.log_failure(logger, logging.WARNING, "it failed", code="PARAM_INVALID",
                                 number=103900, hint="fix it")
        finally:
            logger.handlers.clear()
        outside, inside, failed = out.getvalue().splitlines()
        assert rid == "abc123"
        if as_json:
            assert "request_id" not in json.loads(outside)
            assert json.loads(inside)["request_id"] == rid
            entry = json.loads(failed)
            assert (entry["code"], entry["status"], entry["hint"]) == (
                "PARAM_INVALID", 103900, "fix it")
            assert entry["msg"] == "it failed [PARAM_INVALID 103900]; fix: fix it"
        else:
            assert f"[{logs.NO_REQUEST}] outside" in outside
            assert f"[{rid}] inside" in inside
            assert failed.endswith(f"[{rid}] it failed [PARAM_INVALID 103900]; fix: fix it")
    assert logs.current_request_id() is None


def test_request_ids_from_the_wire_are_checked() -> None:
    assert logs.valid_request_id("4f2a9c01-x") == "4f2a9c01-x"
    for bad in ("", "a b", "x" * 65, "line\nbreak", None):
        assert logs.valid_request_id(bad) is None
    assert re.fullmatch(r"[0-9a-f]{16}", logs.new_request_id())


#: a peer-chosen name that would start a forged ERROR line in a text log
FORGED = "ok\n2026-01-01 00:00:00,000 ERROR hixl.agent [-] fake: agent compromised\x1b[2J\u2028x"
#: how it must appear: one line, every control written as an escape
ESCAPED = ("ok\\n2026-01-01 00:00:00,000 ERROR hixl.agent [-] fake: agent compromised"
           "\\x1b[2J\\u2028x")
#: what starts a record of the text format: its timestamp
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


def test_text_logs_escape_what_peers_send_and_indent_tracebacks() -> None:
    """Every record is one line whatever its arguments hold; a traceback (whose last line
    may quote a peer's string) follows on indented lines: no peer text starts a line."""
    out = io.StringIO()
    logger = logging.getLogger("hixl.test_logs.escape")
    logger.propagate = False
    logger.addHandler(logs.make_handler(False, out))
    logger.setLevel(logging.INFO)
    try:
        logger.info("serving owner=%s", FORGED)
        try:
            raise ValueError(f"bad name {FORGED}")
        except ValueError:
            logger.exception("handshake from %s failed", FORGED)
    finally:
        logger.handlers.clear()
    lines = out.getvalue().splitlines()
    records = [line for line in lines if RECORD_START.match(line)]
    assert len(records) == 2, lines
    assert records[0].endswith(f"serving owner={ESCAPED}")
    assert records[1].endswith(f"handshake from {ESCAPED} failed")
    assert all(line.startswith("  ") for line in lines[2:]), lines
    assert any("ValueError: bad name ok" in line for line in lines[2:])
    assert "\x1b" not in out.getvalue() and "\u2028" not in out.getvalue()
    assert logs.escape_controls("plain \\ text, tab\t") == "plain \\ text, tab\\t"


def test_a_peer_name_with_a_newline_cannot_forge_an_agent_log_line(agent_process) -> None:
    """A client whose engine name (handshake) and segment owner carry a newline and a
    forged record: the real hixl-agent's text log shows them escaped on the line of the
    record that names them, and honest calls keep working."""
    node = agent_process(config={"log_json": False, "log_level": "DEBUG",
                                 "pool": [{"size": "1MiB"}]})
    with AgentClient(node.engine, timeout=DEADLINE_S) as client:
        client.handshake(FORGED)
        forged = client.allocate(4096, owner=FORGED)
        honest = client.allocate(4096, owner="127.0.0.1:50999")
        assert {s.segment_id for s in client.list_segments()[1]} >= {
            forged.segment_id, honest.segment_id}
        waiting.wait_until(lambda: "owner=127.0.0.1:50999" in node.log(),
                           "the honest allocation in the agent's log", DEADLINE_S)
        lines = node.log().splitlines()
        quoting = [line for line in lines if "fake: agent compromised" in line]
        assert quoting and all(ESCAPED in line for line in quoting), quoting
        assert [line for line in lines if f"handshake from {ESCAPED}" in line]
        assert [line for line in lines if f"owner={ESCAPED}" in line]
        assert not [line for line in lines if line.startswith("2026-01-01")]
        client.deregister(forged.segment_id, forged.epoch)
        client.deregister(honest.segment_id, honest.epoch)
