"""Engines built inside `row_invariant_packing()` multiply bf16 layers by inferlab's packed kernel at every step size,
also where the CPU has AMX and the default sends steps of four rows or more to oneDNN's GEMM
(layers/packed_linear.py: onednn_min_rows), whose roundings differ from the kernel's. Tests whose claim is that a
sequence's greedy tokens do not depend on what shared its steps build their engine so, as a user would with
INFERLAB_ONEDNN_MIN_ROWS=0. `onednn_from_rows(n)` sets the switch to any row count (n = 0: never)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def onednn_from_rows(rows: int) -> Iterator[None]:
    from inferlab.layers import packed_linear

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("INFERLAB_ONEDNN_MIN_ROWS", str(rows))
            packed_linear.onednn_min_rows.cache_clear()
            yield
    finally:
        packed_linear.onednn_min_rows.cache_clear()  # read again, from the restored environment, by the next engine


def row_invariant_packing():
    return onednn_from_rows(0)
