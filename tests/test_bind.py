"""Bind audit: every listening socket of a real hixl-agent and hixl-master binds only the
configured host, never the wildcard (0.0.0.0 / ::), and the unix sockets carry the
configured mode.

Sockets are found without psutil: the inodes of a process's /proc/<pid>/fd links
("socket:[N]") are looked up in /proc/<pid>/net/{tcp,tcp6,unix}. Listeners: agent gRPC,
TCP data port, metrics HTTP, fd socket, unix data socket; master gRPC, metrics HTTP and
any further port it opens (the store call endpoint): all of them, whatever they are.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable

import pytest
from conftest import AgentProcess, clean_env

from hixl.processes import free_port
from hixl.tools.daemons import MasterProcess

LISTEN = "0A"                 # TCP_LISTEN in /proc/net/tcp
UNIX_ACCEPTING = 0x10000      # __SO_ACCEPTCON in /proc/net/unix flags
StartAgent = Callable[..., AgentProcess]


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # an fd closed meanwhile
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    return inodes


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # the kernel prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(raw) == 16 and words[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntop(socket.AF_INET, words[12:])  # v4-mapped: gRPC's IPv4 binds
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def tcp_listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on, IPv4 and IPv6."""
    inodes = socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}", encoding="ascii") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == LISTEN and inode in inodes:
                    address, port = local.split(":")
                    found.add((_address(address), int(port, 16)))
    return found


def unix_listeners(pid: int) -> set[str]:
    """Paths of the unix sockets `pid` accepts connections on."""
    inodes = socket_inodes(pid)
    found = set()
    with open(f"/proc/{pid}/net/unix", encoding="utf-8", errors="replace") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if (len(fields) >= 8 and int(fields[6]) in inodes
                    and int(fields[3], 16) & UNIX_ACCEPTING):
                found.add(fields[7])
    return found


def local_non_loopback_address() -> str | None:
    """An IPv4 address of this host that is not loopback, or None (no route anywhere)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent
            address = probe.getsockname()[0]
        except OSError:
            return None
    if address.startswith("127.") or address == "0.0.0.0":
        return None
    with socket.socket() as check, contextlib.suppress(OSError):
        check.bind((address, 0))
        return address
    return None


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])



@pytest.mark.parametrize("where, mode", [("127.0.0.2", 0o600), ("non-loopback", 0o660)])
def test_agent_and_master_listen_only_on_the_configured_host(
        where: str, mode: int, agent_process: StartAgent) -> None:
    host = where if where != "non-loopback" else local_non_loopback_address()
    if host is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    master_metrics = free_port(host)
    with MasterProcess(host=host, extra=["--metrics-port", str(master_metrics)],
                       env=clean_env()) as master:
        master_address = master.target
        assert master_address.startswith(f"{host}:")
        listening = tcp_listeners(master.pid)
        assert {port_of(master_address), master_metrics} <= {p for _, p in listening}
        assert {address for address, _ in listening} == {host}, listening  # no wildcard
        assert unix_listeners(master.pid) == set()

        agent_metrics = free_port(host)
        settings: dict[str, object] = {"host": host, "metrics_port": agent_metrics,
                                       "master": master_address, "socket_mode": mode}
        if mode == 0o660:
            settings.pop("socket_mode")  # the default
        agent = agent_process(config=settings)
        assert agent.engine.startswith(f"{host}:")
        listening = tcp_listeners(agent.proc.pid)
        expected = {port_of(agent.engine), port_of(agent.info.data_tcp), agent_metrics}
        assert {p for _, p in listening} == expected, listening
        assert {address for address, _ in listening} == {host}, listening
        sockets = unix_listeners(agent.proc.pid)
        assert sockets == {agent.info.data_unix, agent.info.fd_socket}
        for path in sockets:
            assert os.stat(path).st_mode & 0o777 == mode, path


def test_master_binds_loopback_by_default() -> None:
    with MasterProcess(host=None, env=clean_env()) as master:  # the master's default host
        address = master.target
        assert address.startswith("127.0.0.1:")
        listening = tcp_listeners(master.pid)
        assert listening and {a for a, _ in listening} == {"127.0.0.1"}, listening
