"""torch.library registration of the Triton kernels, and their autograd formula.

The public functions in ``flashtile.api`` validate their arguments and then call
``torch.ops.flashtile.attn_fwd``: a custom op with a fake (meta) implementation, so
``torch.compile(fullgraph=True)`` traces straight through it, and a registered backward
(``torch.ops.flashtile.attn_bwd``). Launch configurations are chosen inside the ops at
run time, never at trace time.

Canonical layout at this boundary: q, k, v are (B, H, S, D) views with unit stride along
D (as ``flashtile.backends.triton.forward`` describes). Outputs are plain tensors: out and the
gradients come back laid out (B, S, H, D) (flash-attn's layout; callers transpose the
view), lse is (B, H, Sq) float32. ``attention``, what the API calls, also takes q, k, v in
flash-attn's (B, S, H, D) or a packed call's (total, H, D) layout (``LAYOUTS``) and gives
out back in it, converting inside the autograd node of a training call.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from functools import partial
from typing import Optional

import torch
import torch.autograd.forward_ad as fwad
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from flashtile.runtime import replay as plan


def _device_capability(t: Tensor) -> Optional[tuple[int, int]]:
    if t.device.type != "cuda":
        return None  # the Triton interpreter on CPU tensors
    from flashtile.backends.configs import cuda_capability, device_index

    return cuda_capability(device_index(t.device))


def _bshd_view(t: Tensor) -> Tensor:
    """(B, H, S, D) view of a new (B, S, H, D) buffer shaped like ``t``."""
    b, h, s, d = t.shape
    return t.new_empty((b, s, h, d)).transpose(1, 2)


# The layouts ``attention`` takes q, k, v in and gives out back in: the canonical one
# ("bhsd": (B, H, S, D) views, as the op), flash-attn's ("bshd": (B, S, H, D)) and a packed
# varlen call's ("thd": (total, H, D), one sequence of all the tokens). A training call's
# conversions happen inside its autograd node: as views outside it, each was a node of its
# own that the backward also ran (five per flash_attn_func call; H200 run 90).
LAYOUTS = ("bhsd", "bshd", "thd")


def _canonical(t: Tensor, layout: str) -> Tensor:
    """A q, k or v given in ``layout`` as the (B, H, S, D) view the kernels take."""
    if layout == "bshd":
        return t.transpose(1, 2)
    if layout == "thd":
        return t.unsqueeze(0).transpose(1, 2)
    return t


def _to_bshd(t: Tensor, layout: str) -> Tensor:
    """An out (or its gradient) given in ``layout`` as (B, S, H, D)."""
    if layout == "bshd":
        return t
    if layout == "thd":
        return t.unsqueeze(0)
    return t.transpose(1, 2)


def _from_bshd(t: Tensor, layout: str) -> Tensor:
    """A (B, S, H, D) result (out, or a gradient of q, k, v) in ``layout``."""
    if layout == "bshd":
        return t
    if layout == "thd":
        return t.squeeze(0)
    return t.transpose(1, 2)


def _new_lse(t: Tensor) -> Tensor:
    """(B, H, Sq) float32 log-sum-exp buffer for q of shape (B, H, Sq, D)."""
    return torch.empty(t.shape[:3], dtype=torch.float32, device=t.device)


def _check_grid(num_programs: int) -> None:
    if num_programs > 2**31 - 1:
        raise ValueError(f"batch x heads x blocks = {num_programs} exceeds the grid limit 2^31 - 1")


def _varlen(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k):
    """The ``backends.worklist.Varlen`` of a packed call (None for a fixed-length one)."""
    if cu_seqlens_q is None:
        return None
    from flashtile.backends.worklist import Varlen

    return Varlen(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)


_FWD_PLANS = plan.cache("attn_fwd")
_BWD_PLANS = plan.cache("attn_bwd")


def _attn_fwd_impl(q: Tensor, k: Tensor, v: Tensor, scale: float, diag_offset: int, window_left: int,
                   window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                   attn_mask: Optional[Tensor], dropout_p: float = 0.0,
                   seed: Optional[Tensor] = None, deterministic: bool = False,
                   cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                   seqused_q: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
                   max_seqlen_q: int = 0, max_seqlen_k: int = 0) -> tuple[Tensor, Tensor]:
    """Forward kernel: returns out (B, Sq, H, D) and lse (B, H, Sq) float32; a repeated
    call replays its launch plan (``flashtile.runtime.replay``), a new one runs ``_attn_fwd_run``.

    ``seed`` is a 1-element int64 tensor on q's device, the Philox key of the dropout mask.
    ``deterministic`` only matters to the backward (it forbids the atomic dQ variant).
    ``cu_seqlens_q`` (and the five after it) make it a packed varlen call: q (1, H, total_q,
    D), k/v (1, Hk, total_k, D), int32 (batch + 1) offsets, optional int32 (batch,) used
    lengths, and the longest sequences; ``diag_offset`` is then per sequence (len_k - len_q).
    """
    args = (q, k, v, scale, diag_offset, window_left, window_right, softcap, alibi_slopes, attn_mask, dropout_p, seed,
            deterministic, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    return _attn_fwd_planned(_fwd_entry(args), args)


# The forward's and the backward's arguments in full: (q, k, v, scale, diag_offset,
# window_left, window_right, softcap, alibi_slopes, attn_mask, dropout_p, seed,
# deterministic, *varlen) and (dout, q, k, v, out, lse, <the same from scale to
# deterministic>, dlse, *varlen); a fixed-length call leaves the six varlen ones out.
_NO_VARLEN = (None, None, None, None, 0, 0)


def _fwd_inputs(args: tuple) -> tuple:
    return (*args[0:3], args[8], args[9], args[11], *args[13:17])


def _fwd_key(args: tuple):
    return plan.make_key(_fwd_inputs(args), (*args[3:8], args[10], bool(args[12]), *args[17:19]))


def _bwd_inputs(args: tuple) -> tuple:
    return (*args[0:6], args[11], args[12], args[14], *args[16:21])


def _bwd_key(args: tuple):
    return plan.make_key(_bwd_inputs(args), (*args[6:11], args[13], bool(args[15]), *args[21:23]))


def _fwd_entry(args: tuple):
    """The forward's plan entry for these (full) arguments, or None when not planned."""
    key = _fwd_key(args)
    return None if key is None else _FWD_PLANS.entry(key, _fwd_inputs(args))


def _attn_fwd_planned(entry, args: tuple) -> tuple[Tensor, Tensor]:
    """``_attn_fwd_impl`` on full arguments with the key's entry already found (None: not
    planned, the ordinary path)."""
    if entry is None:
        return _attn_fwd_run(*args)
    return plan.run(entry, _fwd_inputs(args), lambda: _attn_fwd_run(*args))


def _attn_bwd_planned(fwd_entry, *args) -> tuple[Tensor, Tensor, Tensor]:
    """``_attn_bwd_impl`` for the backward of a planned forward: its key is the forward's
    plus what only the backward brings (dout, dlse, the switches), so the entry is found in
    the forward entry's ``below`` without making the full key."""
    args = args + _NO_VARLEN[len(args) - 17:]
    if plan.active_recorder() is not None:  # inside another call's recording: never planned
        return _attn_bwd_run(*args)
    dout, dlse = args[0], args[16]
    small = (plan.env_key(), plan.tensor_key(dout), plan.tensor_key(dlse))
    entry = fwd_entry.below.get(small)
    if entry is None:
        key = _bwd_key(args)
        if key is None:  # something traces this backward: the ordinary path, this time
            return _attn_bwd_run(*args)
        entry = fwd_entry.below[small] = _BWD_PLANS.entry(key, _bwd_inputs(args))
    return plan.run(entry, _bwd_inputs(args), lambda: _attn_bwd_run(*args))


def _attn_fwd_run(q, k, v, scale, diag_offset, window_left, window_right, softcap, alibi_slopes, attn_mask,
                  dropout_p, seed, deterministic, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                  max_seqlen_k) -> tuple[Tensor, Tensor]:
    """The forward's ordinary path: config, buffers, launches (``_attn_fwd_impl``'s arguments)."""
    from flashtile.backends import configs
    from flashtile.backends.triton.forward import attention_forward

    if q.dtype == torch.bfloat16 and q.device.type != "cuda":
        raise TypeError("bfloat16 cannot run under TRITON_INTERPRET=1 (triton 3.6's interpreter has no bf16 arithmetic)")
    batch, nheads, seqlen_q, head_dim = q.shape
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    out = q.new_empty((batch, seqlen_q, nheads, head_dim))  # returned as it is: not a view
    out4 = out.transpose(1, 2)
    lse = _new_lse(q)
    if out4.numel() == 0 or k.shape[2] == 0 or (varlen is not None and varlen.batch == 0):
        # No keys at all: every row is empty (output 0, LSE -inf), as in the kernel.
        return out.zero_(), lse.fill_(float("-inf"))
    if varlen is not None and (seqused_q is not None or seqused_k is not None):
        # Rows past a sequence's used length belong to no work item.
        out4.zero_()
        lse.fill_(float("-inf"))
    capability = _device_capability(q)
    rows = seqlen_q if varlen is None else max_seqlen_q
    if capability is None:
        config = configs.INTERPRETER_FWD
    else:
        config = configs.default_fwd_config(capability, head_dim, str(q.dtype).replace("torch.", ""),
                                            window_right >= 0, rows, attn_mask is not None)
    if varlen is None:
        _check_grid(-(-seqlen_q // config.block_m) * batch * nheads)
    else:
        _check_grid(varlen.batch * (-(-max_seqlen_q // config.block_m)) * nheads)
    problem = dict(scale=scale, diag_offset=diag_offset, window_left=window_left, window_right=window_right,
                   softcap=softcap, alibi_slopes=alibi_slopes, attn_mask=attn_mask)
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        if capability is not None and configs.autotune_enabled(None) and dropout_p == 0.0 and varlen is None:
            config = _autotune(q, k, v, out4, lse, problem, config)  # on q's device, as the launch
        attention_forward(q, k, v, out4, lse, config=config, dropout_p=dropout_p, seed=seed, varlen=varlen,
                          **problem)
    return out, lse


@torch.library.custom_op("flashtile::attn_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, diag_offset: int, window_left: int,
             window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
             attn_mask: Optional[Tensor], dropout_p: float = 0.0,
             seed: Optional[Tensor] = None, deterministic: bool = False,
             cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
             seqused_q: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
             max_seqlen_q: int = 0, max_seqlen_k: int = 0) -> tuple[Tensor, Tensor]:
    """The forward as a torch.library op (what torch.compile traces): see ``_attn_fwd_impl``."""
    return _attn_fwd_impl(q, k, v, scale, diag_offset, window_left, window_right, softcap, alibi_slopes,
                          attn_mask, dropout_p, seed, deterministic, cu_seqlens_q, cu_seqlens_k, seqused_q,
                          seqused_k, max_seqlen_q, max_seqlen_k)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, scale, diag_offset, window_left, window_right, softcap, alibi_slopes, attn_mask,
                   dropout_p=0.0, seed=None, deterministic=False, cu_seqlens_q=None, cu_seqlens_k=None,
                   seqused_q=None, seqused_k=None, max_seqlen_q=0, max_seqlen_k=0):
    batch, nheads, seqlen_q, head_dim = q.shape
    return (q.new_empty((batch, seqlen_q, nheads, head_dim)),
            q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))


def _attn_bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                   diag_offset: int, window_left: int, window_right: int, softcap: float,
                   alibi_slopes: Optional[Tensor], attn_mask: Optional[Tensor], dropout_p: float = 0.0,
                   seed: Optional[Tensor] = None, deterministic: bool = False,
                   dlse: Optional[Tensor] = None,
                   cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                   seqused_q: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
                   max_seqlen_q: int = 0, max_seqlen_k: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Backward kernels. dout/out are (B, Sq, H, D); returns dq (B, Sq, H, D), dk/dv (B, Sk, Hk, D).

    ``dlse`` (B, H, Sq), the gradient reaching the returned LSE (a z-loss, say), is folded
    into the kernels' Delta: d lse / d s_j = p_j, so dS_j = p_j (dP_j - (Delta - dlse)).
    The varlen arguments are the forward's (B = 1, packed sequences). Planned as the forward.
    """
    args = (dout, q, k, v, out, lse, scale, diag_offset, window_left, window_right, softcap, alibi_slopes, attn_mask,
            dropout_p, seed, deterministic, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
            max_seqlen_k)
    return plan.call(_BWD_PLANS, _bwd_key(args), _bwd_inputs(args), lambda: _attn_bwd_run(*args))


def _attn_bwd_run(dout, q, k, v, out, lse, scale, diag_offset, window_left, window_right, softcap, alibi_slopes,
                  attn_mask, dropout_p, seed, deterministic, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                  max_seqlen_q, max_seqlen_k) -> tuple[Tensor, Tensor, Tensor]:
    """The backward's ordinary path (``_attn_bwd_impl``'s arguments)."""
    from flashtile.backends import configs
    from flashtile.backends.triton.backward import attention_backward

    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    dq4, dk4, dv4 = _bshd_view(q), _bshd_view(k), _bshd_view(v)
    if q.numel() == 0 or k.numel() == 0 or (varlen is not None and varlen.batch == 0):
        return dq4.transpose(1, 2).zero_(), dk4.transpose(1, 2).zero_(), dv4.transpose(1, 2).zero_()
    if varlen is not None and (seqused_q is not None or seqused_k is not None):
        for t in (dq4, dk4, dv4):  # rows and keys past the used lengths get no program
            t.zero_()
    if dout.dtype != out.dtype:  # autograd casts; a direct op call might not (tl.dot needs one dtype)
        dout = dout.to(out.dtype)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    capability = _device_capability(q)
    if capability is None:
        config = replace(configs.INTERPRETER_BWD, fused_dq=configs.bwd_dq_mode(deterministic) == "atomic")
    else:
        config = configs.default_bwd_config(
            capability, q.shape[-1], str(q.dtype).replace("torch.", ""), deterministic,
            tile_masks=window_left >= 0 or window_right >= 0 or attn_mask is not None)
    if varlen is None:
        _check_grid(-(-q.shape[2] // config.block_m_q) * q.shape[0] * q.shape[1])
    else:
        _check_grid(varlen.batch * (-(-max_seqlen_q // config.block_m_q)) * q.shape[1])
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        attention_backward(q, k, v, out.transpose(1, 2), lse, dout.transpose(1, 2), dq4, dk4, dv4,
                           scale=scale, diag_offset=diag_offset, window_left=window_left,
                           window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes,
                           attn_mask=attn_mask, config=config, dropout_p=dropout_p, seed=seed, dlse=dlse,
                           varlen=varlen, deterministic=deterministic)
    return dq4.transpose(1, 2), dk4.transpose(1, 2), dv4.transpose(1, 2)


@torch.library.custom_op("flashtile::attn_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
             diag_offset: int, window_left: int, window_right: int, softcap: float,
             alibi_slopes: Optional[Tensor], attn_mask: Optional[Tensor], dropout_p: float = 0.0,
             seed: Optional[Tensor] = None, deterministic: bool = False,
             dlse: Optional[Tensor] = None,
             cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
             seqused_q: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
             max_seqlen_q: int = 0, max_seqlen_k: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """The backward as a torch.library op: see ``_attn_bwd_impl``."""
    return _attn_bwd_impl(dout, q, k, v, out, lse, scale, diag_offset, window_left, window_right, softcap,
                          alibi_slopes, attn_mask, dropout_p, seed, deterministic, dlse, cu_seqlens_q,
                          cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, scale, diag_offset, window_left, window_right, softcap,
                   alibi_slopes, attn_mask, dropout_p=0.0, seed=None, deterministic=False, dlse=None,
                   cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=0,
                   max_seqlen_k=0):
    def bshd(t):
        b, h, s, d = t.shape
        return t.new_empty((b, s, h, d))

    return bshd(q), bshd(k), bshd(v)


def _setup_context(ctx, inputs, output):
    (q, k, v, scale, diag_offset, window_left, window_right, softcap, alibi_slopes, attn_mask, dropout_p, seed,
     deterministic) = inputs[:13]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.problem = (scale, diag_offset, window_left, window_right, softcap)
    # Non-differentiable extras: kept as plain references (no gradient flows to them).
    ctx.alibi_slopes = alibi_slopes
    ctx.attn_mask = attn_mask
    ctx.dropout = (dropout_p, seed, deterministic)
    ctx.varlen = tuple(inputs[13:])  # cu_seqlens_q/k, seqused_q/k, max_seqlen_q/k (a varlen call)
    ctx.num_inputs = len(inputs)


def _grads(ctx, dout, dlse, bwd):
    # The op's q, k, v are (B, H, S, D) views and its out (B, S, H, D); the eager Function's
    # q, k, v and out are all in the caller's layout (ctx.layout).
    layout = getattr(ctx, "layout", None)
    q, k, v, out, lse = ctx.saved_tensors
    if layout is not None:
        q, k, v = (_canonical(t, layout) for t in (q, k, v))
        out = _to_bshd(out, layout)
        dout = None if dout is None else _to_bshd(dout, layout)
    if dout is None:  # only the LSE was used downstream
        dout = torch.zeros_like(out)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, *ctx.problem, ctx.alibi_slopes, ctx.attn_mask, *ctx.dropout, dlse,
                     *ctx.varlen)
    # The backward returns (B, S, H, D), each gradient goes back in its input's layout.
    layout = layout or "bhsd"
    return tuple(_from_bshd(g, layout) for g in (dq, dk, dv)) + (None,) * (ctx.num_inputs - 3)


def _backward(ctx, dout, dlse):
    return _grads(ctx, dout, dlse, torch.ops.flashtile.attn_bwd)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same forward, saved tensors and backward as the op's registered autograd, without
    the custom-op dispatch (measured on CPU, kernels stubbed: ~50 us of host time per
    training call; short sequences are launch-bound on the GPU).

    ``forward`` takes ctx itself: a separate ``setup_context`` makes every ``apply`` bind
    its arguments with ``inspect.signature`` (torch 2.11-2.13; ~25 us of the device host's
    time per call, H200 run 50). Only plain eager calls come here (``_plain_eager``: no
    functorch transform, which would need ``setup_context``)."""

    @staticmethod
    def forward(ctx, hint, layout, *inputs):
        # q, k, v come in ``layout`` and out goes back in it (``LAYOUTS``). The forward's
        # plan entry is kept in ``hint.below`` when the caller has a hint (``attention``),
        # else found here; the backward finds its own entry below it.
        args = tuple(_canonical(t, layout) for t in inputs[:3]) + inputs[3:] + _NO_VARLEN[len(inputs) - 13:]
        entry = None if hint is None else hint.below.get("attn_fwd")
        if entry is None:
            entry = _fwd_entry(args)
            if hint is not None and entry is not None:
                hint.below["attn_fwd"] = entry
        out, lse = _attn_fwd_planned(entry, args)
        out = _from_bshd(out, layout)
        # An unused LSE (or out) arrives as None and skips the Delta update; the op's
        # autograd passes zeros instead. Same gradients either way.
        ctx.set_materialize_grads(False)
        _setup_context(ctx, inputs, (out, lse))
        ctx.entry, ctx.layout = entry, layout
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # create_graph=True: go through the op, whose missing autograd formula makes a
        # double backward raise instead of treating the kernels' output as constant; a
        # traced backward (compiled autograd) also needs the op and its fake kernel.
        if torch.is_grad_enabled() or not _plain_eager(dout, dlse):
            bwd = torch.ops.flashtile.attn_bwd
        elif ctx.entry is not None:
            bwd = partial(_attn_bwd_planned, ctx.entry)
        else:
            bwd = _attn_bwd_impl
        return (None, None) + _grads(ctx, dout, dlse, bwd)


def _refuse_forward_ad(*tensors) -> None:
    """Forward-mode AD (jvp) has no rule here; without this check the tangent of the
    output would silently be missing."""
    if getattr(fwad, "_current_level", -1) < 0:
        return
    if any(t is not None and fwad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError("forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) is not supported "
                                  "by flashtile's Triton kernels; use reverse mode (backward)")


def _plain_eager(*tensors) -> bool:
    """True when the kernels may be called directly: real tensors of a real device, nothing
    tracing or transforming them. Otherwise (torch.compile, compiled autograd, FakeTensor,
    make_fx or any dispatch mode, vmap/functorch, jit.trace, meta tensors, tensor
    subclasses) the call must go through the op, which those tools understand."""
    if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None:
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    mode = _get_current_dispatch_mode()
    if mode is not None and type(mode) is not plan.Recorder:  # a plan's recorder is not a tracer
        return False
    return all(t is None or (type(t) is Tensor and t.device.type != "meta") for t in tensors)


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, diag_offset: int, window_left: int,
              window_right: int, softcap: float, alibi_slopes: Optional[Tensor], attn_mask: Optional[Tensor],
              dropout_p: float = 0.0, seed: Optional[Tensor] = None,
              deterministic: bool = False, varlen: tuple = (), hint=None,
              layout: str = "bhsd") -> tuple[Tensor, Tensor]:
    """What ``flashtile.api`` calls: the same code as ``torch.ops.flashtile.attn_fwd``
    without the op dispatch for plain eager calls, the op itself whenever something traces
    or transforms the tensors (torch.compile, FakeTensor, vmap, ...: see ``_plain_eager``).

    Arguments as ``attn_fwd``, but q, k, v in ``layout`` (``LAYOUTS``: "bhsd" the op's
    (B, H, S, D), "bshd" flash-attn's (B, S, H, D), "thd" a packed (total, H, D));
    returns out in the same layout and lse (B, H, Sq) float32. ``varlen``: empty, or its six
    varlen arguments (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
    max_seqlen_k). ``hint``: the plan entry (``flashtile.runtime.replay``) of an API call whose
    key determines this call's arguments but their addresses; a training call then keeps
    its kernels' entry in ``hint.below`` instead of making their key."""
    tail = (scale, diag_offset, window_left, window_right, softcap, alibi_slopes, attn_mask, dropout_p, seed,
            deterministic, *varlen)
    _refuse_forward_ad(q, k, v, alibi_slopes, attn_mask)
    if not _plain_eager(q, k, v, alibi_slopes, attn_mask, seed, *varlen[:4]):
        out, lse = torch.ops.flashtile.attn_fwd(*(_canonical(t, layout) for t in (q, k, v)), *tail)
        return _from_bshd(out, layout), lse
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(hint, layout, q, k, v, *tail)
    out, lse = _attn_fwd_impl(*(_canonical(t, layout) for t in (q, k, v)), *tail)
    return _from_bshd(out, layout), lse


def _autotune(q, k, v, out4, lse, problem: dict, default):
    from triton.testing import do_bench

    from flashtile.backends import configs
    from flashtile.backends.triton.forward import attention_forward
    import triton

    key = "|".join(map(str, (
        torch.cuda.get_device_name(q.device), q.dtype, q.shape[-1], q.shape[1] // k.shape[1],
        problem["window_left"] >= 0, problem["window_right"] >= 0, problem["softcap"] > 0,
        problem["alibi_slopes"] is not None,
        None if problem["attn_mask"] is None else problem["attn_mask"].dtype, triton.__version__,
    )))

    def time_ms(cfg):
        return do_bench(lambda: attention_forward(q, k, v, out4, lse, config=cfg, **problem),
                        warmup=5, rep=20, return_mode="median")

    return configs.autotuned_fwd_config(key, [default] + configs.fwd_candidates(q.shape[-1]), time_ms)


# ---------------------------------------------------------------------------------------
# KV-cache decoding (flash_attn_with_kvcache): not differentiable, mutates the caches
# ---------------------------------------------------------------------------------------

_KV_PLANS = plan.cache("kvcache")


def _kvcache_impl(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                  cos: Optional[Tensor], sin: Optional[Tensor], seqlens: Tensor, leftpad: Optional[Tensor],
                  batch_idx: Optional[Tensor], table: Optional[Tensor], alibi: Optional[Tensor], scale: float,
                  softcap: float, window_left: int, window_right: int, interleaved: bool, rotary_local: bool,
                  num_splits: int, device_check: bool, batch_cache: int, num_blocks: int,
                  rotary_len: int) -> tuple[Tensor, Tensor]:
    """The kv-cache kernels (``flashtile.backends.triton.decode``), through the launch plan of the key:
    out (batch, seqlen_q, H, D), lse (batch, H, seqlen_q) float32; k_cache/v_cache get k, v."""
    inputs = (q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, table, alibi)
    scalars = (scale, softcap, window_left, window_right, interleaved, rotary_local, num_splits, device_check,
               batch_cache, num_blocks, rotary_len)
    return plan.call(_KV_PLANS, plan.make_key(inputs, scalars), inputs,
                     lambda: _kvcache_run(*inputs, *scalars))


def _kvcache_run(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, table, alibi, scale, softcap,
                 window_left, window_right, interleaved, rotary_local, num_splits, device_check, batch_cache,
                 num_blocks, rotary_len):
    from flashtile.backends.triton import decode

    if q.dtype == torch.bfloat16 and q.device.type != "cuda":
        raise TypeError("bfloat16 cannot run under TRITON_INTERPRET=1 (triton 3.6's interpreter has no bf16 arithmetic)")
    batch, seqlen_q, nheads, head_dim = q.shape
    new = 0 if k is None else k.shape[1]
    out = q.new_empty((batch, seqlen_q, nheads, head_dim))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    status, parts = decode.scratch(q, k_cache, table, num_splits, device_check)
    if device_check:
        paged = table is not None
        page = k_cache.shape[1] if paged else 0
        capacity = table.shape[1] * page if paged else k_cache.shape[1]
        decode.check_metadata(status, seqlens, leftpad, batch_idx, table, new=new, queries=seqlen_q,
                              capacity=capacity, batch_cache=batch_cache, num_blocks=num_blocks, page=page,
                              rotary_len=rotary_len, rotary_local=rotary_local)
    if k is not None and new > 0:
        decode.append(k_cache, v_cache, k, v, seqlens, batch_idx, table, cos, sin, interleaved=interleaved,
                      status=status)
    decode.decode(q, k_cache, v_cache, out, lse, seqlens, leftpad, batch_idx, table, alibi, cos, sin, new=new,
                  scale=scale, softcap=softcap, window_left=window_left, window_right=window_right,
                  interleaved=interleaved, rotary_local=rotary_local, num_splits=num_splits, status=status,
                  parts=parts)
    return out, lse


@torch.library.custom_op("flashtile::kvcache", mutates_args=("k_cache", "v_cache"), device_types=("cuda", "cpu"))
def kvcache_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
               cos: Optional[Tensor], sin: Optional[Tensor], seqlens: Tensor, leftpad: Optional[Tensor],
               batch_idx: Optional[Tensor], table: Optional[Tensor], alibi: Optional[Tensor], scale: float,
               softcap: float, window_left: int, window_right: int, interleaved: bool, rotary_local: bool,
               num_splits: int, device_check: bool, batch_cache: int, num_blocks: int,
               rotary_len: int) -> tuple[Tensor, Tensor]:
    """The kv-cache call as a torch.library op that declares its in-place writes to the
    caches (what torch.compile traces): see ``_kvcache_impl``."""
    return _kvcache_impl(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, table, alibi, scale,
                         softcap, window_left, window_right, interleaved, rotary_local, num_splits, device_check,
                         batch_cache, num_blocks, rotary_len)


@kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, table, alibi, *rest):
    batch, seqlen_q, nheads, head_dim = q.shape
    return q.new_empty((batch, seqlen_q, nheads, head_dim)), q.new_empty((batch, nheads, seqlen_q),
                                                                          dtype=torch.float32)


def kvcache(*args, hint=None) -> tuple[Tensor, Tensor]:
    """What ``flashtile.api.kvcache`` calls (``kvcache_op``'s arguments): the kernels
    directly for plain eager calls, the op when something traces (``_plain_eager``).
    ``hint``: the plan entry of an API call whose key determines these arguments but
    their addresses; the kernels' entry is then kept in ``hint.below`` and a repeated call
    replays it without making its key (as ``attention`` does for training calls)."""
    if not _plain_eager(*args[:12]):
        return torch.ops.flashtile.kvcache(*args)
    if hint is None:
        return _kvcache_impl(*args)
    entry = hint.below.get("kvcache")
    if entry is None:
        key = plan.make_key(args[:12], args[12:])
        if key is None:
            return _kvcache_impl(*args)
        entry = hint.below["kvcache"] = _KV_PLANS.entry(key, args[:12])
    return plan.run(entry, args[:12], lambda: _kvcache_run(*args))
