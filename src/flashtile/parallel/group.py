"""The process group of a context-parallel call: its size and rank, and a shape check
across its ranks (every rank must pass the same shapes, or the ring would hang)."""

from __future__ import annotations

import torch


def group_info(group):
    """(world size, rank) of a ProcessGroup, or of a 1-D DeviceMesh's group; None: the world."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs an initialised torch.distributed process group")
    return dist.get_world_size(as_group(group)), dist.get_rank(as_group(group))


def as_group(group):
    if group is not None and hasattr(group, "get_group"):  # a DeviceMesh (1-D, or pass mesh["cp"])
        return group.get_group()
    return group


def check_same_across_ranks(q, k, group, world):
    """Every rank must pass the same shapes (a mismatch would hang or garble the ring): one
    small all-gather of the shapes."""
    import torch.distributed as dist

    mine = torch.tensor([*q.shape, *k.shape], dtype=torch.int64,
                        device=q.device if dist.get_backend(group) == "nccl" else "cpu")
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    for r, shape in enumerate(every):
        if not torch.equal(shape, mine):
            raise ValueError(f"ranks pass different shapes: this rank q, k = {tuple(q.shape)}, {tuple(k.shape)}; "
                             f"rank {r}: {tuple(shape[:4].tolist())}, {tuple(shape[4:].tolist())}")
