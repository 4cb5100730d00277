"""The docs agree with the code: docs/errors.md lists every error code with the very fix
hints processes log (both ways), docs/operations.md covers every port setting, and every
relative link in the docs leads somewhere."""

from __future__ import annotations

import os
import re

import pytest

from hixl import errors, store_codes
from hixl.client.mooncake import transfer_engine
from hixl.control import DEFAULT_GRPC_PORT
from hixl.server.agent.config import AgentConfig
from hixl.server.master.master import DEFAULT_PORT as MASTER_PORT
from hixl.server.master.master import MasterConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_RETURNED = "not returned by hixl"


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def section(text: str, number: int) -> str:
    """The text of the `## <number>.` section."""
    match = re.search(rf"^## {number}\. .*?(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"docs/errors.md lost its section {number}"
    return match.group(0)


def code_rows(text: str) -> list[list[str]]:
    """The cells of every table row whose first cell is an integer (a code)."""
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and re.fullmatch(r"-?\d+", cells[0]):
            rows.append(cells)
    return rows


@pytest.fixture(scope="module")
def errors_md() -> str:
    return read("docs/errors.md")


def test_every_hixl_status_and_class_is_documented_with_its_hint(errors_md: str) -> None:
    rows = code_rows(section(errors_md, 1))
    documented_codes = {int(cells[0]) for cells in rows}
    assert documented_codes == set(errors.STATUS_NAMES)  # every code, and no other
    classes: dict[str, str] = {}
    for code, name, exception, _cause, fix in rows:
        assert errors.STATUS_NAMES[int(code)] == name, f"{code} is {errors.STATUS_NAMES[int(code)]}"
        if exception == "—":
            continue
        cls = next((c for c in errors.HINTS if c.__name__ == exception), None)
        assert cls is not None, f"docs/errors.md lists {exception}, hixl.errors.HINTS does not"
        assert cls.status == int(code), f"{exception} has status {cls.status}, not {code}"
        assert fix == errors.HINTS[cls], f"{exception}: the docs' fix is not the logged hint"
        classes[exception] = fix
    assert set(classes) == {cls.__name__ for cls in errors.HINTS}


def test_every_error_class_has_a_hint() -> None:
    """A new HixlError subclass gets a hint of its own (or is a deliberate alias)."""
    def subclasses(cls: type) -> set[type]:
        found = set(cls.__subclasses__())
        for sub in list(found):
            found |= subclasses(sub)
        return found

    classes = {c for c in subclasses(errors.HixlError) if c.__module__ == errors.__name__}
    assert classes | {errors.HixlError} == set(errors.HINTS)
    assert all(errors.hint_for(c) for c in classes)


def test_every_store_code_is_documented_and_each_hint_is_the_logged_one(errors_md: str) -> None:
    rows = code_rows(section(errors_md, 2))
    by_code = {int(cells[0]): cells for cells in rows}
    assert len(by_code) == len(rows), "a store code is listed twice"
    assert set(by_code) == {int(code) for code in store_codes.ErrorCode}
    for code in store_codes.ErrorCode:
        _, name, cause, fix = by_code[int(code)]
        assert name == code.name
        hint = store_codes.HINTS.get(code)
        if hint is not None:
            assert fix == hint, f"{code.name}: the docs' fix is not the logged hint"
            assert NOT_RETURNED not in cause
        elif code != store_codes.ErrorCode.OK:
            assert cause.startswith(NOT_RETURNED) and fix == "—", code.name
    assert store_codes.hint_for_code(-704) == store_codes.HINTS[store_codes.ErrorCode.OBJECT_NOT_FOUND]
    assert store_codes.hint_for_code(12345) == ""


def test_transfer_engine_return_values_are_documented(errors_md: str) -> None:
    rows = code_rows(section(errors_md, 3))
    documented = {int(cells[0]): cells[1] for cells in rows}
    constants = {value: name for name, value in vars(transfer_engine).items()
                 if name.startswith("ERR_") and isinstance(value, int)}
    assert documented == constants


def test_operations_covers_ports_settings_and_sizing() -> None:
    text = read("docs/operations.md")
    for heading in ("Sizing segments", "Ports and sockets", "Security", "Upgrades",
                    "Failure behaviour", "Logs and request ids"):
        assert re.search(rf"^## \d+\. {heading}", text, flags=re.M), heading
    # every port the agent or master can be told to use, and their defaults
    port_keys = [key for key, spec in AgentConfig.describe().items() if spec["type"] == "port"]
    port_keys += [key for key in MasterConfig.describe() if key.endswith("port")]
    for key in port_keys:
        assert f"`{key}`" in text or f"--{key.replace('_', '-')}" in text, key
    assert str(DEFAULT_GRPC_PORT) in text and str(MASTER_PORT) in text
    for key in ("pool_max_bytes", "cluster_token_file", "socket_mode", "allowed_uids",
                "runtime_dir", "lease_ttl_ms", "log_json"):
        assert f"`{key}" in text, key
    # the KV block arithmetic it quotes
    block = 128 * 61 * (512 + 64) * 2
    assert block == 8784 * 1024 and f"{block:,}" in text
    for gib in (1, 16, 64, 256):
        blocks = (gib << 30) // block
        assert f"| {gib} GiB | {blocks:,} | {blocks * 128:,} |" in text


DOC_PATHS = ["README.md"] + sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs"))
                                   if name.endswith(".md"))


def test_every_doc_page_is_checked() -> None:
    assert {"docs/architecture.md", "docs/operations.md", "docs/errors.md",
            "docs/benchmarks.md"} <= set(DOC_PATHS)


@pytest.mark.parametrize("path", DOC_PATHS)
def test_relative_links_lead_somewhere(path: str) -> None:
    text = read(path)
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        where = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), target))
        assert os.path.exists(where), f"{path} links to {target}, which does not exist"
