"""GPU forward tests (``pytest -m gpu``): QUALITY.md's matrix for the Triton kernels.

Every case NaN-poisons the output and LSE buffers, then applies the accuracy rule
(flashtile.testing) to out and LSE against float64 and plain PyTorch in the input dtype.
"""

from __future__ import annotations


import pytest
import torch

import flashtile
from cases import Case, check_flash_case
from flashtile.testing import assert_close, plain_attention

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

SEQ_PAIRS = [(1, 1), (1, 239), (239, 1), (3, 799), (113, 203), (128, 217), (127, 513), (1023, 1024),
             (1024, 1023), (2048, 2048), (4224, 4224)]
HEAD_DIMS = [16, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
HEADS = [(6, 6), (6, 2), (6, 1)]
DTYPES = [torch.float16, torch.bfloat16]


def _matrix():
    cases = []
    n = 0
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            for seqs in SEQ_PAIRS:
                for causal in (False, True):
                    h, hk = HEADS[n % 3]
                    layout = ("contiguous", "transposed", "packed")[(n // 3) % 3]
                    n += 1
                    cases.append(Case(*seqs, head_dim, dtype=dtype, causal=causal, batch=2, nheads=h, nheads_k=hk,
                                      layout=layout))
    return cases


@pytest.mark.parametrize("case", _matrix(), ids=lambda c: c.id)
def test_matrix(case):
    check_flash_case(case, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("window", [(0, 0), (16, 16), (100, -1), (-1, 37), (255, 0), (1000, 1000)])
@pytest.mark.parametrize("seqs", [(1023, 1024), (700, 1500), (1500, 700)])
def test_windows(dtype, window, seqs):
    check_flash_case(Case(*seqs, 128, dtype=dtype, window=window, nheads=6, nheads_k=2), device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_alibi(dtype, head_dim, causal):
    check_flash_case(Case(777, 1029, head_dim, dtype=dtype, causal=causal, softcap=30.0, dist="q5"), device="cuda")
    check_flash_case(Case(777, 1029, head_dim, dtype=dtype, causal=causal, alibi="batch"), device="cuda")
    check_flash_case(Case(1029, 777, head_dim, dtype=dtype, causal=causal, alibi="heads", softcap=5.0,
                          window=(200, 10)), device="cuda")


@pytest.mark.parametrize("dist", ["rand", "q5"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_distributions(dist, head_dim):
    check_flash_case(Case(1000, 1000, head_dim, dtype=torch.bfloat16, causal=True, dist=dist), device="cuda")


@pytest.mark.parametrize("head_dim", [32, 59, 128, 256])
def test_fp32_inputs(head_dim):
    check_flash_case(Case(300, 517, head_dim, dtype=torch.float32, causal=True, nheads=4, nheads_k=2), device="cuda")


def _sdpa_inputs(dtype, mask_kind, mask_shape, L=1000, S=1200, B=2, H=6, Hk=2, E=128):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, H, L, E, device="cuda", generator=g, dtype=dtype)
    k = torch.randn(B, Hk, S, E, device="cuda", generator=g, dtype=dtype)
    v = torch.randn(B, Hk, S, E, device="cuda", generator=g, dtype=dtype)
    if mask_kind == "bool":
        mask = torch.rand(mask_shape, device="cuda", generator=g) > 0.5
        if mask_shape[-2] > 1:
            mask[..., 5, :] = False
    else:
        mask = torch.randn(mask_shape, device="cuda", generator=g, dtype=torch.float32).to(dtype) * 3
        if mask_shape[-2] > 1:
            mask[..., 6, :] = float("-inf")
            mask[..., 7, :] = -1e4
    return q, k, v, mask


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", [(1000, 1200), (2, 1, 1000, 1200), (1, 6, 1000, 1200), (2, 6, 1, 1200)],
                         ids=lambda s: "x".join(map(str, s)))
def test_sdpa_masks(dtype, mask_kind, mask_shape):
    q, k, v, mask = _sdpa_inputs(dtype, mask_kind, mask_shape)
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    kwargs = dict(scale=128 ** -0.5, attn_mask=mask.expand(2, 6, 1000, 1200))
    ref, _ = plain_attention(q, k, v, dtype=torch.float64, **kwargs)
    base, _ = plain_attention(q, k, v, **kwargs)
    assert_close(f"sdpa {mask_kind} {mask_shape}", out, ref, base)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("seqs", [(1000, 1200), (1200, 1000), (4096, 4096)])
def test_sdpa_causal_top_left_matches_torch(dtype, seqs):
    L, S = seqs
    q, k, v, _ = _sdpa_inputs(dtype, "bool", (1, 1), L=L, S=S, Hk=6)
    out = flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)
    kwargs = dict(scale=128 ** -0.5, window_right=0)
    ref, _ = plain_attention(q, k, v, dtype=torch.float64, **kwargs)
    base, _ = plain_attention(q, k, v, **kwargs)
    assert_close("sdpa causal", out, ref, base)
    if L <= S:  # torch's own kernel, where every row sees a key
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert_close("torch sdpa vs ref", theirs, ref, base, factor=4.0)


def test_batch_heads_beyond_grid_limit():
    # batch x heads = 70,000 > 65,535 (the CUDA grid y/z limit) on a flat grid.
    check_flash_case(Case(5, 7, 32, batch=70_000, nheads=1, nheads_k=1), device="cuda")


def test_offsets_beyond_int32():
    # k and v hold more than 2^31 elements: the last head's offsets need int64.
    H, D, L = 16, 128, 8
    S = 2**31 // (H * D) + 777
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(1, L, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    assert k.numel() > 2**31
    out = flashtile.flash_attn_func(q, k, v)
    for h in (0, H - 1):
        qh, kh, vh = (t[:, :, h : h + 1].transpose(1, 2) for t in (q, k, v))
        ref, _ = plain_attention(qh, kh, vh, scale=D ** -0.5, dtype=torch.float32)
        base, _ = plain_attention(qh, kh, vh, scale=D ** -0.5)
        assert_close(f"head {h}", out[:, :, h : h + 1].transpose(1, 2), ref, base, factor=4.0)


@pytest.mark.parametrize("seqlen", [16384])
def test_long_sequence(seqlen):
    check_flash_case(Case(seqlen, seqlen, 128, dtype=torch.bfloat16, causal=True, batch=1, nheads=2, nheads_k=1),
                     device="cuda")


def test_noncontiguous_last_dim_is_copied():
    q = torch.randn(1, 64, 4, 256, device="cuda", dtype=torch.float16)[..., ::2]
    k = torch.randn(1, 80, 4, 128, device="cuda", dtype=torch.float16)
    v = torch.randn(1, 80, 4, 128, device="cuda", dtype=torch.float16)
    out = flashtile.flash_attn_func(q, k, v)
    ref = flashtile.flash_attn_func(q.contiguous(), k, v)
    assert torch.equal(out, ref)


def test_deterministic_bitwise():
    q, k, v = (torch.randn(4, 2048, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    first = flashtile.flash_attn_func(q, k, v, causal=True)
    for _ in range(5):
        assert torch.equal(flashtile.flash_attn_func(q, k, v, causal=True), first)


def test_extra_memory_is_output_and_lse():
    B, S, H, D = 1, 16384, 16, 128
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.float16) for _ in range(3))
    flashtile.flash_attn_func(q, k, v)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    expected = out.numel() * out.element_size() + lse.numel() * 4
    assert extra <= expected + 2 * 2**20, (extra, expected)
