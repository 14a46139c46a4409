"""The one validation layer of the public functions: every check runs before any launch
and raises ValueError or TypeError naming the argument and the value received."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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


def _real(name: str, value, what: str = "a float") -> float:
    """A Python or NumPy real number (not a bool) as a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return float(value)


def _integer(name: str, value) -> int:
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


def _flag(name: str, value) -> bool:
    """A Python or NumPy bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _check_scale(name: str, scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = _real(name, scale, "a float or None")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return scale


def _check_dropout(dropout_p) -> float:
    dropout_p = _real("dropout_p", dropout_p)
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


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


def _check_window(window_size) -> tuple[int, int]:
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
        value = _integer(f"window_size {side}", value)
        if value < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 = unbounded), got {value}")
        sides.append(value)
    return sides[0], sides[1]


def _check_softcap(softcap) -> float:
    softcap = _real("softcap", softcap)
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {softcap}")
    return softcap


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


# --------------------------------------------------------------------------- varlen
def _check_index_tensor(name: str, t, ndim: int, device) -> torch.Tensor:
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


def _check_max_seqlen(name: str, value) -> int:
    value = _integer(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


# Validated varlen metadata: one host copy per distinct set of tensors (a training step
# reuses its cu_seqlens across every layer). Keyed by the tensors' identity, storage and
# version counter, so an in-place edit or a new tensor is checked again.
_CHECKED: dict = {}
_CHECKED_MAX = 64


def _values_key(tensors, scalars) -> tuple:
    return tuple((id(t), t.data_ptr(), t._version) if t is not None else None for t in tensors) + tuple(scalars)


def _check_varlen_values(cu_q, cu_k, used_q, used_k, max_q: int, max_k: int, total_q: int, total_k: Optional[int],
                         block_table=None, page_size: int = 0, num_blocks: int = 0) -> None:
    """The checks that need the values of the metadata tensors: one device-to-host copy,
    remembered per set of tensors; skipped while a CUDA graph is being captured or
    torch.compile traces (the kernels clamp every index, so unchecked values stay
    memory-safe, though their results are then unspecified).

    ``total_k`` is None for paged keys (lengths are bounded by the block table instead).
    """
    tensors = (cu_q, cu_k, used_q, used_k, block_table)
    if torch.compiler.is_compiling() or (cu_q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    # Inference tensors have no version counter: checked on every call, never cached.
    cacheable = not any(t is not None and t.is_inference() for t in tensors)
    key = _values_key(tensors, (max_q, max_k, total_q, total_k, page_size, num_blocks)) if cacheable else None
    if key is not None and key in _CHECKED:
        return
    parts = [t.reshape(-1).to(torch.int64) for t in tensors if t is not None]
    host = torch.cat(parts).cpu().tolist() if parts else []
    pos = 0

    def take(t):
        nonlocal pos
        if t is None:
            return None
        n = t.numel()
        values = host[pos:pos + n]
        pos += n
        return values

    cq, ck, uq, uk, bt = (take(t) for t in tensors)
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
                raise ValueError(f"sequence {b} has {n} keys, more than block_table holds "
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
