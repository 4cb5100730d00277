"""hixl.addresses: the one host:port parser, and the callers that name their setting.

Unit tests: no processes, no sockets."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl.addresses import is_host_port, join_host_port, normalize_host_port, split_host_port
from hixl.errors import ConfigError, ParamInvalid


@pytest.mark.parametrize(("text", "expected"), [
    ("a:1", ("a", 1)), ("127.0.0.1:50051", ("127.0.0.1", 50051)), ("[::1]:7", ("::1", 7)),
    ("b-2.example:0003", ("b-2.example", 3)), ("h:65535", ("h", 65535)),
])
def test_host_port(text: str, expected: tuple[str, int]) -> None:
    assert split_host_port(text) == expected


@pytest.mark.parametrize(("text", "problem"), [
    ("nohost", "'nohost' is not host:port: it names no port"),
    ("h:", "names no port"),
    ("h:0", "the port must be 1..65535"),
    ("h:99999", "the port must be 1..65535"),
    ("h:port", "the port must be"),
    ("::1:50051", r"IPv6 address goes in brackets, e.g. \[::1\]:50051"),
    ("http://h:1", "without a scheme"),
    ("h :1", "is not host:port"),
    ("h/x:1", "is not host:port"),
    ("", "is not host:port"),
    (":1", "has no host"),
    ("[]:1", "has no host"),
    ("[::1", r"an IPv6 address is '\[addr\]:port'"),
    ("[::1]x", "is not host:port"),
    ("a]:1", "is not host:port"),
    (7, "must be a 'host:port' string"),
    (None, "must be a 'host:port' string"),
])
def test_refusals_name_the_setting(text: object, problem: str) -> None:
    with pytest.raises(ParamInvalid, match=problem) as caught:
        split_host_port(text, "master address")
    assert caught.value.args[0].startswith("master address")


def test_options() -> None:
    assert split_host_port("h", default_port=443) == ("h", 443)
    assert split_host_port("[::1]", default_port=0) == ("::1", 0)
    assert split_host_port("h:0", min_port=0) == ("h", 0)
    assert split_host_port("::1", default_port=443, bare_ipv6=True) == ("::1", 443)
    with pytest.raises(ParamInvalid) as caught:
        split_host_port("h", no_port="say so")
    assert caught.value.args[0] == "say so"
    with pytest.raises(ConfigError) as caught:
        split_host_port("h:0", "etcd_endpoints:", error=ConfigError)
    assert caught.value.args[0].startswith("etcd_endpoints: 'h:0'")


def test_normalize_and_join() -> None:
    assert normalize_host_port(" a:01 ") == "a:1"
    assert normalize_host_port("[::1]:2") == "[::1]:2"
    assert join_host_port("::1", 5) == "[::1]:5" and join_host_port("h", 5) == "h:5"
    assert is_host_port("h:1") and not is_host_port("h") and not is_host_port(None)


_hosts = st.one_of(
    st.from_regex(r"[a-z0-9][a-z0-9.-]{0,20}", fullmatch=True),
    st.ip_addresses().map(str))


@given(_hosts, st.integers(min_value=1, max_value=65535))
def test_round_trip(host: str, port: int) -> None:
    assert split_host_port(join_host_port(host, port)) == (host, port)
    assert normalize_host_port(join_host_port(host, port)) == join_host_port(host, port)


@given(st.text(max_size=30))
def test_any_text_parses_or_is_refused_typed(text: str) -> None:
    try:
        host, port = split_host_port(text)
    except ParamInvalid:
        return
    assert host and 1 <= port <= 65535 and not any(c.isspace() for c in host)


# ------------------------------------------------------------ callers, one parser each


def test_master_addresses() -> None:
    from hixl.failover import parse_address, parse_addresses

    assert parse_address(" [::1]:050051 ") == "[::1]:50051"
    assert parse_addresses("a:1,a:1,b:2") == ("a:1", "b:2")
    with pytest.raises(ParamInvalid, match="advertise_address 'x' is not host:port"):
        parse_address("x", "advertise_address")


def test_engine_names() -> None:
    from hixl.client.engine import parse_engine_name

    assert parse_engine_name("10.0.0.1") == ("10.0.0.1", 0)
    assert parse_engine_name("[::1]:5") == ("::1", 5)
    assert parse_engine_name("h:0", remote=True) == ("h", 0)
    with pytest.raises(ParamInvalid, match="has no port: a remote engine is its agent's"):
        parse_engine_name("10.0.0.1", remote=True)
    with pytest.raises(ParamInvalid, match="engine name 'a:b:1': an IPv6 address goes in"):
        parse_engine_name("a:b:1")
    with pytest.raises(ParamInvalid, match="non-empty string"):
        parse_engine_name("")


def test_data_addresses() -> None:
    from hixl.transports.tcp import parse_data_address

    assert parse_data_address("tcp://[::1]:9") == ("tcp", socket.AF_INET6, ("::1", 9))
    assert parse_data_address("tcp://h:9") == ("tcp", socket.AF_INET, ("h", 9))
    assert parse_data_address("unix:///run/x") == ("unix", socket.AF_UNIX, "/run/x")
    with pytest.raises(ParamInvalid, match="is not tcp://host:port"):
        parse_data_address("tcp://h")
    with pytest.raises(ParamInvalid, match="port must be 1..65535"):
        parse_data_address("tcp://h:0")


def test_bench_and_etcd_and_grpc_targets() -> None:
    from hixl.auth import server_host_port
    from hixl.etcd import _parse_endpoint
    from hixl.store_rpc import target_host
    from hixl.tools import bench

    assert bench.split_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        bench.split_host_port("10.0.0.1")
    assert _parse_endpoint("https://[::1]:2379/") == ("[::1]:2379", "https")
    with pytest.raises(ConfigError, match="etcd_endpoints: 'localhost' is not host:port"):
        _parse_endpoint("localhost")
    assert target_host("[::1]:5") == "::1" and target_host("unix:/x") is None
    assert server_host_port("Example.COM.") == ("example.com", 443)
    assert server_host_port("::1") == ("::1", 443)
    assert server_host_port("[::1]:80") == ("::1", 80) and server_host_port("h:x") is None
