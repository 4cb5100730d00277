"""What a client says when the address it dialled answered, but is not the server it wanted.

A cluster has three kinds of port (a hixl-master's, an agent's gRPC port, an agent's data
port), so dialling the wrong one is the likeliest mistake. gRPC reports it in its own
terms: UNIMPLEMENTED ("Method not found!") from a gRPC server without the service, or
"Failed parsing HTTP/2 (Frame size ...)" from a port that does not speak gRPC at all.
`wrong_server` turns either into a `WrongServer` (hixl.errors) saying what the address
turned out to be, what the call expected there and what to dial instead; each client
(agent calls, the store's master calls, the registry's) names its own `Expected`. Such
an error is final: the same address will answer the same way, so a caller retrying until
its deadline (store setup, say) stops at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from hixl.errors import HixlError, WrongServer

#: what gRPC says when the other end does not speak HTTP/2 (an agent's data port, say)
NOT_HTTP2 = ("Failed parsing HTTP/2", "Frame size", "Trying to connect an http1.x server")


@dataclass(frozen=True)
class Expected:
    """The server a client wanted at an address, and what to say when it reached another.

    `service`: the gRPC service it calls ("the hixl Agent service"); `serves_grpc`: what a
    gRPC server without that service probably is; `not_grpc`: what a port that does not
    speak gRPC probably is; `fix`: what to dial instead (a sentence).
    """

    service: str
    serves_grpc: str
    not_grpc: str
    fix: str


#: an agent's gRPC port (Engine.connect, every AgentClient call)
AGENT = Expected(
    service="the hixl Agent service",
    serves_grpc="a hixl-master's port (it serves the registry and the store), or another "
                "server?",
    not_grpc="an agent's data port (data= on its 'hixl-agent serving' line) or another kind "
             "of server?",
    fix="Dial the agent's engine name, host:grpc_port (engine= on its 'hixl-agent serving' "
        "line, default port 50161)")

#: a hixl-master's port, as the KV store dials it (MasterClient, the Mooncake store)
MASTER = Expected(
    service="the hixl Master service (the KV store)",
    serves_grpc="an hixl agent's gRPC port (the store needs hixl-master: an agent serves "
                "none, not even with its embedded registry), or another server?",
    not_grpc="an hixl agent's data port (data= on its 'hixl-agent serving' line) or another "
             "kind of server?",
    fix="Give the store hixl-master's address, host:port (the 'hixl-master serving' line, "
        "default port 50051; Mooncake's master_server_addr)")

#: a registry (hixl-master, or an agent without a master of its own), as engines follow it
REGISTRY = Expected(
    service="the hixl Registry service",
    serves_grpc="an hixl agent that publishes to a master of its own (an agent serves a "
                "registry only when started without --master), or another server?",
    not_grpc="an hixl agent's data port (data= on its 'hixl-agent serving' line) or another "
             "kind of server?",
    fix="Give Engine(registry=...) (HIXL_REGISTRY) the address the agents' --master names: "
        "a hixl-master's host:port (default port 50051)")


def wrong_server(rpc: grpc.RpcError, error: HixlError, target: str, expected: Expected,
                 what: str, cls: type[WrongServer] = WrongServer) -> HixlError:
    """`error` (what the failed call `rpc` stands for), or a `cls` saying what `target`
    turned out to be when the call reached something other than `expected`: a gRPC server
    without its service (UNIMPLEMENTED), or a port not speaking gRPC at all. `what` names
    the call ("handshake at agent h:p"); the message starts with it."""
    code_fn = getattr(rpc, "code", None)
    code = code_fn() if callable(code_fn) else None
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return cls(f"{what}: {target} serves gRPC but not {expected.service}: "
                   f"{expected.serves_grpc} {expected.fix}")
    if any(marker in str(error) for marker in NOT_HTTP2):
        return cls(f"{what}: {target} does not speak gRPC: {expected.not_grpc} "
                   f"{expected.fix}")
    return error


__all__ = ["AGENT", "MASTER", "NOT_HTTP2", "REGISTRY", "Expected", "wrong_server"]
