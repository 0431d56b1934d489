"""Huge-page advice for the KV pool: taken where THP is on, skipped for small tensors, values untouched."""

from __future__ import annotations

from pathlib import Path

import torch

from inferlab.common.host_memory import advise_huge_pages


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

