"""Human-friendly sizes and durations for the YAML file: `512MiB`, `1.5GB`, `30m`, `1h30m`."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_BYTE_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")
_SIZE_HINT = "not a size: use bytes or a unit such as 512MiB, 1GiB, 1.5GB"

_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# `ms` comes first in the alternation so `500ms` is not read as 500 minutes and a stray `s`.
_DURATION_PART = r"(\d+(?:\.\d+)?)(ms|s|m|h|d)"
_DURATION = re.compile(rf"(?:{_DURATION_PART})+")
_DURATION_HINT = "not a duration: use seconds or units such as 500ms, 30s, 30m, 2h, 1h30m"


def parse_byte_size(value: Any) -> int:
    """Bytes from an int or a string such as `4096`, `512MiB`, `1GiB` or `1.5GB`."""
    if isinstance(value, str):
        match = _BYTE_SIZE.fullmatch(value.strip().lower())
        if match is None or match[2] not in _BYTE_UNITS:
            raise _error("byte_size", _SIZE_HINT, value)
        return int(float(match[1]) * _BYTE_UNITS[match[2]])
    # bool is an int subclass, but `ram: true` is a mistake, not one byte.
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise _error("byte_size", "a size cannot be negative", value)
        return value
    raise _error("byte_size", _SIZE_HINT, value)


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as `30`, `500ms`, `30m`, `2h`, `1d`, `1h30m`."""
    if isinstance(value, str):
        text = value.strip().lower()
        if _DURATION.fullmatch(text):
            seconds = sum(float(n) * _SECONDS[unit] for n, unit in re.findall(_DURATION_PART, text))
        else:
            try:
                seconds = float(text)
            except ValueError:
                raise _error("duration", _DURATION_HINT, value) from None
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise _error("duration", _DURATION_HINT, value)
    if not math.isfinite(seconds) or seconds < 0:
        raise _error("duration", "a duration must be a finite number of seconds >= 0", value)
    return seconds


def _error(kind: str, message: str, value: Any) -> PydanticCustomError:
    # A custom error keeps pydantic from prefixing "Value error, "; without a context dict the
    # message is used verbatim, so braces in the offending value are harmless.
    return PydanticCustomError(kind, f"{message} (got {value!r})")


ByteSize = Annotated[
    int,
    BeforeValidator(parse_byte_size),
    WithJsonSchema({"type": ["integer", "string"], "examples": [4096, "512MiB", "1.5GB"]}),
]
"""A size in bytes; YAML may spell it `4096`, `512MiB`, `1GiB` (binary) or `1.5GB` (decimal)."""

Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    WithJsonSchema({"type": ["number", "string"], "examples": [30, "500ms", "30m", "1h30m"]}),
]
"""A duration in seconds; YAML may spell it `30`, `500ms`, `30s`, `30m`, `2h`, `1d` or `1h30m`."""
