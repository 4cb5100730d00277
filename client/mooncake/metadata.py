"""Where the Mooncake TransferEngine adapter publishes and finds segments (issue 17, item 5).

Mooncake's `metadata_server` chooses how a segment name becomes an address:

- `P2PHANDSHAKE`: no directory; a segment name is the engine's own "ip:port".
- `hixl://host:port`: an hixl registry (hixl-master or any agent) keeps the address table.
- `http://host:port/metadata`: Mooncake's HTTP metadata protocol (`GET|PUT|DELETE
  ?key=K`), as hixl-master `--enable_http_metadata_server` or mooncake_master serves it.
- `etcd://host:port` (several: `,` or `;` between them), or a bare `host:port` as
  Mooncake takes it: etcd, through hixl's own etcd client (the `etcd` extra).

With a directory, a segment may be named anything its host can bind ("10.0.0.5", or
"10.0.0.5:17001"): the engine publishes `mooncake/rpc_meta/<name>` ({"ip_or_host_name",
"rpc_port"}, Mooncake's record) and `mooncake/ram/<name>` (its buffers, Mooncake's segment
description for the tcp protocol), and peers resolve the name to the engine's "ip:port"
before they connect. On etcd the keys live under the prefix `/mooncake/` (hixl's etcd
client is confined to an absolute prefix), on a lease that a crashed engine's keys expire
with; over HTTP they are Mooncake's keys exactly and the engine deletes them on close.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol

from hixl.addresses import is_host_port, split_host_port
from hixl.errors import HixlError, ParamInvalid, PeerUnavailable

P2P_HANDSHAKE = "P2PHANDSHAKE"
REGISTRY_SCHEME = "hixl://"
HTTP_SCHEMES = ("http://", "https://")
ETCD_SCHEME = "etcd://"
#: the prefix of Mooncake's metadata keys
RPC_META, RAM = "mooncake/rpc_meta/", "mooncake/ram/"
#: where the keys live on etcd (hixl's etcd client needs an absolute prefix)
ETCD_PREFIX = "/mooncake/"
#: seconds a crashed engine's etcd keys outlive it
ETCD_LEASE_TTL_S = 10
ACCEPTED = (f"{P2P_HANDSHAKE!r} (peers exchange metadata directly), "
            f"'{REGISTRY_SCHEME}host:port' (an hixl registry: hixl-master or any agent), "
            "'http://host:port/metadata' (Mooncake's HTTP metadata server: hixl-master "
            "--enable_http_metadata_server or mooncake_master's), or 'etcd://host:port' "
            "(also a bare 'host:port', as Mooncake takes it)")


class Directory(Protocol):
    """A key-value store of Mooncake's metadata keys."""

    def describe(self) -> str: ...

    def put(self, key: str, value: bytes) -> None: ...

    def create(self, key: str, value: bytes) -> bool:
        """Write `key` only if nobody holds it (False: somebody does)."""
        ...

    def get(self, key: str) -> bytes | None: ...

    def delete(self, key: str) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class MetadataServer:
    """What a `metadata_server` text names: nothing (P2P), an hixl registry address, or
    a directory to open (`open()`)."""

    text: str
    registry: str = ""
    http_url: str = ""
    etcd_endpoints: str = ""

    @property
    def is_directory(self) -> bool:
        return bool(self.http_url or self.etcd_endpoints)

    def open(self, timeout: float) -> Directory:
        if self.http_url:
            return HttpDirectory(self.http_url, timeout)
        return EtcdDirectory(self.etcd_endpoints, timeout)


def parse_metadata_server(text: Any) -> MetadataServer:
    """The metadata server `text` names; ParamInvalid naming it and the accepted forms."""
    def refuse(why: str) -> ParamInvalid:
        return ParamInvalid(f"metadata server {text!r} {why}: use {ACCEPTED}")

    if not isinstance(text, str) or not text.strip():
        raise refuse("is not a text")
    value = text.strip()
    if value == P2P_HANDSHAKE:
        return MetadataServer(value)
    if value.startswith(REGISTRY_SCHEME):
        address = value[len(REGISTRY_SCHEME):].rstrip("/")
        if not is_host_port(address):
            raise refuse("does not name host:port")
        return MetadataServer(value, registry=address)
    if value.lower().startswith(HTTP_SCHEMES):
        parts = urllib.parse.urlsplit(value)
        if not parts.hostname or parts.query or parts.fragment:
            raise refuse("is not a URL like http://host:port/metadata")
        try:
            parts.port  # noqa: B018 - urlsplit checks the port only when asked
        except ValueError:
            raise refuse("has a bad port") from None
        return MetadataServer(value, http_url=value)
    endpoints = value[len(ETCD_SCHEME):] if value.lower().startswith(ETCD_SCHEME) else value
    members = [m.strip() for m in endpoints.replace(";", ",").split(",") if m.strip()]
    if "://" in endpoints or not members or not all(is_host_port(m) for m in members):
        raise refuse("is not spoken")
    return MetadataServer(value, etcd_endpoints=",".join(members))


class HttpDirectory:
    """Mooncake's HTTP metadata protocol: GET/PUT/DELETE `<url>?key=<quoted key>`."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout

    def describe(self) -> str:
        return f"HTTP metadata server {self.url}"

    def _call(self, method: str, key: str, body: bytes | None = None) -> tuple[int, bytes]:
        url = f"{self.url}?key={urllib.parse.quote(key, safe='')}"
        request = urllib.request.Request(url, data=body, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise PeerUnavailable(f"{self.describe()}: {method} {key}: {reason}") from None

    def put(self, key: str, value: bytes) -> None:
        status, body = self._call("PUT", key, value)
        if status != 200:
            raise HixlError(f"{self.describe()}: PUT {key} answered {status}: "
                            f"{body.decode(errors='replace')[:200]}")

    def create(self, key: str, value: bytes) -> bool:
        """PUT of an rpc_meta key: Mooncake's metadata servers refuse to overwrite one."""
        status, body = self._call("PUT", key, value)
        if status == 400 and b"Duplicate" in body:
            return False
        if status != 200:
            raise HixlError(f"{self.describe()}: PUT {key} answered {status}: "
                            f"{body.decode(errors='replace')[:200]}")
        return True

    def get(self, key: str) -> bytes | None:
        status, body = self._call("GET", key)
        if status == 404:
            return None
        if status != 200:
            raise HixlError(f"{self.describe()}: GET {key} answered {status}: "
                            f"{body.decode(errors='replace')[:200]}")
        return body

    def delete(self, key: str) -> None:
        status, body = self._call("DELETE", key)
        if status not in (200, 404):
            raise HixlError(f"{self.describe()}: DELETE {key} answered {status}: "
                            f"{body.decode(errors='replace')[:200]}")

    def close(self) -> None:
        pass


class EtcdDirectory:
    """Mooncake's keys on etcd, under ETCD_PREFIX, every one on this engine's lease."""

    def __init__(self, endpoints: str, timeout: float) -> None:
        from hixl.etcd import EtcdClient

        self._client = EtcdClient({"endpoints": endpoints, "prefix": ETCD_PREFIX,
                                   "timeout": timeout}, name="hixl-mooncake-te")
        self._endpoints = endpoints
        try:
            self._lease = self._client.grant(ETCD_LEASE_TTL_S)
        except BaseException:
            self._client.close()
            raise

    def describe(self) -> str:
        return f"etcd at {self._endpoints}"

    def put(self, key: str, value: bytes) -> None:
        self._client.put(key, value, lease=self._lease)

    def create(self, key: str, value: bytes) -> bool:
        from hixl.etcd import Compare, Put

        return self._client.txn([Compare.absent(key)],
                                [Put(key, value, self._lease.id)]).succeeded

    def get(self, key: str) -> bytes | None:
        found = self._client.get(key)
        return None if found is None else found.value

    def delete(self, key: str) -> None:
        self._client.delete(key)

    def close(self) -> None:
        self._client.close()  # revokes the lease: what it held goes at once


def rpc_meta(host: str, port: int) -> bytes:
    """Mooncake's rpc_meta record of an engine serving at host:port."""
    return json.dumps({"ip_or_host_name": host, "rpc_port": port}).encode()


def ram_segment(name: str, port: int, buffers: list[tuple[int, int]]) -> bytes:
    """Mooncake's segment description (tcp protocol) of `buffers` [(addr, length)]."""
    return json.dumps({"name": name, "protocol": "tcp", "tcp_data_port": port,
                       "buffers": [{"name": "cpu:0", "addr": addr, "length": length}
                                   for addr, length in buffers]}).encode()


def address_of(record: bytes, name: str, where: str) -> str:
    """The "host:port" an rpc_meta record gives; PeerUnavailable naming it if unusable."""
    try:
        meta = json.loads(record)
        host, port = meta["ip_or_host_name"], int(meta["rpc_port"])
    except (ValueError, KeyError, TypeError):
        raise PeerUnavailable(f"segment {name!r}: its rpc_meta record on {where} is not "
                              f"Mooncake's {{ip_or_host_name, rpc_port}}: {record[:200]!r}"
                              ) from None
    if not isinstance(host, str) or not host or not 0 < port < 65536:
        raise PeerUnavailable(f"segment {name!r}: rpc_meta on {where} names no address: "
                              f"{record[:200]!r}")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def answers(address: str, timeout: float) -> bool:
    """Whether something accepts connections at "host:port" (a claimed name's holder)."""
    try:
        with socket.create_connection(split_host_port(address), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


__all__ = ["ACCEPTED", "ETCD_PREFIX", "RAM", "RPC_META", "Directory", "EtcdDirectory",
           "HttpDirectory", "MetadataServer", "address_of", "answers", "parse_metadata_server",
           "ram_segment", "rpc_meta"]
