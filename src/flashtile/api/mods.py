"""Ready-made score and mask functions for ``flex_attention`` (and torch's).

Mask functions (``mask_mod(b, h, q_idx, kv_idx) -> bool``), for ``create_block_mask``:

    causal                          query i sees keys j <= i (top-left, as SDPA's is_causal)
    sliding_window(left, right=0)   keys in [i - left, i + right]
    chunked(size)                   keys in the query's chunk of ``size`` positions (Llama 4)
    document(doc_ids)               keys of the query's document (doc_ids: (L,) ints, one per
                                    token of a packed sequence, or (B, L))
    document_from_cu_seqlens(cu, total)   the same from flash-attn's cu_seqlens
    prefix_lm(prefix)               bidirectional over the first ``prefix`` keys, causal after
                                    (an int or a (B,) tensor)
    and_masks(*mods), or_masks(*mods)     every / any of several masks

Score functions (``score_mod(score, b, h, q_idx, kv_idx) -> score``):

    alibi(slopes)       score - slopes[h] * |i - j| (slopes: (H,) float32)
    softcap(cap)        cap * tanh(score / cap)
    relative_bias(table)  score + table[h, i - j + S - 1] (table: (H, L + S - 1), learnable)
    bias(table)         score + table[i, j] ((L, S), learnable)

Every one is written with the torch ops the kernels' translator takes
(``backends/triton/modgen.py``), so they run on the twin, on torch's flex_attention and on
flashtile's kernels alike. Those with a built-in equivalent (causal, sliding_window,
alibi, softcap) carry it as ``flashtile_builtin``: a flex call made of them alone, with a
block mask from ``flashtile.create_block_mask``, runs flashtile's built-in kernels (the
same attention; ``dispatch.flex_builtin``).
"""

from __future__ import annotations

from typing import Callable

import torch

from flashtile.problem.validate import mod_parameter, mod_tensor

__all__ = ["causal", "sliding_window", "chunked", "document", "document_from_cu_seqlens", "prefix_lm",
           "and_masks", "or_masks", "alibi", "softcap", "relative_bias", "bias"]


def causal(b, h, q_idx, kv_idx):
    """Query i sees keys j <= i."""
    return q_idx >= kv_idx


causal.flashtile_builtin = {"window": (-1, 0)}


def sliding_window(left: int, right: int = 0) -> Callable:
    """Query i sees keys j with i - left <= j <= i + right (right=0: causal)."""
    mod_parameter("sliding_window's left", left, 0)
    mod_parameter("sliding_window's right", right, 0)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)

    sliding_window_mask.flashtile_builtin = {"window": (left, right)}
    return sliding_window_mask


def chunked(size: int) -> Callable:
    """Query i sees keys j of its chunk: i // size == j // size (and j <= i)."""
    mod_parameter("chunked's size", size, 1)

    def chunked_mask(b, h, q_idx, kv_idx):
        return (q_idx // size == kv_idx // size) & (q_idx >= kv_idx)

    return chunked_mask


def document(doc_ids: torch.Tensor) -> Callable:
    """Query i sees the keys of its own document: doc_ids[i] == doc_ids[j] (doc_ids (L,) or
    (B, L): one id per token of a packed sequence). Combine with ``causal`` by ``and_masks``."""
    mod_tensor("doc_ids", doc_ids, (1, 2))
    if doc_ids.dim() == 1:
        def document_mask(b, h, q_idx, kv_idx):
            return doc_ids[q_idx] == doc_ids[kv_idx]
    else:
        def document_mask(b, h, q_idx, kv_idx):
            return doc_ids[b, q_idx] == doc_ids[b, kv_idx]
    return document_mask


def document_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> Callable:
    """``document`` from flash-attn's cu_seqlens ((n + 1,) int, cu_seqlens[-1] <= total;
    tokens past cu_seqlens[-1] form one more document)."""
    positions = torch.arange(total, device=cu_seqlens.device)
    doc_ids = torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)
    return document(doc_ids)


def prefix_lm(prefix) -> Callable:
    """Every query sees the first ``prefix`` keys; after them, causal (an int, or a (B,)
    tensor: one prefix length per sequence)."""
    if isinstance(prefix, torch.Tensor):
        def prefix_lm_mask(b, h, q_idx, kv_idx):
            return (kv_idx < prefix[b]) | (q_idx >= kv_idx)
    else:
        def prefix_lm_mask(b, h, q_idx, kv_idx):
            return (kv_idx < prefix) | (q_idx >= kv_idx)
    return prefix_lm_mask


def and_masks(*mods: Callable) -> Callable:
    """Visible where every mask says visible."""
    def and_mask(b, h, q_idx, kv_idx):
        keep = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            keep = keep & mod(b, h, q_idx, kv_idx)
        return keep

    return and_mask


def or_masks(*mods: Callable) -> Callable:
    """Visible where any mask says visible."""
    def or_mask(b, h, q_idx, kv_idx):
        keep = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            keep = keep | mod(b, h, q_idx, kv_idx)
        return keep

    return or_mask


def alibi(slopes: torch.Tensor) -> Callable:
    """ALiBi: score - slopes[h] * |i - j| (slopes (H,), one per query head)."""
    def alibi_score(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    alibi_score.flashtile_builtin = {"alibi": slopes}
    return alibi_score


def softcap(cap: float) -> Callable:
    """Gemma 2's soft cap: cap * tanh(score / cap)."""
    mod_parameter("softcap", cap, 0, strict=True)

    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    softcap_score.flashtile_builtin = {"softcap": float(cap)}
    return softcap_score


def relative_bias(table: torch.Tensor, seqlen_k: int) -> Callable:
    """score + table[h, i - j + seqlen_k - 1]: a learnable bias per head and relative
    position (table (H, L + seqlen_k - 1))."""
    def relative_bias_score(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + (seqlen_k - 1)]

    return relative_bias_score


def bias(table: torch.Tensor) -> Callable:
    """score + table[i, j]: a full learnable (L, S) bias."""
    def bias_score(score, b, h, q_idx, kv_idx):
        return score + table[q_idx, kv_idx]

    return bias_score
