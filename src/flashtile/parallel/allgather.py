"""Packed documents across ranks, in Llama 3's all-gather form: every rank holds a
contiguous shard of one packed token axis, all-gathers K and V, and attends its own query
tokens to their documents' keys with one varlen call.

A document [s, e) of the global axis that overlaps this rank's tokens [a0, a1) gives the
query piece [a, b) = [max(s, a0), min(e, a1)) and, for causal attention, the key span
[s, b): with varlen's bottom-right alignment (query i sees key j iff j <= i + len_k -
len_q) that is exactly "key position <= query position" within the document. Without
causal the key span is the whole document [s, e).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 (equal shards); the backward sums the gradient over ranks
    and keeps this rank's shard."""

    @staticmethod
    def forward(ctx, x, group, world, rank):
        import torch.distributed as dist

        ctx.args = (group, world, rank, x.shape[0])
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        group, world, rank, n = ctx.args
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)  # gloo has no reduce_scatter for every dtype; this is the simple form
        return grad[rank * n:(rank + 1) * n], None, None, None


def _pieces(cu: Sequence[int], start: int, end: int, causal: bool):
    """Query pieces [a, b) of this rank's tokens [start, end) and their key spans."""
    q_spans, k_spans = [], []
    for s, e in zip(cu[:-1], cu[1:]):
        a, b = max(s, start), min(e, end)
        if a >= b:
            continue
        q_spans.append((a - start, b - start))
        k_spans.append((s, b if causal else e))
    return q_spans, k_spans


def varlen_allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, group=None, *,
                               causal: bool = False, softmax_scale: Optional[float] = None, softcap: float = 0.0):
    """Attention of this rank's shard of a packed token axis (documents across ranks).

    Args:
        q: (local_tokens, nheads, headdim), tokens [rank * local_tokens, (rank + 1) *
            local_tokens) of the packed axis; k, v: (local_tokens, nheads_k, headdim).
            Every rank holds the same number of tokens.
        cu_seqlens: the documents of the whole packed axis, (batch + 1) offsets from 0 to
            world * local_tokens (a list, or a tensor read once on the host).
        causal, softmax_scale, softcap: as in ``flash_attn_varlen_func``, per document.

    Returns:
        out (local_tokens, nheads, headdim); differentiable in q, k, v (the K/V all-gather's
        backward sums the gradients over ranks).
    """
    import flashtile

    from flashtile.parallel.group import as_group, check_same_across_ranks, group_info
    from flashtile.problem import validate

    world, rank = group_info(group)
    group = as_group(group)
    cu = validate.allgather_call(q, k, v, cu_seqlens, world)
    local = q.shape[0]
    if world > 1:
        check_same_across_ranks(q[None], k[None], group, world)
        keys = _AllGather.apply(k, group, world, rank)
        values = _AllGather.apply(v, group, world, rank)
    else:
        keys, values = k, v
    q_spans, k_spans = _pieces(cu, rank * local, (rank + 1) * local, causal)
    device = q.device
    # A leading empty sequence keeps cu_seqlens_k starting at 0 (the first key span may
    # start later); each piece's keys are its span, from its start, seqused_k long.
    cu_q = torch.tensor([0, 0] + [b for _, b in q_spans], dtype=torch.int32, device=device)
    starts = [s for s, _ in k_spans]
    cu_k = torch.tensor([0] + starts + [keys.shape[0]], dtype=torch.int32, device=device)
    used_k = torch.tensor([0] + [e - s for s, e in k_spans], dtype=torch.int32, device=device)
    if not q_spans:
        return q * 0
    max_q = max(b - a for a, b in q_spans)
    max_k = max(e - s for s, e in k_spans)
    return flashtile.flash_attn_varlen_func(q, keys, values, cu_q, cu_k, max_q, max_k, causal=causal,
                                            softmax_scale=softmax_scale, softcap=softcap, seqused_k=used_k)
