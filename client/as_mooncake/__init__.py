"""`hixl-as-mooncake`: run an unmodified program with Mooncake's Python names served by hixl.

vLLM, SGLang and LMCache import `mooncake.store` and `mooncake.engine` themselves. Run them
under the launcher, in the style of `opentelemetry-instrument`:

    hixl-as-mooncake vllm serve ...        # or: python -m hixl.client.as_mooncake CMD ...

and, in that process and every Python process it starts, `import mooncake.store`,
`from mooncake.store import MooncakeDistributedStore`, `import mooncake.engine` and
`mooncake.mooncake_config` resolve to hixl's adapters (`ALIASES`). The launcher puts this
package's directory in front of PYTHONPATH, where its `sitecustomize.py` installs
`MooncakeAlias` on sys.meta_path at interpreter start (then runs any other
sitecustomize it hides), and execs the command. Nothing else changes: outside the
launcher, a real Mooncake installed on the same machine is what `import mooncake` finds.

The opt-in for a whole environment (when the command cannot be wrapped):
`hixl-as-mooncake --install-pth` writes a `.pth` file into site-packages that installs the
alias in every process of that environment; `--uninstall-pth` removes it. In either form,
HIXL_AS_MOONCAKE=0 turns the alias off for a process (and its children).

Other `mooncake.*` modules (Mooncake's own tools) are refused with an ImportError naming
this launcher, rather than half-loaded from the real package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Mooncake module -> the hixl module that stands in for it
ALIASES = {
    "mooncake.store": "hixl.client.mooncake.store",
    "mooncake.engine": "hixl.client.mooncake.transfer_engine",
    "mooncake.mooncake_config": "hixl.client.mooncake.store",
}
PACKAGE = "mooncake"
#: the Mooncake release whose Python API (../shared/mooncake-api.txt) the adapters follow
MOONCAKE_VERSION = "0.3.13"
#: "0" turns the alias off (launcher, .pth and children alike)
ENV_SWITCH = "HIXL_AS_MOONCAKE"
SITE_DIR = Path(__file__).resolve().parent
PTH_NAME = "hixl-as-mooncake.pth"
PTH_LINE = ("import os; os.environ.get('HIXL_AS_MOONCAKE', '1') != '0' and "
            "__import__('hixl.client.as_mooncake', fromlist=['install']).install()\n")
USAGE = """usage: hixl-as-mooncake [--] COMMAND [ARGS...]
       hixl-as-mooncake --install-pth [--site-dir DIR] | --uninstall-pth [--site-dir DIR]
       hixl-as-mooncake --version

Run COMMAND with `import mooncake.store` / `mooncake.engine` / `mooncake.mooncake_config`
served by hixl (in COMMAND's Python processes and their children). --install-pth makes
that the default for every process of this Python environment (a .pth file in its
site-packages, or DIR); HIXL_AS_MOONCAKE=0 turns it off for a process.
"""


def version_line() -> str:
    """What --version prints: hixl's version (as `hixl --version` does) and the Mooncake
    release whose names it serves."""
    from hixl import __version__

    return (f"hixl-as-mooncake {__version__} (hixl {__version__}, standing in for Mooncake "
            f"{MOONCAKE_VERSION}: {', '.join(sorted(ALIASES))})")


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


class _AliasLoader(importlib.abc.Loader):
    """Loads a Mooncake name as the hixl module standing in for it (the module object
    itself: `mooncake.store.MooncakeDistributedStore is hixl's class`)."""

    def __init__(self, target: str | None) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.target is not None:
            return importlib.import_module(self.target)
        package = types.ModuleType(PACKAGE, "Mooncake's Python names, served by hixl "
                                            "(hixl-as-mooncake).")
        package.__path__ = []  # submodules come from MooncakeAlias only
        return package

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class MooncakeAlias(importlib.abc.MetaPathFinder):
    """Finds `mooncake` and the ALIASES in hixl; refuses other `mooncake.*` by name."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == PACKAGE:
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(None),
                                                  is_package=True)
        if fullname in ALIASES:
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(ALIASES[fullname]))
        if fullname.startswith(PACKAGE + "."):
            raise ModuleNotFoundError(
                f"{fullname} is Mooncake's own module; under hixl-as-mooncake (or its .pth) "
                f"hixl serves {', '.join(sorted(ALIASES))} only. Run without it, or with "
                f"{ENV_SWITCH}=0, to use the installed Mooncake", name=fullname)
        return None


def install() -> None:
    """Put MooncakeAlias first on sys.meta_path (once), unless HIXL_AS_MOONCAKE=0."""
    if not enabled() or any(isinstance(f, MooncakeAlias) for f in sys.meta_path):
        return
    loaded = sorted(name for name in sys.modules
                    if name == PACKAGE or name.startswith(PACKAGE + "."))
    for name in loaded:  # a real mooncake imported before: later imports get hixl's
        del sys.modules[name]
    sys.meta_path.insert(0, MooncakeAlias())


def run_hidden_sitecustomize() -> None:
    """Run the sitecustomize that this package's own one hides on sys.path (Debian's, a
    virtualenv's, another launcher's), as Python would have without us."""
    ours = str(SITE_DIR)
    rest = [p for p in sys.path if _real(p) != ours]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _real(path: str) -> str:
    try:
        return str(Path(path or ".").resolve())
    except OSError:
        return path


def launch_environment(environ: dict[str, str]) -> dict[str, str]:
    """`environ` with this package's directory first on PYTHONPATH (an explicit
    HIXL_AS_MOONCAKE=0 in it still turns the alias off)."""
    env = dict(environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and _real(p) != str(SITE_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *paths])
    return env


def _site_dir(args: list[str]) -> Path:
    if args[:1] == ["--site-dir"] and len(args) == 2:
        return Path(args[1])
    if args:
        raise SystemExit(f"hixl-as-mooncake: unexpected {' '.join(args)!r}\n{USAGE}")
    return Path(sysconfig.get_paths()["purelib"])


def main(argv: Sequence[str] | None = None) -> Any:
    """The launcher: exec COMMAND with the alias, or install/uninstall the .pth."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout, end="")
        return 2 if not args else 0
    if args[0] == "--version":
        if args[1:]:
            print(f"hixl-as-mooncake: --version takes nothing after it, got "
                  f"{' '.join(args[1:])!r}\n{USAGE}", file=sys.stderr, end="")
            return 2
        print(version_line())
        return 0
    if args[0] in ("--install-pth", "--uninstall-pth"):
        pth = _site_dir(args[1:]) / PTH_NAME
        try:
            if args[0] == "--install-pth":
                pth.write_text(PTH_LINE, encoding="utf-8")
                print(f"hixl-as-mooncake: {pth} written: every process of this environment "
                      f"imports hixl as mooncake ({ENV_SWITCH}=0 turns it off)")
            else:
                pth.unlink(missing_ok=True)
                print(f"hixl-as-mooncake: {pth} removed")
        except OSError as exc:
            print(f"hixl-as-mooncake: {pth}: {exc.strerror}", file=sys.stderr)
            return 1
        return 0
    if args[0] == "--":
        args = args[1:]
    if not args or args[0].startswith("-"):
        print(f"hixl-as-mooncake: no command to run{f' (unknown option {args[0]})' if args else ''}"
              f"\n{USAGE}", file=sys.stderr, end="")
        return 2
    try:
        os.execvpe(args[0], args, launch_environment(dict(os.environ)))
    except OSError as exc:
        print(f"hixl-as-mooncake: cannot run {args[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126


__all__ = ["ALIASES", "ENV_SWITCH", "MOONCAKE_VERSION", "MooncakeAlias", "install", "launch_environment", "main",
           "run_hidden_sitecustomize"]
