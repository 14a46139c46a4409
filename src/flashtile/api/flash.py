"""flash-attn 2's fixed-length functions: ``flash_attn_func`` and its packed variants."""

from __future__ import annotations

from typing import Optional

import torch

from flashtile.runtime import replay as plan
from flashtile.problem.window import effective_window
from flashtile.dispatch import _Problem, attention_with_probs
from flashtile.problem.validate import (_check_alibi, _check_dropout, _check_head_dim, _check_heads, _check_same,
                                        _check_scale, _check_softcap, _check_tensor, _check_window, _flag,
                                        _unit_last_stride)


_PLANS = plan.cache("flash_attn_func")


def _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_attn_probs, names=("q", "k", "v")):
    """Validate (once per key: ``flashtile.runtime.replay``), then run; a repeated call without
    grad replays its whole launch plan."""
    inputs = (q, k, v, alibi_slopes)
    scalars = plan.plain_scalars((names, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                                  return_attn_probs))
    key = None if scalars is None else plan.make_key(inputs, scalars)
    if key is None:
        return _run(q, k, v, alibi_slopes, _prepare(q, k, v, dropout_p, softmax_scale, causal, window_size,
                                                    softcap, alibi_slopes, deterministic, return_attn_probs, names))
    entry = _PLANS.entry(key, inputs)
    prepared = entry.prepared
    if prepared is None:
        prepared = entry.prepared = _prepare(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                             alibi_slopes, deterministic, return_attn_probs, names)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _run(q, k, v, alibi_slopes, prepared, entry)  # autograd's Function replays the kernels' plans
    return plan.run(entry, inputs, lambda: _run(q, k, v, alibi_slopes, prepared))


def _prepare(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
             return_attn_probs, names):
    """Every check of a call; returns what its run needs besides the tensors."""
    qn, kn, vn = names
    _check_tensor(qn, q, 4)
    _check_tensor(kn, k, 4)
    _check_tensor(vn, v, 4)
    _check_same(q, k, v, names)
    batch, seqlen_q, nheads, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch of {qn}, {kn}, {vn} must match, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape != v.shape:
        raise ValueError(f"{kn} and {vn} must have the same shape (batch, seqlen_k, nheads_k, headdim), "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"head dim of {kn} ({k.shape[-1]}) must equal head dim of {qn} ({head_dim})")
    _check_head_dim(qn, head_dim)
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    _check_heads(nheads, nheads_k, qn, kn)
    dropout_p = _check_dropout(dropout_p)
    scale = _check_scale("softmax_scale", softmax_scale, head_dim)
    left, right = _check_window(window_size)
    if _flag("causal", causal):
        right = 0
    softcap = _check_softcap(softcap)
    alibi = _check_alibi(alibi_slopes, batch, nheads, q.device)
    left, right = effective_window(left, right, seqlen_q, seqlen_k, seqlen_k - seqlen_q)
    problem = _Problem(scale, seqlen_k - seqlen_q, left, right, softcap, dropout_p,
                       _flag("deterministic", deterministic))
    return problem, _flag("return_attn_probs", return_attn_probs), alibi is not alibi_slopes


def _run(q, k, v, alibi, prepared, hint=None):
    problem, want_probs, expand_alibi = prepared
    if expand_alibi:  # (nheads,) slopes, as _check_alibi expands them
        alibi = alibi.unsqueeze(0).expand(q.shape[0], alibi.shape[0])
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    out, lse, probs = attention_with_probs(q, k, v, problem, alibi, want_probs=want_probs, hint=hint, layout="bshd")
    return (out, lse, probs) if want_probs else out


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
):
    """Exact attention with flash-attn 2's interface and semantics.

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16/bfloat16/float32.
        k, v: (batch, seqlen_k, nheads_k, headdim); nheads % nheads_k == 0 (MQA/GQA:
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
            kernels under ``FLASHTILE_BWD_DQ=atomic``. With it: the split kernels (7
            products, no reductions).
        return_attn_probs: also return softmax_lse (differentiable, e.g. for a z-loss) and
            S_dmask: None without dropout; with dropout_p > 0 a (batch, nheads, seqlen_q,
            seqlen_k) float32 tensor holding exp(s - rowmax(s)) for kept entries, the
            same value negated where dropout dropped the entry and 0 where the mask hides
            it (so ``S_dmask.abs() * exp(rowmax - lse)`` are the probabilities and
            ``S_dmask >= 0`` the kernel's keep mask). For tests and debugging only: it is
            recomputed densely, O(seqlen_q * seqlen_k) memory.

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype; with ``return_attn_probs``,
        ``(out, softmax_lse, S_dmask)`` where softmax_lse is (batch, nheads, seqlen_q) float32,
        natural log, -inf for rows that see no key (whose output is 0).

    float32 inputs are computed with IEEE float32 dot products (no TF32), fp16/bf16 with
    fp32 accumulation and the probabilities rounded to the input dtype before P @ V.
    """
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       deterministic, return_attn_probs)


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
):
    """:func:`flash_attn_func` on qkv (batch, seqlen, 3, nheads, headdim); q, k, v are views (no copy)."""
    _check_tensor("qkv", qkv, 5)
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    return _flash_attn(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                       softcap, alibi_slopes, deterministic, return_attn_probs,
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
):
    """:func:`flash_attn_func` with kv (batch, seqlen_k, 2, nheads_k, headdim); k, v are views (no copy)."""
    _check_tensor("kv", kv, 5)
    if kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    return _flash_attn(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, return_attn_probs, names=("q", "kv[:, :, 0]", "kv[:, :, 1]"))
