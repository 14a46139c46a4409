"""The NumPy reference: the tiled algebra against the textbook formulas (CPU, numpy only).

Groups: exactness (forward), tile-size invariance, causal masking, numerical stability,
log-sum-exp, gradients, dtypes, properties (hypothesis), memory, bad input.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.reference import (causal_visible, flash_attention_backward, flash_attention_forward, naive_attention,
                                 naive_attention_backward, unstable_attention)

EXACT_TOL = 1e-12  # float64: the tiles only re-associate sums
F32_TOL = 1e-5  # float32 inputs against the float64 computation of the same inputs


def make_qkv(seed: int, lead: tuple[int, ...], Sq: int, Sk: int, d: int, dv: int | None = None,
             dtype=np.float64, kind: str = "randn"):
    """Fresh random Q (lead, Sq, d), K (lead, Sk, d), V (lead, Sk, dv); never zeros.

    kind: "randn" standard normal; "rand" uniform [0, 1) (all scores positive, so the
    softmax is flat); "q5" standard normal with Q scaled by 5 (peaked softmax).
    """
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    draw = rng.random if kind == "rand" else rng.standard_normal
    Q = draw(lead + (Sq, d)) * (5.0 if kind == "q5" else 1.0)
    K = draw(lead + (Sk, d))
    V = draw(lead + (Sk, dv))
    return Q.astype(dtype), K.astype(dtype), V.astype(dtype)


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def ident(*parts) -> str:
    return "-".join(str(p) for p in parts)


# ---------------------------------------------------------------------------------------
# Exactness: tiled forward == naive formula in float64
# ---------------------------------------------------------------------------------------

SQUARE_N = (1, 7, 113, 1023)
HEAD_DIMS = (1, 3, 64, 80)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("N", SQUARE_N, ids=lambda n: f"N{n}")
def test_tiled_equals_naive_square(N: int, d: int, causal: bool) -> None:
    Q, K, V = make_qkv(N * 100 + d, (), N, N, d)
    out = flash_attention_forward(Q, K, V, causal=causal)
    ref = naive_attention(Q, K, V, causal=causal)
    assert out.shape == (N, d) and out.dtype == np.float64
    assert max_abs(out, ref) <= EXACT_TOL


SEQLEN_PAIRS = [(1, 1), (1, 239), (239, 1), (3, 799), (113, 203), (128, 217), (127, 513),
                (203, 113), (1023, 1024), (1024, 1023)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Sq,Sk", SEQLEN_PAIRS, ids=[f"Sq{a}-Sk{b}" for a, b in SEQLEN_PAIRS])
def test_tiled_equals_naive_rectangular(Sq: int, Sk: int, causal: bool) -> None:
    Q, K, V = make_qkv(Sq * 7 + Sk, (), Sq, Sk, 40)
    out, lse = flash_attention_forward(Q, K, V, Br=64, Bc=48, causal=causal, return_lse=True)
    ref, ref_lse = naive_attention(Q, K, V, causal=causal, return_lse=True)
    assert max_abs(out, ref) <= EXACT_TOL
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert max_abs(lse[finite], ref_lse[finite]) <= EXACT_TOL


@pytest.mark.parametrize("kind", ["randn", "rand", "q5"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tiled_equals_naive_batched(kind: str, causal: bool) -> None:
    """Leading (batch, heads) dims broadcast through the tile loop, and dv != d."""
    Q, K, V = make_qkv(11, (2, 3), 70, 90, 24, dv=17, kind=kind)
    out = flash_attention_forward(Q, K, V, Br=16, Bc=32, causal=causal)
    assert out.shape == (2, 3, 70, 17)
    assert max_abs(out, naive_attention(Q, K, V, causal=causal)) <= EXACT_TOL
    # Each (batch, head) slice is an independent problem.
    one = flash_attention_forward(Q[1, 2], K[1, 2], V[1, 2], Br=16, Bc=32, causal=causal)
    assert max_abs(out[1, 2], one) <= EXACT_TOL


def test_explicit_scale_is_used() -> None:
    Q, K, V = make_qkv(3, (), 20, 30, 8)
    out = flash_attention_forward(Q, K, V, scale=0.37, Br=8, Bc=8)
    assert max_abs(out, naive_attention(Q, K, V, scale=0.37)) <= EXACT_TOL
    assert max_abs(out, naive_attention(Q, K, V)) > 1e-3  # the default 1/sqrt(8) differs


def test_poisoned_output_buffers_are_fully_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward allocates O and lse with np.empty; fill them with NaN to prove every
    element is written (an edge tile forgotten would leave NaN behind)."""
    real_empty = np.empty

    def nan_empty(shape, dtype=float, *args, **kwargs):
        buf = real_empty(shape, dtype, *args, **kwargs)
        buf.fill(np.nan)
        return buf

    monkeypatch.setattr(np, "empty", nan_empty)
    for Sq, Sk, causal in ((37, 53, False), (53, 37, True), (37, 53, True)):
        Q, K, V = make_qkv(5, (2,), Sq, Sk, 8)
        out, lse = flash_attention_forward(Q, K, V, Br=16, Bc=8, causal=causal, return_lse=True)
        assert not np.isnan(out).any() and not np.isnan(lse).any()
        O, lse = flash_attention_forward(Q, K, V, Br=16, Bc=8, causal=causal, return_lse=True)
        grads = flash_attention_backward(Q, K, V, O, np.ones_like(O), lse, Br=8, Bc=16, causal=causal)
        assert not any(np.isnan(g).any() for g in grads)


# ---------------------------------------------------------------------------------------
# Tile sizes change the schedule, not the result
# ---------------------------------------------------------------------------------------

TILES = [(1, 1), (1, 7), (7, 1), (3, 5), (16, 16), (13, 29), (64, 64), (100, 100), (128, 1)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Br,Bc", TILES, ids=[f"Br{a}-Bc{b}" for a, b in TILES])
def test_tile_size_invariance(Br: int, Bc: int, causal: bool) -> None:
    # 45 x 61: divisible by none of the tiles above except 1; Br/Bc > N is allowed too.
    Q, K, V = make_qkv(17, (), 45, 61, 12)
    out, lse = flash_attention_forward(Q, K, V, Br=Br, Bc=Bc, causal=causal, return_lse=True)
    ref, ref_lse = flash_attention_forward(Q, K, V, Br=45, Bc=61, causal=causal, return_lse=True)
    assert max_abs(out, ref) <= EXACT_TOL
    assert max_abs(lse, ref_lse) <= EXACT_TOL
    dO = np.random.default_rng(1).standard_normal(out.shape)
    grads = flash_attention_backward(Q, K, V, out, dO, lse, Br=Br, Bc=Bc, causal=causal)
    ref_grads = naive_attention_backward(Q, K, V, dO, causal=causal)
    for g, r in zip(grads, ref_grads):
        assert max_abs(g, r) <= EXACT_TOL


# ---------------------------------------------------------------------------------------
# Causal masking (bottom-right aligned: query i sees key j iff j <= i + Sk - Sq)
# ---------------------------------------------------------------------------------------


def test_causal_visible_is_bottom_right() -> None:
    vis = causal_visible(2, 4)
    assert vis.tolist() == [[True, True, True, False], [True, True, True, True]]
    vis = causal_visible(4, 2)
    assert vis.tolist() == [[False, False], [False, False], [True, False], [True, True]]
    assert np.array_equal(causal_visible(5, 5), np.tril(np.ones((5, 5), dtype=bool)))


@pytest.mark.parametrize("Sq,Sk", [(40, 40), (24, 56), (56, 24)], ids=["square", "Sq<Sk", "Sq>Sk"])
@pytest.mark.parametrize("Br,Bc", [(8, 8), (7, 5), (1, 16)], ids=["Br8-Bc8", "Br7-Bc5", "Br1-Bc16"])
def test_causal_row_ignores_later_keys_bitwise(Sq: int, Sk: int, Br: int, Bc: int) -> None:
    offset = Sk - Sq
    Q, K, V = make_qkv(23, (), Sq, Sk, 16)
    rng = np.random.default_rng(99)
    base = flash_attention_forward(Q, K, V, Br=Br, Bc=Bc, causal=True)
    for i in range(max(0, -offset), Sq - 1, 5):
        last = i + offset  # the last key row i may see
        K2, V2 = K.copy(), V.copy()
        K2[last + 1:] = rng.standard_normal(K2[last + 1:].shape) * 10
        V2[last + 1:] = rng.standard_normal(V2[last + 1:].shape) * 10
        out = flash_attention_forward(Q, K2, V2, Br=Br, Bc=Bc, causal=True)
        assert np.array_equal(out[: i + 1], base[: i + 1]), f"row <= {i} read a later key"
        # The control: the later rows did read the changed keys, so the test can fail.
        assert not np.array_equal(out[i + 1:], base[i + 1:])


@pytest.mark.parametrize("Sq,Sk", [(40, 40), (24, 56), (56, 24)], ids=["square", "Sq<Sk", "Sq>Sk"])
def test_causal_row_depends_on_visible_keys(Sq: int, Sk: int) -> None:
    """Changing any key or value that row i sees changes row i (so masking is not too wide)."""
    offset = Sk - Sq
    Q, K, V = make_qkv(29, (), Sq, Sk, 16)
    base = flash_attention_forward(Q, K, V, Br=8, Bc=8, causal=True)
    i = Sq - 3
    for j in (0, (i + offset) // 2, i + offset):
        V2 = V.copy()
        V2[j] += 1.0
        assert not np.array_equal(flash_attention_forward(Q, K, V2, Br=8, Bc=8, causal=True)[i], base[i])
        if i + offset > 0:  # with a single visible key its softmax weight is 1 whatever K is
            K2 = K.copy()
            K2[j] += 1.0
            assert not np.array_equal(flash_attention_forward(Q, K2, V, Br=8, Bc=8, causal=True)[i], base[i])


@pytest.mark.parametrize("Br,Bc", [(4, 4), (16, 3), (1, 1)])
def test_empty_causal_rows_are_zero_with_lse_neg_inf(Br: int, Bc: int) -> None:
    """Sq > Sk causal: rows i < Sq - Sk see no key. Output exactly 0, LSE -inf, no NaN,
    and their gradients are 0."""
    Sq, Sk = 29, 11
    empty = Sq - Sk
    Q, K, V = make_qkv(31, (2,), Sq, Sk, 8)
    # No NaN is ever made and then hidden: an empty row must not compute (-inf) - (-inf).
    with np.errstate(invalid="raise", over="raise", divide="raise"):
        O, lse = flash_attention_forward(Q, K, V, Br=Br, Bc=Bc, causal=True, return_lse=True)
    assert not np.isnan(O).any() and not np.isnan(lse).any()
    assert np.all(O[:, :empty] == 0.0)
    assert np.all(np.isneginf(lse[:, :empty])) and np.all(np.isfinite(lse[:, empty:]))
    ref, ref_lse = naive_attention(Q, K, V, causal=True, return_lse=True)
    assert np.all(ref[:, :empty] == 0.0) and np.all(np.isneginf(ref_lse[:, :empty]))

    dO = np.random.default_rng(2).standard_normal(O.shape)  # nonzero upstream on empty rows too
    with np.errstate(invalid="raise", over="raise", divide="raise"):
        grads = flash_attention_backward(Q, K, V, O, dO, lse, Br=Br, Bc=Bc, causal=True)
        ref_grads = naive_attention_backward(Q, K, V, dO, causal=True)
    for dQ, dK, dV in (grads, ref_grads):
        assert not any(np.isnan(g).any() for g in (dQ, dK, dV))
        assert np.all(dQ[:, :empty] == 0.0)
        assert np.any(dQ[:, empty:] != 0.0)


# ---------------------------------------------------------------------------------------
# Numerical stability: logits shifted by +500
# ---------------------------------------------------------------------------------------

SHIFT = 500.0


def shifted_inputs(seed: int, N: int, d: int):
    """float32 (Q', K', V) whose scores with scale=1 are q.k/sqrt(d) + 500 for every pair:
    Q' = [Q/sqrt(d), 1], K' = [K, 500]. Softmax ignores a constant added to a row, so the
    attention equals that of (Q, K, V)."""
    Q, K, V = make_qkv(seed, (), N, N, d)
    Qs = np.concatenate([Q / math.sqrt(d), np.ones((N, 1))], axis=-1)
    Ks = np.concatenate([K, np.full((N, 1), SHIFT)], axis=-1)
    return Qs.astype(np.float32), Ks.astype(np.float32), V.astype(np.float32), (Q, K, V)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_shifted_logits_tiled_float32_is_finite_and_accurate(causal: bool) -> None:
    Qs, Ks, V, (Q, K, V64) = shifted_inputs(41, 200, 32)
    scores = Qs.astype(np.float64) @ Ks.astype(np.float64).T
    assert scores.min() > 450  # every logit really is around +500
    out = flash_attention_forward(Qs, Ks, V, Br=32, Bc=48, causal=causal, scale=1.0)
    assert out.dtype == np.float32 and np.all(np.isfinite(out))
    ref = naive_attention(Qs.astype(np.float64), Ks.astype(np.float64), V.astype(np.float64),
                          causal=causal, scale=1.0)
    # Scores near 500 carry float32 rounding of ~500 * 2^-24 = 3e-5 each.
    assert max_abs(out, ref) <= 1e-4
    # And the shift itself changes nothing: same as the unshifted problem.
    assert max_abs(ref, naive_attention(Q, K, V64, causal=causal)) <= 1e-4


def test_unstable_softmax_overflows_in_float32() -> None:
    Qs, Ks, V, _ = shifted_inputs(43, 64, 16)
    with np.errstate(all="raise"):  # the function must silence its own overflow
        out = unstable_attention(Qs, Ks, V, scale=1.0)
    assert out.dtype == np.float32
    assert np.isnan(out).any() or np.isinf(out).any()
    # float64 has headroom up to ~709, so the same formula survives +500 there.
    out64 = unstable_attention(*(x.astype(np.float64) for x in (Qs, Ks, V)), scale=1.0)
    assert np.all(np.isfinite(out64))


def test_unstable_attention_is_right_on_small_logits() -> None:
    Q, K, V = make_qkv(47, (), 30, 40, 8)
    assert max_abs(unstable_attention(Q, K, V), naive_attention(Q, K, V)) <= EXACT_TOL


def test_very_negative_logits_still_count() -> None:
    """A row whose logits are all far below any 'masked' constant like -1e5 is not empty."""
    Q, K, V = make_qkv(53, (), 12, 20, 4)
    Qs = np.concatenate([Q, np.ones((12, 1))], axis=-1)
    Ks = np.concatenate([K, np.full((20, 1), -1e6)], axis=-1)
    out, lse = flash_attention_forward(Qs, Ks, V, Br=4, Bc=8, causal=True, scale=1.0, return_lse=True)
    ref, ref_lse = naive_attention(Qs, Ks, V, causal=True, scale=1.0, return_lse=True)
    assert np.all(np.isfinite(out)) and np.all(lse < -9e5)
    assert max_abs(out, ref) <= 1e-9  # scores ~1e6 carry ~1e-10 absolute rounding
    assert max_abs(lse, ref_lse) <= 1e-9 * 1e6


# ---------------------------------------------------------------------------------------
# Log-sum-exp
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lse_is_logsumexp_of_scores(causal: bool) -> None:
    Sq, Sk, d = 33, 47, 16
    Q, K, V = make_qkv(59, (2,), Sq, Sk, d, kind="q5")
    _, lse = flash_attention_forward(Q, K, V, Br=8, Bc=16, causal=causal, return_lse=True)
    S = (Q @ np.swapaxes(K, -1, -2)) / math.sqrt(d)
    if causal:
        S = np.where(causal_visible(Sq, Sk), S, -np.inf)
    m = S.max(axis=-1, keepdims=True)
    expected = (m + np.log(np.exp(S - m).sum(axis=-1, keepdims=True)))[..., 0]
    assert lse.shape == (2, Sq)
    assert max_abs(lse, expected) <= EXACT_TOL
    # exp(S - lse) rows are the softmax: they sum to one.
    assert max_abs(np.exp(S - lse[..., None]).sum(-1), np.ones((2, Sq))) <= EXACT_TOL


# ---------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------

GRAD_CASES = [((), 1, 1, 4), ((), 2, 5, 8), ((), 17, 17, 16), ((), 37, 53, 16), ((2,), 53, 37, 8),
              ((2, 2), 64, 64, 32), ((), 5, 2, 3)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lead,Sq,Sk,d", GRAD_CASES, ids=[ident("B", *l, f"Sq{a}", f"Sk{b}", f"D{c}")
                                                         for l, a, b, c in GRAD_CASES])
def test_backward_equals_naive(lead, Sq: int, Sk: int, d: int, causal: bool) -> None:
    Q, K, V = make_qkv(61 + Sq, lead, Sq, Sk, d, dv=d + 1)
    dO = np.random.default_rng(3).standard_normal(lead + (Sq, d + 1))
    O, lse = flash_attention_forward(Q, K, V, Br=16, Bc=8, causal=causal, return_lse=True)
    grads = flash_attention_backward(Q, K, V, O, dO, lse, Br=8, Bc=16, causal=causal)
    ref = naive_attention_backward(Q, K, V, dO, causal=causal)
    for name, g, r, x in zip(("dQ", "dK", "dV"), grads, ref, (Q, K, V)):
        assert g.shape == x.shape, name
        assert not np.isnan(g).any(), name
        assert max_abs(g, r) <= EXACT_TOL, name


def _loss(Q, K, V, dO, causal: bool) -> float:
    """sum(O * dO): its gradient with respect to (Q, K, V) is the backward with upstream dO."""
    return float(np.sum(flash_attention_forward(Q, K, V, Br=8, Bc=8, causal=causal) * dO))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Sq,Sk", [(13, 21), (21, 13)])
def test_backward_matches_finite_differences(Sq: int, Sk: int, causal: bool) -> None:
    Q, K, V = make_qkv(67, (), Sq, Sk, 6)
    rng = np.random.default_rng(4)
    dO = rng.standard_normal((Sq, 6))
    O, lse = flash_attention_forward(Q, K, V, Br=8, Bc=8, causal=causal, return_lse=True)
    grads = flash_attention_backward(Q, K, V, O, dO, lse, Br=8, Bc=8, causal=causal)
    h = 1e-6
    inputs = [Q, K, V]
    for x, g in zip(inputs, grads):
        for _ in range(6):
            idx = tuple(int(rng.integers(n)) for n in x.shape)
            saved = x[idx]
            x[idx] = saved + h
            up = _loss(*inputs, dO, causal)
            x[idx] = saved - h
            down = _loss(*inputs, dO, causal)
            x[idx] = saved
            fd = (up - down) / (2 * h)
            assert abs(fd - g[idx]) <= 1e-6 * max(1.0, abs(g[idx])), (idx, fd, g[idx])


# ---------------------------------------------------------------------------------------
# attention sinks
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Sq,Sk", [(1, 1), (17, 29), (29, 17)])
def test_sink_tiled_equals_naive_and_a_column_of_scores(Sq: int, Sk: int, causal: bool) -> None:
    """Forward with a sink per head: the tiles against the textbook formula, and both against
    the definition (one more score column whose value row is 0); rows that see no key
    (causal, Sq > Sk) get O 0 and lse sink."""
    Q, K, V = make_qkv(71 + Sq, (2, 3), Sq, Sk, 8)
    sink = np.array([-1.0, 2.0, 5.0])
    O, lse = flash_attention_forward(Q, K, V, Br=8, Bc=16, causal=causal, return_lse=True, sink=sink)
    ref_O, ref_lse = naive_attention(Q, K, V, causal=causal, return_lse=True, sink=sink)
    assert max_abs(O, ref_O) <= EXACT_TOL and max_abs(lse, ref_lse) <= EXACT_TOL
    S = (Q @ np.swapaxes(K, -1, -2)) / math.sqrt(8)
    if causal:
        S = np.where(causal_visible(Sq, Sk), S, -np.inf)
    S = np.concatenate([S, np.broadcast_to(sink[:, None, None], S.shape[:-1] + (1,))], axis=-1)
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    assert max_abs(O, P[..., :-1] @ V) <= EXACT_TOL
    if causal and Sq > Sk:
        assert np.array_equal(O[..., :Sq - Sk, :], np.zeros_like(O[..., :Sq - Sk, :]))
        assert np.array_equal(lse[..., :Sq - Sk], np.broadcast_to(sink[:, None], (2, 3, Sq - Sk)))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sink_gradients(causal: bool) -> None:
    """dQ, dK, dV and dsink: tiles against the textbook backward, and dsink against finite
    differences of sum(O * dO)."""
    Q, K, V = make_qkv(73, (2, 3), 21, 13, 6)
    dO = np.random.default_rng(5).standard_normal((2, 3, 21, 6))
    sink = np.array([-1.0, 1.5, 4.0])
    O, lse = flash_attention_forward(Q, K, V, Br=8, Bc=8, causal=causal, return_lse=True, sink=sink)
    grads = flash_attention_backward(Q, K, V, O, dO, lse, Br=8, Bc=4, causal=causal, sink=sink)
    ref = naive_attention_backward(Q, K, V, dO, causal=causal, sink=sink)
    assert len(grads) == 4 and grads[3].shape == sink.shape
    for name, g, r in zip(("dQ", "dK", "dV", "dsink"), grads, ref):
        assert max_abs(g, r) <= EXACT_TOL, name
    h = 1e-6
    for i in range(3):
        up, down = sink.copy(), sink.copy()
        up[i] += h
        down[i] -= h
        fd = (np.sum(flash_attention_forward(Q, K, V, causal=causal, sink=up) * dO)
              - np.sum(flash_attention_forward(Q, K, V, causal=causal, sink=down) * dO)) / (2 * h)
        assert abs(fd - grads[3][i]) <= 1e-6 * max(1.0, abs(fd)), (i, fd, grads[3][i])


def test_bad_sink_names_the_argument() -> None:
    Q, K, V = make_qkv(1, (2, 3), 4, 4, 4)
    with pytest.raises(ValueError, match="sink"):
        flash_attention_forward(Q, K, V, sink=np.zeros(4))
    with pytest.raises(TypeError, match="sink"):
        naive_attention(Q, K, V, sink=np.zeros(3, dtype=np.int64))


# ---------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float32_inputs(causal: bool) -> None:
    Q, K, V = make_qkv(71, (2,), 90, 70, 32, dtype=np.float32)
    out, lse = flash_attention_forward(Q, K, V, Br=16, Bc=32, causal=causal, return_lse=True)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    ref, ref_lse = naive_attention(*(x.astype(np.float64) for x in (Q, K, V)), causal=causal, return_lse=True)
    assert max_abs(out, ref) <= F32_TOL
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse))
    assert max_abs(lse[finite], ref_lse[finite]) <= F32_TOL
    dO = np.random.default_rng(5).standard_normal(out.shape).astype(np.float32)
    grads = flash_attention_backward(Q, K, V, out, dO, lse, Br=16, Bc=32, causal=causal)
    ref_grads = naive_attention_backward(*(x.astype(np.float64) for x in (Q, K, V, dO)), causal=causal)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == np.float32
        assert max_abs(g, r) <= 1e-4  # gradients sum more terms than the forward


def test_mixed_precision_promotes_to_float64() -> None:
    Q, K, V = make_qkv(73, (), 10, 12, 4)
    out = flash_attention_forward(Q.astype(np.float32), K, V, Br=4, Bc=4)
    assert out.dtype == np.float64


def test_array_likes_are_accepted() -> None:
    Q, K, V = make_qkv(79, (), 3, 4, 2)
    out = flash_attention_forward(Q.tolist(), K.tolist(), V.tolist(), Br=2, Bc=2)
    assert max_abs(out, naive_attention(Q, K, V)) <= EXACT_TOL


# ---------------------------------------------------------------------------------------
# Property test
# ---------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    Sq=st.integers(1, 40),
    Sk=st.integers(1, 40),
    d=st.integers(1, 9),
    Br=st.integers(1, 20),
    Bc=st.integers(1, 20),
    causal=st.booleans(),
    batched=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_tiled_equals_naive(Sq, Sk, d, Br, Bc, causal, batched, seed) -> None:
    Q, K, V = make_qkv(seed, (2,) if batched else (), Sq, Sk, d)
    with np.errstate(invalid="raise", over="raise", divide="raise"):  # no hidden NaN/inf
        out, lse = flash_attention_forward(Q, K, V, Br=Br, Bc=Bc, causal=causal, return_lse=True)
    ref, ref_lse = naive_attention(Q, K, V, causal=causal, return_lse=True)
    assert max_abs(out, ref) <= EXACT_TOL
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert max_abs(lse[finite], ref_lse[finite]) <= EXACT_TOL
    dO = np.random.default_rng(seed).standard_normal(out.shape)
    for g, r in zip(flash_attention_backward(Q, K, V, out, dO, lse, Br=Bc, Bc=Br, causal=causal),
                    naive_attention_backward(Q, K, V, dO, causal=causal)):
        assert max_abs(g, r) <= EXACT_TOL


# ---------------------------------------------------------------------------------------
# Memory: the tiled algorithm never holds an (Sq, Sk) array
# ---------------------------------------------------------------------------------------


def _peak_bytes(fn) -> int:
    tracemalloc.start()  # numpy reports its data buffers to tracemalloc
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tiled_never_allocates_the_score_matrix(causal: bool) -> None:
    N, d = 2048, 16
    Q, K, V = make_qkv(83, (), N, N, d)
    dO = np.ones((N, d))
    O, lse = flash_attention_forward(Q, K, V, Br=64, Bc=64, causal=causal, return_lse=True)
    score_bytes = N * N * 8  # 32 MiB
    # Inputs are allocated before tracing starts; what is traced is O(N d) outputs plus
    # (Br, Bc) tiles, about 1 MiB here. A single (Sq, Sk) float64 array would be 32 MiB.
    fwd = _peak_bytes(lambda: flash_attention_forward(Q, K, V, Br=64, Bc=64, causal=causal, return_lse=True))
    bwd = _peak_bytes(lambda: flash_attention_backward(Q, K, V, O, dO, lse, Br=64, Bc=64, causal=causal))
    print(f"peak traced bytes: forward {fwd}, backward {bwd}, one score matrix {score_bytes}")
    assert fwd < score_bytes / 8, fwd
    assert bwd < score_bytes / 8, bwd
    # The check can fail: the naive formula, traced the same way, does cross the line.
    small = N // 4
    naive = _peak_bytes(lambda: naive_attention(Q[:small], K[:small], V[:small], causal=causal))
    assert naive >= small * small * 8


# ---------------------------------------------------------------------------------------
# Bad input: ValueError / TypeError naming the argument, before any arithmetic
# ---------------------------------------------------------------------------------------

FORWARDS = [
    pytest.param(lambda Q, K, V, **kw: flash_attention_forward(Q, K, V, **kw), id="tiled"),
    pytest.param(lambda Q, K, V, **kw: naive_attention(Q, K, V, **kw), id="naive"),
    pytest.param(lambda Q, K, V, **kw: unstable_attention(Q, K, V, **kw), id="unstable"),
]


def _good(Sq: int = 6, Sk: int = 8, d: int = 4):
    return make_qkv(0, (), Sq, Sk, d)


@pytest.mark.parametrize("fn", FORWARDS)
def test_bad_shapes_name_the_argument(fn) -> None:
    Q, K, V = _good()
    with pytest.raises(ValueError, match=r"\bQ\b.*rank 1"):
        fn(Q[0], K, V)
    with pytest.raises(ValueError, match=r"\bV\b.*rank 1"):
        fn(Q, K, V[0])
    with pytest.raises(ValueError, match=r"Q, K and V must have the same rank"):
        fn(Q[None], K, V)
    with pytest.raises(ValueError, match=r"head dim d of Q and K must match"):
        fn(Q, K[:, :3], V)
    with pytest.raises(ValueError, match=r"leading dimensions must match"):
        fn(np.stack([Q, Q]), np.stack([K, K, K]), np.stack([V, V, V]))
    with pytest.raises(ValueError, match=r"K and V must have the same length"):
        fn(Q, K, V[:5])
    with pytest.raises(ValueError, match=r"head dim d must be >= 1"):
        fn(Q[:, :0], K[:, :0], V)
    with pytest.raises(ValueError, match=r"sequence lengths must be >= 1"):
        fn(Q[:0], K, V)


@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float16, np.complex128, np.bool_])
def test_bad_dtype_names_the_argument(fn, dtype) -> None:
    Q, K, V = _good()
    with pytest.raises(TypeError, match=r"\bQ must be float32 or float64"):
        fn(Q.astype(dtype), K, V)
    with pytest.raises(TypeError, match=r"\bK must be float32 or float64"):
        fn(Q, K.astype(dtype), V)


@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), np.float32("nan")])
def test_non_finite_scale_is_rejected(fn, scale) -> None:
    with pytest.raises(ValueError, match=r"scale must be finite"):
        fn(*_good(), scale=scale)


@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("scale", ["0.5", True, [1.0]])
def test_non_numeric_scale_is_rejected(fn, scale) -> None:
    with pytest.raises(TypeError, match=r"scale must be a real number"):
        fn(*_good(), scale=scale)


@pytest.mark.parametrize("which", ["Br", "Bc"])
def test_bad_tile_sizes_name_the_argument(which: str) -> None:
    Q, K, V = _good()
    O, lse = flash_attention_forward(Q, K, V, return_lse=True)
    calls = [
        lambda **kw: flash_attention_forward(Q, K, V, **kw),
        lambda **kw: flash_attention_backward(Q, K, V, O, O, lse, **kw),
    ]
    for call in calls:
        for bad in (0, -3):
            with pytest.raises(ValueError, match=rf"\b{which} must be >= 1, got {bad}"):
                call(**{which: bad})
        for bad in (8.0, 2.5, "8", True, None):
            with pytest.raises(TypeError, match=rf"\b{which} must be a positive int"):
                call(**{which: bad})
    # numpy integers are ints
    out = flash_attention_forward(Q, K, V, **{which: np.int64(3)})
    assert max_abs(out, naive_attention(Q, K, V)) <= EXACT_TOL


def test_backward_bad_shapes_name_the_argument() -> None:
    Q, K, V = _good()
    O, lse = flash_attention_forward(Q, K, V, return_lse=True)
    dO = np.ones_like(O)
    with pytest.raises(ValueError, match=r"\bdO must have shape"):
        flash_attention_backward(Q, K, V, O, dO[:-1], lse)
    with pytest.raises(ValueError, match=r"\bdO must have shape"):
        flash_attention_backward(Q, K, V, O, dO[:, :-1], lse)
    with pytest.raises(ValueError, match=r"\bdO must have shape"):
        naive_attention_backward(Q, K, V, dO[None])
    with pytest.raises(ValueError, match=r"\bO must have shape"):
        flash_attention_backward(Q, K, V, O.T, dO, lse)
    with pytest.raises(ValueError, match=r"\blse must have shape"):
        flash_attention_backward(Q, K, V, O, dO, lse[:-1])
    with pytest.raises(TypeError, match=r"\bQ must be float32 or float64"):
        flash_attention_backward(Q.astype(np.int64), K, V, O, dO, lse)
    with pytest.raises(ValueError, match=r"scale must be finite"):
        naive_attention_backward(Q, K, V, dO, scale=float("nan"))
