"""Learnable attention sinks (``learnable_sink``) on CPU: the torch twin and the Triton
kernels under TRITON_INTERPRET=1, in flash_attn_func and scaled_dot_product_attention,
against float64 references (QUALITY.md's rule, NaN-poisoned outputs); the packed and
kv-cache entry points have their sink cases beside their other cases (test_varlen.py,
test_kvcache.py). Sinks are drawn small (they barely move a row: a dropped sink could pass)
and large (around and above the rows' LSE: much of many rows' weight)."""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from cases import Case, check_flash_case, check_flash_grads
from flashtile.testing import GRAD_FACTOR, assert_close, plain_attention
from oracle import dense_attention

pytestmark = pytest.mark.usefixtures("poison_outputs")


@pytest.mark.parametrize("sink", ["small", "large"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_gradients(backend, sink, causal):
    case = Case(37, 53, 32, causal=causal, batch=2, nheads=4, nheads_k=2, sink=sink)
    check_flash_case(case)
    check_flash_grads(case)


def test_with_window_softcap_alibi_and_fp32(backend):
    case = Case(45, 60, 16, dtype=torch.float32, window=(9, 3), softcap=5.0, alibi="heads", batch=1, nheads=2,
                nheads_k=1, sink="large")
    check_flash_case(case)
    check_flash_grads(case)


def test_a_sink_moves_the_result():
    """The tests above cannot pass with the sink ignored: large sinks move out by far more
    than any tolerance; small ones (weight ~exp(-2) against ~50 keys) by ~1e-3, within a
    bf16 tolerance but 1000x a float32 one."""
    for name in ("small", "large"):
        case = Case(37, 53, 32, batch=1, nheads=2, nheads_k=1, sink=name, dtype=torch.float32)
        q, k, v = (torch.randn(1, n, h, 32, generator=torch.Generator().manual_seed(0))
                   for n, h in ((37, 2), (53, 1), (53, 1)))
        from cases import make_sink

        with_sink = flashtile.flash_attn_func(q, k, v, learnable_sink=make_sink(case))
        without = flashtile.flash_attn_func(q, k, v)
        assert (with_sink - without).abs().max() > (1e-3 if name == "small" else 0.3)


def test_rows_that_see_no_key_get_the_sink(backend):
    # causal bottom-right with seqlen_q > seqlen_k: rows 0..3 see no key
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 7, 2, 16, generator=g)
    k, v = (torch.randn(2, 3, 2, 16, generator=g) for _ in range(2))
    sink = torch.tensor([1.5, -0.5])
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.equal(lse[:, :, :4], sink[None, :, None].expand(2, 2, 4))
    check_flash_grads(Case(7, 3, 16, dtype=torch.float32, causal=True, batch=2, nheads=2, nheads_k=2, sink="large"))


def test_no_keys_at_all(backend):
    q = torch.randn(1, 4, 2, 16, requires_grad=True)
    k = torch.randn(1, 0, 2, 16, requires_grad=True)
    sink = torch.tensor([0.25, 2.0], requires_grad=True)
    out, lse, _ = flashtile.flash_attn_func(q, k, k, learnable_sink=sink, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sink.detach()[None, :, None].expand(1, 2, 4))
    # lse = sink: d(sum lse) / d sink = the number of rows per head
    dq, dsink = torch.autograd.grad(lse.sum() + out.sum(), (q, sink))
    assert torch.equal(dsink, torch.full((2,), 4.0)) and torch.equal(dq, torch.zeros_like(dq))


@pytest.mark.parametrize("causal", [False, True])
def test_lse_gradient_reaches_the_sink(backend, causal):
    """A loss on the returned LSE (z-loss) as well as on out: dsink = sum_i P_sink,i (dlse_i - Delta_i)."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, n, 2, 16, generator=g) for n in (23, 31, 31))
    sink = torch.tensor([3.0, 0.5])

    def loss(out, lse):
        return (out * 0.3).sum() + (lse.square() * 0.1).sum()

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sink)]
    out, lse, _ = flashtile.flash_attn_func(*leaves[:3], causal=causal, learnable_sink=leaves[3],
                                            return_attn_probs=True)
    got = torch.autograd.grad(loss(out, lse), leaves)
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v, sink)]
    ro, rl = dense_attention(*(t.transpose(1, 2) for t in ref_leaves[:3]), scale=0.25, diag_offset=8,
                             window_right=0 if causal else -1, sink=ref_leaves[3])
    want = torch.autograd.grad(loss(ro.transpose(1, 2), rl), ref_leaves)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_sink_parameter(dtype):
    """transformers' sinks are parameters in the model's dtype: read as float32, the gradient
    comes back in the parameter's dtype (the twin: the interpreter has no bf16)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 19, 4, 16, generator=g) for _ in range(3))
    sink = (torch.randn(4, generator=g) + 3).to(dtype).requires_grad_(True)
    out = flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    (dsink,) = torch.autograd.grad(out.square().sum(), sink)
    assert dsink.dtype == dtype
    s64 = sink.detach().double().requires_grad_(True)
    ro, _ = dense_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), scale=0.25, window_right=0, sink=s64)
    (want,) = torch.autograd.grad(ro.transpose(1, 2).square().sum(), s64)
    torch.testing.assert_close(dsink.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_sdpa(backend, mask_kind):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 21, 16, generator=g)
    k, v = (torch.randn(2, 2, 30, 16, generator=g) for _ in range(2))
    sink = torch.randn(4, generator=g) * 2 + 3
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, 21, 30, generator=g) > 0.4
    elif mask_kind == "float":
        mask = torch.randn(21, 30, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sink)]
    out = flashtile.scaled_dot_product_attention(*leaves[:3], attn_mask=mask, enable_gqa=True,
                                                 is_causal=mask is None, learnable_sink=leaves[3])
    full = None if mask is None else mask.expand(2, 4, 21, 30)

    def ref(dtype):
        xs = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)] + [sink.detach().requires_grad_(True)]
        o, _ = plain_attention(*xs[:3], scale=0.25, window_right=0 if mask is None else -1, attn_mask=full,
                               sink=xs[3], dtype=dtype)
        return o, xs

    dout = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, leaves, dout)
    (want_out, want_leaves), (base_out, base_leaves) = ref(torch.float64), ref(torch.float32)
    assert_close("out", out, want_out, base_out)
    want = torch.autograd.grad(want_out, want_leaves, dout.double())
    base = torch.autograd.grad(base_out, base_leaves, dout)
    for name, a, w, b in zip(("dq", "dk", "dv", "dsink"), got, want, base):
        assert_close(name, a, w, b, GRAD_FACTOR)


def test_dropout_with_a_sink_matches_the_twin(monkeypatch, triton_backend):
    """The kernels and the twin draw the same dropout mask from the same key: with a sink,
    their outputs and gradients agree to rounding."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 29, 2, 16, generator=g) for _ in range(3))
    sink = torch.tensor([2.0, 4.0])

    def run():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sink)]
        torch.manual_seed(123)
        out = flashtile.flash_attn_func(*leaves[:3], dropout_p=0.3, causal=True, learnable_sink=leaves[3])
        return (out, *torch.autograd.grad(out.square().sum(), leaves))

    kernels = run()
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    twin = run()
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), kernels, twin):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_sink_gradient_is_deterministic(triton_backend):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 70, 4, 16, generator=g) for _ in range(3))
    sink = torch.randn(4, generator=g) + 3

    def dsink():
        s = sink.clone().requires_grad_(True)
        out = flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=s, deterministic=True)
        return torch.autograd.grad(out.square().sum(), s)[0]

    first = dsink()
    assert torch.equal(first, dsink())


def test_opcheck_with_a_sink(triton_backend):
    from flashtile import autograd  # noqa: F401

    q, k, v = (torch.randn(1, 2, n, 16, dtype=torch.float32, requires_grad=True) for n in (9, 13, 13))
    sink = torch.tensor([1.0, 3.0], requires_grad=True)
    args = (q, k, v, 0.25, 4, -1, 0, 0.0, None, None, 0.0, None, False, None, None, None, None, 0, 0, sink)
    torch.library.opcheck(torch.ops.flashtile.attn_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_torch_compile_fullgraph_with_a_sink(triton_backend):
    q, k, v = (torch.randn(1, n, 2, 16, dtype=torch.float32, requires_grad=True) for n in (12, 20, 20))
    sink = torch.tensor([2.0, 0.5], requires_grad=True)

    def f(q_, k_, v_, s_):
        return flashtile.flash_attn_func(q_, k_, v_, causal=True, learnable_sink=s_).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, sink), (q, k, v, sink))
    want = torch.autograd.grad(f(q, k, v, sink), (q, k, v, sink))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sink,error,match", [
    ([1.0, 2.0], TypeError, "learnable_sink must be a torch.Tensor"),
    (torch.zeros(3), ValueError, r"learnable_sink must have shape \(2,\)"),
    (torch.zeros(1, 2), ValueError, r"learnable_sink must have shape \(2,\)"),
    (torch.zeros(2, dtype=torch.int32), TypeError, "learnable_sink must be float16, bfloat16 or float32"),
    (torch.zeros(2, dtype=torch.float64), TypeError, "learnable_sink must be float16, bfloat16 or float32"),
])
def test_bad_sinks_are_refused_by_every_entry_point(sink, error, match):
    q = torch.randn(1, 5, 2, 16)
    with pytest.raises(error, match=match):
        flashtile.flash_attn_func(q, q, q, learnable_sink=sink)
    with pytest.raises(error, match=match):
        flashtile.scaled_dot_product_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2),
                                               learnable_sink=sink)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(error, match=match):
        flashtile.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 5, 5, learnable_sink=sink)
    cache = torch.zeros(1, 8, 2, 16)
    before = cache.clone()
    with pytest.raises(error, match=match):
        flashtile.flash_attn_with_kvcache(q[:, :1], cache, cache, q[:, :1], q[:, :1], cache_seqlens=2,
                                          learnable_sink=sink)
    assert torch.equal(cache, before)  # nothing written


def test_the_registry_sends_sinks_to_the_gluon_kernels():
    from flashtile.backends import registry

    call = registry.Call(capability=(9, 0), dtype="bfloat16", head_dim=128, seqlen_q=4096, window_right=0,
                         sink=True)
    # the Gluon forward adds the sink in its epilogue
    assert registry.forward(call).kernel == "sm90.forward"
    # the backward sees a sink only through the LSE: the Gluon kernels take it
    assert registry.backward(call).family == "sm90"


def test_sink_values_are_natural_log_and_not_scaled(backend):
    """One query, one key: p_key = 1 / (1 + exp(sink - s)) with s = scale * q.k; out = p_key * v."""
    q = torch.full((1, 1, 1, 4), 1.0)
    k = torch.full((1, 1, 1, 4), 0.5)
    v = torch.full((1, 1, 1, 4), 2.0)
    sink = torch.tensor([1.25])
    out, lse, _ = flashtile.flash_attn_func(q, k, v, softmax_scale=0.3, learnable_sink=sink, return_attn_probs=True)
    s = 0.3 * 2.0
    p = 1.0 / (1.0 + math.exp(1.25 - s))
    torch.testing.assert_close(out, torch.full_like(out, 2.0 * p))
    torch.testing.assert_close(lse, torch.full_like(lse, math.log(math.exp(s) + math.exp(1.25))))
