"""Dispatch of the canonical problem (see ``flashtile.backends.triton.forward``) to a backend: the
Triton kernels through ``flashtile.autograd``, or the chunked torch twin."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class _Problem:
    """The canonical attention problem (see module docstring)."""

    scale: float
    diag_offset: int
    window_left: int
    window_right: int
    softcap: float
    dropout_p: float = 0.0
    deterministic: bool = False


def _backend_for(device: torch.device) -> str:
    choice = os.environ.get("FLASHTILE_BACKEND", "auto").strip().lower() or "auto"
    if choice not in _BACKENDS:
        raise ValueError(f"FLASHTILE_BACKEND must be one of {_BACKENDS}, got {choice!r}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"FLASHTILE_BACKEND=triton needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors; got device {device}"
        )
    return choice


def _torch_path(q4, k4, v4, problem: _Problem, alibi, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked torch twin; plain differentiable torch code, so autograd traces it."""
    from flashtile import autograd as ops
    from flashtile.backends.twin.attention import chunked_attention_forward

    out, lse = chunked_attention_forward(
        q4, k4, v4, scale=problem.scale, diag_offset=problem.diag_offset,
        window_left=problem.window_left, window_right=problem.window_right,
        softcap=problem.softcap, alibi_slopes=alibi, attn_mask=mask, dropout_p=problem.dropout_p,
    )
    if torch.is_grad_enabled() and out.requires_grad:
        return out.to(q4.dtype).transpose(1, 2).contiguous().transpose(1, 2), lse.to(torch.float32)
    out4 = ops._bshd_view(q4)
    lse_out = ops._new_lse(q4)
    out4.copy_(out)
    lse_out.copy_(lse)
    return out4, lse_out


def host_spans(varlen) -> list[tuple[int, int, int, int]]:
    """(q start, q length, k start, k length) of every sequence of a varlen call, its
    lengths cut to seqused, read on the host (one copy per tensor): for the torch twin and
    S_dmask, never for the kernels."""
    cu_q, cu_k, used_q, used_k = (None if t is None else t.tolist() for t in varlen[:4])
    spans = []
    for b in range(len(cu_q) - 1):
        len_q, len_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if used_q is not None:
            len_q = min(used_q[b], len_q)
        if used_k is not None:
            len_k = min(used_k[b], len_k)
        spans.append((cu_q[b], len_q, cu_k[b], len_k))
    return spans


def _torch_varlen_path(q4, k4, v4, problem: _Problem, alibi, varlen) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of a packed call: the chunked twin once per sequence (its bounds read
    on the host: CPU tensors), rows past a sequence's used length 0 / -inf. Differentiable."""
    from flashtile.backends.twin.attention import chunked_attention_forward

    heads, total_q, dim = q4.shape[1], q4.shape[2], q4.shape[3]
    outs, lses, row = [], [], 0

    def gap(start, end):
        # Rows that see no key: 0 / -inf, still in q's graph (zero gradient, as the kernels).
        rows = q4[:, :, start:end]
        outs.append(torch.where(torch.zeros((), dtype=torch.bool, device=q4.device), rows, 0.0))
        lses.append(torch.full((1, heads, end - start), float("-inf"), device=q4.device))

    for b, (start_q, len_q, start_k, len_k) in enumerate(host_spans(varlen)):
        if start_q > row:
            gap(row, start_q)
        if len_k == 0:
            row = start_q  # every row of this sequence is empty: a gap, below or at the next one
            continue
        out, lse = chunked_attention_forward(
            q4[:, :, start_q:start_q + len_q], k4[:, :, start_k:start_k + len_k], v4[:, :, start_k:start_k + len_k],
            scale=problem.scale, diag_offset=len_k - len_q, window_left=problem.window_left,
            window_right=problem.window_right, softcap=problem.softcap,
            alibi_slopes=None if alibi is None else alibi[b:b + 1], dropout_p=problem.dropout_p)
        outs.append(out.to(q4.dtype))
        lses.append(lse.to(torch.float32))
        row = start_q + len_q
    if total_q > row or not outs:
        gap(row, total_q)
    out = torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous().transpose(1, 2), torch.cat(lses, dim=2)


def _attention(q, k, v, problem: _Problem, alibi, mask, varlen: tuple = (),
               seed=None, hint=None, layout: str = "bhsd") -> tuple[torch.Tensor, torch.Tensor]:
    """Run the canonical problem on q, k, v given in ``layout`` (``autograd.LAYOUTS``: by
    default (B, H, S, D) views): out in the same layout, laid out as (B, Sq, H, D) in
    memory, and lse (B, H, Sq).

    ``varlen``: empty, or (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
    max_seqlen_k) of a validated packed call (B = 1; the diagonal is per sequence).
    ``seed``: the dropout's Philox key when the caller needs to know it (S_dmask); drawn
    here otherwise. ``hint``: the caller's plan entry (``autograd.attention``).
    """
    from flashtile import autograd  # registers torch.ops.flashtile on first use

    if _backend_for(q.device) == "torch":
        q4, k4, v4 = (autograd._canonical(t, layout) for t in (q, k, v))
        if varlen:
            out4, lse = _torch_varlen_path(q4, k4, v4, problem, alibi, varlen)
        else:
            out4, lse = _torch_path(q4, k4, v4, problem, alibi, mask)
        return autograd._from_bshd(out4.transpose(1, 2), layout), lse

    if alibi is not None and alibi.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "alibi_slopes requires grad: the Triton kernels do not compute slope gradients; detach the slopes, "
            "or run on CPU tensors where the torch path differentiates them")
    if mask is not None and mask.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "attn_mask requires grad: the Triton kernels do not compute mask gradients (that would need an "
            "(L, S) gradient); detach the mask, or run on CPU tensors where the torch path differentiates it")
    if problem.dropout_p > 0.0 and seed is None:
        seed = new_seed(q.device)
    return autograd.attention(
        q, k, v, problem.scale, problem.diag_offset, problem.window_left, problem.window_right,
        problem.softcap, alibi, mask, problem.dropout_p, seed,
        problem.deterministic or torch.are_deterministic_algorithms_enabled(), tuple(varlen), hint, layout)


def attention_with_probs(q, k, v, problem: _Problem, alibi, varlen: tuple = (), want_probs: bool = False,
                         hint=None, layout: str = "bhsd"):
    """``_attention`` for the flash-attn functions: (out, lse, S_dmask or None), q, k, v and
    out in ``layout``. With ``want_probs`` and dropout, the Philox key is drawn here so that
    S_dmask (``_probs.dropout_probs``) redraws the kernels' own mask; the twin cannot
    (torch.rand)."""
    seed = None
    want_mask = want_probs and problem.dropout_p > 0.0
    if want_mask:
        if _backend_for(q.device) == "torch":
            raise NotImplementedError(
                "return_attn_probs=True with dropout_p > 0 reports the Triton kernels' Philox mask; the torch twin "
                "(CPU tensors) draws its mask with torch.rand. Run on CUDA tensors, or on CPU tensors with "
                "FLASHTILE_BACKEND=triton and TRITON_INTERPRET=1")
        seed = new_seed(q.device)
    out, lse = _attention(q, k, v, problem, alibi, None, varlen, seed, hint, layout)
    probs = None
    if want_mask:
        from flashtile import autograd
        from flashtile.backends.probs import dropout_probs

        probs = dropout_probs(autograd._canonical(q, layout), autograd._canonical(k, layout), problem, alibi, seed,
                              varlen)
    return out, lse, probs


def new_seed(device) -> torch.Tensor:
    """A dropout Philox key from torch's generator of ``device``: torch.manual_seed makes the
    mask reproducible, and the backward redraws the same mask from the same key."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
