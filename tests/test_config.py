"""AgentConfig: YAML < environment < flags, and every unusable value refused by key and source."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from hixl.errors import ConfigError, ParamInvalid
from hixl.server.agent.config import AgentConfig, PoolEntry, default_runtime_dir
from hixl.sizes import parse_size
from hixl.types import Perm


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_without_any_source() -> None:
    config = AgentConfig.load(None, {}, {})
    assert config.host == "127.0.0.1"
    assert config.grpc_port == 50161
    assert config.data_port == 0
    assert config.data_unix is True
    assert config.pool == []
    assert config.pool_max_bytes == 1 << 30
    assert config.master == ""
    assert config.socket_mode == 0o660
    assert set(config.allowed_uids) == {os.getuid(), 0}
    assert config.runtime_dir == default_runtime_dir()
    assert config.node_id  # hostname:bootid
    assert config.node_id.split(":")[0]


def test_yaml_file_values(tmp_path: Path) -> None:
    path = write(tmp_path, """
host: 10.0.0.5
grpc_port: 6000
data_port: 6001
data_unix: false
runtime_dir: /tmp/hixl-test-rt
node_id: node-a
pool:
  - {name: kv, size: 64MiB}
  - {name: ro, size: 4096, perms: r}
pool_max_bytes: 2GiB
master: "10.0.0.1:50051"
lease_ttl_ms: 3000
socket_mode: 0600
allowed_uids: [0, 1000]
log_level: debug
log_json: true
""")
    config = AgentConfig.load(path, {}, {})
    assert config == AgentConfig(
        host="10.0.0.5", grpc_port=6000, data_port=6001, data_unix=False,
        runtime_dir="/tmp/hixl-test-rt", node_id="node-a",
        pool=[PoolEntry("kv", 64 << 20, Perm.RW), PoolEntry("ro", 4096, Perm.READ)],
        pool_max_bytes=2 << 30, master="10.0.0.1:50051", lease_ttl_ms=3000,
        socket_mode=0o600, allowed_uids=[0, 1000], log_level="DEBUG", log_json=True)


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, "grpc_port: 6000\ndata_port: 6001\nmaster: file:1\nlog_level: ERROR\n")
    env = {"HIXL_AGENT_GRPC_PORT": "7000", "HIXL_AGENT_MASTER": "env:1",
           "HIXL_AGENT_POOL": "[{name: e, size: 1MiB}]", "HIXL_AGENT_LOG_JSON": "yes",
           "HIXL_AGENT_ALLOWED_UIDS": "0,42", "HIXL_AGENT_SOCKET_MODE": "0640",
           "UNRELATED": "ignored"}
    config = AgentConfig.load(path, {"master": "flag:1", "data_port": "9001"}, env)
    assert config.grpc_port == 7000          # env beats file
    assert config.master == "flag:1"         # flag beats env and file
    assert config.data_port == 9001          # flag (text) beats file
    assert config.log_level == "ERROR"       # file beats default
    assert config.pool == [PoolEntry("e", 1 << 20, Perm.RW)]
    assert config.log_json is True
    assert config.allowed_uids == [0, 42]
    assert config.socket_mode == 0o640


def test_none_override_means_flag_not_given(tmp_path: Path) -> None:
    path = write(tmp_path, "grpc_port: 6000\n")
    assert AgentConfig.load(path, {"grpc_port": None}, {}).grpc_port == 6000


def test_empty_file_is_all_defaults(tmp_path: Path) -> None:
    assert AgentConfig.load(write(tmp_path, ""), {}, {}) == AgentConfig.load(None, {}, {})


def test_describe_covers_every_field() -> None:
    described = AgentConfig.describe()
    assert list(described) == [f.name for f in dataclasses.fields(AgentConfig)]
    for key, entry in described.items():
        assert entry["doc"] and entry["type"] and "default" in entry, key
        assert entry["env"] == "HIXL_AGENT_" + key.upper()


@pytest.mark.parametrize(("text", "expected"), [
    ("4096", 4096), (4096, 4096), ("64MiB", 64 << 20), ("1GiB", 1 << 30), ("1G", 1 << 30),
    ("16MB", 16_000_000), ("2k", 2048), ("2KB", 2000), ("1.5GiB", 3 << 29), (" 8 KiB ", 8192),
    ("1TiB", 1 << 40),
])
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-1", "0", 0, -5, "1.3B", True, 1.5,
                                  "1e9", None])
def test_parse_size_refuses(text: object) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


BAD_FILE_VALUES = [
    ("bogus_key: 1", "bogus_key"),
    ("grpc_port: abc", "grpc_port"),
    ("grpc_port: 70000", "grpc_port"),
    ("grpc_port: -1", "grpc_port"),
    ("grpc_port: true", "grpc_port"),
    ("grpc_port: 1.5", "grpc_port"),
    ("data_port: [1]", "data_port"),
    ("data_unix: maybe", "data_unix"),
    ("data_unix: 1", "data_unix"),
    ("host: 5", "host"),
    ("host: ''", "host"),
    ("runtime_dir: relative/dir", "runtime_dir"),
    ("node_id: ''", "node_id"),
    ("pool: 5", "pool"),
    ("pool: [5]", "pool"),
    ("pool: [{name: a}]", "pool"),
    ("pool: [{size: 1MiB, color: red}]", "pool"),
    ("pool: [{size: lots}]", "pool"),
    ("pool: [{size: 0}]", "pool"),
    ("pool: [{size: 1MiB, perms: x}]", "pool"),
    ("pool: [{size: 1MiB, perms: ''}]", "pool"),
    ("pool: [{name: a, size: 1MiB}, {name: a, size: 1MiB}]", "pool"),
    ("pool_max_bytes: 1 zillion", "pool_max_bytes"),
    ("pool_max_bytes: -4", "pool_max_bytes"),
    ("max_segments: 0", "max_segments"),
    ("max_segments: many", "max_segments"),
    ("max_segments: 1.5", "max_segments"),
    ("master: [a]", "master"),
    ("lease_ttl_ms: 0", "lease_ttl_ms"),
    ("lease_ttl_ms: soon", "lease_ttl_ms"),
    ("socket_mode: rwx", "socket_mode"),
    ("socket_mode: 0o1777", "socket_mode"),
    ("allowed_uids: 0", "allowed_uids"),
    ("allowed_uids: [root]", "allowed_uids"),
    ("allowed_uids: [-1]", "allowed_uids"),
    ("log_level: LOUD", "log_level"),
    ("log_json: 2", "log_json"),
    ("grpc_port: 6000\ndata_port: 6000", "data_port"),
]


@pytest.mark.parametrize(("text", "key"), BAD_FILE_VALUES)
def test_bad_file_value_names_key_and_file(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as info:
        AgentConfig.load(path, {}, {})
    message = str(info.value)
    assert repr(key) in message, message
    assert path in message, message
    assert isinstance(info.value, ParamInvalid)


@pytest.mark.parametrize(("var", "value"), [
    ("HIXL_AGENT_GRPC_PORT", "fifty"),
    ("HIXL_AGENT_DATA_UNIX", "perhaps"),
    ("HIXL_AGENT_POOL", "[{size: nope}]"),
    ("HIXL_AGENT_POOL", "{unclosed"),
    ("HIXL_AGENT_ALLOWED_UIDS", "0,bob"),
    ("HIXL_AGENT_SOCKET_MODE", "999"),
    ("HIXL_AGENT_LEASE_TTL_MS", "-3"),
    ("HIXL_AGENT_NO_SUCH_KEY", "1"),
])
def test_bad_env_value_names_variable(var: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        AgentConfig.load(None, {}, {var: value})
    message = str(info.value)
    assert var in message, message
    assert repr(var[len("HIXL_AGENT_"):].lower()) in message, message


@pytest.mark.parametrize(("key", "value"), [
    ("grpc_port", "x"), ("pool_max_bytes", "big"), ("nonsense", 1), ("log_level", "chatty"),
    ("data_unix", "2"),
])
def test_bad_override_names_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        AgentConfig.load(None, {key: value}, {})
    assert repr(key) in str(info.value) and "command-line" in str(info.value)


@pytest.mark.parametrize(("text", "needle"), [
    ("- just\n- a list\n", "mapping"),
    ("grpc_port: [unclosed\n", "YAML"),
    ("42\n", "mapping"),
])
def test_bad_yaml_document(tmp_path: Path, text: str, needle: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        AgentConfig.load(path, {}, {})
    assert path in str(info.value) and needle in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as info:
        AgentConfig.load(missing, {}, {})
    assert missing in str(info.value)


def test_load_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIXL_AGENT_DATA_PORT", "12345")
    assert AgentConfig.load(None, {}).data_port == 12345


# ---------------------------------------------------------------- runtime dir (issue 15, item 10)


def test_prepare_runtime_dir_creates_it_private_and_refuses_what_others_control(
        tmp_path: Path) -> None:
    from hixl.server.agent.config import prepare_runtime_dir

    fresh = tmp_path / "a" / "run"
    prepare_runtime_dir(str(fresh))
    assert fresh.stat().st_mode & 0o7777 == 0o700
    prepare_runtime_dir(str(fresh))                              # ours: used as it is
    shared = tmp_path / "shared"
    prepare_runtime_dir(str(shared), [os.getuid(), 0, os.getuid() + 4242])
    assert shared.stat().st_mode & 0o7777 == 0o711               # others may reach sockets
    os.chmod(fresh, 0o775)
    with pytest.raises(ConfigError, match=f"{fresh} is writable by group .*chmod go-w"):
        prepare_runtime_dir(str(fresh))
    not_dir = tmp_path / "file"
    not_dir.write_text("")
    with pytest.raises(ConfigError, match=f"{not_dir} is not a directory"):
        prepare_runtime_dir(str(not_dir))


# ---------------------------------------------------------------- allowed_uids (issue 15, item 11)


def test_an_empty_allowed_uids_is_the_agents_uid_and_root_not_everyone(tmp_path: Path) -> None:
    """The fd server admits every uid when its set is empty: an empty list from any
    source (file, environment, flags, or an engine's own AgentConfig) resolves to the
    default, the agent's uid and root, and --describe-config says so."""
    default = sorted({os.getuid(), 0})
    assert AgentConfig.load(write(tmp_path, "allowed_uids: []\n"), {}, {}).allowed_uids == default
    assert AgentConfig.load(None, {}, {"HIXL_AGENT_ALLOWED_UIDS": ""}).allowed_uids == default
    assert AgentConfig.load(None, {"allowed_uids": []}, {}).allowed_uids == default
    assert AgentConfig(allowed_uids=[]).allowed_uids == default
    assert AgentConfig.load(None, {"allowed_uids": [42]}, {}).allowed_uids == [42]  # exactly
    doc = AgentConfig.describe()["allowed_uids"]["doc"]
    assert "empty list: the agent's uid and root" in doc and "exactly" in doc
