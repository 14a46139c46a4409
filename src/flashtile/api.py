"""flash-attn- and SDPA-compatible attention: validation, dispatch, the public functions.

Both APIs reduce to one canonical problem (see ``flashtile.ops.forward``): q (B, H, Sq, D),
k/v (B, Hk, Sk, D) as strided views, a diagonal offset (Sk - Sq for flash-attn's
bottom-right causal alignment, 0 for SDPA's top-left), an inclusive window (left, right)
around that diagonal (-1 = unbounded; causal = right 0), softcap, ALiBi slopes and an
explicit mask. Every check runs before any kernel launch and raises ``ValueError`` or
``TypeError`` naming the argument and the value received.

Backends: CUDA tensors run the Triton kernels; CPU tensors run the chunked torch twin
(same semantics, O(N) memory). ``FLASHTILE_BACKEND=triton|torch|auto`` forces one, e.g.
to run the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .ops.window import effective_window

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BACKENDS = ("auto", "triton", "torch")


# --------------------------------------------------------------------------- checks
def _check_tensor(name: str, x, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got {x.dim()} (shape {tuple(x.shape)})")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")


def _check_same(q, k, v, names=("q", "k", "v")) -> None:
    for name, t in zip(names[1:], (k, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{names[0]} and {name} must have the same dtype, got {q.dtype} and {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{names[0]} and {name} must be on the same device, got {q.device} and {t.device}")


def _check_scale(name: str, scale: Optional[float], head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return float(scale)


def _check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def _check_heads(nheads: int, nheads_k: int, qname: str = "q", kname: str = "k") -> None:
    if nheads_k < 1 or nheads % nheads_k != 0:
        raise ValueError(
            f"number of query heads ({nheads}) must be divisible by the number of "
            f"key/value heads ({nheads_k}) of {kname}"
        )


def _check_head_dim(name: str, head_dim: int) -> None:
    if not (1 <= head_dim <= MAX_HEAD_DIM):
        raise ValueError(f"head dim of {name} must be in [1, {MAX_HEAD_DIM}], got {head_dim}")


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    # The kernels need unit stride along the head dim; any other layout is copied once
    # (documented in the public docstrings), as flash-attn does.
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


# --------------------------------------------------------------------------- dispatch
@dataclass(frozen=True)
class _Problem:
    """The canonical attention problem (see module docstring)."""

    scale: float
    diag_offset: int
    window_left: int
    window_right: int
    softcap: float
    dropout_p: float = 0.0
    deterministic: bool = False


def _backend_for(device: torch.device) -> str:
    choice = os.environ.get("FLASHTILE_BACKEND", "auto").strip().lower() or "auto"
    if choice not in _BACKENDS:
        raise ValueError(f"FLASHTILE_BACKEND must be one of {_BACKENDS}, got {choice!r}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"FLASHTILE_BACKEND=triton needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors; got device {device}"
        )
    return choice


def _torch_path(q4, k4, v4, problem: _Problem, alibi, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked torch twin; plain differentiable torch code, so autograd traces it."""
    from . import autograd as ops
    from .ops.chunked import chunked_attention_forward

    out, lse = chunked_attention_forward(
        q4, k4, v4, scale=problem.scale, diag_offset=problem.diag_offset,
        window_left=problem.window_left, window_right=problem.window_right,
        softcap=problem.softcap, alibi_slopes=alibi, attn_mask=mask, dropout_p=problem.dropout_p,
    )
    if torch.is_grad_enabled() and out.requires_grad:
        return out.to(q4.dtype).transpose(1, 2).contiguous().transpose(1, 2), lse.to(torch.float32)
    out4 = ops._bshd_view(q4)
    lse_out = ops._new_lse(q4)
    out4.copy_(out)
    lse_out.copy_(lse)
    return out4, lse_out


def _attention(q4, k4, v4, problem: _Problem, alibi, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the canonical problem: out (B, H, Sq, D) laid out as (B, Sq, H, D), lse (B, H, Sq)."""
    if _backend_for(q4.device) == "torch":
        return _torch_path(q4, k4, v4, problem, alibi, mask)
    from . import autograd  # registers torch.ops.flashtile on first use

    if alibi is not None and alibi.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "alibi_slopes requires grad: the Triton kernels do not compute slope gradients; detach the slopes, "
            "or run on CPU tensors where the torch path differentiates them")
    if mask is not None and mask.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "attn_mask requires grad: the Triton kernels do not compute mask gradients (that would need an "
            "(L, S) gradient); detach the mask, or run on CPU tensors where the torch path differentiates it")
    seed = None
    if problem.dropout_p > 0.0:
        # The Philox key comes from torch's generator of that device: torch.manual_seed makes
        # the mask reproducible, and the backward redraws the same mask from the same key.
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q4.device)
    out, lse = autograd.attention(
        q4, k4, v4, problem.scale, problem.diag_offset, problem.window_left, problem.window_right,
        problem.softcap, alibi, mask, problem.dropout_p, seed,
        problem.deterministic or torch.are_deterministic_algorithms_enabled())
    return out.transpose(1, 2), lse


# --------------------------------------------------------------------------- flash-attn
def _check_window(window_size) -> tuple[int, int]:
    if not isinstance(window_size, Sequence) or isinstance(window_size, str) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = window_size
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"window_size {side} must be an int, got {value!r}")
        if value < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 = unbounded), got {value}")
    return left, right


def _check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {softcap}")
    return float(softcap)


def _check_alibi(alibi_slopes, batch: int, nheads: int, device) -> Optional[torch.Tensor]:
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on {device}, got {alibi_slopes.device}")
    if tuple(alibi_slopes.shape) == (nheads,):
        return alibi_slopes.unsqueeze(0).expand(batch, nheads)
    if tuple(alibi_slopes.shape) == (batch, nheads):
        return alibi_slopes
    raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {tuple(alibi_slopes.shape)}")


def _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_attn_probs, names=("q", "k", "v")):
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
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal:
        right = 0
    softcap = _check_softcap(softcap)
    alibi = _check_alibi(alibi_slopes, batch, nheads, q.device)
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))

    left, right = effective_window(left, right, seqlen_q, seqlen_k, seqlen_k - seqlen_q)
    problem = _Problem(scale, seqlen_k - seqlen_q, left, right, softcap, dropout_p, bool(deterministic))
    out4, lse = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), problem, alibi, None)
    out = out4.transpose(1, 2)
    if return_attn_probs:
        return out, lse, None
    return out


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
        deterministic: forbid the backward's atomic dQ variant, so gradients are bitwise
            reproducible (so does ``torch.use_deterministic_algorithms(True)``). The
            default backward is deterministic too: the Gluon backward on Hopper has no
            atomics, and the Triton kernels use them only with ``FLASHTILE_BWD_DQ=atomic``.
        return_attn_probs: also return softmax_lse and None in place of flash-attn's
            debugging probability matrix (never materialised here). softmax_lse is
            differentiable (e.g. for a z-loss).

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype; with ``return_attn_probs``,
        ``(out, softmax_lse, None)`` where softmax_lse is (batch, nheads, seqlen_q) float32,
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


# --------------------------------------------------------------------------- SDPA
def _check_mask(attn_mask, query: torch.Tensor, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in (query.dtype, torch.float32):
        raise TypeError(f"attn_mask must be bool, {query.dtype} or float32, got {attn_mask.dtype}")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask must be on {query.device}, got {attn_mask.device}")
    if attn_mask.dim() > len(shape):
        raise ValueError(f"attn_mask must have at most {len(shape)} dimensions, got shape {tuple(attn_mask.shape)}")
    try:
        return attn_mask.expand(shape)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {shape}") from None


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (same semantics).

    Args:
        query: (batch, heads, L, E) or (batch, L, E); float16/bfloat16/float32.
        key, value: (batch, heads_kv, S, E) / (batch, S, E). heads_kv must equal heads
            unless ``enable_gqa`` (then heads % heads_kv == 0). value's E must equal E.
        attn_mask: broadcastable to (batch, heads, L, S). bool: True = take part;
            float (query's dtype or float32): added to the scores. Evaluated inside the
            kernel tile by tile, never expanded in memory.
        dropout_p: as in torch: applied only when > 0 (pass 0.0 at evaluation time).
        is_causal: top-left aligned (torch's ``tril``): query i sees keys j <= i. Not
            together with attn_mask (as in torch).
        scale: defaults to 1 / sqrt(E).

    Returns:
        (batch, heads, L, E) in query's dtype (a transposed view of a (batch, L, heads, E)
        buffer, as torch's flash backend returns). Rows with no visible key give 0.
    """
    squeeze = isinstance(query, torch.Tensor) and query.dim() == 3
    ndim = 3 if squeeze else 4
    _check_tensor("query", query, ndim)
    _check_tensor("key", key, ndim)
    _check_tensor("value", value, ndim)
    _check_same(query, key, value, ("query", "key", "value"))
    if squeeze:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    batch, nheads, seqlen_q, head_dim = query.shape
    if key.shape[0] != batch or value.shape[0] != batch:
        raise ValueError(f"batch of query, key, value must match, got {batch}, {key.shape[0]}, {value.shape[0]}")
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[-1] != head_dim:
        raise ValueError(f"E of key ({key.shape[-1]}) must equal E of query ({head_dim})")
    _check_head_dim("query", head_dim)
    nheads_k, seqlen_k = key.shape[1], key.shape[2]
    if nheads_k != nheads and not enable_gqa:
        raise ValueError(f"query has {nheads} heads and key {nheads_k}: pass enable_gqa=True for grouped-query attention")
    _check_heads(nheads, nheads_k, "query", "key")
    dropout_p = _check_dropout(dropout_p)
    scale = _check_scale("scale", scale, head_dim)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask and is_causal=True cannot be given together (as in torch)")
    if squeeze and attn_mask is not None:
        # 3-D inputs: torch broadcasts the mask against (batch, L, S); the head axis is ours.
        attn_mask = _check_mask(attn_mask, query, (batch, seqlen_q, seqlen_k)).unsqueeze(1)
    mask = _check_mask(attn_mask, query, (batch, nheads, seqlen_q, seqlen_k))
    query, key, value = (_unit_last_stride(t) for t in (query, key, value))

    problem = _Problem(scale, 0, -1, 0 if is_causal else -1, 0.0, dropout_p)
    out, _ = _attention(query, key, value, problem, None, mask)
    return out.squeeze(1) if squeeze else out
