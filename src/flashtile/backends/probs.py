"""S_dmask: the probabilities and dropout mask of a call, for tests and debugging.

flash-attn's ``return_attn_probs=True`` hands back the (seqlen_q, seqlen_k) matrix the
kernel never stores. Here it is recomputed densely (O(N^2) memory) from the same scores
and the same Philox stream as the kernels: ``exp(s - rowmax(s))`` for a kept entry, its
negation for a dropped one, 0 where the mask hides the key. So ``S_dmask.abs() *
exp(rowmax - lse)`` are the probabilities and ``S_dmask >= 0`` the keep mask.
"""

from __future__ import annotations

import torch

from flashtile.backends.twin.attention import visible_mask_rows
from flashtile.backends.triton.forward import dropout_keep_mask


def _tile(q, k, problem, slopes, diag: int) -> torch.Tensor:
    """exp(s - rowmax) of one sequence: q (H, Lq, D), k (Hk, Lk, D); 0 where hidden."""
    group = q.shape[0] // k.shape[0]
    s = torch.matmul(q.float(), k.float().repeat_interleave(group, 0).transpose(1, 2)) * problem.scale
    if problem.softcap > 0:
        s = problem.softcap * torch.tanh(s / problem.softcap)
    lq, lk = q.shape[1], k.shape[1]
    if slopes is not None:
        rel = (torch.arange(lq, device=q.device)[:, None] + diag - torch.arange(lk, device=q.device)[None, :]).abs()
        s = s - slopes.float()[:, None, None] * rel
    visible = visible_mask_rows(0, lq, lk, diag, problem.window_left, problem.window_right, q.device)
    s = torch.where(visible, s, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(m == float("-inf"), 0.0, m)
    return torch.exp(s - m)


@torch.no_grad()
def dropout_probs(q4, k4, problem, alibi, seed, meta=()) -> torch.Tensor:
    """S_dmask of a canonical call: q4 (B, H, Sq, D), k4 (B, Hk, Sk, D) -> (B, H, Sq, Sk);
    varlen (``meta`` = cu_seqlens_q/k, seqused_q/k, max_seqlen_q/k; B = 1) ->
    (batch, H, max_seqlen_q, max_seqlen_k), each sequence in its top-left corner."""
    heads = q4.shape[1]
    if meta:
        from flashtile.dispatch import host_spans

        spans = [(0, *span) for span in host_spans(meta)]
        batch, rows, cols = len(spans), meta[4], meta[5]
    else:
        batch, rows, cols = q4.shape[0], q4.shape[2], k4.shape[2]
        spans = [(b, 0, rows, 0, cols) for b in range(batch)]
    out = torch.zeros((batch, heads, rows, cols), dtype=torch.float32, device=q4.device)
    for b, (row, q0, lq, k0, lk) in enumerate(spans):
        if lq == 0 or lk == 0:
            continue  # nothing visible: zeros
        slopes = None if alibi is None else alibi[b]
        out[b, :, :lq, :lk] = _tile(q4[row, :, q0:q0 + lq], k4[row, :, k0:k0 + lk], problem, slopes, lk - lq)
    keep = dropout_keep_mask(seed, batch * heads, rows, cols, problem.dropout_p).view(batch, heads, rows, cols)
    return torch.where(keep, out, -out)
