"""HIXL option keys (string keys to string values) and their validation.

hixl honours the options that mean something for a host-DRAM transfer engine and
refuses, by name, values it cannot use, instead of silently ignoring them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from hixl.errors import ParamInvalid

OPTION_ENABLE_USE_FABRIC_MEM = "EnableUseFabricMem"
OPTION_BUFFER_POOL = "BufferPool"
OPTION_RDMA_TRAFFIC_CLASS = "RdmaTrafficClass"
OPTION_RDMA_SERVICE_LEVEL = "RdmaServiceLevel"
OPTION_GLOBAL_RESOURCE_CONFIG = "GlobalResourceConfig"
OPTION_AUTO_CONNECT = "AutoConnect"
OPTION_LOCAL_COMM_RES = "LocalCommRes"

KNOWN_OPTIONS = (
    OPTION_ENABLE_USE_FABRIC_MEM,
    OPTION_BUFFER_POOL,
    OPTION_RDMA_TRAFFIC_CLASS,
    OPTION_RDMA_SERVICE_LEVEL,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_AUTO_CONNECT,
    OPTION_LOCAL_COMM_RES,
)


def _flag(key: str, value: str) -> bool:
    if value not in ("0", "1"):
        raise ParamInvalid(f"option {key!r} must be \"0\" or \"1\", got {value!r}")
    return value == "1"


def _int_in(key: str, value: str, lo: int, hi: int, multiple: int = 1) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ParamInvalid(f"option {key!r} must be an integer, got {value!r}") from None
    if not lo <= number <= hi or number % multiple:
        extra = f" and a multiple of {multiple}" if multiple > 1 else ""
        raise ParamInvalid(f"option {key!r} must be in [{lo}, {hi}]{extra}, got {number}")
    return number


@dataclass(frozen=True)
class EngineOptions:
    """Parsed options of one engine."""

    fabric_mem: bool = False
    auto_connect: bool = False
    buffer_pool: tuple[int, int] = (0, 0)
    rdma_traffic_class: int = 132
    rdma_service_level: int = 4
    global_resource_config: Mapping[str, object] | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str] | None) -> EngineOptions:
        """Validate HIXL's string options; unknown keys and bad values raise ParamInvalid."""
        values: dict[str, object] = {}
        for key, raw in (options or {}).items():
            if not isinstance(key, str) or not isinstance(raw, str):
                raise ParamInvalid(f"options map strings to strings; got {key!r}: {raw!r}")
            if key == OPTION_ENABLE_USE_FABRIC_MEM:
                values["fabric_mem"] = _flag(key, raw)
            elif key == OPTION_AUTO_CONNECT:
                values["auto_connect"] = _flag(key, raw)
            elif key == OPTION_BUFFER_POOL:
                values["buffer_pool"] = _buffer_pool(raw)
            elif key == OPTION_RDMA_TRAFFIC_CLASS:
                values["rdma_traffic_class"] = _int_in(key, raw, 0, 255, multiple=4)
            elif key == OPTION_RDMA_SERVICE_LEVEL:
                values["rdma_service_level"] = _int_in(key, raw, 0, 7)
            elif key in (OPTION_GLOBAL_RESOURCE_CONFIG, OPTION_LOCAL_COMM_RES):
                try:
                    parsed = json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise ParamInvalid(f"option {key!r} is not valid JSON: {exc}") from None
                if not isinstance(parsed, dict):
                    raise ParamInvalid(f"option {key!r} must be a JSON object")
                if key == OPTION_GLOBAL_RESOURCE_CONFIG:
                    values["global_resource_config"] = parsed
            else:
                raise ParamInvalid(
                    f"unknown option {key!r}; known options: {', '.join(KNOWN_OPTIONS)}")
        parsed_options = cls(**values)  # type: ignore[arg-type]
        if parsed_options.fabric_mem and parsed_options.buffer_pool != (0, 0):
            raise ParamInvalid(
                f"{OPTION_ENABLE_USE_FABRIC_MEM}=1 cannot be combined with {OPTION_BUFFER_POOL}"
                f" (as in HIXL); set {OPTION_BUFFER_POOL}=\"0:0\"")
        return parsed_options


def _buffer_pool(raw: str) -> tuple[int, int]:
    parts = raw.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ParamInvalid(
            f"option {OPTION_BUFFER_POOL!r} must be \"BUFFER_NUM:BUFFER_SIZE_MB\", got {raw!r}")
    return int(parts[0]), int(parts[1])
