"""flash_attn_varlen_func on the GPU (``pytest -m gpu``): QUALITY.md's rule over the varlen
matrix at fp16/bf16 with NaN-poisoned outputs, documents bitwise equal to their own
fixed-length call, determinism, torch.compile and CUDA-graph capture of a training step."""

from __future__ import annotations

import pytest
import torch

import flashtile
from varlen_cases import VarlenCase, check_varlen, cu_seqlens, make_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

DTYPES = [torch.float16, torch.bfloat16]
MIXED = (0, 1, 2, 17, 113, 1000)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [32, 59, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_mixed_lengths(dtype, head_dim, causal):
    check_varlen(VarlenCase(MIXED + (1500, 3), head_dim=head_dim, dtype=dtype, nheads=6, nheads_k=2,
                            causal=causal), device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_q_and_k_lengths_differ(dtype, causal):
    check_varlen(VarlenCase((700, 0, 5, 1300, 64), (300, 9, 0, 1600, 64), head_dim=128, dtype=dtype,
                            causal=causal), device="cuda")


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_gqa(heads):
    check_varlen(VarlenCase((513, 77, 1024), head_dim=64, dtype=torch.bfloat16, nheads=heads[0], nheads_k=heads[1],
                            causal=True), device="cuda")


@pytest.mark.parametrize("window", [(0, 0), (64, 64), (255, 0), (-1, 37)])
def test_windows(window):
    check_varlen(VarlenCase((900, 1, 300), (1000, 40, 300), head_dim=128, dtype=torch.bfloat16, window=window),
                 device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_softcap_alibi(dtype):
    check_varlen(VarlenCase((777, 0, 129), (1029, 3, 129), head_dim=64, dtype=dtype, causal=True, softcap=30.0,
                            alibi=True), device="cuda")


def test_seqused():
    check_varlen(VarlenCase((600, 300, 1), head_dim=128, dtype=torch.bfloat16, causal=True,
                            seqused_q=(400, 0, 1), seqused_k=(599, 300, 0)), device="cuda")


@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_paged(page_size):
    check_varlen(VarlenCase((100, 0, 70), (300, 40, 512), head_dim=128, dtype=torch.bfloat16, causal=True,
                            page_size=page_size), device="cuda")


@pytest.mark.parametrize("ws", ["1", "0"], ids=["gluon", "triton"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_documents_bitwise_equal_their_fixed_length_call(monkeypatch, ws, head_dim):
    # Same kernels (the Gluon ones on Hopper, or with FLASHTILE_WS=0 the Triton ones), same
    # order within a tile: each document gives its own fixed-length call's bits. (Tiles
    # that reach into the next document are masked to exactly 0 for finite data.)
    monkeypatch.setenv("FLASHTILE_WS", ws)
    # (A 1-query document would not do: its causal call sees every key, so flash_attn_func
    # normalises it to a non-causal one, another kernel at d64.)
    case = VarlenCase((1000, 17, 333, 3), (1200, 17, 300, 64), head_dim=head_dim, dtype=torch.bfloat16, causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cq, ck = cu_seqlens(case.lens_q, "cuda"), cu_seqlens(case.keys, "cuda")
    # deterministic on both sides: the split kernels (causal packed d64 calls default to the
    # one-pass kernel, whose dQ atomics have no fixed order)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cq, ck, 1000, 1200, causal=True, return_attn_probs=True,
                                                   deterministic=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    cq, ck = cq.tolist(), ck.tolist()
    for b in range(len(case.lens_q)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        qb, kb, vb = (t.detach()[None, s].requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk)))
        o, l, _ = flashtile.flash_attn_func(qb, kb, vb, causal=True, return_attn_probs=True, deterministic=True)
        assert torch.equal(o[0], out[sq]) and torch.equal(l[0], lse[:, sq]), b
        g = torch.autograd.grad(o, (qb, kb, vb), dout[None, sq])
        for name, a, full, s in zip("qkv", g, grads, (sq, sk, sk)):
            assert torch.equal(a[0], full[s]), f"d{name} of document {b}"


def test_deterministic_reruns():
    case = VarlenCase((2000, 5, 700), head_dim=64, dtype=torch.bfloat16, causal=True, nheads=8, nheads_k=2)
    q, k, v, _ = make_inputs(case, "cuda")
    cu = cu_seqlens(case.lens_q, "cuda")
    results = []
    for _ in range(3):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flashtile.flash_attn_varlen_func(*leaves, cu, cu, 2000, 2000, causal=True, deterministic=True)
        results.append((out,) + torch.autograd.grad(out, leaves, torch.ones_like(out)))
    for again in results[1:]:
        for a, b in zip(results[0], again):
            assert torch.equal(a, b)


def test_cuda_graph_capture_of_a_training_step():
    # No host synchronisation in a varlen call: the whole forward + backward is captured.
    lens = (1000, 0, 300, 77)
    case = VarlenCase(lens, head_dim=128, dtype=torch.bfloat16, causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = cu_seqlens(lens, "cuda")
    dout = torch.randn_like(q)

    def step():
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 1000, 1000, causal=True)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up on a side stream (compiles, checks), as torch's graph recipe asks
            eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(eager, static):
            assert torch.equal(a, b)
    # new values in the same buffers: the replay follows them (cu_seqlens read on the device)
    cu.copy_(cu_seqlens((500, 500, 300, 77), "cuda"))
    graph.replay()
    ref = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 1000, 1000, causal=True)
    assert torch.equal(static[0], ref)


def test_torch_compile_fullgraph():
    case = VarlenCase((300, 129, 2), head_dim=64, dtype=torch.bfloat16, causal=True)
    q, k, v, _ = make_inputs(case, "cuda")
    cu = cu_seqlens(case.lens_q, "cuda")

    def f(q, k, v, cu):
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=True) * 2

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(q, k, v, cu), f(q, k, v, cu))


def test_dropout_s_dmask_on_gpu():
    lens, p = (300, 0, 129), 0.17
    q, k, v, _ = make_inputs(VarlenCase(lens, head_dim=64, dtype=torch.bfloat16), "cuda")
    cu = cu_seqlens(lens, "cuda")
    torch.manual_seed(3)
    out, lse, s_dmask = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, dropout_p=p, causal=True,
                                                         return_attn_probs=True)
    visible = torch.ones(300, 300, dtype=torch.bool, device="cuda").tril()
    keep = (s_dmask[0] >= 0) & visible
    rate = keep.sum().item() / (visible.sum().item() * 4)
    assert abs(rate - (1 - p)) < 0.01, rate
    qd, kd, vd = (t[:300].transpose(0, 1).double() for t in (q, k, v))
    kd, vd = kd.repeat_interleave(2, 0), vd.repeat_interleave(2, 0)
    s = (qd @ kd.transpose(1, 2) / 8).masked_fill(~visible, float("-inf"))
    ref = torch.where(s_dmask[0] >= 0, torch.softmax(s, -1), 0.0) / (1 - p) @ vd
    torch.testing.assert_close(out[:300].transpose(0, 1).double(), ref, atol=2e-2, rtol=2e-2)


def test_seqused_ignores_garbage_past_the_used_rows():
    # Rows past seqused hold NaN (an unused cache tail): they must not reach the output.
    case = VarlenCase((300, 200), head_dim=128, dtype=torch.bfloat16, causal=True, seqused_k=(250, 130))
    q, k, v, _ = make_inputs(case, "cuda")
    k[250:300] = float("nan")
    v[250:300] = float("nan")
    k[300 + 130:] = float("nan")
    v[300 + 130:] = float("nan")
    cu = cu_seqlens(case.lens_q, "cuda")
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=True,
                                           seqused_k=torch.tensor([250, 130], dtype=torch.int32, device="cuda"))
    assert torch.isfinite(out).all()
