"""From a padded batch with an attention mask to the varlen layout and back (flash-attn's
``bert_padding`` helpers), so a padded batch takes ``flash_attn_varlen_func`` in two lines::

    x, indices, cu_seqlens, max_seqlen = unpad_input(hidden, attention_mask)
    ...  # q, k, v from x: (total, nheads, headdim)
    out = pad_input(flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen),
                    indices, batch, seqlen)
"""

from __future__ import annotations

import torch

from flashtile.problem import validate


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor):
    """Keep the tokens where ``attention_mask`` is true, sequence by sequence.

    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen) bool or integer, nonzero = a real token (anywhere
            in the row; the kept tokens keep their order).

    Returns:
        (tokens (total, ...), indices (total,) int64 into the flattened (batch * seqlen)
        axis, cu_seqlens (batch + 1,) int32, max_seqlen int). max_seqlen is read on the
        host (one synchronisation, as in flash-attn).
    """
    validate.unpad_call(hidden_states, attention_mask)
    keep = attention_mask.bool()
    lengths = keep.sum(dim=1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(lengths.max().item()) if lengths.numel() else 0
    tokens = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return tokens, indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of ``unpad_input``: (total, ...) -> (batch, seqlen, ...), zeros at the
    padding. Differentiable (an index scatter into a new tensor)."""
    validate.pad_call(hidden_states, indices)
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
