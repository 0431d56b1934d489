"""Was the machine busy while a load point ran? CPU accounting from /proc, read at the start and end of the point.

A benchmark on a busy machine measures the neighbour, not the server: on a 2-core machine, one compile in another
terminal cut inferlab's `make run` from 231 to 9.7 output tok/s. And a client that saturates its own event loop
inflates every latency it reports. So each load point records (definitions and thresholds in docs/metrics.md):

- foreign_cpu_share: CPU time used by processes other than bench and the server under test, over the machine's
  capacity (all CPUs x the interval). The server is known when bench started it, or when it listens on a
  loopback port (found through /proc/net/tcp); its descendants (worker processes) count as the server.
- bench_cpu_share / bench_cpu_cores: bench's own CPU (its worker processes included once reaped).
- server_cpu_share: the server's CPU, when it is local.
- cpu_pressure_some_avg: the share of the interval in which some runnable task waited for a CPU (PSI), in %.

Linux only; elsewhere, or without /proc, the fields are None and no verdict is given.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

FOREIGN_MAX = 0.10  # other processes using 10% of the machine's CPU make a load point contaminated
CLIENT_BUSY = 0.80  # bench using 80% of a core per process (one event loop each) is client-bound
LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "[::1]"}


def _ticks(stat_line: str) -> tuple[int, int]:
    """(own, reaped children's) CPU ticks from a /proc/<pid>/stat line; the name in parentheses may hold spaces."""
    f = stat_line.rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12]), int(f[13]) + int(f[14])


def _ppid(stat_line: str) -> int:
    return int(stat_line.rsplit(")", 1)[1].split()[1])


@dataclass(slots=True)
class Snapshot:
    wall: float
    busy: int  # ticks all CPUs spent neither idle nor in iowait
    total: int  # ticks of all CPUs
    cpus: int
    bench: int  # bench's own ticks plus its reaped children's (worker processes)
    server: dict[int, int]  # pid -> ticks, the server and its descendants
    pressure_us: int | None  # /proc/pressure/cpu "some total", microseconds


@dataclass(slots=True)
class MachineSampler:
    """`start()` before a load point, `stop()` after it: the machine's CPU accounting over the interval."""

    server_pid: int | None = None
    root: Path = Path("/")
    clock: Callable[[], float] = time.monotonic
    clk_tck: int = field(default_factory=lambda: os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
    _start: Snapshot | None = None
    _pids: list[int] = field(default_factory=list)

    def _read(self, rel: str) -> str:
        return (self.root / rel).read_text()

    def _descendants(self) -> list[int]:
        if self.server_pid is None:
            return []
        parents: dict[int, int] = {}
        for d in (self.root / "proc").iterdir():
            if d.name.isdigit():
                try:
                    parents[int(d.name)] = _ppid((d / "stat").read_text())
                except (OSError, ValueError, IndexError):
                    pass
        tree, frontier = [self.server_pid], [self.server_pid]
        while frontier:
            frontier = [p for p, pp in parents.items() if pp in frontier and p not in tree]
            tree += frontier
        return tree

    def snapshot(self, pids: list[int]) -> Snapshot | None:
        try:
            lines = self._read("proc/stat").splitlines()
            cpu = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
            cpus = sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit())
            own, reaped = _ticks(self._read("proc/self/stat"))
        except (OSError, ValueError, IndexError):
            return None
        server = {}
        for pid in pids:
            try:
                server[pid] = _ticks(self._read(f"proc/{pid}/stat"))[0]
            except (OSError, ValueError, IndexError):
                pass
        try:
            some = next(ln for ln in self._read("proc/pressure/cpu").splitlines() if ln.startswith("some "))
            pressure = int(some.rsplit("total=", 1)[1])
        except (OSError, ValueError, StopIteration, IndexError):
            pressure = None
        return Snapshot(self.clock(), sum(cpu) - cpu[3] - cpu[4], sum(cpu), max(1, cpus), own + reaped, server,
                        pressure)

    def start(self) -> None:
        self._pids = self._descendants()
        self._start = self.snapshot(self._pids)

    def stop(self, workers: int = 1) -> dict:
        """The interval's figures (see the module doc) and the verdicts; None where unmeasurable."""
        a, b = self._start, self.snapshot(self._pids)
        out: dict = {"interval_s": None, "cpu_count": None, "busy_share": None, "foreign_cpu_share": None,
                     "bench_cpu_share": None, "bench_cpu_cores": None, "server_cpu_share": None,
                     "server_pid": self.server_pid, "cpu_pressure_some_avg": None,
                     "contaminated": None, "client_bound": None}
        if a is None or b is None or b.total <= a.total:
            return out
        total, wall = b.total - a.total, b.wall - a.wall
        bench = b.bench - a.bench
        server = sum(b.server[p] - a.server[p] for p in a.server if p in b.server)
        busy = b.busy - a.busy
        out.update(interval_s=wall, cpu_count=b.cpus, busy_share=busy / total,
                   foreign_cpu_share=max(0, busy - bench - server) / total, bench_cpu_share=bench / total,
                   bench_cpu_cores=bench / self.clk_tck / wall if wall > 0 else None,
                   server_cpu_share=server / total if self.server_pid is not None else None)
        if a.pressure_us is not None and b.pressure_us is not None and wall > 0:
            out["cpu_pressure_some_avg"] = 100.0 * (b.pressure_us - a.pressure_us) / 1e6 / wall
        out["contaminated"] = out["foreign_cpu_share"] >= FOREIGN_MAX
        if out["bench_cpu_cores"] is not None:
            out["client_bound"] = out["bench_cpu_cores"] >= CLIENT_BUSY * max(1, workers)
        return out


def machine_warnings(m: dict | None) -> list[str]:
    """The warnings a load point's machine figures call for (shown by the table, the HTML report, diagnose)."""
    if not m:
        return []
    out = []
    if m.get("contaminated"):
        pressure = m.get("cpu_pressure_some_avg")
        out.append(f"contaminated: other processes used {m['foreign_cpu_share']:.0%} of this machine's CPU during "
                   f"the run (threshold {FOREIGN_MAX:.0%})"
                   + (f", and tasks waited for a CPU {pressure:.0f}% of the time" if pressure is not None else "")
                   + ": the figures measure a busy machine; rerun on a quiet one")
    if m.get("client_bound"):
        out.append(f"client-bound: bench itself used {m['bench_cpu_cores']:.2f} CPU cores (threshold "
                   f"{CLIENT_BUSY:.0%} of a core per process): its own delays are inside the latencies; "
                   f"raise --workers or run bench on another machine")
    return out


def verdict_lines(results: dict) -> list[str]:
    """One closing line per kind of trouble over all load points, printed even with --quiet: a number measured on
    a busy machine must not travel without its warning."""
    runs = results.get("runs") or []
    out = []
    for key, what in (("contaminated", "on a busy machine (contaminated)"), ("client_bound", "client-bound")):
        bad = [r["load"]["label"] for r in runs if (r.get("machine") or {}).get(key)]
        if bad:
            out.append(f"warning: {len(bad)} of {len(runs)} load point(s) measured {what}: {', '.join(bad)}; "
                       f"see the warnings in the results")
    return out


def local_server_pid(base_url: str, root: Path = Path("/")) -> int | None:
    """The pid listening on base_url's port when the host is a loopback address (a server on this machine that
    bench did not start); None otherwise or when it cannot be found (another user's process, no /proc)."""
    parts = urlsplit(base_url)
    if parts.hostname not in LOOPBACK and f"[{parts.hostname}]" not in LOOPBACK:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    inodes = set()
    for name in ("proc/net/tcp", "proc/net/tcp6"):
        try:
            lines = (root / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return None
    for d in (root / "proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(d.name)
        except OSError:
            continue
    return None
