"""What /proc/cpuinfo says about this CPU (Linux); empty where it cannot be read."""

from __future__ import annotations


def cpuinfo_field(key: str) -> str:
    """The first core's value for `key` ("model name", "vendor_id", ...), or "" if absent or unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == key), "")
    except OSError:
        return ""
