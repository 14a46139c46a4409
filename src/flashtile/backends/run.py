"""Run the kernels of a canonical call: choose them (``registry``), allocate the outputs,
launch, and replay a repeated call's launches (``runtime.replay``).

What ``flashtile.autograd``'s ops call. Three passes, each planned per key:

    forward   q, k, v (B, H, S, D) views -> out (B, Sq, H, D), lse (B, H, Sq) float32
    backward  dout, q, k, v, out, lse -> dq (B, Sq, H, D), dk, dv (B, Sk, Hk, D)
    kvcache   append to the caches in place, then decode -> out, lse

The arguments of each pass are the ops' (``FwdArgs``, ``BwdArgs``, ``KVCacheArgs``: named
tuples in op order). A plan's key is its tensors (``tensors()``) and its scalars
(``scalars()``); a training call keeps the forward's entry under the API's and the
backward's under the forward's (``runtime.replay``, ``entry.below``), so a repeated
training step makes no key at all.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from flashtile.backends import configs, layout, registry
from flashtile.problem.spec import Problem, Varlen
from flashtile.problem.window import launch_window
from flashtile.runtime import replay, settings
from flashtile.runtime.device import capability_of, device_context

FWD_PLANS = replay.cache("attn_fwd")
BWD_PLANS = replay.cache("attn_bwd")
KV_PLANS = replay.cache("kvcache")


class FwdArgs(NamedTuple):
    """The forward op's arguments (``torch.ops.flashtile.attn_fwd``), in its order."""

    q: Tensor
    k: Tensor
    v: Tensor
    scale: float
    diag_offset: int
    window_left: int
    window_right: int
    softcap: float
    alibi: Optional[Tensor]
    mask: Optional[Tensor]
    dropout_p: float = 0.0
    seed: Optional[Tensor] = None
    deterministic: bool = False
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    seqused_q: Optional[Tensor] = None
    seqused_k: Optional[Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    sink: Optional[Tensor] = None
    attention_chunk: int = 0

    @classmethod
    def of(cls, args: tuple) -> "FwdArgs":
        """The op's arguments (at least the 10 without defaults) as a ``FwdArgs``, without
        NamedTuple's per-field constructor."""
        return tuple.__new__(cls, args if len(args) == 21 else args + _FWD_DEFAULTS[len(args) - 10:])

    def tensors(self) -> tuple:
        return (self.q, self.k, self.v, self.alibi, self.mask, self.seed, self.cu_seqlens_q, self.cu_seqlens_k,
                self.seqused_q, self.seqused_k, self.sink)

    def scalars(self) -> tuple:
        return (self.scale, self.diag_offset, self.window_left, self.window_right, self.softcap, self.dropout_p,
                bool(self.deterministic), self.max_seqlen_q, self.max_seqlen_k, self.attention_chunk)


class BwdArgs(NamedTuple):
    """The backward op's arguments (``torch.ops.flashtile.attn_bwd``), in its order."""

    dout: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor
    scale: float
    diag_offset: int
    window_left: int
    window_right: int
    softcap: float
    alibi: Optional[Tensor]
    mask: Optional[Tensor]
    dropout_p: float = 0.0
    seed: Optional[Tensor] = None
    deterministic: bool = False
    dlse: Optional[Tensor] = None
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    seqused_q: Optional[Tensor] = None
    seqused_k: Optional[Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    sink: Optional[Tensor] = None
    attention_chunk: int = 0

    @classmethod
    def of(cls, args: tuple) -> "BwdArgs":
        """The op's arguments (at least the 13 without defaults) as a ``BwdArgs``, without
        NamedTuple's per-field constructor (the backward's host path runs every step)."""
        return tuple.__new__(cls, args if len(args) == 25 else args + _BWD_DEFAULTS[len(args) - 13:])

    def tensors(self) -> tuple:
        return (self.dout, self.q, self.k, self.v, self.out, self.lse, self.alibi, self.mask, self.seed, self.dlse,
                self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_q, self.seqused_k, self.sink)

    def scalars(self) -> tuple:
        return (self.scale, self.diag_offset, self.window_left, self.window_right, self.softcap, self.dropout_p,
                bool(self.deterministic), self.max_seqlen_q, self.max_seqlen_k, self.attention_chunk)


_FWD_DEFAULTS = tuple(FwdArgs._field_defaults.values())
_BWD_DEFAULTS = tuple(BwdArgs._field_defaults.values())


def _varlen(a) -> Optional[Varlen]:
    """The packed call's metadata of a pass's arguments (None: fixed lengths)."""
    if a.cu_seqlens_q is None:
        return None
    return Varlen(a.cu_seqlens_q, a.cu_seqlens_k, a.seqused_q, a.seqused_k, a.max_seqlen_q, a.max_seqlen_k)


def _check_grid(num_programs: int) -> None:
    if num_programs > 2**31 - 1:
        raise ValueError(f"batch x heads x blocks = {num_programs} exceeds the grid limit 2^31 - 1")


def _refuse_interpreted_bf16(q: Tensor) -> None:
    if q.dtype == torch.bfloat16 and q.device.type != "cuda":
        raise TypeError("bfloat16 cannot run under TRITON_INTERPRET=1 (triton 3.6's interpreter has no bf16 arithmetic)")


def _call(q: Tensor, problem: Problem, alibi, mask, varlen: Optional[Varlen], k: Tensor, v: Tensor, *tensors,
          sink=None) -> registry.Call:
    """The registry's description of a pass over q (B, H, Sq, D), k, v and ``tensors``."""
    return registry.Call(
        capability=capability_of(q), dtype=str(q.dtype).replace("torch.", ""), head_dim=q.shape[-1],
        seqlen_q=q.shape[2] if varlen is None else varlen.max_seqlen_q, scale=problem.scale,
        window_left=problem.window_left, window_right=problem.window_right, softcap=problem.softcap,
        alibi=alibi is not None, mask=mask is not None, dropout=problem.dropout_p > 0.0, varlen=varlen is not None,
        chunk=problem.chunk > 0, head_dim_v=v.shape[-1] if v.shape[-1] != q.shape[-1] else 0,
        seqused=varlen is not None and varlen.seqused, deterministic=problem.deterministic,
        aligned=layout.tma_ready(q, k, v, *tensors), sink=sink is not None)


# --------------------------------------------------------------------------- forward
def forward_entry(a: FwdArgs):
    """The forward's plan entry for these arguments, or None when not planned."""
    key = replay.make_key(a.tensors(), a.scalars())
    return None if key is None else FWD_PLANS.entry(key, a.tensors())


def forward_planned(entry, a: FwdArgs) -> tuple[Tensor, Tensor]:
    """The forward with the key's entry already found (None: not planned)."""
    if entry is None:
        return _forward_run(a)
    return replay.run(entry, a.tensors(), lambda: _forward_run(a))


def forward(*args) -> tuple[Tensor, Tensor]:
    """The forward op's implementation: out (B, Sq, H, D) and lse (B, H, Sq) float32; a
    repeated call replays its launch plan."""
    a = FwdArgs.of(args)
    return forward_planned(forward_entry(a), a)


def forward_into(out4: Tensor, *args) -> Tensor:
    """The forward op's ordinary path (no plan of its own) writing out into the caller's
    ``out4`` (B, H, Sq, Dv), any strides with unit stride along Dv (the kernels read its
    strides; the registry takes its alignment into account); returns lse (B, H, Sq)
    float32. For callers whose contract fixes out's layout (``integrations/torch_sdpa``)."""
    return _forward_run(FwdArgs.of(args), out4)[1]


def _forward_run(a: FwdArgs, out4: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The forward's ordinary path: buffers (``out4``: the caller's), the registry's
    choice, launches."""
    q, k, v = a.q, a.k, a.v
    _refuse_interpreted_bf16(q)
    batch, nheads, seqlen_q, _ = q.shape
    varlen = _varlen(a)
    if out4 is None:
        out = q.new_empty((batch, seqlen_q, nheads, v.shape[-1]))  # returned as it is: not a view
        out4 = out.transpose(1, 2)
    else:
        out = out4.transpose(1, 2)
    lse = layout.new_lse(q)
    no_keys = k.shape[2] == 0
    if out4.numel() == 0 or (varlen is not None and varlen.batch == 0) or (no_keys and varlen is None):
        # No keys at all: every row is empty (output 0, LSE -inf or the sink), as in the kernel.
        out4.zero_()
        if a.sink is not None and varlen is None:
            return out, lse.copy_(a.sink[None, :, None].expand_as(lse))
        return out, lse.fill_(float("-inf"))
    if no_keys and a.sink is None:  # packed, no keys: the same (a sink's rows go to the kernel)
        out4.zero_()
        return out, lse.fill_(float("-inf"))
    if varlen is not None and varlen.seqused:
        # Rows past a sequence's used length belong to no work item.
        out4.zero_()
        lse.fill_(float("-inf"))
    left, right = launch_window(a.window_left, a.window_right, seqlen_q, k.shape[2], a.diag_offset, varlen)
    problem = Problem(a.scale, a.diag_offset, left, right, a.softcap, a.dropout_p, bool(a.deterministic),
                      a.attention_chunk)
    call = _call(q, problem, a.alibi, a.mask, varlen, k, v, out4, sink=a.sink)
    choice = registry.forward(call)
    with device_context(q):
        if call.capability is not None and settings.autotune() and a.dropout_p == 0.0 and varlen is None:
            choice = _autotune(call, choice, a, problem, out4, lse)
        rows = seqlen_q if varlen is None else varlen.max_seqlen_q
        block_m = choice.config.block_m if choice.config is not None else 128
        _check_grid(-(-rows // block_m) * nheads * (batch if varlen is None else varlen.batch))
        _launch_forward(choice, q, k, v, out4, lse, problem, a.alibi, a.mask, a.seed, varlen, a.sink)
    return out, lse


def _launch_forward(choice, q, k, v, out4, lse, problem, alibi, mask, seed, varlen, sink=None) -> None:
    if choice.family == "sm90":
        from flashtile.backends.sm90 import forward as sm90_forward

        sm90_forward.attention_forward_ws(q, k, v, out4, lse, scale=problem.scale, diag_offset=problem.diag_offset,
                                          causal=problem.causal, varlen=varlen, sink=sink)
    else:
        from flashtile.backends.triton import forward as triton_forward

        triton_forward.attention_forward(q, k, v, out4, lse, problem, config=choice.config, alibi=alibi, mask=mask,
                                         seed=seed, varlen=varlen, sink=sink)


def launch_forward(q, k, v, out4, lse, problem: Problem, config=None, alibi=None, mask=None, seed=None,
                   varlen=None, sink=None) -> registry.Choice:
    """Launch the forward the registry picks for a ``config`` of the table (None: the
    table's own) on buffers the caller made: out4 (B, H, Sq, D), lse (B, H, Sq) float32.
    What autotuning and the benchmark sweeps time; returns the choice."""
    choice = registry.forward(_call(q, problem, alibi, mask, varlen, k, v, out4, sink=sink), config)
    with device_context(q):
        _launch_forward(choice, q, k, v, out4, lse, problem, alibi, mask, seed, varlen, sink)
    return choice


def _autotune(call, choice, a: FwdArgs, problem: Problem, out4, lse):
    """The fastest of the table's config and ``configs.fwd_candidates`` for this key (timed
    once, cached on disk: ``configs.autotuned_fwd_config``), as the registry's choice."""
    import triton
    from triton.testing import do_bench

    q, k = a.q, a.k
    key = "|".join(map(str, (
        torch.cuda.get_device_name(q.device), q.dtype, q.shape[-1], q.shape[1] // k.shape[1],
        problem.window_left >= 0, problem.window_right >= 0, problem.softcap > 0, a.alibi is not None,
        None if a.mask is None else a.mask.dtype, a.sink is not None, problem.chunk > 0, triton.__version__,
    )))
    default = configs.default_fwd_config(call.capability, call.head_dim, call.dtype, call.window_right >= 0,
                                         call.seqlen_q, call.mask)

    def time_ms(cfg):
        pick = registry.forward(call, cfg)
        return do_bench(lambda: _launch_forward(pick, q, k, a.v, out4, lse, problem, a.alibi, a.mask, a.seed, None,
                                                a.sink),
                        warmup=5, rep=20, return_mode="median")

    best = configs.autotuned_fwd_config(key, [default] + configs.fwd_candidates(q.shape[-1]), time_ms)
    return registry.forward(call, best)


# --------------------------------------------------------------------------- backward
def backward(*args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward op's implementation. dout/out are (B, Sq, H, D); returns dq (B, Sq, H,
    D), dk/dv (B, Sk, Hk, D) and dsink ((H,) float32; (0,) without a sink). ``dlse`` (B, H,
    Sq), the gradient reaching the returned LSE (a z-loss, say), is folded into the kernels'
    Delta: d lse / d s_j = p_j, so dS_j = p_j (dP_j - (Delta - dlse)). Planned as the
    forward."""
    a = BwdArgs.of(args)
    tensors = a.tensors()
    return replay.call(BWD_PLANS, replay.make_key(tensors, a.scalars()), tensors, lambda: _backward_run(a))


def backward_planned(fwd_entry, *args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward of a planned forward: its key is the forward's plus what only the
    backward brings (dout, dlse, the switches) and the saved tensors' keys (a
    saved-tensors hook may hand them back with other strides), so the entry is found in
    the forward entry's ``below`` without making the full key."""
    a = BwdArgs.of(args)
    if replay.active_recorder() is not None:  # inside another call's recording: never planned
        return _backward_run(a)
    small = (replay.env_key(), *map(replay.tensor_key, (a.dout, a.q, a.k, a.v, a.out, a.lse, a.dlse)))
    entry = fwd_entry.below.get(small)
    tensors = a.tensors()
    if entry is None:
        key = replay.make_key(tensors, a.scalars())
        if key is None:  # something traces this backward: the ordinary path, this time
            return _backward_run(a)
        entry = fwd_entry.below[small] = BWD_PLANS.entry(key, tensors)
    return replay.run(entry, tensors, lambda: _backward_run(a))


def _sink_grad(sink: Optional[Tensor], lse: Tensor, delta: Tensor) -> Tensor:
    """dsink ((H,) float32, ``triton.backward.sink_grad``), or (0,) without a sink."""
    if sink is None:
        return lse.new_empty((0,))
    from flashtile.backends.triton import backward as triton_backward

    with device_context(lse):
        return triton_backward.sink_grad(sink, lse, delta)


def backward_into(grads: tuple[Tensor, Tensor, Tensor], *args) -> Tensor:
    """The backward op's ordinary path (no plan of its own) writing dq, dk, dv into the
    caller's ``grads`` (B, H, Sq, D), (B, Hk, Sk, D), (B, Hk, Sk, Dv): any strides with unit
    stride along D; returns dsink ((0,) without a sink). For callers whose contract fixes
    the gradients' layout (``integrations/torch_sdpa``)."""
    return _backward_run(BwdArgs.of(args), grads)[3]


def _backward_run(a: BwdArgs, grads: Optional[tuple] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward's ordinary path: buffers (``grads``: the caller's dq, dk, dv (B, H, S,
    D) views), the registry's choice, Delta, launches."""
    q, k, v = a.q, a.k, a.v
    varlen = _varlen(a)
    dq4, dk4, dv4 = grads or (layout.bshd_view(q), layout.bshd_view(k), layout.bshd_view(v))
    if q.numel() == 0 or k.numel() == 0 or (varlen is not None and varlen.batch == 0):
        # Out is 0 wherever there are rows: Delta is -dlse.
        delta = torch.zeros_like(a.lse) if a.dlse is None else -a.dlse.float().contiguous()
        return (dq4.transpose(1, 2).zero_(), dk4.transpose(1, 2).zero_(), dv4.transpose(1, 2).zero_(),
                _sink_grad(a.sink, a.lse, delta))
    if varlen is not None and varlen.seqused:
        for t in (dq4, dk4, dv4):  # rows and keys past the used lengths get no program
            t.zero_()
    dout = a.dout
    if dout.dtype != a.out.dtype:  # autograd casts; a direct op call might not (tl.dot needs one dtype)
        dout = dout.to(a.out.dtype)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    out4, do4 = a.out.transpose(1, 2), dout.transpose(1, 2)
    if not a.lse.is_contiguous():
        raise ValueError("lse must be contiguous (the forward's own output)")
    deterministic = bool(a.deterministic)
    left, right = launch_window(a.window_left, a.window_right, q.shape[2], k.shape[2], a.diag_offset, varlen)
    problem = Problem(a.scale, a.diag_offset, left, right, a.softcap, a.dropout_p, deterministic, a.attention_chunk)
    choice = registry.backward(_call(q, problem, a.alibi, a.mask, varlen, k, v, do4, dq4, dk4, dv4))
    rows = q.shape[2] if varlen is None else varlen.max_seqlen_q
    block_m = choice.config.block_m_q if choice.config is not None else 64
    _check_grid(-(-rows // block_m) * q.shape[1] * (q.shape[0] if varlen is None else varlen.batch))
    delta = _launch_backward(choice, q, k, v, out4, a.lse, do4, dq4, dk4, dv4, problem, a.alibi, a.mask, a.seed,
                             a.dlse, varlen)
    return dq4.transpose(1, 2), dk4.transpose(1, 2), dv4.transpose(1, 2), _sink_grad(a.sink, a.lse, delta)


def _launch_backward(choice, q, k, v, out4, lse, do4, dq4, dk4, dv4, problem, alibi, mask, seed, dlse,
                     varlen) -> Tensor:
    """Delta (every family needs it), then the backward kernels of ``choice``; returns Delta.
    A sink needs nothing here: it is in the LSE, and its own gradient is ``_sink_grad``."""
    from flashtile.backends.triton import backward as triton_backward

    onepass = choice.kernel == "sm90.backward_onepass"
    with device_context(q):
        if onepass:
            tables = [(128, True)]  # one program per block of 128 keys
        elif choice.family == "sm90":
            tables = [(128, True), (128, False)]  # the Gluon kernels' blocks: 128 keys, 128 queries
        elif choice.config.fused_dq:
            tables = [(choice.config.block_n_kv, True)]
        else:
            tables = [(choice.config.block_n_kv, True), (choice.config.block_m_q, False)]
        acc = None  # the one-pass kernel's float32 dQ, zeroed by the preprocess's launch (fixed lengths)
        if onepass:
            from flashtile.backends.sm90 import backward_onepass

            if varlen is None:
                acc = backward_onepass.accumulator(q)
        delta, built = triton_backward.preprocess(out4, do4, dlse, varlen, tables, problem.window_left,
                                                  problem.window_right, k.shape[2], accumulator=acc)
        if onepass:
            backward_onepass.attention_backward_onepass(q, k, v, do4, lse, delta, dq4, dk4, dv4,
                                                        scale=problem.scale, diag_offset=problem.diag_offset,
                                                        causal=problem.causal,
                                                        varlen=None if varlen is None else (varlen, *built),
                                                        dq_accum=acc, deterministic=problem.deterministic)
        elif choice.family == "sm90":
            from flashtile.backends.sm90 import backward_split

            backward_split.attention_backward_ws(q, k, v, do4, lse, delta, dq4, dk4, dv4, scale=problem.scale,
                                                 diag_offset=problem.diag_offset, causal=problem.causal,
                                                 varlen=None if varlen is None else (varlen, *built))
        else:
            triton_backward.attention_backward(q, k, v, lse, delta, do4, dq4, dk4, dv4, problem,
                                               config=choice.config, alibi=alibi, mask=mask, seed=seed,
                                               varlen=varlen, tables=built)
    return delta


def launch_backward(q, k, v, out4, lse, do4, dq4, dk4, dv4, problem: Problem, config=None, alibi=None, mask=None,
                    seed=None, dlse=None, varlen=None) -> registry.Choice:
    """Launch the backward on buffers the caller made (q, out4, do4, dq4 (B, H, Sq, D); k,
    v, dk4, dv4 (B, Hk, Sk, D); lse the forward's): the registry's choice, or with
    ``config`` (a ``configs.BwdConfig``) the Triton kernels with those tiles. What the
    benchmark sweeps time; returns the choice."""
    if config is not None:
        choice = registry.Choice("triton", "triton.backward_atomic" if config.fused_dq else "triton.backward",
                                 config, ("a config was given",))
    else:
        choice = registry.backward(_call(q, problem, alibi, mask, varlen, k, v, do4, dq4, dk4, dv4))
    _launch_backward(choice, q, k, v, out4, lse, do4, dq4, dk4, dv4, problem, alibi, mask, seed, dlse, varlen)
    return choice


# --------------------------------------------------------------------------- kv cache
class KVCacheArgs(NamedTuple):
    """The kv-cache op's arguments (``torch.ops.flashtile.kvcache``), in its order."""

    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    k: Optional[Tensor]
    v: Optional[Tensor]
    cos: Optional[Tensor]
    sin: Optional[Tensor]
    seqlens: Tensor
    leftpad: Optional[Tensor]
    batch_idx: Optional[Tensor]
    table: Optional[Tensor]
    alibi: Optional[Tensor]
    sink: Optional[Tensor]
    scale: float
    softcap: float
    window_left: int
    window_right: int
    interleaved: bool
    rotary_local: bool
    num_splits: int
    device_check: bool
    batch_cache: int
    num_blocks: int
    rotary_len: int
    attention_chunk: int = 0
    padding: bool = False  # negative cache_seqlens: a padding sequence (nothing appended or read)

    def tensors(self) -> tuple:
        return self[:13]

    def scalars(self) -> tuple:
        return self[13:]


def kvcache(*args, hint=None) -> tuple[Tensor, Tensor]:
    """The kv-cache op's implementation: out (batch, seqlen_q, H, D), lse (batch, H,
    seqlen_q) float32; k_cache/v_cache get k, v. ``hint``: the plan entry of an API call
    whose key determines these arguments but their addresses; the kernels' entry is then
    kept in ``hint.below`` and a repeated call replays it without making its key."""
    tensors = args[:13]  # KVCacheArgs.tensors(), without building the tuple on the replay path
    entry = None if hint is None else hint.below.get("kvcache")
    if entry is None:
        a = KVCacheArgs(*args)
        # under CUDA-graph capture a step takes other launches (``decode.fuse_step``)
        key = replay.make_key(tensors, (*a.scalars(), replay.capturing(a.q)))
        if key is None:
            return _kvcache_run(a)
        entry = KV_PLANS.entry(key, tensors)
        if hint is not None:
            hint.below["kvcache"] = entry
    return replay.run(entry, tensors, lambda: _kvcache_run(KVCacheArgs(*args)))


def _kvcache_run(a: KVCacheArgs) -> tuple[Tensor, Tensor]:
    from flashtile.backends.triton import decode

    q = a.q
    _refuse_interpreted_bf16(q)
    batch, seqlen_q, nheads, _ = q.shape
    new = 0 if a.k is None else a.k.shape[1]
    out = q.new_empty((batch, seqlen_q, nheads, a.v_cache.shape[-1]))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    # the decode kernel appends k, v itself (a short append: decode.FUSED_APPEND_MAX)
    fused = 0 < new <= decode.FUSED_APPEND_MAX and settings.decode_append() == "fused"
    # ... and checks the metadata itself where it is the only writer (no append kernel)
    combine, check = settings.decode_combine(), settings.decode_check()
    small = "auto" in (combine, check) and decode.fuse_step(q, a.k_cache, a.v_cache, a.table)
    # ... or each decode program checks what it reads, and the kernel after it appends
    spread_ok = (a.device_check and (new == 0 or fused) and check in ("auto", "spread")
                 and decode.spread_step(q, a.k_cache, a.v_cache, a.table, a.num_splits, new))
    # (an explicit spread check that applies keeps the separate combine: its last kernel is that combine)
    fused_combine = combine == "fused" or (combine == "auto" and small and not (check == "spread" and spread_ok))
    fused_check = a.device_check and (new == 0 or fused) and (check == "fused" or (check == "auto" and small))
    spread = spread_ok and not fused_check and not fused_combine
    status, parts, slots = decode.scratch(q, a.k_cache, a.table, a.num_splits, a.device_check,
                                          a.v_cache.shape[-1], spread)
    if a.device_check and not fused_check and not spread:
        paged = a.table is not None
        page = a.k_cache.shape[1] if paged else 0
        capacity = a.table.shape[1] * page if paged else a.k_cache.shape[1]
        decode.check_metadata(status, a.seqlens, a.leftpad, a.batch_idx, a.table, new=new, queries=seqlen_q,
                              capacity=capacity, batch_cache=a.batch_cache, num_blocks=a.num_blocks, page=page,
                              rotary_len=a.rotary_len, rotary_local=a.rotary_local, padding=a.padding)
    if new > 0 and not fused:
        decode.append(a.k_cache, a.v_cache, a.k, a.v, a.seqlens, a.batch_idx, a.table, a.cos, a.sin,
                      interleaved=a.interleaved, status=status, padding=a.padding)
    decode.decode(q, a.k_cache, a.v_cache, out, lse, a.seqlens, a.leftpad, a.batch_idx, a.table, a.alibi, a.cos,
                  a.sin, new=new, scale=a.scale, softcap=a.softcap, window_left=a.window_left,
                  window_right=a.window_right, interleaved=a.interleaved, rotary_local=a.rotary_local,
                  num_splits=a.num_splits, status=status, parts=parts, sink=a.sink, chunk=a.attention_chunk,
                  k_new=a.k if fused else None, v_new=a.v if fused else None,
                  fused_combine=fused_combine, padding=a.padding, fused_check=fused_check,
                  rotary_len=a.rotary_len, slots=slots)
    return out, lse


# --------------------------------------------------------------------------- flex_attention
def flex_launch(q: Tensor, k: Tensor, v: Tensor, score_mod, sparsity, scale: float, options: dict):
    """The flex kernels' launch for a validated call: the mods translated
    (``triton/modgen.py``: refused with an error naming what does not translate), the
    registry's choice, the tiles (``triton/flex.FlexLaunch``)."""
    from torch.nn.attention.flex_attention import noop_mask

    from flashtile.backends.triton import flex, modgen

    _refuse_interpreted_bf16(q)
    registry.flex(capability_of(q))
    score = None if score_mod is None else modgen.translate(score_mod, "score", q.device)
    mask_mod = None if sparsity is None else sparsity.mask_mod
    mask = None if mask_mod is None or mask_mod is noop_mask else modgen.translate(mask_mod, "mask", q.device)
    return flex.FlexLaunch(q, k, v, score, mask, sparsity, scale, options, interpret=settings.interpret())
