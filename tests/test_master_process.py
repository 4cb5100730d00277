"""hixl-master as a real process, driven over real gRPC by RegistryClient.

Deadlines here only prove "does not hang"; nothing asserts how long anything took.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from conftest import temporary_log

from hixl import wire
from hixl.errors import HixlError, NotConnected, ParamInvalid, PeerUnavailable, StaleEpoch
from hixl.processes import DaemonProcess, free_port
from hixl.registry_client import RegistryClient
from hixl.server.master.master import MasterConfig, StoreConfig, parse_config
from hixl.store_rpc import METHODS
from hixl.types import MemType, Perm, SegmentInfo

START_DEADLINE_S = 30
EVENT_DEADLINE_S = 10
READY_PREFIX = "hixl-master serving "


def seg(engine: str, segment_id: int, base: int, length: int = 4096, epoch: int = 1) -> SegmentInfo:
    return SegmentInfo(segment_id=segment_id, engine=engine, node_id="node-1", base=base,
                       length=length, mem_type=MemType.MEM_HOST, perms=Perm.RW, epoch=epoch,
                       shareable=True, name=f"{engine}-{segment_id}")


class Master(DaemonProcess):
    """A hixl-master subprocess (hixl.processes drains its output); its stderr goes to a
    temporary log file (`stderr`: its lines so far), removed once the object is gone."""

    def __init__(self, *flags: str) -> None:
        super().__init__([sys.executable, "-m", "hixl.server.master.master", *flags],
                         name="hixl-master", ready=READY_PREFIX,
                         log_path=temporary_log(self, "hixl-master-"))
        self.target = ""

    @property
    def stderr(self) -> list[str]:
        return self.log().splitlines(keepends=True)

    def wait_ready(self, timeout: float = START_DEADLINE_S) -> str:
        self.target = super().wait_ready(timeout)[len(READY_PREFIX):].strip()
        return self.target

    def stop(self, signum: int = signal.SIGTERM) -> int:  # type: ignore[override]
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        return self.proc.wait(timeout=START_DEADLINE_S)


@pytest.fixture
def master() -> Iterator[Master]:
    process = Master("--port", "0", "--max-lease-ttl-ms", "30000")
    try:
        process.wait_ready()
        yield process
    finally:
        process.kill()


@pytest.fixture
def client(master: Master) -> Iterator[RegistryClient]:
    with RegistryClient(master.target, timeout=EVENT_DEADLINE_S) as registry_client:
        yield registry_client


class Watcher:
    """Consumes RegistryClient.watch() on a thread; events (or the final error) go to a queue."""

    def __init__(self, target: str) -> None:
        self.client = RegistryClient(target, timeout=EVENT_DEADLINE_S)
        self.events: queue.Queue[tuple[str, int, list[SegmentInfo]] | Exception] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for event in self.client.watch():
                self.events.put(event)
        except Exception as exc:  # noqa: BLE001 - handed to the test to check
            self.events.put(exc)

    def next(self) -> tuple[str, int, list[SegmentInfo]]:
        item = self.events.get(timeout=EVENT_DEADLINE_S)
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        self.client.close()
        self.thread.join(timeout=EVENT_DEADLINE_S)


# ---------------------------------------------------------------- service


def test_publish_query_keepalive_unpublish(client: RegistryClient) -> None:
    table = [seg("10.0.0.1:100", 2, 0x20000, length=8192), seg("10.0.0.1:100", 1, 0x10000)]
    lease = client.publish("10.0.0.1:100", "node-1", 3, [], ttl_ms=20_000)
    assert client.query() == []
    # the same epoch keeps the lease while the table changes
    assert client.publish("10.0.0.1:100", "node-1", 3,
                          [seg("10.0.0.1:100", 2, 0x20000, length=8192, epoch=3),
                           seg("10.0.0.1:100", 1, 0x10000, epoch=3)], ttl_ms=20_000) == lease
    expected = sorted((SegmentInfo(**{**s.__dict__, "epoch": 3}) for s in table),
                      key=lambda s: s.base)
    assert client.query() == expected
    assert client.query("10.0.0.1:100") == expected
    assert client.query("someone-else") == []
    assert client.keepalive(lease) == 20_000

    client.unpublish(lease)
    assert client.query() == []
    with pytest.raises(NotConnected, match=f"lease {lease} expired or unknown; publish again"):
        client.keepalive(lease)


def test_errors_arrive_typed_and_named(client: RegistryClient) -> None:
    with pytest.raises(ParamInvalid, match="overlaps the registered range"):
        client.publish("a", "node-1", 1, [seg("a", 1, 0x1000), seg("a", 2, 0x1800)], 5_000)
    with pytest.raises(ParamInvalid, match=r"ttl_ms must be in \(0, 30000\], got 30001"):
        client.publish("a", "node-1", 1, [], 30_001)
    with pytest.raises(ParamInvalid, match="ttl_ms must be"):
        client.publish("a", "node-1", 1, [], 0)
    with pytest.raises(ParamInvalid, match="engine name must be a non-empty string"):
        client.publish("", "node-1", 1, [], 5_000)
    client.publish("a", "node-1", 5, [seg("a", 1, 0x1000, epoch=5)], 5_000)
    with pytest.raises(StaleEpoch, match="epoch 4 is older than the epoch 5"):
        client.publish("a", "node-1", 4, [], 5_000)
    assert client.query("a") == [seg("a", 1, 0x1000, epoch=5)]


def test_watch_sees_snapshot_changes_and_lease_expiry(master: Master,
                                                      client: RegistryClient) -> None:
    steady = seg("steady", 1, 0x1000)
    client.publish("steady", "node-1", 1, [steady], ttl_ms=30_000)
    watcher = Watcher(master.target)
    try:
        assert watcher.next() == ("SNAPSHOT", 0, [steady])

        doomed = [seg("doomed", 1, 0x1000, epoch=7), seg("doomed", 2, 0x8000, epoch=7)]
        client.publish("doomed", "node-1", 7, doomed, ttl_ms=300)  # never kept alive
        assert watcher.next() == ("ADDED", 7, doomed)
        # the master's expiry task drops it without anyone asking
        assert watcher.next() == ("REMOVED", 7, doomed)
        assert client.query() == [steady]
    finally:
        watcher.close()


def test_restart_with_newer_epoch_is_seen_as_removed_then_added(master: Master,
                                                                client: RegistryClient) -> None:
    old_lease = client.publish("a", "node-1", 1, [seg("a", 1, 0x1000)], 30_000)
    watcher = Watcher(master.target)
    try:
        assert watcher.next() == ("SNAPSHOT", 0, [seg("a", 1, 0x1000)])
        new_lease = client.publish("a", "node-1", 2, [seg("a", 1, 0x1000, epoch=2)], 30_000)
        assert new_lease != old_lease
        assert watcher.next() == ("REMOVED", 1, [seg("a", 1, 0x1000)])
        assert watcher.next() == ("ADDED", 2, [seg("a", 1, 0x1000, epoch=2)])
        with pytest.raises(NotConnected, match=f"lease {old_lease} expired"):
            client.keepalive(old_lease)
    finally:
        watcher.close()


def test_killed_master_gives_typed_errors_not_hangs(master: Master) -> None:
    client = RegistryClient(master.target, timeout=3)
    watcher = Watcher(master.target)
    try:
        lease = client.publish("a", "node-1", 1, [], 5_000)
        assert watcher.next() == ("SNAPSHOT", 0, [])
        master.kill()

        with pytest.raises(PeerUnavailable, match="watch of registry"):
            watcher.next()
        with pytest.raises(HixlError, match=f"keepalive of lease {lease} at registry"):
            client.keepalive(lease)
        with pytest.raises(HixlError, match="query of registry"):
            client.query(timeout=1)
    finally:
        watcher.close()
        client.close()


def test_sigterm_with_an_open_watch_exits_zero(master: Master) -> None:
    watcher = Watcher(master.target)
    try:
        assert watcher.next()[0] == "SNAPSHOT"
        assert master.stop(signal.SIGTERM) == 0
        with pytest.raises(HixlError):
            watcher.next()
    finally:
        watcher.close()


def test_sigint_exits_zero(master: Master) -> None:
    assert master.stop(signal.SIGINT) == 0


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize("flags", [
    ["-rpc_address=127.0.0.1", "-rpc_port=0", "-default_kv_lease_ttl=4000",
     "-eviction_high_watermark_ratio=0.9", "-eviction_ratio=0.1", "-client_ttl=20"],
    ["--rpc_address", "127.0.0.1", "--rpc_port", "0", "--default_kv_lease_ttl", "4000",
     "--eviction_high_watermark_ratio", "0.9", "--eviction_ratio", "0.1", "--client_ttl", "20"],
    ["--rpc_address=127.0.0.1", "--rpc_port=0", "-eviction_ratio", "0.1"],
], ids=["gflags-single-dash", "double-dash-separate", "mixed"])
def test_mooncake_flag_spellings_start_a_working_master(flags: list[str]) -> None:
    process = Master(*flags)
    try:
        target = process.wait_ready()
        assert target.startswith("127.0.0.1:")
        with RegistryClient(target, timeout=EVENT_DEADLINE_S) as client:
            client.publish("a", "node-1", 1, [seg("a", 1, 0x1000)], 1_000)
            assert client.query() == [seg("a", 1, 0x1000)]
        assert process.stop() == 0
    finally:
        process.kill()


def test_mooncake_flags_are_recorded_in_the_config() -> None:
    config = parse_config(["-rpc_address=0.0.0.0", "--rpc_port", "6000",
                           "-default_kv_lease_ttl=4000", "--eviction_high_watermark_ratio=0.9",
                           "-eviction_ratio", "0.1", "-client_ttl=20",
                           "--max-lease-ttl-ms", "9000", "--log-level", "debug"])
    assert config == MasterConfig(
        host="0.0.0.0", port=6000, max_lease_ttl_ms=9000, log_level="DEBUG",
        store=StoreConfig(default_kv_lease_ttl_ms=4000, eviction_high_watermark_ratio=0.9,
                          eviction_ratio=0.1, client_ttl_s=20))
    assert parse_config([]) == MasterConfig()
    assert MasterConfig().host == "127.0.0.1" and MasterConfig().port == 50051


@pytest.mark.parametrize(("flags", "named"), [
    (["--eviction_ratio", "1.5"], "--eviction_ratio"),
    (["-eviction_high_watermark_ratio=-0.1"], "eviction_high_watermark_ratio"),
    (["--eviction_ratio=nan"], "--eviction_ratio"),
    (["--client_ttl", "0"], "--client_ttl"),
    (["-default_kv_lease_ttl=0"], "default_kv_lease_ttl"),
    (["--default_kv_lease_ttl", "soon"], "default_kv_lease_ttl"),
    (["-rpc_port=http"], "rpc_port"),
    (["--port", "70000"], "--port"),
    (["--max-lease-ttl-ms", "0"], "--max-lease-ttl-ms"),
    (["--log-level", "chatty"], "--log-level"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--call-bytes-budget", "1KiB"], "--call-bytes-budget"),
    (["--call-bytes-budget", "lots"], "--call-bytes-budget"),
    (["--call-body-timeout-s", "0"], "--call-body-timeout-s"),
    (["--call-spin-us", "20000"], "--call-spin-us"),
    (["--call-spin-us", "soon"], "--call-spin-us"),
])
def test_bad_flags_exit_nonzero_naming_the_flag(flags: list[str], named: str) -> None:
    result = subprocess.run([sys.executable, "-m", "hixl.server.master.master", *flags],
                            capture_output=True, text=True, timeout=START_DEADLINE_S)
    assert result.returncode != 0
    assert named in result.stderr
    assert READY_PREFIX not in result.stdout


def test_taken_port_fails_with_a_message(master: Master) -> None:
    port = master.target.rsplit(":", 1)[1]
    result = subprocess.run([sys.executable, "-m", "hixl.server.master.master", "--port", port],
                            capture_output=True, text=True, timeout=START_DEADLINE_S)
    assert result.returncode == 1
    assert f"cannot serve gRPC on 127.0.0.1:{port}: port {port} is in use" in result.stderr


@pytest.mark.parametrize(("var", "value"), [
    ("HIXL_MASTER_CALL_BYTES_BUDGET", "0"),
    ("HIXL_MASTER_CALL_BYTES_BUDGET", "64KiB"),
    ("HIXL_MASTER_CALL_BODY_TIMEOUT_S", "never"),
])
def test_bad_call_limits_in_the_environment_exit_2_naming_the_key(var: str,
                                                                   value: str) -> None:
    env = {**os.environ, var: value}
    result = subprocess.run([sys.executable, "-m", "hixl.server.master.master", "--port", "0",
                             "--no-persist"], capture_output=True, text=True, env=env,
                            timeout=START_DEADLINE_S)
    assert result.returncode == 2, result.stderr
    assert var in result.stderr and repr(var[len("HIXL_MASTER_"):].lower()) in result.stderr
    assert READY_PREFIX not in result.stdout


def _reply(sock: socket.socket) -> tuple[wire.Header, bytes]:
    header = wire.decode_header(sock.recv(wire.HEADER_SIZE, socket.MSG_WAITALL))
    payload = sock.recv(header.length, socket.MSG_WAITALL) if header.length else b""
    return header, payload


def test_call_limits_reach_the_store_call_endpoint() -> None:
    """--call-bytes-budget and --call-body-timeout-s set the store call endpoint's limits:
    a body over the budget is refused naming it (the connection goes on), and a body that
    stalls closes its connection with the configured deadline in the log."""
    fast_port = free_port()
    process = Master("--port", "0", "--no-persist", "--fast-port", str(fast_port),
                     "--log-level", "DEBUG", "--call-bytes-budget", "1MiB",
                     "--call-body-timeout-s", "2")
    put_start = next(number for number, name in METHODS.items() if name == "PutStart")
    try:
        process.wait_ready()
        with socket.create_connection(("127.0.0.1", fast_port), timeout=30) as sock:
            sock.sendall(wire.ClientProtocol().hello(b"pytest"))
            assert _reply(sock)[0].status == 0
            sock.sendall(wire.Header(wire.Op.CALL, 1, segment_id=put_start,
                                     length=2 << 20).pack() + bytes(2 << 20))
            header, text = _reply(sock)
            assert header.reason == wire.Reason.INTERNAL, text
            assert b"not applied" in text and b"limit of 1048576 bytes" in text, text
            sock.sendall(wire.Header(wire.Op.PING, 2).pack())
            assert _reply(sock)[0].request_id == 2  # the connection goes on
            # a body that never comes: the connection is closed at the deadline
            sock.sendall(wire.Header(wire.Op.CALL, 3, segment_id=put_start,
                                     length=512 << 10).pack())
            assert sock.recv(1) == b""
        process.stop()  # its log is whole once it exited
        log = "".join(filter(None, process.stderr))
        assert "a call body did not arrive within 2 s" in log, log
    finally:
        process.kill()
