"""FlashAttention-2's tile algebra in NumPy: forward and backward, exact in float64.

This is the algorithm the Triton kernels run, written so that a person can follow it.
Nothing here ever holds an (Sq, Sk) array: the largest temporaries are one (Br, Bc)
score tile per batch element and the O(N) row statistics.

Shapes: Q (..., Sq, d), K (..., Sk, d), V (..., Sk, dv), leading dims equal.
Causal masking is aligned bottom-right (flash-attn): query i sees key j iff
j <= i + Sk - Sq. A row that sees no key gets output 0 and LSE -inf, never NaN.

The online softmax, for one row and a new key tile with scores s_j::

    m_new = max(m_old, max_j s_j)
    l_new = exp(m_old - m_new) * l_old + sum_j exp(s_j - m_new)
    O_new = exp(m_old - m_new) * O_old + sum_j exp(s_j - m_new) v_j

Multiplying every earlier term by exp(m_old - m_new) re-bases it on the new maximum;
after the last tile O = O_new / l_new is exactly softmax(s) V, and the row's
log-sum-exp is m + log(l), saved for the backward pass.

An attention sink (a learned logit per head that joins only the denominator, gpt-oss) is
one more step of the same update after the last tile, with s = sink and no value row:
O is only rescaled. Its gradient needs nothing from the tiles: the sink's probability is
exp(sink - lse) and its dP is 0, so dsink = -sum_i exp(sink - lse_i) D_i.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from flashtile.reference._checks import check_block, check_qkv, check_scale, check_sink, reduce_to, result_dtype


def _tile_mask(r0: int, r1: int, c0: int, c1: int, offset: int) -> np.ndarray:
    """Bool (r1-r0, c1-c0): key c visible to query r iff c <= r + offset."""
    return np.arange(c0, c1)[None, :] <= np.arange(r0, r1)[:, None] + offset


def _crosses_diagonal(r0: int, c1: int, offset: int) -> bool:
    """A tile needs an element mask iff its last key is beyond its first row's diagonal."""
    return c1 - 1 > r0 + offset


def flash_attention_forward(
    Q,
    K,
    V,
    Br: int = 64,
    Bc: int = 64,
    causal: bool = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    sink=None,
):
    """Tiled attention forward, FlashAttention-2 loop order (Q tiles outer, K/V inner).

    Args:
        Q: (..., Sq, d) float32/float64.  K: (..., Sk, d).  V: (..., Sk, dv).
        Br: rows of a Q tile (>= 1; need not divide Sq).
        Bc: rows of a K/V tile (>= 1; need not divide Sk).
        causal: bottom-right aligned causal mask, applied inside the tiles that cross
            the diagonal; tiles wholly above it are never visited.
        scale: defaults to 1/sqrt(d).
        return_lse: also return lse (..., Sq), natural log, -inf for empty rows.
        sink: None, or logits broadcastable to the leading dims (e.g. (H,) for (B, H, Sq,
            d)): an attention sink in every row's denominator (module docstring); an empty
            row then gets O 0 and lse sink.

    Returns:
        O (..., Sq, dv), or (O, lse).
    """
    Q, K, V = check_qkv(Q, K, V)
    Br, Bc = check_block("Br", Br), check_block("Bc", Bc)
    scale = check_scale(scale, Q.shape[-1])
    dtype = result_dtype(Q, K, V)
    lead = Q.shape[:-2]
    sinks = check_sink(sink, lead, dtype)
    Sq, Sk, dv = Q.shape[-2], K.shape[-2], V.shape[-1]
    offset = Sk - Sq  # bottom-right alignment of the causal diagonal

    O = np.empty(lead + (Sq, dv), dtype=dtype)
    lse = np.empty(lead + (Sq,), dtype=dtype)
    for r0 in range(0, Sq, Br):
        r1 = min(r0 + Br, Sq)
        q = Q[..., r0:r1, :].astype(dtype)
        m = np.full(lead + (r1 - r0,), -np.inf, dtype=dtype)  # running row max
        l = np.zeros(lead + (r1 - r0,), dtype=dtype)  # running sum of exp(s - m)
        acc = np.zeros(lead + (r1 - r0, dv), dtype=dtype)  # running sum of exp(s - m) v
        # The last key any row of this tile may see is (r1 - 1) + offset.
        c_stop = min(Sk, r1 + offset) if causal else Sk
        for c0 in range(0, max(c_stop, 0), Bc):
            c1 = min(c0 + Bc, Sk)
            s = (q @ np.swapaxes(K[..., c0:c1, :].astype(dtype), -1, -2)) * scale
            if causal and _crosses_diagonal(r0, c1, offset):
                s = np.where(_tile_mask(r0, r1, c0, c1, offset), s, -np.inf)
            m_new = np.maximum(m, s.max(axis=-1))
            # A row with nothing visible yet has m_new = -inf; subtracting 0 instead
            # keeps exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN.
            m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
            p = np.exp(s - m_safe[..., None])
            alpha = np.exp(m - m_safe)  # rescale of everything accumulated so far
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ V[..., c0:c1, :].astype(dtype)
            m = m_new
        if sinks is not None:  # one more logit per row, with no value row
            s_sink = np.broadcast_to(sinks, lead)[..., None]
            m_new = np.maximum(m, s_sink)
            m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
            alpha = np.exp(m - m_safe)
            l = alpha * l + np.exp(s_sink - m_safe)
            acc = alpha[..., None] * acc
            m = m_new
        seen = l > 0
        O[..., r0:r1, :] = np.where(seen[..., None], acc / np.where(seen, l, 1.0)[..., None], 0.0)
        with np.errstate(divide="ignore"):
            lse[..., r0:r1] = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
    return (O, lse) if return_lse else O


def flash_attention_backward(
    Q,
    K,
    V,
    O,
    dO,
    lse,
    Br: int = 64,
    Bc: int = 64,
    causal: bool = False,
    scale: Optional[float] = None,
    sink=None,
):
    """Tiled attention backward (FlashAttention-2): K/V tiles outer, Q tiles inner.

    Scores are recomputed tile by tile from the saved ``lse`` (P = exp(S - lse)), so no
    (Sq, Sk) array exists. With D = rowsum(dO * O) computed once up front::

        dV_j += P^T dO_i        dP = dO_i V_j^T        dS = P * (dP - D_i)
        dK_j += scale * dS^T Q_i        dQ_i += scale * dS K_j

    dK and dV of a key tile are finished inside the inner loop; dQ is accumulated
    across key tiles (the GPU kernel does that with atomics or a second pass).

    Args:
        Q, K, V: as in :func:`flash_attention_forward`.
        O: (..., Sq, dv) forward output.  dO: (..., Sq, dv) upstream gradient.
        lse: (..., Sq) from ``flash_attention_forward(..., return_lse=True)``.
        Br, Bc, causal, scale: as in the forward; need not equal the forward's tiles.
        sink: the forward's sink (its lse includes it): the tiles need nothing more, and
            dsink = -sum_i exp(sink - lse_i) D_i is returned too.

    Returns:
        (dQ, dK, dV) with the shapes of Q, K, V; with a sink, (dQ, dK, dV, dsink).
    """
    Q, K, V = check_qkv(Q, K, V)
    Br, Bc = check_block("Br", Br), check_block("Bc", Bc)
    scale = check_scale(scale, Q.shape[-1])
    dtype = result_dtype(Q, K, V)
    lead = Q.shape[:-2]
    Sq, Sk, dv = Q.shape[-2], K.shape[-2], V.shape[-1]
    for name, arr, shape in (("O", O, lead + (Sq, dv)), ("dO", dO, lead + (Sq, dv)), ("lse", lse, lead + (Sq,))):
        if np.shape(arr) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {np.shape(arr)}")
    O, dO, lse = (np.asarray(a, dtype=dtype) for a in (O, dO, lse))
    offset = Sk - Sq

    D = (dO * O).sum(axis=-1)  # (..., Sq): equals rowsum(dP * P), the softmax Jacobian term
    # Empty rows (lse = -inf) must give P = 0: exp(s - (+inf)) = 0 where exp(s + inf) would not.
    lse_safe = np.where(np.isneginf(lse), np.inf, lse)
    dQ = np.zeros(Q.shape, dtype=dtype)
    dK = np.empty(K.shape, dtype=dtype)
    dV = np.empty(V.shape, dtype=dtype)
    for c0 in range(0, Sk, Bc):
        c1 = min(c0 + Bc, Sk)
        k = K[..., c0:c1, :].astype(dtype)
        v = V[..., c0:c1, :].astype(dtype)
        dk = np.zeros(k.shape, dtype=dtype)
        dv_acc = np.zeros(v.shape, dtype=dtype)
        # The first query that sees key c0 is c0 - offset; start at its tile.
        r_start = (max(0, c0 - offset) // Br) * Br if causal else 0
        for r0 in range(r_start, Sq, Br):
            r1 = min(r0 + Br, Sq)
            q = Q[..., r0:r1, :].astype(dtype)
            do = dO[..., r0:r1, :]
            s = (q @ np.swapaxes(k, -1, -2)) * scale
            if causal and _crosses_diagonal(r0, c1, offset):
                s = np.where(_tile_mask(r0, r1, c0, c1, offset), s, -np.inf)
            p = np.exp(s - lse_safe[..., r0:r1, None])
            dv_acc += np.swapaxes(p, -1, -2) @ do
            dp = do @ np.swapaxes(v, -1, -2)
            ds = p * (dp - D[..., r0:r1, None])
            dQ[..., r0:r1, :] += scale * (ds @ k)
            dk += scale * (np.swapaxes(ds, -1, -2) @ q)
        dK[..., c0:c1, :] = dk
        dV[..., c0:c1, :] = dv_acc
    sinks = check_sink(sink, lead, dtype)
    if sinks is None:
        return dQ, dK, dV
    p_sink = np.exp(np.broadcast_to(sinks, lead)[..., None] - lse_safe)  # 0 on rows with lse -inf
    return dQ, dK, dV, reduce_to(-(p_sink * D).sum(axis=-1), sinks.shape)
