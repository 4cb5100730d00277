"""hixl-master's HTTP side as mooncake_master serves it (issue 17, item 4): the admin
pages on --metrics_port and the HTTP metadata server, on real hixl-master processes, with
a real store client putting keys. Where the real mooncake_master is installed (the
`mooncake` extra; CI installs it), the same requests go to it too and the answers must
match byte for byte where they carry no addresses.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import waiting
from prometheus_client.parser import text_string_to_metric_families
from test_master_process import EVENT_DEADLINE_S, Master

from hixl.client.mooncake import MooncakeDistributedStore
from hixl.processes import free_port
from hixl.server.master.master_http import HttpServer, MetadataStore
from hixl.store_codes import ErrorCode

HOST = "127.0.0.1"
SEGMENT = 16 << 20


def http(method: str, url: str, body: bytes | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body) of one real HTTP request; error statuses too."""
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=EVENT_DEADLINE_S) as reply:
            return reply.status, reply.headers.get("Content-Type") or "", reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type") or "", exc.read()


def answers(url: str) -> bool:
    try:
        return http("GET", url)[0] == 200
    except OSError:
        return False


class HixlMaster:
    """hixl-master with both HTTP servers on, on free ports."""

    def __init__(self, *flags: str) -> None:
        self.admin_port, self.metadata_port = free_port(), free_port()
        self.process = Master(f"--rpc_address={HOST}", "--rpc_port=0", "--no-persist",
                              f"--metrics_port={self.admin_port}",
                              "--enable_http_metadata_server",
                              f"--http_metadata_server_port={self.metadata_port}", *flags)
        self.target = self.process.wait_ready()
        self.admin = f"http://{HOST}:{self.admin_port}"
        self.metadata = f"http://{HOST}:{self.metadata_port}/metadata"

    def close(self) -> None:
        self.process.kill()


@pytest.fixture
def master() -> Iterator[HixlMaster]:
    started = HixlMaster()
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def store(master: HixlMaster) -> Iterator[MooncakeDistributedStore]:
    client = MooncakeDistributedStore()
    assert client.setup(HOST, master.metadata, SEGMENT, SEGMENT, "tcp", "", master.target) == 0
    try:
        yield client
    finally:
        client.close()


def test_pages_answer_in_mooncakes_formats(master: HixlMaster,
                                           store: MooncakeDistributedStore) -> None:
    assert store.put("k1", b"x" * 1000) == 0
    assert store.put("k2", b"y" * 10) == 0
    segment = store.get_hostname()

    assert http("GET", f"{master.admin}/get_all_segments")[::2] == (200, f"{segment}\n".encode())
    status, kind, body = http("GET", f"{master.admin}/get_all_keys")
    assert (status, kind) == (200, "text/plain; version=0.0.4")
    assert body == b"k1\nk2\n"

    status, kind, body = http("GET", f"{master.admin}/query_key?key=k1")
    assert (status, kind) == (200, "application/json; charset=utf-8")
    [descriptor] = json.loads(body)["data"]
    assert json.loads(body)["success"] is True
    assert descriptor["size_"] == 1000 and descriptor["protocol_"] == "tcp"
    assert descriptor["transport_endpoint_"] == segment and descriptor["buffer_address_"] > 0
    # a query is a read, as in Mooncake: it leases the object
    assert store.remove("k1") == ErrorCode.OBJECT_HAS_LEASE

    status, _, body = http("GET", f"{master.admin}/batch_query_keys?keys=k2,missing")
    data = json.loads(body)["data"]
    assert status == 200 and list(data) == ["k2", "missing"]
    assert data["k2"]["ok"] is True and data["k2"]["values"][0]["size_"] == 10
    assert data["missing"] == {"ok": False, "error": "OBJECT_NOT_FOUND", "values": None,
                               "disk_values": None, "local_disk_values": None,
                               "nof_values": None}

    status, _, body = http("GET", f"{master.admin}/query_segment?segment={segment}")
    name, used, capacity = body.decode().splitlines()
    assert status == 200 and name == segment
    assert used.startswith("Used(bytes): ") and int(used.split(": ")[1]) >= 1010
    assert capacity == f"Capacity(bytes) : {SEGMENT}"

    status, kind, body = http("GET", f"{master.admin}/health")
    assert (status, kind) == (200, "application/json; charset=utf-8")
    assert json.loads(body) == {"status": "ok", "role": "leader", "ha_state": "serving",
                                "service_ready": True, "leader_address": None,
                                "view_version": None}
    assert b"Keys: 2" in http("GET", f"{master.admin}/metrics/summary")[2]


def test_metrics_carry_hixls_and_mooncakes_names(master: HixlMaster,
                                                 store: MooncakeDistributedStore) -> None:
    assert store.put("k", b"z" * 4096) == 0
    status, _, body = http("GET", f"{master.admin}/metrics")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body.decode())
               for s in family.samples}
    assert status == 200
    assert samples[("master_key_count", ())] == 1
    assert samples[("master_total_capacity_bytes", ())] == SEGMENT
    segment = (("segment", store.get_hostname()),)
    assert samples[("segment_total_capacity_bytes", segment)] == SEGMENT
    assert samples[("segment_allocated_bytes", segment)] >= 4096
    assert any(name.startswith("hixl_store_") for name, _ in samples)


def test_error_pages(master: HixlMaster) -> None:
    assert http("GET", f"{master.admin}/query_key?key=nope") == (
        404, "application/json; charset=utf-8",
        b'{"success":false,"error_code":-704,"error_message":"OBJECT_NOT_FOUND"}')
    assert http("GET", f"{master.admin}/batch_query_keys")[::2] == (
        400, b'{"success":false,"error":"No keys provided. Use ?keys=key1,key2,..."}')
    assert http("GET", f"{master.admin}/query_segment?segment=nope")[::2] == (
        500, b"Failed to query segment")
    assert http("GET", f"{master.admin}/nothing/here")[::2] == (404, b"404 Not Found")
    assert http("GET", f"{master.admin}/get_all_segments")[::2] == (200, b"")


def test_metadata_protocol(master: HixlMaster) -> None:
    url = master.metadata
    assert http("GET", f"{url}?key=a")[::2] == (404, b"metadata not found")
    assert http("PUT", f"{url}?key=a", b'{"v": 1}')[::2] == (200, b"metadata updated")
    assert http("GET", f"{url}?key=a") == (200, "application/json", b'{"v": 1}')
    assert http("PUT", f"{url}?key=a", b"2")[::2] == (200, b"metadata updated")
    assert http("GET", f"{url}?key=a")[2] == b"2"
    assert http("PUT", f"{url}?key=mooncake/rpc_meta/x", b"1")[0] == 200
    assert http("PUT", f"{url}?key=mooncake/rpc_meta/x", b"2")[::2] == (
        400, b"Duplicate rpc_meta key not allowed")
    assert http("DELETE", f"{url}?key=a")[::2] == (200, b"metadata deleted")
    assert http("DELETE", f"{url}?key=a")[::2] == (404, b"metadata not found")
    assert http("GET", url)[::2] == (400, b"Missing key parameter")
    assert http("POST", f"{url}?key=a", b"1")[::2] == (404, b"404 Not Found")


def test_metadata_server_bounds_what_it_holds() -> None:
    server = HttpServer(MetadataStore(max_total_bytes=1000).routes(), HOST, 0, "test")
    try:
        url = f"{server.url}/metadata"
        assert http("PUT", f"{url}?key=a", b"x" * 600)[0] == 200
        status, _, body = http("PUT", f"{url}?key=b", b"x" * 600)
        assert status == 413 and b"at most 1000 bytes" in body
        assert http("GET", f"{url}?key=b")[0] == 404
        assert http("PUT", f"{url}?key=a", b"x" * 900)[0] == 200  # replacing frees the old
        assert http("DELETE", f"{url}?key=a")[0] == 200
        assert http("PUT", f"{url}?key=b", b"x" * 600)[0] == 200
    finally:
        server.close()


def test_http_side_is_off_unless_asked_and_bound_to_the_host() -> None:
    port = free_port()
    plain = Master("--rpc_port=0", "--no-persist")
    try:
        plain.wait_ready()
        with pytest.raises(OSError):
            http("GET", f"http://{HOST}:{port}/health")
        assert plain.stop() == 0
    finally:
        plain.kill()
    assert not any("HTTP" in line for line in plain.stderr if line)
    started = HixlMaster()
    try:
        log = "".join(line for line in started.process.stderr if line)
        assert f"HTTP metadata server on http://{HOST}:{started.metadata_port}/metadata" in log
        assert f"on http://{HOST}:{started.admin_port}" in log
    finally:
        started.close()


def test_a_taken_http_port_stops_the_master_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "hixl.server.master.master", "--rpc_port=0",
                                 "--no-persist", "--enable_http_metadata_server",
                                 f"--http_metadata_server_port={port}"],
                                capture_output=True, text=True, timeout=EVENT_DEADLINE_S * 3)
    assert result.returncode == 1
    assert (f"cannot serve the HTTP metadata server on {HOST}:{port}: port {port} is in use"
            in result.stderr and "(--http_metadata_server_port, key" in result.stderr)
    assert "Traceback" not in result.stderr


# ------------------------------------------------------- against the real mooncake_master


def _mooncake_master() -> str:
    found = shutil.which("mooncake_master") or str(Path(sys.executable).parent /
                                                   "mooncake_master")
    if not Path(found).exists():
        pytest.skip("mooncake_master is not installed (the `mooncake` extra)")
    return found


#: requests whose answers carry no addresses or timings: equal from both masters
SAME_ANSWERS: list[tuple[str, str, str, bytes | None]] = [
    ("admin", "GET", "/get_all_segments", None),
    ("admin", "GET", "/get_all_keys", None),
    ("admin", "GET", "/query_key?key=x", None),
    ("admin", "GET", "/batch_query_keys?keys=a,b", None),
    ("admin", "GET", "/batch_query_keys", None),
    ("admin", "GET", "/query_segment?segment=x", None),
    ("admin", "GET", "/nothing", None),
    ("metadata", "GET", "?key=a", None),
    ("metadata", "PUT", "?key=a", b"hello"),
    ("metadata", "GET", "?key=a", None),
    ("metadata", "PUT", "?key=mooncake/rpc_meta/x", b"1"),
    ("metadata", "PUT", "?key=mooncake/rpc_meta/x", b"2"),
    ("metadata", "DELETE", "?key=a", None),
    ("metadata", "DELETE", "?key=a", None),
    ("metadata", "GET", "", None),
]


def _replay(admin: str, metadata: str) -> list[tuple[int, bytes]]:
    bases = {"admin": admin, "metadata": metadata}
    return [http(method, bases[base] + path, body)[::2]  # type: ignore[misc]
            for base, method, path, body in SAME_ANSWERS]


def test_answers_match_the_real_mooncake_master(master: HixlMaster) -> None:
    binary = _mooncake_master()
    admin_port, metadata_port = free_port(), free_port()
    real = subprocess.Popen(
        [binary, f"--rpc_port={free_port()}", f"--rpc_address={HOST}",
         f"--metrics_port={admin_port}", f"--metrics_host={HOST}",
         "--enable_http_metadata_server=true", f"--http_metadata_server_port={metadata_port}",
         f"--http_metadata_server_host={HOST}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        admin = f"http://{HOST}:{admin_port}"
        waiting.wait_until(lambda: answers(f"{admin}/health"), "mooncake_master's /health",
                           EVENT_DEADLINE_S * 3)
        expected = _replay(admin, f"http://{HOST}:{metadata_port}/metadata")
        health: dict[str, Any] = json.loads(http("GET", f"{admin}/health")[2])
    finally:
        real.kill()
        real.wait()
    assert _replay(master.admin, master.metadata) == expected
    ours = json.loads(http("GET", f"{master.admin}/health")[2])
    assert ours == health


def test_idle_connections_cannot_pile_up_threads() -> None:
    server = HttpServer(MetadataStore().routes(), HOST, 0, "test", max_connections=2)
    idle = [socket.create_connection((HOST, server.port)) for _ in range(2)]
    try:
        with socket.create_connection((HOST, server.port)) as extra:
            waiting.wait_until(lambda: waiting.closed_by_peer(extra),
                               "the connection over the bound closed", EVENT_DEADLINE_S)
        idle.pop().close()
        waiting.wait_until(lambda: _served(f"{server.url}/metadata?key=a"),
                           "a request served once a slot is free", EVENT_DEADLINE_S)
    finally:
        for sock in idle:
            sock.close()
        server.close()


def _served(url: str) -> bool:
    try:
        return http("GET", url)[0] == 404
    except OSError:
        return False
