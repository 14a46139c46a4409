"""Learnable sinks on the GPU (``pytest -m gpu``): QUALITY.md's rule at fp16/bf16 with
NaN-poisoned outputs in every entry point, the gradients of q, k, v and the sink; on
Hopper the default kernels (the Gluon forward and backward where they take the call) and
the Triton backward; determinism reruns."""

from __future__ import annotations

import pytest
import torch

import flashtile
from cases import Case, check_flash_case, check_flash_grads, make_inputs, make_sink
from test_kvcache import _case, _run_and_check
from varlen_cases import VarlenCase, check_varlen

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("sink", ["small", "large"])
@pytest.mark.parametrize("seqs,causal", [((1023, 1024), True), ((700, 1500), False), ((1500, 700), True)])
def test_forward_and_gradients(dtype, head_dim, sink, seqs, causal):
    case = Case(*seqs, head_dim, dtype=dtype, causal=causal, nheads=6, nheads_k=2, sink=sink)
    check_flash_case(case, device="cuda")
    check_flash_grads(case, device="cuda")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_backward(head_dim, monkeypatch):
    monkeypatch.setenv("FLASHTILE_WS", "0")
    check_flash_grads(Case(1023, 1024, head_dim, dtype=torch.bfloat16, causal=True, nheads=6, nheads_k=2,
                           sink="large"), device="cuda")


@pytest.mark.parametrize("kind", ["window", "softcap", "alibi"])
def test_with_features(kind):
    extra = {"window": dict(window=(200, 17)), "softcap": dict(softcap=30.0, dist="q5", causal=True),
             "alibi": dict(alibi="batch", causal=True)}[kind]
    check_flash_grads(Case(777, 1029, 128, dtype=torch.bfloat16, nheads=6, nheads_k=2, sink="large", **extra),
                      device="cuda")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen(causal):
    check_varlen(VarlenCase((0, 1, 2, 17, 113, 1000, 1500, 3), (5, 0, 2, 17, 113, 1000, 1500, 3), head_dim=128,
                            dtype=torch.bfloat16, nheads=6, nheads_k=2, causal=causal, sink=True), device="cuda")


@pytest.mark.parametrize("page", [0, 16, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_kvcache(page, num_splits):
    q, k, v, kc, vc, table, seqlens = _case(batch=4, sq=4, new=4, heads=(32, 8), d=128, capacity=600,
                                             seqlens=(0, 1, 333, 590), dtype=torch.bfloat16, page=page)
    q, k, v, kc, vc, seqlens = (t.cuda() for t in (q, k, v, kc, vc, seqlens))
    table = None if table is None else table.cuda()
    sink = (torch.randn(32, generator=torch.Generator().manual_seed(3)) * 2 + 5).cuda()
    _run_and_check(q, k, v, kc, vc, seqlens, table=table, causal=True, num_splits=num_splits, sink=sink)


def test_deterministic_reruns_are_bitwise_equal():
    case = Case(1500, 1500, 128, dtype=torch.bfloat16, causal=True, nheads=8, nheads_k=2, sink="large")
    q, k, v, _ = make_inputs(case, "cuda")
    sink = make_sink(case, "cuda")
    dout = torch.randn_like(q)

    def grads():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sink)]
        out = flashtile.flash_attn_func(*leaves[:3], causal=True, learnable_sink=leaves[3], deterministic=True)
        return (out, *torch.autograd.grad(out, leaves, dout))

    first = grads()
    for _ in range(3):
        for a, b in zip(first, grads()):
            assert torch.equal(a, b)
