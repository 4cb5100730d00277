"""Optional TLS for gRPC: which PEM files each side uses, read and checked once.

TLS encrypts the control plane and lets clients verify servers (and, with client
authentication, servers verify clients); the cluster token (hixl.auth) still
authenticates every call on top of it. The data path (TCP and unix sockets) and the
master's store call endpoint are not covered: they are authenticated by the token only.

Settings, per file: an explicit value (agent config keys `tls_cert_file`, `tls_key_file`,
`tls_ca_file`; the same `hixl-master` flags; arguments in code), else the environment
variable of the same name, `HIXL_TLS_CERT_FILE`, `HIXL_TLS_KEY_FILE`, `HIXL_TLS_CA_FILE`,
so one set of variables gives a node's agent, its clients and the CLI the same files.

- A server serves TLS when it has a certificate and key; with a CA and `client_auth` it
  also requires each client to present a certificate that CA signed (mutual TLS).
- A client dials with TLS when it has a CA (the one that signed the servers'
  certificates); with a certificate and key it presents them (for mutual TLS).
  `HIXL_TLS_SERVER_NAME` names the server in certificates that do not carry the address
  dialled (engine names are `ip:port`: give certificates IP subjectAltNames, or one
  shared name and this variable).

Every problem with a file (missing, unreadable, not PEM, a key that does not match its
certificate, an encrypted key gRPC cannot use) is a ConfigError naming the setting and the
file, raised when the settings are read, never at the first connection.
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import grpc

from hixl.errors import ConfigError

log = logging.getLogger("hixl.tls")

ENV_CA_FILE = "HIXL_TLS_CA_FILE"
ENV_CERT_FILE = "HIXL_TLS_CERT_FILE"
ENV_KEY_FILE = "HIXL_TLS_KEY_FILE"
ENV_SERVER_NAME = "HIXL_TLS_SERVER_NAME"

_CERT_MARK = b"-----BEGIN CERTIFICATE-----"
_MAX_PEM = 1 << 20  # a PEM file larger than this is not a certificate or a key


def _read_pem(path: str, setting: str, what: str) -> bytes:
    """The bytes of `path`, which `setting` named; ConfigError if unusable."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # checked first: a FIFO would block
            raise ConfigError(f"{setting} {path}: not a regular file")
        with open(path, "rb") as f:
            data = f.read(_MAX_PEM + 1)
    except OSError as exc:
        raise ConfigError(f"{setting} {path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > _MAX_PEM or b"-----BEGIN " not in data:
        raise ConfigError(f"{setting} {path}: not a PEM file (expected a {what})")
    return data


def _read_key_pair(cert_file: str, key_file: str, cert_setting: str,
                   key_setting: str) -> tuple[bytes, bytes]:
    """(certificate chain, private key) PEM; ConfigError unless they belong together."""
    cert = _read_pem(cert_file, cert_setting, "certificate")
    key = _read_pem(key_file, key_setting, "private key")
    if _CERT_MARK not in cert:
        raise ConfigError(f"{cert_setting} {cert_file}: holds no certificate "
                          "(-----BEGIN CERTIFICATE-----)")
    if b"PRIVATE KEY-----" not in key:
        raise ConfigError(f"{key_setting} {key_file}: holds no private key "
                          "(-----BEGIN ... PRIVATE KEY-----)")
    if b"ENCRYPTED" in key:
        raise ConfigError(f"{key_setting} {key_file}: the private key is encrypted; gRPC "
                          "needs it unencrypted (protect it with mode 0600 instead)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        # the password callback never prompts on a terminal (a daemon would hang)
        context.load_cert_chain(cert_file, key_file, password=lambda: b"\0")
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise ConfigError(f"{key_setting} {key_file}: the private key does not match "
                              f"the certificate in {cert_setting} {cert_file}") from None
        raise ConfigError(f"{cert_setting} {cert_file} / {key_setting} {key_file}: cannot "
                          f"be loaded: {exc.reason or exc}") from None
    except OSError as exc:  # removed or replaced between the two reads
        raise ConfigError(f"{cert_setting} {cert_file} / {key_setting} {key_file}: cannot "
                          f"read: {exc.strerror or exc}") from None
    mode = os.stat(key_file).st_mode
    if mode & 0o077:
        log.warning("TLS private key %s is accessible by group or others (mode %s); "
                    "chmod 600 it", key_file, oct(stat.S_IMODE(mode)))
    return cert, key


def _read_ca(ca_file: str, setting: str) -> bytes:
    """The CA certificates PEM; ConfigError unless it holds at least one certificate."""
    data = _read_pem(ca_file, setting, "CA certificate")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cadata=data.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{setting} {ca_file}: holds no usable CA certificate: "
                          f"{getattr(exc, 'reason', None) or exc}") from None
    return data


def _pick(value: str, env: Mapping[str, str], var: str, key: str) -> tuple[str, str]:
    """(path, the setting that chose it): an explicit value, else the variable."""
    if value:
        return value, key
    from_env = env.get(var, "").strip()
    return from_env, var


@dataclass(frozen=True)
class ClientTLS:
    """How a client dials gRPC servers over TLS: trust `ca_file`; present `cert_file` and
    `key_file` when given (mutual TLS); `server_name` overrides the name the server's
    certificate must carry (default: the host dialled). Files are read and checked here:
    a problem is a ConfigError naming the file."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    #: the settings that named ca_file, cert_file, key_file (for messages)
    settings: tuple[str, str, str] = field(default=("ca_file", "cert_file", "key_file"),
                                           compare=False, repr=False)
    _credentials: grpc.ChannelCredentials | None = field(default=None, init=False,
                                                         compare=False, repr=False)

    def __post_init__(self) -> None:
        ca_setting, cert_setting, key_setting = self.settings
        if not self.ca_file:
            raise ConfigError(f"TLS client: {ca_setting} is required (the CA that signed "
                              "the servers' certificates)")
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError(f"TLS client: {cert_setting} and {key_setting} go together; "
                              f"set both (mutual TLS) or neither")
        ca = _read_ca(self.ca_file, ca_setting)
        cert = key = None
        if self.cert_file:
            cert, key = _read_key_pair(self.cert_file, self.key_file, cert_setting,
                                       key_setting)
        object.__setattr__(self, "_credentials", grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert))

    @property
    def credentials(self) -> grpc.ChannelCredentials:
        assert self._credentials is not None
        return self._credentials

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name \
            else []

    def describe(self) -> str:
        """For messages: 'TLS (CA <file>[, client certificate <file>])'."""
        text = f"TLS (CA {self.ca_file}"
        if self.cert_file:
            text += f", client certificate {self.cert_file}"
        return text + ")"

    @classmethod
    def from_settings(cls, ca_file: str = "", cert_file: str = "", key_file: str = "",
                      server_name: str = "", *, env: Mapping[str, str] | None = None,
                      keys: tuple[str, str, str] = ("tls_ca_file", "tls_cert_file",
                                                     "tls_key_file")) -> ClientTLS | None:
        """Each empty value taken from its HIXL_TLS_* variable in `env` (default
        os.environ); None (plaintext) when that leaves no CA (a certificate alone is a
        server's: an agent serving TLS may still dial a plaintext master)."""
        environ = os.environ if env is None else env
        ca, ca_key = _pick(ca_file, environ, ENV_CA_FILE, keys[0])
        if not ca:
            return None
        cert, cert_key = _pick(cert_file, environ, ENV_CERT_FILE, keys[1])
        key, key_key = _pick(key_file, environ, ENV_KEY_FILE, keys[2])
        name = server_name or environ.get(ENV_SERVER_NAME, "").strip()
        return _cached(ca, cert, key, name, (ca_key, cert_key, key_key), _stamp(ca),
                       _stamp(cert), _stamp(key))


#: what a client takes: None = from the environment (HIXL_TLS_*), False = plaintext,
#: or the TLS settings themselves
TlsSetting = ClientTLS | Literal[False] | None


def _stamp(path: str) -> tuple[int, int] | None:
    """(mtime, size) of `path`: a renewed certificate is read again, an unchanged one not."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=32)
def _cached(ca: str, cert: str, key: str, name: str, settings: tuple[str, str, str],
            *stamps: tuple[int, int] | None) -> ClientTLS:
    return ClientTLS(ca, cert, key, name, settings)


def client_tls(tls: TlsSetting = None, env: Mapping[str, str] | None = None,
               ) -> ClientTLS | None:
    """The TLS settings a client uses: `tls` itself, None for False (plaintext), and for
    None those of HIXL_TLS_* in `env` (default os.environ; no CA there: plaintext)."""
    if tls is False:
        return None
    if tls is None:
        return ClientTLS.from_settings(env=env)
    if not isinstance(tls, ClientTLS):
        raise ConfigError(f"tls must be a hixl.tls.ClientTLS, False or None, got "
                          f"{type(tls).__name__}")
    return tls


@dataclass(frozen=True)
class ServerTLS:
    """How a gRPC server serves TLS: `cert_file` and `key_file` (its certificate chain and
    key); with `client_auth`, only clients presenting a certificate signed by `ca_file`
    are served (mutual TLS). Files are read and checked here (ConfigError naming them)."""

    cert_file: str
    key_file: str
    ca_file: str = ""
    client_auth: bool = False
    #: the settings that named cert_file, key_file, ca_file (for messages)
    settings: tuple[str, str, str] = field(default=("tls_cert_file", "tls_key_file",
                                                    "tls_ca_file"),
                                           compare=False, repr=False)
    _credentials: grpc.ServerCredentials | None = field(default=None, init=False,
                                                        compare=False, repr=False)

    def __post_init__(self) -> None:
        cert_setting, key_setting, ca_setting = self.settings
        if not self.cert_file or not self.key_file:
            raise ConfigError(f"TLS server: {cert_setting} and {key_setting} are both "
                              "required")
        if self.client_auth and not self.ca_file:
            raise ConfigError(f"TLS server: client authentication needs {ca_setting} (the "
                              "CA that signs client certificates)")
        cert, key = _read_key_pair(self.cert_file, self.key_file, cert_setting, key_setting)
        ca = _read_ca(self.ca_file, ca_setting) if self.client_auth else None
        object.__setattr__(self, "_credentials", grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=self.client_auth))

    @property
    def credentials(self) -> grpc.ServerCredentials:
        assert self._credentials is not None
        return self._credentials

    def describe(self) -> str:
        """For logs: 'TLS (certificate <file>[, client certificates from CA <file>])'."""
        text = f"TLS (certificate {self.cert_file}"
        if self.client_auth:
            text += f", client certificates required, CA {self.ca_file}"
        return text + ")"

    @classmethod
    def from_settings(cls, cert_file: str = "", key_file: str = "", ca_file: str = "",
                      client_auth: bool = False, *, env: Mapping[str, str] | None = None,
                      keys: tuple[str, str, str] = ("tls_cert_file", "tls_key_file",
                                                     "tls_ca_file")) -> ServerTLS | None:
        """Each empty file setting taken from its HIXL_TLS_* variable in `env` (default
        os.environ); None (plaintext) when that leaves neither certificate nor key."""
        environ = os.environ if env is None else env
        cert, cert_key = _pick(cert_file, environ, ENV_CERT_FILE, keys[0])
        key, key_key = _pick(key_file, environ, ENV_KEY_FILE, keys[1])
        ca, ca_key = _pick(ca_file, environ, ENV_CA_FILE, keys[2])
        if not cert and not key:
            if client_auth:
                raise ConfigError(f"TLS server: client authentication is asked for but "
                                  f"{keys[0]} and {keys[1]} are not set (TLS is off)")
            return None
        if not cert or not key:
            missing, given = (cert_key, key_key) if not cert else (key_key, cert_key)
            raise ConfigError(f"TLS server: {given} is set but {missing} is not; set both")
        return cls(cert, key, ca, client_auth, (cert_key, key_key, ca_key))
