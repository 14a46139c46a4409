"""Ulysses (DeepSpeed) sequence parallelism: an all-to-all turns sequence shards into
head shards, every rank runs flashtile's kernel on the full sequence for nheads / N query
heads, and an all-to-all turns the output back. Differentiable (the all-to-alls'
backward is the opposite all-to-all).

The sequence shards are contiguous: rank r holds tokens [r L, (r + 1) L) (``shard_sequence``
with layout "contiguous"). Query heads must divide by the world size; key/value heads that
do not (GQA with fewer KV heads than ranks) are replicated to one per query-head group
first, so that each rank receives the KV heads its query heads read (documented cost:
more KV traffic).
"""

from __future__ import annotations

from typing import Optional

import torch


def _all_to_all(x: torch.Tensor, group, world: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into ``world`` pieces along scatter_dim, send piece i to rank i, and
    concatenate what arrives along gather_dim."""
    import torch.distributed as dist

    pieces = [p.contiguous() for p in torch.tensor_split(x, world, dim=scatter_dim)]
    received = [torch.empty_like(p) for p in pieces]
    dist.all_to_all(received, pieces, group=group)
    return torch.cat(received, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world, scatter_dim, gather_dim):
        ctx.args = (group, world, scatter_dim, gather_dim)
        return _all_to_all(x, group, world, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        group, world, scatter_dim, gather_dim = ctx.args
        return _all_to_all(grad, group, world, gather_dim, scatter_dim), None, None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, causal: bool = False,
                      window_size=(-1, -1), softcap: float = 0.0, softmax_scale: Optional[float] = None):
    """Attention of this rank's contiguous shard (batch, local_seqlen, heads, headdim) of a
    sequence sharded over ``group``, by head-sharding all-to-alls. Same arguments and
    semantics as ``ring_attention`` (the global sequence is square); nheads must be
    divisible by the world size."""
    import flashtile

    from flashtile.parallel.group import group_info
    from flashtile.problem import validate

    validate.parallel_call(q, k, v, causal, window_size, softcap, softmax_scale)
    world, _ = group_info(group)
    if world == 1:
        return flashtile.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, softcap=softcap)
    heads, heads_k = q.shape[2], k.shape[2]
    validate.ulysses_heads(heads, world)
    if heads_k % world:
        # each rank gets heads / world query heads; give it the KV heads they read
        k = k.repeat_interleave(heads // heads_k, dim=2)
        v = v.repeat_interleave(heads // heads_k, dim=2)
    qh, kh, vh = (_AllToAll.apply(t, group, world, 2, 1) for t in (q, k, v))  # (B, S, H / N, D)
    out = flashtile.flash_attn_func(qh, kh, vh, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                    softcap=softcap)
    return _AllToAll.apply(out, group, world, 1, 2)
