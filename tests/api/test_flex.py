"""flex_attention (torch's FlexAttention API) on CPU.

- The torch twin (``backends/twin/flex.py``, the default on CPU tensors) against torch's own
  flex_attention, which runs the forward on CPU tensors (eager): out and LSE for the
  ready-made mods (``flashtile.mods``) and hand-written ones, GQA, E != Ev, L != S, lengths
  1 to 300, block masks from torch's create_block_mask and flashtile's, broadcast over
  batch and heads or given per batch / per head, blocks of 16 to 128 (skipped, partial
  and full blocks).
- flashtile.create_block_mask against torch's: the same block lists.
- The twin's gradients: float64 gradcheck in q, k, v and in learned biases a score_mod
  captures (torch's flex_attention has no CPU backward); rows that see no key.
- The kernels under TRITON_INTERPRET=1 against the twin in float64: out, LSE and dq, dk,
  dv with a loss on the LSE too (NaN-poisoned buffers), on both routes a call can take (the
  flex kernels with translated mods; the built-in kernels for the ready-made causal /
  sliding_window / alibi / softcap with flashtile's block mask); learned biases' gradients;
  mods the translator refuses; the translation cache.
- Bad arguments refused before anything runs, naming the argument.
"""

from __future__ import annotations

import collections
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flashtile
from flashtile import mods
from flashtile.backends.twin import flex as twin_flex
from flashtile.problem.blockmask import sparsity as read_sparsity
from flex_refused import branchy_mask, branchy_score, cumsum_score, erf_score, hand_block_mask

# torch's flex_attention on CPU tensors runs eagerly and says so at every call.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


# --------------------------------------------------------------------------- cases
def _drawn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _doc_ids(*lengths: int) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


DOCS = _doc_ids(40, 1, 59, 30)  # 130 tokens, a one-token document among them
DOCS_PER_BATCH = torch.stack([DOCS, _doc_ids(10, 100, 20)])
WINDOWS = torch.tensor([2, 9, 33, 1000])  # one window per query head


def neg_inf_score(score, b, h, q_idx, kv_idx):
    """Masking by the score: -inf off a causal band, and everywhere in rows 0..2."""
    return torch.where((q_idx >= 3) & (q_idx >= kv_idx) & (q_idx - kv_idx < 50), score, -float("inf"))


def per_head_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= WINDOWS[h]


def key_prefix(b, h, q_idx, kv_idx):
    return kv_idx < 4


def every_other(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx) % 2 == 0


def rows_from_5(b, h, q_idx, kv_idx):
    """Rows 0..4 see no key."""
    return (q_idx >= 5) & (q_idx >= kv_idx)


@dataclass(frozen=True)
class FlexCase:
    id: str
    seqlen_q: int = 130
    seqlen_k: int = 130
    mask: Optional[Callable] = None
    score: Optional[Callable] = None
    batch: int = 2
    nheads: int = 2
    nheads_k: int = 2
    head_dim: int = 16
    head_dim_v: int = 16
    mask_batch: Optional[int] = None  # create_block_mask's B (None: broadcast)
    mask_heads: Optional[int] = None  # and H
    block_size: object = 128
    scale: Optional[float] = None

    def inputs(self, seed: int):
        q = _drawn(self.batch, self.nheads, self.seqlen_q, self.head_dim, seed=seed)
        k = _drawn(self.batch, self.nheads_k, self.seqlen_k, self.head_dim, seed=seed + 1)
        v = _drawn(self.batch, self.nheads_k, self.seqlen_k, self.head_dim_v, seed=seed + 2)
        return q, k, v

    def block_mask(self, maker: str):
        if self.mask is None:
            return None
        make = torch_flex.create_block_mask if maker == "torch" else flashtile.create_block_mask
        return make(self.mask, self.mask_batch, self.mask_heads, self.seqlen_q, self.seqlen_k, device="cpu",
                    BLOCK_SIZE=self.block_size)

    @property
    def kwargs(self) -> dict:
        return dict(score_mod=self.score, scale=self.scale, enable_gqa=self.nheads != self.nheads_k)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.scale is None else self.scale


SLOPES2 = torch.tensor([0.5, 0.125])
SLOPES4 = torch.tensor([0.5, 0.25, 0.125, 0.0625])
LSE = torch_flex.AuxRequest(lse=True)  # torch's form (return_lse is deprecated there)

CASES = [
    FlexCase("plain"),
    FlexCase("causal", mask=mods.causal),
    FlexCase("causal-blocks16", mask=mods.causal, block_size=16),
    FlexCase("causal-B2-H2-given", mask=mods.causal, mask_batch=2, mask_heads=2, block_size=32),
    FlexCase("sliding_window", 300, 300, mask=mods.sliding_window(24, 8), batch=1, block_size=16),
    FlexCase("sliding_window-128", mask=mods.sliding_window(20)),
    FlexCase("document", mask=mods.document(DOCS), block_size=16),
    FlexCase("document-causal", mask=mods.and_masks(mods.document(DOCS), mods.causal), block_size=(32, 16)),
    FlexCase("prefix_lm", mask=mods.prefix_lm(25), block_size=16),
    FlexCase("global_tokens", mask=mods.or_masks(mods.sliding_window(6, 6), key_prefix), block_size=16),
    FlexCase("dilated", mask=mods.and_masks(mods.causal, every_other), block_size=16),
    FlexCase("rows_masked", 17, 17, mask=rows_from_5, block_size=16),
    FlexCase("rows_masked-130", mask=rows_from_5),
    FlexCase("alibi", score=mods.alibi(SLOPES2)),
    FlexCase("alibi-causal", mask=mods.causal, score=mods.alibi(SLOPES2), block_size=32),
    FlexCase("softcap", mask=mods.sliding_window(40, 40), score=mods.softcap(2.0), scale=1.0, block_size=16),
    FlexCase("relative_bias", 17, 70, score=mods.relative_bias(_drawn(2, 17 + 70 - 1, seed=10), 70)),
    FlexCase("bias", 70, 40, score=mods.bias(_drawn(70, 40, seed=11, scale=2.0)), mask=mods.causal),
    FlexCase("score-neg-inf", score=neg_inf_score),
    FlexCase("score-neg-inf-and-mask", 70, 90, score=neg_inf_score, mask=mods.document(DOCS[:90]), block_size=16),
    FlexCase("gqa", mask=mods.causal, score=mods.alibi(SLOPES4), nheads=4, nheads_k=2, block_size=16),
    FlexCase("mqa-per-head", mask=per_head_window, nheads=4, nheads_k=1, mask_heads=4, block_size=16),
    FlexCase("e32-ev16", mask=mods.document(DOCS), head_dim=32, head_dim_v=16, block_size=32),
    FlexCase("e16-ev32", 17, 70, mask=mods.prefix_lm(5), head_dim=16, head_dim_v=32),
    FlexCase("l17-s130", 17, 130, mask=mods.causal, block_size=16),
    FlexCase("l300-s17", 300, 17, mask=mods.sliding_window(100), batch=1, block_size=16),
    FlexCase("l130-s300", 130, 300, mask=mods.prefix_lm(200), batch=1, block_size=(16, 64)),
    FlexCase("per-batch-document", mask=mods.document(DOCS_PER_BATCH), mask_batch=2, block_size=16),
    FlexCase("per-batch-prefix", mask=mods.prefix_lm(torch.tensor([10, 90])), mask_batch=2, block_size=32),
    FlexCase("per-head", mask=per_head_window, nheads=4, nheads_k=2, mask_heads=4, block_size=16),
    FlexCase("per-batch-and-head", mask=mods.and_masks(mods.document(DOCS_PER_BATCH), per_head_window),
             nheads=4, nheads_k=4, mask_batch=2, mask_heads=4, block_size=16,
             score=mods.alibi(SLOPES4)),
]


def assert_out_and_lse(out, lse, want_out, want_lse, atol, rtol=1e-5):
    """out and LSE within (atol, rtol); -inf exactly where the reference has it."""
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(out.double(), want_out.double(), atol=atol, rtol=rtol, msg="out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), "lse -inf rows"
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse.double()[finite], atol=atol, rtol=rtol, msg="lse")


# --------------------------------------------------------------------------- the twin against torch
@pytest.mark.parametrize("maker", ["torch", "flashtile"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_twin_against_torch_flex_attention(case, maker):
    q, k, v = case.inputs(seed=len(case.id))
    block_mask = case.block_mask(maker)
    out, lse = flashtile.flex_attention(q, k, v, block_mask=block_mask, return_lse=True, **case.kwargs)
    want_out, aux = torch_flex.flex_attention(q, k, v, block_mask=block_mask, return_aux=LSE, **case.kwargs)
    want_lse = aux.lse
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_out_and_lse(out, lse, want_out, want_lse, atol=2e-5)
    if case.mask is not None or case.score is not None:  # the mods matter in every case
        plain = flashtile.flex_attention(q, k, v, scale=case.scale, enable_gqa=case.nheads != case.nheads_k)
        assert (out - plain).abs().max() > 1e-2


@pytest.mark.parametrize("seqlens", [(1, 1), (17, 17), (130, 130), (300, 300), (1, 300), (300, 1), (17, 130),
                                     (130, 17)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("maker", ["torch", "flashtile"])
def test_twin_lengths_against_torch(seqlens, maker):
    sq, sk = seqlens
    case = FlexCase(f"{sq}x{sk}", sq, sk, mask=mods.sliding_window(40, 3), score=mods.alibi(SLOPES2),
                    block_size=16 if max(sq, sk) < 200 else 128)
    q, k, v = case.inputs(seed=sq + 3 * sk)
    block_mask = case.block_mask(maker)
    got = flashtile.flex_attention(q, k, v, block_mask=block_mask, return_lse=True, **case.kwargs)
    want_out, aux = torch_flex.flex_attention(q, k, v, block_mask=block_mask, return_aux=LSE, **case.kwargs)
    assert_out_and_lse(*got, want_out, aux.lse, atol=2e-5)


def _listed(num: torch.Tensor, idx: torch.Tensor) -> list:
    """The set of block indices each row of a BlockMask's lists names (its first num entries)."""
    counts = num.flatten().tolist()
    rows = idx.flatten(0, -2)
    return [set(rows[i, :n].tolist()) for i, n in enumerate(counts)]


@pytest.mark.parametrize("mask,batch,heads,sq,sk,block", [
    (mods.causal, None, None, 300, 200, 128),
    (mods.causal, None, None, 130, 130, 16),
    (mods.sliding_window(20, 5), None, None, 130, 97, (32, 16)),
    (mods.document(DOCS), None, None, 130, 130, 16),
    (mods.document(DOCS_PER_BATCH), 2, None, 130, 130, 32),
    (per_head_window, None, 4, 130, 130, 16),
    (mods.and_masks(mods.document(DOCS_PER_BATCH), per_head_window), 2, 4, 130, 130, 16),
    (rows_from_5, None, None, 17, 17, 16),
    (mods.or_masks(mods.sliding_window(6, 6), key_prefix), None, None, 200, 200, (16, 32)),
], ids=["causal-300x200", "causal-b16", "window-ragged", "document", "per-batch", "per-head", "per-batch-head",
        "rows-masked", "global-tokens"])
def test_create_block_mask_matches_torch(mask, batch, heads, sq, sk, block):
    ours = flashtile.create_block_mask(mask, batch, heads, sq, sk, device="cpu", BLOCK_SIZE=block)
    want = torch_flex.create_block_mask(mask, batch, heads, sq, sk, device="cpu", BLOCK_SIZE=block)
    assert isinstance(ours, torch_flex.BlockMask)
    assert ours.BLOCK_SIZE == want.BLOCK_SIZE and tuple(ours.seq_lengths) == tuple(want.seq_lengths)
    assert int(want.full_kv_num_blocks.sum()) > 0 or int(want.kv_num_blocks.sum()) > 0
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                     ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        a_num, b_num = getattr(ours, num), getattr(want, num)
        assert a_num.shape == b_num.shape and torch.equal(a_num.to(torch.int32), b_num.to(torch.int32)), num
        assert _listed(a_num, getattr(ours, idx)) == _listed(b_num, getattr(want, idx)), idx
    assert ours.mask_mod is mask


# --------------------------------------------------------------------------- the twin's gradients
def _sparsity(mask, batch, heads, sq, sk, mask_heads=None, block=16):
    bm = None if mask is None else flashtile.create_block_mask(mask, None, mask_heads, sq, sk, device="cpu",
                                                                BLOCK_SIZE=block)
    return read_sparsity(bm, batch, heads, sq, sk, "cpu")


def _leaves64(batch, hq, hk, sq, sk, e, ev, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_(True)
            for shape in ((batch, hq, sq, e), (batch, hk, sk, e), (batch, hk, sk, ev))]


@pytest.mark.parametrize("mask,score,hk,ev", [
    (None, None, 2, 4),
    (rows_from_5, mods.alibi(torch.tensor([0.5, 0.25], dtype=torch.float64)), 1, 3),
    (mods.and_masks(mods.causal, every_other), mods.softcap(1.5), 2, 5),
    (mods.or_masks(mods.sliding_window(1, 1), key_prefix), None, 1, 4),
], ids=["plain", "masked-rows-alibi-gqa", "dilated-softcap", "global-window"])
def test_twin_gradcheck_qkv(mask, score, hk, ev):
    sq, sk = 7, 9
    sp = _sparsity(mask, 1, 2, sq, sk, block=16)
    leaves = _leaves64(1, 2, hk, sq, sk, 4, ev, seed=sq + hk + ev)

    def out_of(q, k, v):
        out, lse = twin_flex.forward(q, k, v, score, sp, 0.7)
        assert out.dtype == torch.float64
        return out

    assert torch.autograd.gradcheck(out_of, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("kind", ["relative_bias", "bias"])
def test_twin_gradcheck_learned_bias(kind):
    """A bias table the score_mod captures is a leaf: its gradient sums dS over the elements
    that read each entry (none for masked elements)."""
    sq, sk = 6, 8
    g = torch.Generator().manual_seed(5)
    shape = (2, sq + sk - 1) if kind == "relative_bias" else (sq, sk)
    table = torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_(True)
    sp = _sparsity(mods.prefix_lm(2), 1, 2, sq, sk)
    leaves = _leaves64(1, 2, 2, sq, sk, 4, 4, seed=7)

    def out_of(q, k, v, t):
        mod = mods.relative_bias(t, sk) if kind == "relative_bias" else mods.bias(t)
        return twin_flex.forward(q, k, v, mod, sp, 0.5)[0]

    assert torch.autograd.gradcheck(out_of, (*leaves, table), eps=1e-6, atol=1e-7, rtol=1e-5)
    # entries read only by masked elements get no gradient
    (grad,) = torch.autograd.grad(out_of(*leaves, table).sum(), table)
    if kind == "bias":
        hidden = ~((torch.arange(sk)[None, :] < 2) | (torch.arange(sq)[:, None] >= torch.arange(sk)[None, :]))
        assert hidden.any() and torch.equal(grad[hidden], torch.zeros_like(grad[hidden]))
        assert (grad[~hidden] != 0).all()


def _dense64(q, k, v, score_mod, mask_mod, scale):
    """Plain float64 attention on full index grids: (out, lse) and no blocks at all."""
    batch, hq, sq, _ = q.shape
    sk, group = k.shape[2], hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(hq).view(1, -1, 1, 1)
    i = torch.arange(sq).view(1, 1, -1, 1)
    j = torch.arange(sk).view(1, 1, 1, -1)
    s = scale * q @ k.transpose(-1, -2)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, i, j).expand(s.shape), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_twin_lse_gradient_against_a_dense_reference():
    """The LSE (float64 from float64 inputs) is differentiable: a loss on out and LSE
    gives the gradients of plain dense float64 attention (every row sees a key)."""
    sq, sk = 21, 37
    mask, score = mods.and_masks(mods.sliding_window(9, 2), every_other), mods.alibi(SLOPES4.double())
    sp = _sparsity(mask, 2, 4, sq, sk)
    leaves = _leaves64(2, 4, 2, sq, sk, 8, 6, seed=3)
    g = torch.Generator().manual_seed(4)
    dout, dlse = torch.randn(2, 4, sq, 6, generator=g, dtype=torch.float64), torch.randn(2, 4, sq, generator=g)
    out, lse = twin_flex.forward(*leaves, score, sp, 0.3)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), leaves)
    want_out, want_lse = _dense64(*leaves, score, mask, 0.3)
    want = torch.autograd.grad((want_out * dout).sum() + (want_lse * dlse).sum(), leaves)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-6, rtol=1e-7)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)


def test_rows_that_see_no_key(backend):
    """out 0, LSE -inf and zero (finite) gradients for rows 0..4, on the twin and the kernels."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 17, 16, generator=g).requires_grad_(True) for _ in range(3))
    block_mask = flashtile.create_block_mask(rows_from_5, None, None, 17, 17, device="cpu", BLOCK_SIZE=16)
    out, lse = flashtile.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()
    assert torch.isfinite(out).all()
    loss = out.square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert torch.equal(dq[:, :, :5], torch.zeros_like(dq[:, :, :5]))
    assert dq[:, :, 5:].abs().amax(-1).min() > 0


def test_rows_that_see_no_key_give_a_learned_bias_no_gradient():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 17, 16, generator=g) for _ in range(3))
    table = torch.randn(17, 17, generator=g, requires_grad=True)
    block_mask = flashtile.create_block_mask(rows_from_5, None, None, 17, 17, device="cpu", BLOCK_SIZE=16)
    out, lse = flashtile.flex_attention(q, k, v, score_mod=mods.bias(table), block_mask=block_mask, return_lse=True)
    (grad,) = torch.autograd.grad(out.square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum(), table)
    assert torch.isfinite(grad).all() and torch.equal(grad[:5], torch.zeros_like(grad[:5]))
    assert (grad[5:].tril() != 0).sum() > 0 and torch.equal(grad.triu(1), torch.zeros_like(grad))


# --------------------------------------------------------------------------- the kernels (interpreter)
@pytest.fixture
def poison_flex_outputs(monkeypatch):
    """The flex kernels' out, lse, dq, dk, dv start as NaN: unwritten elements fail."""
    from flashtile.backends.triton import flex as flex_kernels

    if hasattr(flex_kernels, "alloc"):
        original = flex_kernels.alloc
        monkeypatch.setattr(flex_kernels, "alloc", lambda *args, **kw: original(*args, **kw).fill_(float("nan")))
    yield


@pytest.fixture
def routes(monkeypatch):
    """Which kernels each flex call ran: "builtin" (flashtile's attention kernels, for the
    ready-made mods with a flashtile block mask: ``dispatch.flex_builtin``) or "flex"."""
    from flashtile import dispatch

    taken = []
    original = dispatch.flex_builtin

    def recording(*args):
        found = original(*args)
        taken.append("flex" if found is None else "builtin")
        return found

    monkeypatch.setattr(dispatch, "flex_builtin", recording)
    return taken


def triangle(b, h, q_idx, kv_idx):
    """mods.causal, written out: no built-in equivalent attached."""
    return q_idx >= kv_idx


def slope_bias(score, b, h, q_idx, kv_idx):
    """mods.alibi(SLOPES2), written out."""
    return score - SLOPES2[h] * (q_idx - kv_idx).abs()


# (case, block mask maker, the kernels that run it)
KERNEL_CASES = [
    (FlexCase("plain", 64, 64, batch=1, score=lambda score, b, h, q_idx, kv_idx: score), "flashtile", "flex"),
    (FlexCase("causal-alibi", mask=mods.causal, score=mods.alibi(SLOPES2), batch=1), "torch", "flex"),
    (FlexCase("causal-alibi-hand", 70, 70, mask=triangle, score=slope_bias, batch=1, block_size=32), "flashtile",
     "flex"),
    (FlexCase("document-gqa", 96, 96, mask=mods.document(DOCS_PER_BATCH[:, :96]), mask_batch=2, nheads=4,
              nheads_k=2, block_size=32), "torch", "flex"),
    (FlexCase("prefix-softcap-ragged", 17, 70, mask=mods.prefix_lm(5), score=mods.softcap(2.0), scale=1.0,
              head_dim=32, head_dim_v=16, block_size=16), "flashtile", "flex"),
    (FlexCase("per-head-gqa", 80, 80, mask=per_head_window, nheads=4, nheads_k=2, mask_heads=4, batch=1,
              block_size=16), "flashtile", "flex"),
    (FlexCase("rows-masked", 17, 40, mask=rows_from_5, batch=1, block_size=16), "flashtile", "flex"),
    # the ready-made mods with flashtile's block mask: the built-in kernels, top-left diagonal
    (FlexCase("builtin-causal-alibi-17x70", 17, 70, mask=mods.causal, score=mods.alibi(SLOPES2), batch=1,
              block_size=16), "flashtile", "builtin"),
    (FlexCase("builtin-window-softcap-70x17", 70, 17, mask=mods.sliding_window(5, 3), score=mods.softcap(2.0),
              scale=1.0, head_dim=32, head_dim_v=16, batch=1, block_size=16), "flashtile", "builtin"),
    (FlexCase("builtin-alibi-gqa-70x40", 70, 40, score=mods.alibi(SLOPES4), nheads=4, nheads_k=2, batch=1), None,
     "builtin"),
]


@pytest.mark.parametrize("case,maker,route", KERNEL_CASES, ids=[c.id for c, _, _ in KERNEL_CASES])
def test_kernels_against_the_twin_in_float64(triton_backend, poison_flex_outputs, routes, case, maker, route):
    q, k, v = case.inputs(seed=len(case.id) + 100)
    block_mask = case.block_mask(maker) if maker else None
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = flashtile.flex_attention(*leaves, block_mask=block_mask, return_lse=True, **case.kwargs)
    assert routes == [route]
    sp = read_sparsity(block_mask, case.batch, case.nheads, case.seqlen_q, case.seqlen_k, "cpu")
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    want_out, want_lse = twin_flex.forward(*ref_leaves, case.score, sp, case.softmax_scale)
    assert out.dtype == torch.float32 and want_out.dtype == torch.float64
    assert_out_and_lse(out, lse, want_out, want_lse, atol=1e-4, rtol=1e-4)

    g = torch.Generator().manual_seed(11)
    dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)

    def loss(o, l):  # noqa: E741
        return (o * dout).sum() + (torch.where(torch.isfinite(l), l, 0.0) * dlse).sum()

    got = torch.autograd.grad(loss(out, lse), leaves)
    want = torch.autograd.grad(loss(want_out, want_lse), ref_leaves)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4, msg=name)


def zero_rows_score(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx < 3, 0.0, score)


@pytest.mark.parametrize("score", [neg_inf_score, zero_rows_score], ids=["neg-inf", "zero"])
def test_kernels_take_a_python_scalar_in_where(triton_backend, poison_flex_outputs, score):
    q, k, v = FlexCase("where", 40, 40, batch=1).inputs(seed=21)
    out, lse = flashtile.flex_attention(q, k, v, score_mod=score, return_lse=True)
    want_out, want_lse = twin_flex.forward(q.double(), k.double(), v.double(), score, None, 0.25)
    assert_out_and_lse(out, lse, want_out, want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("score,mask,match", [
    (erf_score, None, r"score_mod 'erf_score' uses the op aten\.erf"),
    (cumsum_score, None, r"score_mod 'cumsum_score' uses the op aten\.cumsum"),
    (branchy_score, None, r"score_mod 'branchy_score' cannot be traced"),
    (None, branchy_mask, r"mask_mod 'branchy_mask' cannot be traced"),
], ids=["erf", "cumsum", "python-if", "mask-python-if"])
def test_untranslatable_mods_are_refused(triton_backend, score, mask, match):
    from flashtile.backends.triton import modgen

    q = torch.randn(1, 2, 20, 16)
    block_mask = None if mask is None else hand_block_mask(mask)
    with pytest.raises(modgen.UntranslatableMod, match=match) as err:
        flashtile.flex_attention(q, q, q, score_mod=score, block_mask=block_mask)
    assert isinstance(err.value, NotImplementedError)


@pytest.mark.parametrize("kind", ["bias", "relative_bias", "alibi_slopes"])
def test_kernels_differentiate_a_learned_bias(triton_backend, poison_flex_outputs, routes, kind):
    """A captured tensor that requires grad (a learned bias) gets its gradient on the kernel
    path too, the LSE's included: against the twin in float64. Entries that only masked
    elements read get none."""
    sq, sk = 24, 40
    case = FlexCase(kind, sq, sk, batch=2, nheads=2, nheads_k=1)
    q, k, v = case.inputs(seed=17)
    shape = {"bias": (sq, sk), "relative_bias": (2, sq + sk - 1), "alibi_slopes": (2,)}[kind]
    table = _drawn(*shape, seed=18).abs()

    def mod(t):
        return {"bias": mods.bias, "alibi_slopes": mods.alibi}.get(kind, lambda t: mods.relative_bias(t, sk))(t)

    # learned slopes: causal with flashtile's block mask would run the built-in kernels, which
    # take no slope gradient: the flex kernels run it
    mask = mods.causal if kind == "alibi_slopes" else mods.prefix_lm(3)
    block_mask = flashtile.create_block_mask(mask, None, None, sq, sk, device="cpu", BLOCK_SIZE=16)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, table)]
    out, lse = flashtile.flex_attention(*leaves[:3], score_mod=mod(leaves[3]), block_mask=block_mask,
                                        enable_gqa=True, return_lse=True)
    sp = read_sparsity(block_mask, 2, 2, sq, sk, "cpu")
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v, table)]
    want_out, want_lse = twin_flex.forward(*ref_leaves[:3], mod(ref_leaves[3]), sp, case.softmax_scale)
    assert_out_and_lse(out, lse, want_out, want_lse, atol=1e-4, rtol=1e-4)
    g = torch.Generator().manual_seed(19)
    dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), leaves)
    want = torch.autograd.grad((want_out * dout).sum() + (want_lse * dlse).sum(), ref_leaves)
    assert routes == ["flex"]
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4, msg=name)
    if kind == "bias":
        hidden = ~((torch.arange(sk)[None, :] < 3) | (torch.arange(sq)[:, None] >= torch.arange(sk)[None, :]))
        assert torch.equal(got[3][hidden], torch.zeros_like(got[3][hidden])) and got[3][~hidden].abs().min() > 0


# --------------------------------------------------------------------------- return_aux
def test_return_aux_gives_the_lse():
    q, k, v = FlexCase("aux").inputs(seed=13)
    block_mask = flashtile.create_block_mask(rows_from_5, None, None, 130, 130, device="cpu", BLOCK_SIZE=16)
    out, lse = flashtile.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    got = flashtile.flex_attention(q, k, v, block_mask=block_mask, return_aux=torch_flex.AuxRequest(lse=True))
    assert isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], torch_flex.AuxOutput)
    assert torch.equal(got[0], out) and torch.equal(got[1].lse, lse)
    out_none, aux = flashtile.flex_attention(q, k, v, block_mask=block_mask, return_aux=torch_flex.AuxRequest())
    assert torch.equal(out_none, out) and aux.lse is None
    assert torch.equal(flashtile.flex_attention(q, k, v, block_mask=block_mask), out)


# --------------------------------------------------------------------------- the translation cache
@pytest.fixture
def traces(monkeypatch):
    """Count the translator's traces, by mod name."""
    from flashtile.backends.triton import modgen

    count = collections.Counter()
    original = modgen._trace

    def counting(fn, kind, device):
        count[getattr(fn, "__name__", "?")] += 1
        return original(fn, kind, device)

    monkeypatch.setattr(modgen, "_trace", counting)
    return count


def _twin(q, k, v, score_mod, block_mask=None):
    sp = read_sparsity(block_mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2], "cpu")
    return twin_flex.forward(q.double(), k.double(), v.double(), score_mod, sp, q.shape[-1] ** -0.5)[0]


def test_the_translation_is_cached(triton_backend, traces):
    q, k, v = FlexCase("cache", 33, 33, batch=1).inputs(seed=14)
    score = mods.relative_bias(_drawn(2, 65, seed=20), 33)

    def band(b, h, q_idx, kv_idx):  # a fresh function: no translation cached for it yet
        return (q_idx - kv_idx).abs() <= 5

    block_mask = flashtile.create_block_mask(band, None, None, 33, 33, device="cpu", BLOCK_SIZE=16)
    first = flashtile.flex_attention(q, k, v, score_mod=score, block_mask=block_mask)
    second = flashtile.flex_attention(q, k, v, score_mod=score, block_mask=block_mask)
    assert traces == {"relative_bias_score": 1, "band": 1}
    assert torch.equal(first, second)
    torch.testing.assert_close(first.double(), _twin(q, k, v, score, block_mask), atol=1e-4, rtol=1e-4)


def test_a_rebound_tensor_is_traced_again(triton_backend, traces):
    """A closure over a mutable holder: the mod reads whichever tensor the holder has now."""
    q, k, v = FlexCase("holder", 33, 33, batch=1).inputs(seed=15)
    holder = {"slopes": torch.tensor([0.5, 0.25])}

    def holder_alibi(score, b, h, q_idx, kv_idx):
        return score - holder["slopes"][h] * (q_idx - kv_idx).abs()

    first = flashtile.flex_attention(q, k, v, score_mod=holder_alibi)
    old = holder["slopes"]  # kept alive: a new tensor cannot reuse its id
    holder["slopes"] = torch.tensor([2.0, 0.0])
    second = flashtile.flex_attention(q, k, v, score_mod=holder_alibi)
    assert traces["holder_alibi"] == 2 and old is not holder["slopes"]
    torch.testing.assert_close(second.double(), _twin(q, k, v, holder_alibi), atol=1e-4, rtol=1e-4)
    assert (second - first).abs().max() > 1e-2
    # the same tensor changed in place: no new trace, the new values are read
    holder["slopes"].mul_(0.5)
    third = flashtile.flex_attention(q, k, v, score_mod=holder_alibi)
    assert traces["holder_alibi"] == 2
    torch.testing.assert_close(third.double(), _twin(q, k, v, holder_alibi), atol=1e-4, rtol=1e-4)
    assert (third - second).abs().max() > 1e-2


GLOBAL_SLOPES = torch.tensor([0.5, 0.25])


def global_alibi(score, b, h, q_idx, kv_idx):
    return score - GLOBAL_SLOPES[h] * (q_idx - kv_idx).abs()


def test_a_reassigned_global_is_traced_again(triton_backend, traces, monkeypatch):
    q, k, v = FlexCase("global", 33, 33, batch=1).inputs(seed=16)
    first = flashtile.flex_attention(q, k, v, score_mod=global_alibi)
    monkeypatch.setattr(sys.modules[__name__], "GLOBAL_SLOPES", torch.tensor([0.0, 3.0]))
    second = flashtile.flex_attention(q, k, v, score_mod=global_alibi)
    assert traces["global_alibi"] == 2
    torch.testing.assert_close(second.double(), _twin(q, k, v, global_alibi), atol=1e-4, rtol=1e-4)
    assert (second - first).abs().max() > 1e-2


# --------------------------------------------------------------------------- bad arguments
class Recorder:
    """A score_mod that counts its calls: a refused call never reaches it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, score, b, h, q_idx, kv_idx):
        self.calls += 1
        return score


def test_score_mod_with_the_wrong_arity():
    q = torch.randn(1, 2, 20, 16)
    with pytest.raises(TypeError, match=r"score_mod must take 5 arguments"):
        flashtile.flex_attention(q, q, q, score_mod=lambda score, b, h, q_idx: score)
    with pytest.raises(TypeError, match=r"score_mod must take 5 arguments"):
        flashtile.flex_attention(q, q, q, score_mod=lambda score, b, h, q_idx, kv_idx, extra: score)


def test_mask_mod_with_the_wrong_arity():
    with pytest.raises(TypeError, match=r"mask_mod must take 4 arguments"):
        flashtile.create_block_mask(lambda b, h, q_idx: q_idx >= 0, None, None, 20, 20, device="cpu")
    good = torch_flex.create_block_mask(mods.causal, None, None, 20, 20, device="cpu")
    bad = torch_flex.BlockMask.from_kv_blocks(good.kv_num_blocks, good.kv_indices, good.full_kv_num_blocks,
                                              good.full_kv_indices, BLOCK_SIZE=good.BLOCK_SIZE,
                                              mask_mod=lambda b, h, q_idx: q_idx >= 0, seq_lengths=(20, 20))
    q, score = torch.randn(1, 2, 20, 16), Recorder()
    with pytest.raises(TypeError, match=r"block_mask\.mask_mod must take 4 arguments"):
        flashtile.flex_attention(q, q, q, score_mod=score, block_mask=bad)
    assert score.calls == 0


@pytest.mark.parametrize("maker", ["torch", "flashtile"])
def test_a_block_mask_for_other_lengths(maker):
    make = torch_flex.create_block_mask if maker == "torch" else flashtile.create_block_mask
    block_mask = make(mods.causal, None, None, 20, 20, device="cpu")
    q, k, score = torch.randn(1, 2, 21, 16), torch.randn(1, 2, 20, 16), Recorder()
    with pytest.raises(ValueError, match=r"block_mask was created for \(Q_LEN, KV_LEN\) = \(20, 20\)"):
        flashtile.flex_attention(q, k, k, score_mod=score, block_mask=block_mask)
    with pytest.raises(ValueError, match=r"block_mask was created for"):
        flashtile.flex_attention(k, q, q, score_mod=score, block_mask=block_mask)
    assert score.calls == 0


def test_block_mask_batch_or_heads_that_do_not_broadcast():
    block_mask = flashtile.create_block_mask(mods.causal, 3, None, 20, 20, device="cpu")
    q = torch.randn(2, 2, 20, 16)
    with pytest.raises(ValueError, match=r"block_mask's batch \(3\)"):
        flashtile.flex_attention(q, q, q, block_mask=block_mask)
    block_mask = flashtile.create_block_mask(mods.causal, None, 3, 20, 20, device="cpu")
    with pytest.raises(ValueError, match=r"block_mask's heads \(3\)"):
        flashtile.flex_attention(q, q, q, block_mask=block_mask)


def test_query_heads_not_a_multiple_of_key_heads():
    k, score = torch.randn(1, 2, 20, 16), Recorder()
    with pytest.raises(ValueError, match=r"enable_gqa"):
        flashtile.flex_attention(torch.randn(1, 4, 20, 16), k, k, score_mod=score)
    for enable_gqa in (False, True):
        with pytest.raises(ValueError, match=r"query heads \(3\) must be divisible .* key/value heads \(2\)"):
            flashtile.flex_attention(torch.randn(1, 3, 20, 16), k, k, score_mod=score, enable_gqa=enable_gqa)
    assert score.calls == 0


def test_block_size_not_a_multiple_of_16():
    with pytest.raises(ValueError, match=r"BLOCK_SIZE must be a positive multiple of 16.*24"):
        flashtile.create_block_mask(mods.causal, None, None, 20, 20, device="cpu", BLOCK_SIZE=24)
    with pytest.raises(ValueError, match=r"BLOCK_SIZE must be a positive multiple of 16"):
        flashtile.create_block_mask(mods.causal, None, None, 20, 20, device="cpu", BLOCK_SIZE=(16, 8))
    block_mask = torch_flex.create_block_mask(mods.causal, None, None, 20, 20, device="cpu", BLOCK_SIZE=8)
    q, score = torch.randn(1, 2, 20, 16), Recorder()
    with pytest.raises(ValueError, match=r"block_mask's BLOCK_SIZE must be a positive multiple of 16"):
        flashtile.flex_attention(q, q, q, score_mod=score, block_mask=block_mask)
    assert score.calls == 0


def test_unknown_kernel_options():
    q, score = torch.randn(1, 2, 20, 16), Recorder()
    with pytest.raises(ValueError, match=r"kernel_options has unknown keys \['BLOCK_Q'\]"):
        flashtile.flex_attention(q, q, q, score_mod=score, kernel_options={"BLOCK_Q": 64})
    assert score.calls == 0
    flashtile.flex_attention(q, q, q, score_mod=score, kernel_options={"PRESCALE_QK": False})  # torch's: accepted
    assert score.calls == 1


def test_return_lse_with_return_aux():
    q, score = torch.randn(1, 2, 20, 16), Recorder()
    with pytest.raises(ValueError, match=r"return_lse and return_aux"):
        flashtile.flex_attention(q, q, q, score_mod=score, return_lse=True,
                                 return_aux=torch_flex.AuxRequest(lse=True))
    assert score.calls == 0


def test_max_scores_and_a_mask_mod_that_is_not_bool():
    q, score = torch.randn(1, 2, 20, 16), Recorder()
    with pytest.raises(NotImplementedError, match=r"max_scores"):
        flashtile.flex_attention(q, q, q, score_mod=score, return_aux=torch_flex.AuxRequest(lse=True, max_scores=True))
    assert score.calls == 0
    with pytest.raises(TypeError, match=r"mask_mod must return a bool tensor, got torch.int64"):
        flashtile.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx - kv_idx, None, None, 20, 20, device="cpu")


def test_a_direct_index_past_a_captured_tensor_is_refused(triton_backend):
    """slopes[h] with fewer slopes than heads: torch raises an IndexError, so do the kernels
    (before the launch), instead of reading 0 through their masked loads."""
    slopes = torch.rand(2)

    def short_alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    q = torch.randn(1, 4, 20, 16)
    with pytest.raises(IndexError, match="short_alibi.*by h"):
        flashtile.flex_attention(q, q, q, score_mod=short_alibi)


try:  # module globals: a triton.jit function reads triton.language from them
    import triton
    import triton.language as tl
except ImportError:  # the tests that need it skip
    triton = None

if triton is not None:
    @triton.jit
    def triton_softcap_20(score, b, h, q_idx, kv_idx, ARGS):
        t = 1.0 - 2.0 / (tl.exp(score / 10.0) + 1.0)  # tanh(score / 20)
        return 20.0 * t, 1.0 - t * t


def _triton_softcap():
    pytest.importorskip("triton")
    return triton_softcap_20


def test_a_triton_function_as_score_mod(triton_backend):
    """A user's own triton.jit score_mod (value and derivative) runs on the kernels, forward
    and backward, as the translated torch function would."""
    q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
    out = flashtile.flex_attention(q, k, v, score_mod=_triton_softcap())
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref, _ = twin_flex.forward(*ref_in, mods.softcap(20.0), None, 0.25)
    want = torch.autograd.grad(ref.sum(), ref_in)
    assert (out.double() - ref).abs().max() < 1e-4
    for got, exp in zip(grads, want):
        assert (got.double() - exp).abs().max() < 1e-4


def test_a_triton_function_is_refused_on_the_twin():
    pytest.importorskip("triton")
    q = torch.randn(1, 2, 40, 16)
    with pytest.raises(TypeError, match="triton.jit score_mod/mask_mod runs on the kernels only"):
        flashtile.flex_attention(q, q, q, score_mod=_triton_softcap())


def test_torch_compile_runs_the_kernels_as_a_graph_break(triton_backend):
    q = torch.randn(1, 2, 64, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    bm = torch_flex.create_block_mask(mods.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    compiled = torch.compile(flashtile.flex_attention)
    out = compiled(q, k, v, score_mod=mods.softcap(5.0), block_mask=bm)
    (grad,) = torch.autograd.grad(out.sum(), q)
    want = flashtile.flex_attention(q, k, v, score_mod=mods.softcap(5.0), block_mask=bm)
    (want_grad,) = torch.autograd.grad(want.sum(), q)
    assert torch.equal(out, want) and torch.equal(grad, want_grad)


_ROW_BIAS = torch.linspace(-1.0, 1.0, 40)


def _row_only(score, b, h, q_idx, kv_idx):
    return _ROW_BIAS[q_idx] * 2.0


def _column_only(score, b, h, q_idx, kv_idx):
    return _ROW_BIAS[kv_idx]


@pytest.mark.parametrize("score_mod", [_row_only, _column_only], ids=["rows", "columns"])
def test_a_score_mod_of_the_indices_alone(triton_backend, score_mod):
    """A score_mod that ignores the score and varies along one axis: the kernels broadcast it
    to the tile (and q, k get no gradient)."""
    q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
    out = flashtile.flex_attention(q, k, v, score_mod=score_mod)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref, _ = twin_flex.forward(*ref_in, score_mod, None, 0.25)
    (want_dv,) = torch.autograd.grad(ref.sum(), ref_in[2:])
    assert (out.double() - ref).abs().max() < 1e-5
    assert grads[0].abs().max() == 0 and grads[1].abs().max() == 0
    assert (grads[2].double() - want_dv).abs().max() < 1e-5
