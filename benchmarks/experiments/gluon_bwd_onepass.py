"""Experiment (issue 17; H200 runs 30-34, back in the tree in session 15): a ONE-PASS
warp-specialized Gluon backward, dQ by reductions into a float32 buffer.

Runs 30-34 found it correct and capped at ~290-375 TF/s (d128) with the reductions issued by
the consumer warpgroups themselves (red.v4/red.v2 from registers, or a TMA reduce staged and
waited at once), against 658 TF/s (d128, S4096) and 468 (d64) with them off
(FLASHTILE_EXP_DQ=1, the same 64 wgmma instructions in the PTX: the dQ product stays). Run
80 then measured the reduction volume alone (benchmarks/tma_reduce_rate.py): 3.6 TB/s by
atomics and by bulk TMA reductions alike, 3x what the kernel got. So the L2 was not the
limit; issuing the reductions between the products was. DQ_MODE 3 (the default here) does
what FA3 does: each warpgroup stores its scaled dQ half into a shared-memory slot and
goes on; a reducer warp of its own (``_reducer``) adds the slot into the float32 dQ with
bulk TMA reductions (``flashtile.ops.tma_reduce``) and frees it. dQ is cast by a copy after
the kernel (the postprocess).

    PYTHONPATH=src python3 benchmarks/experiments/gluon_bwd_onepass.py        # GPU: check, time
    FLASHTILE_EXP_DQ=0 PYTHONPATH=src python3 benchmarks/experiments/gluon_bwd_onepass.py   # A/B: red.v4
    PYTHONPATH=src python3 benchmarks/experiments/gluon_bwd_onepass.py --compile             # CPU: sm_90a

Compiled for sm_90a (session 15, CPU): d64 fits without spills in every variant; d128 fits
only with 3 ring slots + 1 dQ slot (224.5 KB) or 2 + 2, and spills 536-1300 B there (mode 0
spilled 876 B too; mode 1 304 B). The reducer warp is not the cause (mode 3 without it: 880
B); using the dQ accumulator at all is (~560 B over mode 1). Giving the reducer more
registers takes them from the consumers: 48 -> 1192 B, 80 -> 2096 B; fewer for the worker
consumer does not help either (232: 1016 B, 216: 1144 B).

Variants are (pipelined, num_buf, rotate[, dq_buf]). The kernel's own notes (from runs 30-34) follow.

Hopper backward in Gluon: warp-specialized, one pass for dQ, dK and dV (sm90, fp16/bf16,
head dim 64/128).

The same algebra as ``backward.py`` (read its docstring first) for the common case, plain
or causal with no softcap/alibi/mask/dropout, scheduled by hand like ``forward_sm90``.
One program owns a block of 2 x 64 keys of one (batch, kv head) and streams every query
block that sees those keys, for every query head of the GQA group. Partitions:

    loader   (1 warp)  K and V of the block once, then (Q_s, dO_s) tiles of 64 queries
                       through a NUM_BUF-slot ring by TMA
    consumer (2 x 4 warps; warpgroup w owns keys w*64 .. w*64+63), per step s:
        issue  S^T_s = K_w Q_s^T,  dP^T_s = V_w dO_s^T            (async wgmma)
        issue  dV_w += P^T_{s-1} dO_{s-1},  dK_w += dS^T_{s-1} Q_{s-1}   (async)
        wait for S_s, dP_s only
        P_s = exp2(S_s * c - lse),  dS_s = P_s (dP_s - Delta)   (under step s-1's products)
        issue  dQ_{s-1}[:, half w] = dS_{s-1} K[:, half w]     (both warpgroups' dS halves)
        wait; add dQ_{s-1} into a float32 dQ (mode 3: store it into a dQ slot for the
        reducer warp; modes 0, 2: atomics from registers); store P_s, dS_s to shared memory
    reducer  (1 warp, mode 3) per step: wait for both halves in the step's slot, two bulk
             TMA reductions into the float32 dQ, wait until they have read it, free it

so the elementwise work of step s runs while the tensor cores do step s-1's products.
The two warpgroups split the dQ product by head-dim halves (64 x D/2 accumulators: the
registers of a full 64 x D one are not there at d128); each reads both warpgroups' dS,
so two mbarriers hand dS between them (``ds_full``: both halves stored; ``ds_empty``:
both warpgroups' dQ products have read them). 5 tile products per tile pair, as FA2/FA3,
against the Triton path's 7; the atomic sum makes dQ's rounding order vary between runs,
so ``deterministic=True`` takes the Triton path.

dK comes out scaled by the softmax scale at the end; dQ's partials are scaled before the
atomics. Inputs are (B, H, S, D) views with 16-byte-aligned strides (4-D TMA
descriptors, any seqlen: zero-filled loads, clipped stores). Causal is bottom-right by
``diag_offset``; rows that see no key have lse -inf and get P = 0 (the causal mask).

Triton 3.6 turns constexprs passed through ``gl.warp_specialize`` into tensors, so the
partitions read compile-time sizes from descriptor and shared-memory types (CAUSAL: the
kv_bar array has a third, unused entry).
"""

from __future__ import annotations

import argparse
import os
import sys

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

from flashtile.ops.backward_sm90 import BLOCK, CONSUMER_REGS, LOADER_REGS, ROWS, _step_range
from flashtile.ops.forward import LOG2E
from flashtile.ops.forward_sm90 import _smem_layout
from flashtile.ops.launch import Launcher
from flashtile.ops.tma_reduce import async_reduce_add_shared_to_global

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_bwd import run  # noqa: E402  (the library experiment's checks and timing)

# BLOCK (= ROWS): keys per consumer warpgroup and queries per step, and the partitions'
# registers, as the library's backward has them. (Q, dO) ring slots: ``default_num_buf``.
HEAD_DIMS = (64, 128)
# dQ reductions, 16 bytes each. A thread of the wgmma accumulator layout holds, per 8
# columns, (row r, cols c, c+1) and (row r + 8, cols c, c+1), c = 2 * (lane % 4); lanes
# 2i and 2i+1 swap halves (one shuffle per value pair) so that the even lane owns row r,
# cols c..c+3, and the odd lane row r + 8, cols c-2..c+1: one red.v4 each, not two red.v2.
_RED_V4 = gl.constexpr("""{
.reg .pred odd;
.reg .b32 ln, s0, s1, x0, x1;
.reg .b64 a;
mov.u32 ln, %laneid;
and.b32 ln, ln, 1;
setp.ne.u32 odd, ln, 0;
selp.b32 s0, $8, $10, odd;
selp.b32 s1, $9, $11, odd;
shfl.sync.bfly.b32 x0, s0, 1, 0x1f, 0xffffffff;
shfl.sync.bfly.b32 x1, s1, 1, 0x1f, 0xffffffff;
@!odd red.global.add.v4.f32 [$4], {$8, $9, x0, x1};
sub.s64 a, $6, 8;
@odd red.global.add.v4.f32 [a], {x0, x1, $10, $11};
}""")
# FLASHTILE_EXP_DQ: 0 = red.v4 reductions, 1 = none (dQ wrong: measures everything else), 2 = red.v2,
# 3 (default) = bulk TMA reductions issued by a reducer warp of their own (``_reducer``).
_EXP_DQ = gl.constexpr(int(os.environ.get("FLASHTILE_EXP_DQ", "3")))
# Registers of mode 3's reducer warp (FLASHTILE_EXP_REDUCER_REGS; the loader's 24 by default).
_REDUCER_REGS = gl.constexpr(int(os.environ.get("FLASHTILE_EXP_REDUCER_REGS", "24")))


@gluon.jit
def _step_coords(s, q_lo, nq, q_rot, kvh, group_size):
    """Step s -> (query head, first query row). Within a head the query blocks run from
    q_lo + q_rot, wrapping around: programs of neighbouring key blocks start on different
    query blocks, so their dQ reductions do not all hit one tile of dQ at once."""
    r = s % nq + q_rot
    r = gl.where(r >= nq, r - nq, r)
    return kvh * group_size + s // nq, (q_lo + r) * ROWS


@gluon.jit
def _step_tiles(s, q_lo, nq, q_rot, kvh, group_size, q_smem, do_smem, q_ready):
    """Step s: the query head, the first query row, and the (Q, dO) tiles once they have
    landed."""
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    HEAD_D: gl.constexpr = q_smem.type.shape[4]
    slot = s % NUM_BUF
    mbarrier.wait(q_ready.index(slot), (s // NUM_BUF) & 1)
    hq, m0 = _step_coords(s, q_lo, nq, q_rot, kvh, group_size)
    return hq, m0, q_smem.index(slot).reshape([ROWS, HEAD_D]), do_smem.index(slot).reshape([ROWS, HEAD_D])


@gluon.jit
def _probs(s, Lse, Delta, b, hq, nheads, seqlen_q, nk, m0, diag_offset, qk_scale,
           CAUSAL: gl.constexpr, s_layout: gl.constexpr):
    """P = exp2(S * c - lse) on a (queries x keys) tile (0 right of the diagonal when
    causal), and the rows' Delta. Queries are the rows, so LSE and Delta are row vectors:
    2 registers per thread each."""
    rows = m0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    row_off = (b * nheads + hq).to(gl.int64) * seqlen_q
    # Rows past seqlen_q get lse = +inf, so their P is 0 (their Q and dO are zero-filled).
    lse2 = gl.load(Lse + row_off + rows, mask=rows < seqlen_q, other=float("inf")) * 1.4426950408889634
    delta = gl.load(Delta + row_off + rows, mask=rows < seqlen_q, other=0.0)
    p = gl.exp2(s * qk_scale - lse2[:, None])
    if CAUSAL:
        if nk + ROWS - 1 > m0 + diag_offset:  # a tile on (or past) the diagonal
            keys = nk + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
            p = gl.where(keys[None, :] <= rows[:, None] + diag_offset, p, 0.0)
    return p, delta


@gluon.jit
def _p_and_ds(s, dp, Lse, Delta, b, hq, nheads, seqlen_q, nk, m0, diag_offset, qk_scale,
              CAUSAL: gl.constexpr, dtype: gl.constexpr, s_layout: gl.constexpr):
    """P and dS = P (dP - Delta), in the input dtype for the products."""
    p, delta = _probs(s, Lse, Delta, b, hq, nheads, seqlen_q, nk, m0, diag_offset, qk_scale, CAUSAL, s_layout)
    ds = p * (dp - delta[:, None])
    return p.to(dtype), ds.to(dtype)


@gluon.jit
def _dq_issue(WG: gl.constexpr, t, k_smem, ds_smem, ds_full):
    """Issue dQ of step t for this warpgroup's half of the head dim, from both warpgroups'
    dS halves (async; the caller waits)."""
    HEAD_D: gl.constexpr = k_smem.type.shape[4]
    HALF_D: gl.constexpr = HEAD_D // 2
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_D, 16])
    mbarrier.wait(ds_full.index(0), t & 1)
    dq = warpgroup_mma(ds_smem.index(0), k_smem.index(0).reshape([ROWS, HEAD_D]).slice(WG * HALF_D, HALF_D, dim=1),
                       gl.zeros([ROWS, HALF_D], gl.float32, dq_layout), use_acc=False, is_async=True)
    return warpgroup_mma(ds_smem.index(1), k_smem.index(1).reshape([ROWS, HEAD_D]).slice(WG * HALF_D, HALF_D, dim=1),
                         dq, is_async=True)


@gluon.jit
def _dq_finish(WG: gl.constexpr, dq, t, hq, m0, ds_empty, DQ, b, stride_dqb, stride_dqh, stride_dqm, scale,
               dq_smem, dq_full, dq_empty):
    """Once step t's dQ product is done: tell the other warpgroup its dS was read, then add
    this warpgroup's dQ half into the float32 dQ. DQ_MODE 3: hand it to the reducer warp
    through shared-memory slot t % DQ_BUF (wait until the slot's last reduction has read
    it, store, fence, arrive); modes 0 and 2: per-thread vector reductions from registers
    (fire and forget). DQ has its rows padded to a multiple of ROWS, so no row needs a mask
    (rows past seqlen_q add P = 0 products)."""
    HALF_D: gl.constexpr = dq.shape[1]
    layout: gl.constexpr = dq.type.layout
    mbarrier.arrive(ds_empty.index(0), count=1)
    if _EXP_DQ == 1:
        return
    if _EXP_DQ == 3:
        DQ_BUF: gl.constexpr = dq_smem.type.shape[0] // 2
        slot = t % DQ_BUF
        mbarrier.wait(dq_empty.index(slot), ((t // DQ_BUF) & 1) ^ 1)  # a fresh barrier passes phase 1
        dq_smem.index(2 * slot + WG).store(dq * scale)
        fence_async_shared()
        mbarrier.arrive(dq_full.index(slot), count=1)
        return
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = WG * HALF_D + gl.arange(0, HALF_D, layout=gl.SliceLayout(0, layout))
    base = DQ + b.to(gl.int64) * stride_dqb + hq.to(gl.int64) * stride_dqh + m0.to(gl.int64) * stride_dqm
    addr = (base + rows[:, None] * stride_dqm + cols[None, :]).to(gl.int64, bitcast=True)
    if _EXP_DQ == 2:
        gl.inline_asm_elementwise("red.global.add.v2.f32 [$2], {$4, $5};", "=r,=r,l,l,r,r", [addr, dq * scale],
                                  dtype=gl.int32, is_pure=False, pack=2)
    else:
        gl.inline_asm_elementwise(_RED_V4, "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [addr, dq * scale],
                                  dtype=gl.int32, is_pure=False, pack=4)


@gluon.jit
def _consumer(WG: gl.constexpr, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ,
              q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty,
              b, kvh, n0, q_rot, group_size, nheads, seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows):
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == 3
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    nk = n0 + WG * ROWS  # first key of this warpgroup
    k_tile = k_smem.index(WG).reshape([ROWS, HEAD_D])
    v_tile = v_smem.index(WG).reshape([ROWS, HEAD_D])
    q_lo, nq = _step_range(n0, seqlen_q, diag_offset, ROWS, CAUSAL)
    n_steps = nq * group_size

    # P and dS (queries x keys) of the previous step wait in shared memory for their
    # products, which read them transposed (dV, dK) or as they are (dQ).
    p_tile = p_smem.index(WG)
    ds_tile = ds_smem.index(WG)
    dk = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    dv = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    mbarrier.wait(kv_bar.index(0), 0)  # dQ reads both warpgroups' K
    mbarrier.wait(kv_bar.index(1), 0)
    hq_prev = kvh * group_size
    m0_prev = q_lo * ROWS
    if n_steps > 0:  # step 0: nothing to overlap with yet
        hq, m0, q_t, do_t = _step_tiles(0, q_lo, nq, q_rot, kvh, group_size, q_smem, do_smem, q_ready)
        hq_prev = hq
        m0_prev = m0
        st = warpgroup_mma(q_t, k_tile.permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        dpt = warpgroup_mma(do_t, v_tile.permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32, s_layout),
                            use_acc=False, is_async=True)
        st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
        pt, dst = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, nk, m0, diag_offset, qk_scale,
                            CAUSAL, dtype, s_layout)
        p_tile.store(pt)
        ds_tile.store(dst)
        fence_async_shared()
        mbarrier.arrive(ds_full.index(0), count=1)
    for s in range(1, n_steps):
        prev = (s - 1) % NUM_BUF
        hq, m0, q_t, do_t = _step_tiles(s, q_lo, nq, q_rot, kvh, group_size, q_smem, do_smem, q_ready)
        st = warpgroup_mma(q_t, k_tile.permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        dpt = warpgroup_mma(do_t, v_tile.permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32, s_layout),
                            use_acc=False, is_async=True)
        dv = warpgroup_mma(p_tile.permute((1, 0)), do_smem.index(prev).reshape([ROWS, HEAD_D]), dv, is_async=True)
        dk = warpgroup_mma(ds_tile.permute((1, 0)), q_smem.index(prev).reshape([ROWS, HEAD_D]), dk, is_async=True)
        st, dpt = warpgroup_mma_wait(num_outstanding=2, deps=(st, dpt))  # step s-1's products stay in flight
        pt, dst = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, nk, m0, diag_offset, qk_scale,
                            CAUSAL, dtype, s_layout)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        mbarrier.arrive(q_empty.index(prev), count=1)  # Q_{s-1} and dO_{s-1} are read
        p_tile.store(pt)  # P_{s-1} is read (only this warpgroup reads it)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(_dq_issue(WG, s - 1, k_smem, ds_smem, ds_full),))
        _dq_finish(WG, dq, s - 1, hq_prev, m0_prev, ds_empty, DQ, b, stride_dqb, stride_dqh, stride_dqm, scale,
                   dq_smem, dq_full, dq_empty)
        hq_prev = hq
        m0_prev = m0
        mbarrier.wait(ds_empty.index(0), (s - 1) & 1)  # the other warpgroup has read dS_{s-1} too
        ds_tile.store(dst)
        fence_async_shared()
        mbarrier.arrive(ds_full.index(0), count=1)

    if n_steps > 0:
        last = (n_steps - 1) % NUM_BUF
        dv = warpgroup_mma(p_tile.permute((1, 0)), do_smem.index(last).reshape([ROWS, HEAD_D]), dv, is_async=True)
        dk = warpgroup_mma(ds_tile.permute((1, 0)), q_smem.index(last).reshape([ROWS, HEAD_D]), dk, is_async=True)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        mbarrier.arrive(q_empty.index(last), count=1)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(_dq_issue(WG, n_steps - 1, k_smem, ds_smem, ds_full),))
        _dq_finish(WG, dq, n_steps - 1, hq_prev, m0_prev, ds_empty, DQ, b, stride_dqb, stride_dqh, stride_dqm,
                   scale, dq_smem, dq_full, dq_empty)
        # The other warpgroup's last dQ product reads this warpgroup's K tile, which is
        # about to stage dK.
        mbarrier.wait(ds_empty.index(0), (n_steps - 1) & 1)

    # K and V are no longer read: their tiles stage dK and dV for the TMA stores, which
    # clip rows past seqlen_k.
    k_smem.index(WG).reshape([ROWS, HEAD_D]).store((dk * scale).to(dtype))
    v_smem.index(WG).reshape([ROWS, HEAD_D]).store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, kvh, nk, 0], k_smem.index(WG))
    tma.async_copy_shared_to_global(dv_desc, [b, kvh, nk, 0], v_smem.index(WG))
    tma.store_wait(pendings=0)


@gluon.jit
def _consumer_serial(WG: gl.constexpr, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ,
                     q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty,
                     b, kvh, n0, q_rot, group_size, nheads, seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows):
    """The consumer without the cross-step overlap: each step's products are issued as
    soon as their operands exist (dV under dS's elementwise work, dK with dQ), and the
    other warpgroup's work fills the tensor cores meanwhile. Fewer accumulators live at
    once than ``_consumer``'s (no dK/dV products in flight over S and dP)."""
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == 3
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    nk = n0 + WG * ROWS
    k_tile = k_smem.index(WG).reshape([ROWS, HEAD_D])
    v_tile = v_smem.index(WG).reshape([ROWS, HEAD_D])
    q_lo, nq = _step_range(n0, seqlen_q, diag_offset, ROWS, CAUSAL)
    n_steps = nq * group_size
    p_tile = p_smem.index(WG)
    ds_tile = ds_smem.index(WG)
    dk = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    dv = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    mbarrier.wait(kv_bar.index(0), 0)  # dQ reads both warpgroups' K
    mbarrier.wait(kv_bar.index(1), 0)
    for s in range(n_steps):
        hq, m0, q_t, do_t = _step_tiles(s, q_lo, nq, q_rot, kvh, group_size, q_smem, do_smem, q_ready)
        st = warpgroup_mma(q_t, k_tile.permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        dpt = warpgroup_mma(do_t, v_tile.permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32, s_layout),
                            use_acc=False, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
        p, delta = _probs(st, Lse, Delta, b, hq, nheads, seqlen_q, nk, m0, diag_offset, qk_scale, CAUSAL, s_layout)
        p_tile.store(p.to(dtype))
        fence_async_shared()
        dv = warpgroup_mma(p_tile.permute((1, 0)), do_t, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt,))
        ds = (p * (dpt - delta[:, None])).to(dtype)
        if s > 0:
            mbarrier.wait(ds_empty.index(0), (s - 1) & 1)  # the other warpgroup has read dS_{s-1}
        ds_tile.store(ds)
        fence_async_shared()
        mbarrier.arrive(ds_full.index(0), count=1)
        dk = warpgroup_mma(ds_tile.permute((1, 0)), q_t, dk, is_async=True)
        dq = _dq_issue(WG, s, k_smem, ds_smem, ds_full)
        dq, dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk, dv))
        _dq_finish(WG, dq, s, hq, m0, ds_empty, DQ, b, stride_dqb, stride_dqh, stride_dqm, scale, dq_smem, dq_full,
                   dq_empty)
        mbarrier.arrive(q_empty.index(s % NUM_BUF), count=1)
    if n_steps > 0:
        mbarrier.wait(ds_empty.index(0), (n_steps - 1) & 1)  # the other's last dQ has read this K tile

    k_smem.index(WG).reshape([ROWS, HEAD_D]).store((dk * scale).to(dtype))
    v_smem.index(WG).reshape([ROWS, HEAD_D]).store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, kvh, nk, 0], k_smem.index(WG))
    tma.async_copy_shared_to_global(dv_desc, [b, kvh, nk, 0], v_smem.index(WG))
    tma.store_wait(pendings=0)


@gluon.jit
def _consumer0(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem,
               p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
               seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows):
    _consumer(0, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem,
              p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
              seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows)


@gluon.jit
def _consumer1(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem,
               p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
               seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows):
    _consumer(1, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem,
              p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
              seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows)


@gluon.jit
def _serial0(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem,
               p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
               seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows):
    _consumer_serial(0, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem,
              p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
              seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows)


@gluon.jit
def _serial1(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem,
               p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
               seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows):
    _consumer_serial(1, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem,
              p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
              seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem,
            p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
            seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows):
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == 3
    for wg in gl.static_range(2):
        mbarrier.expect(kv_bar.index(wg), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, kvh, n0 + wg * ROWS, 0], kv_bar.index(wg), k_smem.index(wg))
        tma.async_copy_global_to_shared(v_desc, [b, kvh, n0 + wg * ROWS, 0], kv_bar.index(wg), v_smem.index(wg))
    q_lo, nq = _step_range(n0, seqlen_q, diag_offset, ROWS, CAUSAL)
    for s in range(nq * group_size):
        slot = s % NUM_BUF
        hq, m0 = _step_coords(s, q_lo, nq, q_rot, kvh, group_size)
        mbarrier.wait(q_empty.index(slot), ((s // NUM_BUF) & 1) ^ 1)  # fresh barriers pass phase 1
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, hq, m0, 0], q_ready.index(slot), q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [b, hq, m0, 0], q_ready.index(slot), do_smem.index(slot))


@gluon.jit
def _reducer(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem,
             p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
             seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full,
             dq_empty, dq_rows):
    """DQ_MODE 3's reduction warp: for every step, once both warpgroups have stored their
    dQ halves in the step's slot, add them into the float32 dQ (a (B * H * dq_rows, D)
    matrix) with two bulk TMA reductions, wait until they have read the slot, and free it.
    The consumers never wait on the L2: only on a slot, DQ_BUF steps later. (Untried: with
    DQ_BUF 2, ``store_wait(pendings=2)`` and free the older slot instead.) Rows are int32:
    B * H * dq_rows < 2**31, as TMA coordinates are."""
    DQ_BUF: gl.constexpr = dq_smem.type.shape[0] // 2
    HALF_D: gl.constexpr = dq_smem.type.shape[2]
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == 3
    q_lo, nq = _step_range(n0, seqlen_q, diag_offset, ROWS, CAUSAL)
    for t in range(nq * group_size):
        slot = t % DQ_BUF
        mbarrier.wait(dq_full.index(slot), (t // DQ_BUF) & 1)
        hq, m0 = _step_coords(t, q_lo, nq, q_rot, kvh, group_size)
        row = (b * nheads + hq) * dq_rows + m0
        for half in gl.static_range(2):
            async_reduce_add_shared_to_global(dq_desc, [row, half * HALF_D], dq_smem.index(2 * slot + half))
        tma.store_wait(pendings=0)  # both reductions have read the slot
        mbarrier.arrive(dq_empty.index(slot), count=1)


@gluon.jit
def _bwd_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, nheads, nheads_k, group_size,
                   seqlen_q, num_n_blocks, diag_offset, stride_dqb, stride_dqh, stride_dqm,
                   qk_scale, scale, dq_desc, dq_rows,
                   CAUSAL: gl.constexpr, PIPELINED: gl.constexpr, ROTATE: gl.constexpr, NUM_BUF: gl.constexpr,
                   DQ_BUF: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    pid = gl.program_id(0)  # flat grid: (batch, kv head, block of 2 * ROWS keys)
    bk = pid // num_n_blocks
    n0 = (pid % num_n_blocks) * (2 * ROWS)
    b = bk // nheads_k
    kvh = bk % nheads_k
    q_lo, nq = _step_range(n0, seqlen_q, diag_offset, ROWS, CAUSAL)
    q_rot = 0
    if ROTATE:
        q_rot = ((pid % num_n_blocks) * nq) // num_n_blocks

    q_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, ROWS, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, ROWS, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_D], v_desc.layout)
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [2, ROWS, ROWS], pds_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, ROWS, ROWS], pds_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [3 if CAUSAL else 2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bar.index(i), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both consumers release a slot
    mbarrier.init(ds_full.index(0), count=2)
    mbarrier.init(ds_empty.index(0), count=2)
    # DQ_MODE 3: DQ_BUF slots of both warpgroups' float32 dQ halves (64 x D/2 each, slot s's
    # half h at 2 s + h); the
    # other modes get a token allocation (the partitions' arguments are the same).
    HALF_D: gl.constexpr = HEAD_D // 2
    if _EXP_DQ == 3:
        dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUF * 2, ROWS, HALF_D], dq_desc.layout)
    else:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 8, 8],
                                            gl.NVMMASharedLayout.get_default_for([8, 8], gl.float32))
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUF, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(DQ_BUF):
        mbarrier.init(dq_full.index(i), count=2)  # both warpgroups' halves
        mbarrier.init(dq_empty.index(i), count=1)  # the reducer

    args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem,
            p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
            seqlen_q, diag_offset, stride_dqb, stride_dqh, stride_dqm, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows)
    if _EXP_DQ == 3:
        if PIPELINED:
            gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_loader, args), (_reducer, args)],
                               [4, 1, 1], [CONSUMER_REGS, LOADER_REGS, _REDUCER_REGS])
        else:
            gl.warp_specialize([(_serial0, args), (_serial1, args), (_loader, args), (_reducer, args)],
                               [4, 1, 1], [CONSUMER_REGS, LOADER_REGS, _REDUCER_REGS])
    elif PIPELINED:
        gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_loader, args)], [4, 1],
                           [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([(_serial0, args), (_serial1, args), (_loader, args)], [4, 1],
                           [CONSUMER_REGS, LOADER_REGS])


_launch = Launcher(_bwd_ws_kernel)


def default_pipelined(head_dim: int) -> bool:
    """The cross-step overlap (``_consumer``) spills at d128 (sm_90a compile)."""
    return head_dim <= 64


def default_num_buf(head_dim: int) -> int:
    """(Q, dO) ring slots: 4, or 3 at d128 (shared memory: the dQ slot stages 32 KB)."""
    return 4 if head_dim <= 64 else 3


def attention_backward_ws(q, k, v, dout, lse, delta, dq, dk, dv, *, scale: float, diag_offset: int,
                          causal: bool, num_buf: int | None = None, pipelined: bool | None = None,
                          rotate: bool = True, dq_buf: int = 1) -> None:
    """Launch the one-pass backward; the caller checked ``ws_applies`` and TMA alignment.

    Args:
        q, dout: (B, H, Sq, D); k, v: (B, Hk, Sk, D); 16-byte-aligned bases and strides,
            unit stride along D, D in HEAD_DIMS, fp16 or bf16.
        lse, delta: (B, H, Sq) float32 contiguous (natural log; delta = rowsum(dO * O),
            minus the LSE's own upstream gradient if any).
        dq: (B, H, Sq, D) to write (any strides); dk, dv: (B, Hk, Sk, D) to write, TMA-able.
        causal: key j visible to query i iff j <= i + diag_offset.
        dq_buf: DQ_MODE 3's shared-memory slots of dQ (64 x D float32 each: 32 KB at d128,
            where 3 ring slots and 1 dQ slot take 224 of the 227 KB).
    """
    import torch
    from triton.experimental.gluon import language as gl_
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    batch, nheads, seqlen_q, head_dim = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    pipelined = default_pipelined(head_dim) if pipelined is None else pipelined
    num_buf = num_buf or default_num_buf(head_dim)
    layout = _smem_layout(BLOCK, head_dim, str(q.dtype).replace("torch.", ""))

    def desc(t):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, BLOCK, head_dim], layout)

    # float32 dQ, (B, H, rows, D) contiguous with rows padded to a multiple of BLOCK: the
    # reductions of the last query block need no mask. Mode 3 sees it as a (B * H * rows, D)
    # matrix in blocks of (BLOCK, D / 2), one per warpgroup's half.
    rows = triton.cdiv(seqlen_q, BLOCK) * BLOCK
    dq_acc = torch.zeros((batch, nheads, rows, head_dim), dtype=torch.float32, device=q.device)
    flat = dq_acc.view(-1, head_dim)
    half = head_dim // 2
    dq_desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [BLOCK, half],
                               gl_.NVMMASharedLayout.get_default_for([BLOCK, half], gl_.float32))
    num_n_blocks = triton.cdiv(seqlen_k, 2 * BLOCK)
    _launch((num_n_blocks * batch * nheads_k,),
            (desc(q), desc(k), desc(v), desc(dout), desc(dk), desc(dv), lse, delta, dq_acc,
             nheads, nheads_k, nheads // nheads_k, seqlen_q, num_n_blocks, diag_offset, *dq_acc.stride()[:3],
             scale * LOG2E, scale, dq_desc, rows),
            dict(CAUSAL=causal, PIPELINED=pipelined, ROTATE=rotate, NUM_BUF=num_buf, DQ_BUF=dq_buf,
                 CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS), 4, 1)
    dq.copy_(dq_acc[:, :, :seqlen_q])  # the postprocess: scale applied already, a cast


def onepass_launch(q, k, v, dout, lse, delta, dq, dk, dv, *, causal, diag, variant):
    pipelined, num_buf, rotate, dq_buf = (tuple(variant) + (1,))[:4]
    attention_backward_ws(q, k, v, dout, lse, delta, dq, dk, dv, scale=q.shape[-1] ** -0.5, diag_offset=diag,
                          causal=causal, pipelined=pipelined, num_buf=num_buf, rotate=rotate, dq_buf=dq_buf)


def compile_check(head_dim: int, causal: bool, variant, dtype: str = "bf16"):
    """Compile the kernel for sm_90a on the CPU (no GPU): flashtile.ops.sm90_check's
    ``Compiled`` (shared memory, registers and spills, PTX), for ``--compile``."""
    from triton.experimental.gluon import language as gl_

    from flashtile.ops.sm90_check import _signature, compile_gluon

    pipelined, num_buf, rotate, dq_buf = variant
    torch_name = {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    half = head_dim // 2
    tile = f"tensordesc<{dtype}[1, 1, {BLOCK}, {head_dim}],{_smem_layout(BLOCK, head_dim, torch_name)}>"
    pointers = {n: tile for n in ("q_desc", "k_desc", "v_desc", "do_desc", "dk_desc", "dv_desc")}
    pointers.update(Lse="*fp32", Delta="*fp32", DQ="*fp32",
                    dq_desc=f"tensordesc<fp32[{BLOCK}, {half}],"
                            f"{gl_.NVMMASharedLayout.get_default_for([BLOCK, half], gl_.float32)}>")
    constexprs = dict(CAUSAL=causal, PIPELINED=pipelined, ROTATE=rotate, NUM_BUF=num_buf, DQ_BUF=dq_buf,
                      CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS)
    fn = _bwd_ws_kernel
    sig = _signature(fn, pointers, constexprs)
    sig = {n: ("fp32" if n in ("qk_scale", "scale") else t) for n, t in sig.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    name = f"onepass mode={int(_EXP_DQ)} d{head_dim} causal={causal} {variant}"
    return compile_gluon(name, fn, {n: t for n, t in sig.items() if t != "constexpr"}, constexprs, attrs,
                         num_warps=4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="0,3,1,1;0,2,1,2;1,3,1,1",
                   help="pipelined,num_buf,rotate[,dq_buf];... (d64 fits 4 ring slots and 2 dQ slots)")
    p.add_argument("--shapes", default="128,4096,0;128,4096,1;128,16384,1;64,4096,0;64,16384,1;64,1024,0;128,1024,1",
                   help="headdim,seqlen,causal;...")
    p.add_argument("--compile", action="store_true",
                   help="no GPU: compile every (variant, head dim, causal) for sm_90a and report them")
    args = p.parse_args(argv)
    variants = [(bool(int(f[0])), int(f[1]), bool(int(f[2])), int(f[3]) if len(f) > 3 else 1)
                for f in (v.split(",") for v in args.variants.split(";"))]
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes.split(";")]
    if args.compile:
        for variant in variants:
            for d in sorted({sh[0] for sh in shapes}):
                for causal in (False, True):
                    try:
                        c = compile_check(d, causal, variant)
                        regs, spills = c.registers()
                        tma_reduce = "cp.reduce.async.bulk.tensor" in c.ptx
                        print(f"{c.name}: shared {c.shared} B, regs {regs}, spills {spills} B, "
                              f"bulk reduce {tma_reduce}", flush=True)
                    except Exception as exc:  # noqa: BLE001  (an experiment: report and go on)
                        print(f"d{d} causal={causal} {variant}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        return 0
    run(variants, [(d, S, bool(c)) for d, S, c in shapes], launch=onepass_launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
