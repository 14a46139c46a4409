"""The Triton forward kernel on CPU tensors under TRITON_INTERPRET=1 (fp16 and fp32).

triton 3.6's interpreter cannot do bf16 arithmetic: bf16 is covered by the GPU tests.
Every case NaN-poisons the output and LSE buffers first, so an element the kernel
forgets to write fails.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from cases import Case, check_flash_case, check_flash_grads
from flashtile.testing import assert_close, plain_attention

pytestmark = pytest.mark.usefixtures("triton_backend", "poison_outputs")

SEQ_PAIRS = [(1, 1), (1, 239), (239, 1), (3, 79), (113, 203), (128, 217), (127, 65), (64, 64)]
HEAD_DIMS = [16, 40, 59, 64, 80]


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQ_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens(seqlen_q, seqlen_k, causal):
    check_flash_case(Case(seqlen_q, seqlen_k, 40, causal=causal, batch=1, nheads=2, nheads_k=1))


@pytest.mark.parametrize("head_dim", HEAD_DIMS + [1, 3, 111, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_head_dims(head_dim, dtype):
    check_flash_case(Case(37, 45, head_dim, dtype=dtype, batch=1, nheads=2, nheads_k=2))


@pytest.mark.parametrize("nheads_k", [6, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_heads(nheads_k, causal):
    check_flash_case(Case(33, 50, 32, causal=causal, batch=1, nheads=6, nheads_k=nheads_k))


@pytest.mark.parametrize("window", [(0, 0), (3, 5), (-1, 2), (7, -1), (20, 0)])
@pytest.mark.parametrize("seqs", [(50, 50), (29, 70), (70, 29)])
def test_windows(window, seqs):
    check_flash_case(Case(*seqs, 32, window=window, batch=1, nheads=2, nheads_k=1))


def test_window_with_causal_sets_right_to_zero():
    check_flash_case(Case(45, 60, 16, causal=True, window=(9, 7), batch=1, nheads=2, nheads_k=2))


@pytest.mark.parametrize("softcap", [2.0, 30.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(softcap, causal):
    check_flash_case(Case(40, 57, 32, causal=causal, softcap=softcap, dist="q5", batch=1, nheads=2, nheads_k=1))


@pytest.mark.parametrize("alibi", ["heads", "batch"])
def test_alibi(alibi):
    check_flash_case(Case(41, 67, 16, causal=True, alibi=alibi, softcap=5.0, batch=2, nheads=4, nheads_k=2))


@pytest.mark.parametrize("layout", ["transposed", "packed"])
@pytest.mark.parametrize("seqs", [(48, 48), (17, 40)])
def test_layouts(layout, seqs):
    check_flash_case(Case(*seqs, 24, layout=layout, batch=2, nheads=3, nheads_k=3))


@pytest.mark.parametrize("dist", ["rand", "q5"])
def test_distributions(dist):
    check_flash_case(Case(50, 61, 32, dist=dist, causal=True, batch=1, nheads=2, nheads_k=2))


def test_fp32_inputs_meet_fp32_rule():
    check_flash_case(Case(70, 90, 48, dtype=torch.float32, causal=True, window=(30, -1), batch=1, nheads=2, nheads_k=1))


# --------------------------------------------------------------------- SDPA masks
def _sdpa_case(mask_kind: str, shape, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, Hk, L, S, E = 2, 4, 2, 37, 53, 32
    q = torch.randn(B, H, L, E, generator=g).to(dtype)
    k = torch.randn(B, Hk, S, E, generator=g).to(dtype)
    v = torch.randn(B, Hk, S, E, generator=g).to(dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(shape, generator=g) > 0.4
        if shape[-2] > 1:
            mask[..., 2, :] = False  # a row that sees nothing
    elif mask_kind == "float":
        mask = (torch.randn(shape, generator=g) * 2).to(dtype)
        if shape[-2] > 1:
            mask[..., 3, :5] = float("-inf")
            mask[..., 4, :] = -1e5  # valid logits far below any masking constant still count
    return q, k, v, mask


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("shape", [(37, 53), (1, 1, 37, 53), (2, 1, 37, 53), (2, 4, 37, 53), (1, 4, 1, 53)],
                         ids=lambda s: "x".join(map(str, s)))
def test_sdpa_masks(mask_kind, shape):
    q, k, v, mask = _sdpa_case(mask_kind, shape)
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    full_mask = mask.expand(2, 4, 37, 53)
    kwargs = dict(scale=32 ** -0.5, attn_mask=full_mask)
    ref, _ = plain_attention(q, k, v, dtype=torch.float64, **kwargs)
    base, _ = plain_attention(q, k, v, **kwargs)
    assert_close(f"sdpa {mask_kind} {shape}", out, ref, base)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_causal_top_left(causal):
    q, k, v, _ = _sdpa_case("none", None)
    out = flashtile.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    kwargs = dict(scale=32 ** -0.5, window_right=0 if causal else -1)
    ref, _ = plain_attention(q, k, v, dtype=torch.float64, **kwargs)
    base, _ = plain_attention(q, k, v, **kwargs)
    assert_close("sdpa causal", out, ref, base)


def test_sdpa_matches_torch_sdpa_fp32():
    q, k, v, mask = _sdpa_case("float", (2, 1, 37, 53), dtype=torch.float32)
    mask[..., 3:5, :] = 0.0  # moderate finite masks: fp32 rounding of s - 1e5 would dominate
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask.double(), enable_gqa=True)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)


def test_empty_rows_are_zero_with_lse_minus_inf():
    q, k, v, _ = _sdpa_case("none", None)
    out, lse, _ = flashtile.flash_attn_func(q.transpose(1, 2)[:, :40], k.transpose(1, 2)[:, :9].contiguous(),
                                            v.transpose(1, 2)[:, :9].contiguous(), causal=True,
                                            return_attn_probs=True)
    # Sq=37 > Sk=9, bottom-right causal: rows 0..27 see no key.
    assert torch.equal(out[:, :28], torch.zeros_like(out[:, :28]))
    assert torch.isneginf(lse[:, :, :28]).all() and torch.isfinite(lse[:, :, 28:]).all()
    assert not torch.isnan(out).any()


def test_large_grid_is_flat(monkeypatch):
    # Programs of many (batch, head) pairs in one flat grid: every row gets written.
    check_flash_case(Case(3, 5, 16, batch=24, nheads=4, nheads_k=1))
    # batch x heads beyond CUDA's 65,535 grid-y limit: still one flat dimension (the launch
    # is recorded, not run: the interpreter would take minutes over 70,000 programs).
    from flashtile.backends.triton import forward

    grids = []
    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    monkeypatch.setattr(forward, "_launch_fwd", lambda grid, *args, **kwargs: grids.append(grid))
    q = torch.zeros(70_000, 1, 1, 16, dtype=torch.float16)
    flashtile.flash_attn_func(q, q, q)
    assert grids == [(70_000,)]


def test_bf16_under_interpreter_is_refused():
    q = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        flashtile.flash_attn_func(q, q, q)


@pytest.mark.parametrize("window", [(2**31 - 1, 2**31 - 1), (2**31 - 2, 0), (-1, 2**31 - 1)])
def test_huge_windows_mean_unbounded(window):
    q, k, v = (torch.randn(1, n, 2, 32, dtype=torch.float16) for n in (40, 25, 25))
    out = flashtile.flash_attn_func(q, k, v, window_size=window)
    left, right = window
    ref = flashtile.flash_attn_func(q, k, v, window_size=(-1, right if right < 2**30 else -1))
    assert torch.equal(out, ref)
    check_flash_case(Case(40, 25, 32, window=window, batch=1, nheads=2, nheads_k=2))


def test_no_keys_gives_zero_and_minus_inf():
    q = torch.randn(1, 5, 2, 64, dtype=torch.float16)
    kv = torch.randn(1, 0, 2, 64, dtype=torch.float16)
    out, lse, _ = flashtile.flash_attn_func(q, kv, kv, causal=True, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_in_data_propagates_to_out_and_lse(bad):
    q, k, v = (torch.randn(1, 9, 2, 16, dtype=torch.float32) for _ in range(3))
    q[0, 3, 0, 0] = bad
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.isnan(out[0, 3, 0]).all() and torch.isnan(lse[0, 0, 3])
    assert torch.isfinite(out[0, :3]).all() and torch.isfinite(lse[0, 1]).all()


@pytest.mark.parametrize("softcap", [1000.0, 1e5])
def test_large_softcap_keeps_precision(softcap):
    # tanh near 0 times a large cap: the kernel's tanh must be accurate relative to x there.
    check_flash_case(Case(64, 80, 32, dtype=torch.float32, softcap=softcap, batch=1, nheads=2, nheads_k=2))
    check_flash_grads(Case(33, 47, 16, dtype=torch.float32, softcap=softcap, batch=1, nheads=2, nheads_k=1))
