"""host:port texts: the one parser of every network address hixl reads.

Forms: "host:port" and "[v6]:port"; where the caller gives a `default_port`, also "host",
"host:" and "[v6]" (that port then). An IPv6 address goes in brackets; a bare one ("::1")
only where `bare_ipv6` (gRPC targets, which read it so, take the default port). The host
comes back without brackets; `join_host_port` puts them back. Whitespace, a "/" or a
scheme ("http://") are refused, so are ports outside `min_port`..65535.

Every refusal is a ParamInvalid (or the `error` class a caller passes, e.g. ConfigError),
naming the setting (`what`) and the text, and saying what to write instead. Callers that
mean more than host:port (the data address "tcp://host:port", etcd's optional scheme, a
server name's normalization) strip or check that part and hand the rest here.
"""

from __future__ import annotations

from hixl.errors import ParamInvalid

MAX_PORT = 65535


def split_host_port(text: object, what: str = "address", *, default_port: int | None = None,
                    min_port: int = 1, bare_ipv6: bool = False, no_port: str = "",
                    error: type[ParamInvalid] = ParamInvalid) -> tuple[str, int]:
    """(host without brackets, port) of `text`; `error` naming `what` when it is not one.

    `default_port`: the port when none is written (None: one must be; `no_port` is then
    the message, default "... is not host:port: it names no port"). `min_port`: 0 where a
    port 0 means "any free one". `bare_ipv6`: "::1" alone is an IPv6 host (gRPC targets).
    """
    if not isinstance(text, str):
        raise error(f"{what} must be a 'host:port' string, got {text!r}")
    if "://" in text:
        raise error(f"{what} {text!r}: give host:port without a scheme")
    if not text or "/" in text or any(c.isspace() for c in text):
        raise error(f"{what} {text!r} is not host:port")
    port_text: str | None
    if text.startswith("["):
        end = text.find("]")
        host, rest = text[1:end], text[end + 1:]
        if end < 0 or (rest and not rest.startswith(":")):
            raise error(f"{what} {text!r} is not host:port (an IPv6 address is "
                        "'[addr]:port')")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, ""
        elif ":" in host:  # several colons without brackets: an IPv6 address alone
            if not bare_ipv6:
                example = port_text if port_text.isdigit() else str(default_port or 50051)
                raise error(f"{what} {text!r}: an IPv6 address goes in brackets, e.g. "
                            f"[::1]:{example}")
            host, port_text = text, ""
    if not host or "[" in host or "]" in host:
        raise error(f"{what} {text!r} has no host" if not host else
                    f"{what} {text!r} is not host:port")
    if not port_text:
        if default_port is None:
            raise error(no_port or f"{what} {text!r} is not host:port: it names no port")
        return host, default_port
    if not port_text.isdigit() or not min_port <= int(port_text) <= MAX_PORT:
        raise error(f"{what} {text!r}: the port must be {min_port}..{MAX_PORT}")
    return host, int(port_text)


def join_host_port(host: str, port: int) -> str:
    """"host:port", an IPv6 host in brackets: the inverse of split_host_port."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def normalize_host_port(text: object, what: str = "address", *,
                        error: type[ParamInvalid] = ParamInvalid) -> str:
    """"host:port" / "[v6]:port" as hixl writes it (surrounding blanks dropped, the port
    without leading zeros); `error` naming `what` when `text` is not one."""
    host, port = split_host_port(text.strip() if isinstance(text, str) else text, what,
                                 error=error)
    return join_host_port(host, port)


def is_host_port(text: object) -> bool:
    """Whether `text` is a "host:port" / "[v6]:port" with a port 1..65535."""
    try:
        split_host_port(text)
    except ParamInvalid:
        return False
    return True


__all__ = ["MAX_PORT", "is_host_port", "join_host_port", "normalize_host_port",
           "split_host_port"]
