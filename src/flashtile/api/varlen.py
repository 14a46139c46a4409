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

from flashtile import dispatch
from flashtile.problem import validate
from flashtile.runtime import replay

_PLANS = replay.cache("flash_attn_varlen_func")

_PADDED: dict = {}  # the padded metadata of recent eager calls (``_padding_sequences``)


def _padding_sequences(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, block_table,
                       seqused_q, seqused_k):
    """``padding_sequences=True``: two more sequences, built on the device (no host read,
    capturable in a CUDA graph): the rows of q past cu_seqlens_q[-1] with no keys (out 0,
    lse -inf or the sink's logit, dq 0) and the keys past cu_seqlens_k[-1] with no rows
    (dk, dv 0; none when paged), so the padding costs no attention. The bounds become at
    least the totals (max_seqlen_k: not when paged). Arguments that are
    not what the validation wants pass through unchanged, for it to name. The padded
    tensors of an eager call are kept for the next call with the same tensors (same
    versions), so the values check, cached per set of tensors, is not redone."""
    if not (isinstance(cu_seqlens_q, torch.Tensor) and isinstance(cu_seqlens_k, torch.Tensor)
            and cu_seqlens_q.dim() == 1 and cu_seqlens_k.dim() == 1 and cu_seqlens_q.numel() > 0
            and cu_seqlens_k.numel() > 0 and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and q.dim() >= 1 and k.dim() >= 1):
        return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, block_table, seqused_q, seqused_k
    paged = block_table is not None
    total_q, total_k = q.shape[0], (None if paged else k.shape[0])
    try:
        max_seqlen_q = max(validate.integer("max_seqlen_q", max_seqlen_q), total_q)
        if not paged:
            max_seqlen_k = max(validate.integer("max_seqlen_k", max_seqlen_k), total_k)
    except TypeError:
        pass  # the validation names it
    sources = (cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_table, seqused_q, seqused_k)
    tensors = [t for t in sources if isinstance(t, torch.Tensor)]
    memo = None
    if not (torch.compiler.is_compiling() or (cu_seqlens_q.is_cuda and torch.cuda.is_current_stream_capturing())
            or any(t.is_inference() for t in tensors)):
        memo = (tuple((id(t), t._version, t.data_ptr()) if isinstance(t, torch.Tensor) else id(t) for t in sources),
                total_q, total_k)
        hit = _PADDED.get(memo)
        if hit is not None:
            return (*hit[:2], max_seqlen_q, max_seqlen_k, *hit[2:6])
    end_q = cu_seqlens_q[-1:]
    end_k = cu_seqlens_k[-1:]
    # sequence B: the padding rows, no keys; sequence B + 1: no rows, the padding keys
    cu_q = torch.cat([cu_seqlens_q, cu_seqlens_q.new_full((2,), total_q)])
    cu_k = torch.cat([cu_seqlens_k, end_k, end_k if paged else cu_seqlens_k.new_full((1,), total_k)])
    if paged and isinstance(block_table, torch.Tensor) and block_table.dim() == 2 and block_table.shape[0] > 0:
        block_table = torch.cat([block_table, block_table[-1:], block_table[-1:]])  # never read: no keys
    if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2 and alibi_slopes.shape[0] > 0:
        alibi_slopes = torch.cat([alibi_slopes, alibi_slopes[-1:], alibi_slopes[-1:]])
    if isinstance(seqused_q, torch.Tensor) and seqused_q.dim() == 1:
        seqused_q = torch.cat([seqused_q, (total_q - end_q).to(seqused_q.dtype), seqused_q.new_zeros(1)])
    if isinstance(seqused_k, torch.Tensor) and seqused_k.dim() == 1:
        seqused_k = torch.cat([seqused_k, seqused_k.new_zeros(1), (cu_k[-1:] - end_k).to(seqused_k.dtype)])
    if memo is not None:
        if len(_PADDED) >= 32:
            _PADDED.clear()
        _PADDED[memo] = (cu_q, cu_k, alibi_slopes, block_table, seqused_q, seqused_k,
                         *tensors)  # the sources too: their ids stay theirs
    return cu_q, cu_k, max_seqlen_q, max_seqlen_k, alibi_slopes, block_table, seqused_q, seqused_k


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, seqused_q, seqused_k,
            learnable_sink=None, attention_chunk=0, names=("q", "k", "v")):
    """Validate (the shapes once per key, the metadata values once per set of tensors),
    then run; a repeated call without grad replays its whole launch plan (``runtime.replay``),
    as ``flash_attn_func`` does."""
    full = lambda: validate.varlen_call(  # noqa: E731
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs, block_table, seqused_q, seqused_k, names,
        learnable_sink, attention_chunk)
    inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_table, seqused_q, seqused_k, learnable_sink)
    scalars = replay.plain_scalars((names, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                    softcap, deterministic, return_attn_probs, attention_chunk))
    key = None if scalars is None else replay.make_key(inputs, scalars)
    if key is None:
        return _run(q, k, v, full(), learnable_sink)
    entry = _PLANS.entry(key, inputs)
    if entry.prepared is None:
        call = full()
        entry.prepared = validate.varlen_prepared(call)
    else:
        call = validate.varlen_repeat(entry.prepared, q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                      block_table, alibi_slopes)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (learnable_sink is not None and learnable_sink.requires_grad)):
        # autograd's Function replays the kernels' plans
        if call.alibi is None and call.block_table is None and not call.want_probs:
            return dispatch.attention_keyed(q, k, v, call.problem, entry, "thd", call.varlen, learnable_sink)[0]
        return _run(q, k, v, call, learnable_sink, entry)
    return replay.run(entry, inputs, lambda: _run(q, k, v, call, learnable_sink))


def _run(q, k, v, call: validate.VarlenCall, sink, hint=None):
    # (total, H, D) in and out: the views to the kernels' (1, H, total, D) and back happen
    # inside the autograd node (as a select outside it, out[0] cost a zero-filled gradient
    # and a copy per backward: H200 run 80, 55 us of a 1.6 ms varlen backward).
    out, lse, probs = dispatch.attention_with_probs(q, k, v, call.problem, call.alibi, call.varlen,
                                                    call.want_probs, hint=hint, qkv_layout="thd",
                                                    block_table=call.block_table, sink=sink)
    return (out, lse.squeeze(0), probs) if call.want_probs else out


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
    learnable_sink: Optional[torch.Tensor] = None,
    attention_chunk: int = 0,
    padding_sequences: bool = False,
):
    """Exact attention over packed sequences, with flash-attn 2's interface and semantics.

    Args:
        q: (total_q, nheads, headdim), the queries of every sequence one after another.
        k, v: (total_k, nheads_k, headdim) and (..., headdim_v) (v's head dim may differ,
            as in ``flash_attn_func``); nheads % nheads_k == 0 (GQA/MQA). With
            ``block_table``: paged, (num_blocks, page_block_size, nheads_k, ...).
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
        learnable_sink: None, or (nheads,): as in ``flash_attn_func``, in every sequence.
        attention_chunk: as in ``flash_attn_func``, chunks counted from each sequence's first
            key (used keys: from cu_seqlens_k[b]).
        padding_sequences: q may hold rows past cu_seqlens_q[-1] and k, v keys past
            cu_seqlens_k[-1] (flash-attn ignores them; transformers' continuous batching
            pads its batches so under CUDA graphs). They attend to nothing and nothing
            attends to them: those rows get out 0, lse -inf (the sink's logit with a sink)
            and dq 0, those keys dk, dv 0 (two sequences more, built on the device: no host
            read, no attention; paged keys have no padding). The bounds count as at least
            the totals (max_seqlen_q >= total_q; max_seqlen_k >= total_k when not paged),
            which may change the kernels' tile choice; not with dropout's S_dmask.
            False (the default): cu_seqlens must end at the totals.

    Returns:
        out (total_q, nheads, headdim_v); with ``return_attn_probs`` ``(out, softmax_lse,
        S_dmask)``. Differentiable with respect to q, k and v (dq, dk, dv in their layouts).

    The metadata values are checked on the host once per set of tensors (one copy; cached
    by identity and version) and never while a CUDA graph is captured or torch.compile
    traces: the call itself reads cu_seqlens only on the device, so a training step with
    it can be captured.
    """
    if validate.padding_sequences(padding_sequences, return_attn_probs, dropout_p):
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, block_table, seqused_q,
         seqused_k) = _padding_sequences(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         alibi_slopes, block_table, seqused_q, seqused_k)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table,
                   seqused_q, seqused_k, learnable_sink, attention_chunk)


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
    *,
    learnable_sink: Optional[torch.Tensor] = None,
    attention_chunk: int = 0,
):
    """:func:`flash_attn_varlen_func` on qkv (total, 3, nheads, headdim); q, k, v are views."""
    validate.packed("qkv", qkv, 4, 1, 3, "(total, 3, nheads, headdim)")
    return _varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                   None, None, None, learnable_sink, attention_chunk, names=("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"))


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
    *,
    learnable_sink: Optional[torch.Tensor] = None,
    attention_chunk: int = 0,
):
    """:func:`flash_attn_varlen_func` with kv (total_k, 2, nheads_k, headdim); k, v are views."""
    validate.packed("kv", kv, 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    return _varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                   None, None, None, learnable_sink, attention_chunk, names=("q", "kv[:, 0]", "kv[:, 1]"))
