"""Tensor layouts at the boundary of the kernels, and the page gather of paged keys.

The kernels take q, k, v as (B, H, S, D) views with unit stride along D ("bhsd") and
return out laid out (B, S, H, D) in memory. The API hands them flash-attn's (B, S, H, D)
("bshd"), SDPA's (B, H, S, D) or a packed call's (total, H, D) ("thd"); a training call's
conversions happen inside its autograd node (``flashtile.autograd``): as views outside
it, each was a node of its own that the backward also ran (five per flash_attn_func
call; H200 run 90).
"""

from __future__ import annotations

import torch

LAYOUTS = ("bhsd", "bshd", "thd")


def canonical(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A q, k or v given in ``layout`` as the (B, H, S, D) view the kernels take."""
    if layout == "bshd":
        return t.transpose(1, 2)
    if layout == "thd":
        return t.unsqueeze(0).transpose(1, 2)
    return t


def to_bshd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """An out (or its gradient) given in ``layout`` as (B, S, H, D)."""
    if layout == "bshd":
        return t
    if layout == "thd":
        return t.unsqueeze(0)
    return t.transpose(1, 2)


def from_bshd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A (B, S, H, D) result (out, or a gradient of q, k, v) in ``layout``."""
    if layout == "bshd":
        return t
    if layout == "thd":
        return t.squeeze(0)
    return t.transpose(1, 2)


def bshd_view(t: torch.Tensor, head_dim: int = 0) -> torch.Tensor:
    """(B, H, S, D) view of a new (B, S, H, D) buffer shaped like ``t`` (B, H, S, D), its
    head dim ``head_dim`` when given (out of a call whose v has another head dim than q):
    the layout every output and gradient of the kernels is written in."""
    b, h, s, d = t.shape
    return t.new_empty((b, s, h, head_dim or d)).transpose(1, 2)


def new_lse(t: torch.Tensor) -> torch.Tensor:
    """(B, H, Sq) float32 log-sum-exp buffer for q of shape (B, H, Sq, D)."""
    return torch.empty(t.shape[:3], dtype=torch.float32, device=t.device)


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its head dim has unit stride, else a contiguous copy (once per call,
    documented in the public docstrings, as flash-attn does)."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """(batch, max_blocks * page_size, Hk, D): each sequence's pages of a paged cache
    (num_blocks, page_size, Hk, D), in block-table order. Entries past a sequence's pages
    are clamped to a valid block (their rows are never used). Differentiable, no host sync."""
    if cache.shape[0] == 0:
        # An empty pool (validation let it through: no sequence has a key): one zero page to
        # point at, still in the cache's graph (its gradient is empty).
        cache = torch.cat((cache, cache.new_zeros((1, *cache.shape[1:]))))
    return cache[block_table.long().clamp(0, cache.shape[0] - 1)].flatten(1, 2)


def paged_keys(k, v, block_table, cu_seqlens_k, seqused_k):
    """Paged k/v (num_blocks, page_size, Hk, D) gathered into one padded sequence of
    ``max_blocks * page_size`` rows per sequence: (batch * max_blocks * page_size, Hk, D),
    with offsets and used lengths for it. Differentiable (an index gather), no host sync.
    Entries past a sequence's pages are clamped to a valid block (their keys are unused)."""
    batch, max_blocks = block_table.shape
    page = k.shape[1]
    kg, vg = (gather_pages(t, block_table).flatten(0, 1) for t in (k, v))
    lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    if seqused_k is not None:
        lengths = torch.minimum(lengths, seqused_k)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=k.device) * (max_blocks * page)
    return kg, vg, cu, lengths.to(torch.int32).contiguous()


def tma_layout_ok(t: torch.Tensor) -> bool:
    """16-byte aligned base and strides, unit last stride, no zero stride (a broadcast view)
    on a dimension longer than 1."""
    if t.data_ptr() % 16 or t.stride(-1) != 1:
        return False
    size = t.element_size()
    return not any((s * size) % 16 or (s == 0 and n > 1) for s, n in zip(t.stride()[:-1], t.shape[:-1]))


def tma_ready(*tensors: torch.Tensor) -> bool:
    """The bulk tensor copy engine (TMA, sm90+) can address every tensor: CUDA, 2-byte
    elements (fp16/bf16), positive sizes (a descriptor needs them), 16-byte aligned bases
    and strides. The device's architecture is the registry's business."""
    t0 = tensors[0]
    if t0.device.type != "cuda" or t0.dtype.itemsize != 2:
        return False
    if any(t.numel() == 0 for t in tensors):
        return False
    return all(tma_layout_ok(t) for t in tensors)
