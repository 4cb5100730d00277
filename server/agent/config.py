"""hixl-agent configuration: one dataclass, every key documented, three layered sources.

Precedence (later wins): defaults < YAML file (`--config`) < environment variables
`HIXL_AGENT_<KEY>` (key upper-cased) < command-line flags / explicit overrides.

Anything unusable — an unknown key, a wrong type, a bad size — raises ConfigError naming
the key and where it came from, so a typo never silently falls back to a default.
`AgentConfig.describe()` enumerates every key (type, default, meaning) for docs and tests.

It lives in the agent's package because only the agent reads it: its keys, defaults,
pool entries and runtime/state directories. The layering itself (`layer_values`,
`convert_key`, `describe_keys`, the plain converters) is server/config.py's, which
hixl-master's `MasterConfig` shares; that module never imports this one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from hixl.control import DEFAULT_GRPC_PORT, node_identity
from hixl.errors import ConfigError, ParamInvalid
from hixl.failover import parse_addresses
from hixl.server.agent.agent import MAX_SEGMENTS
from hixl.server.config import (
    _as_bool,
    _as_int,
    _as_mode,
    _as_port,
    _as_positive_int,
    _as_size,
    _as_str,
    _as_uid_list,
    _key,
    describe_keys,
    layer_values,
)
from hixl.server.connections import HANDSHAKE_TIMEOUT_S, PREAUTH_CONNECTIONS
from hixl.sizes import parse_size
from hixl.tls import ClientTLS, ServerTLS
from hixl.types import Perm, check_allowed_engines

ENV_PREFIX = "HIXL_AGENT_"
METRICS_PORT = 9161  # the conventional port of an agent's Prometheus endpoint
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def default_runtime_dir() -> str:
    """/run/hixl if this user may create or write it, else $XDG_RUNTIME_DIR/hixl, else
    /tmp/hixl-<uid> (a name any user can take first: prepare_runtime_dir checks it)."""
    if os.access("/run/hixl", os.W_OK) or (
            not os.path.exists("/run/hixl") and os.access("/run", os.W_OK)):
        return "/run/hixl"
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return os.path.join(xdg, "hixl")
    return f"/tmp/hixl-{os.getuid()}"


def default_state_dir() -> str:
    """$HIXL_AGENT_STATE_DIR (also for agents embedded in an engine, which read no other
    environment), else /var/lib/hixl if this user may create or write it, else
    $XDG_STATE_HOME/hixl, else ~/.local/state/hixl: a place that survives reboots (unlike
    runtime_dir)."""
    chosen = os.environ.get("HIXL_AGENT_STATE_DIR", "")
    if chosen:
        return chosen
    if os.access("/var/lib/hixl", os.W_OK) or (
            not os.path.exists("/var/lib/hixl") and os.access("/var/lib", os.W_OK)):
        return "/var/lib/hixl"
    xdg = os.environ.get("XDG_STATE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "hixl")
    return os.path.join(os.path.expanduser("~"), ".local", "state", "hixl")


def _default_uids() -> list[int]:
    """The agent's uid and root: what allowed_uids is when unset or empty."""
    return sorted({os.getuid(), 0})


def prepare_runtime_dir(path: str, allowed_uids: Iterable[int] = ()) -> None:
    """Create the runtime dir (0700; 0711 when allowed_uids names other users, who must
    reach the sockets in it) or check the one that is there: ours, not a symlink of
    someone else's, and not writable by group or others. Whoever may write in it could
    replace the agent's fd socket with their own and hand clients fake memory; the last
    resort /tmp/hixl-<uid> can be created by any user before the agent starts.
    Raises ConfigError naming the path and the fix."""
    uid = os.geteuid()
    others = set(allowed_uids) - {uid, 0}
    try:
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        os.mkdir(path, 0o711 if others else 0o700)
        os.chmod(path, 0o711 if others else 0o700)  # not narrowed by the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"key 'runtime_dir': cannot create {path}: {exc.strerror or exc}; "
                          "choose a directory this user may create") from None
    fix = (f"remove it, or use a directory of your own (key 'runtime_dir', "
           f"{ENV_PREFIX}RUNTIME_DIR; $XDG_RUNTIME_DIR/hixl is used when it is set)")
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        raise ConfigError(f"key 'runtime_dir': {path} is a symlink owned by uid "
                          f"{link.st_uid}, not by this agent's uid {uid}: {fix}")
    found = os.stat(path)
    if not stat.S_ISDIR(found.st_mode):
        raise ConfigError(f"key 'runtime_dir': {path} is not a directory: {fix}")
    if found.st_uid != uid:
        raise ConfigError(f"key 'runtime_dir': {path} is owned by uid {found.st_uid}, not by "
                          f"this agent's uid {uid}: whoever owns it can replace the agent's "
                          f"sockets; {fix}")
    writers = " and ".join(who for who, bit in (("group", 0o020), ("others", 0o002))
                           if found.st_mode & bit)
    if writers:
        raise ConfigError(f"key 'runtime_dir': {path} is writable by {writers} (mode "
                          f"{stat.S_IMODE(found.st_mode):o}): they could replace the agent's "
                          f"sockets; chmod go-w {path}, or {fix}")


@dataclass(frozen=True)
class PoolEntry:
    """One segment of the node's DRAM pool, created when the agent starts."""

    name: str
    size: int
    perms: Perm = Perm.RW
    allowed_engines: tuple[str, ...] = ()  # engines that may reach it; empty: every engine


# ---------------------------------------------------------------- the agent's converters
# The plain ones (text, integers, ports, booleans, sizes, modes, uid lists) are the shared
# loading's (hixl.server.config); these carry one agent key's meaning or limits.

def _as_master(value: object, text: bool) -> str:
    """"" (no master), or one or more "host:port", comma-separated; each checked, the
    list kept as "h1:p1,h2:p2" (hixl.failover parses it again where it is dialled)."""
    raw = _as_str(value, text).strip()
    if not raw:
        return ""
    try:
        return ",".join(parse_addresses(raw, "master address"))
    except ParamInvalid as exc:
        raise ValueError(f"must be 'host:port' or a comma-separated list of them: "
                         f"{exc.args[0]}") from None


def _as_metrics_port(value: object, text: bool) -> int:
    port = _as_int(value, text)
    if not 0 <= port <= 65535:
        raise ValueError(f"must be a TCP port in [1, 65535], or 0 for no metrics endpoint, "
                         f"got {port}")
    return port


#: the most a handshake may be given, in seconds: longer lets idle outsiders hold
#: pre-auth slots for that long
MAX_HANDSHAKE_TIMEOUT_S = 600.0
#: the most pending (pre-auth) connections per listener: each is a thread and an fd
MAX_PREAUTH_CONNECTIONS = 4096


def _as_handshake_timeout(value: object, text: bool) -> float:
    """Seconds in (0, MAX_HANDSHAKE_TIMEOUT_S]: an int, a float or their text."""
    if text and isinstance(value, str):
        try:
            seconds = float(value.strip())
        except ValueError:
            raise ValueError(f"must be a number of seconds, got {value!r}") from None
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"must be a number of seconds, got {type(value).__name__} {value!r}")
    else:
        seconds = float(value)
    if not 0.0 < seconds <= MAX_HANDSHAKE_TIMEOUT_S:  # also refuses nan
        raise ValueError(f"must be in (0, {MAX_HANDSHAKE_TIMEOUT_S:g}] seconds, got {value!r}")
    return seconds


def _as_preauth_connections(value: object, text: bool) -> int:
    number = _as_int(value, text)
    if not 1 <= number <= MAX_PREAUTH_CONNECTIONS:
        raise ValueError(f"must be in [1, {MAX_PREAUTH_CONNECTIONS}], got {number}")
    return number


def _as_pool_size(value: object, text: bool) -> int:
    """A size, or 0 / "0" / "" for none (the 'pool' list applies)."""
    if value in (0, "0", "") or (isinstance(value, str) and not value.strip()):
        return 0
    return _as_size(value, text)


def _as_log_level(value: object, text: bool) -> str:
    level = _as_str(value, text).strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return level


_POOL_KEYS = ("name", "size", "perms", "allowed_engines")


def _as_pool(value: object, text: bool) -> list[PoolEntry]:
    if text and isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ValueError(f"is not a YAML/JSON list: {exc}") from None
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(
            "must be a list of {name, size, perms} entries, got " + type(value).__name__)
    entries: list[PoolEntry] = []
    for i, item in enumerate(value):
        where = f"entry [{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be a mapping with name/size/perms")
        unknown = sorted(set(map(str, item)) - set(_POOL_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(_POOL_KEYS)})")
        if "size" not in item:
            raise ValueError(f"{where}: 'size' is required")
        name = item.get("name", f"pool-{i}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: 'name' must be a non-empty string")
        try:
            size = parse_size(item["size"])
        except ConfigError as exc:
            raise ValueError(f"{where}: {exc.args[0]}") from None
        perms_text = item.get("perms", "rw")
        try:
            perms = Perm.parse(perms_text) if isinstance(perms_text, str) else None
        except ValueError:
            perms = None
        if not perms:
            raise ValueError(f"{where}: 'perms' must be 'r', 'w' or 'rw', got {perms_text!r}")
        allowed = item.get("allowed_engines", [])
        if not isinstance(allowed, list):
            raise ValueError(f"{where}: 'allowed_engines' must be a list of engine names "
                             f"('host:port'), got {type(allowed).__name__} {allowed!r}")
        try:
            allowed_engines = check_allowed_engines(allowed, "'allowed_engines'")
        except ParamInvalid as exc:
            raise ValueError(f"{where}: {exc.args[0]}") from None
        if any(e.name == name for e in entries):
            raise ValueError(f"{where}: duplicate pool segment name {name!r}")
        entries.append(PoolEntry(name, size, perms, allowed_engines))
    return entries


# ---------------------------------------------------------------- the config

@dataclass
class AgentConfig:
    """Everything hixl-agent (or an embedded agent) needs; see `describe()` per key."""

    host: str = "127.0.0.1"
    grpc_port: int = DEFAULT_GRPC_PORT
    data_port: int = 0
    data_unix: bool = True
    data_handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    data_preauth_connections: int = PREAUTH_CONNECTIONS
    runtime_dir: str = field(default_factory=default_runtime_dir)
    state_dir: str = field(default_factory=default_state_dir)
    node_id: str = field(default_factory=node_identity)
    pool: list[PoolEntry] = field(default_factory=list)
    pool_size: int = 0
    pool_max_bytes: int = 1 << 30
    max_segments: int = MAX_SEGMENTS
    master: str = ""
    lease_ttl_ms: int = 10_000
    socket_mode: int = 0o660
    allowed_uids: list[int] = field(default_factory=_default_uids)
    log_level: str = "INFO"
    log_json: bool = False
    cluster_token_file: str = ""
    metrics_port: int = 0
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    tls_client_auth: bool = False

    def __post_init__(self) -> None:
        # resolved here, for agents built directly (embedded in an engine) too: the fd
        # server reads an empty set as "every uid"
        if not self.allowed_uids:
            self.allowed_uids = _default_uids()
        if self.pool_size:  # the shorthand wins over any list, wherever either was set
            self.pool = [PoolEntry("pool", self.pool_size, Perm.RW)]

    # key -> converter, documentation, type; kept beside the fields and checked to match.
    KEYS = {
        "host": _key(_as_str,
                     "Interface the gRPC and TCP data servers bind, and the host part of the "
                     "engine name (\"host:grpc_port\") that peers dial. Use the node's "
                     "reachable address on multi-node clusters.", "str"),
        "grpc_port": _key(_as_port,
                          f"gRPC control-plane port (default {DEFAULT_GRPC_PORT}); 0 picks a "
                          "free port and the engine name uses the actual one.", "port"),
        "data_port": _key(_as_port, "TCP data-path port; 0 (default) picks a free port.", "port"),
        "data_unix": _key(_as_bool,
                          "Also serve the data path on a unix socket "
                          "<runtime_dir>/agent-<grpc_port>.data.sock for same-node peers.",
                          "bool"),
        "data_handshake_timeout_s": _key(
            _as_handshake_timeout,
            "Seconds a new data connection (TCP or unix) has, from accept, to complete its "
            "handshake (HELLO, and the cluster-token proof with a token); past it the agent "
            f"closes it. Default {HANDSHAKE_TIMEOUT_S:g}; at most "
            f"{MAX_HANDSHAKE_TIMEOUT_S:g}. Shorter frees the slots idle outsiders hold "
            "sooner; it must cover a few round trips to the farthest client.", "float"),
        "data_preauth_connections": _key(
            _as_preauth_connections,
            "Data connections that may wait for their handshake at once, per listener (TCP, "
            "unix socket), apart from authenticated connections: when they are all taken, "
            "the oldest is closed to take a newcomer, so connections that never "
            "authenticate cannot keep token holders out. Default "
            f"{PREAUTH_CONNECTIONS}; at most {MAX_PREAUTH_CONNECTIONS} (each is a thread "
            "and an fd).", "int"),
        "runtime_dir": _key(_as_str,
                            "Directory for the unix sockets (fd socket, unix data socket); "
                            "default /run/hixl if writable, else $XDG_RUNTIME_DIR/hixl, "
                            "else /tmp/hixl-<uid>. It must be owned by the agent's user and "
                            "not writable by group or others (anyone who may write in it "
                            "could replace the agent's sockets), or hixl-agent refuses to "
                            "start; created 0700 (0711 when allowed_uids names other "
                            "users).", "path"),
        "state_dir": _key(_as_str,
                          "Directory (0700, ours, not writable by others) for what must "
                          "survive a restart: each engine name's secret (owner-<name>-"
                          "<digest>.key, 0600), from which the agent proves to the registry "
                          "that the name is its own, so a restarted agent takes it back at "
                          "once and nobody else can publish it. Default /var/lib/hixl if "
                          "writable, else $XDG_STATE_HOME/hixl, else ~/.local/state/hixl. "
                          "Keep it across restarts and reboots. Unused with grpc_port 0 (a "
                          "new name each start: its secret lives in memory only).", "path"),
        "node_id": _key(_as_str,
                        "This node's name and fabric domain; default hostname:boot-id "
                        "(8 chars). Agents with the same node_id map each other's segments.",
                        "str"),
        "pool": _key(_as_pool,
                     "DRAM pool segments created at start: a list of {name, size, perms, "
                     "allowed_engines} (size like 1GiB/64MiB/bytes, perms 'rw' or 'r'; "
                     "allowed_engines: the engine names that may reach the segment, on "
                     "every path; omitted or empty: every engine). Not charged to "
                     "pool_max_bytes.", "list"),
        "pool_size": _key(_as_pool_size,
                          "Shorthand for `pool: [{name: pool, size: SIZE, perms: rw}]`: one "
                          "read-write pool segment named 'pool' of SIZE (e.g. 4GiB); when "
                          "set it replaces any 'pool' list. 0 (default): the 'pool' list.",
                          "size"),
        "pool_max_bytes": _key(_as_size,
                               "Budget for segments clients allocate at run time "
                               "(AllocateSegment); default 1GiB.", "size"),
        "max_segments": _key(_as_positive_int,
                             "Segments clients may hold at once (AllocateSegment and "
                             "RegisterSegment together; the pool does not count): each "
                             "keeps two fds and a memory mapping in the agent, so tiny "
                             "segments would otherwise exhaust both. Past it a new one "
                             "fails with RESOURCE_EXHAUSTED. Default "
                             f"{MAX_SEGMENTS}; lowered at start to a quarter of the "
                             "open-files limit (ulimit -n) or half vm.max_map_count when "
                             "either is smaller. Whatever the count, the whole table must fit in "
                             "3 MiB serialized (Handshake and ListSegments replies).",
                             "int"),
        "master": _key(_as_master,
                       "hixl-master address (\"host:port\") to publish segments to, or "
                       "every master of the cluster, comma-separated (\"h1:p1,h2:p2\": the "
                       "agent publishes to one and fails over to the next); empty "
                       "(default) runs an embedded registry on this agent's gRPC port.",
                       "str"),
        "lease_ttl_ms": _key(_as_positive_int,
                             "Registry lease time-to-live in ms; the agent renews it every "
                             "ttl/3. Default 10000.", "int"),
        "socket_mode": _key(_as_mode,
                            "File mode of the unix sockets (octal, default 0660).", "mode"),
        "allowed_uids": _key(_as_uid_list,
                             "User ids allowed on the fd socket (SO_PEERCRED check): exactly "
                             "those listed. Unset or an empty list: the agent's uid and "
                             "root (an empty list admitted every uid before; no setting "
                             "does now: list each uid).", "list[int]"),
        "log_level": _key(_as_log_level, "DEBUG, INFO (default), WARNING or ERROR.", "str"),
        "log_json": _key(_as_bool, "Log one JSON object per line instead of text.", "bool"),
        "cluster_token_file": _key(_as_str,
                                   "File holding the cluster token (content stripped; keep it "
                                   "mode 0600). With a token, every gRPC call and data "
                                   "connection must prove it (HMAC, the token never crosses "
                                   "the wire), and publishing to the master proves it. Empty "
                                   "(default): the token of $HIXL_CLUSTER_TOKEN or the file "
                                   "$HIXL_CLUSTER_TOKEN_FILE names, else none (no "
                                   "authentication).", "path"),
        "metrics_port": _key(_as_metrics_port,
                             "Port of the Prometheus endpoint (http://host:PORT/metrics, "
                             "on this agent's host): traffic, connections, segments, "
                             f"registry lease. 0 (default): none; {METRICS_PORT} is the "
                             "conventional port. Off by default so that several agents "
                             "on one host (tests, benchmarks) never collide; a port in "
                             "use fails the start.", "port"),
        "tls_cert_file": _key(_as_str,
                              "PEM certificate (chain) the gRPC server presents: with "
                              "tls_key_file, gRPC (Agent service, embedded registry) is "
                              "served over TLS only. Give it the host's address as an IP "
                              "subjectAltName (peers dial host:grpc_port). The data path is "
                              "not encrypted. Empty (default): $HIXL_TLS_CERT_FILE, else "
                              "plaintext gRPC.", "path"),
        "tls_key_file": _key(_as_str,
                             "PEM private key of tls_cert_file (unencrypted; keep it mode "
                             "0600). Empty (default): $HIXL_TLS_KEY_FILE.", "path"),
        "tls_ca_file": _key(_as_str,
                            "PEM CA certificate(s): the agent dials its master with TLS, "
                            "trusting this CA (and presenting tls_cert_file, for a master "
                            "that requires client certificates); with tls_client_auth, the "
                            "CA that must sign clients' certificates. Empty (default): "
                            "$HIXL_TLS_CA_FILE, else the master is dialled in plaintext.",
                            "path"),
        "tls_client_auth": _key(_as_bool,
                                "Mutual TLS: serve only gRPC clients presenting a "
                                "certificate signed by tls_ca_file (default false: any "
                                "client; the cluster token still authenticates calls).",
                                "bool"),
    }

    @classmethod
    def describe(cls) -> dict[str, dict[str, str]]:
        """Every key with its type, default and meaning (for docs, --help and tests)."""
        return describe_keys(cls.KEYS, vars(cls()), ENV_PREFIX, _show_agent_default)

    @classmethod
    def load(cls, path: str | None = None, overrides: Mapping[str, Any] | None = None,
             env: Mapping[str, str] | None = None) -> AgentConfig:
        """Defaults, then the YAML file at `path`, then HIXL_AGENT_* in `env`, then `overrides`.

        `env` defaults to os.environ; pass {} to ignore the environment.
        """
        config = cls(**layer_values(cls.KEYS, ENV_PREFIX, path, overrides, env))
        config._check(path)
        return config

    def _check(self, path: str | None) -> None:
        where = f"config file {path}" if path else "configuration"
        if self.grpc_port and self.grpc_port == self.data_port:
            raise ConfigError(f"{where}: key 'data_port': {self.data_port} is also grpc_port")
        if self.metrics_port and self.metrics_port in (self.grpc_port, self.data_port):
            raise ConfigError(f"{where}: key 'metrics_port': {self.metrics_port} is also "
                              f"{'grpc_port' if self.metrics_port == self.grpc_port else 'data_port'}")
        if not self.host:
            raise ConfigError(f"{where}: key 'host' must not be empty")
        if not self.runtime_dir or not os.path.isabs(self.runtime_dir):
            raise ConfigError(
                f"{where}: key 'runtime_dir' must be an absolute path, got {self.runtime_dir!r}")
        if not self.state_dir or not os.path.isabs(self.state_dir):
            raise ConfigError(
                f"{where}: key 'state_dir' must be an absolute path, got {self.state_dir!r}")
        if not self.node_id:
            raise ConfigError(f"{where}: key 'node_id' must not be empty")

    @property
    def log_level_number(self) -> int:
        return int(getattr(logging, self.log_level))

    def server_tls(self, env: Mapping[str, str] | None = None) -> ServerTLS | None:
        """How the gRPC server serves TLS (None: plaintext): the tls_* keys, each empty
        one from its HIXL_TLS_* variable in `env` (default os.environ). Reads and checks
        the files: ConfigError naming the one that is unusable."""
        return ServerTLS.from_settings(self.tls_cert_file, self.tls_key_file,
                                       self.tls_ca_file, self.tls_client_auth, env=env)

    def client_tls(self, env: Mapping[str, str] | None = None) -> ClientTLS | None:
        """How this agent dials gRPC servers (its master): TLS trusting tls_ca_file (else
        $HIXL_TLS_CA_FILE), presenting its certificate; None (plaintext) with no CA."""
        return ClientTLS.from_settings(self.tls_ca_file, self.tls_cert_file,
                                       self.tls_key_file, env=env)


def _show_agent_default(name: str, value: Any) -> str:
    if name == "socket_mode":
        return oct(value)
    if name == "pool":
        return "[]"
    return repr(value)


def _check_keys_match_fields() -> None:
    names = [f.name for f in dataclasses.fields(AgentConfig)]
    if names != list(AgentConfig.KEYS):
        raise AssertionError(f"AgentConfig fields {names} and KEYS {list(AgentConfig.KEYS)} differ")


_check_keys_match_fields()
