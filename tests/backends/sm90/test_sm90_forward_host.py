"""Host-side pieces of the Gluon forward (CPU): which tensors the bulk tensor copy engine
can address, its tiles, its descriptors. Which calls take it is the registry's
(tests/backends/test_registry.py); the kernel itself is GPU-only
(test_sm90_forward_gpu.py) and compile-checked for sm_90a in test_sm90_compile.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from flashtile.backends import configs  # noqa: E402
from flashtile.backends.layout import tma_layout_ok  # noqa: E402
from flashtile.backends.sm90.forward import default_block_n  # noqa: E402


def test_tma_layout_rules():
    x = torch.zeros(2, 8, 64, 16, 64, dtype=torch.bfloat16)  # (B, S, 3?, H, D)-like storage
    bshd = x[:, :, 0]  # (B, S, H, D) slice of a packed tensor
    assert tma_layout_ok(bshd.transpose(1, 2))  # flash layout read as (B, H, S, D)
    assert tma_layout_ok(torch.zeros(2, 4, 33, 64, dtype=torch.float16))
    assert not tma_layout_ok(torch.zeros(2, 4, 33, 128, dtype=torch.float16)[..., ::2])  # last stride 2
    assert not tma_layout_ok(torch.zeros(2, 4, 33, 36, dtype=torch.float16))  # 72-byte rows
    assert tma_layout_ok(torch.zeros(2, 4, 33, 40, dtype=torch.float16))  # 80-byte rows
    flat = torch.zeros(2 * 4 * 33 * 64 + 1, dtype=torch.float16)
    assert not tma_layout_ok(flat[1:].view(2, 4, 33, 64))  # base 2 bytes off alignment
    one_head = torch.zeros(2, 1, 33, 64, dtype=torch.float16)
    assert not tma_layout_ok(one_head.expand(2, 4, 33, 64))  # stride 0 over 4 heads: broadcast
    assert tma_layout_ok(torch.zeros(2, 33, 64, dtype=torch.float16)[:, None])  # stride of a size-1 dim is free


def test_block_n_and_table():
    assert default_block_n(64) == default_block_n(128) == 128 and default_block_n(256) == 64
    for (bucket, causal, long), cfg in configs._SM90_FWD.items():
        # Short causal d64 keeps the Triton kernel's 64-row tiles (H200 run 23).
        assert cfg.use_ws == (bucket in (64, 128, 256) and (bucket, causal, long) != (64, True, False))
    assert not any(cfg.use_ws for cfg in configs._GENERIC_FWD.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tma_descriptor_is_the_checked_constructors_descriptor(dtype):
    """``tma_descriptor`` skips the dataclass's checks but must build the same descriptor
    (same fields, so the same launch arguments and the same direct-launch key)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashtile.backends.sm90.common import smem_layout, tma_descriptor
    from flashtile.runtime.launch import arg_key

    for d in (64, 128, 256):
        packed = torch.zeros(2, 40, 3, 4, d, dtype=dtype)[:, :, 1].transpose(1, 2)  # (B, H, S, D) of a qkv pack
        for t in (packed, torch.zeros(1, 2, 17, d, dtype=dtype)):
            for rows in (32, 64, 128):
                fast = tma_descriptor(t, rows)
                checked = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, d],
                                           smem_layout(rows, d, str(dtype).replace("torch.", "")))
                assert fast == checked and fast.base is t
                assert arg_key(fast) == arg_key(checked)
