"""Chunked local attention on the GPU (``pytest -m gpu``): QUALITY.md's rule at fp16/bf16 with
NaN-poisoned outputs, forward and gradients, in every entry point that takes
``attention_chunk``; chunks smaller than, equal to and larger than the kernels' tiles (64
and 128 rows), so blocks span several chunks, one, or part of one. Always the Triton
kernels (the registry keeps chunks off the Gluon ones)."""

from __future__ import annotations

import pytest
import torch

from cases import Case, check_flash_case, check_flash_grads
from test_kvcache import _case, _run_and_check
from varlen_cases import VarlenCase, check_varlen

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("chunk", [48, 128, 1000])
@pytest.mark.parametrize("seqs,causal", [((1023, 1024), True), ((700, 1500), False), ((1500, 700), True)])
def test_forward_and_gradients(dtype, head_dim, chunk, seqs, causal):
    case = Case(*seqs, head_dim, dtype=dtype, causal=causal, nheads=6, nheads_k=2, chunk=chunk)
    check_flash_case(case, device="cuda")
    check_flash_grads(case, device="cuda")


@pytest.mark.parametrize("kind", ["window", "softcap", "sink"])
def test_with_features(kind):
    extra = {"window": dict(window=(200, 17)), "softcap": dict(softcap=30.0, dist="q5", causal=True),
             "sink": dict(sink="large", causal=True)}[kind]
    check_flash_grads(Case(777, 1029, 128, dtype=torch.bfloat16, nheads=6, nheads_k=2, chunk=256, **extra),
                      device="cuda")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen(causal):
    check_varlen(VarlenCase((0, 1, 2, 17, 113, 1000, 1500, 3), head_dim=128, dtype=torch.bfloat16, nheads=6,
                            nheads_k=2, causal=causal, chunk=200), device="cuda")


@pytest.mark.parametrize("page", [0, 16, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_kvcache(page, num_splits):
    q, k, v, kc, vc, table, seqlens = _case(batch=4, sq=4, new=4, heads=(32, 8), d=128, capacity=600,
                                             seqlens=(0, 1, 333, 590), dtype=torch.bfloat16, page=page)
    q, k, v, kc, vc, seqlens = (t.cuda() for t in (q, k, v, kc, vc, seqlens))
    table = None if table is None else table.cuda()
    _run_and_check(q, k, v, kc, vc, seqlens, table=table, causal=True, num_splits=num_splits, chunk=96)
