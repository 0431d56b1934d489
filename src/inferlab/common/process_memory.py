"""Resident memory of processes, read from /proc (Linux): what a server holds, and which bytes of it a tensor holds.

Two questions need two readings. Comparing servers (benchmarks/peers.py) needs the resident set of a process tree
(vLLM runs an API process and an engine process). Finding where one process's memory goes
(benchmarks/memory_footprint.py) needs to know, for a buffer at a known address, how many of its pages are
resident: a reserved but never written KV pool costs address space, not memory, and /proc/self/pagemap says which
pages are present.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PRESENT = 1 << 63  # pagemap entry bit 63: page present in RAM (bit 62: swapped)
_SWAPPED = 1 << 62


@dataclass(slots=True)
class MemoryRollup:
    """/proc/PID/smaps_rollup in bytes: rss counts shared pages in full, pss splits them among their sharers."""
    rss: int
    pss: int
    anonymous: int  # private memory the process wrote (heap, tensors): what it alone costs the machine
    file: int  # file-backed pages resident (shared libraries, a mapped model file): the page cache's, reclaimable


def rollup(pid: int | str = "self") -> MemoryRollup:
    """One process's resident memory. Raises OSError where the process is gone or /proc is not readable."""
    vals: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                vals[parts[0].rstrip(":")] = int(parts[1]) * 1024
    rss = vals.get("Rss", 0)
    anon = vals.get("Anonymous", 0)
    return MemoryRollup(rss=rss, pss=vals.get("Pss", 0), anonymous=anon, file=rss - anon - vals.get("Shmem", 0))


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            # the command name may hold spaces and parentheses: the fields after the last ')' are fixed
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        kids.setdefault(ppid, []).append(int(p.name))
    return kids


def process_tree(pid: int) -> list[int]:
    """pid and every live descendant."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def tree_memory(pid: int) -> MemoryRollup:
    """The sum over a process tree. RSS double-counts libraries the processes share; PSS does not, so PSS is the
    fair figure for a multi-process server and RSS the one `ps` and top show."""
    total = MemoryRollup(0, 0, 0, 0)
    found = False
    for p in process_tree(pid):
        try:
            r = rollup(p)
        except OSError:
            continue  # a child that exited between the listing and the read
        found = True
        total.rss += r.rss
        total.pss += r.pss
        total.anonymous += r.anonymous
        total.file += r.file
    if not found:
        raise ProcessLookupError(f"no process {pid} (or /proc/{pid}/smaps_rollup is not readable)")
    return total


def _peak_rss(pid: int) -> int:
    """VmHWM from /proc/PID/status: the kernel's own high-water mark of the process's RSS, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no VmHWM in /proc/{pid}/status")


def reset_peak_rss(pid: int) -> None:
    """Restart the high-water mark of every process in the tree at its current RSS (clear_refs 5, Linux 4.0+)."""
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            continue  # exited, or not ours to reset: its peak then counts from its start


def tree_peak_rss(pid: int) -> int:
    """The sum of each process's peak RSS since its last reset. Reading it costs nothing while the processes run,
    unlike sampling smaps_rollup, which took 17 ms of CPU a read for a 1 GiB server and holds its mmap lock meanwhile
    (sampled every 0.25 s it cost a 2-core server at one stream several percent, measured). The processes' peaks
    need not coincide, so the sum is an upper bound of the tree's peak."""
    total, found = 0, False
    for p in process_tree(pid):
        try:
            total += _peak_rss(p)
            found = True
        except OSError:
            continue
    if not found:
        raise ProcessLookupError(f"no process {pid} (or /proc/{pid}/status is not readable)")
    return total


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of [address, address + nbytes) in this process that are in RAM (whole pages at the ends counted in
    part), read from /proc/self/pagemap. Swapped pages are not counted; a never-written page that was read maps
    the kernel's shared zero page and counts here, though not in RSS."""
    if nbytes <= 0:
        return 0
    first, last = address // PAGE, (address + nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        data = f.read((last - first + 1) * 8)
    present = 0
    for i, entry in enumerate(memoryview(data).cast("Q")):
        if entry & _PRESENT and not entry & _SWAPPED:
            page = first + i
            present += min(address + nbytes, (page + 1) * PAGE) - max(address, page * PAGE)
    return present
