"""Every hixl-agent setting through every channel (issue 20, items 3 and 4).

A newcomer reads "every flag is a YAML key and a HIXL_AGENT_* variable" in --help: for each
option of the real parser, the same value given as a flag (both spellings), as a YAML key
and as an environment variable loads the same configuration. A misspelt flag is answered
with the closest real one; the processes started here are real hixl-agent daemons.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import READY_PREFIX, clean_env, parse_ready, start_agent

from hixl.client.agent_client import AgentClient
from hixl.server.agent.config import ENV_PREFIX, AgentConfig, PoolEntry
from hixl.server.main import COMMAND_ONLY, build_agent_parser, parse_agent_argv
from hixl.types import Perm

#: a value (as text, the way a flag and a variable carry it) each key can take that is
#: not its default, so that loading it shows the channel worked
SAMPLES: dict[str, str] = {
    "host": "127.0.0.2",
    "grpc_port": "50999",
    "data_port": "50998",
    "data_unix": "false",
    "data_handshake_timeout_s": "2.5",
    "data_preauth_connections": "7",
    "runtime_dir": "/tmp/hixl-sample-run",
    "state_dir": "/tmp/hixl-sample-state",
    "node_id": "node-sample",
    "pool": "[{name: kv, size: 1MiB, perms: r}]",
    "pool_size": "2MiB",
    "pool_max_bytes": "3MiB",
    "max_segments": "17",
    "master": "10.0.0.9:50051",
    "lease_ttl_ms": "4321",
    "socket_mode": "0640",
    "allowed_uids": "[0, 4242]",
    "log_level": "DEBUG",
    "log_json": "true",
    "cluster_token_file": "/tmp/hixl-sample.token",
    "metrics_port": "9999",
    "tls_cert_file": "/tmp/hixl-sample.crt",
    "tls_key_file": "/tmp/hixl-sample.key",
    "tls_ca_file": "/tmp/hixl-sample-ca.crt",
    "tls_client_auth": "true",
}


def _option_dests() -> list[str]:
    return [action.dest for action in build_agent_parser()._actions
            if action.option_strings and action.dest not in ("help", "version", *COMMAND_ONLY)]


def test_every_config_key_is_a_flag_and_every_flag_a_key() -> None:
    dests = _option_dests()
    assert dests == list(AgentConfig.KEYS)
    assert set(SAMPLES) == set(dests), "give each new key a sample value above"


def _via_flags(key: str, value: str, spelling: str) -> AgentConfig:
    args = parse_agent_argv([f"--{spelling}={value}"])
    overrides = {k: v for k, v in vars(args).items() if k not in COMMAND_ONLY and v is not None}
    assert set(overrides) == {key}
    return AgentConfig.load(None, overrides, env={})


@pytest.mark.parametrize("key", list(SAMPLES))
def test_each_key_means_the_same_as_flag_yaml_and_environment(key: str,
                                                              tmp_path: Path) -> None:
    value = SAMPLES[key]
    default = getattr(AgentConfig.load(None, {}, env={}), key)
    dashed = _via_flags(key, value, key.replace("_", "-"))
    underscored = _via_flags(key, value, key)
    from_env = AgentConfig.load(None, {}, env={ENV_PREFIX + key.upper(): value})
    config_file = tmp_path / "agent.yaml"
    config_file.write_text(yaml.safe_dump({key: yaml.safe_load(value)}), encoding="utf-8")
    from_yaml = AgentConfig.load(str(config_file), {}, env={})
    got = getattr(dashed, key)
    assert got != default, f"sample of {key} is its default: the test would prove nothing"
    assert getattr(underscored, key) == getattr(from_env, key) == getattr(from_yaml, key) == got
    # the flags' own doc says which variable: --describe-config names it
    assert AgentConfig.describe()[key]["env"] == ENV_PREFIX + key.upper()


def test_pool_size_shorthand_from_every_channel_builds_one_pool_segment(tmp_path: Path) -> None:
    expected = [PoolEntry("pool", 2 << 20, Perm.RW)]
    assert AgentConfig.load(None, {}, env={"HIXL_AGENT_POOL_SIZE": "2MiB"}).pool == expected
    config_file = tmp_path / "agent.yaml"
    config_file.write_text("pool: [{name: kv, size: 1MiB}]\npool_size: 2MiB\n", encoding="utf-8")
    assert AgentConfig.load(str(config_file), {}, env={}).pool == expected


def test_grpc_port_takes_the_masters_spelling_too() -> None:
    assert parse_agent_argv(["--port", "50999"]).grpc_port == "50999"
    assert parse_agent_argv(["-grpc_port=50998"]).grpc_port == "50998"


def test_booleans_take_gflags_forms() -> None:
    assert parse_agent_argv(["--no-data-unix"]).data_unix is False
    assert parse_agent_argv(["--nodata_unix"]).data_unix is False
    assert parse_agent_argv(["-data_unix=false"]).data_unix is False
    assert parse_agent_argv(["--log-json"]).log_json is True


def _run_agent(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hixl.server.main", *args],
                          capture_output=True, text=True, timeout=60, env=clean_env(env))


def test_misspelt_flag_is_answered_with_the_closest_real_one() -> None:
    result = _run_agent(["--pool_sise", "1GiB"])
    assert result.returncode == 2
    assert "unknown flag --pool_sise; did you mean --pool_size?" in result.stderr
    result = _run_agent(["--grpc-prot=0"])
    assert result.returncode == 2 and "did you mean --grpc-port?" in result.stderr


def test_version_flag() -> None:
    from hixl import __version__

    result = _run_agent(["--version"])
    assert (result.returncode, result.stdout.strip()) == (0, f"hixl-agent {__version__}")


def test_agent_takes_its_pool_size_from_the_environment(tmp_path: Path) -> None:
    """The newcomer's step: HIXL_AGENT_POOL_SIZE=2MiB (failed with "unknown key
    'pool_size'") gives a real agent its pool."""
    config_file = tmp_path / "agent.yaml"
    config_file.write_text(yaml.safe_dump({
        "host": "127.0.0.1", "grpc_port": 0, "data_port": 0,
        "runtime_dir": str(tmp_path / "run"), "state_dir": str(tmp_path / "state")}),
        encoding="utf-8")
    log_path = tmp_path / "agent.log"
    agent, line = start_agent(str(config_file), "--grpc_port=0", log_path=str(log_path),
                              env={"HIXL_AGENT_POOL_SIZE": "2MiB"}, timeout=30.0)
    proc = agent.proc
    try:
        assert line.startswith(READY_PREFIX)
        with AgentClient(parse_ready(line)["engine"], timeout=10.0) as client:
            info = client.handshake("pytest")
        assert [(s.name, s.length, s.perms) for s in info.segments] == [
            ("pool", 2 << 20, Perm.RW)]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
