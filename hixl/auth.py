"""Cluster-token authentication: loading the token and the HMAC proofs, pure functions.

One shared secret per cluster (the *cluster token*) proves membership. It never crosses
the wire: each side proves it holds the token with HMAC-SHA256 over fresh nonces, and
every comparison is constant-time (`hmac.compare_digest`).

- Data path (`hixl.wire`): HELLO -> CHALLENGE(server nonce) -> AUTH(client nonce, client
  proof) -> OK(server proof). The client proof binds both nonces and the identity sent in
  HELLO, so a proof captured on one connection is worthless on the next (new server
  nonce); the server proof, under a different label, lets the client authenticate the
  agent too, and cannot be obtained by reflecting the client's own proof.
- gRPC: each call carries metadata `hixl-auth: <unix_ms>.<nonce hex>.<proof hex>`, the
  proof an HMAC of (method, unix_ms, nonce). The server accepts a timestamp within
  +-`GRPC_WINDOW_S` of its own clock (cluster clocks are assumed NTP-synced to well under
  that) and each nonce once (`GrpcVerifier` remembers the nonces of the window), so a
  captured header can be neither replayed nor reused for another method.

The token authenticates peers; it does not encrypt or integrity-protect the streams. On
an untrusted network, run hixl inside an encrypted overlay (WireGuard, IPsec).

Sources, in order: an explicit token file (config key `cluster_token_file`, flag
`--cluster-token-file`), then `HIXL_CLUSTER_TOKEN` (the value), then
`HIXL_CLUSTER_TOKEN_FILE` (a path). Never a command-line value: argv is world-readable.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Mapping

from hixl.errors import ConfigError

log = logging.getLogger("hixl.auth")

ENV_TOKEN = "HIXL_CLUSTER_TOKEN"
ENV_TOKEN_FILE = "HIXL_CLUSTER_TOKEN_FILE"

NONCE_SIZE = 16
PROOF_SIZE = hashlib.sha256().digest_size  # 32

DATA_CLIENT_LABEL = b"hixl-data-v1"
DATA_SERVER_LABEL = b"hixl-data-v1-server"
GRPC_LABEL = b"hixl-grpc-v1"

METADATA_KEY = "hixl-auth"
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

def _grpc_mac(token: bytes, method: str, unix_ms: int, nonce: bytes) -> bytes:
    # the fields cannot run into each other: method and unix_ms contain no NUL, the
    # nonce has a fixed size and comes last
    return _mac(token, GRPC_LABEL, b"\0", method.encode("utf-8"), b"\0",
                str(unix_ms).encode("ascii"), b"\0", nonce)


def make_grpc_proof(token: bytes, method: str, *, unix_ms: int | None = None,
                    nonce: bytes | None = None) -> str:
    """The `hixl-auth` metadata value for one call of `method` ("/pkg.Service/Method")."""
    if unix_ms is None:
        unix_ms = time.time_ns() // 1_000_000
    if nonce is None:
        nonce = new_nonce()
    return f"{unix_ms}.{nonce.hex()}.{_grpc_mac(token, method, unix_ms, nonce).hex()}"


class GrpcVerifier:
    """Checks `hixl-auth` values: right token, fresh timestamp, nonce never seen before.

    Nonces are remembered until their timestamp leaves the window, at most `max_tracked`
    of them; past that the oldest are forgotten and proofs older than the newest forgotten
    one are refused, so replay protection never lapses (honest clients send fresh ones).
    Thread-safe.
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

    def verify(self, method: str, value: str | bytes | None) -> str | None:
        """None when `value` proves the token for `method`, else why not (for the client)."""
        if value is None:
            return "no cluster token presented (hixl-auth metadata missing): this server " \
                   f"requires one; set {ENV_TOKEN} or {ENV_TOKEN_FILE}"
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        parts = value.split(".")
        try:
            if len(parts) != 3 or not parts[0].isdigit():
                raise ValueError
            unix_ms = int(parts[0])
            nonce = bytes.fromhex(parts[1])
            proof = bytes.fromhex(parts[2])
        except ValueError:
            return "malformed hixl-auth metadata: expected <unix_ms>.<nonce hex>.<proof hex>"
        if len(nonce) != NONCE_SIZE or len(proof) != PROOF_SIZE:
            return "malformed hixl-auth metadata: wrong nonce or proof size"
        if not hmac.compare_digest(_grpc_mac(self._token, method, unix_ms, nonce), proof):
            return "wrong cluster token (the hixl-auth proof does not match)"
        now_ms = int(self._clock() * 1000)
        if abs(now_ms - unix_ms) > self._window_ms:
            return (f"hixl-auth timestamp is {(unix_ms - now_ms) / 1000:+.0f} s off this "
                    f"server's clock (at most +-{self._window_ms // 1000} s): sync the clocks")
        with self._lock:
            self._forget_locked(now_ms)
            if unix_ms <= self._floor_ms:
                return "hixl-auth proof too old to check for replay; retry"
            if nonce in self._seen:
                return "replayed hixl-auth proof refused (each proof is good for one call)"
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (unix_ms, nonce))
        return None

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
