"""Run a validated problem: on the torch twin, or on the kernels through ``flashtile.autograd``.

The public functions validate their arguments into a ``problem.spec.Problem`` (and a
``Varlen`` or a kv-cache ``CacheCall``) and call one function here. The family is the
registry's answer for the tensors' device (``backends.registry.backend``): CUDA tensors
run the kernels, CPU tensors the twin; ``FLASHTILE_BACKEND`` overrides it (the kernels on
CPU tensors under ``TRITON_INTERPRET=1``). Which kernel then runs is decided inside the
ops, by the registry too (``backends.run``).
"""

from __future__ import annotations

from typing import Optional

import torch

from flashtile import autograd  # registers torch.ops.flashtile
from flashtile.backends import layout, registry
from flashtile.problem.spec import Problem, Varlen
from flashtile.problem.validate import cache_strides
from flashtile.runtime import settings

settings.trace_as_constants(torch.compiler.assume_constant_result)


def new_seed(device) -> torch.Tensor:
    """A dropout Philox key from torch's generator of ``device``: torch.manual_seed makes the
    mask reproducible, and the backward redraws the same mask from the same key."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def attention(q, k, v, problem: Problem, alibi=None, mask=None, varlen: Optional[Varlen] = None, seed=None,
              hint=None, qkv_layout: str = "bhsd", sink=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q, k, v given in ``qkv_layout`` (``layout.LAYOUTS``: by default (B, H, S,
    D) views): out in the same layout, laid out as (B, Sq, H, D) in memory, and lse (B, H,
    Sq) float32. Differentiable in q, k, v.

    ``varlen``: a packed call's metadata (B = 1; the diagonal is per sequence). ``seed``: the
    dropout's Philox key when the caller needs to know it (S_dmask); drawn here otherwise.
    ``hint``: the caller's plan entry (``autograd.attention``). ``sink``: None or a validated
    (H,) tensor (``problem.validate.sink``), read as float32 (a differentiable cast).
    Tensors whose head dim is not contiguous are copied once (the kernels need unit stride
    along D), as flash-attn does.
    """
    q, k, v = (layout.unit_last_stride(t) for t in (q, k, v))
    if sink is not None:
        sink = sink.float().contiguous()
    if problem.dropout_p > 0.0 and seed is None:
        seed = new_seed(q.device)
    if registry.backend(q.device) == "twin":
        from flashtile.backends.twin import attention as twin

        q4, k4, v4 = (layout.canonical(t, qkv_layout) for t in (q, k, v))
        if varlen is not None:
            out4, lse = twin.varlen_forward(q4, k4, v4, problem, alibi, varlen, seed, sink)
        else:
            out4, lse = twin.forward(q4, k4, v4, problem, alibi, mask, seed, sink)
        return layout.from_bshd(out4.transpose(1, 2), qkv_layout), lse

    if alibi is not None and alibi.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "alibi_slopes requires grad: the Triton kernels do not compute slope gradients; detach the slopes, "
            "or run on CPU tensors where the torch path differentiates them")
    if mask is not None and mask.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "attn_mask requires grad: the Triton kernels do not compute mask gradients (that would need an "
            "(L, S) gradient); detach the mask, or run on CPU tensors where the torch path differentiates it")
    return autograd.attention(
        q, k, v, problem.scale, problem.diag_offset, problem.window_left, problem.window_right, problem.softcap,
        alibi, mask, problem.dropout_p, seed, problem.deterministic or torch.are_deterministic_algorithms_enabled(),
        () if varlen is None else varlen, hint, qkv_layout, sink, problem.chunk)


def attention_keyed(q, k, v, problem: Problem, hint, qkv_layout: str = "bhsd", varlen: Optional[Varlen] = None,
                    sink=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention(q, k, v, problem, varlen=varlen, hint=hint, qkv_layout=qkv_layout, sink=sink)``
    for a call whose plan key was made (``runtime.replay.make_key`` gave one, so nothing
    traces or transforms it and no forward-AD level is open) and that has no tensor but q,
    k, v, the packed metadata and a validated sink (no ALiBi, mask or paged keys): the same
    result. What ``attention`` derives from the key alone (the family, the layout copies,
    the op's arguments) is derived once per key and kept in ``hint.below``, the metadata's
    and the sink's tensors left out (each call brings its own); a key that needs
    ``attention``'s full path (dropout, the twin, a head dim with a stride) keeps going
    there."""
    tail = hint.below.get("attention")
    if tail is None:
        plain = (problem.dropout_p == 0.0 and q.device.type != "meta" and registry.backend(q.device) == "kernels"
                 and all(t.stride(-1) == 1 for t in (q, k, v)))
        # the deterministic flag: the key holds torch.are_deterministic_algorithms_enabled()
        bare = None if varlen is None else varlen._replace(cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                                                           seqused_k=None)
        tail = hint.below["attention"] = problem_tail(problem, bare, sink is not None) if plain else ()
    if not tail:
        return attention(q, k, v, problem, varlen=varlen, hint=hint, qkv_layout=qkv_layout, sink=sink)
    if varlen is not None:  # this call's metadata tensors in their four slots
        tail = (*tail[:10], *varlen[:4], *tail[14:])
    if sink is not None:  # and its sink, read as float32 (a differentiable cast), in its slot
        sink = sink.float().contiguous()
        tail = (*tail[:16], sink, *tail[17:])
    return autograd.attention_keyed(hint, qkv_layout, q, k, v, tail, sink)


def problem_tail(problem: Problem, varlen: Optional[Varlen] = None, sink_slot: bool = False) -> tuple:
    """``attn_fwd``'s arguments after q, k, v for a call of ``problem`` with no tensor but q, k,
    v and the packed metadata ``varlen`` (no dropout, ALiBi, mask or sink; ``sink_slot``: with
    the sink's slot, holding None, for a caller to fill); its first ten are also
    ``attn_bwd``'s up to its dlse. Deterministic when the problem or torch says so."""
    return autograd.op_tail(problem.scale, problem.diag_offset, problem.window_left, problem.window_right,
                            problem.softcap, None, None, 0.0, None,
                            problem.deterministic or torch.are_deterministic_algorithms_enabled(),
                            () if varlen is None else tuple(varlen), chunk=problem.chunk, sink_slot=sink_slot)


def attention_with_probs(q, k, v, problem: Problem, alibi=None, varlen: Optional[Varlen] = None,
                         want_probs: bool = False, hint=None, qkv_layout: str = "bhsd", block_table=None,
                         sink=None):
    """``attention`` for the flash-attn functions: (out, lse, S_dmask or None). With
    ``want_probs`` and dropout, the Philox key is drawn here so that S_dmask
    (``backends.probs.dropout_probs``) redraws the mask the call used, on either family.
    ``block_table``: a packed call's paged keys (k, v (num_blocks, page, Hk, D)), gathered
    into one padded sequence per document first (``layout.paged_keys``)."""
    if block_table is not None:
        k, v, cu_k, used_k = layout.paged_keys(k, v, block_table, varlen.cu_seqlens_k, varlen.seqused_k)
        varlen = varlen._replace(cu_seqlens_k=cu_k, seqused_k=used_k)
    want_mask = want_probs and problem.dropout_p > 0.0
    seed = new_seed(q.device) if want_mask else None
    out, lse = attention(q, k, v, problem, alibi, None, varlen, seed, hint, qkv_layout, sink)
    probs = None
    if want_mask:
        from flashtile.backends.probs import dropout_probs

        probs = dropout_probs(layout.canonical(q, qkv_layout), layout.canonical(k, qkv_layout), problem, alibi,
                              seed, varlen, kernels=registry.backend(q.device) == "kernels")
    return out, lse, probs


def kvcache_twin(q, k_cache, v_cache, k, v, cos, sin, call):
    """A validated kv-cache call (``problem.validate.CacheCall``) on the torch twin: the caches
    get the new keys and values in place; returns (out (batch, seqlen_q, H, D), lse (batch,
    H, seqlen_q) float32)."""
    from flashtile.backends.twin.kvcache import kvcache as twin_kvcache

    return twin_kvcache(q, k_cache, v_cache, k, v, cos, sin, call)


def kvcache_kernels(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, table, alibi, spec,
                    device_check: bool, hint=None, sink=None):
    """A validated kv-cache call on the kernels (``backends/triton/decode.py``) through
    ``autograd.kvcache``: the same results as ``kvcache_twin``. ``device_check``: the
    kernels check the metadata values on the device (the host did not). ``hint``: the
    API's plan entry (``autograd.kvcache``). ``sink``: None or a validated (H,) tensor.
    Not differentiable (a decode step)."""
    cache_strides(k_cache, v_cache)
    q, k, v, cos, sin = (None if t is None else layout.unit_last_stride(t) for t in (q, k, v, cos, sin))
    sink = None if sink is None else sink.float().contiguous()
    return autograd.kvcache(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, table, alibi, sink,
                            spec.scale, spec.softcap, spec.window_left, spec.window_right, spec.interleaved,
                            spec.rotary_local, spec.num_splits, device_check, spec.batch_cache, spec.num_blocks,
                            spec.rotary_len, spec.chunk, spec.padding, hint=hint)


def runs_kernels(device) -> bool:
    """Whether tensors on ``device`` run the kernels (else the twin): ``registry.backend``."""
    return registry.backend(device) == "kernels"


def combine(out_partial, lse_partial, out_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_combine`` of validated partials: out_partial (S, B, N, H, D), lse_partial
    (S, B, H, N) float32 -> (out (B, N, H, D) in ``out_dtype``, lse (B, H, N) float32)."""
    if registry.backend(out_partial.device) == "twin":
        from flashtile.backends.twin.kvcache import combine as twin_combine

        return twin_combine(out_partial, lse_partial, out_dtype)
    from flashtile.backends.triton import decode

    s, b, n, h, d = out_partial.shape
    out = out_partial.new_empty((b, n, h, d), dtype=out_dtype)
    lse = lse_partial.new_empty((b, h, n), dtype=torch.float32)
    decode.combine(layout.unit_last_stride(out_partial), layout.unit_last_stride(lse_partial.float()), out, lse)
    return out, lse


def flex(query, key, value, score_mod, call) -> tuple[torch.Tensor, torch.Tensor]:
    """A validated ``flex_attention`` call (``problem.validate.FlexCall``): (out (B, Hq, L,
    Ev) in query's dtype, lse (B, Hq, L) float32). CPU tensors run the twin
    (``backends/twin/flex.py``), CUDA tensors the Triton flex kernels through
    ``autograd.flex``; both differentiable in query, key, value and the mods' captured
    tensors where they can (the kernels refuse what they cannot differentiate)."""
    if registry.backend(query.device) == "twin":
        from flashtile.backends.twin import flex as twin_flex

        if _triton_mod(score_mod) or (call.sparsity is not None and _triton_mod(call.sparsity.mask_mod)):
            raise TypeError("a triton.jit score_mod/mask_mod runs on the kernels only (CUDA tensors, or "
                            "FLASHTILE_BACKEND=triton with TRITON_INTERPRET=1); the twin runs torch functions")

        return twin_flex.forward(query, key, value, score_mod, call.sparsity, call.scale)
    deterministic = call.deterministic or torch.are_deterministic_algorithms_enabled()
    builtin = flex_builtin(query, key, score_mod, call)
    if builtin is not None:
        problem, alibi = builtin
        return attention(query, key, value, problem, alibi)
    return autograd.flex(query, key, value, score_mod, call.sparsity, call.scale, deterministic, call.options)


def flex_builtin(query, key, score_mod, call):
    """(Problem, ALiBi slopes or None) of a flex call that flashtile's built-in kernels compute
    exactly, else None: ready-made mods alone (``api/mods.py``'s ``flashtile_builtin``: a
    causal or sliding-window mask_mod, an ALiBi or softcap score_mod), a block mask built
    by ``flashtile.create_block_mask`` from that mask_mod (its blocks agree with it), the
    top-left diagonal of torch's q_idx/kv_idx. The built-in kernels (the Gluon ones on
    Hopper where they take the call) are faster than the flex kernels for the same
    attention."""
    from flashtile.problem.window import effective_window

    sp = call.sparsity
    left, right, softcap, alibi = -1, -1, 0.0, None
    if sp is not None:
        mask_info = getattr(sp.mask_mod, "flashtile_builtin", None)
        if not sp.exact or mask_info is None:
            return None
        left, right = mask_info["window"]
    if score_mod is not None:
        info = getattr(score_mod, "flashtile_builtin", None)
        if info is None:
            return None
        softcap = info.get("softcap", 0.0)
        slopes = info.get("alibi")
        if slopes is not None:
            nheads = query.shape[1]
            if (slopes.dtype != torch.float32 or tuple(slopes.shape) != (nheads,) or slopes.device != query.device
                    or (slopes.requires_grad and torch.is_grad_enabled())):
                return None
            alibi = slopes.unsqueeze(0).expand(query.shape[0], nheads)
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    left, right = effective_window(left, right, seqlen_q, seqlen_k, 0)
    return Problem(call.scale, 0, left, right, softcap, 0.0, call.deterministic), alibi


def _triton_mod(fn) -> bool:
    """Whether a mod is a ``triton.jit`` function (which only the kernels can run)."""
    if fn is None or not hasattr(fn, "arg_names"):
        return False
    from flashtile.backends.triton.modgen import is_triton_function

    return is_triton_function(fn)


# The dispatch keys excluded outside any kernel (torch's defaults: the autocast keys).
_OUTSIDE_EXCLUDE = torch._C._dispatch_tls_local_exclude_set()


def attention_grads(dout, q, k, v, out, lse, problem: Problem, alibi=None, varlen: Optional[Varlen] = None,
                    qkv_layout: str = "bhsd") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in ``qkv_layout`` of an ``attention`` call, given its saved out and lse (B,
    H, Sq) and the gradient ``dout`` of out: what a backward outside flashtile's autograd
    needs (PyTorch's flash ops, ``integrations/torch_sdpa.py``). No dropout. The kernels
    run their backward op on the saved out and lse; the twin recomputes the forward under
    autograd (its backward is torch's)."""
    if registry.backend(q.device) == "twin":
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        # Called as an aten kernel, autograd's dispatch keys are excluded here: let them back in
        # (keep only what is excluded outside any kernel, e.g. the autocast keys).
        exclude = torch._C._dispatch_tls_local_exclude_set()
        exclude = exclude - (exclude - _OUTSIDE_EXCLUDE)
        with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
                torch.enable_grad():
            again, _ = attention(*leaves, problem, alibi, None, varlen, qkv_layout=qkv_layout)
            return torch.autograd.grad(again, leaves, dout)
    q4, k4, v4 = (layout.canonical(layout.unit_last_stride(t), qkv_layout) for t in (q, k, v))
    out_bshd = layout.to_bshd(out, qkv_layout)
    dout_bshd = layout.to_bshd(layout.unit_last_stride(dout), qkv_layout)
    tail = () if varlen is None else tuple(varlen)
    dq, dk, dv, _ = torch.ops.flashtile.attn_bwd(
        dout_bshd, q4, k4, v4, out_bshd, lse, problem.scale, problem.diag_offset, problem.window_left,
        problem.window_right, problem.softcap, alibi, None, 0.0, None,
        problem.deterministic or torch.are_deterministic_algorithms_enabled(), None, *tail)
    return tuple(layout.from_bshd(g, qkv_layout) for g in (dq, dk, dv))
