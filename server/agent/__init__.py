"""hixl-agent: the per-node daemon that owns host-memory segments and serves them.

`agent` (the segments, no networking), `runtime` (`AgentServer`: the daemon, and the
registry publisher), `grpc_service` (the Agent service), `fd_server` (fds to same-node
peers), `data_server` (the socket data path). `hixl.client.engine` embeds an agent in a
process through `runtime` alone (the SDK's one seam into the server).
"""
