"""Huge pages for the KV pool and streamed weights: advice taken where THP is on, small tensors skipped, values kept."""

from __future__ import annotations

from pathlib import Path

import torch

from inferlab.common.host_memory import HUGE_PAGE, advise_huge_pages, huge_page_copies


def test_huge_page_advice_keeps_the_tensor_and_skips_small_ones():
    small = torch.zeros(1024)
    assert advise_huge_pages(small) is False
    big = torch.empty(8 * 2**20, dtype=torch.bfloat16)  # 16 MiB
    advised = advise_huge_pages(big)
    big.fill_(1.5)
    assert big.eq(1.5).all()
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if mode.exists() and "[never]" not in mode.read_text():
        assert advised  # the kernel accepts the advice where THP is on



def test_huge_page_copies_are_equal_aligned_and_on_one_mapping():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(960, 576, generator=g).bfloat16(), torch.randint(0, 256, (3, 33), dtype=torch.uint8),
               torch.randn(1000, 1001, generator=g)[:, ::2],  # not contiguous: copied into a contiguous view
               torch.randn(4096, 576, generator=g).half().view(torch.int16)]
    copies = huge_page_copies(tensors)
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t) and c.is_contiguous()
        assert c.data_ptr() % 64 == 0 and c.data_ptr() != t.data_ptr()
    assert copies[0].data_ptr() % HUGE_PAGE == 0  # the mapping's first huge page starts the first copy
    # end to end, in the order given: each starts at the previous one's end, rounded up to 64 bytes
    for a, b in zip(copies, copies[1:]):
        assert b.data_ptr() == a.data_ptr() + -(-a.numel() * a.element_size() // 64) * 64
    tensors[0].zero_()
    assert copies[0].abs().sum() > 0  # copies, not views of the originals
