"""S_dmask: the probabilities and dropout mask of a call, for tests and debugging.

flash-attn's ``return_attn_probs=True`` hands back the (seqlen_q, seqlen_k) matrix the
kernel never stores. Here it is recomputed densely (O(N^2) memory) from the same scores
and the same Philox stream as the kernels and the twin: ``exp(s - rowmax(s))`` for a kept
entry, its negation for a dropped one, 0 where the mask hides the key. So ``S_dmask.abs()
* exp(rowmax - lse)`` are the probabilities and ``S_dmask >= 0`` the keep mask.
"""

from __future__ import annotations

import torch

from flashtile.backends.twin.attention import host_spans, visible_mask_rows


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
    visible = visible_mask_rows(0, lq, lk, diag, problem.window_left, problem.window_right, q.device, problem.chunk)
    s = torch.where(visible, s, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(m == float("-inf"), 0.0, m)
    return torch.exp(s - m)


def _keep(seed, batch_heads: int, rows: int, cols: int, dropout_p: float, kernels: bool) -> torch.Tensor:
    """(batch_heads, rows, cols) bool: the Philox keep mask of every (bh, i, j), drawn by the
    Triton kernel (kernels) or by its torch twin (the same bits)."""
    if kernels:
        from flashtile.backends.triton.scores import dropout_keep_mask

        return dropout_keep_mask(seed, batch_heads, rows, cols, dropout_p)
    from flashtile.backends.twin.philox import keep_mask

    bh = torch.arange(batch_heads, device=seed.device)[:, None, None]
    return keep_mask(int(seed.item()), bh, torch.arange(rows, device=seed.device)[:, None],
                     torch.arange(cols, device=seed.device), dropout_p)


@torch.no_grad()
def dropout_probs(q4, k4, problem, alibi, seed, varlen=None, kernels: bool = True) -> torch.Tensor:
    """S_dmask of a canonical call: q4 (B, H, Sq, D), k4 (B, Hk, Sk, D) -> (B, H, Sq, Sk);
    packed (``varlen``: a ``problem.spec.Varlen``; B = 1) -> (batch, H, max_seqlen_q,
    max_seqlen_k), each sequence in its top-left corner. ``kernels``: the mask as the Triton
    kernels draw it (else the twin's torch Philox: the same bits)."""
    heads = q4.shape[1]
    if varlen is not None:
        spans = [(0, *span) for span in host_spans(varlen)]
        batch, rows, cols = len(spans), varlen.max_seqlen_q, varlen.max_seqlen_k
    else:
        batch, rows, cols = q4.shape[0], q4.shape[2], k4.shape[2]
        spans = [(b, 0, rows, 0, cols) for b in range(batch)]
    out = torch.zeros((batch, heads, rows, cols), dtype=torch.float32, device=q4.device)
    for b, (row, q0, lq, k0, lk) in enumerate(spans):
        if lq == 0 or lk == 0:
            continue  # nothing visible: zeros
        slopes = None if alibi is None else alibi[b]
        out[b, :, :lq, :lk] = _tile(q4[row, :, q0:q0 + lq], k4[row, :, k0:k0 + lk], problem, slopes, lk - lq)
    keep = _keep(seed, batch * heads, rows, cols, problem.dropout_p, kernels).view(batch, heads, rows, cols)
    return torch.where(keep, out, -out)
