"""Every argument check of every entry point, and the problem each call reduces to.

The public functions (``flashtile.api``, ``flashtile.parallel``) call one builder each
(``flash_call``, ``varlen_call``, ``kvcache_call``, ``sdpa_call``, ``parallel_call``),
which checks every argument before anything runs and returns the canonical problem
(``problem.spec``): an error is a ValueError or TypeError that names the argument and the
value received, raised before any kernel launch and before a cache is written. The checks
of metadata *values* (cu_seqlens, cache_seqlens, block tables) read them on the host once
per set of tensors; values held by CUDA tensors of a kv-cache call are checked on the
device instead (``flashtile.api.kvcache``).

Shapes of q, k, v are checked by one function (``qkv_shapes``) for every layout.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import NamedTuple, Optional

import numpy as np
import torch

from flashtile.problem.spec import CacheSpec, Problem, Varlen
from flashtile.problem.window import effective_chunk, effective_window

MAX_HEAD_DIM = 512
MAX_DECODE_HEAD_DIM = 576  # q and k of a kv-cache call: MLA's absorbed decode (512 latent + 64 rope)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class BlockTableCapacityError(ValueError, RuntimeError):
    """A paged call addresses more keys than ``block_table`` holds. A ValueError like every
    argument error here, and a RuntimeError where flash-attn raises one (its #2709)."""


# --------------------------------------------------------------------------- scalars
def real(name: str, value, what: str = "a float") -> float:
    """A Python or NumPy real number (not a bool) as a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return float(value)


def integer(name: str, value) -> int:
    """A Python or NumPy integer, or a one-element integer tensor (not a bool), as an int."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int, got a {value.dtype} tensor of shape {tuple(value.shape)}")
        return int(value.item())
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


def padding_sequences(value, return_attn_probs, dropout_p) -> bool:
    """``padding_sequences`` of a varlen call: a bool, not with dropout's S_dmask (which the
    padded bounds would size: total_q x total_k per sequence)."""
    on = flag("padding_sequences", value)
    if on and return_attn_probs is True and isinstance(dropout_p, (int, float)) and dropout_p > 0:
        raise ValueError("padding_sequences cannot be combined with return_attn_probs and dropout (S_dmask would be "
                         "sized by the padded bounds, total_q x total_k per sequence)")
    return on


def flag(name: str, value) -> bool:
    """A Python or NumPy bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def softmax_scale(name: str, scale, head_dim: int) -> float:
    """The softmax scale (None: 1 / sqrt(head_dim)); finite."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = real(name, scale, "a float or None")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return scale


def dropout(dropout_p) -> float:
    dropout_p = real("dropout_p", dropout_p)
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


def softcap(value) -> float:
    value = real("softcap", value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {value}")
    return value


def window(window_size) -> tuple[int, int]:
    """(left, right) from a tuple, list or 2-element integer tensor of ints (NumPy ints too)."""
    if isinstance(window_size, torch.Tensor):
        if window_size.shape != (2,) or window_size.dtype.is_floating_point or window_size.dtype == torch.bool:
            raise TypeError(f"window_size must be a pair (left, right) of ints, got a {window_size.dtype} tensor "
                            f"of shape {tuple(window_size.shape)}")
        window_size = window_size.tolist()
    elif isinstance(window_size, np.ndarray):
        window_size = window_size.tolist()
    if not isinstance(window_size, Sequence) or isinstance(window_size, str) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right), got {window_size!r}")
    sides = []
    for side, value in zip(("left", "right"), window_size):
        value = integer(f"window_size {side}", value)
        if value < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 = unbounded), got {value}")
        sides.append(value)
    return sides[0], sides[1]


def causal_window(causal, window_size, name: str = "causal") -> tuple[int, int]:
    """The window of a flash-attn-style call: ``window_size``, its right side 0 when causal
    (not yet normalised against the lengths: ``problem.window.effective_window``)."""
    left, right = window(window_size)
    if flag(name, causal):
        right = 0
    return left, right


def attention_chunk(value) -> int:
    """Chunked attention's chunk size: an int >= 1, or 0 (off: FA3's default)."""
    value = integer("attention_chunk", value)
    if not 0 <= value <= 2**31 - 1:
        raise ValueError(f"attention_chunk must be >= 1 (a chunk of that many positions; 0 = off) and fit int32, "
                         f"got {value}")
    return value


def max_seqlen(name: str, value) -> int:
    value = integer(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


# --------------------------------------------------------------------------- tensors
def tensor(name: str, x, ndim: int) -> None:
    """A float16/bfloat16/float32 torch.Tensor of ``ndim`` dimensions."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got {x.dim()} (shape {tuple(x.shape)})")
    if x.dtype not in DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")


def same_dtype_and_device(q, k, v, names=("q", "k", "v")) -> None:
    for name, t in zip(names[1:], (k, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{names[0]} and {name} must have the same dtype, got {q.dtype} and {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{names[0]} and {name} must be on the same device, got {q.device} and {t.device}")


def heads(nheads: int, nheads_k: int, qname: str = "q", kname: str = "k") -> None:
    if nheads_k < 1 or nheads % nheads_k != 0:
        raise ValueError(
            f"number of query heads ({nheads}) must be divisible by the number of "
            f"key/value heads ({nheads_k}) of {kname}"
        )


def head_dim(name: str, value: int, limit: int = MAX_HEAD_DIM) -> None:
    if not (1 <= value <= limit):
        raise ValueError(f"head dim of {name} must be in [1, {limit}], got {value}")


class Shapes(NamedTuple):
    """What ``qkv_shapes`` read off q, k, v."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    head_dim_v: int


# Where the batch, sequence and head axes are in each layout (None: no such axis).
_AXES = {"bshd": (0, 1, 2), "bhsd": (0, 2, 1), "thd": (None, 0, 1), "cache": (0, 1, 2), "paged": (0, 1, 2)}
_KV_DOCS = {"bshd": " (batch, seqlen_k, nheads_k, headdim)", "bhsd": " (batch, nheads_k, seqlen_k, headdim)",
            "thd": " (total_k, nheads_k, headdim)", "paged": " (num_blocks, page_block_size, nheads_k, headdim)",
            "cache": " (batch_cache, seqlen_cache, nheads_k, headdim), or paged (num_blocks, page_block_size, nheads_k, "
                     "headdim)"}


def qkv_shapes(q, k, v, names=("q", "k", "v"), layout: str = "bshd", kv_layout: Optional[str] = None,
               max_qk: int = MAX_HEAD_DIM) -> Shapes:
    """The one check of q, k, v for every entry point: tensors of the layout's rank, one
    dtype and device, k and v of one shape but the head dim, one batch, q and k of one head
    dim in [1, ``max_qk``], v's in [1, MAX_HEAD_DIM] (it may differ: DeepSeek's 192 / 128),
    query heads a multiple of key/value heads.

    ``layout``: "bshd" (flash-attn), "bhsd" (SDPA) or "thd" (packed); ``kv_layout``: k and
    v's, when it differs: "paged" (num_blocks, page, Hk, D) or "cache" (a kv cache: rows
    or pages).
    """
    qn, kn, vn = names
    kv_layout = kv_layout or layout
    kv_ndim = 3 if kv_layout == "thd" else 4
    tensor(qn, q, 3 if layout == "thd" else 4)
    tensor(kn, k, kv_ndim)
    tensor(vn, v, kv_ndim)
    same_dtype_and_device(q, k, v, names)
    qb, qs, qh = _AXES[layout]
    kb, ks, kh = _AXES[kv_layout]
    if qb is not None and layout == kv_layout:
        if k.shape[kb] != q.shape[qb] or v.shape[kb] != q.shape[qb]:
            raise ValueError(f"batch of {qn}, {kn}, {vn} must match, got {q.shape[qb]}, {k.shape[kb]}, "
                             f"{v.shape[kb]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{kn} and {vn} must have the same shape{_KV_DOCS[kv_layout]} but for the head dim, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    dim = q.shape[-1]
    if k.shape[-1] != dim:
        raise ValueError(f"head dim of {kn} ({k.shape[-1]}) must equal head dim of {qn} ({dim})")
    head_dim(qn, dim, max_qk)
    head_dim(vn, v.shape[-1])
    nheads, nheads_k = q.shape[qh], k.shape[kh]
    heads(nheads, nheads_k, qn, kn)
    return Shapes(1 if qb is None else q.shape[qb], q.shape[qs], k.shape[ks], nheads, nheads_k, dim, v.shape[-1])


def alibi(alibi_slopes, batch: int, nheads: int, device) -> Optional[torch.Tensor]:
    """(batch, nheads) float32 slopes from (nheads,) or (batch, nheads) ones (None: no ALiBi)."""
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


def sink(learnable_sink, nheads: int, device) -> None:
    """None, or a (nheads,) float16/bfloat16/float32 tensor on ``device``: one sink logit per
    query head (``problem.spec``; the kernels read it as float32, ``dispatch.attention``)."""
    if learnable_sink is None:
        return
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor or None, got {type(learnable_sink).__name__}")
    if learnable_sink.dtype not in DTYPES:
        raise TypeError(f"learnable_sink must be float16, bfloat16 or float32, got {learnable_sink.dtype}")
    if learnable_sink.device != device:
        raise ValueError(f"learnable_sink must be on {device} (the device of q), got {learnable_sink.device}")
    if tuple(learnable_sink.shape) != (nheads,):
        raise ValueError(f"learnable_sink must have shape ({nheads},) (one logit per query head), got "
                         f"{tuple(learnable_sink.shape)}")


def attn_mask(mask, query: torch.Tensor, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
    """A bool or float mask broadcast (as a view) to ``shape``."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and mask.dtype not in (query.dtype, torch.float32):
        raise TypeError(f"attn_mask must be bool, {query.dtype} or float32, got {mask.dtype}")
    if mask.device != query.device:
        raise ValueError(f"attn_mask must be on {query.device}, got {mask.device}")
    if mask.dim() > len(shape):
        raise ValueError(f"attn_mask must have at most {len(shape)} dimensions, got shape {tuple(mask.shape)}")
    try:
        return mask.expand(shape)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {shape}") from None


def index_tensor(name: str, t, ndim: int, device) -> torch.Tensor:
    """An int32 tensor of ``ndim`` dimensions on ``device`` (made contiguous)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension{'s' * (ndim > 1)}, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of q), got {t.device}")
    return t.contiguous()


def per_sequence(name: str, t, batch: int, device) -> Optional[torch.Tensor]:
    """None, or an int32 (batch,) tensor: one entry per sequence."""
    if t is None:
        return None
    t = index_tensor(name, t, 1, device)
    if t.numel() != batch:
        raise ValueError(f"{name} must have shape ({batch},) (one entry per sequence), got {tuple(t.shape)}")
    return t


def _block_table(block_table, batch: int, device) -> torch.Tensor:
    table = index_tensor("block_table", block_table, 2, device)
    if table.shape[0] != batch:
        raise ValueError(f"block_table must have shape ({batch}, max_blocks), got {tuple(table.shape)}")
    return table


# --------------------------------------------------------------------------- flash_attn_func
class FlashCall(NamedTuple):
    """A validated ``flash_attn_func`` call, all but its tensors (``entry.prepared``)."""

    problem: Problem
    want_probs: bool
    expand_alibi: bool  # (nheads,) slopes, expanded to (batch, nheads) per call


def flash_call(q, k, v, dropout_p, softmax_scale_, causal, window_size, softcap_, alibi_slopes, deterministic,
               return_attn_probs, learnable_sink=None, attention_chunk_=0, names=("q", "k", "v")) -> FlashCall:
    """Every check of a ``flash_attn_func`` call (q, k, v (batch, seqlen, heads, dim))."""
    shapes = qkv_shapes(q, k, v, names, "bshd")
    p = dropout(dropout_p)
    scale = softmax_scale("softmax_scale", softmax_scale_, shapes.head_dim)
    left, right = causal_window(causal, window_size)
    cap = softcap(softcap_)
    slopes = alibi(alibi_slopes, shapes.batch, shapes.nheads, q.device)
    sink(learnable_sink, shapes.nheads, q.device)
    chunk = attention_chunk(attention_chunk_)
    diag = shapes.seqlen_k - shapes.seqlen_q
    left, right = effective_window(left, right, shapes.seqlen_q, shapes.seqlen_k, diag)
    chunk = effective_chunk(chunk, right, shapes.seqlen_q, shapes.seqlen_k, diag)
    problem = Problem(scale, diag, left, right, cap, p, flag("deterministic", deterministic), chunk)
    return FlashCall(problem, flag("return_attn_probs", return_attn_probs), slopes is not alibi_slopes)


# --------------------------------------------------------------------------- flash_attn_varlen_func
class VarlenCall(NamedTuple):
    """A validated ``flash_attn_varlen_func`` call."""

    problem: Problem
    varlen: Varlen
    block_table: Optional[torch.Tensor]  # int32 (batch, max_blocks): k, v are paged
    alibi: Optional[torch.Tensor]
    want_probs: bool


def varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale_,
                causal, window_size, softcap_, alibi_slopes, deterministic, return_attn_probs, block_table,
                seqused_q, seqused_k, names=("q", "k", "v"), learnable_sink=None,
                attention_chunk_=0) -> VarlenCall:
    """Every check of a packed call, metadata values included (one host copy per set of
    tensors: ``varlen_values``). The window is normalised against the longest sequences:
    a side that hides no key of them hides none of any."""
    paged = block_table is not None
    shapes = qkv_shapes(q, k, v, names, "thd", "paged" if paged else "thd")
    device = q.device
    cu_q = index_tensor("cu_seqlens_q", cu_seqlens_q, 1, device)
    cu_k = index_tensor("cu_seqlens_k", cu_seqlens_k, 1, device)
    if cu_q.numel() < 1 or cu_k.numel() < 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must hold batch + 1 >= 1 entries")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got {cu_q.numel() - 1} "
                         f"and {cu_k.numel() - 1} sequences")
    batch = cu_q.numel() - 1
    max_q = max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = max_seqlen("max_seqlen_k", max_seqlen_k)
    used_q = per_sequence("seqused_q", seqused_q, batch, device)
    used_k = per_sequence("seqused_k", seqused_k, batch, device)
    table, page_size, num_blocks = None, 0, 0
    if paged:
        table = _block_table(block_table, batch, device)
        num_blocks, page_size = k.shape[0], k.shape[1]
        if page_size < 1:
            raise ValueError(f"page_block_size of {names[1]} must be >= 1, got shape {tuple(k.shape)}")
    p = dropout(dropout_p)
    scale = softmax_scale("softmax_scale", softmax_scale_, shapes.head_dim)
    left, right = causal_window(causal, window_size)
    cap = softcap(softcap_)
    slopes = alibi(alibi_slopes, batch, shapes.nheads, device)
    sink(learnable_sink, shapes.nheads, device)
    chunk = attention_chunk(attention_chunk_)
    det = flag("deterministic", deterministic)
    want_probs = flag("return_attn_probs", return_attn_probs)
    varlen_values(cu_q, cu_k, used_q, used_k, max_q, max_k, shapes.seqlen_q, None if paged else k.shape[0], table,
                  page_size, num_blocks)
    left, right = effective_window(left, right, max_q, max_k, max_k - max_q)
    chunk = effective_chunk(chunk, right, max_q, max_k, max_k - max_q, varlen=True)
    problem = Problem(scale, 0, left, right, cap, p, det, chunk)
    return VarlenCall(problem, Varlen(cu_q, cu_k, used_q, used_k, max_q, max_k), table, slopes, want_probs)


def varlen_repeat(call: VarlenCall, q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table,
                  alibi_slopes) -> VarlenCall:
    """A packed call whose key (``runtime.replay``: shapes, strides, dtypes, devices,
    alignment, scalars) an earlier ``varlen_call`` validated (``call``, stored without its
    tensors by ``varlen_prepared``): only the metadata values are checked again
    (``varlen_values``: a dictionary lookup when they are the tensors an earlier call
    checked), and the call gets this call's tensors."""
    v = call.varlen
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    used_q = None if seqused_q is None else seqused_q.contiguous()
    used_k = None if seqused_k is None else seqused_k.contiguous()
    table = None if block_table is None else block_table.contiguous()
    paged = table is not None
    varlen_values(cu_q, cu_k, used_q, used_k, v.max_seqlen_q, v.max_seqlen_k, q.shape[0],
                  None if paged else k.shape[0], table, k.shape[1] if paged else 0, k.shape[0] if paged else 0)
    slopes = alibi_slopes
    if slopes is not None and slopes.dim() == 1:
        slopes = slopes.unsqueeze(0).expand(cu_q.numel() - 1, slopes.shape[0])
    return call._replace(varlen=v._replace(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k),
                         block_table=table, alibi=slopes)


def varlen_prepared(call: VarlenCall) -> VarlenCall:
    """``call`` without its tensors: what a plan entry keeps for ``varlen_repeat``."""
    return call._replace(varlen=call.varlen._replace(cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                                                     seqused_k=None), block_table=None, alibi=None)


# Validated varlen metadata: one host copy per distinct set of tensors (a training step
# reuses its cu_seqlens across every layer). Keyed by the tensors' identity, storage and
# version counter, so an in-place edit or a new tensor is checked again.
_CHECKED: dict = {}
_CHECKED_MAX = 64


def _values_key(tensors, scalars) -> tuple:
    return tuple((id(t), t.data_ptr(), t._version) if t is not None else None for t in tensors) + tuple(scalars)


def _host_values(tensors) -> list:
    """The values of ``tensors`` (None entries stay None) in one device-to-host copy."""
    parts = [t.reshape(-1).long() for t in tensors if t is not None]
    host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().tolist() if parts else []
    out, pos = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        out.append(host[pos:pos + t.numel()])
        pos += t.numel()
    return out


def _tracing_or_capturing(t) -> bool:
    """Values cannot be read now: torch.compile traces, or a CUDA graph is being captured."""
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def varlen_values(cu_q, cu_k, used_q, used_k, max_q: int, max_k: int, total_q: int, total_k: Optional[int],
                  block_table=None, page_size: int = 0, num_blocks: int = 0) -> None:
    """The checks that need the values of a packed call's metadata: one device-to-host copy,
    remembered per set of tensors; skipped while a CUDA graph is being captured or
    torch.compile traces (the kernels clamp every index, so unchecked values stay
    memory-safe, though their results are then unspecified).

    ``total_k`` is None for paged keys (lengths are bounded by the block table instead).
    """
    tensors = (cu_q, cu_k, used_q, used_k, block_table)
    if _tracing_or_capturing(cu_q):
        return
    # Inference tensors have no version counter: checked on every call, never cached.
    cacheable = not any(t is not None and t.is_inference() for t in tensors)
    key = _values_key(tensors, (max_q, max_k, total_q, total_k, page_size, num_blocks)) if cacheable else None
    if key is not None and key in _CHECKED:
        return
    cq, ck, uq, uk, bt = _host_values(tensors)
    for name, cu, total in (("cu_seqlens_q", cq, total_q), ("cu_seqlens_k", ck, total_k)):
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {cu[0]}")
        for b in range(len(cu) - 1):
            if cu[b + 1] < cu[b]:
                raise ValueError(f"{name} must be non-decreasing, got {name}[{b}] = {cu[b]} > "
                                 f"{name}[{b + 1}] = {cu[b + 1]}")
        if total is not None and cu[-1] != total:
            raise ValueError(f"{name}[-1] ({cu[-1]}) must equal the number of tokens ({total})")
    lengths = {"q": [b - a for a, b in zip(cq, cq[1:])], "k": [b - a for a, b in zip(ck, ck[1:])]}
    for side, used in (("q", uq), ("k", uk)):
        if used is None:
            continue
        for b, (u, n) in enumerate(zip(used, lengths[side])):
            if not 0 <= u <= n:
                raise ValueError(f"seqused_{side}[{b}] = {u} must be in [0, {n}], the length of sequence {b}")
        lengths[side] = used
    if block_table is not None:
        pages_per_seq = block_table.shape[1]
        for b, n in enumerate(lengths["k"]):
            if n > pages_per_seq * page_size:
                raise BlockTableCapacityError(f"sequence {b} has {n} keys, more than block_table holds "
                                              f"({pages_per_seq} blocks of {page_size})")
            row = bt[b * pages_per_seq:(b + 1) * pages_per_seq]
            for j in range(-(-n // page_size)):
                if not 0 <= row[j] < num_blocks:
                    raise ValueError(f"block_table[{b}, {j}] = {row[j]} must be in [0, {num_blocks}) "
                                     f"(the number of blocks of k)")
    for side, bound in (("q", max_q), ("k", max_k)):
        longest = max(lengths[side], default=0)
        if longest > bound:
            raise ValueError(f"max_seqlen_{side} ({bound}) is smaller than the longest sequence ({longest})")
    if key is None:
        return
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED[key] = tuple(t for t in tensors if t is not None)  # kept alive: ids stay unique


# --------------------------------------------------------------------------- scaled_dot_product_attention
class SdpaCall(NamedTuple):
    """A validated SDPA call: q, k, v as (batch, heads, seqlen, dim) (3-D inputs get a head
    axis), the mask broadcast to (batch, heads, L, S), and whether to drop the head axis."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: Optional[torch.Tensor]
    problem: Problem
    squeeze: bool


def sdpa_call(query, key, value, attn_mask_, dropout_p, is_causal, scale, enable_gqa,
              learnable_sink=None) -> SdpaCall:
    """Every check of a ``scaled_dot_product_attention`` call (torch's semantics: top-left
    causal, heads must match unless ``enable_gqa``, no mask together with is_causal)."""
    squeeze = isinstance(query, torch.Tensor) and query.dim() == 3
    names = ("query", "key", "value")
    if squeeze:
        for name, t in zip(names, (query, key, value)):
            tensor(name, t, 3)
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    shapes = qkv_shapes(query, key, value, names, "bhsd")
    if shapes.nheads_k != shapes.nheads and not flag("enable_gqa", enable_gqa):
        raise ValueError(f"query has {shapes.nheads} heads and key {shapes.nheads_k}: pass enable_gqa=True for "
                         f"grouped-query attention")
    p = dropout(dropout_p)
    scale = softmax_scale("scale", scale, shapes.head_dim)
    causal = flag("is_causal", is_causal)
    if causal and attn_mask_ is not None:
        raise ValueError("attn_mask and is_causal=True cannot be given together (as in torch)")
    shape = (shapes.batch, shapes.nheads, shapes.seqlen_q, shapes.seqlen_k)
    if squeeze and attn_mask_ is not None:
        # 3-D inputs: torch broadcasts the mask against (batch, L, S); the head axis is ours.
        attn_mask_ = attn_mask(attn_mask_, query, (shapes.batch, shapes.seqlen_q, shapes.seqlen_k)).unsqueeze(1)
    mask = attn_mask(attn_mask_, query, shape)
    sink(learnable_sink, shapes.nheads, query.device)
    left, right = effective_window(-1, 0 if causal else -1, shapes.seqlen_q, shapes.seqlen_k, 0)
    return SdpaCall(query, key, value, mask, Problem(scale, 0, left, right, 0.0, p), squeeze)


# --------------------------------------------------------------------------- flex_attention
# kernel_options keys: flashtile's, and torch's (tuning hints of torch's own kernel: accepted
# so that Flex code runs unchanged; BLOCK_M, BLOCK_N, num_warps and num_stages size the
# Triton flex kernels' tiles, the rest are ignored).
FLEX_OPTIONS = ("deterministic",)
TORCH_FLEX_OPTIONS = ("num_warps", "num_stages", "BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2",
                      "BLOCK_N2", "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "WRITE_DQ",
                      "FORCE_USE_FLEX_ATTENTION", "USE_TMA", "kpack", "matrix_instr_nonkdim", "waves_per_eu",
                      "BACKEND")


def mod_parameter(what: str, value, minimum: float, strict: bool = False) -> None:
    """A ready-made mod's parameter (``api/mods.py``): a number >= ``minimum`` (> with ``strict``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{what} must be {'>' if strict else '>='} {minimum}, got {value}")


def mod_tensor(what: str, t, ndims: tuple) -> None:
    """A tensor a ready-made mod captures: a torch.Tensor of one of ``ndims`` dimensions."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in ndims:
        raise ValueError(f"{what} must have {' or '.join(map(str, ndims))} dimensions, got shape {tuple(t.shape)}")


class FlexCall(NamedTuple):
    """A validated ``flex_attention`` call: the scale, the block sparsity
    (``problem.blockmask.Sparsity`` or None), whether the LSE is returned (and how:
    "tuple" for return_lse, "aux" for return_aux), and the kernel options."""

    scale: float
    sparsity: object
    want_lse: str
    deterministic: bool
    options: dict


def flex_call(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
              return_aux) -> FlexCall:
    """Every check of a ``flex_attention`` call (torch's semantics: query (B, Hq, L, E),
    key (B, Hkv, S, E), value (B, Hkv, S, Ev); Hq == Hkv unless ``enable_gqa``)."""
    from flashtile.problem import blockmask

    names = ("query", "key", "value")
    shapes = qkv_shapes(query, key, value, names, "bhsd")
    if shapes.nheads_k != shapes.nheads and not flag("enable_gqa", enable_gqa):
        raise ValueError(f"query has {shapes.nheads} heads and key {shapes.nheads_k}: pass enable_gqa=True for "
                         f"grouped-query attention")
    scale = softmax_scale("scale", scale, shapes.head_dim)
    if score_mod is not None:
        blockmask.mod_arity("score_mod", score_mod, 5)
    sparsity = blockmask.sparsity(block_mask, shapes.batch, shapes.nheads, shapes.seqlen_q, shapes.seqlen_k,
                                  query.device)
    if sparsity is not None and sparsity.mask_mod is not None:
        blockmask.mod_arity("block_mask.mask_mod", sparsity.mask_mod, 4)
    want = "tuple" if flag("return_lse", return_lse) else ""
    if return_aux is not None:
        if want:
            raise ValueError("return_lse and return_aux cannot be given together (as in torch): use "
                             "return_aux=AuxRequest(lse=True)")
        if not hasattr(return_aux, "lse"):
            raise TypeError(f"return_aux must be a torch AuxRequest or None, got {type(return_aux).__name__}")
        if getattr(return_aux, "max_scores", False):
            raise NotImplementedError("return_aux=AuxRequest(max_scores=True): flashtile's flex_attention returns "
                                      "the LSE only")
        want = "aux"
        aux_lse = bool(return_aux.lse)
    options = {} if kernel_options is None else kernel_options
    if not isinstance(options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(options).__name__}")
    unknown = sorted(set(options) - set(FLEX_OPTIONS) - set(TORCH_FLEX_OPTIONS))
    if unknown:
        raise ValueError(f"kernel_options has unknown keys {unknown}: flashtile takes {list(FLEX_OPTIONS)} and "
                         f"torch's {list(TORCH_FLEX_OPTIONS)}")
    for name in ("BLOCK_M", "BLOCK_N"):
        if name in options:
            value = integer(f"kernel_options[{name!r}]", options[name])
            if value < 16 or value & (value - 1):
                raise ValueError(f"kernel_options[{name!r}] must be a power of two >= 16, got {value}")
    deterministic = flag("kernel_options['deterministic']", options.get("deterministic", False))
    if want == "aux" and not aux_lse:
        want = "aux-none"
    return FlexCall(scale, sparsity, want, deterministic, dict(options))


# --------------------------------------------------------------------------- flash_attn_with_kvcache
def rotary_tables(cos, sin, q, dim: int) -> int:
    """rotary_dim of the tables (0: no rotary)."""
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
    if not 0 < rotary_dim <= dim:
        raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {rotary_dim}) must be in (0, headdim = {dim}]")
    return rotary_dim


class CacheCall(NamedTuple):
    """A validated ``flash_attn_with_kvcache`` call: the metadata as int32 tensors on q's
    device (cache_seqlens made one from an int), the spec, and what the call returns."""

    seqlens: torch.Tensor
    leftpad: Optional[torch.Tensor]
    batch_idx: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]
    alibi: Optional[torch.Tensor]
    rotary: bool
    spec: CacheSpec
    want_lse: bool
    sink: Optional[torch.Tensor] = None


_TRACED_VIEWS = (" (under torch.compile, views of one tensor with the same rows count as sharing memory: "
                 "their addresses are not known while tracing; pass tensors that are not views of one tensor)")


def _column_view(part: torch.Tensor, whole: torch.Tensor, offset: Optional[int] = None) -> bool:
    """Whether ``part`` is a view of some of ``whole``'s last-dim columns (rows the same, as
    ``whole[..., a:b]``): MLA's latent cache, v_cache = k_cache[..., :512], whose appends
    write the same memory. Other views of one buffer (k and v pages side by side) are not.
    ``offset``: the byte offset it must sit at (None: any within a row).

    Under torch.compile (fake tensors: no addresses, no storage offsets) the answer is
    conservative: views of one base (``part`` made from ``whole``, or both from one tensor)
    with the same rows count as sharing memory. The callers only refuse on it, so a traced
    call is refused where an eager one might not be, never computed differently."""
    if (part.dtype != whole.dtype or part.shape[:-1] != whole.shape[:-1] or part.stride() != whole.stride()
            or part.stride(-1) != 1):
        return False
    if torch.compiler.is_compiling():
        return part._base is whole or (part._base is not None and part._base is whole._base)
    if part.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr():
        return False
    gap = part.data_ptr() - whole.data_ptr()
    if gap % part.element_size():
        return False
    first = gap // part.element_size()
    return (offset is None or gap == offset) and 0 <= first and first + part.shape[-1] <= whole.shape[-1]


def kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, softmax_scale_, causal, window_size, softcap_, rotary_interleaved, alibi_slopes,
                 num_splits, return_softmax_lse, learnable_sink=None, attention_chunk_=0,
                 padding_sequences=False) -> CacheCall:
    """Every check of a kv-cache call but those of the metadata values (``cache_values``)."""
    shapes = qkv_shapes(q, k_cache, v_cache, ("q", "k_cache", "v_cache"), "bshd", "cache", MAX_DECODE_HEAD_DIM)
    batch, seqlen_q, nheads, dim = q.shape
    nheads_k = k_cache.shape[2]
    device = q.device
    paged = block_table is not None
    table = None
    if paged:
        table = _block_table(block_table, batch, device)
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
        tensor("k", k, 4)
        tensor("v", v, 4)
        same_dtype_and_device(q, k, v, ("q", "k", "v"))
        if (k.shape[:-1] != v.shape[:-1] or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]
                or v.shape[-1] != shapes.head_dim_v):
            raise ValueError(f"k and v must have shape ({batch}, seqlen_new, {nheads_k}, {dim}) and ({batch}, "
                             f"seqlen_new, {nheads_k}, {shapes.head_dim_v}), got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        new = k.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is required when k and v are appended")
        cache_seqlens = capacity
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens = index_tensor("cache_seqlens", cache_seqlens, 1, device)
        if seqlens.numel() != batch:
            raise ValueError(f"cache_seqlens must have shape ({batch},), got {tuple(seqlens.shape)}")
    else:
        seqlens = torch.full((batch,), integer("cache_seqlens", cache_seqlens), dtype=torch.int32, device=device)
    batch_idx = leftpad = None
    if cache_batch_idx is not None:
        batch_idx = index_tensor("cache_batch_idx", cache_batch_idx, 1, device)
        if batch_idx.numel() != batch:
            raise ValueError(f"cache_batch_idx must have shape ({batch},), got {tuple(batch_idx.shape)}")
    if cache_leftpad is not None:
        leftpad = index_tensor("cache_leftpad", cache_leftpad, 1, device)
        if leftpad.numel() != batch:
            raise ValueError(f"cache_leftpad must have shape ({batch},), got {tuple(leftpad.shape)}")
    rotary_dim = rotary_tables(rotary_cos, rotary_sin, q, dim)
    if rotary_dim and k is None:
        raise ValueError("rotary_cos/rotary_sin apply only when k and v are appended (as in flash-attn)")
    latent = _column_view(v_cache, k_cache)
    if rotary_dim and latent:
        raise ValueError("rotary_cos/rotary_sin cannot be used with a v_cache that shares k_cache's memory (a latent "
                         "cache): rotating k would rotate v too; apply the rotary embedding before the call"
                         + _TRACED_VIEWS * torch.compiler.is_compiling())
    if k is not None and latent and not _column_view(
            v, k, None if torch.compiler.is_compiling() else v_cache.data_ptr() - k_cache.data_ptr()):
        # Both appends write the shared columns, in no fixed order on a GPU (different threads
        # store k's and v's columns): only the same values give one answer.
        raise ValueError("v must be a view of k's columns, as v_cache is of k_cache's (MLA's latent cache: "
                         "v = k[..., :headdim_v]): both are appended into the same cache memory"
                         + _TRACED_VIEWS * torch.compiler.is_compiling())
    scale = softmax_scale("softmax_scale", softmax_scale_, dim)
    left, right = causal_window(causal, window_size)
    # q is rotated at its own positions when some side bounds the keys, as flash-attn
    # decides it: after trimming sides of at least the cache length to -1.
    local = any(0 <= side < capacity for side in (left, right))
    # Sides that hide no key of any sequence (len_k <= capacity) become -1 (unbounded), for
    # both paths: a raw 2**31 - 1 would overflow the decode kernel's int32 bounds.
    left, right = effective_window(left, right, seqlen_q, capacity, capacity - seqlen_q)
    # Every sequence has len_k <= capacity keys; rows at negative positions (seqlen_q >
    # len_k) exist in any sequence unless a single query is asked.
    chunk = effective_chunk(attention_chunk(attention_chunk_), right, seqlen_q, capacity, capacity - seqlen_q,
                            varlen=seqlen_q > 1)
    cap = softcap(softcap_)
    slopes = alibi(alibi_slopes, batch, nheads, device)
    sink(learnable_sink, nheads, device)
    interleaved = flag("rotary_interleaved", rotary_interleaved)
    splits = integer("num_splits", num_splits)
    if splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 = choose), got {splits}")
    want_lse = flag("return_softmax_lse", return_softmax_lse)
    padding = flag("padding_sequences", padding_sequences)
    spec = CacheSpec(scale, cap, left, right, interleaved, local, splits, new, seqlen_q, capacity, batch_cache,
                     num_blocks, page, rotary_cos.shape[0] if rotary_dim else -1, chunk, padding)
    return CacheCall(seqlens, leftpad, batch_idx, table, slopes, bool(rotary_dim), spec, want_lse, learnable_sink)


def cache_strides(k_cache, v_cache) -> None:
    """The kernels write the caches in place: unit stride along the head dim (the torch twin
    writes any layout)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along headdim (it is written in place), got strides "
                             f"{t.stride()}")


def cache_values(call: CacheCall) -> None:
    """The checks that need a kv-cache call's metadata values (one host copy; skipped while
    a CUDA graph is captured or torch.compile traces, where the writes are clamped instead)."""
    spec = call.spec
    seqlens = call.seqlens
    if _tracing_or_capturing(seqlens):
        return
    lens, pads, rows, table = _host_values((seqlens, call.leftpad, call.batch_idx, call.block_table))
    batch = len(lens)
    pads = pads or [0] * batch
    new = spec.new
    padding = [spec.padding and n < 0 for n in lens]  # padding sequences: nothing of theirs is read or written
    if rows is not None:
        for b, r in enumerate(rows):
            if not 0 <= r < spec.batch_cache and not padding[b]:
                raise ValueError(f"cache_batch_idx[{b}] = {r} must be in [0, {spec.batch_cache}) (the cache's batch)")
    paged = call.block_table is not None
    for b, n in enumerate(lens):
        if padding[b]:
            continue
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] = {n} must be >= 0 (or pass padding_sequences=True: a negative "
                             f"length then marks a padding sequence)")
        if n + new > spec.capacity:
            where = (f"the {spec.capacity} keys block_table holds ({call.block_table.shape[1]} blocks of "
                     f"{spec.page})" if paged else f"the cache length {spec.capacity}")
            error = BlockTableCapacityError if paged else ValueError
            raise error(f"cache_seqlens[{b}] + seqlen_new = {n} + {new} exceeds {where}")
        if not 0 <= pads[b] <= n:
            raise ValueError(f"cache_leftpad[{b}] = {pads[b]} must be in [0, cache_seqlens[{b}] = {n}]")
        if spec.rotary_len >= 0:
            # k at positions n + i, i < new (cache indices); q there too when causal/windowed
            need = n + max(new, spec.queries if spec.rotary_local else 1)
            if need > spec.rotary_len:
                raise ValueError(f"rotary_cos/rotary_sin hold {spec.rotary_len} positions, sequence {b} needs {need}")
    if paged:
        width = call.block_table.shape[1]
        for b, n in enumerate(lens):
            if padding[b]:
                continue
            row = table[b * width:(b + 1) * width]
            for j in range(-(-(n + new) // spec.page)):
                if not 0 <= row[j] < spec.num_blocks:
                    raise ValueError(f"block_table[{b}, {j}] = {row[j]} must be in [0, {spec.num_blocks}) "
                                     f"(the number of blocks of k_cache)")


# --------------------------------------------------------------------------- flashtile.parallel
def parallel_call(q, k, v, causal, window_size, softcap_, softmax_scale_) -> Problem:
    """The local shards of a context-parallel call: q, k, v (batch, local_seqlen, heads,
    dim) of one length, and the flash-attn scalars. The diagonal is per pair of shards."""
    shapes = qkv_shapes(q, k, v)
    if shapes.head_dim_v != shapes.head_dim:
        raise ValueError(f"the context-parallel layer takes one head dim for q, k and v; v's is {shapes.head_dim_v}, "
                         f"q's {shapes.head_dim}")
    if shapes.seqlen_k != shapes.seqlen_q:
        raise ValueError(f"k and v must have shape (batch, local_seqlen, nheads_k, headdim) matching q "
                         f"{tuple(q.shape)}, got {tuple(k.shape)} and {tuple(v.shape)}")
    left, right = causal_window(causal, window_size)
    return Problem(softmax_scale("softmax_scale", softmax_scale_, shapes.head_dim), 0, left, right,
                   softcap(softcap_))


def packed(name: str, x, ndim: int, axis: int, count: int, doc: str) -> None:
    """A packed tensor (qkv or kv) of ``ndim`` dimensions with ``count`` entries on ``axis``."""
    tensor(name, x, ndim)
    if x.shape[axis] != count:
        raise ValueError(f"{name} must have shape {doc}, got {tuple(x.shape)}")


def sequence_layout(layout: str, layouts: tuple[str, ...]) -> None:
    if layout not in layouts:
        raise ValueError(f"layout must be one of {layouts}, got {layout!r}")


def ring_call(q, k, v, causal, window_size, softcap_, softmax_scale_, layout: str, layouts) -> Problem:
    """``ring_attention``'s checks: ``parallel_call``'s, and a layout (zigzag wants an even
    local length)."""
    problem = parallel_call(q, k, v, causal, window_size, softcap_, softmax_scale_)
    sequence_layout(layout, layouts)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout 'zigzag' needs an even local_seqlen, got {q.shape[1]}")
    return problem


def shard_length(total: int, parts: int, layout: str, world: int) -> None:
    if total % parts:
        raise ValueError(f"sequence length {total} must be divisible by {parts} for layout {layout!r} on {world} ranks")


def ulysses_heads(nheads: int, world: int) -> None:
    if nheads % world:
        raise ValueError(f"ulysses_attention needs nheads ({nheads}) divisible by the world size ({world})")


def allgather_call(q, k, v, cu_seqlens, world: int) -> list[int]:
    """``varlen_allgather_attention``'s checks: local packed tensors of one token count, and
    the documents of the whole axis (read on the host) as a list of offsets."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor (local_tokens, heads, headdim)")
    if k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"k and v must have shape ({q.shape[0]}, nheads_k, headdim), got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    local = q.shape[0]
    if not cu or cu[0] != 0 or cu[-1] != world * local or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must run from 0 to world * local_tokens = {world * local}, non-decreasing; "
                         f"got {cu[:4]}...{cu[-2:]}")
    return cu


def combine_call(out_partial, lse_partial) -> None:
    """``flash_attn_combine``: (num_splits, batch, seqlen, nheads, headdim) partial outputs
    and (num_splits, batch, nheads, seqlen) LSEs on one device."""
    if not isinstance(out_partial, torch.Tensor) or not isinstance(lse_partial, torch.Tensor):
        raise TypeError("out_partial and lse_partial must be torch.Tensors")
    if out_partial.dim() != 5:
        raise ValueError(f"out_partial must be (num_splits, batch, seqlen, nheads, headdim), got shape "
                         f"{tuple(out_partial.shape)}")
    s, b, n, h, _ = out_partial.shape
    if tuple(lse_partial.shape) != (s, b, h, n):
        raise ValueError(f"lse_partial must have shape {(s, b, h, n)}, got {tuple(lse_partial.shape)}")
    if lse_partial.device != out_partial.device:
        raise ValueError(f"lse_partial must be on {out_partial.device}, got {lse_partial.device}")


def unpad_call(hidden_states, attention_mask) -> None:
    """``unpad_input``: a (batch, seqlen) mask of the hidden states' first two axes."""
    if not isinstance(hidden_states, torch.Tensor) or not isinstance(attention_mask, torch.Tensor):
        raise TypeError("hidden_states and attention_mask must be torch.Tensors")
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"attention_mask must have shape (batch, seqlen) = {tuple(hidden_states.shape[:2])}, "
                         f"got {tuple(attention_mask.shape)}")
    if attention_mask.device != hidden_states.device:
        raise ValueError(f"attention_mask must be on {hidden_states.device}, got {attention_mask.device}")


def pad_call(hidden_states, indices) -> None:
    """``pad_input``: one index per token."""
    if hidden_states.shape[0] != indices.numel():
        raise ValueError(f"hidden_states has {hidden_states.shape[0]} tokens but indices {indices.numel()}")
