"""The public APIs on CPU tensors (torch backend): semantics, layouts and bad input.

Every bad input must raise ValueError or TypeError naming the argument, before any work.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from cases import Case, check_flash_case, make_inputs
from flashtile.testing import plain_attention

pytestmark = pytest.mark.usefixtures("poison_outputs")


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", "auto")


@pytest.mark.parametrize("case", [
    Case(37, 53, 40),
    Case(53, 37, 16, causal=True, nheads_k=2),
    Case(1, 239, 59, causal=True, nheads_k=1),
    Case(239, 1, 59, causal=True),
    Case(33, 70, 24, dtype=torch.float32, window=(5, 3), alibi="batch"),
    Case(40, 40, 32, softcap=20.0, layout="packed", alibi="heads"),
    Case(19, 45, 8, layout="transposed", dist="q5", nheads_k=3),
    Case(64, 64, 32, dtype=torch.bfloat16, causal=True, window=(9, -1)),
], ids=lambda c: c.id)
def test_flash_attn_func_torch_path(case):
    check_flash_case(case)


def test_packed_variants_match_unpacked():
    qkv = torch.randn(2, 33, 3, 4, 16, dtype=torch.float16)
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=True)
    ref = flashtile.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert torch.equal(out, ref)
    q = torch.randn(2, 20, 4, 16, dtype=torch.float16)
    kv = torch.randn(2, 33, 2, 2, 16, dtype=torch.float16)
    out = flashtile.flash_attn_kvpacked_func(q, kv, window_size=(4, 4))
    ref = flashtile.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], window_size=(4, 4))
    assert torch.equal(out, ref)


def test_output_layout_is_bshd_contiguous():
    q, k, v, _ = make_inputs(Case(17, 29, 16, layout="transposed"))
    out = flashtile.flash_attn_func(q, k, v)
    assert out.shape == q.shape and out.is_contiguous()
    sdpa_out = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert sdpa_out.shape == (2, 6, 17, 16)
    assert sdpa_out.transpose(1, 2).is_contiguous()  # (B, L, H, E) memory, as torch's flash backend


def test_sdpa_3d_inputs_and_torch_agreement():
    q = torch.randn(3, 21, 16, dtype=torch.float32)
    k = torch.randn(3, 34, 16, dtype=torch.float32)
    v = torch.randn(3, 34, 16, dtype=torch.float32)
    out = flashtile.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_sdpa_masks_match_torch(mask_dtype):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, n, 16, generator=g) for n in (19, 27, 27))
    mask = torch.rand(2, 1, 19, 27, generator=g) > 0.3 if mask_dtype == torch.bool else torch.randn(1, 4, 1, 27, generator=g)
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_rows_hidden_by_finfo_min_match_torch(dtype):
    # The torch twin (CPU tensors) on a transformers-style mask whose rows 1 and 4 are hidden
    # entirely by torch.finfo(dtype).min: the forward is torch's SDPA's (the mean of v), the
    # gradients are those of that even softmax (float64 math). torch's own CPU SDPA (2.13)
    # gets these gradients 9x too large (n keys: its saved LSE cannot hold log n at -3.4e38),
    # so they are compared with float64. The Triton kernels' version: test_backward_triton_interp.py.
    from flashtile.testing import GRAD_FACTOR, assert_close

    g = torch.Generator().manual_seed(8)
    q, k, v, dout = (torch.randn(2, 3, n, 16, generator=g).to(dtype) for n in (7, 9, 9, 7))
    mask = torch.zeros(2, 1, 7, 9, dtype=dtype)
    mask[..., 6:] = torch.finfo(dtype).min
    mask[:, :, [1, 4]] = torch.finfo(dtype).min

    def run(fn, dt=dtype):
        leaves = [t.to(dt).requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves, attn_mask=mask.to(dt))
        return (out.detach(), *torch.autograd.grad(out, leaves, dout.to(dt)))

    def plain(a, b, c, attn_mask):
        return plain_attention(a, b, c, scale=0.25, attn_mask=attn_mask.expand(2, 3, 7, 9))[0]

    got = run(flashtile.scaled_dot_product_attention)
    torch_sdpa = run(torch.nn.functional.scaled_dot_product_attention)
    ref, base = run(plain, torch.float64), run(plain)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[0], torch_sdpa[0], **tol)
    torch.testing.assert_close(got[0][:, :, 1], v.mean(dim=2), **tol)
    for name, a, r, b in zip(("dq", "dk", "dv"), got[1:], ref[1:], base[1:]):
        assert_close(f"twin finfo.min {name}", a, r, b, factor=GRAD_FACTOR)


def test_gradients_flow_on_torch_path():
    q, k, v = (torch.randn(1, n, 2, 8, dtype=torch.float32, requires_grad=True) for n in (5, 7, 7))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    out.square().sum().backward()
    ref_q, ref_k, ref_v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref, _ = plain_attention(ref_q.transpose(1, 2), ref_k.transpose(1, 2), ref_v.transpose(1, 2),
                             scale=8 ** -0.5, diag_offset=2, window_right=0)
    ref.transpose(1, 2).square().sum().backward()
    for got, want in ((q, ref_q), (k, ref_k), (v, ref_v)):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-4)


def test_empty_batch():
    q = torch.randn(0, 5, 2, 8)
    out, lse, _ = flashtile.flash_attn_func(q, q, q, return_attn_probs=True)
    assert out.shape == (0, 5, 2, 8) and lse.shape == (0, 2, 5)


# ----------------------------------------------------------------------------- bad input
def _qkv(dtype=torch.float16, B=1, Sq=4, Sk=5, H=2, Hk=2, D=8):
    return (torch.randn(B, Sq, H, D, dtype=dtype), torch.randn(B, Sk, Hk, D, dtype=dtype),
            torch.randn(B, Sk, Hk, D, dtype=dtype))


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda q, k, v: (q.to(torch.int32), k, v), TypeError, "q must be float16"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "q must be float16"),
    (lambda q, k, v: (q, k.float(), v), TypeError, "q and k must have the same dtype"),
    (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dimensions"),
    (lambda q, k, v: (q, k[:, :3], v), ValueError, "k and v must have the same shape"),
    (lambda q, k, v: (q, k[..., :4], v[..., :4]), ValueError, "head dim of k"),
    (lambda q, k, v: (q.repeat(2, 1, 1, 1), k, v), ValueError, "batch"),
    (lambda q, k, v: (q.repeat(1, 1, 3, 1)[:, :, :3], k, v), ValueError, "divisible"),
    (lambda q, k, v: (torch.zeros(1, 4, 2, 0, dtype=q.dtype),) * 3, ValueError, "head dim of q"),
        (lambda q, k, v: (torch.zeros(1, 4, 2, 513, dtype=q.dtype),) * 3, ValueError, r"\[1, 512\], got 513"),
    (lambda q, k, v: ("q", k, v), TypeError, "q must be a torch.Tensor"),
])
def test_flash_attn_bad_tensors(mutate, exc, match):
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_func(*mutate(*_qkv()))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale"),
    (dict(window_size=(-2, 0)), ValueError, "window_size left must be >= -1"),
    (dict(window_size=(0,)), TypeError, "window_size must be a pair"),
    (dict(window_size=(0, 1.5)), TypeError, "window_size right"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float16)), TypeError, "alibi_slopes must be float32"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have shape"),
])
def test_flash_attn_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_func(*_qkv(), **kwargs)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(attn_mask=torch.ones(4, 6, dtype=torch.bool)), ValueError, "does not broadcast"),
    (dict(attn_mask=torch.ones(4, 5, dtype=torch.int64)), TypeError, "attn_mask must be bool"),
    (dict(attn_mask=torch.ones(4, 5, dtype=torch.bool), is_causal=True), ValueError, "cannot be given together"),
    (dict(attn_mask=[[True]]), TypeError, "attn_mask must be a torch.Tensor"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(dropout_p=2.0), ValueError, "dropout_p"),
])
def test_sdpa_bad_arguments(kwargs, exc, match):
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    with pytest.raises(exc, match=match):
        flashtile.scaled_dot_product_attention(q, k, v, **kwargs)


def test_sdpa_gqa_needs_enable_gqa():
    q, k, v = (t.transpose(1, 2) for t in _qkv(H=4, Hk=2))
    with pytest.raises(ValueError, match="enable_gqa"):
        flashtile.scaled_dot_product_attention(q, k, v)
    assert flashtile.scaled_dot_product_attention(q, k, v, enable_gqa=True).shape == q.shape


def test_backend_variable_is_checked(monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FLASHTILE_BACKEND must be one of"):
        flashtile.flash_attn_func(*_qkv())
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        flashtile.flash_attn_func(*_qkv())


def test_packed_shapes_checked():
    with pytest.raises(ValueError, match="qkv must have shape"):
        flashtile.flash_attn_qkvpacked_func(torch.randn(1, 4, 2, 2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="kv must have shape"):
        flashtile.flash_attn_kvpacked_func(torch.randn(1, 4, 2, 8, dtype=torch.float16),
                                           torch.randn(1, 4, 3, 2, 8, dtype=torch.float16))


def test_nan_in_data_propagates_without_crash():
    q, k, v = _qkv(dtype=torch.float32)
    k[0, 1, 0, 0] = float("nan")
    out = flashtile.flash_attn_func(q, k, v)
    assert torch.isnan(out[:, :, 0]).all() and not torch.isnan(out[:, :, 1]).any()
    assert math.isfinite(out[:, :, 1].sum().item())


def test_dropout_on_torch_path_is_seeded_and_rescaled():
    q = torch.zeros(2, 30, 2, 32)
    k = torch.randn(2, 24, 2, 32)
    v = torch.zeros(2, 24, 2, 32)
    v[:, torch.arange(24), :, torch.arange(24)] = 1.0
    torch.manual_seed(0)
    a = flashtile.flash_attn_func(q, k, v, dropout_p=0.4)
    torch.manual_seed(0)
    b = flashtile.flash_attn_func(q, k, v, dropout_p=0.4)
    assert torch.equal(a, b)
    kept = a[..., :24]
    rate = 1.0 - (kept > 0).float().mean().item()
    assert abs(rate - 0.4) < 0.03, rate
    torch.testing.assert_close(kept[kept > 0], torch.full_like(kept[kept > 0], 1 / (24 * 0.6)))


def test_sdpa_3d_inputs_with_batched_mask_match_torch():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, n, 16, generator=g) for n in (5, 7, 7))
    mask = torch.rand(2, 5, 7, generator=g) > 0.3
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               atol=1e-5, rtol=1e-5)


def test_training_memory_of_torch_path_is_chunked():
    # Each chunk is checkpointed: the saved activations must not grow with Sq * Sk.
    q, k, v = (torch.randn(1, n, 2, 16, requires_grad=True) for n in (1024, 1024, 1024))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = flashtile.flash_attn_func(q, k, v, causal=True)
    # Without checkpointing the chunks keep ~3.5 (Sq, Sk) score-sized tensors per head
    # (7.7M elements here); with it only references to the inputs (0.4M).
    assert sum(saved) < 1024 * 1024, sum(saved)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
