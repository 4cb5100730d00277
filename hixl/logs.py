"""Logging for hixl processes: one setup, text or JSON lines, a request id on every line.

A request id names one client request across processes: the client's gRPC interceptor
(hixl.control) sends it as `x-request-id` metadata, the agent's or master's server
interceptor puts it in `current_request_id()` for the handler, calls the handler makes on
the request's behalf (agent -> master) send it on, and every log line written meanwhile
carries it (`RequestIdFilter`). A failed call returns it to the client, whose exception
message then says "(request <id>)", so `grep <id>` finds the server side in the logs.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Iterator
from typing import IO, Any

#: gRPC metadata key carrying the request id (client -> server, and back on errors)
REQUEST_ID_KEY = "x-request-id"
#: what text lines show when a record belongs to no request
NO_REQUEST = "-"

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"

_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "hixl_request_id", default=None)
# an id from the wire is echoed into logs: only short, plain ones are taken as they are
_VALID_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
# LogRecord attributes every record has; anything else on a record came as `extra=`
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "request_id"}


def new_request_id() -> str:
    """A fresh request id: 16 hex digits (64 random bits; unique enough to grep for)."""
    return uuid.uuid4().hex[:16]


def valid_request_id(value: str | None) -> str | None:
    """`value` if it may be used as a request id (short, no spaces or control bytes)."""
    return value if value is not None and _VALID_ID.match(value) else None


def current_request_id() -> str | None:
    """The id of the request this code runs for, or None outside any request."""
    return _REQUEST_ID.get()


def set_request_id(request_id: str | None) -> contextvars.Token[str | None]:
    """Make `request_id` current (in this context); undo with `reset_request_id(token)`."""
    return _REQUEST_ID.set(request_id)


def reset_request_id(token: contextvars.Token[str | None]) -> None:
    _REQUEST_ID.reset(token)


@contextlib.contextmanager
def request_context(request_id: str | None = None) -> Iterator[str]:
    """Run a block as one request: gRPC calls made inside it send this id (a new one by
    default), and log lines written inside it carry it."""
    rid = request_id or new_request_id()
    token = _REQUEST_ID.set(rid)
    try:
        yield rid
    finally:
        _REQUEST_ID.reset(token)


class RequestIdFilter(logging.Filter):
    """Stamps `record.request_id` (the current id, or "-") on every record it sees.

    Install it on a handler (setup_logging does) so records of every logger get it;
    a record that already has one (`extra={"request_id": ...}`) keeps it.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _REQUEST_ID.get() or NO_REQUEST
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers: ts, level, logger, msg, request_id
    (when the record belongs to a request), every `extra=` field, and exc on errors."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        request_id = getattr(record, "request_id", None)
        if request_id not in (None, NO_REQUEST):
            entry["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry.setdefault(key, value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


#: what may not reach a text log as it is: C0 and C1 controls (newline, carriage return,
#: escape sequences), DEL, and the Unicode line and paragraph separators
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_one(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100
                                else f"\\u{ord(char):04x}")


def escape_controls(text: str) -> str:
    """`text` with every control character and line separator written as a backslash
    escape (\\n, \\x1b, \\u2028): peers name engines, segments and keys, and a name
    with a newline could otherwise add a forged line to the log."""
    return _UNSAFE.sub(_escape_one, text)


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT, one line per record whatever its message holds: the message is
    escaped (escape_controls). A traceback or stack follows on lines that each start
    with two spaces (controls in them escaped too), so a line that starts with a
    timestamp is always a record of its own, never text a peer chose."""

    def __init__(self, fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = escape_controls(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:  # noqa: N802 - logging's name
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802 - logging's name
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    """Each line of a traceback escaped and indented by two spaces."""
    return "\n".join("  " + escape_controls(line) for line in text.splitlines())


def make_handler(as_json: bool = False, stream: IO[str] | None = None) -> logging.Handler:
    """A stream handler (stderr by default) in hixl's text or JSON format, request ids on."""
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if as_json else TextFormatter())
    handler.addFilter(RequestIdFilter())
    return handler


def setup_logging(level: int | str = logging.INFO, as_json: bool = False,
                  stream: IO[str] | None = None) -> None:
    """Route every logger of this process to one handler (see `make_handler`) at `level`
    ("INFO" or logging.INFO). For daemons (hixl-agent, hixl-master): it replaces the
    root logger's handlers."""
    root = logging.getLogger()
    root.handlers[:] = [make_handler(as_json, stream)]
    root.setLevel(logging.getLevelName(level.upper()) if isinstance(level, str) else level)


def log_failure(logger: logging.Logger, level: int, message: str, *, code: str,
                number: int, hint: str, **fields: Any) -> None:
    """The one log line for one failed request: "<message> [CODE number]; fix: <hint>".

    JSON lines carry `code`, `status`, `hint` and `fields` as their own keys as well.
    """
    text = f"{message} [{code} {number}]"
    if hint:
        text += f"; fix: {hint}"
    logger.log(level, "%s", text, extra={"code": code, "status": number, "hint": hint,
                                         **fields})


__all__ = [
    "NO_REQUEST", "REQUEST_ID_KEY", "TEXT_FORMAT", "JsonFormatter", "RequestIdFilter",
    "TextFormatter", "current_request_id", "escape_controls", "log_failure", "make_handler", "new_request_id",
    "request_context", "reset_request_id", "set_request_id", "setup_logging",
    "valid_request_id",
]
