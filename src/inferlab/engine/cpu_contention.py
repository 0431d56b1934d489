"""How much of the machine's CPU other processes use, and how long a CPU quota held us back, from /proc and the
cgroup's cpu.stat, without a reference.

A server started beside a busy neighbour never sees a quiet step, so step times alone cannot tell it that its
threads share their cores (the thread adapter's reference would be the stalled time). Before the model loads, our
threads are idle: the machine's busy time (/proc/stat) minus our own (/proc/self/stat) is then what the others use.
A busy loop in another login session shows as 1.0 CPU of 2.

While serving it is evidence, not a trigger: the others then include the bench client (0.2-0.8 CPU on the 2-core
machine at 8-64 streams, measured), so what they use cannot say on its own that the team shares its cores. But a
step slowdown with no other process holding a core and no quota throttling us comes from somewhere fewer threads
cannot help (the host's own noise, our own event loop), and the thread adapter keeps its team then.

Linux only; elsewhere `read()` returns None.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from inferlab.common.cpu_budget import throttle_stat_files, throttled_seconds


@dataclass(slots=True, frozen=True)
class Contention:
    wall: float  # seconds the sample covers
    foreign_cpus: float  # CPUs' worth of time other processes used over the interval
    cpus: int  # the machine's CPUs
    throttled: float = 0.0  # the share of the interval a CPU quota on our cgroup (or an ancestor) held us back


@dataclass(slots=True)
class ContentionMeter:
    """`read()` returns what other processes used since the previous read (None on the first, or without /proc)."""

    root: Path = Path("/")
    clock: Callable[[], float] = time.monotonic
    _last: tuple[float, int, int, float] | None = None  # (wall, busy ticks, own ticks, throttled seconds)
    _ok: bool = True
    _cpus: int = 1
    _tck: int = field(default_factory=lambda: os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
    _throttle_files: list[Path] | None = None

    def _busy_ticks(self) -> int:
        """Ticks all CPUs spent neither idle nor in iowait, from /proc/stat (which also counts the CPUs)."""
        lines = (self.root / "proc/stat").read_text().splitlines()
        self._cpus = max(1, sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit()))
        f = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(f) - f[3] - f[4]

    def _own_ticks(self) -> int:
        f = (self.root / "proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])  # utime + stime, all threads

    def read(self) -> Contention | None:
        if not self._ok:
            return None
        try:
            if self._throttle_files is None:
                self._throttle_files = throttle_stat_files(self.root)
            sample = (self.clock(), self._busy_ticks(), self._own_ticks(), throttled_seconds(self._throttle_files))
        except (OSError, ValueError, IndexError):
            self._ok = False  # no /proc here: stop trying
            return None
        last, self._last = self._last, sample
        if last is None or sample[0] <= last[0]:
            return None
        wall = sample[0] - last[0]
        foreign = max(0.0, ((sample[1] - last[1]) - (sample[2] - last[2])) / self._tck / wall)
        throttled = min(1.0, max(0.0, (sample[3] - last[3]) / wall))
        return Contention(wall, foreign, self._cpus, throttled)
