"""Packed-sequence test cases: flash_attn_varlen_func against the float64 reference applied
sequence by sequence (and plain PyTorch in the input dtype, the base of QUALITY.md's rule)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

import flashtile
from flashtile.testing import GRAD_FACTOR, assert_close, plain_attention


@dataclass(frozen=True)
class VarlenCase:
    lens_q: tuple
    lens_k: Optional[tuple] = None  # None: the same as lens_q
    head_dim: int = 16
    dtype: torch.dtype = torch.float32
    nheads: int = 4
    nheads_k: int = 2
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    seqused_q: Optional[tuple] = None
    seqused_k: Optional[tuple] = None
    page_size: int = 0  # > 0: paged keys through a shuffled block table
    max_pad: int = 0  # added to max_seqlen_q/k (a loose bound is allowed)
    sink: bool = False  # (nheads,) learnable sinks, around the rows' LSE
    chunk: int = 0  # attention_chunk (0: off)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def keys(self) -> tuple:
        return self.lens_q if self.lens_k is None else self.lens_k

    @property
    def id(self) -> str:
        parts = [f"q{'-'.join(map(str, self.lens_q))}"]
        if self.lens_k is not None:
            parts.append(f"k{'-'.join(map(str, self.lens_k))}")
        parts.append(f"d{self.head_dim}")
        parts.append(str(self.dtype).replace("torch.", ""))
        parts.append(f"h{self.nheads}-{self.nheads_k}")
        for flag, name in ((self.causal, "causal"), (self.alibi, "alibi"), (self.seqused_q, "usedq"),
                           (self.seqused_k, "usedk")):
            if flag:
                parts.append(name)
        if self.window != (-1, -1):
            parts.append(f"w{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.page_size:
            parts.append(f"page{self.page_size}")
        if self.sink:
            parts.append("sink")
        if self.chunk:
            parts.append(f"chunk{self.chunk}")
        return "-".join(parts)


def cu_seqlens(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def make_inputs(case: VarlenCase, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(case.lens_q), sum(case.keys)
    q = torch.randn(tq, case.nheads, case.head_dim, generator=g).to(device, case.dtype)
    k = torch.randn(tk, case.nheads_k, case.head_dim, generator=g).to(device, case.dtype)
    v = torch.randn(tk, case.nheads_k, case.head_dim, generator=g).to(device, case.dtype)
    alibi = None
    if case.alibi:
        alibi = (torch.rand(len(case.lens_q), case.nheads, generator=g) * 0.3).to(device)
    return q, k, v, alibi


def make_sink(case: VarlenCase, device: str, seed: int = 0) -> Optional[torch.Tensor]:
    """(nheads,) float32 sinks around a row's LSE (log of a few keys) and above it."""
    if not case.sink:
        return None
    g = torch.Generator().manual_seed(seed + 11)
    return (torch.randn(case.nheads, generator=g) * 2.0 + 2.5).to(device)


def paginate(k, v, lens_k, page_size: int, seed: int = 0):
    """Paged copies of packed k/v: pages of each sequence scattered over a shuffled pool
    (plus two spare blocks), and the block table; returns (k_pages, v_pages, table, where)
    with ``where[t] = (block, offset)`` of packed key row t."""
    g = torch.Generator().manual_seed(seed + 1)
    pages = [math.ceil(n / page_size) for n in lens_k]
    max_blocks = max(max(pages, default=0), 1)
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(lens_k), max_blocks, dtype=torch.int32)
    kp = torch.randn(num_blocks, page_size, *k.shape[1:], generator=g).to(k.device, k.dtype)
    vp = torch.randn(num_blocks, page_size, *v.shape[1:], generator=g).to(v.device, v.dtype)
    where, row, nxt = [], 0, 0
    for b, n in enumerate(lens_k):
        for p in range(pages[b]):
            table[b, p] = order[nxt]
            nxt += 1
        # slots past the pages hold any valid block (flash-attn leaves them unspecified)
        table[b, pages[b]:] = order[-1]
        for t in range(n):
            blk, off = int(table[b, t // page_size]), t % page_size
            kp[blk, off] = k[row + t]
            vp[blk, off] = v[row + t]
            where.append((blk, off))
        row += n
    return kp, vp, table.to(k.device), where


def reference(case: VarlenCase, q, k, v, alibi, dtype, sink=None):
    """Packed out (total_q, H, D) and lse (H, total_q): plain attention in ``dtype`` on each
    sequence's used part; unused rows 0 / -inf (a used row with no key: 0 / the sink).
    Differentiable."""
    cu_q, cu_k = cu_seqlens(case.lens_q, "cpu").tolist(), cu_seqlens(case.keys, "cpu").tolist()
    left, right = case.window
    if case.causal:
        right = 0
    scale = 1.0 / math.sqrt(case.head_dim)
    outs, lses = [], []
    for b in range(len(case.lens_q)):
        lq = case.lens_q[b] if case.seqused_q is None else case.seqused_q[b]
        lk = case.keys[b] if case.seqused_k is None else case.seqused_k[b]
        qb = q[cu_q[b]:cu_q[b] + lq].transpose(0, 1).unsqueeze(0)
        kb = k[cu_k[b]:cu_k[b] + lk].transpose(0, 1).unsqueeze(0)
        vb = v[cu_k[b]:cu_k[b] + lk].transpose(0, 1).unsqueeze(0)
        if lq and lk:
            o, lse = plain_attention(qb, kb, vb, scale=scale, diag_offset=lk - lq, window_left=left,
                                     window_right=right, softcap=case.softcap,
                                     alibi_slopes=None if alibi is None else alibi[b:b + 1], sink=sink,
                                     chunk=case.chunk, dtype=dtype)
        else:
            o = qb.new_zeros(qb.shape, dtype=dtype)
            lse = torch.full(qb.shape[:3], float("-inf"), dtype=torch.float64 if dtype == torch.float64
                             else torch.float32, device=q.device)
            if sink is not None:
                lse = sink.to(lse.dtype)[None, :, None].expand(qb.shape[:3])
        rest = case.lens_q[b] - lq
        outs += [o[0].transpose(0, 1).to(dtype), q.new_zeros((rest, *q.shape[1:]), dtype=dtype)]
        lses += [lse[0].double(), torch.full((q.shape[1], rest), float("-inf"), dtype=torch.float64,
                                             device=q.device)]
    return torch.cat(outs), torch.cat(lses, dim=1)


def run_varlen(case: VarlenCase, q, k, v, alibi, paged=None, **kwargs):
    """The call under test: returns (out, lse)."""
    device = q.device
    max_q = max(case.lens_q, default=0) + case.max_pad
    max_k = max(case.keys, default=0) + case.max_pad
    used = {}
    if case.seqused_q is not None:
        used["seqused_q"] = torch.tensor(case.seqused_q, dtype=torch.int32, device=device)
    if case.seqused_k is not None:
        used["seqused_k"] = torch.tensor(case.seqused_k, dtype=torch.int32, device=device)
    kk, vv, table = (k, v, None) if paged is None else paged
    out, lse, _ = flashtile.flash_attn_varlen_func(
        q, kk, vv, cu_seqlens(case.lens_q, device), cu_seqlens(case.keys, device), max_q, max_k,
        causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=alibi,
        return_attn_probs=True, block_table=table, attention_chunk=case.chunk, **used, **kwargs)
    return out, lse


def check_varlen(case: VarlenCase, device: str = "cpu", grads: bool = True, seed: int = 0):
    """Forward (and gradients) of one case under the accuracy rule; returns the outputs
    (out, lse[, dq, dk, dv]) for further checks."""
    q, k, v, alibi = make_inputs(case, device, seed)
    paged = None
    if case.page_size:
        kp, vp, table, where = paginate(k, v, case.keys, case.page_size, seed)
        paged = (kp, vp, table)
    leaves = [q] + ([k, v] if paged is None else [paged[0], paged[1]])
    leaves = [t.detach().requires_grad_(grads) for t in leaves]
    q_, k_, v_ = leaves
    if paged is not None:
        paged = (k_, v_, table)
    sink = make_sink(case, device, seed)
    sinks = {}
    if sink is not None:
        sinks = dict(got=sink.detach().requires_grad_(grads), ref=sink.detach().double().requires_grad_(grads),
                     base=sink.detach().requires_grad_(grads))
    out, lse = run_varlen(case, q_, k_, v_, alibi, paged, learnable_sink=sinks.get("got"))
    ref_dtype = torch.float64
    qr, kr, vr = (t.detach().double().requires_grad_(grads) for t in (q, k, v))
    qb, kb, vb = (t.detach().requires_grad_(grads) for t in (q, k, v))
    ref_out, ref_lse = reference(case, qr, kr, vr, alibi, ref_dtype, sinks.get("ref"))
    base_out, base_lse = reference(case, qb, kb, vb, alibi, case.dtype, sinks.get("base"))
    assert_close("out", out, ref_out, base_out)
    assert_close("lse", lse, ref_lse, base_lse)
    if not grads:
        return out, lse
    gen = torch.Generator().manual_seed(seed + 7)
    dout = torch.randn(out.shape, generator=gen).to(device, case.dtype)
    extra = (("got", "ref", "base") if sink is not None else ())
    got = torch.autograd.grad(out, leaves + [sinks[n] for n in extra[:1]], dout, allow_unused=False)
    want = torch.autograd.grad(ref_out, (qr, kr, vr, *[sinks[n] for n in extra[1:2]]), dout.double())
    base = torch.autograd.grad(base_out, (qb, kb, vb, *[sinks[n] for n in extra[2:]]), dout)
    if sink is not None:
        assert_close("dsink", got[3], want[3], base[3], GRAD_FACTOR)
        got, want, base = got[:3], want[:3], base[:3]
    dq, dk, dv = got
    if paged is not None:
        # gradients of the pages: each packed key row's slot, and zeros everywhere else
        rows = torch.tensor([b for b, _ in where], dtype=torch.long)
        offs = torch.tensor([o for _, o in where], dtype=torch.long)
        used = torch.zeros(dk.shape[:2], dtype=torch.bool, device=dk.device)
        used[rows, offs] = True
        for name, d in (("dk_pages", dk), ("dv_pages", dv)):
            assert torch.equal(d[~used], torch.zeros_like(d[~used])), f"{name}: unused slots got gradient"
        dk, dv = dk[rows, offs], dv[rows, offs]
    for name, x, w, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want, base):
        assert_close(name, x, w, b, GRAD_FACTOR)
    return out, lse, dq, dk, dv
