"""The generated protobuf code committed in hixl/v1/ is exactly what proto/ produces.

Regenerates into a temporary directory with scripts/gen_proto.py's own `generate` and
compares byte for byte, so a .proto edited without regenerating (or generated code edited
by hand) fails here instead of at a peer that disagrees on the wire.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
FIX = "run `python scripts/gen_proto.py` and commit the regenerated hixl/v1/ files"


def _load_generate() -> Callable[[Path], list[Path]]:
    """gen_proto.py is a script, not a module of the package: load it from its path."""
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate


def _generated_names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Relative path (e.g. hixl/v1/agent_pb2.py) -> freshly generated file."""
    out = tmp_path_factory.mktemp("gen_proto")
    paths = _load_generate()(out)
    assert paths, "scripts/gen_proto.py generated nothing"
    return {p.relative_to(out).as_posix(): p for p in paths}


def test_generated_code_matches_committed(fresh: dict[str, Path]) -> None:
    directories = {ROOT / Path(rel).parent for rel in fresh}
    committed = {(d / name).relative_to(ROOT).as_posix()
                 for d in directories if d.is_dir() for name in _generated_names(d)}
    missing = sorted(set(fresh) - committed)
    extra = sorted(committed - set(fresh))
    assert not missing, f"generated files not committed: {missing}; {FIX}"
    assert not extra, f"committed generated files with no .proto source: {extra}; {FIX}"
    for rel, path in sorted(fresh.items()):
        want = path.read_bytes()
        have = (ROOT / rel).read_bytes()
        if want != have:
            diff = difflib.unified_diff(
                have.decode(errors="replace").splitlines(),
                want.decode(errors="replace").splitlines(),
                f"committed/{rel}", f"generated/{rel}", lineterm="", n=1)
            excerpt = "\n".join(list(diff)[:30])
            pytest.fail(f"{rel} differs from what proto/ generates; {FIX}\n{excerpt}")


def test_every_proto_has_generated_code() -> None:
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    assert protos, f"no .proto files under {PROTO_ROOT}"
    for proto in protos:
        stem = proto.relative_to(PROTO_ROOT).with_suffix("")
        for suffix in GENERATED_SUFFIXES:
            target = ROOT / stem.parent / f"{stem.name}{suffix}"
            assert target.is_file(), (
                f"{proto.relative_to(ROOT)} has no generated {target.relative_to(ROOT)}; "
                f"{FIX} (and make scripts/gen_proto.py pick the file up)")
