"""Console entry points: `hixl-agent` (the per-node daemon) and `hixl-master`.

hixl-agent prints exactly one line to stdout once it serves — "hixl-agent serving
engine=HOST:PORT data=... unix=... fd=... epoch=... registry=..." (registry: published,
not-published (the reason follows as a WARNING on stderr), pending, embedded or none;
with a master, once the first publish was tried) — so scripts and tests can wait for it; everything else goes to the log (stderr). Exit status: 0 after a clean SIGTERM/SIGINT
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

#: flags that are no config key: they say what to read or what to do instead of serving
COMMAND_ONLY = ("config", "describe_config")
#: other names of a key's flag: hixl-master's spelling, where the agent's differs
FLAG_ALIASES = {"grpc_port": ("--port",)}
#: how long the ready line waits for the first publish to the master (its outcome is on it)
FIRST_PUBLISH_WAIT_S = 5.0


def build_agent_parser() -> argparse.ArgumentParser:
    """One flag per config key (`--grpc-port` for grpc_port; translate() takes
    `--grpc_port` and gflags' spellings too), derived from AgentConfig.KEYS, so a key
    added later is a flag, a YAML key and a HIXL_AGENT_* variable at once."""
    from hixl import __version__
    from hixl.server.agent.config import ENV_PREFIX, AgentConfig
    from hixl.server.mooncake_flags import BoolFlag

    parser = argparse.ArgumentParser(
        prog="hixl-agent", allow_abbrev=False,
        description="hixl per-node agent: owns the node's DRAM pool, publishes its segments "
                    "and serves one-sided reads/writes into them. Settings come from "
                    f"--config FILE, then {ENV_PREFIX}<KEY> environment variables, then "
                    "flags; every flag is a YAML key and a variable (--grpc-port: "
                    f"grpc_port, {ENV_PREFIX}GRPC_PORT).",
        epilog="Flags take dashes or underscores (--grpc-port, --grpc_port) and gflags' "
               "spellings: -flag=value, --flag value; booleans as --flag, --flag=false or "
               "--no-flag; --flagfile=FILE (one flag per line).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--config", metavar="FILE", help="YAML config file")
    parser.add_argument("--describe-config", action=BoolFlag, default=None,
                        help="print every config key (type, default, meaning) as JSON and exit")
    for key, spec in AgentConfig.KEYS.items():
        flag = "--" + key.replace("_", "-")
        if spec["type"] == "bool":
            parser.add_argument(flag, dest=key, action=BoolFlag, default=None,
                                help=spec["doc"])
        else:
            parser.add_argument(flag, *FLAG_ALIASES.get(key, ()), dest=key,
                                metavar=key.upper(), help=spec["doc"])
    return parser


def parse_agent_argv(argv: list[str]) -> argparse.Namespace:
    """`argv` in any spelling translate() takes; a flag that cannot be taken exits(2)
    naming it (and the closest real one), as argparse does."""
    from hixl.server.mooncake_flags import FlagError, translate

    parser = build_agent_parser()
    try:
        translation = translate(parser, argv, mooncake=False)
    except FlagError as exc:
        parser.error(str(exc))
    return parser.parse_args(translation.argv)


def agent_main(argv: list[str] | None = None) -> int:
    """The hixl-agent console script."""
    from hixl.server.agent.config import AgentConfig, prepare_runtime_dir

    try:
        args = parse_agent_argv(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse printed the message (or --help, --version)
        return exc.code if isinstance(exc.code, int) else 2
    if args.describe_config:
        print(json.dumps(AgentConfig.describe(), indent=2))
        return 0
    overrides = {key: value for key, value in vars(args).items()
                 if key not in COMMAND_ONLY and value is not None}
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

    from hixl.server.agent.runtime import AgentServer

    def announce(server: AgentServer) -> None:
        ends = server.endpoints
        assert ends is not None and server.agent is not None
        publication = server.publication(FIRST_PUBLISH_WAIT_S)
        registry = publication.split(":", 1)[0].replace(" ", "-")
        print(f"hixl-agent serving engine={server.engine_name} data={ends.data_tcp} "
              f"unix={ends.data_unix or '-'} fd={ends.fd_socket} epoch={server.agent.epoch} "
              f"registry={registry}", flush=True)
        if publication.startswith("not published"):
            logging.getLogger("hixl.agent").warning(
                "serving, but not published to master %s: %s; peers that look this agent "
                "up in the registry cannot find it until it is (retrying; `hixl status "
                "--agent %s` shows how it stands; check key 'master' and the cluster token)",
                config.master, publication.removeprefix("not published: "),
                server.engine_name)

    try:
        AgentServer(config, cluster_token=token).serve_forever(on_ready=announce)
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were installed
        print("hixl-agent: interrupted during start-up", file=sys.stderr)
        return 130
    except HixlError as exc:
        logging.getLogger("hixl.agent").error("cannot start: %s", exc)
        print(f"hixl-agent: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def master_main(argv: list[str] | None = None) -> int:
    """The hixl-master console script (implemented in hixl.server.master.master)."""
    try:
        from hixl.server.master.master import run_master

        return run_master(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:  # Ctrl-C before its signal handlers are installed
        print("hixl-master: interrupted during start-up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(agent_main())
