"""Console entry points: `hixl-agent` (the per-node daemon) and `hixl-master`.

hixl-agent prints exactly one line to stdout once it serves — "hixl-agent serving
engine=HOST:PORT data=... unix=... fd=... epoch=..." — so scripts and tests can wait for
it; everything else goes to the log (stderr). Exit status: 0 after a clean SIGTERM/SIGINT
shutdown, 2 for a configuration error, 1 when it cannot start.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from hixl.auth import load_token
from hixl.errors import ConfigError, HixlError
from hixl.logs import setup_logging


def build_agent_parser() -> argparse.ArgumentParser:
    from hixl.server.config import AgentConfig

    keys = AgentConfig.describe()
    parser = argparse.ArgumentParser(
        prog="hixl-agent", allow_abbrev=False,
        description="hixl per-node agent: owns the node's DRAM pool, publishes its segments "
                    "and serves one-sided reads/writes into them. Settings come from "
                    "--config FILE, then HIXL_AGENT_<KEY> environment variables, then flags.")
    parser.add_argument("--config", metavar="FILE", help="YAML config file")
    for key in ("host", "grpc_port", "data_port", "runtime_dir", "node_id", "master",
                "pool_max_bytes", "max_segments", "lease_ttl_ms", "log_level", "cluster_token_file",
                "metrics_port", "tls_cert_file", "tls_key_file", "tls_ca_file"):
        parser.add_argument("--" + key.replace("_", "-"), dest=key, metavar=key.upper(),
                            help=keys[key]["doc"])
    parser.add_argument("--pool-size", metavar="SIZE",
                        help="shorthand for one read-write pool segment named 'pool' of SIZE "
                             "(e.g. 4GiB); replaces any 'pool' list from file or environment")
    parser.add_argument("--no-data-unix", dest="data_unix", action="store_const", const=False,
                        help="do not serve the data path on a unix socket")
    parser.add_argument("--log-json", dest="log_json", action="store_const", const=True,
                        help="log JSON lines")
    parser.add_argument("--tls-client-auth", dest="tls_client_auth", action="store_const",
                        const=True, help=keys["tls_client_auth"]["doc"])
    parser.add_argument("--describe-config", action="store_true",
                        help="print every config key (type, default, meaning) as JSON and exit")
    return parser


def agent_main(argv: list[str] | None = None) -> int:
    """The hixl-agent console script."""
    from hixl.server.config import AgentConfig, prepare_runtime_dir

    parser = build_agent_parser()
    args = parser.parse_args(argv)
    if args.describe_config:
        print(json.dumps(AgentConfig.describe(), indent=2))
        return 0
    overrides = {key: value for key, value in vars(args).items()
                 if key not in ("config", "pool_size", "describe_config") and value is not None}
    if args.pool_size is not None:
        overrides["pool"] = [{"name": "pool", "size": args.pool_size, "perms": "rw"}]
    try:
        config = AgentConfig.load(args.config, overrides)
        # read here, so that a missing or empty token file is a config error (exit 2)
        token = load_token(config.cluster_token_file or None)
        config.server_tls()  # likewise an unusable TLS file (read again by the server)
        config.client_tls()
        # before any socket is made in it: ours, and nobody else may write in it
        prepare_runtime_dir(config.runtime_dir, config.allowed_uids)
    except ConfigError as exc:
        print(f"hixl-agent: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level_number, config.log_json)

    from hixl.server.runtime import AgentServer

    def announce(server: AgentServer) -> None:
        ends = server.endpoints
        assert ends is not None and server.agent is not None
        print(f"hixl-agent serving engine={server.engine_name} data={ends.data_tcp} "
              f"unix={ends.data_unix or '-'} fd={ends.fd_socket} epoch={server.agent.epoch}",
              flush=True)

    try:
        AgentServer(config, cluster_token=token).serve_forever(on_ready=announce)
    except HixlError as exc:
        logging.getLogger("hixl.agent").error("cannot start: %s", exc)
        print(f"hixl-agent: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def master_main(argv: list[str] | None = None) -> int:
    """The hixl-master console script (implemented in hixl.server.master)."""
    from hixl.server.master import run_master

    return run_master(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(agent_main())
