"""Hopper forward in Gluon: warp-specialized, FA3-style (sm90, fp16/bf16, head dim 64/128/256).

The same algorithm as ``forward.py`` for the common case, no causal window edge other
than the diagonal, no softcap/alibi/mask/dropout, scheduled by hand because plain Triton
3.6 cannot keep a tensor-core product in flight across the softmax (docs/perf-notes.md,
runs 16-18):

    one work item = 128 query rows of one (batch, head); a program takes one item, or
    (persistent) walks the items pid, pid + grid, ..., or (dynamic, the default but at d256
    without causal) claims items from an atomic counter; three partitions:
      loader   (1 warp, 24 registers)  an item's Q, then its K_j and V_j through a
                                        NUM_BUF-slot shared-memory ring by TMA; waits for
                                        free slots, and fetches the next item's tiles
                                        while the consumers finish the last one
      consumer (2 x 4 warps, 64 rows each, CONSUMER_REGS registers), per key tile j:
          issue S_j = Q K_j^T (async wgmma)
          issue O  += P_{j-1} V_{j-1} (async, P from registers)
          wait for S_j only; release K_j's slot
          mask if the tile straddles the diagonal or the end of the keys; softmax of S_j
          wait for O; release V_{j-1}'s slot; rescale O by alpha_j
      so the P V product runs on the tensor cores while the softmax runs on the ALUs,
      and the warp scheduler interleaves one consumer's softmax with the other's wgmma.

Inputs are (B, H, S, D) views with any 16-byte-aligned strides (flash's (B, S, H, D)
layout arrives transposed): 4-D TMA descriptors with a [1, 1, rows, D] box read them in
place, zero-fill rows past the sequence end and clip stores to it, so any seqlen works.
Query head h reads key/value head h // group_size; causal is bottom-right by
``diag_offset`` (key j visible to query i iff j <= i + diag_offset). Rows that see no
key give out 0 and lse -inf. Scores are in base 2 (the scale folded with log2 e into
the exponent's FFMA; the scale must be positive).

Triton 3.6 turns constexprs passed through ``gl.warp_specialize`` into tensors, so the
partitions read every compile-time size from the descriptor and shared-memory types
(CAUSAL: the q_ready barrier array has a third, unused entry).
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashtile.backends.sm90.common import load_kv_tiles, tma_descriptor, work_item
from flashtile.backends.triton.scores import C_LN2, C_LOG2E, LOG2E
from flashtile.runtime.device import device_index, sm_count
from flashtile.runtime.launch import Launcher
from flashtile.runtime.replay import stream_counter

HALF_M = 64  # query rows per consumer warpgroup; a program holds two
BLOCK_M = 2 * HALF_M
NUM_BUF = 2  # K/V ring slots (H200 run 18: 2 slots of 128 keys)
LOADER_REGS = 24  # registers of the loader warp (setmaxnreg; the consumers take 240)


def default_block_n(head_dim: int) -> int:
    """Keys per tile: 128, or 64 at d256 (registers: the 64 x 256 fp32 output tile of a
    consumer already takes 128 per thread; shared memory: 2 K/V slots of 64 keys, Q/O)."""
    return 64 if head_dim > 128 else 128


@gluon.jit
def _mask_scores(s, mq, n0, seqlen_k, diag_offset, CAUSAL: gl.constexpr, s_layout: gl.constexpr):
    """-inf where key n0 + c is past the end, or (causal) right of row mq + r's diagonal."""
    rows = mq + gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s_layout))
    cols = n0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))
    ok = cols[None, :] < seqlen_k
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None] + diag_offset)
    return gl.where(ok, s, float("-inf"))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """One online-softmax step on a tile of raw scores: (P, alpha, m, l) with m the running
    row maximum of the raw scores and P = exp2(s * qk_scale - m * qk_scale), one FFMA and
    one MUFU op per element (qk_scale > 0 makes the max commute with the scaling); alpha
    rescales what was accumulated against the old maximum. A row that has seen no key yet
    keeps m = -inf and is exponentiated against 0, so -inf - -inf never occurs."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
    p = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i * qk_scale - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _total_items(num_m_blocks, num_bh, nheads, Items):
    """How many work items the dynamic schedule hands out."""
    if Items.dtype.element_ty == gl.int32:
        return gl.load(Items) * nheads
    else:
        return num_m_blocks * num_bh


@gluon.jit
def _store_o_varlen(out, o_desc, o_tile, q_empty, WG: gl.constexpr, Out, stride_oh, stride_om, h, q_row, mq,
                    seqlen_q, o_layout: gl.constexpr, ALIAS_O: gl.constexpr):
    """A warpgroup's output rows mq .. of a sequence starting at row q_row: by TMA when the
    tile lies inside the sequence (TMA clips at the tensor's end, not the sequence's),
    else from registers, row by row."""
    ROWS: gl.constexpr = out.shape[0]
    HEAD_D: gl.constexpr = out.shape[1]
    if mq + ROWS > seqlen_q:
        st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = mq + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_layout))
        cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, st_layout))
        ptrs = Out + h.to(gl.int64) * stride_oh + (q_row + rows).to(gl.int64)[:, None] * stride_om + cols[None, :]
        gl.store(ptrs, gl.convert_layout(out, st_layout), mask=(rows < seqlen_q)[:, None])
        if ALIAS_O:
            mbarrier.arrive(q_empty.index(WG), count=1)
    else:
        tma.store_wait(pendings=0)
        o_tile.reshape([ROWS, HEAD_D]).store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [0, h, q_row + mq, 0], o_tile)
        if ALIAS_O:
            tma.store_wait(pendings=0)
            mbarrier.arrive(q_empty.index(WG), count=1)


@gluon.jit
def _consume_item(WG: gl.constexpr, t, it, done, q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem,
                  v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads,
                  group_size, seqlen_q, seqlen_k, diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink):
    """Warpgroup WG's 64 rows of work item t: it key tiles were consumed before it (the
    position in the K/V ring) and done items (the Q barriers' phase). Returns its key tiles."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    NUM_BUF: gl.constexpr = k_smem.type.shape[0]
    CAUSAL: gl.constexpr = q_ready.type.shape[0] == 3
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_tile = q_smem.index(WG).reshape([ROWS, HEAD_D])
    o_tile = o_smem.index(WG)
    # d256: no room for separate O tiles, so O is staged in the Q tile, which the loader
    # may refill only once O has left it.
    ALIAS_O: gl.constexpr = HEAD_D > 128
    zeros_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    VARLEN: gl.constexpr = Items.dtype.element_ty == gl.int32
    HAS_SINK: gl.constexpr = Sink.dtype.element_ty == gl.float32  # else q's pointer (fp16/bf16)
    lse_stride = seqlen_q  # varlen: total_q (the host passes it as seqlen_q)
    b, h, kvh, bh, m0, n_tiles, q_row, k_row, seqlen_q, seqlen_k, diag_offset = work_item(
        t, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset, Items, item_cap,
        ROWS, BLOCK_N, CAUSAL)
    mq = m0 + WG * ROWS  # first query row of this warpgroup
    # A key tile needs element masks iff it reaches past the keys or past the diagonal
    # of this warpgroup's first row (the last tile, and the diagonal ones when causal).
    mask_from = seqlen_k - BLOCK_N
    if CAUSAL:
        mask_from = gl.minimum(mask_from, mq + diag_offset - BLOCK_N + 1)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([ROWS], gl.float32, row_s)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    p = gl.zeros([ROWS, BLOCK_N], dtype, s_layout)  # carried in 16 bits: 32 registers, not 64
    mbarrier.wait(q_ready.index(WG), done & 1)
    if n_tiles > 0:  # tile 0: nothing to overlap with yet
        slot = it % NUM_BUF
        mbarrier.wait(k_ready.index(slot), (it // NUM_BUF) & 1)
        s = warpgroup_mma(q_tile, k_smem.index(slot).reshape([BLOCK_N, HEAD_D]).permute((1, 0)), zeros_s,
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_empty.index(slot), count=1)
        if mask_from < 0:
            s = _mask_scores(s, mq, 0, seqlen_k, diag_offset, CAUSAL, s_layout)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        p = p.to(dtype)

    for j in range(1, n_tiles):
        slot = (it + j) % NUM_BUF
        prev = (it + j - 1) % NUM_BUF
        mbarrier.wait(k_ready.index(slot), ((it + j) // NUM_BUF) & 1)
        mbarrier.wait(v_ready.index(prev), ((it + j - 1) // NUM_BUF) & 1)
        p_op = gl.convert_layout(p, p_layout)
        s = warpgroup_mma(q_tile, k_smem.index(slot).reshape([BLOCK_N, HEAD_D]).permute((1, 0)), zeros_s,
                          use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(prev).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        mbarrier.arrive(k_empty.index(slot), count=1)
        n0 = j * BLOCK_N
        if n0 > mask_from:
            s = _mask_scores(s, mq, n0, seqlen_k, diag_offset, CAUSAL, s_layout)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        p = p.to(dtype)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    if not ALIAS_O:
        mbarrier.arrive(q_empty.index(WG), count=1)  # every Q K^T of this item is done

    if n_tiles > 0:
        last = (it + n_tiles - 1) % NUM_BUF
        mbarrier.wait(v_ready.index(last), ((it + n_tiles - 1) // NUM_BUF) & 1)
        acc = warpgroup_mma(gl.convert_layout(p, p_layout),
                            v_smem.index(last).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last), count=1)

    m_fin = m_i * qk_scale  # the rows' running max in base 2
    if HAS_SINK:
        # one more logit per query head in the denominator only (``triton.scores.add_sink``):
        # a row that saw no key ends with out 0 and lse sink[h]
        sink2 = gl.load(Sink + h) * C_LOG2E
        top = gl.maximum(m_fin, sink2)
        top = gl.where(top == float("-inf"), 0.0, top)  # a -inf sink on an empty row: stays empty
        alpha = gl.exp2(m_fin - top)
        l_i = l_i * alpha + gl.exp2(sink2 - top)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        m_fin = top
    # l == 0 exactly when a row saw no key (NaN from the data propagates instead).
    seen = l_i != 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    if VARLEN:
        _store_o_varlen(out.to(dtype), o_desc, o_tile, q_empty, WG, Out, stride_oh, stride_om, h, q_row, mq,
                        seqlen_q, o_layout, ALIAS_O)
    else:
        tma.store_wait(pendings=0)  # the previous item's O has left the staging tile
        o_tile.reshape([ROWS, HEAD_D]).store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, mq, 0], o_tile)  # clips rows past seqlen_q
        if ALIAS_O:
            tma.store_wait(pendings=0)
            mbarrier.arrive(q_empty.index(WG), count=1)
    rows = mq + gl.arange(0, ROWS, layout=row_s)
    lse = gl.where(seen, (m_fin + gl.log2(l_safe)) * C_LN2, float("-inf"))
    gl.store(Lse + bh.to(gl.int64) * lse_stride + q_row + rows, lse, mask=rows < seqlen_q)
    return n_tiles


@gluon.jit
def _consumer(WG: gl.constexpr, q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem,
              q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size,
              seqlen_q, seqlen_k, diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink):
    it = 0  # key tiles consumed so far: the position in the K/V ring
    done = 0  # work items finished
    for t in range(gl.program_id(0), num_m_blocks * num_bh, gl.num_programs(0)):
        it += _consume_item(WG, t, it, done, q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem,
                            q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads,
                            group_size, seqlen_q, seqlen_k, diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink)
        done += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _consumer0(q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
               k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset,
               qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink):
    _consumer(0, q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
              k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset,
              qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink)


@gluon.jit
def _consumer1(q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
               k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset,
               qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink):
    _consumer(1, q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
              k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset,
              qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink)


@gluon.jit
def _load_item(t, it, done, q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty,
               k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k,
               diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink):
    """Work item t's Q tiles, then its K/V tiles into the ring; returns its key tiles."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    CAUSAL: gl.constexpr = q_ready.type.shape[0] == 3
    b, h, kvh, bh, m0, n_tiles, q_row, k_row, seqlen_q, seqlen_k, diag_offset = work_item(
        t, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset, Items, item_cap,
        ROWS, BLOCK_N, CAUSAL)
    for wg in gl.static_range(2):
        # A fresh mbarrier counts as having completed phase 1: the first wait passes.
        mbarrier.wait(q_empty.index(wg), (done & 1) ^ 1)
        mbarrier.expect(q_ready.index(wg), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, q_row + m0 + wg * ROWS, 0], q_ready.index(wg),
                                        q_smem.index(wg))
    load_kv_tiles(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, kvh, it, n_tiles, k_row)
    return n_tiles


@gluon.jit
def _loader(q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
            k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset,
            qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink):
    it = 0
    done = 0
    for t in range(gl.program_id(0), num_m_blocks * num_bh, gl.num_programs(0)):
        it += _load_item(t, it, done, q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready,
                         q_empty, k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size,
                         seqlen_q, seqlen_k, diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink)
        done += 1


@gluon.jit
def _allocate(q_desc, k_desc, v_desc, o_desc, CAUSAL: gl.constexpr, NUM_BUF: gl.constexpr):
    """Shared memory and mbarriers of a program: Q (and O) tiles of both consumers, the
    K/V ring, and their ready/empty barriers."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_D], q_desc.layout)
    if HEAD_D > 128:
        o_smem = q_smem  # see ALIAS_O in _consumer
    else:
        o_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_D], o_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [3 if CAUSAL else 2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
        mbarrier.init(v_empty.index(i), count=2)
    return q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty


@gluon.jit
def fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, Lse, nheads, group_size, seqlen_q, seqlen_k,
                   num_m_blocks, num_bh, diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink,
                   CAUSAL: gl.constexpr, NUM_BUF: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   LOADER_REGS: gl.constexpr):
    """Persistent when launched on fewer programs than work items: each program walks the
    items t = pid, pid + grid, ... and the loader fetches the next item's Q and first
    K/V tiles while the consumers finish the last one."""
    (q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
     v_empty) = _allocate(q_desc, k_desc, v_desc, o_desc, CAUSAL, NUM_BUF)
    args = (q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
            v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink)
    gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_loader, args)], [4, 1],
                       [CONSUMER_REGS, LOADER_REGS])


# ---------------------------------------------------------------------------- dynamic schedule
# One program per SM; the loader claims the next work item from a global counter (an
# atomic add) whenever it starts one, and hands its index to the two consumers through a
# 2-slot ring in shared memory. Items are claimed in ``fixed_item`` order (head by head,
# causal heads from their longest block), so the running items stay on a few heads (their
# K/V in L2) as with one program per item, while the loader prefetches the next item's
# tiles as in the static persistent loop, and no program idles while others have work.


@gluon.jit
def _claim_item(Counter):
    """Index of the next work item: one lane of the loader warp adds 1 to *Counter; the
    old value is broadcast to the warp."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=layout)
    old = gl.atomic_add(Counter + lane * 0, gl.full([32], 1, gl.int32, layout), mask=lane == 0)
    return gl.max(gl.where(lane == 0, old, -1), axis=0)


@gluon.jit
def _publish_item(t, n, item_smem, item_ready, item_empty):
    """Item t as the n-th entry of the hand-off ring (slot n % 2), once both consumers
    have read the entry that slot held before."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    slot = n % 2
    mbarrier.wait(item_empty.index(slot), ((n // 2) & 1) ^ 1)  # fresh barriers pass phase 1
    item_smem.index(slot).store(gl.full([32], t, gl.int32, layout))
    mbarrier.arrive(item_ready.index(slot), count=1)


@gluon.jit
def _read_item(n, item_smem, item_ready, item_empty):
    """The n-th entry of the hand-off ring (every thread reads the whole 32-word slot)."""
    layout: gl.constexpr = gl.BlockedLayout([32], [32], [4], [0])
    slot = n % 2
    mbarrier.wait(item_ready.index(slot), (n // 2) & 1)
    t = gl.max(item_smem.index(slot).load(layout), axis=0)
    mbarrier.arrive(item_empty.index(slot), count=1)
    return t


@gluon.jit
def _dyn_consumer(WG: gl.constexpr, q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem,
                  q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size,
                  seqlen_q, seqlen_k, diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink, Counter, item_smem, item_ready, item_empty):
    total = _total_items(num_m_blocks, num_bh, nheads, Items)
    it = 0
    done = 0
    t = _read_item(0, item_smem, item_ready, item_empty)
    while t < total:
        it += _consume_item(WG, t, it, done, q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem,
                            q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads,
                            group_size, seqlen_q, seqlen_k, diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink)
        done += 1
        t = _read_item(done, item_smem, item_ready, item_empty)
    tma.store_wait(pendings=0)


@gluon.jit
def _dyn_consumer0(q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                   k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k,
                   diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink, Counter, item_smem, item_ready, item_empty):
    _dyn_consumer(0, q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                  k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k,
                  diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink, Counter, item_smem, item_ready, item_empty)


@gluon.jit
def _dyn_consumer1(q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                   k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k,
                   diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink, Counter, item_smem, item_ready, item_empty):
    _dyn_consumer(1, q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                  k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k,
                  diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink, Counter, item_smem, item_ready, item_empty)


@gluon.jit
def _dyn_loader(q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset,
                qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink, Counter, item_smem, item_ready, item_empty):
    total = _total_items(num_m_blocks, num_bh, nheads, Items)
    it = 0
    done = 0
    t = _claim_item(Counter)
    _publish_item(t, 0, item_smem, item_ready, item_empty)
    while t < total:
        it += _load_item(t, it, done, q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready,
                         q_empty, k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size,
                         seqlen_q, seqlen_k, diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink)
        done += 1
        t = _claim_item(Counter)
        _publish_item(t, done, item_smem, item_ready, item_empty)  # t >= total tells the consumers to stop
    _reset_counter(Counter, t, total)


@gluon.jit
def _reset_counter(Counter, t, total):
    """Leave *Counter at 0 for the next launch: every program ends with exactly one claim
    past the last item, so the claim that returned total + programs - 1 was the launch's
    last atomic on it. (One counter per device and stream, ``plan.stream_counter``.)"""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=layout)
    last = t == total + gl.num_programs(0) - 1
    gl.atomic_xchg(Counter + lane * 0, gl.zeros([32], gl.int32, layout), mask=(lane == 0) & last)


@gluon.jit
def fwd_ws_dyn_kernel(q_desc, k_desc, v_desc, o_desc, Lse, Counter, nheads, group_size, seqlen_q, seqlen_k,
                       num_m_blocks, num_bh, diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink,
                       CAUSAL: gl.constexpr, NUM_BUF: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       LOADER_REGS: gl.constexpr):
    """``fwd_ws_kernel`` with the dynamic schedule; *Counter (int32) must be 0 at launch,
    and is 0 again when the kernel ends."""
    (q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
     v_empty) = _allocate(q_desc, k_desc, v_desc, o_desc, CAUSAL, NUM_BUF)
    item_smem = gl.allocate_shared_memory(gl.int32, [2, 32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(item_ready.index(i), count=1)
        mbarrier.init(item_empty.index(i), count=2)  # both consumers read an entry
    args = (q_desc, k_desc, v_desc, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
            v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset, qk_scale, Items, item_cap, Out, stride_oh, stride_om, Sink,
            Counter, item_smem, item_ready, item_empty)
    gl.warp_specialize([(_dyn_consumer0, args), (_dyn_consumer1, args), (_dyn_loader, args)], [4, 1],
                       [CONSUMER_REGS, LOADER_REGS])


_launch = Launcher(fwd_ws_kernel)
_launch_dyn = Launcher(fwd_ws_dyn_kernel)


def attention_forward_ws(q, k, v, out, lse, *, scale: float, diag_offset: int, causal: bool,
                         block_n: int | None = None, num_buf: int = NUM_BUF, persistent: bool | None = None,
                         dynamic: bool | None = None, varlen=None, sink=None) -> None:
    """Launch the warp-specialized forward; the registry checked its scope
    (``scope.forward_scope``) and TMA alignment.

    Args:
        q: (B, H, Sq, D); k, v: (B, Hk, Sk, D); out: (B, H, Sq, D); 16-byte-aligned
            bases and strides, unit stride along D, D in scope.HEAD_DIMS, fp16 or bf16.
        lse: (B, H, Sq) float32, contiguous.
        causal: key j visible to query i iff j <= i + diag_offset.
        block_n, num_buf: keys per tile (default ``default_block_n``) and K/V ring slots
            (128 query rows per program).
        persistent: one program per SM walking the work items in a fixed order (True), or
            one program per item (False). Used only when ``dynamic`` is False.
        dynamic: one program per SM claiming items from an atomic counter
            (``fwd_ws_dyn_kernel``). Default: dynamic unless ``persistent`` is given,
            except at d256 without causal (one program per item: O staged in Q's tile
            serializes the next item's Q load, -1-3% for the static schedule, run 26).
            On the H200 (run 44, bf16) dynamic beat one-per-item by 6-17% on causal
            rows at S1024/S2048 and the static schedule by 1-4% without causal; it lost
            1-3% on some causal rows at S4096-S16384 (benchmarks/experiments/fwd_schedule.py).
        varlen: None, or an ``backends.worklist.Varlen`` (B = 1, packed sequences: the dynamic
            schedule over the device-built work list; ``diag_offset`` is per sequence).
        sink: None, or (H,) float32 contiguous: one logit per query head in the softmax's
            denominator (natural log units; the LSE includes it).
    """
    batch, nheads, seqlen_q, head_dim = q.shape
    block_n = block_n or default_block_n(head_dim)
    descs = (tma_descriptor(q, HALF_M), tma_descriptor(k, block_n), tma_descriptor(v, block_n),
             tma_descriptor(out, HALF_M), lse)
    if varlen is not None:
        from flashtile.backends.worklist import build_work_items

        [(table, cap)] = build_work_items(varlen, seqlen_q, k.shape[2], [(BLOCK_M, False)], -1,
                                          0 if causal else -1)
        items, dynamic, num_m_blocks = cap * nheads, True, 0
        # seqlen_q: the LSE's row stride (total_q); the lengths come from the work list
        sizes = (nheads, nheads // k.shape[1], seqlen_q, 0, 0, 0, 0, scale * LOG2E,
                 table, cap, out, out.stride(1), out.stride(2), q if sink is None else sink)
    else:
        num_m_blocks = triton.cdiv(seqlen_q, BLOCK_M)
        items = num_m_blocks * batch * nheads
        sizes = (nheads, nheads // k.shape[1], seqlen_q, k.shape[2], num_m_blocks, batch * nheads, diag_offset,
                 scale * LOG2E, lse, 0, lse, 0, 0, q if sink is None else sink)
    if dynamic is None:
        dynamic = persistent is None and (causal or head_dim <= 128)
    persistent = bool(persistent)
    grid = min(items, sm_count(device_index(q.device))) if persistent or dynamic else items
    constexprs = dict(CAUSAL=causal, NUM_BUF=num_buf, CONSUMER_REGS=240, LOADER_REGS=LOADER_REGS)
    if dynamic:
        counter = stream_counter(q.device)
        _launch_dyn((grid,), (*descs, counter, *sizes), constexprs, 4, 1)
    else:
        _launch((grid,), (*descs, *sizes), constexprs, 4, 1)
