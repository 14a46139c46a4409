"""The Triton backward kernels on CPU tensors under TRITON_INTERPRET=1 (fp16 and fp32).

Gradients follow QUALITY.md's rule: at most 3x plain PyTorch's own error against a float64
reference, one shared upstream gradient, NaN-poisoned gradient buffers.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from cases import Case, check_flash_grads
from flashtile.testing import GRAD_FACTOR, assert_close, plain_attention

pytestmark = pytest.mark.usefixtures("triton_backend", "poison_outputs")


@pytest.mark.parametrize("seqs", [(1, 1), (2, 5), (5, 2), (17, 17), (37, 53), (53, 37), (64, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens(seqs, causal):
    check_flash_grads(Case(*seqs, 32, causal=causal, batch=1, nheads=2, nheads_k=1))


@pytest.mark.parametrize("head_dim", [1, 16, 40, 59, 80])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_head_dims(head_dim, dtype):
    check_flash_grads(Case(29, 35, head_dim, dtype=dtype, causal=True, batch=1, nheads=2, nheads_k=2))


@pytest.mark.parametrize("nheads_k", [6, 2, 1], ids=["mha", "gqa", "mqa"])
def test_gqa_sums_dk_dv_over_groups(nheads_k):
    check_flash_grads(Case(33, 41, 16, causal=True, batch=2, nheads=6, nheads_k=nheads_k))


@pytest.mark.parametrize("window", [(0, 0), (3, 5), (-1, 2), (7, -1)])
def test_windows(window):
    check_flash_grads(Case(45, 38, 16, window=window, batch=1, nheads=2, nheads_k=1))


@pytest.mark.parametrize("softcap", [2.0, 30.0])
def test_softcap(softcap):
    check_flash_grads(Case(40, 47, 32, causal=True, softcap=softcap, dist="q5", batch=1, nheads=2, nheads_k=1))


def test_alibi_and_softcap_and_window():
    check_flash_grads(Case(41, 59, 16, window=(20, 3), alibi="batch", softcap=5.0, batch=2, nheads=4, nheads_k=2))


@pytest.mark.parametrize("layout", ["transposed", "packed"])
def test_layouts_and_noncontiguous_dout(layout):
    check_flash_grads(Case(36, 36, 24, layout=layout, causal=True, batch=2, nheads=3, nheads_k=3))
    check_flash_grads(Case(36, 36, 24, layout=layout, batch=1, nheads=3, nheads_k=3), noncontiguous_dout=False)


def test_fp32_gradients():
    check_flash_grads(Case(50, 70, 48, dtype=torch.float32, causal=True, window=(25, -1), batch=1, nheads=2, nheads_k=1))


def test_empty_rows_have_zero_gradient():
    # Sq=20 > Sk=6, bottom-right causal: query rows 0..13 see nothing.
    dq, dk, dv = check_flash_grads(Case(20, 6, 16, causal=True, batch=1, nheads=2, nheads_k=1))[1:]
    assert torch.equal(dq[:, :14], torch.zeros_like(dq[:, :14]))
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_deterministic_bitwise():
    case = Case(33, 47, 16, causal=True, batch=2, nheads=4, nheads_k=2)
    first = check_flash_grads(case)
    again = check_flash_grads(case)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_sdpa_mask_gradients(mask_kind):
    g = torch.Generator().manual_seed(4)
    B, H, Hk, L, S, E = 2, 4, 2, 23, 31, 16
    q, k, v = (torch.randn(B, h, n, E, generator=g, dtype=torch.float16) for h, n in ((H, L), (Hk, S), (Hk, S)))
    if mask_kind == "bool":
        mask = torch.rand(B, 1, L, S, generator=g) > 0.4
        mask[..., 3, :] = False
    else:
        mask = (torch.randn(1, H, L, S, generator=g) * 2).to(torch.float16)
    dout = torch.randn(B, H, L, E, generator=g, dtype=torch.float16)
    full = mask.expand(B, H, L, S)

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        return torch.autograd.grad(fn(*leaves), leaves, dout.to(leaves[0].dtype))

    got = grads(lambda a, b, c: flashtile.scaled_dot_product_attention(a, b, c, attn_mask=mask, enable_gqa=True))
    ref = grads(lambda a, b, c: plain_attention(a.double(), b.double(), c.double(), scale=E ** -0.5, attn_mask=full)[0])
    base = grads(lambda a, b, c: plain_attention(a, b, c, scale=E ** -0.5, attn_mask=full)[0])
    for name, a, r, b in zip(("dq", "dk", "dv"), got, ref, base):
        assert_close(f"sdpa {mask_kind} {name}", a, r, b, factor=GRAD_FACTOR)


def test_sdpa_causal_top_left_gradients():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float32) for n in (30, 19, 19))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flashtile.scaled_dot_product_attention(*leaves, is_causal=True)
    got = torch.autograd.grad(out.sum(), leaves)
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, is_causal=True)
    want = torch.autograd.grad(ref.sum(), ref_leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=0)


def test_float_mask_requiring_grad_is_refused():
    q = torch.randn(1, 2, 8, 16)
    mask = torch.zeros(8, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask requires grad"):
        flashtile.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_opcheck():
    q, k, v = (torch.randn(1, 2, n, 16, dtype=torch.float32) for n in (9, 13, 13))
    args = (q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), 0.25, 4, -1, 0, 0.0, None, None)
    from flashtile import autograd  # noqa: F401

    torch.library.opcheck(torch.ops.flashtile.attn_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_eager_calls_skip_function_apply(monkeypatch, triton_backend):
    """A plain eager call with grad makes its autograd node through the C ``apply`` directly
    (``autograd._eager_apply``: 4-5 us less host time than ``Function.apply``'s Python
    classmethod, CPU stub, session 42), keyed or not; its gradients are the op's."""
    from flashtile import autograd

    def refuse(*args, **kwargs):
        raise AssertionError("Function.apply's Python classmethod was called")

    q, k, v = (torch.randn(1, n, 2, 16, dtype=torch.float16, requires_grad=True) for n in (12, 20, 20))
    dout = torch.randn(1, 12, 2, 16, dtype=torch.float16)
    want = torch.autograd.grad(torch.ops.flashtile.attn_fwd(*(t.transpose(1, 2) for t in (q, k, v)), 0.25, 8, -1, 0,
                                                            0.0, None, None)[0], (q, k, v), dout)
    monkeypatch.setattr(autograd._EagerAttention, "apply", staticmethod(refuse))
    for plans in ("0", "1"):  # the plain path and the keyed one (a plan per API key)
        monkeypatch.setenv("FLASHTILE_PLANS", plans)
        for _ in range(2):
            out = flashtile.flash_attn_func(q, k, v, softmax_scale=0.25, causal=True)
            assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
            got = torch.autograd.grad(out, (q, k, v), dout)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), plans


def test_torch_compile_fullgraph_forward_and_backward():
    q, k, v = (torch.randn(1, n, 2, 16, dtype=torch.float32, requires_grad=True) for n in (12, 20, 20))

    def f(q_, k_, v_):
        return flashtile.flash_attn_func(q_, k_, v_, causal=True).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    got = torch.autograd.grad(loss, (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph_sdpa_with_a_mask():
    """scaled_dot_product_attention (a bool mask, GQA) traces through the same ops."""
    q = torch.randn(1, 4, 12, 16, dtype=torch.float32, requires_grad=True)
    k, v = (torch.randn(1, 2, 20, 16, dtype=torch.float32, requires_grad=True) for _ in range(2))
    mask = torch.rand(1, 1, 12, 20, generator=torch.Generator().manual_seed(0)) > 0.3

    def f(q_, k_, v_):
        return flashtile.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, enable_gqa=True).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", [
    Case(33, 41, 16, causal=True, batch=2, nheads=6, nheads_k=2),
    Case(45, 38, 16, window=(3, 5), softcap=5.0, alibi="heads", batch=1, nheads=2, nheads_k=1),
    Case(29, 35, 40, dtype=torch.float32, batch=1, nheads=2, nheads_k=2),
], ids=lambda c: c.id)
def test_atomic_dq_variant(case, monkeypatch):
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "atomic")
    check_flash_grads(case)


def test_deterministic_flag_overrides_atomic(monkeypatch):
    from flashtile.backends import configs

    monkeypatch.setenv("FLASHTILE_BWD_DQ", "atomic")
    assert configs.bwd_dq_mode(True) == "split" and configs.bwd_dq_mode(False) == "atomic"
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "auto")  # the default: the one-pass Gluon kernel where it applies
    assert configs.bwd_dq_mode(True) == "split" and configs.bwd_dq_mode(False) == "split"
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "fast")
    with pytest.raises(ValueError, match="FLASHTILE_BWD_DQ"):
        configs.bwd_dq_mode(False)


@pytest.mark.parametrize("causal", [False, True])
def test_lse_gradient_z_loss(causal):
    # A loss on the returned LSE (z-loss) must reach q and k: dS = P * (dP - (Delta - dlse)).
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, n, 2, 16, generator=g) for n in (23, 31, 31))

    def loss(attention, q_, k_, v_):
        out, lse = attention(q_, k_, v_)
        return (out * 0.3).sum() + (lse.square() * 0.1).sum()

    def ours(q_, k_, v_):
        out, lse, _ = flashtile.flash_attn_func(q_, k_, v_, causal=causal, return_attn_probs=True)
        return out, lse

    def ref(q_, k_, v_):
        return plain_attention(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), scale=0.25,
                               diag_offset=8, window_right=0 if causal else -1, dtype=torch.float64)

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    got = torch.autograd.grad(loss(ours, *leaves), leaves)
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(loss(ref, *ref_leaves), ref_leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=3e-5, rtol=0)


def test_alibi_requiring_grad_is_refused():
    q = torch.randn(1, 8, 2, 16)
    slopes = torch.rand(2, requires_grad=True)
    with pytest.raises(NotImplementedError, match="alibi_slopes requires grad"):
        flashtile.flash_attn_func(q, q, q, alibi_slopes=slopes)


def test_eager_path_matches_the_op():
    # Eager calls skip the custom-op dispatch (flashtile.autograd.attention); the op is what
    # torch.compile sees. Both must give the same out, LSE and gradients, bit for bit,
    # including through an LSE-only loss term.
    from flashtile import autograd

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g) for n in (21, 27, 27))
    args = (0.25, 6, -1, 0, 0.0, None, None, 0.0, None, False)
    results = []
    for call in (autograd.attention, torch.ops.flashtile.attn_fwd):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = call(*leaves, *args)
        if call is autograd.attention:  # out in its inputs' layout, (B, H, S, D); the op's is (B, S, H, D)
            out = out.transpose(1, 2)
        loss = (out * torch.linspace(-1, 1, out.shape[-1])).sum() + 0.1 * lse.square().sum()
        results.append((out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves)))
        lse_only = call(*[t.clone().requires_grad_(True) for t in (q, k, v)], *args)[1]
        assert lse_only.grad_fn is not None
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("api", ["flash", "varlen", "sdpa"])
def test_a_training_call_is_one_autograd_node(api):
    """The layout views between the caller's tensors and the kernels' (B, H, S, D) happen
    inside the autograd node: as views outside it, each was a node of its own that every
    backward ran too (flash_attn_func had five; H200 run 90). The output of
    flash_attn_func is then a plain tensor, as flash-attn's: an in-place op on it is
    allowed (a backward through it then fails, as flash-attn's: out is saved)."""
    g = torch.Generator().manual_seed(3)
    if api == "flash":
        q, k, v = (torch.randn(2, 9, 2, 16, generator=g).requires_grad_() for _ in range(3))
        out = flashtile.flash_attn_func(q, k, v, causal=True)
    elif api == "sdpa":
        q, k, v = (torch.randn(2, 2, 9, 16, generator=g).requires_grad_() for _ in range(3))
        out = flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        q, k, v = (torch.randn(18, 2, 16, generator=g).requires_grad_() for _ in range(3))
        cu = torch.tensor([0, 7, 18], dtype=torch.int32)
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True)
    assert out.shape == q.shape
    assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
    leaves = [f for f, _ in out.grad_fn.next_functions if f is not None]
    assert [type(f).__name__ for f in leaves] == ["AccumulateGrad"] * 3
    assert [f.variable for f in leaves] == [q, k, v]
    if api == "flash":
        assert not out._is_view()
        flashtile.flash_attn_func(q, k, v).mul_(2)  # a view made inside a custom Function refuses this
    dq, dk, dv = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_eager_path_without_grad_builds_no_graph():
    q = torch.randn(1, 9, 2, 16, requires_grad=True)
    with torch.no_grad():
        out = flashtile.flash_attn_func(q, q, q, causal=True)
    assert out.grad_fn is None and not out.requires_grad


def test_double_backward_raises():
    # The backward kernels have no derivative: a second backward must fail loudly, never
    # treat the first gradient as a constant (which would give silent zeros).
    q, k, v = (torch.randn(1, 11, 2, 16, requires_grad=True) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.square().sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        torch.autograd.grad(dq.sum(), (q, k), allow_unused=True)


@pytest.mark.parametrize("case", [
    Case(33, 41, 16, causal=True, batch=2, nheads=6, nheads_k=2),
    Case(45, 38, 16, window=(3, 5), softcap=5.0, alibi="heads", batch=1, nheads=2, nheads_k=1),
    Case(29, 35, 40, dtype=torch.float32, batch=1, nheads=2, nheads_k=2),
    Case(40, 24, 16, batch=1, nheads=2, nheads_k=1),
], ids=lambda c: c.id)
def test_one_loop_dkdv_variant(case, monkeypatch):
    # BwdConfig.split_phases=False: the dk/dv kernel masks every query tile in one loop.
    from dataclasses import replace

    from flashtile.backends import configs

    monkeypatch.setattr(configs, "INTERPRETER_BWD", replace(configs.INTERPRETER_BWD, split_phases=False))
    check_flash_grads(case)


def _small_qkv(requires_grad=False):
    g = torch.Generator().manual_seed(9)
    return [torch.randn(1, 7, 2, 16, generator=g).requires_grad_(requires_grad) for _ in range(3)]


def test_fake_tensors_and_make_fx_see_the_op():
    # Tracing tools must get the op (and its fake kernel), never the real launch.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        q, k, v = (torch.empty(1, 7, 2, 16) for _ in range(3))
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        assert type(out).__name__ == "FakeTensor" and out.shape == (1, 7, 2, 16)
    graph = make_fx(lambda q_, k_, v_: flashtile.flash_attn_func(q_, k_, v_), tracing_mode="fake")(*_small_qkv())
    assert any("flashtile.attn_fwd" in str(n.target) for n in graph.graph.nodes)
    meta = [t.to("meta") for t in _small_qkv()]
    assert flashtile.flash_attn_func(*meta).shape == (1, 7, 2, 16)


def test_vmap_and_compiled_autograd():
    q, k, v = _small_qkv(requires_grad=True)
    want = torch.autograd.grad(flashtile.flash_attn_func(q, k, v).square().sum(), (q, k, v))
    loss = flashtile.flash_attn_func(q, k, v).square().sum()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
        loss.backward()
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        assert torch.equal(got, ref)
    batched = torch.vmap(lambda q_: flashtile.flash_attn_func(q_, k.detach(), v.detach()))(torch.stack([q.detach()] * 2))
    assert torch.equal(batched[1], flashtile.flash_attn_func(q.detach(), k.detach(), v.detach()))


def test_forward_mode_ad_is_refused():
    import torch.autograd.forward_ad as fwad

    q, k, v = _small_qkv()
    with fwad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        flashtile.flash_attn_func(fwad.make_dual(q, torch.ones_like(q)), k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_sdpa_rows_hidden_by_finfo_min(dtype):
    # transformers hides keys with torch.finfo(dtype).min in an additive mask. A row hidden
    # entirely must come out as torch's SDPA gives it: at fp32 (and bf16) the bias swallows
    # q.k and the row spreads evenly (out = mean of v, gradients of that softmax); at fp16
    # (-65504 scaled by log2 e is still finite) the q.k differences survive. Rows 2, 7
    # hidden entirely, row 4 all but two keys, the rest a padding mask.
    g = torch.Generator().manual_seed(6)
    B, H, L, S, E = 2, 2, 19, 37, 16
    q, k, v, dout = (torch.randn(B, H, n, E, generator=g, dtype=dtype) for n in (L, S, S, L))
    hide = torch.zeros(B, 1, L, S, dtype=torch.bool)
    hide[..., 30:] = True
    hide[:, :, [2, 7], :] = True
    hide[:, :, 4, :] = True
    hide[:, :, 4, [5, 11]] = False
    mask = torch.zeros(B, 1, L, S, dtype=dtype).masked_fill(hide, torch.finfo(dtype).min)
    full = mask.expand(B, H, L, S)

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        return (out.detach(), *torch.autograd.grad(out, leaves, dout.to(out.dtype)))

    got = run(lambda a, b, c: flashtile.scaled_dot_product_attention(a, b, c, attn_mask=mask))
    ref = run(lambda a, b, c: plain_attention(a.double(), b.double(), c.double(), scale=E ** -0.5,
                                              attn_mask=full.double())[0])
    base = run(lambda a, b, c: plain_attention(a, b, c, scale=E ** -0.5, attn_mask=full)[0])
    for name, a, r, b in zip(("out", "dq", "dk", "dv"), got, ref, base):
        assert_close(f"finfo.min {name}", a, r, b, factor=2.0 if name == "out" else GRAD_FACTOR)
    if dtype == torch.float32:
        mean_v = v.double().mean(dim=2)
        for row in (2, 7):
            torch.testing.assert_close(got[0][:, :, row].double(), mean_v, atol=1e-5, rtol=0)


def test_preprocess_zeroes_the_one_pass_accumulator():
    """The Delta launch zeroes the one-pass backward's float32 dQ (fixed lengths), one
    launch fewer than a memset: every row of every (batch, head), padding rows included
    (padded to 128 rows at d64: the last program zeroes the rows past its block, one block
    or several), and Delta unchanged by it. Packed calls and a wrongly shaped buffer are
    refused first."""
    from flashtile.backends.triton.backward import preprocess

    g = torch.Generator().manual_seed(0)
    out, dout = (torch.randn(2, 3, 70, 64, generator=g).to(torch.float16) for _ in range(2))
    acc = torch.full((2, 3, 128, 64), float("nan"))
    plain, _ = preprocess(out, dout, None, None, [], -1, -1, 70)
    delta, built = preprocess(out, dout, None, None, [], -1, -1, 70, accumulator=acc)
    assert torch.equal(delta, plain) and built == [] and torch.equal(acc, torch.zeros_like(acc))
    out, dout = (torch.randn(2, 3, 130, 64, generator=g).to(torch.float16) for _ in range(2))
    for rows in (192, 256):  # 3 blocks of 64: a padding of 1 and of 2 blocks
        acc = torch.full((2, 3, rows, 64), float("nan"))
        delta, _ = preprocess(out, dout, None, None, [], -1, -1, 130, accumulator=acc)
        assert torch.equal(acc, torch.zeros_like(acc))
    acc = torch.full((2, 3, 256, 64), float("nan"))
    for bad in (torch.zeros(2, 3, 130, 64), torch.zeros(2, 3, 100, 64), torch.zeros(2, 3, 256, 64, dtype=torch.float16),
                torch.zeros(64)):
        with pytest.raises(ValueError, match="accumulator"):
            preprocess(out, dout, None, None, [], -1, -1, 130, accumulator=bad)
    with pytest.raises(ValueError, match="fixed-length"):
        preprocess(out, dout, None, object(), [], -1, -1, 130, accumulator=acc)
