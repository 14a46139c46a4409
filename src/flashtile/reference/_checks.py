"""Input validation shared by the NumPy reference functions.

Every check raises ``ValueError`` or ``TypeError`` naming the argument and the value
received, before any arithmetic runs.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

_FLOAT_DTYPES = (np.float32, np.float64)


def as_float_array(name: str, x) -> np.ndarray:
    """Return ``x`` as a float32/float64 ndarray of rank >= 2, or raise naming ``name``."""
    if not isinstance(x, np.ndarray):
        try:
            x = np.asarray(x)
        except Exception as exc:  # pragma: no cover - exotic inputs
            raise TypeError(f"{name} must be array-like, got {type(x).__name__}") from exc
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or float64, got dtype {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape (N, d) or (..., N, d), got rank {x.ndim} shape {x.shape}")
    return x


def check_qkv(Q, K, V):
    """Validate Q (..., Sq, d), K (..., Sk, d), V (..., Sk, dv) and return them as arrays."""
    Q = as_float_array("Q", Q)
    K = as_float_array("K", K)
    V = as_float_array("V", V)
    if not (Q.ndim == K.ndim == V.ndim):
        raise ValueError(f"Q, K and V must have the same rank, got Q {Q.shape}, K {K.shape}, V {V.shape}")
    if Q.shape[:-2] != K.shape[:-2] or Q.shape[:-2] != V.shape[:-2]:
        raise ValueError(
            f"leading dimensions must match: Q {Q.shape[:-2]}, K {K.shape[:-2]}, V {V.shape[:-2]}"
        )
    if Q.shape[-1] != K.shape[-1]:
        raise ValueError(f"head dim d of Q and K must match: Q d={Q.shape[-1]}, K d={K.shape[-1]}")
    if K.shape[-2] != V.shape[-2]:
        raise ValueError(f"K and V must have the same length: K {K.shape[-2]}, V {V.shape[-2]}")
    if Q.shape[-1] < 1:
        raise ValueError(f"head dim d must be >= 1, got Q shape {Q.shape}")
    if Q.shape[-2] < 1 or K.shape[-2] < 1:
        raise ValueError(f"sequence lengths must be >= 1, got Sq={Q.shape[-2]}, Sk={K.shape[-2]}")
    return Q, K, V


def result_dtype(*arrays: np.ndarray) -> np.dtype:
    """float64 if any input is float64 (the reference's exact mode), else float32."""
    return np.result_type(*arrays)


def check_scale(scale: Optional[float], d: int) -> float:
    """Default 1/sqrt(d); reject NaN/inf and non-numbers."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def check_block(name: str, value) -> int:
    """Tile sizes are positive integers."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def check_sink(sink, lead: tuple, dtype) -> Optional[np.ndarray]:
    """None, or per-row-group sink logits broadcastable to the leading dims ``lead`` (one
    per (batch, head), e.g. shape (H,) for Q (B, H, Sq, d)), as an array of ``dtype``."""
    if sink is None:
        return None
    arr = np.asarray(sink)
    if arr.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"sink must be float32 or float64, got dtype {arr.dtype}")
    try:
        np.broadcast_to(arr, lead)
    except ValueError:
        raise ValueError(f"sink of shape {arr.shape} does not broadcast to the leading dims {lead}") from None
    return arr.astype(dtype)


def reduce_to(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum a gradient over the axes that broadcasting ``shape`` added or stretched."""
    while grad.ndim > len(shape):
        grad = grad.sum(axis=0)
    for axis, n in enumerate(shape):
        if n == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad
