"""docs/architecture.md is a map, and the map stays true: its module table names every
module under hixl/, server/, client/ and tools/ and no module that is gone, it stays short, and
every link in the docs and the README, #anchor included, leads to a file and a heading
that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "architecture.md"
PACKAGES = ("hixl", "server", "client", "tools")
MAX_LINES = 250
TABLE_HEADING = "## 3. Where each part lives"
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def tree_modules() -> set[str]:
    """Every module file the map must name: .py under the four packages, recursively,
    but package `__init__.py` files and generated protobuf modules (`*_pb2*.py`)."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "__init__.py" or "_pb2" in path.name or "__pycache__" in path.parts:
                continue
            found.add(path.relative_to(ROOT).as_posix())
    return found


def table_modules(text: str) -> list[str]:
    """The paths in the first column of the module table (its section of the map)."""
    assert TABLE_HEADING in text, f"docs/architecture.md lost its section {TABLE_HEADING!r}"
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+\.py)` \|", section, flags=re.M)


def test_table_parsing_finds_rows_and_misses() -> None:
    text = f"{TABLE_HEADING}\n\n| module | what |\n|---|---|\n| `hixl/a.py` | x |\n| `b/c.py` | y |\n\n## next\n| `hixl/z.py` | no |\n"
    assert table_modules(text) == ["hixl/a.py", "b/c.py"]


def test_module_table_names_every_module_and_only_modules_that_exist() -> None:
    listed = table_modules(MAP.read_text(encoding="utf-8"))
    duplicates = sorted({path for path in listed if listed.count(path) > 1})
    assert not duplicates, f"listed twice in the map's module table: {duplicates}"
    missing = sorted(tree_modules() - set(listed))
    assert not missing, f"docs/architecture.md §3 does not list {missing}: add a row each"
    gone = sorted(path for path in listed if not (ROOT / path).is_file())
    assert not gone, f"docs/architecture.md §3 lists modules that do not exist: {gone}"


def test_the_map_is_short() -> None:
    lines = len(MAP.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, (f"docs/architecture.md has {lines} lines, the map's limit is "
                                f"{MAX_LINES}: move detail to a subsystem page")


def anchors(path: Path) -> set[str]:
    """GitHub's anchor for every heading of a markdown file (code blocks skipped)."""
    found: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6} (.+)", line)
        if fenced or heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        base, n = slug, 1
        while slug in found:
            slug, n = f"{base}-{n}", n + 1
        found.add(slug)
    return found


def test_anchor_slugs_are_githubs() -> None:
    assert anchors(ROOT / "docs" / "data-path.md") >= {"4-the-lone-op-in-c-hixl_fastwire"}
    assert "6-where-hixl-differs-from-mooncakes-store-api" in anchors(MAP)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_lead_to_files_and_headings_that_exist(path: Path) -> None:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        assert where.exists(), f"{path.name} links to {target}: no such file"
        if anchor and where.suffix == ".md":
            assert anchor in anchors(where), f"{path.name} links to {target}: no such heading"
