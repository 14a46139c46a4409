"""flash_attn_varlen_func on CPU: the torch twin and the Triton kernels under
TRITON_INTERPRET=1, against the float64 reference applied per sequence (QUALITY.md's rule,
NaN-poisoned outputs), plus the API's checks, packed variants and helpers."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

import flashtile
from varlen_cases import VarlenCase, check_varlen, cu_seqlens, make_inputs, run_varlen

MIXED = (0, 1, 2, 17, 113, 400)  # the GPU tests add 1000 and 1500


pytestmark = pytest.mark.usefixtures("poison_outputs")


@pytest.fixture
def coarse_interpreter_tiles(monkeypatch):
    """32 x 32 tiles under the interpreter instead of 16 x 16: a quarter of the programs for
    the 400-token document (13 query tiles, the last partial); 17 and 113 still end in
    partial tiles, 1 and 2 in one. Launch plans recorded with these tiles are dropped afterwards."""
    from dataclasses import replace

    from flashtile.backends import configs
    from flashtile.runtime import replay as plan

    plan.clear()
    monkeypatch.setattr(configs, "INTERPRETER_FWD", replace(configs.INTERPRETER_FWD, block_m=32, block_n=32))
    monkeypatch.setattr(configs, "INTERPRETER_BWD", replace(configs.INTERPRETER_BWD, block_m_kv=32, block_n_kv=32,
                                                             block_m_q=32, block_n_q=32))
    yield
    plan.clear()


@pytest.mark.parametrize("causal", [False, True])
def test_mixed_lengths(backend, causal, coarse_interpreter_tiles):
    # One batch holding empty, 1-, 2-token and long documents; fewer heads keep it quick.
    check_varlen(VarlenCase(MIXED, head_dim=16, nheads=2, nheads_k=1, causal=causal), grads=causal)


@pytest.mark.parametrize("lens", [((5, 0, 17, 1, 40), (9, 0, 3, 2, 33)), ((30, 4, 7), (2, 19, 7))],
                         ids=["a", "b"])
@pytest.mark.parametrize("causal", [False, True])
def test_q_and_k_lengths_differ(backend, lens, causal):
    # causal both ways: len_q > len_k (rows that see nothing) and len_q < len_k
    check_varlen(VarlenCase(lens[0], lens[1], causal=causal))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_gqa(backend, heads):
    check_varlen(VarlenCase((23, 9, 31), nheads=heads[0], nheads_k=heads[1], causal=True))


@pytest.mark.parametrize("window", [(0, 0), (3, 5), (-1, 2), (7, -1), (40, 40)])
def test_windows(backend, window):
    check_varlen(VarlenCase((21, 1, 35), (28, 3, 30), window=window))


def test_softcap_alibi(backend):
    check_varlen(VarlenCase((19, 0, 33), (25, 4, 33), causal=True, softcap=5.0, alibi=True))


@pytest.mark.parametrize("causal", [False, True])
def test_sinks(backend, causal):
    """Mixed lengths with an empty sequence and one with queries but no keys (its rows see
    only the sink: out 0, lse the sink), GQA; gradients of the sink included."""
    check_varlen(VarlenCase((19, 0, 33, 4), (25, 4, 33, 0), causal=causal, sink=True))


def test_sinks_with_seqused_and_pages(backend):
    check_varlen(VarlenCase((9, 14, 5), (12, 30, 7), page_size=16, seqused_q=(9, 10, 0), seqused_k=(12, 17, 3),
                            causal=True, sink=True))


def test_batch_of_one_and_loose_max_seqlen(backend):
    check_varlen(VarlenCase((37,), (51,), causal=True, max_pad=20))


def test_fp16_kernels(backend):
    if backend == "torch":
        pytest.skip("the twin computes in float32 whatever the dtype; covered by the fp32 cases")
    check_varlen(VarlenCase((21, 0, 40), (30, 2, 40), dtype=torch.float16, head_dim=32, causal=True))


@pytest.mark.parametrize("side", ["q", "k", "both"])
def test_seqused(backend, side):
    lens = (20, 7, 33, 0)
    used_q = (13, 7, 1, 0) if side in ("q", "both") else None
    used_k = (5, 0, 30, 0) if side in ("k", "both") else None
    out, lse, dq, dk, dv = check_varlen(VarlenCase(lens, causal=True, seqused_q=used_q, seqused_k=used_k))
    cu = cu_seqlens(lens, "cpu").tolist()
    for b, n in enumerate(lens):
        uq = n if used_q is None else used_q[b]
        uk = n if used_k is None else used_k[b]
        assert torch.equal(out[cu[b] + uq:cu[b + 1]], torch.zeros_like(out[cu[b] + uq:cu[b + 1]]))
        assert torch.isneginf(lse[:, cu[b] + uq:cu[b + 1]]).all()
        assert not dq[cu[b] + uq:cu[b + 1]].any() and not dk[cu[b] + uk:cu[b + 1]].any()
        assert not dv[cu[b] + uk:cu[b + 1]].any()


@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_paged_kv(backend, page_size):
    check_varlen(VarlenCase((9, 0, 40), (12, 3, 300) if page_size == 256 else (12, 3, 45), causal=True,
                            page_size=page_size))


def test_paged_with_seqused_k(backend):
    check_varlen(VarlenCase((9, 14), (12, 30), page_size=16, seqused_k=(12, 17), causal=True))


def test_empty_and_all_empty_batches(backend):
    q, k, v, _ = make_inputs(VarlenCase((0, 0)), "cpu")
    cu = torch.zeros(3, dtype=torch.int32)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 0, 0, return_attn_probs=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
    # queries but no keys in any sequence: rows are 0 / -inf, not NaN
    q = torch.randn(5, 4, 16, requires_grad=True)
    k = torch.randn(0, 2, 16, requires_grad=True)
    v = torch.randn(0, 2, 16, requires_grad=True)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, torch.tensor([0, 2, 5], dtype=torch.int32),
                                                   torch.zeros(3, dtype=torch.int32), 3, 0, causal=True,
                                                   return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_packed_variants(backend):
    lens = (11, 0, 26)
    cu = cu_seqlens(lens, "cpu")
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(sum(lens), 3, 4, 16, generator=g, requires_grad=True)
    out = flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, 26, causal=True)
    ref = flashtile.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 26, 26, causal=True)
    assert torch.equal(out, ref)
    (grad,) = torch.autograd.grad(out.sum(), qkv)
    (grad_ref,) = torch.autograd.grad(ref.sum(), qkv)
    assert torch.equal(grad, grad_ref) and grad.abs().sum() > 0
    q = qkv[:, 0].detach()
    kv = torch.randn(sum(lens), 2, 2, 16, generator=g)
    out = flashtile.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 26, 26, window_size=(4, 1))
    ref = flashtile.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu, 26, 26, window_size=(4, 1))
    assert torch.equal(out, ref)


def test_backward_graph_has_no_copying_nodes(triton_backend):
    # Between the leaves and the output there are only views and the attention node: a
    # select (``out[0]``) there made every backward zero-fill and copy a gradient the size
    # of q (H200 run 80: 55 us of a 1.6 ms backward).
    lens = (7, 12)
    cu = cu_seqlens(lens, "cpu")
    q, k, v = (torch.randn(sum(lens), 2, 16, requires_grad=True) for _ in range(3))
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True, return_attn_probs=True)
    names, todo = set(), [out.grad_fn, lse.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and type(fn).__name__ != "AccumulateGrad":
            names.add(type(fn).__name__)
            todo.extend(f for f, _ in fn.next_functions)
    assert names and not [n for n in names if "Select" in n or "Copy" in n or "Clone" in n], names


def test_documents_match_fixed_length_calls(backend):
    # Each document of a packed batch gives what flash_attn_func gives on it alone.
    case = VarlenCase((17, 40, 1), (23, 40, 9), causal=True)
    q, k, v, _ = make_inputs(case, "cpu")
    out, lse = run_varlen(case, q, k, v, None)
    cq, ck = cu_seqlens(case.lens_q, "cpu").tolist(), cu_seqlens(case.keys, "cpu").tolist()
    for b in range(3):
        o, l, _ = flashtile.flash_attn_func(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]],
                                            v[None, ck[b]:ck[b + 1]], causal=True, return_attn_probs=True)
        torch.testing.assert_close(out[cq[b]:cq[b + 1]], o[0], rtol=0, atol=2e-6)
        torch.testing.assert_close(lse[:, cq[b]:cq[b + 1]], l[0], rtol=0, atol=2e-6)


def test_varlen_triton_bitwise_equals_fixed_for_equal_lengths(monkeypatch):
    # Same kernel, same order of work within a tile: equal-length documents packed give
    # the fixed-length batched call bitwise (forward, LSE and gradients).
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    g = torch.Generator().manual_seed(5)
    B, S, H, D = 3, 37, 4, 16
    q, k, v = (torch.randn(B, S, H, D, generator=g).requires_grad_() for _ in range(3))
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    cu = cu_seqlens((S,) * B, "cpu")
    qp, kp, vp = (t.detach().reshape(B * S, H, D).requires_grad_() for t in (q, k, v))
    outp, lsep, _ = flashtile.flash_attn_varlen_func(qp, kp, vp, cu, cu, S, S, causal=True, return_attn_probs=True)
    assert torch.equal(outp.reshape(B, S, H, D), out)
    assert torch.equal(lsep.reshape(H, B, S).transpose(0, 1), lse)
    dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    gradsp = torch.autograd.grad(outp, (qp, kp, vp), dout.reshape(B * S, H, D))
    for a, b in zip(grads, gradsp):
        assert torch.equal(a.reshape(B * S, H, D), b)


def test_dropout_statistics_and_s_dmask(monkeypatch):
    # The kernels' Philox mask: S_dmask reproduces the probabilities and the keep mask, the
    # keep rate is 1 - p, and out equals the dense computation with that mask.
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    lens_q, lens_k, p = (24, 0, 40), (30, 5, 40), 0.3
    q, k, v, _ = make_inputs(VarlenCase(lens_q, lens_k), "cpu")
    cq, ck = cu_seqlens(lens_q, "cpu"), cu_seqlens(lens_k, "cpu")
    torch.manual_seed(11)
    out, lse, s_dmask = flashtile.flash_attn_varlen_func(q, k, v, cq, ck, 40, 40, dropout_p=p, causal=True,
                                                         return_attn_probs=True)
    assert s_dmask.shape == (3, 4, 40, 40)
    kept = total = 0
    for b in range(3):
        lq, lk = lens_q[b], lens_k[b]
        qb = q[cq[b]:cq[b + 1]].transpose(0, 1).double()
        kb = k[ck[b]:ck[b + 1]].transpose(0, 1).double().repeat_interleave(2, 0)
        vb = v[ck[b]:ck[b + 1]].transpose(0, 1).double().repeat_interleave(2, 0)
        s = qb @ kb.transpose(1, 2) / math.sqrt(16)
        visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + lk - lq
        s = s.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(s, -1).nan_to_num(0.0)
        sd = s_dmask[b, :, :lq, :lk].double()
        rowmax = s.amax(-1, keepdim=True)
        got = sd.abs() * torch.exp(rowmax - lse[:, cq[b]:cq[b + 1], None].double())
        torch.testing.assert_close(got.nan_to_num(0.0), probs, atol=1e-5, rtol=1e-5)
        keep = sd >= 0
        assert not s_dmask[b, :, lq:].any() and not s_dmask[b, :, :, lk:].any()
        ref = (torch.where(keep, probs, 0.0) / (1 - p)) @ vb
        torch.testing.assert_close(out[cq[b]:cq[b + 1]].transpose(0, 1).double(), ref, atol=1e-5, rtol=1e-5)
        kept += int((keep & visible).sum())
        total += int(visible.sum()) * 4
    rate = kept / total
    # binomial: ~5 standard deviations of the keep rate over these entries
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / total), rate
    # the same seed reproduces the mask and the output; gradients run with it
    torch.manual_seed(11)
    again = flashtile.flash_attn_varlen_func(q, k, v, cq, ck, 40, 40, dropout_p=p, causal=True,
                                             return_attn_probs=True)
    assert torch.equal(again[0], out) and torch.equal(again[2], s_dmask)


def test_fixed_length_s_dmask(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 19, 2, 16, generator=g) for _ in range(3))
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, dropout_p=0.2, return_attn_probs=True)
    assert s_dmask.shape == (2, 2, 19, 19)
    s = q.transpose(1, 2).double() @ k.transpose(1, 2).double().transpose(-1, -2) / 4
    ref = torch.where(s_dmask >= 0, torch.softmax(s, -1), 0.0) / 0.8 @ v.transpose(1, 2).double()
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=1e-5, rtol=1e-5)
    assert flashtile.flash_attn_func(q, k, v, return_attn_probs=True)[2] is None


def test_the_twin_reports_its_dropout_mask(monkeypatch):
    """The twin draws the kernels' Philox mask (backends/twin/philox.py): S_dmask on CPU
    tensors is the mask the twin's output used, and for one seed the twin and the Triton
    kernels (under the interpreter) drop the same weights (flash-attn's drop-in gap:
    return_attn_probs with dropout on CPU tensors)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 19, 2, 16, generator=g) for _ in range(3))
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    torch.manual_seed(5)
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
    s = q.transpose(1, 2).double() @ k.transpose(1, 2).double().transpose(-1, -2) / 4
    s = s.masked_fill(torch.ones(19, 19, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(s, -1)
    ref = torch.where(s_dmask >= 0, probs, 0.0) / 0.7 @ v.transpose(1, 2).double()
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=1e-5, rtol=1e-5)
    rowmax = s.amax(-1, keepdim=True)
    got = s_dmask.double().abs() * torch.exp(rowmax - lse[..., None].double())
    torch.testing.assert_close(got, probs, atol=1e-5, rtol=1e-5)
    if os.environ.get("TRITON_INTERPRET") == "1":
        monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
        torch.manual_seed(5)
        kernels = flashtile.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
        assert torch.equal(kernels[2] >= 0, s_dmask >= 0)
        torch.testing.assert_close(kernels[0], out, atol=1e-5, rtol=1e-5)


def test_philox_twin_draws_the_kernels_bits():
    """backends/twin/philox.py against the Triton keep-mask kernel (interpreter), seeds with
    the high word set and probabilities at the edges."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    from flashtile.backends.triton.scores import dropout_keep_mask
    from flashtile.backends.twin.philox import keep_mask

    for seed, p in ((0, 0.5), (2**62 - 1, 0.1), (123456789012345, 0.9), (7, 1e-7)):
        want = dropout_keep_mask(torch.tensor([seed]), 3, 33, 70, p)
        got = keep_mask(seed, torch.arange(3)[:, None, None], torch.arange(33)[:, None], torch.arange(70), p)
        assert torch.equal(got, want), (seed, p)


def test_dropout_gradients_match_the_reported_mask(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    lens, p = (13, 29), 0.25
    q, k, v, _ = make_inputs(VarlenCase(lens, nheads=2, nheads_k=2), "cpu")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = cu_seqlens(lens, "cpu")
    out, _, s_dmask = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 29, 29, dropout_p=p, causal=True,
                                                       return_attn_probs=True)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs = []
    for b in range(2):
        sl = slice(int(cu[b]), int(cu[b + 1]))
        n = lens[b]
        s = qd[sl].transpose(0, 1) @ kd[sl].transpose(0, 1).transpose(1, 2) / 4
        s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(n)[:, None], float("-inf"))
        keep = s_dmask[b, :, :n, :n] >= 0
        outs.append((torch.where(keep, torch.softmax(s, -1), 0.0) / (1 - p) @ vd[sl].transpose(0, 1)).transpose(0, 1))
    want = torch.autograd.grad(torch.cat(outs), (qd, kd, vd), dout.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------- the API's checks
def _args(**over):
    q = torch.randn(10, 4, 16)
    k = torch.randn(12, 2, 16)
    base = dict(q=q, k=k, v=k.clone(), cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32), max_seqlen_q=6, max_seqlen_k=7)
    base.update(over)
    return base


@pytest.mark.parametrize("over, error, match", [
    (dict(cu_seqlens_q=torch.tensor([0, 4, 10])), TypeError, "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=torch.tensor([[0, 5, 12]], dtype=torch.int32)), ValueError, "cu_seqlens_k must have 1 dim"),
    (dict(cu_seqlens_q=torch.tensor([1, 4, 10], dtype=torch.int32)), ValueError, "cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 6, 4, 10], dtype=torch.int32),
          cu_seqlens_k=torch.tensor([0, 5, 6, 12], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 11], dtype=torch.int32)), ValueError, r"cu_seqlens_k\[-1\] \(11\)"),
    (dict(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)), ValueError, "same batch"),
    (dict(max_seqlen_q=5), ValueError, r"max_seqlen_q \(5\) is smaller than the longest sequence \(6\)"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0"),
    (dict(max_seqlen_k=7.0), TypeError, "max_seqlen_k must be an int"),
    (dict(seqused_k=torch.tensor([6, 7], dtype=torch.int32)), ValueError, r"seqused_k\[0\] = 6 must be in \[0, 5\]"),
    (dict(seqused_q=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError, r"seqused_q must have shape \(2,\)"),
    (dict(seqused_q=torch.tensor([1, 2])), TypeError, "seqused_q must be int32"),
    (dict(q=torch.randn(10, 4, 16).half()), TypeError, "q and k must have the same dtype"),
    (dict(k=torch.randn(12, 3, 16), v=torch.randn(12, 3, 16)), ValueError, "divisible"),
    (dict(window_size=(1, 2, 3)), TypeError, "window_size must be a pair"),
    (dict(window_size=torch.tensor([1.0, 2.0])), TypeError, "window_size must be a pair"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
])
def test_bad_inputs(over, error, match):
    with pytest.raises(error, match=match):
        flashtile.flash_attn_varlen_func(**_args(**over))


def _paged_args(table, num_blocks=4, page=4):
    k = torch.randn(num_blocks, page, 2, 16)
    return _args(k=k, v=k.clone(), block_table=table)


@pytest.mark.parametrize("table, error, match", [
    (torch.tensor([[0, 1], [2, 3]]), TypeError, "block_table must be int32"),
    (torch.tensor([0, 1, 2, 3], dtype=torch.int32), ValueError, "block_table must have 2 dim"),
    (torch.tensor([[0, 1]], dtype=torch.int32), ValueError, r"block_table must have shape \(2, max_blocks\)"),
    (torch.tensor([[0, 1], [2, 4]], dtype=torch.int32), ValueError, r"block_table\[1, 1\] = 4 must be in \[0, 4\)"),
    (torch.tensor([[0], [2]], dtype=torch.int32), ValueError, "more than block_table holds"),
])
def test_bad_block_tables(table, error, match):
    with pytest.raises(error, match=match):
        flashtile.flash_attn_varlen_func(**_paged_args(table))


def test_checks_run_again_after_an_in_place_edit():
    args = _args()
    flashtile.flash_attn_varlen_func(**args)
    args["cu_seqlens_q"][1] = 11  # now decreasing: the cached verdict must not hide it
    with pytest.raises(ValueError, match="non-decreasing"):
        flashtile.flash_attn_varlen_func(**args)


# --------------------------------------------------------------------------- scalar compatibility
def test_numpy_scalars_and_tensor_windows():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=g) for _ in range(3))
    ref = flashtile.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, window_size=(5, 0), softcap=4.0)
    got = flashtile.flash_attn_func(q, k, v, softmax_scale=np.float32(0.3), causal=np.bool_(True),
                                    window_size=(np.int64(5), np.int32(0)), softcap=np.float64(4.0),
                                    dropout_p=np.float32(0.0))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    for window in ([5, 0], torch.tensor([5, 0]), np.array([5, 0])):
        assert torch.equal(flashtile.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, window_size=window,
                                                     softcap=4.0), ref)
    window = torch.randint(0, 20, (2,), generator=g)  # as flash-attn's own tests pass it
    a = flashtile.flash_attn_func(q, k, v, window_size=window)
    b = flashtile.flash_attn_func(q, k, v, window_size=tuple(window.tolist()))
    assert torch.equal(a, b)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    c = flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, np.int64(20), 20, window_size=window)
    assert torch.equal(c, b[0])
    sdpa = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=np.bool_(True), scale=np.float32(0.25))
    torch.testing.assert_close(sdpa, torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=0.25), rtol=1e-5, atol=1e-5)


def test_bool_is_not_an_int():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(TypeError, match="window_size left must be an int"):
        flashtile.flash_attn_func(q, q, q, window_size=(True, 0))
    with pytest.raises(TypeError, match="softmax_scale must be a float"):
        flashtile.flash_attn_func(q, q, q, softmax_scale=np.bool_(True))


# --------------------------------------------------------------------------- padding helpers
def test_unpad_pad_roundtrip_and_varlen_equals_masked_sdpa():
    g = torch.Generator().manual_seed(9)
    B, S, H, D = 3, 12, 2, 16
    lengths = torch.tensor([12, 5, 0])
    mask = torch.arange(S)[None, :] < lengths[:, None]
    x = torch.randn(B, S, 3, H, D, generator=g)
    tokens, indices, cu, max_len = flashtile.unpad_input(x, mask)
    assert tokens.shape == (17, 3, H, D) and cu.tolist() == [0, 12, 17, 17] and max_len == 12
    assert cu.dtype == torch.int32 and indices.dtype == torch.int64
    back = flashtile.pad_input(tokens, indices, B, S)
    assert torch.equal(back, x * mask[:, :, None, None, None])
    out = flashtile.flash_attn_varlen_qkvpacked_func(tokens, cu, max_len, causal=True)
    padded = flashtile.pad_input(out, indices, B, S)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    keep = mask[:, None, None, :] & torch.ones(S, S, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2)
    torch.testing.assert_close(padded[mask], ref[mask], rtol=1e-5, atol=1e-5)
    assert not padded[~mask].any()


def test_inference_mode_metadata(backend):
    # Inference tensors have no version counter: the value checks run on every call.
    q, k, v, _ = make_inputs(VarlenCase((4, 6), nheads=2, nheads_k=2), "cpu")
    with torch.inference_mode():
        cu = torch.tensor([0, 4, 10], dtype=torch.int32)
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
        assert torch.isfinite(out).all()
        bad = torch.tensor([0, 4, 9], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]"):
            flashtile.flash_attn_varlen_func(q, k, v, bad, cu, 6, 6)


# --------------------------------------------------------------------------- issue 40's fuzz defects
def test_empty_page_pool(backend):
    """A paged call on a pool of no pages, when no sequence has a key: out 0, lse -inf and
    zero gradients (the page gather once raised IndexError on both paths)."""
    I = torch.int32
    pool = torch.randn(0, 4, 2, 8, requires_grad=True)
    q = torch.randn(3, 2, 8, requires_grad=True)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, pool, pool, torch.tensor([0, 3], dtype=I),
                                                   torch.tensor([0, 0], dtype=I), 3, 0,
                                                   block_table=torch.zeros(1, 1, dtype=I), return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    assert pool.grad is None or pool.grad.shape == pool.shape  # the twin never reads the pool


@pytest.mark.parametrize("value", ["no", 1, None])
def test_deterministic_must_be_a_bool(backend, value):
    """deterministic is validated as causal is (a string is not taken as True)."""
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flashtile.flash_attn_varlen_func(**_args(deterministic=value))
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flashtile.flash_attn_func(q, q, q, deterministic=value)


def test_paged_overflow_is_a_value_and_a_runtime_error():
    """Keys past what block_table holds: the error names block_table and is both a
    ValueError and a RuntimeError (flash-attn raises the latter)."""
    table = torch.tensor([[0], [2]], dtype=torch.int32)
    for error in (ValueError, RuntimeError):
        with pytest.raises(error, match="more than block_table holds"):
            flashtile.flash_attn_varlen_func(**_paged_args(table))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pad", [(5, 3), (0, 0), (4, 0), (0, 6)], ids=["q-and-k", "none", "q-only", "k-only"])
def test_padding_sequences(backend, causal, pad):
    """padding_sequences=True: rows of q past cu_seqlens_q[-1] and keys past
    cu_seqlens_k[-1] (transformers' continuous batching pads its batches so under CUDA
    graphs) attend to nothing and nothing attends to them: out 0, lse -inf, dq 0, dk and dv
    0 there; the real sequences' out, lse and gradients are those of the call without the
    padding. Without the flag: an error."""
    g = torch.Generator().manual_seed(5)
    lens_q, lens_k = [3, 9, 6], [5, 9, 8]
    tq, tk = sum(lens_q), sum(lens_k)
    pq, pk = pad
    q = torch.randn(tq + pq, 4, 16, generator=g)
    k, v = (torch.randn(tk + pk, 2, 16, generator=g) for _ in range(2))
    dout = torch.randn(tq + pq, 4, 16, generator=g)
    cu_q, cu_k = (torch.tensor([0, *np.cumsum(x)], dtype=torch.int32) for x in (lens_q, lens_k))

    def run(q, k, v, cu_q, cu_k, max_q, max_k, dout, **kw):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse, _ = flashtile.flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=causal,
                                                       return_attn_probs=True, **kw)
        grads = torch.autograd.grad(out, leaves, dout)
        return out, lse, grads

    out, lse, (dq, dk, dv) = run(q, k, v, cu_q, cu_k, np.int64(9), 9, dout, padding_sequences=True)
    want, want_lse, (wq, wk, wv) = run(q[:tq], k[:tk], v[:tk], cu_q, cu_k, 9, 9, dout[:tq])
    for got, ref in ((out[:tq], want), (lse[:, :tq], want_lse), (dq[:tq], wq), (dk[:tk], wk), (dv[:tk], wv)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for t in (out[tq:], dq[tq:], dk[tk:], dv[tk:]):
        assert torch.equal(t, torch.zeros_like(t))
    assert torch.isneginf(lse[:, tq:]).all()
    if pq or pk:
        match = r"cu_seqlens_q\[-1\] \(18\)" if pq else r"cu_seqlens_k\[-1\] \(22\)"
        with pytest.raises(ValueError, match=match + " must equal the number of tokens"):
            flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=causal)


def test_padding_sequences_must_be_a_bool():
    q = torch.randn(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="padding_sequences must be a bool"):
        flashtile.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, padding_sequences="yes")
    with pytest.raises(TypeError, match="padding_sequences must be a bool"):
        flashtile.flash_attn_with_kvcache(q[None], q[None], q[None], padding_sequences=1)


def test_padding_sequences_with_pages_seqused_and_alibi(backend):
    """The padding sequences next to paged keys, seqused and per-sequence ALiBi slopes; the
    padded metadata is kept for a repeated eager call (the values check is not redone);
    dropout's S_dmask is refused with it."""
    from flashtile.problem import validate

    g = torch.Generator().manual_seed(6)
    lens = [7, 12, 3]
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    q = torch.randn(sum(lens) + 5, 4, 16, generator=g)
    page = 8
    kc, vc = (torch.randn(9, page, 2, 16, generator=g) for _ in range(2))
    table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    used_q, used_k = torch.tensor([7, 10, 3], dtype=torch.int32), torch.tensor([6, 12, 2], dtype=torch.int32)
    slopes = torch.rand(3, 4, generator=g)
    kw = dict(causal=True, block_table=table, seqused_q=used_q, seqused_k=used_k, alibi_slopes=slopes)
    reads = []
    host_values = validate._host_values
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(validate, "_host_values", lambda ts: (reads.append(1), host_values(ts))[1])
        outs = [flashtile.flash_attn_varlen_func(q, kc, vc, cu, cu, 12, 12, padding_sequences=True, **kw)
                for _ in range(3)]
    assert len(reads) == 1
    want = flashtile.flash_attn_varlen_func(q[:22], kc, vc, cu, cu, 12, 12, **kw)
    for out in outs:
        torch.testing.assert_close(out[:22], want, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[22:], torch.zeros_like(out[22:]))
    with pytest.raises(ValueError, match="padding_sequences cannot be combined with return_attn_probs and dropout"):
        flashtile.flash_attn_varlen_func(q, kc, vc, cu, cu, 12, 12, dropout_p=0.1, return_attn_probs=True,
                                         padding_sequences=True, **kw)
