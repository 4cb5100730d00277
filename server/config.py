"""The layered configuration loading both daemons share: YAML file < environment < flags.

Precedence (later wins): defaults < YAML file (`--config`) < environment variables
`<PREFIX><KEY>` (key upper-cased) < command-line flags / explicit overrides.

Anything unusable — an unknown key, a wrong type, a bad size — raises ConfigError naming
the key and where it came from, so a typo never silently falls back to a default.

The layering (`layer_values`, `convert_key`, `describe_keys`) works on any schema of
`_key(converter, doc, type)` entries: hixl-agent's `AgentConfig`
(hixl.server.agent.config) writes its own from the plain converters here (`_as_*`), and
hixl-master's `MasterConfig` derives one from its flags (`keys_from_parser`). The two
daemons' bind errors speak with one voice too (`probe_bind`, `bind_failure`). Shared code:
it imports neither daemon's package.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import socket
from collections.abc import Callable, Collection, Mapping
from typing import Any

import yaml

from hixl.errors import ConfigError
from hixl.sizes import parse_size

# ---------------------------------------------------------------- bind errors, one voice

def probe_bind(host: str, port: int) -> OSError | None:
    """Why `host:port` cannot be bound for listening (the OSError), or None when it can:
    asked of the kernel with a plain socket (SO_REUSEADDR, as gRPC binds) before a server
    tries, so the refusal says why instead of "port in use?" or a gRPC log line."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            bare or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        return OSError(errno.EADDRNOTAVAIL, f"cannot resolve {bare!r}: {exc.strerror}")
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.listen(1)
        except OSError as exc:
            return exc
    return None


def bind_failure(what: str, host: str, port: int, setting: str, reason: OSError | str,
                 host_setting: str = "key 'host' (--host)",
                 zero: str = "0 for any free one") -> str:
    """The one shape of every bind error of hixl's daemons: what could not be served,
    on which address, why, and the setting to change (`setting` names the port's, e.g.
    "key 'data_port' (--data-port, HIXL_AGENT_DATA_PORT)"; `zero`: what 0 means there)."""
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    code = reason.errno if isinstance(reason, OSError) else None
    if code == errno.EADDRINUSE:
        why = (f"port {port} is in use by another process (`ss -ltnp 'sport = :{port}'` "
               f"shows which)")
        fix = f"choose another port with {setting}, {zero}, or stop that process"
    elif code == errno.EADDRNOTAVAIL:
        why = (f"{host!r} is not an address of this machine"
               + (f" ({reason.strerror})" if isinstance(reason, OSError) and
                  "resolve" in str(reason.strerror) else ""))
        fix = (f"set {host_setting} to an address of this machine (`ip -brief address` "
               "lists them), 127.0.0.1 for this host only")
    elif code == errno.EACCES:
        why = f"port {port} is privileged (below 1024) and this user may not bind it"
        fix = f"choose a port of 1024 or above with {setting}"
    else:
        text = reason.strerror if isinstance(reason, OSError) else reason
        why = str(text or reason)
        fix = f"check {host_setting} and {setting}"
    return f"cannot serve {what} on {address}: {why}; {fix}"


# ---------------------------------------------------------------- converters
# Each takes the raw value and whether it came as text (environment variable) and returns
# the typed value or raises ValueError with a message; the loader adds key and source.

def _as_str(value: object, text: bool) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {type(value).__name__} {value!r}")
    return value


def _as_int(value: object, text: bool) -> int:
    if text and isinstance(value, str):
        try:
            return int(value.strip(), 0)
        except ValueError:
            raise ValueError(f"must be an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be an integer, got {type(value).__name__} {value!r}")
    return value


def _as_port(value: object, text: bool) -> int:
    port = _as_int(value, text)
    if not 0 <= port <= 65535:
        raise ValueError(f"must be a TCP port in [0, 65535] (0 = any free port), got {port}")
    return port


def _as_positive_int(value: object, text: bool) -> int:
    number = _as_int(value, text)
    if number <= 0:
        raise ValueError(f"must be positive, got {number}")
    return number


def _as_bool(value: object, text: bool) -> bool:
    if text and isinstance(value, str):
        word = value.strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"must be true/false (or 1/0, yes/no), got {value!r}")
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {type(value).__name__} {value!r}")
    return value


def _as_size(value: object, text: bool) -> int:
    try:
        return parse_size(value)
    except ConfigError as exc:
        raise ValueError(exc.args[0]) from None


def _as_mode(value: object, text: bool) -> int:
    """A file mode: an int (YAML reads 0660 as octal) or octal text "0660" / "0o660"."""
    if isinstance(value, str):
        digits = value.strip().lower().removeprefix("0o")
        try:
            mode = int(digits, 8)
        except ValueError:
            raise ValueError(f"must be an octal file mode like 0660, got {value!r}") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        raise ValueError(f"must be an octal file mode like 0660, got {type(value).__name__}")
    if not 0 <= mode <= 0o777:
        raise ValueError(f"must be a permission mode in [0, 0o777], got {oct(mode)}")
    return mode


def _as_uid_list(value: object, text: bool) -> list[int]:
    if text and isinstance(value, str):
        parts = [p for p in re.split(r"[,\s]+", value.strip().strip("[]")) if p]
        value = parts
        text_items = True
    else:
        text_items = False
    if not isinstance(value, list):
        raise ValueError(f"must be a list of user ids, got {type(value).__name__} {value!r}")
    uids = []
    for item in value:
        uid = _as_int(item, text_items)
        if uid < 0:
            raise ValueError(f"user id must not be negative, got {uid}")
        uids.append(uid)
    return uids


Converter = Callable[[object, bool], Any]


def _key(converter: Converter, doc: str, type_name: str) -> dict[str, Any]:
    return {"converter": converter, "doc": doc, "type": type_name}


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: the top level must be a mapping of keys, "
            f"got {type(data).__name__}")
    return {str(k): v for k, v in data.items()}


# ---------------------------------------------------------------- layering, for any schema
# A schema maps each key to _key(converter, doc, type). AgentConfig writes its own
# (KEYS, hixl.server.agent.config); hixl-master derives its schema from its flags
# (keys_from_parser).

Schema = Mapping[str, Mapping[str, Any]]


def convert_key(keys: Schema, key: str, raw: object, text: bool, source: str) -> Any:
    """`raw` converted by `key`'s converter; ConfigError naming the key and `source`."""
    spec = keys.get(key)
    if spec is None:
        raise ConfigError(f"{source}: unknown key {key!r}; known keys: {', '.join(keys)}")
    try:
        return spec["converter"](raw, text)
    except ValueError as exc:
        raise ConfigError(f"{source}: key {key!r} {exc}") from None


def layer_values(keys: Schema, env_prefix: str, path: str | None = None,
                 overrides: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The typed values set by the YAML file at `path`, then `<env_prefix><KEY>` variables in
    `env` (default os.environ), then `overrides` (flags; None = not given): later wins, and
    keys no source sets are absent (the caller's defaults apply)."""
    values: dict[str, Any] = {}
    if path:
        for key, raw in _read_yaml(path).items():
            values[key] = convert_key(keys, key, raw, False, f"config file {path}")
    environ = os.environ if env is None else env
    for var, raw in sorted(environ.items()):
        if not var.startswith(env_prefix):
            continue
        key = var[len(env_prefix):].lower()
        values[key] = convert_key(keys, key, raw, True, f"environment variable {var}")
    for key, raw in (overrides or {}).items():
        if raw is None:
            continue  # a flag that was not given
        # flags arrive as text ("--grpc-port 0"); programmatic overrides may be typed
        values[key] = convert_key(keys, key, raw, isinstance(raw, str),
                                  f"command-line option {key}")
    return values


def describe_keys(keys: Schema, defaults: Mapping[str, Any], env_prefix: str,
                  show: Callable[[str, Any], str] | None = None) -> dict[str, dict[str, str]]:
    """key -> {type, default (shown by `show`, default repr), doc, env}: the describe() contract."""
    return {name: {"type": spec["type"],
                   "default": show(name, defaults[name]) if show else repr(defaults[name]),
                   "doc": spec["doc"], "env": env_prefix + name.upper()}
            for name, spec in keys.items()}


_PLAIN_PARSERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float}


def _flag_converter(parse: Callable[[str], Any] | None, type_name: str) -> Converter:
    """A converter that checks a YAML value against the field's annotation (`type_name`,
    e.g. "int" or "int | None"), then validates it with the flag's own argparse type, so a
    key refuses exactly what its flag refuses."""
    allowed = {part.strip() for part in type_name.split("|")}
    if allowed == {"bool"}:
        return _as_bool
    known = allowed & {"int", "float", "str", "None"}
    parse = parse or next((_PLAIN_PARSERS[t] for t in _PLAIN_PARSERS if t in allowed), str)

    def convert(value: object, text: bool) -> Any:
        if value is None and "None" in allowed:
            return None
        if not text and known:
            fits = not isinstance(value, bool) and (
                (isinstance(value, int) and bool(allowed & {"int", "float"}))
                or (isinstance(value, float) and "float" in allowed)
                or (isinstance(value, str) and "str" in allowed))
            if not fits:
                raise ValueError(f"must be {' or '.join(sorted(known))}, "
                                 f"got {type(value).__name__} {value!r}")
        try:
            return parse(value if isinstance(value, str) else str(value))
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise ValueError(str(exc) or f"is not valid: {value!r}") from None

    return convert


def keys_from_parser(parser: argparse.ArgumentParser, field_types: Mapping[str, str],
                     skip: Collection[str] = ("help",)) -> dict[str, dict[str, Any]]:
    """A schema from a command's flags: each option's dest is a key, its help text the doc,
    its argparse type the validator, and `field_types[dest]` (the config dataclass's
    annotation) the YAML type. Derived, not written twice: a flag added later is a config
    key and an environment variable at once. A dest with no field is an AssertionError."""
    keys: dict[str, dict[str, Any]] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in skip or action.dest in keys:
            continue
        if action.dest not in field_types:
            raise AssertionError(f"flag {'/'.join(action.option_strings)} (dest "
                                 f"{action.dest!r}) has no config field")
        doc = action.help or ""
        if "%" in doc:
            doc = doc % {**vars(action), "prog": parser.prog}
        if action.nargs == 0 and isinstance(action.const, bool):  # --no-persist and the like
            doc += (f" (the flag {action.option_strings[0]} sets {action.dest}: "
                    f"{str(action.const).lower()})")
        type_name = field_types[action.dest]
        keys[action.dest] = _key(_flag_converter(action.type, type_name), doc, type_name)
    return keys
