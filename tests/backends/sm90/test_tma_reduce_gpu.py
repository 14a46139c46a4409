"""The Gluon bulk TMA reduction (``backends.sm90.tma_reduce``) on an sm90 GPU: 132 programs each add
the same fp32 tile into one block, and the block holds 132 times the tile (issue 17: the
instruction FA3 accumulates dQ with, reached from triton 3.6's Gluon). The compile-only
half is in test_sm90_compile.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("programs", [1, 132])
def test_bulk_reduction_adds_every_program_tile(programs):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the bulk tensor reduction probe is built for sm90 (Hopper)")
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashtile.backends.sm90.tma_reduce import reduce_probe_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(-8, 8, (64, 128), generator=g, device="cuda").float() / 4  # exact sums
    acc = torch.full((96, 160), 0.5, device="cuda")  # a block inside a larger tensor
    layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float32)
    desc = TensorDescriptor(acc, list(acc.shape), list(acc.stride()), [64, 128], layout)
    reduce_probe_kernel[(programs,)](desc, x, x.stride(0), ROWS=64, COLS=128)
    torch.cuda.synchronize()
    want = torch.full_like(acc, 0.5)
    want[:64, :128] += programs * x
    assert torch.equal(acc, want)
