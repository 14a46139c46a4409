"""Normalisation of attention windows (pure Python: no torch, no triton)."""

from __future__ import annotations


def effective_window(left: int, right: int, seqlen_q: int, seqlen_k: int, diag_offset: int) -> tuple[int, int]:
    """Replace window sides that cannot hide any key by -1 (unbounded).

    Exact, not a heuristic: row i's left edge i + diag_offset - left is <= 0 for every row
    once left >= seqlen_q - 1 + diag_offset, and its right edge is >= seqlen_k - 1 once
    right >= seqlen_k - 1 - diag_offset. It also keeps huge windows (2**31 - 1) from
    overflowing the kernels' int32 index arithmetic.
    """
    if left >= 0 and left >= seqlen_q - 1 + diag_offset:
        left = -1
    if right >= 0 and right >= seqlen_k - 1 - diag_offset:
        right = -1
    return left, right
