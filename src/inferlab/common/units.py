"""Quantities with units, as cards and flags write them: "500ms", "2.5s", "20GiB", "10/s"; and milliseconds for
reports. The one definition: cards, bench's flags and SLOs, and the engine's --kv-cache-memory all read these.

The rules:
- A bare number ('500', 500, 0.5) is refused: '500' could be ms or s, '8' bytes or GB, and a wrong guess is
  silent. A caller whose flag is documented in one unit says so with `bare=` (bench's --timeout 600 is seconds,
  --kv-cache-memory 1073741824 is bytes); a bare number is then read in that unit.
- Time units: us (or µs), ms, s, and m or min for minutes (as Go, Prometheus and systemd write durations).
- Size units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024), case-insensitive. A
  bare 'm' or 'g' is refused for sizes: it could mean MB or MiB.
- Rates: a count per s or per min.
"""

from __future__ import annotations

import argparse
import re

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_TIME = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0}
_SIZE = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40}


class UnitError(ValueError, argparse.ArgumentTypeError):
    """A quantity that cannot be read. An ArgumentTypeError too, so argparse shows its message for a flag."""


def _bare_number(value) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or re.fullmatch(r"[-+]?" + _NUM, str(value).strip()) is not None


def _with_unit(value, what: str, bare: str | None, example: str) -> str:
    if not _bare_number(value):
        return str(value).strip()
    if bare is None:
        raise UnitError(f"{what}: {value!r} has no unit; write e.g. {example.format(v=value)}")
    return f"{value}{bare}"


def parse_duration(value: str | int | float, what: str = "duration", *, bare: str | None = None) -> float:
    """'500ms' -> 0.5 (seconds); '2m' -> 120. Signed values are read ('-5ms'); the caller judges the sign."""
    text = _with_unit(value, what, bare, "'{v}ms' or '{v}s'")
    m = re.fullmatch(r"([-+]?)" + _NUM + r"\s*([a-zµ]+)", text.lower())
    if not m:
        raise UnitError(f"{what}: cannot read {value!r} as a duration; write e.g. '500ms', '2s' or '1.5min'")
    sign, num, unit = m.groups()
    if unit not in _TIME:
        raise UnitError(f"{what}: unknown time unit {unit!r} in {value!r} (use us, ms, s, m or min)")
    return float(sign + num) * _TIME[unit]


def parse_bytes(value: str | int, what: str = "size", *, bare: str | None = None) -> int:
    """'20GiB' -> 21474836480; '512 MiB', '2GB'. With bare='B', '1073741824' is a byte count."""
    text = _with_unit(value, what, bare, "'{v}GB' or '{v}GiB'")
    m = re.fullmatch(_NUM + r"\s*([a-z]+)", text.lower())
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


def format_ms(seconds: float | None, unit: bool = True) -> str:
    """Seconds as milliseconds with about four significant digits ('12.35 ms', '512.3 ms'); '–' for a figure
    not measured. unit=False for a table cell whose heading names the unit."""
    if seconds is None:
        return "–"
    ms = seconds * 1e3
    digits = 3 if abs(ms) < 10 else 2 if abs(ms) < 100 else 1 if abs(ms) < 1000 else 0
    return f"{ms:.{digits}f}" + (" ms" if unit else "")
