"""Sizes in bytes from text: the one parser every hixl setting, flag and API uses.

One convention, dd(1)'s, case-insensitive:

- a plain number is bytes ("4096", or an int 4096); "B" is bytes too ("512B");
- K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024 ("64M" = "64MiB" = 64·2^20);
- KB, MB, GB, TB are powers of 1000 ("16MB" = 16·10^6).

A decimal fraction is allowed when the result is a whole number of bytes ("1.5GiB",
"1.5k"; not "1.3B"). Anything else (an unknown unit, a float, a bool, an exponent like
"1e9", a sign) raises ConfigError (a ParamInvalid, so a ValueError) saying what is wanted.

Mooncake's configuration reads "16MB" as 16 MiB (every unit binary there): its adapter
(`hixl.client.mooncake.store.mooncake_size`) converts at that boundary and then calls
`parse_size`; nothing else in hixl reads sizes differently.
"""

from __future__ import annotations

import re
from decimal import Decimal

from hixl.errors import ConfigError

UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _letter in enumerate("kmgt", start=1):
    UNITS[_letter] = UNITS[_letter + "ib"] = 1024 ** _i
    UNITS[_letter + "b"] = 1000 ** _i
del _i, _letter
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def split_size(text: str) -> tuple[str, str] | None:
    """(number, unit lower-cased) of a size text, or None when it has not that shape."""
    match = _SIZE_RE.match(text)
    return (match.group(1), match.group(2).lower()) if match else None


def parse_size(value: object, *, allow_zero: bool = False) -> int:
    """Bytes from an int or a text like "4096", "64MiB", "1GiB", "16MB", "1.5G".

    Units as in dd(1): K/KiB/M/MiB/G/GiB/T/TiB are powers of 1024, KB/MB/GB/TB powers
    of 1000 (case-insensitive). The result must be a positive whole number of bytes
    (zero too with `allow_zero`). ConfigError otherwise.
    """
    if isinstance(value, bool):
        raise ConfigError(f"size must be a number of bytes or a text like '64MiB', got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        parts = split_size(value)
        if parts is None or parts[1] not in UNITS:
            raise ConfigError(
                f"size {value!r} is not understood; use bytes or a unit like 64MiB, 1GiB, 16MB")
        exact = Decimal(parts[0]) * UNITS[parts[1]]  # the regex admits only decimals
        if exact != exact.to_integral_value():
            raise ConfigError(f"size {value!r} is not a whole number of bytes")
        number = int(exact)
    else:
        raise ConfigError(
            f"size must be a number of bytes or a text like '64MiB', got {type(value).__name__}")
    if number < 0 or (number == 0 and not allow_zero):
        raise ConfigError(f"size must be {'non-negative' if allow_zero else 'positive'}, "
                          f"got {value!r}")
    return number


def parse_size_list(text: str) -> tuple[int, ...]:
    """Sizes of a comma-separated list like "4K,1M" (empty entries skipped), each as
    `parse_size`; ConfigError on a bad entry or an empty list."""
    sizes = tuple(parse_size(part) for part in text.split(",") if part.strip())
    if not sizes:
        raise ConfigError(f"give at least one size, e.g. 4K,1M, got {text!r}")
    return sizes


def format_size(n: int, *, approximate: bool = False) -> str:
    """The inverse of parse_size, in the same units: 4096 -> '4K', 8994816 -> '8784K',
    67108864 -> '64M'; other sizes in bytes ('1000B'), or, with `approximate`, to one
    decimal of the largest unit below them ('1.5M', which parse_size may refuse)."""
    units = (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10))
    for unit, scale in units:
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    if approximate:
        for unit, scale in units:
            if n >= scale:
                return f"{n / scale:.1f}{unit}"
    return f"{n}B"


__all__ = ["UNITS", "format_size", "parse_size", "parse_size_list", "split_size"]
