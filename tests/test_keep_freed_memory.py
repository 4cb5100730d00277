"""The store's get / get_batch land values in warm pages (hixl.memory.keep_freed_memory).

A value read into a new `bytes` is written into memory malloc just took; with glibc's
defaults a batch of 1 MiB values is fresh from the kernel on every call (freed memory is
trimmed at once), and first-touch page faults cost more than the copy. The store client
tunes malloc at setup unless told not to. Checked where users meet it: a store client in
its own process reads a batch twice; the second call's page faults are counted.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hixl.errors import ConfigError
from hixl.memory import KEEP_FREED_ENV, PAGE_SIZE, _tune_malloc
from hixl.tools.daemons import MasterProcess
from tests.test_mooncake_store import Worker, master, pattern, sha, workers  # noqa: F401

MiB = 1 << 20
KEYS, SIZE = 8, MiB
PAGES = KEYS * SIZE // PAGE_SIZE


def read_twice(master: MasterProcess, workers: Callable[..., Worker]) -> dict:  # noqa: F811
    worker = workers(master, segment=32 * MiB)
    assert worker.step(do="puts", prefix="v", count=KEYS, seed=3, size=SIZE)["codes"] == [0] * KEYS
    answer = worker.step(do="get_batch", keys=[f"v{i}" for i in range(KEYS)])
    assert answer["sha256"] == [sha(pattern(3 + i, SIZE)) for i in range(KEYS)]
    return answer


def test_store_get_batch_reuses_freed_pages(master, workers,  # noqa: F811
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEEP_FREED_ENV, raising=False)
    faults = read_twice(master, workers)["page_faults"]
    assert faults < PAGES // 10, f"{faults} page faults reading {PAGES} pages of values"


@pytest.mark.parametrize("env", [{KEEP_FREED_ENV: "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}])
def test_opt_out_leaves_malloc_alone(master, workers, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                     env: dict[str, str]) -> None:
    """HIXL_KEEP_FREED_MEMORY=0 or the caller's own malloc settings: glibc's defaults stay,
    and (the check that the first test can fail) the values land in fresh pages."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    faults = read_twice(master, workers)["page_faults"]
    assert faults >= PAGES // 2, f"only {faults} page faults reading {PAGES} pages"


def test_settings_in_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """What setup logs; nothing is changed in this process (the calls decline)."""
    assert _tune_malloc(0) == f"malloc left as it is ({KEEP_FREED_ENV}=0)"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert _tune_malloc(None) == "malloc left as it is (the caller set GLIBC_TUNABLES)"
    monkeypatch.setenv(KEEP_FREED_ENV, "lots")
    with pytest.raises(ConfigError, match=KEEP_FREED_ENV):
        _tune_malloc(None)
