"""FlexAttention's API on flashtile: user-defined score and mask functions.

``flex_attention`` has the signature and semantics of torch's
``torch.nn.attention.flex_attention.flex_attention``; code written for Flex runs by
changing the import. ``create_block_mask`` builds torch's own ``BlockMask``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from flashtile import dispatch
from flashtile.problem import validate
from flashtile.problem.blockmask import create_block_mask

__all__ = ["flex_attention", "create_block_mask"]


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Optional[Callable] = None,
    block_mask=None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Optional[dict] = None,
    *,
    return_aux=None,
):
    """Attention with a user-defined score function and block-sparse mask (torch's FlexAttention).

    Args:
        query: (B, Hq, L, E); float16/bfloat16/float32.
        key: (B, Hkv, S, E); value: (B, Hkv, S, Ev), Ev may differ from E (E, Ev <= 512).
            Hq == Hkv, or a multiple of it with ``enable_gqa=True`` (query head h reads
            key/value head h // (Hq // Hkv)).
        score_mod: None, or ``score_mod(score, b, h, q_idx, kv_idx) -> score`` written with
            torch ops (as for torch): ``score`` is the scaled product ``scale * q.k``
            (float32); b, h, q_idx, kv_idx index tensors (h: the query head). It may read
            captured tensors (per-head slopes, an (L, S) bias, a relative-position table),
            which are differentiable where they require grad. Or a ``triton.jit`` function
            ``(score, b, h, q_idx, kv_idx, ARGS) -> (score, d score / d input)`` (the
            kernels only; ARGS unused): what the translator would generate.
        block_mask: None (every key visible) or a torch ``BlockMask`` (torch's
            ``create_block_mask`` or ``flashtile.create_block_mask``) built for (L, S): its
            skipped blocks are hidden, its full blocks visible, its partial blocks
            evaluate its ``mask_mod(b, h, q_idx, kv_idx) -> bool``. B or H of 1 broadcast.
        scale: default 1 / sqrt(E).
        return_lse: also return the log-sum-exp (B, Hq, L) float32, natural log.
        kernel_options: None or a dict: ``deterministic`` (bool: no float atomics whose
            order varies; also on under ``torch.use_deterministic_algorithms(True)``),
            ``BLOCK_M``/``BLOCK_N``/``num_warps``/``num_stages`` (the Triton kernels' tiles);
            torch's other keys are accepted and ignored.
        return_aux: torch's newer form, ``AuxRequest(lse=True)``: returns (out,
            AuxOutput(lse=...)).

    Returns:
        out (B, Hq, L, Ev) in query's dtype; with ``return_lse`` (out, lse). A row that
        sees no key gets out 0 and lse -inf (and finite gradients), as torch. The LSE is
        differentiable.

    CPU tensors run the torch twin (``backends/twin/flex.py``), forward and backward (torch's
    flex_attention has no CPU backward); CUDA tensors the Triton flex kernels, into which
    the mods are translated (``backends/triton/modgen.py``: what translates is listed
    there; anything else is refused with an error naming it).
    """
    call = validate.flex_call(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                              kernel_options, return_aux)
    out, lse = dispatch.flex(query, key, value, score_mod, call)
    if call.want_lse == "tuple":
        return out, lse
    if call.want_lse.startswith("aux"):
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(lse=lse if call.want_lse == "aux" else None)
    return out
