"""Which calls the Hopper (Gluon) kernels take, and the reason when they do not.

Pure Python (no triton, no torch): ``backends.registry`` asks these functions for every
call, ``flashtile explain`` answers from them without a GPU, and the kernels of this
package import their head-dim sets from here. Each scope function returns None when the
call is in scope, else one sentence that says why not.
"""

from __future__ import annotations

from typing import Optional

HEAD_DIMS = (64, 128, 256)  # the Gluon forward and backward kernels
ONEPASS_HEAD_DIMS = (64, 128)  # the one-pass backward, default where faster (H200 runs 86, 96)
SPLIT_HEAD_DIMS = (256,)  # dV and dK from separate kernels (backward_split's _dv_kernel, _dk_kernel)
VARLEN_BACKWARD_HEAD_DIMS = tuple(d for d in HEAD_DIMS if d not in SPLIT_HEAD_DIMS)
# Deterministic fixed-length calls take the one-pass kernel's ordered dQ sums: without causal
# at every length (its key blocks from query tiles of their own where ``det_rotate`` allows:
# H100 run 237, bf16, against the split kernels +3 to +12.5% at S2048-4096), causal ones from
# this seqlen_q on (S2048: d64 +3% on the H100 (run 237), +4.5% on the H200 (run 238), d128
# -1% and +1%; S4096 on the H100 +10% and +5.5%; runs 232-235: +9 to +12% at d64
# S8192-16384, 0 to +5% at d128). Below 2048 queries nothing was measured for either kernel:
# causal calls keep the split kernels there, calls without causal take the rotated order
# (3 to 12.5% faster than the split kernels at S2048-4096 in run 237).
DETERMINISTIC_ONEPASS_MIN_SEQLEN = 2048


def kernels_scope(call) -> Optional[str]:
    """The forward's scope, which the backward kernels share: fp16/bf16, head dim 64, 128
    or 256, plain or causal (no other window side), no softcap, ALiBi, mask, dropout or chunk, a
    scale the exponent's FFMA keeps normal (1e-30 < scale < 1e30: m * scale with m = -inf
    must not become -inf * 0). ``call``: a ``registry.Call``."""
    if call.dtype not in ("float16", "bfloat16"):
        return f"the Gluon kernels take fp16/bf16, not {call.dtype}"
    if call.head_dim not in HEAD_DIMS:
        return f"the Gluon kernels take head dims {HEAD_DIMS}, not {call.head_dim}"
    if call.head_dim_v not in (0, call.head_dim):
        return f"the Gluon kernels take one head dim for q, k and v, not {call.head_dim} and {call.head_dim_v}"
    extras = [name for name, on in (("a left window", call.window_left >= 0),
                                    ("a right window other than causal", call.window_right > 0),
                                    ("softcap", call.softcap), ("ALiBi", call.alibi), ("a mask", call.mask),
                                    ("dropout", call.dropout), ("chunked attention", call.chunk)) if on]
    if extras:
        return "the Gluon kernels take plain or causal attention only, not " + " or ".join(extras)
    if not 1e-30 < call.scale < 1e30:
        return f"the Gluon kernels need 1e-30 < softmax_scale < 1e30, got {call.scale}"
    return None


def _rows_scope(call) -> Optional[str]:
    """``kernels_scope``, and no seqused/paged keys in a packed call (the Gluon tiles read
    whole rows past a sequence's used end: masked scores, but 0 * NaN in P V if those rows
    hold garbage, as an unused cache tail may)."""
    reason = kernels_scope(call)
    if reason is None and call.varlen and call.seqused:
        reason = "a packed call with seqused or paged keys stays on the Triton kernels (rows past the used end)"
    return reason


def forward_scope(call) -> Optional[str]:
    """The Gluon forward: ``_rows_scope`` (an attention sink is added in its epilogue:
    ``attention_forward_ws(sink=)``)."""
    return _rows_scope(call)


def backward_scope(call) -> Optional[str]:
    """The Gluon backward (split or one-pass): ``_rows_scope`` (a sink reaches the backward
    only through the LSE: in scope); packed calls at head dims 64 and 128 only (no varlen
    kernels for the d256 split)."""
    reason = _rows_scope(call)
    if reason is None and call.varlen and call.head_dim not in VARLEN_BACKWARD_HEAD_DIMS:
        reason = f"no packed-call Gluon backward at head dim {call.head_dim}"
    return reason


def onepass_scope(call, bwd_dq: str) -> Optional[str]:
    """The one-pass backward instead of the split kernels: a head dim of ONEPASS_HEAD_DIMS,
    ``FLASHTILE_BWD_DQ`` (``bwd_dq``) auto or onepass, deterministic calls with fixed lengths
    only (its deterministic mode adds dQ's parts in a fixed order) and under ``auto`` causal
    ones from ``DETERMINISTIC_ONEPASS_MIN_SEQLEN`` queries on, and
    for packed calls either no causal
    mask, head dim 64 or ``onepass`` (H100 packed backward one-pass / split: without causal
    1.03-1.08x at every row in run 118, 1.04-1.14x in run 127; causal at d64 1.01-1.04x
    with the 32-byte dQ swizzle, at d128 0.98-1.03x: run 127)."""
    if call.deterministic and call.varlen:
        return ("deterministic packed calls take the split kernels (the one-pass kernel orders dQ's sums for "
                "fixed lengths)")
    if call.head_dim not in ONEPASS_HEAD_DIMS:
        return f"the one-pass kernel takes head dims {ONEPASS_HEAD_DIMS}; d{call.head_dim} takes the split kernels"
    if bwd_dq not in ("auto", "onepass"):
        return f"FLASHTILE_BWD_DQ={bwd_dq} keeps the split kernels"
    if (call.deterministic and bwd_dq == "auto" and call.window_right == 0  # causal (kernels_scope: no other window)
            and call.seqlen_q < DETERMINISTIC_ONEPASS_MIN_SEQLEN):
        return (f"deterministic and causal with seqlen_q < {DETERMINISTIC_ONEPASS_MIN_SEQLEN}: the split kernels "
                "(the one-pass kernel's ordered dQ sums are not measured faster there; FLASHTILE_BWD_DQ=onepass "
                "takes it)")
    if (call.varlen and bwd_dq != "onepass" and call.head_dim != 64
            and (call.window_left >= 0 or call.window_right >= 0)):
        return (f"causal packed calls at d{call.head_dim} take the split kernels (the one-pass kernel ran "
                "0.98-1.03x them there; FLASHTILE_BWD_DQ=onepass takes it)")
    return None
