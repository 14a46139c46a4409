"""flash_attn_with_kvcache on the GPU (``pytest -m gpu``): the CPU matrix's reference at
fp16/bf16 under the accuracy rule, a decode loop against the prefill of the whole
sequence, and a decode step captured in a CUDA graph with changing cache_seqlens."""

from __future__ import annotations

import pytest
import torch

import flashtile
from test_kvcache import _case, _run_and_check

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


def _cuda(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("page", [0, 16, 256])
@pytest.mark.parametrize("sq", [1, 4])
def test_matrix(dtype, page, sq):
    q, k, v, kc, vc, table, seqlens = _case(batch=4, sq=sq, new=sq, heads=(32, 8), d=128, capacity=600,
                                             seqlens=(0, 1, 333, 590), dtype=dtype, page=page)
    q, k, v, kc, vc, table, seqlens = _cuda(q, k, v, kc, vc, table, seqlens)
    _run_and_check(q, k, v, kc, vc, seqlens, table=table, causal=True)


def test_decode_loop_matches_prefill():
    g = torch.Generator(device="cuda").manual_seed(0)
    B, S, H, Hk, D, steps = 2, 200, 8, 2, 128, 64
    q, k, v = (torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (H, Hk, Hk))
    full = flashtile.flash_attn_func(q, k, v, causal=True)
    prefill = S - steps
    kc = torch.zeros(B, S, Hk, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    seqlens = torch.zeros(B, dtype=torch.int32, device="cuda")
    out = flashtile.flash_attn_with_kvcache(q[:, :prefill], kc, vc, k[:, :prefill], v[:, :prefill],
                                            cache_seqlens=seqlens, causal=True)
    outs = [out]
    seqlens += prefill
    for t in range(prefill, S):
        outs.append(flashtile.flash_attn_with_kvcache(q[:, t:t + 1], kc, vc, k[:, t:t + 1], v[:, t:t + 1],
                                                      cache_seqlens=seqlens, causal=True))
        seqlens += 1
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=2e-2, rtol=2e-2)
    assert torch.equal(kc, k) and torch.equal(vc, v)


def test_cuda_graph_decode_step():
    B, S, H, Hk, D = 4, 512, 16, 4, 128
    kc = torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, 1, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([0, 100, 300, 500], dtype=torch.int32, device="cuda")

    def step():
        return flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for _ in range(3):
        seqlens += 1
        graph.replay()
        torch.cuda.synchronize()
        kc2, vc2 = kc.clone(), vc.clone()
        ref = flashtile.flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=seqlens, causal=True)
        assert torch.equal(static, ref)
