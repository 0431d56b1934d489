"""Host memory for an engine that runs on the CPU: glibc malloc settings, and huge pages for the KV pool.

Every step allocates a few multi-megabyte tensors and frees them before the next: at 64 sequences the logits alone
are 12.6 MB in fp32, the sampler's probabilities and CDF as much again. glibc hands out blocks above its mmap
threshold (128 KiB, raised only as such blocks are freed) as fresh mappings, and trims freed memory off the top of
the heap, so a step's temporaries were page-faulted in anew on many steps: sampling 64 rows took 15 ms where the
same arithmetic on reused memory takes 4 ms (measured). Keeping blocks up to the threshold's ceiling (32 MiB on
64-bit) on the heap and not trimming it back lets each step reuse the last one's memory: the KV pool and the
weights, far larger, still get their own mappings. An explicit MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in
the environment wins, as does a preloaded allocator (tcmalloc, jemalloc), where mallopt is not glibc's.

The KV pool is read in scattered 2 KiB blocks; on 4 KiB pages nearly every block is a TLB miss, so the pool asks for
transparent huge pages (`madvise`, honoured where THP is in `madvise` or `always` mode) before it is first written.
It lives on its own anonymous mapping, whose pages the kernel zero-fills on first touch: the pool costs memory as
sequences write to it, not all at start (a 1 GiB pool zeroed by hand was 1 GiB resident before the first request).
The weights the kernels stream every step get the same pages (`huge_page_copies`), all on one mapping.

After the model is loaded, the heap holds hundreds of MiB that loading freed (GGUF dequantization's float32
copies, state-dict conversions) but glibc keeps, since the trim threshold above stops it from giving the heap
back: `release_free_heap` returns those pages once (malloc_trim), and the step buffers then settle on what stays.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os

import torch

log = logging.getLogger("inferlab.engine")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for it on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 512 * 2**20

_applied = False


def keep_step_buffers() -> bool:
    """Apply the settings once per process; returns whether they are in effect."""
    global _applied
    if _applied:
        return True
    if any(v in os.environ for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (or no dynamic loader to ask)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _applied:
        log.info("malloc settings for the CPU engine not applied (mallopt refused them)")
    return _applied


MADV_HUGEPAGE = 14
HUGE_PAGE = 2 * 2**20


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask the kernel to back a large CPU tensor with 2 MiB pages (transparent huge pages in `madvise` mode) before
    it is first written. Returns whether the advice was taken."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < 2 * HUGE_PAGE:
        return False
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return end > start and madvise(start, end - start, MADV_HUGEPAGE) == 0


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros on a private anonymous mapping of its own: the kernel gives each page as zeros when it
    is first touched, so untouched parts cost address space, not memory. The mapping lives as long as the tensor
    (torch.frombuffer keeps a reference to it)."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    # MAP_PRIVATE: Python's default for an anonymous map is MAP_SHARED, which is shmem (not anonymous memory, and no
    # transparent huge pages unless shmem_enabled allows them).
    buf = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def huge_page_copies(tensors: list[torch.Tensor], align: int = 64) -> list[torch.Tensor]:
    """Copies of CPU tensors laid end to end, in the order given, on one anonymous mapping of their own backed by
    2 MiB pages where THP allows: views of it, each starting on an `align`-byte boundary, that keep the mapping
    alive. For weights a kernel streams once a step: on 4 KiB pages every page is a TLB miss and the hardware
    prefetcher stops at each page's end, and a layer's matrices (0.6-3.5 MiB each for SmolLM2-135M) are each too
    small to get a huge page of their own; laid out in the order a step reads them, they also form one stream."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // align) * align
    # One huge page of slack, so the views can start on a 2 MiB boundary of the mapping (mmap aligns to 4 KiB).
    raw = zeroed_host_tensor((end + HUGE_PAGE,), torch.uint8)
    arena = raw[-raw.data_ptr() % HUGE_PAGE:][:end]
    advise_huge_pages(arena)
    copies = []
    for t, off, n in zip(tensors, offsets, sizes):
        c = arena[off:off + n].view(t.dtype).view(t.shape)
        c.copy_(t)
        copies.append(c)
    return copies


def release_free_heap() -> bool:
    """Give the heap's free pages back to the kernel once (glibc's malloc_trim(0)); returns whether any were.
    Call it after loading, never per step (it would undo keep_step_buffers)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


def available_memory() -> int:
    """Bytes the host can still give: MemAvailable, not MemTotal, since on a shared machine what other processes
    hold cannot hold our KV pool or weights. Falls back to physical memory where /proc is not readable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
