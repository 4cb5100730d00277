"""hixl-agent: the per-node daemon that owns host-memory segments and serves them.

`agent` (the segments, no networking), `runtime` (`AgentServer`: the daemon, and the
registry publisher), `grpc_service` (the Agent service), `fd_server` (fds to same-node
peers), `data_server` (the socket data path), `config` (`AgentConfig`: the agent's
settings, on the layered loading of `hixl.server.config`). `hixl.client.engine` embeds an
agent in a process through `runtime` (the SDK's one seam into the server), configured by
an `AgentConfig`.
"""
