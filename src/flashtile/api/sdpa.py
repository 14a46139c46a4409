"""torch's ``scaled_dot_product_attention`` semantics on flashtile's kernels."""

from __future__ import annotations

from typing import Optional

import torch

from flashtile import dispatch
from flashtile.problem import validate
from flashtile.runtime import replay

_PLANS = replay.cache("scaled_dot_product_attention")


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    learnable_sink: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (same semantics).

    Args:
        query: (batch, heads, L, E) or (batch, L, E); float16/bfloat16/float32.
        key, value: (batch, heads_kv, S, E) and (batch, heads_kv, S, Ev) / (batch, S, ...).
            heads_kv must equal heads unless ``enable_gqa`` (then heads % heads_kv == 0);
            Ev may differ from E (as in torch); E, Ev <= 512.
        attn_mask: broadcastable to (batch, heads, L, S). bool: True = take part;
            float (query's dtype or float32): added to the scores. Evaluated inside the
            kernel tile by tile, never expanded in memory. Huge negative biases
            (torch.finfo(float32 or bfloat16).min, transformers' "hidden") behave as in
            torch: a row that only such keys reach spreads evenly over them (the mean of
            their values), with the gradients of that even softmax on every backend; a row
            whose keys are all -inf gives 0.
        dropout_p: as in torch: applied only when > 0 (pass 0.0 at evaluation time).
        is_causal: top-left aligned (torch's ``tril``): query i sees keys j <= i. Not
            together with attn_mask (as in torch).
        scale: defaults to 1 / sqrt(E).
        learnable_sink: flashtile's addition: None, or (heads,) float16/bfloat16/float32,
            one logit per query head that joins only the softmax's denominator (gpt-oss's
            attention sinks): p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)), in
            natural-log units, not scaled. Differentiable.

    Returns:
        (batch, heads, L, Ev) in query's dtype (a transposed view of a (batch, L, heads, Ev)
        buffer, as torch's flash backend returns). Rows with no visible key give 0.
    """
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, learnable_sink)
    if attn_mask is None and learnable_sink is None:
        # validated once per key (``runtime.replay``); a repeated call without grad replays
        # its whole launch plan, one with grad goes straight to the autograd node
        scalars = replay.plain_scalars((dropout_p, is_causal, scale, enable_gqa))
        plan_key = None if scalars is None else replay.make_key((query, key, value), scalars)
        if plan_key is not None:
            entry = _PLANS.entry(plan_key, (query, key, value))
            if entry.prepared is None:
                call = validate.sdpa_call(*args)
                entry.prepared = (call.problem, call.squeeze)
            if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
                return _keyed(entry, query, key, value, grad=True)
            return replay.run(entry, (query, key, value), lambda: _keyed(entry, query, key, value, grad=False))
    return _run(validate.sdpa_call(*args), learnable_sink)


def _run(call: validate.SdpaCall, sink) -> torch.Tensor:
    out, _ = dispatch.attention(call.query, call.key, call.value, call.problem, None, call.mask, sink=sink)
    return out.squeeze(1) if call.squeeze else out


def _keyed(entry, query, key, value, grad: bool) -> torch.Tensor:
    """A call of a validated key without a mask or a sink (``entry.prepared``: its problem,
    and whether 3-D inputs got a head axis); ``grad``: it needs the autograd node."""
    problem, squeeze = entry.prepared
    if squeeze:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    if grad:
        out = dispatch.attention_keyed(query, key, value, problem, entry, "bhsd")[0]
    else:
        out, _ = dispatch.attention(query, key, value, problem, hint=entry)
    return out.squeeze(1) if squeeze else out
