"""Context parallelism: attention over a sequence sharded across the ranks of a
torch.distributed process group (NCCL on GPUs, gloo on CPU). torch.distributed is
imported only when a function runs.

    ring.py   ring_attention (K/V blocks around the ring, fp32 LSE merge), the zigzag and
              contiguous layouts, shard_sequence / unshard_sequence / positions
    ulysses.py ulysses_attention (all-to-all from sequence shards to head shards and back)
    allgather.py varlen_allgather_attention (packed documents across ranks: all-gather K/V,
              one varlen call per rank, Llama 3's form)
"""

from __future__ import annotations

from flashtile.parallel.ring import LAYOUTS, positions, ring_attention, shard_sequence, unshard_sequence
from flashtile.parallel.allgather import varlen_allgather_attention
from flashtile.parallel.ulysses import ulysses_attention

__all__ = ["LAYOUTS", "ring_attention", "ulysses_attention", "varlen_allgather_attention", "shard_sequence",
           "unshard_sequence", "positions"]
