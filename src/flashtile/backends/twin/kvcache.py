"""The torch twin of ``flash_attn_with_kvcache``: rotary, an in-place append, attention.

The same semantics as the kv-cache kernels (``backends/triton/decode.py``) in torch ops:
the new keys are rotated at their cache index and written into the cache (rows, or pages
of ``block_table``), the queries rotated (at their own positions when the call is causal
or windowed, else all at the cache end), then the packed twin attends each sequence's
queries to its valid cache (from leftpad to cache_seqlens + seqlen_new).
"""

from __future__ import annotations

import torch

from flashtile.backends.layout import gather_pages, unit_last_stride
from flashtile.backends.twin.attention import varlen_forward
from flashtile.problem.spec import Problem, Varlen


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x (batch, seqlen, heads, headdim) at integer ``positions``
    (batch, seqlen), on its first ``2 * cos.shape[1]`` features: GPT-J pairs (0, 1), (2, 3)
    when ``interleaved``, else GPT-NeoX halves. Computed in float32, returned in x's dtype."""
    half = cos.shape[1]
    rd = 2 * half
    c = cos.float()[positions][:, :, None, :]  # (batch, seqlen, 1, rd / 2)
    s = sin.float()[positions][:, :, None, :]
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def append(k_cache, v_cache, k, v, seqlens, batch_idx, table, capacity: int, padding: bool = False) -> None:
    """Write k, v (batch, new, Hk, D) at positions seqlens .. seqlens + new of each
    sequence's cache (its row, or its pages). Positions are clamped to the cache (values not
    checked inside a graph capture never write outside it). ``padding``: sequences with a
    negative length are padding, nothing of theirs is written."""
    if padding:
        keep = seqlens >= 0
        if not bool(keep.all()):
            seqlens, k, v = seqlens[keep], k[keep], v[keep]
            batch_idx = None if batch_idx is None else batch_idx[keep]
            table = None if table is None else table[keep]
            if table is None and batch_idx is None:  # row b of the cache for sequence b
                batch_idx = torch.nonzero(keep).flatten().to(torch.int32)
    batch, new = k.shape[:2]
    pos = (seqlens.long()[:, None] + torch.arange(new, device=k.device)[None, :]).clamp(0, capacity - 1)
    if table is not None:
        page = k_cache.shape[1]
        blocks = table.long().gather(1, pos // page).clamp(0, k_cache.shape[0] - 1)
        index = (blocks, pos % page)
    else:
        rows = (torch.arange(batch, device=k.device) if batch_idx is None
                else batch_idx.long().clamp(0, k_cache.shape[0] - 1))
        index = (rows[:, None].expand(batch, new), pos)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)  # last, as the kernels: where v_cache is a view of k_cache, v's values stay


@torch.no_grad()
def kvcache(q, k_cache, v_cache, k, v, cos, sin, call) -> tuple[torch.Tensor, torch.Tensor]:
    """A validated kv-cache call (``problem.validate.CacheCall``): the caches get k, v;
    returns out (batch, seqlen_q, H, Dv) and lse (batch, H, seqlen_q) float32."""
    spec = call.spec
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    device = q.device
    seqlens, leftpad, batch_idx, table = call.seqlens, call.leftpad, call.batch_idx, call.block_table
    capacity, new = spec.capacity, spec.new
    pads = leftpad.long() if leftpad is not None else torch.zeros(batch, dtype=torch.long, device=device)
    start = seqlens.long()  # rotary position of the first new token: its index in the cache row
    if call.rotary:
        steps = torch.arange(max(seqlen_q, new, 1), device=device)
        limit = cos.shape[0] - 1  # clamped: values not checked inside a graph capture stay in range
        local = steps[None, :seqlen_q] if spec.rotary_local else 0 * steps[None, :seqlen_q]
        q = apply_rotary(q, cos, sin, (start[:, None] + local).clamp(0, limit), spec.interleaved)
        if k is not None:
            k = apply_rotary(k, cos, sin, (start[:, None] + steps[None, :new]).clamp(0, limit), spec.interleaved)
    if k is not None:
        append(k_cache, v_cache, k, v, seqlens, batch_idx, table, capacity, spec.padding)
    lengths = (seqlens.long() + new - pads).to(torch.int32)
    if spec.padding:  # a padding sequence reads no key: out 0, lse -inf (a sink's logit with one)
        lengths = torch.where(seqlens < 0, 0, lengths).to(torch.int32)
        pads = torch.where(seqlens < 0, 0, pads)
    if table is not None:
        keys, values = gather_pages(k_cache, table), gather_pages(v_cache, table)  # (batch, capacity, Hk, D)
    elif batch_idx is not None:
        rows = batch_idx.long().clamp(0, spec.batch_cache - 1)
        keys, values = k_cache[rows], v_cache[rows]
    else:
        keys, values = k_cache[:batch], v_cache[:batch]
    head_dim_v = v_cache.shape[-1]
    keys = unit_last_stride(keys.reshape(batch * capacity, nheads_k, head_dim))
    values = unit_last_stride(values.reshape(batch * capacity, nheads_k, head_dim_v))
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen_q
    cu_k = (torch.arange(batch + 1, device=device) * capacity).to(torch.int32)
    cu_k[:-1] += pads.to(torch.int32)
    qp = unit_last_stride(q).reshape(batch * seqlen_q, nheads, head_dim)
    problem = Problem(spec.scale, 0, spec.window_left, spec.window_right, spec.softcap, chunk=spec.chunk)
    varlen = Varlen(cu_q, cu_k, None, lengths, seqlen_q, capacity)
    out4, lse = varlen_forward(qp.unsqueeze(0).transpose(1, 2), keys.unsqueeze(0).transpose(1, 2),
                               values.unsqueeze(0).transpose(1, 2), problem, call.alibi, varlen,
                               sink=None if call.sink is None else call.sink.float())
    out = out4.transpose(1, 2)[0].reshape(batch, seqlen_q, nheads, head_dim_v)
    return out, lse[0].reshape(nheads, batch, seqlen_q).transpose(0, 1)


def combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """FA3's combine in torch: out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i lse_i;
    a row no split saw gets out 0 and lse -inf."""
    lse = torch.logsumexp(lse_partial.float(), dim=0)  # -inf where every split is -inf
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    weight = torch.exp(lse_partial.float() - safe[None])  # 0 for a split that saw nothing
    out = (weight.permute(0, 1, 3, 2)[..., None] * out_partial.float()).sum(0)
    return out.to(out_dtype), lse
