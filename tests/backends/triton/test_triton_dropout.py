"""Dropout in the Triton kernels (interpreter): rate, reproducibility, same mask in backward."""

from __future__ import annotations

import pytest
import torch

import flashtile

pytestmark = [pytest.mark.usefixtures("triton_backend", "poison_outputs"), pytest.mark.slow(seconds=20)]

SK, D = 48, 64


def _keep_mask(seed: int, p: float, B=2, Sq=40, H=4, causal=False) -> torch.Tensor:
    """The dropout mask the kernels draw for ``seed``, read out through the output.

    q = 0 makes every visible weight equal; v = one-hot(j) makes out[..., j] that weight
    times keep_j / (1 - p), so keep = out[..., :SK] > 0.
    """
    q = torch.zeros(B, Sq, H, D)
    k = torch.randn(B, SK, H, D)
    v = torch.zeros(B, SK, H, D)
    v[:, torch.arange(SK), :, torch.arange(SK)] = 1.0
    torch.manual_seed(seed)
    out = flashtile.flash_attn_func(q, k, v, dropout_p=p, causal=causal)
    return out[..., :SK] > 0  # (B, Sq, H, SK)


@pytest.mark.parametrize("p", [0.1, 0.9])  # both tails of the rate (0.5 took 7 s more of the interpreter)
def test_drop_rate(p):
    keep = _keep_mask(0, p, B=4, Sq=64, H=2)  # 24,576 draws: 0.01 is over 5 standard deviations
    rate = 1.0 - keep.float().mean().item()
    assert abs(rate - p) < 0.01, rate


def test_same_seed_same_mask_other_seed_other_mask():
    a, b, c = _keep_mask(1, 0.3, H=2), _keep_mask(1, 0.3, H=2), _keep_mask(2, 0.3, H=2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_kept_weights_are_rescaled_and_lse_is_undropped():
    q = torch.zeros(1, 8, 2, D)
    k = torch.randn(1, SK, 2, D)
    v = torch.zeros(1, SK, 2, D)
    v[:, torch.arange(SK), :, torch.arange(SK)] = 1.0
    out, lse, _ = flashtile.flash_attn_func(q, k, v, dropout_p=0.25, return_attn_probs=True)
    kept = out[..., :SK][out[..., :SK] > 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1.0 / (SK * 0.75)))
    torch.testing.assert_close(lse, torch.full_like(lse, torch.log(torch.tensor(float(SK))).item()))


@pytest.mark.parametrize("causal", [False, True])
def test_backward_uses_the_forward_mask(causal):
    p, seed, B, Sq, H = 0.3, 7, 2, 40, 2
    keep = _keep_mask(seed, p, B=B, Sq=Sq, H=H, causal=causal).permute(0, 2, 1, 3)  # (B, H, Sq, SK)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, n, H, D, generator=g) for n in (Sq, SK, SK))
    dout = torch.randn(B, Sq, H, D, generator=g)

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    torch.manual_seed(seed)
    out = flashtile.flash_attn_func(*leaves, dropout_p=p, causal=causal)
    got = torch.autograd.grad(out, leaves, dout)

    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    qd, kd, vd = (t.transpose(1, 2) for t in ref_leaves)
    s = qd @ kd.transpose(-1, -2) * D ** -0.5
    if causal:
        visible = torch.ones(Sq, SK, dtype=torch.bool).tril(SK - Sq)
        s = s.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(s, dim=-1) * keep / (1 - p)
    ref = (probs @ vd).transpose(1, 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    want = torch.autograd.grad(ref, ref_leaves, dout.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=0)
