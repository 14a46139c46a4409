"""FlexAttention on plain torch ops: the twin of the flex kernels, differentiable by autograd.

For CPU tensors (torch's own flex_attention has no backward there), and the float64 oracle
of the tests when given float64 inputs. Same semantics as torch's flex_attention:

    s[b, h, i, j] = score_mod(scale * q_i . k_j, b, h, i, j)     (working precision)
    s = -inf where block (i // Q_BLOCK, j // KV_BLOCK) is skipped, or partial and
        mask_mod(b, h, i, j) is False
    out = softmax(s) @ v, lse = logsumexp(s) (natural log); a row with no visible key:
        out 0, lse -inf, gradients 0

The mods are called once per slab of query rows on broadcast index tensors (b (B,1,1,1),
h (1,H,1,1), q_idx (1,1,rows,1), kv_idx (1,1,1,S), int64), so a mod written with torch ops
for torch's vmap runs unchanged, and autograd differentiates it, captured tensors too
(learned biases). Scores are float32 (float64 for float64 inputs), as torch's math path.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from flashtile.problem.blockmask import Sparsity

# Most score elements held at once per slab of query rows (float32: 256 MiB).
_SLAB_ELEMENTS = 1 << 26


def _visible(sparsity: Optional[Sparsity], state, b, h, rows, seqlen_k, device):
    """(B or 1, H or 1, len(rows), S) bool of the visible elements of a slab."""
    cols = torch.arange(seqlen_k, device=device)
    if sparsity is None:
        return None
    blocks = state[:, :, (rows // sparsity.q_block)][..., cols // sparsity.kv_block]
    visible = blocks == 2
    partial = blocks == 1
    if sparsity.mask_mod is None:
        return visible | partial
    keep = torch.as_tensor(sparsity.mask_mod(b, h, rows.view(1, 1, -1, 1), cols.view(1, 1, 1, -1)), device=device)
    if keep.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a bool tensor, got {keep.dtype}")
    return visible | (partial & keep)


def _setup(q, k, v, sparsity: Optional[Sparsity], work):
    """What both passes share: k and v in ``work`` precision with the query heads' copies
    (GQA), the broadcast index tensors b, h, kv_idx, the block states, the rows per slab."""
    batch, nheads = q.shape[:2]
    seqlen_k, group = k.shape[2], nheads // k.shape[1]
    kw, vw = k.to(work), v.to(work)
    if group > 1:
        kw, vw = kw.repeat_interleave(group, dim=1), vw.repeat_interleave(group, dim=1)
    b = torch.arange(batch, device=q.device).view(-1, 1, 1, 1)
    h = torch.arange(nheads, device=q.device).view(1, -1, 1, 1)
    kv_idx = torch.arange(seqlen_k, device=q.device).view(1, 1, 1, -1)
    state = sparsity.block_state() if sparsity is not None else None
    slab = max(1, _SLAB_ELEMENTS // max(1, batch * nheads * seqlen_k))
    return kw, vw, b, h, kv_idx, state, slab


def forward(q, k, v, score_mod: Optional[Callable], sparsity: Optional[Sparsity], scale: float):
    """q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) -> (out (B, Hq, L, Ev) in q's
    dtype, lse (B, Hq, L) float32, float64 for float64 inputs). Differentiable in q, k, v and the mods' captured tensors."""
    batch, nheads, seqlen_q, _ = q.shape
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    kw, vw, b, h, kv_idx, state, slab = _setup(q, k, v, sparsity, work)
    qw = q.to(work)
    seqlen_k, device = k.shape[2], q.device
    outs, lses = [], []
    for first in range(0, seqlen_q, slab):
        rows = torch.arange(first, min(seqlen_q, first + slab), device=device)
        s = torch.matmul(qw[:, :, first:first + rows.numel()], kw.transpose(-1, -2)) * scale
        if score_mod is not None:
            s = score_mod(s, b, h, rows.view(1, 1, -1, 1), kv_idx)
            s = torch.as_tensor(s, device=device).to(work).expand(batch, nheads, rows.numel(), seqlen_k)
        visible = _visible(sparsity, state, b, h, rows, seqlen_k, device)
        if visible is not None:
            s = s.masked_fill(~visible, float("-inf"))
        m = s.amax(-1, keepdim=True).detach()
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m)
        total = e.sum(-1, keepdim=True)
        empty = total == 0
        safe = torch.where(empty, torch.ones_like(total), total)
        outs.append(torch.matmul(e / safe, vw))
        lses.append(torch.where(empty, torch.full_like(total, float("-inf")), m + torch.log(safe)).squeeze(-1))
    out = torch.cat(outs, dim=2).to(q.dtype)
    lse = torch.cat(lses, dim=2).to(torch.float64 if work == torch.float64 else torch.float32)
    return out, lse


def captured_grads(q, k, v, dout, lse, delta, score_mod: Callable, sparsity: Optional[Sparsity], scale: float,
                   tensors: tuple) -> tuple:
    """Gradients of ``tensors`` (a score_mod's captured tensors that require grad) for the
    flex kernels' backward, a slab of query rows at a time, in plain torch: the scores are
    recomputed (float32) and differentiated through ``score_mod`` against dS = P * (dP -
    delta), with P from the forward's ``lse`` and delta = rowsum(dO * O) - dlse. Memory:
    one slab of (B, Hq, rows, S) scores. Returns one gradient per tensor (None where the
    mod does not reach it)."""
    batch, nheads, seqlen_q, _ = q.shape
    kw, vw, b, h, kv_idx, state, slab = _setup(q, k, v, sparsity, torch.float32)
    seqlen_k, device = k.shape[2], q.device
    grads = [None] * len(tensors)
    for first in range(0, seqlen_q, slab):
        last = min(seqlen_q, first + slab)
        rows = torch.arange(first, last, device=device)
        with torch.no_grad():
            raw = torch.matmul(q[:, :, first:last].float(), kw.transpose(-1, -2)) * scale
            dp = torch.matmul(dout[:, :, first:last].float(), vw.transpose(-1, -2))
        with torch.enable_grad():
            s = score_mod(raw, b, h, rows.view(1, 1, -1, 1), kv_idx)
            s = torch.as_tensor(s, device=device).float().expand(batch, nheads, last - first, seqlen_k)
            with torch.no_grad():
                visible = _visible(sparsity, state, b, h, rows, seqlen_k, device)
                row_lse = lse[:, :, first:last, None]
                p = torch.exp(s.detach() - torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse))
                p = torch.where(torch.isinf(row_lse), torch.zeros_like(p), p)
                if visible is not None:
                    p = p.masked_fill(~visible, 0.0)
                ds = p * (dp - delta[:, :, first:last, None])
            parts = torch.autograd.grad(s, tensors, ds, allow_unused=True)
        grads = [g if part is None else (part if g is None else g + part) for g, part in zip(grads, parts)]
    return tuple(grads)
