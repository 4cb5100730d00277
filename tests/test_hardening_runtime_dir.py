"""Issue 15, item 10: a runtime dir someone else controls is refused, not used.

The agent's unix sockets (the fd socket above all) live in `runtime_dir`; its last-resort
default, /tmp/hixl-<uid>, is a name any user can create first. Whoever owns the directory
or may write in it can swap the agent's fd socket for their own and hand clients fake
memory. Each attack below prepares such a directory; a real `hixl-agent` refuses to start
(exit 2, the path and the fix named) and never puts a socket in it. Then an agent given
a fresh directory creates it 0700 and serves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hixl.client.agent_client import AgentClient, FdClient

#: a uid nobody on the test host runs as: "another user" (needs root to act as it)
OTHER_UID = 4242
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creating another user's "
                                "directory needs root")


@pytest.fixture
def base() -> Iterator[Path]:
    """A short private directory (unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="hxr-"))
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def start_agent(runtime_dir: Path, state_dir: Path) -> subprocess.CompletedProcess[str]:
    """hixl-agent with `runtime_dir`, expected to exit at once (a refusal)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIXL_AGENT_")}
    env["HIXL_AGENT_STATE_DIR"] = str(state_dir)
    return subprocess.run(
        [sys.executable, "-m", "hixl.server.main", "--host", "127.0.0.1", "--grpc-port", "0",
         "--runtime-dir", str(runtime_dir)],
        capture_output=True, text=True, env=env, timeout=120, check=False)


def assert_refused(run: subprocess.CompletedProcess[str], runtime_dir: Path,
                   *reasons: str) -> None:
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert "serving" not in run.stdout
    assert f"key 'runtime_dir': {runtime_dir}" in run.stderr, run.stderr
    for reason in reasons:
        assert reason in run.stderr, run.stderr


@needs_root
def test_a_runtime_dir_another_user_created_first_is_refused(base: Path) -> None:
    """The attack on /tmp/hixl-<uid>: another user makes the directory (and a fake fd
    socket in it) before the agent starts."""
    planted = base / "hixl-run"
    planted.mkdir(mode=0o755)
    (planted / "agent-50161.fd.sock").write_text("the attacker's")
    os.chown(planted, OTHER_UID, OTHER_UID)
    run = start_agent(planted, base / "state")
    assert_refused(run, planted, f"owned by uid {OTHER_UID}", "use a directory of your own")
    assert sorted(p.name for p in planted.iterdir()) == ["agent-50161.fd.sock"]


@needs_root
def test_a_runtime_dir_symlink_of_another_user_is_refused(base: Path) -> None:
    """A symlink another user owns can be pointed elsewhere after the agent checked."""
    target = base / "mine"
    target.mkdir(mode=0o700)
    link = base / "hixl-link"
    link.symlink_to(target)
    os.chown(link, OTHER_UID, OTHER_UID, follow_symlinks=False)
    assert_refused(start_agent(link, base / "state"), link, f"symlink owned by uid {OTHER_UID}")
    assert list(target.iterdir()) == []


def test_a_runtime_dir_others_may_write_is_refused(base: Path) -> None:
    """Ours, but writable by group or others (a sticky /tmp-like dir too): they could
    unlink or pre-create the agent's socket names."""
    for mode, writers in ((0o777, "group and others"), (0o1733, "group and others"),
                          (0o770, "group"), (0o703, "others")):
        shared = base / f"shared-{mode:o}"
        shared.mkdir()
        os.chmod(shared, mode)
        run = start_agent(shared, base / "state")
        assert_refused(run, shared, f"writable by {writers}", f"chmod go-w {shared}")
        assert list(shared.iterdir()) == []


def test_a_fresh_runtime_dir_is_created_0700_and_serves(base: Path, agent_process) -> None:  # type: ignore[no-untyped-def]
    """Honest use: the agent creates its directory 0700 (0711 when allowed_uids names
    other users, who must reach the sockets), serves, and hands out fds."""
    private = base / "run"
    node = agent_process(config={"runtime_dir": str(private), "pool": [{"size": "1MiB"}]})
    assert private.stat().st_mode & 0o7777 == 0o700
    assert node.info.fd_socket.startswith(str(private) + "/")
    with AgentClient(node.engine) as client:
        segment = client.allocate(4096)
    with FdClient(node.info.fd_socket) as fdc:
        fd, length = fdc.fetch(segment.segment_id, segment.epoch, True)
        os.close(fd)
    assert length >= 4096
    shared = base / "run-shared"
    agent_process(config={"runtime_dir": str(shared),
                          "allowed_uids": sorted({os.getuid(), 0, OTHER_UID})})
    assert shared.stat().st_mode & 0o7777 == 0o711
