"""hixl.processes: the one launcher of daemons and helpers (spawn, ready line, stop, port).

The launcher's own tests start small Python children, so tests/conftest.py sorts them
"process"; the port picker starts nothing, and its tests stay "unit".
"""

from __future__ import annotations

import re
import signal
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from hixl.processes import DaemonProcess, ProcessNotReady, free_port, free_ports

GIVE_UP_S = 30.0  # only guards against a hang


def child(script: str) -> list[str]:
    """argv of a Python child running `script` (unbuffered, so its lines come at once)."""
    return [sys.executable, "-u", "-c", textwrap.dedent(script)]


def test_the_ready_line_is_found_after_other_output() -> None:
    with DaemonProcess(child("""
            import sys, time
            print("warming up")
            print("a warning", file=sys.stderr)
            print("demo serving port=4242 epoch=7")
            time.sleep(60)
            """), name="demo", ready="demo serving ") as demo:
        assert demo.wait_ready(GIVE_UP_S) == "demo serving port=4242 epoch=7"
        assert demo.alive()
        assert "warming up" in demo.tail() and "a warning" in demo.tail()
    assert not demo.alive()


def test_a_regex_ready_line_gives_its_match() -> None:
    with DaemonProcess(child("""
            import time
            print("listening on 127.0.0.1:5555", flush=True)
            time.sleep(60)
            """), ready=re.compile(r"listening on (\S+):(\d+)")) as demo:
        demo.wait_ready(GIVE_UP_S)
        assert demo.ready_match is not None and demo.ready_match.group(2) == "5555"


def test_a_process_that_dies_before_ready_is_named_with_its_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    demo = DaemonProcess(child("""
            import sys
            print("config: unknown key 'pool_sise'", file=sys.stderr)
            sys.exit(3)
            """), name="demo-daemon", ready="demo serving ", log_path=str(log))
    with pytest.raises(ProcessNotReady) as raised:
        demo.wait_ready(GIVE_UP_S)
    message = str(raised.value)
    assert "demo-daemon exited with status 3" in message
    assert "unknown key 'pool_sise'" in message and str(log) in message
    assert raised.value.returncode == 3
    assert "unknown key" in demo.log()


def test_a_process_not_ready_by_the_deadline_is_killed_and_named() -> None:
    demo = DaemonProcess(child("""
            import time
            print("still loading")
            time.sleep(60)
            """), name="slow-daemon", ready="slow serving ")
    with pytest.raises(ProcessNotReady) as raised:
        demo.wait_ready(0.5)
    assert "slow-daemon was not ready after 0.5 s" in str(raised.value)
    assert "still loading" in str(raised.value)
    assert not demo.alive()


def test_stop_kills_a_process_that_ignores_sigterm() -> None:
    stubborn = DaemonProcess(child("""
            import signal, time
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("stubborn serving")
            time.sleep(60)
            """), ready="stubborn serving")
    stubborn.wait_ready(GIVE_UP_S)
    assert stubborn.stop(grace_s=0.5) == -signal.SIGKILL
    assert not stubborn.alive()


def test_a_helper_stopped_by_stdin_exits_cleanly_and_its_lines_are_read() -> None:
    with DaemonProcess(child("""
            import sys
            print("helper ready")
            for line in sys.stdin:
                print("echo", line.strip())
            print("bye")
            """), ready="helper ready", stop_by="stdin", lines=True) as helper:
        helper.wait_ready(GIVE_UP_S)
        assert helper.send("one\n")
        assert helper.next_line(GIVE_UP_S) == "echo one\n"
        assert helper.stop(GIVE_UP_S) == 0
        assert helper.next_line(GIVE_UP_S) == "bye\n"
        assert helper.next_line(GIVE_UP_S) == ""  # EOF, and it stays so
        assert helper.next_line(GIVE_UP_S) == ""
        assert not helper.send("more\n")


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    assert len(set(free_ports(5))) == 5


def test_free_ports_lie_outside_the_range_the_kernel_hands_out() -> None:
    """A port from the ephemeral range may go to any bind(0) or outgoing connection before
    the server told to use it binds it (a CI failure: an agent refused its chosen port)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
        low, _high = (int(field) for field in f.read().split())
    if low < 11000:
        pytest.skip(f"this host's ephemeral range starts at {low}: free_ports falls back to bind(0)")
    ports = free_ports(50)
    assert len(set(ports)) == 50
    assert all(1024 <= port < low for port in ports), ports
