"""How many CPUs this process may actually use: its affinity mask and its cgroup's CPU quota (v1 or v2).

`os.cpu_count()` counts the machine; a container limited by `--cpus=1` (a CFS quota) or a process pinned by
`taskset` gets less. libgomp already sizes its default team from the affinity mask, but not from the quota: two
threads under a one-CPU quota burn it in half a period and sit throttled for the rest, stalling every parallel
region. Everything is read below `root` so tests can pass a fake `/proc` + `/sys` tree.

The quota rounds down (1.5 CPUs -> 1 thread, never below 1), as Go's automaxprocs does: for barrier-heavy
OpenMP code an idle half CPU costs less than a throttled thread.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class CpuBudget:
    affinity: int  # CPUs in the affinity mask
    quota: float | None  # CPUs' worth of time the cgroup allows per period; None = unlimited
    quota_source: str | None  # the file the quota came from

    @property
    def threads(self) -> int:
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, math.floor(self.quota + 1e-9)))

    def describe(self) -> str:
        quota = f"cgroup quota {self.quota:g} CPU ({self.quota_source})" if self.quota is not None else "no cgroup quota"
        return f"{self.threads} thread(s): affinity {self.affinity} CPU(s), {quota}"


def parse_cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' (the kernel's list format) -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def affinity_cpus(root: Path = Path("/")) -> int:
    """CPUs in this process's affinity mask, from /proc/self/status (Cpus_allowed_list)."""
    try:
        for line in (root / "proc/self/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return max(1, len(parse_cpu_list(line.split(":", 1)[1])))
    except (OSError, ValueError):
        pass
    if str(root) == "/" and hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _cgroup_paths(root: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 cpu-controller path) of this process, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _mounts(root: Path) -> list[tuple[str, str, str, str]]:
    """(fstype, mount point, root of the hierarchy it shows, super options) of each cgroup mount."""
    out = []
    try:
        lines = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        f, r = left.split(), right.split()
        if len(f) >= 5 and len(r) >= 3 and r[0] in ("cgroup", "cgroup2"):
            out.append((r[0], f[4], f[3], r[2]))
    return out


def _dirs(root: Path, mount: str, mount_root: str, path: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount point, innermost first. Inside a container the
    mount shows only its own subtree (mount_root), so that prefix is cut from the path first."""
    rel = path
    if mount_root not in ("", "/") and (rel == mount_root or rel.startswith(mount_root.rstrip("/") + "/")):
        rel = rel[len(mount_root):]
    parts = [p for p in rel.split("/") if p]
    base = root / mount.lstrip("/")
    dirs = [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()] or [base]


def _quota_v2(d: Path) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _quota_v1(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def _cpu_cgroup_dirs(root: Path) -> list[tuple[str, Path]]:
    """(fstype, directory) of this process's CPU cgroup and its ancestors, in every hierarchy that has one."""
    v2, v1 = _cgroup_paths(root)
    mounts = _mounts(root)
    if not mounts:  # no mountinfo (a minimal fake tree): the conventional places
        mounts = [("cgroup2", "/sys/fs/cgroup", "/", ""), ("cgroup2", "/sys/fs/cgroup/unified", "/", ""),
                  ("cgroup", "/sys/fs/cgroup/cpu,cpuacct", "/", "cpu"), ("cgroup", "/sys/fs/cgroup/cpu", "/", "cpu")]
    out = []
    for fstype, mount, mount_root, options in mounts:
        if fstype == "cgroup2" and v2 is not None:
            path = v2
        elif fstype == "cgroup" and v1 is not None and "cpu" in options.split(","):
            path = v1
        else:
            continue
        out += [(fstype, d) for d in _dirs(root, mount, mount_root, path)]
    return out


def cgroup_quota(root: Path = Path("/")) -> tuple[float | None, str | None]:
    """The tightest CPU quota on this process's cgroup and its ancestors (v2 cpu.max, v1 cpu.cfs_quota_us), in
    CPUs, and the file it came from; (None, None) when none is set or none can be read."""
    best: tuple[float | None, str | None] = (None, None)
    for fstype, d in _cpu_cgroup_dirs(root):
        read, name = (_quota_v2, "cpu.max") if fstype == "cgroup2" else (_quota_v1, "cpu.cfs_quota_us")
        q = read(d)
        if q is not None and (best[0] is None or q < best[0]):
            best = (q, "/" + str((d / name).relative_to(root)))
    return best


def throttle_stat_files(root: Path = Path("/")) -> list[Path]:
    """The cpu.stat files whose throttled time says a CPU quota on this process's cgroup (or an ancestor) held it
    back: v2 `throttled_usec`, v1 `throttled_time` (ns). Found once; read with `throttled_seconds`."""
    return [d / "cpu.stat" for _, d in _cpu_cgroup_dirs(root) if (d / "cpu.stat").is_file()]


def throttled_seconds(files: list[Path]) -> float:
    """The most throttled time, cumulative, of any of these cpu.stat files (each cgroup counts its own periods)."""
    best = 0.0
    for f in files:
        try:
            lines = f.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(" ")
            if key in ("throttled_usec", "throttled_time"):
                best = max(best, int(value) / (1e6 if key == "throttled_usec" else 1e9))
    return best


def cpu_budget(root: Path | str = "/") -> CpuBudget:
    root = Path(root)
    quota, source = cgroup_quota(root)
    return CpuBudget(affinity_cpus(root), quota, source)
