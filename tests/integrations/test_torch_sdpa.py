"""The SDPA provider (``flashtile.integrations.torch_sdpa``) on CPU: it registers with
PyTorch's registry without activating, activation puts flashtile's kernels on the CUDA key
of each flash op and restoring removes them; installed on the CPU key (the twin), every
overridden op returns what its contract says (shapes, strides of the meta kernel, the LSE
layout, placeholder RNG outputs) and the values and gradients of PyTorch's math
implementation; calls flashtile does not take run PyTorch's own kernel and are counted."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import flashtile  # noqa: E402
from flashtile.integrations import torch_sdpa  # noqa: E402

OPS = tuple(torch_sdpa.KERNELS)


def _has_python_kernel(op: str, key: str) -> bool:
    dump = torch._C._dispatch_dump(f"aten::{op}")
    return any(line.startswith(f"{key}:") for line in dump.splitlines())


@pytest.fixture
def on_cpu():
    """flashtile's kernels on the CPU key (the twin behind them), removed after the test."""
    handle = torch_sdpa.install("CPU")
    yield handle
    handle.remove()


def test_registers_without_activating():
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        pytest.skip("this torch has no flash-attention registry")
    assert "flashtile" in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() != "flashtile"
    assert not any(_has_python_kernel(op, "CUDA") for op in OPS)


@pytest.mark.parametrize("how", ["registry", "helper"])
def test_activate_and_restore(how):
    attention = torch.nn.attention
    if how == "registry" and not hasattr(attention, "activate_flash_attention_impl"):
        pytest.skip("this torch has no flash-attention registry")
    if how == "registry":
        attention.activate_flash_attention_impl("flashtile")
    else:
        torch_sdpa.activate()
    try:
        assert torch_sdpa.active()
        assert all(_has_python_kernel(op, "CUDA") for op in OPS)
        assert "active" in torch_sdpa.report()
    finally:
        torch_sdpa.deactivate()
    assert not torch_sdpa.active()
    assert not any(_has_python_kernel(op, "CUDA") for op in OPS)


def test_activated_is_active_inside_only():
    with torch_sdpa.activated():
        assert torch_sdpa.active()
        assert all(_has_python_kernel(op, "CUDA") for op in OPS)
    assert not torch_sdpa.active()
    assert not any(_has_python_kernel(op, "CUDA") for op in OPS)


def _math(q, k, v, causal, scale=None):
    """PyTorch's math SDPA in float64, with its gradients (top-left causal, GQA)."""
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, 1) for t in leaves[1:])
    out = torch.ops.aten._scaled_dot_product_attention_math(leaves[0], kk, vv, None, 0.0, causal, scale=scale)[0]
    return out, leaves


def _family(request, monkeypatch, backend):
    """The twin ("torch") or the kernels under the interpreter ("triton") for CPU tensors."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    else:
        monkeypatch.setenv("FLASHTILE_BACKEND", "torch")


def _laid_out(t, how):
    """(B, H, S, D) ``t`` contiguous ("bhsd") or as a view of a (B, S, H, D) buffer ("bshd")."""
    return t.contiguous() if how == "bhsd" else t.transpose(1, 2).contiguous().transpose(1, 2)


def _sdpa_inputs(seed, dtype, heads_k, seqlen_k, how):
    """q (2, 4, 37, 16), k, v (2, heads_k, seqlen_k, 16) and dout laid out as ``how`` says:
    "bhsd", "bshd" (``_laid_out``) or "qkv" (q, k, v sliced from one (B, S, 3, H, D)
    projection: not dense, so the gradients' layout is empty_like's, not the inputs')."""
    g = torch.Generator().manual_seed(seed)
    if how == "qkv":
        q, k, v = torch.randn(2, 37, 3, 4, 16, generator=g).to(dtype).permute(2, 0, 3, 1, 4)
    else:
        q = _laid_out(torch.randn(2, 4, 37, 16, generator=g).to(dtype), how)
        k, v = (_laid_out(torch.randn(2, heads_k, seqlen_k, 16, generator=g).to(dtype), how) for _ in range(2))
    dout = _laid_out(torch.randn(2, 4, 37, 16, generator=g).to(dtype), "bhsd" if how == "qkv" else how)
    return q, k, v, dout


# every case on the twin; some on the kernels (the interpreter takes ~3 s a case)
_CONTRACT = [("torch", c, hk, how) for c in (False, True) for hk in (4, 2) for how in ("bhsd", "bshd")] + [
    ("torch", True, 4, "qkv"), ("triton", False, 4, "bhsd"), ("triton", False, 2, "bshd"),
    ("triton", True, 2, "bhsd"), ("triton", True, 4, "qkv")]


@pytest.mark.parametrize("backend, causal, heads_k, how", _CONTRACT)
def test_sdpa_op_contract(on_cpu, request, monkeypatch, plan_replays, backend, causal, heads_k, how):
    """On the twin and on the kernels (interpreted): the op's outputs have the meta kernels'
    strides (out laid out as query, each gradient as ``empty_like`` its input: written so by
    the kernels, not copied after, or the call could not be planned), values and gradients
    are PyTorch math's, and a repeated call on new tensors of the same layout replays its
    plans (one replay per op) with the right results."""
    _family(request, monkeypatch, backend)
    dtype = torch.float32 if backend == "torch" else torch.float16
    tol = 1e-5 if backend == "torch" else 4e-3  # float16 inputs and outputs on the kernels
    for seed in (0, 1):
        plan_replays["n"] = 0
        q, k, v, dout = _sdpa_inputs(seed, dtype, heads_k, 37 if causal else 50, how)
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=0.3)
        meta = torch.ops.aten._scaled_dot_product_flash_attention(*(t.to("meta") for t in (q, k, v)), 0.0, causal,
                                                                    False, scale=0.3)
        for got, want in zip(res, meta):
            if isinstance(want, torch.Tensor):
                assert got.shape == want.shape and got.dtype == want.dtype
                assert got.stride() == want.stride() or got.numel() <= 1
            else:
                assert got == want
        ref, leaves = _math(q, k, v, causal, scale=0.3)
        assert (res[0].double() - ref).abs().max() < tol
        lse_ref = torch.logsumexp(_scores(q, k, causal, 0.3), -1)
        assert (res[1].double() - lse_ref).abs().max() < (1e-5 if backend == "torch" else 1e-3)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, res[0], res[1], torch.empty(0), torch.empty(0), q.shape[2], k.shape[2], 0.0, causal,
            res[6], res[7], scale=0.3)
        want = torch.autograd.grad(ref, leaves, dout.double())
        for got, exp, inp in zip(grads, want, (q, k, v)):
            assert got.shape == inp.shape and got.stride() == torch.empty_like(inp, device="meta").stride()
            assert (got.double() - exp).abs().max() < 4 * tol
        if backend == "triton":  # planned: the second round is one replay per op
            assert plan_replays["n"] == 2 * seed


def test_v_head_dim_of_its_own(on_cpu, backend):
    """v's head dim other than q's (PyTorch's flash ops do not take it, and their meta
    kernels give out q's head dim): out is still (B, H, L, Ev), dense in query's order, with
    math's values (not written over rows of another shape)."""
    g = torch.Generator().manual_seed(3)
    dtype, tol = (torch.float32, 1e-5) if backend == "torch" else (torch.float16, 4e-3)
    q, k = (torch.randn(1, 2, 8, 16, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(1, 2, 8, 32, generator=g).to(dtype)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
    assert out.shape == (1, 2, 8, 32) and out.is_contiguous()
    ref, _ = _math(q, k, v, True)
    assert (out.double() - ref).abs().max() < tol
    packed = torch.ops.aten._flash_attention_forward(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                                                     v.transpose(1, 2).contiguous(), None, None, 8, 8, 0.0, True,
                                                     False)[0]
    assert packed.shape == (1, 8, 2, 32) and packed.is_contiguous()
    assert (packed.transpose(1, 2).double() - ref).abs().max() < tol


def _scores(q, k, causal, scale):
    group = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * scale
    if causal:
        i = torch.arange(q.shape[2])[:, None]
        s = s.masked_fill(torch.arange(k.shape[2])[None, :] > i, float("-inf"))
    return s


@pytest.mark.parametrize("backend, window", [("torch", (None, None)), ("torch", (5, 0)), ("triton", (5, 0))])
def test_flash_op_dense_and_packed_contract(on_cpu, request, monkeypatch, plan_replays, backend, window):
    """``_flash_attention_forward``/``_backward``, dense and packed, and the in-place forward:
    flashtile's own API's results, the LSE layouts; on the kernels a repeated call replays
    its plan with the same results."""
    _family(request, monkeypatch, backend)
    g = torch.Generator().manual_seed(1)
    dtype, tol = (torch.float32, 1e-5) if backend == "torch" else (torch.float16, 2e-3)
    left, right = window
    causal = right == 0
    q = torch.randn(2, 30, 4, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, 30, 2, 16, generator=g).to(dtype) for _ in range(2))
    fwd = torch.ops.aten._flash_attention_forward
    out, lse, rng, offset, debug = fwd(q, k, v, None, None, 30, 30, 0.0, causal, False, window_size_left=left,
                                       window_size_right=right)
    ws = (-1 if left is None else left, -1 if right is None else right)
    want, want_lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=ws, return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert rng.dtype == torch.uint64 and rng.shape == (2,) and debug.numel() == 0
    # packed: the same two sequences, (total, H, D), LSE (H, total)
    cu = torch.tensor([0, 30, 60], dtype=torch.int32)
    pq, pk, pv = (t.reshape(60, *t.shape[2:]) for t in (q, k, v))

    def packed():
        # max_seqlen 45 (an upper bound, as flash-attn takes it): the offsets may change below
        return fwd(pq, pk, pv, cu, cu, 45, 45, 0.0, causal, False, window_size_left=left, window_size_right=right)

    pout, plse, *_ = packed()
    assert pout.shape == (60, 4, 16) and plse.shape == (4, 60)
    assert (pout.reshape(2, 30, 4, 16) - out).abs().max() < tol
    assert (plse.reshape(4, 2, 30).transpose(0, 1) - lse).abs().max() < 1e-5
    inplace = torch.empty_like(pout)
    ilse = torch.ops.aten._flash_attention_forward_no_dropout_inplace(
        inplace, pq, pk, pv, cu, cu, 30, 30, 0.0, causal, False, window_size_left=left, window_size_right=right)
    assert torch.equal(inplace, pout) and torch.equal(ilse, plse)
    # the backward of each against flashtile's own API's autograd
    dout = torch.randn(out.shape, generator=g).to(dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want_grads = torch.autograd.grad(flashtile.flash_attn_func(*leaves, causal=causal, window_size=ws), leaves, dout)
    empty = torch.empty(0, dtype=torch.int32)
    bwd = torch.ops.aten._flash_attention_backward
    grads = bwd(dout, q, k, v, out, lse, empty, empty, 30, 30, 0.0, causal, rng, offset, window_size_left=left,
                window_size_right=right)

    def packed_grads():
        return bwd(dout.reshape(60, 4, 16), pq, pk, pv, pout, plse, cu, cu, 45, 45, 0.0, causal, rng, offset,
                   window_size_left=left, window_size_right=right)

    pgrads = packed_grads()
    for got, pgot, exp, inp in zip(grads, pgrads, want_grads, (q, k, v)):
        assert got.stride() == inp.stride()
        assert (got - exp).abs().max() < 4 * tol
        assert (pgot.reshape(exp.shape) - exp).abs().max() < 4 * tol
    if backend == "triton":  # planned: each repeated call is one replay, bit for bit
        plan_replays["n"] = 0
        assert all(torch.equal(a, b) for a, b in zip(packed()[:2], (pout, plse)))
        assert all(torch.equal(a, b) for a, b in zip(packed_grads(), pgrads))
        # the in-place op's kernels write into the caller's out, no copy after them (a new out:
        # the plan patches its address)
        again = torch.full_like(pout, float("nan"))
        copies = []
        with monkeypatch.context() as m:
            original = torch.Tensor.copy_
            m.setattr(torch.Tensor, "copy_", lambda t, *a, **k: copies.append(t) or original(t, *a, **k))
            torch.ops.aten._flash_attention_forward_no_dropout_inplace(
                again, pq, pk, pv, cu, cu, 30, 30, 0.0, causal, False, window_size_left=left,
                window_size_right=right)
        assert torch.equal(again, pout) and not copies
        assert plan_replays["n"] == 3
    # offsets of the same shape with other values (a new tensor, checked again): a replay on the
    # kernels, with flash_attn_varlen_func's results
    cu[1] = 15  # two sequences of 15 and 45 tokens
    got = packed()[0]
    want = flashtile.flash_attn_varlen_func(pq, pk, pv, cu, cu, 45, 45, causal=causal, window_size=ws)
    assert (got - want).abs().max() < tol and (got - pout).abs().max() > 0.1
    assert plan_replays["n"] == (4 if backend == "triton" else 0)


@pytest.mark.parametrize("kept_by", ["get_kernel", "binding"])
def test_what_flashtile_does_not_take_runs_pytorchs_kernel(kept_by, monkeypatch):
    """Installed on the Meta key (whose original kernels exist everywhere): a call with dropout
    goes to PyTorch's own kernel, counted; the report names it. "binding": a torch with the
    dispatcher binding but not torch.library.get_kernel (which 2.11 and 2.13 both have)."""
    if not hasattr(torch.library, "get_kernel"):
        pytest.skip("this torch cannot keep the original kernels (torch.library.get_kernel)")
    if kept_by == "binding":
        monkeypatch.delattr(torch.library, "get_kernel")
        assert torch_sdpa._kernel_getter() is not None
    handle = torch_sdpa.install("Meta")
    torch_sdpa.FALLBACKS.clear()
    try:
        q = torch.empty(2, 4, 64, 16, device="meta", dtype=torch.bfloat16)
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.1, False, False)
        assert out[0].shape == q.shape and out[0].device.type == "meta"
        assert torch_sdpa.FALLBACKS[("_scaled_dot_product_flash_attention", "dropout")] == 1
        assert "1 call(s) ran PyTorch's own kernel (dropout)" in torch_sdpa.report()
    finally:
        handle.remove()
        torch_sdpa.FALLBACKS.clear()


def test_without_the_original_kernel_such_a_call_raises_naming_the_feature(monkeypatch):
    monkeypatch.delattr(torch.library, "get_kernel", raising=False)
    monkeypatch.delattr(torch._C, "_dispatch_get_computed_kernel_for_dispatch_key", raising=False)
    assert torch_sdpa._kernel_getter() is None
    handle = torch_sdpa.install("Meta")
    try:
        q = torch.empty(2, 4, 64, 16, device="meta", dtype=torch.bfloat16)
        with pytest.raises(NotImplementedError, match="with dropout"):
            torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.1, False, False)
    finally:
        handle.remove()
        torch_sdpa.FALLBACKS.clear()


def test_explain_reports_the_provider(capsys):
    from flashtile.cli import main

    assert main(["explain", "--sdpa-provider"]) == 0
    assert "flashtile SDPA provider: registered, not active" in capsys.readouterr().out
