"""A deliberately naive dense float64 attention oracle with flashtile's full mask semantics.

Written independently of ``flashtile.backends.twin.attention`` and as plainly as possible: full
(B, H, Sq, Sk) matrices, key/value heads explicitly repeated for every query head, explicit
index grids i and j. Slow and memory-hungry on purpose; use it on small shapes in tests.
"""

from __future__ import annotations

import torch


def dense_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    diag_offset: int = 0,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """Float64 scores (B, H, Sq, Sk) with -inf where a key is not visible.

    q: (B, H, Sq, D); k: (B, Hk, Sk, D); alibi_slopes: (B, H); attn_mask: (B, H, Sq, Sk)
    bool (True = keep) or floating (added). See ``dense_attention`` for the rule.
    """
    batch, num_heads, seqlen_q, _ = q.shape
    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads

    # Query head h reads key head h // group: repeat_interleave lays them out that way.
    k_rep = k.double().repeat_interleave(group, dim=1)  # (B, H, Sk, D)

    scores = scale * (q.double() @ k_rep.transpose(-1, -2))
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)

    i = torch.arange(seqlen_q).reshape(seqlen_q, 1).expand(seqlen_q, seqlen_k)
    j = torch.arange(seqlen_k).reshape(1, seqlen_k).expand(seqlen_q, seqlen_k)

    if alibi_slopes is not None:
        distance = (i + diag_offset - j).abs().double()  # (Sq, Sk)
        slopes = alibi_slopes.double().reshape(batch, num_heads, 1, 1)
        scores = scores - slopes * distance

    keep = torch.ones(batch, num_heads, seqlen_q, seqlen_k, dtype=torch.bool)
    if window_left >= 0:
        keep = keep & (j >= i + diag_offset - window_left)
    if window_right >= 0:
        keep = keep & (j <= i + diag_offset + window_right)
    if chunk > 0:  # chunk number of the query's position and of the key (Python's // floors)
        position = i + diag_offset
        same = torch.tensor([[(p // chunk) == (c // chunk) for p, c in zip(prow, crow)]
                             for prow, crow in zip(position.tolist(), j.tolist())], dtype=torch.bool)
        keep = keep & same
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            scores = scores + attn_mask.double()

    return scores.masked_fill(~keep, float("-inf"))


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    diag_offset: int = 0,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive float64 attention: returns (out (B, H, Sq, D), lse (B, H, Sq)), both float64.

    Key j is visible to query i iff ``(window_left < 0 or j >= i + diag_offset - window_left)``
    and ``(window_right < 0 or j <= i + diag_offset + window_right)`` and the bool mask (if
    any) is True there. Scores: ``scale * q.k``, then ``softcap * tanh(s / softcap)`` if
    softcap > 0, then ``- slope[b, h] * |i + diag_offset - j|``, then ``+ float mask``.
    ``lse = logsumexp`` over visible keys, ``out = exp(s - lse) @ v``. Rows with nothing
    visible (or all scores -inf) give out 0 and lse -inf. ``sink`` (H,): one more logit per
    head in every row's logsumexp with no value (out 0 and lse sink[h] for an empty row).
    ``chunk`` > 0: also hide keys whose chunk number j // chunk differs from the query
    position's (i + diag_offset) // chunk.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    scores = dense_scores(
        q,
        k,
        scale=scale,
        diag_offset=diag_offset,
        window_left=window_left,
        window_right=window_right,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        attn_mask=attn_mask,
        chunk=chunk,
    )
    v_rep = v.double().repeat_interleave(group, dim=1)  # (B, H, Sk, D)

    # torch.logsumexp returns -inf for an all -inf row (it guards the max itself).
    if sink is not None:  # the sink as one more column of scores, whose value row is 0
        column = sink.double().reshape(1, num_heads, 1, 1).expand(*scores.shape[:3], 1)
        lse = torch.logsumexp(torch.cat([scores, column], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)  # (B, H, Sq)
    empty = lse == float("-inf")
    # For an empty row, s - lse is (-inf) - (-inf) = NaN; point those rows at lse 0 instead,
    # which makes every p there exp(-inf) = 0, hence out 0.
    lse_for_p = torch.where(empty, torch.zeros_like(lse), lse)
    probs = torch.exp(scores - lse_for_p.unsqueeze(-1))
    out = probs @ v_rep
    return out, lse
