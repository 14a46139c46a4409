"""flex_attention on the GPU (``pytest -m gpu``): the Triton flex kernels under QUALITY.md's
rule at fp16/bf16 with NaN-poisoned outputs, forward and gradients, for the mods of the
CPU tests; determinism reruns; one compile per mod whatever B, L, S and the captured
tensors' values."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import flashtile
from flashtile.api import mods
from flashtile.backends.triton import flex as flex_kernels
from flashtile.backends.twin import flex as twin
from flashtile.problem.blockmask import sparsity as read_sparsity
from flashtile.testing import FORWARD_FACTOR, GRAD_FACTOR, assert_close

pytestmark = [pytest.mark.gpu]

DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    original = flex_kernels.alloc

    def poisoned(shape, like, dtype=None):
        return original(shape, like, dtype).fill_(float("nan"))

    monkeypatch.setattr(flex_kernels, "alloc", poisoned)


def _mods(name, batch, nheads, seqlen_q, seqlen_k, device):
    g = torch.Generator(device="cpu").manual_seed(7)
    if name == "causal":
        return None, mods.causal
    if name == "window":
        return None, mods.sliding_window(256)
    if name == "document":
        doc = torch.sort(torch.randint(0, 5, (seqlen_k,), generator=g)).values.to(device)
        return None, (lambda b, h, q_idx, kv_idx: doc[torch.clamp(q_idx, max=seqlen_k - 1)] == doc[kv_idx])
    if name == "prefix":
        return None, mods.prefix_lm(torch.tensor([37, 300], device=device)[:batch])
    if name == "global":
        return None, mods.or_masks(mods.sliding_window(64), lambda b, h, q_idx, kv_idx: kv_idx < 4)
    if name == "empty_rows":
        return None, (lambda b, h, q_idx, kv_idx: (q_idx >= 5) & (kv_idx <= q_idx))
    if name == "alibi":
        return mods.alibi(torch.rand(nheads, generator=g).to(device)), mods.causal
    if name == "softcap":
        return mods.softcap(20.0), None
    if name == "relative":
        table = torch.randn(nheads, seqlen_q + seqlen_k - 1, generator=g).to(device)
        return mods.relative_bias(table, seqlen_k), mods.causal
    if name == "bias":
        return mods.bias(torch.randn(seqlen_q, seqlen_k, generator=g).to(device)), None
    raise ValueError(name)


def _base(q, k, v, score_mod, state_sp, scale):
    """Plain PyTorch in the input dtype (the rule's base): the twin's formula at low precision;
    and its float32 LSE (the LSE's base: its rounding grows with the scores' size, which an
    ALiBi over 2k keys makes large)."""
    dtype = q.dtype
    group = q.shape[1] // k.shape[1]
    kd, vd = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ kd.transpose(-1, -2)) * scale
    b = torch.arange(q.shape[0], device=q.device).view(-1, 1, 1, 1)
    h = torch.arange(q.shape[1], device=q.device).view(1, -1, 1, 1)
    i = torch.arange(q.shape[2], device=q.device).view(1, 1, -1, 1)
    j = torch.arange(k.shape[2], device=q.device).view(1, 1, 1, -1)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j).to(dtype)
    if state_sp is not None:
        state = state_sp.block_state()
        blocks = state[:, :, i.view(-1) // state_sp.q_block][..., j.view(-1) // state_sp.kv_block]
        keep = blocks == 2
        if state_sp.mask_mod is not None:
            keep = keep | ((blocks == 1) & state_sp.mask_mod(b, h, i, j))
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(dtype)
    return p @ vd, torch.logsumexp(s.float(), -1)


def _check(name, dtype, batch, nheads, nheads_k, seqlen_q, seqlen_k, head_dim, head_dim_v, block=128,
           builtin=False):
    device = "cuda"
    g = torch.Generator(device="cpu").manual_seed(11)
    q = torch.randn(batch, nheads, seqlen_q, head_dim, generator=g).to(device, dtype)
    k = torch.randn(batch, nheads_k, seqlen_k, head_dim, generator=g).to(device, dtype)
    v = torch.randn(batch, nheads_k, seqlen_k, head_dim_v, generator=g).to(device, dtype)
    dout = torch.randn(batch, nheads, seqlen_q, head_dim_v, generator=g).to(device, dtype)
    score_mod, mask_mod = _mods(name, batch, nheads, seqlen_q, seqlen_k, device)
    bm = None
    if mask_mod is not None:
        # torch's builder: the flex kernels run (flashtile's would send ready-made mods to the
        # built-in kernels, tested by test_ready_made_mods_take_the_builtin_kernels).
        make = flashtile.create_block_mask if builtin else create_block_mask
        bm = make(mask_mod, batch if name == "prefix" else None, None, seqlen_q, seqlen_k, device=device,
                  BLOCK_SIZE=block)
    sp = read_sparsity(bm, batch, nheads, seqlen_q, seqlen_k, device)
    scale = head_dim ** -0.5
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = flashtile.flex_attention(*leaves, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                                        return_lse=True)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref, ref_lse = twin.forward(*ref_leaves, score_mod, sp, scale)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    base_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    base, base_lse = _base(*base_leaves, score_mod, sp, scale)
    base_grads = torch.autograd.grad(base, base_leaves, dout)
    assert_close(f"{name} out", out, ref, base, FORWARD_FACTOR)
    assert_close(f"{name} lse", lse, ref_lse.detach(), base_lse.detach())
    for label, got, want, plain in zip("qkv", grads, ref_grads, base_grads):
        assert_close(f"{name} d{label}", got, want, plain, GRAD_FACTOR)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["causal", "window", "document", "prefix", "global", "empty_rows", "alibi",
                                  "softcap", "relative", "bias"])
def test_mods(dtype, name):
    _check(name, dtype, 2, 4, 2, 1000, 1300, 128, 128)


@pytest.mark.parametrize("head_dim,head_dim_v", [(64, 64), (192, 128), (32, 96)])
@pytest.mark.parametrize("seqs", [(1, 1), (17, 130), (300, 17), (2047, 2049)])
def test_shapes(head_dim, head_dim_v, seqs):
    _check("causal", torch.bfloat16, 2, 6, 2, *seqs, head_dim, head_dim_v)
    _check("alibi", torch.bfloat16, 1, 4, 4, *seqs, head_dim, head_dim_v, block=64)


@pytest.mark.parametrize("name", ["causal", "window", "alibi", "softcap"])
def test_ready_made_mods_take_the_builtin_kernels(name, monkeypatch):
    from flashtile import dispatch

    calls = []
    original = dispatch.attention
    monkeypatch.setattr(dispatch, "attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    _check(name, torch.bfloat16, 2, 4, 2, 1000, 1300, 128, 128, builtin=True)
    assert calls


def test_learned_bias_gradients():
    g = torch.Generator(device="cpu").manual_seed(5)
    q, k, v = (torch.randn(2, 4, 700, 64, generator=g).cuda().bfloat16().requires_grad_(True) for _ in range(3))
    table = (torch.randn(4, 1399, generator=g) * 0.1).cuda().requires_grad_(True)
    bias = (torch.randn(700, 700, generator=g) * 0.1).cuda().requires_grad_(True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 699] + bias[q_idx, kv_idx]

    bm = create_block_mask(mods.causal, None, None, 700, 700, device="cuda")
    out = flashtile.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                   kernel_options={"deterministic": True})
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, table, bias), dout)
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref, _ = twin.forward(*ref_in, score_mod, read_sparsity(bm, 2, 4, 700, 700, "cuda"), 64 ** -0.5)
    want = torch.autograd.grad(ref, ref_in + [table, bias], dout.double())
    for name, a, b in zip(("dq", "dk", "dv", "dtable", "dbias"), got, want):
        err = (a.double() - b.double()).abs().max().item()
        assert err <= 0.05 * b.abs().max().item() + 1e-3, (name, err)
    again = torch.autograd.grad(flashtile.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                                         kernel_options={"deterministic": True}),
                                (table, bias), dout)
    assert torch.equal(again[0], got[3]) and torch.equal(again[1], got[4])


def test_deterministic_reruns_are_bitwise_equal():
    g = torch.Generator(device="cpu").manual_seed(3)
    q, k, v = (torch.randn(2, 8, 1500, 128, generator=g).cuda().bfloat16() for _ in range(3))
    dout = torch.randn_like(q)
    bm = create_block_mask(mods.causal, None, None, 1500, 1500, device="cuda")

    def grads():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = flashtile.flex_attention(*leaves, score_mod=mods.softcap(30.0), block_mask=bm)
        return (out, *torch.autograd.grad(out, leaves, dout))

    first = grads()
    for _ in range(3):
        for a, b in zip(first, grads()):
            assert torch.equal(a, b)


def test_one_compile_per_mod():
    """New B, L, S and new captured values reuse the compiled kernels."""
    slopes = torch.rand(4, device="cuda")
    score_mod = mods.alibi(slopes)
    kernels = (flex_kernels.flex_fwd_kernel, flex_kernels.flex_dq_kernel, flex_kernels.flex_dkdv_kernel)

    def compiled():
        return sum(len(cache) for kern in kernels for cache, *_ in kern.device_caches.values())

    def run(batch, seqlen_q, seqlen_k):
        q = torch.randn(batch, 4, seqlen_q, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(batch, 4, seqlen_k, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(batch, 4, seqlen_k, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bm = create_block_mask(mods.causal, None, None, seqlen_q, seqlen_k, device="cuda")
        out = flashtile.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
        out.sum().backward()
        torch.cuda.synchronize()

    run(1, 256, 256)
    before = compiled()
    for batch, seqlen_q, seqlen_k in [(2, 1000, 1000), (3, 77, 1234), (1, 4099, 4099), (5, 129, 300)]:
        slopes.copy_(torch.rand(4, device="cuda"))
        run(batch, seqlen_q, seqlen_k)
    assert compiled() == before
