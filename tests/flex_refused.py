"""Mods that flashtile's flex kernels refuse (shared by tests/api/test_flex.py and
tests/backends/triton/test_modgen.py), and the block mask those tests build by hand."""

from __future__ import annotations

import torch
from torch.nn.attention import flex_attention as torch_flex


def erf_score(score, b, h, q_idx, kv_idx):
    return torch.erf(score)


def cumsum_score(score, b, h, q_idx, kv_idx):
    return torch.cumsum(score, dim=0)


def branchy_score(score, b, h, q_idx, kv_idx):
    if q_idx >= kv_idx:  # Python control flow on a tensor value
        return score
    return score - 100.0


def branchy_mask(b, h, q_idx, kv_idx):
    return torch.tensor(bool(q_idx >= kv_idx))


def hand_block_mask(mask_mod, seqlen: int = 20) -> "torch_flex.BlockMask":
    """A BlockMask of two 16-key blocks for ``seqlen`` queries and keys, every block listed
    as partial, made without evaluating ``mask_mod`` (torch's builder would run it on real
    tensors)."""
    return torch_flex.BlockMask.from_kv_blocks(
        torch.ones(1, 1, 2, dtype=torch.int32), torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32),
        BLOCK_SIZE=16, mask_mod=mask_mod, seq_lengths=(seqlen, seqlen))
