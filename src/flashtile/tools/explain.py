"""Which kernels a call takes, and why: ``flashtile explain`` / ``flashtile.tools.explain.explain``.

Answers from the same decision functions the launch uses (``backends.configs`` tables,
``forward_sm90.ws_applies``, the varlen and TMA conditions of ``backends.triton.forward`` and
``backends.triton.backward``) for a described call, so no GPU is needed. It assumes what the API makes
of ordinary inputs: flash-attn layout tensors, contiguous, 16-byte aligned.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class Plan:
    """The kernels of one call."""

    backend: str  # "gluon-sm90" | "triton" | "torch-twin"
    forward: str
    forward_config: Optional[dict]
    backward: str
    backward_config: Optional[dict]
    reasons: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"forward:  {self.forward}" + (f"  {self.forward_config}" if self.forward_config else ""),
                 f"backward: {self.backward}" + (f"  {self.backward_config}" if self.backward_config else "")]
        return "\n".join(lines + [f"  - {r}" for r in self.reasons])


_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def explain(seqlen_q: int, seqlen_k: Optional[int] = None, head_dim: int = 128, *, dtype: str = "bf16",
            causal: bool = False, window: tuple = (-1, -1), softcap: float = 0.0, alibi: bool = False,
            mask: bool = False, dropout_p: float = 0.0, varlen: bool = False, seqused: bool = False,
            device: str = "cuda", capability: tuple = (9, 0), ws_env: bool = True,
            deterministic: bool = False) -> Plan:
    """The plan of a flash-attn-style call (``varlen``: a packed call, seqlen = the longest
    sequence; ``seqused``: with seqused_q/k or paged keys) on a GPU of ``capability``, or on
    CPU tensors (``device="cpu"``). ``ws_env=False`` stands for FLASHTILE_WS=0;
    ``deterministic`` for the call's flag (or torch.use_deterministic_algorithms).
    FLASHTILE_BWD_DQ is read from the environment."""
    import torch

    from flashtile.backends import configs
    from flashtile.backends.sm90 import forward as forward_sm90
    from flashtile.backends.sm90.backward_split import SPLIT_HEAD_DIMS
    from flashtile.problem.window import effective_window

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    reasons = []
    if device == "cpu":
        return Plan("torch-twin", "chunked torch twin (backends/twin/attention.py)", None, "torch autograd through the twin", None,
                    ["CPU tensors run the torch twin (FLASHTILE_BACKEND=triton with TRITON_INTERPRET=1 runs the "
                     "Triton kernels instead)"])
    left, right = window
    if causal:
        right = 0
    if not varlen:
        left, right = effective_window(left, right, seqlen_q, seqlen_k, seqlen_k - seqlen_q)
        if causal and right < 0:
            reasons.append("causal sees every key here (seqlen_q = 1 or all keys before the diagonal): run as "
                           "non-causal")
    torch_dtype = getattr(torch, _DTYPES[dtype])
    cfg = configs.default_fwd_config(capability, head_dim, _DTYPES[dtype], right >= 0, seqlen_q, mask)

    class _Q:  # what ws_applies reads of q
        pass

    fake = _Q()
    fake.dtype = torch_dtype
    scope = forward_sm90.ws_applies(fake, head_dim, head_dim ** -0.5, left, right, softcap,
                                    object() if alibi else None, object() if mask else None, dropout_p)
    hopper = capability[0] == 9
    aligned = head_dim * 2 % 16 == 0 and dtype != "fp32"
    fwd_ws = cfg.use_ws and ws_env and hopper and aligned and scope and not (varlen and seqused)
    if fwd_ws:
        forward = "Gluon warp-specialized forward (backends/sm90/forward.py" + (", work list)" if varlen else ")")
        fwd_config = None
    else:
        forward = "Triton forward (backends/triton/forward.py" + (", VARLEN work list)" if varlen else ")")
        fwd_config = asdict(cfg)
        fwd_config["use_tma"] = bool(cfg.use_tma and aligned and not varlen)
        if not hopper:
            reasons.append("the Gluon kernels need Hopper (sm90)")
        elif not ws_env:
            reasons.append("FLASHTILE_WS=0")
        elif not scope:
            reasons.append("outside the Gluon kernels' scope: they take fp16/bf16, head dim 64/128/256, plain or "
                           "causal, no softcap, ALiBi, mask or dropout")
        elif not cfg.use_ws:
            reasons.append("the sm90 table sends this shape to the Triton kernel (short causal d64)")
        elif varlen and seqused:
            reasons.append("varlen with seqused/paged keys stays on Triton (masked loads past the used rows)")
    split = head_dim in SPLIT_HEAD_DIMS
    bwd_ws = ws_env and hopper and aligned and scope and not (varlen and (seqused or split))
    if bwd_ws:
        from flashtile.backends.sm90 import backward_onepass as backward_sm90_onepass

        backward = "Gluon dK/dV + dQ kernels (backends/sm90/backward_split.py" + (", work lists)" if varlen else ")")
        if split and not varlen:
            backward = "Gluon dV, dK and dQ kernels (backends/sm90/backward_split.py, d256 split)"
        if not varlen and backward_sm90_onepass.applies(head_dim, deterministic):
            backward = ("Gluon one-pass kernel (backends/sm90/backward_onepass.py: dQ by float32 reductions, not "
                        "bitwise reproducible; deterministic=True takes the split kernels)")
        bwd_config = None
    else:
        backward = "Triton dK/dV + dQ kernels (backends/triton/backward.py" + (", VARLEN work lists)" if varlen else ")")
        tile_masks = left >= 0 or right >= 0 or mask
        bwd_config = asdict(configs.default_bwd_config(capability, head_dim, _DTYPES[dtype], True,
                                                       tile_masks=tile_masks))
        if varlen and split and scope:
            reasons.append("no varlen Gluon backward at head dim 256")
    backend = "gluon-sm90" if (fwd_ws or bwd_ws) else "triton"
    return Plan(backend, forward, fwd_config, backward, bwd_config, reasons)
