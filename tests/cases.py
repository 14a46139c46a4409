"""Test cases shared by the torch-path, interpreter and GPU tests of the forward APIs.

A ``Case`` describes one flash-attn-style call; ``check_flash_case`` runs it through
``flashtile.flash_attn_func`` and applies the accuracy rule (flashtile.testing) against a
float64 reference and plain PyTorch in the input dtype, for the output and the LSE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

import flashtile
from flashtile.testing import GRAD_FACTOR, assert_close, plain_attention

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Case:
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    causal: bool = False
    batch: int = 2
    nheads: int = 6
    nheads_k: int = 6
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None  # None, "heads" (nheads,), "batch" (batch, nheads)
    layout: str = "contiguous"  # contiguous | transposed | packed
    dist: str = "randn"  # randn | rand | q5 (q scaled by 5)
    scale: Optional[float] = None
    sink: Optional[str] = None  # None, "small" (below most rows' LSE), "large" (above many)
    chunk: int = 0  # attention_chunk (0: off)
    head_dim_v: int = 0  # v's head dim (0: head_dim)

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def id(self) -> str:
        parts = [f"B{self.batch}", f"H{self.nheads}-{self.nheads_k}", f"Q{self.seqlen_q}", f"K{self.seqlen_k}",
                 f"D{self.head_dim}", DTYPE_NAMES[self.dtype]]
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.alibi:
            parts.append(f"alibi-{self.alibi}")
        if self.layout != "contiguous":
            parts.append(self.layout)
        if self.dist != "randn":
            parts.append(self.dist)
        if self.sink:
            parts.append(f"sink-{self.sink}")
        if self.chunk:
            parts.append(f"chunk{self.chunk}")
        if self.head_dim_v:
            parts.append(f"V{self.head_dim_v}")
        return "-".join(parts)


def _draw(shape, dtype, device, dist, generator):
    if dist == "rand":
        return torch.rand(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)


def make_inputs(case: Case, device: str = "cpu", seed: int = 0):
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D) in the case's layout, and ALiBi slopes."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, Sq, Sk, H, Hk, D = case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_k, case.head_dim
    if case.dv != D:  # v of its own head dim: no packed qkv/kv tensor
        q = _draw((B, Sq, H, D), case.dtype, device, case.dist, g)
        k = _draw((B, Sk, Hk, D), case.dtype, device, case.dist, g)
        v = _draw((B, Sk, Hk, case.dv), case.dtype, device, case.dist, g)
        if case.layout == "transposed":
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    elif case.layout == "packed" and Sq == Sk and H == Hk:
        qkv = _draw((B, Sq, 3, H, D), case.dtype, device, case.dist, g)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    elif case.layout == "packed":
        q = _draw((B, Sq, H, D), case.dtype, device, case.dist, g)
        kv = _draw((B, Sk, 2, Hk, D), case.dtype, device, case.dist, g)
        k, v = kv[:, :, 0], kv[:, :, 1]
    elif case.layout == "transposed":
        q = _draw((B, H, Sq, D), case.dtype, device, case.dist, g).transpose(1, 2)
        k = _draw((B, Hk, Sk, D), case.dtype, device, case.dist, g).transpose(1, 2)
        v = _draw((B, Hk, Sk, D), case.dtype, device, case.dist, g).transpose(1, 2)
    else:
        q = _draw((B, Sq, H, D), case.dtype, device, case.dist, g)
        k = _draw((B, Sk, Hk, D), case.dtype, device, case.dist, g)
        v = _draw((B, Sk, Hk, D), case.dtype, device, case.dist, g)
    if case.dist == "q5":
        q = q * 5
    alibi = None
    if case.alibi == "heads":
        alibi = torch.rand((H,), generator=g, device=device) * 0.5
    elif case.alibi == "batch":
        alibi = torch.rand((B, H), generator=g, device=device) * 0.5
    return q, k, v, alibi


def make_sink(case: Case, device: str = "cpu", seed: int = 0) -> Optional[torch.Tensor]:
    """The case's (nheads,) float32 sinks: "small" ones barely move a row (a dropped sink
    could pass unnoticed, as in Transformer Engine's #2541); "large" ones, around a row's
    LSE (log Sk + 1/2 for unit scores) and above it, take much of many rows' weight."""
    if case.sink is None:
        return None
    g = torch.Generator(device=device).manual_seed(seed + 7)
    z = torch.randn((case.nheads,), generator=g, device=device)
    if case.sink == "small":
        return z * 0.5 - 2.0
    return z * 2.0 + math.log(max(case.seqlen_k, 1)) + 1.0


def reference(case: Case, q, k, v, alibi, dtype: torch.dtype, sink=None):
    """plain_attention in ``dtype`` on the canonical (B, H, S, D) views; returns (out BSHD, lse)."""
    scale = case.scale if case.scale is not None else 1.0 / math.sqrt(case.head_dim)
    left, right = case.window
    if case.causal:
        right = 0
    slopes = None
    if alibi is not None:
        slopes = alibi.expand(case.batch, case.nheads) if alibi.dim() == 1 else alibi
    out, lse = plain_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
        diag_offset=case.seqlen_k - case.seqlen_q, window_left=left, window_right=right,
        softcap=case.softcap, alibi_slopes=slopes, sink=sink, chunk=case.chunk, dtype=dtype,
    )
    return out.transpose(1, 2), lse


def check_flash_case(case: Case, device: str = "cpu", seed: int = 0):
    """Run ``flash_attn_func`` on the case and assert the accuracy rule for out and LSE."""
    q, k, v, alibi = make_inputs(case, device, seed)
    sink = make_sink(case, device, seed)
    out, lse, probs = flashtile.flash_attn_func(
        q, k, v, softmax_scale=case.scale, causal=case.causal, window_size=case.window,
        softcap=case.softcap, alibi_slopes=alibi, return_attn_probs=True, learnable_sink=sink,
        attention_chunk=case.chunk,
    )
    assert probs is None
    assert out.shape == (*q.shape[:3], case.dv) and out.dtype == q.dtype
    assert lse.shape == (case.batch, case.nheads, case.seqlen_q) and lse.dtype == torch.float32
    ref_out, ref_lse = reference(case, q, k, v, alibi, torch.float64, sink)
    base_out, base_lse = reference(case, q, k, v, alibi, case.dtype, sink)
    # float32 inputs: plain torch in float32 is the base; its LSE error is tiny but real.
    assert_close(f"{case.id} out", out, ref_out, base_out)
    assert_close(f"{case.id} lse", lse, ref_lse, base_lse)
    return out, lse


def _grads(fn, inputs, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def check_flash_grads(case: Case, device: str = "cpu", seed: int = 0, noncontiguous_dout: bool = True):
    """Gradients of ``flash_attn_func`` against float64 and plain-dtype references (QUALITY rule).

    One shared upstream gradient for the kernel and both references; with
    ``noncontiguous_dout`` it is a transposed view. With a sink its gradient is checked too.
    """
    q, k, v, alibi = make_inputs(case, device, seed)
    sink = make_sink(case, device, seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    dout = torch.randn((case.batch, case.nheads, case.seqlen_q, case.dv), generator=g, device=device,
                       dtype=torch.float32).to(case.dtype)
    dout = dout.transpose(1, 2) if noncontiguous_dout else dout.transpose(1, 2).contiguous()

    def kernel(q_, k_, v_, *sink_):
        return flashtile.flash_attn_func(q_, k_, v_, softmax_scale=case.scale, causal=case.causal,
                                         window_size=case.window, softcap=case.softcap, alibi_slopes=alibi,
                                         learnable_sink=sink_[0] if sink_ else None, attention_chunk=case.chunk)

    def ref_fn(dtype):
        return lambda q_, k_, v_, *sink_: reference(case, q_, k_, v_, alibi, dtype, *sink_)[0]

    inputs = (q, k, v) if sink is None else (q, k, v, sink)
    got = _grads(kernel, inputs, dout)
    ref = _grads(ref_fn(torch.float64), inputs, dout.double())
    base = _grads(ref_fn(case.dtype), inputs, dout)
    for name, a, r, b in zip(("dq", "dk", "dv", "dsink"), got[1:], ref[1:], base[1:]):
        assert a.shape == r.shape, (name, a.shape)
        assert a.dtype == (torch.float32 if name == "dsink" else case.dtype), (name, a.dtype)
        assert_close(f"{case.id} {name}", a, r, b, factor=GRAD_FACTOR)
    return got


def rotating_cases(head_dims, seq_pairs, heads) -> list[Case]:
    """fp16/bf16 x head dim x (seqlen_q, seqlen_k) x causal, batch 2, with the head
    grouping (``heads``: MHA, GQA, MQA pairs) and the layout rotating from case to case."""
    cases, n = [], 0
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in head_dims:
            for seqs in seq_pairs:
                for causal in (False, True):
                    h, hk = heads[n % 3]
                    layout = ("contiguous", "transposed", "packed")[(n // 3) % 3]
                    n += 1
                    cases.append(Case(*seqs, head_dim, dtype=dtype, causal=causal, batch=2, nheads=h, nheads_k=hk,
                                      layout=layout))
    return cases


def spy_calls(monkeypatch, module, name: str, calls: list | None = None) -> list:
    """Wrap ``module.name`` so that every call's keyword arguments are recorded (with the
    function's name under "fn"); returns the (live) list of records, ``calls`` if given (so
    two spies can share one). Launch plans are off while the spy is in place: a plan's
    replay calls the recorded kernels, not the Python function the spy wraps."""
    from flashtile.runtime import replay as plan

    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    plan.clear()
    calls = [] if calls is None else calls
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(dict(kwargs, fn=name))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls
