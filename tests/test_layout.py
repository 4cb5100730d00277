"""Layout rules that keep the distribution honest.

- Dependencies point one way (docs/architecture.md §5: tools -> client -> core <- server):
  the core `hixl` modules import none of hixl.server, hixl.client, hixl.tools;
  hixl.server imports neither hixl.client nor hixl.tools; hixl.client does not import
  hixl.tools and reaches hixl.server only through one seam (an agent embedded by
  client/engine.py); hixl.tools never imports hixl.server. Checked by
  parsing every import statement (and constant `import_module("...")` calls) with `ast`,
  then once more at run time in a fresh interpreter.
- Every console script in pyproject.toml resolves to a callable, every lazily re-exported
  name in `hixl` resolves, and every source package is listed in pyproject.toml (a wheel
  would silently leave an unlisted one out).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import EntryPoint, distribution
from pathlib import Path

import pytest

import hixl

ROOT = Path(__file__).resolve().parent.parent

# Modules still being written may not exist yet: a missing module FILE is skipped (with
# the reason) while this is True. Lead: set it to False before landing, so that a missing
# module fails instead.
ALLOW_MISSING_MODULES = True

# Source directory of each import package (pyproject.toml [tool.setuptools.package-dir]).
SOURCE_ROOTS = {"hixl": ROOT / "hixl", "hixl.server": ROOT / "server",
                "hixl.client": ROOT / "client", "hixl.tools": ROOT / "tools"}

# Not checked for the core rule: the package root re-exports hixl.client names lazily
# (through __getattr__), and hixl/v1 is generated code.
CORE_EXEMPT = (ROOT / "hixl" / "__init__.py", ROOT / "hixl" / "v1",
               ROOT / "hixl" / "shmem.py")  # a facade over hixl.client.shmem, like the root


def _module_name(path: Path) -> tuple[str, str]:
    """(qualified module name, package used to resolve its relative imports)."""
    for package, root in SOURCE_ROOTS.items():
        if path.is_relative_to(root):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
                return ".".join(parts), ".".join(parts)
            return ".".join(parts), ".".join(parts[:-1])
    raise AssertionError(f"{path} is not under any source root")


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every import in the file, relative ones resolved.

    `from hixl import client` yields "hixl.client", so importing a subpackage by name
    from its parent counts as importing it.
    """
    _, package = _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and _is_dynamic_import(node.func):
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield node.lineno, first.value


def _is_dynamic_import(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("import_module", "__import__")


def _violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in files:
        for line, module in imported_modules(path):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                found.append(f"{shown}:{line} imports {module}")
    return sorted(set(found))


def _python_files(root: Path, exempt: tuple[Path, ...] = ()) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if not any(p == e or p.is_relative_to(e) for e in exempt))


def _require_module(module: str, why: str) -> None:
    """Skip (while modules are still being written) or fail when `module` has no file."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is not None:
        return
    message = f"{why}: module {module} does not exist"
    if ALLOW_MISSING_MODULES:
        pytest.skip(f"{message} yet (ALLOW_MISSING_MODULES is on)")
    pytest.fail(message)


# ---------------------------------------------------------------- dependency direction

def test_core_imports_no_side() -> None:
    files = _python_files(ROOT / "hixl", CORE_EXEMPT)
    assert files
    bad = _violations(files, ("hixl.server", "hixl.client", "hixl.tools"))
    assert not bad, ("core hixl modules must not depend on hixl.server, hixl.client or "
                     "hixl.tools (move the shared piece into hixl/, or the code into "
                     "server/, client/ or tools/):\n" + "\n".join(bad))


def test_server_imports_neither_client_nor_tools() -> None:
    files = _python_files(ROOT / "server")
    assert files
    bad = _violations(files, ("hixl.client", "hixl.tools"))
    assert not bad, "hixl.server must not depend on hixl.client or hixl.tools:\n" + \
        "\n".join(bad)


#: the one client module that may import hixl.server: the SDK's seam (an agent embedded
#: in the process: Engine._start_embedded_agent, embedded_agent_config)
SERVER_SEAM = (ROOT / "client" / "engine.py",)


def test_the_client_reaches_the_server_only_through_the_seam() -> None:
    files = _python_files(ROOT / "client", SERVER_SEAM)
    assert files
    bad = _violations(files, ("hixl.server",))
    assert not bad, ("hixl.client reaches hixl.server only through client/engine.py's "
                     "embedded agent (move shared constants into hixl/):\n" + "\n".join(bad))


def test_the_client_does_not_import_the_tools() -> None:
    files = _python_files(ROOT / "client")
    assert files
    bad = _violations(files, ("hixl.tools",))
    assert not bad, ("the SDK (hixl.client) must not depend on the command-line tools "
                     "(move the shared piece into client/ or hixl/):\n" + "\n".join(bad))


def test_the_tools_start_daemons_as_processes_and_never_import_the_server() -> None:
    files = _python_files(ROOT / "tools")
    assert files
    bad = _violations(files, ("hixl.server",))
    assert not bad, ("hixl.tools starts daemons by module name (hixl.processes) and must "
                     "not import hixl.server:\n" + "\n".join(bad))


def test_import_rules_catch_violations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: every spelling of a forbidden import is seen, relative too."""
    fake_core = tmp_path / "hixl"
    (fake_core / "transports").mkdir(parents=True)
    monkeypatch.setitem(SOURCE_ROOTS, "hixl", fake_core)
    sample = fake_core / "transports" / "sample.py"
    sample.write_text(
        "import hixl.server.agent.agent\n"
        "from hixl import client\n"
        "from ..client.engine import Engine\n"
        "import importlib\n"
        "importlib.import_module('hixl.server')\n"
        "from hixl.types import Perm\n"
        "from . import base\n",
        encoding="utf-8")
    found = _violations([sample], ("hixl.server", "hixl.client"))
    assert [v.rsplit(" imports ", 1)[1] for v in found] == [
        "hixl.server.agent.agent", "hixl.client", "hixl.client.engine", "hixl.client.engine.Engine",
        "hixl.server"]


def test_core_import_loads_no_side() -> None:
    """At run time too: importing every core module pulls in no server, client or tools
    code."""
    modules = ["hixl"] + [_module_name(p)[0] for p in _python_files(ROOT / "hixl", CORE_EXEMPT)]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[:2] in (['hixl', 'server'],"
        " ['hixl', 'client'], ['hixl', 'tools']))\n"
        "print(' '.join(loaded))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [], f"core import loaded: {result.stdout}"


# ---------------------------------------------------------------- entry points

def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _console_scripts() -> dict[str, str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: what the installed distribution declares
        return {ep.name: ep.value for ep in distribution("hixl").entry_points
                if ep.group == "console_scripts"}
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


SCRIPTS = _console_scripts()


def test_console_scripts_declared() -> None:
    assert {"hixl-agent", "hixl-master", "hixl"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_resolves_to_callable(name: str) -> None:
    entry = EntryPoint(name=name, value=SCRIPTS[name], group="console_scripts")
    _require_module(entry.module, f"console script {name} = {entry.value}")
    target = entry.load()
    assert callable(target), f"console script {name} = {entry.value} is not callable"


@pytest.mark.parametrize("name", sorted(hixl._LAZY))
def test_lazy_reexport_resolves(name: str) -> None:
    module = hixl._LAZY[name]
    _require_module(module, f"hixl.{name} (lazily re-exported)")
    assert getattr(hixl, name) is getattr(importlib.import_module(module), name)


def test_every_source_package_is_listed() -> None:
    config = _pyproject()["tool"]["setuptools"]
    listed = set(config["packages"])
    assert {pkg: str(ROOT / d) for pkg, d in config["package-dir"].items()} == {
        pkg: str(root) for pkg, root in SOURCE_ROOTS.items()}
    on_disk = set()
    for root in SOURCE_ROOTS.values():
        for init in root.rglob("__init__.py"):
            on_disk.add(_module_name(init)[0])
    unlisted = sorted(on_disk - listed)
    assert not unlisted, (f"packages missing from [tool.setuptools] packages in "
                          f"pyproject.toml (a wheel would leave them out): {unlisted}")
    assert not listed - on_disk, f"listed packages with no directory: {sorted(listed - on_disk)}"
