"""Resident-memory accounting read from /proc, checked against buffers whose residency the test controls and against
a child process whose memory it knows."""

from __future__ import annotations

import mmap
import subprocess
import sys

import pytest
import torch

from inferlab.common.host_memory import zeroed_host_tensor
from inferlab.common.process_memory import (PAGE, process_tree, reset_peak_rss, resident_bytes, rollup, tree_memory,
                                             tree_peak_rss)

MiB = 2**20

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _address(buf: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_resident_bytes_counts_the_pages_written_and_not_the_rest():
    buf = mmap.mmap(-1, 64 * MiB, flags=mmap.MAP_PRIVATE)
    addr = _address(buf)
    assert resident_bytes(addr, 64 * MiB) == 0  # reserved, never touched
    for off in range(0, 8 * MiB, PAGE):  # the first 8 MiB
        buf[off] = 1
    buf[40 * MiB] = 1  # and one page far away
    # transparent huge pages may bring in up to a 2 MiB page around each written byte
    assert 8 * MiB + PAGE <= resident_bytes(addr, 64 * MiB) <= 8 * MiB + 4 * MiB + 2 * MiB
    assert resident_bytes(addr + 8 * MiB + 2 * MiB, 16 * MiB) == 0  # between them (past any huge page)
    # a range that starts and ends inside pages counts only its own bytes
    assert resident_bytes(addr + 100, 200) == 200
    del addr
    buf.close()


def test_zeroed_host_tensor_is_zeros_and_costs_only_what_is_written():
    t = zeroed_host_tensor((4, 2, 1024, 1024), torch.bfloat16)  # 16 MiB, 4 MiB per t[i]
    assert t.shape == (4, 2, 1024, 1024) and t.dtype == torch.bfloat16
    assert resident_bytes(t.data_ptr(), 16 * MiB) == 0
    anon_before = rollup().anonymous
    t[1].fill_(3.0)
    # t[1] is resident; t[3], 4 MiB past it, never touched (huge pages reach at most 2 MiB past a write)
    assert resident_bytes(t[1].data_ptr(), 4 * MiB) == 4 * MiB
    assert resident_bytes(t[3].data_ptr(), 4 * MiB) == 0
    assert rollup().anonymous - anon_before >= 4 * MiB - PAGE
    assert t[1].eq(3.0).all() and not t[0].any() and not t[2:].any()  # the rest reads as zeros


def test_rollup_and_tree_memory_see_a_child_that_holds_a_known_amount():
    # The child writes 96 MiB and waits; the tree's anonymous memory grows by that, our own does not.
    code = "import sys; b = bytearray(96 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ok', flush=True); " \
           "sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ok"
        mine = rollup()
        tree = tree_memory(child.pid)
        assert tree.anonymous >= 96 * MiB
        assert tree.rss >= tree.anonymous and tree.pss <= tree.rss
        assert process_tree(child.pid) == [child.pid]
        whole = tree_memory(__import__("os").getpid())  # this process and the child
        assert whole.anonymous >= mine.anonymous + 96 * MiB - 8 * MiB
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    with pytest.raises(ProcessLookupError):
        tree_memory(child.pid)


def test_tree_peak_rss_holds_a_freed_peak_until_reset():
    # The child writes 96 MiB and frees it: its peak stays; a reset starts the mark again at what it holds now.
    code = ("import sys\n"
            "for line in sys.stdin:\n"
            "    b = bytearray(int(line) * 2**20); b[::4096] = b'x' * len(b[::4096]); del b\n"
            "    print('ok', flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child.stdin.write("96\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ok"
        now = rollup(child.pid).rss
        assert tree_peak_rss(child.pid) >= now + 96 * MiB - 8 * MiB  # freed (bytearray's pages go back), peak kept
        reset_peak_rss(child.pid)
        assert tree_peak_rss(child.pid) < now + 16 * MiB
        child.stdin.write("48\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ok"
        assert now + 40 * MiB <= tree_peak_rss(child.pid) < now + 96 * MiB
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    with pytest.raises(ProcessLookupError):
        tree_peak_rss(child.pid)
