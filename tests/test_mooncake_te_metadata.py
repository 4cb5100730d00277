"""The Mooncake TransferEngine adapter's metadata back-ends besides P2PHANDSHAKE (issue 17,
item 5): `http://host:port/metadata` (hixl-master --enable_http_metadata_server, and the
real mooncake_master's where installed) and `etcd://host:port` (a real etcd). Engines are
named as Mooncake deployments name them, found by name, and move real bytes.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import waiting
from etcd_cluster import start_cluster_or_skip
from test_mooncake_master_http import HOST, HixlMaster, _mooncake_master, answers, free_port, http

from hixl.client.mooncake import TransferEngine, TransferNotify, TransferOpcode
from hixl.client.mooncake.metadata import ETCD_PREFIX
from hixl.processes import DaemonProcess

DEADLINE_S = 30.0
SIZE = 64 << 10
wait_for = partial(waiting.wait_until, timeout=DEADLINE_S)


class Buffer:
    """Private memory of this process, registered with an engine."""

    def __init__(self, engine: TransferEngine, fill: bytes = b"") -> None:
        self.memory = ctypes.create_string_buffer(fill, SIZE)
        self.addr = ctypes.addressof(self.memory)
        assert engine.register_memory(self.addr, SIZE) == 0, engine.get_last_error()

    def bytes(self, length: int) -> bytes:
        return self.memory.raw[:length]


@pytest.fixture(scope="module")
def hixl_master() -> Iterator[HixlMaster]:
    started = HixlMaster()
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def etcd_url() -> Iterator[str]:
    cluster = start_cluster_or_skip(1)
    try:
        yield f"etcd://{cluster.endpoints[0]}"
    finally:
        cluster.close()


def _metadata_get(url: str, key: str) -> bytes | None:
    status, _, body = http("GET", f"{url}?key={urllib.parse.quote(key, safe='')}")
    return body if status == 200 else None


def _engines(url: str, *names: str) -> list[TransferEngine]:
    engines = []
    for name in names:
        engine = TransferEngine()
        assert engine.initialize(name, url, "tcp", "") == 0, engine.get_last_error()
        engines.append(engine)
    return engines


def _moves_bytes_by_name(url: str, lookup: Callable[[str], bytes | None]) -> None:
    """Two engines named as a deployment names them ("ip", "ip:port") move bytes both
    ways, sync, async and with a notify, and publish Mooncake's records."""
    port = free_port()
    first, second = _engines(url, HOST, f"{HOST}:{port}")
    try:
        assert second.get_rpc_port() == port
        source, target = Buffer(first, b"hello metadata"), Buffer(second)
        name = f"{HOST}:{port}"
        assert first.get_first_buffer_address(name) == target.addr
        assert first.transfer_sync_write(name, source.addr, target.addr, 14) == 0
        assert target.bytes(14) == b"hello metadata"
        back = Buffer(second, b"the other way")
        batch = second.batch_transfer_async_write(HOST, [back.addr], [source.addr + 100], [13])
        assert batch > 0 and second.get_batch_transfer_status([batch]) == 0
        assert source.bytes(113)[100:] == b"the other way"
        assert first.transfer_sync(name, source.addr, target.addr + 200, 5,
                                   TransferOpcode.Write, TransferNotify("job", "done")) == 0
        assert [(n.name, n.msg) for n in second.get_notifies()] == [("job", "done")]
        record = lookup(f"mooncake/rpc_meta/{name}")
        assert record is not None
        assert json.loads(record) == {"ip_or_host_name": HOST, "rpc_port": port}
        ram = lookup(f"mooncake/ram/{name}")
        assert ram is not None
        assert {(b["addr"], b["length"]) for b in json.loads(ram)["buffers"]} == {
            (target.addr, SIZE), (back.addr, SIZE)}
        assert first.send_probe(name) == 0
    finally:
        first.close()
        second.close()
    assert lookup(f"mooncake/rpc_meta/{HOST}:{port}") is None  # withdrawn on close
    assert lookup(f"mooncake/ram/{HOST}") is None


def test_http_metadata_on_hixl_master(hixl_master: HixlMaster) -> None:
    _moves_bytes_by_name(hixl_master.metadata, partial(_metadata_get, hixl_master.metadata))


def test_http_metadata_on_the_real_mooncake_master() -> None:
    binary = _mooncake_master()
    admin_port, metadata_port = free_port(), free_port()
    real = subprocess.Popen(
        [binary, f"--rpc_port={free_port()}", f"--rpc_address={HOST}",
         f"--metrics_port={admin_port}", f"--metrics_host={HOST}",
         "--enable_http_metadata_server=true", f"--http_metadata_server_port={metadata_port}",
         f"--http_metadata_server_host={HOST}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: answers(f"http://{HOST}:{admin_port}/health"), "mooncake_master")
        url = f"http://{HOST}:{metadata_port}/metadata"
        _moves_bytes_by_name(url, partial(_metadata_get, url))
    finally:
        real.kill()
        real.wait()


def test_etcd_metadata(etcd_url: str) -> None:
    from hixl.etcd import EtcdClient

    with EtcdClient({"endpoints": etcd_url.removeprefix("etcd://"),
                     "prefix": ETCD_PREFIX}) as client:
        def lookup(key: str) -> bytes | None:
            found = client.get(key)
            return None if found is None else found.value

        _moves_bytes_by_name(etcd_url, lookup)
        bare = etcd_url.removeprefix("etcd://")  # Mooncake's form: a bare host:port
        [engine] = _engines(bare, "localhost")
        try:
            assert lookup("mooncake/rpc_meta/localhost") is not None
        finally:
            engine.close()


ENGINE_SCRIPT = """
import sys, time
from hixl.client.mooncake import TransferEngine
engine = TransferEngine()
assert engine.initialize(sys.argv[1], sys.argv[2], "tcp", "") == 0, engine.get_last_error()
print("ready", flush=True)
time.sleep(600)
"""


def _engine_process(name: str, url: str) -> DaemonProcess:
    engine = DaemonProcess([sys.executable, "-c", ENGINE_SCRIPT, name, url],
                           name="transfer engine", ready="ready")
    engine.wait_ready()
    return engine


@pytest.mark.parametrize("backend", ["http", "etcd"])
def test_a_name_is_taken_while_its_engine_answers_and_freed_when_it_dies(
        backend: str, request: pytest.FixtureRequest) -> None:
    url = (request.getfixturevalue("hixl_master").metadata if backend == "http"
           else request.getfixturevalue("etcd_url"))
    name = "127.0.0.2"  # no port: each engine under it takes a free one in the RPC range
    holder = _engine_process(name, url)
    try:
        rival = TransferEngine()
        assert rival.initialize(name, url, "tcp", "") == -1
        assert f"segment name {name!r} is taken" in rival.get_last_error()
        user = TransferEngine()
        assert user.initialize(HOST, url, "tcp", "") == 0
        assert user.send_probe(name) == 0
        holder.kill()
        # a killed engine withdrew nothing; its name goes to the next engine that asks
        successor = TransferEngine()
        wait_for(lambda: successor.initialize(name, url, "tcp", "") == 0,
                 "the dead engine's name taken over")
        try:
            target = Buffer(successor)
            source = Buffer(user, b"after the takeover")
            assert user.transfer_sync_write(name, source.addr, target.addr, 18) == 0
            assert target.bytes(18) == b"after the takeover"
        finally:
            successor.close()
            user.close()
    finally:
        holder.close()


def test_unknown_names_and_bad_servers_fail_naming_them(hixl_master: HixlMaster) -> None:
    [engine] = _engines(hixl_master.metadata, HOST)
    try:
        source = Buffer(engine)
        assert engine.transfer_sync_write("nobody", source.addr, 4096, 1) == -1
        assert "segment 'nobody' is not published on HTTP metadata server" in \
            engine.get_last_error()
        assert engine.batch_transfer_async_read("nobody", [source.addr], [4096], [1]) == 0
    finally:
        engine.close()
    closed = f"http://{HOST}:{free_port()}/metadata"
    engine = TransferEngine()
    assert engine.initialize(HOST, closed, "tcp", "") == -1
    assert closed in engine.get_last_error()


@pytest.mark.parametrize("server", [
    "redis://127.0.0.1:6379", "http://", "http://h:99999/metadata", "etcd://", "etcd://host",
    "hixl://nohost", "", "host:port", 42,
])
def test_unspoken_metadata_servers_are_refused_naming_the_forms(server: Any) -> None:
    engine = TransferEngine()
    assert engine.initialize(HOST, server, "tcp", "") == -1
    error = engine.get_last_error()
    assert repr(server) in error
    for form in ("P2PHANDSHAKE", "hixl://host:port", "http://host:port/metadata",
                 "etcd://host:port"):
        assert form in error
    assert engine.get_engine() is None


@pytest.mark.parametrize("backend", ["http", "etcd"])
def test_engines_starting_under_one_name_at_once_leave_one_holder(
        backend: str, request: pytest.FixtureRequest) -> None:
    from concurrent.futures import ThreadPoolExecutor

    url = (request.getfixturevalue("hixl_master").metadata if backend == "http"
           else request.getfixturevalue("etcd_url"))
    engines = [TransferEngine() for _ in range(4)]
    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            codes = list(pool.map(lambda e: e.initialize("127.0.0.3", url, "tcp", ""),
                                  engines))
        assert sorted(codes) == [-1, -1, -1, 0]
        for engine, code in zip(engines, codes, strict=True):
            if code != 0:
                assert "segment name '127.0.0.3'" in engine.get_last_error()
                assert "taken" in engine.get_last_error()
    finally:
        for engine in engines:
            engine.close()


def test_ram_record_follows_batch_registrations(hixl_master: HixlMaster) -> None:
    url = hixl_master.metadata
    [engine] = _engines(url, "127.0.0.4")
    try:
        memory = [ctypes.create_string_buffer(SIZE) for _ in range(3)]
        addrs = [ctypes.addressof(m) for m in memory]
        assert engine.batch_register_memory(addrs, [SIZE] * 3) == 0

        def recorded() -> set[int]:
            record = _metadata_get(url, "mooncake/ram/127.0.0.4")
            assert record is not None
            return {b["addr"] for b in json.loads(record)["buffers"]}

        assert recorded() == set(addrs)
        assert engine.batch_unregister_memory(addrs[:2]) == 0
        assert recorded() == {addrs[2]}
        assert engine.unregister_memory(addrs[2]) == 0
        assert recorded() == set()
    finally:
        engine.close()
