"""hixl.tools: the command-line tools (`hixl` and its subcommands), the benches, the soak
run and the scenarios (KV offload, MoE dispatch) built on the SDK.

Tools use the client SDK and the core; they never import the server: daemons are
processes started by module name (hixl.processes). Nothing in hixl.client or the core
imports this package (tests/test_layout.py).
"""
