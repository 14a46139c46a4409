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


def launch_window(left: int, right: int, seqlen_q: int, seqlen_k: int, diag_offset: int,
                  varlen=None) -> tuple[int, int]:
    """``effective_window`` as every launcher applies it before its kernel sees the sides:
    against the tensors' lengths, or, for a packed call (``varlen``: its ``max_seqlen_q``
    and ``max_seqlen_k``), against the longest sequences. Sequence b's diagonal is
    len_k(b) - len_q(b): its left side hides nothing once left >= len_k(b) - 1 and its
    right side once right >= len_q(b) - 1, so a side that hides nothing of the longest
    sequences hides nothing of any. Idempotent: the API's own normalisation is kept."""
    if varlen is not None:
        seqlen_q, seqlen_k = varlen.max_seqlen_q, varlen.max_seqlen_k
        diag_offset = seqlen_k - seqlen_q
    return effective_window(left, right, seqlen_q, seqlen_k, diag_offset)


def effective_chunk(chunk: int, right: int, seqlen_q: int, seqlen_k: int, diag_offset: int,
                    varlen: bool = False) -> int:
    """0 (off) where chunked attention (``problem.spec``: query i sees only keys of its own
    chunk of ``chunk`` positions, [c, c + chunk) with c = floor((i + diag_offset) / chunk)
    * chunk) cannot hide a key, else ``chunk``.

    Exact: rows at positions p >= 0 and every key lie in chunk 0 once chunk > max(p, Sk - 1);
    rows at p < 0 (seqlen_q > seqlen_k, bottom-right) are in a chunk with no keys, which
    hides keys from them unless the window already does (right side < -p: causal). A
    packed call (``varlen``; the lengths are the longest sequences') may have such rows in
    any sequence: only a causal one can drop its chunk.
    """
    if chunk <= 0:
        return 0
    if varlen:
        negative_rows_see_keys = right != 0
    else:
        last_negative = min(-1, seqlen_q - 1 + diag_offset)  # the negative row nearest the keys
        negative_rows_see_keys = diag_offset < 0 and (right < 0 or last_negative + right >= 0)
    if not negative_rows_see_keys and max(seqlen_q - 1 + diag_offset, seqlen_k - 1) < chunk:
        return 0
    return chunk
