"""flash-attn 2's variable-length functions: packed sequences, one token axis.

``flash_attn_varlen_func`` packs ``batch`` sequences of different lengths into one token
axis (how trainers feed documents); sequence b owns query rows ``cu_seqlens_q[b] ..
cu_seqlens_q[b + 1]`` and key rows ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]``, and attends
only within itself. It runs on the same kernels as the fixed-length functions, with a
work list of (sequence, block) items built on the device (``flashtile.backends.worklist``).
"""

from __future__ import annotations

from typing import Optional

import torch

from flashtile.problem.window import effective_window
from flashtile.dispatch import _Problem, attention_with_probs
from flashtile.problem.validate import (_check_alibi, _check_dropout, _check_head_dim, _check_heads,
                                        _check_index_tensor, _check_max_seqlen, _check_same, _check_scale,
                                        _check_softcap, _check_tensor, _check_varlen_values, _check_window, _flag,
                                        _unit_last_stride)


def gather_pages(cache, block_table):
    """(batch, max_blocks * page_size, Hk, D): each sequence's pages of a paged cache
    (num_blocks, page_size, Hk, D), in block-table order. Entries past a sequence's pages
    are clamped to a valid block (their rows are never used). Differentiable, no host sync."""
    if cache.shape[0] == 0:
        # An empty pool (validation let it through: no sequence has a key): one zero page to
        # point at, still in the cache's graph (its gradient is empty).
        cache = torch.cat((cache, cache.new_zeros((1, *cache.shape[1:]))))
    return cache[block_table.long().clamp(0, cache.shape[0] - 1)].flatten(1, 2)


def _paged_keys(k, v, block_table, cu_seqlens_k, seqused_k):
    """Paged k/v (num_blocks, page_size, Hk, D) gathered into one padded sequence of
    ``max_blocks * page_size`` rows per sequence: (batch * max_blocks * page_size, Hk, D),
    with offsets and used lengths for it. Differentiable (an index gather), no host sync.
    Entries past a sequence's pages are clamped to a valid block (their keys are unused)."""
    batch, max_blocks = block_table.shape
    page = k.shape[1]
    kg, vg = (gather_pages(t, block_table).flatten(0, 1) for t in (k, v))
    lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    if seqused_k is not None:
        lengths = torch.minimum(lengths, seqused_k)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=k.device) * (max_blocks * page)
    return kg, vg, cu, lengths.to(torch.int32).contiguous()


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, seqused_q, seqused_k,
            names=("q", "k", "v")):
    qn, kn, vn = names
    paged = block_table is not None
    _check_tensor(qn, q, 3)
    _check_tensor(kn, k, 4 if paged else 3)
    _check_tensor(vn, v, 4 if paged else 3)
    _check_same(q, k, v, names)
    total_q, nheads, head_dim = q.shape
    if k.shape != v.shape:
        layout = "(num_blocks, page_block_size, nheads_k, headdim)" if paged else "(total_k, nheads_k, headdim)"
        raise ValueError(f"{kn} and {vn} must have the same shape {layout}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"head dim of {kn} ({k.shape[-1]}) must equal head dim of {qn} ({head_dim})")
    _check_head_dim(qn, head_dim)
    nheads_k = k.shape[-2]
    _check_heads(nheads, nheads_k, qn, kn)
    device = q.device
    cu_q = _check_index_tensor("cu_seqlens_q", cu_seqlens_q, 1, device)
    cu_k = _check_index_tensor("cu_seqlens_k", cu_seqlens_k, 1, device)
    if cu_q.numel() < 1 or cu_k.numel() < 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must hold batch + 1 >= 1 entries")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got {cu_q.numel() - 1} "
                         f"and {cu_k.numel() - 1} sequences")
    batch = cu_q.numel() - 1
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    used_q = used_k = None
    if seqused_q is not None:
        used_q = _check_index_tensor("seqused_q", seqused_q, 1, device)
    if seqused_k is not None:
        used_k = _check_index_tensor("seqused_k", seqused_k, 1, device)
    for name, t in (("seqused_q", used_q), ("seqused_k", used_k)):
        if t is not None and t.numel() != batch:
            raise ValueError(f"{name} must have shape ({batch},) (one entry per sequence), got {tuple(t.shape)}")
    page_size = num_blocks = 0
    if paged:
        table = _check_index_tensor("block_table", block_table, 2, device)
        if table.shape[0] != batch:
            raise ValueError(f"block_table must have shape ({batch}, max_blocks), got {tuple(table.shape)}")
        num_blocks, page_size = k.shape[0], k.shape[1]
        if page_size < 1:
            raise ValueError(f"page_block_size of {kn} must be >= 1, got shape {tuple(k.shape)}")
    dropout_p = _check_dropout(dropout_p)
    scale = _check_scale("softmax_scale", softmax_scale, head_dim)
    left, right = _check_window(window_size)
    if _flag("causal", causal):
        right = 0
    softcap = _check_softcap(softcap)
    alibi = _check_alibi(alibi_slopes, batch, nheads, device)
    _check_varlen_values(cu_q, cu_k, used_q, used_k, max_q, max_k, total_q, None if paged else k.shape[0],
                         table if paged else None, page_size, num_blocks)
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    if paged:
        k, v, cu_k, used_k = _paged_keys(k, v, table, cu_k, used_k)

    # One window for every sequence: a side that hides no key of the longest ones hides none.
    left, right = effective_window(left, right, max_q, max_k, max_k - max_q)
    problem = _Problem(scale, 0, left, right, softcap, dropout_p, _flag("deterministic", deterministic))
    want_probs = _flag("return_attn_probs", return_attn_probs)
    meta = (cu_q, cu_k, used_q, used_k, max_q, max_k)
    # (total, H, D) in and out: the views to the kernels' (1, H, total, D) and back happen
    # inside the autograd node (as a select outside it, out[0] cost a zero-filled gradient
    # and a copy per backward: H200 run 80, 55 us of a 1.6 ms varlen backward).
    out, lse, probs = attention_with_probs(q, k, v, problem, alibi, meta, want_probs, layout="thd")
    return (out, lse.squeeze(0), probs) if want_probs else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    *,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
):
    """Exact attention over packed sequences, with flash-attn 2's interface and semantics.

    Args:
        q: (total_q, nheads, headdim), the queries of every sequence one after another.
        k, v: (total_k, nheads_k, headdim); nheads % nheads_k == 0 (GQA/MQA). With
            ``block_table``: paged, (num_blocks, page_block_size, nheads_k, headdim).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), starting at 0, non-decreasing,
            ending at total_q / total_k (paged: cu_seqlens_k still gives the key lengths).
            Sequence b owns rows cu[b] .. cu[b + 1]; empty sequences are allowed.
        max_seqlen_q, max_seqlen_k: ints >= the longest query / key sequence (they size
            the grid without reading cu_seqlens on the host).
        dropout_p, softmax_scale, softcap, deterministic: as in ``flash_attn_func``.
        causal: bottom-right aligned within each sequence: query i of sequence b sees key
            j iff j <= i + len_k(b) - len_q(b).
        window_size: (left, right) around the same per-sequence diagonal (-1 = unbounded);
            a tuple, list or 2-element integer tensor.
        alibi_slopes: (nheads,) or (batch, nheads) float32, per sequence.
        return_attn_probs: also return softmax_lse (nheads, total_q) float32 and, when
            dropout_p > 0, S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k) float32
            (see ``flash_attn_func``; None without dropout). S_dmask is for tests and
            debugging: O(batch * max_seqlen_q * max_seqlen_k) memory, and it reads
            cu_seqlens on the host.
        block_table: None, or int32 (batch, max_blocks): sequence b's keys are pages
            block_table[b, 0], block_table[b, 1], ... of k and v. The pages are gathered
            into one padded buffer (batch * max_blocks * page_block_size rows) before the
            kernels run; decoding without that copy is ``flash_attn_with_kvcache``'s job.
        seqused_q, seqused_k: int32 (batch,) (FA3): only the first seqused tokens of each
            sequence take part (and set its diagonal); its other rows get out 0, LSE -inf
            and zero gradients.

    Returns:
        out (total_q, nheads, headdim); with ``return_attn_probs`` ``(out, softmax_lse,
        S_dmask)``. Differentiable with respect to q, k and v (dq, dk, dv in their layouts).

    The metadata values are checked on the host once per set of tensors (one copy; cached
    by identity and version) and never while a CUDA graph is captured or torch.compile
    traces: the call itself reads cu_seqlens only on the device, so a training step with
    it can be captured.
    """
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table,
                   seqused_q, seqused_k)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """:func:`flash_attn_varlen_func` on qkv (total, 3, nheads, headdim); q, k, v are views."""
    _check_tensor("qkv", qkv, 4)
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, nheads, headdim), got {tuple(qkv.shape)}")
    return _varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                   None, None, None, names=("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"))


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """:func:`flash_attn_varlen_func` with kv (total_k, 2, nheads_k, headdim); k, v are views."""
    _check_tensor("kv", kv, 4)
    if kv.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    return _varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                   None, None, None, names=("q", "kv[:, 0]", "kv[:, 1]"))
