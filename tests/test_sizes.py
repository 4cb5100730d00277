"""hixl.sizes: the one size parser (dd(1) units) and the Mooncake boundary (binary units).

Unit tests: no processes, no sockets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl.client.mooncake.store import MooncakeConfig, mooncake_size
from hixl.errors import ConfigError
from hixl.sizes import UNITS, format_size, parse_size, parse_size_list

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(("text", "expected"), [
    ("4096", 4096), (4096, 4096), ("512B", 512), ("64MiB", 64 * MiB), ("64M", 64 * MiB),
    ("64m", 64 * MiB), ("16MB", 16_000_000), ("16mb", 16_000_000), ("2KB", 2000),
    ("2k", 2 * KiB), ("1.5GiB", 3 * GiB // 2), ("1.5k", 1536), (" 8 KiB ", 8 * KiB),
    ("1TiB", 1 << 40), ("1TB", 10 ** 12), ("1G", GiB),
])
def test_dd_convention(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("value", ["", "abc", "12XB", "-1", "+1", "0", 0, -5, "1.3B",
                                   True, 1.5, "1e9", None, "1 2", "1..5k", b"1k"])
def test_refused(value: object) -> None:
    with pytest.raises(ConfigError):
        parse_size(value)


def test_config_error_is_a_value_error() -> None:  # callers catching ValueError keep working
    with pytest.raises(ValueError, match="not understood"):
        parse_size("12XB")


def test_zero_only_when_allowed() -> None:
    assert parse_size("0", allow_zero=True) == 0 and parse_size(0, allow_zero=True) == 0
    with pytest.raises(ConfigError, match="positive"):
        parse_size("0")
    with pytest.raises(ConfigError, match="non-negative"):
        parse_size(-1, allow_zero=True)


def test_size_list() -> None:
    assert parse_size_list("4K,1M") == (4 * KiB, MiB)
    assert parse_size_list(" 1 , ,2KB") == (1, 2000)
    for bad in ("", " , ", "4K,nope"):
        with pytest.raises(ConfigError):
            parse_size_list(bad)


@given(st.integers(min_value=1, max_value=1 << 50), st.sampled_from(sorted(UNITS)))
def test_every_unit_multiplies(number: int, unit: str) -> None:
    for spelled in (unit, unit.upper()):
        assert parse_size(f"{number}{spelled}") == number * UNITS[unit]


def test_server_config_uses_the_same_parser() -> None:
    from hixl.server import config

    assert config.parse_size is parse_size


# ------------------------------------------------------------- the Mooncake boundary


@pytest.mark.parametrize(("value", "expected"), [
    ("16MB", 16 * MiB), ("16mb", 16 * MiB), ("4gb", 4 * GiB), ("4GB", 4 * GiB),
    ("1KB", KiB), ("1TB", 1 << 40), ("1.5k", 1536), (" 1.5k ", 1536), ("16MiB", 16 * MiB),
    ("16M", 16 * MiB), ("512", 512), ("512b", 512), (0, 0), ("0", 0), (42, 42),
    (3355443200.0, 3355443200),
])
def test_mooncake_units_are_binary(value: object, expected: int) -> None:
    assert mooncake_size(value) == expected


@pytest.mark.parametrize("value", ["12XB", "", "-1", -1, True, 1.5, None, [1]])
def test_mooncake_refuses(value: object) -> None:
    with pytest.raises(ValueError):
        mooncake_size(value)


def test_the_two_meanings_of_mb() -> None:
    """The one place "MB" means MiB is Mooncake's config, converted at its boundary."""
    assert parse_size("16MB") == 16_000_000
    assert mooncake_size("16MB") == 16 * MiB == parse_size("16MiB")


def test_mooncake_config_converts_at_the_boundary() -> None:
    config = MooncakeConfig(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE",
                            global_segment_size="64MB", local_buffer_size="16MB",
                            protocol="tcp", device_name=None,
                            master_server_address="127.0.0.1:50051")
    assert (config.global_segment_size, config.local_buffer_size) == (64 * MiB, 16 * MiB)


@pytest.mark.parametrize(("n", "text"), [
    (4096, "4K"), (8994816, "8784K"), (64 << 20, "64M"), (1 << 30, "1G"), (1 << 40, "1T"),
    (1000, "1000B"), (1, "1B"),
])
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text and parse_size(text) == n


def test_format_size_approximate() -> None:
    assert format_size((3 << 19) + 1, approximate=True) == "1.5M"
    assert format_size(3 << 19, approximate=True) == "1536K"
    assert format_size(1000, approximate=True) == "1000B"


@given(st.integers(min_value=1, max_value=1 << 60))
def test_format_then_parse_round_trips(n: int) -> None:
    assert parse_size(format_size(n)) == n
