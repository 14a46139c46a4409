"""Variable-length batches on the device: per-sequence lengths and the work list.

A varlen call packs ``batch`` sequences into one token axis: sequence b owns query rows
``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` and key rows ``cu_seqlens_k[b] ..
cu_seqlens_k[b + 1]`` (paged keys are gathered into such rows first). The kernels
see it as the canonical problem with one batch row, q (1, H, total_q, D), and a work list
that says which (sequence, block of rows) each program takes. The list is built here, on
the device, by one small kernel (``_build_items_kernel``), so a varlen call never copies
cu_seqlens to the host and stays capturable in a CUDA graph.

The work-list buffer (int32) of one table, ``cap`` items at most::

    [0]                     number of items (<= cap)
    [16 + i]                sequence of item i
    [16 + cap + i]          block of item i (rows block * BLOCK .. of that sequence)
    [16 + 2 cap + 4 b ..]   sequence b: q start, q length, k start, k length
    [16 + 2 cap + 4 B ..]   scratch: exclusive prefix sums of the blocks per sequence

Items are sorted longest first (the number of keys a query block sees, or queries a key
block is seen by), ties in sequence and block order: with one program per item the
hardware starts them in that order, so the long causal blocks do not run last. Lengths are
clamped to the tensors (a start in [0, total], an end in [start, total], seqused in
[0, length]) so that even values the host never checked (inside a CUDA graph capture)
cannot address memory outside q, k or v.

Kernels read an item with ``varlen_item`` and ``program_item`` (Triton) and the Gluon twins
in ``backends/sm90/common.py``.
"""

from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl

from flashtile.runtime.device import device_context
from flashtile.runtime.launch import Launcher

HEADER = 16  # int32 words before the items: the count, then padding (16-byte alignment)
SORT_LIMIT = 16384  # tables up to this many items are sorted in one program (tl.sort)
_CHUNK = 1024
_FIELD_BITS = 21  # sort key: cost, sequence and block in 21 bits each


@triton.jit
def varlen_item(Items, item, item_cap):
    """Item ``item`` of a work-list table: (sequence, block, q start, q length, k start,
    k length)."""
    b = tl.load(Items + 16 + item)
    blk = tl.load(Items + 16 + item_cap + item)
    seq = Items + 16 + 2 * item_cap + 4 * b
    return b, blk, tl.load(seq), tl.load(seq + 1), tl.load(seq + 2), tl.load(seq + 3)


@triton.jit
def program_item(pid, Items, item_cap, count, heads, num_blocks, seqlen_q, seqlen_k, diag_offset,
                 REVERSE: tl.constexpr, VARLEN: tl.constexpr):
    """What program ``pid`` of a flat 1-D grid works on: (b, head, block, bh, b_ptr, q_row,
    k_row, seqlen_q, seqlen_k, diag_offset).

    Fixed lengths: programs of one (b, head) are adjacent, ``num_blocks`` per pair (their
    K/V tiles are shared through L2), blocks last-first when ``REVERSE`` (causal: the last
    query blocks see the most keys); b_ptr = b addresses the batch row, q_row = k_row = 0.
    Packed (``VARLEN``): one program per (head, work item), heads outer, ``count`` items
    (the caller has returned for pid >= count * heads); the items of one head come longest
    first, so the programs running at once share a few heads' K/V through L2 (heads inner
    measured 0.71x at causal d128 on the H200, run 56). Pointers then address batch row 0
    from the sequence's first rows, and the lengths and diagonal are the sequence's. ``bh``
    = b * heads + head (the dropout stream); ``head`` counts ``heads`` (query heads, or
    key/value heads in the dk/dv kernel)."""
    if VARLEN:
        head = pid // count
        item = pid % count
        b, block, start_q, seqlen_q, start_k, seqlen_k = varlen_item(Items, item, item_cap)
        diag_offset = seqlen_k - seqlen_q
        bh = b * heads + head
        b_ptr = (b * 0).to(tl.int64)
        q_row = start_q.to(tl.int64)
        k_row = start_k.to(tl.int64)
    else:
        bh = pid // num_blocks
        block = pid % num_blocks
        if REVERSE:
            block = num_blocks - 1 - block
        b = bh // heads
        head = bh % heads
        b_ptr = b.to(tl.int64)
        q_row = (b * 0).to(tl.int64)
        k_row = q_row
    return b, head, block, bh, b_ptr, q_row, k_row, seqlen_q, seqlen_k, diag_offset


@triton.jit
def _find_seq(prefix, i, batch, STEPS: tl.constexpr):
    """The last sequence b < batch with prefix[b] <= i (prefix non-decreasing, prefix[0] = 0):
    the sequence that holds item i (empty sequences share their successor's prefix)."""
    lo = tl.zeros_like(i)
    hi = lo + batch
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        active = hi - lo > 1
        go = tl.load(prefix + mid, mask=active, other=0) <= i
        lo = tl.where(active & go, mid, lo)
        hi = tl.where(active & ~go, mid, hi)
    return lo


@triton.jit
def _item_cost(seq, b, blk, block, keys, window_left, window_right,
               WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """Keys a query block sees (``keys`` false) or queries a key block is seen by (true), for
    the bottom-right diagonal of each sequence and the window (left, right) around it."""
    len_q = tl.load(seq + 4 * b + 1)
    len_k = tl.load(seq + 4 * b + 3)
    diag = len_k - len_q
    r0 = blk * block
    q_last = tl.minimum(r0 + block, len_q) - 1
    k_last = tl.minimum(r0 + block, len_k) - 1
    # a query block [r0, q_last] sees keys [lo_k, hi_k)
    lo_k = tl.zeros_like(r0)
    hi_k = len_k
    # a key block [r0, k_last] is seen by queries [lo_q, hi_q)
    lo_q = tl.zeros_like(r0)
    hi_q = len_q
    if WINDOW_LEFT:
        lo_k = tl.maximum(r0 + diag - window_left, 0)
        hi_q = tl.minimum(k_last - diag + window_left + 1, len_q)
    if WINDOW_RIGHT:
        hi_k = tl.minimum(q_last + diag + window_right + 1, len_k)
        lo_q = tl.maximum(r0 - diag - window_right, 0)
    return tl.maximum(tl.where(keys != 0, hi_q - lo_q, hi_k - lo_k), 0)


@triton.jit
def _build_items_kernel(
    CuQ, CuK, UsedQ, UsedK, Buf,
    batch, total_q, total_k,
    off0, cap0, block0, keys0,
    off1, cap1, block1, keys1,
    off2, cap2, block2, keys2,
    window_left, window_right,
    HAS_USED_Q: tl.constexpr, HAS_USED_K: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    CHUNK: tl.constexpr, SORT_P2: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    """One program per table (at most three): sequence lengths, block counts, the items."""
    pid = tl.program_id(0)
    off = tl.where(pid == 0, off0, tl.where(pid == 1, off1, off2))
    cap = tl.where(pid == 0, cap0, tl.where(pid == 1, cap1, cap2))
    block = tl.where(pid == 0, block0, tl.where(pid == 1, block1, block2))
    keys = tl.where(pid == 0, keys0, tl.where(pid == 1, keys1, keys2))
    table = Buf + off
    seq = table + 16 + 2 * cap
    prefix = seq + 4 * batch

    # 1. Per sequence: clamped starts and lengths, its blocks, their exclusive prefix sums.
    carry = 0
    for c0 in range(0, batch, CHUNK):
        b = c0 + tl.arange(0, CHUNK)
        ok = b < batch
        start_q = tl.minimum(tl.maximum(tl.load(CuQ + b, mask=ok, other=0), 0), total_q)
        end_q = tl.minimum(tl.maximum(tl.load(CuQ + b + 1, mask=ok, other=0), start_q), total_q)
        start_k = tl.minimum(tl.maximum(tl.load(CuK + b, mask=ok, other=0), 0), total_k)
        end_k = tl.minimum(tl.maximum(tl.load(CuK + b + 1, mask=ok, other=0), start_k), total_k)
        len_q = end_q - start_q
        len_k = end_k - start_k
        if HAS_USED_Q:
            len_q = tl.minimum(tl.maximum(tl.load(UsedQ + b, mask=ok, other=0), 0), len_q)
        if HAS_USED_K:
            len_k = tl.minimum(tl.maximum(tl.load(UsedK + b, mask=ok, other=0), 0), len_k)
        tl.store(seq + 4 * b, start_q, mask=ok)
        tl.store(seq + 4 * b + 1, len_q, mask=ok)
        tl.store(seq + 4 * b + 2, start_k, mask=ok)
        tl.store(seq + 4 * b + 3, len_k, mask=ok)
        n = tl.where(ok, (tl.where(keys != 0, len_k, len_q) + block - 1) // block, 0)
        tl.store(prefix + b, tl.cumsum(n, 0) - n + carry, mask=ok)
        carry += tl.sum(n, 0)
    count = tl.minimum(carry, cap)  # cap is a bound the host derived from max_seqlen
    tl.store(prefix + batch, carry)
    tl.store(table, count)
    tl.debug_barrier()  # the prefix sums and lengths above are read by other threads below

    # 2. The items: sequence by binary search over the prefix sums, then the order.
    if SORT_P2 > 0:
        i = tl.arange(0, SORT_P2)
        valid = i < count
        b = _find_seq(prefix, i, batch, SEARCH_STEPS)
        blk = i - tl.load(prefix + b, mask=valid, other=0)
        cost = _item_cost(seq, b, blk, block, keys, window_left, window_right, WINDOW_LEFT, WINDOW_RIGHT)
        field = (1 << 21) - 1
        key = ((tl.minimum(cost, field).to(tl.int64) << 42) | ((field - b).to(tl.int64) << 21)
               | (field - blk).to(tl.int64))
        key = tl.sort(tl.where(valid, key, -1), descending=True)
        tl.store(table + 16 + i, (field - ((key >> 21) & field)).to(tl.int32), mask=valid)
        tl.store(table + 16 + cap + i, (field - (key & field)).to(tl.int32), mask=valid)
    else:
        # Too many items to sort in one program: sequence order; query blocks of a causal
        # sequence from the last (they see the most keys), key blocks from the first.
        for c0 in range(0, cap, CHUNK):
            i = c0 + tl.arange(0, CHUNK)
            valid = i < count
            b = _find_seq(prefix, i, batch, SEARCH_STEPS)
            first = tl.load(prefix + b, mask=valid, other=0)
            blk = i - first
            if WINDOW_RIGHT:
                nblk = tl.load(prefix + b + 1, mask=valid, other=0) - first
                blk = tl.where(keys != 0, blk, nblk - 1 - blk)
            tl.store(table + 16 + i, b, mask=valid)
            tl.store(table + 16 + cap + i, blk, mask=valid)


_launch_build = Launcher(_build_items_kernel)


def item_capacity(batch: int, total: Optional[int], max_seqlen: int, block: int) -> int:
    """How many blocks of ``block`` rows the sequences can hold at most: the bound the
    host knows without reading cu_seqlens (``total`` None: no bound from the rows)."""
    bound = batch * triton.cdiv(max_seqlen, block)
    if total is not None:
        bound = min(bound, (total + batch * (block - 1)) // block)
    return max(bound, 0)


def build_work_items(varlen, total_q: int, total_k: int, tables, window_left: int,
                     window_right: int) -> list[tuple[object, int]]:
    """One device buffer holding a work list per entry of ``tables`` (at most three pairs
    ``(block, over_keys)``: blocks of ``block`` query rows, or key rows with over_keys);
    returns ``(table view, capacity)`` per entry for the kernels' ``Items``/``item_cap``
    arguments. One kernel launch, no host synchronisation. ``varlen``: a
    ``problem.spec.Varlen``; ``total_q``/``total_k``: the rows of q and of k."""
    import torch

    if not 1 <= len(tables) <= 3:
        raise ValueError(f"one to three tables per launch, got {len(tables)}")
    batch = varlen.batch
    caps, offs, size = [], [], 0
    for block, over_keys in tables:
        total = total_k if over_keys else total_q
        cap = max(item_capacity(batch, total, varlen.max_seqlen_k if over_keys else varlen.max_seqlen_q, block), 1)
        caps.append(cap)
        offs.append(size)
        size += -(-(HEADER + 2 * cap + 5 * batch + 1) // 4) * 4  # each table 16-byte aligned
    device = varlen.cu_seqlens_q.device
    buf = torch.empty(size, dtype=torch.int32, device=device)
    if batch == 0:
        buf.zero_()
        return [(buf[o:], c) for o, c in zip(offs, caps)]
    p2 = triton.next_power_of_2(max(caps))
    sort_p2 = p2 if p2 <= SORT_LIMIT and batch < 2**_FIELD_BITS else 0
    pairs = list(zip(offs, caps, [t[0] for t in tables], [int(t[1]) for t in tables]))
    rest = [pairs[min(i, len(pairs) - 1)] for i in (1, 2)]
    used_q = varlen.seqused_q if varlen.seqused_q is not None else varlen.cu_seqlens_q
    used_k = varlen.seqused_k if varlen.seqused_k is not None else varlen.cu_seqlens_k
    num_warps = 16 if sort_p2 >= 4096 else 4
    with device_context(varlen.cu_seqlens_q):
        _launch_build(
            (len(pairs),),
            (varlen.cu_seqlens_q, varlen.cu_seqlens_k, used_q, used_k, buf,
             batch, total_q, total_k, *pairs[0], *rest[0], *rest[1],
             window_left, window_right),
            dict(HAS_USED_Q=varlen.seqused_q is not None, HAS_USED_K=varlen.seqused_k is not None,
                 WINDOW_LEFT=window_left >= 0, WINDOW_RIGHT=window_right >= 0,
                 CHUNK=_CHUNK, SORT_P2=sort_p2, SEARCH_STEPS=max(1, batch.bit_length() + 1)),
            num_warps, 1)
    return [(buf[o:], c) for o, c in zip(offs, caps)]
