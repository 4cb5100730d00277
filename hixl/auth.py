"""Cluster-token authentication: loading the token and the HMAC proofs, pure functions.

One shared secret per cluster (the *cluster token*) proves membership. It never crosses
the wire: each side proves it holds the token with HMAC-SHA256 over fresh nonces, and
every comparison is constant-time (`hmac.compare_digest`).

- Data path (`hixl.wire`): HELLO -> CHALLENGE(server nonce) -> AUTH(client nonce, client
  proof) -> OK(server proof). The client proof binds both nonces and the identity sent in
  HELLO, so a proof captured on one connection is worthless on the next (new server
  nonce); the server proof, under a different label, lets the client authenticate the
  agent too, and cannot be obtained by reflecting the client's own proof.
- gRPC: each call carries metadata `hixl-auth: v2.<unix_ms>.<nonce>.<digest>.<proof>.<server>`,
  the proof an HMAC of (method, the server dialled, unix_ms, nonce, SHA-256 of the
  serialized request). The server accepts a timestamp within +-`GRPC_WINDOW_S` of its own
  clock (cluster clocks are assumed NTP-synced to well under that), a server that is one
  of its own names (`ServerNames`: the addresses it listens on, names resolving to them,
  an allow-list), a request whose digest matches, and each nonce once (`GrpcVerifier`
  remembers the nonces of the window). So a captured header can be neither replayed
  (to this server or any other of the cluster), nor reused for another method or body.

The token authenticates peers and binds each gRPC request; it does not encrypt anything,
nor protect gRPC replies or the data path's bytes. On an untrusted network, run hixl inside
an encrypted overlay (WireGuard, IPsec) or give gRPC TLS (hixl.tls).

Sources, in order: an explicit token file (config key `cluster_token_file`, flag
`--cluster-token-file`), then `HIXL_CLUSTER_TOKEN` (the value), then
`HIXL_CLUSTER_TOKEN_FILE` (a path). Never a command-line value: argv is world-readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from hixl.addresses import join_host_port, split_host_port
from hixl.errors import ConfigError, ParamInvalid

log = logging.getLogger("hixl.auth")

ENV_TOKEN = "HIXL_CLUSTER_TOKEN"
ENV_TOKEN_FILE = "HIXL_CLUSTER_TOKEN_FILE"

NONCE_SIZE = 16
PROOF_SIZE = hashlib.sha256().digest_size  # 32

DATA_CLIENT_LABEL = b"hixl-data-v1"
DATA_SERVER_LABEL = b"hixl-data-v1-server"
GRPC_LABEL = b"hixl-grpc-v2"
GRPC_PROOF_VERSION = "v2"
DIGEST_SIZE = hashlib.sha256().digest_size  # 32

METADATA_KEY = "hixl-auth"
ENV_SERVER_NAMES = "HIXL_GRPC_SERVER_NAMES"
GRPC_WINDOW_S = 120.0
GRPC_MAX_TRACKED = 100_000  # nonces remembered for replay checks (bounded memory)


# ---------------------------------------------------------------- the token

def read_token_file(path: str) -> bytes:
    """The token in `path` (content stripped); ConfigError naming the file if unusable.

    A file that group or others may access is used, with a warning: the token grants
    read/write access to every segment of the cluster.
    """
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # checked first: opening a FIFO would block
            raise ConfigError(f"cluster token file {path}: not a regular file")
        with open(path, "rb") as f:
            content = f.read()
    except OSError as exc:
        raise ConfigError(f"cluster token file {path}: cannot read: "
                          f"{exc.strerror or exc}") from None
    token = content.strip()
    if not token:
        raise ConfigError(f"cluster token file {path} is empty; put the cluster token in it")
    if mode & 0o077:
        log.warning("cluster token file %s is accessible by group or others (mode %s); "
                    "chmod 600 it", path, oct(stat.S_IMODE(mode)))
    return token


def load_token(path: str | None = None, env: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster token, or None when none is configured (authentication off).

    `path` (a token file) wins; otherwise `HIXL_CLUSTER_TOKEN` (the value itself) or
    `HIXL_CLUSTER_TOKEN_FILE` (a path) from `env` (default os.environ). Setting both
    variables, an empty value or an unusable file is a ConfigError naming it.
    """
    if path:
        return read_token_file(path)
    environ = os.environ if env is None else env
    value = environ.get(ENV_TOKEN)
    file_path = environ.get(ENV_TOKEN_FILE)
    if value is not None and file_path is not None:
        raise ConfigError(f"both {ENV_TOKEN} and {ENV_TOKEN_FILE} are set; set only one")
    if value is not None:
        token = value.strip().encode("utf-8")
        if not token:
            raise ConfigError(f"environment variable {ENV_TOKEN} is set but empty")
        return token
    if file_path is not None:
        if not file_path.strip():
            raise ConfigError(f"environment variable {ENV_TOKEN_FILE} is set but empty")
        return read_token_file(file_path)
    return None


def as_token(value: str | bytes | None) -> bytes | None:
    """A token given in code (str or bytes) as bytes; None stays None, empty is refused."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, bytes | bytearray):
        raise ConfigError(f"cluster token must be str or bytes, got {type(value).__name__}")
    token = bytes(value).strip()
    if not token:
        raise ConfigError("cluster token must not be empty")
    return token


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


# ---------------------------------------------------------------- data path proofs

def _mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"".join(parts), hashlib.sha256).digest()


def data_client_proof(token: bytes, server_nonce: bytes, client_nonce: bytes,
                      identity: bytes) -> bytes:
    """HMAC(token, label | server nonce | client nonce | identity): the client's AUTH proof."""
    return _mac(token, DATA_CLIENT_LABEL, server_nonce, client_nonce, identity)


def data_server_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC(token, server label | client nonce | server nonce): the agent's answer to AUTH."""
    return _mac(token, DATA_SERVER_LABEL, client_nonce, server_nonce)


def proofs_equal(expected: bytes, given: bytes | bytearray | memoryview) -> bool:
    """Constant-time comparison: timing tells nothing about which bytes differ."""
    return hmac.compare_digest(expected, bytes(given))


# ---------------------------------------------------------------- gRPC proofs

class GrpcClaim(NamedTuple):
    """What a well-formed `hixl-auth` value claims (its MAC already checked)."""

    unix_ms: int
    nonce: bytes
    digest: bytes  # SHA-256 of the serialized request
    server: str  # the server the client dialled, as grpc_authority() writes it


def request_digest(body: bytes | bytearray | memoryview) -> bytes:
    """SHA-256 of a serialized request: what a gRPC proof binds the request body with."""
    return hashlib.sha256(body).digest()


EMPTY_DIGEST = request_digest(b"")  # an empty message (HealthRequest() serializes to b"")


def _field(value: bytes) -> bytes:
    return len(value).to_bytes(4, "big") + value


def _grpc_mac(token: bytes, method: str, unix_ms: int, nonce: bytes, digest: bytes,
              server: str) -> bytes:
    # variable fields length-prefixed: no two different claims share an input
    return _mac(token, GRPC_LABEL, _field(method.encode("utf-8")),
                _field(server.encode("ascii")), _field(str(unix_ms).encode("ascii")),
                _field(nonce), _field(digest))


def make_grpc_proof(token: bytes, method: str, server: str, digest: bytes = EMPTY_DIGEST, *,
                    unix_ms: int | None = None, nonce: bytes | None = None) -> str:
    """The `hixl-auth` metadata value for one call of `method` ("/pkg.Service/Method") to
    `server` (the target dialled, as `grpc_authority` writes it) with a request that
    serializes to bytes of SHA-256 `digest` (`request_digest`)."""
    if unix_ms is None:
        unix_ms = time.time_ns() // 1_000_000
    if nonce is None:
        nonce = new_nonce()
    if not _printable(server):
        raise ValueError(f"gRPC proof: server {server!r} is not a printable ASCII name")
    proof = _grpc_mac(token, method, unix_ms, nonce, digest, server)
    return (f"{GRPC_PROOF_VERSION}.{unix_ms}.{nonce.hex()}.{digest.hex()}.{proof.hex()}."
            f"{server}")


def _printable(text: str) -> bool:
    return bool(text) and text.isascii() and text.isprintable() and " " not in text


class GrpcVerifier:
    """Checks `hixl-auth` values: right token, fresh timestamp, nonce never seen before.

    `check` tells whether a value proves the token (and returns what it claims: the
    server, the request digest); `remember` then admits its nonce once. The server and
    body checks are the caller's (hixl.control.TokenInterceptor). Nonces are remembered
    until their timestamp leaves the window, at most `max_tracked` of them; past that the
    oldest are forgotten and proofs older than the newest forgotten one are refused, so
    replay protection never lapses (honest clients send fresh ones). Thread-safe.
    """

    def __init__(self, token: bytes, *, window_s: float = GRPC_WINDOW_S,
                 clock: Callable[[], float] = time.time,
                 max_tracked: int = GRPC_MAX_TRACKED) -> None:
        self._token = token
        self._window_ms = int(window_s * 1000)
        self._clock = clock
        self._max = max_tracked
        self._lock = threading.Lock()
        self._seen: set[bytes] = set()
        self._expiry: list[tuple[int, bytes]] = []  # heap of (unix_ms, nonce)
        self._floor_ms = -1  # proofs at or below this are too old to check for replay

    def check(self, method: str, value: str | bytes | None,
              ) -> tuple[str, None] | tuple[None, GrpcClaim]:
        """(None, the claim) when `value` proves the token for `method` and is fresh, else
        (why not, for the client; None). Remembers nothing."""
        if value is None:
            return ("no cluster token presented (hixl-auth metadata missing): this server "
                    f"requires one; set {ENV_TOKEN} or {ENV_TOKEN_FILE}"), None
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        parts = value.split(".", 5)
        if len(parts) == 3 and parts[0].isdigit():
            return ("this client sends the hixl-auth proof of an older hixl (method, time and "
                    "nonce only), which this server refuses: upgrade the client (the proof "
                    "now binds the server dialled and the request)"), None
        try:
            if len(parts) != 6 or parts[0] != GRPC_PROOF_VERSION or not parts[1].isdigit():
                raise ValueError
            unix_ms = int(parts[1])
            nonce = bytes.fromhex(parts[2])
            digest = bytes.fromhex(parts[3])
            proof = bytes.fromhex(parts[4])
        except ValueError:
            return ("malformed hixl-auth metadata: expected "
                    f"{GRPC_PROOF_VERSION}.<unix_ms>.<nonce>.<digest>.<proof>.<server>"), None
        server = parts[5]
        if (len(nonce) != NONCE_SIZE or len(digest) != DIGEST_SIZE
                or len(proof) != PROOF_SIZE or not _printable(server)):
            return "malformed hixl-auth metadata: wrong nonce, digest, proof or server", None
        if not hmac.compare_digest(
                _grpc_mac(self._token, method, unix_ms, nonce, digest, server), proof):
            return "wrong cluster token (the hixl-auth proof does not match)", None
        now_ms = int(self._clock() * 1000)
        if abs(now_ms - unix_ms) > self._window_ms:
            return (f"hixl-auth timestamp is {(unix_ms - now_ms) / 1000:+.0f} s off this "
                    f"server's clock (at most +-{self._window_ms // 1000} s): sync the "
                    "clocks"), None
        return None, GrpcClaim(unix_ms, nonce, digest, server)

    def remember(self, claim: GrpcClaim) -> str | None:
        """None the first time a (checked) claim's nonce is seen, else why it is refused."""
        now_ms = int(self._clock() * 1000)
        with self._lock:
            self._forget_locked(now_ms)
            if claim.unix_ms <= self._floor_ms:
                return "hixl-auth proof too old to check for replay; retry"
            if claim.nonce in self._seen:
                return "replayed hixl-auth proof refused (each proof is good for one call)"
            self._seen.add(claim.nonce)
            heapq.heappush(self._expiry, (claim.unix_ms, claim.nonce))
        return None

    def verify(self, method: str, value: str | bytes | None, *, body: bytes | None = None,
               names: ServerNames | None = None) -> str | None:
        """Every check at once, synchronously (tools and tests): None when `value` proves the
        token for `method`, is fresh, unseen, bound to one of `names` (IP literals and
        exact names only: no resolution) and to `body` (when given)."""
        why, claim = self.check(method, value)
        if claim is None:
            return why
        if names is not None and not names.match_literal(claim.server):
            return names.mismatch(claim.server)
        if body is not None and not hmac.compare_digest(request_digest(body), claim.digest):
            return BODY_MISMATCH
        return self.remember(claim)

    def _forget_locked(self, now_ms: int) -> None:
        expiry = self._expiry
        while expiry and (expiry[0][0] < now_ms - self._window_ms
                          or len(expiry) >= self._max):
            unix_ms, nonce = heapq.heappop(expiry)
            self._seen.discard(nonce)
            if unix_ms >= now_ms - self._window_ms:  # forgotten while still in the window
                self._floor_ms = max(self._floor_ms, unix_ms)

    @property
    def tracked(self) -> int:
        with self._lock:
            return len(self._seen)


BODY_MISMATCH = ("the request does not match the hixl-auth proof (its SHA-256 differs from "
                 "the one the proof binds): a proof replayed with another request?")


# ---------------------------------------------------------------- servers' names

def server_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of "host:port", "[v6]:port", "host" or a bare IPv6 address (port 443,
    gRPC's default), the host lower-cased, without a trailing dot, an IP in its canonical
    form; None when `address` is none of these (a unix: target, a bad port)."""
    try:
        host, port = split_host_port(address.strip(), "server address", default_port=443,
                                     min_port=0, bare_ipv6=True)
    except ParamInvalid:
        return None
    host = host.rstrip(".").lower()
    if not host:
        return None
    ip = _ip(host)
    if ip is not None:
        host = str(ip)
    elif ":" in host:
        return None
    return host, port


def grpc_authority(target: str) -> str:
    """The server a client dials `target` at, as gRPC proofs bind it: "host:port" with the
    host normalized (server_host_port), whatever the form of the target ("host:port",
    "[::1]:port", "dns:///host:port", "ipv4:a.b.c.d:port"...; the first of a list);
    targets without a host (unix:...) as they are."""
    text = target.strip()
    lowered = text.lower()
    if lowered.startswith("dns://"):  # dns://[resolver]/host:port
        text = text[6:].split("/", 1)[-1]
    else:
        for scheme in ("dns:", "ipv4:", "ipv6:"):
            if lowered.startswith(scheme):
                text = text[len(scheme):]
                break
    text = text.split(",", 1)[0]
    parsed = server_host_port(text) if not lowered.startswith(("unix:", "unix-abstract:")) \
        else None
    server = join_host_port(*parsed) if parsed is not None else text
    return server if _printable(server) else urllib.parse.quote(server, safe=":[]/@")


IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(host: str) -> IpAddress | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class ServerNames:
    """The names a gRPC server answers to, which a proof's bound server must be one of.

    - each address it listens on ("host:port", with the port bound): that name, and any
      name that resolves to that IP, with that port;
    - for a wildcard address (0.0.0.0, ::): any address of this host (one a socket can
      bind), or a name resolving to one, with that port;
    - `extra` names and those in $HIXL_GRPC_SERVER_NAMES (comma-separated "host:port"):
      names peers reach it by that are none of these (NAT, a proxy, a load balancer).

    So a proof made for an agent or master at another address or port is refused, and one
    made for this server under any of its names is not. Resolutions are cached (a minute,
    bounded).
    """

    RESOLVE_TTL_S = 60.0
    MAX_CACHED = 1024

    def __init__(self, extra: Iterable[str] = (), env: Mapping[str, str] | None = None,
                 ) -> None:
        self._exact: set[str] = set()
        self._ips: dict[int, set[IpAddress]] = {}
        self._any_ports: set[int] = set()
        self._shown: list[str] = []
        self._resolved: dict[str, tuple[float, tuple[IpAddress, ...]]] = {}
        self._local: dict[IpAddress, bool] = {}
        environ = os.environ if env is None else env
        listed = [(name, "extra") for name in extra]
        listed += [(name, ENV_SERVER_NAMES)
                   for name in environ.get(ENV_SERVER_NAMES, "").split(",") if name.strip()]
        for name, where in listed:
            parsed = server_host_port(name)
            if parsed is None or ":" not in name:
                raise ConfigError(f"{where}: {name.strip()!r} is not a 'host:port' name")
            self._add_exact(join_host_port(*parsed))

    def _add_exact(self, name: str) -> None:
        if name not in self._exact:
            self._exact.add(name)
            self._shown.append(name)

    def listen(self, address: str, port: int) -> None:
        """The server listens on `address` ("host:port"), bound to `port`."""
        parsed = server_host_port(address)
        if parsed is None:
            self._add_exact(address)
            return
        host = parsed[0]
        ip = _ip(host)
        ips: tuple[IpAddress, ...] = (ip,) if ip is not None else _resolve_now(host)
        if any(ip.is_unspecified for ip in ips):
            self._any_ports.add(port)
            self._shown.append(f"any address of this host, port {port}")
        else:
            self._add_exact(join_host_port(host, port))
        self._ips.setdefault(port, set()).update(ip for ip in ips if not ip.is_unspecified)

    @property
    def known(self) -> bool:
        return bool(self._exact or self._any_ports)

    def describe(self) -> str:
        return ", ".join(self._shown) or "(no address known)"

    def mismatch(self, server: str) -> str:
        """Why a proof bound to `server` is refused here, naming both."""
        if not self.known:
            return (f"the hixl-auth proof is bound to server {server}, and this server does "
                    "not know the addresses it serves (bind them with hixl.control.add_port)")
        return (f"the hixl-auth proof is bound to server {server}, and this server is "
                f"{self.describe()}: a proof made for another server (replayed?), or a "
                "client that dialled this server by a name it does not answer to (add it "
                f"to {ENV_SERVER_NAMES})")

    def match_literal(self, server: str) -> bool | None:
        """True: `server` is this server; False: it is not; None: a host name that must be
        resolved to tell (`accepts`)."""
        if server in self._exact:
            return True
        parsed = server_host_port(server)
        if parsed is None:
            return False
        host, port = parsed
        if port not in self._ips and port not in self._any_ports:
            return False
        ip = _ip(host)
        if ip is None:
            return None
        return self._ip_is_ours(ip, port)

    async def accepts(self, server: str) -> bool:
        """Whether `server` names this server; a host name is resolved (off the loop)."""
        known = self.match_literal(server)
        if known is not None:
            return known
        host, port = server_host_port(server) or ("", 0)
        now = time.monotonic()
        cached = self._resolved.get(host)
        if cached is not None and cached[0] > now:
            ips = cached[1]
        else:
            ips = ()
            with contextlib.suppress(OSError, UnicodeError):
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, None, type=socket.SOCK_STREAM)
                ips = tuple(ip for ip in (_ip(str(info[4][0]).split("%")[0])
                                          for info in infos) if ip is not None)
            if len(self._resolved) >= self.MAX_CACHED:
                self._resolved.clear()
            self._resolved[host] = (now + self.RESOLVE_TTL_S, ips)
        return any(self._ip_is_ours(ip, port) for ip in ips)

    def _ip_is_ours(self, ip: IpAddress, port: int) -> bool:
        if ip in self._ips.get(port, ()):
            return True
        if port not in self._any_ports:
            return False
        local = self._local.get(ip)
        if local is None:
            local = _is_local(ip)
            if len(self._local) >= self.MAX_CACHED:
                self._local.clear()
            self._local[ip] = local
        return local


def _resolve_now(host: str) -> tuple[IpAddress, ...]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return ()
    return tuple(ip for ip in (_ip(str(info[4][0]).split("%")[0]) for info in infos)
                 if ip is not None)


def _is_local(ip: IpAddress) -> bool:
    """Whether `ip` is an address of this host: a socket can bind it."""
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((str(ip), 0))
    except OSError:
        return False
    return True
