"""The accuracy rule of ../shared/QUALITY.md, defined once for tests and benchmarks.

A low-precision kernel is not held to a fixed atol: it is compared with how wrong plain
PyTorch is in the same precision::

    ref  = attention in float64 (float32 inputs) or float32+ (fp16/bf16) from the same inputs
    base = plain PyTorch attention in the input dtype
    pass iff max|out - ref| <= FORWARD_FACTOR * max|base - ref| + ABS_SLACK
             max|grad - ref_grad| <= GRAD_FACTOR * max|base_grad - ref_grad| + ABS_SLACK

NaN anywhere fails unless the reference has NaN at the same place; -inf (empty-row LSE)
must sit exactly where the reference has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FORWARD_FACTOR = 2.0
GRAD_FACTOR = 3.0
ABS_SLACK = 1e-5


@dataclass(frozen=True)
class Verdict:
    """Outcome of one comparison; ``ok`` is the rule, the numbers say by how much."""

    name: str
    ok: bool
    err: float
    base_err: float
    tol: float
    reason: str = ""

    def __str__(self) -> str:
        state = "ok" if self.ok else "FAIL"
        return f"{self.name}: {state} err={self.err:.3e} base_err={self.base_err:.3e} tol={self.tol:.3e} {self.reason}"


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    finite = torch.isfinite(ref)
    if not finite.any():
        return 0.0
    return (x.double()[finite] - ref.double()[finite]).abs().max().item()


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, base: Optional[torch.Tensor],
            factor: float = FORWARD_FACTOR) -> Verdict:
    """Apply the rule to ``out`` (kernel), ``ref`` (high precision), ``base`` (plain torch)."""
    out_d, ref_d = out.double(), ref.double()
    if out_d.shape != ref_d.shape:
        return Verdict(name, False, float("inf"), 0.0, 0.0, f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    bad_nan = torch.isnan(out_d) & ~torch.isnan(ref_d)
    if bad_nan.any():
        where = tuple(bad_nan.nonzero()[0].tolist())
        return Verdict(name, False, float("nan"), 0.0, 0.0, f"{int(bad_nan.sum())} NaN, first at {where}")
    inf_ref = torch.isinf(ref_d)
    if not torch.equal(torch.isinf(out_d) & ~torch.isnan(ref_d), inf_ref) or not torch.equal(out_d[inf_ref], ref_d[inf_ref]):
        return Verdict(name, False, float("inf"), 0.0, 0.0, "infinities differ from the reference")
    base_err = 0.0 if base is None else _max_err(base, ref_d)
    err = _max_err(out_d, ref_d)
    tol = factor * base_err + ABS_SLACK
    return Verdict(name, err <= tol, err, base_err, tol)


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, base: Optional[torch.Tensor],
                 factor: float = FORWARD_FACTOR) -> Verdict:
    """``compare`` that raises AssertionError with the numbers when the rule fails."""
    verdict = compare(name, out, ref, base, factor)
    assert verdict.ok, str(verdict)
    return verdict


def plain_attention(q, k, v, *, scale: float, diag_offset: int = 0, window_left: int = -1,
                    window_right: int = -1, softcap: float = 0.0, alibi_slopes=None, attn_mask=None,
                    sink=None, chunk: int = 0,
                    dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention the plain PyTorch way in ``dtype`` (default: q's), materialising (Sq, Sk).

    The "base" of the accuracy rule (in the input dtype) and, with ``dtype=torch.float64``,
    the reference. Same canonical semantics as the kernels: q (B, H, Sq, D), k/v
    (B, Hk, Sk, D), visibility window around ``diag_offset``, softcap, ALiBi (B, H),
    mask (B, H, Sq, Sk) bool or float, chunked attention (``chunk``), sinks (H,) (one more
    score column with no value row, as gpt-oss's eager attention does it). Returns (out
    (B, H, Sq, D), lse (B, H, Sq)), empty rows 0 / -inf (0 / sink with a sink).
    """
    from flashtile.backends.twin.attention import visible_mask

    dtype = dtype or q.dtype
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    kd = kd.repeat_interleave(group, dim=1)
    vd = vd.repeat_interleave(group, dim=1)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    s = (qd @ kd.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        s = s - alibi_slopes.to(dtype)[:, :, None, None] * (i + diag_offset - j).abs().to(dtype)
    keep = visible_mask(seqlen_q, seqlen_k, diag_offset, window_left, window_right, device=q.device, chunk=chunk)
    keep = keep.expand(s.shape)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            s = s + attn_mask.to(dtype)
    s = s.masked_fill(~keep, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.to(dtype).reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
        vd = torch.cat([vd, vd.new_zeros((*vd.shape[:2], 1, vd.shape[-1]))], dim=2)
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, dim=-1)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    # Only an empty row sums to exactly 0; a NaN sum must stay NaN (NaN in the data propagates).
    p = torch.where(denom != 0, e / torch.where(denom != 0, denom, torch.ones_like(denom)), torch.zeros_like(e))
    return p @ vd, lse
