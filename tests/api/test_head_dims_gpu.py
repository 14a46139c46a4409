"""Head dims to 512 and v's own head dim on the GPU (``pytest -m gpu``): QUALITY.md's rule at
fp16/bf16 with NaN-poisoned outputs, forward and gradients, on the Triton kernels (the
registry keeps these shapes off the Gluon ones); MLA's absorbed decode over a latent cache."""

from __future__ import annotations

import pytest
import torch

from cases import Case, check_flash_case, check_flash_grads
from test_kvcache import _run_and_check

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("dims", [(192, 128), (128, 64), (512, 512), (320, 320), (64, 512)], ids=str)
@pytest.mark.parametrize("seqs,causal", [((1023, 1024), True), ((700, 1500), False)])
def test_forward_and_gradients(dtype, dims, seqs, causal):
    d, dv = dims
    case = Case(*seqs, d, dtype=dtype, causal=causal, nheads=4, nheads_k=2, head_dim_v=dv if dv != d else 0)
    check_flash_case(case, device="cuda")
    check_flash_grads(case, device="cuda")


@pytest.mark.parametrize("page", [0, 64])
@pytest.mark.parametrize("num_splits", [0, 1])
def test_mla_decode(page, num_splits):
    g = torch.Generator().manual_seed(6)
    batch, capacity, d, dv = 4, 1024, 576, 512
    if page:
        blocks = capacity // page
        k_cache = torch.randn(batch * blocks + 2, page, 1, d, generator=g)
        table = torch.randperm(batch * blocks + 2, generator=g)[:batch * blocks].reshape(batch, blocks)
        table = table.to(torch.int32).cuda()
    else:
        k_cache, table = torch.randn(batch, capacity, 1, d, generator=g), None
    k_cache = k_cache.to(torch.bfloat16).cuda()
    q = (torch.randn(batch, 1, 128, d, generator=g) * 0.1).to(torch.bfloat16).cuda()
    k = torch.randn(batch, 1, 1, d, generator=g).to(torch.bfloat16).cuda()
    seqlens = torch.tensor([0, 17, 600, 1023], dtype=torch.int32).cuda()
    _run_and_check(q, k, k[..., :dv], k_cache, k_cache[..., :dv], seqlens, table=table, causal=True,
                   num_splits=num_splits)
