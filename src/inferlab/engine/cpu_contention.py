"""How much of the CPU the engine's threads actually get, measured without a reference.

A step-time reference cannot tell a busy machine from a slow one when the machine was already busy at start-up
(the reference is then the stalled time). The scheduler itself keeps the answer: `/proc/self/task/*/schedstat`
holds, per thread, the nanoseconds it spent runnable but waiting for a CPU (run_delay). On a quiet machine our
threads wait little (the bench client or the event loop now and then); with a neighbour in another session under
autogroup, each of two OpenMP threads waits half the time. `/proc/stat` minus our own CPU time adds what the
other processes use, so the adapter probes more threads only when a core is actually free.

Linux only; elsewhere `read()` returns None and the adapter relies on step times alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True, frozen=True)
class Contention:
    wall: float  # seconds the sample covers
    wait_share: float  # our threads' time runnable-but-waiting over the interval, per thread of the team
    foreign_cpus: float  # CPUs' worth of time other processes used over the interval
    cpus: int  # the machine's CPUs


@dataclass(slots=True)
class ContentionMeter:
    """`read(team)` returns the contention since the previous read (None on the first, or without /proc)."""

    root: Path = Path("/")
    clock: Callable[[], float] = time.monotonic
    _last: tuple[float, int, int, int] | None = None  # (wall, run_delay ns, busy ticks, own ticks)
    _cpus: int = 1
    _ok: bool = True
    _tck: int = field(default_factory=lambda: os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)

    def _run_delay_ns(self) -> int:
        total = 0
        for task in (self.root / "proc/self/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[1])
            except (OSError, ValueError, IndexError):
                pass  # a thread that ended between listing and reading
        return total

    def _busy_ticks(self) -> int:
        """Ticks all CPUs spent neither idle nor in iowait, from /proc/stat (which also counts the CPUs)."""
        lines = (self.root / "proc/stat").read_text().splitlines()
        self._cpus = max(1, sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit()))
        f = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(f) - f[3] - f[4]

    def _own_ticks(self) -> int:
        f = (self.root / "proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])  # utime + stime, all threads

    def read(self, team: int) -> Contention | None:
        if not self._ok:
            return None
        try:
            now = self.clock()
            sample = (now, self._run_delay_ns(), self._busy_ticks(), self._own_ticks())
        except (OSError, ValueError, IndexError):
            self._ok = False  # no schedstat or /proc/stat here: stop trying
            return None
        last, self._last = self._last, sample
        if last is None or now <= last[0]:
            return None
        wall = now - last[0]
        foreign = max(0.0, ((sample[2] - last[2]) - (sample[3] - last[3])) / self._tck / wall)
        return Contention(wall, (sample[1] - last[1]) / 1e9 / wall / max(1, team), foreign, self._cpus)
