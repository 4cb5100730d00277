"""No edits in the caller (issue 17, item 2): a script that only knows Mooncake's names
runs on hixl under `hixl-as-mooncake`, and on the real Mooncake (where it is installed)
without it. Every run is a real interpreter started the way an operator starts one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_master_process import Master

BIN = Path(sys.executable).parent
LAUNCHER = [str(BIN / "hixl-as-mooncake")]
TIMEOUT_S = 120

#: what a framework does: Mooncake's imports, Mooncake's calls, nothing hixl
MOONCAKE_SCRIPT = r"""
import json, sys
import mooncake.store
import mooncake.engine
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from mooncake.engine import TransferEngine
from mooncake.mooncake_config import MooncakeConfig

report = {"store": MooncakeDistributedStore.__module__, "engine": TransferEngine.__module__,
          "config": MooncakeConfig.__module__,
          "same": mooncake.store.MooncakeDistributedStore is MooncakeDistributedStore}
if len(sys.argv) > 1:
    store = MooncakeDistributedStore()
    report["setup"] = store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                                  sys.argv[1])
    config = ReplicateConfig()
    config.replica_num = 1
    report["put"] = store.put("framework-key", b"from a Mooncake-only script", config)
    report["get"] = store.get("framework-key").decode()
    report["exists"] = store.is_exist("framework-key")
    store.close()
    # vLLM's P2P connector: a TransferEngine, registered memory, a write by segment name
    import ctypes
    engine = TransferEngine()
    report["initialize"] = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "")
    source = ctypes.create_string_buffer(b"kv blocks", 4096)
    target = ctypes.create_string_buffer(4096)
    report["register"] = engine.batch_register_memory(
        [ctypes.addressof(source), ctypes.addressof(target)], [4096, 4096])
    report["write"] = engine.batch_transfer_sync_write(
        f"127.0.0.1:{engine.get_rpc_port()}", [ctypes.addressof(source)],
        [ctypes.addressof(target)], [9])
    report["moved"] = target.value.decode()
print(json.dumps(report))
"""


def run(args: list[str], env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ)
    full.pop("HIXL_AS_MOONCAKE", None)
    full.update(env or {})
    return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S, env=full,
                          cwd=cwd)


def report(result: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("framework") / "framework.py"
    path.write_text(MOONCAKE_SCRIPT)
    return path


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    process = Master("--rpc_port=0", "--no-persist")
    try:
        yield process.wait_ready()
    finally:
        process.kill()


def real_mooncake_installed() -> bool:
    found = run([sys.executable, "-c", "import mooncake.store"])
    return found.returncode == 0


def test_launcher_serves_mooncakes_names_from_hixl(script: Path, master: str) -> None:
    seen = report(run([*LAUNCHER, sys.executable, str(script), master]))
    assert seen == {"store": "hixl.client.mooncake.store",
                    "engine": "hixl.client.mooncake.transfer_engine",
                    "config": "hixl.client.mooncake.store", "same": True, "setup": 0,
                    "put": 0, "get": "from a Mooncake-only script", "exists": 1,
                    "initialize": 0, "register": 0, "write": 0, "moved": "kv blocks"}


def test_python_dash_m_form_and_child_processes(script: Path) -> None:
    child = (f"import subprocess, sys; sys.exit(subprocess.run([sys.executable, "
             f"{str(script)!r}]).returncode)")
    seen = report(run([sys.executable, "-m", "hixl.client.as_mooncake", sys.executable,
                       "-c", child]))
    assert seen["store"] == "hixl.client.mooncake.store"


def test_without_the_launcher_the_real_mooncake_is_untouched(script: Path) -> None:
    if not real_mooncake_installed():
        result = run([sys.executable, str(script)])
        assert result.returncode != 0 and "No module named 'mooncake'" in result.stderr
        return
    seen = report(run([sys.executable, str(script)]))
    assert seen["store"] == "mooncake.store" and seen["engine"] == "mooncake.engine"
    switched_off = report(run([*LAUNCHER, sys.executable, str(script)],
                              env={"HIXL_AS_MOONCAKE": "0"}))
    assert switched_off["store"] == "mooncake.store"


def test_mooncakes_other_modules_are_refused_by_name() -> None:
    result = run([*LAUNCHER, sys.executable, "-c", "import mooncake.buffer_pool"])
    assert result.returncode == 1
    assert "mooncake.buffer_pool is Mooncake's own module" in result.stderr
    assert "HIXL_AS_MOONCAKE=0" in result.stderr


def test_a_sitecustomize_it_hides_still_runs(tmp_path: Path, script: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nos.environ['SITE_RAN'] = 'yes'\n")
    probe = ("import os, runpy, sys; sys.argv = [sys.argv[1]]; "
             "print(os.environ.get('SITE_RAN')); runpy.run_path(sys.argv[0])")
    result = run([*LAUNCHER, sys.executable, "-c", probe, str(script)],
                 env={"PYTHONPATH": str(tmp_path)})
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0, result.stderr
    assert lines[0] == "yes"
    assert json.loads(lines[-1])["store"] == "hixl.client.mooncake.store"


def test_pth_opt_in_for_an_environment(tmp_path: Path, script: Path) -> None:
    site = tmp_path / "site-packages"
    site.mkdir()
    installed = run([*LAUNCHER, "--install-pth", "--site-dir", str(site)])
    assert installed.returncode == 0 and "hixl-as-mooncake.pth" in installed.stdout
    with_site = ["-c", f"import runpy, site, sys; site.addsitedir({str(site)!r}); "
                       f"runpy.run_path({str(script)!r})"]
    assert report(run([sys.executable, *with_site]))["store"] == "hixl.client.mooncake.store"
    off = run([sys.executable, *with_site], env={"HIXL_AS_MOONCAKE": "0"})
    if real_mooncake_installed():
        assert report(off)["store"] == "mooncake.store"
    else:
        assert off.returncode != 0 and "No module named 'mooncake'" in off.stderr
    assert run([*LAUNCHER, "--uninstall-pth", "--site-dir", str(site)]).returncode == 0
    assert not list(site.iterdir())


@pytest.mark.parametrize(("args", "code", "said"), [
    ([], 2, "usage: hixl-as-mooncake"),
    (["--frobnicate"], 2, "unknown option --frobnicate"),
    (["no-such-command-here"], 127, "cannot run 'no-such-command-here'"),
    (["--install-pth", "--site-dir", "/nonexistent/dir"], 1, "/nonexistent/dir"),
    (["--version", "python"], 2, "--version takes nothing after it, got 'python'"),
])
def test_launcher_refusals(args: list[str], code: int, said: str) -> None:
    result = run([*LAUNCHER, *args])
    assert result.returncode == code
    assert said in result.stderr
    assert "Traceback" not in result.stderr


def test_version_names_hixls_and_the_mooncake_it_stands_in_for() -> None:
    """`hixl-as-mooncake --version`, as `hixl --version`: the program and hixl's version on
    stdout, exit 0; and the Mooncake release whose Python names it serves. After a
    command, --version is the command's own flag (passed through untouched)."""
    from hixl import __version__
    from hixl.client.as_mooncake import MOONCAKE_VERSION

    result = run([*LAUNCHER, "--version"])
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert line.startswith(f"hixl-as-mooncake {__version__} ")
    assert f"Mooncake {MOONCAKE_VERSION}" in line and "mooncake.store" in line
    assert MOONCAKE_VERSION == "0.3.13" and result.stderr == ""
    passed = run([*LAUNCHER, sys.executable, "--version"])
    assert passed.returncode == 0 and passed.stdout.startswith("Python "), passed
