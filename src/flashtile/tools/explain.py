"""Which kernels a call takes, and why: ``flashtile explain`` / ``flashtile.tools.explain.explain``.

Prints the registry's own answer (``backends.registry``) for a described call, so no GPU
is needed: the same ``registry.forward`` and ``registry.backward`` the launches ask. It
assumes what the API makes of ordinary inputs: flash-attn layout tensors, contiguous,
16-byte aligned.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class Explanation:
    """The kernels of one call, with the registry's reasons."""

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
            deterministic: bool = False, sink: bool = False, chunk: int = 0) -> Explanation:
    """The kernels of a flash-attn-style call (``varlen``: a packed call, seqlen = the
    longest sequence; ``seqused``: with seqused_q/k or paged keys) on a GPU of
    ``capability``, or on CPU tensors (``device="cpu"``). ``ws_env=False`` stands for
    FLASHTILE_WS=0; ``deterministic`` for the call's flag (or
    torch.use_deterministic_algorithms); ``sink``: learnable sinks; ``chunk``: chunked
    attention (0: off). FLASHTILE_BWD_DQ is read from the environment."""
    import os
    from unittest import mock

    from flashtile.backends import registry
    from flashtile.problem.window import effective_chunk, effective_window

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    if device == "cpu":
        return Explanation("torch-twin", registry.KERNELS["twin"], None, "torch autograd through the twin", None,
                           ["CPU tensors run the torch twin (FLASHTILE_BACKEND=triton with TRITON_INTERPRET=1 runs "
                            "the Triton kernels instead)"])
    left, right = window
    if causal:
        right = 0
    reasons = []
    chunk = effective_chunk(chunk, right, seqlen_q, seqlen_k, seqlen_k - seqlen_q, varlen=varlen)
    if not varlen:
        left, right = effective_window(left, right, seqlen_q, seqlen_k, seqlen_k - seqlen_q)
        if causal and right < 0:
            reasons.append("causal sees every key here (seqlen_q = 1 or all keys before the diagonal): run as "
                           "non-causal")
    call = registry.Call(capability=tuple(capability), dtype=_DTYPES[dtype], head_dim=head_dim, seqlen_q=seqlen_q,
                         scale=head_dim ** -0.5, window_left=left, window_right=right, softcap=softcap,
                         alibi=alibi, mask=mask, dropout=dropout_p > 0.0, varlen=varlen, seqused=varlen and seqused,
                         deterministic=deterministic, aligned=head_dim * 2 % 16 == 0 and dtype != "fp32", sink=sink,
                         chunk=chunk > 0)
    with mock.patch.dict(os.environ, {"FLASHTILE_WS": "1" if ws_env else "0"}):
        fwd, bwd = registry.forward(call), registry.backward(call)
    backend = "gluon-sm90" if "sm90" in (fwd.family, bwd.family) else "triton"
    work = ", work lists" if varlen else ""
    for choice in (fwd, bwd):
        reasons += [r for r in choice.why if r not in reasons]
    return Explanation(backend, fwd.description + work, asdict(fwd.config) if fwd.config else None,
                       bwd.description + work, asdict(bwd.config) if bwd.config else None, reasons)


# Ready-made mods by name, with example arguments (``flashtile explain --flex-score/--flex-mask``).
FLEX_SCORES = ("alibi", "softcap", "relative_bias", "bias")
FLEX_MASKS = ("causal", "sliding_window", "chunked", "document", "prefix_lm")


def example_mod(name: str, seqlen_q: int, seqlen_k: int, nheads: int):
    import torch

    from flashtile.api import mods

    return {"alibi": lambda: mods.alibi(torch.rand(nheads)), "softcap": lambda: mods.softcap(30.0),
            "relative_bias": lambda: mods.relative_bias(torch.zeros(nheads, seqlen_q + seqlen_k - 1), seqlen_k),
            "bias": lambda: mods.bias(torch.zeros(seqlen_q, seqlen_k)), "causal": lambda: mods.causal,
            "sliding_window": lambda: mods.sliding_window(1024), "chunked": lambda: mods.chunked(8192),
            "document": lambda: mods.document(torch.zeros(seqlen_k, dtype=torch.long)),
            "prefix_lm": lambda: mods.prefix_lm(256)}[name]()


def explain_flex(score_mod=None, mask_mod=None, *, device: str = "cuda", capability: tuple = (9, 0)) -> str:
    """What a ``flex_attention`` call compiles to: the kernels (the registry's choice and
    reasons) and the Triton source of each translated mod (``backends/triton/modgen.py``),
    or the error that refuses a mod. ``score_mod``/``mask_mod``: the user's functions."""
    import torch

    from flashtile.backends import registry
    from flashtile.backends.triton import modgen

    if device == "cpu":
        lines = [f"forward and backward: {registry.KERNELS['twin']} (backends/twin/flex.py)",
                 "  - CPU tensors run the torch twin: the mods run as written, autograd differentiates them "
                 "(captured tensors too)"]
    else:
        choice = registry.flex(tuple(capability))
        lines = [f"forward and backward: {choice.description}"] + [f"  - {r}" for r in choice.why]
    if all(getattr(fn, "flashtile_builtin", None) is not None for fn in (score_mod, mask_mod) if fn is not None):
        lines.append("  - ready-made mods with a built-in equivalent: with a block mask from "
                     "flashtile.create_block_mask, the call runs the built-in kernels instead (the same attention; "
                     "`flashtile explain --causal/--window/--alibi/--softcap` shows which)")
    for kind, fn in (("score", score_mod), ("mask", mask_mod)):
        if fn is None:
            continue
        try:
            translated = modgen.translate(fn, kind, torch.device("cpu"))
        except modgen.UntranslatableMod as err:
            lines.append(f"{kind}_mod: refused by the kernels: {err}")
            continue
        captured = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in translated.captured)
        lines.append(f"{kind}_mod {translated.name!r}: reads {captured or 'no tensors'}; translated to:")
        lines += ["    " + line for line in translated.source.splitlines()]
    return "\n".join(lines)
