"""Context parallelism: attention over a sequence sharded across the ranks of a
torch.distributed process group (NCCL on GPUs, gloo on CPU). torch.distributed is
imported only when a function runs.

    ring.py   ring_attention (K/V blocks around the ring, fp32 LSE merge), the zigzag and
              contiguous layouts, shard_sequence / unshard_sequence / positions
"""

from __future__ import annotations

from .ring import LAYOUTS, positions, ring_attention, shard_sequence, unshard_sequence

__all__ = ["LAYOUTS", "ring_attention", "shard_sequence", "unshard_sequence", "positions"]
