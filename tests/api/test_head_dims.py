"""Head dims to 512 and a value head dim that differs from the query's (DeepSeek's 192 / 128,
MLA's absorbed decode: q and k of 576 over a latent cache whose first 512 columns are v),
on CPU: the torch twin and the Triton kernels under TRITON_INTERPRET=1, forward and
backward, against the independent float64 oracle; NaN-poisoned outputs."""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from oracle import dense_attention
from test_kvcache import _run_and_check
from varlen_cases import cu_seqlens

pytestmark = pytest.mark.usefixtures("poison_outputs")

DIMS = [(48, 16), (24, 40), (192, 128), (16, 512), (512, 512), (300, 200)]


def _check(backend, q, k, v, causal, **kwargs):
    """flash_attn_func against the oracle: out, lse, dq, dk, dv."""
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse, _ = flashtile.flash_attn_func(*leaves, causal=causal, return_attn_probs=True, **kwargs)
    assert out.shape == (*q.shape[:3], v.shape[-1])
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ro, rl = dense_attention(*(t.transpose(1, 2) for t in ref_leaves), scale=q.shape[-1] ** -0.5,
                             diag_offset=k.shape[1] - q.shape[1], window_right=0 if causal else -1)
    ro = ro.transpose(1, 2)
    torch.testing.assert_close(out.double(), ro, atol=3e-6, rtol=1e-5)
    finite = torch.isfinite(rl)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse.double()[finite], rl[finite], atol=3e-6, rtol=1e-5)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ro, ref_leaves, dout.double())
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}-v{d[1]}")
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func(backend, dims, causal):
    d, dv = dims
    g = torch.Generator().manual_seed(d + dv)
    q = torch.randn(2, 21, 4, d, generator=g)
    k = torch.randn(2, 34, 2, d, generator=g)
    v = torch.randn(2, 34, 2, dv, generator=g)
    _check(backend, q, k, v, causal)


def test_value_head_dim_with_sinks_chunks_and_a_window(backend):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 40, 4, 64, generator=g)
    k = torch.randn(1, 40, 1, 64, generator=g)
    v = torch.randn(1, 40, 1, 24, generator=g)
    sink = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(11, 0), attention_chunk=16,
                                            learnable_sink=sink, return_attn_probs=True)
    ro, rl = dense_attention(q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2),
                             scale=0.125, window_left=11, window_right=0, chunk=16, sink=sink.double())
    torch.testing.assert_close(out.double(), ro.transpose(1, 2), atol=3e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), rl, atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen(backend, causal):
    lens_q, lens_k = (13, 0, 30, 4), (20, 5, 30, 0)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lens_q), 4, 96, generator=g)
    k = torch.randn(sum(lens_k), 2, 96, generator=g)
    v = torch.randn(sum(lens_k), 2, 32, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flashtile.flash_attn_varlen_func(*leaves, cu_seqlens(lens_q, "cpu"), cu_seqlens(lens_k, "cpu"),
                                           max(lens_q), max(lens_k), causal=causal)
    assert out.shape == (sum(lens_q), 4, 32)
    dout = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, leaves, dout)
    cq, ck = cu_seqlens(lens_q, "cpu").tolist(), cu_seqlens(lens_k, "cpu").tolist()
    for b in range(len(lens_q)):
        if not lens_q[b]:
            continue
        parts = [t[None].double().requires_grad_(True) for t in (q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]],
                                                                 v[ck[b]:ck[b + 1]])]
        ro, _ = dense_attention(*(t.transpose(1, 2) for t in parts), scale=96 ** -0.5,
                                diag_offset=lens_k[b] - lens_q[b], window_right=0 if causal else -1)
        ro = ro.transpose(1, 2)[0]
        torch.testing.assert_close(out[cq[b]:cq[b + 1]].double(), ro, atol=3e-6, rtol=1e-5)
        if lens_k[b]:
            want = torch.autograd.grad(ro, parts, dout[cq[b]:cq[b + 1]].double())
            for a, w, (lo, hi) in zip(got, want, ((cq[b], cq[b + 1]), (ck[b], ck[b + 1]), (ck[b], ck[b + 1]))):
                torch.testing.assert_close(a[lo:hi].double(), w[0], atol=1e-5, rtol=1e-5)


def test_sdpa_value_dim(backend):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 19, 40, generator=g)
    k = torch.randn(2, 4, 27, 40, generator=g)
    v = torch.randn(2, 4, 27, 8, generator=g)
    mask = torch.rand(2, 1, 19, 27, generator=g) > 0.3
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    torch.testing.assert_close(out.double(), want, atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("page", [0, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode_over_a_latent_cache(backend, page, num_splits):
    """MLA's absorbed decode: q and k of 576 (512 latent + 64 rope), one latent KV head,
    v_cache = k_cache[..., :512] (a view of the same cache: no copy), 8 query heads; the
    appended v are the new k's first columns."""
    g = torch.Generator().manual_seed(6)
    batch, capacity, d, dv = 3, 48, 576, 512
    if page:
        blocks = capacity // page
        k_cache = torch.randn(batch * blocks + 2, page, 1, d, generator=g)
        table = torch.randperm(batch * blocks + 2, generator=g)[:batch * blocks].reshape(batch, blocks)
        table = table.to(torch.int32)
    else:
        k_cache, table = torch.randn(batch, capacity, 1, d, generator=g), None
    v_cache = k_cache[..., :dv]
    q = torch.randn(batch, 2, 8, d, generator=g) * 0.1
    k = torch.randn(batch, 2, 1, d, generator=g)
    seqlens = torch.tensor([0, 17, 46], dtype=torch.int32)
    out = _run_and_check(q, k, k[..., :dv], k_cache, v_cache, seqlens, table=table, causal=True,
                         num_splits=num_splits)
    assert out.shape == (batch, 2, 8, dv)
    assert torch.equal(k_cache[..., :dv], v_cache)


@pytest.mark.parametrize("call, match", [
    (lambda q: flashtile.flash_attn_func(torch.randn(1, 4, 2, 513), torch.randn(1, 4, 2, 513), q),
     r"head dim of q must be in \[1, 512\], got 513"),
    (lambda q: flashtile.flash_attn_func(q, q, torch.randn(1, 4, 2, 513)), r"head dim of v must be in \[1, 512\]"),
    (lambda q: flashtile.flash_attn_func(q, q, torch.randn(1, 5, 2, 16)), "k and v must have the same shape"),
    (lambda q: flashtile.flash_attn_with_kvcache(torch.randn(1, 1, 2, 577), torch.randn(1, 8, 2, 577),
                                                 torch.randn(1, 8, 2, 512), cache_seqlens=3),
     r"head dim of q must be in \[1, 576\], got 577"),
    (lambda q: flashtile.flash_attn_with_kvcache(torch.randn(1, 1, 2, 64), torch.randn(1, 8, 2, 64),
                                                 torch.randn(1, 8, 2, 32), torch.randn(1, 1, 2, 64),
                                                 torch.randn(1, 1, 2, 64), cache_seqlens=3),
     r"k and v must have shape \(1, seqlen_new, 2, 64\) and \(1, seqlen_new, 2, 32\)"),
])
def test_bad_head_dims(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(1, 4, 2, 16))


def test_rotary_with_a_latent_cache_is_refused():
    k_cache = torch.zeros(1, 8, 1, 64)
    before = k_cache.clone()
    k = torch.randn(1, 1, 1, 64)
    table = torch.randn(8, 8)
    with pytest.raises(ValueError, match="shares k_cache's memory"):
        flashtile.flash_attn_with_kvcache(torch.randn(1, 1, 2, 64), k_cache, k_cache[..., :32], k, k[..., :32],
                                          rotary_cos=table, rotary_sin=table, cache_seqlens=2)
    assert torch.equal(k_cache, before)


def test_a_latent_cache_takes_v_as_the_same_view_of_k():
    """v_cache a view of k_cache's first columns: both appends write those bytes (on a GPU in no
    fixed order), so v must be k's same view; a copy with other values, or a view of other
    columns, is refused before anything is written."""
    k_cache = torch.zeros(1, 8, 1, 64)
    before = k_cache.clone()
    k = torch.randn(1, 1, 1, 64)
    for v in (torch.randn(1, 1, 1, 32), k[..., :32].clone(), k[..., 32:]):
        with pytest.raises(ValueError, match="v must be a view of k's columns"):
            flashtile.flash_attn_with_kvcache(torch.randn(1, 1, 2, 64), k_cache, k_cache[..., :32], k, v,
                                              cache_seqlens=2)
    assert torch.equal(k_cache, before)
    # k and v pages side by side in one buffer share its storage, not memory: no such rule
    pages = torch.zeros(2, 2, 8, 1, 64)
    out = flashtile.flash_attn_with_kvcache(torch.randn(1, 1, 2, 64), pages[0], pages[1], k, torch.randn(1, 1, 1, 64),
                                            cache_seqlens=2)
    assert out.shape == (1, 1, 2, 64) and torch.equal(pages[0, 0, 2], k[0, 0])


def test_the_context_parallel_layer_refuses_a_value_head_dim():
    from flashtile.problem.validate import parallel_call

    q = torch.randn(1, 8, 2, 32)
    with pytest.raises(ValueError, match="one head dim for q, k and v"):
        parallel_call(q, q, q[..., :16], True, (-1, -1), 0.0, None)


def test_the_registry_keeps_other_head_dims_off_the_gluon_kernels():
    from flashtile.backends import registry

    for head_dim, head_dim_v, reason in ((192, 128, "head dims (64, 128, 256), not 192"),
                                         (128, 64, "one head dim for q, k and v"),
                                         (512, 0, "not 512")):
        call = registry.Call(capability=(9, 0), dtype="bfloat16", head_dim=head_dim, head_dim_v=head_dim_v,
                             seqlen_q=8192)
        for choice in (registry.forward(call), registry.backward(call)):
            assert choice.family == "triton" and any(reason in why for why in choice.why), choice


def test_the_tables_have_every_head_dim():
    from flashtile.backends import configs

    for d in (1, 16, 100, 256, 300, 512):
        for cap in ((9, 0), (8, 0)):
            assert configs.default_fwd_config(cap, d, "bfloat16", True, 4096).block_m >= 16
            assert configs.default_bwd_config(cap, d, "bfloat16").block_n_kv >= 16
    assert math.isfinite(configs.head_dim_bucket(512))
