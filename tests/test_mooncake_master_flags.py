"""hixl-master takes mooncake_master's command line (issue 17, item 3): gflags spellings,
Mooncake's durations and flags, unused ones accepted with a warning, misspelt ones refused
naming the closest real flag. Parsing is checked on `parse_config` (the function
hixl-master runs), serving on real hixl-master processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import waiting
from etcd_cluster import start_cluster_or_skip
from test_master_process import READY_PREFIX, START_DEADLINE_S, Master

from hixl.client.store_client import MasterClient
from hixl.errors import HixlError
from hixl.server.master.master import MasterConfig, StoreConfig, etcd_settings, parse_config
from hixl.server.mooncake_flags import UNUSED

#: one setting in every spelling gflags (and argparse) takes
SPELLINGS = [
    ["-client_ttl=20"], ["--client_ttl=20"], ["-client_ttl", "20"], ["--client_ttl", "20"],
    ["--client-ttl=20"], ["-client-ttl", "20"],
]


@pytest.mark.parametrize("flags", SPELLINGS, ids=[" ".join(f) for f in SPELLINGS])
def test_every_gflags_spelling_sets_the_flag(flags: list[str]) -> None:
    assert parse_config(flags, env={}).store.client_ttl_s == 20


@pytest.mark.parametrize("flags", [
    ["--fast_port=-1"], ["--fast-port", "-1"], ["-fast_port", "-1"],
    ["--max_lease_ttl_ms=9000", "--fast_port=-1"],
])
def test_hixl_flags_take_underscores_and_dashes(flags: list[str]) -> None:
    assert parse_config(flags, env={}).fast_port == -1


@pytest.mark.parametrize(("flags", "value"), [
    (["--enable_metric_reporting"], True),
    (["-enable_metric_reporting"], True),
    (["--enable_metric_reporting=true"], True),
    (["--enable_metric_reporting=t"], True),
    (["--enable_metric_reporting=1"], True),
    (["--enable_metric_reporting=YES"], True),
    (["--enable_metric_reporting=false"], False),
    (["--enable_metric_reporting=0"], False),
    (["--enable_metric_reporting", "--noenable_metric_reporting"], False),
    (["-noenable_metric_reporting"], False),
    (["--enable-metric-reporting", "--no-enable-metric-reporting"], False),
])
def test_booleans_as_gflags_writes_them(flags: list[str], value: bool) -> None:
    assert parse_config(flags, env={}).enable_metric_reporting is value


@pytest.mark.parametrize("flags", [["--no-persist"], ["--nopersist"], ["--persist=false"],
                                   ["-persist=f"]])
def test_persist_off_in_every_spelling(flags: list[str]) -> None:
    assert parse_config(flags, env={}).store.persist is False


def test_a_flag_overrides_a_true_from_the_environment() -> None:
    env = {"HIXL_MASTER_LOG_JSON": "true"}
    assert parse_config([], env=env).log_json is True
    assert parse_config(["--log_json=false"], env=env).log_json is False
    assert parse_config(["--nolog_json"], env=env).log_json is False


@pytest.mark.parametrize(("text", "ms"), [
    ("4000", 4000), ("500ms", 500), ("10s", 10_000), ("5m", 300_000), ("1h", 3_600_000),
    ("1.5s", 1500),
])
def test_durations_where_mooncake_takes_them(text: str, ms: int) -> None:
    config = parse_config([f"--default_kv_lease_ttl={text}",
                           f"-default_kv_soft_pin_ttl={text}"], env={})
    assert config.store.default_kv_lease_ttl_ms == ms
    assert config.store.default_kv_soft_pin_ttl_ms == ms


def test_glog_verbosity_is_debug_logging() -> None:
    assert parse_config(["-v=1"], env={}).log_level == "DEBUG"
    assert parse_config(["--v", "2"], env={}).log_level == "DEBUG"
    assert parse_config(["-v=0"], env={}).log_level == "INFO"


def test_a_launch_scripts_command_line_is_recorded_in_the_config() -> None:
    config = parse_config([
        "--rpc_port=50061", "--rpc_address=10.0.0.5", "--max_threads=64",
        "--metrics_port=9003", "--enable_metric_reporting=true",
        "--default_kv_lease_ttl=10s", "--default_kv_soft_pin_ttl=30m",
        "--eviction_ratio=0.1", "--eviction_high_watermark_ratio=0.9", "--client_ttl=30",
        "--allocation_strategy=free_ratio_first", "--enable_http_metadata_server=true",
        "--http_metadata_server_port=8081", "--http_metadata_server_host=10.0.0.6",
        "--cluster_id=prod", "--enable_offload=false", "-v=1", "--metrics_host=10.0.0.7",
        "--rpc_interface=eth1"], env={})
    assert config == MasterConfig(
        host="10.0.0.5", port=50061, metrics_port=9003, enable_metric_reporting=True,
        metrics_host="10.0.0.7", rpc_interface="eth1",
        log_level="DEBUG", enable_http_metadata_server=True, http_metadata_server_port=8081,
        http_metadata_server_host="10.0.0.6",
        store=StoreConfig(default_kv_lease_ttl_ms=10_000,
                          default_kv_soft_pin_ttl_ms=1_800_000, eviction_ratio=0.1,
                          eviction_high_watermark_ratio=0.9, client_ttl_s=30,
                          allocation_strategy="free_ratio_first", cluster_id="prod"))


def test_ha_flags_become_hixls_etcd_settings() -> None:
    config = parse_config(["--enable_ha=true", "--etcd_endpoints=10.0.0.1:2379;10.0.0.2:2379",
                           "--cluster_id=prod"], env={})
    etcd = etcd_settings(config.store)
    assert etcd is not None
    assert etcd.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert etcd.prefix == "/hixl/prod/"
    via_connstring = parse_config(["--enable_ha", "--ha_backend_type=etcd",
                                   "--ha_backend_connstring=10.0.0.3:2379"], env={})
    etcd = etcd_settings(via_connstring.store)
    assert etcd is not None and etcd.endpoints == ("10.0.0.3:2379",)
    assert etcd.prefix == "/hixl/default/"


def test_config_path_file_sets_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    path = tmp_path / "master.json"
    path.write_text(json.dumps({"rpc_port": 50071, "client_ttl": 15, "enable_ha": False,
                                "enable_metric_reporting": True, "max_threads": 8,
                                "default_kv_lease_ttl": "2s"}))
    config = parse_config([f"--config_path={path}", "--client_ttl=25"], env={})
    assert config.port == 50071
    assert config.store.client_ttl_s == 25
    assert config.store.default_kv_lease_ttl_ms == 2000
    assert config.enable_metric_reporting is True


def test_flagfile_lines_are_flags(tmp_path: Path) -> None:
    path = tmp_path / "flags"
    path.write_text("# a launch script's flags\n--rpc_port=50072\n\n-eviction_ratio=0.2\n")
    config = parse_config([f"--flagfile={path}"], env={})
    assert config.port == 50072 and config.store.eviction_ratio == 0.2


def _refused(*flags: str) -> str:
    result = subprocess.run([sys.executable, "-m", "hixl.server.master.master", *flags],
                            capture_output=True, text=True, timeout=START_DEADLINE_S)
    assert result.returncode == 2, result.stderr
    assert READY_PREFIX not in result.stdout
    assert "Traceback" not in result.stderr
    return result.stderr


@pytest.mark.parametrize(("flags", "said"), [
    (["--rpc_prot=50051"], "unknown flag --rpc_prot=50051; did you mean --rpc_port?"),
    (["-eviction_ration=0.1"], "did you mean --eviction_ratio?"),
    (["--enable_metrics_reporting"], "did you mean --enable_metric_reporting?"),
    (["--fast_prot", "0"], "did you mean --fast_port?"),
    (["--zzzz"], "unknown flag --zzzz (hixl-master --help lists the flags)"),
    (["--enable_ha=maybe"], "expected true or false"),
    (["--enable_cxl=maybe"], "--enable_cxl=maybe: 'maybe' is not a valid bool value"),
    (["--max_threads=lots"], "--max_threads=lots: 'lots' is not a valid int value"),
    (["--default_kv_lease_ttl=5q"], "a duration like 500ms, 10s, 5m, 1h"),
    (["--default_kv_lease_ttl=0s"], "must be above 0 ms"),
    (["--rpc_port"], "flag --rpc_port needs a value"),
    (["--ha_backend_type=redis"], "runs on etcd only; got 'redis'"),
    (["--enable_ha"], "enable_ha: hixl-master's high availability runs on etcd: give "
                      "etcd_endpoints"),
    (["--cluster_id=a", "--etcd_prefix=/hixl/b/", "--etcd_endpoints=127.0.0.1:1"],
     "give one"),
    (["-v=loud"], "glog verbosity must be an integer"),
    (["--config_path=/nonexistent/master.json"], "--config_path /nonexistent/master.json: "
                                                 "cannot read it"),
])
def test_bad_command_lines_exit_2_naming_the_flag(flags: list[str], said: str) -> None:
    assert said in _refused(*flags)


def test_a_config_path_key_that_is_no_flag_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "master.json"
    path.write_text(json.dumps({"rpc_prot": 1}))
    assert "unknown flag --rpc_prot=1; did you mean --rpc_port?" in _refused(
        f"--config_path={path}")


def test_unused_flags_are_known_mooncake_flags_not_hixl_ones() -> None:
    from hixl.server.master.master import build_parser
    from hixl.server.mooncake_flags import _flag_table

    assert not set(UNUSED) & set(_flag_table(build_parser()))


def test_mooncake_launch_line_serves_and_warns_once_per_unused_flag() -> None:
    process = Master("--rpc_address=127.0.0.1", "--rpc_port=0", "--max_threads=64",
                     "--enable_offload=false", "--memory_allocator=offset",
                     "--default_kv_lease_ttl=10s", "--no-persist", "-v=0",
                     "--rpc_enable_tcp_no_delay", "--logtostderr")
    try:
        target = process.wait_ready()
        assert target.startswith("127.0.0.1:")
        assert process.stop() == 0
    finally:
        process.kill()
    process.proc.wait()
    stderr = "".join(line for line in process.stderr if line)
    for flag in ("max_threads", "enable_offload", "memory_allocator",
                 "rpc_enable_tcp_no_delay", "logtostderr"):
        assert stderr.count(f"--{flag}: accepted, not used") == 1, stderr
    assert stderr.count("accepted, not used") == 5, stderr  # the honoured ones are not


def _stderr_of(process: Master) -> str:
    return "".join(line for line in list(process.stderr) if line)


def test_rpc_interface_binds_its_address_and_a_missing_one_is_refused() -> None:
    process = Master("--rpc_interface=lo", "--rpc_port=0", "--no-persist")
    try:
        assert process.wait_ready().startswith("127.0.0.1:")
        assert process.stop() == 0
    finally:
        process.kill()
    said = _refused("--rpc_interface=no-such-if0", "--rpc_port=0", "--no-persist")
    assert "rpc_interface 'no-such-if0': no IPv4 address on such an interface" in said
    assert "lo" in said


def test_metric_reporting_logs_a_summary() -> None:
    process = Master("--rpc_port=0", "--no-persist", "--enable_metric_reporting")
    try:
        process.wait_ready()
        waiting.wait_until(lambda: "Master Metrics: Mem Storage:" in _stderr_of(process),
                           "a metric report in the log", START_DEADLINE_S)
    finally:
        process.kill()


def test_mooncake_ha_flags_run_a_leader_on_etcd() -> None:
    """Two masters started with mooncake_master's HA flags: one leads (its keys under
    /hixl/<cluster_id>/, serving, /health ready), the other stands by (/health 503,
    naming the leader)."""
    from test_mooncake_master_http import free_port, http

    from hixl.etcd import EtcdClient

    cluster = start_cluster_or_skip(1)
    endpoint = cluster.endpoints[0]
    ports = [free_port(), free_port()]
    masters = [Master("--rpc_address=127.0.0.1", "--rpc_port=0", "--enable_ha=true",
                      "--ha_backend_type=etcd", f"--etcd_endpoints={endpoint};",
                      "--cluster_id=flags-test", f"--metrics_port={port}")
               for port in ports]
    try:
        targets = [master.wait_ready() for master in masters]
        with EtcdClient({"endpoints": endpoint, "prefix": "/hixl/flags-test/"}) as etcd:
            waiting.wait_until(lambda: etcd.get_prefix("").items,
                               "the masters' keys under /hixl/flags-test/", START_DEADLINE_S)

        def health(port: int) -> tuple[int, dict[str, object]]:
            status, _, body = http("GET", f"http://127.0.0.1:{port}/health")
            return status, json.loads(body)

        def roles() -> list[object]:
            return sorted(health(port)[1]["role"] for port in ports)  # type: ignore[type-var]

        waiting.wait_until(lambda: roles() == ["leader", "standby"], "one master elected",
                           START_DEADLINE_S)
        first = 0 if health(ports[0])[0] == 200 else 1
        leader, standby = targets[first], ports[1 - first]
        assert health(ports[first]) == (200, {"status": "ok", "role": "leader",
                                              "ha_state": "serving", "service_ready": True,
                                              "leader_address": leader,
                                              "view_version": None})
        waiting.wait_until(lambda: health(standby)[1]["leader_address"] == leader,
                           "the standby naming the leader", START_DEADLINE_S)
        status, seen = health(standby)
        assert status == 503 and seen["ha_state"] == "standby"
        assert seen["service_ready"] is False
        with MasterClient(leader, timeout=START_DEADLINE_S) as client:
            assert _answers(client)
        for master in masters:
            assert master.stop() == 0
    finally:
        for master in masters:
            master.kill()
        cluster.close()


def _answers(client: MasterClient) -> bool:
    try:
        client.heartbeat()
    except HixlError:
        return False
    return True


# ------------------------------------------------------------------ --eviction-grace-ms

@pytest.mark.parametrize("flags", [["--eviction_grace_ms=250"], ["--eviction-grace-ms", "250"],
                                   ["-eviction_grace_ms", "250"], ["-eviction-grace-ms=250"]])
def test_eviction_grace_in_every_spelling_reaches_the_store_options(flags: list[str]) -> None:
    config = parse_config(flags, env={})
    assert config.store.eviction_grace_ms == 250
    assert config.store.options().eviction_grace_ms == 250   # what ObjectStore is built with


def test_eviction_grace_from_yaml_and_the_environment(tmp_path: Path) -> None:
    assert parse_config([], env={}).store.options().eviction_grace_ms == 1000
    path = tmp_path / "master.yaml"
    path.write_text("eviction_grace_ms: 4000\n")
    assert parse_config([f"--config={path}"], env={}).store.eviction_grace_ms == 4000
    env = {"HIXL_MASTER_EVICTION_GRACE_MS": "5000"}
    assert parse_config([f"--config={path}"], env=env).store.eviction_grace_ms == 5000
    assert parse_config([f"--config={path}", "--eviction_grace_ms=6000"],
                        env=env).store.eviction_grace_ms == 6000
    assert MasterConfig.describe()["eviction_grace_ms"]["env"] == "HIXL_MASTER_EVICTION_GRACE_MS"


@pytest.mark.parametrize("value", ["0", "-5", "1s", "soon"])
def test_a_bad_eviction_grace_is_refused_by_name(value: str) -> None:
    said = _refused(f"--eviction_grace_ms={value}", "--rpc_port=0", "--no-persist")
    assert "--eviction-grace-ms" in said


@pytest.mark.parametrize("grace_ms", [1, 600_000])
def test_a_running_master_holds_fresh_puts_for_the_grace_it_was_given(grace_ms: int) -> None:
    """A real hixl-master and store client: the pool is filled, then a read lease of
    1.5 s (the store's own clock: more than the default 1 s grace) runs out, and four more
    values are put. Under a 1 ms grace they evict the oldest values; under a 10-minute
    one they run out of room (NO_AVAILABLE_HANDLE) and every acknowledged value is kept."""
    from hixl.client.mooncake import MooncakeDistributedStore
    from hixl.store_codes import ErrorCode
    from hixl.tools.daemons import MasterProcess

    mib = 1 << 20
    value = b"g" * mib
    with MasterProcess(extra=[f"--eviction_grace_ms={grace_ms}", "-default_kv_lease_ttl=1500",
                              "--eviction_high_watermark_ratio=1.0"]) as master:
        store = MooncakeDistributedStore(setup_timeout=START_DEADLINE_S)
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 8 * mib + mib // 2, 16 * mib, "tcp",
                           "", master.target) == 0, store.last_error
        try:
            with MasterClient(master.target, timeout=START_DEADLINE_S) as check:
                assert store.put("clock", b"c" * 4096) == 0
                kept: list[str] = []
                while True:
                    stats = check.stats()
                    if stats["capacity"] - stats["used"] < mib:
                        break
                    assert len(kept) < 16, stats
                    assert store.put(f"v{len(kept)}", value) == 0, store.last_error
                    kept.append(f"v{len(kept)}")
                assert store.get("clock") == b"c" * 4096        # a read lease of 1.5 s
                waiting.wait_until(lambda: store.remove("clock") == 0,
                                   "the clock value's read lease ends", START_DEADLINE_S)
                late = [store.put(f"late{i}", value) for i in range(4)]
                sizes = [store.get_size(key) for key in kept]
                evicted = check.stats()["evicted"]
                if grace_ms == 1:
                    assert late == [0] * 4, store.last_error
                    assert evicted >= 1 and sizes[0] == ErrorCode.OBJECT_NOT_FOUND  # oldest
                    assert store.get("late3") == value
                else:
                    assert late[-1] == ErrorCode.NO_AVAILABLE_HANDLE, late
                    assert evicted == 0 and sizes == [mib] * len(kept)  # nothing evicted
        finally:
            store.close()
