"""The torch glue: the kernels as torch.library ops, their fake kernels, the autograd formula.

``flashtile.dispatch`` calls ``attention`` (and ``kvcache``): for plain eager calls they
go straight to ``backends.run`` (the op dispatch costs ~50 us of host time per training
call; short sequences are launch-bound on the GPU), and through the registered ops
whenever something traces or transforms the tensors (torch.compile, FakeTensor, vmap,
...: ``_plain_eager``), so ``torch.compile(fullgraph=True)`` traces straight through:

    torch.ops.flashtile.attn_fwd   q, k, v (B, H, S, D) views -> out (B, Sq, H, D), lse (B, H, Sq)
    torch.ops.flashtile.attn_bwd   its backward (registered as attn_fwd's autograd formula)
    torch.ops.flashtile.kvcache    append to the caches in place, then decode (not differentiable)

The ops' arguments are flat (``backends.run.FwdArgs``, ``BwdArgs``, ``KVCacheArgs`` name
them); launch configurations are chosen inside the ops at run time, never at trace time.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.autograd.forward_ad as fwad
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from flashtile.backends import layout, run
from flashtile.runtime import replay, settings

@torch.library.custom_op("flashtile::attn_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, diag_offset: int, window_left: int,
             window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
             attn_mask: Optional[Tensor], dropout_p: float = 0.0,
             seed: Optional[Tensor] = None, deterministic: bool = False,
             cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
             seqused_q: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
             max_seqlen_q: int = 0, max_seqlen_k: int = 0,
             sink: Optional[Tensor] = None, attention_chunk: int = 0) -> tuple[Tensor, Tensor]:
    """The forward (``backends.run.forward``): out (B, Sq, H, D) and lse (B, H, Sq) float32.

    ``seed``: a 1-element int64 tensor on q's device, the Philox key of the dropout mask.
    ``deterministic`` only matters to the backward. ``cu_seqlens_q`` and the five after it
    make it a packed call (``problem.spec.Varlen``): q (1, H, total_q, D), k/v (1, Hk,
    total_k, D), each sequence with its own diagonal (len_k - len_q). ``sink``: (H,)
    float32 logits in the softmax's denominator (``problem.spec``), differentiable.
    ``attention_chunk``: chunked attention (0: off).
    """
    return run.forward(q, k, v, scale, diag_offset, window_left, window_right, softcap, alibi_slopes, attn_mask,
                       dropout_p, seed, deterministic, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                       max_seqlen_q, max_seqlen_k, sink, attention_chunk)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, scale, diag_offset, window_left, window_right, softcap, alibi_slopes, attn_mask,
                   dropout_p=0.0, seed=None, deterministic=False, cu_seqlens_q=None, cu_seqlens_k=None,
                   seqused_q=None, seqused_k=None, max_seqlen_q=0, max_seqlen_k=0, sink=None, attention_chunk=0):
    batch, nheads, seqlen_q, _ = q.shape
    return (q.new_empty((batch, seqlen_q, nheads, v.shape[-1])),
            q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))


@torch.library.custom_op("flashtile::attn_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
             diag_offset: int, window_left: int, window_right: int, softcap: float,
             alibi_slopes: Optional[Tensor], attn_mask: Optional[Tensor], dropout_p: float = 0.0,
             seed: Optional[Tensor] = None, deterministic: bool = False,
             dlse: Optional[Tensor] = None,
             cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
             seqused_q: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
             max_seqlen_q: int = 0, max_seqlen_k: int = 0,
             sink: Optional[Tensor] = None, attention_chunk: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward (``backends.run.backward``): dq (B, Sq, H, D), dk/dv (B, Sk, Hk, D),
    dsink (H,) float32 ((0,) without a sink)."""
    return run.backward(dout, q, k, v, out, lse, scale, diag_offset, window_left, window_right, softcap,
                        alibi_slopes, attn_mask, dropout_p, seed, deterministic, dlse, cu_seqlens_q, cu_seqlens_k,
                        seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, sink, attention_chunk)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, scale, diag_offset, window_left, window_right, softcap,
                   alibi_slopes, attn_mask, dropout_p=0.0, seed=None, deterministic=False, dlse=None,
                   cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=0,
                   max_seqlen_k=0, sink=None, attention_chunk=0):
    def bshd(t):
        b, h, s, d = t.shape
        return t.new_empty((b, s, h, d))

    dsink = lse.new_empty((0,) if sink is None else (q.shape[1],))
    return bshd(q), bshd(k), bshd(v), dsink


def _setup_context(ctx, inputs, output):
    (q, k, v, scale, diag_offset, window_left, window_right, softcap, alibi_slopes, attn_mask, dropout_p, seed,
     deterministic) = inputs[:13]
    out, lse = output
    sink = inputs[19] if len(inputs) > 19 else None
    # the sink is saved too: an in-place change to it before the backward then raises, as for
    # any saved tensor (a float32 sink is the caller's own tensor, not a copy)
    ctx.save_for_backward(q, k, v, out, lse, *(() if sink is None else (sink,)))
    ctx.problem = (scale, diag_offset, window_left, window_right, softcap)
    # Non-differentiable extras: kept as plain references (no gradient flows to them).
    ctx.alibi_slopes = alibi_slopes
    ctx.attn_mask = attn_mask
    ctx.dropout = (dropout_p, seed, deterministic)
    ctx.varlen = tuple(inputs[13:19])  # cu_seqlens_q/k, seqused_q/k, max_seqlen_q/k (a varlen call)
    ctx.has_sink = sink is not None
    ctx.chunk = inputs[20] if len(inputs) > 20 else 0
    ctx.num_inputs = len(inputs)


def _grads(ctx, dout, dlse, bwd, saved=None):
    # The op's q, k, v are (B, H, S, D) views and its out (B, S, H, D); the eager Function's
    # q, k, v and out are all in the caller's layout (ctx.layout). ``saved``: ctx.saved_tensors
    # when the caller unpacked them already (each unpack runs the saved-tensor hooks again:
    # non-reentrant checkpointing refuses a second one, offloading would copy twice).
    where = getattr(ctx, "layout", None)
    q, k, v, out, lse, *sink = ctx.saved_tensors if saved is None else saved
    sink = sink[0] if sink else None
    if where is not None:
        q, k, v = (layout.canonical(t, where) for t in (q, k, v))
        out = layout.to_bshd(out, where)
        dout = None if dout is None else layout.to_bshd(dout, where)
    if dout is None:  # only the LSE was used downstream
        dout = torch.zeros_like(out)
    tail = ctx.varlen
    if sink is not None or ctx.chunk:
        tail = (*(ctx.varlen or (None, None, None, None, 0, 0)), sink, ctx.chunk)
    dq, dk, dv, dsink = bwd(dout, q, k, v, out, lse, *ctx.problem, ctx.alibi_slopes, ctx.attn_mask, *ctx.dropout,
                            dlse, *tail)
    # The backward returns (B, S, H, D), each gradient goes back in its input's layout.
    where = where or "bhsd"
    grads = [layout.from_bshd(g, where) for g in (dq, dk, dv)] + [None] * (ctx.num_inputs - 3)
    if sink is not None:
        grads[19] = dsink  # the op's sink argument
    return tuple(grads)


def _backward(ctx, dout, dlse):
    return _grads(ctx, dout, dlse, torch.ops.flashtile.attn_bwd)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same forward, saved tensors and backward as the op's registered autograd, without
    the custom-op dispatch.

    ``forward`` takes ctx itself: a separate ``setup_context`` makes every ``apply`` bind
    its arguments with ``inspect.signature`` (torch 2.11-2.13; ~25 us of the device host's
    time per call, H200 run 50). Only plain eager calls come here (``_plain_eager``: no
    functorch transform, which would need ``setup_context``).

    ``apply(hint, where, q, k, v, sink, tail, keyed)``: the op's arguments after v come as
    one tuple ``tail`` (``apply`` walks every argument in Python and C++: ~1-2 us per call
    saved against 16 loose ones); the sink, the one differentiable tensor among them, comes
    loose as well, so that its gradient has a slot (it is also in ``tail``). ``keyed``: a
    call of ``attention_keyed``, whose plans are recorded at this level."""

    @staticmethod
    def forward(ctx, hint, where, q, k, v, sink, tail, keyed):
        # q, k, v come in ``where`` (a ``layout.LAYOUTS``) and out goes back in it. The
        # forward's plan entry is kept in ``hint.below`` when the caller has a hint
        # (``attention``), else found here; the backward finds its own entry below it.
        inputs = (q, k, v) + tail
        if keyed:
            # a keyed call (``attention_keyed``): the forward, layouts included, is one plan
            # on the caller's q, k, v, a packed call's metadata tensors (tail[10:14]) and the
            # sink (tail[16]), so a repeated call makes no op arguments
            planned = (q, k, v, *tail[10:14], *tail[16:17])  # and the sink's tensor
            entry = replay.below(hint, "attn_fwd_keyed", planned)
            out, lse = replay.run(entry, planned, partial(_forward_in_layout, where, q, k, v, tail))
        else:
            a = _fwd_args(where, q, k, v, tail)
            entry = None if hint is None else hint.below.get("attn_fwd")
            if entry is None:
                entry = run.forward_entry(a)
                if hint is not None and entry is not None:
                    hint.below["attn_fwd"] = entry
            out, lse = run.forward_planned(entry, a)
            out = layout.from_bshd(out, where)
        # An unused LSE (or out) arrives as None and skips the Delta update; the op's
        # autograd passes zeros instead. Same gradients either way.
        ctx.set_materialize_grads(False)
        _setup_context(ctx, inputs, (out, lse))
        ctx.entry, ctx.layout, ctx.keyed = entry, where, keyed
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # create_graph=True: go through the op, whose missing autograd formula makes a
        # double backward raise instead of treating the kernels' output as constant; a
        # traced backward (compiled autograd) also needs the op and its fake kernel.
        if torch.is_grad_enabled() or not _plain_eager(dout, dlse):
            bwd = torch.ops.flashtile.attn_bwd
        elif ctx.keyed and replay.active_recorder() is None and settings.plans_enabled():
            # a keyed call's backward, layouts included, is one plan on the saved tensors,
            # dout and dlse, found below the forward's by what only the backward brings and
            # by the saved tensors' own keys (a saved-tensors hook may hand them back with
            # other strides)
            unpacked = ctx.saved_tensors  # once: each read runs the saved-tensor hooks
            saved = (*unpacked, dout, dlse)
            inputs = (*saved, *ctx.varlen[:4])  # and a packed call's metadata tensors (keyed by the forward)
            entry = replay.below(ctx.entry, (replay.env_key(), *map(replay.tensor_key, saved)), inputs)
            dq, dk, dv, dsink = replay.run(entry, inputs, lambda: _keyed_grads(ctx, dout, dlse, unpacked))
            return None, None, dq, dk, dv, dsink, None, None
        elif ctx.entry is not None:
            bwd = partial(run.backward_planned, ctx.entry)
        else:
            bwd = run.backward
        grads = _grads(ctx, dout, dlse, bwd)
        return None, None, *grads[:3], grads[19] if ctx.has_sink else None, None, None


# ``Function.apply`` without its Python classmethod: the C ``_FunctionBase.apply`` it ends in.
# The classmethod binds arguments for a ``setup_context`` (``_EagerAttention`` has none),
# sends functorch transforms elsewhere (its callers' ``_plain_eager`` / ``replay.make_key``
# refused those calls already) and unwraps dead functorch wrappers (``_eager_apply`` does,
# for the tensors among its arguments): 4-5 us of a call with grad (CPU stub, session 42).
_function_base_apply = super(torch.autograd.Function, _EagerAttention).apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _eager_apply(hint, where: str, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], tail: tuple,
                 keyed: bool):
    """``_EagerAttention.apply(...)`` for a plain eager call (nothing traces or transforms it)."""
    return _function_base_apply(hint, where, _unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v),
                                None if sink is None else _unwrap_if_dead(sink), tail, keyed)


def _keyed_grads(ctx, dout, dlse, saved) -> tuple:
    """dq, dk, dv and the sink's gradient (None without a sink) of a keyed call's backward."""
    grads = _grads(ctx, dout, dlse, run.backward, saved)
    return (*grads[:3], grads[19] if ctx.has_sink else None)


def _fwd_args(where: str, q: Tensor, k: Tensor, v: Tensor, tail: tuple) -> run.FwdArgs:
    """The forward op's arguments for q, k, v given in ``where``."""
    return run.FwdArgs.of((layout.canonical(q, where), layout.canonical(k, where), layout.canonical(v, where)) + tail)


def _forward_in_layout(where: str, q: Tensor, k: Tensor, v: Tensor, tail: tuple) -> tuple[Tensor, Tensor]:
    """The forward op's work (no plan of its own) for q, k, v in ``where``: out in ``where``, lse."""
    out, lse = run.forward_planned(None, _fwd_args(where, q, k, v, tail))
    return layout.from_bshd(out, where), lse


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
    if mode is not None and type(mode) is not replay.Recorder:  # a plan's recorder is not a tracer
        return False
    return all(t is None or (type(t) is Tensor and t.device.type != "meta") for t in tensors)


def op_tail(scale: float, diag_offset: int, window_left: int, window_right: int, softcap: float,
            alibi_slopes: Optional[Tensor], attn_mask: Optional[Tensor], dropout_p: float, seed: Optional[Tensor],
            deterministic: bool, varlen: tuple = (), sink: Optional[Tensor] = None, chunk: int = 0,
            sink_slot: bool = False) -> tuple:
    """``attn_fwd``'s arguments after q, k, v (``varlen``: empty or its six; the sink and the
    chunk only when either is set or ``sink_slot`` asks for the sink's slot, after the
    varlen six)."""
    if sink is not None or chunk or sink_slot:
        varlen = (*(varlen or (None, None, None, None, 0, 0)), sink, chunk)
    return (scale, diag_offset, window_left, window_right, softcap, alibi_slopes, attn_mask, dropout_p, seed,
            deterministic, *varlen)


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, diag_offset: int, window_left: int,
              window_right: int, softcap: float, alibi_slopes: Optional[Tensor], attn_mask: Optional[Tensor],
              dropout_p: float = 0.0, seed: Optional[Tensor] = None,
              deterministic: bool = False, varlen: tuple = (), hint=None,
              qkv_layout: str = "bhsd", sink: Optional[Tensor] = None, chunk: int = 0) -> tuple[Tensor, Tensor]:
    """What ``flashtile.dispatch`` calls: ``attn_fwd`` (and its autograd) for q, k, v given
    in ``qkv_layout`` (``layout.LAYOUTS``: "bhsd" the op's (B, H, S, D), "bshd" flash-attn's,
    "thd" a packed (total, H, D)); returns out in the same layout and lse (B, H, Sq)
    float32. ``varlen``: empty, or its six op arguments. ``hint``: the plan entry
    (``runtime.replay``) of an API call whose key determines this call's arguments but
    their addresses; a training call then keeps its kernels' entry in ``hint.below``.
    ``sink``: None or (H,) float32 (differentiable). ``chunk``: chunked attention (0: off)."""
    tail = op_tail(scale, diag_offset, window_left, window_right, softcap, alibi_slopes, attn_mask, dropout_p, seed,
                   deterministic, varlen, sink, chunk)
    _refuse_forward_ad(q, k, v, alibi_slopes, attn_mask, sink)
    if not _plain_eager(q, k, v, alibi_slopes, attn_mask, seed, *tail[10:14], sink):
        out, lse = torch.ops.flashtile.attn_fwd(*(layout.canonical(t, qkv_layout) for t in (q, k, v)), *tail)
        return layout.from_bshd(out, qkv_layout), lse
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sink is not None and sink.requires_grad)):
        return _eager_apply(hint, qkv_layout, q, k, v, sink, tail, False)
    out, lse = run.forward(*(layout.canonical(t, qkv_layout) for t in (q, k, v)), *tail)
    return layout.from_bshd(out, qkv_layout), lse


def attention_keyed(hint, qkv_layout: str, q: Tensor, k: Tensor, v: Tensor, tail: tuple,
                    sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """``attention`` for a call with grad whose plan key was made (``runtime.replay.make_key``:
    nothing traces or transforms it, no forward-AD level, plain tensors, so ``_plain_eager``
    holds) and whose op arguments after v are ``tail`` (no tensor among them but a packed
    call's metadata and the sink, which the API key covers; ``sink``: tail[16] or None): the
    eager autograd node directly (``dispatch.attention_keyed``)."""
    return _eager_apply(hint, qkv_layout, q, k, v, sink, tail, True)


@torch.library.custom_op("flashtile::kvcache", mutates_args=("k_cache", "v_cache"), device_types=("cuda", "cpu"))
def kvcache_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
               cos: Optional[Tensor], sin: Optional[Tensor], seqlens: Tensor, leftpad: Optional[Tensor],
               batch_idx: Optional[Tensor], table: Optional[Tensor], alibi: Optional[Tensor],
               sink: Optional[Tensor], scale: float, softcap: float, window_left: int, window_right: int, interleaved: bool, rotary_local: bool,
               num_splits: int, device_check: bool, batch_cache: int, num_blocks: int,
               rotary_len: int, attention_chunk: int = 0, padding: bool = False) -> tuple[Tensor, Tensor]:
    """The kv-cache call as an op that declares its in-place writes to the caches (what
    torch.compile traces): ``backends.run.kvcache``."""
    return run.kvcache(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, table, alibi, sink, scale,
                       softcap, window_left, window_right, interleaved, rotary_local, num_splits, device_check,
                       batch_cache, num_blocks, rotary_len, attention_chunk, padding)


@kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, table, alibi, sink, *rest):
    batch, seqlen_q, nheads, _ = q.shape
    return (q.new_empty((batch, seqlen_q, nheads, v_cache.shape[-1])),
            q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))


def kvcache(*args, hint=None) -> tuple[Tensor, Tensor]:
    """What ``flashtile.dispatch`` calls for a kv-cache call (``kvcache_op``'s arguments): the
    kernels directly for plain eager calls, the op when something traces (``_plain_eager``).
    ``hint``: as in ``attention``."""
    if not _plain_eager(*args[:13]):
        return torch.ops.flashtile.kvcache(*args)
    return run.kvcache(*args, hint=hint)



# --------------------------------------------------------------------------- flex_attention
class _Flex(torch.autograd.Function):
    """The flex kernels' autograd node: out and lse from ``flex.forward``, the gradients of
    q, k, v from ``flex.backward`` (the LSE's gradient included), and those of a score_mod's
    captured tensors that require grad (learned biases) from a plain-torch pass over slabs
    of rows (``twin.flex.captured_grads``)."""

    @staticmethod
    def forward(ctx, q, k, v, launch, score_mod, *captured):
        from flashtile.backends.triton import flex

        out, lse = flex.forward(q, k, v, launch)
        ctx.save_for_backward(q, k, v, out, lse, *captured)
        ctx.launch, ctx.score_mod = launch, score_mod
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from flashtile.backends.triton import flex

        q, k, v, out, lse, *captured = ctx.saved_tensors
        dq, dk, dv, delta = flex.backward(dout, q, k, v, out, lse, dlse, ctx.launch)
        dcaptured = ()
        if captured and delta is None:
            dcaptured = tuple(torch.zeros_like(t) for t in captured)
        elif captured:
            from flashtile.backends.twin.flex import captured_grads

            before, warn_only = torch.are_deterministic_algorithms_enabled(), \
                torch.is_deterministic_algorithms_warn_only_enabled()
            if ctx.launch.deterministic:  # torch's index backward accumulates by sorting, not atomics
                torch.use_deterministic_algorithms(True)
            try:
                dcaptured = captured_grads(q, k, v, dout, lse, delta, ctx.score_mod, ctx.launch.sparsity,
                                           ctx.launch.scale, tuple(captured))
            finally:
                torch.use_deterministic_algorithms(before, warn_only=warn_only)
        return (dq, dk, dv, None, None, *dcaptured)


@torch.compiler.disable
def flex(q: Tensor, k: Tensor, v: Tensor, score_mod, sparsity, scale: float, deterministic: bool,
         options: dict) -> tuple[Tensor, Tensor]:
    """``flex_attention`` on the kernels: (out (B, Hq, L, Ev), lse (B, Hq, L) float32),
    differentiable in q, k, v and in the score_mod's captured tensors that require grad.
    The kernels never use float atomics; under ``deterministic`` the captured tensors'
    gradients run with torch's deterministic algorithms (their index backward). Under
    torch.compile the call is a graph break (the mods are Python functions the kernels
    receive translated, not graph inputs)."""
    _refuse_forward_ad(q, k, v)
    launch = run.flex_launch(q, k, v, score_mod, sparsity, scale, options)
    q, k, v = (layout.unit_last_stride(t) for t in (q, k, v))
    captured = launch.score.requires_grad if launch.score is not None else ()
    if torch.is_grad_enabled() and (captured or any(t.requires_grad for t in (q, k, v))):
        launch.deterministic = deterministic
        return _Flex.apply(q, k, v, launch, score_mod, *captured)
    from flashtile.backends.triton import flex as flex_kernels

    return flex_kernels.forward(q, k, v, launch)
