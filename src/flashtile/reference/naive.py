"""The textbook attention formulas, materialising the full (Sq, Sk) score matrix.

These are the oracles of the tiled algorithm: short, obviously right, and O(N^2) in
memory. Shapes: Q (..., Sq, d), K (..., Sk, d), V (..., Sk, dv); leading dimensions
must match. Causal masking is aligned bottom-right, as in flash-attn: query i sees key
j iff j <= i + Sk - Sq. A row that sees no key has output 0 and LSE -inf.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from flashtile.reference._checks import check_qkv, check_scale, check_sink, reduce_to, result_dtype


def causal_visible(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """Bool (Sq, Sk) matrix: True where query i may attend to key j (bottom-right causal)."""
    rows = np.arange(seqlen_q)[:, None]
    cols = np.arange(seqlen_k)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def _scores(Q, K, causal: bool, scale: float, dtype) -> np.ndarray:
    S = (Q.astype(dtype) @ np.swapaxes(K.astype(dtype), -1, -2)) * scale
    if causal:
        S = np.where(causal_visible(Q.shape[-2], K.shape[-2]), S, -np.inf)
    return S


def _stable_softmax(S: np.ndarray, sink=None):
    """Row softmax with the row max subtracted; empty (all -inf) rows give 0 and LSE -inf.
    ``sink`` (broadcast to S's leading dims): one more logit per row in the denominator
    only (its probability is 1 - the row's sum)."""
    m = S.max(axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, np.broadcast_to(sink, S.shape[:-2])[..., None, None])
    m_safe = np.where(np.isneginf(m), 0.0, m)  # avoid (-inf) - (-inf) = NaN
    E = np.exp(S - m_safe)
    total = E.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(np.broadcast_to(sink, S.shape[:-2])[..., None, None] - m_safe)
    empty = total == 0
    P = np.where(empty, 0.0, E / np.where(empty, 1.0, total))
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, m_safe + np.log(total))[..., 0]
    return P, lse


def naive_attention(
    Q,
    K,
    V,
    causal: bool = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    sink=None,
):
    """softmax(scale * Q K^T [+ causal mask]) V, the stable textbook way.

    Args:
        Q: (..., Sq, d) float32/float64.  K: (..., Sk, d).  V: (..., Sk, dv).
        causal: mask keys j > i + Sk - Sq (bottom-right aligned).
        scale: defaults to 1/sqrt(d).
        return_lse: also return the row log-sum-exp (natural log), shape (..., Sq).
        sink: None, or logits broadcastable to the leading dims (e.g. (H,) for (B, H, Sq,
            d)): one more term exp(sink) in every row's denominator, with no value (an
            attention sink); the LSE includes it.

    Returns:
        O (..., Sq, dv) in the inputs' result dtype, or (O, lse) with ``return_lse``.
    """
    Q, K, V = check_qkv(Q, K, V)
    scale = check_scale(scale, Q.shape[-1])
    dtype = result_dtype(Q, K, V)
    P, lse = _stable_softmax(_scores(Q, K, causal, scale, dtype), check_sink(sink, Q.shape[:-2], dtype))
    O = P @ V.astype(dtype)
    return (O, lse) if return_lse else O


def unstable_attention(Q, K, V, scale: Optional[float] = None):
    """The formula as first written, exp(S) / sum(exp(S)) with no max subtracted.

    Kept to show what goes wrong: in float32, logits above ~88.7 overflow exp to inf and
    the division gives inf/inf = NaN. Never use it for anything but that demonstration.
    """
    Q, K, V = check_qkv(Q, K, V)
    scale = check_scale(scale, Q.shape[-1])
    dtype = result_dtype(Q, K, V)
    S = (Q @ np.swapaxes(K, -1, -2)).astype(dtype) * dtype.type(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        E = np.exp(S)
        P = E / E.sum(axis=-1, keepdims=True)
    return P @ V


def naive_attention_backward(
    Q,
    K,
    V,
    dO,
    causal: bool = False,
    scale: Optional[float] = None,
    sink=None,
):
    """Textbook gradients of O = softmax(scale * Q K^T) V with respect to Q, K, V.

    With P the probabilities and dO the upstream gradient (..., Sq, dv)::

        dV = P^T dO
        dP = dO V^T
        dS = P * (dP - rowsum(dP * P))      # softmax Jacobian, row by row
        dQ = scale * dS K,   dK = scale * dS^T Q

    With a ``sink`` (as in :func:`naive_attention`) the sink is one more key whose value is
    0: P is taken with it in the denominator, dP_sink = 0, so rowsum(dP * P) is unchanged
    and dsink = sum over rows of P_sink * (0 - rowsum(dP * P)), reduced to sink's shape.

    Returns:
        (dQ, dK, dV) with the shapes of Q, K, V; with a sink, (dQ, dK, dV, dsink).
    """
    Q, K, V = check_qkv(Q, K, V)
    scale = check_scale(scale, Q.shape[-1])
    dtype = result_dtype(Q, K, V)
    dO = np.asarray(dO, dtype=dtype)
    expected = Q.shape[:-1] + (V.shape[-1],)
    if dO.shape != expected:
        raise ValueError(f"dO must have shape {expected}, got {dO.shape}")
    sinks = check_sink(sink, Q.shape[:-2], dtype)
    P, lse = _stable_softmax(_scores(Q, K, causal, scale, dtype), sinks)
    Qd, Kd, Vd = Q.astype(dtype), K.astype(dtype), V.astype(dtype)
    dV = np.swapaxes(P, -1, -2) @ dO
    dP = dO @ np.swapaxes(Vd, -1, -2)
    rowsum = (dP * P).sum(axis=-1, keepdims=True)
    dS = P * (dP - rowsum)
    dQ = scale * (dS @ Kd)
    dK = scale * (np.swapaxes(dS, -1, -2) @ Qd)
    if sinks is None:
        return dQ, dK, dV
    p_sink = np.exp(np.broadcast_to(sinks, Q.shape[:-2])[..., None] - lse)
    return dQ, dK, dV, reduce_to(-(p_sink * rowsum[..., 0]).sum(axis=-1), sinks.shape)
