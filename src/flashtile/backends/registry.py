"""Which kernel family runs a call, and why: the one place a family is chosen.

Three families: the torch twin (``backends/twin``: plain torch ops, CPU tensors), the
portable Triton kernels (``backends/triton``) and the Hopper Gluon kernels
(``backends/sm90``). The launchers (``backends.run``), ``flashtile explain``,
``flashtile check`` and the tests all ask the functions here; none repeats their rules.

A call is described by a ``Call`` (facts of a validated call, no tensors), so the same
answer comes for a real call on a GPU and for a described one on a laptop. A ``Choice``
names the kernel, its launch configuration and the reasons a faster family was not taken.
Order of preference, per pass:

    forward   sm90 forward, where the sm90 table sends the shape and ``sm90.scope`` takes it;
              else the Triton forward with the table's tiles.
    backward  sm90 one-pass (d64/d128; deterministic: fixed lengths, causal ones from 2048
              queries on, or any fixed length with FLASHTILE_BWD_DQ=onepass), else the sm90 split kernels, in
              ``sm90.scope``; else the Triton dK/dV and dQ kernels (dQ by atomics only with
              FLASHTILE_BWD_DQ=atomic and not deterministic).
    decode    the Triton kv-cache kernels (the only family).
    flex      the Triton flex kernels (FlexAttention's score_mod/mask_mod/BlockMask); the
              Gluon kernels take no user functions yet.

The backward does not consult the forward's table: a short causal d64 forward runs on
Triton (its 64-row tiles waste less on the diagonal) while its backward runs on Gluon.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from flashtile.backends import configs
from flashtile.backends.sm90 import scope as sm90_scope
from flashtile.runtime import settings

KERNELS = {
    "twin": "chunked torch twin (backends/twin/attention.py), differentiated by torch autograd",
    "triton.forward": "Triton forward (backends/triton/forward.py)",
    "triton.backward": "Triton dK/dV + dQ kernels (backends/triton/backward.py)",
    "triton.backward_atomic": "Triton dK/dV kernel with dQ by float32 atomics (backends/triton/backward.py: "
                              "FA2's single pass, not bitwise reproducible)",
    "triton.decode": "Triton kv-cache kernels (backends/triton/decode.py): check, split-KV decode (appending a short "
                     "append itself; a long one runs the append kernel first), combine",
    "triton.flex": "Triton flex kernels (backends/triton/flex.py): translated score_mod/mask_mod, block-sparse "
                   "forward, dQ and dK/dV (deterministic)",
    "sm90.forward": "Gluon warp-specialized forward (backends/sm90/forward.py)",
    "sm90.backward_split": "Gluon dK/dV + dQ kernels (backends/sm90/backward_split.py)",
    "sm90.backward_split_d256": "Gluon dV, dK and dQ kernels (backends/sm90/backward_split.py, d256 split)",
    "sm90.backward_onepass": "Gluon one-pass kernel (backends/sm90/backward_onepass.py: dQ by float32 reductions, "
                             "in a fixed order when deterministic)",
}


@dataclass(frozen=True)
class Call:
    """What the choice of kernels depends on.

    ``capability``: the CUDA device's (major, minor); None for CPU tensors under
    ``TRITON_INTERPRET=1``. ``seqlen_q``: query rows (a packed call: the longest
    sequence). The window is normalised (``problem.window``). ``seqused``: a packed call
    with seqused_q/k (or paged keys). ``aligned``: every tensor of the pass can be read by
    TMA (fp16/bf16, 16-byte aligned bases and strides; ``backends.run.tma_ready``).
    ``sink``: a learnable sink per head (only the forward reads it; the backward sees it
    through the LSE). ``chunk``: chunked attention. ``head_dim_v``: v's head dim when it
    differs from q's (0: the same).
    """

    capability: Optional[tuple[int, int]]
    dtype: str
    head_dim: int
    seqlen_q: int
    scale: float = 1.0
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi: bool = False
    mask: bool = False
    dropout: bool = False
    varlen: bool = False
    seqused: bool = False
    deterministic: bool = False
    aligned: bool = True
    sink: bool = False
    chunk: bool = False
    head_dim_v: int = 0

    @property
    def widest(self) -> int:
        """The larger of the q/k and v head dims (``head_dim_v`` 0: the same as q's)."""
        return max(self.head_dim, self.head_dim_v)


@dataclass(frozen=True)
class Choice:
    """The kernel that runs a pass (a key of ``KERNELS``), its family, its launch
    configuration (a ``configs.FwdConfig``/``BwdConfig`` for the Triton kernels, None
    for the others) and why no faster family took the call."""

    family: str
    kernel: str
    config: Any = None
    why: tuple[str, ...] = ()

    @property
    def description(self) -> str:
        return KERNELS[self.kernel]


def backend(device) -> str:
    """"twin" (plain torch ops) or "kernels" (Triton and Gluon) for tensors on ``device``:
    the kernels for CUDA tensors, the twin for CPU tensors; ``FLASHTILE_BACKEND`` forces one
    (the kernels on CPU tensors only under ``TRITON_INTERPRET=1``)."""
    choice = settings.backend()
    if choice == "auto":
        return "kernels" if device.type == "cuda" else "twin"
    if choice == "triton":
        if device.type != "cuda" and not settings.interpret():
            raise ValueError(f"FLASHTILE_BACKEND=triton needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors; "
                             f"got device {device}")
        return "kernels"
    return "twin"


def _gluon_reason(call: Call, scope) -> Optional[str]:
    """Why the Gluon kernels of ``scope`` (an ``sm90.scope`` function) do not take the call:
    the device, the switch, the scope, then the tensors' alignment; None when they do."""
    if call.capability[0] != 9:
        return "the Gluon kernels need Hopper (sm90)"
    if not settings.gluon_enabled():
        return "FLASHTILE_WS=0"
    reason = scope(call)
    if reason is None and not call.aligned:
        reason = "the tensors are not TMA-ready (16-byte aligned bases and strides)"
    return reason


def forward(call: Call, config: Optional[configs.FwdConfig] = None) -> Choice:
    """The forward kernel of ``call``. ``config``: a table entry to use instead of the
    table's (autotuning's winner)."""
    if call.capability is None:
        return Choice("triton", "triton.forward", configs.INTERPRETER_FWD,
                      ("CPU tensors: the Triton kernels under TRITON_INTERPRET=1",))
    cfg = config or configs.default_fwd_config(call.capability, call.widest, call.dtype, call.window_right >= 0,
                                               call.seqlen_q, call.mask)
    if cfg.use_ws:
        reason = _gluon_reason(call, sm90_scope.forward_scope)
        if reason is None:
            return Choice("sm90", "sm90.forward")
    elif call.capability[0] == 9:
        reason = (_gluon_reason(call, sm90_scope.forward_scope)
                  or "the sm90 table sends this shape to the Triton kernel (short causal d64: 64-row tiles)")
    else:
        reason = "the Gluon kernels need Hopper (sm90)"
    cfg = replace(cfg, use_ws=False, use_tma=cfg.use_tma and call.aligned and not call.varlen)
    return Choice("triton", "triton.forward", cfg, (reason,))


def backward(call: Call) -> Choice:
    """The backward kernels of ``call``."""
    if call.capability is None:
        fused = configs.bwd_dq_mode(call.deterministic) == "atomic"
        return Choice("triton", "triton.backward_atomic" if fused else "triton.backward",
                      replace(configs.INTERPRETER_BWD, fused_dq=fused),
                      ("CPU tensors: the Triton kernels under TRITON_INTERPRET=1",))
    reason = _gluon_reason(call, sm90_scope.backward_scope)
    if reason is None:
        onepass = sm90_scope.onepass_scope(call, settings.bwd_dq())
        if onepass is None:
            return Choice("sm90", "sm90.backward_onepass")
        split = "sm90.backward_split_d256" if call.head_dim in sm90_scope.SPLIT_HEAD_DIMS else "sm90.backward_split"
        return Choice("sm90", split, None, (onepass,))
    tile_masks = call.window_left >= 0 or call.window_right >= 0 or call.mask or call.chunk
    cfg = configs.default_bwd_config(call.capability, call.widest, call.dtype, call.deterministic,
                                     tile_masks=tile_masks)
    return Choice("triton", "triton.backward_atomic" if cfg.fused_dq else "triton.backward", cfg, (reason,))


def decode() -> Choice:
    """The kv-cache kernels (one family: the Triton kernels)."""
    return Choice("triton", "triton.decode")


def flex(capability: Optional[tuple[int, int]]) -> Choice:
    """The kernels of a ``flex_attention`` call (forward and backward)."""
    if capability is None:
        return Choice("triton", "triton.flex", None, ("CPU tensors: the Triton kernels under TRITON_INTERPRET=1",))
    return Choice("triton", "triton.flex", None,
                  ("the Gluon kernels take no score_mod/mask_mod (FlexAttention) yet",))
