"""CPU tests of the chunked torch attention forward against the naive dense oracle and SDPA.

Protects: the canonical mask semantics (windows around a shifted diagonal, softcap, ALiBi,
bool/float masks), the empty-row convention (out 0, LSE -inf, zero gradients, no NaN),
GQA/MQA without K/V copies, chunking that never builds the whole (Sq, Sk) matrix, strided
inputs, and differentiability (float64 gradcheck).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from flashtile.backends.twin.attention import chunked_attention_forward, visible_mask, visible_mask_rows
from oracle import dense_attention, dense_scores

SEQLENS = [(1, 1), (1, 239), (239, 1), (3, 799), (113, 203), (128, 217)]
HEAD_DIMS = [1, 16, 40, 59, 80]
KV_HEADS = [6, 2, 1]  # with 6 query heads: MHA, GQA, MQA
NUM_HEADS = 6
BATCH = 2
NEG_INF = float("-inf")


def _generator(*key: object) -> torch.Generator:
    """A generator seeded from the test case, so each case draws its own fresh inputs.

    crc32, not hash(): str hashes are salted per process, which would make failures
    unreproducible and differ between pytest-xdist workers.
    """
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _qkv(
    gen: torch.Generator,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    num_kv_heads: int,
    dtype: torch.dtype = torch.float64,
    q_scale: float = 1.0,
    batch: int = BATCH,
    num_heads: int = NUM_HEADS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(batch, num_heads, seqlen_q, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, num_kv_heads, seqlen_k, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, num_kv_heads, seqlen_k, head_dim, generator=gen, dtype=torch.float64)
    return (q * q_scale).to(dtype), k.to(dtype), v.to(dtype)


def _assert_close_to_oracle(
    out: torch.Tensor,
    lse: torch.Tensor,
    out_ref: torch.Tensor,
    lse_ref: torch.Tensor,
    atol: float,
) -> None:
    """Same shapes, no NaN, the same -inf LSE rows (with out exactly 0 there), numbers close."""
    assert out.shape == out_ref.shape and lse.shape == lse_ref.shape
    assert out.is_contiguous() and lse.is_contiguous()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty_ref = lse_ref == NEG_INF
    assert torch.equal(lse == NEG_INF, empty_ref), "rows with no visible key differ"
    assert torch.all(out[empty_ref] == 0)
    torch.testing.assert_close(out.double(), out_ref, atol=atol, rtol=0)
    torch.testing.assert_close(
        lse.double()[~empty_ref], lse_ref[~empty_ref], atol=atol, rtol=atol
    )


def _mask_kwargs(
    name: str, seqlen_q: int, seqlen_k: int, gen: torch.Generator, large_negative: float = -1e5
) -> dict:
    """The mask configurations under test, by name. Windows use the bottom-right diagonal.

    ``large_negative`` is the finite "almost masked" value float masks sprinkle in. For
    float32 inputs pass a moderate one: s - 1e5 in float32 rounds s to ~4e-3, which is the
    dtype's limit, not a bug (``test_large_negative_logits_still_count`` covers -1e5).
    """
    bottom_right = seqlen_k - seqlen_q
    shape = (BATCH, NUM_HEADS, seqlen_q, seqlen_k)
    if name == "none":
        return {}
    if name == "causal_bottom_right":
        return {"diag_offset": bottom_right, "window_right": 0}
    if name == "causal_top_left":
        return {"diag_offset": 0, "window_right": 0}
    if name.startswith("window"):
        left, right = (int(x) for x in name.split("_")[1:])
        return {"diag_offset": bottom_right, "window_left": left, "window_right": right}
    if name == "softcap30":
        return {"softcap": 30.0}
    if name == "softcap2":
        return {"softcap": 2.0}
    if name == "alibi":
        return {"alibi_slopes": torch.rand(BATCH, NUM_HEADS, generator=gen) * 0.5}
    if name == "bool_mask":
        return {"attn_mask": _random_bool_mask(shape, gen)}
    if name == "float_mask":
        return {"attn_mask": _random_float_mask(shape, gen, large_negative)}
    if name == "combo_window_softcap_alibi_float":
        return {
            "diag_offset": bottom_right,
            "window_left": 3,
            "window_right": 5,
            "softcap": 2.0,
            "alibi_slopes": torch.rand(BATCH, NUM_HEADS, generator=gen),
            "attn_mask": _random_float_mask(shape, gen, large_negative),
        }
    if name == "combo_causal_top_left_bool_alibi_softcap":
        return {
            "diag_offset": 0,
            "window_right": 0,
            "softcap": 30.0,
            "alibi_slopes": torch.rand(BATCH, NUM_HEADS, generator=gen),
            "attn_mask": _random_bool_mask(shape, gen),
        }
    raise KeyError(name)


def _random_bool_mask(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random keep/drop with every third query row fully masked."""
    mask = torch.rand(shape, generator=gen) < 0.6
    mask[..., ::3, :] = False
    return mask


def _random_float_mask(
    shape: tuple[int, ...], gen: torch.Generator, large_negative: float = -1e5
) -> torch.Tensor:
    """Random additive biases with -inf holes, large negative entries, every fourth row -inf."""
    mask = torch.randn(shape, generator=gen, dtype=torch.float32)
    draw = torch.rand(shape, generator=gen)
    mask = torch.where(draw < 0.3, torch.tensor(NEG_INF), mask)
    mask = torch.where((draw >= 0.3) & (draw < 0.4), torch.tensor(large_negative), mask)
    mask[..., 1::4, :] = NEG_INF
    return mask


# ---------------------------------------------------------------------------------------
# Visibility helper
# ---------------------------------------------------------------------------------------


def test_visible_mask_draws_bottom_right_causal() -> None:
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(visible_mask(3, 5, diag_offset=2, window_left=-1, window_right=0), expected)


def test_visible_mask_window_and_rows_agree() -> None:
    full = visible_mask(11, 17, diag_offset=3, window_left=2, window_right=1)
    i = torch.arange(11)[:, None]
    j = torch.arange(17)[None, :]
    assert torch.equal(full, (j >= i + 3 - 2) & (j <= i + 3 + 1))
    parts = [visible_mask_rows(r, min(r + 4, 11), 17, 3, 2, 1) for r in range(0, 11, 4)]
    assert torch.equal(torch.cat(parts), full)


# ---------------------------------------------------------------------------------------
# Against the dense oracle: shapes, masks, dtypes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_kv_heads", KV_HEADS, ids=lambda h: f"Hk{h}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
def test_matches_oracle_float64(seqlens: tuple[int, int], head_dim: int, num_kv_heads: int) -> None:
    seqlen_q, seqlen_k = seqlens
    gen = _generator("f64", seqlens, head_dim, num_kv_heads)
    # q scaled by 5 sharpens the softmax, where a wrong max or rescale shows most.
    q, k, v = _qkv(gen, seqlen_q, seqlen_k, head_dim, num_kv_heads, q_scale=5.0)
    scale = 1.0 / math.sqrt(head_dim)
    for mask_name in ("none", "causal_bottom_right"):
        kwargs = _mask_kwargs(mask_name, seqlen_q, seqlen_k, gen)
        out_ref, lse_ref = dense_attention(q, k, v, scale=scale, **kwargs)
        for chunk_size in (7, 64):
            out, lse = chunked_attention_forward(q, k, v, scale=scale, chunk_size=chunk_size, **kwargs)
            assert out.dtype == torch.float64 and lse.dtype == torch.float64
            _assert_close_to_oracle(out, lse, out_ref, lse_ref, atol=1e-10)


@pytest.mark.parametrize("num_kv_heads", [6, 1], ids=lambda h: f"Hk{h}")
@pytest.mark.parametrize("head_dim", [16, 59], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
def test_matches_oracle_float32(seqlens: tuple[int, int], head_dim: int, num_kv_heads: int) -> None:
    seqlen_q, seqlen_k = seqlens
    gen = _generator("f32", seqlens, head_dim, num_kv_heads)
    q, k, v = _qkv(gen, seqlen_q, seqlen_k, head_dim, num_kv_heads, dtype=torch.float32)
    scale = 1.0 / math.sqrt(head_dim)
    kwargs = _mask_kwargs("combo_window_softcap_alibi_float", seqlen_q, seqlen_k, gen, -30.0)
    out_ref, lse_ref = dense_attention(q, k, v, scale=scale, **kwargs)
    out, lse = chunked_attention_forward(q, k, v, scale=scale, chunk_size=7, **kwargs)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    # float32 against the float64 oracle on the same float32 inputs: only rounding differs.
    _assert_close_to_oracle(out, lse, out_ref, lse_ref, atol=2e-5)


MASK_NAMES = [
    "causal_bottom_right",
    "causal_top_left",
    "window_0_0",
    "window_3_5",
    "window_-1_2",
    "window_7_-1",
    "softcap30",
    "softcap2",
    "alibi",
    "bool_mask",
    "float_mask",
    "combo_window_softcap_alibi_float",
    "combo_causal_top_left_bool_alibi_softcap",
]
MASK_SEQLENS = [(1, 239), (239, 1), (3, 799), (113, 203), (217, 128)]


@pytest.mark.parametrize("num_kv_heads", [6, 2], ids=lambda h: f"Hk{h}")  # MHA, GQA (MQA: the other tests)
@pytest.mark.parametrize("seqlens", MASK_SEQLENS, ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
@pytest.mark.parametrize("mask_name", MASK_NAMES)
def test_masks_match_oracle(mask_name: str, seqlens: tuple[int, int], num_kv_heads: int) -> None:
    seqlen_q, seqlen_k = seqlens
    head_dim = 40
    gen = _generator("mask", mask_name, seqlens, num_kv_heads)
    q, k, v = _qkv(gen, seqlen_q, seqlen_k, head_dim, num_kv_heads, q_scale=2.0)
    kwargs = _mask_kwargs(mask_name, seqlen_q, seqlen_k, gen)
    scale = 1.0 / math.sqrt(head_dim)

    out_ref, lse_ref = dense_attention(q, k, v, scale=scale, **kwargs)
    out, lse = chunked_attention_forward(q, k, v, scale=scale, chunk_size=64, **kwargs)
    _assert_close_to_oracle(out, lse, out_ref, lse_ref, atol=1e-10)

    q32, k32, v32 = q.float(), k.float(), v.float()
    kwargs = _mask_kwargs(mask_name, seqlen_q, seqlen_k, _generator("mask32", mask_name), -30.0)
    out_ref32, lse_ref32 = dense_attention(q32, k32, v32, scale=scale, **kwargs)
    out32, lse32 = chunked_attention_forward(q32, k32, v32, scale=scale, chunk_size=7, **kwargs)
    _assert_close_to_oracle(out32, lse32, out_ref32, lse_ref32, atol=3e-5)


def _plain_lowp_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch attention computed entirely in the input dtype (the accuracy baseline)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, NEG_INF)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seqlens", [(113, 203), (128, 217), (239, 1)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
def test_low_precision_meets_accuracy_rule(seqlens: tuple[int, int], dtype: torch.dtype) -> None:
    """QUALITY.md's rule: error <= 2 x plain PyTorch's own error in the same dtype + 1e-5."""
    seqlen_q, seqlen_k = seqlens
    head_dim, num_kv_heads = 59, 2
    gen = _generator("lowp", seqlens, dtype)
    q, k, v = _qkv(gen, seqlen_q, seqlen_k, head_dim, num_kv_heads, dtype=dtype)
    scale = 1.0 / math.sqrt(head_dim)
    # Top-left causal: with Sq > Sk no row is empty, so the plain baseline has no NaN.
    kwargs = {"diag_offset": 0, "window_right": 0}
    out_ref, lse_ref = dense_attention(q, k, v, scale=scale, **kwargs)
    keep = visible_mask(seqlen_q, seqlen_k, 0, -1, 0)
    out_base, lse_base = _plain_lowp_attention(q, k, v, scale, keep)
    out, lse = chunked_attention_forward(q, k, v, scale=scale, chunk_size=64, **kwargs)

    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any()
    out_err = (out.double() - out_ref).abs().max().item()
    base_err = (out_base.double() - out_ref).abs().max().item()
    assert out_err <= 2 * base_err + 1e-5, (out_err, base_err)
    lse_err = (lse.double() - lse_ref).abs().max().item()
    lse_base_err = (lse_base.double() - lse_ref).abs().max().item()
    assert lse_err <= 2 * lse_base_err + 1e-5, (lse_err, lse_base_err)


# ---------------------------------------------------------------------------------------
# Empty rows and large negative logits
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
def test_empty_rows_give_zero_and_neg_inf(dtype: torch.dtype) -> None:
    seqlen_q, seqlen_k, head_dim = 9, 4, 16
    gen = _generator("empty", dtype)
    q, k, v = _qkv(gen, seqlen_q, seqlen_k, head_dim, 2, dtype=dtype)
    scale = 0.25
    # Bottom-right causal with Sq > Sk: query i sees keys j <= i - 5, so rows 0..4 are empty.
    out, lse = chunked_attention_forward(
        q, k, v, scale=scale, diag_offset=seqlen_k - seqlen_q, window_right=0, chunk_size=2
    )
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.all(out[:, :, :5] == 0)
    assert torch.all(lse[:, :, :5] == NEG_INF)
    assert torch.isfinite(lse[:, :, 5:]).all()

    # A window that lies entirely right of the keys empties every row.
    out, lse = chunked_attention_forward(q, k, v, scale=scale, diag_offset=50, window_left=0, window_right=0)
    assert torch.all(out == 0) and torch.all(lse == NEG_INF)

    # Rows emptied by a bool mask, and by a float mask that is all -inf.
    bool_mask = torch.ones(BATCH, NUM_HEADS, seqlen_q, seqlen_k, dtype=torch.bool)
    bool_mask[:, :, 3] = False
    float_mask = torch.zeros(BATCH, NUM_HEADS, seqlen_q, seqlen_k, dtype=dtype)
    float_mask[:, :, 6] = NEG_INF
    for mask, row in ((bool_mask, 3), (float_mask, 6)):
        out, lse = chunked_attention_forward(
            q, k, v, scale=scale, attn_mask=mask, alibi_slopes=torch.ones(BATCH, NUM_HEADS)
        )
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert torch.all(out[:, :, row] == 0) and torch.all(lse[:, :, row] == NEG_INF)
        others = [r for r in range(seqlen_q) if r != row]
        assert torch.isfinite(lse[:, :, others]).all()


def test_empty_rows_have_zero_gradients() -> None:
    seqlen_q, seqlen_k, head_dim = 6, 3, 5
    gen = _generator("empty-grad")
    inputs = [t.requires_grad_() for t in _qkv(gen, seqlen_q, seqlen_k, head_dim, 3)]
    out, lse = chunked_attention_forward(
        *inputs, scale=0.5, diag_offset=seqlen_k - seqlen_q, window_right=0, softcap=5.0, chunk_size=4
    )
    num_empty = seqlen_q - seqlen_k  # bottom-right causal: rows 0..2 see nothing
    assert torch.all(lse[:, :, :num_empty] == NEG_INF)
    # Upstream gradients are nonzero everywhere, the -inf LSE rows included.
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grad_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    dq, dk, dv = torch.autograd.grad((out, lse), inputs, (grad_out, grad_lse))
    for grad in (dq, dk, dv):
        assert torch.isfinite(grad).all()
    assert torch.all(dq[:, :, :num_empty] == 0)
    assert torch.any(dq[:, :, num_empty:] != 0)


def test_large_negative_logits_still_count() -> None:
    """A row whose only visible logits are -1e5 is a real softmax, not an empty row."""
    seqlen_q, seqlen_k, head_dim = 5, 8, 16
    gen = _generator("neg1e5")
    q, k, v = _qkv(gen, seqlen_q, seqlen_k, head_dim, 6)
    scale = 1.0 / math.sqrt(head_dim)
    mask = torch.zeros(BATCH, NUM_HEADS, seqlen_q, seqlen_k, dtype=torch.float64)
    mask[:, :, 2] = NEG_INF
    mask[:, :, 2, 3] = -1e5
    mask[:, :, 2, 6] = -1e5
    mask[:, :, 4] = -1e5  # a whole row shifted by -1e5: softmax is shift-invariant

    out_ref, lse_ref = dense_attention(q, k, v, scale=scale, attn_mask=mask)
    out, lse = chunked_attention_forward(q, k, v, scale=scale, attn_mask=mask, chunk_size=2)
    _assert_close_to_oracle(out, lse, out_ref, lse_ref, atol=1e-10)

    # Row 2 is the two-key softmax over keys 3 and 6.
    s = scale * torch.einsum("bhd,bhjd->bhj", q[:, :, 2], k[:, :, [3, 6]])
    p = torch.softmax(s, dim=-1)
    expected = torch.einsum("bhj,bhjd->bhd", p, v[:, :, [3, 6]])
    torch.testing.assert_close(out[:, :, 2], expected, atol=1e-9, rtol=0)
    torch.testing.assert_close(lse[:, :, 2], torch.logsumexp(s, dim=-1) - 1e5, atol=1e-9, rtol=0)

    # Row 4 equals the unmasked row.
    out_plain, _ = chunked_attention_forward(q, k, v, scale=scale)
    torch.testing.assert_close(out[:, :, 4], out_plain[:, :, 4], atol=1e-9, rtol=0)

    # float32: the -1e5 row is still non-empty (rounding of s - 1e5 costs ~1e-2 at most).
    out32, lse32 = chunked_attention_forward(
        q.float(), k.float(), v.float(), scale=scale, attn_mask=mask.float()
    )
    assert torch.isfinite(lse32).all()
    torch.testing.assert_close(out32[:, :, 2].double(), expected, atol=2e-2, rtol=0)


# ---------------------------------------------------------------------------------------
# LSE
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_name", ["none", "combo_window_softcap_alibi_float", "bool_mask"])
def test_lse_is_logsumexp_of_oracle_scores(mask_name: str) -> None:
    seqlen_q, seqlen_k, head_dim = 37, 53, 24
    gen = _generator("lse", mask_name)
    q, k, v = _qkv(gen, seqlen_q, seqlen_k, head_dim, 2, q_scale=5.0)
    kwargs = _mask_kwargs(mask_name, seqlen_q, seqlen_k, gen)
    scale = 1.0 / math.sqrt(head_dim)
    scores = dense_scores(q, k, scale=scale, **kwargs)
    _, lse = chunked_attention_forward(q, k, v, scale=scale, chunk_size=8, **kwargs)
    expected = torch.logsumexp(scores, dim=-1)
    assert torch.equal(lse == NEG_INF, expected == NEG_INF)
    finite = torch.isfinite(expected)
    torch.testing.assert_close(lse[finite], expected[finite], atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------------------
# SDPA semantics (top-left causal, bool keep / float additive masks, broadcasting)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_kv_heads", KV_HEADS, ids=lambda h: f"Hk{h}")
@pytest.mark.parametrize(
    "seqlens", [(5, 9), (9, 5), (113, 203), (203, 113)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}"
)
def test_causal_matches_torch_sdpa(seqlens: tuple[int, int], num_kv_heads: int) -> None:
    seqlen_q, seqlen_k = seqlens
    gen = _generator("sdpa-causal", seqlens, num_kv_heads)
    q, k, v = _qkv(gen, seqlen_q, seqlen_k, 32, num_kv_heads)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out, _ = chunked_attention_forward(
        q, k, v, scale=1 / math.sqrt(32), diag_offset=0, window_right=0, chunk_size=16
    )
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)


MASK_BROADCAST_SHAPES = {
    "11QK": lambda b, h, sq, sk: (1, 1, sq, sk),
    "B11K": lambda b, h, sq, sk: (b, 1, 1, sk),
    "1HQ1": lambda b, h, sq, sk: (1, h, sq, 1),
    "BHQK": lambda b, h, sq, sk: (b, h, sq, sk),
    "QK": lambda b, h, sq, sk: (sq, sk),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64], ids=["bool", "float"])
@pytest.mark.parametrize("mask_shape", list(MASK_BROADCAST_SHAPES), ids=str)
def test_masks_match_torch_sdpa(mask_shape: str, mask_dtype: torch.dtype, causal: bool) -> None:
    """Broadcast masks expanded to (B, H, Sq, Sk) behave as SDPA's attn_mask.

    Torch 2.13's CPU SDPA returns 0 for a fully masked row (bool all False or float all
    -inf), the same convention as ours, so those rows are compared too.
    """
    seqlen_q, seqlen_k, head_dim, num_kv_heads = 23, 31, 16, 2
    gen = _generator("sdpa-mask", mask_shape, mask_dtype, causal)
    q, k, v = _qkv(gen, seqlen_q, seqlen_k, head_dim, num_kv_heads)
    shape = MASK_BROADCAST_SHAPES[mask_shape](BATCH, NUM_HEADS, seqlen_q, seqlen_k)
    if mask_dtype == torch.bool:
        mask = torch.rand(shape, generator=gen) < 0.7
    else:
        mask = torch.randn(shape, generator=gen, dtype=torch.float64)
        mask = mask.masked_fill(torch.rand(shape, generator=gen) < 0.3, NEG_INF)

    sdpa_mask = mask
    if causal:
        # SDPA takes either is_causal or attn_mask: fold top-left causal into the mask.
        tril = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril()
        sdpa_mask = mask & tril if mask_dtype == torch.bool else torch.where(tril, mask, NEG_INF)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, enable_gqa=True)

    expanded = mask.expand(BATCH, NUM_HEADS, seqlen_q, seqlen_k)  # stride-0 views, as the API passes
    out, lse = chunked_attention_forward(
        q, k, v, scale=1 / math.sqrt(head_dim), attn_mask=expanded,
        diag_offset=0, window_right=0 if causal else -1, chunk_size=5,
    )
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)


# ---------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_kv_heads", KV_HEADS, ids=lambda h: f"Hk{h}")
def test_strided_inputs(num_kv_heads: int) -> None:
    seqlen_q = seqlen_k = 45
    head_dim = 24
    gen = _generator("strided", num_kv_heads)
    scale = 1.0 / math.sqrt(head_dim)
    slopes = torch.rand(1, NUM_HEADS, generator=gen).expand(BATCH, NUM_HEADS)  # stride-0 batch
    kwargs = {"scale": scale, "diag_offset": 0, "window_left": 9, "window_right": 0, "alibi_slopes": slopes}

    # (B, S, H, D) tensors seen as (B, H, S, D) through transpose(1, 2).
    q_bshd = torch.randn(BATCH, seqlen_q, NUM_HEADS, head_dim, generator=gen, dtype=torch.float64)
    k_bshd = torch.randn(BATCH, seqlen_k, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v_bshd = torch.randn(BATCH, seqlen_k, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    views = [t.transpose(1, 2) for t in (q_bshd, k_bshd, v_bshd)]

    # q, k, v sliced out of one packed (B, S, H + 2 Hk, D) tensor.
    packed_heads = NUM_HEADS + 2 * num_kv_heads
    packed = torch.randn(BATCH, seqlen_q, packed_heads, head_dim, generator=gen, dtype=torch.float64)
    sliced = [
        packed[:, :, :NUM_HEADS].transpose(1, 2),
        packed[:, :, NUM_HEADS : NUM_HEADS + num_kv_heads].transpose(1, 2),
        packed[:, :, NUM_HEADS + num_kv_heads :].transpose(1, 2),
    ]
    for q, k, v in (views, sliced):
        assert not q.is_contiguous()
        out, lse = chunked_attention_forward(q, k, v, chunk_size=8, **kwargs)
        out_contig, lse_contig = chunked_attention_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), chunk_size=8, **kwargs
        )
        out_ref, lse_ref = dense_attention(q, k, v, **kwargs)
        assert out.is_contiguous() and out.shape == (BATCH, NUM_HEADS, seqlen_q, head_dim)
        torch.testing.assert_close(out, out_contig, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, lse_contig, atol=1e-12, rtol=0)
        _assert_close_to_oracle(out, lse, out_ref, lse_ref, atol=1e-10)


# ---------------------------------------------------------------------------------------
# Memory: chunked, and no K/V copy per query head
# ---------------------------------------------------------------------------------------


def test_never_materialises_full_scores_or_repeated_kv() -> None:
    dispatch = pytest.importorskip("torch.utils._python_dispatch")

    largest: list[int] = [0]

    class _LargestOutput(dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            result = func(*args, **(kwargs or {}))
            for t in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(t, torch.Tensor):
                    # Storage, not numel: views of stride-0 expanded masks allocate nothing.
                    largest[0] = max(largest[0], t.untyped_storage().nbytes() // t.element_size())
            return result

    batch, num_heads, num_kv_heads, seqlen_q, seqlen_k, head_dim, chunk = 1, 8, 1, 64, 512, 64, 8
    gen = _generator("memory")
    q, k, v = _qkv(
        gen, seqlen_q, seqlen_k, head_dim, num_kv_heads,
        dtype=torch.float32, batch=batch, num_heads=num_heads,
    )
    mask = torch.zeros(1, 1, seqlen_q, seqlen_k).expand(batch, num_heads, seqlen_q, seqlen_k)
    with _LargestOutput():
        chunked_attention_forward(
            q, k, v, scale=0.125, window_right=0, softcap=10.0,
            alibi_slopes=torch.ones(batch, num_heads), attn_mask=mask, chunk_size=chunk,
        )
    # Legitimate tensors: one chunk's scores (B*H*chunk*Sk), the output (B*H*Sq*D) and
    # K/V themselves (B*Hk*Sk*D): all 32768 here. Whole-length scores (B*H*Sq*Sk) or K/V
    # repeated per query head (B*H*Sk*D) would be 8x larger.
    bound = max(batch * num_heads * chunk * seqlen_k, batch * num_heads * seqlen_q * head_dim)
    assert largest[0] <= bound, (largest[0], bound)


# ---------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------


def _tiny_case() -> tuple[torch.Tensor, ...]:
    gen = _generator("gradcheck")
    q, k, v = _qkv(gen, 5, 7, 3, 1, batch=1, num_heads=2)
    slopes = torch.rand(1, 2, generator=gen)
    mask = torch.randn(1, 2, 5, 7, generator=gen, dtype=torch.float64)
    mask[0, 0, 4, 1] = NEG_INF  # a hole inside a window, never a whole row
    mask[0, 1, 2, 3] = -1e5
    return q, k, v, slopes, mask


def test_gradcheck_float64() -> None:
    q, k, v, slopes, mask = _tiny_case()
    kwargs = {
        "scale": 0.7, "diag_offset": 2, "window_left": 3, "window_right": 0,
        "softcap": 2.0, "alibi_slopes": slopes, "attn_mask": mask, "chunk_size": 2,
    }

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return chunked_attention_forward(q, k, v, **kwargs)

    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


def test_gradcheck_float64_with_empty_rows() -> None:
    q, k, v, slopes, mask = _tiny_case()
    q = torch.cat([q, q], dim=2)  # Sq = 10 > Sk = 7: bottom-right causal empties rows 0..2

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, _ = chunked_attention_forward(
            q, k, v, scale=0.7, diag_offset=-3, window_right=0, softcap=2.0, alibi_slopes=slopes, chunk_size=4
        )
        return out

    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


def test_gradients_match_oracle() -> None:
    seqlen_q, seqlen_k, head_dim = 19, 26, 8
    gen = _generator("grad-oracle")
    q, k, v = _qkv(gen, seqlen_q, seqlen_k, head_dim, 2, q_scale=2.0)
    kwargs = _mask_kwargs("combo_window_softcap_alibi_float", seqlen_q, seqlen_k, gen)
    kwargs["attn_mask"][..., 1::4, :] = 0.0  # the oracle's logsumexp has NaN grads on empty rows
    scale = 1.0 / math.sqrt(head_dim)
    # One shared upstream gradient, non-contiguous, for both implementations.
    grad_out = torch.randn(BATCH, seqlen_q, NUM_HEADS, head_dim, generator=gen, dtype=torch.float64)
    grad_out = grad_out.transpose(1, 2)
    grad_lse = torch.randn(BATCH, NUM_HEADS, seqlen_q, generator=gen, dtype=torch.float64)

    def grads(impl, **extra) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = impl(*inputs, scale=scale, **kwargs, **extra)
        assert torch.isfinite(lse).all(), "this case must have no empty rows"
        return list(torch.autograd.grad((out, lse), inputs, (grad_out, grad_lse)))

    for got, want in zip(grads(chunked_attention_forward, chunk_size=6), grads(dense_attention)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
