"""torch's ``scaled_dot_product_attention`` semantics on flashtile's kernels."""

from __future__ import annotations

from typing import Optional

import torch

from flashtile.dispatch import _Problem, _attention
from flashtile.problem.validate import (_check_dropout, _check_head_dim, _check_heads, _check_mask, _check_same,
                                        _check_scale, _check_tensor, _flag, _unit_last_stride)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (same semantics).

    Args:
        query: (batch, heads, L, E) or (batch, L, E); float16/bfloat16/float32.
        key, value: (batch, heads_kv, S, E) / (batch, S, E). heads_kv must equal heads
            unless ``enable_gqa`` (then heads % heads_kv == 0). value's E must equal E.
        attn_mask: broadcastable to (batch, heads, L, S). bool: True = take part;
            float (query's dtype or float32): added to the scores. Evaluated inside the
            kernel tile by tile, never expanded in memory. Huge negative biases
            (torch.finfo(float32 or bfloat16).min, transformers' "hidden") behave as in
            torch: a row that only such keys reach spreads evenly over them (the mean of
            their values), with the gradients of that even softmax on every backend; a row
            whose keys are all -inf gives 0.
        dropout_p: as in torch: applied only when > 0 (pass 0.0 at evaluation time).
        is_causal: top-left aligned (torch's ``tril``): query i sees keys j <= i. Not
            together with attn_mask (as in torch).
        scale: defaults to 1 / sqrt(E).

    Returns:
        (batch, heads, L, E) in query's dtype (a transposed view of a (batch, L, heads, E)
        buffer, as torch's flash backend returns). Rows with no visible key give 0.
    """
    squeeze = isinstance(query, torch.Tensor) and query.dim() == 3
    ndim = 3 if squeeze else 4
    _check_tensor("query", query, ndim)
    _check_tensor("key", key, ndim)
    _check_tensor("value", value, ndim)
    _check_same(query, key, value, ("query", "key", "value"))
    if squeeze:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    batch, nheads, seqlen_q, head_dim = query.shape
    if key.shape[0] != batch or value.shape[0] != batch:
        raise ValueError(f"batch of query, key, value must match, got {batch}, {key.shape[0]}, {value.shape[0]}")
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[-1] != head_dim:
        raise ValueError(f"E of key ({key.shape[-1]}) must equal E of query ({head_dim})")
    _check_head_dim("query", head_dim)
    nheads_k, seqlen_k = key.shape[1], key.shape[2]
    if nheads_k != nheads and not _flag("enable_gqa", enable_gqa):
        raise ValueError(f"query has {nheads} heads and key {nheads_k}: pass enable_gqa=True for grouped-query attention")
    _check_heads(nheads, nheads_k, "query", "key")
    dropout_p = _check_dropout(dropout_p)
    scale = _check_scale("scale", scale, head_dim)
    is_causal = _flag("is_causal", is_causal)
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask and is_causal=True cannot be given together (as in torch)")
    if squeeze and attn_mask is not None:
        # 3-D inputs: torch broadcasts the mask against (batch, L, S); the head axis is ours.
        attn_mask = _check_mask(attn_mask, query, (batch, seqlen_q, seqlen_k)).unsqueeze(1)
    mask = _check_mask(attn_mask, query, (batch, nheads, seqlen_q, seqlen_k))
    query, key, value = (_unit_last_stride(t) for t in (query, key, value))

    problem = _Problem(scale, 0, -1, 0 if is_causal else -1, 0.0, dropout_p)
    out, _ = _attention(query, key, value, problem, None, mask)
    return out.squeeze(1) if squeeze else out
