"""flash-attn 2's decoding entry point: ``flash_attn_with_kvcache`` (and FA3's combine).

A decode step appends each sequence's new keys/values to its KV cache in place (rotary
applied first, when given) and attends its new queries to the whole valid cache.

On the Triton backend (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) the call
runs ``flashtile.backends.triton.decode``'s kernels through one op (``torch.ops.flashtile.kvcache``,
which declares its writes to the caches for torch.compile): the split-KV decode kernel
(all query heads of a KV head in one program, keys read straight from the cache rows or
pages), which also appends up to 64 new tokens itself (rotary of k included; a longer
append, or ``FLASHTILE_DECODE_APPEND=separate``, runs the append kernel first), then the
combine when it splits (inside the decode kernel for an eager step with a small cache read:
``decode.fuse_step``; the device check of the metadata too, so such a step is one launch,
while a step captured in a CUDA graph keeps the combine, which costs it less GPU time, and
checks the metadata in the decode kernel's programs, each what its split reads, with the
append moved after the verdict into the combine's kernel, where ``decode.spread_step``
allows it, else in the check kernel; the paths agree to float32 reassociation, not bit
for bit). Nothing
is gathered or copied per call, and a repeated call replays its launch plan.

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

from typing import Optional

import torch

from flashtile import dispatch
from flashtile.problem import validate
from flashtile.runtime import replay, settings

_PLANS = replay.cache("flash_attn_with_kvcache")


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
    *,
    learnable_sink: Optional[torch.Tensor] = None,
    attention_chunk: int = 0,
    padding_sequences: bool = False,
):
    """Attention of new queries against a KV cache, appending new keys/values in place.

    Args:
        q: (batch, seqlen_q, nheads, headdim); seqlen_q = 1 for plain decoding; headdim
            <= 576 (MLA's absorbed decode: 512 latent + 64 rope columns).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim) and (...,
            headdim_v), or paged (num_blocks, page_block_size, nheads_k, ...) with
            ``block_table``; any page size >= 1; v_cache may be a view of k_cache's first
            headdim_v columns (MLA's latent cache: ``v_cache = k_cache[..., :512]``, no
            copy). Modified in place when k, v are given.
        k, v: None, or (batch, seqlen_new, nheads_k, headdim) and (..., headdim_v): written
            into the caches at positions cache_seqlens .. cache_seqlens + seqlen_new
            (rotated first when rotary tables are given), then attended to in the same
            call. Where v_cache shares k_cache's memory, v must be the same view of k
            (v = k[..., :headdim_v]; anything else is refused: both appends write those
            columns), and rotary tables are refused (they would rotate v).
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2): k is rotated at
            positions cache_seqlens + i (its index in the cache row, leftpad included, as
            flash-attn does); q at the same positions when causal or windowed, else all of
            its rows at cache_seqlens. As in flash-attn, a window side of at least the cache's
            capacity (its rows, or block_table's pages x page size) is no window here: with
            window_size=(capacity, -1) q rotates at cache_seqlens.
            ``rotary_interleaved``: GPT-J pairs (True) or GPT-NeoX halves (False).
        cache_seqlens: int, or int32 (batch,): the cache's valid end before the append
            (None: the whole cache is valid).
        cache_batch_idx: None, or int32 (batch,): the cache row of each batch element (not
            with block_table). None: sequence b uses row b, so a cache allocated for a larger
            batch (batch_cache >= batch) serves fewer sequences; its other rows are untouched.
            When k and v are appended, no two sequences may share a row (not checked: the
            appends and the reads of one launch would race).
        cache_leftpad: None, or int32 (batch,): the cache row starts at that index (not
            with block_table).
        block_table: None, or int32 (batch, max_blocks): sequence b's cache is pages
            block_table[b, 0], block_table[b, 1], ...; when k and v are appended, a page
            that receives new keys belongs to one sequence only (not checked, as above).
        softmax_scale, window_size, softcap, alibi_slopes: as in ``flash_attn_func``; causal
            is bottom-right against the valid cache: query i of sequence b sees key j iff
            j <= i + len_k(b) - seqlen_q, len_k(b) = cache_seqlens + seqlen_new - leftpad.
        num_splits: 0 (choose: enough splits of the cache length to fill the GPU when
            batch x nheads_k does not), 1 (no split) or n splits (at most one per key tile
            and 128); the result depends on it only through float32 reassociation.
        return_softmax_lse: also return the LSE (batch, nheads, seqlen_q) float32.
        learnable_sink: None, or (nheads,) float16/bfloat16/float32: one logit per query head
            that joins only the softmax's denominator (gpt-oss's sinks; FA4's name), added
            once per row, whatever the split; natural-log units, not multiplied by
            softmax_scale. The LSE includes it.
        attention_chunk: chunked local attention (FA3's name): query i of sequence b sees
            key j only if floor((i + len_k(b) - seqlen_q) / C) == floor(j / C), keys counted
            from leftpad; 0 (the default) is off.
        padding_sequences: a sequence whose cache_seqlens is negative is padding: nothing
            is appended for it and no key is read (its block_table row, batch index and
            leftpad are ignored); its out is 0 and its lse -inf (the sink's logit with a
            sink), as a sequence without keys. This is how transformers' continuous
            batching pads a decode batch to a static size under CUDA graphs (cache_seqlens
            -1, block_table rows of -1), which flash-attn's kernels happen to skip. False
            (the default): a negative cache_seqlens is an error.

    Returns:
        out (batch, seqlen_q, nheads, headdim_v), or (out, lse). Not differentiable (as in
        flash-attn): use the other functions to train.

    Every check runs before the cache is touched: a call that raises leaves the cache
    bitwise unchanged. Metadata values held by CUDA tensors are checked on the device
    (module docstring): a bad value there writes nothing and returns NaN.
    """
    entry = None
    mode = settings.kvcache_check()
    if isinstance(cache_seqlens, torch.Tensor) and (cache_seqlens.is_cuda or mode == "device"):
        # only metadata checked on the device can skip the host path (``_fast``)
        tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                   block_table, alibi_slopes, learnable_sink)
        scalars = replay.plain_scalars((softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
                                        return_softmax_lse, attention_chunk, padding_sequences,
                                        replay.capturing(q)))  # other launches under capture
        key = None if scalars is None else replay.make_key(tensors, scalars)
        if key is not None:
            entry = _PLANS.entry(key, tensors)
            if entry.prepared is not None:
                # the whole call replays as one plan (its launches and buffers), as a
                # repeated ``flash_attn_func`` call does
                return replay.run(entry, tensors, lambda: _fast(entry, *tensors))
    call = validate.kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                 cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                 rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, learnable_sink,
                                 attention_chunk, padding_sequences)
    kernels = dispatch.runs_kernels(q.device)
    host = _host_check(call.seqlens, mode)
    if host or not kernels:
        validate.cache_values(call)
    same = (call.seqlens is cache_seqlens and call.leftpad is cache_leftpad and call.batch_idx is cache_batch_idx
            and call.block_table is block_table)
    if kernels and entry is not None and not host and mode != "host" and same:
        # Nothing of this call's host path depends on more than the key: this call is
        # recorded as the key's plan of the whole call, and the next one replays it (or,
        # where a plan is refused, goes straight to the kernels: ``_fast``).
        entry.prepared = (call.spec, call.rotary, call.alibi is not alibi_slopes, call.want_lse)
        return replay.run(entry, tensors, lambda: _fast(entry, *tensors))
    if kernels:
        out, lse = dispatch.kvcache_kernels(q, k_cache, v_cache, k, v, rotary_cos if call.rotary else None,
                                            rotary_sin if call.rotary else None, call.seqlens, call.leftpad,
                                            call.batch_idx, call.block_table, call.alibi, call.spec, not host, None,
                                            learnable_sink)
    else:
        out, lse = dispatch.kvcache_twin(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, call)
    return (out, lse) if call.want_lse else out


def _fast(entry, q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, leftpad, table, alibi, sink):
    """A repeated call whose key was validated (``flash_attn_with_kvcache``'s first call
    with it stored what the kernels need besides the tensors in ``entry.prepared``):
    metadata on the device, checked there, so nothing here depends on values. While
    ``replay.run`` records this call as the API's plan, the kernels' own plan (``hint``)
    is not used: one recording at a time; a call whose API plan was refused (a copy such
    as a bfloat16 sink's float32 cast) keeps the kernels' plan."""
    spec, rotary, expand_alibi, want_lse = entry.prepared
    if expand_alibi:
        alibi = alibi.unsqueeze(0).expand(q.shape[0], alibi.shape[0])
    if not rotary:
        cos = sin = None
    out, lse = dispatch.kvcache_kernels(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, table,
                                        alibi, spec, True, sink=sink,
                                        hint=entry if replay.active_recorder() is None else None)
    return (out, lse) if want_lse else out


def _host_check(seqlens: torch.Tensor, mode: str) -> bool:
    """Whether the metadata values are checked on the host (FLASHTILE_KVCACHE_CHECK): by
    default when they are there (CPU tensors, an int cache_seqlens), never for CUDA
    tensors (that would be a device synchronisation per call); ``host`` reads CUDA
    metadata too (except while a CUDA graph is captured or torch.compile traces), ``device``
    checks even CPU metadata with the device kernel (the Triton backend only). ``mode``:
    ``runtime.settings.kvcache_check()``."""
    if mode == "device":
        return False
    if not seqlens.is_cuda:
        return True
    if mode == "host":
        return not (torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing())
    return False


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
    validate.combine_call(out_partial, lse_partial)
    return dispatch.combine(out_partial, lse_partial, out_dtype or out_partial.dtype)
