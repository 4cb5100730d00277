"""Issue 15, item 11: `allowed_uids: []` no longer admits every uid on the fd socket.

The fd server admits everyone when its uid set is empty, and an empty list in the config
reached it as such. The config now resolves an empty list (like an unset key) to the
agent's uid and root. The attack: a process of another user connects to the fd socket of
a real `hixl-agent` configured with `allowed_uids: []` (socket and directory open to all,
so that only the uid check stands in the way) and asks it for something.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hixl.client.agent_client import AgentClient, FdClient
from hixl.errors import HixlError

OTHER_UID = 4242
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")

@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A runtime dir any user may reach (0711 on the way down), ours and not writable by
    others, so that only allowed_uids decides who gets in."""
    base = Path(tempfile.mkdtemp(prefix="hxu-"))
    os.chmod(base, 0o711)
    run = base / "run"
    run.mkdir(mode=0o711)
    os.chmod(run, 0o711)
    yield run
    subprocess.run(["rm", "-rf", str(base)], check=False)


@contextlib.contextmanager
def as_other_user() -> Iterator[None]:
    """Run the block with effective uid OTHER_UID: a socket connected meanwhile carries
    that uid (SO_PEERCRED records the connecting process's effective credentials)."""
    os.seteuid(OTHER_UID)
    try:
        yield
    finally:
        os.seteuid(0)


def ping_as_other_user(fd_socket: str) -> str:
    """What the fd socket answers a client of another user: "SERVED" or the refusal."""
    with as_other_user():
        fdc = FdClient(fd_socket, timeout=30.0)
    with fdc:
        try:
            fdc.ping()
        except HixlError as exc:
            return f"REFUSED {type(exc).__name__} {exc}"
    return "SERVED"


def test_an_empty_allowed_uids_admits_only_the_agent_and_root(open_dir: Path,
                                                               agent_process) -> None:  # type: ignore[no-untyped-def]
    node = agent_process(config={"runtime_dir": str(open_dir), "allowed_uids": [],
                                 "socket_mode": 0o666, "pool": [{"size": "1MiB"}]})
    out = ping_as_other_user(node.info.fd_socket)
    assert out.startswith("REFUSED PermissionDenied"), out
    assert f"uid {OTHER_UID}" in out and str(sorted({os.getuid(), 0})) in out, out
    # the agent's own user still gets its fds, and the segments are intact
    with AgentClient(node.engine) as client:
        segment = client.allocate(4096)
        with FdClient(node.info.fd_socket) as fdc:
            fd, length = fdc.fetch(segment.segment_id, segment.epoch, True)
            os.close(fd)
        assert length >= 4096
        assert segment.segment_id in {s.segment_id for s in client.list_segments()[1]}


def test_a_listed_uid_is_admitted(open_dir: Path, agent_process) -> None:  # type: ignore[no-untyped-def]
    """Honest configuration: list the other user and it gets in."""
    node = agent_process(config={"runtime_dir": str(open_dir), "socket_mode": 0o666,
                                 "allowed_uids": sorted({os.getuid(), 0, OTHER_UID})})
    out = ping_as_other_user(node.info.fd_socket)
    assert out.startswith("SERVED"), out
