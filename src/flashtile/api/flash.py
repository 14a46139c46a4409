"""flash-attn 2's fixed-length functions: ``flash_attn_func`` and its packed variants."""

from __future__ import annotations

from typing import Optional

import torch

from flashtile import dispatch
from flashtile.problem import validate
from flashtile.runtime import replay

_PLANS = replay.cache("flash_attn_func")


def _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_attn_probs, learnable_sink=None, attention_chunk=0, names=("q", "k", "v")):
    """Validate (once per key: ``runtime.replay``), then run; a repeated call without grad
    replays its whole launch plan."""
    args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
            learnable_sink, attention_chunk)
    inputs = (q, k, v, alibi_slopes, learnable_sink)
    scalars = replay.plain_scalars((names, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                                    return_attn_probs, attention_chunk))
    key = None if scalars is None else replay.make_key(inputs, scalars)
    if key is None:
        return _run(q, k, v, alibi_slopes, learnable_sink, validate.flash_call(q, k, v, *args, names))
    entry = _PLANS.entry(key, inputs)
    call = entry.prepared
    if call is None:
        call = entry.prepared = validate.flash_call(q, k, v, *args, names)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (learnable_sink is not None and learnable_sink.requires_grad)):
        # autograd's Function replays the kernels' plans
        if alibi_slopes is None and not call.want_probs:
            return dispatch.attention_keyed(q, k, v, call.problem, entry, "bshd", sink=learnable_sink)[0]
        return _run(q, k, v, alibi_slopes, learnable_sink, call, entry)
    return replay.run(entry, inputs, lambda: _run(q, k, v, alibi_slopes, learnable_sink, call))


def _run(q, k, v, alibi, sink, call: validate.FlashCall, hint=None):
    if call.expand_alibi:  # (nheads,) slopes, as validate.alibi expands them
        alibi = alibi.unsqueeze(0).expand(q.shape[0], alibi.shape[0])
    out, lse, probs = dispatch.attention_with_probs(q, k, v, call.problem, alibi, want_probs=call.want_probs,
                                                    hint=hint, qkv_layout="bshd", sink=sink)
    return (out, lse, probs) if call.want_probs else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
    """Exact attention with flash-attn 2's interface and semantics.

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16/bfloat16/float32; headdim <= 512.
        k, v: (batch, seqlen_k, nheads_k, headdim) and (..., headdim_v): v's head dim may
            differ (DeepSeek's 192 / 128), <= 512; nheads % nheads_k == 0 (MQA/GQA:
            query head h reads key/value head h // (nheads // nheads_k)).
            Any strides with unit stride along headdim (views of a packed qkv tensor,
            transposes) run without copies; other layouts are copied once.
        dropout_p: probability of dropping each attention weight, in [0, 1); kept weights
            are scaled by 1 / (1 - dropout_p). The mask is drawn with Philox from a key
            taken from torch's generator of q's device (``torch.manual_seed`` reproduces
            it); the backward redraws the same mask. Pass 0.0 at evaluation time.
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
            For seqlen_q=2, seqlen_k=5 the mask is::

                1 1 1 1 0
                1 1 1 1 1

            and for seqlen_q=5, seqlen_k=2 (rows 0-2 see nothing and give 0)::

                0 0
                0 0
                0 0
                1 0
                1 1

        window_size: (left, right), inclusive, around the same diagonal: query i sees
            keys in [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right];
            -1 = unbounded. ``causal=True`` sets right to 0.
        softcap: if > 0, scores -> softcap * tanh(scores / softcap) after scaling.
        alibi_slopes: (nheads,) or (batch, nheads) float32; adds
            -slope * |i + seqlen_k - seqlen_q - j| to the scores after softcap.
        deterministic: gradients bitwise reproducible (so does
            ``torch.use_deterministic_algorithms(True)``): the backward takes no kernel
            that sums dQ in a varying order. Without it, Hopper at head dim 64 or 128 takes
            the one-pass Gluon backward (5 tile products per tile pair, dQ by float32
            reductions: 3-16% faster on the H200, dQ's rounding varies between runs, dK and
            dV do not); every other case is deterministic anyway, except the Triton
            kernels under ``FLASHTILE_BWD_DQ=atomic``. With it: the one-pass kernel with dQ's
            sums in a fixed order (``backends/sm90/backward_onepass.py``) at fixed lengths,
            causal ones from 2048 queries on, else the split kernels (7 products, no
            reductions).
        learnable_sink: None, or (nheads,) float16/bfloat16/float32: one logit per query head
            that joins only the softmax's denominator (gpt-oss's attention sinks; FA4's
            name): p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)), in natural-log units,
            not multiplied by softmax_scale. The returned LSE includes it (a row that sees
            no key gets out 0 and lse sink_h). Differentiable: its gradient is reduced in a
            fixed order (deterministic).
        attention_chunk: chunked local attention (FA3's name; Llama 4): C >= 1 lets query i
            see key j only if both lie in one chunk of C positions, counted from key 0:
            floor((i + seqlen_k - seqlen_q) / C) == floor(j / C), together with causal and
            the window. 0 (the default) is off.
        return_attn_probs: also return softmax_lse (differentiable, e.g. for a z-loss) and
            S_dmask: None without dropout; with dropout_p > 0 a (batch, nheads, seqlen_q,
            seqlen_k) float32 tensor holding exp(s - rowmax(s)) for kept entries, the
            same value negated where dropout dropped the entry and 0 where the mask hides
            it (so ``S_dmask.abs() * exp(rowmax - lse)`` are the probabilities and
            ``S_dmask >= 0`` the kernel's keep mask). For tests and debugging only: it is
            recomputed densely, O(seqlen_q * seqlen_k) memory.

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype; with ``return_attn_probs``,
        ``(out, softmax_lse, S_dmask)`` where softmax_lse is (batch, nheads, seqlen_q) float32,
        natural log, -inf for rows that see no key (whose output is 0).

    float32 inputs are computed with IEEE float32 dot products (no TF32), fp16/bf16 with
    fp32 accumulation and the probabilities rounded to the input dtype before P @ V.
    """
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       deterministic, return_attn_probs, learnable_sink, attention_chunk)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
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
    """:func:`flash_attn_func` on qkv (batch, seqlen, 3, nheads, headdim); q, k, v are views (no copy)."""
    validate.packed("qkv", qkv, 5, 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    return _flash_attn(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                       softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink, attention_chunk,
                       names=("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"))


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
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
    """:func:`flash_attn_func` with kv (batch, seqlen_k, 2, nheads_k, headdim); k, v are views (no copy)."""
    validate.packed("kv", kv, 5, 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return _flash_attn(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, return_attn_probs, learnable_sink, attention_chunk,
                       names=("q", "kv[:, :, 0]", "kv[:, :, 1]"))
