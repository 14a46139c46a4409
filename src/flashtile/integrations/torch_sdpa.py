"""flashtile behind PyTorch's own attention: a flash-attention provider.

    import flashtile.integrations.torch_sdpa      # registers "flashtile" (does not activate it)
    torch.nn.attention.activate_flash_attention_impl("flashtile")   # torch with the registry
    flashtile.integrations.torch_sdpa.activate()  # the same on any torch (torch.library)
    ...                                           # F.scaled_dot_product_attention's flash
                                                  # backend and varlen_attn now run flashtile
    flashtile.integrations.torch_sdpa.deactivate()  # PyTorch's own kernels again

While active, the CUDA kernels of PyTorch's flash ops are flashtile's, forward and backward:

    aten::_scaled_dot_product_flash_attention (+ _backward)   SDPA's flash backend
    aten::_flash_attention_forward (+ _backward)              varlen_attn, packed or dense
    aten::_flash_attention_forward_no_dropout_inplace          varlen_attn's out= form

Each returns what the op's contract says (shapes and strides of PyTorch's meta kernels, the
LSE as (B, H, L), or (H, total) packed, placeholder RNG state), so autograd, torch.compile
and CUDA graphs see the ops they know. Calls flashtile does not take (dropout, whose mask
is PyTorch's Philox stream; return_debug_mask; paged keys; ALiBi or seqused_k, which the
ops' backward does not receive) run PyTorch's own kernel instead, fetched before the
override (``torch.library.get_kernel``), and are counted in ``FALLBACKS`` ((op, reason) ->
calls; ``flashtile explain --sdpa-provider`` prints them). Where the original kernel cannot
be fetched, such a call raises NotImplementedError naming the feature: never a different
result.

Versions: torch 2.11 and 2.13 both have the provider registry (``torch.nn.attention.
register_flash_attention_impl``, ``activate_flash_attention_impl``,
``restore_flash_attention_impl``; FA3 and FA4 register through it; the same ``_registry.py``
in both) and ``torch.library.get_kernel`` (read in the 2.11.0 wheel's sources). A torch
without ``get_kernel`` but with the dispatcher binding it wraps
(``torch._C._dispatch_get_computed_kernel_for_dispatch_key``) keeps the original kernels
through that. On a torch without the registry ``activate()`` installs the same kernels
through ``torch.library.Library("aten", "IMPL")``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import torch

from flashtile import dispatch
from flashtile.backends import layout, run
from flashtile.problem import validate
from flashtile.runtime import replay

NAME = "flashtile"
FALLBACKS: collections.Counter = collections.Counter()
_HANDLE: list = [None]  # the active handle when activated without the registry
_FWD_PLANS = replay.cache("sdpa_provider_forward")
_BWD_PLANS = replay.cache("sdpa_provider_backward")
_FLASH_FWD_PLANS = replay.cache("flash_provider_forward")
_FLASH_BWD_PLANS = replay.cache("flash_provider_backward")


class Handle:
    """What ``activate`` installed: the ``torch.library.Library`` holding the kernels (its
    deletion removes them) and the original kernels the fallbacks call."""

    def __init__(self, library, originals: dict):
        self.library, self.originals = library, originals

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
        self.library = None


# --------------------------------------------------------------------------- the kernels
def _fallback(op: str, reason: str, original, keyset, args, kwargs):
    FALLBACKS[(op, reason)] += 1
    if original is None:
        raise NotImplementedError(f"flashtile's provider does not take aten::{op} with {reason}, and PyTorch's own "
                                  f"kernel could not be kept (torch {torch.__version__} has neither "
                                  f"torch.library.get_kernel nor the dispatcher binding it wraps): deactivate the "
                                  f"provider for this call")
    return original.call_boxed(keyset, *args, **kwargs)


def _restrided(t: torch.Tensor, stride: tuple) -> torch.Tensor:
    """``t`` with ``stride`` (what the op's meta kernel, or an input, has): a copy only if they
    differ (torch.compile plans later reads with those strides)."""
    if t.stride() == tuple(stride) or t.numel() <= 1:
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


@functools.lru_cache(maxsize=256)
def _meta_strides(op: str, shapes: tuple, args: tuple, kwargs: tuple) -> tuple:
    """The strides of the outputs of ``op``'s meta kernel for tensors of ``shapes`` ((shape,
    stride, dtype) or None) and the other arguments."""
    tensors = [None if s is None else torch.empty_strided(s[0], s[1], dtype=s[2], device="meta") for s in shapes]
    it = iter(tensors)
    full = [next(it) if a == "<t>" else a for a in args]
    outs = getattr(torch.ops.aten, op).default(*full, **dict(kwargs))
    return tuple(o.stride() if isinstance(o, torch.Tensor) else None for o in outs)


def _aux(query):
    """rng_state, philox offset and debug mask of a call without dropout: placeholders,
    uninitialized as PyTorch's own flash kernel leaves them (no fill launches); the backward
    reads them only with dropout, which goes to PyTorch's kernel."""
    return (torch.empty((2,), dtype=torch.uint64, device=query.device),
            torch.empty((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))


def _side(value) -> int:
    return -1 if value is None else int(value)


def _problem(query, key, value, cum_q, cum_k, max_q, max_k, is_causal, scale, left, right):
    """The validated problem, Varlen and ``validate.VarlenCall`` (None, None for a dense
    call) of a flash op's call, no dropout."""
    window = (_side(left), _side(right))
    if cum_q is None:
        call = validate.flash_call(query, key, value, 0.0, scale, is_causal, window, 0.0, None, False, False)
        return call.problem, None, None
    call = validate.varlen_call(query, key, value, cum_q, cum_k, int(max_q), int(max_k), 0.0, scale, is_causal,
                                window, 0.0, None, False, False, None, None, None)
    return call.problem, call.varlen, call


def _flash_forward(original, keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                   alibi_slopes=None, block_table=None, num_splits=None, _op="_flash_attention_forward", _out=None):
    args = (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask)
    kwargs = dict(scale=scale, window_size_left=window_size_left, window_size_right=window_size_right,
                  seqused_k=seqused_k, alibi_slopes=alibi_slopes)
    if block_table is not None:
        kwargs["block_table"] = block_table
    if num_splits is not None:
        kwargs["num_splits"] = num_splits
    reason = ("dropout" if dropout_p > 0 else "return_debug_mask" if return_debug_mask
              else "paged keys (block_table)" if block_table is not None
              else "alibi_slopes (the backward op has none)" if alibi_slopes is not None
              else "seqused_k (the backward op has none)" if seqused_k is not None else None)
    if reason is not None:
        return _fallback(_op, reason, original, keyset, args, kwargs)
    sides = (window_size_left, window_size_right)
    if not dispatch.runs_kernels(query.device):
        problem, varlen, _ = _problem(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
                                      *sides)
        out, lse = dispatch.attention(query, key, value, problem, None, None, varlen,
                                      qkv_layout="bshd" if varlen is None else "thd")
        if varlen is not None:
            lse = lse.squeeze(0)  # (H, total_q)
        out = _restrided(out, _out_stride("_flash_attention_forward", args, (), query, value))
        return (out, lse, *_aux(query))
    inputs = (query, key, value, cum_seq_q, cum_seq_k, _out)
    scalars = (max_q, max_k, is_causal, scale, *sides)
    entry, prepared = _prepared(_FLASH_FWD_PLANS, inputs, scalars, lambda: _prepare_flash(
        query, key, value, cum_seq_q, cum_seq_k, *scalars[:4], sides,
        lambda: _out_stride("_flash_attention_forward", args, (), query, value)))
    varlen = _varlen_again(prepared[1], query, key, cum_seq_q, cum_seq_k)

    def compute():
        out, lse = _forward_kernels(prepared, varlen, "bshd" if varlen is None else "thd", query, key, value, _out)
        return (out, lse if varlen is None else lse.squeeze(0), *_aux(query))

    return _planned(entry, inputs, compute)


def _prepared(plans, inputs, scalars, prepare):
    """(entry, prepared) of a provider call on the kernels: its plan entry in ``plans``
    (``runtime.replay``; None when the call is not planned) and what it derives from its key
    alone (``prepare()``: validation included), made once per key."""
    plain = replay.plain_scalars(scalars)
    plan_key = None if plain is None else replay.make_key(inputs, plain)
    if plan_key is None:
        return None, prepare()
    entry = plans.entry(plan_key, inputs)
    if entry.prepared is None:
        entry.prepared = prepare()
    return entry, entry.prepared


def _planned(entry, inputs, compute):
    """``compute()`` through ``entry``'s plan (recorded by a first call, replayed by later
    ones), or directly when the call is not planned."""
    return compute() if entry is None else replay.run(entry, inputs, compute)


def _prepare_flash(query, key, value, cum_q, cum_k, max_q, max_k, is_causal, scale, sides, strides):
    """A flash op's (problem, packed call without its tensors or None, ``strides()``): the
    validation of its key."""
    problem, _, call = _problem(query, key, value, cum_q, cum_k, max_q, max_k, is_causal, scale, *sides)
    return problem, None if call is None else validate.varlen_prepared(call), strides()


def _prepare_sdpa(query, key, value, is_causal, scale, strides):
    """SDPA's flash op's (problem, None, ``strides()``): the validation of its key."""
    return validate.sdpa_call(query, key, value, None, 0.0, is_causal, scale, True).problem, None, strides()


def _shapes(args) -> tuple:
    """(shape, stride, dtype) of each tensor among an op's arguments (``_meta_strides``)."""
    return tuple((tuple(a.shape), tuple(a.stride()), a.dtype) for a in args if isinstance(a, torch.Tensor))


def _marked(args) -> tuple:
    """An op's arguments with each tensor replaced by "<t>" (``_meta_strides``)."""
    return tuple("<t>" if isinstance(a, torch.Tensor) else a for a in args)


def _varlen_again(prepared, query, key, cum_q, cum_k):
    """A planned packed call's Varlen (None: a dense call) with this call's offsets, their
    values checked (``validate.varlen_repeat``: a lookup for tensors checked before)."""
    if prepared is None:
        return None
    return validate.varlen_repeat(prepared, query, key, cum_q, cum_k, None, None, None, None).varlen


def _forward_kernels(prepared, varlen, where, query, key, value, given=None):
    """(out, lse) of a flash op's forward on the kernels, q, k, v given in ``where``: out in
    the op's layout (or written into ``given``: the in-place op's out, unit stride along its
    head dim)."""
    problem, _, stride = prepared
    q, k, v = (layout.canonical(layout.unit_last_stride(t), where) for t in (query, key, value))
    out = _new_out(query, value, stride) if given is None else given
    lse = run.forward_into(layout.canonical(out, where), q, k, v, *dispatch.problem_tail(problem, varlen))
    return (out if given is not None else _restrided(out, stride)), lse


def _out_stride(op: str, args, kwargs: tuple, query, value) -> tuple:
    """out's strides: those of ``op``'s meta kernel (``empty_like(query)``). With v's head dim
    other than q's (which PyTorch's flash ops do not take, and for which their meta kernels
    give q's head dim) a dense buffer of out's shape in query's dimension order."""
    if value.shape[-1] == query.shape[-1]:
        return _meta_strides(op, _shapes(args), _marked(args), kwargs)[0]
    return _dense_like(query, value.shape[-1])


def _dense_like(t: torch.Tensor, last: int) -> tuple:
    """The strides of a dense tensor of ``t``'s shape but ``last`` along its last axis, in the
    dimension order of ``t`` (what ``empty_like`` gives for ``t``'s own shape)."""
    order = torch.empty_like(t, device="meta").stride()
    perm = sorted(range(t.dim()), key=lambda i: -order[i])
    return torch.empty_permuted((*t.shape[:-1], last), perm, device="meta").stride()


def _new_out(query, value, stride) -> torch.Tensor:
    """out's buffer for the kernels: with ``stride``, or, where that has no unit stride along
    the head dim (a query whose head dim is not its innermost axis), a contiguous one that
    ``_restrided`` then copies (such a call is not planned)."""
    shape = (*query.shape[:-1], value.shape[-1])
    if stride[-1] != 1:
        return query.new_empty(shape)
    return torch.empty_strided(shape, stride, dtype=query.dtype, device=query.device)


def _flash_forward_inplace(original, keyset, out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                           is_causal, return_debug_mask, **kwargs):
    if dropout_p > 0 or return_debug_mask or any(kwargs.get(n) is not None
                                                  for n in ("block_table", "alibi_slopes", "seqused_k")):
        return _fallback("_flash_attention_forward_no_dropout_inplace", "an argument flashtile does not take",
                         original, keyset, (out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                            is_causal, return_debug_mask), kwargs)
    # the kernels write into out directly where they can (unit stride along its head dim, the
    # op's shape and dtype); elsewhere the result is copied into it
    direct = (dispatch.runs_kernels(query.device) and out.stride(-1) == 1 and out.dtype == query.dtype
              and tuple(out.shape) == (*query.shape[:-1], value.shape[-1]))
    result, lse, *_ = _flash_forward(None, keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                     is_causal, return_debug_mask, **kwargs, _out=out if direct else None)
    if not direct:
        out.copy_(result)
    return lse


def _flash_backward(original, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                    max_k, dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                    window_size_right=None):
    if dropout_p > 0:
        return _fallback("_flash_attention_backward", "dropout", original, keyset,
                         (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                          is_causal, rng_state, unused),
                         dict(scale=scale, window_size_left=window_size_left, window_size_right=window_size_right))
    if cum_seq_q is not None and cum_seq_q.numel() == 0:
        cum_seq_q = cum_seq_k = None  # a dense call's backward gets empty offsets
    sides = (window_size_left, window_size_right)
    if not dispatch.runs_kernels(query.device):
        problem, varlen, _ = _problem(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
                                      *sides)
        lse = logsumexp if varlen is None else logsumexp.unsqueeze(0)
        grads = dispatch.attention_grads(grad_out, query, key, value, out, lse, problem, None, varlen,
                                         qkv_layout="bshd" if varlen is None else "thd")
        return tuple(map(_restrided, grads, _like_inputs(query, key, value)))
    inputs = (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k)
    scalars = (max_q, max_k, is_causal, scale, *sides)
    entry, prepared = _prepared(_FLASH_BWD_PLANS, inputs, scalars, lambda: _prepare_flash(
        query, key, value, cum_seq_q, cum_seq_k, *scalars[:4], sides, lambda: _like_inputs(query, key, value)))
    varlen = _varlen_again(prepared[1], query, key, cum_seq_q, cum_seq_k)
    where = "bshd" if varlen is None else "thd"
    return _planned(entry, inputs, lambda: _backward_kernels(prepared, varlen, where, *inputs[:6]))


def _sdpa_forward(original, keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                  scale=None):
    if dropout_p > 0 or return_debug_mask:
        return _fallback("_scaled_dot_product_flash_attention", "dropout" if dropout_p > 0 else "return_debug_mask",
                         original, keyset, (query, key, value, dropout_p, is_causal, return_debug_mask),
                         dict(scale=scale))
    args = (query, key, value, dropout_p, is_causal, return_debug_mask)
    if not dispatch.runs_kernels(query.device):  # the twin (tests install the provider on the CPU key)
        call = validate.sdpa_call(query, key, value, None, 0.0, is_causal, scale, True)
        out, lse = dispatch.attention(call.query, call.key, call.value, call.problem)
        out = _restrided(out, _out_stride("_scaled_dot_product_flash_attention", args, (("scale", scale),), query,
                                          value))
        return (out, lse, None, None, query.shape[2], key.shape[2], *_aux(query))
    inputs = (query, key, value)
    entry, prepared = _prepared(_FWD_PLANS, inputs, (is_causal, scale), lambda: _prepare_sdpa(
        query, key, value, is_causal, scale,
        lambda: _out_stride("_scaled_dot_product_flash_attention", args, (("scale", scale),), query, value)))

    def compute():
        out, lse = _forward_kernels(prepared, None, "bhsd", query, key, value)
        return (out, lse, None, None, query.shape[2], key.shape[2], *_aux(query))

    return _planned(entry, inputs, compute)


def _sdpa_backward(original, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                   max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    if dropout_p > 0:
        return _fallback("_scaled_dot_product_flash_attention_backward", "dropout", original, keyset,
                         (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                          is_causal, philox_seed, philox_offset), dict(scale=scale))
    if not dispatch.runs_kernels(query.device):
        call = validate.sdpa_call(query, key, value, None, 0.0, is_causal, scale, True)
        grads = dispatch.attention_grads(grad_out, call.query, call.key, call.value, out, logsumexp, call.problem)
        return tuple(map(_restrided, grads, _like_inputs(query, key, value)))
    inputs = (grad_out, query, key, value, out, logsumexp)
    entry, prepared = _prepared(_BWD_PLANS, inputs, (is_causal, scale), lambda: _prepare_sdpa(
        query, key, value, is_causal, scale, lambda: _like_inputs(query, key, value)))
    return _planned(entry, inputs, lambda: _backward_kernels(prepared, None, "bhsd", *inputs))


def _like_inputs(*inputs) -> tuple:
    """The strides of the backward meta kernels' gradients (``empty_like`` of each input: its
    strides where it is dense, else dense in its dimension order, as for q, k, v sliced from
    one packed projection), which the kernels write directly."""
    return tuple(torch.empty_like(t, device="meta").stride() for t in inputs)


def _backward_kernels(prepared, varlen, where, grad_out, query, key, value, out, logsumexp):
    """A flash op's backward on the kernels (q, k, v, out and dout given in ``where``), each
    gradient written in the layout of the op's meta kernel."""
    problem, _, strides = prepared
    q, k, v, dout = (layout.unit_last_stride(t) for t in (query, key, value, grad_out))
    if any(st[-1] != 1 for st in strides):  # an input whose head dim is not its innermost axis: copied after
        grads = tuple(torch.empty_like(t) for t in (q, k, v))
    else:
        grads = tuple(torch.empty_strided(t.shape, st, dtype=t.dtype, device=t.device)
                      for t, st in zip((q, k, v), strides))
    lse = logsumexp if varlen is None else logsumexp.unsqueeze(0)
    canon = lambda t: layout.canonical(t, where)  # noqa: E731
    tail = dispatch.problem_tail(problem)
    if varlen is not None:
        tail = (*tail, None, *varlen)  # the backward op's dlse, then the packed metadata
    run.backward_into(tuple(map(canon, grads)), layout.to_bshd(dout, where), canon(q), canon(k), canon(v),
                      layout.to_bshd(out, where), lse, *tail)
    return tuple(map(_restrided, grads, strides))


KERNELS = {
    "_scaled_dot_product_flash_attention": _sdpa_forward,
    "_scaled_dot_product_flash_attention_backward": _sdpa_backward,
    "_flash_attention_forward": _flash_forward,
    "_flash_attention_forward_no_dropout_inplace": _flash_forward_inplace,
    "_flash_attention_backward": _flash_backward,
}


# --------------------------------------------------------------------------- install / activate
def _kernel_getter():
    """``torch.library.get_kernel`` (torch 2.11, 2.13), else the dispatcher binding it wraps
    (``torch._C._dispatch_get_computed_kernel_for_dispatch_key``), else None."""
    if hasattr(torch.library, "get_kernel"):
        return torch.library.get_kernel
    binding = getattr(torch._C, "_dispatch_get_computed_kernel_for_dispatch_key", None)
    if binding is None or not hasattr(torch._C, "_SafeKernelFunction"):
        return None
    return lambda op, key: binding(op, torch._C.DispatchKey.__members__[key])


def install(dispatch_key: str = "CUDA") -> Handle:
    """Install flashtile's kernels for ``dispatch_key`` of every op of ``KERNELS`` that this
    torch has (the registry's ``register_fn``; tests install them for "CPU" or "Meta")."""
    getter = _kernel_getter()
    keep = getter is not None
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    originals = {}
    for name, kernel in KERNELS.items():
        if not hasattr(torch.ops.aten, name):
            continue
        original = None
        if keep:
            try:
                original = getter(f"aten::{name}", dispatch_key)
            except RuntimeError:
                original = None
        originals[name] = original
        if keep:
            library.impl(name, functools.partial(kernel, original), dispatch_key, with_keyset=True)
        else:
            library.impl(name, functools.partial(kernel, None, None), dispatch_key)
    return Handle(library, originals)


def _registry():
    attention = torch.nn.attention
    return attention if hasattr(attention, "register_flash_attention_impl") else None


def activate() -> None:
    """Route PyTorch's flash ops on CUDA tensors to flashtile (through the registry where this
    torch has it, else directly)."""
    registry = _registry()
    if registry is not None:
        registry.activate_flash_attention_impl(NAME)
        return
    deactivate()
    _HANDLE[0] = install()


def deactivate() -> None:
    """PyTorch's own flash kernels again."""
    registry = _registry()
    if registry is not None:
        if registry.current_flash_attention_impl() == NAME:
            registry.restore_flash_attention_impl()
        return
    if _HANDLE[0] is not None:
        _HANDLE[0].remove()
        _HANDLE[0] = None


@contextlib.contextmanager
def activated():
    """The provider active inside the ``with`` block, deactivated after it."""
    activate()
    try:
        yield
    finally:
        deactivate()


def active() -> bool:
    registry = _registry()
    if registry is not None:
        return registry.current_flash_attention_impl() == NAME
    return _HANDLE[0] is not None


def report() -> str:
    """What ``flashtile explain --sdpa-provider`` prints: the state and the fallbacks so far."""
    lines = [f"flashtile SDPA provider: {'active' if active() else 'registered, not active'} (torch "
             f"{torch.__version__}, registry {'yes' if _registry() is not None else 'no'}, fallback kernels "
             f"{'kept' if _kernel_getter() is not None else 'unavailable'})"]
    if not FALLBACKS:
        lines.append("  no call went back to PyTorch's own kernels")
    for (op, reason), count in sorted(FALLBACKS.items()):
        lines.append(f"  aten::{op}: {count} call(s) ran PyTorch's own kernel ({reason})")
    return "\n".join(lines)


if _registry() is not None and NAME not in _registry().list_flash_attention_impls():
    _registry().register_flash_attention_impl(NAME, register_fn=install)


__all__ = ["activate", "deactivate", "active", "install", "report", "FALLBACKS", "NAME"]
