"""Block sparsity of a flex call: which (query block, key block) pairs a query block visits.

FlexAttention describes a mask twice: element by element (``mask_mod(b, h, q_idx, kv_idx)
-> bool``) and block by block (torch's ``BlockMask``: for each query block of Q_BLOCK rows,
the key blocks of KV_BLOCK columns it must visit). A visited block is *partial* (the mask
is evaluated on its elements) or *full* (every element is visible: the mask is not
evaluated); a block in neither list is skipped. The block lists decide, as in torch: an
element of a skipped block is hidden whatever ``mask_mod`` says, one of a full block is
visible.

``create_block_mask`` builds torch's own ``BlockMask`` (so the result also works with
torch's flex_attention) by evaluating ``mask_mod`` on the tensors' device, a slab of query
blocks at a time, on indices inside the lengths only; elements past them count as hidden,
so a block that the end of the sequence cuts is partial, as in torch. ``sparsity`` reads a ``BlockMask`` into the
``Sparsity`` the kernels and the twin take.
"""

from __future__ import annotations

import inspect
from typing import Callable, NamedTuple, Optional

import torch

# The most mask elements evaluated at once by create_block_mask (bools: 64 MiB).
_SLAB_ELEMENTS = 1 << 26


class Sparsity(NamedTuple):
    """A ``BlockMask`` as the kernels read it. Tensors are int32 on the call's device, with
    a leading (Bm, Hm) of 1 where the mask broadcasts over batch or heads.

    ``kv_num`` (Bm, Hm, nQ) and ``kv_idx`` (Bm, Hm, nQ, nK): the partial key blocks of each
    query block; ``full_kv_num``/``full_kv_idx`` the full ones (None: no full blocks).
    ``q_num``/``q_idx``/``full_q_num``/``full_q_idx``: the same lists transposed (for each
    key block, the query blocks that visit it): the backward's dK/dV walks them.
    ``mask_mod``: evaluated on partial blocks (None: a partial block hides nothing).
    ``exact``: the lists are exactly ``mask_mod``'s (built by ``create_block_mask`` here),
    so the element mask alone says what is visible (``dispatch.flex_builtin``).
    """

    q_block: int
    kv_block: int
    seq_lengths: tuple[int, int]
    kv_num: torch.Tensor
    kv_idx: torch.Tensor
    full_kv_num: Optional[torch.Tensor]
    full_kv_idx: Optional[torch.Tensor]
    q_num: torch.Tensor
    q_idx: torch.Tensor
    full_q_num: Optional[torch.Tensor]
    full_q_idx: Optional[torch.Tensor]
    mask_mod: Optional[Callable]
    exact: bool = False

    @property
    def batch(self) -> int:
        return self.kv_num.shape[0]

    @property
    def heads(self) -> int:
        return self.kv_num.shape[1]

    def block_state(self) -> torch.Tensor:
        """(Bm, Hm, nQ, nK) uint8: 0 skipped, 1 partial, 2 full (the twin's view)."""
        n_k = self.kv_idx.shape[-1]
        state = torch.zeros(self.kv_num.shape + (n_k,), dtype=torch.uint8, device=self.kv_num.device)
        for num, idx, value in ((self.kv_num, self.kv_idx, 1), (self.full_kv_num, self.full_kv_idx, 2)):
            if num is None:
                continue
            taken = (torch.arange(idx.shape[-1], device=idx.device) < num[..., None].long()).to(torch.uint8)
            # amax: an index listed again past the count (padding) never clears a listed block
            state.scatter_reduce_(-1, idx.long(), taken * value, reduce="amax")
        return state


def mod_arity(name: str, fn, count: int) -> None:
    """``fn`` is a callable of ``count`` positional arguments (score_mod: 5, mask_mod: 4)."""
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    if type(fn).__module__.startswith("triton."):
        return  # a triton.jit mod: (..., ARGS) -> its own contract (backends/triton/modgen.triton_mod)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or a Triton function: the call itself will tell
    params = list(sig.parameters.values())
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if not (len(required) <= count <= len(positional)):
        want = "(score, b, h, q_idx, kv_idx)" if count == 5 else "(b, h, q_idx, kv_idx)"
        raise TypeError(f"{name} must take {count} arguments {want}, got a function of {len(positional)} "
                        f"positional arguments {tuple(p.name for p in positional)}")


def block_sizes(name: str, block_size) -> tuple[int, int]:
    """BLOCK_SIZE (an int or a (Q_BLOCK, KV_BLOCK) pair) as two positive multiples of 16."""
    pair = tuple(block_size) if isinstance(block_size, (tuple, list)) else (block_size, block_size)
    if len(pair) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) for b in pair):
        raise TypeError(f"{name} must be an int or a pair of ints, got {block_size!r}")
    if any(b < 16 or b % 16 for b in pair):
        raise ValueError(f"{name} must be a positive multiple of 16 (the kernels' tile granularity), got "
                         f"{block_size!r}")
    return pair


def mask_values(mask_mod, batch: int, heads: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``mask_mod`` on every (b, h, row, col): a (batch, heads, len(rows), len(cols)) bool
    tensor, the index tensors broadcast against each other (int64, as torch's eager path)."""
    device = rows.device
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    keep = mask_mod(b, h, rows.view(1, 1, -1, 1), cols.view(1, 1, 1, -1))
    keep = torch.as_tensor(keep, device=device)
    if keep.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a bool tensor, got {keep.dtype}")
    return keep.expand(batch, heads, rows.numel(), cols.numel())


def create_block_mask(mask_mod: Callable, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                      device=None, BLOCK_SIZE=128):
    """torch's ``create_block_mask`` (same arguments, same result): the ``BlockMask`` of
    ``mask_mod`` over (B, H, Q_LEN, KV_LEN), built on ``device`` (default: CUDA when
    available, as torch). B or H None: the mask does not depend on it (size 1, broadcast).

    Evaluates ``mask_mod`` with broadcast index tensors, a slab of query blocks at a time;
    a block whose elements are all visible is full, one with some partial, one with none
    skipped (elements past Q_LEN or KV_LEN count as hidden).
    """
    from torch.nn.attention.flex_attention import BlockMask

    mod_arity("mask_mod", mask_mod, 4)
    q_block, kv_block = block_sizes("BLOCK_SIZE", BLOCK_SIZE)
    for name, value in (("B", B), ("H", H)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or a positive int, got {value!r}")
    for name, value in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    batch, heads = B or 1, H or 1
    n_q, n_k = -(-Q_LEN // q_block), -(-KV_LEN // kv_block)
    cols = torch.arange(KV_LEN, device=device)
    any_blocks, all_blocks = [], []
    slab = max(1, _SLAB_ELEMENTS // max(1, batch * heads * q_block * n_k * kv_block))
    for first in range(0, n_q, slab):
        last = min(n_q, first + slab)
        rows = torch.arange(first * q_block, min(Q_LEN, last * q_block), device=device)
        keep = mask_values(mask_mod, batch, heads, rows, cols)  # the mod sees only real indices
        # Pad to whole blocks with hidden elements (a block the end cuts is partial, as in torch).
        keep = torch.nn.functional.pad(keep, (0, n_k * kv_block - KV_LEN, 0, (last - first) * q_block - rows.numel()))
        blocks = keep.reshape(batch, heads, last - first, q_block, n_k, kv_block)
        any_blocks.append(blocks.any(-1).any(-2))
        all_blocks.append(blocks.all(-1).all(-2))
    full = torch.cat(all_blocks, dim=2)
    partial = torch.cat(any_blocks, dim=2) & ~full
    kv_num, kv_idx = _lists(partial)
    full_num, full_idx = _lists(full)
    block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(q_block, kv_block),
                                          mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))
    # Its blocks agree with mask_mod exactly (``Sparsity.exact``): a copy or a change drops it.
    block_mask._flashtile_exact = (mask_mod, kv_num.data_ptr())
    return block_mask


def _lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) int32 of the True blocks along the last axis, in ascending order first."""
    num = blocks.sum(-1, dtype=torch.int32)
    idx = torch.argsort(blocks.to(torch.uint8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, idx.contiguous()


def sparsity(block_mask, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, device) -> Optional[Sparsity]:
    """A torch ``BlockMask`` checked against the call and read into a ``Sparsity`` (None: none)."""
    if block_mask is None:
        return None
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a torch.nn.attention.flex_attention.BlockMask (from create_block_mask) "
                        f"or None, got {type(block_mask).__name__}")
    q_block, kv_block = (block_mask.BLOCK_SIZE if isinstance(block_mask.BLOCK_SIZE, tuple)
                         else (block_mask.BLOCK_SIZE, block_mask.BLOCK_SIZE))
    block_sizes("block_mask's BLOCK_SIZE", (int(q_block), int(kv_block)))
    lengths = tuple(int(x) for x in block_mask.seq_lengths)
    if lengths != (seqlen_q, seqlen_k):
        raise ValueError(f"block_mask was created for (Q_LEN, KV_LEN) = {lengths} but the call has "
                         f"({seqlen_q}, {seqlen_k}): build it for these lengths")
    kv_num = block_mask.kv_num_blocks
    if kv_num.device.type != torch.device(device).type:
        raise ValueError(f"block_mask must be on the device of query ({device}), got {kv_num.device}")
    bm_b, bm_h, n_q = kv_num.shape
    n_k = block_mask.kv_indices.shape[-1]
    if bm_b not in (1, batch):
        raise ValueError(f"block_mask's batch ({bm_b}) must be 1 or the query's ({batch})")
    if bm_h not in (1, nheads):
        raise ValueError(f"block_mask's heads ({bm_h}) must be 1 or the query's ({nheads})")
    if n_q != -(-seqlen_q // q_block) or n_k < -(-seqlen_k // kv_block):
        raise ValueError(f"block_mask has {n_q} x {n_k} blocks of {q_block} x {kv_block}, which does not cover "
                         f"({seqlen_q}, {seqlen_k})")
    if block_mask.q_num_blocks is None:
        raise ValueError("block_mask has no query-block lists (q_num_blocks): build it with compute_q_blocks=True "
                         "(create_block_mask does)")

    def i32(t):
        return None if t is None else t.to(torch.int32).contiguous()

    return Sparsity(int(q_block), int(kv_block), lengths, i32(kv_num), i32(block_mask.kv_indices),
                    i32(block_mask.full_kv_num_blocks), i32(block_mask.full_kv_indices),
                    i32(block_mask.q_num_blocks), i32(block_mask.q_indices), i32(block_mask.full_q_num_blocks),
                    i32(block_mask.full_q_indices), block_mask.mask_mod,
                    getattr(block_mask, "_flashtile_exact", None) == (block_mask.mask_mod, kv_num.data_ptr()))
