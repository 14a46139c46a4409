"""flash-attn 2's decoding entry point: ``flash_attn_with_kvcache`` (and FA3's combine).

A decode step appends each sequence's new keys/values to its KV cache in place (rotary
applied first, when given) and attends its new queries to the whole valid cache.

On the Triton backend (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) the call
runs ``flashtile.backends.triton.decode``'s kernels through one op (``torch.ops.flashtile.kvcache``,
which declares its writes to the caches for torch.compile): the append (and the rotary of
k), then the split-KV decode kernel (all query heads of a KV head in one program, keys
read straight from the cache rows or pages) and its combine. Nothing is gathered or
copied per call, and a repeated call replays its launch plan.

The checks of the metadata *values* (cache_seqlens, cache_leftpad, cache_batch_idx,
block_table, rotary length) run before anything is written: on the host when the values
are there (CPU tensors, an int cache_seqlens: a ValueError naming the argument), and on
the device when they are CUDA tensors, so that a decode step never synchronises with the
GPU and can be captured in a CUDA graph. A device check that fails leaves the cache
untouched and makes out and the LSE NaN (``FLASHTILE_KVCACHE_CHECK=host`` reads CUDA
metadata on the host instead, one synchronisation per call, for a ValueError).

The torch twin (CPU tensors by default) runs the same semantics with torch ops: rotary,
an in-place append, and the packed varlen twin over the cache rows.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from flashtile.runtime import replay as plan
from flashtile.dispatch import _Problem, _attention, _backend_for
from flashtile.problem.validate import (_check_alibi, _check_head_dim, _check_heads, _check_index_tensor,
                                        _check_same, _check_scale, _check_softcap, _check_tensor, _check_window,
                                        _flag, _integer, _unit_last_stride)
from flashtile.problem.window import effective_window
from flashtile.api.varlen import gather_pages


def _check_rotary(cos, sin, q, head_dim: int):
    if cos is None and sin is None:
        return 0
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D (seqlen_ro, rotary_dim / 2), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    rotary_dim = 2 * cos.shape[1]
    if not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {rotary_dim}) must be in (0, headdim = {head_dim}]")
    return rotary_dim


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


def _check_values(seqlens, leftpad, batch_idx, block_table, *, new: int, queries: int, capacity: int,
                  batch_cache: int, num_blocks: int, page: int, rotary_len: Optional[int], causal_rotary: bool):
    """The checks that need the metadata's values (one host copy; skipped while a CUDA
    graph is captured or torch.compile traces, where the writes are clamped instead)."""
    if torch.compiler.is_compiling() or (seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    tensors = [t for t in (seqlens, leftpad, batch_idx, block_table) if t is not None]
    host = torch.cat([t.reshape(-1).long() for t in tensors]).cpu().tolist()
    batch = seqlens.numel()
    lens, host = host[:batch], host[batch:]
    pads = [0] * batch
    if leftpad is not None:
        pads, host = host[:batch], host[batch:]
    if batch_idx is not None:
        rows, host = host[:batch], host[batch:]
        for b, r in enumerate(rows):
            if not 0 <= r < batch_cache:
                raise ValueError(f"cache_batch_idx[{b}] = {r} must be in [0, {batch_cache}) (the cache's batch)")
    for b, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] = {n} must be >= 0")
        if n + new > capacity:
            raise ValueError(f"cache_seqlens[{b}] + seqlen_new = {n} + {new} exceeds the cache length {capacity}")
        if not 0 <= pads[b] <= n:
            raise ValueError(f"cache_leftpad[{b}] = {pads[b]} must be in [0, cache_seqlens[{b}] = {n}]")
        if rotary_len is not None:
            # k at positions n + i, i < new (cache indices); q there too when causal/windowed
            need = n + max(new, queries if causal_rotary else 1)
            if need > rotary_len:
                raise ValueError(f"rotary_cos/rotary_sin hold {rotary_len} positions, sequence {b} needs {need}")
    if block_table is not None:
        width = block_table.shape[1]
        for b, n in enumerate(lens):
            row = host[b * width:(b + 1) * width]
            for j in range(-(-(n + new) // page)):
                if not 0 <= row[j] < num_blocks:
                    raise ValueError(f"block_table[{b}, {j}] = {row[j]} must be in [0, {num_blocks}) "
                                     f"(the number of blocks of k_cache)")


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens=None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size=(-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Attention of new queries against a KV cache, appending new keys/values in place.

    Args:
        q: (batch, seqlen_q, nheads, headdim); seqlen_q = 1 for plain decoding.
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or paged
            (num_blocks, page_block_size, nheads_k, headdim) with ``block_table``; any
            page size >= 1. Modified in place when k, v are given.
        k, v: None, or (batch, seqlen_new, nheads_k, headdim): written into the cache at
            positions cache_seqlens .. cache_seqlens + seqlen_new (rotated first when
            rotary tables are given), then attended to in the same call.
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2): k is rotated at
            positions cache_seqlens + i (its index in the cache row, leftpad included, as
            flash-attn does); q at the same positions when causal or windowed, else all of
            its rows at cache_seqlens.
            ``rotary_interleaved``: GPT-J pairs (True) or GPT-NeoX halves (False).
        cache_seqlens: int, or int32 (batch,): the cache's valid end before the append
            (None: the whole cache is valid).
        cache_batch_idx: None, or int32 (batch,): the cache row of each batch element (not
            with block_table). None: sequence b uses row b, so a cache allocated for a larger
            batch (batch_cache >= batch) serves fewer sequences; its other rows are untouched.
        cache_leftpad: None, or int32 (batch,): the cache row starts at that index (not
            with block_table).
        block_table: None, or int32 (batch, max_blocks): sequence b's cache is pages
            block_table[b, 0], block_table[b, 1], ...
        softmax_scale, window_size, softcap, alibi_slopes: as in ``flash_attn_func``; causal
            is bottom-right against the valid cache: query i of sequence b sees key j iff
            j <= i + len_k(b) - seqlen_q, len_k(b) = cache_seqlens + seqlen_new - leftpad.
        num_splits: 0 (choose: enough splits of the cache length to fill the GPU when
            batch x nheads_k does not), 1 (no split) or n splits (at most one per key tile
            and 128); the result depends on it only through float32 reassociation.
        return_softmax_lse: also return the LSE (batch, nheads, seqlen_q) float32.

    Returns:
        out (batch, seqlen_q, nheads, headdim), or (out, lse). Not differentiable (as in
        flash-attn): use the other functions to train.

    Every check runs before the cache is touched: a call that raises leaves the cache
    bitwise unchanged. Metadata values held by CUDA tensors are checked on the device
    (module docstring): a bad value there writes nothing and returns NaN.
    """
    entry = None
    mode = _check_mode()
    if isinstance(cache_seqlens, torch.Tensor) and (cache_seqlens.is_cuda or mode == "device"):
        # only metadata checked on the device can skip the host path (``_fast``)
        tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                   block_table, alibi_slopes)
        scalars = plan.plain_scalars((softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
                                      return_softmax_lse))
        key = None if scalars is None else plan.make_key(tensors, scalars)
        if key is not None:
            entry = _PLANS.entry(key, tensors)
            if entry.prepared is not None:
                return _fast(entry, *tensors)
    _check_tensor("q", q, 4)
    _check_tensor("k_cache", k_cache, 4)
    _check_tensor("v_cache", v_cache, 4)
    _check_same(q, k_cache, v_cache, ("q", "k_cache", "v_cache"))
    batch, seqlen_q, nheads, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if k_cache.shape[-1] != head_dim:
        raise ValueError(f"head dim of k_cache ({k_cache.shape[-1]}) must equal head dim of q ({head_dim})")
    _check_head_dim("q", head_dim)
    nheads_k = k_cache.shape[2]
    _check_heads(nheads, nheads_k, "q", "k_cache")
    device = q.device
    paged = block_table is not None
    if paged:
        table = _check_index_tensor("block_table", block_table, 2, device)
        if table.shape[0] != batch:
            raise ValueError(f"block_table must have shape ({batch}, max_blocks), got {tuple(table.shape)}")
        if cache_batch_idx is not None or cache_leftpad is not None:
            raise ValueError("cache_batch_idx and cache_leftpad cannot be combined with a paged cache (block_table)")
        num_blocks, page = k_cache.shape[0], k_cache.shape[1]
        capacity = table.shape[1] * page
        batch_cache = batch
    else:
        num_blocks = page = 0
        batch_cache, capacity = k_cache.shape[0], k_cache.shape[1]
        if cache_batch_idx is None and batch_cache < batch:
            # flash-attn: without cache_batch_idx sequence b uses row b; rows past the batch stay untouched
            raise ValueError(f"k_cache holds {batch_cache} sequences but q {batch}: pass cache_batch_idx, or a "
                             f"cache with at least {batch} rows")
    new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None:
        _check_tensor("k", k, 4)
        _check_tensor("v", v, 4)
        _check_same(q, k, v, ("q", "k", "v"))
        if k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"k and v must have shape ({batch}, seqlen_new, {nheads_k}, {head_dim}), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        new = k.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is required when k and v are appended")
        cache_seqlens = capacity
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens = _check_index_tensor("cache_seqlens", cache_seqlens, 1, device)
        if seqlens.numel() != batch:
            raise ValueError(f"cache_seqlens must have shape ({batch},), got {tuple(seqlens.shape)}")
    else:
        seqlens = torch.full((batch,), _integer("cache_seqlens", cache_seqlens), dtype=torch.int32, device=device)
    batch_idx = leftpad = None
    if cache_batch_idx is not None:
        batch_idx = _check_index_tensor("cache_batch_idx", cache_batch_idx, 1, device)
        if batch_idx.numel() != batch:
            raise ValueError(f"cache_batch_idx must have shape ({batch},), got {tuple(batch_idx.shape)}")
    if cache_leftpad is not None:
        leftpad = _check_index_tensor("cache_leftpad", cache_leftpad, 1, device)
        if leftpad.numel() != batch:
            raise ValueError(f"cache_leftpad must have shape ({batch},), got {tuple(leftpad.shape)}")
    rotary_dim = _check_rotary(rotary_cos, rotary_sin, q, head_dim)
    if rotary_dim and k is None:
        raise ValueError("rotary_cos/rotary_sin apply only when k and v are appended (as in flash-attn)")
    scale = _check_scale("softmax_scale", softmax_scale, head_dim)
    left, right = _check_window(window_size)
    causal = _flag("causal", causal)
    if causal:
        right = 0
    # Sides that hide no key of any sequence (len_k <= capacity) become -1 (unbounded), for
    # both paths: a raw 2**31 - 1 overflows the decode kernel's int32 bounds.
    left, right = effective_window(left, right, seqlen_q, capacity, capacity - seqlen_q)
    softcap = _check_softcap(softcap)
    alibi = _check_alibi(alibi_slopes, batch, nheads, device)
    interleaved = _flag("rotary_interleaved", rotary_interleaved)
    num_splits = _integer("num_splits", num_splits)
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 = choose), got {num_splits}")
    want_lse = _flag("return_softmax_lse", return_softmax_lse)
    local = causal or left >= 0 or right >= 0
    rotary_len = rotary_cos.shape[0] if rotary_dim else None
    check_args = dict(new=new, queries=seqlen_q, capacity=capacity, batch_cache=batch_cache, num_blocks=num_blocks,
                      page=page, rotary_len=rotary_len, causal_rotary=local)
    metadata = (seqlens, leftpad, batch_idx, table if paged else None)
    triton = _backend_for(device) == "triton"
    host = _host_check(seqlens, mode)
    if host or not triton:
        _check_values(*metadata, **check_args)
    if triton:
        consts = dict(scale=scale, softcap=softcap, left=left, right=right, interleaved=interleaved, local=local,
                      num_splits=num_splits, device_check=not host, **check_args)
        same = all(a is b for a, b in zip(metadata, (cache_seqlens, cache_leftpad, cache_batch_idx, block_table)))
        hint = None
        if entry is not None and not host and mode != "host" and same:
            # Nothing of this call's host path depends on more than the key: the next call
            # with it goes straight to the kernels (``_fast``), and the kernels' plan entry
            # is kept under this one (``hint``).
            entry.prepared = (bool(rotary_dim), alibi is not alibi_slopes, want_lse, consts)
            hint = entry
        out, lse = _kernels(q, k_cache, v_cache, k, v, rotary_cos if rotary_dim else None,
                            rotary_sin if rotary_dim else None, *metadata, alibi, hint=hint, **consts)
        return (out, lse) if want_lse else out

    with torch.no_grad():
        pads = leftpad.long() if leftpad is not None else torch.zeros(batch, dtype=torch.long, device=device)
        start = seqlens.long()  # rotary position of the first new token: its index in the cache row
        if rotary_dim:
            steps = torch.arange(max(seqlen_q, new, 1), device=device)
            limit = rotary_cos.shape[0] - 1  # clamped: values not checked inside a graph capture stay in range
            q_pos = (start[:, None] + (steps[None, :seqlen_q] if local else 0 * steps[None, :seqlen_q])).clamp(0, limit)
            q = apply_rotary(q, rotary_cos, rotary_sin, q_pos, interleaved)
            if k is not None:
                k_pos = (start[:, None] + steps[None, :new]).clamp(0, limit)
                k = apply_rotary(k, rotary_cos, rotary_sin, k_pos, interleaved)
        if k is not None:
            _append(k_cache, v_cache, k, v, seqlens, batch_idx, table if paged else None, capacity)
        lengths = (seqlens.long() + new - pads).to(torch.int32)
        if paged:
            keys, values = gather_pages(k_cache, table), gather_pages(v_cache, table)  # (batch, capacity, Hk, D)
        elif batch_idx is not None:
            rows = batch_idx.long().clamp(0, batch_cache - 1)
            keys, values = k_cache[rows], v_cache[rows]
        else:
            keys, values = k_cache[:batch], v_cache[:batch]
        keys, values = (t.reshape(batch * capacity, nheads_k, head_dim) for t in (keys, values))
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen_q
        cu_k = (torch.arange(batch + 1, device=device) * capacity).to(torch.int32)
        cu_k[:-1] += pads.to(torch.int32)
        qp = _unit_last_stride(q).reshape(batch * seqlen_q, nheads, head_dim)
        keys, values = _unit_last_stride(keys), _unit_last_stride(values)
        problem = _Problem(scale, 0, left, right, softcap)
        meta = (cu_q, cu_k, None, lengths, seqlen_q, capacity)
        out4, lse = _attention(qp.unsqueeze(0).transpose(1, 2), keys.unsqueeze(0).transpose(1, 2),
                               values.unsqueeze(0).transpose(1, 2), problem, alibi, None, meta)
    out = out4.transpose(1, 2)[0].reshape(batch, seqlen_q, nheads, head_dim)
    if not want_lse:
        return out
    return out, lse[0].reshape(nheads, batch, seqlen_q).transpose(0, 1)


_PLANS = plan.cache("flash_attn_with_kvcache")


def _fast(entry, q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, leftpad, table, alibi):
    """A repeated call whose key was validated (``flash_attn_with_kvcache``'s first call
    with it stored what the kernels need besides the tensors in ``entry.prepared``):
    metadata on the device, checked there, so nothing here depends on values."""
    rotary, expand_alibi, want_lse, consts = entry.prepared
    if expand_alibi:
        alibi = alibi.unsqueeze(0).expand(q.shape[0], alibi.shape[0])
    if not rotary:
        cos = sin = None
    out, lse = _kernels(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, table, alibi, hint=entry,
                        **consts)
    return (out, lse) if want_lse else out


def _check_mode() -> str:
    mode = os.environ.get("FLASHTILE_KVCACHE_CHECK", "auto").strip().lower() or "auto"
    if mode not in ("auto", "host", "device"):
        raise ValueError(f"FLASHTILE_KVCACHE_CHECK must be auto, host or device, got {mode!r}")
    return mode


def _host_check(seqlens: torch.Tensor, mode: str) -> bool:
    """Whether the metadata values are checked on the host (FLASHTILE_KVCACHE_CHECK): by
    default when they are there (CPU tensors, an int cache_seqlens), never for CUDA
    tensors (that would be a device synchronisation per call); ``host`` reads CUDA
    metadata too (except while a CUDA graph is captured or torch.compile traces), ``device``
    checks even CPU metadata with the device kernel (the Triton backend only). ``mode``:
    ``_check_mode()``."""
    if mode == "device":
        return False
    if not seqlens.is_cuda:
        return True
    if mode == "host":
        return not (torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing())
    return False


def _kernels(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, table, alibi, *, scale, softcap,
             left, right, interleaved, local, num_splits, device_check, new, queries, capacity, batch_cache,
             num_blocks, page, rotary_len, causal_rotary, hint=None):
    """The Triton path (``flashtile.backends.triton.decode``): the device check when the host did not
    check, the append, the split-KV decode and its combine. ``hint``: this call's plan
    entry when its key determines everything the kernels' key holds but addresses."""
    from flashtile import autograd

    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along headdim (it is written in place), got strides "
                             f"{t.stride()}")
    q, k, v, cos, sin = (None if t is None else _unit_last_stride(t) for t in (q, k, v, cos, sin))
    return autograd.kvcache(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, table, alibi,
                            scale, softcap, left, right, interleaved, local, num_splits, device_check,
                            batch_cache, num_blocks, -1 if rotary_len is None else rotary_len, hint=hint)


def _append(k_cache, v_cache, k, v, seqlens, batch_idx, table, capacity: int) -> None:
    """Write k, v (batch, new, Hk, D) at positions seqlens .. seqlens + new of each
    sequence's cache (its row, or its pages). Positions are clamped to the cache (values not
    checked inside a graph capture never write outside it)."""
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
    v_cache.index_put_(index, v)


def flash_attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out_dtype=None):
    """Merge attention computed over disjoint key sets (FA3's combine; split-KV, context
    parallelism): out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i lse_i.

    Args:
        out_partial: (num_splits, batch, seqlen, nheads, headdim), each split's normalised
            output (float32 recommended).
        lse_partial: (num_splits, batch, nheads, seqlen) float32, each split's LSE (-inf
            where the split saw no key).
        out_dtype: dtype of the result (default: out_partial's).

    Returns:
        (out (batch, seqlen, nheads, headdim), lse (batch, nheads, seqlen) float32). A row
        that no split saw gets out 0 and lse -inf.
    """
    if not isinstance(out_partial, torch.Tensor) or not isinstance(lse_partial, torch.Tensor):
        raise TypeError("out_partial and lse_partial must be torch.Tensors")
    if out_partial.dim() != 5:
        raise ValueError(f"out_partial must be (num_splits, batch, seqlen, nheads, headdim), got shape "
                         f"{tuple(out_partial.shape)}")
    s, b, n, h, _ = out_partial.shape
    if tuple(lse_partial.shape) != (s, b, h, n):
        raise ValueError(f"lse_partial must have shape {(s, b, h, n)}, got {tuple(lse_partial.shape)}")
    if _backend_for(out_partial.device) == "triton":
        from flashtile.backends.triton import decode

        if lse_partial.device != out_partial.device:
            raise ValueError(f"lse_partial must be on {out_partial.device}, got {lse_partial.device}")
        out = out_partial.new_empty((b, n, h, out_partial.shape[-1]), dtype=out_dtype or out_partial.dtype)
        lse = lse_partial.new_empty((b, h, n))
        decode.combine(_unit_last_stride(out_partial), _unit_last_stride(lse_partial.float()), out, lse)
        return out, lse
    lse = torch.logsumexp(lse_partial.float(), dim=0)  # -inf where every split is -inf
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    weight = torch.exp(lse_partial.float() - safe[None])  # 0 for a split that saw nothing
    out = (weight.permute(0, 1, 3, 2)[..., None] * out_partial.float()).sum(0)
    return out.to(out_dtype or out_partial.dtype), lse
