"""Quantities with units, as cards and flags write them: "500ms", "2.5s", "20GiB", "10/s"."""

from __future__ import annotations

import re

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_TIME = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}
_SIZE = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40}


class UnitError(ValueError):
    pass


def _bare_number(value) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or re.fullmatch(r"[-+]?" + _NUM, str(value).strip()) is not None


def parse_duration(value: str | int | float, what: str = "duration") -> float:
    """'500ms' -> 0.5 (seconds). A bare number is refused: '500' could be ms or s, and a wrong guess is silent."""
    if _bare_number(value):
        raise UnitError(f"{what}: {value!r} has no unit; write e.g. '{value}ms' or '{value}s'")
    m = re.fullmatch(r"([-+]?)" + _NUM + r"\s*([a-zµ]+)", str(value).strip().lower())
    if not m:
        raise UnitError(f"{what}: cannot read {value!r} as a duration; write e.g. '500ms', '2s' or '1.5min'")
    sign, num, unit = m.groups()
    num = sign + num
    if unit not in _TIME:
        raise UnitError(f"{what}: unknown time unit {unit!r} in {value!r} (use us, ms, s or min)")
    return float(num) * _TIME[unit]


def parse_bytes(value: str | int, what: str = "size") -> int:
    """'20GiB' -> 21474836480. A bare number is refused for the same reason as durations."""
    if _bare_number(value):
        raise UnitError(f"{what}: {value!r} has no unit; write e.g. '{value}GB' or '{value}GiB'")
    m = re.fullmatch(_NUM + r"\s*([a-z]+)", str(value).strip().lower())
    if not m or m.group(2) not in _SIZE:
        raise UnitError(f"{what}: cannot read {value!r} as a size; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    return int(float(m.group(1)) * _SIZE[m.group(2)])


def parse_rate(value: str | int | float, what: str = "rate") -> float:
    """'10/s' or '600/min' -> requests per second."""
    if _bare_number(value):
        raise UnitError(f"{what}: {value!r} has no unit; write e.g. '{value}/s'")
    m = re.fullmatch(_NUM + r"\s*/\s*(s|min)", str(value).strip().lower())
    if not m:
        raise UnitError(f"{what}: cannot read {value!r} as a rate; write e.g. '10/s' or '600/min'")
    return float(m.group(1)) / (60.0 if m.group(2) == "min" else 1.0)


def format_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"
